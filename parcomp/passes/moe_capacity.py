"""The spec's MoE capacity policy: ``moe capacity_factor=F [drop=tokens]`` / ``moe drop=none``.

The capacity C of an MoE layer is the slot dim of its dispatch buffer ``[B, E, C, H]``, so it
is a shape: changing it changes the types of every value between the ``moe_dispatch`` and the
``moe_combine`` (the permutes, reshapes and the experts' matmuls on ``[E, B*C, H]``). This
pass rewrites them, before any other: ``moe_route {capacity}`` (the drop rule) and
``moe_dispatch {capacity}`` (the buffer) get the spec's C, and every value downstream of the
buffer is re-typed by following the slot dim through the ops:

- each dim of such a value is a row-major product of *atoms* ``(size, is_slots)``; the
  buffer's dims are ``B``, ``E``, ``C*``, ``H`` (``*``: the slots);
- ``permute`` permutes the dims; ``reshape`` regroups the atoms in order (an atom that is not
  the slots may be cut in two, outer part first, as row-major order does);
- any other op keeps a dim of an operand where it lines up with an output dim of the same size
  (numpy broadcasting's right alignment: elementwise ops, a batched matmul's batch and row
  dims), and its new type is the op's own shape rule on the new operand types; the two must
  agree;
- ``moe_combine`` ends it: its slots operand must hold the slots whole, as dim 2.

A use the slots cannot be followed through (an op that contracts or reduces over them, a
reshape that cuts the slot dim, an op whose type is its own, such as ``expand``) is a
:class:`~parcomp.errors.SpecError` at the ``moe`` statement naming the value: never a silently
wrong shape. A model built with a capacity of 1 slot has nothing to follow (a size-1 dim), so
it is an error too.
"""
from __future__ import annotations

from dataclasses import replace

from ..errors import SpecError
from ..ir.graph import Graph, make_attrs
from ..ir.ops import OPS
from ..ir.types import TensorType


def apply_moe_spec(graph: Graph, spec) -> tuple:
    """``(graph, changes)``: ``graph`` with every MoE layer given the capacity of the spec's
    ``moe`` statement (``spec.moe``, a :class:`parcomp.spec.moe.MoeSpec`; None: no change).

    ``changes``: one dict per layer, ``{"route", "dispatch", "top_k", "experts", "seq",
    "model_capacity", "capacity", "drop", "slots", "model_slots", "asked"}`` (capacities in slots
    per expert per row; 0: none dropped, the buffer then has ``seq`` slots; ``asked``: what the
    factor asks for before the cap at ``seq``, :meth:`parcomp.spec.moe.MoeSpec.capacity`).

    Raises:
        SpecError: at the statement: the model has no ``moe_route``; a dispatch whose weights do
            not come straight from one; the slots cannot be followed (see the module docstring).
    """
    moe = getattr(spec, "moe", None)
    if moe is None:
        return graph, []
    routes = graph.by_op("moe_route")
    if not routes:
        raise SpecError("moe: the model has no MoE layer (no moe_route op); remove the statement", moe.loc)
    new, changes, marks = {}, [], {}
    for r in routes:
        seq, experts = r.type.shape[-2], r.type.shape[-1]
        cap = moe.capacity(seq, r.attr("top_k"), experts)
        new[r.name] = replace(r, attrs=make_attrs(**{**dict(r.attrs), "capacity": cap}))
        for d in (graph[u] for u in graph.users()[r.name]):
            if d.op != "moe_dispatch":
                continue
            if d.inputs[1] != r.name:
                raise SpecError(f"moe: %{d.name} reads the routing %{r.name} as tokens", moe.loc)
            slots, old = cap or seq, d.attr("capacity")
            if old == 1 and slots != 1:
                raise SpecError(f"moe: %{d.name} was built with 1 slot per expert, a size-1 dim the new "
                                f"capacity cannot be followed through; build the model with more slots", moe.loc)
            b, e, _, h = d.type.shape
            new[d.name] = replace(d, type=TensorType((b, e, slots, h), d.type.dtype),
                                  attrs=make_attrs(**{**dict(d.attrs), "capacity": slots}))
            marks[d.name] = (((b, False),), ((e, False),), ((old, True),), ((h, False),))
            changes.append({"route": r.name, "dispatch": d.name, "top_k": r.attr("top_k"), "experts": experts,
                            "seq": seq, "model_capacity": r.attr("capacity") or 0, "capacity": cap,
                            "drop": moe.drop, "slots": slots, "model_slots": old,
                            "asked": moe.asked(seq, r.attr("top_k"), experts)})
    slots_of = {c["dispatch"]: c["slots"] for c in changes}
    other = [d.name for d in graph.by_op("moe_dispatch") if d.name not in slots_of]
    if other:
        raise SpecError(f"moe: %{other[0]} does not read its weights straight from a moe_route, so its "
                        f"capacity cannot follow the route's", moe.loc)
    _follow(graph, new, marks, slots_of, moe.loc)
    return graph.with_nodes([new.get(n.name, n) for n in graph.nodes]), changes


def capacity_notes(changes) -> list:
    """One line per layer whose factor asks for more slots than a row has tokens (the cap of
    :meth:`parcomp.spec.moe.MoeSpec.capacity`), for the compile output; [] when none."""
    return [f"moe: capacity_factor asks %{c['route']} for {_count(c['asked'])} slots per expert per row; "
            f"capped at {c['capacity']}, the {c['seq']} tokens of a row (a token's top-{c['top_k']} "
            f"experts differ, so an expert takes at most one slot per token): nothing is dropped"
            for c in changes if c.get("asked", 0) > c["capacity"]]


def _count(n: int) -> str:
    """``n`` with thousands separators, or ``~1.23e+45`` past a million (a huge factor such as
    1e300 asks for a 300-digit count)."""
    return f"{n:,}" if n < 10**6 else f"~{float(n):.3g}"


def reference_text(changes, factor) -> str:
    """What ``check`` compares a training step with when the spec changed the model's capacity
    (instead of torch.optim, whose module computes the model as built): the unsharded step of
    the model with the spec's capacity ``capacity N`` per layer (``factor``: the statement's
    capacity_factor, None for drop=none)."""
    caps = sorted({c["capacity"] or c["seq"] for c in changes})
    built = sorted({c["model_capacity"] or c["seq"] for c in changes})
    said = f"capacity_factor={factor:g}" if factor is not None else "drop=none"
    return (f"the unsharded step of the model with capacity {', '.join(map(str, caps))} (spec's moe "
            f"{said}; the torch model is built with capacity {', '.join(map(str, built))})")


def spec_changes_capacity(changes) -> bool:
    """Whether the spec's capacity differs from the model's in some layer (then the model's
    own framework no longer computes what the program does: the reference is the unsharded
    graph with the spec's capacity)."""
    return any(c["capacity"] != c["model_capacity"] or c["slots"] != c["model_slots"] for c in changes)


def _follow(graph, new, marks, slots_of, loc) -> None:
    """Re-type every value downstream of a dispatch buffer (into ``new``), tracking its atoms
    in ``marks``; the slots atom of the buffer made by dispatch ``d`` becomes ``slots_of[d]``."""
    owner = {name: name for name in marks}  # value -> the dispatch whose slots it carries
    for n in graph.nodes:
        ins = [i for i in n.inputs if i in marks]
        if not ins or n.name in slots_of:
            continue
        src = owner[ins[0]]
        if n.op == "moe_combine":
            if n.inputs[0] not in marks or [any(c for _, c in dim) for dim in marks[n.inputs[0]]] != \
                    [False, False, True, False] or len(marks[n.inputs[0]][2]) != 1:
                raise SpecError(f"moe: %{n.name} does not read the slots of %{src} as its dim 2", loc)
            continue
        if n.op == "permute":
            out = tuple(marks[n.inputs[0]][p] for p in n.attr("perm"))
        elif n.op == "reshape":
            out = _regroup(marks[n.inputs[0]], n.type.shape, n.name, loc)
        else:
            out = _aligned(graph, n, marks, loc)
        marks[n.name], owner[n.name] = out, src
        shape = tuple(_size(dim, slots_of[src]) for dim in out)
        if n.op not in ("permute", "reshape"):
            _same_as_rule(graph, n, new, shape, loc)
        new[n.name] = replace(new.get(n.name, n), type=TensorType(shape, n.type.dtype))


def _size(dim, slots: int) -> int:
    out = 1
    for s, is_slots in dim:
        out *= slots if is_slots else s
    return out


def _regroup(dims, shape, name, loc) -> tuple:
    """The atoms of a reshape's result ``shape`` from its operand's ``dims`` (row-major)."""
    atoms = [a for dim in dims for a in dim if a[0] != 1]  # the slots are never 1 (apply_moe_spec)
    out, i = [], 0
    for n in shape:
        got, prod = [], 1
        while prod < n and i < len(atoms):
            s, is_slots = atoms[i]
            if n % (prod * s) == 0:
                got.append(atoms[i])
                prod, i = prod * s, i + 1
            elif not is_slots and n % prod == 0 and s % (n // prod) == 0:
                got.append((n // prod, False))
                atoms[i], prod = (s // (n // prod), False), n
            else:
                raise SpecError(f"moe: the reshape %{name} cuts the expert slots (to {list(shape)}); "
                                f"the capacity cannot be changed through it", loc)
        out.append(tuple(got))
    return tuple(out)


def _aligned(graph, n, marks, loc) -> tuple:
    """Atoms of ``n``'s dims: an operand's dim lined up from the right with the same size."""
    shape, out = n.type.shape, []
    for j, size in enumerate(shape):
        got = ((size, False),)
        for i in n.inputs:
            dims = marks.get(i)
            jj = j - (len(shape) - len(dims)) if dims else -1
            if dims and 0 <= jj < len(dims) and graph[i].type.shape[jj] == size and any(c for _, c in dims[jj]):
                got = dims[jj]
                break
        out.append(got)
    for i in n.inputs:  # every slot dim of an operand must reach the result
        dims = marks.get(i)
        for jj, dim in enumerate(dims or ()):
            j = jj + len(shape) - len(dims)
            if any(c for _, c in dim) and not (0 <= j < len(shape) and out[j] == dim):
                raise SpecError(f"moe: %{n.name} ({n.op}) contracts or reduces the expert slots of %{i}; "
                                f"the capacity cannot be changed through it", loc)
    return tuple(out)


def _same_as_rule(graph, n, new, shape, loc) -> None:
    """The op's own shape rule on the re-typed operands must give ``shape``."""
    ins = [new[i].type if i in new else graph[i].type for i in n.inputs]
    try:
        got = OPS[n.op].infer(ins, n).shape
    except ValueError as e:
        got = str(e)
    if got != shape:
        raise SpecError(f"moe: %{n.name} ({n.op}) does not follow the expert slots: its type would be "
                        f"{got}, the slots say {list(shape)}", loc)
