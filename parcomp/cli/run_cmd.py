"""The body of ``parcomp run``: program.py under torchrun on local gloo ranks, against the unsharded model."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

import numpy as np

from ..check.budget import check_memory
from ..check.differential import compare_outputs, least_precise, tolerance_for, verdict
from ..check.train_check import carried as _carried, compute_dtype, optimizer_on, replay_reference
from ..check.train_check import torch_reference as _torch_reference, training_result as _training_result, verdict_text
from ..check.training import numpy_train
from ..errors import ParcompError
from ..frontends.model_file import ModelFile
from ..outdir import record_written, write_dir_atomic
from ..passes.fused_weights import in_stored_indices, parts_to_stored, to_view_shapes  # attention part
from ..report.report import format_collectives
from ..spec.train_config import check_steps, train_config
from ..units import plural
from .common import (compile_model, feeds_for, input_feeds, is_torch_module, print_kept, print_result, program_files, reference_module,
                              require_ids_in_tables,
                              reference_outputs, short_losses, collective_summary, training_feeds, vs_tolerance)


#: what ``run``'s verdict says and what it does not (the sharding is proven by ``check``)
RUN_NOTE = ("torchrun's {dtype} result against the unsharded model in {dtype}, within {rtol:.0e} of each "
            "value's scale: a check of the program on real ranks; the sharding itself is proven by the "
            "float64 check of the same program (parcomp check, docs/design/check.md \"How check decides\")")

RUN_FILES = ("model.pt", "inputs.pt", "outputs.pt", "replay.pt")  # what ``run`` writes besides the program


def run_files(compiled) -> tuple:
    """What ``run`` writes into its work directory besides the program: RUN_FILES and
    each rank's ``outputs.rank{r}.pt``."""
    stages = compiled.program_.pipeline.stages if compiled.program_.pipeline is not None else ()
    return (RUN_FILES + tuple(f"outputs.rank{r}.pt" for r in range(compiled.program.mesh.size))
            + tuple(f"outputs.pt.stage{s.index}" for s in stages))  # a pipeline's (pipeline_run.py)


def write_work(args, work: str, compiled, module=None) -> None:
    kept = write_dir_atomic(work, program_files(compiled, "torch", args.profile,
                                                os.path.basename(args.model), module=module),
                            run_files(compiled),
                            flag="--keep" if args.keep else "the work directory", command="run")
    if args.keep and not args.json:
        print_kept(work, kept)


def end_work(args, work: str, compiled) -> None:
    """After a run: ``--keep``'s run files get their hashes in the manifest (a later edit
    makes them the user's); a temporary work directory is removed."""
    if args.keep:
        record_written(work, run_files(compiled))
    else:
        shutil.rmtree(work, ignore_errors=True)


def checkpoint_file(work: str, graph, feeds: dict, module) -> str:
    """The checkpoint program.py reads: a model file itself (its weights, each rank reading
    its slices), else ``work/model.pt`` written from ``feeds``: a tied weight under each of
    its names (param attr ``aliases``; one storage in the file), so that it is also the
    model's ``state_dict`` for ``load_state_dict(strict=True)``."""
    if isinstance(module, ModelFile):
        return module.path
    import torch

    path, tensors = os.path.join(work, "model.pt"), {}
    for n in graph.params:
        value = feeds[n.name]  # np.ascontiguousarray makes a 0-d value (a scalar constant) 1-d
        tensors[n.name] = torch.from_numpy(np.ascontiguousarray(value).reshape(np.shape(value)))
        for alias in filter(None, (n.attr("aliases") or "").split(",")):
            tensors.setdefault(alias, tensors[n.name])
    torch.save(parts_to_stored(tensors, graph, derived=False), path)  # a multi-query weight whole
    return path


def run(args):
    """``parcomp run``: launch program.py on ``--nproc`` local gloo ranks with torchrun and compare
    with the unsharded module (for training: K steps against torch.optim / the unsharded step)."""
    from parcomp_backends.torch.launch import assemble_outputs, run_torchrun, write_inputs

    compiled, module, example = compile_model(args, numeric="run")
    if compiled.program_.pipeline is not None:  # one pipelined step (parcomp/cli/run_pipeline.py)
        from .run_pipeline import run_pipeline

        return run_pipeline(args, compiled, training_feeds(compiled, module, example, 0),
                            lambda work: write_work(args, work, compiled, module),
                            lambda work: end_work(args, work, compiled))
    if args.nproc == compiled.program.mesh.size:  # else the --nproc error below comes first
        check_memory(compiled, "run")
    if compiled.report.get("training"):
        return run_training(args, compiled, module, example)
    if args.steps is not None:
        raise ParcompError(f"--steps {args.steps}: the spec has no train line, so the program is "
                           f"one forward pass; drop --steps or add a train line")
    size = compiled.program.mesh.size
    if args.nproc != size:
        raise ParcompError(f"--nproc {args.nproc} but the spec's mesh {compiled.program.mesh} has "
                           f"{plural(size, 'rank')}")
    graph = compiled.unsharded
    feeds = feeds_for(graph, module, example)
    require_ids_in_tables(graph, feeds)  # before launching: torch's IndexError is no located error
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="parcomp-run-")
    try:
        write_work(args, work, compiled, module)
        ckpt = checkpoint_file(work, graph, feeds, module)
        write_inputs({n.name: feeds[n.name] for n in graph.inputs}, os.path.join(work, "inputs.pt"))
        out_path = os.path.join(work, "outputs.pt")
        proc = run_torchrun(work, size, ckpt, os.path.join(work, "inputs.pt"),
                            out_path, extra_args=("--device", "cpu"))
        if proc.returncode != 0:
            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise ParcompError(f"the program failed on {plural(size, 'rank')} (exit {proc.returncode}); "
                               f"its output is above")
        got = assemble_outputs(out_path, compiled.program)
    finally:
        end_work(args, work, compiled)
    dtype = least_precise(compiled.unsharded)
    result = compare_outputs(got, reference_outputs(graph, reference_module(compiled, module), example, feeds),
                             tolerance_for(dtype))
    result["note"] = RUN_NOTE.format(dtype=dtype, rtol=tolerance_for(dtype))
    print_result(args, compiled, result, f"torchrun, {plural(size, 'gloo rank')}")
    return {**result, "collectives": collective_summary(compiled.report["collectives"]), "world_size": size}


def launch_run(compiled, work, feeds, nproc, extra, module=None):
    from parcomp_backends.torch.launch import run_torchrun, write_inputs

    ckpt = checkpoint_file(work, compiled.unsharded, feeds, module)
    write_inputs(input_feeds(compiled, feeds), os.path.join(work, "inputs.pt"))
    out_path = os.path.join(work, "outputs.pt")
    for attempt in (1, 2):  # exit 2: program.py's own located error; other codes may be the
        # launcher's (a free port taken before torchrun bound it): one retry on a new port
        proc = run_torchrun(work, nproc, ckpt, os.path.join(work, "inputs.pt"),
                            out_path, extra_args=("--device", "cpu", *extra))
        if proc.returncode in (0, 2) or attempt == 2:
            break
        print(f"parcomp run: torchrun exited {proc.returncode}; retrying once on a new port",
              file=sys.stderr, flush=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise ParcompError(f"the program failed on {plural(nproc, 'rank')} (exit {proc.returncode}); "
                           f"its output is above")
    return out_path


def run_training(args, compiled, module, example):
    """``run`` of a training program: program.py under torchrun twice, with ``--replay`` (each
    step from the reference state, every carried value within the dtype's tolerance: the
    verdict's main evidence; see :mod:`parcomp.check.train_check`) and free-running (its losses
    against the reference's, :func:`free_running`)."""
    from parcomp_backends.torch import assemble_training_outputs
    import torch

    size = compiled.program.mesh.size
    if args.nproc != size:
        raise ParcompError(f"--nproc {args.nproc} but the spec's mesh {compiled.program.mesh} has "
                           f"{plural(size, 'rank')}")
    steps = train_config(compiled.spec).steps if args.steps is None else check_steps(args.steps)
    feeds = training_feeds(compiled, module, example, 0)
    require_ids_in_tables(compiled.unsharded, feeds)
    module = reference_module(compiled, module)  # the spec's MoE capacity
    replay = replay_reference(compiled, module if is_torch_module(module) else None, example, feeds, steps)
    work = os.path.abspath(args.keep) if args.keep else tempfile.mkdtemp(prefix="parcomp-run-")
    try:
        write_work(args, work, compiled, module)
        out_path = launch_run(compiled, work, feeds, size, ("--steps", str(steps)), module)
        outputs, losses = assemble_training_outputs(out_path, compiled.program)
        # absolute: torchrun runs program.py in ``work``, where a relative --keep is not
        replay_path = os.path.abspath(os.path.join(work, "replay.pt"))
        torch.save([{k: torch.from_numpy(np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in s.items()}
                    for s in replay["starts"]], replay_path)
        out_path = launch_run(compiled, work, feeds, size, ("--steps", str(steps), "--replay", replay_path),
                              module)
        replayed, replayed_losses = assemble_training_outputs(out_path, compiled.program)
    finally:
        end_work(args, work, compiled)
    params = [n.name for n in compiled.unsharded.params]
    dtype = compute_dtype(compiled) or least_precise(compiled.unsharded)
    rtol = tolerance_for(dtype)
    got = {**to_view_shapes(replay["starts"][-1], compiled.logical), **replayed,
           "losses": np.array(replayed_losses, "float32")}
    want = dict(replay["want"])  # the optimizer: the unsharded one on program.py's gradients
    want.update({k: v for k, v in optimizer_on(compiled.logical, replay["start"], replayed).items() if k in want})
    result = _training_result(got, want, params, rtol)
    # the free-running trajectory: what program.py carries, the checkpoint's buffers and frozen
    # params staying as loaded
    kept = to_view_shapes({n.name: feeds[n.name] for n in compiled.logical.params if n.name in feeds},
                          compiled.logical)
    got = {**kept, **outputs, "losses": np.array(losses, "float32")}
    if is_torch_module(module):
        ref_losses, want = _torch_reference(compiled, module, example, feeds, steps)
    else:
        ref = numpy_train(compiled.logical, feeds, steps)
        ref_losses, want = ref["losses"], _carried(ref)
    result["free_running"] = free_running(got, want, params, rtol)
    result["ok"] = result["ok"] and result["free_running"]["ok"]
    result["note"] = RUN_NOTE.format(dtype=dtype, rtol=rtol)
    result = in_stored_indices(result, compiled.logical)  # qkv.weight[0,0], not its view's [0,0,0]
    result["verdict"] = verdict(result, result["free_running"])
    result["losses"], result["reference_losses"] = losses, ref_losses
    if not args.json:
        print(format_collectives(compiled.report["collectives"]))
        ref_name = "torch.optim" if is_torch_module(module) else "unsharded numpy"
        print_run_training(result, size, steps, ref_name, ref_losses)
    return {**result, "collectives": collective_summary(compiled.report["collectives"]), "world_size": size,
            "steps": steps}


def free_running(got: dict, want: dict, params, rtol: float) -> dict:
    """Free-running trajectories (program.py's ``--steps`` against the reference's): every step's
    loss is judged within ``rtol``; the other carried values are compared and reported, not
    judged (AdamW turns the rounding of a near-zero gradient into a move of ~lr, and the next
    step starts from there: trajectories part by rounding alone, parcomp/check/train_check.py)."""
    res = _training_result(got, want, params, rtol)
    losses = _training_result({"losses": got.get("losses")} if "losses" in got else {},
                              {"losses": want["losses"]}, params, rtol)
    judged = ("ok", "why", "rel_err", "tolerance", "err_over_tol", "worst")
    return {**res, **{k: losses[k] for k in judged}, "drift": {k: res[k] for k in ("rel_err", "worst")},
            "note": f"only the losses are judged; the other carried values drift apart by rounding: "
                    f"{res['rel_err']:.1e} of the scale at {res['worst']}"}


def print_run_training(result, size, steps, ref_name, ref_losses):
    free = result["free_running"]
    print(f"torchrun, {plural(size, 'gloo rank')}, {plural(steps, 'step')}: losses "
          f"{short_losses(result['losses'])}")
    print(f"  reference losses: {short_losses(ref_losses)}")
    for name, r in ((f"each step from the unsharded run's state, vs {ref_name}", result),
                    ("free-running, vs " + ref_name, free)):
        print(f"  {name}:\n    loss {r['max_loss_err']:.2e}  grads {r['max_grad_err']:.2e}"
              f"  params {r['max_param_err']:.2e}  all carried {r['max_abs_err']:.2e}  "
              + f"({vs_tolerance(r)}{'; ' + r['note'] if r is free else ''})")
        if r.get("missing"):
            print(f"    missing from the program: {', '.join(r['missing'])}")
    if result.get("note"):  # what the verdict rests on; the last line is the verdict
        print(f"  note: {result['note']}")
    word = result["verdict"]
    why = [w for w in (result["why"], free["why"] if not free["ok"] else "") if w]
    print(verdict_text(word, [("", w) for w in why]))
