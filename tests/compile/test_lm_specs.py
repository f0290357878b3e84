"""The shipped transformer specs: GPT-2 and Llama LMs from torch.export, TP=2 and
DP=2 x TP=2 training, checked step by step against the unsharded model and torch.optim."""
from __future__ import annotations

import collections
import json
import os

import pytest

from parcomp.cli.main import main

from numerics import assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")


def _check(capsys, factory, spec):
    rc = main(["check", f"{MODELS}:{factory}", "--spec", os.path.join(ROOT, "specs", spec), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return rc, out


@pytest.mark.parametrize("factory,spec", [("gpt2_lm", "gpt2_lm_tp2_train.pcs"),
                                          ("llama_lm", "llama_lm_tp2_train.pcs")])
def test_tp2_lm_trains_like_torch_with_four_all_reduce_per_block(capsys, factory, spec):
    """Megatron's minimum: per block 2 all_reduce forward (attention and MLP outputs) and 2
    backward (their input gradients); both models have 2 blocks."""
    rc, out = _check(capsys, factory, spec)
    assert rc == 0
    assert_check_ok(out)
    kinds = [(c["kind"], c["phase"]) for c in out["collectives"]]
    assert kinds == [("all_reduce", "forward")] * 4 + [("all_reduce", "backward")] * 4


def test_gpt2_lm_dp2_tp2_trains_like_torch(capsys):
    rc, out = _check(capsys, "gpt2_lm", "gpt2_lm_dp2_tp2_train.pcs")
    assert rc == 0
    assert_check_ok(out)
    # data parallel: nothing gathered over dp, each gradient summed over dp; Megatron's
    # 4 all_reduce over tp a block, except backward values partial over dp as well, summed over
    # the joint dp,tp group at once; the 17 gradients summed over dp alone go in 3 buckets
    # (a bucket holds gradients of one layout)
    counts = collections.Counter((c["kind"], c["axis"], c["phase"]) for c in out["collectives"])
    assert counts == {("all_reduce", "tp", "forward"): 4, ("all_reduce", "tp", "backward"): 3,
                      ("all_reduce", "dp,tp", "backward"): 3, ("all_reduce", "dp", "loss"): 2,
                      ("all_reduce", "dp", "backward"): 3}


# Megatron sequence parallel (`sequence-parallel`): per block forward all_gather before the
# colwise matmuls and reduce_scatter after the rowwise ones; backward the mirror pairs; the
# final norm's all_gather before the LM head (and its gradient's before the last block's
# rowwise backward); one all_reduce of every norm-weight gradient
SP_FORWARD = [("all_gather", "forward"), ("reduce_scatter", "forward")] * 4 + [("all_gather", "forward")]
SP_BACKWARD = ([("all_gather", "backward")] + [("reduce_scatter", "backward"), ("all_gather", "backward")] * 4
               + [("all_reduce", "backward")])


@pytest.mark.parametrize("factory,spec,norm_grads", [("gpt2_lm", "gpt2_lm_tp2_sp_train.pcs", 10),
                                                     ("llama_lm", "llama_lm_tp2_sp_train.pcs", 5)])
def test_tp2_sp_lm_trains_like_torch_with_megatrons_sequence_parallel_collectives(capsys, factory, spec,
                                                                                  norm_grads):
    rc, out = _check(capsys, factory, spec)
    assert rc == 0
    assert_check_ok(out)
    colls = out["collectives"]
    assert [(c["kind"], c["phase"]) for c in colls] == SP_FORWARD + SP_BACKWARD
    assert len({c["bytes"] for c in colls if c["kind"] != "all_reduce"}) == 1  # AG and RS of equal bytes
    assert f"{norm_grads} norm-weight gradients" in colls[-1]["reason"]
    per_block = (len(colls) - 2) / 2  # less the final norm's pair; 2 blocks
    assert per_block <= 9  # the bound (DTensor's SP plan: 12)
