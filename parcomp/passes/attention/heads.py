"""Attention heads and tensor parallelism (attention part): the pass attention-heads.

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
  the mesh axis. Where the dim split off is no heads dim but the parts of a packed q|k|v
  projection cut apart after the reshape (nn.MultiheadAttention's ``in_proj_weight``:
  ``unflatten(-1, (3, E))``, then one index per part; :func:`packed_parts`), the error says
  so, with the heads attention sees and the rewrite whose parts colwise splits (q, k, v cut
  from the last dim with ``chunk``, as GPT-2's ``c_attn``: :mod:`parcomp.passes.fused_weights`).
  nn.MultiheadAttention itself also merges batch and heads into one dim (``[seq, batch *
  heads, head_dim]``), which no block split of its heads survives.
"""
from __future__ import annotations

from parcomp.errors import SpecError
from parcomp.ir.types import R, Shard
from parcomp.rules.sharding import reshape_dim_map

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
    part slices of a fused weight (parcomp/passes/fused_weights.py)."""
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


def packed_parts(graph, users, reshape) -> list | None:
    """The ``slice`` nodes that cut apart the parts of a packed projection, when the dim
    ``reshape`` splits off its output's last dim (``[.., k*F] -> [.., k, F]``) is no heads dim
    but ``k`` parts (q, k, v): followed through single-use reshapes and permutes, it is cut by
    ``k`` slices of one index each (nn.MultiheadAttention's ``unflatten(-1, (3, E))``, then
    ``proj[0], proj[1], proj[2]``). None otherwise."""
    src = graph[reshape.inputs[0]].type
    pos = reshape_dim_map(src.shape, reshape.type.shape).get(src.rank - 1)
    if pos is None:
        return None
    k, cur = reshape.type.shape[pos], reshape.name
    for _ in range(64):
        us = [graph[u] for u in users[cur]]
        if len(us) == k and all(u.op == "slice" and u.attr("dim") == pos and u.attr("step", 1) == 1
                                and u.attr("stop") - u.attr("start") == 1 for u in us):
            return sorted(us, key=lambda u: u.attr("start")) if {u.attr("start") for u in us} == set(range(k)) else None
        if len(us) != 1 or us[0].op not in ("reshape", "permute"):
            return None
        n = us[0]
        pos = (list(n.attr("perm")).index(pos) if n.op == "permute"
               else reshape_dim_map(graph[cur].type.shape, n.type.shape).get(pos))
        if pos is None or n.type.shape[pos] != k:
            return None
        cur = n.name
    return None


def _attention_heads(graph, users, start, limit=64):
    """``(heads, head_dim)`` of the first ``sdpa`` whose operand ``start`` reaches (q, k or v
    [.., heads, seq, head_dim]), or None."""
    frontier, seen = [start], set()
    while frontier and len(seen) < limit:
        cur = frontier.pop(0)
        for u in users[cur]:
            if u in seen:
                continue
            seen.add(u)
            n = graph[u]
            if n.op == "sdpa" and graph[n.inputs[0]].type.rank >= 3:
                q = graph[n.inputs[0]].type.shape
                return q[-3], q[-1]
            frontier.append(u)
    return None


def _packed_message(graph, users, name, axis, ranks, reshape, parts) -> str:
    """Why ``colwise`` does not split a packed q|k|v projection whose parts are cut apart
    after a reshape, and what to write instead."""
    k, width = len(parts), reshape.type.shape[-1]
    which = {3: " (q, k and v)", 2: " (k and v)"}.get(k, "")
    src = graph[reshape.inputs[0]].type.shape
    heads = _attention_heads(graph, users, parts[0].name)
    seen = f" (attention sees {heads[0]} heads of {heads[1]} in each part)" if heads else ""
    then = f"then '{name} colwise' splits each part's heads over {axis}"
    if heads and heads[0] % ranks:
        then = f"its {heads[0]} heads then need a mesh axis that divides {heads[0]}, not {ranks} ranks"
    return (f"{name} colwise over {axis} ({ranks} ranks): {name} packs {k} parts{which} of {width} "
            f"features each, and the model cuts them apart after a reshape (%{reshape.name}: "
            f"[..,{src[-1]}] -> [..,{k},{width}], then one slice per part, as nn.MultiheadAttention does "
            f"with its in_proj_weight): the {k} there are those parts, not attention heads{seen}. colwise "
            f"splits a packed weight per part where the model cuts the parts out of its last dim, as "
            f"GPT-2's c_attn: q, k, v = F.linear(x, in_proj_weight, in_proj_bias).chunk({k}, -1), each "
            f"viewed as [batch, heads, seq, head_dim] for F.scaled_dot_product_attention (the same "
            f"parameters: the module's state_dict loads); {then}. Otherwise give {name} and its output "
            f"projection no colwise/rowwise rule (the attention then runs whole on every rank)")


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
                parts = packed_parts(graph, users, reshape)
                if parts is not None:
                    raise SpecError(_packed_message(graph, users, name, spec.mesh.names[axis], ranks,
                                                    reshape, parts), rule.loc)
                size = reshape.type.shape[-1]
                raise SpecError(
                    f"{name} colwise over {spec.mesh.names[axis]} ({ranks} ranks): its output is split "
                    f"into {heads} heads of {size} (reshape %{reshape.name}), and {heads} heads cannot be "
                    f"split evenly over {ranks} ranks (nor is this a grouped-query kv projection with "
                    f"fewer heads than ranks); use a mesh axis that divides {heads}, or give {name} "
                    f"another layout", rule.loc)
