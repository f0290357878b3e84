"""Runtime helpers of the norms + embedding part for the emitted ``program.py``.

Pasted (the ``norms`` section) only into programs that use ``layer_norm_grad`` (``norm_grad``,
or ``layer_norm_grads`` for a layer norm's gradients in one statement),
``rms_norm_grad`` (``rms_norm_grads`` for dx and dweight in one), ``dropout``, ``embedding`` or ``embedding_grad``
(:func:`parcomp_backends.torch.emit.norms.runtime_sections`). The formulas are those of
``parcomp/reference/norm_ops.py``; the dropout hash is the same int64 arithmetic (no
product reaches 2**63), so the masks equal numpy's bit for bit. ``start`` arguments say
where this rank's block lies in the global tensor (the emitter writes them from COORD).
"""
import torch

# >>> program.py: norms
M32 = 0xFFFFFFFF


def mul32(x, c):
    """(x * c) mod 2**32 for 0 <= x < 2**32 (a tensor or an int), no int64 overflow."""
    return (((x & 0xFFFF) * c) + ((((x >> 16) * c) & 0xFFFF) << 16)) & M32


def mix32(x):
    """A 32-bit integer finaliser (lowbias32), the same as parcomp's numpy dropout."""
    x = x ^ (x >> 16)
    x = mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def dropout_keep(shape, p, seed, global_shape, start, device=None, step=None):
    """Keep mask of dropout: a hash of the seed, the training step (a 0-d tensor; None: no
    step) and each element's global flat index."""
    idx, stride = torch.zeros(tuple(shape), dtype=torch.int64, device=device), 1
    for d in reversed(range(len(shape))):
        r = (torch.arange(shape[d], dtype=torch.int64, device=device) + start[d]) * stride
        idx = idx + r.reshape((-1,) + (1,) * (len(shape) - d - 1))
        stride *= global_shape[d]
    h = mix32(seed & M32)
    if step is not None:
        h = mix32(h ^ (step.to(torch.int64) & M32))
    h = mix32(h ^ (idx >> 32))
    return mix32(h ^ (idx & M32)) >= int(round(float(p) * 2.0 ** 32))


def dropout_by_index(x, p, seed, global_shape, start, step=None):
    """x * mask / (1 - p), the mask fixed by the step and the global element index (any sharding)."""
    keep = dropout_keep(x.shape, p, seed, global_shape, start, x.device, step)
    return x * (keep.to(x.dtype) * (0.0 if p >= 1 else 1.0 / (1.0 - p)))


def norm_grad(dy, x, w, eps, rms):
    """dx of layer_norm (rms=False) / rms_norm over the last dim.

    layer_norm: torch's fused backward kernel (the one autograd runs), its mean and rstd
    recomputed by one native_layer_norm of x: two kernels instead of a dozen elementwise
    passes over the tokens."""
    if not rms:
        shape = (x.shape[-1],)
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, None, None, eps)
        return torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, w, None,
                                                         [True, False, False])[0]
    rstd = 1 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    xhat = x * rstd
    g = dy if w is None else dy * w
    return rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True))


def layer_norm_forward(x, w, b, eps):
    """layer_norm(x, w, b) over the last dim, and the (mean, rstd) its kernel computed, kept
    for the backward's layer_norm_grads."""
    y, mean, rstd = torch.ops.aten.native_layer_norm(x, (x.shape[-1],), w, b, eps)
    return y, (mean, rstd)


def layer_norm_grads(dy, x, w, eps, mask, saved=None):
    """The gradients of layer_norm(x, w, b) over the last dim that ``mask`` (dx, dweight, dbias)
    asks for, in that order (one alone: that tensor): one fused backward kernel with an output mask (the one autograd
    runs), on the forward's ``saved`` (mean, rstd) (None: one native_layer_norm computes them).
    dweight and dbias sum over this rank's tokens. The kernel reads the bias only for its shape
    and dtype, those of ``w``, and the weight for dx only: ``w`` None (no dx asked) stands for
    zeros of that shape, in x's dtype."""
    shape = (x.shape[-1],)
    if w is None:
        w = x.new_zeros(shape)
    if saved is None:
        _, mean, rstd = torch.ops.aten.native_layer_norm(x, shape, None, None, eps)
    else:
        mean, rstd = saved
    grads = torch.ops.aten.native_layer_norm_backward(dy, x, shape, mean, rstd, w, w, list(mask))
    got = tuple(g for g, wanted in zip(grads, mask) if wanted)
    return got[0] if len(got) == 1 else got


def rms_norm_grads(dy, x, w, eps, mask):
    """The gradients of rms_norm(x, w) over the last dim that ``mask`` (dx, dweight) asks for,
    in that order, on one rstd and one normalised x (``norm_grad``'s formula for dx; dweight
    sums dy * x * rstd over this rank's tokens) instead of dx alone plus an rms_norm of x and a
    mul for dweight. torch 2.13 has no fused rms_norm backward on CPU
    (``aten._fused_rms_norm_backward`` is a CUDA kernel; autograd runs the decomposition)."""
    rstd = 1 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    xhat = x * rstd
    out = []
    if mask[0]:
        g = dy * w
        out.append(rstd * (g - xhat * (g * xhat).mean(-1, keepdim=True)))
    if mask[1]:
        out.append((dy * xhat).sum(tuple(range(x.dim() - 1))))
    return tuple(out)


def embedding_rows(ids, table, start):
    """Rows of ids in this rank's table rows start.. (vocab-parallel); others are zero."""
    local = ids - start
    ok = (local >= 0) & (local < table.shape[0])
    out = torch.nn.functional.embedding(torch.where(ok, local, 0), table)
    return torch.where(ok.unsqueeze(-1), out, torch.zeros((), dtype=out.dtype, device=out.device))


def embedding_grad_rows(dy, ids, rows, start, padding_idx=None):
    """Scatter-add of dy into this rank's ``rows`` table rows from ``start`` (others skipped;
    so are the ids equal to the global ``padding_idx``: torch's padding row gets no gradient)."""
    local = (ids - start).reshape(-1)
    ok = (local >= 0) & (local < rows)
    if padding_idx is not None:
        ok = ok & (ids.reshape(-1) != padding_idx)
    # the skipped ids add into one spare row past the table (no boolean indexing: its
    # data-dependent shape would split a torch.compile graph), which the result leaves out
    out = torch.zeros((rows + 1, dy.shape[-1]), dtype=dy.dtype, device=dy.device)
    return out.index_add_(0, torch.where(ok, local, rows), dy.reshape(-1, dy.shape[-1]))[:rows]
# <<< program.py
