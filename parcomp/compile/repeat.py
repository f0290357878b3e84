"""Repeated blocks of a model graph (block-plan reuse).

A transformer's input graph is: sources (params, inputs), a *prefix* (embeddings), ``N``
*windows* of ``L`` compute nodes each (one per block), a *suffix* (final norm, head). Block
``b``'s params are named ``<prefix>.<b>.<rest>`` (``transformer.h.7.attn.c_attn.weight``,
``model.layers.7.mlp.up_proj.weight``); window ``b`` starts at the first compute node reading
one of them and the windows are equally long. Names correspond between windows *by position*
(fx counters are not trusted: block 0's ``addmm`` is block 1's ``addmm_4``).

:func:`find_blocks` finds them (or None); :func:`reduced` builds the same model with ``M``
blocks (blocks ``0..M-1``, the suffix rewired to window ``M-1``), keeping every name of the
full graph, so the reduced compile's names are the full compile's names.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..ir.graph import Graph, evolve

#: fewest blocks worth reusing a plan for (the reduced model has REDUCED blocks)
MIN_BLOCKS = 8
_PARAM = re.compile(r"^(.+?)\.(\d+)\.(.+)$")
_SOURCES = ("param", "input")


@dataclass(frozen=True)
class Blocks:
    """The repeated blocks of a graph.

    Attributes:
        prefix: the params' common prefix (``transformer.h``).
        n: number of blocks.
        start: index (in ``compute``) of window 0's first node.
        length: compute nodes per window.
        compute: names of the non-source nodes in order.
    """

    prefix: str
    n: int
    start: int
    length: int
    compute: tuple

    def window(self, b: int) -> tuple:
        """Names of window ``b``'s nodes, in order."""
        s = self.start + b * self.length
        return self.compute[s:s + self.length]

    def block_tag(self, b: int) -> str:
        """The name part every param (and module path) of block ``b`` starts with."""
        return f"{self.prefix}.{b}"


def find_blocks(graph: Graph, min_blocks: int = MIN_BLOCKS) -> Blocks | None:
    """The repeated blocks of ``graph``, or None when it has fewer than ``min_blocks`` or
    they are not laid out as equal windows (the callers then compile the whole graph)."""
    groups = {}
    for n in graph.nodes:
        if n.op == "param":
            m = _PARAM.match(n.name)
            if m:
                groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), []).append(m.group(3))
    if not groups:
        return None
    prefix, blocks = max(groups.items(), key=lambda kv: len(kv[1]))
    n = len(blocks)
    if n < min_blocks or sorted(blocks) != list(range(n)):
        return None
    if any(blocks[b] != blocks[0] for b in range(n)):
        return None
    owner = {f"{prefix}.{b}.{rest}": b for b in range(n) for rest in blocks[b]}
    compute = tuple(x.name for x in graph.nodes if x.op not in _SOURCES)
    starts = {}
    for k, name in enumerate(compute):
        for i in graph[name].inputs:
            b = owner.get(i)
            if b is not None and b not in starts:
                starts[b] = k
    if sorted(starts) != list(range(n)):
        return None
    start, length = starts[0], starts.get(1, 0) - starts[0]
    if length <= 0 or any(starts[b] != start + b * length for b in range(n)):
        return None
    if start + n * length > len(compute):
        return None
    return Blocks(prefix, n, start, length, compute)


def reduced(graph: Graph, blocks: Blocks, m: int) -> Graph:
    """``graph`` with blocks ``0..m-1`` only: the suffix (and the outputs) read window
    ``m-1`` where they read window ``n-1``; every name is the full graph's.

    Raises:
        ValueError: the suffix reads a window other than the last (no such model here).
    """
    last, keep_last = blocks.window(blocks.n - 1), blocks.window(m - 1)
    rewire = dict(zip(last, keep_last))
    dropped = set()
    for b in range(m, blocks.n):
        dropped.update(blocks.window(b))
    tags = tuple(blocks.block_tag(b) + "." for b in range(m, blocks.n))
    suffix = set(blocks.compute[blocks.start + blocks.n * blocks.length:])
    nodes = []
    for x in graph.nodes:
        if x.name in dropped or (x.op == "param" and x.name.startswith(tags)):
            continue
        if x.name in suffix:
            if any(i in dropped and i not in rewire for i in x.inputs):
                raise ValueError(f"{x.name} reads a block before the last")
            x = evolve(x, inputs=tuple(rewire.get(i, i) for i in x.inputs))
        nodes.append(x)
    outs = tuple(rewire.get(o, o) for o in graph.outputs)
    if any(o in dropped for o in outs):
        raise ValueError("an output of a block before the last")
    return graph.with_nodes(nodes, outs)


def spec_names_a_block(spec, blocks: Blocks, graph: Graph) -> bool:
    """Whether the rules of ``spec`` tell the blocks apart: a param of block ``b`` matched by
    other rules than the same param of block 0 (``transformer.h.7.mlp.c_fc.weight``, or
    ``transformer.h.1*.mlp...`` matching blocks 1 and 10-19), or a rule on other names
    (activations, outputs) whose pattern holds a number as a name part. The plan of one
    block is then not another's."""
    number = re.compile(r"(^|\.)[0-9*]*[0-9][0-9*]*(\.|$)")
    if any(r.target != "param" and number.search(r.pattern) for r in spec.rules):
        return True
    params = [r for r in spec.rules if r.target == "param"]
    head = f"{blocks.prefix}.0."
    for x in graph.nodes:
        if x.op == "param" and x.name.startswith(head):
            rest = x.name[len(head):]
            want = [k for k, r in enumerate(params) if r.matches(x.name)]
            for b in range(1, blocks.n):
                name = f"{blocks.prefix}.{b}.{rest}"
                if [k for k, r in enumerate(params) if r.matches(name)] != want:
                    return True
    return False
