"""The torch emitter's attention backward: the ``sdpa_grad`` nodes of one attention (same
operands, same attributes, one per q / k / v) printed as one statement.

The IR keeps one ``sdpa_grad`` per operand (each is its own value for the planner, the
interpreter and the check); :func:`joint_grads` finds the nodes that differentiate the same
attention, and the step function assigns all of them where the first one stands, from one call
(:func:`parcomp_backends.torch.runtime.program_attention.attention_grads`, or
``ring_sdpa_grads`` for ring attention: one backward ring). The later nodes print nothing but
their ``del``; their values exist from the first node on.
"""
from __future__ import annotations

from ..runtime import sections

JOINT_FORMATS = {
    "sdpa_grad_joint": "attention_grads({0}, {1}, {2}, {3}, {parts}, {mask_args}, scale={scale})",
    "sdpa_grad_ring_joint": ("ring_sdpa_grads({0}, {1}, {2}, {3}, {scale}, {causal}, {cp_axis}, {chunking}, "
                             "{parts}{window_arg})"),
}
HELPER_NAMES = ("attention_grads",)
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


def attention_sections(program) -> list:
    """The ``attention_grads`` runtime section if a (non-ring) ``sdpa_grad`` of ``program``
    is printed jointly."""
    joint = joint_grads(program)
    if any(n.op == "sdpa_grad" and n.name in joint and n.attr("cp") != "ring" for n in program.nodes):
        return [sections("program_attention")["attention_grads"]]
    return []
