"""parcomp.check / parcomp.explain from Python give the CLI's results, as objects."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import parcomp
from parcomp.errors import ParcompError

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "specs"))
from models import gpt2_mlp  # noqa: E402


def _cli(*args):
    out = subprocess.run([sys.executable, "-m", "parcomp.cli", *args, "--json"], capture_output=True, text=True,
                         cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_check_from_python_is_the_cli_check():
    module, example, names = gpt2_mlp()
    got = parcomp.check(module, example, str(ROOT / "specs/gpt2_mlp_tp2_train.pcs"), input_names=names)
    cli = _cli("check", "specs/models.py:gpt2_mlp", "--spec", "specs/gpt2_mlp_tp2_train.pcs")
    assert isinstance(got, parcomp.CheckResult) and got.ok and got.verdict == "OK"
    assert got.losses == tuple(cli["losses"]) and got.reference_losses == tuple(cli["reference_losses"])
    assert got.raw["collectives"] == cli["collectives"]
    assert got.result.max_abs_err == cli["max_abs_err"] and got.vs_torch.ok
    assert [c.kind for c in got.collectives] == ["all_reduce", "all_reduce"]


def test_check_finds_a_wrong_spec_and_says_where():
    module, example, names = gpt2_mlp()
    text = "mesh tp=2\nc_fc.weight colwise\nc_proj.weight colwise\ninput x replicated\noutput output replicated\n"
    got = parcomp.check(module, example, text, input_names=names)
    assert got.ok  # a legal layout is equal however it communicates
    with pytest.raises(ParcompError) as e:
        parcomp.check(module, example, text.replace("input x", "input y"), input_names=names)
    assert "<spec text>:4:" in str(e.value)


def test_explain_from_python_is_the_cli_explain():
    module, example, names = gpt2_mlp()
    got = parcomp.explain(module, example, str(ROOT / "specs/gpt2_mlp_tp2_train.pcs"), input_names=names)
    cli = _cli("explain", "specs/models.py:gpt2_mlp", "--spec", "specs/gpt2_mlp_tp2_train.pcs")
    assert got.raw["explain"]["edges"] == cli["explain"]["edges"]
    assert got.count("all_reduce") == 2 and got.count("all_reduce", phase="backward") == 1
    assert got.changes[0].from_layout == "[P]" and got.changes[0].to_layout == "[R]"
    assert got.memory_bytes_per_rank == cli["explain"]["memory_bytes_per_rank"]


def test_check_and_explain_collectives_are_one_type_with_the_same_fields():
    """``check(...).collectives`` and ``explain(...).collectives`` are both
    :class:`parcomp.Collective`; on a spec without gradient buckets they list the same
    collectives, local shapes included; explain adds the estimated seconds."""
    module, example, names = gpt2_mlp()
    spec = str(ROOT / "specs/gpt2_mlp_tp2_train.pcs")
    checked = parcomp.check(module, example, spec, input_names=names).collectives
    explained = parcomp.explain(module, example, spec, input_names=names).collectives
    assert all(type(c) is parcomp.Collective for c in checked + explained)
    key = lambda c: (c.kind, c.axis, c.phase, c.bytes, c.local_shape, c.dim)  # noqa: E731
    assert sorted(map(key, explained)) == sorted(map(key, checked))
    assert all(c.local_shape for c in explained)
    assert all(c.seconds > 0 for c in explained) and all(c.seconds is None for c in checked)
