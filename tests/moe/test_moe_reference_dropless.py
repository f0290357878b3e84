"""The numpy reference runs MoE dropless (parcomp/reference/moe_packed.py): the values between a
dispatch and its combine are the routed rows only, each expert multiplies exactly its rows, and
the results equal the dense slot buffer's (the same reference with ``moe_packed.DENSE``)."""
from __future__ import annotations

import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.ir import parse_graph
from parcomp.reference import moe_packed
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.moe_ops import slots
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.spec import parse_spec

from moe_cases import MoeCase, model_text, spec_text

EXPERT_MATMULS = 9  # gate, up, down forward; dx and the weight gradient of each backward


def _f64(case, expert_op="silu"):
    return model_text(case).replace("f32[", "f64[").replace("= silu(%g)", f"= {expert_op}(%g)")


def _int_feeds(graph, seed, router="random"):
    """Small integers (float64): products and sums stay exact. ``router``: ``"ties"`` gives every
    logit 0 (top-k by the lower expert index: experts 0..k-1 take every token, the others none);
    ``"skew"`` makes expert 0 the first choice of every token and the last expert no one's."""
    rng = np.random.default_rng(seed)
    out = {n.name: rng.integers(-2, 3, n.type.shape).astype(n.type.dtype)
           for n in graph.nodes if n.op in ("input", "param")}
    if router == "ties":
        out["gate.weight"][:] = 0
    elif router == "skew":
        out["x"][..., 0] = 3
        out["gate.weight"][:, 0] = 0
        out["gate.weight"][0, 0], out["gate.weight"][-1, 0] = 9, -9
    return out


def _both(fn):
    """(packed, dense) results of ``fn()``."""
    packed = fn()
    with moe_packed.DENSE:
        dense = fn()
    return packed, dense


def _compiled(case, expert_op="silu", train=True):
    return compile_graph(parse_graph(_f64(case, expert_op)), parse_spec(spec_text(case, train), "case.pcs"))


def _assert_same(got, want, exact):
    assert set(got) == set(want)
    for k in want:
        if exact:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)
        else:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-13, atol=1e-13, err_msg=k)


ROUTERS = ["ties", "skew", "random"]


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("expert_op", ["relu", "silu", "exp"])
def test_unsharded_step_equals_the_dense_buffers(router, expert_op):
    """One training step of the unsharded graph (loss, every gradient, every update), packed and
    dense: to the bit where every value is dyadic (small integers, relu, tied routing weights of
    1/2, a loss mean over 64 elements), within float64 rounding otherwise (the combine adds a
    token's k rows in another order). ``exp`` is not 0 at 0: the dense buffer's empty slots hold
    1 after it, which nothing reads (the gradients there are 0)."""
    case = MoeCase(experts=4, top_k=2, batch=2, seq=8, hidden=4, inter=5, capacity=0, ep=2)
    c = _compiled(case, expert_op)
    feeds = _int_feeds(c.logical, 3, router)
    packed, dense = _both(lambda: run_unsharded(c.logical, feeds))
    _assert_same(packed, dense, exact=expert_op == "relu" and router == "ties")


@pytest.mark.parametrize("router", ROUTERS)
@pytest.mark.parametrize("capacity", [0, 3])
def test_expert_parallel_step_equals_the_dense_buffers_and_multiplies_only_routed_rows(router, capacity):
    """ep=2 training step, every rank simulated: the same outputs as the dense buffers (to the
    bit on tied routing, within float64 rounding otherwise), no value between dispatch and combine held as the [B, E, C, H] buffer or its [E, B*C, H]
    reshape, and each rank's experts multiply exactly the (token, expert) pairs routed to them,
    9 times (forward and backward), where the dense buffers multiply every slot (E/k = 2 times
    the routed rows without a capacity)."""
    case = MoeCase(experts=4, top_k=2, batch=4, seq=8, hidden=4, inter=5, capacity=capacity, ep=2)
    c = _compiled(case, "relu")
    feeds = _int_feeds(c.logical, 5, router)
    packed, dense = _both(lambda: run_spmd(c.program, feeds))
    assert packed.moe_dense == "" and dense.moe == [{}, {}]
    _assert_same(packed.outputs(c.program), dense.outputs(c.program), exact=router == "ties")
    slot_shaped = [n.name for n in c.program.nodes  # the dense slot values: [B, E, C, H], [E, B*C, H]
                   if (n.type.rank == 4 and n.type.shape[2] == case.slots)
                   or (n.type.rank == 3 and n.type.shape[1] == case.batch * case.slots)]
    assert len(slot_shaped) >= 10
    for r in range(2):
        assert all(isinstance(dense.env[r][v], np.ndarray) for v in slot_shaped)
        assert all(isinstance(packed.env[r][v], moe_packed.SlotRows) for v in slot_shaped)
    # the routed pairs that have a slot, per rank's experts (rank 0: experts 0, 1; rank 1: 2, 3)
    env = {}
    run_unsharded(c.logical, feeds, env=env)
    _, _, e, _ = slots(np.asarray(env["c"]), case.slots)
    per_rank = [int(np.sum(e // 2 == r)) for r in range(2)]
    assert [m["expert_rows"] for m in packed.moe] == [EXPERT_MATMULS * k for k in per_rank]
    dense_rows = EXPERT_MATMULS * case.experts * case.batch * case.slots  # every slot, all ranks
    if capacity == 0:  # nothing dropped: every token's k pairs, 1/(E/k) of the slots
        assert sum(per_rank) == case.batch * case.seq * case.top_k
        assert 2 * sum(m["expert_rows"] for m in packed.moe) == dense_rows
    assert all(p <= d for p, d in zip(packed.peak_bytes, dense.peak_bytes))
    if capacity == 0 and router != "ties":  # (on ties rank 0's experts take every token: all its slots)
        assert sum(packed.peak_bytes) < sum(dense.peak_bytes)
    if router == "ties":  # experts 0 and 1 (rank 0) take every token (within capacity), rank 1's none
        assert per_rank[1] == 0 and packed.moe[1]["expert_rows"] == 0


def test_sent_bytes_of_the_ragged_exchange_are_the_dense_form_s():
    """The interpreter's log of the ragged all_to_all (routed rows and a mask byte per slot row)
    is the same packed as dense."""
    case = MoeCase(experts=4, top_k=1, batch=2, seq=4, hidden=4, inter=4, capacity=0, ep=2)
    c = _compiled(case, "silu", train=False)
    feeds = _int_feeds(c.logical, 1, "skew")
    packed, dense = _both(lambda: run_spmd(c.program, feeds))
    sent = lambda run: [e["sent_bytes"] for e in run.log if "sent_bytes" in e]  # noqa: E731
    assert sent(packed) == sent(dense) and sent(packed)


def test_a_statement_the_packed_form_does_not_cover_runs_dense():
    """A sum over the slots read as an output: the reference says why and runs the dense buffers."""
    case = MoeCase(experts=4, top_k=2, batch=2, seq=4, hidden=4, inter=4, capacity=0, ep=1)
    text = _f64(case).replace("return %output\n", "%total: f64[4,4] = sum(%y) {dims=(1,)}\n"
                                                   "return %output, %total as total\n")
    graph = parse_graph(text)
    feeds = _int_feeds(graph, 2)
    packed, dense = _both(lambda: run_unsharded(graph, feeds))
    _assert_same(packed, dense, exact=False)
    c = compile_graph(graph, parse_spec("mesh ep=1\n", "one.pcs"))
    run = run_spmd(c.program, feeds)
    assert run.moe_dense == "%total: sum of slots" and run.moe == [{}]
    _assert_same(run.outputs(c.program), dense, exact=False)
