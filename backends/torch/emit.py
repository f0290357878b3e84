"""Emit a self-contained, readable ``program.py`` for torchrun from a compiled program.

The program is one rank's view of the local (per-rank) graph: a PROFILE block
(the only lines that depend on the device profile), constants describing the
mesh, a small runtime of collectives written with ``torch.distributed`` (same
semantics as ``parcomp/reference/interpreter.py``), one line per parameter
slice, one line per graph node, and a ``main`` that checks the world size,
loads, runs, writes the outputs and optionally times forward steps.  Nothing in
it imports parcomp.  The text is deterministic: same input, same bytes.

Everything it prints comes from fields of the :class:`parcomp.program.Program`:
a training program (``Program.train``) becomes ``train_step`` plus a loop:
``--steps K`` steps, each feeding its CARRIED outputs back as params and
optimizer state (the state starts at zeros), the step input set to 1..K (see
:mod:`.runtime`).  Variables are named after the model's modules where the
frontend knew them (``c_fc``, ``c_proj_matmul``), and every line a spec rule
caused ends with that rule's ``spec.pcs:LINE``.
"""
from __future__ import annotations

import builtins
import json
import keyword
import math
import re
import textwrap
from dataclasses import replace
from json.encoder import encode_basestring_ascii as _json_str  # json.dumps of a str

from parcomp.ir.ops import LAYOUT_OPS
from parcomp.ir.types import DTYPE_SHORT, Partial, Replicate, layout_str, shard_axes
from parcomp.program import MAX_STEPS, ParcompError, Program, TrainLoop, no_cycle_collection, plural

from .emit_cp import Q_OPERAND, cp_kw  # context parallel (issue 14); Q_OPERAND: sdpa, sdpa_grad
from .emit_cp_ring import (HELPER_NAMES as RING_HELPERS, RING_FORMATS, balance_src, ring_comment, ring_key, ring_kw,
                           ring_sections)
from .emit_norms import HELPER_NAMES as NORM_HELPERS, NORM_FORMATS, norm_kw, runtime_sections
from .emit_moe import HELPER_NAMES as MOE_HELPERS, MOE_DEFAULTS, MOE_FORMATS, moe_key, moe_sections  # issue 14
from .emit_reduce import (ASYNC_REDUCE, HELPER_NAMES as REDUCE_HELPERS, IN_PLACE_REDUCE, REDUCE_FORMATS, reduce_key, reduce_kw,
                          reduce_sections)
from .emit_text import wrap
from .emit_cluster import CLUSTER_NAMES, cluster_constants
from .profiles import get_profile
from .runtime import (CLUSTER_HELP, CONSTANT_LOADER, FORWARD_HELP, FUNCTIONAL, IMPORTS, MAIN, ONNX_READER, RUNTIME,
                      TIED_LOADER, TRAIN_HELP, TRAIN_MAIN, TRAIN_RUNTIME)

# op -> format string; {0}, {1}: operand variables, {name}: attribute as a Python literal
OP_FORMATS = {
    "relu": "torch.relu({0})",
    "gelu": "torch.nn.functional.gelu({0}, approximate={approximate})",
    "tanh": "torch.tanh({0})",
    "exp": "torch.exp({0})",
    "sigmoid": "torch.sigmoid({0})",
    "silu": "torch.nn.functional.silu({0})",
    "pow": "torch.pow({0}, {exponent})",
    "add_scalar": "{0} + {value}",
    "neg": "torch.neg({0})",
    "scale": "{0} * {value}",
    "add": "{0} + {1}",
    "sub": "{0} - {1}",
    "mul": "{0} * {1}",
    "div": "{0} / {1}",
    "matmul": "torch.matmul({0}, {1})",
    "permute": "{0}.permute{perm}",
    "reshape": "{0}.reshape({local_shape})",
    "sum": "torch.sum({0}, dim={dims})",  # dims=() is the identity (see _code)
    "expand": "{0}.reshape({kept_shape}).expand({local_shape})",
    "ones": "torch.ones({local_shape}, dtype={dtype}, device=DEVICE)",
    "relu_grad": "{0} * ({1} > 0).to({0}.dtype)",
    "tanh_grad": "{0} * (1 - {1} * {1})",
    "sigmoid_grad": "{0} * {1} * (1 - {1})",
    "silu_grad": "{0} * torch.sigmoid({1}) * (1 + {1} * (1 - torch.sigmoid({1})))",
    "pow_grad": "{0} * {exponent} * torch.pow({1}, {exponent} - 1)",
    "gelu_grad": "torch.ops.aten.gelu_backward({0}, {1}, approximate={approximate})",
    "cross_entropy": ("torch.nn.functional.cross_entropy({0}.reshape(-1, {0}.shape[-1]), {1}.reshape(-1), "
                      'reduction="none").reshape({local_shape})'),
    "cross_entropy_grad": ("{0}.unsqueeze(-1) * (torch.softmax({1}, dim=-1) - "
                           "torch.nn.functional.one_hot({2}, {1}.shape[-1]).to({1}.dtype))"),
    # torch.optim.AdamW's update (numpy_ops._adamw): decay, then m / (sqrt(v) / sqrt(bc2) + eps)
    "adamw_param": ("{0} * (1 - {lr} * {weight_decay}) - {lr} / (1 - {beta1} ** {3}) * {1} "
                    "/ (torch.sqrt({2}) / torch.sqrt(1 - {beta2} ** {3}) + {eps})"),
    "all_reduce": "all_reduce({0}, {axis})",
    "all_gather": "all_gather({0}, {dim}, {axis})",
    "reduce_scatter": "reduce_scatter({0}, {dim}, {axis})",
    "all_to_all": "all_to_all({0}, {src_dim}, {dim}, {axis})",
    "shard_slice": "shard_slice({0}, {dim}, {axis})",
    "partial_mask": "partial_mask({0}, {axis})",
    "relayout": "{0}",
    # lowered ops (parcomp/passes/lower.py)
    "dense": "torch.nn.functional.linear({args})",
    "addmm": "torch.addmm({0}, {1}, {2})",
    "matmul_t": "torch.matmul({1}.t(), {0}.t())",
    "add_scaled": "torch.add({0}, {1}, alpha={b})",
    "axpby": "torch.add({0} * {a}, {1}, alpha={b})",
    "mse_sum": 'torch.nn.functional.mse_loss({0}, {1}, reduction="sum")',
    "mse_grad": "({1} - {2}).mul_({0} * 2.0)",
    "wait": "wait({0})",
    # ---- attention part (issue 17): views, sdpa, RoPE pointwise ops ----
    "slice": "torch.ops.aten.slice({0}, {dim}, {start}, {stop}, {step})",
    "slice_grad": ("torch.ops.aten.slice_scatter(torch.zeros({local_shape}, dtype={dtype}, device=DEVICE), "
                   "{0}, {dim}, {start}, {stop}, {step})"),
    "cat": "torch.cat(({args},), dim={dim})",
    # loss part (issue 17): a constant pad of one dim (moved last for F.pad, then back)
    "pad": "torch.nn.functional.pad({0}.movedim({dim}, -1), ({before}, {after}), value={value}).movedim(-1, {dim})",
    "sdpa": "torch.nn.functional.scaled_dot_product_attention({0}, {1}, {2}, {mask_args}, scale={scale})",
    "sdpa_grad": ("torch.func.vjp(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention("
                  "q, k, v, {mask_args}, scale={scale}), {1}, {2}, {3})[1]({0})[{wrt_index}]"),
    "cos": "torch.cos({0})",
    "sin": "torch.sin({0})",
    "cast": "{0}.to({dtype})",
    "arange": "torch.arange({local_shape}[0], dtype=torch.float64, device=DEVICE).mul({step}).add({start}).to({dtype})",
    # ---- end of the attention part ----
    "clip_coef": "torch.clamp({max_norm} / (torch.sqrt({0}) + 1e-6), max=1.0)",  # issue 13
    "grad_upcast": "{0}.float()",  # issue 13, mixed precision: the gradient widened before its reduction
    "nonfinite": "(~torch.isfinite({0})).float()",  # issue 13: fp16 loss scaling (parcomp/passes/amp.py)
    "amp_select": "torch.where({0} > 0, {2}, {1})",
    "amp_ratio": "torch.where({0} > 0, {1} * 0.5 - 0.5, torch.where({2} + 1 >= {interval}, {1} * 2 + 1, {1}))",
    "amp_tracker": "torch.where(({0} > 0) | ({1} + 1 >= {interval}), torch.zeros_like({1}), {1} + 1)",
    **NORM_FORMATS,  # norms + embedding part (issue 17): backends/torch/emit_norms.py
    **REDUCE_FORMATS,  # reductions part (issue 17): backends/torch/emit_reduce.py
    **MOE_FORMATS,  # expert parallel MoE (issue 14): backends/torch/emit_moe.py
    **RING_FORMATS,  # ring attention (issue 14): backends/torch/emit_cp_ring.py
}
# ``inplace=true``: the result is written into the first operand (torch.optim's own updates)
IN_PLACE_FORMATS = {
    "all_reduce": "all_reduce_({0}, {axis})",
    "add": "{0}.add_({1})",
    "add_scaled": "{0}.add_({1}, alpha={b})",
    "axpby": "{0}.mul_({a}).add_({1}, alpha={b})",
    "adamw_param": ("{0}.mul_(1 - {lr} * {weight_decay}).sub_({lr} / (1 - {beta1} ** {3}) * {1} "
                    "/ (torch.sqrt({2}) / torch.sqrt(1 - {beta2} ** {3}) + {eps}))"),
    **IN_PLACE_REDUCE,
}
# ``async_op=true``: start the collective, ``wait`` returns its value (key + "_": in place)
ASYNC_FORMATS = {"all_reduce": "all_reduce_start({0}, {axis})", "all_reduce_": "all_reduce_start_({0}, {axis})",
                 **ASYNC_REDUCE}
ATTR_DEFAULTS = {"gelu": {"approximate": "none"}, "gelu_grad": {"approximate": "none"},
                 # attention part (issue 17)
                 **{op: {"causal": False} for op in ("sdpa", "sdpa_grad")},
                 **{op: {"step": 1} for op in ("slice", "slice_grad")}, "arange": {"start": 0, "step": 1},
                 **MOE_DEFAULTS}  # issue 14
LOCAL_LAYOUT_OPS = ("shard_slice", "partial_mask")
_LAYOUT_OPS = frozenset(LAYOUT_OPS)
_NON_WORD = re.compile(r"\W")
TORCH_DTYPES = {"float32": "torch.float32", "float64": "torch.float64", "float16": "torch.float16",
                "bfloat16": "torch.bfloat16", "int64": "torch.int64", "int32": "torch.int32",
                "bool": "torch.bool"}
COMMENT_WIDTH = 108

_TOP_NAMES = set(re.findall(r"^(?:def )?([A-Za-z_]\w*)", RUNTIME + MAIN + TRAIN_MAIN + ONNX_READER
                            + FUNCTIONAL + CONSTANT_LOADER + TIED_LOADER, re.M)) | {"funcol"}
RESERVED = (set(keyword.kwlist) | set(dir(builtins)) | _TOP_NAMES
            | {"torch", "dist", "p", "inp", "argparse", "importlib", "json", "math", "os", "sys", "time",
               "PROFILE", "DIST_BACKEND", "PRELUDE", "profile_device", "MESH", "GROUP_RANKS",
               "PARAMS", "INPUTS", "OUTPUT_LAYOUTS", "OUTPUT_GLOBAL_SHAPES", "SHARDED_OUTPUT",
               "RUN_HINT", "load_params", "load_inputs", "forward", "STATE", "CARRIED", "STEP_INPUT",
               "TRAIN_STEPS", "MAX_STEPS", "train_step"} | set(NORM_HELPERS) | set(REDUCE_HELPERS) | set(MOE_HELPERS)
            | set(RING_HELPERS)
            | set(CLUSTER_NAMES))


class EmitError(ParcompError):
    """The program cannot be emitted (an op or dtype the torch backend has no entry for)."""


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
    """The text of ``program.py`` for ``compiled`` (a :class:`parcomp.compiler.Compiled`).

    Args:
        compiled: a :class:`parcomp.compiler.Compiled` (its ``program_``) or a
            :class:`parcomp.program.Program`: the only facts this backend reads.
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
    with no_cycle_collection():  # parcomp/gcpause.py: no cycles are made, none to collect
        return _emit(compiled, profile, model, steps, functional, constants)


def _emit(compiled, profile, model, steps, functional, constants) -> str:
    prof, prog = get_profile(profile), _program_of(compiled)
    if prog.pipeline is not None:  # a pp mesh axis: the pipelined program (pipeline_emit.py)
        from .pipeline_emit import check_pipeline_profile, emit_pipeline_program, pipeline_emittable

        if pipeline_emittable(prog):  # else (tp inside a stage) the SPMD program, pp replicated
            check_pipeline_profile(prof.name)
            return emit_pipeline_program(prog, model, _code)
    program, train = prog.graph, prog.train
    if train is not None and steps:
        train = replace(train, steps=int(steps))
    names = _names(prog)
    runtime = TRAIN_RUNTIME if train else RUNTIME
    if model and model.endswith(".onnx"):
        runtime += "\n\n\n" + ONNX_READER
    parts = [_profile_block(prof), _constants(prog, train), runtime, *runtime_sections(program),
             *reduce_sections(program), *moe_sections(program), *ring_sections(program), *([FUNCTIONAL] if functional else []),
             *([CONSTANT_LOADER] if constants else []),
             *([TIED_LOADER] if any(n.attr("aliases") for n in program.params) else []),
             _loaders(prog, train, constants), _forward(prog, names, train), TRAIN_MAIN if train else MAIN]
    head = _header(prog, model, train) + "\n" + IMPORTS
    return "\n\n\n".join(p.strip("\n") for p in [head] + parts) + "\n"


def _py(v) -> str:
    """A Python literal for an attribute value."""
    if type(v) is str:  # the most common: json.dumps(v)'s own encoder, without its set-up
        return _json_str(v)
    if isinstance(v, bool) or isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else f'float("{v}")'
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, tuple):
        return repr(tuple(int(x) for x in v))
    raise EmitError(f"attribute value {v!r} has no Python form")


def _names(prog) -> dict:
    """value name -> unique Python identifier (sanitized, no keywords/builtins).

    A node the frontend traced inside a model module is named after the module
    path (``c_fc``; the module's earlier nodes ``c_fc_<op>``), any other after its value.
    """
    out, taken, program = {}, set(), prog.graph
    bases = _module_bases(prog)
    for n in program.nodes:
        base = _NON_WORD.sub("_", bases.get(n.name, n.name)) or "v"
        if base[0].isdigit():
            base = "_" + base
        if base in RESERVED:
            base += "_"
        cand, k = base, 1
        while cand in taken:
            cand, k = f"{base}_{k}", k + 1
        taken.add(cand)
        out[n.name] = cand
    return out


def _module_bases(prog) -> dict:
    """value -> ``path`` for the last computing node of each module path, ``path_op`` for its
    other nodes and its collectives (which may sit far from the module, where a value is used)."""
    by_path, out = {}, {}
    for n in prog.graph.nodes:
        path = prog.provenance[n.name].source
        if not path or n.op in ("input", "param", "relayout"):
            continue
        if n.op in LAYOUT_OPS:
            out[n.name] = f"{path}_{n.op}"
        else:
            by_path.setdefault(path, []).append(n)
    for path, nodes in by_path.items():
        out.update({n.name: f"{path}_{n.op}" for n in nodes[:-1]})
        out[nodes[-1].name] = path
    return out


def _spec_ref(prog, name) -> str:
    """``"  # spec.pcs:LINE"`` for a line the spec rule at that line caused, else ``""``."""
    ref = prog.provenance[name].spec_ref
    return f"  # {ref}" if ref else ""


def _global_shape(program, node) -> tuple:
    shape = list(node.attr("global_shape") or node.type.shape)
    if node.attr("global_shape") is None:
        for a, p in enumerate(node.layout):
            if hasattr(p, "dim"):
                shape[p.dim] *= program.mesh.sizes[a]
    return tuple(shape)


def _header(prog, model, train) -> str:
    program, mesh, colls, spec_name = prog.graph, prog.mesh, prog.collectives, prog.spec_name
    total = sum(c.bytes for c in colls)
    kinds = ", ".join(f"{c.kind} over {c.axis}" + (f" ({c.phase})" if train else "")
                      for c in colls) or "none"
    sharded = not _all_replicated(program)
    out = ("rank 0 writes {output name: full tensor}" if not sharded else
           "every rank r writes FILE with .rank{r} before the suffix: its slices, layouts, global shapes")
    steps = textwrap.wrap(f"collectives per {'training' if train else 'forward'} step: {len(colls)}, "
                          f"{total} bytes/rank in all: {kinds}", 96, subsequent_indent="    ")
    lines = [
        f"program.py: one rank's {'training steps' if train else 'forward pass'}, emitted by parcomp "
        "(torch backend). Do not edit.",
        "",
        f"model: {(model or 'a parcomp graph').replace(chr(34) * 3, '')}",
        f"spec:  {spec_name or '(none recorded)'}",
        f"mesh:  {mesh} ({plural(mesh.size, 'rank')}; row-major, the last axis varies fastest)",
        *steps,
        "",
        "Run one process per rank:",
        f"    {_run_hint(program, model)} [--device cpu]",
        "",
        *(TRAIN_HELP if train else FORWARD_HELP).format(
            out=out, steps=train and train.steps, cluster=CLUSTER_HELP,
            step=f"; input {train.step} = k" if train and train.step else "").split("\n"),
    ]
    return '"""' + "\n".join(lines) + '\n"""'


def _run_hint(program, model=None) -> str:
    args = []
    if program.params:
        onnx = model and model.endswith(".onnx")
        args.append(f"--checkpoint {model.rsplit('/', 1)[-1] if onnx else 'model.pt'}")
    if program.inputs:
        args.append("--input " + ("x.pt" if len(program.inputs) == 1 else "inputs.pt"))
    args.append("--output out.pt")
    return f"torchrun --nproc-per-node {program.mesh.size} program.py " + " ".join(args)


def _profile_block(prof) -> str:
    lines = [f"# ---- PROFILE {prof.name}: the only lines that differ between device profiles ----",
             f"PROFILE = {json.dumps(prof.name)}",
             f"DIST_BACKEND = {json.dumps(prof.dist_backend)}",
             f"PRELUDE = {_py_tuple(prof.prelude)}  # imported first; skipped under --device cpu",
             f"BIND_DEVICE_ID = {prof.bind_device_id}  # init_process_group(device_id=DEVICE)",
             "LAUNCH_ENV = (  # --print-launch: set on every node before torchrun",
             *(f"    {json.dumps(line)}," for line in prof.launch_env), ")",
             "", "",
             "def profile_device():",
             f'    """Bind this process to its device under profile {prof.name} and return it."""']
    if prof.check:
        lines += [f"    if not ({prof.check}):", f"        fail(f{json.dumps(prof.check_message)})"]
    if prof.set_device:
        lines.append(f"    {prof.set_device}")
    lines += [f"    {line}" for line in prof.policy]  # cuda: TF32 off (issue 16)
    if prof.dtype_check:
        lines += [f"    if not ({prof.dtype_check}):", f"        fail(f{json.dumps(prof.dtype_message)})"]
    lines += [f"    return torch.device({prof.device})", "# ---- end of PROFILE ----"]
    return "\n".join(lines)


def _py_tuple(xs) -> str:
    xs = [json.dumps(x) for x in xs]
    return f"({xs[0]},)" if len(xs) == 1 else "(" + ", ".join(xs) + ")"


def _all_replicated(program) -> bool:
    return all(isinstance(p, Replicate) for o in program.outputs for p in program[o].layout)


def _constants(prog, train) -> str:
    program, mesh = prog.graph, prog.mesh
    groups = {a: prog.group_ranks(a) for a in prog.groups}  # mesh axes, then joint groups "dp,tp"
    outs = program.named_outputs()
    lines = [
        f"MESH = {json.dumps(dict(mesh.axes))}  # mesh axes in order; ranks are row-major",
        f"GROUP_RANKS = {json.dumps(groups)}  # each axis's rank groups, in coordinate order",
        f"PARAMS = {_py_tuple(n.name for n in program.params)}",
        f"INPUTS = {_py_tuple(n.name for n in _data_inputs(program, train))}",
        f"OUTPUT_LAYOUTS = {json.dumps({pub: layout_str(program[v].layout) for pub, v in outs})}",
        "OUTPUT_GLOBAL_SHAPES = " + json.dumps(
            {pub: list(_global_shape(program, program[v])) for pub, v in outs}),
        f"SHARDED_OUTPUT = {not _all_replicated(program)}  # True: every rank writes its own slices",
        f"RUN_HINT = {json.dumps(_run_hint(program))}",
        *cluster_constants(prog),
    ]
    if train:
        lines += ["# optimizer state: zeros at step 1 (--replay files carry it)",
                  *_wrap(f"STATE = {_py_tuple(train.state)}"),
                  "# outputs named like params: the next step's params and state",
                  *_wrap(f"CARRIED = {_py_tuple(train.carried)}"),
                  f"STEP_INPUT = {json.dumps(train.step) if train.step else None}"
                  "  # fed the step number k = 1..K (0-d float32)",
                  f"TRAIN_STEPS = {train.steps}  # default of --steps",
                  f"MAX_STEPS = {MAX_STEPS:_}  # the most --steps allows (as a spec's steps=)"]
    return "\n".join(lines)


def _wrap(line: str) -> list:
    """A long ``NAME = (...)`` assignment as lines of at most 108 characters."""
    return wrap(line, COMMENT_WIDTH, "", "    ")


def _data_inputs(program, train) -> list:
    """The inputs read from ``--input`` (a training program sets its step input itself)."""
    return [n for n in program.inputs if not train or n.name != train.step]


def _slice_expr(program, node, src: str) -> tuple:
    """(expression for this rank's block of the full tensor ``src``, comment)."""
    mesh, gshape = program.mesh, _global_shape(program, node)
    expr, what = src, []
    for d, size in enumerate(gshape):
        axes = shard_axes(node.layout, d)
        if not axes:
            continue
        index, chunk = None, size
        for a in axes:  # first mesh axis outer (parcomp.ir.types.shard_offsets)
            chunk //= mesh.sizes[a]
            index = f"COORD[{a}]" if index is None else f"{_paren(index)} * {mesh.sizes[a]} + COORD[{a}]"
        expr += f".narrow({d}, {_paren(index)} * {chunk}, {chunk})"
        unit = {0: "rows", 1: "columns"}.get(d, "entries") if len(gshape) == 2 else "entries"
        over = " then ".join(mesh.names[a] for a in axes) + (" (outer first)" if len(axes) > 1 else "")
        what.append(f"dim {d} split over {over}: "
                    f"this rank's {chunk} of {size} {unit}")
    for a, p in enumerate(node.layout):
        if isinstance(p, Partial):
            what.append(f"partial over {mesh.names[a]}: coordinate 0 keeps it, others zeros")
    return expr, "; ".join(what) or "replicated: every rank keeps all of it"


def _paren(expr: str) -> str:
    return f"({expr})" if "+" in expr else expr


def _loaders(prog, train, constants=()) -> str:
    program, out, state = prog.graph, [], train.state if train else ()
    for fn, kind, nodes, arg in (("load_params", "param", program.params, "ckpt"),
                                 ("load_inputs", "input", _data_inputs(program, train), "feeds")):
        doc = {"param": "parameter", "input": "input"}[kind]
        lines = [f"def {fn}({arg}):",
                 f'    """This rank\'s slice of every {doc}, on DEVICE (full tensors are not kept)."""',
                 "    out = {}"]
        for n in nodes:
            if n.type.dtype not in TORCH_DTYPES:
                raise EmitError(f"{kind} {n.name!r} has dtype {n.type.dtype}, which has no torch name")
            full = _global_shape(program, n)
            head = f"{n.name}: full {_ty(n.type.dtype, full)} {layout_str(n.layout)} -> {n.type}; "
            key = json.dumps(n.name)
            take = "take_constant" if kind == "param" and n.name in constants else "take"
            if kind == "param" and n.attr("aliases"):  # a tied weight: any of its names
                take, key = "take_tied", "(" + ", ".join(map(json.dumps, (n.name, *n.attr("aliases").split(",")))) + ")"
            src = f"{take}({arg}, {key}, {full!r}, {TORCH_DTYPES[n.type.dtype]})"
            if n.attr("stored_shape"):  # a fused weight: stored whole, viewed per part (issue 17)
                src = _view_of(f"{take}({arg}, {key}, {tuple(n.attr('stored_shape'))!r}, "
                               f"{TORCH_DTYPES[n.type.dtype]})", n.attr("stored_shape"), full)
                head += f"stored {_ty(n.type.dtype, n.attr('stored_shape'))}, viewed per part; "
            sliced, what = _slice_expr(program, n, balance_src(program, n, src))  # issue 14
            expr = f"place({sliced})"
            for a, p in enumerate(n.layout):
                if p == Partial("sum"):  # a P(max) source: every rank keeps it
                    expr = f"partial_mask({expr}, {json.dumps(program.mesh.names[a])})"
            if n.name in state:  # optimizer state: the checkpoint's (--replay), else zeros
                lines += _comment(f"{head}optimizer state: zeros at step 1 unless the checkpoint "
                                  f"holds it (--replay); {what}", "    ")
                lines += [f"    out[{json.dumps(n.name)}] = ({expr} if {json.dumps(n.name)} in {arg} "
                          f"else", f"        torch.zeros({tuple(n.type.shape)!r}, "
                          f"dtype={TORCH_DTYPES[n.type.dtype]}, device=DEVICE))"]
                continue
            lines += _comment(head + what, "    ")
            lines.append(f"    out[{json.dumps(n.name)}] = {expr}{_spec_ref(prog, n.name)}")
        lines.append("    return out")
        out.append("\n".join(lines))
    return "\n\n\n".join(out)


def _ty(dtype, shape) -> str:
    return f"{DTYPE_SHORT.get(dtype, dtype)}[{','.join(str(s) for s in shape)}]"


def _comment(text: str, indent: str) -> list:
    return wrap(text, COMMENT_WIDTH, indent + "# ", indent + "#   ")  # textwrap.wrap's lines


def _forward(prog, names, train) -> str:
    """The step function: one statement per node of the lowered program, in its order,
    then ``del`` of the values the node ``frees`` (parcomp/passes/lower.py)."""
    fn, doc = ("train_step", "One training step (forward, backward, update)") if train else (
        "forward", "One forward step on this rank")
    lines = [f"def {fn}(p, inp):", f'    """{doc}: local slices in, {{output name: local value}} out."""']
    program, provenance, var_of = prog.graph, prog.provenance, names.__getitem__
    tails = {}  # (id(layout), id(type)) -> "  # [S(0), R] f32[8,32]": nodes share these objects
    for n in program.nodes:
        op = n.op
        tail = tails.get((id(n.layout), id(n.type)))
        if tail is None:
            tail = tails[id(n.layout), id(n.type)] = f"  # {layout_str(n.layout)} {n.type}"
        ref = provenance[n.name].spec_ref
        if ref:  # as _spec_ref, after a "; "
            tail += f"; {ref}"
        var = names[n.name]
        if op == "input" or op == "param":
            src = "p" if op == "param" else "inp"
            lines.append(f"    {var} = {src}[{_json_str(n.name)}]{tail}")
            continue
        if op in _LAYOUT_OPS:
            lines += _layout_comment(program, n, prog.collective(n.name), names)
        lines += [c for text in ring_comment(prog, n) for c in _comment(text, "    ")]  # issue 14
        lines.append(f"    {var} = {_code(n, list(map(var_of, n.inputs)), program)}{tail}")
        frees = n.attr("frees")
        if frees:
            lines.append("    del " + ", ".join(map(var_of, frees.split())))
    ret = ", ".join(f"{json.dumps(pub)}: {names[v]}" for pub, v in program.named_outputs())
    lines.append(f"    return {{{ret}}}")
    return "\n".join(lines)


def _code(n, args, program=None) -> str:
    """The right-hand side computing node ``n`` from operand variables ``args``
    (``inplace``: :data:`IN_PLACE_FORMATS`; ``async_op``: :data:`ASYNC_FORMATS`)."""
    op, attr = n.op, n.attr
    async_op, inplace = attr("async_op"), attr("inplace")
    table = (ASYNC_FORMATS if async_op else IN_PLACE_FORMATS if inplace else OP_FORMATS)
    rkey = reduce_key(n)
    key = ring_key(n, moe_key(n, rkey + ("_" if async_op and inplace else "")))
    if key not in table:
        raise EmitError(f"op {n.op!r} (%{n.name}) has no torch mapping; the torch backend "
                        f"knows: {', '.join(sorted(OP_FORMATS))}")
    if op == "sum" and not attr("dims"):
        return args[0]
    if op == "pow_grad" and attr("exponent") == 2.0:  # d(x**2) = 2 x dy, without pow(x, 1)
        return f"{args[0]} * ({args[1]} * 2.0)"
    ty = n.type
    if ty.dtype not in TORCH_DTYPES:
        raise EmitError(f"%{n.name} has dtype {ty.dtype}, which has no torch name")
    if op in ATTR_DEFAULTS:
        attrs = dict(ATTR_DEFAULTS[op])
        attrs.update(n.attrs)
        kw = {k: _py(v) for k, v in attrs.items()}
    else:
        kw = {k: _py(v) for k, v in dict(n.attrs).items()}
    kw["local_shape"] = repr(tuple(ty.shape))
    kw["dtype"] = TORCH_DTYPES[ty.dtype]
    kw["args"] = ", ".join(args)
    if op in NORM_FORMATS:
        kw.update(norm_kw(program, n, args))  # norms + embedding part (issue 17)
    if op in REDUCE_FORMATS or rkey in REDUCE_FORMATS:  # reduce_kw's own test
        kw.update(reduce_kw(program, n, _py))  # reductions part (issue 17)
    if op in Q_OPERAND:
        kw.update(cp_kw(program, n))  # context parallel (issue 14): causal mask at the rank's rows
        kw.update(ring_kw(n))  # ring attention (issue 14): sdpa / sdpa_grad only
    if op == "expand":
        kw["kept_shape"] = repr(tuple(1 if d in attr("dims") else s for d, s in enumerate(ty.shape)))
    if op == "sdpa_grad":  # attention part (issue 17): which of torch.func.vjp's (dq, dk, dv)
        kw["wrt_index"] = "qkv".index(attr("wrt"))
    return table[key].format(*args, **kw)


def _layout_comment(program, n, record, names) -> list:
    """The comment above a layout change: kind, axis, layouts, bytes, the reason (whose spec
    references are basenames: no machine path reaches a program), a value it names written
    as the program's variable (``%linear_1_mm`` -> ``_2_dense``) where the program has it."""
    src = program[n.inputs[0]]
    reason = record.reason if record else n.attr("reason", "")
    reason = re.sub(r"%([\w.]+)", lambda m: names.get(m.group(1), m.group(0)), reason)
    change = f"{layout_str(src.layout)} -> {layout_str(n.layout)}"
    if n.op in LOCAL_LAYOUT_OPS:
        head = f"{n.op} over {n.attr('axis')} {change} (local, no communication):"
    else:
        nbytes = record.bytes if record else "?"
        head = f"{n.op} over {n.attr('axis')} {change}, bytes/rank {nbytes}:"
    return _comment(f"{head} {reason}", "    ")


def _view_of(take: str, stored, full) -> str:
    """A stored tensor as the graph holds it: a fused weight's ``.reshape(view)``, or a
    padded vocab table's zero rows appended (parcomp/passes/vocab_pad.py, issue 17)."""
    if math.prod(stored) == math.prod(full):
        return f"{take}.reshape({tuple(full)!r})"
    pad = [x for s, f in zip(reversed(stored), reversed(full)) for x in (0, f - s)]
    return f"torch.nn.functional.pad(whole({take}), {pad!r})"
