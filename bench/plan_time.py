"""`parcomp plan` time on chains of MLP blocks (specs/models.py:mlp_chain), mesh tp=2.

Prints, per depth, the seconds of :func:`parcomp.plan.planner.plan` (the search over every
parameter's and activation's layout; torch.export import not included), which search ran,
whether it is proven optimal, and whether the plan is Megatron's (one all_reduce per block).

    .venv/bin/python bench/plan_time.py [--blocks 12,48]
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", default="12,48")
    args = ap.parse_args()
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp.plan.planner import plan
    from parcomp.spec import parse_spec

    spec = importlib.util.spec_from_file_location("models", os.path.join(HERE, "..", "specs", "models.py"))
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    print("| blocks | plan (s) | search | proven optimal | all_reduce per block |")
    print("|---|---|---|---|---|")
    for n in (int(b) for b in args.blocks.split(",")):
        graph = import_torch(*models.mlp_chain(blocks=n))
        t0 = time.perf_counter()
        text, chosen = plan(graph, "tp=2")
        took = time.perf_counter() - t0
        recs = compile_graph(graph, parse_spec(text, "plan.pcs")).report["collectives"]
        per = sum(r["kind"] == "all_reduce" for r in recs) / n
        print(f"| {n} | {took:.2f} | {chosen.search['search']} | {chosen.search['proven_optimal']} | {per:g} |")


if __name__ == "__main__":
    main()
