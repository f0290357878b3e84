"""Attention's backward in program.py: the gradients of one attention (dq, dk, dv: three
``sdpa_grad`` nodes in the IR) from the fused kernel's backward on the output and logsumexp
its forward kept (or, without such a kernel, one forward and one backward of
``scaled_dot_product_attention``), and ring attention's three gradients from one backward ring.
Counted (kernel calls, sdpa calls, ring shifts) and compared with torch's autograd."""
from __future__ import annotations

import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.cli import commands  # noqa: E402
from parcomp_backends.torch.emit import RUNTIME_MARK, emit_program  # noqa: E402
from parcomp_backends.torch.launch import free_port  # noqa: E402
from parcomp_backends.torch.runtime import program_attention, program_ring  # noqa: E402

MODEL = "specs/models.py:causal_attention"  # transformers' LlamaAttention, RoPE, GQA 4/2 heads


def _import(path):
    spec = importlib.util.spec_from_file_location("parcomp_attention_program", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _CountSdpa:
    """Counts the calls of torch's scaled_dot_product_attention (looked up when called)."""

    def __enter__(self):
        self.real, self.calls = torch.nn.functional.scaled_dot_product_attention, 0

        def counting(*args, **kw):
            self.calls += 1
            return self.real(*args, **kw)

        torch.nn.functional.scaled_dot_product_attention = counting
        return self

    def __exit__(self, *exc):
        torch.nn.functional.scaled_dot_product_attention = self.real


class _CountKernels(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten attention kernels run (forward and backward), whoever calls them
    (sdpa itself dispatches to them)."""

    def __enter__(self):
        self.calls = {}
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if "dot_product" in name:
            self.calls[name] = self.calls.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


FLASH_CPU = "_scaled_dot_product_flash_attention_for_cpu"


def test_training_step_runs_the_attention_forward_once_and_its_gradients_equal_torch(tmp_path):
    """A world-size-1 program.py of LlamaAttention (GQA: kv heads repeated) trained one SGD
    step: the forward keeps the kernel's output and logsumexp, the backward is the kernel's
    own backward on them (one forward kernel call in the step, one backward; a torch.func.vjp
    over sdpa ran the forward twice), and every weight gradient equals torch's autograd."""
    spec = tmp_path / "t.pcs"
    spec.write_text("mesh tp=1\ntrain loss=mse optimizer=sgd(lr=0.1) input_grads=no\n")
    c, module, example = commands.compile_model(SimpleNamespace(model=MODEL, spec=str(spec)), numeric="check")
    text = emit_program(c, "cpu")
    step = text.split("def train_step")[1].split(RUNTIME_MARK)[0]  # the step, not the runtime after it
    assert step.count("= attention_forward(") == 1 and step.count("= attention_backward(") == 1
    assert "attention_grads(" not in step and "torch.func.vjp" not in step
    assert "torch.nn.functional.scaled_dot_product_attention(" not in step
    assert "del attn_sdpa_saved" in step
    (tmp_path / "program.py").write_text(text)
    program = _import(tmp_path / "program.py")
    feeds = commands.training_feeds(c, module, example, 0)
    params = {n.name: torch.from_numpy(np.asarray(feeds[n.name])).clone() for n in c.logical.params}
    inputs = {n.name: torch.from_numpy(np.asarray(feeds[n.name])).clone() for n in c.logical.inputs}
    with _CountKernels() as count, torch.no_grad():
        out = program.train_step(params, inputs)
    assert count.calls == {FLASH_CPU: 1, FLASH_CPU + "_backward": 1}, count.calls
    for name, w in module.named_parameters():
        w.data.copy_(torch.from_numpy(np.asarray(feeds[name])))
    torch.nn.functional.mse_loss(module(inputs["x"]), inputs["target"]).backward()
    grads = dict(module.named_parameters())
    assert len(grads) == 4
    for name, w in grads.items():
        torch.testing.assert_close(out[name + ".grad"], w.grad, rtol=1e-5, atol=1e-6 * float(w.grad.abs().max()))


def test_cuda_program_keeps_the_kernel_tensors_and_its_runtime_falls_back(tmp_path):
    """The cuda profile's program prints the same forward / backward statements (the runtime
    picks the kernel on the device the program runs on: flash or efficient on a GPU, the CPU
    flash kernel under --device cpu), and its runtime holds the CUDA kernels' calls."""
    spec = tmp_path / "t.pcs"
    spec.write_text("mesh tp=1\ntrain loss=mse optimizer=sgd(lr=0.1) input_grads=no\n")
    c, _, _ = commands.compile_model(SimpleNamespace(model=MODEL, spec=str(spec)))
    text = emit_program(c, "cuda")
    step, runtime = text.split("def train_step")[1].split(RUNTIME_MARK)
    assert step.count("= attention_forward(") == 1 and step.count("= attention_backward(") == 1
    for op in ("_scaled_dot_product_flash_attention(", "_scaled_dot_product_flash_attention_backward(",
               "_scaled_dot_product_efficient_attention(", "_scaled_dot_product_efficient_attention_backward(",
               "torch._fused_sdp_choice(", "torch.func.vjp("):
        assert op in runtime, op


@pytest.mark.parametrize("lowering", ["all_gather", "ring"])
def test_context_parallel_programs_keep_the_forward_for_the_backward(lowering):
    """cp=2: the all_gather lowering's attention (a mask at the rank's rows) keeps the kernel's
    tensors like any other; the ring's forward keeps its output and row logsumexp
    (ring_sdpa_saved) and its one backward ring reads them (no statistics pass)."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.ir import parse_graph

    from graphs import spec
    from test_context_parallel import _attn

    c = compile_graph(parse_graph(_attn(8)), spec(f"mesh cp=2\ncontext-parallel lowering={lowering}\n"
                                                  "input x split-seq\noutput output split-seq\n"
                                                  "train loss=mse optimizer=sgd(lr=0.1)\n"))
    step = emit_program(c, "cpu").split("def train_step")[1].split(RUNTIME_MARK)[0]
    if lowering == "ring":
        assert step.count("= ring_sdpa_saved(") == 1 and step.count("ring_sdpa_grads(") == 1
        assert "saved=o_saved)" in step and "del o_saved" in step
        assert "pass 1" not in step and "no statistics pass" in step  # the comments say what runs
    else:
        assert step.count("= attention_forward(") == 1 and step.count("= attention_backward(") == 1
        assert step.count(".tril(COORD[0] * 4)") == 2 and "attention_grads(" not in step


def test_memory_estimates_count_the_kernels_logsumexp():
    """The resident estimate and the report's saved activations count the float32 logsumexp
    (one per query row) the forward keeps for its attention's backward: 1 x 1 x 8 rows, 32 B."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.cost.memory import local_bytes, resident_bytes, resident_values
    from parcomp.ir import parse_graph
    from parcomp.ir.liveness import saved_attention

    from graphs import spec
    from test_context_parallel import _attn

    c = compile_graph(parse_graph(_attn(8)), spec("mesh dp=1\ntrain loss=mse optimizer=sgd(lr=0.1)\n"))
    g = c.program  # the lowered local graph
    assert [g[v].op for v in saved_attention(g)] == ["sdpa"]
    plain = sum(local_bytes(g[v].type, g[v].layout, g.mesh) for v in resident_values(g))
    assert resident_bytes(g, {}) - plain == 32


def _sdpa_case(case, dtype=torch.float64):
    """``(q, k, v, dy, sdpa keyword arguments)`` of a test attention: causal, non-causal,
    a boolean mask (a causal block of rows at an offset, as context parallel's), fewer
    key/value rows than queries."""
    g = torch.Generator().manual_seed(0)
    lq, lk = (6, 10) if case in ("mask", "cross") else (8, 8)
    q, dy = (torch.randn(2, 3, lq, 4, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 3, lk, 4, generator=g, dtype=dtype) for _ in range(2))
    kw = {"causal": {"is_causal": True}, "plain": {"is_causal": False}, "cross": {"is_causal": False},
          "mask": {"attn_mask": torch.ones(lq, lk, dtype=torch.bool).tril(4)}}[case]
    return q, k, v, dy, {**kw, "scale": 0.3}


@pytest.mark.parametrize("case", ["causal", "plain", "mask", "cross"])
@pytest.mark.parametrize("parts", ["qkv", "kv", "q"])
def test_attention_backward_uses_the_saved_kernel_tensors_and_equals_autograd(case, parts):
    """attention_forward + attention_backward (float64): one forward kernel call, one
    backward kernel call, no sdpa recomputation; the gradients asked for equal torch's
    autograd of sdpa to 1e-12, the output its forward's."""
    q, k, v, dy, kw = _sdpa_case(case)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = torch.nn.functional.scaled_dot_product_attention(*leaves, **kw)
    y.backward(dy)
    with _CountKernels() as count, torch.no_grad():
        out, saved = program_attention.attention_forward(q, k, v, **kw)
        got = program_attention.attention_backward(dy, q, k, v, saved, parts, **kw)
    assert count.calls == {FLASH_CPU: 1, FLASH_CPU + "_backward": 1}, count.calls
    assert saved[0] == "flash_cpu" and saved[1] is out
    torch.testing.assert_close(out, y.detach(), rtol=1e-12, atol=1e-12)
    got = got if len(parts) > 1 else (got,)
    assert len(got) == len(parts)
    for c, t in zip(parts, got):
        torch.testing.assert_close(t, leaves["qkv".index(c)].grad, rtol=1e-12, atol=1e-12)


def test_attention_backward_without_a_fused_kernel_recomputes_through_vjp(monkeypatch):
    """Where no fused kernel with a known backward runs (another device; here forced), the
    forward keeps nothing (``saved`` None) and the backward is the vjp over sdpa: the same
    gradients. A tensor on a device other than cpu / cuda (meta) gets no kernel."""
    meta = torch.empty(1, 1, 4, 4, device="meta")
    assert program_attention.attention_kernel(meta, meta, meta, None, True, None) is None
    q, k, v, dy, kw = _sdpa_case("mask")
    monkeypatch.setattr(program_attention, "attention_kernel", lambda *a: None)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, **kw).backward(dy)
    with _CountSdpa() as count, torch.no_grad():
        out, saved = program_attention.attention_forward(q, k, v, **kw)
        got = program_attention.attention_backward(dy, q, k, v, saved, "qkv", **kw)
    assert saved is None and count.calls == 2
    for t, leaf in zip(got, leaves):
        torch.testing.assert_close(t, leaf.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_cuda_kernel_calls_fit_their_schemas(monkeypatch, kernel):
    """The CUDA kernels' forward and backward calls of attention_forward / attention_backward,
    on meta tensors (no GPU here): the arguments fit the ops' schemas, the saved tuple unpacks,
    the gradients have their operands' shapes."""
    monkeypatch.setattr(program_attention, "attention_kernel", lambda *a: kernel)
    q, k, v, dy = (torch.empty(2, 3, 64, 32, device="meta", dtype=torch.float16) for _ in range(4))
    out, saved = program_attention.attention_forward(q, k, v, is_causal=True, scale=0.3)
    assert saved[0] == kernel and out.shape == q.shape
    got = program_attention.attention_backward(dy, q, k, v, saved, "qkv", is_causal=True, scale=0.3)
    assert [t.shape for t in got] == [q.shape] * 3


@pytest.mark.parametrize("parts", ["qkv", "kv", "q"])
def test_attention_grads_equal_torch_autograd_with_one_forward(parts):
    """The runtime helper: only the gradients asked for, each equal to torch's autograd of sdpa,
    from one sdpa call (causal, GQA-free, a given scale)."""
    g = torch.Generator().manual_seed(0)
    q, k, v, dy = (torch.randn(2, 3, 8, 4, generator=g) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=True, scale=0.3).backward(dy)
    with _CountSdpa() as count, torch.no_grad():
        got = program_attention.attention_grads(dy, q, k, v, parts, is_causal=True, scale=0.3)
    assert count.calls == 1
    got = got if len(parts) > 1 else (got,)
    assert len(got) == len(parts)
    for c, t in zip(parts, got):
        torch.testing.assert_close(t, leaves["qkv".index(c)].grad, rtol=1e-5, atol=1e-6)


def _ring_rank(rank, port, out_dir, n=2, causal=True):
    """One of ``n`` gloo ranks: ring attention's gradients of this rank's rows, jointly and one
    gradient at a time, with the ring steps each posted (``ring_start``) and, for the joint
    one, the order of posts, waits and block computations."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=n)
    try:
        program_ring.GROUPS, program_ring.GROUP_RANKS = {"cp": torch.distributed.group.WORLD}, {"cp": [list(range(n))]}
        program_ring.RANK = rank
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, 2, 4 * n, 4, generator=g, dtype=torch.float64) for _ in range(4)]  # dy, q, k, v
        dy, q, k, v = (t[:, :, 4 * rank:4 * rank + 4] for t in full)  # contiguous chunks
        events, real = [], (program_ring.ring_start, program_ring.ring_finish, program_ring.ring_scores)

        def start(*args):
            events.append("post")
            return real[0](*args)

        def finish(started):
            events.append("wait")
            return real[1](started)

        def scores(*args):
            events.append("compute")
            return real[2](*args)

        program_ring.ring_start, program_ring.ring_finish, program_ring.ring_scores = start, finish, scores
        try:
            joint = program_ring.ring_sdpa_grads(dy, q, k, v, 0.5, causal, "cp", "contiguous", "qkv")
            order, events[:] = list(events), []
            single = [program_ring.ring_sdpa_grad(dy, q, k, v, 0.5, causal, "cp", "contiguous", w) for w in "qkv"]
            singles, events[:] = events.count("post"), []
            out, saved = program_ring.ring_sdpa_saved(q, k, v, 0.5, causal, "cp", "contiguous")
            forward, events[:] = events.count("post"), []
            kept = program_ring.ring_sdpa_grads(dy, q, k, v, 0.5, causal, "cp", "contiguous", "qkv", saved=saved)
        finally:
            program_ring.ring_start, program_ring.ring_finish, program_ring.ring_scores = real
        torch.save({"joint": joint, "single": single, "order": order, "kept": kept, "out": out,
                    "shifts": (order.count("post"), singles), "kept_shifts": (forward, events.count("post"))},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def _ring_grads(tmp_path, n, causal):
    """Every rank's results of :func:`_ring_rank` on ``n`` processes, and torch's autograd
    gradients of q, k, v over the whole sequence."""
    import torch.multiprocessing as mp

    mp.spawn(_ring_rank, args=(free_port(), str(tmp_path), n, causal), nprocs=n, join=True)
    g = torch.Generator().manual_seed(0)
    dy, q, k, v = (torch.randn(1, 2, 4 * n, 4, generator=g, dtype=torch.float64) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    y = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal, scale=0.5)
    y.backward(dy)
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in range(n)]
    torch.testing.assert_close(torch.cat([r["out"] for r in got], dim=2), y.detach(), rtol=1e-12, atol=1e-12)
    return got, [t.grad for t in leaves]


def test_ring_backward_runs_one_ring_for_the_three_gradients(tmp_path):
    """cp=2 (two gloo processes): ring_sdpa_grads gives dq, dk, dv with 3 ring steps (the
    statistics pass, K/V to the next rank, dK/dV home), where one ring_sdpa_grad per gradient
    made 8; both equal torch's autograd of the whole sequence. Each K/V transfer is posted
    before the computation on the block this rank holds and waited for after it (overlap).
    Given the output and row logsumexp the forward ring kept (ring_sdpa_saved, one K/V shift),
    the backward skips the statistics pass: 2 ring steps; every result equals autograd."""
    got, grads = _ring_grads(tmp_path, 2, True)
    assert [r["shifts"] for r in got] == [(3, 8), (3, 8)]  # without the forward's statistics
    assert [r["kept_shifts"] for r in got] == [(1, 2), (1, 2)]  # forward; backward on its statistics
    for r in got:  # statistics pass; gradient pass; dK/dV home
        assert r["order"] == ["post", "compute", "wait", "compute",
                              "post", "compute", "wait", "compute", "post", "wait"], r["order"]
    for i, grad in enumerate(grads):
        for key in ("joint", "single", "kept"):
            whole = torch.cat([r[key][i] for r in got], dim=2)
            torch.testing.assert_close(whole, grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n,causal", [(3, True), (4, False)])
def test_ring_backward_on_more_ranks_passes_partials_on_and_equals_autograd(tmp_path, n, causal):
    """cp=3 and cp=4: the partial dK/dV of a block starts at the rank after its owner, goes on
    with the block (sent in the same post as the next K/V) and home after the last step; every
    step's post comes before its block's computation. dq, dk, dv equal torch's autograd of the
    whole sequence in float64."""
    got, grads = _ring_grads(tmp_path, n, causal)
    for r in got:
        assert r["shifts"][0] == 2 * (n - 1) + 2  # statistics, K/V: n-1 each; the last partial on; home
        back = r["order"][3 * (n - 1) + 1:]  # after the statistics pass
        assert back[:3] == ["post", "compute", "wait"] and back[-2:] == ["post", "wait"], back
    for r in got:  # the forward's statistics kept: the backward's n-1 statistics shifts go
        assert r["kept_shifts"] == (n - 1, n + 1)
    for i, grad in enumerate(grads):
        for key in ("joint", "kept"):
            whole = torch.cat([r[key][i] for r in got], dim=2)
            torch.testing.assert_close(whole, grad, rtol=1e-12, atol=1e-12)


def test_attention_forward_and_backward_compile_as_one_graph():
    """torch.compile(fullgraph=True) captures the forward that keeps the kernel's tensors and
    the backward on them (the CPU kernel choice needs no dispatch query): no graph break, the
    same output and gradients."""
    g = torch.Generator().manual_seed(1)
    q, k, v, dy = (torch.randn(1, 2, 8, 4, generator=g) for _ in range(4))

    def step(q, k, v, dy):
        out, saved = program_attention.attention_forward(q, k, v, is_causal=True, scale=0.3)
        return (out, *program_attention.attention_backward(dy, q, k, v, saved, "qkv", is_causal=True, scale=0.3))

    with torch.no_grad():
        eager, compiled = step(q, k, v, dy), torch.compile(step, fullgraph=True)(q, k, v, dy)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)


def test_attention_grads_compile_as_one_graph():
    """torch.compile(fullgraph=True) captures the joint backward (``--compile`` of a functional
    program captures the whole step): no graph break, the same gradients."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(1, 2, 8, 4, generator=g) for _ in range(4)]
    with torch.no_grad():
        eager = program_attention.attention_grads(*args, "qkv", is_causal=True, scale=0.3)
        compiled = torch.compile(lambda *t: program_attention.attention_grads(*t, "qkv", is_causal=True, scale=0.3),
                                 fullgraph=True)(*args)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b)
