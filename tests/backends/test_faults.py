"""A rank that hangs or dies: every other rank stops within ``--timeout`` (every process group,
WORLD and each mesh axis's, has it) and names that rank in one line, instead of waiting in a
collective or printing gloo's tracebacks; and each mesh axis's process group is made by one
call per rank, however large the mesh.

Two torchrun runs (slow) on the dp=2 x tp=2 training program (GPT2MLP): rank 3 hangs in its
first ``all_reduce`` (a tp collective of step 1), or kills itself there with SIGKILL. The rest
runs in this process against the runtime modules program.py is pasted from.
"""
from __future__ import annotations

import re
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.cost.topology import axis_groups, group_ranks, joint_groups  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.ir.types import Mesh  # noqa: E402
from parcomp.spec import load_spec  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun, write_program  # noqa: E402
from parcomp_backends.torch.runtime import program_cluster as cl  # noqa: E402
from parcomp_backends.torch.runtime import program_common as rt  # noqa: E402

from fake_store import FakeStore  # noqa: E402

SPECS = Path(__file__).resolve().parents[1].parent / "specs"
TIMEOUT_S = 10  # the program's --timeout in the torchrun runs
STARTUP_S = 120  # torchrun, 4 imports of torch and the first step on a busy 2-core machine (~20 s idle)

# runs program.py with rank 3 hanging (MODE=hang) or killed by SIGKILL (MODE=kill) at its
# first all_reduce: a tp all_reduce of step 1's forward
FAULTY = """\
import os, runpy, signal, sys, time
import torch.distributed as dist
def faulty(*args, **kwargs):
    if os.environ["MODE"] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)
if os.environ["RANK"] == "3":
    dist.all_reduce = faulty
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


def rank_errors(text) -> dict:
    """{rank: its error line} from the launcher's stderr."""
    return {int(m.group(1)): m.group(2)
            for m in re.finditer(r"^program\.py \(rank (\d+)\): error: (.*)$", text, re.M)}


@pytest.fixture(scope="module")
def dp2tp2(tmp_path_factory):
    """A directory with the dp=2 x tp=2 training program, its checkpoint, inputs and FAULTY."""
    graph, module, (x,) = load_model(f"{SPECS / 'models.py'}:gpt2_mlp")
    d = tmp_path_factory.mktemp("dp2tp2")
    write_program(compile_graph(graph, load_spec(SPECS / "gpt2_mlp_dp2_tp2_train.pcs")), d, "cpu")
    (d / "faulty.py").write_text(FAULTY)
    torch.save(module.state_dict(), d / "model.pt")
    torch.save({"x": x, "target": torch.zeros_like(module(x))}, d / "inputs.pt")
    return d


def assert_no_raw_gloo_errors(stderr):
    """No gloo message or worker traceback outside the ranks' one-line errors (torchrun's own
    report of the failed workers, at the end, is the launcher's)."""
    workers = stderr.split("ChildFailedError")[0]
    other = [ln for ln in workers.splitlines() if not ln.startswith("program.py (rank")]
    assert not [ln for ln in other if "gloo" in ln or "Connection" in ln or "Timed out" in ln], workers[-4000:]
    assert "Traceback" not in workers.split("program.py (rank")[0], workers[-4000:]


def _run(d, mode):
    """The faulty run; the launcher's limit bounds it (a subprocess.TimeoutExpired fails the
    test): startup, then --timeout, then 30 s for every rank to report and exit."""
    return run_torchrun(d, 4, str(d / "model.pt"), str(d / "inputs.pt"), str(d / "out.pt"),
                        ("--timeout", str(TIMEOUT_S)), timeout=STARTUP_S + TIMEOUT_S + 30,
                        program="faulty.py", env={"MODE": mode})


@pytest.mark.slow
def test_a_rank_hung_in_a_tp_collective_is_named_by_every_other_rank_within_the_timeout(dp2tp2):
    """Rank 3 hangs in step 1's tp all_reduce. Rank 2 (its tp peer) and ranks 0-1 (waiting in
    dp and tp collectives that cannot finish) time out after --timeout 10 s (gloo's message
    says so: the sub-mesh groups have the timeout, not gloo's 30 minutes) and each prints one
    line naming rank 3; the launcher then stops rank 3, which says the others named it."""
    res = _run(dp2tp2, "hang")
    assert res.returncode != 0
    errors = rank_errors(res.stderr)
    assert sorted(errors) == [0, 1, 2, 3], res.stderr[-4000:]
    for rank in (0, 1, 2):
        line = errors[rank]
        assert line.startswith("step 1: rank 3 (on "), line
        assert "stopped answering" in line and "--timeout 10 s" in line, line
        assert "Timed out waiting 10000ms" in line, line
    assert errors[3].startswith("step 1: this rank stopped answering"), errors[3]
    assert_no_raw_gloo_errors(res.stderr)


@pytest.mark.slow
def test_a_rank_killed_with_sigkill_is_named_by_every_survivor(dp2tp2):
    """Rank 3 dies (SIGKILL) in step 1: rank 2 loses its tp peer, the launcher stops the others
    with SIGTERM; every survivor prints one line naming rank 3, no gloo traceback."""
    res = _run(dp2tp2, "kill")
    errors = rank_errors(res.stderr)
    assert sorted(errors) == [0, 1, 2], res.stderr[-4000:]
    for line in errors.values():
        assert line.startswith("step 1: rank 3 (on ") and "stopped answering" in line, line
    assert_no_raw_gloo_errors(res.stderr)


# --- in this process --------------------------------------------------------------------

def _posted(store, rank, report):
    """``rank``'s report as report_fault posts it (a rank this process does not play)."""
    store.set(f"parcomp/fault/rank{rank}", report)
    store.append("parcomp/fault/ranks", f"{rank} ")
    store.add("parcomp/fault/count", 1)


def _report(monkeypatch, store, rank, cause):
    """report_fault(cause) as ``rank`` of 4; returns its exit code."""
    monkeypatch.setattr(cl, "RANK", rank)
    monkeypatch.setattr(cl, "FAULT", {**cl.FAULT, "store": store, "lock": cl.threading.Lock()})
    with pytest.raises(SystemExit) as e:
        cl.report_fault(cause)
    return e.value.code


@pytest.fixture
def four_ranks(monkeypatch):
    monkeypatch.setattr(cl, "WORLD_SIZE", 4)
    monkeypatch.setattr(cl, "HOSTS", ["a", "a", "b", "b"])
    monkeypatch.setattr(cl, "FAULT_WAIT_S", 0.3)
    monkeypatch.setattr(cl, "FAULT", {**cl.FAULT, "timeout": 10.0, "where": "step 2"})

    def leave(code):
        raise SystemExit(code)

    monkeypatch.setattr(cl, "exit_now", leave)


def test_the_first_verdict_names_the_silent_rank_for_every_rank_even_one_woken_later(
        monkeypatch, capsys, four_ranks):
    """Ranks 1, 2 and then 0 report a timed-out collective; rank 3 reports nothing until the
    launcher's SIGTERM wakes it after rank 0 has decided. Every line names rank 3."""
    store = FakeStore()
    timed_out = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                             "for recv operation to complete")
    for rank in (1, 2):  # posted earlier (their own wait is what this process cannot play)
        _posted(store, rank, "stopped RuntimeError: Timed out (step 2)")
    assert _report(monkeypatch, store, 0, timed_out) == 2
    assert _report(monkeypatch, store, 3, "stopped by the launcher (SIGTERM)") == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == ("program.py (rank 0): error: step 2: rank 3 (on b) stopped answering (hung, or "
                        "gone without a word: killed or crashed); each collective waits at most --timeout "
                        "10 s; this rank: RuntimeError: Timed out waiting 10000ms for recv operation to "
                        "complete")
    assert lines[1].startswith("program.py (rank 3): error: step 2: this rank stopped answering"), lines[1]
    assert lines[1].endswith("this rank: stopped by the launcher (SIGTERM)"), lines[1]


def test_a_ranks_own_error_is_printed_with_its_traceback_and_named_by_the_others(
        monkeypatch, capsys, four_ranks):
    """Rank 2's own error (not a collective's) exits 1 at once with its traceback; the others,
    stopped by the launcher, name it and its message, and nobody as silent."""
    store = FakeStore()
    try:
        {}["w"]
    except KeyError as e:
        assert _report(monkeypatch, store, 2, e) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.splitlines()[-1] == "program.py (rank 2): error: step 2: this rank: KeyError: 'w'"
    for rank in (1, 3):  # the launcher's SIGTERM reaches every rank at once
        _posted(store, rank, "stopped stopped by the launcher (SIGTERM) (step 2)")
    assert _report(monkeypatch, store, 0, "stopped by the launcher (SIGTERM)") == 2
    line = capsys.readouterr().err.splitlines()[-1]
    assert line == ("program.py (rank 0): error: step 2: the run failed on rank 2 (on b) of 4, so every "
                    "rank stops: rank 2: KeyError: 'w' (step 2); this rank: stopped by the launcher (SIGTERM)")


def test_a_rank_that_fails_with_a_message_is_named_with_it(monkeypatch, capsys, four_ranks):
    """Rank 1 exits 2 through fail() mid-run (its line printed); the ranks the launcher then
    stops name it and its message, not as gone without a word."""
    store = FakeStore()
    monkeypatch.setattr(cl, "RANK", 1)
    monkeypatch.setattr(cl, "FAULT", {**cl.FAULT, "store": store, "lock": cl.threading.Lock()})
    monkeypatch.setattr(cl, "FAILED", ["--save ck: cannot write there"])
    cl.note_exit(2)
    for rank in (2, 3):
        _posted(store, rank, "stopped stopped by the launcher (SIGTERM) (step 2)")
    assert _report(monkeypatch, store, 0, "stopped by the launcher (SIGTERM)") == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "program.py (rank 0): error: step 2: the run failed on rank 1 (on a) of 4, so every rank stops: "
        "rank 1: --save ck: cannot write there (step 2); this rank: stopped by the launcher (SIGTERM)")


def test_a_ranks_own_failure_is_seen_by_the_others_watch_but_a_timeout_report_is_not(monkeypatch, four_ranks):
    """The watch thread of a rank blocked in a collective ends it when another rank posts its own
    failure (fail() through note_exit, or an error of its own): where the collective would wait
    for that rank until --timeout (NCCL, or a rank whose exit hangs). A stopped collective's
    report (a timeout) does not count: a hung rank would otherwise report itself present. Nor
    does anything while this rank agrees on a step, or once it has failed itself."""
    store = FakeStore()
    monkeypatch.setattr(cl, "FAULT", {**cl.FAULT, "store": store, "lock": cl.threading.Lock()})
    monkeypatch.setattr(cl, "FAILED", [])
    _posted(store, 2, "stopped RuntimeError: Timed out (step 2)")
    assert not cl.peer_reported()
    monkeypatch.setattr(cl, "RANK", 1)
    monkeypatch.setattr(cl, "FAILED", ["input 'input_ids' of sample 3 in --data d.py:f (step 2) holds -7"])
    cl.note_exit(2)
    monkeypatch.setattr(cl, "RANK", 0)
    assert not cl.peer_reported()  # this process played rank 1, which has failed
    monkeypatch.setattr(cl, "FAILED", [])
    assert cl.peer_reported()
    cl.FAULT["agreeing"] = True
    assert not cl.peer_reported()
    cl.FAULT["agreeing"] = False
    cl.FAULT["store"] = None  # the store gone (the run has ended): no report
    assert not cl.peer_reported()


def test_sigterm_with_every_rank_present_exits_143_naming_nobody(monkeypatch, capsys, four_ranks):
    """A plain stop (torchrun's SIGTERM to every rank, none hung or failed): exit 143."""
    store = FakeStore()
    for rank in (0, 1, 2):
        _posted(store, rank, "stopped stopped by the launcher (SIGTERM) (step 2)")
    assert _report(monkeypatch, store, 3, "stopped by the launcher (SIGTERM)") == 143
    assert capsys.readouterr().err.splitlines()[-1] == (
        "program.py (rank 3): error: step 2: this rank: stopped by the launcher (SIGTERM)")


def test_collective_errors_are_told_from_a_ranks_own():
    assert cl.collective_error(RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert cl.collective_error(torch.distributed.DistBackendError("NCCL watchdog timeout"))
    assert not cl.collective_error(KeyError("w")) and not cl.collective_error(RuntimeError("shape mismatch"))


class CountingDist:
    """Stands in for torch.distributed in make_groups: counts the groups made."""

    def __init__(self, backend="gloo", bound=None):
        self.calls, self.backend = [], backend
        self.group = types.SimpleNamespace(WORLD=types.SimpleNamespace(bound_device_id=bound))

    def get_backend(self):
        return self.backend

    def new_group(self, ranks, timeout=None, use_local_synchronization=False):
        self.calls.append(("new_group", tuple(ranks), timeout, use_local_synchronization))
        return ("group", tuple(ranks))

    def split_group(self, split_ranks, timeout=None):
        self.calls.append(("split_group", len(split_ranks), timeout))
        return ("split", tuple(next(r for r in split_ranks if rt.RANK in r)))


BIG = {"dp": 16, "sq": 8, "tp": 8}  # 1,024 ranks
BIG_AXES = ("dp", "sq", "tp", "dp,sq", "dp,sq,tp")  # the 2-block MLP training step's (bench/mesh_compile_time.py)


@pytest.fixture
def big_mesh(monkeypatch):
    mesh = Mesh(tuple(BIG.items()))
    groups = {a: group_ranks(axis_groups(mesh, i)) for i, a in enumerate(BIG)}
    for joint in BIG_AXES[3:]:
        groups[joint] = group_ranks(joint_groups(mesh, mesh.axes_of(joint)))
    for name, value in (("MESH", BIG), ("GROUP_RANKS", groups), ("COMM_AXES", BIG_AXES),
                        ("WORLD_SIZE", 1024), ("MESH_SIZE", 1024), ("GROUPS", {}), ("LINE_GROUPS", {})):
        monkeypatch.setattr(rt, name, value)
    return groups


@pytest.mark.parametrize("rank", [0, 517, 1023])
def test_a_1024_rank_mesh_makes_one_group_per_axis_with_the_timeout(monkeypatch, big_mesh, rank):
    """dp16 x sq8 x tp8: each rank makes 4 groups (dp, sq, tp, the joint dp,sq; dp,sq,tp is
    WORLD), each its own line synchronised among its ranks, each with --timeout (it made one
    group per line of every axis: 328); with WORLD bound to an NCCL device, 4 splits of WORLD.
    Every axis's group is this rank's line."""
    import datetime

    monkeypatch.setattr(rt, "RANK", rank)
    for backend, bound, kind in (("gloo", None, "new_group"), ("nccl", "cuda:0", "split_group")):
        fake = CountingDist(backend, bound)
        monkeypatch.setattr(rt, "dist", fake)
        monkeypatch.setattr(rt, "GROUPS", {})
        monkeypatch.setattr(rt, "LINE_GROUPS", {})
        rt.make_groups(42.0)
        assert [c[0] for c in fake.calls] == [kind] * 4, fake.calls[:5]
        assert all(datetime.timedelta(seconds=42) in c for c in fake.calls)
        assert rt.GROUPS["dp,sq,tp"] is fake.group.WORLD
        for axis in BIG_AXES[:4]:
            mine = next(r for r in big_mesh[axis] if rank in r)
            assert rt.GROUPS[axis][1] == tuple(mine) and len(mine) == {"dp": 16, "sq": 8, "tp": 8, "dp,sq": 128}[axis]
        if kind == "new_group":
            assert all(c[3] is True for c in fake.calls)


def test_axes_with_the_same_ranks_share_one_group(monkeypatch):
    """dp=2 x sq=1: the joint dp,sq group has dp's ranks: one group, not two of one name."""
    fake = CountingDist()
    for name, value in (("MESH", {"dp": 2, "sq": 1, "tp": 2}), ("COMM_AXES", ("dp", "dp,sq")),
                        ("GROUP_RANKS", {"dp": [[0, 2], [1, 3]], "dp,sq": [[0, 2], [1, 3]]}),
                        ("WORLD_SIZE", 4), ("RANK", 1), ("GROUPS", {}), ("LINE_GROUPS", {}),
                        ("dist", fake)):
        monkeypatch.setattr(rt, name, value)
    rt.make_groups(5.0)
    assert len(fake.calls) == 1 and rt.GROUPS["dp"] is rt.GROUPS["dp,sq"]
