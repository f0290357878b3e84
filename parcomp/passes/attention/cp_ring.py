"""The point-to-point steps of ring attention as Program records (``lowering=ring``).

A ring-marked ``sdpa`` / ``sdpa_grad`` (``parcomp/passes/attention/ctxpar.py``) communicates inside the op:
no collective of the layout search carries its K/V. So that the report, program.py's header and
its comments still account for every byte, :func:`ring_records` gives the fields of one
:class:`parcomp.compile.program.Collective` of kind ``send_recv`` per ring pass the program runs
(what moves, how many shifts, why: :func:`program_ring_steps`), named ``NODE.ring<i>``.
Bytes are per rank: every shift sends one block (and receives one) per tensor that moves.

The passes are the emitted program's, not the interpreter's per-node simulation
(:func:`parcomp.reference.cp_ring.ring_steps`, where each ``sdpa_grad`` recomputes its
statistics and runs its own ring): the ``sdpa_grad`` nodes of one attention (same operands and
attributes, one per q / k / v) run as **one** backward ring (program_ring.py's
``ring_sdpa_grads``, printed at the first of them, which carries all the records), and where
the same program computes that attention's forward (:func:`parcomp.ir.liveness.saved_attention`)
the backward reads the forward ring's output and row logsumexp and has no statistics pass.
"""
from __future__ import annotations

from parcomp.ir.liveness import saved_attention
from parcomp.ir.types import layout_str
from parcomp.reference.cp_ring import is_ring, ring_steps

KIND = "send_recv"
_PER_NODE = ("wrt", "frees", "inplace", "async_op")  # attributes that differ between the gradients of one attention


def _moved_bytes(local, node, what: str) -> int:
    """Bytes of one shift of ``what`` (``k,v``, ``dk``, ``dv``, ``dk,dv``) of ``node`` on one rank."""
    k, v = (local[i] for i in node.inputs[-2:])
    if what in ("k,v", "dk,dv"):
        return k.type.nbytes + v.type.nbytes
    return (k if what == "dk" else v).type.nbytes


def backward_rings(graph) -> dict:
    """``{sdpa_grad name: (first node's name, parts, saved)}`` for the ring ``sdpa_grad`` nodes
    run as one backward ring: those of one attention (same operands and attributes), at most one
    per operand; ``parts``: the gradients it gives (q, k, v in that order), ``saved``: whether
    the forward ring's output and row logsumexp are kept for it. A node absent runs on its own
    (two nodes for one operand: ``ring_sdpa_grad``, statistics recomputed)."""
    return graph.memo("cp_ring.backward_rings", _backward_rings)


def _backward_rings(graph):
    groups = {}
    for n in graph.nodes:
        if n.op == "sdpa_grad" and is_ring(n):
            key = (n.inputs, tuple((k, v) for k, v in n.attrs if k not in _PER_NODE))
            groups.setdefault(key, []).append(n)
    kept = set(saved_attention(graph).values())
    out = {}
    for nodes in groups.values():
        parts = "".join(c for c in "qkv" if any(n.attr("wrt") == c for n in nodes))
        if len(parts) != len(nodes):
            continue
        for n in nodes:
            out[n.name] = (nodes[0].name, parts, nodes[0].name in kept)
    return out


def program_ring_steps(graph, node, n: int) -> list:
    """``[(what, count, reason)]``: the point-to-point passes the program runs for ring node
    ``node`` of ``graph`` on a group of ``n`` (each shift sends one block per tensor to
    coordinate c+1 and receives one from c-1). The forward: ``n - 1`` shifts of K and V. One
    backward ring (program_ring.py's ``ring_sdpa_grads``; the first ``sdpa_grad`` of the
    attention has them all, the others none): without ``saved`` statistics, a forward pass
    first; ``n - 1`` shifts of K/V, each posted before the step's compute; with dK or dV asked,
    ``n - 1`` shifts of the partial dK and dV (the first ``n - 2`` in the same message as the
    next K/V shift, the last home to the block's owner): ``n + 1`` messages at ``n`` > 2, 2 at
    ``n`` = 2. A node run on its own: :func:`parcomp.reference.cp_ring.ring_steps`."""
    if node.op == "sdpa":
        return ring_steps(node, n)
    got = backward_rings(graph).get(node.name)
    if got is None:
        return ring_steps(node, n)
    first, parts, saved = got
    if node.name != first:
        return []
    grads = ", ".join(f"d{p.upper()}" for p in parts)
    steps = [] if saved else [("k,v", n - 1, "ring attention backward, statistics pass: K/V blocks around "
                                             "the ring to recompute each row's softmax statistics")]
    steps.append(("k,v", n - 1, f"ring attention backward ({grads} in one ring"
                                f"{' on the forward ring output and row logsumexp kept' if saved else ''}): "
                                "each K/V block passed on to the next rank while this rank computes "
                                "its slice of the gradients"))
    if "k" in parts or "v" in parts:
        steps.append(("dk,dv", n - 1, "ring attention backward: the partial dK and dV of each block "
                                      "travel with it (beside the next K/V shift) and the last returns "
                                      "to the block's owner"))
    return steps


def ring_records(sharded, local, node) -> list:
    """The fields (a dict each, all but ``provenance``) of the ``send_recv``
    :class:`~parcomp.compile.program.Collective` records of ring node ``node`` (``[]`` for any other
    node, and for an ``sdpa_grad`` whose attention's backward ring another node carries).
    ``sharded`` / ``local``: the global and per-rank graphs."""
    if not is_ring(node):
        return []
    mesh, axis = sharded.mesh, node.attr("cp_axis")
    n = mesh.sizes[mesh.axis_index(axis)]
    lnode, k = local[node.name], local[node.inputs[-2]]
    out = []
    for i, (what, count, reason) in enumerate(program_ring_steps(sharded, node, n)):
        moved = _moved_bytes(local, lnode, what)
        why = (f"{reason}; %{node.name} ({node.op}{'' if node.op == 'sdpa' else ' ' + node.attr('wrt')}), "
               f"{count} shift{'s' if count != 1 else ''} of {what} to coordinate c+1, "
               f"{moved} bytes each")
        lay = layout_str(sharded[node.inputs[-2]].layout)
        out.append({"name": f"{node.name}.ring{i}", "kind": KIND, "axis": axis, "dim": 2,
                    "dtype": k.type.dtype, "local_shape": tuple(k.type.shape), "src_layout": lay,
                    "dst_layout": lay, "bytes": count * moved, "phase": node.phase,
                    "producer": node.name, "consumers": (f"{node.op} %{node.name}",), "reason": why})
    return out
