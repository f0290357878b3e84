"""Loss, MoE and context-parallel options through the CLI: each test is one command line, with
the located error or the number it should give."""
from __future__ import annotations

import pytest

from parcomp.cli.main import main

OWN_LOSS_MODEL = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        logits = self.fc(x)
        return {"logits": logits, "loss": (logits * logits).sum()}


def make():
    torch.manual_seed(0)
    return M(), (torch.randn(6, 4),), ["x"]
'''


@pytest.mark.parametrize("loss", ["cross_entropy", "cross_entropy(label_smoothing=0.1)"])
def test_cross_entropy_on_a_scalar_output_is_a_located_error(tmp_path, capsys, loss):
    """``loss=cross_entropy(...) output=loss`` on a model's own scalar loss (a user wanting
    label smoothing on gpt2_lm_loss): was an IndexError traceback in decompose.py."""
    (tmp_path / "m.py").write_text(OWN_LOSS_MODEL)
    spec = tmp_path / "s.pcs"
    spec.write_text(f"mesh tp=2\nfc.weight colwise\ninput x replicated\n"
                    f"train loss={loss} output=loss optimizer=sgd(lr=0.01)\n")
    assert main(["check", f"{tmp_path / 'm.py'}:make", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "s.pcs:4:7" in err and "loss=output" in err and "Traceback" not in err


@pytest.mark.parametrize("factor", ["1e400", "inf"])
def test_moe_infinite_capacity_factor_says_finite(factor):
    """``moe capacity_factor=1e400`` (parsed as inf) said 'give a number > 0': inf is one."""
    from parcomp.errors import SpecError
    from parcomp.spec import parse_spec

    with pytest.raises(SpecError) as e:
        parse_spec(f"mesh ep=2\nmoe capacity_factor={factor}\n", "bad.pcs")
    assert e.value.loc.line == 2 and "finite" in str(e.value)


def test_moe_huge_capacity_factor_note_stays_short():
    """``moe capacity_factor=1e300`` printed the 301-digit slot count in check's note."""
    from parcomp.passes.moe_capacity import capacity_notes
    from parcomp.spec.moe import MoeSpec

    asked = MoeSpec(1e300, "tokens", None).asked(8, 2, 4)
    note, = capacity_notes([{"route": "moe_route", "asked": asked, "capacity": 8, "seq": 8, "top_k": 2}])
    assert len(note) < 260 and "~4e+300 slots" in note, note
    small, = capacity_notes([{"route": "r", "asked": 16, "capacity": 8, "seq": 8, "top_k": 2}])
    assert "for 16 slots" in small


def test_sp_vs_cp_counts_the_kv_heads_the_program_moves_when_kv_heads_do_not_divide_by_tp(tmp_path):
    """``mesh cp=2 tp=4`` on specs/models.py:causal_attention (2 kv heads, 4 tp ranks): each
    rank's K/V gathers carry both kv heads (the program keeps K, V whole over tp before the GQA
    repeat: 2x2x8x8 f32 = 1 KiB each), but the SP-vs-CP row for this spec said 2048 B (1 kv head)
    where the program moves 4 x 1 KiB."""
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1].parent
    spec = tmp_path / "s.pcs"
    spec.write_text((root / "specs" / "attention_cp2_tp2_train.pcs").read_text()
                    .replace("mesh cp=2 tp=2", "mesh cp=2 tp=4"))
    out = tmp_path / "out"
    assert main(["compile", f"{root / 'specs' / 'models.py'}:causal_attention", "--spec", str(spec),
                 "-o", str(out)]) == 0
    rep = json.loads((out / "report.json").read_text())
    rec = rep["sp_vs_cp"]
    mine = [c for c in rep["collectives"] if c["axis"] == "cp" and (
        c["kind"] == "reduce_scatter" or c["reason"].split()[0] in ("%add_1", "%transpose_2"))]
    assert len(mine) == rec["ways"]["all_gather"]["calls"] == 4
    assert sum(c["bytes"] for c in mine) == rec["ways"]["all_gather"]["bytes_per_rank"], (mine, rec)


@pytest.mark.parametrize("opt", ["label_smoothing=0.1", "ignore_index=5"])
def test_own_loss_refuses_cross_entropy_options_and_says_where_they_go(tmp_path, capsys, opt):
    """``loss=output(label_smoothing=0.1) output=loss`` (gpt2_lm_loss) is refused, and the message
    says the model's loss takes its options in the model, or loss=cross_entropy on the logits."""
    (tmp_path / "m.py").write_text(OWN_LOSS_MODEL)
    spec = tmp_path / "s.pcs"
    spec.write_text(f"mesh tp=2\nfc.weight colwise\ninput x replicated\n"
                    f"train loss=output({opt}) output=loss optimizer=sgd(lr=0.01)\n")
    assert main(["check", f"{tmp_path / 'm.py'}:make", "--spec", str(spec)]) == 2
    err = capsys.readouterr().err
    assert "s.pcs:4:7" in err and "has no option" in err and "loss=cross_entropy(...)" in err, err


def test_a_model_loss_taken_with_mean_trains(tmp_path, capsys):
    """A model returning ``(logits * logits).mean()`` as its loss (``train loss=output``): was
    'no lowering for aten.mean.default' (only ``mean(dim)`` was lowered)."""
    import json

    (tmp_path / "m.py").write_text(OWN_LOSS_MODEL.replace("(logits * logits).sum()", "(logits * logits).mean()"))
    spec = tmp_path / "s.pcs"
    spec.write_text("mesh tp=2\nfc.weight colwise\ninput x replicated\n"
                    "train loss=output output=loss optimizer=sgd(lr=0.01) steps=2\n")
    assert main(["check", f"{tmp_path / 'm.py'}:make", "--spec", str(spec), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["err_over_tol"] <= 1 and len(last["losses"]) == 2
