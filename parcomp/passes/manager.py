"""Pass pipeline (xDSL ``PassPipeline`` style): named passes, verify after each.

A pass is a pure function ``Graph -> Graph``.  The pipeline verifies the IR
after every pass (xDSL's contract: verified IR in, verified IR out) and can hand
each intermediate graph to a callback (``--print-ir-after-all``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..errors import VerifyError
from ..ir.graph import Graph
from .autodiff import add_training_step
from .bind_layouts import bind_layouts
from .decompose import decompose_reductions
from .insert_collectives import insert_collectives
from .localize import localize
from .lowering.lower import LOWERING, SPEC_LOWERING
from .shard_prop import shard_prop
from .verify import verify


@dataclass(frozen=True)
class Pass:
    """A named graph-to-graph function."""

    name: str
    fn: Callable

    def __call__(self, graph: Graph) -> Graph:
        return self.fn(graph)


def forward_pipeline(spec, heuristic: bool = False) -> list:
    """The passes that turn an unsharded graph into a per-rank program.

    With a ``train`` line in the spec, ``autodiff`` appends loss, backward and
    optimizer update to the global graph before anything is sharded. The lowering
    passes of :mod:`.lowering.lower` (fusions, overlap, in-place, frees) come last. ``heuristic``:
    shard-prop skips the ILP (see :func:`.shard_prop.shard_prop`).
    """
    train = [Pass("autodiff", lambda g: add_training_step(g, spec))] if spec.train else []
    return [Pass("decompose-reductions", decompose_reductions),  # reductions part
            Pass("bind-layouts", lambda g: bind_layouts(g, spec)), *train,
            Pass("shard-prop", lambda g: shard_prop(g, memory=getattr(spec, "memory", None),
                                                    memory_loc=getattr(spec, "memory_loc", None),
                                                    heuristic=heuristic)),
            Pass("insert-collectives", insert_collectives),
            Pass("localize", localize),
            *(Pass(name, (lambda g, fn=fn: fn(g, spec)) if name in SPEC_LOWERING else fn)
              for name, fn in LOWERING)]


def run_pipeline(graph: Graph, passes, after: Callable | None = None) -> dict:
    """Run ``passes`` in order; returns ``{pass name: graph after it}``. Each new graph is
    verified (a pass returning its input object unchanged is not: it passed already).

    Raises:
        VerifyError: a pass produced invalid IR (names the pass and the node).
    """
    memo = {}  # nodes verified unchanged are not checked again (verify's memo)
    verify(graph, memo)
    out = {"input": graph}
    for p in passes:
        before, graph = graph, p(graph)
        try:
            if graph is not before:  # a pass that changed nothing returns its input, verified already
                verify(graph, memo)
        except VerifyError as e:
            err = VerifyError(f"after pass {p.name}: {e.message}")
            err.node = getattr(e, "node", None)  # lets a caller point at a .pcir line
            raise err from None
        out[p.name] = graph
        if after is not None:
            after(p.name, graph)
    return out
