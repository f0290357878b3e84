"""Dropless MoE in ``program.py``: the experts compute only the routed tokens.

The graph keeps the MoE layer's static shapes (parcomp/reference/moe_ops.py): a dispatch
buffer ``[B, E, C, H]`` with C slots per expert per row, the experts as batched matmuls over
``E`` on it, ``moe_combine`` back. Without a capacity (``C`` = the row's tokens, nothing can
be dropped) most slots are empty: the buffer is E/k times the routed tokens and so are the
experts' FLOPs. This module rewrites the statements of every value between a ``moe_dispatch``
and a ``moe_combine`` (forward and backward) to a *packed* form: only the routed
(token, expert) pairs, one row each, sorted by expert, then row, then token (the slot order):

- ``moe_dispatch`` gathers the routed tokens (``moe_pack``); ``moe_combine`` /
  ``moe_combine_grad_c`` read them back by the same plan (``moe_route_plan`` of the weights
  ``c``: the pairs and the count of each expert, read to the host once: the layer's one
  device sync, after which the pairs are a ``nonzero_static`` of known size, so that under
  torch.compile with scalar outputs captured the layer is no graph break);
- a matmul of the slots with the expert weights ``[E, K, N]`` is one matmul per expert over
  exactly its rows (``moe_grouped_mm``); the weight gradient ``slots^T @ grad`` likewise
  (``moe_grouped_wgrad``);
- ``permute`` / ``reshape`` that only move the slot dims (B, E, C) are no-ops on the packed
  rows; element-wise ops, ``all_reduce`` and ops on a feature dim (``slice``, ``cat``) run on
  the packed rows as they are, with the dim renumbered;
- an ``all_to_all`` from rows-split to experts-split sends each peer the rows of its experts:
  the per-expert counts are exchanged once per layer by one ``all_to_all`` of counts
  (``moe_route_plan(c, axis)``, before its host copy, which then carries both; read by
  ``moe_expert_plan``), the rows by one ``all_to_all_single`` with split sizes; the way back
  (and the backward's two) reuse those counts.

The values are the dense program's, row for row (a dense buffer's empty slots hold zeros,
which combine never reads). A program with a capacity (the spec's ``moe capacity_factor``)
keeps the dense buffer: slots there are a bound the user asked for. Any statement on a slot
value this module does not know (a reduction over slots, a reshape that cuts them) leaves
the whole program dense, and :func:`dropless_plan` says which.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from parcomp.ir.moe_slots import SLOT_ATOMS, SlotLayoutError, feature_atom, regroup
from parcomp.ir.moe_slots import feature_dims as slot_feature_dims
from parcomp.ir.moe_slots import is_slot_dim
from parcomp.ir.moe_slots import signature as slot_signature

DROPLESS_EXCHANGE = ("; dropless: only the routed tokens' rows travel, packed by expert, after the "
                     "per-expert counts (one all_to_all per layer and step); bytes here: the padded "
                     "buffer's, an upper bound")
ELEMENTWISE = frozenset({
    "relu", "gelu", "tanh", "exp", "sigmoid", "silu", "pow", "add_scalar", "neg", "scale", "cast",
    "add", "sub", "mul", "div", "add_scaled", "axpby", "relu_grad", "tanh_grad", "sigmoid_grad",
    "silu_grad", "pow_grad", "gelu_grad", "grad_upcast", "partial_mask", "all_reduce", "wait",
    "relayout"})


@dataclass(frozen=True)
class Packed:
    """A slot value's dense layout: each dim a tuple of (atom, local size); slot atoms are
    B, E, C, feature atoms ("f", id). ``plan``: the plan variable its rows follow;
    ``side``: "rows" (a rank's own rows, the plan of c) or "experts" (after the all_to_all)."""
    dims: tuple
    plan: str
    side: str

    def slot_dim(self, d) -> bool:
        return is_slot_dim(self.dims, d)

    def signature(self) -> tuple:
        """The layout with feature atoms by size only: what element-wise operands must share."""
        return slot_signature(self.dims)

    def feature_dims(self) -> list:
        return slot_feature_dims(self.dims)

    def physical(self, d) -> int:
        """The dim of the packed tensor ([N, *feature dims]) that dense feature dim d is."""
        return 1 + self.feature_dims().index(d)


class NotDropless(Exception):
    """A statement the packed form does not cover (the program stays dense)."""


@dataclass
class DroplessPlan:
    """What :func:`dropless_plan` decided: per node, the statement lines replacing its own
    (``lines``), or why the program stays dense (``why``)."""
    lines: dict = field(default_factory=dict)
    why: str = ""
    stash: dict = field(default_factory=dict)  # saved value -> (Packed, c): a stage forward's packed stash

    @property
    def active(self) -> bool:
        return bool(self.lines)

    def comment(self) -> str:
        """The step function's line about its MoE layers."""
        if self.active:
            return ("MoE: dropless: each expert computes exactly its routed tokens (packed rows sorted "
                    "by expert; moe_route_plan, moe_grouped_mm); shapes in the comments are the dense "
                    "slot buffer's")
        return f"MoE: the dense slot buffer [B, E, C, H]: {self.why}"


def _atoms_dims(shape, names) -> tuple:
    return tuple(((a, s),) for a, s in zip(names, shape))


def dropless_plan(prog, names, stash_out: bool = False, stash_in=None, prefix: str = "saved.",
                  kept_routes=()) -> DroplessPlan:
    """The packed statements of ``prog``'s MoE layers (empty where there is none, or where the
    program keeps its dense slot buffers: ``why`` says which statement).

    A pipeline stage's forward and backward are two programs, the values the backward needs
    stashed between them (``saved.V`` outputs, read back as inputs ``V``): with ``stash_out``
    a saved output may stay packed, and the plan's ``stash`` says how (``{V: (Packed, c)}``,
    rows following the route plan of the weights ``c``, saved too); ``stash_in`` (the forward
    plan's ``stash``) starts those inputs of the backward packed, the route plan computed again
    from ``c`` right where it is read in (the same weights: the same pairs, in the same order).
    ZB-H1's halves of the backward chain a third program: the input half's outputs ``wstash.V``
    (``prefix``) may stay packed for the weight half, following weights ``c`` it saves or the
    forward stashed (``kept_routes``: the microbatch's stash, which the weight half's ``inp``
    holds too); a program given ``c`` by the stash but not reading it takes it from ``inp``."""
    program = prog.graph
    inputs = {n.name for n in program.inputs}
    if not any(n.op in ("moe_dispatch", "moe_combine", "moe_combine_grad_c") for n in program.nodes) \
            and not inputs & set(stash_in or ()):
        return DroplessPlan()
    if any(n.op == "moe_route" and n.attr("capacity", 0) for n in program.nodes):
        return DroplessPlan(why="a capacity is set (the spec's moe capacity_factor, or the model's)")
    try:
        return _plan(program, names, stash_out, stash_in or {}, prefix, set(kept_routes))
    except NotDropless as e:
        return DroplessPlan(why=str(e))


def _plan(program, names, stash_out=False, stash_in=None, prefix="saved.", kept_routes=frozenset()) -> DroplessPlan:
    packed: dict = {}
    plans: dict = {}  # c value name -> plan variable (rows side)
    expert_plans: dict = {}  # (rows plan, axis) -> experts-side plan variable
    back: dict = {}  # experts-side plan variable -> (rows plan, axis)
    lines: dict = {}
    taken = set(names.values())

    def fresh(base):
        name, i = base, 1
        while name in taken:
            name, i = f"{base}_{i}", i + 1
        taken.add(name)
        return name

    def route_plan(c):
        if c not in plans:
            plans[c] = fresh(f"{names[c]}_route_plan")
            return plans[c], [f"{plans[c]} = moe_route_plan({names[c]})"]
        return plans[c], []

    inputs = {n.name for n in program.inputs}
    order = {n.name: i for i, n in enumerate(program.nodes)}
    at_input = {}  # c input -> its route plan's statement, printed after c is read in
    for v, (p, c) in stash_in.items():
        if v not in inputs:  # a stashed value another program reads
            continue
        if c not in plans:
            plans[c] = fresh(f"{names[c] if c in names else _identifier(c)}_route_plan")
            if c in inputs:
                at_input[c] = [f"{plans[c]} = moe_route_plan({names[c]})"]
            else:  # the weights stay in the microbatch's stash, which inp holds: at the first reader
                first = min((u for u, (_, d) in stash_in.items() if d == c and u in inputs), key=order.__getitem__)
                at_input[first] = [f"{plans[c]} = moe_route_plan(inp[{json.dumps(c)}])"]
        packed[v] = Packed(p.dims, plans[c], "rows")
    named = program.named_outputs()
    saved = {v for pub, v in named if stash_out and pub == f"{prefix}{v}"}
    outputs = {v for pub, v in named if pub != f"{prefix}{v}" or v not in saved}
    for n in program.nodes:
        if n.op == "input":
            if n.name in at_input:
                lines[n.name] = at_input[n.name]
            continue
        ins = [packed.get(i) for i in n.inputs]
        if n.op == "moe_dispatch":
            if ins[0] is not None or ins[1] is not None:
                raise NotDropless(f"%{n.name}: a moe_dispatch of slots")
            x, c = (program[i] for i in n.inputs)
            if n.name in outputs:
                raise NotDropless(f"%{n.name}: slots as a program output")
            if n.attr("capacity") < c.type.shape[1]:
                raise NotDropless(f"%{n.name}: capacity {n.attr('capacity')} below the row's tokens")
            plan, pre = route_plan(n.inputs[1])
            b, e, cap, h = n.type.shape
            packed[n.name] = Packed(_atoms_dims((b, e, cap), SLOT_ATOMS) + ((feature_atom(h),),), plan, "rows")
            args = ", ".join(names[i] for i in n.inputs)
            lines[n.name] = pre + [f"{names[n.name]} = moe_pack({args}, {plan}, {n.attr('weighted', False)})"]
            continue
        if all(p is None for p in ins):
            continue
        lines[n.name], out = _statement(program, n, ins, names, expert_plans, back, fresh, route_plan)
        if out is not None:
            if n.name in outputs:
                raise NotDropless(f"%{n.name}: slots as a program output")
            packed[n.name] = out
    for plan, axis in expert_plans:  # its counts cross ``axis`` in the rows plan's one host copy
        for key, ls in lines.items():
            lines[key] = [f"{ln[:-1]}, {axis!r})" if ln.startswith(f"{plan} = moe_route_plan(") else ln
                          for ln in ls] if ls is not None else None
    stash, of_plan = {}, {v: c for c, v in plans.items()}
    for v in sorted(saved & set(packed)):
        p = packed[v]
        if p.side != "rows" or p.plan not in of_plan or of_plan[p.plan] not in saved | kept_routes:
            raise NotDropless(f"%{v}: slots stashed for the backward without their routing weights")
        stash[v] = (p, of_plan[p.plan])
    return DroplessPlan(lines=lines, stash=stash)


def _identifier(name: str) -> str:
    """A Python identifier made of value name ``name`` (one the program's names leave out)."""
    out = "".join(ch if ch.isalnum() or ch == "_" else "_" for ch in name)
    return out if out[:1].isalpha() or out[:1] == "_" else f"_{out}"


def _statement(program, n, ins, names, expert_plans, back, fresh, route_plan):
    """(lines, Packed of the result or None) of node ``n`` with some packed operand; lines
    None: the dense statement as it is, on the packed rows."""
    var, args = names[n.name], [names[i] for i in n.inputs]
    op = n.op
    p = next(q for q in ins if q is not None)
    if op in ("moe_combine", "moe_combine_grad_c"):
        y, cname = (ins[0], n.inputs[1]) if op == "moe_combine" else (ins[1], n.inputs[2])
        if y is None or any(q is not None for i, q in enumerate(ins) if q is not y):
            raise NotDropless(f"%{n.name}: {op} of slots it does not combine")
        plan, pre = route_plan(cname)
        if y.plan != plan or y.side != "rows":
            raise NotDropless(f"%{n.name}: {op} by other weights than its slots were dispatched by")
        if op == "moe_combine":
            return pre + [f"{var} = moe_unpack({args[0]}, {args[1]}, {plan}, {n.attr('weighted', True)})"], None
        return pre + [f"{var} = moe_pack_grad_c({args[0]}, {args[1]}, {args[2]}, {plan})"], None
    if op in ("permute", "reshape"):
        if op == "permute":
            dims = tuple(p.dims[i] for i in n.attr("perm"))
        else:
            dims = _regrouped(p.dims, n.type.shape)
        out = Packed(dims, p.plan, p.side)
        old = [p.dims[d] for d in p.feature_dims()]
        new = [out.dims[d] for d in out.feature_dims()]
        if op == "reshape" and old != new:
            raise NotDropless(f"%{n.name}: a reshape of the feature dims of slots")
        if op == "permute" and sorted(map(str, old)) != sorted(map(str, new)):
            raise NotDropless(f"%{n.name}: a permute that changes feature dims")
        if old == new:
            return [f"{var} = {args[0]}"], out
        perm = [0] + [1 + old.index(d) for d in new]
        return [f"{var} = {args[0]}.permute{tuple(perm)}"], out
    if op in ELEMENTWISE:
        if any(q is None or q.signature() != p.signature() or q.plan != p.plan for q in ins):
            raise NotDropless(f"%{n.name}: {op} of slots with another layout or a non-slot operand")
        return None, p  # the dense statement, on the packed rows
    if op == "matmul":
        a, w = ins
        if a is not None and w is None and program[n.inputs[1]].type.rank == 3 and len(a.dims) == 3:
            if a.dims[0] != (a.dims[0][0],) or a.dims[0][0][0] != "E" or not a.slot_dim(1) or a.slot_dim(2):
                raise NotDropless(f"%{n.name}: a matmul of slots not batched over the experts")
            out = Packed((a.dims[0], a.dims[1], (feature_atom(n.type.shape[2]),)), a.plan, a.side)
            return [f"{var} = moe_grouped_mm({args[0]}, {args[1]}, {a.plan})"], out
        if a is not None and w is not None and len(a.dims) == 3 and len(w.dims) == 3:
            ok = (a.plan == w.plan and a.dims[0] == w.dims[0] and a.dims[0][0][0] == "E" and len(a.dims[0]) == 1
                  and a.slot_dim(2) and not a.slot_dim(1) and w.slot_dim(1) and not w.slot_dim(2)
                  and sorted(x[0] for x in a.dims[2]) == sorted(x[0] for x in w.dims[1]))
            if not ok:
                raise NotDropless(f"%{n.name}: a matmul of two slot values that is no weight gradient")
            return [f"{var} = moe_grouped_wgrad({args[0]}, {args[1]}, {a.plan})"], None
        if a is not None and w is None and program[n.inputs[1]].type.rank == 2 and not a.slot_dim(len(a.dims) - 1):
            out = Packed(a.dims[:-1] + ((feature_atom(n.type.shape[-1]),),), a.plan, a.side)
            return None, out  # one weight for every expert: a plain matmul of the rows
        raise NotDropless(f"%{n.name}: a matmul of slots the packed form does not cover")
    if op in ("slice", "slice_grad"):
        d = n.attr("dim")
        if p.slot_dim(d):
            raise NotDropless(f"%{n.name}: a {op} of the slot dims")
        out = Packed(p.dims[:d] + ((feature_atom(n.type.shape[d]),),) + p.dims[d + 1:], p.plan, p.side)
        pd = p.physical(d)
        a = n.attr
        if op == "slice":
            return [f"{var} = torch.ops.aten.slice({args[0]}, {pd}, {a('start')}, {a('stop')}, {a('step', 1)})"], out
        shape = ", ".join([f"{args[0]}.shape[0]"] + [str(n.type.shape[f]) for f in out.feature_dims()])
        return [f"{var} = torch.ops.aten.slice_scatter({args[0]}.new_zeros(({shape})), {args[0]}, {pd}, "
                f"{a('start')}, {a('stop')}, {a('step', 1)})"], out
    if op == "cat":
        d = n.attr("dim")
        if any(q is None or q.plan != p.plan for q in ins) or p.slot_dim(d):
            raise NotDropless(f"%{n.name}: a cat of slots along the slots or with non-slots")
        out = Packed(p.dims[:d] + ((feature_atom(n.type.shape[d]),),) + p.dims[d + 1:], p.plan, p.side)
        return [f"{var} = torch.cat(({', '.join(args)},), dim={p.physical(d)})"], out
    if op == "all_to_all":
        return _exchange(n, p, names, expert_plans, back, fresh)
    raise NotDropless(f"%{n.name}: {op} of slots")


def _exchange(n, p, names, expert_plans, back, fresh):
    """The all_to_all of slots between rows-split and experts-split, packed."""
    src, dim, axis = n.attr("src_dim"), n.attr("dim"), n.attr("axis")
    var, x = names[n.name], names[n.inputs[0]]
    first = lambda d: p.dims[d][0][0]  # noqa: E731 - the outer atom of dim d
    sizes = n.type.shape
    if p.side == "rows" and first(dim) == "E" and first(src) == "B":
        key = (p.plan, axis)
        pre = []
        if key not in expert_plans:
            q = expert_plans[key] = fresh(f"{p.plan}_{axis}")
            back[q] = key
            pre = [f"{q} = moe_expert_plan({p.plan}, {axis!r})"]
        q = expert_plans[key]
        out = Packed(_resize(p.dims, sizes), q, "experts")
        return pre + [f"{var} = moe_to_experts({x}, {p.plan}, {q}, {axis!r})"], out
    if p.side == "experts" and first(dim) == "B" and first(src) == "E" and back[p.plan][1] == axis:
        rows = back[p.plan][0]
        out = Packed(_resize(p.dims, sizes), rows, "rows")
        return [f"{var} = moe_to_rows({x}, {p.plan}, {rows}, {axis!r})"], out
    raise NotDropless(f"%{n.name}: an all_to_all of slots that is not rows <-> experts")


def _resize(dims, shape):
    """``dims`` with the outer atom of each dim resized so the dim has ``shape``'s size."""
    out = []
    for d, size in zip(dims, shape):
        rest = 1
        for a in d[1:]:
            rest *= a[1]
        out.append(((d[0][0], size // rest),) + d[1:])
    return tuple(out)


def _regrouped(dims, shape):
    """The atoms of ``dims`` regrouped into ``shape`` (parcomp/ir/moe_slots.py), or NotDropless."""
    try:
        return regroup(dims, shape)
    except SlotLayoutError as e:
        raise NotDropless(str(e)) from None
