"""``sequence-parallel``: Megatron's sequence parallelism, said once in the spec.

Megatron-LM (``--sequence-parallel``) and DTensor's ``SequenceParallel`` style run the norms
(and the dropout and residual additions around them) on activations split along the sequence
dim over the tensor-parallel axis; the tensor-parallel regions then start with an all_gather
of the sequence and end with a reduce_scatter instead of an all_reduce.

The spec statement ``sequence-parallel [over AXIS]`` (default axis: ``tp``) pins the output of
every ``layer_norm`` / ``rms_norm`` whose value has a sequence dim (rank >= 3, dim -2), and
its input, to ``S(seq)`` on that axis, **and their gradients to the same layout** (a ``relayout`` with
``grad=true``, whose VJP is a relayout of the gradient: DTensor's redistribute backward returns
the gradient in the placement the forward started from). Everything else is left to the layout
search: with the norms' inputs and outputs split, a row-parallel output is cheaper to
reduce_scatter than to all_reduce, so the residual stream, dropout and residual additions follow
on the split sequence, and the colwise matmuls gather it (see docs/design/context_parallel.md, "Sequence
parallel"). On the other mesh axes the pin takes ``S(0)`` where a model input's dim 0 (the
batch) is split over that axis (data parallel), else ``R``.

A sequence the axis does not divide (a ViT's 17 tokens, class token and 16 patches, at tp=2) is
padded at each norm, as Megatron pads its sequence: the norm's input gets zero positions at
the end (``pad``) up to a multiple of the axis, the norm runs on the split padded sequence, and
its output is cut back (``slice``) before anything else reads it. So the padding never reaches
attention (no key mask is needed: the pad positions are not there) nor the loss, and a pad
position's gradient is zero (the slice's VJP pads the gradient with zeros; a norm's weight
gradient sums rows of zero). Unlike Megatron, the residual stream between the norms keeps the
unpadded length, so it is not split along the sequence (the search keeps it a partial sum or
replicated): the padded plan saves the norms' activations only.
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.errors import SpecError
from parcomp.ir.graph import Graph, Node, make_attrs
from parcomp.ir.names import NameGen
from parcomp.ir.types import Replicate, Shard, TensorType, divisibility_problem, shard_axes

#: ops whose output the statement pins (the norm regions' entry points)
NORM_OPS = ("layer_norm", "rms_norm")


def pin_sequence_parallel(graph: Graph, spec) -> Graph:
    """Pin every norm's input and output (and their gradients) split along the sequence over the SP axis.

    Args:
        graph: the unsharded graph after bind-layouts' rules (mesh set).
        spec: the spec; ``spec.sequence_parallel`` is ``(axis, loc)`` or None (no change).

    Raises:
        SpecError: at the statement, when the model has no norm with a sequence dim, or a
            norm's sequence length is not divisible by the axis size (names the norm).
    """
    sp = getattr(spec, "sequence_parallel", None)
    if sp is None:
        return graph
    axis, loc = sp
    a = graph.mesh.axis_index(axis)
    norms = [n for n in graph.nodes if n.op in NORM_OPS and n.type.rank >= 3]
    if not norms:
        found = [f"{n.op} %{n.name} {n.type}" for n in graph.nodes if n.op in NORM_OPS]
        raise SpecError("sequence-parallel splits the sequence of the norms' activations, but the "
                        "model has no layer_norm or rms_norm over [batch, seq, hidden]"
                        + (f" (it has {', '.join(found)})" if found else ""), loc)
    batch = {ax for n in graph.inputs for ax in shard_axes(n.layout or (), 0)}
    where = f"the spec's sequence-parallel at {loc.file.rsplit('/', 1)[-1]}:{loc.line}"
    pins = {}
    for n in norms:
        lay = tuple(Shard(n.type.rank - 2) if i == a else Shard(0) if i in batch else Replicate()
                    for i in range(len(graph.mesh.axes)))
        seq, size = n.type.shape[n.type.rank - 2], graph.mesh.sizes[a]
        pad = -seq % size
        padded = TensorType(n.type.shape[:-2] + (seq + pad,) + n.type.shape[-1:], n.type.dtype)
        problem = divisibility_problem(padded, lay, graph.mesh)
        if problem:
            raise SpecError(f"sequence-parallel over {axis}: {n.op} %{n.name} {n.type} "
                            f"(module {n.source or '?'}): {problem}", loc)
        pins[n.name] = (lay, pad)
    return _pin_all(graph, pins, where, loc)


def _pin_all(graph, pins, origin, loc):
    """Insert ``relayout {grad=true}`` on each pinned norm's input (for the norm only) and on
    its output (for every consumer): DTensor's SequenceParallel, input and output ``S(seq)``;
    a norm with padding (``pins``: name -> (layout, pad)) runs on its input padded with zero
    positions and its output is cut back (module docstring). One pass over the graph (a
    48-block model has ~100 norms among ~16k nodes)."""
    fresh = NameGen(n.name for n in graph.nodes).fresh
    out_of = {name: fresh(f"{name}.seq_out") for name in pins}

    def relayout(name, operand, norm, ty):
        return Node(name, "relayout", (operand,), ty, make_attrs(origin=origin, grad=True),
                    pins[norm.name][0], source=norm.source, spec_loc=loc)

    nodes = []
    for n in graph.nodes:
        n = replace(n, inputs=tuple(out_of.get(i, i) for i in n.inputs)) \
            if any(i in out_of for i in n.inputs) else n
        if n.name not in pins:
            nodes.append(n)
            continue
        pad, seq = pins[n.name][1], n.type.rank - 2
        pin_in, src = fresh(f"{n.name}.seq_in"), n.inputs[0]
        ty = n.type
        if pad:  # zero positions at the end, up to a multiple of the axis
            ty = TensorType(n.type.shape[:seq] + (n.type.shape[seq] + pad,) + n.type.shape[seq + 1:], n.type.dtype)
            src = fresh(f"{n.name}.seq_pad")
            nodes.append(Node(src, "pad", (n.inputs[0],), ty, make_attrs(dim=seq, before=0, after=pad, value=0.0),
                              source=n.source, spec_loc=loc))
        nodes += [relayout(pin_in, src, n, ty), replace(n, inputs=(pin_in,) + n.inputs[1:], type=ty)]
        if pad:  # cut back to the model's positions before any consumer reads it
            split = fresh(f"{n.name}.seq_split")
            nodes += [relayout(split, n.name, n, ty),
                      Node(out_of[n.name], "slice", (split,), n.type,
                           make_attrs(dim=seq, start=0, stop=n.type.shape[seq], step=1), source=n.source,
                           spec_loc=loc)]
        else:
            nodes.append(relayout(out_of[n.name], n.name, n, ty))
    return graph.with_nodes(nodes, [out_of.get(o, o) for o in graph.outputs])
