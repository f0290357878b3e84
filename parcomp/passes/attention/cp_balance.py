"""Load-balanced causal chunking (``context-parallel chunking=balanced``).

With a causal mask and contiguous chunks, rank c of n computes c + 1 blocks of the n x n
score matrix: the last rank does n times the first's work. Balanced chunking cuts the sequence
into ``2n`` chunks and gives rank c chunks ``c`` and ``2n - 1 - c`` (one early, one late): every
rank then sees the same number of query-key pairs.

The program keeps the usual contiguous ``S(seq)`` layouts but runs on the sequence in **storage
order**: storage row ``j`` holds natural position ``order[j]`` (:func:`storage_order`, rank-major:
rank 0's chunks, then rank 1's, ...). So that nothing changes meaning:

- every model **input** split along a dim over the CP axis (the training label too) is fed in
  storage order (:func:`feed`: the interpreter's feeds; program.py's ``load_inputs``), and every
  **output** split along a dim over that axis is put back in natural order when assembled
  (:func:`output`: ``SPMDRun.outputs``, ``parcomp run``'s assembly);
- position tables: a constant (non-trainable) param with a dim of the sequence's length (the
  frontend's folded RoPE cos/sin) is fed in storage order along those dims (``balanced_dims``),
  and every ``arange`` as long as the sequence produces positions in storage order
  (``balanced=n``): RoPE angles from global positions;
- every sdpa gets ``chunking=balanced, cp_size=n``: the ring kernel's mask and the all_gather
  form's mask (``parcomp/reference/cp_ops.py``) compare global positions, not storage rows.

Pass-through ops (pointwise, per-token matmuls, norms over hidden) and sums over the sequence
(losses) do not care about the order. What would care (a slice or shift along the sequence, a
learned position table indexed by storage row) is not checked: the statement is for attention
models whose only positional ops are RoPE's ``arange`` and the causal mask. An input with a dim
as long as the sequence that is not split over the CP axis is a located error (it would be fed
in natural order).
"""
from __future__ import annotations


from parcomp.errors import SpecError
from parcomp.reference.cp_storage import balanced_of, split_dim


def mark_balanced(graph, cp, seqs) -> list:
    """The nodes of ``graph`` with the balanced marks (see the module docstring).

    ``seqs``: the sequence lengths of the sdpa's q. Raises SpecError (at the statement): a
    sequence not divisible into 2n chunks, or an input of the sequence's length not split over
    the CP axis.
    """
    a = graph.mesh.axis_index(cp.axis)
    n = graph.mesh.sizes[a]
    for s in seqs:
        if s % (2 * n):
            raise SpecError(f"context-parallel chunking=balanced over {cp.axis}: a sequence of {s} "
                            f"does not cut into {2 * n} equal chunks (2 x {cp.axis}={n})", cp.loc)
    out = []
    for node in graph.nodes:
        if node.op == "input" and split_dim(node.layout, a) is None and any(s in seqs for s in node.type.shape):
            raise SpecError(f"context-parallel chunking=balanced: input {node.name} {node.type} has "
                            f"a dim of the sequence's length but is not split over {cp.axis}; give it "
                            f"split-seq (it would be fed in natural order)", cp.loc)
        dims = tuple(d for d, s in enumerate(node.type.shape) if s in seqs)
        if node.op == "arange" and node.type.shape[0] in seqs:
            node = node.with_attrs(balanced=n)
        elif node.op == "param" and node.attr("trainable") is False and dims:  # a folded position table
            node = node.with_attrs(balanced=n, balanced_dims=dims)
        elif node.op == "sdpa":
            node = node.with_attrs(chunking="balanced", cp_size=n, cp_axis=cp.axis)
        out.append(node)
    return out


def check_ends(sharded, spec, model_outputs) -> None:
    """Balanced chunking keeps the sequence in storage order end to end: every input (the train
    line's label too) and every output with a dim of the sequence's length must be split over the
    CP axis (``model_outputs``: the model's output names), so that feeding and assembling (:func:`feed`, :func:`outputs`) restore natural order.
    A value gathered to ``replicated`` would be assembled in storage order: wrong numbers.

    Raises:
        SpecError: at the ``context-parallel`` statement, naming the input or output.
    """
    got = balanced_of(sharded)
    if got is None:
        return
    seqs = {sharded[n.inputs[0]].type.shape[2] for n in sharded.nodes
            if n.op == "sdpa" and n.attr("chunking") == "balanced"}
    cp = spec.context_parallel
    ends = [("input", n.name, n) for n in sharded.nodes if n.op == "input"]
    ends += [("output", public, sharded[value]) for public, value in sharded.named_outputs()
             if public in model_outputs]  # the model's own outputs, not gradients or optimizer state
    for kind, name, node in ends:
        if split_dim(node.layout, got[0]) is None and any(s in seqs for s in node.type.shape):
            raise SpecError(f"context-parallel chunking=balanced: {kind} {name} {node.type} has a dim "
                            f"of the sequence's length but is not split over {cp.axis}; give it "
                            f"split-seq (balanced chunks hold the sequence out of order, so a "
                            f"replicated {kind} would be in the wrong order)", cp.loc)
