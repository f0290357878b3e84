"""The cluster runtime of program.py: agreement on failure, the placement check at
start, process groups, the Ascend prelude order, timeouts and ``--print-launch``.

Three torchrun runs (slow): a checkpoint missing on one of two simulated nodes; dp=2 x tp=2
started as four one-process launchers; the ascend program under a stand-in ``torch_npu``.
The rest runs in this process against the runtime modules the program is pasted from.
"""
from __future__ import annotations

import datetime
import importlib.util
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.cli.commands import feeds_for  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.errors import SpecError  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.spec import load_spec, parse_spec  # noqa: E402
from parcomp_backends.torch import assemble_outputs, emit_program, run_torchrun  # noqa: E402
from parcomp_backends.torch.launch import (run_torchrun_multinode, write_checkpoint, write_inputs,  # noqa: E402
                                           write_program)
from parcomp_backends.torch.runtime import program_cluster as cl  # noqa: E402
from parcomp_backends.torch.runtime import program_common as rt  # noqa: E402

from fake_store import FakeStore  # noqa: E402
from numerics import assert_equivalent  # noqa: E402

SPECS = Path(__file__).resolve().parents[1].parent / "specs"
MODEL = f"{SPECS / 'models.py'}:gpt2_mlp"
TIMEOUT = 90
SP_SPEC = "mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x split-seq\noutput output split-seq\n"


@pytest.fixture(scope="module")
def gpt2():
    """(module, example x, compiled dp=2 x tp=2, compiled tp=2 sequence-parallel (all_gather))."""
    graph, module, example = load_model(MODEL)
    dp2tp2 = compile_graph(graph, load_spec(SPECS / "gpt2_mlp_dp2_tp2.pcs"))
    sp = compile_graph(graph, parse_spec(SP_SPEC, "sp.pcs"))
    return module, example[0], dp2tp2, sp


def rank_errors(results) -> dict:
    """{rank: [its error lines]} from every launcher's stderr."""
    out = {}
    for res in results:
        for m in re.finditer(r"^program\.py \(rank (\d+)\): error: (.*)$", res.stderr, re.M):
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


# --- torchrun ---------------------------------------------------------------------------

# node i reads NODE -> n<i>: the checkpoint exists only under n0 (node 1's disk lacks it)
PER_NODE_PATH = """\
import os, runpy, sys
sys.argv = [a.replace("NODE", "n" + os.environ["PARCOMP_SIM_NODE"]) for a in sys.argv]
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
def test_checkpoint_missing_on_one_node_stops_every_rank_within_seconds(gpt2, tmp_path):
    module, x, dp2tp2, _ = gpt2
    write_program(dp2tp2, tmp_path, "cpu")
    (tmp_path / "n0").mkdir()
    write_checkpoint(module, tmp_path / "n0" / "model.pt")
    (tmp_path / "probe.py").write_text(PER_NODE_PATH)
    start = time.monotonic()
    results = run_torchrun_multinode(tmp_path, 2, 2, str(tmp_path / "NODE" / "model.pt"), {"x": x},
                                     tmp_path / "out.pt", ("--device", "cpu"), timeout=TIMEOUT,
                                     rdzv="static", program="probe.py")
    took = time.monotonic() - start
    # both launchers exit on their own (a killed one has a negative code) with an error
    assert [r.returncode > 0 for r in results] == [True, True], [r.stderr[-2000:] for r in results]
    assert took < 30, f"launchers took {took:.1f} s"
    errors = rank_errors(results)
    assert sorted(errors) == [0, 1, 2, 3]
    for rank, lines in errors.items():
        summary = [ln for ln in lines if ln.startswith("loading failed on ranks 2-3 (on sim-node1) of 4")]
        assert summary, (rank, lines)
        assert "n1/model.pt does not exist" in summary[0]
    assert not list(tmp_path.glob("out*.pt"))


@pytest.mark.slow
def test_dp2_tp2_on_four_one_process_launchers_is_refused_naming_the_tp_group_and_hosts(gpt2, tmp_path):
    module, x, dp2tp2, _ = gpt2
    write_program(dp2tp2, tmp_path, "cpu")
    results = run_torchrun_multinode(tmp_path, 4, 1, module, {"x": x}, tmp_path / "out.pt",
                                     ("--device", "cpu"), timeout=TIMEOUT, rdzv="static")
    assert all(r.returncode > 0 for r in results), [r.stderr[-2000:] for r in results]
    errors = rank_errors(results)
    assert sorted(errors) == [0, 1, 2, 3]
    for lines in errors.values():
        assert ("the tp group [0, 1] spans hosts (rank 0 on sim-node0, rank 1 on sim-node1)"
                in lines[0]), lines
        assert "LOCAL_WORLD_SIZE=1" in lines[0] and "--placement warn" in lines[0]
    assert not list(tmp_path.glob("out*.pt"))


# a stand-in for torch_npu: patches torch.distributed as torch_npu / torchair do, records calls,
# and serves "hccl" with gloo so the program runs on this machine
STAND_IN_NPU = """\
import os, torch, torch.distributed as dist
_original = {name: getattr(dist, name) for name in ("all_gather_into_tensor", "reduce_scatter_tensor")}

def _patched(name):
    def call(*args, **kwargs):
        with open(f"called.{name}.{os.environ['RANK']}", "a") as f:
            f.write("1")
        return _original[name](*args, **kwargs)
    call.__module__ = "torch_npu.distributed"
    return call

for _name in _original:
    setattr(dist, _name, _patched(_name))
"""

# the program, imported before its prelude (as on a real NPU), with the device bound to CPU
AS_NPU = """\
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("program", "program.py")
program = importlib.util.module_from_spec(spec)
spec.loader.exec_module(program)
assert "torch_npu" not in sys.modules
program.profile_device = lambda: torch.device("cpu")
program.DIST_BACKEND = "gloo"
program.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_ascend_program_calls_the_collectives_torch_npu_patched(gpt2, tmp_path):
    module, x, _, sp = gpt2
    text = emit_program(sp, "ascend")
    assert 'all_gather(x, 1, "tp")' in text and 'reduce_scatter(c_proj, 1, "tp")' in text
    write_program(sp, tmp_path, "ascend")
    (tmp_path / "torch_npu.py").write_text(STAND_IN_NPU)
    (tmp_path / "as_npu.py").write_text(AS_NPU)
    res = run_torchrun(tmp_path, 2, module, {"x": x}, tmp_path / "out.pt", timeout=TIMEOUT,
                       program="as_npu.py", env={"PYTHONPATH": str(tmp_path)})
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert sorted(p.name for p in tmp_path.glob(f"called.{name}.*")) == [f"called.{name}.0",
                                                                             f"called.{name}.1"]
    got = assemble_outputs(tmp_path / "out.pt", sp.program)["output"]
    feeds = feeds_for(sp.unsharded, module, (x,))
    with torch.no_grad():
        want = module.eval()(x).numpy()
    assert_equivalent(got, want)


# --- in this process --------------------------------------------------------------------


def test_collective_prefers_a_device_module_replacement(monkeypatch):
    def replaced(*args, **kwargs):
        return "patched"

    dist = torch.distributed
    assert rt.collective("all_gather_single", "all_gather_into_tensor") is dist.all_gather_single
    monkeypatch.setattr(dist, "all_gather_into_tensor", replaced)  # after the program was imported
    assert rt.collective("all_gather_single", "all_gather_into_tensor") is replaced


def test_groups_are_made_only_for_used_axes_and_world_is_reused(monkeypatch):
    """Each rank makes its own line of each axis it communicates over (one call per axis, with
    the timeout); an axis whose one line holds every rank is WORLD."""
    made = []
    monkeypatch.setattr(torch.distributed, "new_group", lambda ranks, **kw: made.append((ranks, kw)) or tuple(ranks))
    monkeypatch.setattr(rt, "GROUP_RANKS", {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]})
    monkeypatch.setattr(rt, "WORLD_SIZE", 4)
    monkeypatch.setattr(rt, "RANK", 0)
    wait = {"timeout": datetime.timedelta(seconds=7), "use_local_synchronization": True}
    for comm, want_made, want in ((("tp",), [[0, 1]], {"tp": (0, 1)}),
                                  (("dp", "tp"), [[0, 2], [0, 1]], {"dp": (0, 2), "tp": (0, 1)})):
        made.clear()
        monkeypatch.setattr(rt, "GROUPS", {})
        monkeypatch.setattr(rt, "LINE_GROUPS", {})
        monkeypatch.setattr(rt, "COMM_AXES", comm)
        rt.make_groups(7)
        assert made == [(ranks, wait) for ranks in want_made] and rt.GROUPS == want
    made.clear()
    rt.GROUPS.clear()
    monkeypatch.setattr(rt, "GROUP_RANKS", {"tp": [[0, 1, 2, 3]]})
    monkeypatch.setattr(rt, "COMM_AXES", ("tp",))
    rt.make_groups(7)
    assert made == [] and rt.GROUPS == {"tp": torch.distributed.group.WORLD}


def test_emitted_program_uses_only_its_collective_axes(gpt2):
    _, _, dp2tp2, sp = gpt2
    for compiled in (dp2tp2, sp):  # dp=2 x tp=2 forward: no dp collective
        text = emit_program(compiled, "cpu")
        assert 'COMM_AXES = ("tp",)' in text and 'HOST_AXES = ("tp",)' in text


def test_agree_gathers_every_failed_rank_and_exits_2(monkeypatch, capsys):
    store = FakeStore()
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(cl, "WORLD_SIZE", 4)
    monkeypatch.setattr(cl, "HOSTS", ["a", "a", "b", "b"])
    # ranks 0..2 arrive first (rank 1 and 2 fail), rank 3 opens the gate and sees the failures
    for rank, step in ((0, lambda: 1), (1, lambda: cl.fail("file m.pt does not exist")),
                       (2, lambda: cl.fail("file m.pt does not exist")), (3, lambda: 1 / 0)):
        monkeypatch.setattr(cl, "RANK", rank)
        monkeypatch.setattr(rt, "RANK", rank)
        if rank < 3:
            with pytest.raises(AssertionError, match="would wait"):
                cl.agree(step, "loading")
        else:
            with pytest.raises(SystemExit) as e:
                cl.agree(step, "loading")
            assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("program.py (rank 3): error: loading failed on ranks 1-3 (on a, b) of 4, "
                          "so every rank stops: ranks 1-2: file m.pt does not exist; "
                          "rank 3: ZeroDivisionError: division by zero"), err


def test_agree_returns_the_step_value_when_every_rank_succeeds(monkeypatch):
    store = FakeStore()
    monkeypatch.setattr(torch.distributed.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(cl, "WORLD_SIZE", 1)
    assert cl.agree(lambda: {"w": 1}, "loading") == {"w": 1}


@pytest.mark.parametrize("mode", ["refuse", "warn"])
def test_placement_on_several_hosts_is_refused_or_warned(monkeypatch, capsys, mode):
    monkeypatch.setattr(cl, "MESH", {"dp": 2, "tp": 2})
    monkeypatch.setattr(cl, "AXIS", {"dp": 0, "tp": 1})
    monkeypatch.setattr(cl, "GROUP_RANKS", {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]})
    monkeypatch.setattr(cl, "HOST_AXES", ("tp",))
    monkeypatch.setattr(cl, "WORLD_SIZE", 4)
    monkeypatch.setattr(rt, "RANK", 0)
    monkeypatch.setattr(cl, "RANK", 0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")

    def gather(out, obj):
        out[:] = hosts

    monkeypatch.setattr(torch.distributed, "all_gather_object", gather)
    hosts = ["h0", "h0", "h1", "h1"]  # tp inside a host: nothing said
    cl.check_placement(mode)
    assert capsys.readouterr().err == ""
    hosts = ["h0", "h1", "h0", "h1"]  # dp inside a host, tp across
    if mode == "refuse":
        with pytest.raises(SystemExit):
            cl.check_placement(mode)
    else:
        cl.check_placement(mode)
    err = capsys.readouterr().err
    assert "the tp group [0, 1] spans hosts (rank 0 on h0, rank 1 on h1)" in err
    assert ("error:" in err) == (mode == "refuse") and ("warning:" in err) == (mode == "warn")


def test_init_has_an_explicit_timeout_and_binds_the_device_where_the_profile_allows(monkeypatch):
    seen = []
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda backend, **kw: seen.append((backend, kw)))
    monkeypatch.setattr(cl, "DEVICE", torch.device("cpu"))
    for bind, device, want_id in ((True, "cuda", torch.device("cpu")), (True, "cpu", None), (False, "ascend", None)):
        monkeypatch.setattr(cl, "BIND_DEVICE_ID", bind)
        cl.init_dist("nccl", types.SimpleNamespace(timeout=42.0, device=device))
        assert seen[-1] == ("nccl", {"timeout": datetime.timedelta(seconds=42), "device_id": want_id})


def test_spec_sets_placement_and_timeout_and_rejects_bad_values(gpt2):
    graph, _, _ = load_model(MODEL)
    text = SP_SPEC.replace("mesh tp=2\n", "mesh tp=2\ntopology nodes=1 devices_per_node=2 placement=warn timeout=90\n")
    program = emit_program(compile_graph(graph, parse_spec(text, "t.pcs")), "cpu")
    assert 'PLACEMENT = "warn"' in program and "TIMEOUT_S = 90 " in program and "TOPOLOGY = (1, 2)" in program
    default = emit_program(gpt2[3], "cpu")
    assert 'PLACEMENT = "refuse"' in default and "TIMEOUT_S = 600 " in default and "TOPOLOGY = None" in default
    for bad, msg in (("placement=maybe", "give refuse or warn"), ("timeout=0", "must be >= 1"),
                     ("timeout=fast", "give a whole number")):
        with pytest.raises(SpecError, match=msg):
            parse_spec(f"mesh tp=2\ntopology {bad}\n", "t.pcs")


def test_print_launch_gives_env_and_one_torchrun_line_per_node(gpt2, tmp_path):
    write_program(gpt2[2], tmp_path, "cuda")  # dp=2 x tp=2; the spec's topology is 2 nodes x 2
    res = subprocess.run([sys.executable, "program.py", "--print-launch"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert any(ln.startswith("export NCCL_SOCKET_IFNAME=") for ln in lines)
    exported = {ln.removeprefix("# ").split()[1].split("=")[0]
                for ln in lines if ln.startswith(("export ", "# export "))}
    assert {"CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_TRACE_BUFFER_SIZE",
            "TORCH_NCCL_DUMP_ON_TIMEOUT", "NCCL_IB_GID_INDEX", "PYTORCH_CUDA_ALLOC_CONF"} <= exported, exported
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in res.stdout
    runs = [ln for ln in lines if ln.startswith("torchrun ")]
    assert [r.split(" program.py")[0] for r in runs] == [
        f"torchrun --nnodes 2 --node-rank {i} --nproc-per-node 2 --master-addr NODE0_ADDR "
        f"--master-port 29500" for i in (0, 1)]
    assert runs[0].endswith("program.py --checkpoint model.pt --input x.pt --output out.pt")
    res = subprocess.run([sys.executable, "program.py", "--print-launch", "4x1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 2 and "the tp group [0, 1] would span nodes" in res.stderr


def test_ascend_refuses_bfloat16_collectives_before_atlas_a2(gpt2, tmp_path, monkeypatch):
    write_program(gpt2[3], tmp_path, "ascend")
    spec = importlib.util.spec_from_file_location("ascend_program", tmp_path / "program.py")
    program = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(program)
    name = ["Ascend910ProB"]
    npu = types.SimpleNamespace(device_count=lambda: 8, set_device=lambda i: None, get_device_name=lambda: name[0])
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    monkeypatch.setattr(program, "COLLECTIVE_DTYPES", ("bfloat16",))
    with pytest.raises(SystemExit):
        program.profile_device()
    name[0] = "Ascend910B3"  # Atlas A2: the check passes (then torch.device("npu:0") needs torch_npu)
    with pytest.raises(RuntimeError, match="npu"):
        program.profile_device()
