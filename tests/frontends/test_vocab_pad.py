"""A torch model's vocab not divisible by tp: GPT-2's tied table (101 rows, as
50257 is odd) split over tp=2 is padded to 102 rows the way Megatron pads it; the padded
logits are masked and sliced off, the loss stays vocab-parallel, and everything equals the
unsharded transformers model and torch.optim (parcomp/passes/vocab_pad.py)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.passes.fused_weights import to_stored_shapes, to_view_shapes

from graphs import spec
from numerics import assert_check_ok

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPEC = ("mesh tp=2\nlm_head.weight [S(0)]   # the tied wte/lm_head table, 101 rows\n"
        "transformer.h.*.attn.c_attn.weight colwise\ntransformer.h.*.attn.c_proj.weight rowwise\n"
        "transformer.h.*.mlp.c_fc.weight colwise\ntransformer.h.*.mlp.c_proj.weight rowwise\n"
        "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=2\n")

LM = """\
%ids: i64[2,4] = input()
%wte: f32[7,4] = param()
%x: f32[2,4,4] = embedding(%ids, %wte)
%wt: f32[4,7] = permute(%wte) {perm=(1, 0)}
%logits: f32[2,4,7] = matmul(%x, %wt)
return %logits as logits
"""


def test_table_is_padded_logits_masked_and_sliced_back():
    c = compile_graph(parse_graph(LM), spec("mesh tp=2\nwte [S(0)]\n"))
    g = c.logical
    assert g["wte"].type.shape == (8, 4) and g["wte"].attr("stored_shape") == (7, 4)
    assert g["logits"].op == "slice" and g["logits"].type.shape == (2, 4, 7)
    (mask,) = [n for n in g.nodes if n.op == "mask_pad"]
    assert mask.attr("size") == 7 and mask.type.shape == (2, 4, 8)
    table = np.arange(28, dtype="f4").reshape(7, 4)
    padded = to_view_shapes({"wte": table, "wte.grad": table}, g)
    assert padded["wte"].shape == (8, 4) and not padded["wte.grad"][7].any()
    np.testing.assert_array_equal(to_stored_shapes(padded, g)["wte"], table)


def test_an_uneven_split_that_is_no_vocab_is_still_an_error():
    text = "%x: f32[2,7] = input()\n%w: f32[7,4] = param()\n%y: f32[2,4] = matmul(%x, %w)\nreturn %y\n"
    with pytest.raises(SpecError, match="not divisible"):
        compile_graph(parse_graph(text), spec("mesh tp=2\nw [S(0)]\n"))
    hidden = MLP.replace("%y: f32[2,7] = matmul(%x, %wt)\nreturn %y", "%y: f32[2,7] = matmul(%x, %wt)\n"
                         "%z: f32[2,7] = relu(%y)\nreturn %z")
    with pytest.raises(SpecError, match="not divisible"):  # a colwise hidden layer is no LM head
        compile_graph(parse_graph(hidden), spec("mesh tp=2\nw colwise\ntrain loss=cross_entropy\n"))


MLP = """\
%x: f32[2,4] = input()
%w: f32[7,4] = param()
%wt: f32[4,7] = permute(%w) {perm=(1, 0)}
%y: f32[2,7] = matmul(%x, %wt)
return %y
"""


def test_an_untied_lm_head_is_padded_only_under_a_cross_entropy_loss():
    with pytest.raises(SpecError, match="not divisible"):
        compile_graph(parse_graph(MLP), spec("mesh tp=2\nw colwise\n"))
    c = compile_graph(parse_graph(MLP), spec("mesh tp=2\nw colwise\ntrain loss=cross_entropy\n"))
    assert c.logical["w"].type.shape == (8, 4) and c.logical["w"].attr("stored_shape") == (7, 4)
    assert any(n.op == "mask_pad" for n in c.logical.nodes)


def test_gpt2_with_odd_vocab_split_over_tp_trains_like_torch(capsys, tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "vocab.pcs"
    path.write_text(SPEC)
    rc = main(["check", f"{MODELS}:gpt2_lm", "--spec", str(path), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0
    assert_check_ok(out)


@pytest.mark.slow
def test_gpt2_with_odd_vocab_under_torchrun(capsys, tmp_path):
    """program.py pads the checkpoint's 101 rows to 102 as it loads them."""
    pytest.importorskip("transformers")
    path = tmp_path / "vocab.pcs"
    path.write_text(SPEC)
    rc = main(["run", f"{MODELS}:gpt2_lm", "--spec", str(path), "--nproc", "2", "--json",
               "--keep", str(tmp_path / "out")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out.get("verdict") == "OK", out
    assert ('torch.nn.functional.pad(whole(take_tied(ckpt, ("lm_head.weight", "transformer.wte.weight")'
            in (tmp_path / "out" / "program.py").read_text())  # tied: read under either name
