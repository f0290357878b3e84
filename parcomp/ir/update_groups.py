"""The optimizer phase of a lowered local program as per-parameter updates, grouped as
torch.optim's multi-tensor kernels take them.

autodiff builds the update of each parameter as its own few nodes (parcomp/passes/autodiff.py,
``optimizer_update``; after ``fuse-updates``, lowered ops):

- AdamW: ``m' = axpby(m, g){a=beta1, b=1-beta1}``, ``g2 = mul(g, g)``,
  ``v' = axpby(v, g2){a=beta2, b=1-beta2}``, ``p' = adamw_param(p, m', v', step)``;
- SGD: ``d = add_scaled(g, p){b=weight_decay}`` (with weight decay),
  ``buf' = axpby(buf, d){a=momentum, b=1}`` (with momentum), ``p' = add_scaled(p, buf'){b=-lr}``.

:func:`update_groups` finds these units and groups those a single call can update: same
kind, hyperparameters, step value, dtype. The pass ``group-updates``
(parcomp/passes/lowering/group_updates.py) puts each group's nodes next to each other; an
emitter then prints one group as one multi-tensor call (the torch backend:
``torch._fused_adamw_``, ``torch._fused_sgd_``, torch.optim's fused kernels). The
numpy reference runs the nodes one by one: same numbers to rounding.

A unit's intermediate values (``g2``, SGD's decayed gradient, the new moments) are read by
nothing outside the unit but the step's outputs (and their ``relayout`` pins); a pattern that does not match (fp16 loss
scaling, which reads the old values again; an LR schedule's rescaled AdamW update) stays
per node.
"""
from __future__ import annotations

from dataclasses import dataclass

from .graph import Graph


@dataclass(frozen=True)
class Update:
    """One parameter's optimizer update in a lowered program.

    ``kind``: ``"adamw"`` or ``"sgd"``; ``nodes``: its node names in program order; ``param``:
    the value the update writes (the param, or a ZeRO shard of it: a ``shard_slice``);
    ``grad``: the gradient it reads; ``state``: AdamW's ``(exp_avg, exp_avg_sq)``, SGD's
    ``(momentum_buffer,)`` or ``()``; ``made``: each node of ``nodes`` whose value is the new
    ``param`` or state, mapped to the value it is written into (``param`` or the state);
    ``decayed``: SGD's ``g + wd p`` node, or None; ``key``: what a group shares."""
    kind: str
    nodes: tuple
    param: str
    grad: str
    state: tuple
    made: tuple  # ((node, written value), ...)
    decayed: str | None
    key: tuple

    def hyper(self) -> dict:
        """The hyperparameters of ``key`` by name."""
        return dict(self.key[1])


def _only_read_by(users, outs, v, reader) -> bool:
    return v not in outs and users[v] == [reader]


def _read_by(graph, users, v, reader) -> bool:
    """``v`` is read by ``reader`` and nothing else but ``relayout`` nodes (in a local program
    an identity: a pipeline stage's output pin) and the step's outputs."""
    return [u for u in users[v] if graph[u].op != "relayout"] == [reader]


def _adamw(graph, users, outs, a) -> Update | None:
    p, m_new, v_new, t = a.inputs
    mn, vn = graph[m_new], graph[v_new]
    if mn.op != "axpby" or vn.op != "axpby" or len({p, m_new, v_new, t}) < 4:
        return None
    m, g = mn.inputs
    v, sq = vn.inputs
    sqn = graph[sq]
    b1, b2 = a.attr("beta1"), a.attr("beta2")
    if (sqn.op != "mul" or sqn.inputs != (g, g) or graph[m].op != "param" or graph[v].op != "param"
            or (mn.attr("a"), mn.attr("b")) != (b1, 1 - b1) or (vn.attr("a"), vn.attr("b")) != (b2, 1 - b2)):
        return None
    if not (_read_by(graph, users, m_new, a.name) and _read_by(graph, users, v_new, a.name)
            and _only_read_by(users, outs, sq, v_new)):
        return None
    if len({graph[x].type for x in (p, g, m, v)}) != 1:
        return None
    hyper = tuple((k, a.attr(k)) for k in ("lr", "beta1", "beta2", "eps", "weight_decay"))
    return Update("adamw", (m_new, sq, v_new, a.name), p, g, (m, v), ((m_new, m), (v_new, v), (a.name, p)),
                  None, ("adamw", hyper, graph[p].type.dtype, t))


def _sgd(graph, users, outs, f) -> Update | None:
    p, d = f.inputs
    if graph[p].type != f.type or graph[d].type != f.type or p == d:
        return None
    nodes, made, state, decayed = [f.name], [(f.name, p)], (), None
    hyper = [("lr", -f.attr("b"))]
    dn = graph[d]
    if dn.op == "axpby" and dn.attr("b") == 1.0 and graph[dn.inputs[0]].op == "param" \
            and dn.phase == "optimizer" and _read_by(graph, users, d, f.name):
        buf, d = dn.inputs
        nodes.insert(0, dn.name)
        made.insert(0, (dn.name, buf))
        state = (buf,)
        hyper.append(("momentum", dn.attr("a")))
        dn = graph[d]
    if dn.op == "add_scaled" and dn.inputs[1] == p and dn.phase == "optimizer" \
            and _only_read_by(users, outs, d, nodes[0]) and graph[dn.inputs[0]].type == f.type:
        decayed, d = dn.name, dn.inputs[0]
        nodes.insert(0, dn.name)
        hyper.append(("weight_decay", dn.attr("b")))
    if d in (p, *state):
        return None
    return Update("sgd", tuple(nodes), p, d, state, tuple(made), decayed,
                  ("sgd", tuple(sorted(hyper)), graph[p].type.dtype, None))


def _updated_value(graph, p) -> bool:
    """``p`` is a param, or a ZeRO shard of one (``shard_slice`` of a param)."""
    n = graph[p]
    return n.op == "param" or (n.op == "shard_slice" and graph[n.inputs[0]].op == "param")


def updates(graph: Graph) -> list:
    """Every per-parameter AdamW or SGD update of ``graph`` (a lowered local program), in the
    order of their last node."""
    def find(g):
        users, outs, out = g.users(), set(g.outputs), []
        for n in g.nodes:
            if n.phase != "optimizer" or not n.inputs or not _updated_value(g, n.inputs[0]):
                continue
            u = (_adamw(g, users, outs, n) if n.op == "adamw_param"
                 else _sgd(g, users, outs, n) if n.op == "add_scaled" else None)
            if u is not None:
                out.append(u)
        return out
    return list(graph.memo("update_groups.updates", find))


def param_of(graph: Graph, u: Update) -> str:
    """The name of the parameter ``u`` updates (a ZeRO shard's param)."""
    n = graph[u.param]
    return n.inputs[0] if n.op == "shard_slice" else n.name


def update_groups(graph: Graph) -> list:
    """The updates of ``graph`` grouped by ``key`` (kind, hyperparameters, dtype, step value),
    each group in program order, the groups in the order of their first update. A unit that
    reads a value another unit of its group makes is left out of the group (one call reads
    every input before it writes)."""
    groups = {}
    for u in updates(graph):
        groups.setdefault(u.key, []).append(u)
    out = []
    for units in groups.values():
        kept, made = [], set()
        for u in units:
            if not any(i in made for n in u.nodes for i in graph[n].inputs):
                kept.append(u)
                made.update(u.nodes)
        out.append(kept)
    return out
