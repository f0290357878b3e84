"""Attention heads and tensor parallelism (issue 17, attention part): part of bind-layouts.

``colwise`` on a q/k/v projection splits its output features; the model then splits
those features into heads (``reshape [.., H*D] -> [.., H, D]``). The split is Megatron's
only when whole heads land on each rank, i.e. ``H % ranks == 0``: otherwise every rank
would hold part of a head and the planner would have to gather the projection's output
again. So, for each colwise weight whose output is split into heads:

- ``H % ranks == 0``: nothing to do (the reshape keeps the split on the heads dim);
- grouped-query attention with fewer kv heads than ranks (``ranks % H == 0`` and the heads
  are repeated by an ``expand`` on their way to attention, transformers' ``repeat_kv``):
  the kv projection (and its bias) is replicated over that axis, as Megatron replicates
  kv heads when tp exceeds their number; each rank repeats the kv heads and keeps the
  ones its query heads read (a local slice), and the gradients of the copies are summed
  by the backward of that slice and of the repeat;
- otherwise: a :class:`SpecError` at the rule, naming the parameter, the head count and
  the mesh axis.
"""
from __future__ import annotations

from ..errors import SpecError
from ..ir.types import R, Shard
from ..rules.sharding import reshape_dim_map

_PASS_THROUGH = ("add", "reshape", "relayout")  # bias addition, addmm's view back to [B, S, F]


def head_splits(graph, users, value):
    """``(reshape node, heads)`` for each reshape that splits the last dim of ``value``
    (followed through bias additions and reshapes that keep the last dim) into heads."""
    out, frontier, seen = [], [value], set()
    while frontier:
        cur = frontier.pop()
        for u in users[cur]:
            n = graph[u]
            if u in seen or n.op not in _PASS_THROUGH:
                continue
            seen.add(u)
            src = graph[cur].type
            if n.op == "reshape" and _one_head(src.shape, n.type.shape):  # [.., D] -> [.., 1, D]
                out.append((n, 1))
                continue
            if n.op == "reshape" and src.rank and n.type.rank and n.type.shape[-1] != src.shape[-1]:
                j = reshape_dim_map(src.shape, n.type.shape).get(src.rank - 1)
                if j is not None and j < n.type.rank - 1:
                    out.append((n, n.type.shape[j]))
                continue
            frontier.append(u)
    return out


def _one_head(src, out) -> bool:
    """``[.., D] -> [.., 1, D]``: a split into one head (multi-query attention's kv), which
    keeps the last dim and so is no split of it by size alone."""
    return len(out) == len(src) + 1 and len(src) >= 2 and out[:-2] == src[:-1] and out[-2:] == (1, src[-1])


def _repeated(graph, users, start, limit=64) -> bool:
    """Whether ``start`` reaches an ``expand`` (a repeat of heads) before any matmul/sdpa."""
    frontier, seen = [start], set()
    while frontier and len(seen) < limit:
        cur = frontier.pop()
        for u in users[cur]:
            if u in seen:
                continue
            seen.add(u)
            if graph[u].op == "expand":
                return True
            if graph[u].op not in ("matmul", "sdpa"):
                frontier.append(u)
    return False


def _matmuls_of(graph, users, name):
    """The matmuls weight ``name`` feeds as right operand, through permute/reshape and the
    part slices of a fused weight (parcomp/frontends/fused.py)."""
    out, frontier = [], [name]
    while frontier:
        cur = frontier.pop()
        for u in users[cur]:
            if graph[u].op == "matmul" and graph[u].inputs[1] == cur:
                out.append(u)
            elif graph[u].op in ("permute", "reshape", "slice"):
                frontier.append(u)
    return out


def _biases(graph, users, mm, bound_by, rule):
    """The params added to matmul ``mm``'s output that follow the weight's ``rule``."""
    adds = [graph[u] for u in users[mm] if graph[u].op == "add"]
    return [i for a in adds for i in a.inputs if i != mm and bound_by.get(i) is rule]


def check_heads(graph, spec, layouts, bound_by):
    """Apply the rules of this module to the colwise weights of ``bound_by`` (in place on
    ``layouts``).

    Raises:
        SpecError: a colwise weight's heads cannot be split evenly (not a GQA repeat).
    """
    users = graph.users()
    for name, rule in list(bound_by.items()):
        if rule is None or rule.layout.word != "colwise" or graph[name].op != "param":
            continue
        axis = spec.mesh.axis_index(rule.layout.axis)
        ranks = spec.mesh.sizes[axis]
        if ranks == 1 or not isinstance(layouts[name][axis], Shard):
            continue
        for mm in _matmuls_of(graph, users, name):
            for reshape, heads in head_splits(graph, users, mm):
                if heads % ranks == 0:
                    continue
                if ranks % heads == 0 and _repeated(graph, users, reshape.name):
                    for other in (name, *_biases(graph, users, mm, bound_by, rule)):
                        layouts[other] = layouts[other][:axis] + (R,) + layouts[other][axis + 1:]
                    continue
                size = reshape.type.shape[-1]
                raise SpecError(
                    f"{name} colwise over {spec.mesh.names[axis]} ({ranks} ranks): its output is split "
                    f"into {heads} heads of {size} (reshape %{reshape.name}), and {heads} heads cannot be "
                    f"split evenly over {ranks} ranks (nor is this a grouped-query kv projection with "
                    f"fewer heads than ranks); use a mesh axis that divides {heads}, or give {name} "
                    f"another layout", rule.loc)
