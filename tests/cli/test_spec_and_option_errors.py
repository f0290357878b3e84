"""Spec and option errors of pipelines, memory limits, spec rules and the layout search: a
located message that names the whole bad value, a
duplicate rule said as such, a warning when the plan gathers a weight the spec splits, and a
wide pipelined step is compared at its gradients' scale, not within a bound wider than them."""
import pytest

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.spec import parse_spec

from graphs import spec

MLP = "%x: f32[64,4] = input()\n%w: f32[4,8] = param()\n%output: f32[64,8] = matmul(%x, %w)\nreturn %output\n"


@pytest.mark.parametrize("value", ["80 XB", "80 GiB", "80GiBs", "1e3GiB", "-5GiB", "80GiB extra"])
def test_a_bad_memory_size_names_the_whole_value_at_its_column(value):
    with pytest.raises(SpecError) as e:
        parse_spec(f"mesh tp=2\nmemory {value}  # note\n", "s.pcs")
    assert f"got {value!r}" in str(e.value) and "a memory size such as 80GiB" in str(e.value)
    assert (e.value.loc.line, e.value.loc.col) == (2, 8)


def test_a_duplicate_rule_is_called_a_duplicate():
    s = spec("mesh tp=2\nw colwise\nw rowwise\n")
    with pytest.raises(SpecError) as e:
        compile_graph(parse_graph(MLP), s)
    assert "duplicate rule: param 'w' already has a rule at" in str(e.value)
    assert "more specific" not in str(e.value) and e.value.loc.line == 3


def test_a_split_weight_the_plan_gathers_whole_is_a_warning(tmp_path, capsys):
    """x [64, 4] @ w [4, 8]: the output (2 KiB) costs more to gather than w (128 B), so the
    search gathers the weight the spec splits; a rule on the output keeps w split."""
    (tmp_path / "m.pcir").write_text(MLP)
    (tmp_path / "s.pcs").write_text("mesh tp=2\nw colwise\noutput output replicated\n")
    c = compile_graph(parse_graph(MLP), spec("mesh tp=2\nw colwise\noutput output replicated\n"))
    assert len(c.report["warnings"]) == 1
    assert c.report["warnings"][0].startswith("w: the spec splits it (")
    assert main(["compile", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"),
                 "-o", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "warning: w: the spec splits it (" in err and "s.pcs:2:1" in err and "all-gathers it whole over tp" in err
    kept = compile_graph(parse_graph(MLP), spec("mesh tp=2\nw colwise\noutput output split-hidden\n"))
    assert kept.report["warnings"] == []


def test_a_wide_pipelined_step_equals_the_unsharded_one_and_a_wrong_gradient_scale_is_caught():
    """At width 32 the worst-case bound of a pipelined chain's gradients exceeded them (the
    pipelined line said OK within it); the scale-relative comparison catches a gradient off
    by the dp factor there as at width 4."""
    from test_pipeline import assert_detects_a_wrong_scale, chain_graph, pipelined
    from numerics import assert_all_equivalent

    for hidden in (32, 4):
        got, want, _ = pipelined(chain_graph(blocks=4, hidden=hidden), "mesh pp=2\n")
        assert_all_equivalent(got, want, sorted(got))
        assert_detects_a_wrong_scale(got, want)


def test_cli_check_of_a_pipeline_says_ok_in_float64(tmp_path, capsys):
    """specs/models.py:mlp_chain at width 32: the pipelined step's line was OK with a gradient
    tolerance of 1e4 times the gradients' scale; it is OK in float64 within the threshold."""
    root = __import__("pathlib").Path(__file__).resolve().parents[1].parent
    (tmp_path / "m.py").write_text(
        "import importlib.util\n"
        f"_s = importlib.util.spec_from_file_location('pm', {str(root / 'specs' / 'models.py')!r})\n"
        "_m = importlib.util.module_from_spec(_s)\n_s.loader.exec_module(_m)\n\n\n"
        "def chain():\n    return _m.mlp_chain(blocks=4)\n")
    (tmp_path / "s.pcs").write_text("mesh pp=2\ntrain optimizer=sgd(lr=0.1) input_grads=no microbatches=2\n")
    rc = main(["check", f"{tmp_path / 'm.py'}:chain", "--spec", str(tmp_path / "s.pcs")])
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("pipelined step"))
    assert rc == 0 and "in float64" in line and line.endswith("OK"), line


@pytest.mark.parametrize("value", ["-5", "0", "nan", "inf", "1e300", "fast"])
def test_program_timeout_out_of_range_is_an_argparse_error_not_a_c10d_traceback(value, capsys):
    """program.py --timeout -5 / nan reached init_process_group (a c10d traceback, exit 1)."""
    import argparse

    pytest.importorskip("torch")
    from parcomp_backends.torch.runtime import program_cluster as cl

    ap = argparse.ArgumentParser(prog="program.py")
    cl.add_cluster_args(ap)
    assert ap.parse_args(["--timeout", "90.5"]).timeout == 90.5
    with pytest.raises(SystemExit) as e:
        ap.parse_args(["--timeout", value])
    assert e.value.code == 2 and f"argument --timeout: {value}: give a number of seconds" in capsys.readouterr().err


def test_spec_timeout_over_what_program_py_takes_is_located():
    parse_spec("mesh tp=2\ntopology timeout=10000000\n", "t.pcs")
    with pytest.raises(SpecError, match="at most 10_000_000 seconds") as e:
        parse_spec("mesh tp=2\ntopology timeout=99999999999999\n", "t.pcs")
    assert (e.value.loc.line, e.value.loc.col) == (2, 18)


def test_save_that_cannot_succeed_fails_before_the_first_step(tmp_path, capsys):
    """--save onto a file (or below one) or onto an existing step-K failed only after the
    last training step (a dcp traceback, the run lost); check_save runs before the first."""
    pytest.importorskip("torch")
    from parcomp_backends.torch.runtime import program_train as pt

    (tmp_path / "file").write_text("mine")
    (tmp_path / "ck" / "step-3").mkdir(parents=True)
    for path, msg in ((tmp_path / "file", "exists and is not a directory"),
                      (tmp_path / "file" / "sub", "is not a writable directory"),
                      (tmp_path / "ck", "step-3 exists; parcomp's program never replaces")):
        with pytest.raises(SystemExit) as e:
            pt.check_save(str(path), 3)
        assert e.value.code == 2 and f"--save {path}: " in capsys.readouterr().err
        assert msg in pt.FAILED[-1]
    pt.check_save(str(tmp_path / "ck"), 4)  # a new step, and a folder still to be made
    pt.check_save(str(tmp_path / "new" / "dir"), 1)
    assert (tmp_path / "file").read_text() == "mine" and not (tmp_path / "new").exists()


def test_plan_output_errors_name_o_and_no_file_beside_the_spec_is_touched(tmp_path):
    """-o in a missing folder said 'No such file or directory: s.pcs.parcomp-tmp' (an OSError),
    -o onto a folder 'Is a directory'; and a file of the user's named SPEC.parcomp-tmp was
    overwritten by the temporary copy and then renamed away."""
    from parcomp.errors import ParcompError
    from parcomp.plan.planner import write_spec

    for path, msg in ((tmp_path / "no" / "s.pcs", "its directory"), (tmp_path, "a directory; give a file name")):
        with pytest.raises(ParcompError, match=msg) as e:
            write_spec(str(path), "mesh tp=2\n")
        assert e.value.where == "-o"
    (tmp_path / "s.pcs.parcomp-tmp").write_text("mine")
    write_spec(str(tmp_path / "s.pcs"), "mesh tp=2\n")
    write_spec(str(tmp_path / "s.pcs"), "mesh tp=4\n")  # its own, unchanged: replaced
    assert (tmp_path / "s.pcs.parcomp-tmp").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.pcs", "s.pcs.parcomp-tmp"]
    assert (tmp_path / "s.pcs").read_text().endswith("mesh tp=4\n")


@pytest.mark.parametrize("line, word, near", [("trian loss=mse", "trian", "train"),
                                              ("memroy 80GiB", "memroy", "memory"),
                                              ("  sequence-paralel", "sequence-paralel", "sequence-parallel"),
                                              ("topolgy nodes=1 devices_per_node=2", "topolgy", "topology")])
def test_a_misspelt_statement_is_said_to_be_one(line, word, near):
    """'trian loss=mse' said only 'expected a placement (R, S(d) or P); got 'mse''."""
    with pytest.raises(SpecError) as e:
        parse_spec(f"mesh tp=2\n{line}\n", "s.pcs")
    assert f"'{word}' is not a statement; did you mean '{near}'?" in str(e.value)
    assert (e.value.loc.line, e.value.loc.col) == (2, line.index(word) + 1)
