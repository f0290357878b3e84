"""Runtime helpers of attention's backward, pasted into a ``program.py`` whose training step
differentiates a (non-ring) ``sdpa`` (see :mod:`parcomp_backends.torch.emit.attention`).

The IR has one ``sdpa_grad`` node per operand (q, k, v); the emitter gathers the nodes of one
attention and prints one statement that gives all of them.

When the step also computes the attention's forward (the usual training step), the forward
is :func:`attention_forward`: the fused kernel torch's ``scaled_dot_product_attention`` would
run, called directly, keeping what the kernel's backward needs (the output, the logsumexp of
each query row, the kernel's random-state tensors); the backward is :func:`attention_backward`,
that kernel's own backward on the saved tensors, so the forward is not computed again:

- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype, float64 too;
  a mask as sdpa passes it: a boolean mask becomes 0 / -inf in the query's dtype);
- CUDA: ``aten._scaled_dot_product_flash_attention`` or
  ``aten._scaled_dot_product_efficient_attention``, whichever torch's own dispatch
  (``torch._fused_sdp_choice``) picks for the operands.

Everything else falls back to :func:`attention_grads`, one ``torch.func.vjp`` over sdpa (one
more forward and one backward): other devices (an NPU: torch_npu's own dispatch, whose fused
kernel's saved tensors program.py does not know), dispatches to the math path (a dtype or shape
no fused kernel takes), the cuDNN kernel, an explicit mask on CUDA (the efficient kernel wants
sdpa's padded bias, whose alignment rule is torch's internal), and the CUDA dispatch under
``torch.compile`` (``torch._fused_sdp_choice`` is no traceable op; the CPU choice needs no
dispatch query and is traced). The IR's ``sdpa`` has no dropout, so no kernel replays a
random state here.
"""
import torch


# >>> program.py: attention_grads
def attention_grads(dy, q, k, v, parts, **sdpa_args):
    """The gradients ``parts`` (a string of ``q``, ``k``, ``v``, in that order) of
    ``scaled_dot_product_attention(q, k, v, **sdpa_args)`` for the output gradient ``dy``: one
    forward, one backward (one ``torch.func.vjp`` over sdpa, with respect to the operands in
    ``parts`` only; torch.compile captures it whole, which ``torch.autograd.grad`` would break)."""
    given = {"q": q, "k": k, "v": v}

    def attend(*wrt):
        ops = {**given, **dict(zip(parts, wrt))}
        return torch.nn.functional.scaled_dot_product_attention(ops["q"], ops["k"], ops["v"], **sdpa_args)

    grads = torch.func.vjp(attend, *(given[c] for c in parts))[1](dy)
    return grads if len(parts) > 1 else grads[0]


_FUSED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def attention_kernel(q, k, v, attn_mask, is_causal, scale):
    """The fused kernel whose backward :func:`attention_backward` calls on saved tensors, as
    torch's sdpa would pick it for these operands: ``"flash_cpu"``, ``"flash"``,
    ``"efficient"``, or None (the vjp fallback; the module docstring says when)."""
    device = q.device.type
    if device == "cpu":
        if torch.compiler.is_compiling():  # the CPU flash kernel's own conditions, as torch checks them
            fits = q.dim() == 4 and q.dtype in _FUSED and q.dtype == k.dtype == v.dtype and \
                q.shape[-1] == k.shape[-1] == v.shape[-1] and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            return "flash_cpu" if fits else None
        choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=scale)
        return "flash_cpu" if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION) else None
    if device != "cuda" or torch.compiler.is_compiling():
        return None
    choice = torch._fused_sdp_choice(q, k, v, attn_mask, 0.0, is_causal, scale=scale)
    if choice == int(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        return "flash"  # flash takes no mask: torch picks it only without one
    if choice == int(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION) and attn_mask is None:
        return "efficient"
    return None


def _float_mask(attn_mask, dtype):
    """sdpa's boolean mask as the fused kernels take it: 0 where kept, -inf elsewhere."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(
        attn_mask.logical_not(), float("-inf"))


def attention_forward(q, k, v, attn_mask=None, is_causal=False, scale=None):
    """``scaled_dot_product_attention(q, k, v, ...)`` and what its kernel's backward needs:
    ``(out, saved)``, ``saved`` a tuple (the kernel's name, the output, the logsumexp, the
    kernel's other saved tensors) that :func:`attention_backward` reads, or None (no fused
    kernel: the backward recomputes through ``torch.func.vjp``). ``saved`` holds the output,
    so a ``del`` of the output's name keeps its buffer until the saved tuple goes."""
    kernel = attention_kernel(q, k, v, attn_mask, is_causal, scale)
    aten = torch.ops.aten
    if kernel == "flash_cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=_float_mask(attn_mask, q.dtype), scale=scale)
        return out, (kernel, out, lse)
    if kernel == "flash":
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q, k, v, 0.0, is_causal, False, scale=scale)
        return out, (kernel, out, lse, cum_q, cum_k, max_q, max_k, seed, offset)
    if kernel == "efficient":
        out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(
            q, k, v, None, True, 0.0, is_causal, scale=scale)
        return out, (kernel, out, lse, seed, offset)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                                           scale=scale)
    return out, None


def attention_backward(dy, q, k, v, saved, parts, attn_mask=None, is_causal=False, scale=None):
    """The gradients ``parts`` (as :func:`attention_grads`) of the attention whose
    :func:`attention_forward` gave ``saved``: its kernel's backward on the saved output and
    logsumexp, no forward again (``saved`` None: :func:`attention_grads`)."""
    if saved is None:
        return attention_grads(dy, q, k, v, parts, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    kernel, out, lse, *rest = saved
    aten = torch.ops.aten
    if kernel == "flash_cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dy, q, k, v, out, lse, 0.0, is_causal, attn_mask=_float_mask(attn_mask, q.dtype), scale=scale)
    elif kernel == "flash":
        cum_q, cum_k, max_q, max_k, seed, offset = rest
        grads = aten._scaled_dot_product_flash_attention_backward(
            dy, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, is_causal, seed, offset, scale=scale)
    else:  # efficient
        seed, offset = rest
        grads = aten._scaled_dot_product_efficient_attention_backward(
            dy, q, k, v, None, out, lse, seed, offset, 0.0, [c in parts for c in "qkv"] + [False], is_causal,
            scale=scale)[:3]
    got = tuple(grads["qkv".index(c)] for c in parts)
    return got if len(parts) > 1 else got[0]
# <<< program.py
