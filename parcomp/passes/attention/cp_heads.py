"""Context parallel together with tensor parallel: the mesh axes that split attention heads.

Megatron runs CP and TP together (``mesh cp=2 tp=2``): q/k/v projections ``colwise`` over tp
(each tp rank computes heads/tp heads), ``o_proj`` ``rowwise`` (one all_reduce over tp after it),
the sequence over cp. The context-parallel pins (``parcomp/passes/attention/ctxpar.py``,
``cp_ulysses.py``) must then keep the heads split on tp, or the layout search has to gather the
projections' weights (or their outputs) whole over tp to meet a pin that is ``R`` there.

:func:`heads_axes` finds, for one pinned value ``[batch, heads, seq, head_dim]`` (an sdpa operand,
or the kv heads entering a GQA repeat), the mesh axes over which its heads arrive split: the
axes on which the projection matmul(s) it comes from have their weight split along the output
features (``colwise``; ``parcomp/passes/attention/heads.py`` has already checked that whole heads land on
each rank, or replicated a kv projection with fewer heads than ranks). The pins put ``S(1)``
(heads) on those axes; the sdpa's single-axis rules (``parcomp/rules/attention.py``) split heads
on every axis, so each tp rank runs attention on its own heads and the cp exchange carries
those heads only. The output pin takes the heads split of q (the output's heads are q's).
"""
from __future__ import annotations

from parcomp.ir.types import Shard
from parcomp.rules.sharding import reshape_dim_map

HEADS = 1  # dim of [batch, heads, seq, head_dim]
_STOP = ("sdpa", "sdpa_grad", "input", "param")


def heads_axes(graph, value: str, skip: set) -> tuple:
    """The mesh axes (indices, ascending, none in ``skip``) over which a projection matmul
    that ``value`` is computed from (walking back through its inputs, stopping at the first
    matmul on each path) has its weight split along the output features. Empty when ``value``
    comes from no matmul, or from none whose weight is split so on any axis. A union, not an
    intersection: RoPE's table is a matmul of positions (never split), and a pin's heads split
    is a choice of layout only (an operand arriving replicated there is sliced locally)."""
    matmuls, frontier, seen = [], [value], set()
    while frontier:
        cur = frontier.pop()
        if cur in seen:
            continue
        seen.add(cur)
        node = graph[cur]
        if node.op == "matmul":
            matmuls.append(node)
        elif node.op not in _STOP:
            frontier.extend(node.inputs)
    axes = set().union(*(_colwise_axes(graph, mm) for mm in matmuls))
    return tuple(sorted(axes - set(skip)))


def _colwise_axes(graph, mm) -> set:
    """Axes on which matmul ``mm``'s right operand ``b[.., k, n]`` comes from a param split
    along the dim that becomes ``n``."""
    found = _param_dim(graph, mm.inputs[1], graph[mm.inputs[1]].type.rank - 1)
    if found is None:
        return set()
    param, dim = found
    return {a for a, p in enumerate(param.layout or ()) if isinstance(p, Shard) and p.dim == dim}


def _param_dim(graph, name: str, dim: int):
    """``(param node, its dim)`` that dim ``dim`` of ``name`` comes from, through permute,
    reshape (a dim that keeps its block structure) and slice (a fused weight's part), or None."""
    node = graph[name]
    while node.op != "param":
        if node.op == "permute":
            dim = node.attr("perm")[dim]
        elif node.op == "reshape":
            back = {j: i for i, j in reshape_dim_map(graph[node.inputs[0]].type.shape, node.type.shape).items()}
            if dim not in back:
                return None
            dim = back[dim]
        elif node.op != "slice":
            return None
        node = graph[node.inputs[0]]
    return node, dim


def with_heads(lay: tuple, axes) -> tuple:
    """``lay`` with ``S(heads)`` on each axis in ``axes``."""
    return tuple(Shard(HEADS) if i in axes else p for i, p in enumerate(lay))
