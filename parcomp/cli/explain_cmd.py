"""The body of ``parcomp explain`` (argument parsing is in :mod:`parcomp.cli.main`).

``parcomp explain MODEL --spec SPEC [--json] [--plots DIR]`` explains one spec;
``parcomp explain MODEL A.pcs B.pcs`` (or ``--spec A.pcs --spec B.pcs``) sets two or more
side by side.  Nothing runs: the model is compiled and the explanation read off the
:class:`parcomp.compile.program.Program` (:mod:`parcomp.report.explain`).
"""
from __future__ import annotations

import os

from ..compile.compiler import compile_graph
from ..errors import ParcompError
from ..frontends.loader import load_model, pointing_into
from ..report.cp_report import sp_cp_lines
from ..report.explain import explain
from ..report.explain_pipeline import pipeline_blocks, pipeline_record
from ..report.explain_text import blocks, compare_blocks, show
from ..report.moe_report import moe_blocks, moe_compare
from ..spec import load_spec


def spec_paths(args) -> list:
    """The specs named on the command line (positional after MODEL, then ``--spec``), in order.

    Raises:
        ParcompError: none given.
    """
    paths = list(args.specs or []) + list(args.spec or [])
    if not paths:
        raise ParcompError("parcomp explain needs a spec: --spec SPEC.pcs (or two specs to compare: "
                           "parcomp explain MODEL A.pcs B.pcs)", where="--spec")
    return paths


def compile_for(model: str, graph, path: str):
    """``graph`` compiled under the spec at ``path`` (its errors at the spec's or model's line)."""
    spec = load_spec(path)
    with pointing_into(model):
        return compile_graph(graph, spec)


def explain_command(args, feeds_for=None) -> dict:
    """``parcomp explain``: print the explanation (or the comparison); returns the JSON result
    ``{"ok": true, "explain": ...}`` or ``{"ok": true, "compare": [...], "specs": [...]}``."""
    paths = spec_paths(args)
    graph, module, example = load_model(args.model)
    compiled = [compile_for(args.model, graph, p) for p in paths]
    xs = [explain(c) for c in compiled]
    moe = _moe(compiled[0], module, example, feeds_for)  # TP inside every expert vs EP
    spcp = compiled[0].report.get("sp_vs_cp")  # SP vs CP (parcomp/report/cp_report.py)
    written = None
    if args.plots:
        if len(compiled) > 1:
            raise ParcompError("--plots draws one spec; give one --spec with --plots", where="--plots")
        from ..report.plots import write_plots

        written = write_plots(compiled[0], xs[0], args.plots)
    pipe = pipeline_record(compiled[0])  # stages, p2p, bubble of a pp spec
    if len(xs) == 1:
        if not args.json:
            show(blocks(xs[0]) + (pipeline_blocks(pipe) if pipe else []) + (moe_blocks(moe) if moe else [])
                 + ([("text", sp_cp_lines(spcp))] if spcp else []))  # SP vs CP
            _say_written(args.plots, written)
        return {"ok": True, "explain": xs[0], "plots": written, **({"moe": moe} if moe else {}),
                **({"sp_vs_cp": spcp} if spcp else {}), **({"pipeline": pipe} if pipe else {})}
    names = [os.path.basename(p) for p in paths]
    if not args.json:
        show(compare_blocks(xs, names))
    return {"ok": True, "specs": paths, "compare": xs}


def _moe(compiled, module, example, feeds_for) -> list:
    """:func:`parcomp.report.moe_report.moe_compare` for the model's example inputs ([] without MoE);
    ``feeds_for``: :func:`parcomp.cli.commands.feeds_for`, passed in (commands imports this module)."""
    if feeds_for is None or not any(n.op == "moe_dispatch" for n in compiled.logical.nodes):
        return []
    from ..cost.links import axis_links

    feeds = feeds_for(compiled.unsharded, module, example)
    return moe_compare(compiled, feeds, axis_links(compiled.spec, compiled.report["placement"]))


def _say_written(out, written) -> None:
    if written is None:
        return
    print(f"wrote {out}/: {', '.join(written['files'])}")
    if written["kept"]:
        print(f"kept {len(written['kept'])} entries in {out}/ that parcomp did not write: "
              f"{', '.join(written['kept'])}")
