"""Bad input found by trying to break parcomp: each is a clear error, exit 2, no traceback."""
import numpy as np
import pytest

from parcomp.cli import main
from parcomp.ir import Mesh, R
from parcomp.reference.interpreter import assemble

BASE = """\
%x: f32[4,8] = input()
%w1: f32[8,16] = param()
%w2: f32[16,8] = param()
%h: f32[4,16] = matmul(%x, %w1)
%r: f32[4,16] = relu(%h)
%y: f32[4,8] = matmul(%r, %w2)
return %y
"""
SPEC = "mesh tp=2\nw1 colwise\nw2 rowwise\ninput x replicated\noutput y replicated\n"


def run_cli(tmp_path, capsys, pcir, spec, cmd="check"):
    (tmp_path / "m.pcir").write_text(pcir)
    (tmp_path / "s.pcs").write_text(spec)
    rc = main([cmd, str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs")]
              + (["-o", str(tmp_path / "out"), "--target", "reference"] if cmd == "compile" else []))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("edit,needle", [
    (("relu(%h)", "pow(%h)"), "pow needs the attribute exponent"),
    (("relu(%h)", 'gelu(%h) {approximate="bogus"}'), "choose one of none, tanh"),
    (("relu(%h)", 'add_scalar(%h) {value="x"}'), "attribute value of add_scalar must be a number"),
    (("relu(%h)", 'all_reduce(%h) {axis="tp"}'), "layout changes are inserted by parcomp"),
    (("%w2: f32[16,8] = param()", '%w2: f32[16,8] = param() {trainable="no"}'),
     "attribute trainable of param must be true or false, not 'no'"),
])
def test_bad_ir_attributes_and_ops(tmp_path, capsys, edit, needle):
    rc, err = run_cli(tmp_path, capsys, BASE.replace(*edit), SPEC)
    assert rc == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("line,needle", [
    ("train loss=mse optimizer=sgd(lr=abc)", "sgd(lr=...) must be a number, not 'abc'"),
    ("train loss=mse steps=0", "steps=0 is out of range: it must be at least 1 and at most 1,000,000"),
    ("train loss=mse zero=1.5", "zero must be a whole number"),
    ("train loss=mse batch=many", "batch must be a whole number"),
    ("train loss=mse optimizer=sgd(lr=-1)", "must not be negative"),
    ("train optimizer=adamw(lr=1e-3, beta1=1.5)", "adamw(beta1=1.5) must be less than 1"),
    ("train optimizer=sgd(lr=1e400)", "sgd(lr=...) must be a finite number, not inf"),
    ("train steps=100000000000", "steps=100000000000 is out of range"),
    ("train loss=mse output=z", "output='z' is not an output of the model (its outputs: y)"),
])
def test_bad_train_options_are_located(tmp_path, capsys, line, needle):
    rc, err = run_cli(tmp_path, capsys, BASE, SPEC.replace("output y replicated\n", "") + line + "\n")
    assert rc == 2 and needle in err and "s.pcs:5:1" in err and "Traceback" not in err


def test_bfloat16_model_compiles(tmp_path, capsys):
    rc, err = run_cli(tmp_path, capsys, BASE.replace("f32", "bf16"), SPEC, cmd="compile")
    assert rc == 0, err


def test_nan_outputs_identical_on_every_replica_are_not_a_divergence():
    mesh = Mesh((("tp", 2),))
    x = np.array([1.0, np.nan], "f4")
    np.testing.assert_array_equal(assemble([x, x.copy()], (R,), (2,), mesh), x)
    with pytest.raises(ValueError, match="replicas differ"):
        assemble([x, np.array([2.0, np.nan], "f4")], (R,), (2,), mesh)


def test_a_rule_shadowed_by_an_earlier_one_is_an_error(tmp_path, capsys):
    rc, err = run_cli(tmp_path, capsys, BASE, "mesh tp=2\nw* colwise\nw2 rowwise\n")
    assert rc == 2 and "s.pcs:3:1" in err and "never applies" in err and "'w*' at " in err


def test_ir_verify_errors_point_at_the_line(tmp_path, capsys):
    rc, err = run_cli(tmp_path, capsys, BASE.replace("%h: f32[4,16]", "%h: f32[4,15]"), SPEC)
    assert rc == 2 and "m.pcir:4:1" in err and "type should be f32[4,16], not f32[4,15]" in err


def test_model_returning_one_tensor_twice(tmp_path, capsys):
    model = tmp_path / "twice.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "class Twice(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc1 = nn.Linear(8, 16); self.fc2 = nn.Linear(16, 8)\n"
        "    def forward(self, x):\n"
        "        y = self.fc2(torch.relu(self.fc1(x)))\n"
        "        return y, y\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return Twice().eval(), (torch.randn(2, 8),), ['x']\n")
    (tmp_path / "s.pcs").write_text("mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\n")
    assert main(["check", f"{model}:make", "--spec", str(tmp_path / "s.pcs"), "--json"]) == 0
    import json
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and [c["kind"] for c in last["collectives"]] == ["all_reduce"]
