"""Sharded checkpoints of a training program.py: torch.distributed.checkpoint save and
resume, on the same or another mesh; atomic saves."""
from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check.training import numpy_train
from parcomp.cli import commands
from parcomp_backends.torch.launch import assemble_training_outputs, run_torchrun, write_program

from numerics import assert_all_equivalent

BODY = "train loss=mse optimizer=adamw(lr=0.01) input_grads=no steps=3\n"
TP2 = "mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\n" + BODY
DP2 = "mesh dp=2\ninput x [S(0)]\n" + BODY
MODEL = "specs/models.py:gpt2_mlp"


def _compile(tmp_path, text, name):
    path = tmp_path / f"{name}.pcs"
    path.write_text(text)
    c, module, example = commands.compile_model(SimpleNamespace(model=MODEL, spec=str(path)), numeric="check")
    return c, module, example


def _launch(directory, compiled, module, feeds, extra):
    import torch

    write_program(compiled, directory)
    inputs = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if k in ("x", "target")}
    res = run_torchrun(directory, 2, module, inputs, directory / "out.pt", ("--device", "cpu", *extra),
                       timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    return res


# a launcher that runs program.py with rank 1 dying right after torch.distributed.checkpoint has
# written its part of a save and before the save is committed (renamed, ``latest`` replaced)
DYING = """\
import os, runpy, sys
import torch.distributed.checkpoint as dcp
real = dcp.save
def dying(*args, **kw):
    out = real(*args, **kw)
    if os.environ["RANK"] == "1":
        os._exit(9)
    return out
dcp.save = dying
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


def _launch(directory, compiled, module, feeds, extra, program="program.py", ok=True):
    import torch

    write_program(compiled, directory)
    (directory / "dying.py").write_text(DYING)
    inputs = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if k in ("x", "target")}
    res = run_torchrun(directory, 2, module, inputs, directory / "out.pt", ("--device", "cpu", *extra),
                       timeout=300, program=program)
    assert (res.returncode == 0) == ok, res.stderr[-4000:]
    return res


@pytest.mark.slow
def test_resume_on_another_mesh_after_a_killed_save_equals_the_unsharded_steps(tmp_path):
    """2 AdamW steps on tp=2, saved; a run that resumes, trains step 3 and is killed (rank 1)
    during its save: the previous checkpoint stays the one ``latest`` names. Resumed on
    dp=2 (another program, another layout of every tensor), step 3 equals 3 unsharded steps
    (params, optimizer state and the step counter carried over). The saved checkpoint also
    loads into plain torch (dcp_to_torch_save) as the full tensors of 2 unsharded steps."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    tp, module, example = _compile(tmp_path, TP2, "tp2")
    dp, _, _ = _compile(tmp_path, DP2, "dp2")
    feeds = commands.training_feeds(tp, module, example, 0)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    res = _launch(tmp_path / "a", tp, module, feeds, ("--steps", "2", "--save", str(ckpt)))
    assert (ckpt / "latest").read_text().strip() == "step-2" and "saved step 2" in res.stdout
    res = _launch(tmp_path / "k", tp, module, feeds, ("--steps", "1", "--resume", str(ckpt), "--save", str(ckpt)),
                  program="dying.py", ok=False)
    assert "step 3 loss" in res.stdout and (ckpt / "step-3.partial").is_dir()  # killed while saving
    assert (ckpt / "latest").read_text().strip() == "step-2" and not (ckpt / "step-3").exists()
    res = _launch(tmp_path / "b", dp, module, feeds, ("--steps", "1", "--resume", str(ckpt)))
    assert "step 3 loss" in res.stdout and "step 1 loss" not in res.stdout
    out, losses = assemble_training_outputs(tmp_path / "b" / "out.pt", dp.program)
    want = numpy_train(tp.logical, feeds, 3)
    keys = [k for k in want["state"] if k in out]
    assert len(keys) == 12  # 4 params, their exp_avg and exp_avg_sq
    assert_all_equivalent({k: out[k] for k in keys}, want["state"], keys)
    dcp_to_torch_save(str(ckpt / "step-2"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt")
    two = numpy_train(tp.logical, feeds, 2)
    assert int(full["step"]) == 2
    assert_all_equivalent({k: full[k].numpy() for k in keys}, two["state"], keys)


@pytest.mark.slow
def test_export_of_a_tp2_checkpoint_is_a_full_safetensors_transformers_loads(tmp_path):
    """3 AdamW steps on tp=2, saved; exported to model.safetensors: transformers' own loader
    (the one from_pretrained uses) reads it, GPT2MLP loads it strictly, and its weights are
    the full tensors of 3 unsharded steps. A second export to the same path is refused."""
    import torch
    from transformers.modeling_utils import load_state_dict

    from parcomp.errors import ParcompError
    from parcomp.cli.export import export_safetensors

    tp, module, example = _compile(tmp_path, TP2, "tp2")
    feeds = commands.training_feeds(tp, module, example, 0)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    _launch(tmp_path / "a", tp, module, feeds, ("--steps", "3", "--save", str(ckpt)))
    out = tmp_path / "model.safetensors"
    names = export_safetensors(tp, str(ckpt), str(out))
    assert sorted(names) == sorted(k for k, _ in module.named_parameters())
    sd = load_state_dict(str(out))
    mlp = copy.deepcopy(module)  # transformers' GPT2MLP, its own weights replaced below
    mlp.load_state_dict(sd, strict=True)
    want = numpy_train(tp.logical, feeds, 3)
    got = {k: v.detach().numpy() for k, v in mlp.state_dict().items()}
    assert_all_equivalent(got, want["state"], names)
    assert not np.allclose(got["c_fc.weight"], module.c_fc.weight.detach().numpy())  # trained
    with pytest.raises(ParcompError, match="exists"):
        export_safetensors(tp, str(ckpt), str(out))
    assert isinstance(sd["c_fc.weight"], torch.Tensor) and sd["c_fc.weight"].is_contiguous()


def test_export_restores_stored_shapes():
    """A per-part view goes back to the checkpoint's fused shape; a padded vocab table loses
    its padding rows."""
    import torch

    from parcomp.cli.export import _stored

    fused = torch.arange(24.0).reshape(2, 3, 4)  # [in, 3, out] view of a [in, 3*out] Conv1D weight
    assert _stored(fused, (2, 12)).shape == (2, 12) and torch.equal(_stored(fused, (2, 12)).reshape(2, 3, 4), fused)
    padded = torch.arange(12.0).reshape(6, 2)  # vocab 5 padded to 6 rows
    assert torch.equal(_stored(padded, (5, 2)), padded[:5])
    assert torch.equal(_stored(padded, None), padded)
    # a grouped q|k|v view [parts, G*hd, in]: its head units (rows of 1 here) back in stored order
    grouped = torch.arange(8.0).reshape(4, 2, 1)  # q heads 0,2 | 1,3 | keys | values
    want = torch.tensor([0.0, 2.0, 1.0, 3.0, 4.0, 5.0, 6.0, 7.0]).reshape(8, 1)  # stored: q0 q1 q2 q3 k0 k1 v0 v1
    assert torch.equal(_stored(grouped, (8, 1), (0, 2, 1, 3, 4, 5, 6, 7)), want)


@pytest.mark.slow
def test_gpt2_tp2_checkpoint_exports_to_what_from_pretrained_loads(tmp_path, capsys):
    """2 AdamW steps of specs/gpt2_lm_tp2_train.pcs under torchrun, saved sharded by DCP;
    ``parcomp export`` writes a directory GPT2LMHeadModel.from_pretrained loads with nothing
    missing or unexpected, the tied embedding written once and equal to the checkpoint's full
    tensor, and its logits those of the model holding the checkpoint's tensors (the
    equivalence of TP=2 and unsharded training: tests/cli/test_export.py, in float64)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import GPT2LMHeadModel

    from parcomp.cli.main import main

    model, spec = "specs/models.py:gpt2_lm", "specs/gpt2_lm_tp2_train.pcs"
    c, module, example = commands.compile_model(SimpleNamespace(model=model, spec=spec), numeric="check")
    feeds = commands.training_feeds(c, module, example, 0)
    ckpt, work = tmp_path / "ckpt", tmp_path / "a"
    ckpt.mkdir()
    write_program(c, work)
    inputs = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("input_ids", "labels")}
    weights = commands.checkpoint_file(str(work), c.unsharded, feeds, module)  # folded constants too
    res = run_torchrun(work, 2, weights, inputs, work / "out.pt",
                       ("--device", "cpu", "--steps", "2", "--save", str(ckpt)), timeout=300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = tmp_path / "hf"
    assert main(["export", model, "--spec", spec, str(ckpt), "-o", str(out)]) == 0
    assert "wrote model.safetensors, config.json" in capsys.readouterr().out
    got, info = GPT2LMHeadModel.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert got.lm_head.weight is got.transformer.wte.weight
    dcp_to_torch_save(str(ckpt / "step-2"), str(tmp_path / "full.pt"))
    full = torch.load(tmp_path / "full.pt")
    assert int(full["step"]) == 2
    want = copy.deepcopy(module)
    want.load_state_dict({k: full[k].reshape(v.shape) for k, v in want.state_dict().items() if k in full},
                         strict=False)  # the fused c_attn's per-part view back in its stored shape
    for k, v in want.state_dict().items():  # lm_head.weight is transformer.wte.weight in both
        np.testing.assert_array_equal(got.state_dict()[k].numpy(), v.numpy())
    assert not np.array_equal(want.lm_head.weight.detach().numpy(), module.lm_head.weight.detach().numpy())
    ids = torch.from_numpy(np.asarray(feeds["input_ids"]))
    with torch.no_grad():
        np.testing.assert_array_equal(got.eval()(ids).logits.numpy(), want(ids).logits.numpy())


# a launcher that runs program.py with rank 1 dying when the 4th save starts (after step 4):
# the checkpoints of steps 1-3 are committed, the 4th is never written
DIES_AT_FOURTH_SAVE = """\
import os, runpy, sys
import torch.distributed.checkpoint as dcp
real, calls = dcp.save, []
def dying(*args, **kw):
    calls.append(1)
    if len(calls) == 4 and os.environ["RANK"] == "1":
        os._exit(9)
    return real(*args, **kw)
dcp.save = dying
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
def test_run_killed_after_step_3_of_6_with_save_every_1_resumes_equal_to_the_unkilled_run(tmp_path):
    """6 AdamW steps on tp=2 with ``--save-every 1``, rank 1 killed as step 4's save starts:
    ``latest`` names step 3 (steps 1-3 committed, nothing partial of step 4 is trusted). The
    run resumed from it for steps 4-6 ends bit-equal to a run of 6 steps that was never
    killed (params, optimizer state, the last loss); step 4's unfinished save is replaced."""
    tp, module, example = _compile(tmp_path, TP2, "tp2")
    feeds = commands.training_feeds(tp, module, example, 0)
    ckpt = tmp_path / "ckpt"
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "dies.py").write_text(DIES_AT_FOURTH_SAVE)
    res = _launch(tmp_path / "k", tp, module, feeds, ("--steps", "6", "--save", str(ckpt), "--save-every", "1"),
                  program="dies.py", ok=False)
    assert "saved step 3" in res.stdout and "saved step 4" not in res.stdout
    assert (ckpt / "latest").read_text().strip() == "step-3"
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == [
        "step-1", "step-2", "step-3", "step-4.partial"]  # rank 0 wrote its part of step 4's save
    res = _launch(tmp_path / "r", tp, module, feeds, ("--steps", "3", "--resume", str(ckpt), "--save", str(ckpt),
                                                     "--save-every", "1"))
    assert "step 4 loss" in res.stdout and "step 3 loss" not in res.stdout and "saved step 6" in res.stdout
    assert (ckpt / "latest").read_text().strip() == "step-6" and not (ckpt / "step-4.partial").exists()
    _launch(tmp_path / "u", tp, module, feeds, ("--steps", "6"))
    resumed, r_losses = assemble_training_outputs(tmp_path / "r" / "out.pt", tp.program)
    whole, w_losses = assemble_training_outputs(tmp_path / "u" / "out.pt", tp.program)
    keys = [k for k in whole if k.endswith(("weight", "bias", "exp_avg", "exp_avg_sq"))]
    assert len(keys) == 12
    for k in keys:
        assert np.array_equal(resumed[k], whole[k]), k
    assert r_losses[-1] == w_losses[-1] and len(r_losses) == 3


# a launcher of program.py whose rank 0, in step 2, sends SIGTERM to torchrun (as SLURM or
# Kubernetes does before killing a job; torchrun passes it on to every rank) and waits, at most
# 60 s, until its own handler has seen it: every rank then stops after step 2 or 3 (rank 1 may
# still be ending step 1 when its SIGTERM comes)
SIGNALLED = """\
import importlib.util, os, signal, sys, time
spec = importlib.util.spec_from_file_location("program", "program.py")
program = importlib.util.module_from_spec(spec)
sys.argv[0] = "program.py"
spec.loader.exec_module(program)
real, calls = program.train_step, []
def step(params, inputs):
    calls.append(1)
    if len(calls) == 2 and os.environ["RANK"] == "0":
        os.kill(os.getppid(), signal.SIGTERM)
        end = time.monotonic() + 60
        while not getattr(program, "STOP", {}).get("asked") and time.monotonic() < end:
            time.sleep(0.01)
    return real(params, inputs)
program.train_step = step
try:
    program.main()
except SystemExit as e:
    program.exit_now(e.code if isinstance(e.code, int) else 1)
program.exit_now(0)
"""


@pytest.mark.slow
def test_run_stopped_by_sigterm_saves_its_step_and_resumes_equal_to_the_unstopped_run(tmp_path):
    """6 AdamW steps on tp=2 with ``--save`` (no --save-every); torchrun gets SIGTERM in rank 0's
    step 2: every rank ends the same step K (2 or 3: the step each rank's signal came in, at most
    one more), saves it (``latest`` names step-K), rank 0 says how to go on and each exits 143
    without --output or a rank's error. Resumed for steps K+1..6, the run ends bit-equal to 6
    steps never stopped (params, optimizer state, every later loss)."""
    tp, module, example = _compile(tmp_path, TP2, "tp2")
    feeds = commands.training_feeds(tp, module, example, 0)
    ckpt = tmp_path / "ckpt"
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "signalled.py").write_text(SIGNALLED)
    res = _launch(tmp_path / "s", tp, module, feeds, ("--steps", "6", "--save", str(ckpt), "--timeout", "60"),
                  program="signalled.py", ok=False)
    latest = (ckpt / "latest").read_text().strip()
    assert latest in ("step-2", "step-3"), res.stdout[-2000:] + res.stderr[-4000:]
    k = int(latest[5:])
    assert f"stopped by SIGTERM after step {k}: saved {ckpt / latest}; go on with --resume {ckpt}" in res.stdout, \
        res.stdout[-2000:] + res.stderr[-4000:]
    assert f"step {k + 1} loss" not in res.stdout and not (tmp_path / "s" / "out.pt").exists()
    assert "program.py (rank" not in res.stderr, res.stderr[-4000:]  # no rank reports a failure
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", latest]
    res = _launch(tmp_path / "r", tp, module, feeds, ("--steps", str(6 - k), "--resume", str(ckpt)))
    assert f"step {k + 1} loss" in res.stdout and f"step {k} loss" not in res.stdout
    _launch(tmp_path / "u", tp, module, feeds, ("--steps", "6"))
    resumed, r_losses = assemble_training_outputs(tmp_path / "r" / "out.pt", tp.program)
    whole, w_losses = assemble_training_outputs(tmp_path / "u" / "out.pt", tp.program)
    keys = [name for name in whole if name.endswith(("weight", "bias", "exp_avg", "exp_avg_sq"))]
    assert len(keys) == 12
    for name in keys:
        assert np.array_equal(resumed[name], whole[name]), name
    assert r_losses == w_losses[k:]


# a launcher that runs program.py with rank 1 dying when the 3rd save starts (after step 3)
DIES_AT_THIRD_SAVE = DIES_AT_FOURTH_SAVE.replace("len(calls) == 4", "len(calls) == 3")


@pytest.mark.slow
def test_train_steps_run_killed_at_step_2_of_4_rerun_with_the_same_command_ends_at_step_4(tmp_path):
    """``--train-steps 4 --save-every 1``, rank 1 killed as step 3's save starts (steps 1-2
    committed); the same command again resumes from step 2 for steps 3-4 (not 4 more), ends
    bit-equal to 4 steps never killed, and removes the unfinished saves parcomp marked as its
    own (a directory step-K.partial without the mark stays); a third time it exits 0 at once."""
    tp, module, example = _compile(tmp_path, TP2, "tp2")
    feeds = commands.training_feeds(tp, module, example, 0)
    ckpt = tmp_path / "ckpt"
    command = ("--train-steps", "4", "--save", str(ckpt), "--save-every", "1")
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "dies.py").write_text(DIES_AT_THIRD_SAVE)
    res = _launch(tmp_path / "k", tp, module, feeds, command, program="dies.py", ok=False)
    assert "saved step 2" in res.stdout and "saved step 3" not in res.stdout
    assert (ckpt / "latest").read_text().strip() == "step-2"
    assert (ckpt / "step-3.partial" / "PARCOMP_SAVING").is_file()
    (ckpt / "step-3.partial").rename(ckpt / "step-9.partial")  # a step this run never saves again
    (ckpt / "step-8.partial").mkdir()  # not parcomp's: no mark
    res = _launch(tmp_path / "r", tp, module, feeds, command + ("--resume", str(ckpt)))
    assert f"resumed from {ckpt / 'step-2'} (step 2)" in res.stdout
    assert [int(k) for k in re.findall(r"step (\d+) loss", res.stdout)] == [3, 4]
    assert (ckpt / "latest").read_text().strip() == "step-4"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-1", "step-2", "step-3", "step-4",
                                                      "step-8.partial"]
    assert not list(ckpt.glob("step-*/PARCOMP_SAVING"))
    _launch(tmp_path / "u", tp, module, feeds, ("--train-steps", "4"))
    resumed, r_losses = assemble_training_outputs(tmp_path / "r" / "out.pt", tp.program)
    whole, w_losses = assemble_training_outputs(tmp_path / "u" / "out.pt", tp.program)
    keys = [k for k in whole if k.endswith(("weight", "bias", "exp_avg", "exp_avg_sq"))]
    assert len(keys) == 12
    for k in keys:
        assert np.array_equal(resumed[k], whole[k]), k
    assert r_losses == w_losses[2:] and len(w_losses) == 4
    res = _launch(tmp_path / "again", tp, module, feeds, command + ("--resume", str(ckpt)))
    assert "step 4 is saved, --train-steps is 4: nothing left to train" in res.stdout
    assert "loss" not in res.stdout
