"""Where a torch.export frontend error points, and what to do about an aten op it has no
lowering for.

An error about an fx node (:func:`unsupported`, ``_Builder.fail``) names the node's module
(:func:`where_of`) and is located at the user's source line it was traced from
(:func:`user_frame`). The hint of the "unsupported op" error (:func:`unsupported_hint`) is, in order: a rewrite
from :data:`REWRITES` with supported ops (curated; each rewrite was traced through the
frontend, ``tests/frontends/test_hand_written_gpt.py``), another overload of the same op that is
supported (``aten.pow.Scalar`` -> ``aten.pow.Tensor_Scalar``), a supported op whose name is
close (difflib ratio >= :data:`NAME_CUTOFF`, said to be by name only), else nothing: a
suggestion that is only a few shared letters (``roll`` -> ``relu``) misleads more than none.
"""
from __future__ import annotations

import difflib
import linecache
import re
import traceback

import torch

from parcomp.errors import FrontendError, SourceLoc

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in \S+\n[ \t]*([^\n]*)')
_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"

_SDPA = "F.scaled_dot_product_attention(q, k, v, is_causal=True)"
_MASK = (f"for a causal mask on attention scores, {_SDPA} instead of masking the scores (or "
         f"attn_mask= a bool mask from constants: torch.ones(s, s, dtype=torch.bool).tril())")
_ROPE = ("rotary embeddings in real arithmetic: q * cos + rotate_half(q) * sin with cos/sin "
         "tables (buffers, folded at import), rotate_half(x) = torch.cat((-x2, x1), -1) of x.chunk(2, -1)")
#: what the error about a complex dtype suggests (complex rotary embeddings, Meta's Llama)
COMPLEX = ("parcomp computes in real dtypes (complex values only as a rotary embedding's "
           "view_as_complex, mul, view_as_real and views); write " + _ROPE)

#: aten op name (no overload) -> how to write it with ops the frontend lowers
REWRITES = {
    "masked_fill": _MASK,
    "where": _MASK,
    "tril": f"for a causal mask on attention scores, {_SDPA}; a mask from constants alone "
            f"(torch.ones(s, s).tril()) is folded at import",
    "triu": f"for a causal mask on attention scores, {_SDPA}; a mask from constants alone "
            f"(torch.ones(s, s).triu(1)) is folded at import",
    "repeat_interleave": "for the kv heads of grouped-query attention, "
                         "k[:, :, None].expand(b, kv_heads, rep, s, d).reshape(b, kv_heads * rep, s, d), "
                         "or F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)",
    "roll": "torch.cat((x[:, -k:], x[:, :-k]), dim=1) instead of torch.roll(x, k, dims=1) "
            "(cat of two slices)",
    "cumsum": "x @ torch.ones(n, n).triu() (the triangle is a constant, folded at import) "
              "for torch.cumsum(x, -1)",
    "index_select": "F.embedding(idx, w) for torch.index_select(w, 0, idx) (rows of a table)",
    "max": "x.amax(dim) for torch.max(x, dim).values (x.argmax(dim) for the indices)",
    "min": "-(-x).amax(dim) for torch.min(x, dim).values",
    "amin": "-(-x).amax(dim) for x.amin(dim)",
    "var": "((x - x.mean(d, keepdim=True)) ** 2).mean(d) * n / (n - 1) for x.var(d) "
           "(without * n / (n - 1) for correction=0)",
    "std": "(((x - x.mean(d, keepdim=True)) ** 2).mean(d) * n / (n - 1)).sqrt() for x.std(d)",
    "logsumexp": "m.squeeze(d) + torch.log(torch.exp(x - m).sum(d)), m = x.amax(d, keepdim=True), "
                 "for torch.logsumexp(x, d)",
    "outer": "a[:, None] * b[None, :] for torch.outer(a, b)",
    "einsum": "matmul (@) with transpose/permute/reshape instead of torch.einsum",
    "expm1": "torch.exp(x) - 1 for torch.expm1(x)",
    "exp2": "torch.exp(x * math.log(2)) for torch.exp2(x)",
    "log1p": "torch.log(1 + x) for torch.log1p(x)",
}

#: a supported op whose name is at least this close (difflib ratio) is named "by name only":
#: relu6 -> relu (0.89) passes, sign -> sin (0.86) and roll -> relu (0.5) do not
NAME_CUTOFF = 0.875


def base(op) -> str:
    """``aten.sum.dim_IntList`` -> ``sum``: an overload's op name."""
    parts = str(op).split(".")
    return parts[1] if len(parts) >= 3 else str(op)


def unsupported_hint(op, supported: list) -> str:
    """``"; <what to do>"`` for aten op ``op`` (an overload or its name) that has no
    lowering, given the ``supported`` op names (``aten.linear.default``...), or ``""``
    when no supported op is related (see the module docstring for the order)."""
    name = base(op)
    if name in REWRITES:
        return f"; rewrite it with supported ops: {REWRITES[name]}"
    same = [o for o in supported if base(o) == name]
    if same:
        return f"; supported overloads of {name}: {', '.join(same)}"
    near = difflib.get_close_matches(name, sorted({base(o) for o in supported}), n=1,
                                     cutoff=NAME_CUTOFF)
    if near:
        return (f"; nearest supported op by name only: "
                f"{', '.join(o for o in supported if base(o) == near[0])}")
    return "; no supported op is close to it"


def module_path(fx) -> str | None:
    """The path of the innermost user module an fx node was traced in (``mlp.c_fc``), or None."""
    stack = fx.meta.get("nn_module_stack") or {}
    path = list(stack.values())[-1][0] if stack else ""
    return path or None


def where_of(fx) -> str:
    """``" in module 'a.b' (Cls)"`` (or ``" in the top-level module (Cls)"``) for an fx
    node, from its ``nn_module_stack``; ``""`` without one."""
    stack = fx.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path, cls = list(stack.values())[-1]
    cls = getattr(cls, "__qualname__", cls)
    return f" in module {path!r} ({cls})" if path else f" in the top-level module ({cls})"


def user_frame(fx) -> SourceLoc | None:
    """The user's source line an fx node was traced from (the last frame outside torch)."""
    frames = _FRAME.findall(fx.meta.get("stack_trace") or "")
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR)] or frames
    if not user:
        return None
    file, line, text = user[-1]
    full = linecache.getline(file, int(line)).rstrip("\n")  # the frame's text is stripped
    if text.strip() and text.strip() in full:
        return SourceLoc(file, int(line), full.index(text.strip()) + 1, full)
    return SourceLoc(file, int(line), 1, text)


_PARCOMP_DIR = __file__.rsplit("/", 2)[0] + "/"


def raising_frame(exc: BaseException) -> SourceLoc | None:
    """The user's source line a torch.export failure ``exc`` was raised from: the innermost
    frame of its traceback outside torch and parcomp (the model's ``forward`` or a module it
    calls), at the column of the expression Python names; None when the model's own code
    never ran (a bad argument to export itself)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not f.filename.startswith((_TORCH_DIR, _PARCOMP_DIR, "<"))]
    if not frames:
        return None
    f = frames[-1]
    full = linecache.getline(f.filename, f.lineno).rstrip("\n")
    if not full:
        return SourceLoc(f.filename, f.lineno, 1, f.line or "")
    col = (f.colno + 1) if getattr(f, "colno", None) is not None else len(full) - len(full.lstrip()) + 1
    return SourceLoc(f.filename, f.lineno, col, full)


#: what the error about a data-dependent branch (``if`` on a tensor's value) says to do
DATA_DEPENDENT = ("forward's Python control flow depends on a tensor's value (an if, while, "
                  "bool(), int(), float() or .item() on a tensor computed from the inputs or weights), "
                  "and an exported program is one program for every input: compute both branches and "
                  "pick elementwise with torch.where(cond, a, b), or make the condition a Python value "
                  "(a config flag, a shape)")


def is_data_dependent(exc: BaseException) -> bool:
    """Whether torch.export failed on a guard on a tensor's value (a data-dependent branch)."""
    return (any(c.__name__ == "GuardOnDataDependentSymNode" for c in type(exc).__mro__)
            or "data-dependent expression" in str(exc))


def unsupported(fx, supported: list) -> FrontendError:
    """The error for an aten op with no lowering (``supported``: the op names that have
    one): the op, the fx node, the module path, a related supported op or rewrite if
    there is one (:func:`unsupported_hint`) and, as its location, the user's source line."""
    return FrontendError(f"unsupported op {fx.target} (fx node %{fx.name}){where_of(fx)}: parcomp has "
                         f"no lowering for it{unsupported_hint(fx.target, supported)} ({len(supported)} "
                         f"supported: parcomp.frontends.torch.export.supported_ops(); README.md, "
                         f"\"What works\")", user_frame(fx), where=module_path(fx) or str(fx.target))
