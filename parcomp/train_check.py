"""Checking a training program: step by step (lockstep) against the unsharded step and torch.optim.

Why lockstep (docs/design.md, "Checking training"): the claim parcomp makes is that the
sharded *step function* equals the unsharded one. Comparing two free-running
trajectories after K steps needs an error bound that carries step k's error into step
k+1, and worst-case bounds compound: AdamW's update is nearly scale-free in the
gradient (step 1 is lr g / (|g| + eps)), so a rounding-sized change of a near-zero
gradient moves a weight by up to ~lr; after a few steps such a bound exceeds the weights'
whole movement and an "OK" under it says nothing. So every step k starts both sides from
the same state, the unsharded run's state before step k, and is compared within that one
step's error bound, which never compounds. How far two free-running trajectories drift
apart is a property of float arithmetic, not of the compiler; ``parcomp run`` reports it.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from .budget import PROGRESS_EVERY_S
from .frontends.fused import to_stored_shapes, to_view_shapes
from .passes.accumulate import accumulates_token_mean
from .passes.train_config import train_config
from .reference.interpreter import run_spmd
from .reference.microbatches import microbatches, stacked_feeds
from .reference.numpy_ops import run_unsharded
from .reference.training import data_for, torch_train, train_steps
from .resolution import RESOLVE
from .tolerance import compare_all, training_bounds, training_errors


def train_feeds(compiled, module, example, seed, feeds_for) -> dict:
    """The model inputs (``feeds_for``) plus the seeded loss data (``target`` / ``labels``)."""
    feeds = feeds_for(compiled.unsharded, module, example, seed)
    feeds.update(stacked_feeds(compiled, feeds, seed))  # issue 13: accumulate=K microbatches
    feeds.update(data_for(compiled.logical, seed))
    return feeds


def torch_reference(compiled, module, example, feeds, steps, start=None, first=1):
    """torch.optim's run of ``steps`` steps (from ``start``, step number ``first``: see
    :func:`parcomp.reference.training.torch_train`), keyed as the program's carried values
    and outputs: every param and buffer of the graph, optimizer state, last gradients, losses.
    Returns ``(losses, values)``."""
    cfg = train_config(compiled.spec)
    graph = compiled.unsharded
    names = [n.name for n in graph.inputs]
    output = graph.output_names.index(cfg.output) if cfg.output else 0
    if start is not None:  # torch holds a fused weight (issue 17) whole, as stored
        start = to_stored_shapes(start, compiled.logical)
    ref = torch_train(module, example, names, feeds, cfg, steps, output, start, first,
                      microbatches(compiled, feeds), whole_batch=accumulates_token_mean(graph, cfg))
    want = {"loss": np.array(ref["losses"][-1], "float32"), "losses": np.array(ref["losses"], "float32"),
            **{n.name: ref["sources"][n.name] for n in graph.params if n.name in ref["sources"]},
            **ref["state"],
            **(ref["input_grads"] if cfg.input_grads else {}),
            **{f"{k}.grad": v for k, v in ref["grads"].items()}}
    # fused weights per part, padded vocab tables padded (issue 17): as the logical graph holds them
    return ref["losses"], to_view_shapes(want, compiled.logical)


def carried(run) -> dict:
    """A :func:`train_steps` result as one dict: the last step's outputs, every carried
    value after the last step, and ``losses`` (one per step)."""
    return {**run["outputs"], **run["state"], "losses": np.array(run["losses"], "float32")}


def training_result(got: dict, want: dict, params, bounds: dict, resolve=RESOLVE) -> dict:
    """:func:`training_errors` of two carried-value dicts within their error ``bounds``,
    the loss error taken over every step (a missing step is a shape mismatch), and a
    failure when ``want`` has a value ``got`` lacks. ``resolve``: see :func:`training_errors`
    (None for a free-running comparison, whose compounding bound is reported, not relied on)."""
    result = training_errors(got, want, params, bounds, resolve)
    missing = sorted(set(want) - set(got))
    if missing:
        result["missing"] = missing
        result["why"] = "; ".join(w for w in (result["why"], f"missing: {', '.join(missing)}") if w)
    result["ok"] = result["ok"] and not missing
    return result


def verdict(*results) -> str:
    """``OK``, ``CANNOT VOUCH`` (every failure is only an error bound that overflowed) or
    ``MISMATCH``, over the comparison results given (None entries skipped)."""
    failed = [r for r in results if r is not None and not r["ok"]]
    if not failed:
        return "OK"
    return "CANNOT VOUCH" if all(r.get("unbounded") for r in failed) else "MISMATCH"


def verdict_text(word: str, why: list, indent: str = "  ") -> str:
    """The verdict line: ``word`` alone when OK; else ``word:`` and each ``(label, reason)`` of
    ``why`` (label may be ""), the first on the verdict's line, the others on lines of their
    own, one line per failing value (a reason is :func:`merge_steps`' or a comparison's:
    lines joined by newlines), continuation lines indented below it."""
    if word == "OK":
        return f"{indent}OK"
    out = []
    for label, reason in why:
        lines = reason.split("\n")
        out.append(f"{label + ': ' if label else ''}{lines[0]}")
        out += [f"    {ln}" for ln in lines[1:]]
    if not out:
        return f"{indent}{word}"
    return "\n".join([f"{indent}{word}: {out[0]}"] + [f"{indent}  {ln}" for ln in out[1:]])


def merge_steps(results: list) -> dict:
    """One result over the per-step results of a lockstep check: the largest errors, the
    worst error/tolerance (its place prefixed ``step k:``), every failing step's reason."""
    worst_k = max(range(len(results)), key=lambda i: results[i]["err_over_tol"])
    worst = results[worst_k]
    out = {k: max(r[k] for r in results) for k in
           ("max_loss_err", "max_grad_err", "max_param_err", "max_abs_err")}
    failed = [(k, r) for k, r in enumerate(results, 1) if not r["ok"]]
    missing = sorted({m for r in results for m in r.get("missing", ())})
    return {**out, "tolerance": worst["tolerance"], "err_over_tol": worst["err_over_tol"],
            "worst": f"step {worst_k + 1}: {worst['worst']}", "ok": not failed,
            "why": _step_reasons(failed),
            "unbounded": bool(failed) and all(r.get("unbounded") for _, r in failed),
            **({"missing": missing} if missing else {})}


def _step_reasons(failed: list) -> str:
    """The reasons of the failing steps ``[(k, result)]``: the first step's in full (one line
    per value), each later one's first line (steps usually fail alike)."""
    if not failed:
        return ""
    (k, r), rest = failed[0], failed[1:3]
    lines = [f"step {k}: {r['why']}"] + [f"step {j}: {brief(s['why'])}" for j, s in rest]
    more = len(failed) - 3
    return "\n".join(lines + ([f"and {more} more failing step{'s' if more > 1 else ''}"] if more > 0 else []))


def brief(why: str, most: int = 300) -> str:
    """A reason (:func:`merge_steps`' or a comparison's, one line per value) as one short
    line: its first line, cut at ``most`` characters, "..." when anything was left out."""
    first = why.split("\n", 1)[0]
    cut = first[:most]
    return cut + (" ..." if cut != why else "")


def _one_step(graph, start: dict, out: dict, bounds: dict) -> tuple:
    """A step's carried values, as the torch side has them: every param of ``graph``
    (buffers and frozen params keep their ``start`` value), the outputs, and ``losses``
    (one entry); and their bounds (0 for what the step does not touch)."""
    kept = to_view_shapes({n.name: start[n.name] for n in graph.params if n.name not in out}, graph)
    untouched = {n.name: np.zeros(n.type.shape) for n in graph.params if n.name not in bounds}
    return ({**kept, **out, "losses": np.array([out["loss"]], "float32")},
            {**untouched, **bounds, "losses": np.array([bounds["loss"]])})


def lockstep(compiled, module, example, feeds, steps: int, resolve=RESOLVE) -> dict:
    """Every step of the sharded program (numpy interpreter, all ranks) from the state the
    unsharded run starts that step from, against the unsharded step and, for a torch
    model, torch.optim's step from the same state, each within that step's error bound.

    Returns ``{"vs_unsharded": result, "vs_torch": result or None, "losses": sharded
    loss of each step, "reference_losses": the unsharded run's}`` (results as
    :func:`merge_steps`). ``resolve``: as :func:`training_result`'s (None: within the bound
    only, for a bfloat16 step whose worst-case bound cannot resolve 10%)."""
    graph, prog = compiled.logical, compiled.program
    params = [n.name for n in compiled.unsharded.params]
    tick = _progress(steps, "numpy interpreter")
    ref = train_steps(lambda s: run_unsharded(graph, s), graph, feeds, steps, record=True)
    vs_ref, vs_torch, losses = [], [], []
    for k, (start, want) in enumerate(zip(ref["starts"], ref["per_step"]), 1):
        tick()
        got = run_spmd(prog, start).outputs(prog)
        losses.append(float(got["loss"]))
        wants = [_one_step(graph, start, want, {"loss": 0})[0]]
        if module is not None:
            wants.append(torch_reference(compiled, module, example, feeds, 1, start, k)[1])
        res = step_results(graph, start, got, wants, params, training_bounds(graph, start, 1, first=k,
                                                                              refined=False), resolve)
        vs_ref.append(res[0])
        vs_torch.extend(res[1:])
    return {"vs_unsharded": merge_steps(vs_ref), "vs_torch": merge_steps(vs_torch) if vs_torch else None,
            "losses": losses, "reference_losses": ref["losses"]}


def step_results(graph, start, got, wants, params, tb, resolve) -> list:
    """:func:`training_result` of one step's outputs ``got`` against each of ``wants`` within
    the boxes of ``tb`` (``training_bounds(..., refined=False)``), and only where some value
    fails them (a bound too loose to resolve, or an error beyond it), again within the bounds
    refined by the exact linear maps of the backward (parcomp/segment_bounds.py) for the
    failing values: the refined bound is never looser, so a verdict the boxes reach is
    the refined one's except that an error between the two tolerances stays unseen
    (docs/design.md, "Refined only when the boxes cannot vouch")."""
    out, bounds = _one_step(graph, start, got, tb["outputs"])
    res = [training_result(out, w, params, bounds, resolve) for w in wants]
    if all(r["ok"] for r in res):
        return res
    failed = set().union(*(_failed(out, w, bounds, params, resolve) for w in wants))
    out, bounds = _one_step(graph, start, got, tb["refine"](failed | ({"loss"} if "losses" in failed else set())))
    return [training_result(out, w, params, bounds, resolve) for w in wants]


def _failed(got, want, bounds, params, resolve) -> set:
    """The keys of ``want`` whose comparison (as :func:`training_result`'s) fails."""
    keys = [k for k in want if k in got]
    res = compare_all(got, want, bounds, keys, resolve=resolve,
                      resolve_keys={"loss", "losses", *(f"{p}.grad" for p in params)})
    return {k for k, r in res["per_key"].items() if not r["ok"]}


def _progress(steps: int, what: str):
    """A function to call once per step: prints ``what: step k of steps`` on stderr every
    :data:`PROGRESS_EVERY_S` seconds."""
    state = {"k": 0, "last": time.monotonic()}

    def tick():
        state["k"] += 1
        now = time.monotonic()
        if now - state["last"] >= PROGRESS_EVERY_S:
            state["last"] = now
            print(f"parcomp check: {what}: step {state['k']:,} of {steps:,}", file=sys.stderr, flush=True)
    return tick


def replay_reference(compiled, module, example, feeds, steps: int) -> dict:
    """What ``program.py --replay`` must produce: each step k run from the unsharded run's
    state before step k, by the reference (torch.optim for a torch model, else the
    unsharded numpy step), with that one step's bounds.

    Returns ``{"starts": [{param: full array}] per step (for the replay file), "want":
    step K's carried values plus ``losses`` (every step's), "bounds": the same keys}``."""
    graph = compiled.logical
    ref = train_steps(lambda s: run_unsharded(graph, s), graph, feeds, steps, record=True)
    losses, loss_bounds, want, bounds = [], [], {}, {}
    for k, (start, out) in enumerate(zip(ref["starts"], ref["per_step"]), 1):
        b = training_bounds(graph, start, 1, first=k)["outputs"]
        if module is not None:
            _, out = torch_reference(compiled, module, example, feeds, 1, start, k)
        want, bounds = _one_step(graph, start, out, b)
        losses.append(float(out["loss"]))
        loss_bounds.append(float(b["loss"]))
    starts = [to_stored_shapes({n.name: s[n.name] for n in graph.params}, graph, derived=False)
              for s in ref["starts"]]
    return {"starts": starts, "want": {**want, "losses": np.array(losses, "float32")},
            "bounds": {**bounds, "losses": np.array(loss_bounds)}}
