"""The sections of ``program.py`` around its step function: the header docstring, the
PROFILE block, the constants, the parameter and input loaders, the line that marks where the
runtime starts (:data:`RUNTIME_MARK`), and the Python names of the graph's values (split from :mod:`parcomp_backends.torch.emit`, which assembles them and re-exports every
name here that callers use).  Deterministic: same Program, same text.
"""
from __future__ import annotations

import builtins
import json
import keyword
import math
import re
import textwrap

from parcomp.version import __version__ as PARCOMP_VERSION
from parcomp.compile.program import MAX_STEPS, plural
from parcomp.ir.index_inputs import index_inputs
from parcomp.ir.ops import LAYOUT_OPS
from parcomp.ir.types import DTYPE_SHORT, Partial, Replicate, layout_str, shard_axes

from ..runtime import (CLUSTER_HELP, CONSTANT_LOADER, FORWARD_HELP, FUNCTIONAL, MAIN, ONNX_READER, RUNTIME,
                      TIED_LOADER, TRAIN_HELP, TRAIN_MAIN)
from .attention import HELPER_NAMES as ATTENTION_HELPERS
from .cluster import CLUSTER_NAMES, cluster_constants
from .cp_ring import HELPER_NAMES as RING_HELPERS, balance_src
from .moe import HELPER_NAMES as MOE_HELPERS
from .nodes import TORCH_DTYPES, EmitError
from .norms import HELPER_NAMES as NORM_HELPERS
from .reduce import HELPER_NAMES as REDUCE_HELPERS
from .text import wrap

_NON_WORD = re.compile(r"\W")
COMMENT_WIDTH = 108

#: program.py reads top down: the header, then this model (constants, parameter loading, the
#: step), then this one line, then the runtime (the PROFILE block and the text pasted from
#: parcomp_backends/torch/runtime: process groups, collectives, checkpoint reading, ``main``)
RUNTIME_MARK = "# ======== runtime (parcomp_backends/torch/runtime): profile, collectives, loading, main ========"

_TOP_NAMES = set(re.findall(r"^(?:def )?([A-Za-z_]\w*)", RUNTIME + MAIN + TRAIN_MAIN + ONNX_READER
                            + FUNCTIONAL + CONSTANT_LOADER + TIED_LOADER, re.M)) | {"funcol"}
RESERVED = (set(keyword.kwlist) | set(dir(builtins)) | _TOP_NAMES
            | {"torch", "dist", "p", "inp", "argparse", "importlib", "json", "math", "os", "sys", "time",
               "PROFILE", "DIST_BACKEND", "PRELUDE", "profile_device", "MESH", "GROUP_RANKS",
               "PARAMS", "INPUTS", "OUTPUT_LAYOUTS", "OUTPUT_GLOBAL_SHAPES", "SHARDED_OUTPUT",
               "RUN_HINT", "load_params", "load_inputs", "forward", "STATE", "CARRIED", "STEP_INPUT",
               "TRAIN_STEPS", "MAX_STEPS", "train_step"} | set(NORM_HELPERS) | set(REDUCE_HELPERS) | set(MOE_HELPERS)
            | set(RING_HELPERS) | set(ATTENTION_HELPERS)
            | set(CLUSTER_NAMES))


def python_names(prog) -> dict:
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


def header_section(prog, model, train) -> str:
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
        f"{PARCOMP_VERSION} (torch backend). Do not edit.",
        "",
        f"model: {(model or 'a parcomp graph').replace(chr(34) * 3, '')}",
        f"spec:  {spec_name or '(none recorded)'}",
        f"mesh:  {mesh} ({plural(mesh.size, 'rank')}; row-major, the last axis varies fastest)",
        *steps,
        "",
        f"Below: this model's constants, parameter loading and step ({'train_step' if train else 'forward'}); "
        "then, after the runtime line, the runtime.",
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


def profile_block(prof) -> str:
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
    lines += [f"    {line}" for line in prof.policy]  # cuda: TF32 off
    if prof.dtype_check:
        lines += [f"    if not ({prof.dtype_check}):", f"        fail(f{json.dumps(prof.dtype_message)})"]
    lines += [f"    return torch.device({prof.device})", "# ---- end of PROFILE ----"]
    return "\n".join(lines)


def _py_tuple(xs) -> str:
    xs = [json.dumps(x) for x in xs]
    return f"({xs[0]},)" if len(xs) == 1 else "(" + ", ".join(xs) + ")"


def _all_replicated(program) -> bool:
    return all(isinstance(p, Replicate) for o in program.outputs for p in program[o].layout)


def constants_section(prog, train) -> str:
    program, mesh = prog.graph, prog.mesh
    groups = {a: prog.group_ranks(a) for a in prog.groups}  # mesh axes, then joint groups "dp,tp"
    outs = program.named_outputs()
    lines = [
        f"MESH = {json.dumps(dict(mesh.axes))}  # mesh axes in order; ranks are row-major",
        f"GROUP_RANKS = {json.dumps(groups)}  # each axis's rank groups, in coordinate order",
        f"PARAMS = {_py_tuple(n.name for n in program.params)}",
        f"INPUTS = {_py_tuple(n.name for n in _data_inputs(program, train))}",
        "# inputs that index a table: {name: [size, ignore_index or None, what]}; values outside",
        "# 0..size-1 are refused at load (take, SampleSlice.read) as torch would raise",
        f"INDEX_BOUNDS = {({k: list(v) for k, v in index_inputs(program).items()})!r}",
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


def loaders_section(prog, train, constants=()) -> str:
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
            if n.attr("stored_shape"):  # a fused weight: stored whole, viewed per part
                src = _view_of(f"{take}({arg}, {key}, {tuple(n.attr('stored_shape'))!r}, "
                               f"{TORCH_DTYPES[n.type.dtype]})", n.attr("stored_shape"), full,
                               n.attr("stored_order"))
                head += f"stored {_ty(n.type.dtype, n.attr('stored_shape'))}, viewed per part; "
            elif n.attr("part_of"):  # a multi-query weight's part: its rows of the stored tensor
                a, b = n.attr("part_rows")
                src = (f"{take}({arg}, {json.dumps(n.attr('part_of'))}, {tuple(n.attr('part_of_shape'))!r}, "
                       f"{TORCH_DTYPES[n.type.dtype]}).narrow(0, {a}, {b - a})")
                head += f"rows {a}:{b} of {n.attr('part_of')} {_ty(n.type.dtype, n.attr('part_of_shape'))}; "
            sliced, what = _slice_expr(program, n, balance_src(program, n, src))
            expr = f"place({sliced})"
            for a, p in enumerate(n.layout):
                if p == Partial("sum"):  # a P(max) source: every rank keeps it
                    expr = f"partial_mask({expr}, {json.dumps(program.mesh.names[a])})"
            if n.name in state:  # optimizer state: the checkpoint's (--replay), else zeros
                lines += comment_lines(f"{head}optimizer state: zeros at step 1 unless the checkpoint "
                                       f"holds it (--replay); {what}", "    ")
                lines += [f"    out[{json.dumps(n.name)}] = ({expr} if {json.dumps(n.name)} in {arg} "
                          f"else", f"        torch.zeros({tuple(n.type.shape)!r}, "
                          f"dtype={TORCH_DTYPES[n.type.dtype]}, device=DEVICE))"]
                continue
            lines += comment_lines(head + what, "    ")
            lines.append(f"    out[{json.dumps(n.name)}] = {expr}{_spec_ref(prog, n.name)}")
        lines.append("    return out")
        out.append("\n".join(lines))
    return "\n\n\n".join(out)


def _ty(dtype, shape) -> str:
    return f"{DTYPE_SHORT.get(dtype, dtype)}[{','.join(str(s) for s in shape)}]"


def comment_lines(text: str, indent: str) -> list:
    return wrap(text, COMMENT_WIDTH, indent + "# ", indent + "#   ")  # textwrap.wrap's lines


def _view_of(take: str, stored, full, order=None) -> str:
    """A stored tensor as the graph holds it: a fused weight's ``.reshape(view)`` (a grouped
    q|k|v's head units taken in its ``order`` first: parcomp/passes/fused_weights.py), or a
    padded vocab table's zero rows appended (parcomp/passes/vocab_pad.py)."""
    if order:
        a = next(d for d in range(len(stored)) if d >= len(full) or full[d] != stored[d])
        units = tuple(stored[:a]) + (len(order), stored[a] // len(order)) + tuple(stored[a + 1:])
        return (f"{take}.reshape({units!r}).index_select({a}, torch.tensor({list(order)!r}))"
                f".reshape({tuple(full)!r})")
    if math.prod(stored) == math.prod(full):
        return f"{take}.reshape({tuple(full)!r})"
    pad = [x for s, f in zip(reversed(stored), reversed(full)) for x in (0, f - s)]
    return f"torch.nn.functional.pad(whole({take}), {pad!r})"
