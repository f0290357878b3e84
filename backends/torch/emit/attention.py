"""The torch emitter's attention backward: the ``sdpa_grad`` nodes of one attention (same
operands, same attributes, one per q / k / v) printed as one statement.

The IR keeps one ``sdpa_grad`` per operand (each is its own value for the planner, the
interpreter and the check); :func:`joint_grads` finds the nodes that differentiate the same
attention, and the step function assigns all of them where the first one stands, from one call
(:func:`parcomp_backends.torch.runtime.program_attention.attention_grads`, or
``ring_sdpa_grads`` for ring attention: one backward ring). The later nodes print nothing but
their ``del``; their values exist from the first node on.

When the step computes the attention's forward too (parcomp.ir.liveness.saved_attention), the
forward prints ``y, y_saved = attention_forward(...)`` (the fused kernel, keeping its output
and logsumexp) and the joint statement ``attention_backward(..., y_saved, ...)`` (the kernel's
backward on them, no forward again), then ``del y_saved``; the runtime falls back to
``attention_grads`` where no fused kernel with a known backward runs (program_attention.py).
Ring attention likewise: ``ring_sdpa_saved`` keeps the output and row logsumexp of its forward
ring, and ``ring_sdpa_grads(..., saved=y_saved)`` skips the statistics pass (program_ring.py).

A pipeline stage's forward and backward are two functions (emit/pipeline.py): the forward
returns the kept tuple as one more stashed value, ``saved.<sdpa>:kernel`` (:func:`stash_key`),
which the runtime keeps with the microbatch's other stashed values and hands to the backward
(``inp.pop("<sdpa>:kernel")``, deleted once read); :func:`stashed_forwards` pairs them
(parcomp.ir.liveness.stashed_attention, whose bytes the stage's stash counts).
"""
from __future__ import annotations

from parcomp.ir.liveness import saved_attention, stashed_attention

from ..runtime import sections

JOINT_FORMATS = {
    "sdpa_grad_joint": "attention_grads({0}, {1}, {2}, {3}, {parts}, {mask_args}, scale={scale})",
    "sdpa_grad_ring_joint": ("ring_sdpa_grads({0}, {1}, {2}, {3}, {scale}, {causal}, {cp_axis}, {chunking}, "
                             "{parts}{window_arg})"),
    # the forward kept what its kernel's backward needs: that backward, no forward again
    "sdpa_grad_saved_joint": "attention_backward({0}, {1}, {2}, {3}, {saved}, {parts}, {mask_args}, scale={scale})",
    "sdpa_grad_ring_saved_joint": ("ring_sdpa_grads({0}, {1}, {2}, {3}, {scale}, {causal}, {cp_axis}, {chunking}, "
                                   "{parts}{window_arg}, saved={saved})"),
}
# the forward of an attention whose joint backward reads what it keeps
SAVED_FORMATS = {"sdpa": "attention_forward({0}, {1}, {2}, {mask_args}, scale={scale})",
                 "sdpa_ring": "ring_sdpa_saved({0}, {1}, {2}, {scale}, {causal}, {cp_axis}, {chunking}{window_arg})"}
HELPER_NAMES = ("attention_grads", "attention_kernel", "attention_forward", "attention_backward", "_FUSED",
                "_float_mask")
_PER_NODE = ("wrt", "frees", "inplace", "async_op")  # attributes that differ between the parts


def joint_grads(program) -> dict:
    """``{node name: (first node's name, parts)}`` for every ``sdpa_grad`` of ``program``:
    ``parts`` (a string of q, k, v in that order) are the operands whose gradients the
    attention's nodes ask for; the first node (in program order) computes them all."""
    return program.memo("emit_attention.joint_grads", _joint_grads)


def _joint_grads(program):
    groups = {}
    for n in program.nodes:
        if n.op == "sdpa_grad":
            key = (n.inputs, tuple((k, v) for k, v in n.attrs if k not in _PER_NODE))
            groups.setdefault(key, []).append(n)
    out = {}
    for nodes in groups.values():
        parts = "".join(c for c in "qkv" if any(n.attr("wrt") == c for n in nodes))
        if len(parts) != len(nodes):  # two nodes for one operand: each printed on its own
            continue
        for n in nodes:
            out[n.name] = (nodes[0].name, parts)
    return out


def joint_targets(program, first: str, names) -> str:
    """The assignment targets of the joint statement at node ``first``: the variables of its
    attention's gradient nodes, in q, k, v order."""
    nodes = sorted((n for n in program.nodes if joint_grads(program).get(n.name, (None,))[0] == first),
                   key=lambda n: "qkv".index(n.attr("wrt")))
    return ", ".join(names[n.name] for n in nodes)


def saved_forwards(program) -> dict:
    """``{sdpa name: first sdpa_grad name}`` and back: the attentions of ``program`` whose forward
    keeps its kernel's saved tensors for its joint backward statement (both in ``program``;
    a pipeline stage's forward and backward functions are two programs: they recompute)."""
    return program.memo("emit_attention.saved_forwards", _saved_forwards)


def _saved_forwards(program):
    joint, out = joint_grads(program), {}
    for fwd, grad in saved_attention(program).items():
        first, parts = joint.get(grad, (None, ""))
        grads = [n for n in program.nodes if joint.get(n.name, (None,))[0] == grad]
        if first == grad and len(grads) == len(parts):
            out[fwd], out[grad] = grad, fwd
    return out


def stash_key(sdpa: str) -> str:
    """The stash entry of the kernel tensors of forward attention ``sdpa`` (``:`` is in no
    value name, so no stashed value has it)."""
    return f"{sdpa}:kernel"


def stashed_forwards(forward, backward) -> dict:
    """``{sdpa name: first sdpa_grad name}``: the attentions whose forward (in program
    ``forward``) keeps its kernel's saved tensors in the stash for their joint backward
    statement in program ``backward`` (a pipeline stage's two functions)."""
    joint, out = joint_grads(backward), {}
    for fwd, grad in stashed_attention(forward, backward).items():
        first, parts = joint.get(grad, (None, ""))
        grads = [n for n in backward.nodes if joint.get(n.name, (None,))[0] == grad]
        if first == grad and len(grads) == len(parts):
            out[fwd] = grad
    return out


def saved_name(var: str, taken) -> str:
    """The variable of an attention's saved tensors beside its output's ``var``."""
    cand = var + "_saved"
    while cand in taken:
        cand += "_"
    return cand


def attention_sections(program) -> list:
    """The ``attention_grads`` runtime section if a (non-ring) ``sdpa_grad`` of ``program``
    is printed jointly."""
    joint = joint_grads(program)
    if any(n.op == "sdpa_grad" and n.name in joint and n.attr("cp") != "ring" for n in program.nodes):
        return [sections("program_attention")["attention_grads"]]
    return []
