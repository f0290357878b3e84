"""The parcomp command: located errors, exit codes, nothing half-written, JSON last line."""
import json
import os

import pytest

from parcomp.cli.main import main

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
    assert last["ok"] and last["err_over_tol"] <= 1 and last["rtol"] == 1e-9 and last["verdict"] == "OK"
    assert last["max_abs_err"] <= last["rtol"] * last["output_scale"] and last["why"] == ""
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
    assert last["err_over_tol"] <= 1 and last["rtol"] == 1e-9 and last["worst"]
    assert max(last["max_grad_err"], last["max_param_err"]) <= last["max_abs_err"]
    assert [(c["kind"], c["phase"]) for c in last["collectives"]] == [("all_reduce", "forward"),
                                                                       ("all_reduce", "backward")]


def test_run_training_two_ranks_matches_unsharded_steps(files, capsys):
    spec = write(files, "train.pcs", TRAIN_SPEC)
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["steps"] == 2 and len(last["losses"]) == 2
    assert last["err_over_tol"] <= 1  # every carried value and each step's loss within float32's tolerance


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
    """The compiler (a buffer given a gradient and an SGD update): step 1 is
    equal to torch's, steps 2-3 are not, and the buffer itself differs: check says so."""
    from train_models import BUFFER_SPEC, MODELS

    import parcomp.frontends.torch.export as frontend
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


@pytest.mark.parametrize("argv, needle", [
    (["run", "--nproc", "2", "--steps", "-1"], "--steps -1: give 1 to 1,000,000 training steps"),
    (["run", "--nproc", "2", "--steps", "0"], "--steps 0: give 1 to 1,000,000 training steps"),
    (["check", "--steps", "-3"], "--steps -3: give 1 to 1,000,000 training steps"),
    (["run", "--nproc", "0"], "argument --nproc: give a whole number >= 1, not '0'"),
    (["run", "--nproc", "-2"], "argument --nproc: give a whole number >= 1, not '-2'"),
    (["check", "--seed", "-1"], "argument --seed: give a whole number >= 0, not '-1'"),
])
def test_a_bad_number_flag_is_refused_before_the_model_is_loaded(tmp_path, capsys, argv, needle):
    """The model named does not exist: the flag's error must come first (no load, no compile)."""
    spec = write(tmp_path, "s.pcs", "mesh tp=2\n")
    rc = main([argv[0], str(tmp_path / "missing.pcir"), "--spec", spec, *argv[1:], "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and needle in err and "missing.pcir" not in err and "Traceback" not in err, err
    assert last_json(out)["where"] in (argv[-2], "command line")


def test_plan_seconds_is_refused_before_the_model_is_loaded(tmp_path, capsys):
    rc = main(["plan", str(tmp_path / "missing.pcir"), "--mesh", "tp=2", "--seconds", "-1",
               "-o", str(tmp_path / "a.pcs")])
    err = capsys.readouterr().err
    assert rc == 2 and "--seconds -1.0: the search needs a positive time budget" in err
    assert "missing.pcir" not in err and not (tmp_path / "a.pcs").exists()


def test_run_steps_without_a_train_line_is_an_error(files, capsys):
    spec = write(files, "ok.pcs", SPEC_OK)
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2", "--steps", "2"]) == 2
    assert "--steps 2: the spec has no train line" in capsys.readouterr().err


# ---- --json on failure: the last line is {"ok": false, "error", "where"}, exit 2 ---------------

def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("argv, where, needle", [
    (["check", "{d}/tiny.pcir", "--spec", "{d}/bad.pcs"], "{d}/bad.pcs:2:12", "unknown layout word"),
    (["check", "{d}/tiny.pcir", "--spec", "{d}/nope.pcs"], "{d}/nope.pcs", "does not exist"),
    (["compile", "{d}/tiny.pcir", "--spec", "{d}/ok.pcs", "-o", "{d}/ok.pcs/sub"], "{d}/ok.pcs/sub",
     "ok.pcs is a file, not a directory"),
    (["check", "{d}/tiny.pcir", "--spec"], "command line", "expected one argument"),
    (["run", "{d}/tiny.pcir", "--spec", "{d}/ok.pcs", "--nproc", "0"], "command line",
     "argument --nproc: give a whole number >= 1, not '0'"),
    (["check", "{d}/m.py", "--spec", "{d}/ok.pcs"], "{d}/m.py", "name the factory, as"),
])
def test_json_error_line(files, capsys, argv, where, needle):
    write(files, "ok.pcs", SPEC_OK)
    write(files, "bad.pcs", "mesh tp=2\nfc1.weight colwize\n")
    write(files, "m.py", "")
    argv = [a.format(d=files) for a in argv] + ["--json"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    last = last_json(out)
    assert last["ok"] is False and last["where"] == where.format(d=files) and needle in last["error"]
    assert needle in err and "Traceback" not in err


# ---- output directories: parcomp replaces only its own files, all or nothing ------------------

def compile_into(files, out, *extra, json_out=False):
    spec = write(files, "ok.pcs", SPEC_OK)
    argv = ["compile", str(files / "tiny.pcir"), "--spec", spec, "-o", str(out), *extra]
    return main(argv + (["--json"] if json_out else []))


def test_compile_again_keeps_the_users_files_and_says_so(files, capsys):
    out = files / "out"
    assert compile_into(files, out) == 0
    (out / "my_checkpoint.pt").write_bytes(b"\x80weights")
    (out / "NOTES.txt").write_text("mine")
    (out / "runs").mkdir()
    capsys.readouterr()
    assert compile_into(files, out) == 0
    assert (out / "my_checkpoint.pt").read_bytes() == b"\x80weights"
    assert (out / "NOTES.txt").read_text() == "mine" and (out / "runs").is_dir()
    assert (f"kept 3 entries in {out}/ that parcomp did not write: NOTES.txt, my_checkpoint.pt, runs"
            in capsys.readouterr().out)
    assert compile_into(files, out, json_out=True) == 0
    assert last_json(capsys.readouterr().out)["kept"] == ["NOTES.txt", "my_checkpoint.pt", "runs"]
    manifest = json.loads((out / ".parcomp-output").read_text())["files"]
    assert sorted(manifest) == ["program.pcir", "program.py", "report.json", "sharded.pcir"]


@pytest.mark.parametrize("fail_at", range(1, 10))  # 4 old files moved aside, then 5 new moved in
def test_a_failed_write_leaves_the_previous_set(files, capsys, monkeypatch, fail_at):
    out = files / "out"
    assert compile_into(files, out, "--target", "reference") == 0
    (out / "NOTES.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real, calls = os.replace, []

    def flaky(src, dst):  # one rename fails, halfway through parcomp's set of files
        calls.append(dst)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")
        return real(src, dst)
    monkeypatch.setattr(os, "replace", flaky)
    assert compile_into(files, out) == 2  # torch target: program.py would be new
    assert "cannot write the output there: No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing new, no temp files


def test_a_file_of_parcomps_the_user_changed_or_replaced_is_theirs(files, capsys):
    out = files / "out"
    assert compile_into(files, out) == 0
    with open(out / "program.py", "a") as f:
        f.write("# my edit\n")
    assert compile_into(files, out) == 2
    assert "program.py is not parcomp's (not written by it, or changed or replaced since)" in \
        capsys.readouterr().err
    assert (out / "program.py").read_text().endswith("# my edit\n")
    (out / "program.py").unlink()
    (out / "program.py").mkdir()
    (out / "program.py" / "data").write_text("mine")
    assert compile_into(files, out) == 2  # the new output needs that name: refused
    assert (out / "program.py" / "data").read_text() == "mine"
    capsys.readouterr()
    assert compile_into(files, out, "--target", "reference") == 0  # it does not: kept
    assert (out / "program.py" / "data").read_text() == "mine"
    assert "that parcomp did not write: program.py" in capsys.readouterr().out


@pytest.mark.parametrize("marker", ["garbage\x00\xff", '{"files": {"../victim.txt": null}}',
                                    '{"files": ["program.py"]}', "[1, 2]"])
def test_a_garbage_marker_deletes_and_overwrites_nothing(files, capsys, marker):
    out = files / "out"
    assert compile_into(files, out) == 0
    (out / ".parcomp-output").write_text(marker, errors="surrogateescape")
    (files / "victim.txt").write_text("outside")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert compile_into(files, out) == 2
    err = capsys.readouterr().err
    assert "are not parcomp's" in err and "lists no files of parcomp's" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert (files / "victim.txt").read_text() == "outside"


def test_a_directory_written_before_manifests_is_still_parcomps(files, capsys):
    out = files / "out"
    assert compile_into(files, out) == 0
    (out / ".parcomp-output").write_text("written by parcomp; replaced by the next compile\n")
    (out / "NOTES.txt").write_text("mine")
    assert compile_into(files, out, "--target", "reference") == 0
    assert sorted(os.listdir(out)) == [".parcomp-output", "NOTES.txt", "program.pcir", "report.json",
                                       "sharded.pcir"]


def test_output_paths_the_os_refuses_are_clean_errors(files, capsys, monkeypatch):
    import tempfile

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", "/ro/.parcomp-x")
    monkeypatch.setattr(tempfile, "mkdtemp", denied)
    assert compile_into(files, files / "new", json_out=True) == 2
    out, err = capsys.readouterr()
    assert "-o " in err and "cannot write the output there: Permission denied" in err
    assert last_json(out)["where"] == str(files / "new") and "Traceback" not in err


def test_run_keep_never_overwrites_a_users_checkpoint(files, capsys):
    keep = files / "keep"
    assert compile_into(files, keep) == 0
    (keep / "model.pt").write_bytes(b"my real checkpoint")
    spec = str(files / "ok.pcs")
    assert main(["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2",
                 "--keep", str(keep)]) == 2
    assert "--keep" in capsys.readouterr().err and (keep / "model.pt").read_bytes() == b"my real checkpoint"


def test_run_keep_twice_refuses_run_files_the_user_edited(files, capsys):
    keep, spec = files / "keep", write(files, "ok.pcs", SPEC_OK)
    argv = ["run", str(files / "tiny.pcir"), "--spec", spec, "--nproc", "2", "--keep", str(keep)]
    assert main(argv) == 0
    manifest = json.loads((keep / ".parcomp-output").read_text())
    assert manifest["command"] == "run" and manifest["files"]["model.pt"] is not None  # hashed
    (keep / "inputs.pt").write_bytes(b"my inputs")
    capsys.readouterr()
    assert main(argv) == 2
    assert "inputs.pt is not parcomp's" in capsys.readouterr().err
    assert (keep / "inputs.pt").read_bytes() == b"my inputs"


def test_files_written_after_the_listing_are_hashed_and_then_the_users_once_edited(tmp_path):
    from parcomp.errors import ParcompError
    from parcomp.outdir import record_written, write_dir_atomic

    out, later = tmp_path / "keep", ("model.pt", "outputs.rank0.pt", "outputs.rank1.pt")
    write_dir_atomic(str(out), {"program.py": "x = 1\n"}, later, flag="--keep", command="run")
    for n in later:
        (out / n).write_bytes(b"written by the run " + n.encode())
    record_written(str(out), later)
    assert write_dir_atomic(str(out), {"program.py": "x = 2\n"}, later, flag="--keep", command="run") == []
    for n in later:  # unchanged since: parcomp's, so replaced (a new run rewrites them)
        (out / n).write_bytes(b"written by the run " + n.encode())
    record_written(str(out), later)
    (out / "outputs.rank1.pt").write_bytes(b"the user's own outputs")
    with pytest.raises(ParcompError, match="outputs.rank1.pt is not parcomp's"):
        write_dir_atomic(str(out), {"program.py": "x = 3\n"}, later, flag="--keep", command="run")
    assert (out / "outputs.rank1.pt").read_bytes() == b"the user's own outputs"
    assert (out / "program.py").read_text() == "x = 2\n"


def test_one_command_never_replaces_anothers_output(files, capsys):
    from parcomp.errors import ParcompError
    from parcomp.outdir import write_dir_atomic

    out = files / "out"
    assert compile_into(files, out) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ParcompError, match="it holds the output of `parcomp compile -o`.*give another"):
        write_dir_atomic(str(out), {"graph.svg": "<svg/>"}, flag="--plots", command="plots")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    plots = files / "plots"
    write_dir_atomic(str(plots), {"graph.svg": "<svg/>"}, flag="--plots", command="plots")
    assert compile_into(files, plots) == 2
    assert "`parcomp explain --plots`" in capsys.readouterr().err
    assert sorted(p.name for p in plots.iterdir()) == [".parcomp-output", "graph.svg"]


def test_report_json_is_byte_identical_across_compiles(files, capsys):
    assert compile_into(files, files / "a") == 0 and compile_into(files, files / "b") == 0
    assert "searched in" in capsys.readouterr().out  # the search's time is printed ...
    a, b = ((files / d / "report.json").read_bytes() for d in "ab")
    assert a == b and b'"seconds"' not in a.split(b'"search"')[1].split(b"}")[0]  # ... not written


# ---- careless model references and files: located errors, exit 2, no traceback ----------------

MOD = "import torch\nfrom torch import nn\n"
CARELESS = [  # (files to write, model argument, needle)
    ({}, "{d}/nope.pcir", "cannot read model"),
    ({"d.pcir/x": ""}, "{d}/d.pcir", "Is a directory"),
    ({"d.py/x": ""}, "{d}/d.py:f", "is a directory; give a .py file"),
    ({"e.pcir": ""}, "{d}/e.pcir", "the file is empty"),
    ({"g.pcir": b"\x00\x01\xfe\xff garbage"}, "{d}/g.pcir", "not UTF-8 text: byte 0xfe at offset 2"),
    ({"g.py": b"\x00\x01garbage"}, "{d}/g.py:f", "source code string cannot contain null bytes"),
    ({"n.py": MOD}, "{d}/n.py", "name the factory, as"),
    ({"n.py": MOD}, "{d}/n.py:make", "factory 'make' does not exist"),
    ({"s.py": "def f(:\n    pass\n"}, "{d}/s.py:f", "s.py:1:7"),
    ({"x.py": "import sys\nsys.exit(3)\n"}, "{d}/x.py:f", "x.py:2:1"),
    ({"r.py": MOD + "def f():\n    raise ValueError('boom')\n"}, "{d}/r.py:f", "r.py:4:1"),
    ({"r.py": MOD + "def f():\n    raise ValueError('boom')\n"}, "{d}/r.py:f", "ValueError: boom"),
    ({"w.py": MOD + "def f():\n    return nn.ReLU()\n"}, "{d}/w.py:f", "got ReLU"),
    ({"w.py": MOD + "def f():\n    return nn.ReLU(), (torch.ones(2),), 5\n"}, "{d}/w.py:f",
     "input names must be a list of strings"),
    ({"w.py": MOD + "def f(x):\n    return x\n"}, "{d}/w.py:f", "missing 1 required positional"),
    ({"w.py": MOD + "f = 3\n"}, "{d}/w.py:f", "factory 'f' is not callable"),
    ({}, "{d}/w.py:", "FACTORY is a Python name"),
    ({}, "a..b:f", "is neither a module name (package.module) nor a .py file"),
    ({}, "no_such_pkg_xyz.mod:f", "no module named 'no_such_pkg_xyz' on the Python path or in"),
    ({"a.txt": "x"}, "{d}/a.txt", "a model reference is FILE.pcir, FILE.py:FACTORY"),
    ({"p.pcir": "%x: f32[2] = input()\n%y: f32[2] = relu(%x)\nreturn %y\n"}, "{d}/p.pcir",
     "the spec is empty"),
]


@pytest.mark.parametrize("made, model, needle", CARELESS)
def test_careless_inputs(tmp_path, capsys, made, model, needle):
    for name, data in made.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data if isinstance(data, bytes) else data.encode())
    (tmp_path / "empty.pcs").write_text("")
    (tmp_path / "ok.pcs").write_text("mesh tp=2\n")
    spec = "empty.pcs" if model.endswith("p.pcir") else "ok.pcs"
    assert main(["check", model.format(d=tmp_path), "--spec", str(tmp_path / spec), "--json"]) == 2
    out, err = capsys.readouterr()
    assert needle in err and "Traceback" not in err and last_json(out)["ok"] is False


def test_wrong_example_shape_prints_one_clean_error(tmp_path, capfd):
    model = write(tmp_path, "m.py", MOD + (
        "def make():\n    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(8, 16), nn.ReLU()), (torch.randn(2, 5),)\n"))
    spec = write(tmp_path, "s.pcs", "mesh tp=2\n0.weight colwise\n")
    assert main(["check", f"{model}:make", "--spec", spec]) == 2
    err = capfd.readouterr().err  # fd level: torch's loggers write to the real stderr
    assert "could not trace Sequential on example inputs of shape (2, 5): RuntimeError" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_package_module_in_the_current_directory_needs_no_pythonpath(tmp_path, monkeypatch, capsys):
    import sys
    pkg = tmp_path / "cwd_models_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "zoo.py").write_text(MOD + "def relu():\n    return nn.ReLU(), (torch.randn(2, 4),)\n")
    write(tmp_path, "s.pcs", "mesh tp=2\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["check", "cwd_models_pkg.zoo:relu", "--spec", "s.pcs"]) == 0, capsys.readouterr().err
    assert str(tmp_path) not in sys.path  # only for that import


def test_spec_errors_come_before_the_model_is_imported(tmp_path, capsys):
    """A missing spec file and ``--nproc`` against the spec's mesh are found before the model's
    import (which can take a while on a real model)."""
    model = write(tmp_path, "m.py", (
        "import sys, torch\n"
        "sys.stderr.write('model imported\\n')\n"
        "def make():\n"
        "    return torch.nn.Linear(4, 4), (torch.ones(2, 4),)\n"))
    spec = write(tmp_path, "s.pcs", "mesh tp=2\nweight colwise\n")
    assert main(["run", f"{model}:make", "--spec", spec, "--nproc", "3"]) == 2
    err = capsys.readouterr().err
    assert "--nproc 3 but the spec's mesh tp=2 has 2 ranks" in err and "model imported" not in err
    assert main(["check", f"{model}:make", "--spec", str(tmp_path / "none.pcs")]) == 2
    err = capsys.readouterr().err
    assert "none.pcs" in err and "does not exist" in err and "model imported" not in err
