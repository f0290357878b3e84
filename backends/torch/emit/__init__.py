"""Emit a self-contained, readable ``program.py`` for torchrun from a compiled program.

The program is one rank's view of the local (per-rank) graph, top down: the header
docstring (model, spec, mesh, parcomp version, how to run it), then the model: constants
describing the mesh, one line per parameter slice, one line per graph node; then one line,
:data:`RUNTIME_MARK`, and the runtime: a PROFILE block (the only lines that depend on the
device profile), collectives written with ``torch.distributed`` (same semantics as
``parcomp/reference/interpreter.py``), checkpoint reading, and a ``main`` that checks the
world size, loads, runs, writes the outputs and optionally times forward steps.  Nothing in
it imports parcomp.  The text is deterministic: same input, same bytes.

Everything it prints comes from fields of the :class:`parcomp.compile.program.Program`:
a training program (``Program.train``) becomes ``train_step`` plus a loop:
``--steps K`` steps, each feeding its CARRIED outputs back as params and
optimizer state (the state starts at zeros), the step input set to 1..K (see
:mod:`parcomp_backends.torch.runtime`).  Variables are named after the model's modules where the
frontend knew them (``c_fc``, ``c_proj_matmul``), and every line a spec rule
caused ends with that rule's ``spec.pcs:LINE``.

This module assembles the program and writes its step function; the per-node text (op
tables, ``node_code``) is :mod:`.nodes`, the other sections (header, PROFILE block,
constants, loaders, value names) :mod:`.sections`.  Their names that callers import
from here (``OP_FORMATS``, ``node_code``, ``python_names``, ``EmitError``, ...) are re-exported.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps of a str

from parcomp.compile.program import Program, TrainLoop, no_cycle_collection
from parcomp.ir.ops import LAYOUT_OPS
from parcomp.ir.types import layout_str

from .attention import attention_sections, joint_grads, joint_targets, saved_forwards, saved_name
from .cp_ring import ring_comment, ring_sections
from .moe import moe_sections
from .moe_dropless import DROPLESS_EXCHANGE, dropless_plan
from .norms import kept_norm_stats, layer_norm_forward_code, runtime_sections, stash_norm_joints
from .reduce import reduce_sections
from .updates import update_plan
# the per-node text and the other sections (re-exported: callers import them from here)
from ..profiles import get_profile
from ..runtime import (CONSTANT_LOADER, FUNCTIONAL, IMPORTS, MAIN, ONNX_READER, RUNTIME, TIED_LOADER, TRAIN_MAIN,
                      TRAIN_RUNTIME)
from .nodes import (ASYNC_FORMATS, ATTR_DEFAULTS, IN_PLACE_FORMATS, OP_FORMATS, TORCH_DTYPES,  # noqa: F401
                    EmitError, node_code, py_literal)
from .sections import (COMMENT_WIDTH, RESERVED, RUNTIME_MARK, comment_lines, constants_section,  # noqa: F401
                       header_section, loaders_section, profile_block, python_names)

LOCAL_LAYOUT_OPS = ("shard_slice", "partial_mask")
_LAYOUT_OPS = frozenset(LAYOUT_OPS)


Training = TrainLoop  # the name this backend exported before the Program held the facts


def training_facts(compiled) -> TrainLoop | None:
    """The training loop facts of a compiled graph (or a Program), or None for a forward program."""
    return _program_of(compiled).train


def _program_of(compiled) -> Program:
    prog = compiled if isinstance(compiled, Program) else getattr(compiled, "program_", None)
    if not isinstance(prog, Program) or prog.graph.stage != "local" or prog.mesh is None:
        raise EmitError("emit_program needs a compiled graph (compile_graph) or its Program")
    return prog


def emit_program(compiled, profile="cpu", model: str | None = None, steps: int | None = None,
                 functional: bool = False, constants=()) -> str:
    """The text of ``program.py`` for ``compiled`` (a :class:`parcomp.compile.compiler.Compiled`).

    Args:
        compiled: a :class:`parcomp.compile.compiler.Compiled` (its ``program_``) or a
            :class:`parcomp.compile.program.Program`: the only facts this backend reads.
        profile: a name of :data:`PROFILES` or a :class:`DeviceProfile`.
        model: what the graph was imported from, for the header (e.g. ``models.py:torch_mlp``);
            a ``.onnx`` file's program also reads that file as its checkpoint.
        steps: a training program's default ``--steps``; default: the spec's
            (``Program.train.steps``). Ignored for forward programs.
        functional: collectives from ``torch.distributed._functional_collectives`` (new
            tensors, nothing in place), so ``program.py --compile`` captures whole steps.
        constants: names of params parcomp computed at import (not in the model's
            state_dict): the program reads each from ``--checkpoint`` if it holds it, else
            from ``constants.safetensors`` beside program.py (``program_files`` writes it).

    Returns:
        Python source, one statement per line, ending in a newline.

    Raises:
        EmitError: an op or dtype without a torch mapping.
        ValueError: unknown profile name.
    """
    with no_cycle_collection():  # parcomp/compile/gcpause.py: no cycles are made, none to collect
        return _emit(compiled, profile, model, steps, functional, constants)


def _emit(compiled, profile, model, steps, functional, constants) -> str:
    prof, prog = get_profile(profile), _program_of(compiled)
    if prog.pipeline is not None:  # a pp mesh axis: the pipelined program (pipeline_emit.py)
        from .pipeline import check_pipeline_profile, emit_pipeline_program, pipeline_emittable

        if pipeline_emittable(prog):  # else (tp inside a stage) the SPMD program, pp replicated
            check_pipeline_profile(prof)
            return emit_pipeline_program(prog, model, step_function, prof, constants)
    program, train = prog.graph, prog.train
    if train is not None and steps:
        train = replace(train, steps=int(steps))
    names = python_names(prog)
    runtime = TRAIN_RUNTIME if train else RUNTIME
    if model and model.endswith(".onnx"):
        runtime += "\n\n\n" + ONNX_READER
    head = header_section(prog, model, train) + "\n" + IMPORTS
    dropless = dropless_plan(prog, names)  # MoE layers on the routed tokens only (emit/moe_dropless.py)
    model_part = [constants_section(prog, train), loaders_section(prog, train, constants),
                  _forward(prog, names, train, dropless)]
    runtime_part = [profile_block(prof), runtime, *runtime_sections(program), *reduce_sections(program),
                    *moe_sections(program, dropless.active), *ring_sections(program), *attention_sections(program),
                    *([FUNCTIONAL] if functional else []),
                    *([CONSTANT_LOADER] if constants else []),
                    *([TIED_LOADER] if any(n.attr("aliases") for n in program.params) else []),
                    TRAIN_MAIN if train else MAIN]
    # top down: the header, this model, the one runtime line, the runtime (docs/ARCHITECTURE.md)
    return "\n\n\n".join(p.strip("\n") for p in [head, *model_part, RUNTIME_MARK, *runtime_part]) + "\n"


def _forward(prog, names, train, dropless=None) -> str:
    """The step function: one statement per node of the lowered program, in its order,
    then ``del`` of the values the node ``frees`` (parcomp/passes/lowering/lower.py);
    ``dropless``: the MoE statements on packed routed tokens (emit/moe_dropless.py)."""
    fn, doc = ("train_step", "One training step (forward, backward, update)") if train else (
        "forward", "One forward step on this rank")
    return step_function(prog, fn, f"{doc}: local slices in, {{output name: local value}} out.", names,
                         dropless=dropless)


def step_function(prog, fn: str, doc: str, names=None, pop_inputs: bool = False, dropless=None,
                  ready=(), stash=None) -> str:
    """``def fn(p, inp)`` computing ``prog``'s lowered graph: one statement per node, in its
    order, each ending in its layout, type and the spec rule that caused it; above each
    collective the comment saying why it is there and its bytes per rank; ``del`` of the
    values a node ``frees``. The SPMD program's step and each pipeline stage's functions
    (:mod:`.pipeline`) are printed by it. ``names``: value -> Python name (default
    :func:`python_names`); ``pop_inputs``: inputs are taken out of ``inp`` (the caller's
    dict) and deleted after their last reader, so a stage function frees a received
    activation or a stashed value as soon as it is read for the last time; ``dropless``: the
    MoE statements on packed routed tokens (emit/moe_dropless.py); ``ready``: public output
    names handed, each right after the statement making it final, to a third argument
    ``ready(name, value)`` (a pipeline stage's parameter gradients: their dp buckets start inside
    the backward); one no later statement reads is deleted after the call and not returned
    (:func:`_handed_over`); ``stash``: ``{node: key}``, attentions and layer norms whose forward and
    backward are two stage functions (:func:`.attention.stashed_forwards`,
    :func:`.norms.stashed_norms`): a forward ``sdpa`` or ``layer_norm`` returns its kernel's saved
    tensors as output ``saved.<key>`` (stashed per microbatch), the first ``sdpa_grad`` or the layer
    norm's gradient statement reads them as input ``<key>`` and deletes them once read."""
    names = python_names(prog) if names is None else names
    lines = [f"def {fn}(p, inp{', ready' if ready else ''}):", f'    """{doc}"""']
    final = {}  # value -> its public names of ``ready``
    for pub, v in prog.graph.named_outputs():
        if pub in ready:
            final.setdefault(v, []).append(pub)
    handed = _handed_over(prog.graph, final)
    packed = dropless.lines if dropless is not None else {}
    if dropless is not None and (dropless.active or dropless.why):
        lines += comment_lines(dropless.comment(), "    ")
    updates = update_plan(prog.graph, names)  # the optimizer's multi-tensor calls (emit/updates.py)
    if updates.alias:  # a fused update's values are its param's and state's variables
        names = {**names, **updates.alias}
    program, provenance, var_of = prog.graph, prog.provenance, names.__getitem__
    popped = _popped_inputs(program) if pop_inputs else {}
    kept = saved_forwards(program)  # attentions whose forward keeps its kernel's tensors (emit/attention.py)
    if kept:
        taken = set(names.values())
        kept = {n: saved_name(names[n if program[n].op == "sdpa" else kept[n]], taken) for n in kept}
    stash = stash or {}
    norm_stash = {n: k for n, k in stash.items() if program[n].op not in ("sdpa", "sdpa_grad")}
    stash = {n: k for n, k in stash.items() if n not in norm_stash}
    if stash:  # a new dict: saved_forwards' is the program's memo
        taken = set(names.values()) | set(kept.values())
        kept = {**kept, **{n: saved_name(names[n], taken) for n in stash}}
    block = program if program.stage == "local" else None  # per-rank: block offsets read COORD
    norm_joint = stash_norm_joints(program, norm_stash)  # a layer norm's gradients in one statement (emit/norms.py)
    unmade = {names[s] for j in norm_joint.values() for s in j.skipped}  # values no statement makes
    norm_stats = kept_norm_stats(program)  # forward layer norms keeping (mean, rstd) for that statement
    if norm_stats or norm_stash:
        taken = set(names.values()) | set(kept.values())
        norm_stats = {n: saved_name(names[n if program[n].op == "layer_norm" else norm_stats[n]], taken)
                      for n in norm_stats}
        taken |= set(norm_stats.values())
        norm_stats.update({n: saved_name(names[n], taken) for n in norm_stash})
    pending = []  # the dead values of a multi-tensor update group, deleted after its last node
    tails = {}  # (id(layout), id(type)) -> "  # [S(0), R] f32[8,32]": nodes share these objects
    for n in program.nodes:
        op = n.op
        tail = tails.get((id(n.layout), id(n.type)))
        if tail is None:
            tail = tails[id(n.layout), id(n.type)] = (f"  # {layout_str(n.layout)} {n.type}"
                                                      if n.layout is not None else f"  # {n.type}")
        ref = provenance[n.name].spec_ref
        if ref:  # as _spec_ref, after a "; "
            tail += f"; {ref}"
        var = names[n.name]
        if op == "input" or op == "param":
            key = _json_str(n.name)
            take = f"p[{key}]" if op == "param" else f"inp.pop({key})" if pop_inputs else f"inp[{key}]"
            lines.append(f"    {var} = {take}{tail}")
            lines += [f"    {text}" for text in packed.get(n.name) or ()]  # a stashed MoE's route plan
            lines += [f"    ready({_json_str(pub)}, {var})" for pub in final.get(n.name, ())]
            if n.name in handed:
                lines.append(f"    del {var}")
            continue
        if op in _LAYOUT_OPS:
            lines += _layout_comment(program, n, prog.collective(n.name), names, n.name in packed)
        first, parts = joint_grads(program).get(n.name, (None, None))
        joint = norm_joint.get(n.name)
        if first is not None and first != n.name:
            lines.append(f"    # {var}: computed above with {names[first]} (one backward of the attention)")
        elif joint is not None and n.name in joint.skipped and joint.at != n.name:
            lines.append(f"    # {var}: not needed (the {joint.words}'s backward at {names[joint.at]} "
                         "gives its weight gradient)")
        elif joint is not None and joint.at != n.name:
            lines.append(f"    # {var}: computed above with {names[joint.at]} (one backward of the {joint.words})")
        else:
            lines += [c for text in ring_comment(prog, n, n.name in kept) for c in comment_lines(text, "    ")]
        if n.name in updates.skipped:  # one multi-tensor call for its group, at the first
            lines += updates.lines.get(n.name, ())
        elif packed.get(n.name) is not None:  # an MoE statement on the routed tokens only
            lines += [f"    {text}" for text in packed[n.name][:-1]] + [f"    {packed[n.name][-1]}{tail}"]
        elif first == n.name:  # one attention's gradients in one statement (emit/attention.py)
            if n.name in stash:  # its forward's kernel tensors, from the microbatch's stash
                lines.append(f"    {kept[n.name]} = inp.pop({_json_str(stash[n.name])})"
                             "  # the forward kernel's output and logsumexp")
            lines.append(f"    {joint_targets(program, first, names)} = "
                         f"{node_code(n, list(map(var_of, n.inputs)), block, parts, kept.get(n.name))}{tail}")
        elif n.name in kept:  # a forward attention keeping what its backward reads
            lines.append(f"    {var}, {kept[n.name]} = "
                         f"{node_code(n, list(map(var_of, n.inputs)), block, saved=kept[n.name])}{tail}")
        elif joint is not None:  # one layer norm's gradients in one statement, at the first
            if joint.at == n.name and n.name in norm_stash:  # its forward's mean and rstd, from the stash
                lines.append(f"    {norm_stats[n.name]} = inp.pop({_json_str(norm_stash[n.name])})"
                             "  # the forward kernel's mean and rstd")
            if joint.at == n.name:
                lines.append(f"    {joint.code(var_of, norm_stats.get(n.name))}{tail}")
        elif n.name in norm_stats:  # a forward layer norm keeping its kernel's mean and rstd
            lines.append(f"    {var}, {layer_norm_forward_code(n, list(map(var_of, n.inputs)), norm_stats[n.name])}"
                         f"{tail}")
        elif first is None:
            lines.append(f"    {var} = {node_code(n, list(map(var_of, n.inputs)), block)}{tail}")
        frees = n.attr("frees").split() if n.attr("frees") else []
        if frees and updates.skipped:  # values no statement made; buffers a fused value took over
            frees = [v for v in frees if v not in updates.unmade and v not in updates.kept]
        frees = list(map(var_of, frees))
        frees += map(var_of, popped.get(n.name, []))
        if unmade:
            frees = [v for v in frees if v not in unmade]
        if joint is not None and joint.at == n.name and n.name in norm_stats:  # the kept mean, rstd, read
            frees.append(norm_stats[n.name])
        if first == n.name and n.name in kept:  # the kernel's saved tensors, read
            frees.append(kept[n.name])
        if n.name in updates.skipped:  # a multi-tensor call's dead values: one del after its group
            pending, frees = pending + frees, []
            if n.name in updates.ends:
                frees, pending = pending, []
        if frees:
            lines.append("    del " + ", ".join(frees))
        lines += [f"    ready({_json_str(pub)}, {var})" for pub in final.get(n.name, ())]
        if n.name in handed:
            lines.append(f"    del {var}")
    ret = ", ".join([f"{json.dumps(pub)}: {names[v]}" for pub, v in program.named_outputs() if v not in handed]
                    + [f"{_json_str('saved.' + key)}: {kept[v]}" for v, key in stash.items()
                       if program[v].op == "sdpa"]
                    + [f"{_json_str('saved.' + key)}: {norm_stats[v]}" for v, key in norm_stash.items()
                       if v not in norm_joint])  # a forward layer norm's, not a gradient statement's
    lines.append(f"    return {{{ret}}}")
    return "\n".join(lines)


def _handed_over(program, final) -> set:
    """The values of ``final`` (value -> its public names handed to ``ready``) that ``ready``
    takes for good: every public name of the value is handed over and no statement after the
    one making it reads it. The function deletes each after its ``ready`` and leaves it out of
    its returned dict, so a microbatch's gradient, once added to the step's sums, is freed at
    once rather than held until the backward returns (a third set of gradients at the peak)."""
    if not final:
        return set()
    publics, made, last = {}, {}, {}
    for _, v in program.named_outputs():
        publics[v] = publics.get(v, 0) + 1
    for i, n in enumerate(program.nodes):
        made[n.name] = i
        for v in n.inputs:
            last[v] = i
    return {v for v, pubs in final.items() if len(pubs) == publics[v] and last.get(v, -1) <= made[v]}


def _popped_inputs(program) -> dict:
    """``{node: [inputs whose last reader it is]}`` (inputs that are no output)."""
    outs, last = set(program.outputs), {}
    inputs = {n.name for n in program.inputs} - outs
    for n in program.nodes:
        for v in n.inputs:
            if v in inputs:
                last[v] = n.name
    out = {}
    for v, reader in last.items():
        out.setdefault(reader, []).append(v)
    return out


def _layout_comment(program, n, record, names, dropless=False) -> list:
    """The comment above a layout change: kind, axis, layouts, bytes, the reason (whose spec
    references are basenames: no machine path reaches a program), a value it names written
    as the program's variable (``%linear_1_mm`` -> ``_2_dense``) where the program has it."""
    src = program[n.inputs[0]]
    reason = record.reason if record else n.attr("reason", "")
    reason = re.sub(r"%([\w.]+)", lambda m: names.get(m.group(1), m.group(0)), reason)
    if dropless:  # the packed exchange of emit/moe_dropless.py
        reason = reason.split("; ragged:")[0] + DROPLESS_EXCHANGE
    change = f"{layout_str(src.layout)} -> {layout_str(n.layout)}"
    if n.op in LOCAL_LAYOUT_OPS:
        head = f"{n.op} over {n.attr('axis')} {change} (local, no communication):"
    else:
        nbytes = record.bytes if record else "?"
        head = f"{n.op} over {n.attr('axis')} {change}, bytes/rank {nbytes}:"
    return comment_lines(f"{head} {reason}", "    ")
