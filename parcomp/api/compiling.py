"""Compiling a module for :func:`parcomp.parallelize`: the forward and the backward program,
cached on disk by a fingerprint of the model's graph, the specs and the compiler.

The forward program is what ``parcomp compile`` emits for the spec (less its ``train`` line).
The backward program is compiled from the *same* graph extended by one scalar,
``sum_i <output_i, cotangent_i>`` (the cotangents are new inputs laid out as the forward
program's outputs), under a gradient-only training step (:func:`parcomp.api.specs.backward_spec`):
its ``.grad`` outputs are the vector-Jacobian product, with every backward collective
(Megatron's f/g pair, the dp gradient all_reduce) placed by the same passes as the CLI's
training programs. It recomputes the forward values it needs, as activation checkpointing does.

Both are emitted as program.py text (the CLI's emitter, the CLI's profile) and executed in
process by :mod:`parcomp.api.runtime`.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from ..compile.compiler import compile_graph
from ..errors import ParcompError
from ..ir.graph import Graph, Node, make_attrs
from ..ir.ops import OPS
from ..ir.text import print_graph
from ..ir.types import Partial, TensorType, layout_str
from .specs import backward_spec, forward_spec

#: bump when the cached files' format changes
CACHE_FORMAT = 1
#: the cotangent input of output ``NAME`` in the backward program
COTANGENT = "{}.grad_output"


@dataclass
class Programs:
    """What rank 0 compiles (or reads from the cache) and hands every rank.

    Attributes:
        forward: program.py text of the forward step (``forward(p, inp)``).
        backward: program.py text of the gradient step (``train_step(p, inp)``), or None for
            a model with nothing to differentiate.
        meta: the facts the module needs (JSON-able; see :func:`_meta`).
        key: the fingerprint the cache files are kept under.
        cached: whether the programs came from the cache (no compile ran).
    """

    forward: str
    backward: str | None
    meta: dict
    key: str
    cached: bool = False
    constants: dict = field(default_factory=dict)


def cache_dir(explicit=None) -> Path:
    """``explicit``, else ``$PARCOMP_CACHE_DIR``, else ``~/.cache/parcomp``."""
    if explicit is not None:
        return Path(explicit)
    env = os.environ.get("PARCOMP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "parcomp"


@lru_cache(maxsize=1)
def compiler_fingerprint() -> str:
    """A hash of parcomp's and the torch backend's source files and torch's version: a cached
    program is reused only by the compiler that wrote it."""
    import torch

    import parcomp_backends

    h = hashlib.sha256(f"{CACHE_FORMAT} torch {torch.__version__}".encode())
    for root in (Path(__file__).resolve().parents[1], Path(parcomp_backends.__file__).resolve().parent):
        for p in sorted(root.rglob("*.py")):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def fingerprint(graph: Graph, spec, options: dict) -> str:
    """The cache key of one model graph, spec and options."""
    h = hashlib.sha256(compiler_fingerprint().encode())
    h.update(print_graph(graph).encode())
    h.update(repr(spec).encode())
    h.update(json.dumps(options, sort_keys=True).encode())
    return h.hexdigest()[:32]


def cotangent_graph(graph: Graph, layouts: dict) -> tuple:
    """``graph`` with one scalar output ``sum_i sum(output_i * cotangent_i)`` over its float
    outputs; ``(graph, {cotangent input: layout})``. ``layouts`` are the forward program's
    output layouts by public name."""
    nodes, outs, cots = list(graph.nodes), [], {}
    types = {n.name: n.type for n in nodes}

    def add(name, op, inputs, **attrs):
        probe = Node(name, op, tuple(inputs), None, make_attrs(**attrs))
        ty = OPS[op].infer([types[i] for i in inputs], probe)
        types[name] = ty
        nodes.append(Node(name, op, tuple(inputs), ty, make_attrs(**attrs)))
        return name

    for public, value in graph.named_outputs():
        ty = types[value]
        if not ty.dtype.startswith("float"):
            continue
        lay = layouts[public]
        if any(isinstance(p, Partial) for p in lay):
            raise ParcompError(f"output {public} is a partial sum ({layout_str(lay)}) in the forward "
                               f"program; give it a layout in the spec (e.g. 'output {public} replicated') "
                               f"or call parallelize(..., gather_outputs=True)", where=public)
        name = COTANGENT.format(public)
        if name in types:
            raise ParcompError(f"the model already has a value named {name}", where=name)
        nodes.insert(0, Node(name, "input", (), TensorType(ty.shape, ty.dtype), ()))
        types[name] = nodes[0].type
        cots[name] = lay
        prod = add(f"{name}.product", "mul", [value, name])
        outs.append(add(f"{name}.sum", "sum", [prod], dims=tuple(range(ty.rank))) if ty.rank else prod)
    if not outs:
        return None, {}
    total = outs[0]
    for i, o in enumerate(outs[1:]):
        total = add(f"grad_output.total_{i}", "add", [total, o])
    cots = {k: cots[k] for k in reversed(list(cots))}  # graph order
    return Graph(tuple(nodes), (total,), graph.mesh, graph.stage, ("loss",)), cots


def _meta(graph: Graph, fwd, bwd, cots: dict) -> dict:
    """The facts the module reads: params (trainable or not, layout, global shape, dtype),
    inputs, outputs (public name, layout), mesh, and which gradients the backward returns."""
    sharded = fwd.sharded
    params = [{"name": n.name, "layout": layout_str(n.layout), "shape": list(n.type.shape),
               "dtype": n.type.dtype, "trainable": bool(n.attr("trainable", True)),
               **({"stored_order": list(n.attr("stored_order"))} if n.attr("stored_order") else {}),
               **({"part_of": n.attr("part_of")} if n.attr("part_of") else {})}
              for n in sharded.params]
    inputs = [{"name": n.name, "layout": layout_str(n.layout), "shape": list(n.type.shape), "dtype": n.type.dtype}
              for n in sharded.inputs]
    outputs = [{"name": pub, "layout": layout_str(sharded[v].layout), "shape": list(sharded[v].type.shape),
                "dtype": sharded[v].type.dtype, "cotangent": COTANGENT.format(pub) if COTANGENT.format(pub) in cots
                else None} for pub, v in sharded.named_outputs()]
    grads = [] if bwd is None else [pub for pub, _ in bwd.program.named_outputs() if pub.endswith(".grad")]
    bwd_inputs = [] if bwd is None else [n.name for n in bwd.program.inputs]
    return {"mesh": {"names": list(fwd.spec.mesh.names), "sizes": list(fwd.spec.mesh.sizes)},
            "params": params, "inputs": inputs, "outputs": outputs, "grads": grads,
            "backward_inputs": bwd_inputs,
            "collectives": {"forward": len(fwd.report["collectives"]),
                            "backward": 0 if bwd is None else len(bwd.report["collectives"])}}


def gradient_program(compiled):
    """The backward compile's Program less its parameter update: outputs ``loss`` and the
    ``.grad`` ones only. Its update (``sgd(lr=0)``) is lowered in place (``p.add_(g,
    alpha=-0.0)``): left in, it would write the module's own parameters (and turn an inf
    gradient into a NaN parameter)."""
    prog = compiled.program_
    graph = prog.graph
    keep = [(pub, v) for pub, v in graph.named_outputs() if pub == "loss" or pub.endswith(".grad")]
    live = {v for _, v in keep}
    for n in reversed(graph.nodes):
        if n.name in live:
            live.update(n.inputs)
    nodes = tuple(n for n in graph.nodes if n.name in live or n.op in ("input", "param"))
    graph = Graph(nodes, tuple(v for _, v in keep), graph.mesh, graph.stage, tuple(p for p, _ in keep))
    train = replace(prog.train, carried=(), state=()) if prog.train is not None else None
    return replace(prog, graph=graph, train=train)


def _output_layouts(compiled) -> dict:
    sharded = compiled.sharded
    return {pub: sharded[v].layout for pub, v in sharded.named_outputs()}


def compile_programs(graph: Graph, spec, *, gather: bool, input_grads: bool, profile: str = "cpu",
                     model_name: str = "parcomp.parallelize", cache=None, use_cache: bool = True) -> Programs:
    """The forward and backward programs of ``graph`` under ``spec``, from the cache when a
    compile with the same fingerprint wrote them, else compiled (and written there).

    Raises:
        ParcompError: what the compile raises (a spec that does not fit the model, ...).
    """
    from parcomp_backends.torch import emit_program

    fspec = forward_spec(spec, gather)
    options = {"gather": gather, "input_grads": input_grads, "profile": profile}
    key = fingerprint(graph, fspec, options)
    folder = cache_dir(cache) / key
    if use_cache and (folder / "meta.json").is_file():
        meta = json.loads((folder / "meta.json").read_text())
        bwd = folder / "backward.py"
        return Programs((folder / "forward.py").read_text(), bwd.read_text() if bwd.is_file() else None,
                        meta, key, cached=True)
    fwd = compile_graph(graph, fspec)
    vjp_graph, cots = cotangent_graph(graph, _output_layouts(fwd))
    bwd = None
    if vjp_graph is not None and (input_grads or any(n.attr("trainable", True) for n in graph.params)):
        bwd = compile_graph(vjp_graph, backward_spec(fspec, cots, input_grads))
    progs = Programs(emit_program(fwd, profile, model=model_name),
                     None if bwd is None else emit_program(gradient_program(bwd), profile, model=model_name),
                     _meta(graph, fwd, bwd, cots), key)
    progs.meta["warnings"] = list(fwd.report.get("warnings", ())) + (
        [] if bwd is None else list(bwd.report.get("warnings", ())))
    if use_cache:
        _store(folder, progs)
    return progs


def _store(folder: Path, progs: Programs) -> None:
    """Write the programs under ``folder`` all at once (a temporary folder renamed): a reader
    sees all of them or none; a concurrent writer of the same key loses the race harmlessly."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        (tmp / "forward.py").write_text(progs.forward)
        if progs.backward is not None:
            (tmp / "backward.py").write_text(progs.backward)
        (tmp / "meta.json").write_text(json.dumps(progs.meta, indent=1, sort_keys=True))
        try:
            os.rename(tmp, folder)
        except OSError:  # another process stored the same key first
            for p in tmp.iterdir():
                p.unlink()
            tmp.rmdir()
    except OSError:  # a read-only home: compile every time, say nothing
        pass


def compile_train_program(graph: Graph, spec, *, profile: str = "cpu", model_name: str = "parcomp.parallelize",
                          cache=None, use_cache: bool = True) -> tuple:
    """The spec's whole training step (its ``train`` line: loss, backward, optimizer update,
    precision, recompute, accumulation, clipping) as program.py text, as ``parcomp compile``
    emits it; ``(text, key, cached)``, from the cache when a compile with the same fingerprint
    wrote it. The spec must have a ``train`` line."""
    from parcomp_backends.torch import emit_program

    options = {"train_step": True, "profile": profile}
    key = fingerprint(graph, spec, options)
    path = cache_dir(cache) / key / "train.py"
    if use_cache and path.is_file():
        return path.read_text(), key, True
    text = emit_program(compile_graph(graph, spec), profile, model=model_name)
    if use_cache:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".train.{os.getpid()}.py")
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError:  # a read-only home: compile every time
            pass
    return text, key, False
