"""Ring attention (``context-parallel lowering=ring``): numpy semantics, all ranks simulated.

An ``sdpa`` / ``sdpa_grad`` marked ``cp=ring`` holds, on every rank of the context-parallel
group (``cp_axis``), its own block of the query rows **and** its own block of K and V
(``S(seq)`` on all operands). The blocks travel around the ring (coordinate c sends to c+1 and
receives from c-1, ``n - 1`` shifts), so at step s rank c holds the K/V block of rank
``(c - s) mod n``:

- **forward** (Liu et al. 2023, FlashAttention's online softmax): per step, the scores of the
  rank's queries against the block it holds, masked causally by **global positions**
  (:func:`positions`); a block every one of whose keys is after every query is skipped; the
  running row max ``m``, sum of exponentials ``l`` and the unnormalised output ``acc`` are
  rescaled by ``exp(m_old - m_new)`` and merged. Output ``acc / l``.
- **backward** (recompute, as every ``sdpa_grad`` recomputes its probabilities): one ring pass
  for the row statistics ``lse = m + log l`` and the output, then a second pass in which each
  step uses **that step's own K/V block**: ``p = exp(s - lse)``, ``dq += ds k_j``; the partial
  dK/dV of block j travel with the block and, after the last step, one more shift returns them
  to their owner (rank j).

:func:`ring_steps` lists these point-to-point steps of one node (program.py runs the
``sdpa_grad`` nodes of one attention as one backward ring: its records are
parcomp/passes/attention/cp_ring.py's ``program_ring_steps``); :func:`run_ring` runs one node on
every group of the mesh, shifting buffers as program.py's ``ring_shift`` does.
"""
from __future__ import annotations

import numpy as np

SEQ = 2


def is_ring(node) -> bool:
    """Whether ``node`` is an sdpa / sdpa_grad of the ring lowering."""
    return node.op in ("sdpa", "sdpa_grad") and node.attr("cp") == "ring"


def positions(chunking: str, n: int, coord: int, rows: int) -> np.ndarray:
    """Global sequence positions of the ``rows`` local rows of coordinate ``coord`` of ``n``.

    ``contiguous``: rows ``coord * rows ...``; ``balanced``: the sequence cut into ``2n`` chunks
    of ``rows / 2``, coordinate c holding chunks c and ``2n - 1 - c`` (one early, one late).
    """
    if chunking != "balanced":
        return coord * rows + np.arange(rows)
    h = rows // 2
    return np.concatenate([coord * h + np.arange(h), (2 * n - 1 - coord) * h + np.arange(h)])


def storage_order(n: int, length: int) -> np.ndarray:
    """Natural positions of storage rows ``0 .. length-1`` under balanced chunking over ``n``
    (rank-major: rank 0's chunks, then rank 1's, ...; parcomp/passes/attention/cp_balance.py)."""
    return np.concatenate([positions("balanced", n, c, length // n) for c in range(n)])


def _shift(bufs):
    """One ring step: coordinate c receives what c - 1 held."""
    return [bufs[(c - 1) % len(bufs)] for c in range(len(bufs))]


def _scores(q, k, node, qpos, kpos):
    """(scores, keep mask or None, fully masked?) of q against one K block."""
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * q.dtype.type(node.attr("scale"))
    if not node.attr("causal", False):
        return s, None, False
    keep = kpos[None, :] <= qpos[:, None]
    if node.attr("window", 0):  # a sliding window, in global positions
        keep = keep & (kpos[None, :] > qpos[:, None] - node.attr("window"))
    return np.where(keep, s, -np.inf), keep, not keep.any()


def ring_forward(qs, ks, vs, node, pos, sent=None):
    """Per coordinate ``(out, lse)`` of the ring forward; ``qs/ks/vs``: the group's local blocks
    in coordinate order, ``pos[c]``: coordinate c's global positions; ``sent``: a dict counting
    the shifts done, by what moved (``"k,v"``)."""
    sent = {} if sent is None else sent
    n, dt = len(qs), qs[0].dtype
    m = [np.full(q.shape[:-1] + (1,), -np.inf, dt) for q in qs]
    l = [np.zeros(q.shape[:-1] + (1,), dt) for q in qs]
    acc = [np.zeros(q.shape[:-1] + vs[0].shape[-1:], dt) for q in qs]
    kb, vb, owner = list(ks), list(vs), list(range(n))
    for step in range(n):
        for c in range(n):
            s, _, empty = _scores(qs[c], kb[c], node, pos[c], pos[owner[c]])
            if empty:
                continue  # every key of this block is after every query of this rank
            m_new = np.maximum(m[c], np.max(s, axis=-1, keepdims=True))
            alpha, p = np.exp(m[c] - m_new), np.exp(s - m_new)
            l[c] = l[c] * alpha + np.sum(p, axis=-1, keepdims=True)
            acc[c] = acc[c] * alpha + np.matmul(p, vb[c])
            m[c] = m_new
        if step < n - 1:
            kb, vb, owner = _shift(kb), _shift(vb), _shift(owner)
            sent["k,v"] = sent.get("k,v", 0) + 1
    return [(a / li).astype(dt) for a, li in zip(acc, l)], [mi + np.log(li) for mi, li in zip(m, l)]


def ring_backward(dys, qs, ks, vs, node, pos, sent=None):
    """Per coordinate ``{"q": dq, "k": dk, "v": dv}`` (dk/dv of the rank's own block); ``sent``
    as :func:`ring_forward`'s (``"dk"`` / ``"dv"``: the partial gradients' shifts)."""
    n, dt, c_ = len(qs), qs[0].dtype, qs[0].dtype.type(node.attr("scale"))
    sent = {} if sent is None else sent
    outs, lse = ring_forward(qs, ks, vs, node, pos, sent)
    d = [np.sum(dy * o, axis=-1, keepdims=True) for dy, o in zip(dys, outs)]
    dq = [np.zeros_like(q) for q in qs]
    kb, vb, owner = list(ks), list(vs), list(range(n))
    dkb, dvb = [np.zeros_like(k) for k in ks], [np.zeros_like(v) for v in vs]
    for step in range(n):
        for c in range(n):
            s, _, empty = _scores(qs[c], kb[c], node, pos[c], pos[owner[c]])
            if empty:
                continue
            p = np.exp(s - lse[c]).astype(dt)  # this step's block of the global probabilities
            dvb[c] = dvb[c] + np.matmul(np.swapaxes(p, -1, -2), dys[c])
            ds = p * (np.matmul(dys[c], np.swapaxes(vb[c], -1, -2)) - d[c])
            dq[c] = dq[c] + np.matmul(ds, kb[c]) * c_
            dkb[c] = dkb[c] + np.matmul(np.swapaxes(ds, -1, -2), qs[c]) * c_
        if step < n - 1:
            kb, vb, owner = _shift(kb), _shift(vb), _shift(owner)
            sent["k,v"] += 1
        dkb, dvb = _shift(dkb), _shift(dvb)  # with their block; the last shift: home
        sent["dk"], sent["dv"] = sent.get("dk", 0) + 1, sent.get("dv", 0) + 1
    return [{"q": a.astype(dt), "k": b.astype(dt), "v": e.astype(dt)} for a, b, e in zip(dq, dkb, dvb)]


def ring_steps(node, n: int) -> list:
    """``[(what, count, reason)]``: the point-to-point shifts of one ring node on a group of
    ``n`` (each rank sends one block to coordinate c+1 and receives one from c-1 per shift)."""
    if node.op == "sdpa":
        return [("k,v", n - 1, "ring attention forward: pass this rank's K/V block to the next "
                               "rank (online-softmax merge of each block as it arrives)")]
    wrt = node.attr("wrt")
    steps = [("k,v", n - 1, "ring attention backward, pass 1: K/V blocks around the ring to "
                            "recompute each row's softmax statistics (max, sum of exponentials)"),
             ("k,v", n - 1, f"ring attention backward (d{wrt}), pass 2: each step's own K/V "
                            "block for its slice of the gradient")]
    if wrt in ("k", "v"):
        steps.append((f"d{wrt}", n, f"ring attention backward: the partial d{wrt.upper()} of each "
                                    "block travels with it and returns to the block's owner"))
    return steps


def ring_group_values(node, qs, ks, vs, dys=None, chunking="contiguous", sent=None):
    """The group's results of ``node`` in coordinate order (forward: outputs; ``sdpa_grad``: the
    gradient ``wrt``), every local block ``[batch, heads, L, dim]``; ``sent``: see
    :func:`ring_forward`."""
    n, rows = len(qs), qs[0].shape[SEQ]
    pos = [positions(chunking, n, c, rows) for c in range(n)]
    if node.op == "sdpa":
        return ring_forward(qs, ks, vs, node, pos, sent)[0]
    return [g[node.attr("wrt")] for g in ring_backward(dys, qs, ks, vs, node, pos, sent)]


def run_ring(program, node, live) -> dict:
    """Run ring node ``node`` of local ``program`` on every group of its ``cp_axis``: sets
    ``live[rank][node.name]`` for every rank (``live``: per-rank value dicts). Returns the
    interpreter's log record: ``{"kind": "send_recv", "axis", "name", "shifts"}``, ``shifts``:
    ``{what moved: shifts}`` of one group (``dk``/``dv``: only the gradient ``node`` returns)."""
    mesh, sent = program.mesh, {}
    for group in mesh.groups(mesh.axes_of(node.attr("cp_axis"))):
        vals = [[live[r][i] for r in group] for i in node.inputs]
        dys, (qs, ks, vs) = (None, vals) if node.op == "sdpa" else (vals[0], vals[1:])
        sent = {}
        outs = ring_group_values(node, qs, ks, vs, dys, node.attr("chunking", "contiguous"), sent)
        for r, y in zip(group, outs):
            live[r][node.name] = np.array(y, order="C", copy=True)
    keep = {"k,v"} | ({f"d{node.attr('wrt')}"} if node.attr("wrt") in ("k", "v") else set())
    return {"kind": "send_recv", "axis": node.attr("cp_axis"), "name": node.name,
            "shifts": {w: c for w, c in sent.items() if w in keep}}
