"""What the ``parcomp`` commands share: compiling a model with its spec, the feeds (full arrays for
every input and param), the unsharded reference, and printing a result (:mod:`parcomp.cli.commands`)."""
from __future__ import annotations

import json
import sys

import numpy as np

from ..check.differential import verdict
from ..check.train_check import train_feeds, verdict_text
from ..compile.compiler import compile_graph
from ..errors import ParcompError, VerifyError
from ..frontends.loader import load_model, pointing_into
from ..frontends.model_file import ModelFile
from ..ir.index_inputs import index_inputs
from ..ir.text import print_graph
from ..passes.moe_capacity import capacity_notes, spec_changes_capacity  # the spec's MoE capacity
from ..passes.fused_weights import stored_to_parts  # multi-query part params
from ..reference.numpy_ops import run_unsharded
from ..report.report import format_collectives
from ..spec import load_spec
from ..units import plural


def compile_model(args, after=None, numeric: str | None = None):
    """Load and compile ``args.model`` with ``args.spec``; ``numeric`` names a command that
    computes with numpy/torch on this machine (``check``/``run``), which then refuses
    dtypes numpy cannot compute in (:func:`require_numpy_dtypes`)."""
    # args.model / args.spec: a reference and a path, or (parcomp.check from Python) the model
    # already imported, (graph, module, example), and a parsed Spec
    # the spec first: its errors (a missing file, a bad line, --nproc against its mesh) come
    # before the model's import, which can take a while
    spec = load_spec(args.spec) if isinstance(args.spec, str) else args.spec
    nproc = getattr(args, "nproc", None)
    if isinstance(nproc, int) and nproc != spec.mesh.size:
        raise ParcompError(f"--nproc {nproc} but the spec's mesh {spec.mesh} has "
                           f"{plural(spec.mesh.size, 'rank')}", where="--nproc")
    graph, module, example = load_model(args.model) if isinstance(args.model, str) else args.model
    with pointing_into(args.model if isinstance(args.model, str) else "<module>"):  # a .pcir model: at its line
        if numeric:
            require_numpy_dtypes(graph, numeric)
        compiled = compile_graph(graph, spec, after)
    print_warnings(compiled)
    return compiled, module, example


def print_warnings(compiled) -> None:
    """What the spec asks for and cannot be honoured (``report["warnings"]``), on stderr."""
    for w in compiled.report.get("warnings", ()):
        print(f"warning: {w}", file=sys.stderr)
    for note in capacity_notes(compiled.report.get("moe_capacity", ())):  # the spec's capacity, capped
        print(f"note: {note}", file=sys.stderr)


#: dtypes numpy has no type for; check/run compute with numpy, so they refuse them
NO_NUMPY_DTYPES = ("bfloat16",)


def require_numpy_dtypes(graph, command: str) -> None:
    """VerifyError naming the first value of ``graph`` whose dtype numpy lacks (bfloat16).

    Raised inside :func:`pointing_into`, a ``.pcir`` model's error is at that value's line.
    """
    for n in graph.nodes:
        if n.type.dtype in NO_NUMPY_DTYPES:
            err = VerifyError(f"%{n.name} is {n.type}: parcomp {command} computes with numpy, which "
                              f"has no {n.type.dtype}; check the model in float32 (e.g. "
                              f"model.float()) and compile the {n.type.dtype} one", where=f"%{n.name}")
            err.node = n.name
            raise err


CONSTANTS_FILE = "constants.safetensors"  # program.py's CONSTANTS_FILE (program_common.py)


def computed_constants(graph, module) -> dict:
    """``{param name: tensor}`` of the params of ``graph`` that are no weights of ``module``'s
    ``state_dict``: the constants the torch frontend computed at import (GPT-2's position ids,
    Llama's RoPE cos/sin; :mod:`parcomp.frontends.torch.fold`) and non-persistent buffers. A user's
    ``torch.save(module.state_dict())`` lacks them, so ``compile`` writes them beside
    program.py. Empty for a model file or a ``.pcir`` model (their files hold every param)."""
    if module is None or isinstance(module, ModelFile):
        return {}
    from ..frontends.torch.fold import module_sources

    weights, sources = set(module.state_dict()), module_sources(module)
    return {n.name: sources[n.name].detach().cpu().contiguous().clone() for n in graph.params
            if n.name not in weights and n.name in sources}


def _constants_bytes(constants: dict) -> bytes:
    """``constants`` as a .safetensors file (deterministic: keys sorted, no metadata)."""
    from safetensors.torch import save

    return save({k: constants[k] for k in sorted(constants)})


def program_files(compiled, target: str, profile: str | None, model: str | None = None,
                  functional: bool = False, module=None) -> dict:
    """The files ``parcomp compile`` writes for ``target``: report.json, sharded.pcir,
    program.pcir and (torch/ascend) program.py, with ``constants.safetensors`` beside it
    when the graph has params :func:`computed_constants` finds in ``module``.

    Raises ParcompError when ``--target ascend`` is given another profile.
    """
    if target == "reference" and profile is not None:
        raise ParcompError(f"--target reference writes no program.py, so --profile {profile} has "
                           f"no effect; drop it or use --target torch")
    if target == "ascend" and profile not in (None, "ascend"):
        raise ParcompError(f"--target ascend emits the ascend (torch_npu/HCCL) profile; "
                           f"--profile {profile} contradicts it (use --target torch --profile {profile})")
    files = {"report.json": json.dumps(file_report(compiled.report), indent=2, sort_keys=True) + "\n",
             "sharded.pcir": print_graph(compiled.sharded),
             "program.pcir": print_graph(compiled.program)}
    if target in ("torch", "ascend"):
        from parcomp_backends.torch import emit_program

        constants = computed_constants(compiled.unsharded, module)
        files["program.py"] = emit_program(compiled, profile or ("ascend" if target == "ascend" else "cpu"),
                                           model=model, functional=functional, constants=tuple(constants))
        if constants:
            files[CONSTANTS_FILE] = _constants_bytes(constants)
    return files


def file_report(report: dict) -> dict:
    """The report as written to report.json: without the search's wall time, so the same
    model and spec give a byte-identical file (the time is printed, not written)."""
    search = report.get("search")
    if not search or "seconds" not in search:
        return report
    return {**report, "search": {k: v for k, v in search.items() if k != "seconds"}}


def print_kept(out: str, kept: list) -> None:
    """Say (one line) which entries of ``out`` parcomp left alone because they are not its own."""
    if kept:
        print(f"kept {len(kept)} {'entry' if len(kept) == 1 else 'entries'} in {out}/ that "
              f"parcomp did not write: {', '.join(kept)}")


def collective_summary(recs) -> list:
    return [{k: r[k] for k in ("kind", "axis", "dim", "phase", "bytes", "local_shape", "reason")}
            for r in recs]


def feeds_for(graph, module, example, seed=0) -> dict:
    """Full arrays for every input and param: the module's weights and example inputs,
    a model file's weights and seeded random inputs, or seeded random values for a
    ``.pcir`` model."""
    if isinstance(module, ModelFile):
        return module.feeds(graph, seed)
    if module is None:
        rng = np.random.default_rng(seed)
        return {n.name: rng.standard_normal(n.type.shape).astype(n.type.dtype)
                for n in graph.nodes if n.op in ("input", "param")}
    from ..frontends.torch.fold import module_sources

    tensors = module_sources(module)  # non-persistent buffers and folded constants too
    state = {k: v.detach().cpu().numpy() for k, v in tensors.items()}
    # a multi-query weight's kv part param: its rows of the stored tensor
    feeds = stored_to_parts({n.name: state[n.attr("part_of") or n.name] for n in graph.params}, graph)
    for node, x in zip(graph.inputs, example):
        feeds[node.name] = x.detach().cpu().numpy()
    return feeds


def require_finite(graph, feeds: dict) -> None:
    """ParcompError naming the first input or param of ``graph`` whose value in ``feeds``
    holds NaN or inf (and where): a check cannot vouch for what is computed from it; then
    :func:`require_ids_in_tables`."""
    for n in graph.nodes:
        x = feeds.get(n.name) if n.op in ("input", "param") else None
        if x is None or np.asarray(x).dtype.kind not in "fc":
            continue
        bad = ~np.isfinite(np.asarray(x))
        if bad.any():
            at = [int(i) for i in np.argwhere(bad)[0]]
            raise ParcompError(f"{n.op} {n.name} holds {int(bad.sum())} NaN/inf value(s) (the first, "
                               f"{np.asarray(x)[tuple(at)]}, at {at}): parcomp check cannot vouch for "
                               f"results computed from them; give finite values", where=n.name)
    require_ids_in_tables(graph, feeds)


def require_ids_in_tables(graph, feeds: dict) -> None:
    """ParcompError naming the first model input that an ``embedding`` looks up in a table
    (a param of ``feeds``) and that holds an id outside the table's rows ``[0, rows)``: torch
    raises ``IndexError: index out of range`` there, and a vocab-split table silently gives
    zero rows for it (Megatron's VocabParallelEmbedding masks every id it does not own)."""
    for n in graph.by_op("embedding"):
        ids, table = n.inputs[0], n.inputs[1]
        kind = graph[ids].op
        if kind not in ("input", "param") or ids not in feeds or table not in feeds:
            continue
        x, rows = np.asarray(feeds[ids]), np.asarray(feeds[table]).shape[0]
        bad = (x < 0) | (x >= rows)
        if bad.any():
            at = [int(i) for i in np.argwhere(bad)[0]]
            fix = (f"give ids in [0, {rows})" if kind == "input" else "a constant the model computes "
                   "from the input's shape, such as position ids: is the example's sequence longer "
                   "than the table?")
            raise ParcompError(f"{kind} {ids} holds {int(bad.sum())} id(s) outside the {rows} rows of "
                               f"embedding table {table} (the first, {int(x[tuple(at)])}, at {at}): {fix}",
                               where=ids)
    # the inputs that reach a lookup through views or collectives, and cross-entropy labels
    # (ignore_index allowed): the bounds program.py checks at load (parcomp.ir.index_inputs)
    for name, (size, ignore, what) in index_inputs(graph).items():
        if name not in feeds:
            continue
        x = np.asarray(feeds[name])
        bad = ((x < 0) | (x >= size)) & (x != ignore if ignore is not None else True)
        if bad.any():
            at = [int(i) for i in np.argwhere(bad)[0]]
            allowed = f"[0, {size})" + (f" or {ignore} (ignore_index)" if ignore is not None else "")
            raise ParcompError(f"input {name} holds {int(bad.sum())} value(s) outside the {what} of size "
                               f"{size} (the first, {int(x[tuple(at)])}, at {at}): give values in {allowed}",
                               where=name)


def reference_outputs(graph, module, example, feeds) -> dict:
    """The unsharded answer: the torch module itself when there is one, a model file's own
    framework (onnx's reference evaluator), else numpy."""
    if isinstance(module, ModelFile):
        return module.reference_outputs(graph, feeds)
    if module is None:
        return run_unsharded(graph, feeds)
    import torch

    with torch.no_grad():
        out = module.eval()(*example)
    outs = [o for o in torch.utils._pytree.tree_leaves(out) if o is not None]  # torch.export's order
    return {name: o.detach().cpu().numpy() for name, o in zip(graph.output_names, outs)}


def is_torch_module(module) -> bool:
    """Whether ``module`` (from ``load_model``) is a torch module (training compares with torch.optim)."""
    return module is not None and not isinstance(module, ModelFile)


DROPOUT_NOTE = ("note: the model has dropout in training mode; parcomp draws its mask from each "
                "element's global index (docs/design/rules.md, \"Norms, dropout, embeddings\"), not from "
                "torch's generator, so the reference is the unsharded graph with parcomp's dropout "
                "(numpy), not the torch module")


def reference_module(compiled, module):
    """``module``, or None where the torch module computes another model than the graph, so the
    unsharded graph (``compiled.unsharded``, numpy) is the reference: the spec's ``moe``
    statement changed the model's capacity, or the graph has a training-mode
    ``dropout`` (parcomp's mask, not torch's generator's: the eval-mode or torch-trained
    module would differ by the dropped elements; a note on stderr says so)."""
    if spec_changes_capacity(compiled.report.get("moe_capacity", ())):
        return None
    if module is not None and not isinstance(module, ModelFile) and compiled.unsharded.by_op("dropout"):
        print(DROPOUT_NOTE, file=sys.stderr)
        return None
    return module


def print_result(args, compiled, result, how):
    result["verdict"] = verdict(result)  # in the --json result too, as for training
    if args.json:
        return
    print(format_collectives(compiled.report["collectives"]))
    if result.get("note"):  # before the verdict: the last line is the verdict
        print(f"note: {result['note']}")
    word = verdict(result)
    vs = result.get("vs_model")
    extra = f"; vs the model's own framework: {vs_tolerance(vs)}" if vs else ""
    print(f"{how}: max abs error vs unsharded {result['max_abs_err']:.3e} "
          f"(output scale {result['output_scale']:.3e}; {vs_tolerance(result)}{extra}) "
          + verdict_text(word, [("", result["why"])], indent=""))


def vs_tolerance(result) -> str:
    """The ``error/tolerance R at WHERE (error E of the scale; tolerance T)`` part of a report
    line: R <= 1 passes (:mod:`parcomp.check.differential`)."""
    at = result["worst"]
    return (f"error/tolerance {result['err_over_tol']:.2g}" + (f" at {at}" if at else "")
            + f": error {result['rel_err']:.1e} of the scale, tolerance {result['rtol']:.0e}")


def training_feeds(compiled, module, example, seed):
    return train_feeds(compiled, module, example, seed, feeds_for)


def input_feeds(compiled, feeds, graph=None) -> dict:
    """What ``inputs.pt`` holds: the inputs of ``graph`` (default: the program) in ``feeds`` less
    a training program's step number (program.py, SPMD or pipelined, feeds it 1..K itself, so a
    kept inputs.pt has no key it does not use)."""
    train = getattr(compiled.program_, "train", None)
    step = train.step if train is not None else None
    graph = compiled.program if graph is None else graph
    return {n.name: feeds[n.name] for n in graph.inputs if n.name in feeds and n.name != step}


def short_losses(losses) -> str:
    """The per-step losses, the first and last five when there are more than twelve."""
    xs = [f"{x:.6f}" for x in losses]
    return ", ".join(xs if len(xs) <= 12 else xs[:5] + [f"... ({len(xs) - 10} more)"] + xs[-5:])
