"""The point-to-point steps of ring attention as Program records (``lowering=ring``).

A ring-marked ``sdpa`` / ``sdpa_grad`` (``parcomp/passes/attention/ctxpar.py``) communicates inside the op:
no collective of the layout search carries its K/V. So that the report, program.py's header and
its comments still account for every byte, :func:`ring_records` gives the fields of one
:class:`parcomp.compile.program.Collective` of kind ``send_recv`` per ring pass of the node (what moves,
how many shifts, why: :func:`parcomp.reference.cp_ring.ring_steps`), named ``NODE.ring<i>``.
Bytes are per rank: every shift sends one block (and receives one) per tensor that moves.
"""
from __future__ import annotations

from parcomp.ir.types import layout_str
from parcomp.reference.cp_ring import is_ring, ring_steps

KIND = "send_recv"


def _moved_bytes(local, node, what: str) -> int:
    """Bytes of one shift of ``what`` (``k,v``, ``dk``, ``dv``) of ``node`` on one rank."""
    k, v = (local[i] for i in node.inputs[-2:])
    if what == "k,v":
        return k.type.nbytes + v.type.nbytes
    return (k if what == "dk" else v).type.nbytes


def ring_records(sharded, local, node) -> list:
    """The fields (a dict each, all but ``provenance``) of the ``send_recv``
    :class:`~parcomp.compile.program.Collective` records of ring node ``node`` (``[]`` for any other
    node). ``sharded`` / ``local``: the global and per-rank graphs."""
    if not is_ring(node):
        return []
    mesh, axis = sharded.mesh, node.attr("cp_axis")
    n = mesh.sizes[mesh.axis_index(axis)]
    lnode, k = local[node.name], local[node.inputs[-2]]
    out = []
    for i, (what, count, reason) in enumerate(ring_steps(node, n)):
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
