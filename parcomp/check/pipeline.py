"""A pipelined training step on the numpy interpreter: every stage and dp replica in one process.

:func:`run_pipeline_step` follows the plan's simulated order of the action lists: a
``forward`` runs the stage's forward program on one microbatch and stashes what the
backward needs, ``send_*`` / ``recv_*`` move values through a mailbox keyed by
(receiving stage, direction, microbatch), a ``backward`` adds the microbatch's parameter
gradients to the stage's sums.  After every microbatch of every dp replica, the sums are
scaled once by ``1 / (microbatches * dp)`` (the dp all-reduce is the sum over replicas; with
``grad_reduce=compute`` each replica's sums rounded to the compute dtype and summed in it)
and each stage's optimizer program runs, after the stages' ``stats`` programs (clip_grad_norm's
sum of squares) are summed over every stage and given to it.  With tp inside a stage (``plan.local``) each
program is the stage's per-rank program run on every rank of the inner mesh
(:func:`~parcomp.reference.interpreter.run_spmd`, its collectives included); values passed
between programs are assembled to full arrays and split again by the next program's layouts.
"""
from __future__ import annotations

import numpy as np

from ..passes.pipeline.stage_train import grad_name
from ..passes.pipeline.zb_split import WSTASH
from ..reference.interpreter import run_spmd
from ..reference.numpy_ops import run_unsharded

__all__ = ["run_pipeline_step", "check_pipeline_step", "compare_steps"]


def _slices(feeds, names, plan):
    """``{name: [piece of dim 0 per (replica, microbatch)]}`` for the batch inputs."""
    parts = plan.microbatches * plan.dp
    return {n: np.split(np.asarray(feeds[n]), parts, axis=0) for n in names if n in feeds}


def _run(plan, s: int, kind: str, feeds: dict) -> dict:
    """Stage ``s``'s ``kind`` program (forward / backward / optimizer, or ZB-H1's
    backward_input / backward_weight of ``plan.split``) on full arrays: the lowered program
    (``plan.lowered``, what program.py prints) once ``lower-stages`` ran."""
    if plan.lowered:
        local = plan.lowered[s].programs[kind]
    elif kind.startswith("backward_"):
        local = getattr(plan.split[s], kind)
    elif not plan.local:
        return run_unsharded(getattr(plan.stages[s], kind), feeds)
    else:
        local = getattr(plan.local[s], kind)
    if local.stage != "local":  # a global program (zero=1 without tp: the forward and backward)
        return run_unsharded(local, feeds)
    return run_spmd(local, {n.name: feeds[n.name] for n in local.nodes
                            if n.op in ("input", "param")}).outputs(local)


def run_pipeline_step(plan, feeds: dict) -> dict:
    """One training step of ``plan`` (a :class:`~parcomp.passes.pipeline.pipeline_plan.PipelinePlan`).

    Args:
        feeds: full arrays: the model inputs and ``target`` / ``labels`` (global batch),
            every param and optimizer state, ``step`` for AdamW.

    Returns:
        ``{"loss": mean over the global batch, <p>: updated, "<p>.grad": gradient,
        optimizer state ...}``: the outputs of the unsharded training step, without input
        gradients.
    """
    batch_names = {n.name for st in plan.stages for g in (st.forward, st.backward)
                   for n in g.inputs} - {v for st in plan.stages for v in st.recv} \
        - {grad_name(v) for st in plan.stages for v in st.send} - {"step"}
    pieces = _slices(feeds, batch_names, plan)
    low = plan.dp_reduce_dtype
    replicas = [[dict() for _ in plan.stages] for _ in range(plan.dp if low else 1)]
    losses = []
    for d in range(plan.dp):  # without a compute-dtype reduction the replicas add into one sum
        _replica(plan, feeds, pieces, d, replicas[d if low else 0], losses)
    for sums in replicas:  # tied weights: one sum over the stages holding a copy (before dp)
        for p, held in plan.tied:
            total = sums[held[0]][grad_name(p)]
            for s in held[1:]:
                total = total + sums[s][grad_name(p)]
            for s in held:
                sums[s][grad_name(p)] = total
    sums = replicas[0] if not low else [_reduced_in(low, [r[s] for r in replicas])
                                        for s in range(len(plan.stages))]
    scale = np.float32(1.0 / (plan.microbatches * plan.dp))
    arr = np.asarray(losses)  # the model's float dtype (float64 in check)
    out = {"loss": (np.sum(arr, dtype=arr.dtype) * arr.dtype.type(scale)).astype(arr.dtype)}
    scaled = [{**feeds, **{k: (v * scale).astype(v.dtype) for k, v in acc.items()}} for acc in sums]
    agreed = {}  # the stages' stats summed over all of them (program.py: an all_reduce over pp)
    for s, st in enumerate(plan.stages):
        if st.stats is not None:
            for k, v in _run(plan, s, "stats", scaled[s]).items():
                agreed[k] = v if k not in agreed else agreed[k] + v
    for s in range(len(plan.stages)):
        out.update(_run(plan, s, "optimizer", {**scaled[s], **agreed}))
    return out


def _reduced_in(dtype: str, parts: list) -> dict:
    """``grad_reduce=compute``'s dp reduction of one stage's gradient sums (one dict per
    replica): each rounded to ``dtype``, summed in it, widened back (program.py's
    ``DP_REDUCE_DTYPE``)."""
    out = {}
    for k, first in parts[0].items():
        total = first.astype(dtype)
        for part in parts[1:]:
            total = (total + part[k].astype(dtype)).astype(dtype)
        out[k] = total.astype(first.dtype)
    return out


def _replica(plan, feeds, pieces, d, sums, losses) -> None:
    """Run every action of every stage for dp replica ``d``, in the simulated order.  Stages
    are virtual stages (``chunk * pp + rank``; the pp coordinate without interleaving); a
    value sent forward by stage ``v`` is received by ``v + 1``, a gradient by ``v - 1``."""
    mail, stash, got = {}, [{} for _ in plan.stages], [{} for _ in plan.stages]
    for r, _, a in plan.simulation.order:
        if a.kind == "optimizer":
            continue
        v, m = a.chunk * plan.pp + r, a.micro
        st = plan.stages[v]
        data = {n: p[d * plan.microbatches + m] for n, p in pieces.items()}
        if a.kind == "forward":
            out = _run(plan, v, "forward", {**feeds, **data, **got[v].pop(("fwd", m), {})})
            stash[v][m] = out
            if "loss" in out:
                losses.append(out["loss"])
        elif a.kind == "send_fwd":
            mail[(v + 1, "fwd", m)] = {x: stash[v][m][x] for x in st.send}
        elif a.kind == "send_bwd":
            mail[(v - 1, "bwd", m)] = stash[v].pop(("bwd", m))
        elif a.kind in ("recv_fwd", "recv_bwd"):
            got[v][(a.kind[5:], m)] = mail.pop((v, a.kind[5:], m))
        else:
            _backward(plan, v, a.kind, {**feeds, **data}, stash[v], got[v], sums[v], m)


def _backward(plan, v, kind, feeds, stash, got, acc, m) -> None:
    """``backward`` (or ZB-H1's ``backward_input`` / ``backward_weight``) of microbatch ``m``
    on stage ``v``: the input gradients to ``stash[("bwd", m)]``, the parameter gradients
    added to ``acc``; B keeps the stash, the gradients received and its ``wstash.<v>``
    values for W."""
    st = plan.stages[v]
    if kind == "backward_weight":
        saved, carried = stash.pop(m), stash.pop(("w", m))
        out = _run(plan, v, kind, {**feeds, **{x: saved[f"saved.{x}"] for x in st.saved}, **carried})
    else:
        saved, grads = stash[m] if kind == "backward_input" else stash.pop(m), got.pop(("bwd", m), {})
        out = _run(plan, v, kind, {**feeds, **{x: saved[f"saved.{x}"] for x in st.saved}, **grads})
    if kind == "backward_input":  # W reads the output gradients received and those B made
        stash[("w", m)] = {**grads, **{k[len(WSTASH):]: x for k, x in out.items() if k.startswith(WSTASH)}}
    if kind != "backward_weight":
        stash[("bwd", m)] = {grad_name(x): out[grad_name(x)] for x in st.recv if grad_name(x) in out}
    if kind == "backward_input":
        return
    for p in st.params:
        g = out[grad_name(p)]
        acc[grad_name(p)] = g.copy() if grad_name(p) not in acc else acc[grad_name(p)] + g


def check_pipeline_step(compiled, feeds: dict, steps: int = 1) -> dict:
    """``steps`` pipelined training steps of ``compiled``'s plan on the interpreter, each from
    the state the unsharded run starts that step from, against the unsharded step
    (:func:`parcomp.check.train_check.step_result`), in float64: the plan is made again from the
    model promoted to float64 (parcomp/check/check64.py). Input gradients are not pipeline outputs."""
    from .check64 import promote_feeds, promote_graph
    from .differential import THRESHOLD
    from ..passes.pass_list import plan_pipeline
    from .train_check import merge_steps, step_result
    from .training import train_steps

    plan = plan_pipeline(promote_graph(compiled.unsharded), compiled.spec)
    logical = promote_graph(compiled.logical)
    params = [n.name for n in compiled.unsharded.params]
    ref = train_steps(lambda st: run_unsharded(logical, st), logical, promote_feeds(feeds), steps, record=True)
    results = []
    for start, want in zip(ref["starts"], ref["per_step"]):
        got = run_pipeline_step(plan, start)
        results.append(step_result(logical, start, got, {k: v for k, v in want.items() if k in got},
                                   params, THRESHOLD))
    return merge_steps(results)


def compare_steps(plan, logical, feeds: dict, steps: int, got=None, rtol: float | None = None) -> dict:
    """``steps`` free-running steps of ``plan`` (or ``got``: the last step's outputs plus
    ``losses``, e.g. program.py's) against the unsharded steps of ``logical`` from the same
    state, within ``rtol`` (default: the tolerance of ``logical``'s float dtype,
    :mod:`parcomp.check.differential`). One step compares every output (the optimizer's against the
    unsharded optimizer on ``got``'s gradients); over several steps only the losses are judged
    and how far the other values drifted apart is reported (``drift``): free-running
    trajectories part by rounding alone (parcomp/check/train_check.py)."""
    from .differential import compare_all, tolerance_for
    from .train_check import optimizer_on
    from .training import train_steps

    if rtol is None:
        rtol = tolerance_for(next((n.type.dtype for n in logical.params if n.type.dtype.startswith("float")),
                                  "float32"))
    if got is None:
        run = train_steps(lambda st: run_pipeline_step(plan, st), logical, feeds, steps)
        got = {**run["outputs"], "losses": np.asarray(run["losses"])}
    ref = train_steps(lambda st: run_unsharded(logical, st), logical, feeds, steps, record=True)
    want = {**ref["outputs"], "losses": np.asarray(ref["losses"])}
    keys = sorted(k for k in got if k in want)
    if steps == 1:
        want.update({k: v for k, v in optimizer_on(logical, ref["starts"][0], got).items() if k in got})
        return compare_all(got, want, keys, rtol)
    res = compare_all(got, want, ["losses"], rtol)
    drift = compare_all(got, want, keys, rtol)
    return {**res, "drift": {k: drift[k] for k in ("max_abs_err", "rel_err", "worst")}}
