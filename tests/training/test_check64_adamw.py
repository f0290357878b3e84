"""The float64 check of AdamW: the step counter takes the graph's dtype, so the
unsharded reference computes AdamW's bias corrections in float64 like the promoted program
(a float32 counter made ``1 - beta2**t`` float32 there: 6.6e-9 apart in every weight)."""
from __future__ import annotations

from types import SimpleNamespace

from parcomp.check.check64 import promote_compiled, promote_feeds
from parcomp.check.training import numpy_train, train_steps
from parcomp.cli import commands
from parcomp.reference.interpreter import run_spmd

from numerics import assert_all_equivalent


def test_a_correct_adamw_tp2_program_equals_the_unsharded_steps_in_float64(tmp_path):
    spec = tmp_path / "tp2.pcs"
    spec.write_text("mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\n"
                    "train loss=mse optimizer=adamw(lr=0.01, weight_decay=0.1) input_grads=no steps=3\n")
    c, module, example = commands.compile_model(SimpleNamespace(model="specs/models.py:gpt2_mlp", spec=str(spec)),
                                           numeric="check")
    wide, feeds = promote_compiled(c), promote_feeds(commands.training_feeds(c, module, example, 0))
    prog = wide.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), wide.logical, feeds, 3)["state"]
    want = numpy_train(wide.logical, feeds, 3)["state"]
    keys = [k for k in want if k != "step"]
    assert len(keys) == 12 and all(got[k].dtype == "float64" for k in keys)
    assert_all_equivalent(got, want, keys)
