"""The batch stays split over the axes that split it (parcomp/passes/search/keep_dp.py): over ``dp``,
and over ``ep`` where the spec splits an input (its tokens) over it.

A model that computes its own loss sums it over the batch in its forward (transformers'
``ForCausalLMLoss``: sum over the counted tokens / their count); that partial sum over dp is the
loss's reduction, all-reduced once, exactly as ``train loss=cross_entropy``'s, never a reason to
gather the batch. An MoE LM under ``mesh ep=2`` keeps each rank's rows outside the experts.
Where no plan can keep the batch split, ``compile``, ``explain`` and report.json say so and
name the op that forces the gather.
"""
from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from parcomp.cli.main import main

from numerics import assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPECS = os.path.join(ROOT, "specs")
OWN_DP2 = os.path.join(SPECS, "gpt2_lm_loss_dp2_train.pcs")
MOE_EP2 = os.path.join(SPECS, "moe_lm_ep2_train.pcs")
# gpt2_lm_loss_dp2_train.pcs's plan on the logits: the loss taken by parcomp
LOGITS_DP2 = ("mesh dp=2\ninput input_ids [S(0)]\n"
              "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2\n")

# report.json's collectives per phase, (kind, axis, count): the loss's sum and token count summed
# once over dp, then the position-embedding gradient, the norm-weight gradients' flat buffer and
# one bucket of every other gradient. The model's own loss is computed in its forward, so its two
# all_reduces are in that phase; parcomp's loss=cross_entropy adds them in the loss phase.
OWN_DP2_PHASES = {"forward": [("all_reduce", "dp", 2)], "backward": [("all_reduce", "dp", 3)]}
LOGITS_DP2_PHASES = {"loss": [("all_reduce", "dp", 2)], "backward": [("all_reduce", "dp", 3)]}
# the MoE LM under ep=2: each block's tokens to their experts and back by all_to_all, forward and
# (transposed) backward; the loss's sum and count over ep; the gradients of the weights every ep
# rank holds whole (attention, router, norms, embedding, lm_head) summed over ep, the experts' not
MOE_EP2_PHASES = {"forward": [("all_to_all", "ep", 4)], "loss": [("all_reduce", "ep", 2)],
                  "backward": [("all_reduce", "ep", 13), ("all_to_all", "ep", 4)]}

# every row attends to every other row of the batch (the rows are the sequence of one sdpa):
# no strategy computes it on split rows, so the batch is gathered over dp
ROWS_ATTEND = """\
%x: f32[4,8] = input()
%w: f32[8,8] = param()
%h: f32[4,8] = matmul(%x, %w)
%q: f32[1,1,4,8] = reshape(%h)
%a: f32[1,1,4,8] = sdpa(%q, %q, %q) {causal=false, scale=0.35}
%y: f32[4,8] = reshape(%a)
return %y as output
"""
ROWS_DP2 = "mesh dp=2\ninput x [S(0)]\ntrain loss=mse optimizer=sgd(lr=0.1)\n"

# a statistic over the batch (the mean over the rows of each feature, subtracted from every row):
# its partial sum over dp is all-reduced once in the forward, the rows stay split
BATCH_MEAN = """\
%x: f32[4,8] = input()
%w: f32[8,8] = param()
%h: f32[4,8] = matmul(%x, %w)
%s: f32[8] = sum(%h) {dims=(0,)}
%m: f32[8] = scale(%s) {value=0.25}
%mb: f32[4,8] = expand(%m) {dims=(0,)}
%y: f32[4,8] = sub(%h, %mb)
return %y as output
"""


def _compile(tmp_path, capsys, model, spec, name="out"):
    """``parcomp compile``: (report.json, what it printed)."""
    out = tmp_path / name
    assert main(["compile", model, "--spec", str(spec), "-o", str(out)]) == 0
    return json.loads((out / "report.json").read_text()), capsys.readouterr().out


def _check(capsys, model, spec) -> dict:
    rc = main(["check", model, "--spec", str(spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rc == 0) == (out["verdict"] == "OK"), (rc, out.get("why"))
    return out


def _phases(report) -> dict:
    """``{phase: sorted [(kind, axis, count)]}`` of report.json's collectives."""
    per = {}
    for c in report["collectives"]:
        per.setdefault(c["phase"], Counter())[(c["kind"], c["axis"])] += 1
    return {p: sorted((k, a, n) for (k, a), n in c.items()) for p, c in per.items()}


def _same_collectives(report) -> list:
    """The collectives in program order as the logits-form comparison of tests/frontends/test_model_loss.py
    counts them: kind, axis, dim and bytes (the phase differs: see OWN_DP2_PHASES)."""
    return [(c["kind"], c["axis"], c["dim"], c["bytes"]) for c in report["collectives"]]


def _gathers_over(report, axis) -> list:
    return [c for c in report["collectives"]
            if c["kind"] == "all_gather" and axis in c["axis"].split(",")]


def test_own_loss_lm_keeps_the_batch_split_over_dp_like_the_logits_loss(tmp_path, capsys):
    """gpt2_lm_loss (transformers' loss in the model's forward) under dp=2: no all_gather over
    dp anywhere, the collectives of gpt2_lm with loss=cross_entropy, data parallel kept."""
    pytest.importorskip("transformers")
    spec = tmp_path / "logits.pcs"
    spec.write_text(LOGITS_DP2)
    own, printed = _compile(tmp_path, capsys, f"{MODELS}:gpt2_lm_loss", OWN_DP2, "own")
    ref, _ = _compile(tmp_path, capsys, f"{MODELS}:gpt2_lm", spec, "logits")
    assert _phases(own) == OWN_DP2_PHASES
    assert _phases(ref) == LOGITS_DP2_PHASES
    assert _same_collectives(own) == _same_collectives(ref)
    assert not _gathers_over(own, "dp")
    assert own["search"]["data_parallel"] is True and "note" not in own["search"]
    assert "all-gathered" not in printed
    # the loss's two reductions are the model's sum over its tokens and its count of them
    assert [c["name"] for c in own["collectives"] if c["phase"] == "forward"] == [
        "cross_entropy_loss_total.all_reduce_dp", "cross_entropy_loss_count.all_reduce_dp"]
    # the same per-rank memory as the logits form: each dp rank holds its own row only
    assert own["memory_bytes_per_rank"] == ref["memory_bytes_per_rank"]


def test_own_loss_lm_under_dp_trains_like_the_unsharded_model(capsys):
    """gpt2_lm_loss_dp2_train.pcs, one step on the numpy interpreter from the unsharded run's
    state: loss, gradients and parameters equal the unsharded step's and torch.optim's."""
    pytest.importorskip("transformers")
    out = _check(capsys, f"{MODELS}:gpt2_lm_loss", OWN_DP2)
    assert_check_ok(out)
    assert not _gathers_over(out, "dp")


def test_moe_lm_keeps_each_ep_ranks_rows_outside_the_experts(tmp_path, capsys):
    """A whole MoE LM under ep=2: input_ids stay split over ep at the embedding (attention,
    norms, router and loss run on each rank's own rows), the tokens reach the experts by
    all_to_all; no collective gathers over ep; the experts' gradients are never summed over ep."""
    pytest.importorskip("transformers")
    report, printed = _compile(tmp_path, capsys, f"{MODELS}:moe_lm", MOE_EP2)
    assert _phases(report) == MOE_EP2_PHASES
    assert not _gathers_over(report, "ep") and "all-gathered" not in printed
    assert report["search"]["data_parallel"] is True
    reduced = [c["name"] for c in report["collectives"] if c["kind"] == "all_reduce" and c["phase"] == "backward"]
    assert not [r for r in reduced if "experts" in r], reduced
    # the dispatches' four all_to_all are ragged (only routed tokens travel), their transposes too
    ragged = [c for c in report["collectives"] if "ragged: only the routed" in c["reason"]]
    assert len(ragged) == 8


def test_moe_lm_under_ep_trains_like_the_unsharded_model(capsys):
    pytest.importorskip("transformers")
    out = _check(capsys, f"{MODELS}:moe_lm", MOE_EP2)
    assert_check_ok(out)
    assert not _gathers_over(out, "ep")


def test_a_statistic_over_the_batch_is_all_reduced_not_gathered(tmp_path, capsys):
    """The mean over the batch's rows is a reduction over the split dim: its partial sum [8] is
    all-reduced once in the forward (mean = sum / global count), not the [4, 8] partial sum of
    its broadcast reduce-scattered; the rows stay split, and the training step equals the
    unsharded one."""
    model, spec = tmp_path / "mean.pcir", tmp_path / "mean.pcs"
    model.write_text(BATCH_MEAN)
    spec.write_text(ROWS_DP2)
    report, _ = _compile(tmp_path, capsys, str(model), spec)
    assert report["search"]["data_parallel"] is True and not _gathers_over(report, "dp")
    assert [(c["kind"], c["name"]) for c in report["collectives"] if c["phase"] == "forward"] == [
        ("all_reduce", "s.all_reduce_dp")]
    out = _check(capsys, str(model), spec)
    assert out["verdict"] == "OK", out.get("why")


def test_where_no_plan_keeps_the_batch_split_compile_explain_and_report_name_the_op(tmp_path, capsys):
    """Rows attending to each other (one sdpa over the batch) cannot run on split rows: the batch
    is gathered over dp, and compile's output, report.json and explain (text and --json) say
    that no plan keeps it split and name the sdpa and the operand it needs whole."""
    model, spec = tmp_path / "rows.pcir", tmp_path / "rows.pcs"
    model.write_text(ROWS_ATTEND)
    spec.write_text(ROWS_DP2)
    report, printed = _compile(tmp_path, capsys, str(model), spec)
    search = report["search"]
    assert search["data_parallel"] is False and _gathers_over(report, "dp")
    assert search["batch_gathered_by"]["node"] == "a" and search["batch_gathered_by"]["op"] == "sdpa"
    cause = "no plan here can: sdpa %a reads %q only as [R], but with the batch split over dp it is"
    assert cause in search["note"]
    assert cause in printed
    assert main(["explain", str(model), "--spec", str(spec)]) == 0
    text = capsys.readouterr().out
    assert "data parallel: activations are all-gathered over dp" in text and cause in text
    assert main(["explain", str(model), "--spec", str(spec), "--json"]) == 0
    x = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["explain"]
    assert x["data_parallel"] is False and x["batch_gathered_by"]["op"] == "sdpa"
    assert cause in x["data_parallel_note"]


@pytest.mark.slow
@pytest.mark.parametrize("factory,spec,axis", [("gpt2_lm_loss", OWN_DP2, "dp"), ("moe_lm", MOE_EP2, "ep")])
def test_batch_split_specs_train_under_torchrun_like_the_unsharded_model(capsys, factory, spec, axis):
    """program.py on 2 gloo ranks, each on its own rows: the steps equal the unsharded model's."""
    pytest.importorskip("transformers")
    rc = main(["run", f"{MODELS}:{factory}", "--spec", spec, "--nproc", "2", "--steps", "1", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (rc == 0) == (out["verdict"] == "OK"), (rc, out.get("why"))
    assert out["world_size"] == 2 and len(out["losses"]) == 1
    assert not _gathers_over(out, axis)
