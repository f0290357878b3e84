"""Runtime helper of attention's backward, pasted into a ``program.py`` whose training step
differentiates a (non-ring) ``sdpa`` (see :mod:`parcomp_backends.torch.emit.attention`).

The IR has one ``sdpa_grad`` node per operand (q, k, v); the emitter gathers the nodes of one
attention and prints one call of :func:`attention_grads` that gives all of them from one
forward and one backward of ``scaled_dot_product_attention`` (its fused kernel's own backward:
flash / memory-efficient on a GPU), instead of one ``torch.func.vjp`` per operand, each of which
redid the forward and the whole backward.
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
# <<< program.py
