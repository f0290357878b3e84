"""Runtime helpers of the MoE ops, pasted into a ``program.py`` only when it uses
them (see :mod:`parcomp_backends.torch.emit.moe`); the torch model of ``specs/models.py:moe_block`` calls the same
functions through the custom ops of ``parcomp/frontends/torch/moe.py``. Semantics (and their
proof obligations): ``parcomp/reference/moe_ops.py``.

The expert-parallel exchange itself is no helper: it is the ``all_to_all`` of the dispatch
buffer between ``moe_dispatch`` and the experts, and back before ``moe_combine``
(program_common's ``all_to_all`` / ``all_to_all_v``).
"""
# flake8: noqa: E402
import torch
import torch.distributed as dist

GROUPS, MESH = {}, {}  # stand-ins: program_common's process groups and mesh


# >>> program.py: moe
def moe_top_mask(z, top_k, capacity):
    """(top-k mask, kept mask) of logits z[..., S, E]: ties to the lower expert, then at most
    ``capacity`` tokens per expert per row, in token order (0: no limit)."""
    order = torch.sort(z, dim=-1, descending=True, stable=True).indices[..., :top_k]
    top = torch.zeros_like(z, dtype=torch.bool).scatter(-1, order, True)
    kept = top & (torch.cumsum(top.to(torch.int64), dim=-2) <= capacity) if capacity else top
    return top, kept


def moe_weights(z, top):
    """softmax over the top-k entries of each token (0 elsewhere)."""
    m = torch.amax(z.masked_fill(~top, float("-inf")), dim=-1, keepdim=True)
    e = torch.exp(z - m).masked_fill(~top, 0.0)
    return e / torch.sum(e, dim=-1, keepdim=True)


def moe_route(z, top_k, capacity):
    """Combine weights [..., S, E] (Mixtral's renormalised top-k softmax; dropped slots 0)."""
    top, kept = moe_top_mask(z, top_k, capacity)
    return moe_weights(z, top).masked_fill(~kept, 0.0)


def moe_route_grad(g, z, top_k, capacity):
    """VJP of moe_route: w (g' - sum(g' w)) on the top-k, g' = g on kept slots."""
    top, kept = moe_top_mask(z, top_k, capacity)
    w = moe_weights(z, top)
    gk = g.masked_fill(~kept, 0.0)
    return (w * (gk - torch.sum(gk * w, dim=-1, keepdim=True))).masked_fill(~top, 0.0)


def moe_slots(c, capacity):
    """(b, s, e, slot) of the routed (token, expert) pairs of weights c[B, S, E] that fit."""
    sel = c != 0
    pos = torch.cumsum(sel.to(torch.int64), dim=1) - 1
    b, s, e = torch.nonzero(sel & (pos < capacity), as_tuple=True)
    return b, s, e, pos[b, s, e]


def moe_dispatch(x, c, capacity, weighted):
    """[B, E, capacity, H]: each routed token's row in its expert's slot (times c if weighted)."""
    out = x.new_zeros((x.shape[0], c.shape[2], capacity, x.shape[2]))
    b, s, e, pos = moe_slots(c, capacity)
    rows = x[b, s] * c[b, s, e].unsqueeze(-1) if weighted else x[b, s]
    out[b, e, pos] = rows
    return out


def moe_combine(y, c, weighted):
    """[B, S, H]: each token's slots summed (times c if weighted)."""
    b, s, e, pos = moe_slots(c, y.shape[2])
    rows = y[b, e, pos] * c[b, s, e].unsqueeze(-1) if weighted else y[b, e, pos]
    return y.new_zeros((c.shape[0], c.shape[1], y.shape[3])).index_put_((b, s), rows, accumulate=True)


def moe_combine_grad_c(g, y, c):
    """[B, S, E]: g[b, s] . y[b, e, slot] on routed pairs, 0 elsewhere."""
    b, s, e, pos = moe_slots(c, y.shape[2])
    out = torch.zeros_like(c)
    out[b, s, e] = torch.sum(g[b, s] * y[b, e, pos], dim=-1)
    return out
# <<< program.py


# >>> program.py: moe_ragged
def all_to_all_ragged(x, src_dim, dim, axis):
    """S(src_dim) -> S(dim) like ``all_to_all``, sending only the nonzero rows (last dim) of
    each chunk: first a one-byte-per-row mask of them (the split sizes, ``all_to_all_single``),
    then the rows with ``input_split_sizes`` / ``output_split_sizes``; the receiver puts them
    back into zeros. Equal to the dense all_to_all (a zero row arrives as +0.0). The split sizes
    reach the host in one copy (one scalar read per peer, 2n + 1 device syncs, before)."""
    n = MESH[axis]
    send = torch.stack(x.chunk(n, dim)).contiguous()
    rows = send.reshape(n, -1, send.shape[-1])
    mask = rows.ne(0).any(-1)
    got = torch.empty_like(mask, dtype=torch.uint8)
    dist.all_to_all_single(got, mask.to(torch.uint8), group=GROUPS[axis])
    got = got.bool()
    packed = rows[mask]
    sizes = torch.stack([got.sum(1), mask.sum(1)]).cpu().tolist()  # [received, sent] per peer
    recv = rows.new_empty((sum(sizes[0]), rows.shape[-1]))
    dist.all_to_all_single(recv, packed, sizes[0], sizes[1], group=GROUPS[axis])
    out = torch.zeros_like(rows)
    out[got] = recv
    return torch.cat(out.reshape(send.shape).unbind(0), dim=src_dim)
# <<< program.py


# >>> program.py: moe_dropless
def moe_route_plan(c, axis=None):
    """The routed (token, expert) pairs of weights c[B, S, E], sorted by expert, then row,
    then token (the slot order): (b, s, e, counts per expert on the device, [peer][local
    expert] counts received over ``axis`` or None, the counts as ints). Every pair is kept (no
    capacity). The layer's one device sync: the counts reach the host in one copy (under
    ``axis``, the experts' ranks first exchange them by one ``all_to_all`` and both cross in
    that copy); the pairs are then the first ``sum(counts)`` nonzeros (``nonzero_static``,
    whose size is known), so under torch.compile (scalar outputs captured) the layer stays
    in one graph."""
    routed = c.permute(2, 0, 1) != 0  # [E, B, S]: expert-major, as the slots are ordered
    counts = routed.sum((1, 2))
    experts = counts.shape[0]
    if axis is None:
        sizes, mat = counts.tolist(), None
    else:
        n = MESH[axis]
        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=GROUPS[axis])
        both = torch.cat([counts, got]).tolist()
        sizes, local = both[:experts], experts // n
        mat = [both[experts + p * local:experts + (p + 1) * local] for p in range(n)]
    flat = torch.nonzero_static(routed.reshape(-1), size=sum(sizes)).reshape(-1)
    rows, tokens = c.shape[0], c.shape[1]
    e, b, s = flat // (rows * tokens), flat // tokens % rows, flat % tokens
    return b, s, e, counts, mat, sizes


def moe_pack(x, c, plan, weighted):
    """The routed tokens of x[B, S, H], one row per pair in the plan's order (times c if
    weighted): the dispatch buffer without its empty slots."""
    b, s, e = plan[:3]
    rows = x[b, s]
    return rows * c[b, s, e].unsqueeze(-1) if weighted else rows


def moe_unpack(y, c, plan, weighted):
    """[B, S, H]: each token's rows of y summed (times c if weighted): moe_combine of the packed rows."""
    b, s, e = plan[:3]
    rows = y * c[b, s, e].unsqueeze(-1) if weighted else y
    return y.new_zeros((c.shape[0], c.shape[1]) + tuple(y.shape[1:])).index_put_((b, s), rows, accumulate=True)


def moe_pack_grad_c(g, y, c, plan):
    """[B, S, E]: g[b, s] . y[row] on the routed pairs, 0 elsewhere (moe_combine_grad_c, packed)."""
    b, s, e = plan[:3]
    out = torch.zeros_like(c)
    out[b, s, e] = torch.sum(g[b, s] * y, dim=-1)
    return out


def moe_grouped_mm(x, w, plan):
    """Rows x[N, K] sorted by expert times w[E, K, F]: each expert's rows by its own weight,
    exactly its count of rows (no empty slot is multiplied)."""
    parts = x.split(plan[-1])
    return torch.cat([part @ w[i] for i, part in enumerate(parts)]) if parts else x.new_zeros((0, w.shape[2]))


def moe_grouped_wgrad(x, g, plan):
    """[E, K, F]: x_e^T @ g_e per expert over its rows (the weight gradient of moe_grouped_mm)."""
    counts = plan[-1]
    return torch.stack([a.t() @ b for a, b in zip(x.split(counts), g.split(counts))])


def moe_expert_plan(plan, axis):
    """The experts-side plan of a rows-side plan over ``axis``: how many rows each peer sends
    each of this rank's experts (exchanged by the rows-side plan's ``moe_route_plan(c, axis)``,
    else here by one all_to_all of the per-expert counts and one host copy);
    (counts per local expert, [peer][local expert] counts, rows per peer)."""
    mat = plan[4]
    if mat is None:
        n = MESH[axis]
        send = plan[3].reshape(n, -1).contiguous()
        got = torch.empty_like(send)
        dist.all_to_all_single(got, send, group=GROUPS[axis])
        mat = got.tolist()
    return mat, [sum(row) for row in mat], [sum(col) for col in zip(*mat)]


def moe_to_experts(x, rows_plan, plan, axis):
    """Packed rows (sorted by expert) to the ranks of their experts: peer j gets the rows of
    its experts; received rows sorted by local expert, then peer (= row), then token."""
    n, (mat, from_peer, counts) = MESH[axis], plan
    local = len(counts)
    send_sizes = [sum(rows_plan[-1][j * local:(j + 1) * local]) for j in range(n)]
    recv = x.new_empty((sum(from_peer),) + tuple(x.shape[1:]))
    dist.all_to_all_single(recv, x.contiguous(), from_peer, send_sizes, group=GROUPS[axis])
    blocks = recv.split([k for row in mat for k in row])  # peer-major
    return torch.cat([blocks[p * local + e] for e in range(local) for p in range(n)])


def moe_to_rows(x, plan, rows_plan, axis):
    """The inverse of moe_to_experts: each peer's rows back to it, in its expert order."""
    n, (mat, from_peer, counts) = MESH[axis], plan
    local = len(counts)
    blocks = x.split([mat[p][e] for e in range(local) for p in range(n)])  # expert-major
    send = torch.cat([blocks[e * n + p] for p in range(n) for e in range(local)])
    recv_sizes = [sum(rows_plan[-1][j * local:(j + 1) * local]) for j in range(n)]
    recv = x.new_empty((sum(recv_sizes),) + tuple(x.shape[1:]))
    dist.all_to_all_single(recv, send, recv_sizes, from_peer, group=GROUPS[axis])
    return recv
# <<< program.py
