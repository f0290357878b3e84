"""The body of ``parcomp check``: every rank in the numpy interpreter against the unsharded model."""
from __future__ import annotations

import sys

from ..check.budget import CHECK_SECONDS_ANNOUNCE, check_memory, check_time
from ..check.check64 import promote_compiled, promote_feeds
from ..check.differential import (THRESHOLD, compare_outputs, least_precise, near_ties, tie_verdict, tolerance_for,
                           verdict)
from ..check.train_check import lockstep, verdict_text
from ..errors import ParcompError
from ..passes.fused_weights import in_stored_indices
from ..passes.moe_capacity import reference_text, spec_changes_capacity
from ..reference.interpreter import run_spmd
from ..reference.numpy_ops import run_unsharded
from ..report.report import format_collectives, format_memory, format_search
from ..spec.train_config import check_steps, train_config
from ..units import plural
from .common import (compile_model, feeds_for, is_torch_module, print_result, reference_module, reference_outputs,
                              require_finite, short_losses, collective_summary, training_feeds, vs_tolerance)

#: what an OK of ``check`` rests on, said once below the numbers
BASIS = ("every rank of the sharded program and the unsharded graph, both in float64 from the same "
         "state, agree on every carried value within {rtol:.0e} of its scale (docs/design/check.md, "
         "\"How check decides\")")


def check(args):
    """``parcomp check``: every rank in the numpy interpreter against the unsharded model
    (for training: the spec's ``steps`` steps against the unsharded steps and, for torch
    models, torch.optim; every carried value is compared, buffers and optimizer state too)."""
    if getattr(args, "examples", None) is not None:  # N drawn specs: parcomp.testing's search
        from .examples_cmd import check_examples

        return check_examples(args, check)  # each drawn spec checked by this function
    compiled, module, example = compile_model(args, numeric="check")
    check_memory(compiled, "check")
    training = compiled.report.get("training")
    if not training and getattr(args, "steps", None) is not None:
        raise ParcompError(f"--steps {args.steps}: the spec has no train line, so the program is "
                           f"one forward pass; drop --steps or add a train line")
    steps = steps_to_check(args, compiled) if training else 1
    est = check_time(compiled, steps)
    if est > CHECK_SECONDS_ANNOUNCE:
        print(f"parcomp check: this takes about {est:,.0f} s", file=sys.stderr, flush=True)
    if training:
        return check_training(args, compiled, module, example, steps)
    feeds = feeds_for(compiled.unsharded, module, example, args.seed)
    require_finite(compiled.unsharded, feeds)
    result = forward_check(compiled, reference_module(compiled, module), example, feeds)
    print_result(args, compiled, result, f"numpy interpreter, {plural(compiled.program.mesh.size, 'rank')}, "
                                          f"in float64")
    return {**result, "collectives": collective_summary(compiled.report["collectives"]),
            "world_size": compiled.program.mesh.size}


def forward_check(compiled, module, example, feeds) -> dict:
    """Every rank of the program in float64 on the numpy interpreter against the unsharded
    graph in float64 (:func:`parcomp.check.differential.compare_outputs`; a failure where the
    unsharded run chose on a near tie is CANNOT VOUCH, naming it); with a torch module or a
    model file, also the program against the model's own framework (``vs_model``: in the
    model's dtype, within that dtype's tolerance)."""
    wide, f64 = promote_compiled(compiled), promote_feeds(feeds)
    got = run_spmd(wide.program, f64).outputs(wide.program)
    env = {}
    want = run_unsharded(wide.unsharded, f64, env=env)
    result = compare_outputs(got, want, THRESHOLD)
    if not result["ok"]:
        result = tie_verdict(result, near_ties(wide.unsharded, env, THRESHOLD))
    if module is not None:
        rtol = tolerance_for(least_precise(compiled.unsharded))
        vs = compare_outputs(got, reference_outputs(compiled.unsharded, module, example, feeds), rtol)
        result = {**result, "vs_model": vs, "ok": result["ok"] and vs["ok"]}
        if not vs["ok"]:
            result["unbounded"] = False
            result["why"] = "; ".join(w for w in (result["why"], f"vs the model's own framework: {vs['why']}") if w)
    return result


def steps_to_check(args, compiled) -> int:
    """The training steps ``check`` runs: ``--steps`` or the spec's."""
    given = getattr(args, "steps", None)
    return train_config(compiled.spec).steps if given is None else check_steps(given)


def check_training(args, compiled, module, example, steps):
    """``check`` of a training program: :func:`parcomp.check.train_check.lockstep`."""
    feeds = training_feeds(compiled, module, example, args.seed)
    require_finite(compiled.unsharded, feeds)
    instead, ref = None, reference_module(compiled, module)  # the torch module may compute another model
    if is_torch_module(module) and ref is None:
        caps = compiled.report.get("moe_capacity", ())
        instead = (reference_text(caps, compiled.spec.moe.capacity_factor) if spec_changes_capacity(caps)
                   else "the unsharded step with parcomp's dropout mask (training-mode dropout)")
    ls = lockstep(compiled, ref if is_torch_module(ref) else None, example, feeds, steps)
    main = ls["vs_unsharded"]
    result = {**main, "losses": ls["losses"], "reference_losses": ls["reference_losses"]}
    if instead:
        result["reference"] = instead
    parts = [main]
    for key in ("native", "vs_torch"):
        if ls[key] is not None:
            result[key] = ls[key]
            parts.append(ls[key])
    if compiled.program_.pipeline is not None:  # the pipelined step too (parcomp/check/pipeline.py)
        from ..check.pipeline import check_pipeline_step

        result["pipeline"] = check_pipeline_step(compiled, feeds, steps)
        parts.append(result["pipeline"])
    result["ok"] = all(r["ok"] for r in parts)
    result = in_stored_indices(result, compiled.logical)  # qkv.weight[0,0], not its view's [0,0,0]
    result["verdict"] = verdict(*parts)
    if not args.json:
        print(format_collectives(compiled.report["collectives"]))
        print(format_memory(compiled.report))
        print(format_search(compiled.report["search"], compiled.report.get("training") is not None))
        if "pipeline" in result:
            r = result["pipeline"]
            print(f"pipelined step on the numpy interpreter vs unsharded step, in float64: "
                  f"{vs_tolerance(r)} {'OK' if r['ok'] else verdict(r) + ': ' + r['why']}")
        print_training(result, f"numpy interpreter, {plural(steps, 'step')}, each from the "
                       f"unsharded run's state, in float64", compiled)
    return {**result, "collectives": collective_summary(compiled.report["collectives"]),
            "world_size": compiled.program.mesh.size, "steps": steps}


def print_training(result, how, compiled=None):
    print(f"{how}: losses {short_losses(result['losses'])}")
    why = []
    low = ((compiled.report.get("training") or {}).get("options") or {}).get("compute_dtype") if compiled else None
    lines = (("vs unsharded step", result), (f"in {low}, vs unsharded", result.get("native")),
             ("vs torch.optim", result.get("vs_torch")))
    for name, r in lines:
        if r is None:
            continue
        print(f"  {name + ':':22} loss {r['max_loss_err']:.2e}  grads {r['max_grad_err']:.2e}"
              f"  params {r['max_param_err']:.2e}  all carried {r['max_abs_err']:.2e}  ({vs_tolerance(r)})")
        if r.get("missing"):
            print(f"    missing from the program: {', '.join(r['missing'])}")
        if r["why"] and r["why"] not in [w for _, w in why]:
            why.append((name, r["why"]))
    if result.get("reference"):  # MoE capacity or dropout: no torch.optim line, say what instead
        print(f"  {'vs torch.optim:':22} not compared; the reference is {result['reference']}")
    word = result.get("verdict") or verdict(result)
    if word == "OK":
        print(f"  {BASIS.format(rtol=THRESHOLD)}")
    print(verdict_text(word, why))
