"""ZB-H1 (backward split into input- and weight-gradient) and interleaved 1F1B (virtual
stages) as action lists checked by the simulator, and hypotheses over every
schedule, stage count, microbatch count, chunk count and stage times."""
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.errors import ParcompError
from parcomp.passes.pipeline.schedule import (SCHEDULES, Action, ScheduleError, analytic_bubble,
                                     analytic_bubble_zb_h1, interleaved, schedule, simulate)


@pytest.mark.parametrize("pp,micro", [(2, 4), (3, 3), (4, 4), (4, 8), (6, 12)])
def test_zb_h1_bubble_is_the_papers_a_third_of_1f1b_idle_time(pp, micro):
    zb, one = simulate(schedule("zb-h1", pp, micro)), simulate(schedule("1f1b", pp, micro))
    assert zb.bubble == pytest.approx(analytic_bubble_zb_h1(pp, micro), rel=1e-12)
    assert one.bubble == pytest.approx(analytic_bubble(pp, micro), rel=1e-12)
    idle = [zb.makespan * pp - sum(zb.busy), one.makespan * pp - sum(one.busy)]
    assert idle[0] == pytest.approx(idle[1] / 3, rel=1e-12)
    assert max(zb.peak_inflight) == max(one.peak_inflight)  # 1F1B's peak stash


def test_zb_h1_splits_every_backward_and_sends_after_the_input_gradient():
    acts = schedule("zb-h1", 3, 4)
    for s, lst in enumerate(acts):
        kinds = [a.kind for a in lst]
        assert "backward" not in kinds
        assert kinds.count("backward_input") == kinds.count("backward_weight") == 4
        for k, a in enumerate(lst):
            if a.kind == "send_bwd":
                assert lst[k - 1] == Action("backward_input", a.micro)


def test_simulator_rejects_a_weight_gradient_before_its_input_gradient():
    acts = [list(x) for x in schedule("zb-h1", 2, 2)]
    k = next(i for i, a in enumerate(acts[1]) if a.kind == "backward_input")
    w = next(i for i, a in enumerate(acts[1]) if a.kind == "backward_weight" and a.micro == acts[1][k].micro)
    acts[1][k], acts[1][w] = acts[1][w], acts[1][k]
    with pytest.raises(ScheduleError) as e:
        simulate(tuple(tuple(x) for x in acts))
    assert e.value.rank == 1 and e.value.step == k and "before backward_input" in str(e.value)


def test_simulator_rejects_a_swapped_send_and_recv_in_zb_h1():
    acts = [list(x) for x in schedule("zb-h1", 2, 2)]
    k = next(i for i, a in enumerate(acts[0]) if a.kind == "send_fwd")
    acts[0][k] = Action("recv_fwd", acts[0][k].micro, 1)
    with pytest.raises(ScheduleError) as e:
        simulate(tuple(tuple(x) for x in acts))
    assert "rank 0 step" in str(e.value) and "deadlock" in str(e.value)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 6), st.integers(1, 12), st.data())
def test_every_schedule_runs_each_microbatch_once_without_deadlock(name, pp, micro, data):
    tf = data.draw(st.lists(st.floats(0.25, 4.0), min_size=pp, max_size=pp))
    tb = [2 * t for t in tf]
    sim = simulate(schedule(name, pp, micro), tf, tb)
    ran = {}
    for s, _, a in sim.order:
        if a.kind in ("forward", "backward", "backward_input", "backward_weight"):
            ran.setdefault((s, a.micro), []).append(a.kind)
    for s in range(pp):
        for m in range(micro):
            kinds = sorted(ran[(s, m)])
            assert kinds in (["backward", "forward"], ["backward_input", "backward_weight", "forward"])
    assert sum(sim.busy) == pytest.approx(3 * micro * sum(tf))
    assert 0 <= sim.bubble < 1 and all(1 <= p <= micro for p in sim.peak_inflight)
    if len(set(tf)) == 1:  # equal stages: GPipe = 1F1B >= ZB-H1
        assert sim.bubble <= analytic_bubble(pp, micro) + 1e-12


@pytest.mark.parametrize("pp,micro,chunks", [(2, 2, 2), (2, 4, 2), (4, 8, 2), (4, 4, 3), (3, 6, 2)])
def test_interleaved_1f1b_divides_the_bubble_by_the_chunks(pp, micro, chunks):
    sim = simulate(interleaved(pp, micro, chunks))
    assert sim.bubble == pytest.approx((pp - 1) / (chunks * micro + pp - 1), rel=1e-12)
    assert sim.bubble < simulate(schedule("1f1b", pp, micro)).bubble


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved(4, 8, 1) == schedule("1f1b", 4, 8)


def test_interleaved_needs_microbatches_a_multiple_of_pp():
    with pytest.raises(ParcompError, match="multiple of pp"):
        interleaved(4, 6, 2)


def test_simulator_rejects_an_interleaved_recv_of_the_wrong_chunk():
    acts = [list(x) for x in interleaved(2, 2, 2)]
    k = next(i for i, a in enumerate(acts[1]) if a.kind == "recv_fwd")
    a = acts[1][k]
    acts[1][k] = Action(a.kind, a.micro, a.peer, 1 - a.chunk)
    with pytest.raises(ScheduleError) as e:
        simulate(tuple(tuple(x) for x in acts))
    assert "deadlock" in str(e.value) and f"rank 1 step {k} waits on recv_fwd m=0 c=1 <- 0" in str(e.value)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 3), st.data())
def test_interleaved_runs_every_chunk_of_every_microbatch_once(pp, groups, chunks, data):
    micro = pp * groups
    tf = data.draw(st.lists(st.floats(0.25, 4.0), min_size=pp, max_size=pp))
    sim = simulate(interleaved(pp, micro, chunks), tf, [2 * t for t in tf])
    ran = sorted((s, a.micro, a.chunk, a.kind) for s, _, a in sim.order if a.kind in ("forward", "backward"))
    assert ran == sorted((s, m, c, k) for s in range(pp) for m in range(micro) for c in range(chunks)
                         for k in ("forward", "backward"))
    assert sum(sim.busy) == pytest.approx(3 * micro * sum(tf))
