"""Torch emitter rows of the norms + embedding part.

:data:`NORM_FORMATS` joins :data:`parcomp_backends.torch.emit.OP_FORMATS`;
:func:`norm_kw` gives the extra format fields a node needs (its operands as arguments,
and for dropout / vocab-parallel embedding where this rank's block lies, as expressions
of ``COORD``); :func:`runtime_sections` the helpers (``program_norms.py``) a program needs.
"""
from __future__ import annotations

from parcomp.ir.liveness import saved_layer_norm, stashed_layer_norm
from parcomp.ir.types import shard_axes

from ..runtime import sections

NORM_FORMATS = {
    "layer_norm": "torch.nn.functional.layer_norm({norm_args})",
    "rms_norm": "torch.nn.functional.rms_norm({norm_args})",
    "layer_norm_grad": "norm_grad({grad_args}, rms=False)",
    "rms_norm_grad": "norm_grad({grad_args}, rms=True)",
    "dropout": "dropout_by_index({0}, {p}, {seed}, {index_shape}, {index_start}{step})",
    "embedding": "embedding_rows({0}, {1}, {vocab_start})",
    "embedding_grad": "embedding_grad_rows({0}, {1}, {rows}, {vocab_start}{padding})",
    # lowered (parcomp/passes/lowering/bucket.py)
    "bucket_cat": "torch.cat([{flat_args}])",
    "bucket_part": "{0}.narrow(0, {offset}, {numel}).view({local_shape})",
}
NEEDS_RUNTIME = ("layer_norm_grad", "rms_norm_grad", "dropout", "embedding", "embedding_grad")
NORM_RUNTIME = sections("program_norms")["norms"]
HELPER_NAMES = ("M32", "mul32", "mix32", "dropout_keep", "dropout_by_index", "norm_grad",
                "layer_norm_forward", "layer_norm_grads", "rms_norm_grads", "embedding_rows",
                "embedding_grad_rows")
_JOINT_FORMAT = {"layer_norm": "layer_norm_grads({0}, {1}, {2}, {eps}, {mask}{saved})",
                 "rms_norm": "rms_norm_grads({0}, {1}, {2}, {eps}, {mask})"}
#: the words a skipped node's comment names the joint statement by
NORM_WORDS = {"layer_norm": "layer norm", "rms_norm": "RMS norm"}
_PER_NODE = ("frees", "bucket")  # attributes that leave a node's value as it is


def _global_shape(program, node) -> tuple:
    shape = list(node.type.shape)
    for a, p in enumerate((node.layout or ()) if program is not None else ()):
        if hasattr(p, "dim"):
            shape[p.dim] *= program.mesh.sizes[a]
    return tuple(shape)


def block_start(program, node, d) -> str:
    """The expression of where dim ``d`` of this rank's block of ``node`` starts."""
    axes = shard_axes(node.layout, d) if program is not None and node.layout else ()
    if not axes:
        return "0"
    index = None
    for a in axes:  # the first mesh axis is the outer one (parcomp.ir.types.shard_offsets)
        size = program.mesh.sizes[a]
        index = f"COORD[{a}]" if index is None else f"({index}) * {size} + COORD[{a}]"
    return f"{f'({index})' if '+' in index else index} * {node.type.shape[d]}"


def norm_kw(program, n, args) -> dict:
    """Extra ``str.format`` fields of node ``n`` (operand variables ``args``) of local ``program``
    (None: an unsharded node, every block starting at 0)."""
    if n.op not in NORM_FORMATS:
        return {}
    eps = repr(float(n.attr("eps", 0.0)))
    if n.op in ("layer_norm", "rms_norm"):
        names = ("weight", "bias")
        extra = "".join(f", {k}={v}" for k, v in zip(names, args[1:]))
        return {"norm_args": f"{args[0]}, ({n.type.shape[-1]},){extra}, eps={eps}"}
    if n.op in ("layer_norm_grad", "rms_norm_grad"):
        return {"grad_args": f"{args[0]}, {args[1]}, {args[2] if len(args) > 2 else None}, {eps}"}
    if n.op == "dropout":
        starts = ", ".join(block_start(program, n, d) for d in range(n.type.rank))
        return {"index_shape": repr(_global_shape(program, n)),
                "index_start": f"({starts}{',' if n.type.rank == 1 else ''})",
                "step": f", step={args[1]}" if len(args) > 1 else ""}
    if n.op == "bucket_cat":
        return {"flat_args": ", ".join(f"{a}.reshape(-1)" for a in args)}
    if n.op == "embedding":
        return {"vocab_start": block_start(program, program[n.inputs[1]], 0) if program is not None else "0"}
    if n.op == "embedding_grad":
        pad = n.attr("padding_idx")
        return {"vocab_start": block_start(program, n, 0), "rows": str(n.type.shape[0]),
                "padding": "" if pad is None else f", padding_idx={int(pad)}"}
    return {}


def runtime_sections(program) -> list:
    """``[helpers text]`` if ``program`` uses an op whose format calls them, else ``[]``."""
    return [NORM_RUNTIME] if any(n.op in NEEDS_RUNTIME for n in program.nodes) else []


class NormJoint:
    """One norm's gradients printed as one statement (:func:`joint_norm_grads`).

    ``at``: the node where the statement stands (the first of ``grads`` in program order);
    ``grads``: ``(dx, dweight, dbias)`` node names (an RMS norm: ``(dx, dweight)``), None
    where the program asks for no such value; ``skipped``: the nodes that only served dweight
    (``layer_norm(x)`` / ``rms_norm(x)``, its ``mul`` by dy), which print nothing; ``inputs``:
    ``(dy, x, weight)``; ``eps``; ``norm``: ``layer_norm`` or ``rms_norm``."""

    def __init__(self, at, grads, skipped, inputs, eps, norm="layer_norm"):
        self.at, self.grads, self.skipped, self.inputs, self.eps = at, grads, skipped, inputs, eps
        self.norm, self.words = norm, NORM_WORDS[norm]

    def code(self, var_of, saved=None) -> str:
        """The statement ``dx, dw, db = layer_norm_grads(...)`` (only the wanted targets);
        ``saved``: the variable of the forward's kept (mean, rstd), or None. A weight None
        (a weight half without dx: the kernel reads the weight for dx only) prints ``None``."""
        targets = ", ".join(var_of(g) for g in self.grads if g is not None)
        mask = "(" + ", ".join(str(g is not None) for g in self.grads) + ")"
        args = ["None" if v is None else var_of(v) for v in self.inputs]
        return f"{targets} = " + _JOINT_FORMAT[self.norm].format(*args, eps=repr(self.eps), mask=mask,
                                                      saved="" if saved is None else f", saved={saved}")


def kept_norm_stats(program) -> dict:
    """``{layer_norm name: joint first node}`` and back: the forward layer norms of ``program``
    whose kernel's mean and rstd the step keeps for their gradients' joint statement
    (:func:`parcomp.ir.liveness.saved_layer_norm`, :func:`joint_norm_grads`). The forward prints
    ``y, y_saved = layer_norm_forward(...)``, the joint statement reads ``saved=y_saved`` and
    deletes it; elsewhere (a pipeline stage's backward function, a dx alone) the backward
    computes them again."""
    return program.memo("emit_norms.kept_norm_stats", _kept_norm_stats)


def _kept_norm_stats(program):
    joint, out = joint_norm_grads(program), {}
    index = {n.name: i for i, n in enumerate(program.nodes)}
    for fwd, grad in saved_layer_norm(program).items():
        j = joint.get(grad)
        if j is not None and j.grads[0] == grad and index[fwd] < index[j.at] and _plain(program[fwd]) \
                and fwd not in joint:
            out[fwd], out[j.at] = j.at, fwd
    return out


def stash_key(layer_norm: str) -> str:
    """The stash entry of forward layer norm ``layer_norm``'s kernel (mean, rstd) (``:`` is in
    no value name, so no stashed value has it)."""
    return f"{layer_norm}:stats"


def stashed_norms(forward, backward) -> dict:
    """``{layer_norm name: joint first node}``: the forward layer norms of program ``forward``
    whose kernel's (mean, rstd) the stash keeps for their gradients' statement in program
    ``backward`` (a pipeline stage's two functions: :func:`parcomp.ir.liveness.stashed_layer_norm`).
    That statement is the joint one of :func:`joint_norm_grads`, or where ``backward`` holds a
    part only (ZB-H1's halves: dx alone in the input half, dweight and dbias alone in the
    weight half) the part's (:func:`part_norm_grads`): with the mean and rstd at hand, each
    part is one ``native_layer_norm_backward`` with its output mask."""
    joint = {**part_norm_grads(backward), **joint_norm_grads(backward)}
    out = {}
    for fwd, first in stashed_layer_norm(forward, backward).items():
        j = joint.get(first)
        x = forward[fwd].inputs[0]
        if j is not None and j.inputs[1] == x and j.eps == float(forward[fwd].attr("eps")):
            out[fwd] = j.at
    return out


def stash_norm_joints(program, at) -> dict:
    """:func:`joint_norm_grads` of ``program`` with the parts (:func:`part_norm_grads`) whose
    statement stands at a node of ``at`` (those reading a stashed mean and rstd)."""
    joint = joint_norm_grads(program)
    if not at:
        return joint
    parts = {k: j for k, j in part_norm_grads(program).items() if j.at in at}
    return {**joint, **parts} if parts else joint


def part_norm_grads(program) -> dict:
    """``{node name: NormJoint}`` of the layer norms whose gradients ``program`` computes in
    part, which :func:`joint_norm_grads` leaves: dx alone (``layer_norm_grad(dy, x, w)``, no
    dweight or dbias beside it), or dweight (``sum(mul(dy, layer_norm(x)))``) with dbias
    (``sum(dy)``) where present and no dx (the weight ``None``: the kernel reads it for dx
    only). Printed only where the forward's mean and rstd are at hand (:func:`stashed_norms`):
    alone, dx is ``norm_grad`` and dweight sums the normalised x as written."""
    return program.memo("emit_norms.part_norm_grads", _part_norm_grads)


def layer_norm_forward_code(n, args, saved) -> str:
    """The statement of forward ``layer_norm`` ``n`` keeping its kernel's (mean, rstd) in ``saved``."""
    w, b = (list(args[1:]) + ["None", "None"])[:2]
    return f"{saved} = layer_norm_forward({args[0]}, {w}, {b}, {float(n.attr('eps'))!r})"


def joint_norm_grads(program) -> dict:
    """``{node name: NormJoint}`` for the nodes of every layer norm of ``program`` whose dx and
    at least one of dweight / dbias it computes: ``layer_norm_grad(dy, x, w)`` (dx),
    ``sum(mul(dy, layer_norm(x)), dims=tokens)`` (dweight, parcomp/rules/norms.py) and
    ``sum(dy, dims=tokens)`` (dbias). The step prints them as one call of torch's fused
    ``native_layer_norm_backward`` with an output mask (the kernel autograd runs), at the first
    of them; ``layer_norm(x)`` and the ``mul`` print nothing. An RMS norm's dx and dweight
    (``rms_norm_grad``, ``sum(mul(dy, rms_norm(x)))``) likewise print one ``rms_norm_grads``
    (one rstd and one normalised x for both). A partial sum (dy split over
    tokens: sequence parallel) stays one: the kernel sums over this rank's tokens, as ``sum``
    does, and the collectives reading it are unchanged."""
    return program.memo("emit_norms.joint_norm_grads", _joint_norm_grads)


def _plain(n) -> bool:
    return not n.attr("inplace") and not n.attr("async_op")


def _part_norm_grads(program):
    nodes, joint, out = program.nodes, joint_norm_grads(program), {}
    readers, index = _readers(program), {n.name: i for i, n in enumerate(nodes)}
    outs = set(program.outputs)

    def only_reader(v):
        rs = readers.get(v, [])
        return rs[0] if len(rs) == 1 and v not in outs else None

    for n in nodes:
        if n.name in joint or not _plain(n):
            continue
        if n.op == "layer_norm_grad" and len(n.inputs) == 3:  # dx alone
            g, x, w = n.inputs
            xt = program[x].type
            if program[g].type.dtype == xt.dtype == program[w].type.dtype:
                out[n.name] = NormJoint(n.name, (n.name, None, None), (), (g, x, w), float(n.attr("eps")))
        elif n.op == "layer_norm" and len(n.inputs) == 1:  # the normalised x of a dweight alone
            x, xt = n.inputs[0], n.type
            mul = only_reader(n.name)
            if mul is None or mul.op != "mul" or not _plain(mul) or len(mul.inputs) != 2:
                continue
            g = mul.inputs[0] if mul.inputs[1] == n.name else mul.inputs[1]
            s = only_reader(mul.name)
            lead, wt = tuple(range(xt.rank - 1)), None
            if s is not None and s.op == "sum" and _plain(s) and tuple(s.attr("dims") or ()) == lead \
                    and s.type.shape == xt.shape[-1:] and s.type.dtype == xt.dtype == program[g].type.dtype \
                    and not set(dict(s.attrs)) - {"dims", *_PER_NODE}:
                wt = s.type
            if wt is None or g == n.name:
                continue
            db = next((r.name for r in readers.get(g, []) if r.op == "sum" and _plain(r) and r.type == wt
                       and tuple(r.attr("dims") or ()) == lead and r.name not in joint
                       and not set(dict(r.attrs)) - {"dims", *_PER_NODE}), None)
            grads = (None, s.name, db)  # the statement stands first: where x may die (the normalised x's)
            at = min([v for v in grads if v is not None] + [n.name, mul.name], key=index.__getitem__)
            if max(index[x], index[g]) > index[at]:
                continue
            joint_ = NormJoint(at, grads, (n.name, mul.name), (g, x, None), float(n.attr("eps")))
            for name in [v for v in grads if v is not None] + [n.name, mul.name]:
                out[name] = joint_
    return out


def _readers(program) -> dict:
    readers = {}
    for n in program.nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    return readers


def _joint_norm_grads(program):
    nodes = program.nodes
    index = {n.name: i for i, n in enumerate(nodes)}
    readers = {}
    for n in nodes:
        for v in n.inputs:
            readers.setdefault(v, []).append(n)
    outs = set(program.outputs)

    def only_reader(v):  # the one node reading value v (no program output), else None
        rs = readers.get(v, [])
        return rs[0] if len(rs) == 1 and v not in outs else None

    def token_sum(n, lead, ty):
        return (n.op == "sum" and _plain(n) and tuple(n.attr("dims") or ()) == lead and n.type == ty
                and not set(dict(n.attrs)) - {"dims", *_PER_NODE})

    out = {}
    for n in nodes:
        if n.op not in ("layer_norm_grad", "rms_norm_grad") or len(n.inputs) != 3 or not _plain(n):
            continue
        norm = n.op[:-len("_grad")]
        g, x, w = n.inputs
        eps, xt, wt = n.attr("eps"), program[x].type, program[w].type
        if program[g].type.dtype != xt.dtype or wt.dtype != xt.dtype:
            continue
        lead = tuple(range(xt.rank - 1))
        dw = db = None
        skipped = []
        for r in readers.get(g, []):
            if db is None and norm == "layer_norm" and token_sum(r, lead, wt):  # an RMS norm has no bias
                db = r.name
            elif dw is None and r.op == "mul" and _plain(r) and len(r.inputs) == 2 and g in r.inputs:
                xhat = program[r.inputs[1] if r.inputs[0] == g else r.inputs[0]]
                s = only_reader(r.name)
                if (xhat.op == norm and xhat.inputs == (x,) and xhat.attr("eps") == eps
                        and _plain(xhat) and only_reader(xhat.name) is r and s is not None
                        and token_sum(s, lead, wt)):
                    dw, skipped = s.name, [xhat.name, r.name]
        if dw is None and db is None:
            continue
        grads = (n.name, dw, db) if norm == "layer_norm" else (n.name, dw)
        at = min((gr for gr in grads if gr is not None), key=index.__getitem__)
        if max(index[x], index[w]) > index[at]:  # x or w made after the first gradient
            continue
        joint = NormJoint(at, grads, tuple(skipped), (g, x, w), float(eps), norm)
        for name in [gr for gr in grads if gr is not None] + skipped:
            out[name] = joint
    return out
