"""The runtime pasted into every program.py, tested as the real modules it is pasted from."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
dist = torch.distributed

from parcomp_backends.torch.launch import free_port  # noqa: E402
from parcomp_backends.torch.runtime import program_common as rt  # noqa: E402
from parcomp_backends.torch.runtime import program_forward, program_train  # noqa: E402
from parcomp_backends.torch.runtime import (CONSTANT_LOADER, MAIN, ONNX_READER, RUNTIME, TIED_LOADER,  # noqa: E402
                                            TRAIN_MAIN, TRAIN_RUNTIME, sections)


@pytest.fixture
def one_rank_gloo(monkeypatch):
    """A 1-process gloo world with the runtime's groups made (mesh x=1: WORLD)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(free_port())
    monkeypatch.setattr(rt, "WORLD_SIZE", 1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        rt.make_groups(60)
        assert rt.GROUPS == {"x": dist.group.WORLD}
        yield
    finally:
        rt.GROUPS.clear()
        dist.destroy_process_group()


def test_collectives_on_one_rank_are_identities_and_keep_their_input(one_rank_gloo):
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    keep = x.clone()
    for y in (rt.all_reduce(x, "x"), rt.all_gather(x, 1, "x"), rt.reduce_scatter(x, 2, "x"),
              rt.all_to_all(x, 0, 2, "x"), rt.shard_slice(x, 1, "x"), rt.partial_mask(x, "x")):
        assert torch.equal(y, keep) and y.shape == keep.shape
    assert torch.equal(x, keep)  # nothing but all_reduce_ writes its operand
    fresh = x * 1
    assert rt.all_reduce_(fresh, "x") is fresh
    for dim in (0, 1):  # started, then waited for: the same values as the blocking forms
        assert torch.equal(rt.wait(rt.all_gather_start(x, dim, "x")), rt.all_gather(x, dim, "x"))
        assert torch.equal(rt.wait(rt.reduce_scatter_start(x, dim, "x")), rt.reduce_scatter(x, dim, "x"))
    assert torch.equal(x, keep)


def test_mesh_coords_are_row_major(monkeypatch):
    monkeypatch.setattr(rt, "MESH", {"dp": 2, "tp": 3})
    assert [rt.mesh_coords(r) for r in (0, 1, 3, 5)] == [(0, 0), (0, 1), (1, 0), (1, 2)]


def test_steps_argument_is_checked(capsys):
    assert program_train.parse_args(["--checkpoint", "m.pt", "--steps", "7"]).steps == 7
    for bad in ("0", "1000001", "two"):
        with pytest.raises(SystemExit) as e:
            program_train.parse_args(["--checkpoint", "m.pt", "--steps", bad])
        assert e.value.code == 2
    assert "give 1 to 1_000_000 training steps" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        program_train.parse_args(["--steps", "2"])  # a training program needs its checkpoint
    assert "--checkpoint" in capsys.readouterr().err


def test_bench_argument_is_bounded(capsys):
    assert program_forward.parse_args(["--bench", "3"]).bench == 3
    assert program_train.parse_args(["--checkpoint", "m.pt", "--bench", "0"]).bench == 0
    for parse in (program_forward.parse_args, lambda a: program_train.parse_args(["--checkpoint", "m.pt", *a])):
        for bad in ("-1", "100001", "1e12", "x"):
            with pytest.raises(SystemExit) as info:
                parse(["--bench", bad])
            assert info.value.code == 2
    assert "give 0 to 100_000 timed steps" in capsys.readouterr().err


def test_forward_arguments_and_fail_exit_2(capsys):
    args = program_forward.parse_args(["--output", "o.pt", "--bench", "3"])
    assert (args.output, args.bench, args.device) == ("o.pt", 3, "cpu")
    with pytest.raises(SystemExit) as e:
        rt.fail("no such file")
    assert e.value.code == 2 and "error: no such file" in capsys.readouterr().err


def test_every_section_is_pasted_and_stand_ins_are_not():
    pasted = (RUNTIME + MAIN + TRAIN_RUNTIME + TRAIN_MAIN + ONNX_READER  # .onnx models
              + CONSTANT_LOADER + TIED_LOADER)  # computed constants, tied weights
    for module in ("program_common", "program_forward", "program_train"):
        for name, text in sections(module).items():
            assert text in pasted, f"{module} section {name} is never pasted"
    assert "Stand-in" not in pasted and "from .program_common" not in pasted
    for text in (MAIN, TRAIN_MAIN):  # both leave through exit_now (no C++ static destructors)
        assert 'if __name__ == "__main__":' in text and text.rstrip().endswith("exit_now(0)")


def test_save_every_saves_each_multiple_and_the_last_step(capsys):
    """``--save-every N``: the steps saved during a run are the multiples of N (counted on from
    a resumed step) and the last; the hook runs after each step with that step's result."""
    assert program_train.saved_steps(1, 6, 1) == [1, 2, 3, 4, 5, 6]
    assert program_train.saved_steps(1, 6, 4) == [4, 6]
    assert program_train.saved_steps(4, 9, 3) == [6, 9]
    assert program_train.saved_steps(1, 6) == [6]  # --save alone: after the last step
    assert program_train.parse_args(["--checkpoint", "m.pt", "--save", "d", "--save-every", "2"]).save_every == 2
    with pytest.raises(SystemExit) as e:
        program_train.parse_args(["--checkpoint", "m.pt", "--save-every", "2"])
    assert e.value.code == 2 and "--save-every N needs --save DIR" in capsys.readouterr().err
    seen = []

    def step(params, inputs):
        return {"loss": params["w"].sum(), "w": params["w"] + 1}

    old = program_train.CARRIED
    program_train.CARRIED = ("w",)
    try:
        program_train.train({"w": torch.zeros(2)}, [{}] * 3, step=step, first=4,
                            after_step=lambda k, p: seen.append((k, float(p["w"][0]))))
    finally:
        program_train.CARRIED = old
    assert seen == [(4, 1.0), (5, 2.0), (6, 3.0)]  # each step's result, numbered on from 4


def test_tf32_is_a_switch_off_by_default(capsys):
    """``--tf32`` turns TF32 matmuls and convolutions on after the cuda profile turned them off
    (rank 0 says so); without it the program leaves them off. main() calls it once the device
    is bound (the pasted text)."""
    from parcomp_backends.torch.runtime import program_cluster

    assert program_train.parse_args(["--checkpoint", "m.pt"]).tf32 is False
    assert program_forward.parse_args(["--tf32"]).tf32 is True
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        program_cluster.set_tf32(True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert "--tf32: float32 matmuls and convolutions run in TF32" in capsys.readouterr().out
        program_cluster.set_tf32(False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
    assert MAIN.index("profile_device()") < MAIN.index("set_tf32(args.tf32)")


def test_ragged_all_to_all_reads_its_split_sizes_in_one_copy(one_rank_gloo, monkeypatch):
    """The ragged all_to_all's split sizes reach the host as one tensor copy, not one scalar
    read (``aten._local_scalar_dense``: a device sync each on a GPU) per peer; the result equals
    the dense exchange (here one rank: the input)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from parcomp_backends.torch.runtime import program_moe

    monkeypatch.setattr(program_moe, "GROUPS", {"x": dist.group.WORLD})
    monkeypatch.setattr(program_moe, "MESH", {"x": 1})

    class Reads(TorchDispatchMode):
        scalars = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                Reads.scalars += 1
            return func(*args, **(kwargs or {}))

    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    x[0, 1] = 0  # a row with nothing routed: not sent
    with Reads():
        y = program_moe.all_to_all_ragged(x, 0, 1, "x")
    assert torch.equal(y, x) and Reads.scalars == 0


def test_a_sigterm_ends_the_loop_after_the_next_step_on_every_rank(one_rank_gloo):
    """A SIGTERM (its handler's ``ask_stop``) during step 2 of a loop that saves: the flag is
    combined over the ranks by an all_reduce that runs during step 3, so the loop ends after
    step 3; with no loop that saves (not armed), the handler leaves the stop to the fault path."""
    from parcomp_backends.torch.runtime import program_cluster

    stop = program_cluster.STOP
    assert stop is program_train.STOP  # program.py is one namespace
    seen = []

    def step(params, inputs):
        if len(seen) == 1:  # step 2
            assert program_cluster.ask_stop() is True
        return {"loss": params["w"].sum(), "w": params["w"] + 1}

    def after(k, params):
        seen.append(k)
        return program_train.stop_after(k)

    old = program_train.CARRIED
    program_train.CARRIED = ("w",)
    stop.update(armed=True, asked=False, flag=None)
    try:
        out, losses = program_train.train({"w": torch.zeros(2)}, [{}] * 6, step=step, after_step=after)
        assert seen == [1, 2, 3] and losses == [0.0, 2.0, 4.0] and float(out["w"][0]) == 3.0
        assert stop["flag"] is None  # nothing left in flight
        stop.update(armed=False, asked=False)
        assert program_cluster.ask_stop() is False and stop["asked"] is False
    finally:
        program_train.CARRIED = old
        stop.update(armed=False, asked=False, flag=None)
