"""The point-to-point order of a pipelined program.py (:func:`p2p_slots`): each run of sends and
receives is one ``batch_isend_irecv`` slot; the simulator runs every rank's slots together as
NCCL/HCCL run them (a slot waits until each of its ops has met its partner in the peer's posted
slot; between two ranks the k-th send meets the k-th receive) and refuses an order that would
deadlock or cross messages."""
import pytest

from parcomp.passes.pipeline.schedule import (SCHEDULES, COMM, Action, ScheduleError, interleaved, p2p_slots,
                                              schedule, simulate)


def _message(s, a, pp):
    vs, d = a.chunk * pp + s, a.kind[5:]
    if a.kind.startswith("send"):
        vs += 1 if d == "fwd" else -1
    return (d, a.micro, vs)


def _check_independently(actions, slots):
    """Every comm action in exactly one slot; per rank pair the sends' messages in posting order
    equal the receives'; a slot holds sends and receives only; a receive's slot comes before
    the compute that reads it."""
    pp = len(actions)
    sends, recvs = {}, {}
    for s, (acts, out) in enumerate(zip(actions, slots)):
        flat = [k for e in out for k in (e if isinstance(e, tuple) else ())]
        assert sorted(flat) == [k for k, a in enumerate(acts) if a.kind in COMM]
        position = {}
        for i, e in enumerate(out):
            for k in (e if isinstance(e, tuple) else (e,)):
                position[k] = i
        for k, a in enumerate(acts):
            if a.kind == "recv_fwd":
                reader = next(j for j, b in enumerate(acts) if b.kind == "forward" and (b.micro, b.chunk) == (a.micro, a.chunk))
                assert position[k] < position[reader]
            if a.kind in COMM:
                pair = (s, a.peer) if a.kind.startswith("send") else (a.peer, s)
                (sends if a.kind.startswith("send") else recvs).setdefault(pair, []).append(
                    (position[k], flat.index(k), _message(s, a, pp)))
    for pair in set(sends) | set(recvs):
        assert [m for *_, m in sorted(sends.get(pair, []))] == [m for *_, m in sorted(recvs.get(pair, []))], pair


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("pp,micro", [(2, 1), (2, 4), (3, 5), (4, 8)])
def test_every_schedule_has_slots_that_meet_in_order(name, pp, micro):
    acts = schedule(name, pp, micro)
    slots = simulate(acts).slots
    assert slots == p2p_slots(acts)
    _check_independently(acts, slots)


@pytest.mark.parametrize("pp,micro,chunks", [(2, 4, 2), (3, 6, 2), (4, 8, 3)])
def test_interleaved_posts_a_receive_early_where_slots_in_list_order_would_deadlock(pp, micro, chunks):
    # interleaved 1F1B with every rank's runs of sends and receives as they come in its list:
    # a rank sends a gradient to a neighbour that is itself blocked sending, its receive for
    # that gradient a slot later (the checker found it); the receive is posted a slot earlier
    acts = interleaved(pp, micro, chunks)
    slots = p2p_slots(acts)
    _check_independently(acts, slots)
    runs = []
    for lst in acts:
        out, run = [], []
        for k, a in enumerate(lst):
            if a.kind in COMM:
                run.append(k)
            elif run:
                out.append(tuple(run))
                run = []
        runs.append(out)
    assert [[e for e in out if isinstance(e, tuple)] for out in slots] != runs


def test_1f1b_pairs_the_send_and_the_receive_of_the_steady_state_in_one_slot():
    # Megatron's send_forward_recv_backward on stage 0, send_backward_recv_forward on stage 1
    acts = schedule("1f1b", 2, 4)
    slots = p2p_slots(acts)
    named = [[tuple(str(acts[s][k]) for k in e) for e in out if isinstance(e, tuple)] for s, out in enumerate(slots)]
    assert ("send_fwd m=1 -> 1", "recv_bwd m=0 <- 1") in named[0]
    assert ("send_bwd m=0 -> 0", "recv_fwd m=1 <- 0") in named[1]


def test_receives_listed_in_another_order_than_the_sends_are_posted_in_the_senders_order():
    # rank 0's activations leave in order m=0, m=1; rank 1's list asks for m=1 first. On NCCL
    # (no tags) its first receive would get m=0's tensor, and its slot [recv m=1] would wait
    # forever for a send that comes after rank 0's blocked [send m=0]: the receive of m=0 is
    # posted with it, and the two in rank 0's order
    acts = ((Action("forward", 0), Action("send_fwd", 0, 1), Action("forward", 1), Action("send_fwd", 1, 1),
             Action("recv_bwd", 0, 1), Action("backward", 0), Action("recv_bwd", 1, 1), Action("backward", 1),
             Action("optimizer")),
            (Action("recv_fwd", 1, 0), Action("forward", 1), Action("recv_fwd", 0, 0), Action("forward", 0),
             Action("backward", 0), Action("send_bwd", 0, 0), Action("backward", 1), Action("send_bwd", 1, 0),
             Action("optimizer")))
    simulate(acts)  # runs with buffered sends and tags (gloo)
    slots = p2p_slots(acts)
    _check_independently(acts, slots)
    assert slots[1][0] == (2, 0)  # recv_fwd m=0, then recv_fwd m=1, in one slot


def test_a_send_nobody_receives_is_refused():
    acts = ((Action("forward", 0), Action("send_fwd", 0, 1), Action("send_fwd", 0, 1), Action("recv_bwd", 0, 1),
             Action("backward", 0), Action("optimizer")),
            (Action("recv_fwd", 0, 0), Action("forward", 0), Action("backward", 0), Action("send_bwd", 0, 0),
             Action("optimizer")))
    with pytest.raises(ScheduleError, match="rank 0 step 2: send_fwd m=0 -> 1 has no partner"):
        p2p_slots(acts)
