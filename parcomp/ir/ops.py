"""The op vocabulary: arity, shape inference and algebraic class of every op.

The algebraic ``kind`` is what the sharding rules and the verifier rely on:

- ``nonlinear``: never accepts a ``Partial`` input (a layout rule the verifier checks: ``parcomp/passes/verify.py``).
- ``linear``: f(sum x_k) = sum f(x_k); passes ``Partial`` through.
- ``additive``: add/sub, linear in all operands jointly (a ``Replicate``
  addend must be counted once, so every operand must be ``Partial`` together).
- ``bilinear``: mul/matmul, linear in each operand separately (exactly one
  operand may be ``Partial``).
- ``linear0``: div, linear in the first operand only.
- ``source``: input/param; ``collective`` and ``local`` are layout changes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .transitions import TRANSITIONS
from .types import TensorType


@dataclass(frozen=True)
class Attr:
    """One attribute an op takes: value ``type`` (a key of :data:`ATTR_TYPES`), whether
    it must be given, the value meant when it is not, and the allowed values (if limited)."""

    type: str
    required: bool = False
    default: object = None
    choices: tuple = ()


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# attribute value type -> (test, what a message says the value must be)
ATTR_TYPES = {
    "number": (lambda v: _is_int(v) or isinstance(v, float), "a number"),
    "int": (_is_int, "a whole number"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "str": (lambda v: isinstance(v, str), 'a string such as "tanh"'),
    "ints": (lambda v: isinstance(v, tuple) and all(_is_int(x) for x in v),
             "a tuple of whole numbers such as (1, 0)"),
}


@dataclass(frozen=True)
class OpDef:
    """Static semantics of one op (Thunder's *meta* function) and its attribute schema."""

    name: str
    arity: int  # -1: any
    kind: str
    infer: Callable  # (in_types, node) -> TensorType
    attrs: dict = field(default_factory=dict)  # attribute name -> Attr


def attr_problem(op: str, attrs) -> str | None:
    """What is wrong with the ``(key, value)`` pairs ``attrs`` of an ``op`` node, or None.

    Checks the op's schema: every required attribute is there, every declared one
    has its type and one of its choices.  Attributes the schema does not declare
    are let through (passes may annotate nodes).
    """
    given = dict(attrs)
    for key, a in OPS[op].attrs.items():
        if key not in given:
            if a.required:
                return f"{op} needs the attribute {key}"
            continue
        v = given[key]
        test, what = ATTR_TYPES[a.type]
        if not test(v):
            return f"attribute {key} of {op} must be {what}, not {v!r}"
        if a.choices and v not in a.choices:
            return f"{op} {key}={v!r}: choose one of {', '.join(map(str, a.choices))}"
    return None


def same_type(ts, n):
    return ts[0]


def _broadcast(ts, n):
    try:
        shape = np.broadcast_shapes(*[t.shape for t in ts])
    except ValueError as e:
        raise ValueError(f"shapes {[t.shape for t in ts]} do not broadcast") from e
    return TensorType(tuple(int(s) for s in shape), ts[0].dtype)


def _matmul(ts, n):
    a, b = ts
    if a.rank < 1 or b.rank < 2:
        raise ValueError(f"matmul needs a rank>=1 lhs and rank>=2 rhs, got {a} and {b}")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul contracts {a.shape[-1]} with {b.shape[-2]}")
    if b.rank > 2 and a.shape[:-2] != b.shape[:-2]:
        raise ValueError(f"batched matmul needs equal batch dims, got {a} and {b}")
    return TensorType(a.shape[:-1] + (b.shape[-1],), a.dtype)


def _permute(ts, n):
    perm = n.attr("perm")
    if sorted(perm) != list(range(ts[0].rank)):
        raise ValueError(f"perm {perm} is not a permutation of {ts[0].rank} dims")
    return TensorType(tuple(ts[0].shape[p] for p in perm), ts[0].dtype)


def _reshape(ts, n):
    # the target shape is the node's own type; check the element count
    if ts[0].numel != n.type.numel:
        raise ValueError(f"reshape of {ts[0]} to {n.type} changes the element count")
    return n.type


def _own(ts, n):
    return n.type


def _sum(ts, n):
    dims = [d % max(ts[0].rank, 1) for d in n.attr("dims")]  # negative: from the end
    return TensorType(tuple(s for d, s in enumerate(ts[0].shape) if d not in dims), ts[0].dtype)


def _expand(ts, n):
    dims = n.attr("dims")
    kept = tuple(s for d, s in enumerate(n.type.shape) if d not in dims)
    if kept != ts[0].shape:
        raise ValueError(f"expand along {dims} of {ts[0]} cannot give {n.type}")
    return n.type


def _cross_entropy(ts, n):
    logits, labels = ts
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels {labels} must have the shape of logits {logits} less its last dim")
    return TensorType(labels.shape, logits.dtype)


def _cross_entropy_grad(ts, n):
    dl, logits, labels = ts
    if dl.shape != labels.shape or logits.shape[:-1] != labels.shape:
        raise ValueError(f"shapes {dl}, {logits}, {labels} do not fit")
    return logits


def _norm(ts, n):  # norms part: (x[, w[, b]]), w and b of shape [x.shape[-1]]
    x = ts[0]
    most = 3 if n.op == "layer_norm" else 2
    if x.rank < 1 or not 1 <= len(ts) <= most:
        raise ValueError(f"{n.op} takes a tensor of rank >= 1 and at most {most - 1} affine operands")
    for t in ts[1:]:
        if t.shape != x.shape[-1:]:
            raise ValueError(f"{n.op} weight/bias {t} must have shape [{x.shape[-1]}] (the last dim of {x})")
    return x


def _norm_grad(ts, n):  # (dy, x[, w]) -> dx
    if len(ts) not in (2, 3) or ts[0].shape != ts[1].shape:
        raise ValueError(f"{n.op} takes (dy, x[, w]) with dy shaped as x, got {ts}")
    if len(ts) == 3 and ts[2].shape != ts[1].shape[-1:]:
        raise ValueError(f"{n.op} weight {ts[2]} must have shape [{ts[1].shape[-1]}]")
    return ts[1]


def _embedding(ts, n):
    ids, table = ts
    if not ids.dtype.startswith("int") or table.rank != 2:
        raise ValueError(f"embedding takes integer ids and a 2-D table, got {ids} and {table}")
    return TensorType(ids.shape + table.shape[1:], table.dtype)


def _embedding_grad(ts, n):
    dy, ids = ts
    if n.type is None or n.type.rank != 2 or dy.shape != ids.shape + n.type.shape[1:]:
        raise ValueError(f"embedding_grad of {dy} at ids {ids} cannot give table {n.type}")
    return n.type
def _amax_grad(ts, n):  # reductions part: (g, x, y) -> dx shaped as x
    g, x, y = ts
    if g.shape != y.shape or _sum([x], n).shape != y.shape:
        raise ValueError(f"amax_grad of {x} needs g and y shaped as its amax, got {g}, {y}")
    return x


def _reduce_some(ts, n):  # amax, mean: torch reads dims=() as "every dim", so never empty
    if not n.attr("dims"):
        raise ValueError(f"{n.op} needs at least one dim in dims (write every dim for a full reduction)")
    return _sum(ts, n)


def _argmax(ts, n):
    x = ts[0]
    if not -x.rank <= n.attr("dim") < x.rank:
        raise ValueError(f"{n.op} over dim {n.attr('dim')} of {x}")
    return TensorType(tuple(s for d, s in enumerate(x.shape) if d != n.attr("dim") % x.rank), "int64")


def _topk(ts, n):  # topk, topk_index: x with its dim cut to k (values; int64 indices)
    x, k = ts[0], n.attr("k")
    if not -x.rank <= n.attr("dim") < x.rank:
        raise ValueError(f"{n.op} over dim {n.attr('dim')} of {x}")
    dim = n.attr("dim") % x.rank
    if not 1 <= k <= x.shape[dim]:
        raise ValueError(f"{n.op} k={k} of dim {dim} of {x} (size {x.shape[dim]})")
    shape = x.shape[:dim] + (k,) + x.shape[dim + 1:]
    return TensorType(shape, "int64" if n.op == "topk_index" else x.dtype)


def _along(ts, n):  # take_along(x, idx), put_along(g, idx): idx's shape but along dim
    x, idx = ts
    if not idx.dtype.startswith("int") or idx.rank != x.rank:
        raise ValueError(f"{n.op} takes integer indices of the rank of {x}, got {idx}")
    dim = n.attr("dim") % max(x.rank, 1)
    others = [d for d in range(x.rank) if d != dim]
    if any(x.shape[d] != idx.shape[d] for d in others):
        raise ValueError(f"{n.op}: {x} and indices {idx} differ outside dim {dim}")
    if n.op == "take_along":
        return TensorType(idx.shape, x.dtype)
    size = n.attr("size")
    return TensorType(x.shape[:dim] + (size,) + x.shape[dim + 1:], x.dtype)


def _pick(ts, n):
    z, labels = ts
    if z.shape[:-1] != labels.shape:
        raise ValueError(f"labels {labels} must have the shape of {z} less its last dim")
    return TensorType(labels.shape, z.dtype)


def _label_mask(ts, n):
    return TensorType(ts[0].shape, n.attr("dtype", "float32"))


OPS: dict = {}


def _def(name, arity, kind, infer, attrs=None):
    """Declare op ``name``: operand count (-1: any), algebraic kind, shape rule, and
    ``attrs`` (attribute name -> :class:`Attr`; None: the op takes none)."""
    OPS[name] = OpDef(name, arity, kind, infer, dict(attrs or {}))


_NUM = Attr("number", required=True)
_GELU = {"approximate": Attr("str", default="none", choices=("none", "tanh"))}
for _n in ("relu", "tanh", "exp", "sigmoid", "silu"):
    _def(_n, 1, "nonlinear", same_type)
_def("gelu", 1, "nonlinear", same_type, _GELU)
_def("pow", 1, "nonlinear", same_type, {"exponent": _NUM})
_def("add_scalar", 1, "nonlinear", same_type, {"value": _NUM})
_def("neg", 1, "linear", same_type)
_def("scale", 1, "linear", same_type, {"value": _NUM})
_def("add", 2, "additive", _broadcast)
_def("sub", 2, "additive", _broadcast)
_def("mul", 2, "bilinear", _broadcast)
_def("div", 2, "linear0", _broadcast)
_def("matmul", 2, "bilinear", _matmul)
_def("permute", 1, "linear", _permute, {"perm": Attr("ints", required=True)})
_def("reshape", 1, "linear", _reshape)
_def("sum", 1, "reduce", _sum, {"dims": Attr("ints", required=True)})  # no keepdims
_def("expand", 1, "expand", _expand, {"dims": Attr("ints", required=True)})  # inverse of sum
_def("ones", 0, "const", _own)
# gradients of pointwise ops: op(dy, x) is linear in dy only
for _n in ("relu_grad", "tanh_grad", "sigmoid_grad", "silu_grad"):
    _def(_n, 2, "linear0", _broadcast)
_def("gelu_grad", 2, "linear0", _broadcast, _GELU)
_def("pow_grad", 2, "linear0", _broadcast, {"exponent": _NUM})
# per-token loss logsumexp - picked logit (0 where label == ignore_index), with torch's label
# smoothing; the gradient dl * (softmax - target distribution). Reductions part:
# ``ignore_index``, ``label_smoothing``; the training loss uses the split-vocab decomposition
_CE = {"ignore_index": Attr("int", default=-100), "label_smoothing": Attr("number", default=0.0)}
_def("cross_entropy", 2, "cross_entropy", _cross_entropy, _CE)
_def("cross_entropy_grad", 3, "cross_entropy_grad", _cross_entropy_grad, _CE)
_def("adamw_param", 4, "nonlinear", _broadcast,  # (p, m, v, t) -> updated p (torch.optim.AdamW)
     {k: _NUM for k in ("lr", "beta1", "beta2", "eps", "weight_decay")})
# ---- attention part: views, RoPE pointwise ops, scaled-dot-product attention ----
# slice(x) {dim, start, stop, step}: x[start:stop:step] along dim (0 <= start <= stop <= size,
#   step >= 1; the frontend clamps torch's open ends); slice_grad(g) {same}: g put back into
#   zeros of the node's own (unsliced) shape, the VJP of slice.
# cat(x1, ..., xn) {dim}: concatenation along dim.
# sdpa(q, k, v) {causal, scale, window}: softmax(scale q k^T [+ causal mask]) v over [batch, heads,
#   seq, head_dim] operands (equal heads: the frontend repeats GQA kv heads explicitly);
#   window w > 0 (only with causal): a sliding-window band, key j kept for query i when
#   i - w < j <= i, in global positions (Mistral's sliding_window, Gemma-2's local layers);
#   sdpa_grad(dy, q, k, v) {wrt, causal, scale}: its gradient with respect to q, k or v.
# cos, sin: pointwise; cast(x): x converted to the node's own dtype; arange() {start, step}:
#   1-D start + step * i in the node's own dtype (positions for rotary embeddings).
_SLICE = {k: Attr("int", required=k != "step", default=1 if k == "step" else None)
          for k in ("dim", "start", "stop", "step")}


def _slice_len(n) -> int:
    return len(range(n.attr("start"), n.attr("stop"), n.attr("step", 1)))


def _check_slice(shape, n):
    d, lo, hi, st = n.attr("dim"), n.attr("start"), n.attr("stop"), n.attr("step", 1)
    if not 0 <= d < len(shape) or not 0 <= lo <= hi <= shape[d] or st < 1:
        raise ValueError(f"slice dim={d} start={lo} stop={hi} step={st} does not fit shape {shape}")


def _slice(ts, n):
    _check_slice(ts[0].shape, n)
    shape = list(ts[0].shape)
    shape[n.attr("dim")] = _slice_len(n)
    return TensorType(tuple(shape), ts[0].dtype)


def _slice_grad(ts, n):
    _check_slice(n.type.shape, n)
    if _slice([n.type], n).shape != ts[0].shape:
        raise ValueError(f"slice_grad of {ts[0]} cannot give {n.type}")
    return n.type


def _cat(ts, n):
    d = n.attr("dim")
    if not ts or any(t.rank != ts[0].rank or not 0 <= d < t.rank for t in ts):
        raise ValueError(f"cat along dim {d} needs operands of one rank, got {list(map(str, ts))}")
    rest = {t.shape[:d] + t.shape[d + 1:] for t in ts}
    if len(rest) != 1:
        raise ValueError(f"cat along dim {d}: other dims differ in {list(map(str, ts))}")
    shape = list(ts[0].shape)
    shape[d] = sum(t.shape[d] for t in ts)
    return TensorType(tuple(shape), ts[0].dtype)


def _sdpa(ts, n):
    q, k, v = ts[-3:]
    if n.attr("window", 0) and (n.attr("window") < 0 or not n.attr("causal", False)):
        raise ValueError(f"sdpa window={n.attr('window')} needs causal=true and a window >= 1")
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        raise ValueError(f"sdpa needs [batch, heads, seq, head_dim] operands, got {q}, {k}, {v}")
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(f"sdpa operands do not fit: q {q}, k {k}, v {v}")
    return TensorType(q.shape[:3] + v.shape[3:], q.dtype)


def _sdpa_grad(ts, n):
    out = _sdpa(ts, n)
    if ts[0].shape != out.shape:
        raise ValueError(f"sdpa_grad: dy {ts[0]} is not the shape of the output {out}")
    return ts[1 + "qkv".index(n.attr("wrt"))]


_SDPA = {"causal": Attr("bool", default=False), "scale": _NUM, "window": Attr("int", default=0)}
_def("slice", 1, "slice", _slice, _SLICE)
_def("slice_grad", 1, "slice", _slice_grad, _SLICE)
_def("cat", -1, "cat", _cat, {"dim": Attr("int", required=True)})
_def("sdpa", 3, "sdpa", _sdpa, _SDPA)
_def("sdpa_grad", 4, "sdpa_grad", _sdpa_grad, {**_SDPA, "wrt": Attr("str", required=True,
                                                                    choices=("q", "k", "v"))})
for _n in ("cos", "sin"):
    _def(_n, 1, "nonlinear", same_type)
_def("cast", 1, "nonlinear", _own)
_def("arange", 0, "const", _own, {"start": Attr("number", default=0), "step": Attr("number", default=1)})
# pad(x) {dim, before, after, value} (loss part): x with ``before`` and ``after``
#   elements of the constant ``value`` added at the ends of ``dim`` (torch's constant pad of one
#   dim; transformers' ForCausalLMLoss pads the labels with ignore_index before its shift)
_PAD = {k: Attr("int", required=True) for k in ("dim", "before", "after")}


def _pad(ts, n):
    x, d, lo, hi = ts[0], n.attr("dim"), n.attr("before"), n.attr("after")
    if not 0 <= d < x.rank or lo < 0 or hi < 0:
        raise ValueError(f"pad dim={d} before={lo} after={hi} does not fit {x} (dim in range, pads >= 0)")
    return TensorType(x.shape[:d] + (x.shape[d] + lo + hi,) + x.shape[d + 1:], x.dtype)


_def("pad", 1, "pad", _pad, {**_PAD, "value": _NUM})
# ---- end of the attention part ----
# ---- norms + embedding part: layer_norm, rms_norm, dropout, embedding ----
# Norms normalise over the LAST dim: (x[, weight[, bias]]) {eps}; their ``*_grad(dy, x[, w])``
# is dx (linear in dy). ``dropout(x[, step]) {p, seed}``: keep-mask from a hash of the seed, the
# training step (a 0-d float32 counter: autodiff adds it) and each element's GLOBAL flat index
# (parcomp/reference/norm_ops.py), so identical under any sharding and new at every step;
# ``index_start``/``index_shape`` are this rank's block (set per rank, never in a model).
# ``embedding(ids, table)`` -> ids.shape + [dim]; ``vocab_start``: first table row this rank
# holds (vocab-parallel; ids outside its rows give zero rows). ``embedding_grad(dy, ids)``:
# the table-shaped scatter-add of dy (its type is the table's). ``padding_idx`` (torch's
# nn.Embedding(padding_idx=...)): the GLOBAL table row whose ids add nothing to the gradient
# (the lookup itself is unchanged); absent: none. Under a vocab split only the rank holding
# that row has ids equal to it, so every sharding applies it where torch does.
_EPS = {"eps": Attr("number", required=True)}
_def("layer_norm", -1, "nonlinear", _norm, _EPS)
_def("rms_norm", -1, "nonlinear", _norm, _EPS)
_def("layer_norm_grad", -1, "linear0", _norm_grad, _EPS)
_def("rms_norm_grad", -1, "linear0", _norm_grad, _EPS)
_def("dropout", -1, "linear", same_type, {"p": _NUM, "seed": Attr("int", required=True),
                                     "index_start": Attr("ints"), "index_shape": Attr("ints")})
_EMB = {"vocab_start": Attr("int"), "padding_idx": Attr("int")}
_def("embedding", 2, "gather", _embedding, _EMB)
_def("embedding_grad", 2, "linear0", _embedding_grad, _EMB)
# ---- end of the norms + embedding part ----
# ---- reductions part: amax, argmax, mean, log, softmax, log_softmax and the
# pieces of their split-dim forms (parcomp/passes/decompose.py). ``dims``/``dim`` may be
# negative (counted from the end); no keepdim. ``amax{detach=true}``: a shift the result
# does not depend on (softmax's max): no gradient flows through it. ``argmax_key``: the
# max-reducible int64 key (value, first global index) of a row, ``argmax_index`` decodes it
# (float32/16 only). ``pick(z, labels)``: z[..., label] on the rank holding that column and
# not ``ignore_index``, else 0; ``pick_grad(g, labels)``: its transpose (typed as z).
# ``label_mask(labels)``: 1.0 where label != ignore_index. ``mask_pad(x) {size, fill}``:
# last-dim entries at global index >= size (vocab padding) set to fill: "lowest" (the dtype's
# most negative finite number: never wins a max, exp gives 0) or "0".
# ``index_start``: the global index of this rank's first element along the indexed dim
# (set per rank by the interpreter / program.py; 0 unsharded).
_IGNORE = {"ignore_index": Attr("int", default=-100)}
_START = {"index_start": Attr("int", default=0)}
_def("log", 1, "nonlinear", same_type)
_def("amax", 1, "reduce_max", _reduce_some, {"dims": Attr("ints", required=True),
                                      "detach": Attr("bool", default=False)})
_def("amax_grad", 3, "linear0", _amax_grad, {"dims": Attr("ints", required=True)})
_def("argmax", 1, "nonlinear", _argmax, {"dim": Attr("int", required=True)})
_def("argmax_key", 1, "nonlinear", _argmax, {"dim": Attr("int", required=True), **_START})
_def("argmax_index", 1, "nonlinear", same_type)
# ``topk(x) {k, dim}``: the k largest along dim, largest first; ties to the lower index (a
# NaN counts as the largest, as in torch); ``topk_index``: their int64 indices (torch.topk's
# two results). ``take_along(x, idx) {dim}``: x's entries at idx along dim
# (torch.gather, numpy take_along_axis); ``put_along(g, idx) {dim, size}``: its transpose, g
# added into zeros of dim ``size`` at idx (torch.scatter_add into zeros).
_TOPK = {"k": Attr("int", required=True), "dim": Attr("int", required=True)}
_def("topk", 1, "nonlinear", _topk, _TOPK)
_def("topk_index", 1, "nonlinear", _topk, _TOPK)
_def("take_along", 2, "linear0", _along, {"dim": Attr("int", required=True)})
_def("put_along", 2, "linear0", _along, {"dim": Attr("int", required=True),
                                         "size": Attr("int", required=True)})
_def("mean", 1, "linear", _reduce_some, {"dims": Attr("ints", required=True)})
_def("softmax", 1, "nonlinear", same_type, {"dim": Attr("int", required=True)})
_def("log_softmax", 1, "nonlinear", same_type, {"dim": Attr("int", required=True)})
_def("pick", 2, "linear0", _pick, {**_IGNORE, **_START})
_def("pick_grad", 2, "linear0", _own, {**_IGNORE, **_START})
_def("label_mask", 1, "nonlinear", _label_mask, {**_IGNORE, "dtype": Attr("str", default="float32")})
_def("mask_pad", 1, "nonlinear", same_type, {"size": Attr("int", required=True), **_START,
                                             "fill": Attr("str", default="lowest", choices=("lowest", "0"))})
# op -> (operand whose global index it uses, None: its result; that dim: an int, or the
# name of the attribute holding it): the ops that need ``index_start`` when the dim is split
RANKED_OPS = {"argmax_key": (0, "dim"), "pick": (0, -1), "pick_grad": (None, -1), "mask_pad": (None, -1)}


def index_dim(graph, node) -> tuple:
    """``(type, layout, dim)`` of the value whose global index RANKED op ``node`` uses."""
    which, dim = RANKED_OPS[node.op]
    src = node if which is None else graph[node.inputs[which]]
    d = node.attr(dim) if isinstance(dim, str) else dim
    return src.type, src.layout, d % src.type.rank
# ---- end of the reductions part ----
# ---- expert parallel MoE: parcomp/rules/moe.py, parcomp/reference/moe_ops.py ----
# moe_route(z[..., S, E]) {top_k, capacity}: Mixtral's gate (softmax, top-k, renormalised) as a
#   dense [..., S, E] of combine weights, 0 off the top-k and on slots dropped past `capacity`
#   tokens per expert per row (0: none dropped); moe_route_grad(g, z): its VJP.
# moe_dispatch(x[B, S, H], c[B, S, E]) {capacity, weighted} -> [B, E, capacity, H]: row b's
#   tokens routed to expert e (c != 0), in token order; moe_combine(y[B, E, C, H], c) {weighted}
#   -> [B, S, H]: each token's slots summed (times c when weighted); moe_combine_grad_c(g, y, c)
#   -> [B, S, E]: g . y[slot] where routed.
from .moe_types import moe_combine_grad_c_type, moe_combine_type, moe_dispatch_type  # noqa: E402
_ROUTE = {"top_k": Attr("int", required=True), "capacity": Attr("int", default=0)}
_def("moe_route", 1, "nonlinear", same_type, _ROUTE)
_def("moe_route_grad", 2, "linear0", same_type, _ROUTE)
_def("moe_dispatch", 2, "bilinear", moe_dispatch_type, {"capacity": Attr("int", required=True),
                                                   "weighted": Attr("bool", default=False)})
_def("moe_combine", 2, "bilinear", moe_combine_type, {"weighted": Attr("bool", default=True)})
_def("moe_combine_grad_c", 3, "bilinear", moe_combine_grad_c_type)
# ---- end of the MoE part ----
# training options: clip_coef(sumsq) {max_norm} = min(1, max_norm / (sqrt(sumsq) + 1e-6)),
# the factor torch.nn.utils.clip_grad_norm_ scales every gradient by (parcomp/spec/train_options.py)
_def("clip_coef", 1, "nonlinear", same_type, {"max_norm": _NUM})
# mixed precision: a gradient widened to float32 (exact); ``partial_over``: mesh axes
# on which its operand must stay a partial sum, so the reduction runs in float32 after it
_def("grad_upcast", 1, "linear", lambda ts, n: TensorType(ts[0].shape, "float32"),
     {"partial_over": Attr("str", default="")})
# fp16 dynamic loss scaling (parcomp/passes/train/amp.py): nonfinite(x) = 1.0 where x is inf/NaN;
# amp_select(found, new, old) = old where found > 0 (a skipped step) else new; the scale's update
_def("nonfinite", 1, "nonlinear", lambda ts, n: TensorType(ts[0].shape, "float32"))
_def("amp_select", 3, "nonlinear", lambda ts, n: ts[1])
_def("amp_ratio", 3, "nonlinear", lambda ts, n: ts[1], {"interval": Attr("int", required=True)})
_def("amp_tracker", 2, "nonlinear", lambda ts, n: ts[1], {"interval": Attr("int", required=True)})
_SOURCE = {"global_shape": Attr("ints")}  # set by localize: the full shape
_def("input", 0, "source", _own, _SOURCE)
_def("param", 0, "source", _own, {**_SOURCE, "trainable": Attr("bool", default=True),
                                  # a fused weight's per-part view: the checkpoint's shape
                                  "stored_shape": Attr("ints"),
                                  # grouped q|k|v: the stored head units in the view's order
                                  "stored_order": Attr("ints"),
                                  # multi-query q|k|v: a part param, rows [start, stop) of the
                                  # stored tensor ``part_of`` of shape ``part_of_shape``
                                  "part_of": Attr("str"), "part_rows": Attr("ints"),
                                  "part_of_shape": Attr("ints"),
                                  # a tied weight's other names, comma-separated (spec rules match them)
                                  "aliases": Attr("str")})
# layout changes inserted by insert-collectives (see parcomp/ir/redistribute.py); ``dim``:
# the tensor dim gathered/scattered/sliced (the target dim of all_to_all), ``src_dim``:
# the dim all_to_all concatenates; ``reason``: why (for reports and comments)
_MOVE = {"axis": Attr("str", required=True), "reason": Attr("str")}
_DIM = Attr("int", required=True)
# reductions part: the partial kind an all_reduce / partial_mask works on
_REDUCE = {"reduce_op": Attr("str", default="sum", choices=("sum", "max"))}
_def("all_reduce", 1, "collective", same_type, {**_MOVE, **_REDUCE})
_def("all_gather", 1, "collective", same_type, {**_MOVE, "dim": _DIM})
_def("reduce_scatter", 1, "collective", same_type, {**_MOVE, "dim": _DIM})
_def("all_to_all", 1, "collective", same_type, {**_MOVE, "dim": _DIM, "src_dim": _DIM,
                                                "ragged": Attr("bool", default=False)})  # passes/lowering/moe_ragged.py
_def("shard_slice", 1, "local", same_type, {**_MOVE, "dim": _DIM})
_def("partial_mask", 1, "local", same_type, {**_MOVE, **_REDUCE})

COLLECTIVES = tuple(op for op, t in TRANSITIONS.items() if t.collective)  # from the one table
LAYOUT_OPS = COLLECTIVES + tuple(op for op, t in TRANSITIONS.items() if not t.collective)
# identity whose output layout is fixed by the spec (outputs, pinned activations);
# insert-collectives replaces it by the redistribution it asks for
_def("relayout", 1, "relayout", same_type, {"origin": Attr("str"),  # origin: the spec rule, in words
                                         "default": Attr("bool", default=False),  # unnamed output
                                         "grad": Attr("bool", default=False)})  # gradient pinned too

# lowered ops: made by parcomp/passes/lowering/lower.py from the ops above, only in local programs
# (their layout rules were checked on the ops they replace). Lowering annotates nodes with
# ``inplace`` (the result is written into the first operand's buffer, dead afterwards),
# ``async_op`` (a collective that a ``wait`` completes) and ``frees`` (values dying after it)
_INPLACE = {"inplace": Attr("bool", default=False)}
_def("dense", -1, "lowered", _own)  # (a, w[, b]) -> a @ w.T (+ b), w stored [out, in]: F.linear
_def("addmm", 3, "lowered", _own)  # (b, a, w) -> b + a @ w, 2-D a and w, 1-D b
_def("matmul_t", 2, "lowered", _own)  # (a, b) -> (a @ b).T computed as b.T @ a.T
_def("add_scaled", 2, "lowered", _own, {"b": _NUM, **_INPLACE})  # x + b * y (SGD's p - lr g)
_def("axpby", 2, "lowered", _own, {"a": _NUM, "b": _NUM, **_INPLACE})  # a x + b y (momentum)
_def("mse_sum", 2, "lowered", _own)  # (y, t) -> sum((y - t)**2) over all dims (0-d)
_def("mse_grad", 3, "lowered", _own)  # (dl, y, t) -> dl * 2 * (y - t), dl broadcast
_def("wait", 1, "lowered", same_type)  # the value of a collective started with async_op=true
# norms + embedding part, parcomp/passes/lowering/bucket.py: (a, b, ...) -> their
# flattened concatenation; (flat) -> flat[offset:offset+numel] reshaped to its type (a view)
_def("bucket_cat", -1, "lowered", _own)
_def("bucket_part", 1, "lowered", _own, {"offset": Attr("int", required=True),
                                         "numel": Attr("int", required=True)})

# derived views of the schemas (read-only conveniences; declare attributes with _def)
REQUIRED_ATTRS = {op: tuple(k for k, a in d.attrs.items() if a.required)
                  for op, d in OPS.items() if any(a.required for a in d.attrs.values())}
ATTR_CHOICES = {(op, k): a.choices for op, d in OPS.items() for k, a in d.attrs.items() if a.choices}
