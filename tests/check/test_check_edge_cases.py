"""Edge cases of ``parcomp check``: each is a located error (exit 2, no traceback), a sound
verdict, or a supported case."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from parcomp.check.differential import compare
from parcomp.cli.main import main
from test_cli import write  # the suite's one file-writing helper

FACTORIES = '''
import torch
from torch import nn
def lin():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), (torch.randn(4, 8),), ["x"]
def bf16():
    m, (x,), names = lin()
    return m.bfloat16(), (x.bfloat16(),), names
def nan_in():
    m, (x,), names = lin()
    x[1, 2] = float("nan")
    return m, (x,), names
def dict_out():
    class A(nn.Module):
        def __init__(s):
            super().__init__(); s.fc = nn.Linear(8, 8)
        def forward(s, x):
            y = s.fc(x); return {"a": y, "b": y * 2}
    torch.manual_seed(0); return A(), (torch.randn(4, 8),), ["x"]
'''
LIN = "mesh tp=2\n0.weight colwise\n2.weight rowwise\ninput x replicated\n"


@pytest.fixture
def play(tmp_path):
    (tmp_path / "odd.py").write_text(FACTORIES)
    return tmp_path




def _fails(argv, capsys, *needles):
    """``main(argv)`` exits 2 with one located message holding every needle, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


# 1-3: dtypes numpy cannot compute in; bool/int outputs
def test_bf16_model_check_names_the_value(play, capsys):
    spec = write(play, "lin.pcs", LIN)
    _fails(["check", f"{play}/odd.py:bf16", "--spec", spec], capsys,
           "%0.weight is bf16[16,8]", "numpy, which has no bfloat16")


def test_bf16_pcir_check_is_located(tmp_path, capsys):
    m = write(tmp_path, "b.pcir", "%x: bf16[2,2] = input()\n%y: bf16[2,2] = exp(%x)\nreturn %y\n")
    spec = write(tmp_path, "s.pcs", "mesh tp=2\n")
    _fails(["check", m, "--spec", spec], capsys, "b.pcir:1:1", "%x is bf16[2,2]")


def test_bool_output_is_compared_exactly(tmp_path, capsys):
    m = write(tmp_path, "b.pcir", "%x: bool[2,2] = input()\nreturn %x\n")
    spec = write(tmp_path, "s.pcs", "mesh tp=2\n")
    assert main(["check", m, "--spec", spec]) == 0
    r = compare(np.array([True, False]), np.array([True, True]))
    assert not r["ok"] and r["max_abs_err"] == 1 and "compare exactly" in r["why"]
    assert compare(np.array([3, 4]), np.array([3, 4]))["ok"]


# 4: dict outputs
def test_dict_outputs_named_by_keys(play, capsys):
    spec = write(play, "s.pcs", "mesh tp=2\ninput x replicated\n")
    assert main(["check", f"{play}/odd.py:dict_out", "--spec", spec, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["worst"].split("[")[0] in ("a", "b")


# 5, 8: hyperparameters in float32
@pytest.mark.parametrize("opt, needle", [
    ("sgd(lr=1e308)", "not representable in float32"),
    ("adamw(beta1=0.99999999999)", "rounds to 1 in float32"),
])
def test_hyperparameters_must_fit_float32(play, capsys, opt, needle):
    spec = write(play, "t.pcs", LIN + f"train optimizer={opt}\n")
    _fails(["check", f"{play}/odd.py:lin", "--spec", spec], capsys, "t.pcs:5:", needle)


# 6: shapes beyond 2^48 elements
def test_huge_shape_is_located(tmp_path, capsys):
    big = "f32[4000000000,4000000000]"
    m = write(tmp_path, "h.pcir", f"%x: {big} = input()\n%w: {big} = param()\n"
                                    f"%y: {big} = matmul(%x, %w)\nreturn %y\n")
    spec = write(tmp_path, "h.pcs", "mesh tp=2\nw colwise\ntrain optimizer=adamw\n")
    _fails(["compile", m, "--spec", spec, "-o", str(tmp_path / "o")], capsys,
           "h.pcir:1:5", "1.6e+19 elements", "2^48")
    assert not os.path.exists(tmp_path / "o")


# 7: a check over many ReLU steps never says NaN; each step from the same state (lockstep)
def test_many_relu_steps_check_is_ok_and_never_nan(play, capsys):
    class A:
        model, spec = f"{play}/odd.py:lin", write(play, "t.pcs", LIN + "train steps=300\n")
    assert main(["check", A.model, "--spec", A.spec]) == 0
    out = capsys.readouterr().out
    assert "nan" not in out.lower() and "division" not in out
    assert "300 steps, each from the unsharded run's state" in out
    assert out.rstrip().endswith("OK") and "CANNOT VOUCH" not in out and "MISMATCH" not in out
    assert "... (290 more)" in out  # 300 losses are shortened


def test_forward_check_json_has_the_verdict(capsys):
    specs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "specs")
    assert main(["check", os.path.join(specs, "tiny_relu_mlp.pcir"), "--spec",
                 os.path.join(specs, "tiny_relu_mlp_tp2.pcs"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["verdict"] == "OK"


def test_verdict_words():
    from parcomp.cli.commands import verdict

    ok, bad = {"ok": True}, {"ok": False, "unbounded": False}
    unb = {"ok": False, "unbounded": True}
    assert verdict(ok, None) == "OK" and verdict(unb, ok) == "CANNOT VOUCH"
    assert verdict(unb, bad) == "MISMATCH" and verdict(bad) == "MISMATCH"


# 9, 10: check estimates its work
def test_check_refuses_a_million_steps_and_suggests_steps(play, capsys):
    spec = write(play, "t.pcs", LIN + "train steps=1000000\n")
    err = _fails(["check", f"{play}/odd.py:lin", "--spec", spec], capsys,
                 "parcomp check would take about", "x 1000000 steps", "--steps ")
    steps = int(err.split("--steps ")[1].split()[0].rstrip(")"))
    assert 1 <= steps < 1000000
    assert main(["check", f"{play}/odd.py:lin", "--spec", spec, "--steps", "2"]) == 0


def test_check_steps_needs_a_train_line(play, capsys):
    spec = write(play, "s.pcs", LIN)
    _fails(["check", f"{play}/odd.py:lin", "--spec", spec, "--steps", "3"], capsys,
           "--steps 3: the spec has no train line")


def test_big_mesh_check_is_estimated():
    from types import SimpleNamespace
    from parcomp.check.budget import CHECK_SECONDS_BUDGET, check_seconds, check_time
    from parcomp.errors import ParcompError
    from parcomp.ir.types import Mesh, TensorType

    node = SimpleNamespace(type=TensorType((4, 8), "float32"))
    small = SimpleNamespace(program=SimpleNamespace(mesh=Mesh((("a", 2),)), nodes=[node] * 5),
                            logical=SimpleNamespace(nodes=[node] * 5))
    huge = SimpleNamespace(program=SimpleNamespace(mesh=Mesh((("a", 1024), ("b", 1024))), nodes=[node] * 5),
                           logical=SimpleNamespace(nodes=[node] * 5))
    assert check_time(small) < 1
    assert check_seconds(huge) > 1000 * check_seconds(small)
    assert check_seconds(huge, 100) > CHECK_SECONDS_BUDGET
    with pytest.raises(ParcompError, match="1048576 ranks x 5 ops x 100 steps"):
        check_time(huge, 100)


# 11-14: .pcir messages
@pytest.mark.parametrize("text, where, needle", [
    ("%é: f32[2] = input()\nreturn %é\n", "m.pcir:1:2", "the character 'é' (U+00E9) is not allowed in a name"),
    ('%x: f32[2] = input()\n%y: f32[2] = relu(%x) {note="unterminated}\nreturn %y\n', "m.pcir:2:29",
     "has no closing quote"),
    ("%x: f32[1,2] = input()\nreturn %x\nreturn %x\n", "m.pcir:3:1",
     "`return` must be the last line, and it appears twice (lines 2 and 3)"),
    ("%x: f32[2,2] = input()\n%y: f32[2,2] = scale(%x) {value=1e999}\nreturn %y\n", "m.pcir:2:33",
     "the number 1e999 is not finite"),
    ("%x: f32[2] = input()\n%y: f32[2] = relu(%x) {a=1e99}\nreturn %y\n", "m.pcir:2:24",
     "relu has no attribute a; it takes none"),
    ("%x: f32[2] = input() {trainable=false}\nreturn %x\n", "m.pcir:1:23",
     "input has no attribute trainable"),
    ("%x: f32[2,2] = input()\n%y: f32[4] = reshape(%x) {shape=(5,)}\nreturn %y\n", "m.pcir:2:27",
     "reshape has no attribute shape"),
])
def test_pcir_messages(tmp_path, capsys, text, where, needle):
    m = write(tmp_path, "m.pcir", text)
    spec = write(tmp_path, "s.pcs", "mesh tp=2\n")
    _fails(["check", m, "--spec", spec], capsys, where, needle)


# 15: NaN in an input
def test_nan_input_is_named(play, capsys):
    spec = write(play, "lin.pcs", LIN)
    _fails(["check", f"{play}/odd.py:nan_in", "--spec", spec], capsys,
           "input x holds 1 NaN/inf value(s) (the first, nan, at [1, 2])")


# 16: concurrent compiles into one directory take turns
def test_concurrent_compiles_into_one_directory(play):
    spec = write(play, "lin.pcs", LIN)
    out = play / "out"
    cmd = [sys.executable, "-m", "parcomp.cli.main", "compile", f"{play}/odd.py:lin", "--spec", spec, "-o", str(out)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
             for _ in range(4)]
    results = [(p.wait(timeout=300), *p.communicate()) for p in procs]
    for rc, stdout, stderr in results:
        assert rc == 0, stderr
        assert "kept" not in stdout and ".parcomp-" not in stdout + stderr
    assert sorted(os.listdir(out)) == [".parcomp-output", "program.pcir", "program.py", "report.json",
                                       "sharded.pcir"]


def test_trainable_with_regex_characters_says_only_stars_are_wildcards(tmp_path, capsys):
    spec = write(tmp_path, "t.pcs", "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\n"
                                    'train optimizer=sgd(lr=0.1) trainable="fc[12].*"\n')
    models = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "specs", "models.py")
    err = _fails(["check", f"{models}:tiny_relu_mlp", "--spec", spec], capsys,
                 "t.pcs:4", "names no parameter", "only wildcards are '*'", "'**'", "[ ] are matched literally")
    assert err.count("error:") == 1
