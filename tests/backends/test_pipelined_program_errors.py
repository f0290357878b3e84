"""Errors of the ONNX frontend, pipelines, training options and the emitted program.py runtime,
each a located message; the pipelined program's
file checks run before ``init_process_group``, so they need no torchrun: the program is started
as torchrun would start one rank (``RANK`` / ``WORLD_SIZE`` in the environment)."""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402

from graphs import spec  # noqa: E402
from test_pipeline import TRAIN, chain_graph, reference  # noqa: E402


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    """A pp=2 program.py of a 2-block chain, its full checkpoint and inputs (files in a dir)."""
    d = tmp_path_factory.mktemp("pp")
    g = chain_graph(blocks=2)
    c = compile_graph(g, spec(f"mesh pp=2\n{TRAIN} microbatches=2 schedule=1f1b\n"))
    (d / "program.py").write_text(emit_program(c))
    ref, feeds, _ = reference(g)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    torch.save(ck, d / "model.pt")
    torch.save(inp, d / "inputs.pt")
    return d, ck, inp


def _rank0(d, *args, world="2"):
    """Run program.py as torchrun's rank 0 of ``world`` would start it (the checks before any
    process group: the world size, the arguments); the CompletedProcess."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE=world, MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")  # nothing listens there: a run past the checks would fail
    return subprocess.run([sys.executable, "program.py", *args], cwd=d, env=env, text=True,
                          capture_output=True, timeout=60)


def _ranks(d, *args):
    """Run program.py on its 2 gloo ranks (torchrun, in ``d``); the CompletedProcess."""
    from parcomp_backends.torch.launch import run_torchrun

    return run_torchrun(d, 2, extra_args=args, timeout=240)


def _assert_clear_error(res, *words, ranks=("0",)):
    """Exit 2, no traceback of program.py, and on each of ``ranks`` one error line holding ``words``."""
    assert res.returncode != 0, (res.returncode, res.stderr[-2000:])
    assert 'program.py", line' not in res.stderr, res.stderr[-3000:]
    for r in ranks:
        lines = [x for x in res.stderr.splitlines() if x.startswith(f"program.py (rank {r}): error: ")]
        assert lines, res.stderr[-3000:]
        line = lines[-1]  # the agreed one, after this rank's own
        for w in words:
            assert w in line, (w, line)


@pytest.mark.slow
def test_pipelined_program_names_a_checkpoint_param_of_the_wrong_shape(pipelined):
    # unchecked, a wrong-shape weight would crash in the first matmul with a traceback on every rank;
    # only stage 0's rank reads it, and both ranks stop naming it (agreed, not a store timeout)
    d, ck, _ = pipelined
    name = sorted(ck)[0]
    torch.save({**ck, name: torch.zeros(3, 3)}, d / "bad_shape.pt")
    res = _ranks(d, "--checkpoint", "bad_shape.pt", "--input", "inputs.pt", "--output", "o.pt")
    _assert_clear_error(res, "loading failed on rank 0", repr(name), "[3, 3]", str(list(ck[name].shape)),
                        "bad_shape.pt", ranks=("0", "1"))


@pytest.mark.slow
def test_pipelined_program_names_a_missing_param_and_the_nearest_keys(pipelined):
    # unchecked, a missing weight would be a KeyError traceback
    d, ck, _ = pipelined
    name = sorted(ck)[0]
    torch.save({k: v for k, v in ck.items() if k != name}, d / "missing.pt")
    res = _ranks(d, "--checkpoint", "missing.pt", "--input", "inputs.pt", "--output", "o.pt")
    _assert_clear_error(res, repr(name), "is not in checkpoint file missing.pt", "nearest keys")


@pytest.mark.slow
def test_pipelined_program_checks_the_input_batch_and_dtype(pipelined):
    # unchecked, a batch of another size would be a broadcasting RuntimeError deep in a stage
    d, _, inp = pipelined
    torch.save({**inp, "target": inp["target"][:2]}, d / "short.pt")
    res = _ranks(d, "--checkpoint", "model.pt", "--input", "short.pt", "--output", "o.pt")
    _assert_clear_error(res, "input 'target'", str(list(inp["target"].shape)))
    torch.save({**inp, "x": inp["x"].double()}, d / "f64.pt")
    res = _ranks(d, "--checkpoint", "model.pt", "--input", "f64.pt", "--output", "o.pt")
    _assert_clear_error(res, "input 'x'", "float64", "float32", "never casts")


@pytest.mark.slow
def test_pipelined_program_refuses_a_missing_file_and_output_dir_before_running(pipelined):
    # unchecked, a missing checkpoint would be torch.load's FileNotFoundError traceback, and a
    # missing --output directory would fail only after every step had run
    d, _, _ = pipelined
    res = _ranks(d, "--checkpoint", "nosuch.pt", "--input", "inputs.pt", "--output", "o.pt")
    _assert_clear_error(res, "checkpoint file nosuch.pt does not exist", ranks=("0", "1"))
    res = _ranks(d, "--checkpoint", "model.pt", "--input", "inputs.pt", "--output", "nodir/o.pt")
    _assert_clear_error(res, "--output nodir/o.pt: its directory does not exist")


@pytest.mark.slow
def test_pipelined_program_refuses_to_write_over_the_file_it_reads(pipelined):
    d, ck, _ = pipelined
    torch.save(ck, d / "o.pt.stage1")
    before = (d / "o.pt.stage1").read_bytes()
    res = _ranks(d, "--checkpoint", "o.pt.stage1", "--input", "inputs.pt", "--output", "o.pt")
    _assert_clear_error(res, "o.pt.stage1, which is --checkpoint")
    assert (d / "o.pt.stage1").read_bytes() == before


def test_pipelined_program_wrong_world_size_and_steps_are_one_line(pipelined):
    # a wrong world size is one line and exit 2 before init_process_group; --steps 0 is refused
    # before loading (not an UnboundLocalError traceback)
    d, _, _ = pipelined
    res = _rank0(d, "--checkpoint", "model.pt", "--input", "inputs.pt", "--output", "o.pt", world="3")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    for w in ("program.py (rank 0): error: ", "mesh pp=2 (2 ranks)", "WORLD_SIZE=3", "--nproc-per-node 2"):
        assert w in line, (w, line)
    res = _rank0(d, "--checkpoint", "model.pt", "--input", "inputs.pt", "--output", "o.pt", "--steps", "0")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "argument --steps: 0: give 1 to 1_000_000" in res.stderr


@pytest.mark.slow
def test_program_refuses_an_output_that_is_its_own_input_or_checkpoint(tmp_path):
    # `program.py --input in.pt --output in.pt` must not replace the user's inputs with the
    # outputs (nor `--output model.pt` the checkpoint)
    from parcomp.ir import parse_graph
    from parcomp.spec import load_spec
    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    from test_torch_backend import SPECS, TINY, TINY_PARAMS, TINY_X

    write_program(compile_graph(parse_graph(TINY, "t.pcir"), load_spec(SPECS / "tiny_relu_mlp_tp2.pcs")),
                  tmp_path)
    torch.save({"x": torch.from_numpy(TINY_X)}, tmp_path / "in.pt")
    before = (tmp_path / "in.pt").read_bytes()
    res = run_torchrun(tmp_path, 2, TINY_PARAMS, str(tmp_path / "in.pt"), str(tmp_path / "in.pt"), timeout=180)
    assert res.returncode != 0
    assert "it would write" in res.stderr and "the file given as --input; give another name" in res.stderr
    assert (tmp_path / "in.pt").read_bytes() == before


@pytest.mark.parametrize("op, near", [("LeakyRelu", "Relu (export nn.ReLU instead of nn.LeakyReLU)"),
                                      ("HardSigmoid", "Sigmoid"), ("Hardmax", "Softmax"),
                                      ("ReduceLogSumExp", "by name only: ReduceSum")])
def test_onnx_op_without_rule_names_the_nearest_supported_op(tmp_path, op, near):
    # the error names the op to use instead, not all 40-odd supported ops
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from parcomp.errors import FrontendError
    from parcomp.frontends.onnx.frontend import load_onnx

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1] if op.startswith("Reduce") else [2, 4])
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], "act0")], "g", [x], [y])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(FrontendError) as e:
        load_onnx(path)
    msg = e.value.message
    assert f"node 'act0' ({op} -> y)" in msg and f"no rule for ONNX op {op}; nearest supported op" in msg
    assert near in msg and "supported ops: Add," in msg


def test_every_nearest_op_row_names_a_supported_op_and_an_unsupported_one():
    from parcomp.frontends.onnx.frontend import load_onnx  # noqa: F401 - registers the transformer rows
    from parcomp.frontends.onnx.ops import NEAREST, supported_ops

    ops = set(supported_ops())
    assert all(near in ops and op not in ops for op, (near, _) in NEAREST.items())


def test_onnx_dynamic_axis_error_names_the_symbolic_dim(tmp_path):
    # an export with dynamic_axes={"x": {0: "batch"}} is refused naming the dim and saying that
    # dynamic_axes made it so (not a bare "no static shape")
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from parcomp.errors import FrontendError
    from parcomp.frontends.onnx.frontend import load_onnx

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], "act0")], "g", [x], [y])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    with pytest.raises(FrontendError) as e:
        load_onnx(path)
    assert "input 'x' has no static shape and known dtype (dim 0 is 'batch')" in e.value.message
    assert "no dynamic_axes or dynamic_shapes" in e.value.message


@pytest.mark.slow
def test_run_training_with_a_relative_keep_directory(tmp_path, monkeypatch, capsys):
    # `parcomp run MODEL --spec TRAIN.pcs --nproc 2 --keep out` (a relative --keep) must reach
    # its --replay launch's file: torchrun runs program.py in the work directory, where the
    # relative path "out/replay.pt" does not exist
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 4], [True] * 2, ["relu", "none"]))
    (tmp_path / "s.pcs").write_text("mesh dp=2\ninput x [S(0)]\ntrain optimizer=sgd(lr=0.1) steps=2\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["run", "m.pcir", "--spec", "s.pcs", "--nproc", "2", "--keep", "work"])
    out = capsys.readouterr()
    assert "replay file" not in out.out + out.err, (out.out + out.err)[-3000:]
    assert rc == 0, (out.out + out.err)[-3000:]
    assert (tmp_path / "work" / "replay.pt").exists()


@pytest.mark.slow
def test_resume_of_another_optimizers_checkpoint_is_one_located_line(tmp_path):
    # `program.py --resume DIR` of a checkpoint saved by an SGD-momentum program into an AdamW
    # program: one located line, not DCP's CheckpointException traceback on every rank (it is
    # a BaseException, which an `except Exception` around dcp.load does not catch)
    from parcomp.ir import parse_graph
    from parcomp_backends.torch import run_torchrun
    from parcomp_backends.torch.launch import write_program

    from graphs import mlp_text

    g = parse_graph(mlp_text((4,), [4, 8, 4], [True] * 2, ["relu", "none"]), "m.pcir")
    rng = np.random.default_rng(0)
    ck = {n.name: rng.standard_normal(n.type.shape).astype("f4") for n in g.nodes if n.op == "param"}
    inp = {k: rng.standard_normal((4, 4)).astype("f4") for k in ("x", "target")}
    head = "mesh dp=2\ninput x [S(0)]\ntrain steps=1 optimizer="
    sgd, adamw = tmp_path / "sgd", tmp_path / "adamw"
    for d, opt in ((sgd, "sgd(lr=0.1, momentum=0.9)"), (adamw, "adamw(lr=0.01)")):
        d.mkdir()
        write_program(compile_graph(g, spec(head + opt + "\n")), d)
    # no --output with sharded outputs: the --output check must not trip (it once did)
    assert "SHARDED_OUTPUT = True" in (sgd / "program.py").read_text()
    res = run_torchrun(sgd, 2, ck, inp, None, ("--save", str(sgd / "ck")), timeout=180)
    assert res.returncode == 0, res.stderr[-2000:]
    # a `latest` file the user wrote is never replaced by --save
    (adamw / "mine").mkdir()
    (adamw / "mine" / "latest").write_text("my notes\n")
    res = run_torchrun(adamw, 2, ck, inp, None, ("--save", str(adamw / "mine")), timeout=180)
    assert res.returncode != 0 and "does not name a step-K checkpoint there" in res.stderr
    assert (adamw / "mine" / "latest").read_text() == "my notes\n"
    res = run_torchrun(adamw, 2, ck, inp, str(adamw / "o.pt"), ("--resume", str(sgd / "ck")), timeout=180)
    assert res.returncode != 0
    assert "CheckpointException" not in res.stderr and "[rank0]: Traceback" not in res.stderr, res.stderr[-3000:]
    assert "was saved by another program: it lacks l0.weight.exp_avg" in res.stderr
    assert "it has l0.bias.momentum_buffer" in res.stderr


@pytest.mark.parametrize("flags, backend", [(["--profile", "cuda"], '"nccl"'), (["--target", "ascend"], '"hccl"')])
def test_pipelined_compile_for_a_gpu_or_npu_profile_binds_its_device(tmp_path, capsys, flags, backend):
    # the program carries the profile's PROFILE block (NCCL / HCCL, its device), as the SPMD
    # program does, instead of a CPU-only gloo program
    from parcomp.cli.main import main

    from graphs import mlp_text

    (tmp_path / "m.pcir").write_text(mlp_text((8,), [4, 8, 8, 4], [True] * 3, ["relu", "tanh", "none"]))
    (tmp_path / "s.pcs").write_text(f"mesh pp=2\n{TRAIN} microbatches=2 schedule=1f1b\n")
    out = tmp_path / "out"
    rc = main(["compile", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs"), *flags,
               "-o", str(out)])
    assert rc == 0, capsys.readouterr().err
    text = (out / "program.py").read_text()
    assert f"DIST_BACKEND = {backend}" in text and "def profile_device():" in text
    assert "batch_isend_irecv" in text and 'init_process_group("gloo"' not in text
