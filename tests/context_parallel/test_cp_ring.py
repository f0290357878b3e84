"""Ring attention (`context-parallel lowering=ring`): K/V blocks around the cp ring with an
online-softmax merge, the causal mask from global positions (fully masked blocks skipped), a
backward that uses each step's own K/V block and returns dK/dV to their owners; equal to
unsharded forward and backward on the interpreter and under torchrun (2 gloo ranks)."""
import json
import pathlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import SpecError
from parcomp.ir import parse_graph
from parcomp.reference import cp_ring
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded
from parcomp_backends.torch.emit import RUNTIME_MARK

from graphs import random_feeds, spec
from numerics import assert_all_equivalent, assert_equivalent
from test_context_parallel import EXACT, _attn

ROOT = pathlib.Path(__file__).resolve().parents[1].parent
MODEL = f"{ROOT / 'specs' / 'models.py'}:causal_attention"
CANONICAL = ROOT / "specs" / "attention_cp2_ring_train.pcs"
BALANCED = ROOT / "specs" / "attention_cp2_ring_balanced_train.pcs"
TRAIN = "train loss=mse optimizer=sgd(lr=0.1)\n"


def _ring_spec(cp=2, dp=False, train=TRAIN, lowering="ring", chunking="contiguous"):
    mesh, io = ((f"dp=2 cp={cp}", "input x [S(0), S(2)]\noutput output [S(0), S(2)]\n") if dp else
                (f"cp={cp}", "input x split-seq\noutput output split-seq\n"))
    return spec(f"mesh {mesh}\ncontext-parallel lowering={lowering} chunking={chunking}\n{io}{train}")


def test_statement_takes_the_ring_lowering_and_marks_the_axis():
    assert spec("mesh dp=2 cp=2\ncontext-parallel lowering=ring\n").context_parallel.lowering == "ring"
    c = compile_graph(parse_graph(_attn(8)), _ring_spec(2))
    rings = [n for n in c.program.nodes if cp_ring.is_ring(n)]
    assert [n.op for n in rings] == ["sdpa", "sdpa_grad", "sdpa_grad", "sdpa_grad"]
    assert {n.attr("cp_axis") for n in rings} == {"cp"}
    # no collective of the search moves q, k or v: every attention operand stays S(seq)
    assert all(str(c.program[i].layout[0]) == "S(2)" for n in rings for i in n.inputs)


def test_chunking_option_and_its_located_errors():
    assert spec("mesh cp=2\ncontext-parallel\n").context_parallel.chunking == "contiguous"
    assert spec("mesh cp=2\ncontext-parallel lowering=ring chunking=balanced\n").context_parallel.chunking == "balanced"
    with pytest.raises(SpecError, match="'zigzag' is not a chunking") as e:
        spec("mesh cp=2\ncontext-parallel chunking=zigzag\n")
    assert (e.value.loc.line, e.value.loc.col) == (2, 18)
    bal = "context-parallel lowering=ring chunking=balanced\ninput * split-seq\n"
    with pytest.raises(SpecError, match="a sequence of 6 does not cut into 4 equal chunks") as e:
        compile_graph(parse_graph(_attn(6)), spec("mesh cp=2\n" + bal))
    assert e.value.loc.line == 2
    # an input as long as the sequence but not split would be fed in natural order
    with pytest.raises(SpecError, match="input x .* not split over cp") as e:
        compile_graph(parse_graph(_attn(8)), spec("mesh cp=2\ncontext-parallel chunking=balanced\n"))
    assert e.value.loc.line == 2


# ---- exact small case: a rank's queries need another rank's keys ----------------------------

@pytest.mark.parametrize("cp", [2, 4])
def test_ring_rows_see_other_ranks_keys_exactly(cp):
    """q = 0: each query averages the values of the keys it sees (exact in float32). With cp=2,
    rows 2, 3 (rank 1) average v[0..2] and v[0..3], v[0], v[1] arriving from rank 0 on the ring:
    2.0 and 2.5 (only its own block would give 3.0 and 3.5). With cp=4 every rank holds one row
    and rank 0 skips the three blocks after it."""
    c = compile_graph(parse_graph(EXACT), spec(f"mesh cp={cp}\ncontext-parallel lowering=ring\n"
                                               "input * split-seq\noutput output split-seq\n"))
    feeds = {"q": np.zeros((1, 1, 4, 1), np.float32), "k": np.zeros((1, 1, 4, 1), np.float32),
             "v": np.arange(1, 5, dtype=np.float32).reshape(1, 1, 4, 1)}
    run = run_spmd(c.program, feeds)
    want = np.array([1.0, 1.5, 2.0, 2.5], np.float32)
    np.testing.assert_array_equal(run.outputs(c.program)["output"].reshape(-1), want)
    per = 4 // cp
    np.testing.assert_array_equal(run.env[cp - 1][c.program.outputs[0]].reshape(-1), want[-per:])
    recs = c.report["collectives"]
    assert [(r["kind"], r["axis"]) for r in recs] == [("send_recv", "cp")]  # K/V around the ring only
    assert recs[0]["bytes"] == (cp - 1) * 2 * 4 * per  # cp - 1 shifts of one K and one V block


@pytest.mark.parametrize("lowering", ["ring", "all_gather"])
def test_balanced_rank_zero_rows_need_rank_one_keys_exactly(lowering):
    """Balanced chunks of 1 row on cp=2: rank 0 holds positions 0 and 3, rank 1 positions 1 and 2.
    q = 0, so position 3's output is the mean of v[0..3] = 2.5, two of those keys (1, 2) being
    rank 1's; the assembled output is back in natural order."""
    c = compile_graph(parse_graph(EXACT), spec(f"mesh cp=2\ncontext-parallel lowering={lowering} "
                                               "chunking=balanced\ninput * split-seq\noutput output split-seq\n"))
    feeds = {"q": np.zeros((1, 1, 4, 1), np.float32), "k": np.zeros((1, 1, 4, 1), np.float32),
             "v": np.arange(1, 5, dtype=np.float32).reshape(1, 1, 4, 1)}
    run = run_spmd(c.program, feeds)
    np.testing.assert_array_equal(run.outputs(c.program)["output"].reshape(-1), [1.0, 1.5, 2.0, 2.5])
    np.testing.assert_array_equal(run.env[0][c.program.outputs[0]].reshape(-1), [1.0, 2.5])
    np.testing.assert_array_equal(run.env[1][c.program.outputs[0]].reshape(-1), [1.5, 2.0])


def test_program_outputs_of_balanced_chunks_assemble_in_natural_order(tmp_path):
    """What each rank of program.py writes (its storage-order slice) is put back in natural order
    by ``parcomp run``'s assembly, as by the interpreter's."""
    import torch
    from parcomp.ir.types import layout_str
    from parcomp_backends.torch.launch import assemble_outputs, rank_path

    c = compile_graph(parse_graph(EXACT), spec("mesh cp=2\ncontext-parallel lowering=ring chunking=balanced\n"
                                               "input * split-seq\noutput output split-seq\n"))
    feeds = {"q": np.zeros((1, 1, 4, 1), np.float32), "k": np.zeros((1, 1, 4, 1), np.float32),
             "v": np.arange(1, 5, dtype=np.float32).reshape(1, 1, 4, 1)}
    run, value = run_spmd(c.program, feeds), c.program.outputs[0]
    path = tmp_path / "out.pt"
    for r in range(2):
        torch.save({"rank": r, "layouts": {"output": layout_str(c.program[value].layout)},
                    "global_shapes": {"output": [1, 1, 4, 1]},
                    "outputs": {"output": torch.from_numpy(run.env[r][value])}}, rank_path(path, r))
    np.testing.assert_array_equal(assemble_outputs(path, c.program)["output"].reshape(-1), [1.0, 1.5, 2.0, 2.5])


def test_contiguous_causal_skips_later_blocks_and_balanced_evens_the_work():
    """Work per rank (query-key pairs computed) for seq 16 on cp=4: contiguous chunks give rank c
    c + 1 blocks (the others are fully masked and skipped); balanced chunks (c and 7 - c) give every
    rank the same number of visible pairs."""
    n, rows = 4, 4

    def visible(chunking, c):
        pos = [cp_ring.positions(chunking, n, j, rows) for j in range(n)]
        return [int((pos[j][None, :] <= pos[c][:, None]).sum()) for j in range(n)]

    assert [sum(1 for v in visible("contiguous", c) if v) for c in range(n)] == [1, 2, 3, 4]
    assert len({sum(visible("balanced", c)) for c in range(n)}) == 1
    assert [list(cp_ring.positions("balanced", 2, c, 4)) for c in range(2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]


# ---- the kernel: every chunking and sequence length, forward and the three gradients -----------

def _full_graph(op, shape, causal):
    t = f"{shape[0]},{shape[1]},{shape[2]},{shape[3]}"
    head = "".join(f"%{w}: f32[{t}] = input()\n" for w in ("dy", "q", "k", "v"))
    attrs = f"causal={'true' if causal else 'false'}, scale=0.5"
    if op == "sdpa":
        return parse_graph(head + f"%o: f32[{t}] = sdpa(%q, %k, %v) {{{attrs}}}\nreturn %o as o\n")
    body = "".join(f"%d{w}: f32[{t}] = sdpa_grad(%dy, %q, %k, %v) {{wrt=\"{w}\", {attrs}}}\n" for w in "qkv")
    return parse_graph(head + body + "return %dq as dq, %dk as dk, %dv as dv\n")


@settings(max_examples=20, deadline=None)
@given(cp=st.sampled_from([2, 4]), half=st.integers(1, 3), chunking=st.sampled_from(["contiguous", "balanced"]),
       causal=st.booleans(), seed=st.integers(0, 10_000))
def test_ring_kernel_equals_unsharded_attention(cp, half, chunking, causal, seed):
    """The ring (all ranks simulated) against numpy attention on the whole sequence, taken in the
    ranks' storage order (balanced: chunks c and 2cp-1-c): output and dq, dk, dv."""
    rows = 2 * half
    shape = (1, 2, cp * rows, 3)
    rng = np.random.default_rng(seed)
    feeds = {w: rng.standard_normal(shape).astype(np.float32) for w in ("dy", "q", "k", "v")}
    order = np.concatenate([cp_ring.positions(chunking, cp, c, rows) for c in range(cp)])
    blocks = {w: np.split(x[:, :, order], cp, axis=2) for w, x in feeds.items()}
    for op in ("sdpa", "sdpa_grad"):
        g = _full_graph(op, shape, causal)
        want = run_unsharded(g, feeds)
        for name, node in ((o, g[v]) for o, v in g.named_outputs()):
            node = node.with_attrs(cp="ring")
            got = cp_ring.ring_group_values(node, blocks["q"], blocks["k"], blocks["v"],
                                            blocks["dy"] if op == "sdpa_grad" else None, chunking)
            back = np.empty(shape, np.float32)
            back[:, :, order] = np.concatenate(got, axis=2)
            assert_equivalent(back, want[name], what=f"{name} ({chunking}, cp={cp})")


# ---- compiled programs equal to unsharded, forward and backward ------------------------------

@settings(max_examples=12, deadline=None)
@given(cp=st.sampled_from([2, 4]), blocks=st.integers(1, 3), batch=st.integers(1, 2),
       dp=st.booleans(), chunking=st.sampled_from(["contiguous", "balanced"]), seed=st.integers(0, 10_000))
def test_ring_training_equals_unsharded(cp, blocks, batch, dp, chunking, seed):
    """Sequence cp x blocks (balanced: 2 cp x blocks, two chunks per rank), with and without dp
    splitting the batch: loss, every gradient (x.grad back in natural order) and every updated
    weight; the only cp traffic of attention is the ring's send_recv."""
    seq = cp * blocks * (2 if chunking == "balanced" else 1)
    # in float64, as `check` decides: the ring's other summation order is then within 1e-9 of the
    # scale (in float32 a gradient with cancellation once missed 1e-3 by 1.4x at seed 852)
    f64 = _attn(seq, 2 if dp else batch).replace("f32[", "f64[")
    c = compile_graph(parse_graph(f64), _ring_spec(cp, dp, chunking=chunking))
    kinds = {(r["kind"], r["phase"]) for r in c.report["collectives"] if r["axis"] == "cp"}
    assert {("send_recv", "forward"), ("send_recv", "backward")} <= kinds
    assert ("reduce_scatter", "backward") not in kinds
    feeds = random_feeds(c.logical, seed)
    run = run_spmd(c.program, feeds)
    assert_all_equivalent(run.outputs(c.program), run_unsharded(c.logical, feeds))
    # the shifts the simulation did are the ones the report lists (forward cp-1; per gradient
    # 2 (cp-1) of K/V, and cp of dK or dV home)
    ran = {r["name"]: sum(r["shifts"].values()) for r in run.p2p}
    assert ran == {n.name: sum(k for _, k, _ in cp_ring.ring_steps(n, cp))
                   for n in c.program.nodes if cp_ring.is_ring(n)}
    assert sorted(ran.values()) == sorted([cp - 1, 2 * (cp - 1), 3 * cp - 2, 3 * cp - 2])


@settings(max_examples=8, deadline=None)
@given(cp=st.sampled_from([2, 4]), blocks=st.integers(1, 2), dp=st.booleans(), seed=st.integers(0, 10_000))
def test_all_gather_with_balanced_chunking_trains_like_unsharded(cp, blocks, dp, seed):
    """The all_gather lowering on balanced chunks: K/V gathered in storage order, each rank's mask
    by the global positions of its rows and of every gathered key."""
    c = compile_graph(parse_graph(_attn(2 * cp * blocks, 2).replace("f32[", "f64[")),
                      _ring_spec(cp, dp, lowering="all_gather", chunking="balanced"))
    assert ("all_gather", "forward") in {(r["kind"], r["phase"]) for r in c.report["collectives"]}
    feeds = random_feeds(c.logical, seed)
    run = run_spmd(c.program, feeds)
    assert_all_equivalent(run.outputs(c.program), run_unsharded(c.logical, feeds))


POSITIONS = """\
%x: f32[1,1,8,4] = input()
%wq: f32[4,4] = param()
%q: f32[1,1,8,4] = matmul(%x, %wq)
%pos: f32[8] = arange()
%c: f32[8] = cos(%pos)
%cr: f32[1,1,8] = reshape(%c)
%ce: f32[1,1,8,4] = expand(%cr) {dims=(3,)}
%qr: f32[1,1,8,4] = mul(%q, %ce)
%o: f32[1,1,8,4] = sdpa(%qr, %x, %x) {causal=true, scale=0.5}
return %o as output
"""


@pytest.mark.parametrize("lowering", ["ring", "all_gather"])
def test_balanced_positions_from_arange_are_global(tmp_path, lowering):
    """A position table computed in the program (``arange`` -> cos, as RoPE computes its angles):
    under balanced chunking the arange yields storage-order positions, so each rank's rows get
    the angles of their global positions (natural-order positions fail this)."""
    s = _ring_spec(2, lowering=lowering, chunking="balanced")
    c = compile_graph(parse_graph(POSITIONS), s)
    assert [dict(n.attrs).get("balanced") for n in c.program.nodes if n.op == "arange"] == [2]
    feeds = random_feeds(c.logical, 1)
    run = run_spmd(c.program, feeds)
    assert_all_equivalent(run.outputs(c.program), run_unsharded(c.logical, feeds))
    from parcomp_backends.torch.emit import emit_program

    assert "balance_rows(torch.arange((8,)[0]" in emit_program(c, "cpu")


def _check(tmp_path, capsys, spec_text):
    path = tmp_path / "s.pcs"
    path.write_text(spec_text)
    rc = main(["check", MODEL, "--spec", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("cp,lowering,chunking", [(2, "ring", "contiguous"), (4, "ring", "contiguous"),
                                                  (2, "ring", "balanced"), (4, "ring", "balanced"),
                                                  (2, "all_gather", "balanced"), (4, "all_gather", "balanced")])
def test_llama_attention_cp_equals_unsharded_forward_and_backward(tmp_path, capsys, cp, lowering, chunking):
    """transformers' LlamaAttention (RoPE tables from global positions, GQA): the ring over cp, and
    balanced chunking (the folded RoPE tables fed in storage order) with either lowering."""
    fwd = (f"mesh cp={cp}\ncontext-parallel lowering={lowering} chunking={chunking}\n"
           "input x split-seq\noutput output split-seq\n")
    rc, out = _check(tmp_path, capsys, fwd)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    if lowering == "ring":
        assert [c["kind"] for c in out["collectives"]] == ["send_recv"]  # no all_gather of K/V
    rc, out = _check(tmp_path, capsys, fwd + TRAIN)
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1 and out["max_grad_err"] is not None, out


def test_canonical_ring_spec_lists_every_ring_pass_with_its_reason(tmp_path, capsys):
    """specs/attention_cp2_ring_train.pcs: forward one pass (cp-1 shifts of K and V); the three
    sdpa_grads one backward ring on the statistics the forward kept (no statistics pass): K/V
    once, dK/dV home once, both on the first sdpa_grad."""
    rc = main(["check", MODEL, "--spec", str(CANONICAL), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out
    ring = [c for c in out["collectives"] if c["kind"] == "send_recv"]
    assert [c["phase"] for c in ring] == ["forward"] + ["backward"] * 2
    kv = 2 * 4 * 8 * 8 * 4  # one block of K (or V): batch 2, 4 heads, 8 rows, dim 8, f32
    assert [c["bytes"] for c in ring] == [2 * kv, 2 * kv, 2 * kv]
    assert all(c["reason"].startswith("ring attention") for c in ring)
    assert "(sdpa)" in ring[0]["reason"] and all("(sdpa_grad " in c["reason"] for c in ring[1:])
    assert len({c["reason"].split("; ")[1].split(" (")[0] for c in ring[1:]}) == 1  # one backward ring, one node
    assert not any("softmax statistics" in c["reason"] for c in ring)  # kept by the forward ring
    assert sum("returns to the block's owner" in c["reason"] for c in ring) == 1  # dK and dV together


def test_program_calls_the_ring_and_comments_each_pass(tmp_path):
    out = tmp_path / "out"
    assert main(["compile", MODEL, "--spec", str(CANONICAL), "-o", str(out)]) == 0
    text = (out / "program.py").read_text()
    # one backward ring, on the statistics the forward ring kept
    assert text.count("= ring_sdpa_saved(") == 1 and text.count("= ring_sdpa_grads(") == 1 and "saved=" in text
    step = text.split("def train_step")[1].split(RUNTIME_MARK)[0]  # the step, not the runtime after it
    assert "ring_sdpa_grad(" not in step
    assert "scaled_dot_product_attention(" not in step
    assert "def ring_shift(" in text and "batch_isend_irecv" in text
    assert 'COMM_AXES = ("cp",)' in text
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if "= ring_sdpa" in line:  # the comment above names each pass: axis, bytes, why
            above = "\n".join(lines[i - 12:i])
            assert "send_recv over cp" in above and "bytes/rank" in above, above


def test_balanced_program_loads_in_storage_order_and_masks_by_position(tmp_path):
    out = tmp_path / "out"
    assert main(["compile", MODEL, "--spec", str(BALANCED), "-o", str(out)]) == 0
    text = (out / "program.py").read_text()
    assert 'balance_rows(take(feeds, "x", (2, 16, 32), torch.float32), (1,), 2).narrow(1, COORD[0] * 8, 8)' in text
    assert 'balance_rows(whole(take_constant(ckpt, "rope.cos", (1, 1, 16, 8), torch.float32)), (2,), 2)' in text
    assert text.count('"cp", "balanced"') == 2  # ring_sdpa and the one backward ring of its three gradients
    ag = tmp_path / "ag.pcs"
    ag.write_text(BALANCED.read_text().replace("lowering=ring", "lowering=all_gather"))
    assert main(["compile", MODEL, "--spec", str(ag), "-o", str(tmp_path / "ag")]) == 0
    ag_text = (tmp_path / "ag" / "program.py").read_text()
    assert ag_text.count("attn_mask=balanced_keep(8, 16, COORD[0] * 8, 2)") == 2  # sdpa; one call for its 3 grads


@pytest.mark.slow
@pytest.mark.parametrize("path", [CANONICAL, BALANCED], ids=["contiguous", "balanced"])
def test_ring_specs_run_on_two_gloo_ranks_like_unsharded(capsys, path):
    rc = main(["run", MODEL, "--spec", str(path), "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"] and out["err_over_tol"] <= 1, out


@pytest.mark.parametrize("lowering", ["ring", "all_gather"])
def test_balanced_chunking_with_a_replicated_output_is_a_located_error(lowering):
    """Balanced chunks hold the sequence in storage order: an output gathered to replicated would
    be assembled out of order (wrong numbers), so it is refused."""
    from parcomp.frontends.loader import load_model
    graph = load_model(str(pathlib.Path(__file__).parents[1].parent / "specs" / "models.py") + ":causal_attention")[0]
    text = (f"mesh cp=2\ncontext-parallel lowering={lowering} chunking=balanced\n"
            "input x split-seq\noutput output replicated\n")
    with pytest.raises(SpecError, match="output output .* not split over cp") as e:
        compile_graph(graph, spec(text))
    assert ":2:" in str(e.value)


# ---- the records are what the program sends ---------------------------------------------------

class _Ring:
    """In-process point-to-point for the runtime's ``ring`` section, one namespace per rank
    (its ``dist``): ``isend`` puts a copy in the (src, dst) mailbox, ``irecv``'s wait takes the
    next one; every ``batch_isend_irecv`` with a send is one message, its sends' bytes counted."""

    isend, irecv = "isend", "irecv"

    def __init__(self, rank, boxes, sent):
        self.rank, self.boxes, self.sent = rank, boxes, sent

    class P2POp:
        def __init__(self, op, tensor, peer, group=None):
            self.op, self.tensor, self.peer = op, tensor, peer

    class _Work:
        def __init__(self, fn):
            self.wait = fn

    def batch_isend_irecv(self, ops):
        sends = [o for o in ops if o.op == "isend"]
        for o in sends:
            self.boxes[(self.rank, o.peer)].put(o.tensor.clone())
        if sends:
            self.sent.append(sum(o.tensor.numel() * o.tensor.element_size() for o in sends))
        return [self._Work(lambda o=o: o.tensor.copy_(self.boxes[(o.peer, self.rank)].get(timeout=60)))
                for o in ops if o.op == "irecv"]


def _run_ring_program(n, shape, seed=0):
    """Per rank ``(forward messages' bytes, backward messages' bytes)`` of program.py's ring
    attention on ``n`` ranks (threads): ``ring_sdpa_saved`` then one ``ring_sdpa_grads`` of q, k
    and v on what it kept, as the emitted step calls them."""
    import queue
    import threading

    import torch
    from parcomp_backends.torch.runtime import sections

    code = sections("program_ring")["ring"]
    boxes = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
    gen = torch.Generator().manual_seed(seed)
    data = [[torch.randn(shape, generator=gen) for _ in range(4)] for _ in range(n)]
    logs = [([], []) for _ in range(n)]
    errors = []

    def rank_main(r):
        try:
            ns = {"torch": torch, "GROUPS": {"cp": None}, "GROUP_RANKS": {"cp": [list(range(n))]}, "RANK": r,
                  "DEVICE": torch.device("cpu"), "dist": _Ring(r, boxes, logs[r][0])}
            exec(code, ns)
            q, k, v, dy = data[r]
            _, saved = ns["ring_sdpa_saved"](q, k, v, 0.5, True, "cp", "contiguous")
            ns["dist"].sent = logs[r][1]
            ns["ring_sdpa_grads"](dy, q, k, v, 0.5, True, "cp", "contiguous", "qkv", saved=saved)
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return logs


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_records_are_the_bytes_and_shifts_the_program_sends(tmp_path, cp):
    """The report's send_recv records of a ring attention trained on cp ranks against what the
    emitted program's ring helpers send, counted in-process: the forward's cp-1 K/V shifts; the
    backward's one ring on the forward's kept statistics: cp-1 K/V shifts and cp-1 of the partial
    dK/dV, in 2 messages at cp=2 and cp+1 beyond (the bytes each rank sends, to the byte)."""
    from parcomp_backends.torch.emit import emit_program
    c = compile_graph(parse_graph(_attn(2 * cp, 2)), _ring_spec(cp))
    step = emit_program(c, "cpu").split("def train_step")[1].split(RUNTIME_MARK)[0]
    assert step.count("ring_sdpa_saved(") == 1 and step.count("ring_sdpa_grads(") == 1 and "saved=" in step
    recs = [r for r in c.report["collectives"] if r["kind"] == "send_recv"]
    shape = tuple(recs[0]["local_shape"])
    assert recs[0]["dtype"] == "float32"
    logs = _run_ring_program(cp, shape)
    block = 4 * int(np.prod(shape))  # one K (or V, dK, dV) block
    for phase, i in (("forward", 0), ("backward", 1)):
        got = {sum(log[i]) for log in logs}
        assert got == {sum(r["bytes"] for r in recs if r["phase"] == phase)}, (phase, got)
    assert {len(log[0]) for log in logs} == {cp - 1}
    assert {len(log[1]) for log in logs} == {2 if cp == 2 else cp + 1}
    back = [r for r in recs if r["phase"] == "backward"]
    assert [r["bytes"] for r in back] == [2 * (cp - 1) * block] * 2  # K/V, then dK/dV
    assert [f"of {w} to" in r["reason"] for r, w in zip(back, ("k,v", "dk,dv"))] == [True, True]
