"""Measure what ``parcomp check``'s threshold separates (docs/design/check.md, "How check decides").

For every shipped spec (specs/*.pcs with its model from specs/models.py):

- the noise floor: the largest scale-relative difference (:mod:`parcomp.check.differential`) over
  every carried value of every step between the sharded program (all ranks, numpy
  interpreter) and the unsharded graph, both in float64 from the same state;
- the signal: one collective's result scaled by (1 + 1e-6) (tests/faults.py), the smallest
  largest difference it leaves over the program's collectives (each injected alone, one step).

    PYTHONPATH=. python tools/noise_floor.py [--specs NAME ...] [--most N] [--json]

``--most N`` injects into at most N collectives per spec (evenly spread; default all).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from faults import collectives, injected, model_of  # noqa: E402

from parcomp.check.check64 import promote_compiled, promote_feeds  # noqa: E402
from parcomp.check.differential import THRESHOLD, compare_outputs, value_scale  # noqa: E402
from parcomp.check.train_check import one_step, optimizer_on, step_result  # noqa: E402
from parcomp.check.training import initial_state  # noqa: E402
from parcomp.cli import commands  # noqa: E402
from parcomp.reference.interpreter import run_spmd  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402
from parcomp.spec.train_config import train_config  # noqa: E402


def compiled_spec(spec: str):
    args = SimpleNamespace(model=model_of(spec), spec=str(ROOT / "specs" / f"{spec}.pcs"))
    c, module, example = commands.compile_model(args, numeric="check")
    training = bool(c.report.get("training"))
    feeds = (commands.training_feeds(c, module, example, 0) if training
             else commands.feeds_for(c.unsharded, module, example, 0))
    return c, promote_compiled(c), promote_feeds(feeds), training, feeds


def steps(wide, feeds, training: bool, count: int) -> dict:
    """Over every carried value of ``count`` steps (one forward pass for a forward spec): the
    largest difference over its element's scale (``rel_err``, as check compares), over its
    value's scale (``of_value_scale``), and how many values were compared (``values``)."""
    if not training:
        got = run_spmd(wide.program, feeds).outputs(wide.program)
        want = run_unsharded(wide.unsharded, feeds)
        return {"rel_err": compare_outputs(got, want)["rel_err"], "values": len(want),
                "of_value_scale": max(_pure(got[k], want[k]) for k in want)}
    graph, prog = wide.logical, wide.program
    params = [n.name for n in wide.unsharded.params]
    state, carried = initial_state(graph, feeds), {n.name for n in graph.params}
    out = {"rel_err": 0.0, "values": 0, "of_value_scale": 0.0}
    for k in range(1, count + 1):
        if "step" in graph:
            state["step"] = np.array(float(k), graph["step"].type.dtype)
        start, env = dict(state), {}
        want = run_unsharded(graph, start, env=env)
        got = run_spmd(prog, start).outputs(prog)
        res = step_result(graph, start, got, want, params, THRESHOLD, env)
        ref = one_step(graph, start, {**want, **optimizer_on(graph, start, got, env)})
        mine = one_step(graph, start, got)
        keys = [key for key in ref if key in mine]
        out = {"rel_err": max(out["rel_err"], res["rel_err"]), "values": out["values"] + len(keys),
               "of_value_scale": max([out["of_value_scale"]] + [_pure(mine[key], ref[key]) for key in keys])}
        state.update({key: v for key, v in want.items() if key in carried})
    return out


def _pure(got, want) -> float:
    g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(g) & np.isfinite(w)
    err = float(np.abs(np.where(fin, g - w, 0.0)).max()) if g.size else 0.0
    s = value_scale(w)
    return err / s if s else (0.0 if err == 0 else np.inf)


def measure(spec: str, most: int | None) -> dict:
    t = time.monotonic()
    c, wide, feeds, training, narrow = compiled_spec(spec)
    count = train_config(c.spec).steps if training else 1
    correct = steps(wide, feeds, training, count)
    noise = correct["rel_err"]
    if c.program_.pipeline is not None:  # the pipelined step, as check runs it
        from parcomp.check.pipeline import check_pipeline_step

        noise = max(noise, check_pipeline_step(c, narrow, count)["rel_err"])
    names = collectives(wide.program)
    if most and len(names) > most:
        names = [names[i] for i in np.linspace(0, len(names) - 1, most).round().astype(int)]
    signals = {}
    for name in names:
        with injected("scale", name):
            signals[name] = steps(wide, feeds, training, 1)["rel_err"]
    weakest = min(signals, key=signals.get) if signals else None
    return {"spec": spec, "carried_values": correct["values"], "noise": noise,
            "noise_of_value_scale": correct["of_value_scale"],
            "collectives": len(collectives(wide.program)), "injected": len(signals),
            "weakest_signal": signals.get(weakest), "weakest_at": weakest, "seconds": round(time.monotonic() - t, 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--specs", nargs="*")
    p.add_argument("--most", type=int)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    specs = a.specs or sorted(x.stem for x in (ROOT / "specs").glob("*.pcs"))
    rows = []
    for spec in specs:
        r = measure(spec, a.most)
        rows.append(r)
        print(f"{spec:36} values {r['carried_values']:5}  noise {r['noise']:.2e} (of value scale "
              f"{r['noise_of_value_scale']:.2e})  weakest 1e-6 signal {r['weakest_signal'] or 0:.2e} over "
              f"{r['injected']}/{r['collectives']} collectives  {r['seconds']} s", flush=True)
    noise = max(r["noise"] for r in rows)
    signal = min(r["weakest_signal"] for r in rows if r["weakest_signal"] is not None)
    print(f"noise floor {noise:.2e}, weakest signal {signal:.2e}, threshold {THRESHOLD:.0e}: "
          f"{THRESHOLD / noise:.0f}x above the noise, {signal / THRESHOLD:.0f}x below the signal")
    if a.json:
        print(json.dumps({"rows": rows, "noise": noise, "signal": signal, "threshold": THRESHOLD}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
