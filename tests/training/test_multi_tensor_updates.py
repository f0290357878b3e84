"""The emitted optimizer phase as torch.optim's multi-tensor kernels: AdamW as one
``torch._fused_adamw_`` call per group, SGD as one ``torch._fused_sgd_``, with the numbers of
``torch.optim.AdamW(fused=True)`` / ``(foreach=True)`` and ``torch.optim.SGD(fused=True)`` /
``(foreach=True)`` on
the same gradients (a world-size-1 program.py imported as a module, no process group)."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir import parse_graph  # noqa: E402
from parcomp.ir.update_groups import update_groups  # noqa: E402
from parcomp.reference.interpreter import run_spmd  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402

from graphs import mlp_text, random_feeds, spec as parse  # noqa: E402

DIMS, BATCH = [8, 16, 16, 4], (6,)


def _compiled(train, dtype="f64", mesh="tp=1", torch_layout=False):
    text = mlp_text(BATCH, DIMS, [True] * 3, ["gelu", "tanh"], torch_layout).replace("f32[", f"{dtype}[")
    return compile_graph(parse_graph(text), parse(f"mesh {mesh}\n{train} input_grads=no\n"))


def _module(c, tmp_path, name):
    path = tmp_path / f"{name}.py"
    path.write_text(emit_program(c, "cpu"))
    spec = importlib.util.spec_from_file_location(f"parcomp_{name}_program", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod, path.read_text()


def _start(c, seed=0):
    """Random params (optimizer state at zeros) and inputs, as torch tensors."""
    feeds = random_feeds(c.logical, seed, scale=0.5)
    state = set(c.program_.train.state)
    p = {n.name: torch.from_numpy(np.asarray(feeds[n.name])).clone() for n in c.logical.params}
    p.update({k: torch.zeros_like(p[k]) for k in state})
    inp = {n.name: torch.from_numpy(np.asarray(feeds[n.name])) for n in c.logical.inputs if n.name != "step"}
    return p, inp


def _train_with_torch(c, mod, make_opt, steps=3):
    """``steps`` steps of the emitted step and, on the step's own gradients, of the torch
    optimizer ``make_opt(params)``: (emitted outputs, torch params, torch optimizer)."""
    p, inp = _start(c)
    ref = {k: v.clone().requires_grad_(False) for k, v in p.items() if f"{k}.grad" in _outputs(c)}
    opt = make_opt(list(ref.values()))
    for k in range(1, steps + 1):
        out = mod.train_step(p, {**inp, "step": torch.tensor(float(k))})
        for name, t in ref.items():
            t.grad = out[f"{name}.grad"].clone()
        opt.step()
        p.update({key: out[key] for key in p if key in out})
    return out, ref, opt


def _outputs(c):
    return {pub for pub, _ in c.program_.graph.named_outputs()}


def _state(opt, t, key):
    return opt.state[t][key]


@pytest.mark.parametrize("torch_layout", [False, True])
@pytest.mark.parametrize("kind", ["fused", "foreach"])
def test_adamw_step_equals_torch_optim_adamw(tmp_path, kind, torch_layout):
    """3 AdamW steps of the emitted program (float64) equal torch.optim.AdamW's on the same
    gradients: params, exp_avg and exp_avg_sq (fused: the same kernel; foreach: to rounding).
    ``torch_layout``: weights stored [out, in] as torch's Linear does."""
    c = _compiled("train loss=mse optimizer=adamw(lr=0.05, weight_decay=0.1)", torch_layout=torch_layout)
    mod, _ = _module(c, tmp_path, "adamw")
    out, ref, opt = _train_with_torch(c, mod, lambda ps: torch.optim.AdamW(
        ps, lr=0.05, weight_decay=0.1, **{kind: True}))
    tol = dict(rtol=0, atol=0) if kind == "fused" else dict(rtol=1e-12, atol=1e-14)
    for name, t in ref.items():
        assert out[name].dtype == torch.float64
        torch.testing.assert_close(out[name], t, **tol, msg=name)
        torch.testing.assert_close(out[f"{name}.exp_avg"], _state(opt, t, "exp_avg"), **tol)
        torch.testing.assert_close(out[f"{name}.exp_avg_sq"], _state(opt, t, "exp_avg_sq"), **tol)


@pytest.mark.parametrize("kind", ["fused", "foreach"])
@pytest.mark.parametrize("hyper", ["momentum=0.9", "momentum=0.9, weight_decay=0.01", "weight_decay=0.01", ""])
def test_sgd_step_equals_torch_optim_sgd(tmp_path, hyper, kind):
    """3 SGD steps of the emitted program (float64) equal torch.optim.SGD's, with and without
    momentum and weight decay (fused: the same kernel, bit for bit; foreach: to rounding); the
    step is one torch._fused_sgd_ call over the six parameters."""
    c = _compiled(f"train loss=mse optimizer=sgd(lr=0.1{', ' if hyper else ''}{hyper})")
    mod, text = _module(c, tmp_path, "sgd")
    kw = dict(h.strip().split("=") for h in hyper.split(",") if h.strip())
    out, ref, opt = _train_with_torch(c, mod, lambda ps: torch.optim.SGD(
        ps, lr=0.1, **{kind: True}, **{k: float(v) for k, v in kw.items()}))
    tol = dict(rtol=0, atol=0) if kind == "fused" else dict(rtol=1e-13, atol=1e-15)
    for name, t in ref.items():
        torch.testing.assert_close(out[name], t, **tol, msg=name)
        if "momentum" in kw:
            torch.testing.assert_close(out[f"{name}.momentum_buffer"], _state(opt, t, "momentum_buffer"), **tol)
    step = [line for line in _step_text(text).splitlines() if "    fused_sgd_([l0_weight, " in line]
    assert len(step) == 1 and "alpha=" not in _step_text(text), step  # one call, no per-node add_


def _step_text(text):
    return text.split("def train_step", 1)[1].split("\n\n\n", 1)[0]


@pytest.mark.parametrize("mesh,train", [("tp=1", ""), ("dp=2", " zero=1")])
def test_one_fused_adamw_call_per_group(tmp_path, mesh, train):
    """The step calls torch._fused_adamw_ once for the group of all six parameters (also with
    ZeRO, on the shards) and prints no per-parameter AdamW statement; the comment names them."""
    c = _compiled(f"train loss=mse optimizer=adamw(lr=0.01) batch=6{train}", "f32", mesh)
    groups = update_groups(c.program_.graph)
    assert [len(g) for g in groups] == [6]
    _, text = _module(c, tmp_path, "count")
    body = _step_text(text)
    assert body.count("fused_adamw_(") == 1 and "def fused_adamw_(" in text
    assert ".addcdiv_(" not in body and "** step" not in body  # no per-node AdamW statement
    assert "fused AdamW (torch.optim.AdamW(fused=True)'s kernel, fused_adamw_ below) over 6 parameters" in body.replace(
        "\n    #   ", " ")


def test_fused_step_equals_the_reference_interpreter_in_float32(tmp_path):
    """The fused float32 step equals the numpy reference's per-node AdamW (the program the
    interpreter runs node by node) to float32 rounding over 3 steps."""
    c = _compiled("train loss=mse optimizer=adamw(lr=0.01, weight_decay=0.1)", "f32")
    mod, _ = _module(c, tmp_path, "ref32")
    prog = c.program_.graph
    p, inp = _start(c)
    names = list(p)
    state = {k: v.numpy().copy() for k, v in p.items()}
    for k in range(1, 4):
        out = mod.train_step(p, {**inp, "step": torch.tensor(float(k))})
        p.update({key: out[key] for key in p if key in out})
        got = run_spmd(prog, {**state, **{i: np.asarray(v) for i, v in inp.items()},
                              "step": np.float32(k)}).outputs(prog)
        state.update({key: np.asarray(got[key]) for key in state if key in got})
    for k in names:
        np.testing.assert_allclose(p[k].numpy(), state[k], rtol=2e-5, atol=2e-6, err_msg=k)


def test_a_strided_gradient_reaches_the_fused_kernel_contiguous():
    """The fused kernel reads raw buffers (strides ignored, CPU and CUDA): a gradient the program
    makes as a transposed view (a dp bucket's part, permuted to the weight's [out, in]) is handed
    over as ``.contiguous()``; one made contiguous (a bucket's part, a sum) as it is. (Without it,
    a dp=2 x tp=2 torch MLP trained wrong from step 2: tests/training/test_program_data.py.)"""
    pytest.importorskip("torch.export")
    from api_workers import MLP_DP_TP, _batches, small_mlp
    from parcomp.api.specs import resolve_spec
    from parcomp.frontends.torch.export import import_torch

    model, batches = small_mlp(), _batches(1)
    graph = import_torch(model, (batches[0][0],))
    c = compile_graph(graph, resolve_spec(MLP_DP_TP + "train loss=mse optimizer=adamw(lr=1e-2)\n", model, graph))
    call = next(ln for ln in emit_program(c, "cpu").splitlines() if ln.startswith("    fused_adamw_("))
    grads = call.split("], [", 2)[1].split(", ")
    prog = c.program_.graph
    units = update_groups(prog)[0]
    assert len(grads) == len(units) == 4
    for u, text in zip(units, grads):
        strided = prog[u.grad].op == "permute"
        assert text.endswith(".contiguous()") == strided, (u.grad, text)
    assert any(prog[u.grad].op == "permute" for u in units)
