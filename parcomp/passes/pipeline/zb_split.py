"""ZB-H1's split backward: a stage's backward program cut into input- and weight-gradient parts.

Zero-bubble schedules (Qi et al. 2023) run a microbatch's backward as two actions:
``backward_input`` (B) makes the gradients of the values the stage received, which the
previous stage waits for; ``backward_weight`` (W) makes the parameter gradients and may
run later, in what would be bubble.  :func:`split_backward` cuts one backward graph (a
stage's global program, or its per-rank program with tp collectives) by data flow:

* B is every node the input gradients (``grad.<v>`` of the received values) need;
* W is every other node the parameter gradients (``grad.<p>``) need; a value W reads that
  B computed (a matmul's output gradient ``dy`` for ``dW = x^T dy``) is an output of B,
  ``wstash.<v>``, kept with the microbatch's stash until W runs, and an ``input`` of W
  (same name, type and layout).  Stashed activations and params W reads are its own
  inputs, as the whole backward's.

Each node runs in exactly one of the two, in the whole backward's order, so B then W
computes the same numbers as the whole backward.  Pure: graphs in, graphs out.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from parcomp.ir.graph import Graph
from ..verify import verify

__all__ = ["SplitBackward", "split_backward", "WSTASH"]

#: prefix of the values B hands to W (output names of B, input names of W)
WSTASH = "wstash."


@dataclass(frozen=True)
class SplitBackward:
    """A backward program cut in two (see the module docstring).

    Attributes:
        backward_input: outputs the input gradients, then ``wstash.<v>`` for each carried value.
        backward_weight: inputs the carried values ``<v>`` (fed from ``wstash.<v>``), the
            stashed activations and params it reads; outputs the parameter gradients.
        carried: names of the values B hands to W.
    """

    backward_input: Graph
    backward_weight: Graph
    carried: tuple


def _needs(graph: Graph, roots) -> set:
    """Every node name ``roots`` depend on (themselves included)."""
    todo, out = list(roots), set()
    while todo:
        v = todo.pop()
        if v not in out:
            out.add(v)
            todo.extend(graph[v].inputs)
    return out


def split_backward(graph: Graph, input_grads) -> SplitBackward:
    """Cut ``graph`` (a stage's backward, global or per-rank) into B and W.

    Args:
        input_grads: public output names of ``graph`` that B makes (``grad.<v>`` of the
            received values); every other output is W's.
    """
    named = list(graph.named_outputs())
    b_out = [(k, v) for k, v in named if k in input_grads]
    w_out = [(k, v) for k, v in named if k not in input_grads]
    in_b = _needs(graph, [v for _, v in b_out])
    in_w = _needs(graph, [v for _, v in w_out])
    sources = {n.name for n in graph.nodes if n.op in ("input", "param")}
    carried = tuple(n.name for n in graph.nodes
                    if n.name in in_b and n.name in in_w and n.name not in sources
                    and (n.name in {v for _, v in w_out}
                         or any(n.name in m.inputs for m in graph.nodes
                                if m.name in in_w and m.name not in in_b)))
    b_nodes = tuple(n for n in graph.nodes if n.name in in_b)
    w_nodes = tuple(replace(n, op="input", inputs=(), attrs=()) if n.name in carried else n
                    for n in graph.nodes if n.name in in_w and (n.name not in in_b or n.name in carried
                                                                 or n.name in sources))
    b = Graph(b_nodes, tuple(v for _, v in b_out) + carried, graph.mesh, graph.stage,
              tuple(k for k, _ in b_out) + tuple(WSTASH + v for v in carried))
    w = Graph(w_nodes, tuple(v for _, v in w_out), graph.mesh, graph.stage, tuple(k for k, _ in w_out))
    verify(b)
    verify(w)
    return SplitBackward(b, w, carried)
