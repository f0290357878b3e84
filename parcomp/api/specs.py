"""What ``parcomp.parallelize`` / ``check`` / ``explain`` accept as the spec, made a parsed Spec.

A spec is a :class:`parcomp.spec.Spec`, the path of a ``.pcs`` file, the text of one, or a
DTensor plan (:mod:`parcomp.api.dtensor_plan`). The two programs ``parallelize`` runs are
compiled from specs derived here: the forward one (the user's spec, less its ``train`` line)
and the backward one (:func:`backward_spec`: the cotangent inputs pinned, a gradient-only
training step).
"""
from __future__ import annotations

import os
from dataclasses import replace

from ..errors import ParcompError
from ..ir.types import layout_str
from ..spec import Spec, load_spec, parse_spec

#: where the derived rules say they come from in messages
DERIVED = "<parcomp.parallelize>"


def resolve_spec(spec, module=None, graph=None) -> Spec:
    """A parsed :class:`Spec` from what the user passed (a DTensor plan is translated for
    ``module``, whose imported ``graph`` names its inputs and outputs).

    Raises:
        ParcompError: a path that does not exist, or something that is no spec.
        SpecError: the text does not parse (located at its line and column).
    """
    if isinstance(spec, Spec):
        return spec
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if isinstance(spec, str):
        if "\n" not in spec and (spec.endswith(".pcs") or os.path.isfile(spec)):
            if not os.path.isfile(spec):
                raise ParcompError(f"spec file {spec} does not exist", where=spec)
            return load_spec(spec)
        return parse_spec(spec, "<spec text>")
    if isinstance(spec, dict) or _is_plan_tuple(spec):
        from .dtensor_plan import plan_spec

        return plan_spec(spec, module, graph)
    raise ParcompError(f"spec must be a parcomp Spec, a .pcs path, its text or a DTensor plan dict "
                       f"(with its DeviceMesh); got {type(spec).__name__}")


def _is_plan_tuple(spec) -> bool:
    return isinstance(spec, tuple) and len(spec) == 2 and any(isinstance(s, dict) for s in spec)


def mesh_text(spec: Spec) -> str:
    """``dp=2 tp=2``: the spec's mesh statement's body."""
    return " ".join(f"{n}={s}" for n, s in zip(spec.mesh.names, spec.mesh.sizes))


def forward_spec(spec: Spec, gather: bool) -> Spec:
    """The spec of the forward program: the user's less its ``train`` line; with ``gather``
    every output replicated on every mesh axis (its own output rules are dropped)."""
    spec = replace(spec, train=None)
    if not gather:
        return spec
    extra = parse_spec(f"mesh {mesh_text(spec)}\noutput ** [{', '.join('R' for _ in spec.mesh.names)}]\n",
                       DERIVED)
    return replace(spec, rules=tuple(r for r in spec.rules if r.target != "output") + extra.rules)


def backward_spec(spec: Spec, cotangents: dict, input_grads: bool) -> Spec:
    """The spec of the backward program: each cotangent input ``{name: layout}`` pinned to its
    output's layout, the user's output rules dropped (the outputs are intermediate values of the
    backward graph, whose only output is the scalar ``<output, cotangent>``), and a training step
    whose update changes nothing (``sgd(lr=0)``): the program's ``.grad`` outputs are the
    gradients, reduced over the batch axes as the spec's layouts require."""
    lines = [f"mesh {mesh_text(spec)}"]
    lines += [f"input {name} {layout_str(lay)}" for name, lay in cotangents.items()]
    lines.append("train loss=output optimizer=sgd(lr=0.0)" + ("" if input_grads else " input_grads=no"))
    extra = parse_spec("\n".join(lines) + "\n", DERIVED)
    rules = extra.rules + tuple(r for r in spec.rules if r.target != "output")
    return replace(spec, rules=rules, train=extra.train)
