"""Liveness of a lowered local program: which values share a buffer (views, in-place results),
when each dies (``frees``), and the peak bytes live on one rank.

The one model shared by the lowering passes (:mod:`parcomp.passes.lowering.lower`), the reference
interpreter and the report: parameters and inputs are held by the caller and never freed;
temporaries inside one statement are not counted.
"""
from __future__ import annotations

from .graph import Graph, Node
from .types import DTYPE_BYTES


SOURCES = ("input", "param")

# results that alias their (first) operand: no new buffer
VIEW_OPS = ("permute", "reshape", "relayout", "expand", "wait", "slice",  # slice: attention part
            "bucket_part")  # bucket_part: norms part

# results that may alias their operand (a local slice, coordinate 0 of a mask)
MAYBE_VIEW_OPS = ("shard_slice", "partial_mask")

IN_PLACE_OPS = ("all_reduce", "add", "add_scaled", "axpby", "adamw_param")


def is_view(n: Node) -> bool:
    return (n.op in VIEW_OPS or (n.op == "sum" and not n.attr("dims"))
            or (n.op in IN_PLACE_OPS and bool(n.attr("inplace"))))


def storage_roots(graph: Graph) -> dict:
    """value name -> the name of the value whose buffer it lives in (itself if it allocates)."""
    roots = {}
    for n in graph.nodes:
        roots[n.name] = roots[n.inputs[0]] if n.inputs and is_view(n) else n.name
    return roots


def frees_of(n: Node) -> tuple:
    """The values ``n``'s ``frees`` attribute says die after it."""
    return tuple(n.attr("frees", "").split())


def peak_bytes(graph: Graph) -> int:
    """Peak bytes live on one rank while ``graph`` (a lowered local program) runs.

    A buffer is counted from the node that allocates it until every value living in it
    has been freed (``frees``); sources and outputs are never freed.
    """
    roots, holders, size, live, peak = storage_roots(graph), {}, {}, 0, 0
    nbytes = {}  # id(type) -> its bytes: the nodes share few type objects (alive in graph)
    for n in graph.nodes:
        name = n.name
        r = roots[name]
        if r == name:
            got = nbytes.get(id(n.type))
            if got is None:
                got = nbytes[id(n.type)] = n.type.nbytes
            size[r] = got
            live += got
            if live > peak:  # live grows only here
                peak = live
            holders[r] = {name}
        else:
            holders[r].add(name)
        for v in n.attr("frees", "").split():  # frees_of(n)
            held = holders[roots[v]]
            held.discard(v)
            if not held:
                live -= size[roots[v]]
    return int(peak)


def broadcast_view(graph, x, root) -> str | None:
    """The ``expand`` through which ``x`` is a view of ``root``'s buffer (``root``:
    :func:`storage_roots`), or None. Several elements of such a view share one memory
    location (stride 0), and torch refuses to write into it ("more than one element of
    the written-to tensor refers to a single memory location": ``add_`` on cross-entropy's
    label-smoothing gradient, an expanded sum), so no in-place op may write into ``x``."""
    while x != root:
        if graph[x].op == "expand":
            return x
        x = graph[x].inputs[0]
    return None



# attributes that say which part of an attention a node is or how it is run, not which attention
_NOT_ATTENTION = ("wrt", "frees", "inplace", "async_op")


def _attention_key(inputs, n) -> tuple:
    return inputs, tuple((k, v) for k, v in n.attrs if k not in _NOT_ATTENTION)


def saved_attention(graph: Graph) -> dict:
    """``{sdpa name: sdpa_grad name}``: each forward ``sdpa`` whose gradients
    ``graph`` also computes (``sdpa_grad`` nodes after it on the same operands and attributes,
    at most one per operand; of two such forwards, the later: a recomputation), with the
    first of those nodes. A backend may keep, from such a
    forward to that node, what its fused kernel's backward needs instead of computing the
    forward again: the output and a logsumexp per query row (:func:`attention_saved_bytes`;
    ring attention: its forward ring's output and row logsumexp, so that its backward ring
    needs no statistics pass)."""
    return _paired_attention(graph.nodes)


def stashed_attention(forward: Graph, backward: Graph) -> dict:
    """``{sdpa name: sdpa_grad name}`` as :func:`saved_attention`, across two programs: each
    ``sdpa`` of ``forward`` whose gradients ``backward`` computes on the same operands (a
    pipeline stage's forward and backward, whose stashed values keep their names), unless
    ``backward`` computes that attention again (a recomputation: it pairs with its own
    gradients there). What the forward's kernel keeps for that backward travels with the
    microbatch's stash (:func:`attention_saved_bytes`)."""
    own = {n.name for n in forward.nodes}
    return {src: grad for src, grad in _paired_attention(forward.nodes + backward.nodes).items()
            if src in own and grad not in own}


def _paired_attention(nodes) -> dict:
    fwd, grads = {}, {}
    for n in nodes:
        if n.op == "sdpa":
            fwd[_attention_key(n.inputs, n)] = n.name  # the last before the gradients: a recomputed one
        elif n.op == "sdpa_grad":
            src = fwd.get(_attention_key(n.inputs[1:], n))
            if src is not None:
                grads.setdefault(src, []).append(n)
    return {src: nodes[0].name for src, nodes in grads.items()
            if len({g.attr("wrt") for g in nodes}) == len(nodes)}


def saved_layer_norm(graph: Graph) -> dict:
    """``{layer_norm name: layer_norm_grad name}``: each forward ``layer_norm`` with a weight
    whose dx ``graph`` also computes (a ``layer_norm_grad`` with a weight after it on the same x
    and eps; of two such forwards, the later: a recomputation), with that node. A backend may keep,
    from such a forward to that node, the mean and rstd per row its kernel computes instead of
    computing them again (:func:`layer_norm_saved_bytes`)."""
    fwd, out = {}, {}
    for n in graph.nodes:
        if n.op == "layer_norm" and len(n.inputs) > 1:
            fwd[n.inputs[0], n.attr("eps")] = n.name  # the last before the gradient: a recomputed one
        elif n.op == "layer_norm_grad" and len(n.inputs) == 3:
            src = fwd.get((n.inputs[1], n.attr("eps")))
            if src is not None and src not in out:
                out[src] = n.name
    return out


def stashed_layer_norm(forward: Graph, backward: Graph) -> dict:
    """``{layer_norm name: backward node name}`` across two programs (a pipeline stage's forward
    and a backward program, whose stashed values keep their names): each forward ``layer_norm``
    with a weight whose gradients ``backward`` computes on the same x and eps, with the first
    node there that needs the kernel's mean and rstd: the ``layer_norm_grad`` (dx) or the
    weight-free ``layer_norm(x)`` of the dweight (ZB-H1's weight half holds that alone);
    unless ``backward`` computes that layer norm again (a recomputation keeps its own). The
    mean and rstd travel with the microbatch's stash (:func:`layer_norm_saved_bytes`)."""
    fwd, again, out = {}, set(), {}
    for n in forward.nodes:
        if n.op == "layer_norm" and len(n.inputs) > 1:
            fwd[n.inputs[0], n.attr("eps")] = n.name
    for n in backward.nodes:
        x = n.inputs[1] if n.op == "layer_norm_grad" and len(n.inputs) == 3 else n.inputs[0] if n.inputs else None
        key = (x, n.attr("eps"))
        if n.op == "layer_norm" and len(n.inputs) > 1:
            again.add(key)
        elif key in fwd and key not in again and fwd[key] not in out and (
                (n.op == "layer_norm_grad" and len(n.inputs) == 3)
                or (n.op == "layer_norm" and len(n.inputs) == 1)):
            out[fwd[key]] = n.name
    return out


def layer_norm_saved_bytes(ty, nbytes: int) -> int:
    """The bytes of the mean and rstd a layer norm kernel keeps beside an output of type ``ty``
    of which a rank holds ``nbytes``: two per row (each row: the last dim), in float32 or the
    wider dtype of ``ty`` (torch's accumulation type)."""
    width = DTYPE_BYTES[ty.dtype]
    return nbytes // (ty.shape[-1] * width) * 2 * max(4, width)


def attention_saved_bytes(ty, nbytes: int) -> int:
    """The bytes of the logsumexp a fused attention kernel keeps beside an sdpa output of
    type ``ty`` (``[batch, heads, seq, head_dim]``) of which a rank holds ``nbytes``: float32,
    one per query row."""
    return nbytes // (ty.shape[-1] * DTYPE_BYTES[ty.dtype]) * 4
