"""One program, three device targets: the cpu/gloo, cuda/nccl and ascend/hccl profiles, and topology.

- Golden program text for GPT-2's MLP on tp=2 under each profile (the ``parcomp compile``
  output); the cuda and ascend programs differ from the cpu one only inside the PROFILE block.
- The cuda and ascend programs, run with ``--device cpu`` (CPU/gloo, not a GPU/NPU run) on two
  torchrun processes, equal the torch module; without ``--device cpu`` they stop at once with a
  clear message here (no torch_npu, no CUDA on this machine).
- A two-node job simulated on this machine (two torchrun launchers, c10d or static
  rendezvous) runs the dp=2 x tp=2 program; its tp groups sit inside a launcher ("node").
- :func:`parcomp.cost.topology.check_topology` on specs whose tp groups fit or span nodes.

No NPU or GPU is used anywhere. Set PARCOMP_ACCEPT=1 to rewrite the golden programs.
"""
from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.cli.commands import feeds_for  # noqa: E402
from parcomp.cli.main import main as parcomp_main  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.cost.topology import check_topology, group_ranks  # noqa: E402
from parcomp.errors import SpecError  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.spec import load_spec, parse_spec  # noqa: E402
from parcomp_backends.torch import PROFILES, assemble_outputs, emit_program, run_torchrun  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun_multinode, write_program  # noqa: E402
from parcomp_backends.torch.profiles import ProfileError, get_profile  # noqa: E402

from numerics import assert_equivalent  # noqa: E402

ROOT = Path(__file__).resolve().parents[1].parent
SPECS = ROOT / "specs"
GOLDEN = Path(__file__).resolve().parents[1] / "golden"
MODEL = f"{SPECS / 'models.py'}:gpt2_mlp"
TIMEOUT = 90
BEGIN, END = "# ---- PROFILE ", "# ---- end of PROFILE ----"


@pytest.fixture(scope="module")
def gpt2():
    """(module, example inputs as a dict, compiled tp=2 program, compiled dp=2 x tp=2 program)."""
    graph, module, example = load_model(MODEL)
    tp2 = compile_graph(graph, load_spec(SPECS / "gpt2_mlp_tp2.pcs"))
    dp2tp2 = compile_graph(graph, load_spec(SPECS / "gpt2_mlp_dp2_tp2.pcs"))
    return module, {"x": example[0]}, tp2, dp2tp2


def want(module, inputs):
    with torch.no_grad():
        return module.eval()(inputs["x"]).numpy()


def assert_like_module(got, compiled, module, inputs):
    """The program's output equals the module's, within float32's tolerance."""
    feeds = feeds_for(compiled.unsharded, module, (inputs["x"],))
    assert_equivalent(got, want(module, inputs))


def profile_span(lines) -> range:
    """Indices of the PROFILE block's lines, markers included."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(BEGIN))
    return range(start, lines.index(END, start) + 1)


# --- program text ---------------------------------------------------------------------


@pytest.mark.parametrize("profile", ["cpu", "cuda", "ascend"])
def test_gpt2_mlp_program_matches_golden(gpt2, profile):
    text = emit_program(gpt2[2], profile, model="models.py:gpt2_mlp")  # as `parcomp compile` labels it
    path = GOLDEN / f"gpt2_mlp_tp2.{profile}.program.py"
    if os.environ.get("PARCOMP_ACCEPT") == "1":
        path.write_text(text)
    assert path.exists(), "no golden yet: run with PARCOMP_ACCEPT=1"
    assert text == path.read_text(), f"{path.name} changed; rerun with PARCOMP_ACCEPT=1 if intended"
    assert str(ROOT) not in text
    compile(text, path.name, "exec")


def test_cuda_and_ascend_goldens_differ_from_cpu_only_in_the_profile_block():
    texts = {p: (GOLDEN / f"gpt2_mlp_tp2.{p}.program.py").read_text().splitlines() for p in PROFILES}
    cpu = texts["cpu"]
    for name, backend, device in (("cuda", "nccl", "cuda"), ("ascend", "hccl", "npu")):
        other = texts[name]
        a_span, b_span = profile_span(cpu), profile_span(other)
        changed = [op for op in difflib.SequenceMatcher(None, cpu, other, autojunk=False).get_opcodes()
                   if op[0] != "equal"]
        assert changed
        for _, i1, i2, j1, j2 in changed:
            assert all(i in a_span for i in range(i1, i2)), (name, cpu[i1:i2])
            assert all(j in b_span for j in range(j1, j2)), (name, other[j1:j2])
        block = "\n".join(other[i] for i in b_span)
        assert f'DIST_BACKEND = "{backend}"' in block and f'torch.device(f"{device}:{{LOCAL_RANK}}")' in block
    ascend = "\n".join(texts["ascend"])
    assert 'PRELUDE = ("torch_npu",)' in ascend and "torch.npu.set_device(LOCAL_RANK)" in ascend
    assert "torch.cuda.set_device(LOCAL_RANK)" in "\n".join(texts["cuda"])


@pytest.mark.parametrize("argv,profile", [(["--target", "ascend"], "ascend"),
                                          (["--target", "torch", "--profile", "cuda"], "cuda"),
                                          (["--target", "torch"], "cpu")])
def test_cli_compile_writes_the_golden_program(tmp_path, argv, profile, capsys):
    out = tmp_path / "out"
    rc = parcomp_main(["compile", MODEL, "--spec", str(SPECS / "gpt2_mlp_tp2.pcs"), *argv, "-o", str(out)])
    assert rc == 0
    assert (out / "program.py").read_text() == (GOLDEN / f"gpt2_mlp_tp2.{profile}.program.py").read_text()


def test_unknown_profile_is_a_clean_cli_error(tmp_path, capsys):
    with pytest.raises(ValueError, match="known: ascend, cpu, cuda"):
        get_profile("tpu")
    rc = parcomp_main(["compile", MODEL, "--spec", str(SPECS / "gpt2_mlp_tp2.pcs"), "--profile", "tpu",
                       "-o", str(tmp_path / "out")])
    assert rc == 2 and "unknown device profile 'tpu'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and issubclass(ProfileError, ValueError)


# --- torchrun, one node ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("profile", ["ascend", "cuda"])
def test_device_profile_program_with_device_cpu_equals_the_module(gpt2, tmp_path, profile):
    module, inputs, tp2, _ = gpt2
    write_program(tp2, tmp_path, profile)
    res = run_torchrun(tmp_path, 2, module, inputs, tmp_path / "out.pt", ("--device", "cpu"),
                       timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    assert_like_module(assemble_outputs(tmp_path / "out.pt", tp2.program)["output"], tp2, module, inputs)


@pytest.mark.slow
@pytest.mark.parametrize("profile,nproc,message", [
    ("ascend", 2, "error: profile ascend needs the module torch_npu (No module named 'torch_npu'); "
                  "install it or rerun with --device cpu"),
    ("cuda", 2, "error: profile cuda: CUDA is not available or has too few GPUs"),
    ("ascend", 3, "error: program compiled for mesh tp=2 (2 ranks) but started with WORLD_SIZE=3; "
                  "run: torchrun --nproc-per-node 2 program.py"),
])
def test_device_profile_without_device_cpu_stops_with_a_clear_message(gpt2, tmp_path, profile, nproc,
                                                                       message):
    module, inputs, tp2, _ = gpt2
    if profile == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    write_program(tp2, tmp_path, profile)
    res = run_torchrun(tmp_path, nproc, module, inputs, tmp_path / "out.pt", timeout=TIMEOUT)
    assert res.returncode != 0
    assert message in res.stderr
    assert 'program.py", line' not in res.stderr  # a message, not a traceback from the program
    assert not list(tmp_path.glob("out*.pt"))


# --- torchrun, two nodes simulated on this machine ---------------------------------------

PROBE = """\
import json, os, runpy, sys
keys = ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "PARCOMP_SIM_NODE")
os.write(1, ("PLACEMENT " + json.dumps({k: int(os.environ[k]) for k in keys}) + "\\n").encode())  # one write: ranks share the pipe
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_two_node_launch_equals_module_and_tp_groups_stay_in_a_node(gpt2, tmp_path, rdzv):
    module, inputs, _, dp2tp2 = gpt2
    spec = load_spec(SPECS / "gpt2_mlp_dp2_tp2.pcs")
    assert spec.topology == (2, 2)
    placement = check_topology(spec)
    assert placement["intra_node_axes"] == ["tp"] and placement["cross_node_axes"] == ["dp"]

    text = emit_program(dp2tp2, "cpu")
    program_groups = json.loads(re.search(r"^GROUP_RANKS = (.*?)  #", text, re.M).group(1))
    # the program's process groups are the placement's
    assert program_groups == {a: group_ranks(g) for a, g in placement["groups"].items()}

    write_program(dp2tp2, tmp_path, "cpu")
    (tmp_path / "probe.py").write_text(PROBE)
    results = run_torchrun_multinode(tmp_path, 2, 2, module, inputs, tmp_path / "out.pt", timeout=TIMEOUT,
                                     rdzv=rdzv, program="probe.py")
    for node, res in enumerate(results):
        assert res.returncode == 0, f"launcher {node}:\n{res.stderr[-3000:]}"
    out = assemble_outputs(tmp_path / "out.pt", dp2tp2.program)["output"]
    assert_like_module(out, dp2tp2, module, inputs)

    node_of = {}
    for launcher, res in enumerate(results):
        for found in re.finditer(r"PLACEMENT (\{[^{}]*\})", res.stdout):  # lines of 2 ranks may interleave
            env = json.loads(found.group(1))
            assert env["PARCOMP_SIM_NODE"] == launcher and env["WORLD_SIZE"] == 4
            assert env["LOCAL_WORLD_SIZE"] == 2
            # torchrun: each node gets a contiguous block of ranks, GROUP_RANK is the node's rank
            assert env["RANK"] == env["GROUP_RANK"] * 2 + env["LOCAL_RANK"]
            node_of[env["RANK"]] = launcher
    assert sorted(node_of) == [0, 1, 2, 3]
    if rdzv == "static":  # --node-rank i: launcher i runs ranks 2i, 2i+1
        assert node_of == {0: 0, 1: 0, 2: 1, 3: 1}
    # the tp groups the program creates run inside one launcher; the dp groups span both
    for g in program_groups["tp"]:
        assert len({node_of[r] for r in g}) == 1, (g, node_of)
        assert len({r // 2 for r in g}) == 1
    for g in program_groups["dp"]:
        assert len({node_of[r] for r in g}) == 2, (g, node_of)


HANG = """\
import os, pathlib, time
pathlib.Path(f"started.{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(600)
"""


@pytest.mark.slow
def test_launchers_time_out_and_kill_their_workers(tmp_path):
    """torchrun starts each worker in its own session: a timeout must kill those too. The
    timeouts leave a loaded 2-core machine time to start the workers (torch's import alone
    took over 7 s at load 10)."""
    (tmp_path / "hang.py").write_text(HANG)
    with pytest.raises(subprocess.TimeoutExpired) as info:
        run_torchrun_multinode(tmp_path, 2, 1, timeout=30, rdzv="static", program="hang.py")
    assert "launcher 0" in info.value.output and "launcher 1" in info.value.output
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(tmp_path, 2, timeout=20, program="hang.py")
    started = sorted(tmp_path.glob("started.*"))
    assert len(started) >= 2, "no worker started before the timeout; nothing was tested"
    for f in started:
        assert not alive(int(f.read_text())), f"worker {f.read_text()} survived"


def alive(pid) -> bool:
    """Whether ``pid`` runs (a zombie waiting for init to reap it is dead)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in "ZX"


# --- --print-launch keeps the options given with it ------------------------------------------

def _program(tmp_path_factory, *profile):
    out = tmp_path_factory.mktemp("launch") / "o"
    assert parcomp_main(["compile", "specs/models.py:gpt2_mlp", "--spec", "specs/gpt2_mlp_tp2.pcs", *profile,
                 "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def program_dir(tmp_path_factory):
    return _program(tmp_path_factory)


def _launch(program_dir, *args):
    return subprocess.run([sys.executable, "program.py", "--print-launch", *args], cwd=program_dir,
                          capture_output=True, text=True, timeout=120)


def test_print_launch_uses_the_options_given_with_it(program_dir):
    res = _launch(program_dir, "1x2", "--checkpoint", "my model.pt", "--input", "x.pt", "--timeout", "30")
    assert res.returncode == 0, res.stderr
    (run,) = [ln for ln in res.stdout.splitlines() if ln.startswith("torchrun ")]
    assert run.endswith("program.py --checkpoint 'my model.pt' --input x.pt --timeout 30")
    res = _launch(program_dir)  # none given: the run hint's
    assert res.stdout.rstrip().endswith("program.py --checkpoint model.pt --input x.pt --output out.pt")


def test_print_launch_sets_the_timeout_given_with_it(tmp_path_factory):
    ascend = _program(tmp_path_factory, "--profile", "ascend")
    assert "export HCCL_EXEC_TIMEOUT=600 " in _launch(ascend).stdout  # the program's default
    res = _launch(ascend, "--checkpoint", "m.pt", "--input", "x.pt", "--timeout", "30")
    assert res.returncode == 0 and "export HCCL_EXEC_TIMEOUT=30 " in res.stdout, res.stderr


def test_print_launch_rejects_a_bad_option_given_with_it(program_dir):
    res = _launch(program_dir, "--checkpoint", "m.pt", "--input", "x.pt", "--stepz", "3")
    assert res.returncode == 2 and "unrecognized arguments: --stepz 3" in res.stderr
    assert "torchrun" not in res.stdout


# --- topology ---------------------------------------------------------------------------


def test_topology_dp2_tp2_on_two_nodes_keeps_tp_inside_a_node():
    got = check_topology(load_spec(SPECS / "gpt2_mlp_dp2_tp2.pcs"))
    assert got == {"nodes": 2, "devices_per_node": 2,
                   "groups": {"dp": {"size": 2, "stride": 2, "count": 2},
                              "tp": {"size": 2, "stride": 1, "count": 2}},
                   "intra_node_axes": ["tp"], "cross_node_axes": ["dp"]}
    assert [group_ranks(got["groups"][a]) for a in ("dp", "tp")] == [[[0, 2], [1, 3]], [[0, 1], [2, 3]]]


def test_topology_absent_places_nothing():
    got = check_topology(load_spec(SPECS / "gpt2_mlp_tp2.pcs"))
    assert got == {"nodes": None, "devices_per_node": None,
                   "groups": {"tp": {"size": 2, "stride": 1, "count": 1}},
                   "intra_node_axes": [], "cross_node_axes": []}


def test_topology_tp4_on_two_nodes_of_two_is_an_error():
    spec = parse_spec("mesh tp=4\ntopology nodes=2 devices_per_node=2\n", "tp4.pcs")
    with pytest.raises(SpecError) as info:
        check_topology(spec)
    msg = str(info.value)
    assert "tp4.pcs: mesh axis tp group [0, 1, 2, 3] spans nodes 0, 1" in msg
    assert "tensor parallelism must stay inside a node" in msg and "make tp <= 2" in msg


def test_topology_tp_outer_spans_nodes_and_is_an_error():
    spec = parse_spec("mesh tp=2 dp=2\ntopology nodes=2 devices_per_node=2\n", "tp_outer.pcs")
    assert spec.mesh.groups(0) == [[0, 2], [1, 3]]
    with pytest.raises(SpecError) as info:
        check_topology(spec)
    msg = str(info.value)
    assert "mesh axis tp group [0, 2] spans nodes 0, 1" in msg
    assert "put tp last in the mesh" in msg and "'mesh dp=2 tp=2'" in msg


def test_topology_other_axes_may_span_nodes():
    spec = parse_spec("mesh dp=2 pp=2 tp=2\ntopology nodes=4 devices_per_node=2\n", "pp.pcs")
    got = check_topology(spec)
    assert (got["nodes"], got["devices_per_node"]) == (4, 2)
    assert got["intra_node_axes"] == ["tp"] and got["cross_node_axes"] == ["dp", "pp"]
    with pytest.raises(SpecError, match="not a multiple of the 2 consecutive ranks"):
        check_topology(parse_spec("mesh dp=3 tp=2\ntopology nodes=2 devices_per_node=3\n", "odd.pcs"))


def test_cuda_program_turns_tf32_off_after_binding_the_device(gpt2):
    """parcomp run's float32 tolerance assumes fp32 rounding: the cuda program sets TF32 off."""
    cuda = emit_program(gpt2[2], "cuda")
    body = cuda[cuda.index("def profile_device():"):cuda.index("# ---- end of PROFILE ----")]
    assert body.index("torch.cuda.set_device(LOCAL_RANK)") < body.index(
        "torch.backends.cuda.matmul.allow_tf32 = False") < body.index("return torch.device")
    assert "torch.backends.cudnn.allow_tf32 = False" in body
    for other in (emit_program(gpt2[2], "cpu"), emit_program(gpt2[2], "ascend")):  # only --tf32 sets it there
        assert "allow_tf32" not in other[other.index("# ---- PROFILE"):other.index("# ---- end of PROFILE ----")]
