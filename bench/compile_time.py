"""Compile time: torch.export import, IR -> per-rank program (compile_graph + emit_program).

Models (``specs/models.py``): ``torch_mlp`` (one Linear(32,128)+GELU+Linear(128,32) block)
and ``mlp_chain(blocks=N)`` (N such blocks in one flat ``nn.Sequential``, hidden 32,
input (2, 8, 32)) for N in {1, 12, 48}. Spec: ``mesh tp=2`` with every block Megatron
(first Linear colwise, second rowwise). The chain's parameters are named by the flat
Sequential index -- block k owns ``{3k}.weight/bias`` (Linear h->4h) and
``{3k+2}.weight/bias`` (Linear 4h->h) -- and a ``*`` pattern cannot pick every third
index, so the spec lists one pair of lines per block::

    mesh tp=2
    0.weight colwise
    2.weight rowwise
    3.weight colwise
    5.weight rowwise
    ...
    input x replicated

The training pipeline adds ``train loss=mse optimizer=sgd(lr=0.1)`` (autodiff appends the
loss, backward and SGD update before sharding).

Measured in one process with 1 thread, median of 3 (min-max shown):

  torch.export      ``torch.export.export(module, inputs, strict=False)`` alone
  import            ``parcomp.frontends.torch.export.import_torch`` (export + lowering to
                    parcomp IR); "lowering" = ``import_exported`` on an ExportedProgram made
                    beforehand (the aten -> parcomp IR walk alone)
  compile           ``parcomp.compile.compiler.compile_graph(graph, spec)``, with a per-pass
                    breakdown taken from its ``after`` callback (each pass includes the IR
                    verification that follows it)
  emit              ``parcomp_backends.torch.emit_program(compiled, "cpu")``

The first torch.export in a process pays a one-time warm-up (lazy imports); it is done
on a throw-away model first and reported separately as "cold".

Run:  .venv/bin/python bench/compile_time.py [--quick] [--json out.json] [--plain] [--blocks 1,12,48]
(``--quick``: blocks 1 and 12 only; ``--blocks``: any list, growth is taken between the last two)
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import importlib.util  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

QUICK = "--quick" in sys.argv
BLOCKS = [1, 12] if QUICK else [1, 12, 48]
if C.arg_value("--blocks"):
    BLOCKS = [int(b) for b in C.arg_value("--blocks").split(",")]
REPS = 3
TRAIN_LINE = "train loss=mse optimizer=sgd(lr=0.1)"


def load_factories():
    path = os.path.join(os.path.dirname(HERE), "specs", "models.py")
    spec = importlib.util.spec_from_file_location("parcomp_bench_models", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def spec_text(blocks: int, train: bool) -> str:
    lines = ["mesh tp=2"]
    for k in range(blocks):
        lines += [f"{3 * k}.weight colwise", f"{3 * k + 2}.weight rowwise"]
    lines.append("input x replicated")
    if train:
        lines.append(TRAIN_LINE)
    return "\n".join(lines) + "\n"


def med(ts):
    return {"median": statistics.median(ts), "min": min(ts), "max": max(ts), "n": len(ts)}


def measure_compile(graph, spec, reps):
    """compile_graph timings: total and per pass (median over reps); the last Compiled."""
    from parcomp.compile.compiler import compile_graph

    totals, per_pass, compiled = [], {}, None
    for _ in range(reps):
        marks = []
        t0 = time.perf_counter()
        compiled = compile_graph(graph, spec, after=lambda name, g: marks.append((name, time.perf_counter())))
        t1 = time.perf_counter()
        totals.append(t1 - t0)
        prev = t0
        for name, t in marks:
            per_pass.setdefault(name, []).append(t - prev)
            prev = t
        per_pass.setdefault("report", []).append(t1 - prev)
    return med(totals), {k: statistics.median(v) for k, v in per_pass.items()}, compiled


def measure_emit(compiled, reps):
    from parcomp_backends.torch import emit_program

    ts, text = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        try:
            text = emit_program(compiled, "cpu")
        except Exception as e:  # noqa: BLE001 - reported, not fatal (e.g. an op without torch mapping)
            return {"error": f"{type(e).__name__}: {str(e).removeprefix('error: ')[:140]}"}, None
        ts.append(time.perf_counter() - t0)
    return med(ts), text


def measure(name, factory, blocks, reps):
    import parcomp.frontends.torch.export as tx
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec

    module, inputs, names = factory()
    r = {"model": name, "blocks": blocks,
         "params": sum(p.numel() for p in module.parameters())}
    r["export"] = med([C.median_s(lambda: torch.export.export(module.eval(), tuple(inputs), strict=False), 1)[0]
                       for _ in range(reps)])
    ts, graph = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        graph = import_torch(module, inputs, names)
        ts.append(time.perf_counter() - t0)
    r["import"] = med(ts)
    # lowering alone: import_exported on a fresh ExportedProgram (it changes the fx graph)
    ts = []
    for _ in range(reps):
        ep = tx.export_module(module, inputs)
        t0 = time.perf_counter()
        tx.import_exported(module, ep, names)
        ts.append(time.perf_counter() - t0)
    r["lowering"] = med(ts)
    r["graph_nodes"] = len(graph.nodes)
    for mode in ("forward", "train"):
        spec = parse_spec(spec_text(blocks, mode == "train"), f"{name}_{mode}.pcs")
        total, passes, compiled = measure_compile(graph, spec, reps)
        emit, text = measure_emit(compiled, reps)
        r[mode] = {"compile": total, "passes": passes, "emit": emit,
                   "program_nodes": len(compiled.program.nodes),
                   "collectives": len(compiled.report["collectives"]),
                   "program_lines": text.count("\n") if text else None}
    return r


def main():
    from parcomp.frontends.torch.export import import_torch

    torch.set_num_threads(1)
    t_start = time.perf_counter()
    print(f"compile_time: specs/models.py torch_mlp and mlp_chain(blocks=N, hidden=32), spec mesh tp=2 "
          f"(every block colwise/rowwise); median of {REPS}; {C.env_line()}")
    models = load_factories()
    # cold: first torch.export / import_torch in this process, on a throw-away model
    m, inp, names = models.torch_mlp()
    t0 = time.perf_counter()
    import_torch(m, inp, names)
    cold = time.perf_counter() - t0

    cases = [("torch_mlp", models.torch_mlp, 1)]
    cases += [(f"mlp_chain({n})", (lambda n=n: models.mlp_chain(blocks=n)), n) for n in BLOCKS]
    results = {"cold_first_import_s": cold, "cases": []}
    for name, factory, blocks in cases:
        results["cases"].append(measure(name, factory, blocks, REPS))
        print(f"  {name} done ({time.perf_counter() - t_start:.0f} s so far)", flush=True)

    def s(d):
        return d["median"] if isinstance(d, dict) and "median" in d else "-"

    def rng(d):
        return f"{d['min']:.4f}-{d['max']:.4f}" if isinstance(d, dict) and "min" in d else "-"

    rows = []
    for r in results["cases"]:
        for mode in ("forward", "train"):
            m = r[mode]
            emit_s = s(m["emit"])
            rows.append({
                "model": r["model"], "mode": mode, "nodes": r["graph_nodes"],
                "export": s(r["export"]) if mode == "forward" else "",
                "import": s(r["import"]) if mode == "forward" else "",
                "lowering": s(r["lowering"]) if mode == "forward" else "",
                "compile": s(m["compile"]), "compile_rng": rng(m["compile"]),
                "emit": emit_s if emit_s != "-" else m["emit"].get("error", "-"),
                "ce": (s(m["compile"]) + emit_s) if emit_s != "-" else "-",
                "pnodes": m["program_nodes"], "colls": m["collectives"],
                "lines": m["program_lines"] or "-",
            })
    C.print_table(
        "compile time, seconds (median of 3; import columns apply to both modes)",
        [("model", "model"), ("mode", "spec"), ("nodes", "IR nodes in"), ("export", "torch.export s"),
         ("import", "import_torch s"), ("lowering", "lowering s"), ("compile", "compile_graph s"),
         ("compile_rng", "compile min-max"), ("emit", "emit_program s"), ("ce", "compile+emit s"),
         ("pnodes", "program nodes"), ("colls", "collectives"), ("lines", "program.py lines")],
        rows)

    pass_names = []
    for r in results["cases"]:
        for mode in ("forward", "train"):
            for k in r[mode]["passes"]:
                if k not in pass_names:
                    pass_names.append(k)
    prow = []
    for r in results["cases"]:
        for mode in ("forward", "train"):
            row = {"model": r["model"], "mode": mode}
            row.update({k: r[mode]["passes"].get(k, "") for k in pass_names})
            prow.append(row)
    C.print_table("compile_graph per pass, seconds (median of 3; each includes the IR verify after it)",
                  [("model", "model"), ("mode", "spec")] + [(k, k) for k in pass_names], prow)

    by = {r["model"]: r for r in results["cases"]}
    print(f"\ncold first import_torch in the process (torch.export warm-up): {cold:.2f} s")
    if len(BLOCKS) >= 2:
        a, b = by[f"mlp_chain({BLOCKS[-2]})"], by[f"mlp_chain({BLOCKS[-1]})"]
        dn = BLOCKS[-1] - BLOCKS[-2]
        growth = {}
        for label, get in (
            ("torch.export", lambda r: s(r["export"])),
            ("import_torch", lambda r: s(r["import"])),
            ("lowering", lambda r: s(r["lowering"])),
            ("compile_graph forward", lambda r: s(r["forward"]["compile"])),
            ("emit_program forward", lambda r: s(r["forward"]["emit"])),
            ("compile_graph train", lambda r: s(r["train"]["compile"])),
            ("emit_program train", lambda r: s(r["train"]["emit"])),
        ):
            va, vb = get(a), get(b)
            if va == "-" or vb == "-":
                print(f"  {label}: not measured (emit failed)")
                continue
            growth[label] = {"ms_per_block": (vb - va) / dn * 1e3, "ratio": vb / va}
            print(f"  per added block ({BLOCKS[-2]} -> {BLOCKS[-1]} blocks) {label}: "
                  f"{(vb - va) / dn * 1e3:.2f} ms/block; x{vb / va:.2f} for x{BLOCKS[-1] / BLOCKS[-2]:.0f} blocks")
        results["growth"] = growth
        fa, ta = s(b["forward"]["compile"]), s(b["train"]["compile"])
        print(f"  training vs forward compile at {BLOCKS[-1]} blocks: x{ta / fa:.1f} "
              f"(autodiff alone {b['train']['passes'].get('autodiff', 0):.3f} s)")
    errs = {r[m]["emit"]["error"] for r in results["cases"] for m in ("forward", "train") if "error" in r[m]["emit"]}
    for e in sorted(errs):
        print(f"  emit_program failed: {e}")
    print(f"total {time.perf_counter() - t_start:.0f} s; load avg at the end {C.loadavg()}")
    C.dump_json(results)


if __name__ == "__main__":
    main()
