"""The body of ``parcomp check``: every rank in the numpy interpreter against the unsharded model."""
from __future__ import annotations

import sys

from .budget import CHECK_SECONDS_ANNOUNCE, check_memory, check_time
from .errors import ParcompError
from .frontends.fused import in_stored_indices
from .reference.interpreter import run_spmd
from .passes.moe_capacity import reference_text, spec_changes_capacity
from .passes.train_config import check_steps, train_config
from .report import format_collectives, format_memory, format_search, plural
from .check64 import NOTE, NOTE_MISMATCH, promote_compiled, promote_feeds, run_precision
from .resolution import where_bound_grew
from .tolerance import compare_outputs as compare, propagate, refine_bounds
from .train_check import brief, lockstep, verdict, verdict_text
from .commands_common import (_compile, feeds_for, _is_torch, _print_result, _reference, reference_outputs,
                              require_finite, _short_losses, _summary, _train_feeds, _vs_tolerance)


def check(args):
    """``parcomp check``: every rank in the numpy interpreter against the unsharded model
    (for training: the spec's ``steps`` steps against the unsharded steps and, for torch
    models, torch.optim; every carried value is compared, buffers and optimizer state too)."""
    compiled, module, example = _compile(args, numeric="check")
    check_memory(compiled, "check")
    training = compiled.report.get("training")
    if not training and getattr(args, "steps", None) is not None:
        raise ParcompError(f"--steps {args.steps}: the spec has no train line, so the program is "
                           f"one forward pass; drop --steps or add a train line")
    steps = _check_steps(args, compiled) if training else 1
    est = check_time(compiled, steps)
    if est > CHECK_SECONDS_ANNOUNCE:
        print(f"parcomp check: this takes about {est:,.0f} s", file=sys.stderr, flush=True)
    if training:
        return _check_training(args, compiled, module, example, steps)
    feeds = feeds_for(compiled.unsharded, module, example, args.seed)
    require_finite(compiled.unsharded, feeds)
    result, how = _forward_check(compiled, module, example, feeds), ""
    if result.get("unbounded"):  # the model's dtype cannot vouch: the float64 re-check (parcomp/check64.py)
        wide = _forward_check(promote_compiled(compiled), None, example, promote_feeds(feeds))
        if not wide.get("unbounded"):
            result, how = {**wide, "note": NOTE.format(err=result["max_abs_err"], why=brief(result["why"]),
                                                        dtype=run_precision(compiled))}, ", in float64"
    _print_result(args, compiled, result, f"numpy interpreter, {plural(compiled.program.mesh.size, 'rank')}{how}")
    return {**result, "collectives": _summary(compiled.report["collectives"]),
            "world_size": compiled.program.mesh.size}


def _forward_check(compiled, module, example, feeds) -> dict:
    """Every rank in the numpy interpreter against the unsharded reference, within the bound
    (:func:`parcomp.tolerance.compare_outputs`): the op-by-op boxes first, the bounds refined by
    exact linear maps between cuts (parcomp/segment_bounds.py, forward_bounds.py) only when the
    boxes do not vouch; a bound too loose to resolve names the op where it grew
    (:func:`parcomp.resolution.where_bound_grew`)."""
    run = run_spmd(compiled.program, feeds)
    got, want = run.outputs(compiled.program), reference_outputs(compiled.unsharded, _reference(compiled, module),
                                                                  example, feeds)
    values, errs = propagate(compiled.logical, feeds, refined=False)  # the boxes; refined only if they fail
    result = compare(got, want, {name: errs[v] for name, v in compiled.logical.named_outputs()})
    if not result["ok"]:
        errs = refine_bounds(compiled.logical, values, errs)
        result = compare(got, want, {name: errs[v] for name, v in compiled.logical.named_outputs()})
    if result.get("unbounded"):
        result["why"] += f" (the bound first grows past resolving at {where_bound_grew(compiled.logical, values, errs)})"
    return result


def _check_steps(args, compiled) -> int:
    """The training steps ``check`` runs: ``--steps`` or the spec's."""
    given = getattr(args, "steps", None)
    return train_config(compiled.spec).steps if given is None else check_steps(given)


def _check_training(args, compiled, module, example, steps):
    """``check`` of a training program: :func:`parcomp.train_check.lockstep`."""
    feeds = _train_feeds(compiled, module, example, args.seed)
    require_finite(compiled.unsharded, feeds)
    instead, ref = None, _reference(compiled, module)  # the torch module may compute another model
    if _is_torch(module) and ref is None:
        caps = compiled.report.get("moe_capacity", ())
        instead = (reference_text(caps, compiled.spec.moe.capacity_factor) if spec_changes_capacity(caps)
                   else "the unsharded step with parcomp's dropout mask (training-mode dropout)")
    module = ref
    ls, how = lockstep(compiled, module if _is_torch(module) else None, example, feeds, steps), ""
    if ls["vs_unsharded"].get("unbounded"):  # float32 cannot vouch: the float64 re-check (parcomp/check64.py)
        wide = lockstep(promote_compiled(compiled), None, example, promote_feeds(feeds), steps)
        note = (NOTE if wide["vs_unsharded"]["ok"] else NOTE_MISMATCH).format(
            err=ls["vs_unsharded"]["max_abs_err"], why=brief(ls["vs_unsharded"]["why"]),
            dtype=run_precision(compiled))
        if wide["vs_unsharded"]["ok"] or not wide["vs_unsharded"].get("unbounded"):  # OK or MISMATCH, as forward
            ls, how = {**wide, "vs_torch": ls["vs_torch"], "note": note}, ", in float64"
        else:  # float64 cannot vouch either: the float32 verdict stands, with what it found
            ls["note"] = (f"the float64 re-check does not vouch either: max abs error {wide['vs_unsharded']['max_abs_err']:.3e}"
                          f"; {brief(wide['vs_unsharded']['why'])}")
    result = {**ls["vs_unsharded"], "losses": ls["losses"], "reference_losses": ls["reference_losses"],
              **({"note": ls["note"]} if "note" in ls else {})}
    if instead:
        result["reference"] = instead
    vs_torch = ls["vs_torch"]  # in float32; with a float64 re-check, a bound too loose is only reported
    if vs_torch is not None:
        result["vs_torch"] = vs_torch
        vs_torch = None if how and vs_torch.get("unbounded") else vs_torch
        result["ok"] = result["ok"] and (vs_torch is None or vs_torch["ok"])
    if compiled.program_.pipeline is not None:  # the pipelined step too (parcomp/reference/pipeline.py)
        from .reference.pipeline import check_pipeline_step

        result["pipeline"] = check_pipeline_step(compiled, feeds, steps)
        result["ok"] = result["ok"] and result["pipeline"]["ok"]
    result = in_stored_indices(result, compiled.logical)  # qkv.weight[0,0], not its view's [0,0,0]
    result["verdict"] = verdict(result, vs_torch)
    if not args.json:
        print(format_collectives(compiled.report["collectives"]))
        print(format_memory(compiled.report))
        print(format_search(compiled.report["search"], compiled.report.get("training") is not None))
        if "pipeline" in result:
            r = result["pipeline"]
            print(f"pipelined step on the numpy interpreter vs unsharded step: error/tolerance "
                  f"{r['err_over_tol']:.2g} {'OK' if r['ok'] else verdict(r) + ': ' + r['why']}"
                  f"{' (' + r['note'] + ')' if r.get('note') else ''}")
        _print_training(result, f"numpy interpreter, {plural(steps, 'step')}, each from the "
                        f"unsharded run's state{how}", "vs unsharded step")
    return {**result, "collectives": _summary(compiled.report["collectives"]),
            "world_size": compiled.program.mesh.size, "steps": steps}


def _basis(result, r) -> str:
    """What an OK rests on when line ``r``'s own bound is not finite: the float64 re-check
    (its note), ``r`` being float32's torch.optim comparison, only reported."""
    if result.get("ok") and r is not result and result.get("note") and r.get("unbounded"):
        return "only reported: the OK rests on the float64 re-check (note below)"
    return ""


def _print_training(result, how, label="vs unsharded step"):
    print(f"{how}: losses {_short_losses(result['losses'])}")
    why = []
    for name, r in ((label, result), ("vs torch.optim", result.get("vs_torch"))):
        if r is None:
            continue
        print(f"  {name + ':':18} loss {r['max_loss_err']:.2e}  grads {r['max_grad_err']:.2e}"
              f"  params {r['max_param_err']:.2e}  all carried {r['max_abs_err']:.2e}"
              f"  ({_vs_tolerance(r, _basis(result, r))})")
        if r.get("missing"):
            print(f"    missing from the program: {', '.join(r['missing'])}")
        if r["why"] and r["why"] not in [w for _, w in why]:
            why.append((name, r["why"]))
    if result.get("reference"):  # MoE capacity or dropout: no torch.optim line, say what instead
        print(f"  {'vs torch.optim:':18} not compared; the reference is {result['reference']}")
    word = result.get("verdict") or verdict(result, result.get("vs_torch"))
    if result.get("note"):  # before the verdict: the last line is the verdict
        print(f"  note: {result['note']}")
    print(verdict_text(word, why))
