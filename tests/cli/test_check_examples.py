"""``parcomp check MODEL --examples N``: drawn specs checked from the command line, the smallest
failing one printed (and written with -o) as a spec that ``parcomp check --spec`` reruns."""
from pathlib import Path

import pytest

from parcomp.cli.main import main
from parcomp.ir.types import P, R

ROOT = Path(__file__).resolve().parents[2]
MODEL = f"{ROOT / 'specs' / 'models.py'}:gpt2_mlp"


def test_five_drawn_specs_of_the_gpt2_mlp_pass(capsys):
    assert main(["check", MODEL, "--examples", "5"]) == 0
    out = capsys.readouterr().out
    assert "OK: 5 drawn specs checked" in out, out


@pytest.fixture
def broken_additive_rule(monkeypatch):
    """Megatron's classic bug, on purpose: a replicated addend (a bias) added to partial sums on
    every rank, so the sum counts it once per rank."""
    from parcomp.rules import sharding

    right = sharding.STRATEGY_RULES["additive"]
    monkeypatch.setitem(sharding.STRATEGY_RULES, "additive",
                        lambda n, ts: right(n, ts) + [((P, R), P), ((R, P), P)])


def test_a_broken_rule_is_found_and_its_shrunk_spec_reruns(broken_additive_rule, capsys, tmp_path):
    out_file = tmp_path / "found.pcs"
    assert main(["check", MODEL, "--examples", "30", "-o", str(out_file)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "add mixes a partial-sum and a non-partial operand" in out, out
    printed = out.split("(hypothesis's shrinking):\n", 1)[1].split("\n\n", 1)[0]
    # shrunk: one mesh axis, no parameter split, the input replicated, a partial-sum output
    lines = printed.splitlines()
    assert lines[0] in ("mesh tp=2", "mesh tp=4") and lines[1:] == ["input x [R]", "output output [P]"], out
    assert out_file.read_text().endswith(printed + "\n")  # -o holds the printed spec

    # the printed text, saved by hand, and the -o file, each rerun by plain `check --spec`
    by_hand = tmp_path / "by_hand.pcs"
    by_hand.write_text(printed + "\n")
    for spec in (by_hand, out_file):
        assert main(["check", MODEL, "--spec", str(spec)]) != 0
        err = capsys.readouterr().err
        assert "add mixes a partial-sum and a non-partial operand" in err, err


def test_o_never_replaces_a_file_parcomp_did_not_write(capsys, tmp_path):
    mine = tmp_path / "mine.pcs"
    mine.write_text("mesh tp=2\n")
    assert main(["check", MODEL, "--examples", "5", "-o", str(mine)]) == 2
    err = capsys.readouterr().err
    assert "was not written by parcomp check --examples" in err and "Traceback" not in err, err
    assert mine.read_text() == "mesh tp=2\n"


@pytest.mark.parametrize("argv, says", [
    (["check", MODEL], "check needs --spec FILE (or --examples N"),
    (["check", MODEL, "--examples", "0"], "give a whole number >= 1"),
    (["check", MODEL, "--spec", "x.pcs", "-o", "y.pcs"], "give --examples"),
    (["check", MODEL, "--examples", "3", "--steps", "2"], "--steps: the drawn specs have no train line"),
])
def test_bad_examples_command_lines_exit_2(argv, says, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err, err
