"""Runtime helpers of the reductions part, pasted into a ``program.py`` only when it
uses them (see :mod:`parcomp_backends.torch.emit.reduce`). Semantics: ``parcomp/reference/reduce_ops.py`` and the
interpreter's ``all_reduce{reduce_op="max"}``.

``start``: the global index of this rank's first element along the indexed dim (the emitter
writes it from ``COORD``).
"""
# flake8: noqa: E402
import torch
import torch.distributed as dist

GROUPS = {}  # stand-in: program_common's process groups


# >>> program.py: reductions
def all_reduce_max(x, axis):
    """P(max) -> R: the elementwise max over the group of ``axis`` (``x`` is left unchanged)."""
    y = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(y, op=dist.ReduceOp.MAX, group=GROUPS[axis])
    return y


def all_reduce_max_(x, axis):
    """P(max) -> R in place, for a fresh contiguous value nothing else reads."""
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=GROUPS[axis])
    return x


def all_reduce_max_start(x, axis):
    """Start all_reduce_max(x, axis); ``wait(handle)`` returns the max."""
    return all_reduce_max_start_(x.clone(memory_format=torch.contiguous_format), axis)


def all_reduce_max_start_(x, axis):
    """Start an in-place all_reduce_max of a fresh contiguous value (functional under
    torch.compile, as :func:`all_reduce_start_`)."""
    if torch.compiler.is_compiling():
        return dist._functional_collectives.all_reduce(x, "max", GROUPS[axis])
    return x, dist.all_reduce(x, op=dist.ReduceOp.MAX, group=GROUPS[axis], async_op=True)


ARGMAX_LOW = (1 << 32) - 1


def argmax_key(x, dim, start):
    """Max over ``dim`` of (order-preserving int of x) << 32 + (LOW - global index): the max
    value and its first global index in one int64 that a max all_reduce combines."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
    key = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF) * (1 << 32)
    shape = [-1 if d == dim % x.dim() else 1 for d in range(x.dim())]
    idx = torch.arange(x.shape[dim], device=x.device, dtype=torch.int64).reshape(shape) + start
    return torch.amax(key + (ARGMAX_LOW - idx), dim=dim)


def argmax_index(key):
    """The global index an argmax key holds."""
    return ARGMAX_LOW - (key & ARGMAX_LOW)


def amax_grad(g, x, y, dims):
    """torch's amax backward: g split evenly over the elements equal to the max."""
    for d in sorted(dims):
        g, y = g.unsqueeze(d), y.unsqueeze(d)
    hit = (x == y).to(x.dtype)
    return g * hit / hit.sum(dim=dims, keepdim=True)


def _pick_cols(labels, start, classes, ignore_index):
    local = labels - start
    mine = (local >= 0) & (local < classes) & (labels != ignore_index)
    return torch.where(mine, local, torch.zeros_like(local)), mine


def pick(z, labels, start, ignore_index):
    """z[..., label] on the rank holding column ``label`` (not ignored), else 0."""
    cols, mine = _pick_cols(labels, start, z.shape[-1], ignore_index)
    got = torch.gather(z, -1, cols.unsqueeze(-1)).squeeze(-1)
    return torch.where(mine, got, torch.zeros_like(got))


def pick_grad(g, labels, shape, start, ignore_index):
    """``g`` scattered to column ``label`` of a zero tensor of ``shape`` (pick's transpose)."""
    cols, mine = _pick_cols(labels, start, shape[-1], ignore_index)
    src = torch.where(mine, g, torch.zeros_like(g)).unsqueeze(-1)
    return torch.zeros(shape, dtype=g.dtype, device=g.device).scatter_(-1, cols.unsqueeze(-1), src)


def mask_pad(x, size, start, fill):
    """Last-dim entries at global index >= ``size`` (vocab padding) set to ``fill``
    ("lowest": the dtype's most negative finite number, or "0")."""
    idx = torch.arange(x.shape[-1], device=x.device) + start
    return x.masked_fill(idx >= size, torch.finfo(x.dtype).min if fill == "lowest" else 0.0)


def put_along(g, idx, dim, size):
    """g added into zeros whose ``dim`` has ``size`` entries, at ``idx`` along it (the
    transpose of torch.gather: torch.scatter_add)."""
    shape = list(g.shape)
    shape[dim] = size
    return g.new_zeros(shape).scatter_add(dim, idx, g)
# <<< program.py
