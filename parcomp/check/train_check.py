"""Checking a training program: step by step (lockstep) against the unsharded step and torch.optim.

Why lockstep (docs/design/check.md, "Checking training"): the claim parcomp makes is that the
sharded *step function* equals the unsharded one. Two free-running trajectories drift apart
by float arithmetic alone (AdamW's update is nearly scale-free in the gradient: step 1 is
lr g / (|g| + eps), so a rounding-sized change of a near-zero gradient moves a weight by up
to ~lr, and the next step starts from there). So every step k starts both sides from the
same state, the unsharded run's state before step k, and compares every value the step
carries (:mod:`parcomp.check.differential`): the loss, the outputs and the gradients against the
unsharded step's, the parameters and optimizer state against the unsharded optimizer run on
the sharded step's own gradients (the unsharded graph with its gradients replaced,
:func:`optimizer_on`). Together these say the sharded step is the unsharded step up to
rounding of the gradients, without comparing AdamW's amplification of that rounding.

The verdict is float64 (:func:`lockstep` promotes the compiled programs,
:mod:`parcomp.check.check64`); a mixed-precision program (``precision=bf16|fp16``) is also run in its
own precision against the unsharded step in that precision, within the dtype's tolerance
(its loss scaling and skipped steps included); a torch model's step is also compared with
torch.optim from the same state, within the tolerance of the dtype torch computes in.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from ..passes.fused_weights import to_stored_shapes, to_view_shapes
from ..passes.train.accumulate import accumulates_token_mean
from ..reference.interpreter import run_spmd
from ..reference.numpy_ops import rerun_with, run_unsharded
from ..spec.train_config import train_config
from .budget import PROGRESS_EVERY_S
from .check64 import narrow_feeds, promote_compiled, promote_feeds
from .differential import THRESHOLD, compare_all, near_ties, tie_verdict, tolerance_for, verdict  # noqa: F401
from .microbatches import microbatches, stacked_feeds
from .training import data_for, initial_state, torch_train, train_steps


def train_feeds(compiled, module, example, seed, feeds_for) -> dict:
    """The model inputs (``feeds_for``) plus the seeded loss data (``target`` / ``labels``)."""
    feeds = feeds_for(compiled.unsharded, module, example, seed)
    feeds.update(stacked_feeds(compiled, feeds, seed))  # accumulate=K microbatches
    feeds.update(data_for(compiled.logical, seed))
    return feeds


def compute_dtype(compiled):
    """The dtype a mixed-precision program computes in (``bfloat16`` / ``float16``), else None."""
    opts = ((compiled.report.get("training") or {}).get("options") or {})
    return opts.get("compute_dtype") if opts.get("precision", "fp32") != "fp32" else None


def torch_reference(compiled, module, example, feeds, steps, start=None, first=1):
    """torch.optim's run of ``steps`` steps (from ``start``, step number ``first``: see
    :func:`parcomp.check.training.torch_train`), keyed as the program's carried values
    and outputs: every param and buffer of the graph, optimizer state, last gradients, losses.
    Returns ``(losses, values)``."""
    cfg = train_config(compiled.spec)
    graph = compiled.unsharded
    names = [n.name for n in graph.inputs]
    output = graph.output_names.index(cfg.output) if cfg.output else 0
    if start is not None:  # torch holds a fused weight whole, as stored
        start = to_stored_shapes(narrow_feeds(start, compiled.logical), compiled.logical)
    ref = torch_train(module, example, names, feeds, cfg, steps, output, start, first,
                      microbatches(compiled, feeds), whole_batch=accumulates_token_mean(graph, cfg))
    want = {"loss": np.array(ref["losses"][-1], "float32"), "losses": np.array(ref["losses"], "float32"),
            **{n.name: ref["sources"][n.name] for n in graph.params if n.name in ref["sources"]},
            **ref["state"],
            **{k: v for k, v in ref["input_grads"].items() if cfg.wants_input_grad(k[:-len(".grad")])},
            **{f"{k}.grad": v for k, v in ref["grads"].items()}}
    # fused weights per part, padded vocab tables padded: as the logical graph holds them
    return ref["losses"], to_view_shapes(want, compiled.logical)


def carried(run) -> dict:
    """A :func:`train_steps` result as one dict: the last step's outputs, every carried
    value after the last step, and ``losses`` (one per step)."""
    return {**run["outputs"], **run["state"], "losses": np.array(run["losses"], "float32")}


def optimizer_keys(graph) -> list:
    """The public outputs the optimizer writes: those named like a carried ``param`` (updated
    parameters, optimizer state, loss-scaling state)."""
    carried_names = {n.name for n in graph.params}
    return [name for name, _ in graph.named_outputs() if name in carried_names]


def grad_overrides(graph, grads: dict) -> dict:
    """``{value name: gradient}``: the value each ``<param>.grad`` output of ``graph`` copies
    (what the optimizer reads), set to ``grads[<param>.grad]`` in the value's dtype."""
    params = {n.name for n in graph.params}
    out = {}
    for name, v in graph.named_outputs():
        if name.endswith(".grad") and name[:-len(".grad")] in params and name in grads:
            node = graph[v]
            target = node.inputs[0] if node.op == "relayout" else v
            out[target] = np.asarray(grads[name]).astype(graph[target].type.dtype).reshape(graph[target].type.shape)
    return out


def optimizer_on(graph, start: dict, grads: dict, env: dict | None = None) -> dict:
    """The unsharded step of ``graph`` from ``start`` with its parameter gradients replaced by
    ``grads`` (``{"<param>.grad": array}``): its optimizer outputs (:func:`optimizer_keys`).
    ``env``: every value of the unsharded step from ``start`` when at hand (only what depends
    on the gradients is computed again)."""
    over = grad_overrides(graph, grads)
    out = rerun_with(graph, env, over) if env is not None else run_unsharded(graph, start, overrides=over)
    return {k: out[k] for k in optimizer_keys(graph)}


def training_result(got: dict, want: dict, params, rtol: float = THRESHOLD) -> dict:
    """:func:`parcomp.check.differential.compare_all` of two carried-value dicts over the keys both
    have, with the largest errors of the loss, the gradients and the parameters, and a failure
    when ``want`` has a value ``got`` lacks."""
    keys = [k for k in want if k in got]
    res = compare_all(got, want, keys, rtol)

    def err(names):
        return max((res["per_key"][k]["max_abs_err"] for k in names if k in res["per_key"]), default=0.0)

    result = {"max_loss_err": err(["loss", "losses"]), "max_grad_err": err([f"{p}.grad" for p in params]),
              "max_param_err": err(params),
              **{k: res[k] for k in ("max_abs_err", "rel_err", "tolerance", "err_over_tol", "worst", "ok",
                                     "why", "unbounded", "rtol")}}
    missing = sorted(set(want) - set(got))
    if missing:
        result["missing"] = missing
        result["why"] = "; ".join(w for w in (result["why"], f"missing: {', '.join(missing)}") if w)
    result["ok"] = result["ok"] and not missing
    return result


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
           ("max_loss_err", "max_grad_err", "max_param_err", "max_abs_err", "rel_err")}
    failed = [(k, r) for k, r in enumerate(results, 1) if not r["ok"]]
    missing = sorted({m for r in results for m in r.get("missing", ())})
    return {**out, "tolerance": worst["tolerance"], "err_over_tol": worst["err_over_tol"], "rtol": worst["rtol"],
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


def one_step(graph, start: dict, out: dict) -> dict:
    """A step's carried values, as the torch side has them: every param of ``graph``
    (buffers and frozen params keep their ``start`` value), the outputs, and ``losses``
    (one entry)."""
    kept = to_view_shapes({n.name: start[n.name] for n in graph.params if n.name not in out}, graph)
    return {**kept, **out, "losses": np.array([out["loss"]])}


def step_result(graph, start: dict, got: dict, want: dict, params, rtol: float, env: dict | None = None) -> dict:
    """One step of the sharded program (``got``) against the unsharded step (``want``) from
    ``start``: the loss, outputs and gradients as they are, the optimizer's outputs against
    the unsharded optimizer on ``got``'s gradients (:func:`optimizer_on`). A failure where the
    unsharded step chose on a near tie is CANNOT VOUCH, naming it. ``env``: every value of the
    unsharded step (computed here when not given)."""
    if env is None:
        env = {}
        run_unsharded(graph, start, env=env)
    ref = {**want, **optimizer_on(graph, start, got, env)}
    res = training_result(one_step(graph, start, got), one_step(graph, start, ref), params, rtol)
    return res if res["ok"] else tie_verdict(res, near_ties(graph, env, rtol))


def _sharded_steps(compiled, feeds: dict, steps: int, rtol: float, tick, vs_torch=None) -> dict:
    """Every step of ``compiled.program`` (all ranks) from the unsharded run's state before it,
    against the unsharded step (:func:`step_result`); ``vs_torch(k, start, got, env)``, when
    given, compares the same step with torch.optim's."""
    graph, prog = compiled.logical, compiled.program
    params = [n.name for n in compiled.unsharded.params]
    state, carried_names = initial_state(graph, feeds), {n.name for n in graph.params}
    results, torch_results, losses, ref_losses = [], [], [], []
    for k in range(1, steps + 1):
        tick()
        if "step" in graph:
            state["step"] = np.array(float(k), graph["step"].type.dtype)
        start, env = dict(state), {}
        want = run_unsharded(graph, start, env=env)
        got = run_spmd(prog, start).outputs(prog)
        results.append(step_result(graph, start, got, want, params, rtol, env))
        if vs_torch is not None:
            torch_results.append(vs_torch(k, start, got, env))
        losses.append(float(got["loss"]))
        ref_losses.append(float(want["loss"]))
        state.update({key: v for key, v in want.items() if key in carried_names})
    return {"result": merge_steps(results), "vs_torch": merge_steps(torch_results) if torch_results else None,
            "losses": losses, "reference_losses": ref_losses}


def _torch_step(compiled, graph, module, example, feeds, rtol):
    """``vs_torch(k, start, got, env)`` for :func:`_sharded_steps`: step ``k`` of the sharded
    program (``got``) against torch.optim's step from the same state: the loss, outputs and
    gradients as they are; torch.optim's parameters and state against the unsharded optimizer
    on torch's gradients (:func:`optimizer_on`)."""
    params = [n.name for n in compiled.unsharded.params]

    def step(k, start, got, env):
        want = torch_reference(compiled, module, example, feeds, 1, start, k)[1]
        grads = {key: v for key, v in want.items() if key.endswith(".grad")}
        ours = {**got, **optimizer_on(graph, start, grads, env)}
        res = training_result(one_step(graph, start, ours), want, params, rtol)
        return res if res["ok"] else tie_verdict(res, near_ties(graph, env, rtol))
    return step


def lockstep(compiled, module, example, feeds, steps: int) -> dict:
    """Every step of the sharded program (numpy interpreter, all ranks) from the state the
    unsharded run starts that step from, against the unsharded step, in float64
    (:func:`step_result`; ``compiled`` and ``feeds`` are promoted here); a mixed-precision
    program also in its own precision (``native``); for a torch ``module``, torch.optim's step
    from the same state (``vs_torch``, within the tolerance of the dtype torch computes in,
    against the float64 run, or a mixed-precision program's own).

    Returns ``{"vs_unsharded": result, "native": result or None, "vs_torch": result or None,
    "losses": sharded loss of each step, "reference_losses": the unsharded run's}`` (results
    as :func:`merge_steps`)."""
    low = compute_dtype(compiled)
    tick = _progress(steps * (2 if low else 1), "numpy interpreter")
    wide = promote_compiled(compiled)
    torch_rtol = tolerance_for(low or "float32")
    on64 = _torch_step(compiled, wide.logical, module, example, feeds, torch_rtol) if module is not None and not low \
        else None
    main = _sharded_steps(wide, promote_feeds(feeds), steps, THRESHOLD, tick, on64)
    native = None
    if low:
        native = _sharded_steps(compiled, feeds, steps, tolerance_for(low), tick, _torch_step(
            compiled, compiled.logical, module, example, feeds, torch_rtol) if module is not None else None)
    return {"vs_unsharded": main["result"], "native": native["result"] if native else None,
            "vs_torch": (native or main)["vs_torch"], "losses": main["losses"],
            "reference_losses": main["reference_losses"],
            **({"native_losses": native["losses"], "native_reference_losses": native["reference_losses"]}
               if native else {})}


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
    state before step k, by the reference (torch.optim for a torch model, else the unsharded
    numpy step).

    Returns ``{"starts": [{param: full array}] per step (for the replay file), "start": the
    last step's start (view shapes), "want": step K's carried values plus ``losses`` (every
    step's)}``."""
    graph = compiled.logical
    ref = train_steps(lambda s: run_unsharded(graph, s), graph, feeds, steps, record=True)
    losses, want = [], {}
    for k, (start, out) in enumerate(zip(ref["starts"], ref["per_step"]), 1):
        if module is not None:
            _, out = torch_reference(compiled, module, example, feeds, 1, start, k)
        want = one_step(graph, start, out)
        losses.append(float(out["loss"]))
    starts = [to_stored_shapes({n.name: s[n.name] for n in graph.params}, graph, derived=False)
              for s in ref["starts"]]
    return {"starts": starts, "start": ref["starts"][-1], "want": {**want, "losses": np.array(losses, "float32")}}
