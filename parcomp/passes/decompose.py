"""decompose-reductions: softmax, log_softmax, mean, argmax and cross_entropy written as the
reductions shard-prop can split (reductions part; see docs/design/rules.md).

Runs on the global graph after ``bind-layouts`` and before ``autodiff``, always: whether a
reduced dim ends up split is shard-prop's choice, made later. The forms:

- ``softmax(x)``  = ``e / sum(e)`` with ``e = exp(x - amax(x){detach})``; ``log_softmax(x)``
  = ``(x - m) - log(sum(exp(x - m)))``. Split along the dim: the max is a ``P(max)``
  (all_reduce max, never summed), the sum of exps a ``P`` (all_reduce sum). The max is a
  shift the result does not depend on: ``detach=true``, no gradient flows through it;
- ``mean(x)`` = ``sum(x) * (1 / global count)``; ``argmax(x)`` = ``argmax_index(argmax_key(x))``
  (float32/float16: the key packs value and first global index in one max-reducible int64);
- ``cross_entropy(z, labels)`` = :func:`cross_entropy_parts`, Megatron's vocab-parallel form:
  max, sum of exps and the target logit (``pick``, held by one rank) are the three
  reductions over the vocab dim; ignored labels give 0.

The lowering pass ``fuse-reductions`` (:mod:`.lowering.fuse_reductions`) writes a softmax,
log_softmax or argmax back as one op where nothing split it. Each form keeps the original
node's name, layout and phase on its last node.
"""
from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph, Node, make_attrs
from ..ir.names import NameGen
from ..ir.ops import OPS

KEYED_DTYPES = ("float32", "float16")  # argmax keys: values that fit an order-preserving int32
LAST = "last"  # _decompose: the form's last node is already made


class Emitter:
    """Appends nodes with fresh names and inferred types (phase/source of a model node)."""

    def __init__(self, names: NameGen, types: dict, like: Node | None = None):
        self.names, self.types, self.like, self.out = names, types, like, []

    def op(self, op, inputs, base, type=None, **attrs) -> str:
        name = self.names.fresh(base)
        node = Node(name, op, tuple(inputs), type, make_attrs(**attrs))
        ty = type or OPS[op].infer([self.types[i] for i in inputs], node)
        node = replace(node, type=ty)
        if self.like is not None:
            node = replace(node, phase=self.like.phase, source=self.like.source, spec_loc=self.like.spec_loc)
        self.out.append(node)
        self.types[name] = ty
        return name


def _shifted(e: Emitter, x, d, base):
    """(x - max(x), the exps, their sum) over dim ``d``; the max is detached."""
    ty = e.types[x]
    m = e.op("amax", [x], f"{base}.max", dims=(d,), detach=True)
    z = e.op("sub", [x, e.op("expand", [m], f"{base}.max_b", type=ty, dims=(d,))], f"{base}.shifted")
    ex = e.op("exp", [z], f"{base}.exp")
    return z, ex, e.op("sum", [ex], f"{base}.sumexp", dims=(d,))


def softmax_parts(e: Emitter, x, d, base, log=False) -> tuple:
    """The ops of softmax / log_softmax over dim ``d``: ``(op, inputs, attrs)`` of the last."""
    ty = e.types[x]
    z, ex, s = _shifted(e, x, d, base)
    if log:
        lse = e.op("expand", [e.op("log", [s], f"{base}.logsumexp")], f"{base}.logsumexp_b",
                   type=ty, dims=(d,))
        return "sub", (z, lse), {}
    return "div", (ex, e.op("expand", [s], f"{base}.sumexp_b", type=ty, dims=(d,))), {}


def cross_entropy_parts(e: Emitter, z, labels, base, ignore_index=-100, smoothing=0.0, pad=None):
    """Per-token cross-entropy of logits ``z`` (classes on the last dim) as reductions that a
    vocab split turns into Megatron's three all_reduces (max, sum of exps, target logit).

    ``pad``: the real class count when ``z`` is padded (``mask_pad``): smoothing averages
    over the real classes only. Returns ``(loss per token, 1.0 where the label counts)``.
    """
    ty = e.types[z]
    d = ty.rank - 1
    shifted, _, s = _shifted(e, z, d, base)
    lse = e.op("log", [s], f"{base}.logsumexp")
    nll = e.op("sub", [lse, e.op("pick", [shifted, labels], f"{base}.target", ignore_index=ignore_index)],
               f"{base}.nll")
    per = nll
    if smoothing:
        classes = pad or ty.shape[-1]
        real = shifted if pad is None else e.op("mask_pad", [shifted], f"{base}.real", size=pad, fill="0")
        mean = e.op("scale", [e.op("sum", [real], f"{base}.sum_logits", dims=(d,))], f"{base}.mean_logits",
                    value=1.0 / classes)
        smooth = e.op("sub", [lse, mean], f"{base}.smooth")
        nll_w = e.op("scale", [nll], f"{base}.nll_w", value=1.0 - smoothing)
        smooth_w = e.op("scale", [smooth], f"{base}.smooth_w", value=float(smoothing))
        per = e.op("add", [nll_w, smooth_w], f"{base}.mix")
    valid = e.op("label_mask", [labels], f"{base}.counted", ignore_index=ignore_index, dtype=ty.dtype)
    return e.op("mul", [per, valid], f"{base}.per_token"), valid


def padded_size(producers: dict, z) -> int | None:
    """The real class count if ``z`` is made by ``mask_pad`` (fill lowest), else None.
    ``producers``: value name -> its node."""
    node = producers.get(z)
    if node is not None and node.op == "mask_pad" and node.attr("fill", "lowest") == "lowest":
        return node.attr("size")
    return None


def _decompose(e: Emitter, n: Node, producers: dict):
    """``(op, inputs, attrs)`` of the last node of ``n``'s form (its other nodes go to ``e``),
    ``LAST`` when the form's last node is already in ``e``, or None to keep ``n``."""
    if not n.inputs:
        return None
    x = n.inputs[0]
    if n.op in ("softmax", "log_softmax"):
        return softmax_parts(e, x, n.attr("dim") % e.types[x].rank, n.name, log=n.op == "log_softmax")
    if n.op == "mean":
        ty = e.types[x]
        dims = tuple(sorted(d % ty.rank for d in n.attr("dims")))
        count = 1
        for d in dims:
            count *= ty.shape[d]
        return "scale", (e.op("sum", [x], f"{n.name}.sum", dims=dims),), {"value": 1.0 / count}
    if n.op == "argmax" and e.types[x].dtype in KEYED_DTYPES:
        key = e.op("argmax_key", [x], f"{n.name}.key", dim=n.attr("dim") % e.types[x].rank)
        return "argmax_index", (key,), {}
    if n.op == "cross_entropy":
        cross_entropy_parts(e, x, n.inputs[1], n.name, n.attr("ignore_index", -100),
                            n.attr("label_smoothing", 0.0), padded_size(producers, x))
        return LAST
    return None


def decompose_reductions(graph: Graph) -> Graph:
    """The graph with every softmax, log_softmax, mean, argmax (float32/16) and cross_entropy
    written as the reductions above (the last node keeps the original name and layout)."""
    names = NameGen(n.name for n in graph.nodes)
    types = {n.name: n.type for n in graph.nodes}
    producers = {n.name: n for n in graph.nodes}
    out = []
    for n in graph.nodes:
        e = Emitter(names, types, n)
        form = _decompose(e, n, producers)
        if form is None:
            out.append(n)
            continue
        if form is LAST:  # cross_entropy: its per-token value is the last node made
            last = e.out.pop()
            out += e.out + [replace(last, name=n.name, layout=n.layout)]
            continue
        op, inputs, attrs = form
        out += e.out + [replace(n, op=op, inputs=tuple(inputs), attrs=make_attrs(**attrs))]
    return graph.with_nodes(out)
