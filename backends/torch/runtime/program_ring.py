"""Runtime helpers of ring attention (``context-parallel lowering=ring``), pasted into a
``program.py`` only when it has a ring-marked sdpa (see :mod:`parcomp_backends.torch.emit.cp_ring`). Semantics, step
for step: ``parcomp/reference/cp_ring.py`` (the numpy simulation the interpreter runs).

Blocks move by point-to-point ``isend`` / ``irecv`` (``torch.distributed.batch_isend_irecv``,
gloo and NCCL alike): coordinate c of the axis's group sends to c+1 and receives from c-1.
Under torch.compile (``--compile``) each shift is a functional ``all_to_all_single`` instead
(:func:`ring_start_functional`), which the compiler traces: the ring step is one graph.
"""
# flake8: noqa: E402
import torch
import torch.distributed as dist

GROUPS, GROUP_RANKS, RANK, DEVICE = {}, {}, 0, torch.device("cpu")  # stand-ins: program_common's


# >>> program.py: ring
def ring_line(axis):
    """(this rank's coordinate, the global ranks of its group of ``axis`` in coordinate order)."""
    line = next(ranks for ranks in GROUP_RANKS[axis] if RANK in ranks)
    return line.index(RANK), line


def ring_start(tensors, axis, receive=None):
    """Post one ring step without waiting: send each of ``tensors`` to coordinate c+1 and
    receive, from coordinate c-1, one tensor like each of ``receive`` (default: like
    ``tensors``); :func:`ring_finish` waits and returns what arrived. Compute that does not
    write the sent tensors may run in between (the transfer overlaps it)."""
    c, line = ring_line(axis)
    if torch.compiler.is_compiling():
        return ring_start_functional(tensors, c, len(line), axis, receive), None
    nxt, prv = line[(c + 1) % len(line)], line[(c - 1) % len(line)]
    got = [torch.empty_like(t) for t in (tensors if receive is None else receive)]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, GROUPS[axis]) for t in tensors]
    ops += [dist.P2POp(dist.irecv, g, prv, GROUPS[axis]) for g in got]
    return got, dist.batch_isend_irecv(ops) if ops else []


def ring_start_functional(tensors, c, n, axis, receive):
    """:func:`ring_start` under torch.compile (``--compile``), which cannot trace
    ``batch_isend_irecv`` (a graph break at every ring step): the same shift as one functional
    ``all_to_all_single`` per tensor, flattened, in which coordinate c sends all of it to
    c+1 and receives all of c-1's (the other split sizes 0); :func:`ring_finish` waits."""
    sizes = [t.numel() for t in tensors]
    if receive is not None and [t.numel() for t in receive] != sizes:
        raise ValueError("a ring step under torch.compile receives tensors as large as it sends")
    out = []
    for t, numel in zip(tensors, sizes):
        send, recv = [0] * n, [0] * n
        send[(c + 1) % n], recv[(c - 1) % n] = numel, numel
        moved = dist._functional_collectives.all_to_all_single(t.contiguous().reshape(-1), recv, send, GROUPS[axis])
        out.append((moved, t.shape))
    return out


def ring_finish(started):
    """What a :func:`ring_start` received, once its sends and receives are done."""
    got, works = started
    if works is None:  # started by ring_start_functional
        return [dist._functional_collectives.wait_tensor(t).reshape(shape) for t, shape in got]
    for work in works:
        work.wait()
    return got


def ring_shift(tensors, axis):
    """One ring step: send each tensor to coordinate c+1, return what coordinate c-1 sent."""
    return ring_finish(ring_start(tensors, axis))


def ring_positions(chunking, n, coord, rows):
    """Global sequence positions of a coordinate's local rows (contiguous or balanced chunks)."""
    if chunking != "balanced":
        return torch.arange(rows, device=DEVICE) + coord * rows
    h = rows // 2
    return torch.cat([torch.arange(h, device=DEVICE) + coord * h,
                      torch.arange(h, device=DEVICE) + (2 * n - 1 - coord) * h])


def ring_scores(q, k, scale, causal, qpos, kpos, window=0):
    """(scores of q against one K block, fully masked?): causal by global positions (and only
    the last ``window`` keys up to each query's position when ``window`` > 0)."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if not causal:
        return s, False
    keep = kpos[None, :] <= qpos[:, None]
    if window:
        keep = keep & (kpos[None, :] > qpos[:, None] - window)
    if torch.compiler.is_compiling():  # no host read of the mask (a graph break): a fully
        return s.masked_fill(~keep, float("-inf")), False  # masked block adds exact zeros
    return s.masked_fill(~keep, float("-inf")), not bool(keep.any())


def ring_stats(q, k, v, scale, causal, axis, chunking, window=0):
    """(output, row logsumexp) of attention over the ring: the online-softmax merge."""
    c, line = ring_line(axis)
    n, rows = len(line), q.shape[2]
    qpos = ring_positions(chunking, n, c, rows)
    m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(q.shape[:-1] + v.shape[-1:], dtype=q.dtype, device=q.device)
    for step in range(n):
        owner = (c - step) % n
        nxt = ring_start([k, v], axis) if step < n - 1 else None  # the next block moves meanwhile
        s, empty = ring_scores(q, k, scale, causal, qpos, ring_positions(chunking, n, owner, rows), window)
        if not empty:  # a block whose keys all follow this rank's queries is skipped
            m_new = torch.maximum(m, torch.amax(s, dim=-1, keepdim=True))
            alpha, p = torch.exp(m - m_new), torch.exp(s - m_new)
            l = l * alpha + torch.sum(p, dim=-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p, v)
            m = m_new
        if nxt is not None:
            k, v = ring_finish(nxt)
    return acc / l, m + torch.log(l)


def ring_sdpa(q, k, v, scale, causal, axis, chunking, window=0):
    """Ring attention forward: this rank's query rows against every rank's K/V block."""
    return ring_stats(q, k, v, scale, causal, axis, chunking, window)[0]


def ring_sdpa_saved(q, k, v, scale, causal, axis, chunking, window=0):
    """Ring attention forward and what its backward reads: ``(output, (output, row
    logsumexp))``; :func:`ring_sdpa_grads` given the second needs no statistics pass."""
    out, lse = ring_stats(q, k, v, scale, causal, axis, chunking, window)
    return out, (out, lse)


def ring_sdpa_grad(dy, q, k, v, scale, causal, axis, chunking, wrt, window=0):
    """The gradient ``wrt`` (q, k or v) of ring attention: statistics recomputed by one ring
    pass, then a second in which each step uses its own K/V block; partial dK/dV travel with
    their block and a last shift returns them to the owner."""
    out, lse = ring_stats(q, k, v, scale, causal, axis, chunking, window)
    c, line = ring_line(axis)
    n, rows = len(line), q.shape[2]
    qpos, d = ring_positions(chunking, n, c, rows), torch.sum(dy * out, dim=-1, keepdim=True)
    dq, part = torch.zeros_like(q), torch.zeros_like(k if wrt == "k" else v)
    for step in range(n):
        owner = (c - step) % n
        s, empty = ring_scores(q, k, scale, causal, qpos, ring_positions(chunking, n, owner, rows), window)
        if not empty:
            p = torch.exp(s - lse)  # this step's block of the global probabilities
            ds = p * (torch.matmul(dy, v.transpose(-1, -2)) - d)
            if wrt == "q":
                dq = dq + torch.matmul(ds, k) * scale
            elif wrt == "k":
                part = part + torch.matmul(ds.transpose(-1, -2), q) * scale
            else:
                part = part + torch.matmul(p.transpose(-1, -2), dy)
        if wrt == "q":
            if step < n - 1:
                k, v = ring_shift([k, v], axis)
        elif step < n - 1:  # the block's partial gradient travels with it
            k, v, part = ring_shift([k, v, part], axis)
        else:  # and a last shift returns it to the block's owner
            part = ring_shift([part], axis)[0]
    return dq if wrt == "q" else part


def ring_sdpa_grads(dy, q, k, v, scale, causal, axis, chunking, parts, window=0, saved=None):
    """The gradients ``parts`` (a string of ``q``, ``k``, ``v``, in that order) of ring
    attention in one backward ring: the statistics (``saved``: the output and row logsumexp
    :func:`ring_sdpa_saved` kept; else recomputed by one forward ring pass), then one pass
    over the K/V blocks in which every transfer overlaps compute. At step s this rank
    posts, before computing on the block it holds: that block's K/V to coordinate c+1 (its
    step s+1), the partial dK/dV of the block it held at step s-1 (sent on with it; the
    owner's own part, of step 0, stays home) and the receive of the partial of the block it
    holds now; after the last step the partial goes home to the block's owner, c+1. Per rank:
    n-1 shifts of K/V and n-1 of dK/dV (at cp=2: K/V, dK/dV home: 2, and the statistics pass
    without ``saved``: 3; :func:`ring_sdpa_grad`, one gradient at a time: 8)."""
    out, lse = ring_stats(q, k, v, scale, causal, axis, chunking, window) if saved is None else saved
    c, line = ring_line(axis)
    n, rows = len(line), q.shape[2]
    qpos, d = ring_positions(chunking, n, c, rows), torch.sum(dy * out, dim=-1, keepdim=True)
    dq, own, held = torch.zeros_like(q), None, None  # own: dK/dV of this rank's block; held: a partial
    travel = "k" in parts or "v" in parts  # partial dK / dV go round with their block
    for step in range(n):
        owner = (c - step) % n
        moves = [k, v] if step < n - 1 else []  # this block, for coordinate c+1's next step
        passes = travel and step >= 2  # the partial of the block held at step s-1, on with it
        posted = ring_start(moves + (held if passes else []), axis, moves + ([k, v] if passes else [])) \
            if moves or passes else None
        s, empty = ring_scores(q, k, scale, causal, qpos, ring_positions(chunking, n, owner, rows), window)
        dk = dv = None  # this step's part of the block's gradients
        if not empty:
            p = torch.exp(s - lse)  # this step's block of the global probabilities
            ds = p * (torch.matmul(dy, v.transpose(-1, -2)) - d)
            if "q" in parts:
                dq = dq + torch.matmul(ds, k) * scale
            if "k" in parts:
                dk = torch.matmul(ds.transpose(-1, -2), q) * scale
            if "v" in parts:
                dv = torch.matmul(p.transpose(-1, -2), dy)
        dk = torch.zeros_like(k) if dk is None else dk
        dv = torch.zeros_like(v) if dv is None else dv
        got = ring_finish(posted) if posted is not None else []
        if moves:
            k, v = got[:2]
        if step == 0:
            own = [dk, dv]
        else:  # the first rank after the owner starts the partial; the others add to it
            held = [got[-2] + dk, got[-1] + dv] if passes else [dk, dv]
    if travel and n > 1:  # the last partial goes home to its block's owner, c+1
        home = ring_finish(ring_start(held, axis))
        own = [own[0] + home[0], own[1] + home[1]]
    got = {"q": dq, "k": own[0], "v": own[1]}
    grads = tuple(got[c] for c in parts)
    return grads if len(parts) > 1 else grads[0]
# <<< program.py


# >>> program.py: balanced
def balance_order(n, length):
    """Natural positions of storage rows 0 .. length-1 under balanced chunking over n ranks:
    rank c holds chunks c and 2n-1-c of the 2n (parcomp/passes/attention/cp_balance.py)."""
    h = length // (2 * n)
    return torch.cat([torch.cat([torch.arange(h) + c * h, torch.arange(h) + (2 * n - 1 - c) * h])
                      for c in range(n)])


def balance_rows(x, dims, n):
    """``x`` (natural order along each of ``dims``) in balanced storage order."""
    for d in dims:
        x = x.index_select(d, balance_order(n, x.shape[d]).to(x.device))
    return x


def balanced_keep(lq, lk, start, n, window=0):
    """[lq, lk] causal mask by global positions: this rank's query rows (storage rows start ..
    start+lq-1) against the whole K in storage order; with ``window`` > 0 only the last
    ``window`` keys up to each query's position."""
    order = balance_order(n, lk).to(DEVICE)
    qpos = order[start:start + lq][:, None]
    keep = order[None, :] <= qpos
    return keep & (order[None, :] > qpos - window) if window else keep
# <<< program.py
