"""The bodies of ``parcomp compile | export | explain | plan`` (argument parsing is in :mod:`parcomp.cli.main`)."""
from __future__ import annotations

import os

from ..compile.compiler import compile_graph
from ..errors import ParcompError
from ..frontends.loader import load_model, pointing_into
from ..ir.text import print_graph
from ..outdir import write_dir_atomic
from ..report.report import format_collectives, format_load, format_memory, format_search
from ..units import plural
from .common import compile_model, feeds_for, print_kept, print_warnings, program_files, collective_summary


def compile(args):  # noqa: A001 - the subcommand's name
    """``parcomp compile``: write program.py, report.json, sharded.pcir, program.pcir (and the
    computed constants' ``constants.safetensors``) atomically."""
    last = []

    def show(name, graph):  # a check (or a pass that changed nothing) returns the graph it was given
        same = bool(last) and last[0] is graph
        last[:] = [graph]
        print(f"# ----- IR after {name} (unchanged) -----" if same else
              f"# ----- IR after {name} -----\n{print_graph(graph)}")

    compiled, module, _ = compile_model(args, show if args.print_ir_after_all else None)
    kept = write_dir_atomic(args.out, program_files(compiled, args.target, args.profile,
                                                    os.path.basename(args.model),
                                                    args.functional_collectives, module))
    recs = compiled.report["collectives"]
    if not args.json:
        print(format_collectives(recs))
        print(format_memory(compiled.report))
        print(format_load(compiled.report["checkpoint_load"], compiled.report.get("pipeline")))
        print(format_search(compiled.report["search"], compiled.report.get("training") is not None))
        place = compiled.report["placement"]
        if place["nodes"] is not None:
            print(f"placement: {plural(place['nodes'], 'node')}; inside a node: "
                  f"{', '.join(place['intra_node_axes']) or '-'}; across nodes: "
                  f"{', '.join(place['cross_node_axes']) or '-'}")
        if "pipeline" in compiled.report:
            from ..passes.pipeline.pipeline_plan import format_pipeline

            print(format_pipeline(compiled.report))
        print(f"wrote {args.out}/")
        print_kept(args.out, kept)
    return {"ok": True, "out": args.out, "collectives": collective_summary(recs), "kept": kept}


def export(args):
    """``parcomp export``: a checkpoint ``program.py --save`` wrote, as one full model.safetensors
    (and config.json) in directory ``-o``: new, empty, or parcomp's own earlier export
    (:func:`parcomp.cli.export.export_pretrained`)."""
    from .export import export_pretrained

    compiled, module, _ = compile_model(args)
    if not compiled.report.get("training"):
        raise ParcompError(f"{args.spec}: the spec has no train line; export reads the checkpoint of a "
                           f"training program.py", where=args.spec)
    done = export_pretrained(compiled, args.checkpoint, args.out, module)
    print(f"wrote {', '.join(done['files'])} ({plural(len(done['tensors']), 'tensor')}) to {done['out']}")
    if done["from_model"]:  # frozen: not trained, so not in the checkpoint (parcomp/cli/export.py)
        print(f"note: {plural(len(done['from_model']), 'parameter')} not trained (requires_grad=False) "
              f"written with the model's own value, as program.py read it from --checkpoint when that "
              f"held this model's weights: {', '.join(done['from_model'][:8])}"
              + (", ..." if len(done["from_model"]) > 8 else ""))
    print_kept(done["out"], done["kept"])
    return {"ok": True, **done} if args.json else None


def explain(args):
    """``parcomp explain``: each collective, why, what the alternatives cost, per-rank memory
    (:mod:`parcomp.cli.explain_cmd`)."""
    from .explain_cmd import explain_command

    return explain_command(args, feeds_for)


def plan(args):
    """``parcomp plan``: choose the layouts, write them as a spec, compile it to show the plan."""
    from ..plan.planner import mesh_text, plan as choose, summary, with_step_estimate, write_spec
    from ..spec import parse_spec

    graph, _, _ = load_model(args.model)
    with pointing_into(args.model):
        text, chosen = choose(graph, mesh_text(args.mesh), args.memory, args.train, args.seconds)
        compiled = compile_graph(graph, parse_spec(text, args.out))
    print_warnings(compiled)
    write_spec(args.out, with_step_estimate(text, chosen, compiled))  # what its estimate covers
    print(summary(chosen, compiled))
    print(format_collectives(compiled.report["collectives"]))
    print(f"wrote {args.out}")
    return {"ok": True, "spec": args.out, "search": chosen.search,
            "collectives": collective_summary(compiled.report["collectives"])} if args.json else None
