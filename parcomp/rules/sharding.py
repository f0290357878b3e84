"""Sharding strategies per op, written for ONE mesh axis and expanded to the mesh.

A strategy is ``(input placements, output placement)`` for a single mesh axis,
as in DTensor's ``expand_to_full_mesh_op_strategy``.  Rules live in the table
:data:`STRATEGY_RULES`, keyed by op kind or op name; each rule is a function
``(node, in_types) -> list[(tuple[Placement, ...], Placement)]``.

Matmul strategies follow DTensor's einsum rules (``gen_einsum_strategies``):
batch and free dims shard one operand and the output, a contracted dim sharded
on both operands gives ``Partial``, and bilinearity lets one operand be
``Partial``.  Add counts a ``Replicate`` addend once: ``P + P -> P`` only, so an
``R`` bias must first become ``P`` (kept on one rank) or the sum must be reduced
first (a layout rule :mod:`parcomp.passes.verify` checks).
"""
from __future__ import annotations

import itertools

from ..ir.ops import OPS
from ..ir.types import PMAX, P, R, Shard, divisibility_problem
from .norms import NORM_STRATEGY_RULES
from .reductions import REDUCE_STRATEGY_RULES


def _pointwise(node, ts, linear):
    out = [((R,), R)] + [((Shard(d),), Shard(d)) for d in range(ts[0].rank)]
    return out + ([((P,), P)] if linear else [])


def _operand_dim(out_rank, out_shape, t, d):
    """The dim of operand ``t`` that broadcasts into output dim ``d`` (None if broadcast)."""
    di = d - (out_rank - t.rank)
    if di < 0 or t.shape[di] != out_shape[d]:
        return None
    return di


def _elementwise(node, ts):
    ty = node.type
    out = [(tuple(R for _ in ts), R)]
    for d in range(ty.rank):
        ins = []
        for t in ts:
            di = _operand_dim(ty.rank, ty.shape, t, d)
            ins.append(R if di is None else Shard(di))
        out.append((tuple(ins), Shard(d)))
    kind = OPS[node.op].kind
    if kind == "additive":
        out.append(((P, P), P))
    elif kind == "bilinear":
        out += [((P, R), P), ((R, P), P)]
    elif kind == "linear0":
        out.append(((P, R), P))
    return out


def _matmul(node, ts):
    a, b = ts
    ro = node.type.rank
    out = [((R, R), R)]
    for d in range(a.rank - 1):  # batch dims and the row dim of a
        is_batch = b.rank > 2 and d < a.rank - 2
        out.append(((Shard(d), Shard(d) if is_batch else R), Shard(d + ro - a.rank)))
    out.append(((Shard(a.rank - 1), Shard(b.rank - 2)), P))  # contracted dim: partial sums
    out.append(((R, Shard(b.rank - 1)), Shard(ro - 1)))  # column split of b
    out += [((P, R), P), ((R, P), P)]
    return out


def _permute(node, ts):
    perm = node.attr("perm")
    return [((R,), R), ((P,), P)] + [((Shard(perm[i]),), Shard(i)) for i in range(len(perm))]


def reshape_dim_map(src: tuple, dst: tuple) -> dict:
    """Input dim -> output dim for dims that can stay sharded through a reshape.

    Dims are grouped into runs with equal element products; only the outermost
    dim of a run keeps a contiguous block structure, so only it maps (to the
    outermost dim of the matching output run).  Size-1 dims never map.
    """
    out, i, j = {}, 0, 0
    while i < len(src) and j < len(dst):
        if src[i] == 1:
            i += 1
            continue
        if dst[j] == 1:
            j += 1
            continue
        i0, j0, pi, pj = i, j, src[i], dst[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                pi *= src[i]
                i += 1
            else:
                pj *= dst[j]
                j += 1
        out[i0] = j0
    return out


def _reshape(node, ts):
    dmap = reshape_dim_map(ts[0].shape, node.type.shape)
    return [((R,), R), ((P,), P)] + [((Shard(i),), Shard(o)) for i, o in dmap.items()]


def _sum(node, ts):
    dims = node.attr("dims")
    out = [((R,), R), ((P,), P)]
    for d in range(ts[0].rank):  # a sum over a split dim leaves partial sums
        out.append(((Shard(d),), P if d in dims else Shard(d - sum(1 for x in dims if x < d))))
    return out


def _expand(node, ts):
    dims = node.attr("dims")
    kept = [d for d in range(node.type.rank) if d not in dims]
    out = [((R,), R), ((P,), P)] + [((Shard(i),), Shard(d)) for i, d in enumerate(kept)]
    return out + [((R,), Shard(d)) for d in dims]  # each rank expands its own chunk


def _ones(node, ts):
    return [((), R)] + [((), Shard(d)) for d in range(node.type.rank)]


def _cross_entropy(node, ts):
    batch = range(ts[1].rank)
    return [((R, R), R)] + [((Shard(d), Shard(d)), Shard(d)) for d in batch]


def _cross_entropy_grad(node, ts):
    batch = range(ts[2].rank)
    return ([((R, R, R), R), ((P, R, R), P)]
            + [((Shard(d), Shard(d), Shard(d)), Shard(d)) for d in batch])


def _nonlinear(node, ts):
    return _pointwise(node, ts, linear=False) if len(ts) == 1 else _elementwise(node, ts)


def _relayout(node, ts):
    # identity; its output layout is pinned by the spec (shard-prop keeps node.layout)
    return [((R,), R), ((P,), P), ((PMAX,), PMAX)] + [((Shard(d),), Shard(d)) for d in range(ts[0].rank)]


STRATEGY_RULES = {
    "nonlinear": _nonlinear,
    "linear": lambda n, ts: _pointwise(n, ts, linear=True),
    "additive": _elementwise,
    "bilinear": _elementwise,
    "linear0": _elementwise,
    "matmul": _matmul,
    "permute": _permute,
    "reshape": _reshape,
    "relayout": _relayout,
    "reduce": _sum,
    "expand": _expand,
    "const": _ones,
    "cross_entropy": _cross_entropy,
    "cross_entropy_grad": _cross_entropy_grad,
    **NORM_STRATEGY_RULES,  # norms + embedding part: parcomp/rules/norms.py
    **REDUCE_STRATEGY_RULES,  # reductions part: parcomp/rules/reductions.py
}


# ---- attention part: views (slice, slice_grad, cat) and sdpa ----
from .attention import ATTENTION_STRATEGIES  # noqa: E402
from .views import VIEW_STRATEGIES  # noqa: E402

STRATEGY_RULES.update(VIEW_STRATEGIES)
STRATEGY_RULES.update(ATTENTION_STRATEGIES)
# ---- end of the attention part ----

def axis_strategies(node, in_types) -> list:
    """Single-axis strategies of ``node``: list of ``(in placements, out placement)``."""
    rule = STRATEGY_RULES.get(node.op) or STRATEGY_RULES.get(OPS[node.op].kind)
    if rule is None:
        raise KeyError(f"no sharding rule for op {node.op!r}")
    return rule(node, in_types)


def mesh_strategies(node, in_types, mesh) -> list:
    """All full-mesh strategies ``(in layouts, out layout)`` that split every tensor evenly.

    The single-axis strategies are combined axis by axis (cartesian product) and
    the combinations whose shards would be uneven are dropped.
    """
    per_axis = axis_strategies(node, in_types)
    out = []
    for combo in itertools.product(*(_on_axis(per_axis, name, node) for name in mesh.names)):
        ins = tuple(tuple(c[0][i] for c in combo) for i in range(len(in_types)))
        res = tuple(c[1] for c in combo)
        if divisibility_problem(node.type, res, mesh):
            continue
        if any(divisibility_problem(t, lay, mesh) for t, lay in zip(in_types, ins)):
            continue
        out.append((ins, res))
    return out


def _on_axis(per_axis, name, node=None) -> list:
    """The single-axis strategies allowed on mesh axis ``name``: a pipeline axis (``pp``)
    splits the model into stages, never a tensor, so only the replicated strategy. An axis
    in ``node``'s ``partial_over`` (mixed precision's ``grad_upcast``) takes its operand's
    partial sums there and reduces nothing before it: neither a replicated operand (an
    all_reduce before it) nor a split one (a ZeRO reduce_scatter before it), so the reduction
    after it sends float32."""
    if node is not None and name in (node.attr("partial_over", "") or "").split():
        return [s for s in per_axis if all(p == P for p in s[0])] or [s for s in per_axis if R not in s[0]]
    if name != "pp":
        return per_axis
    rep = [s for s in per_axis if s[1] == R and all(p == R for p in s[0])]
    return rep or per_axis


def is_valid_strategy(node, in_types, in_layouts, out_layout, mesh) -> bool:
    """Whether ``in_layouts -> out_layout`` is allowed for ``node`` on every mesh axis."""
    per_axis = axis_strategies(node, in_types)
    for a in range(len(mesh.axes)):
        pair = (tuple(lay[a] for lay in in_layouts), out_layout[a])
        if pair not in per_axis:
            return False
    return True
from .moe import MOE_STRATEGY_RULES  # noqa: E402  expert parallel MoE

STRATEGY_RULES.update(MOE_STRATEGY_RULES)
