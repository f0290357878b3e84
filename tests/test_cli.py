"""The parcomp command: located errors, exit codes, nothing half-written, JSON last line."""
import json
import os

import pytest

from parcomp.cli import main

from test_megatron import TINY

SPEC_OK = "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\noutput output replicated\n"


@pytest.fixture
def files(tmp_path):
    (tmp_path / "tiny.pcir").write_text(TINY)
    return tmp_path


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_check_json_last_line(files, capsys):
    spec = write(files, "ok.pcs", SPEC_OK)
    assert main(["check", str(files / "tiny.pcir"), "--spec", spec, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["err_over_tol"] <= 1 and 0 < last["tolerance"] < last["output_scale"]
    assert last["max_abs_err"] <= last["tolerance"] and last["why"] == ""
    assert [(c["kind"], c["axis"], c["phase"]) for c in last["collectives"]] == [("all_reduce", "tp", "forward")]
    assert last["collectives"][0]["bytes"] == 8


def test_compile_writes_program_report_and_ir(files, capsys):
    spec = write(files, "ok.pcs", SPEC_OK)
    out = files / "out"
    assert main(["compile", str(files / "tiny.pcir"), "--spec", spec, "-o", str(out)]) == 0
    assert sorted(os.listdir(out)) == [".parcomp-output", "program.pcir", "program.py", "report.json",
                                       "sharded.pcir"]
    report = json.loads((out / "report.json").read_text())
    assert [c["kind"] for c in report["collectives"]] == ["all_reduce"]


@pytest.mark.parametrize("spec_text,needle", [
    ("mesh tp=2\nfc1.weight colwize\n", "ok.pcs:2:12"),                      # unknown word
    ("mesh tp=2\nfc1.wieght colwise\n", "did you mean fc1.weight"),           # unknown param
    ("mesh tp=3\nfc1.weight colwise\n", "not divisible by mesh axis tp of size 3"),
    ("mesh tp=2\nfc1.weight colwise\n[\n", "ok.pcs:3:1"),                     # syntax error
])
def test_bad_spec_is_located_exit_2_and_writes_nothing(files, capsys, spec_text, needle):
    spec = write(files, "ok.pcs", spec_text)
    out = files / "out"
    assert main(["compile", str(files / "tiny.pcir"), "--spec", spec, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not out.exists()
    assert not [p for p in os.listdir(files) if p.startswith(".parcomp-")]


def test_failed_compile_leaves_previous_output_untouched(files, capsys):
    spec = write(files, "ok.pcs", SPEC_OK)
    out = files / "out"
    assert main(["compile", str(files / "tiny.pcir"), "--spec", spec, "-o", str(out)]) == 0
    before = (out / "program.py").read_text()
    bad = write(files, "bad.pcs", "mesh tp=2\nfc9.weight colwise\n")
    assert main(["compile", str(files / "tiny.pcir"), "--spec", bad, "-o", str(out)]) == 2
    assert (out / "program.py").read_text() == before


def test_bad_ir_text_is_located(files, capsys):
    bad = write(files, "bad.pcir", TINY.replace("relu(%h)", "relu(%nope)"))
    spec = write(files, "ok.pcs", SPEC_OK)
    assert main(["check", bad, "--spec", spec]) == 2
    err = capsys.readouterr().err
    assert "bad.pcir:5:1" in err and "%r uses %nope before it is defined" in err


def test_unsupported_op_names_op_and_module(tmp_path, capsys):
    model = write(tmp_path, "m.py", (
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        return torch.cumsum(self.fc(x), -1)\n"
        "def make():\n"
        "    return M(), (torch.ones(2, 4),)\n"))
    spec = write(tmp_path, "s.pcs", "mesh tp=2\nfc.weight colwise\n")
    assert main(["check", f"{model}:make", "--spec", spec]) == 2
    err = capsys.readouterr().err
    assert "aten.cumsum" in err and "m.py:6" in err and "Traceback" not in err


def test_run_nproc_must_match_mesh(files, capsys):
    spec = write(files, "ok.pcs", SPEC_OK)
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "3"]) == 2
    assert "--nproc 3 but the spec's mesh tp=2 has 2 ranks" in capsys.readouterr().err


TRAIN_SPEC = SPEC_OK.replace("output output replicated\n", "") + "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9) steps=2\n"


def test_check_training_json_has_grad_param_errors_and_losses(files, capsys):
    spec = write(files, "train.pcs", TRAIN_SPEC)
    assert main(["check", str(files / "tiny.pcir"), "--spec", spec, "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and len(last["losses"]) == 2 and last["steps"] == 2  # the spec's steps=2
    assert last["err_over_tol"] <= 1 and 0 < last["tolerance"] and last["worst"]
    assert max(last["max_grad_err"], last["max_param_err"]) <= last["max_abs_err"]
    assert [(c["kind"], c["phase"]) for c in last["collectives"]] == [("all_reduce", "forward"),
                                                                       ("all_reduce", "backward")]


def test_run_training_two_ranks_matches_unsharded_steps(files, capsys):
    spec = write(files, "train.pcs", TRAIN_SPEC)
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["steps"] == 2 and len(last["losses"]) == 2
    assert last["err_over_tol"] <= 1  # every carried value and each step's loss within its bound


def test_compile_never_deletes_a_users_directory(files, capsys, monkeypatch):
    spec = write(files, "ok.pcs", SPEC_OK)
    mine = files / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("important")
    assert main(["compile", str(files / "tiny.pcir"), "--spec", spec, "-o", str(mine)]) == 2
    assert "not written by parcomp; it is left alone" in capsys.readouterr().err
    assert (mine / "notes.txt").read_text() == "important"
    monkeypatch.chdir(files)
    assert main(["compile", "tiny.pcir", "--spec", spec, "-o", "."]) == 2
    assert "current directory" in capsys.readouterr().err and (files / "tiny.pcir").exists()
    assert main(["compile", "tiny.pcir", "--spec", spec, "-o", "ok.pcs"]) == 2
    assert "a file of that name exists" in capsys.readouterr().err


def _check_json(capsys, model, spec_path):
    rc = main(["check", model, "--spec", spec_path, "--json"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out.strip().splitlines()[-1]) if rc != 2 else None), out.err


def test_check_trains_a_buffer_model_for_the_specs_steps_like_torch(tmp_path, capsys):
    from train_models import BUFFER_SPEC, MODELS

    spec = write(tmp_path, "buf.pcs", BUFFER_SPEC)
    rc, last, _ = _check_json(capsys, f"{MODELS}:buffer_mlp", spec)
    assert rc == 0 and last["ok"] and last["vs_torch"]["ok"] and len(last["losses"]) == 3
    assert not last["vs_torch"].get("missing")


def test_check_fails_when_a_buffer_is_updated(tmp_path, capsys, monkeypatch):
    """The compiler of issue 7 (a buffer given a gradient and an SGD update): step 1 is
    equal to torch's, steps 2-3 are not, and the buffer itself differs: check says so."""
    from train_models import BUFFER_SPEC, MODELS

    import parcomp.frontends.torch_export as frontend
    monkeypatch.setattr(frontend, "_frozen", lambda *a: {})
    spec = write(tmp_path, "buf.pcs", BUFFER_SPEC)
    rc, last, _ = _check_json(capsys, f"{MODELS}:buffer_mlp", spec)
    assert rc == 1 and not last["ok"] and not last["vs_torch"]["ok"]
    # the sharded program still equals its own (wrong) unsharded steps: only torch tells
    assert last["max_abs_err"] < last["vs_torch"]["max_param_err"] / 1000


def test_check_trains_the_named_output_of_a_two_output_model(tmp_path, capsys):
    from train_models import MODELS

    base = "mesh tp=2\nfc.weight colwise\ninput x replicated\ntrain loss=mse"
    rc, _, err = _check_json(capsys, f"{MODELS}:two_outputs", write(tmp_path, "a.pcs", base + "\n"))
    assert rc == 2 and "a.pcs:4:1" in err and "Traceback" not in err
    assert "the model has 2 outputs (output_0, output_1); say which one the loss is computed on" in err
    for name in ("output_0", "output_1"):
        rc, last, _ = _check_json(capsys, f"{MODELS}:two_outputs",
                                  write(tmp_path, "b.pcs", f"{base} output={name}\n"))
        assert rc == 0 and last["ok"] and last["vs_torch"]["ok"], name


@pytest.mark.parametrize("steps,needle", [("0", "--steps 0: give 1 to 1,000,000 training steps"),
                                          ("100000000000", "--steps 100000000000: give 1 to 1,000,000")])
def test_run_steps_out_of_range_is_a_clean_error(files, capsys, steps, needle):
    spec = write(files, "train.pcs", TRAIN_SPEC)
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2", "--steps", steps]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_run_steps_without_a_train_line_is_an_error(files, capsys):
    spec = write(files, "ok.pcs", SPEC_OK)
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2", "--steps", "2"]) == 2
    assert "--steps 2: the spec has no train line" in capsys.readouterr().err
