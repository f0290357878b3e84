"""The bodies of ``parcomp compile | check | run`` (argument parsing is in :mod:`parcomp.cli`)."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

import numpy as np

from .compiler import compile_graph
from .errors import ParcompError
from .frontends.loader import load_model
from .ir.text import print_graph
from .reference.interpreter import run_spmd
from .reference.numpy_ops import run_unsharded
from .report import format_collectives
from .spec import load_spec


def _compile(args, after=None):
    graph, module, example = load_model(args.model)
    spec = load_spec(args.spec)
    return compile_graph(graph, spec, after), module, example


def write_dir_atomic(out: str, files: dict) -> None:
    """Write ``{name: text}`` into directory ``out``, all or nothing.

    The files go to a temporary sibling directory first, which then replaces
    ``out``; on any error nothing at ``out`` changes.
    """
    parent = os.path.dirname(os.path.abspath(out)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".parcomp-", dir=parent)
    try:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                f.write(text)
        if os.path.isdir(out):
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def program_files(compiled, target: str, profile: str | None) -> dict:
    """The files ``parcomp compile`` writes for ``target``."""
    files = {"report.json": json.dumps(compiled.report, indent=2, sort_keys=True) + "\n",
             "sharded.pcir": print_graph(compiled.sharded),
             "program.pcir": print_graph(compiled.program)}
    if target in ("torch", "ascend"):
        from parcomp_backends.torch import emit_program

        files["program.py"] = emit_program(compiled, profile or ("ascend" if target == "ascend" else "cpu"))
    return files


def compile(args):  # noqa: A001 - the subcommand's name
    def show(name, graph):
        print(f"// ----- IR after {name} -----\n{print_graph(graph)}")

    compiled, _, _ = _compile(args, show if args.print_ir_after_all else None)
    write_dir_atomic(args.out, program_files(compiled, args.target, args.profile))
    recs = compiled.report["collectives"]
    if not args.json:
        print(format_collectives(recs))
        print(f"wrote {args.out}/")
    return {"ok": True, "out": args.out, "collectives": _summary(recs)}


def _summary(recs) -> list:
    return [{k: r[k] for k in ("kind", "axis", "dim", "phase", "bytes", "local_shape", "reason")}
            for r in recs]


def feeds_for(graph, module, example, seed=0) -> dict:
    """Full arrays for every input and param: the module's weights and example inputs,
    or seeded random values for a ``.pcir`` model."""
    if module is None:
        rng = np.random.default_rng(seed)
        return {n.name: rng.standard_normal(n.type.shape).astype(n.type.dtype)
                for n in graph.nodes if n.op in ("input", "param")}
    state = {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}
    feeds = {n.name: state[n.name] for n in graph.params}
    for node, x in zip(graph.inputs, example):
        feeds[node.name] = x.detach().cpu().numpy()
    return feeds


def reference_outputs(graph, module, example, feeds) -> dict:
    """The unsharded answer: the torch module itself when there is one, else numpy."""
    if module is None:
        return run_unsharded(graph, feeds)
    import torch

    with torch.no_grad():
        out = module.eval()(*example)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return {name: o.detach().cpu().numpy() for name, o in zip(graph.output_names, outs)}


def compare(got: dict, want: dict) -> dict:
    """Max abs error and the output scale (max |want|) over all outputs."""
    err = max(float(np.max(np.abs(got[k].astype(np.float64) - want[k]))) for k in want)
    scale = max(float(np.max(np.abs(want[k]))) for k in want)
    return {"max_abs_err": err, "output_scale": scale, "rel_err": err / max(scale, 1e-30),
            "ok": err <= 1e-5 * max(scale, 1.0)}


def check(args):
    compiled, module, example = _compile(args)
    graph = compiled.unsharded
    feeds = feeds_for(graph, module, example, args.seed)
    run = run_spmd(compiled.program, feeds)
    result = compare(run.outputs(compiled.program), reference_outputs(graph, module, example, feeds))
    _print_result(args, compiled, result, f"numpy interpreter, {compiled.program.mesh.size} ranks")
    return {**result, "collectives": _summary(compiled.report["collectives"]),
            "world_size": compiled.program.mesh.size}


def _print_result(args, compiled, result, how):
    if args.json:
        return
    print(format_collectives(compiled.report["collectives"]))
    verdict = "OK" if result["ok"] else "MISMATCH"
    print(f"{how}: max abs error vs unsharded {result['max_abs_err']:.3e} "
          f"(output scale {result['output_scale']:.3e}) {verdict}")


def run(args):
    from parcomp_backends.torch.launch import assemble_outputs, run_torchrun, write_inputs

    compiled, module, example = _compile(args)
    size = compiled.program.mesh.size
    if args.nproc != size:
        raise ParcompError(f"--nproc {args.nproc} but the spec's mesh {compiled.program.mesh} has "
                           f"{size} ranks")
    graph = compiled.unsharded
    feeds = feeds_for(graph, module, example)
    work = args.keep or tempfile.mkdtemp(prefix="parcomp-run-")
    try:
        write_dir_atomic(work, program_files(compiled, "torch", args.profile))
        import torch

        torch.save({k: torch.from_numpy(np.ascontiguousarray(feeds[k])) for k in
                    (n.name for n in graph.params)}, os.path.join(work, "model.pt"))
        write_inputs({n.name: feeds[n.name] for n in graph.inputs}, os.path.join(work, "inputs.pt"))
        out_path = os.path.join(work, "outputs.pt")
        proc = run_torchrun(work, size, os.path.join(work, "model.pt"), os.path.join(work, "inputs.pt"),
                            out_path, extra_args=("--device", "cpu"))
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise ParcompError(f"the program failed on {size} ranks (exit {proc.returncode}); "
                               f"its output is above")
        got = assemble_outputs(out_path, compiled.program)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    result = compare(got, reference_outputs(graph, module, example, feeds))
    _print_result(args, compiled, result, f"torchrun, {size} gloo ranks")
    return {**result, "collectives": _summary(compiled.report["collectives"]), "world_size": size}
