"""Training programs from the torch backend: the training ops, the emitted loop, torchrun runs.

The op table's training entries (gelu_grad, cross_entropy, cross_entropy_grad,
adamw_param, 0-d values) are checked against the numpy reference; every run
launches real gloo processes with torchrun and compares each step's loss, the
final parameters, the last step's gradients and the optimizer state with the
same module trained by ``torch.optim`` on one process.
"""
from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir import LAYOUT_OPS, OPS, Node, TensorType, make_attrs  # noqa: E402
from parcomp.reference.numpy_ops import NUMPY_OPS  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402
from parcomp_backends.torch import (assemble_training_outputs, emit_program,  # noqa: E402
                                    run_torchrun, training_facts)
from parcomp_backends.torch.emit import OP_FORMATS, node_code  # noqa: E402
from parcomp_backends.torch.emit.norms import NORM_RUNTIME  # noqa: E402
from parcomp_backends.torch.emit.reduce import REDUCE_FORMATS  # noqa: E402
from parcomp_backends.torch.launch import write_program  # noqa: E402

from numerics import assert_all_equivalent, assert_equivalent  # noqa: E402

MODELS = Path(__file__).resolve().parents[1].parent / "specs" / "models.py"
TIMEOUT = 120
STEPS = 3
F = torch.nn.functional


# --- the op table on the training ops, against numpy ----------------------------------

_X = ((2, 3), (2, 3))
COMPUTE_OPS = sorted(set(OP_FORMATS) - set(LAYOUT_OPS) - {"relayout"}  # lowered ops: test_lowering.py
                     - {op for op, d in OPS.items() if d.kind == "lowered"}
                     - set(REDUCE_FORMATS)  # reductions part: tests/rules/test_reductions.py
                     # fp16 loss scaling: scalar scaler state, tests/training/test_precision.py;
                     # MoE: routing operands, tests/moe/test_moe.py (torchrun vs interpreter)
                     - {"amp_ratio", "amp_select", "amp_tracker", "moe_route", "moe_route_grad", "moe_dispatch",
                        "moe_combine", "moe_combine_grad_c", "all_to_all_ragged"}
                     # ring attention / balanced chunking: point-to-point inside the op;
                     # program.py runs them in tests/context_parallel/test_cp_ring.py (torchrun vs interpreter)
                     - {"sdpa_ring", "sdpa_grad_ring", "arange_balanced"})
SHAPED_CASES = {  # case: (op, operand shapes, result shape, attrs); "i:2,3" = int64 labels in [0, 5)
    "pow": ("pow", ((2, 3),), (2, 3), {"exponent": 3.0}),
    "add_scalar": ("add_scalar", ((2, 3),), (2, 3), {"value": 1.5}),
    "scale": ("scale", ((2, 3),), (2, 3), {"value": -0.5}),
    "pow_grad": ("pow_grad", _X, (2, 3), {"exponent": 3.0}),
    "matmul": ("matmul", ((2, 3), (3, 4)), (2, 4), {}),
    "permute": ("permute", ((2, 3, 4),), (4, 2, 3), {"perm": (2, 0, 1)}),
    "reshape": ("reshape", ((2, 3),), (3, 2), {}),
    "sum": ("sum", ((2, 3, 4),), (2,), {"dims": (1, 2)}),
    "sum_none": ("sum", ((2, 3),), (2, 3), {"dims": ()}),
    "expand": ("expand", ((2,),), (2, 3), {"dims": (1,)}),
    "ones": ("ones", (), (2, 3), {}),
    # the training ops, and 0-d values (the loss is one)
    "gelu_grad_tanh": ("gelu_grad", _X, (2, 3), {"approximate": "tanh"}),
    "cross_entropy": ("cross_entropy", ((2, 3, 5), "i:2,3"), (2, 3), {}),
    "cross_entropy_0d": ("cross_entropy", ((5,), "i:"), (), {}),
    "cross_entropy_grad": ("cross_entropy_grad", ((2, 3), (2, 3, 5), "i:2,3"), (2, 3, 5), {}),
    "cross_entropy_grad_0d": ("cross_entropy_grad", ((), (5,), "i:"), (5,), {}),
    "adamw_param": ("adamw_param", ((2, 3), (2, 3), "abs:2,3", ()), (2, 3),
                    {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05}),
    "ones_0d": ("ones", (), (), {}),
    "sum_to_0d": ("sum", ((2, 3),), (), {"dims": (0, 1)}),
    "expand_0d": ("expand", ((),), (2, 3), {"dims": (0, 1)}),
    "scale_0d": ("scale", ((),), (), {"value": 0.25}),
    "pow_grad_0d": ("pow_grad", ((), ()), (), {"exponent": 2.0}),
    # attention part
    "slice": ("slice", ((2, 3),), (2, 2), {"dim": 1, "start": 0, "stop": 3, "step": 2}),
    "slice_grad": ("slice_grad", ((1, 3),), (2, 3), {"dim": 0, "start": 1, "stop": 2, "step": 1}),
    "cat": ("cat", ((2, 3), (1, 3)), (3, 3), {"dim": 0}),
    "pad": ("pad", ((2, 3),), (2, 6), {"dim": 1, "before": 1, "after": 2, "value": 0.5}),
    "arange": ("arange", (), (4,), {"start": -1, "step": 0.25}),
    "sdpa": ("sdpa", ((1, 2, 3, 4),) * 3, (1, 2, 3, 4), {"scale": 0.5}),
    **{"sdpa_grad" + ("" if w == "q" else f"_{w}"): ("sdpa_grad", ((1, 2, 3, 4),) * 4, (1, 2, 3, 4),
                                                    {"causal": True, "scale": 0.5, "wrt": w}) for w in "qkv"},
    # norms + embedding part; helpers from backends/torch/runtime/program_norms.py
    "layer_norm": ("layer_norm", ((2, 3, 8), (8,), (8,)), (2, 3, 8), {"eps": 1e-5}),
    "layer_norm_plain": ("layer_norm", ((2, 3, 8),), (2, 3, 8), {"eps": 1e-5}),
    "rms_norm": ("rms_norm", ((2, 3, 8), (8,)), (2, 3, 8), {"eps": 1e-6}),
    "rms_norm_plain": ("rms_norm", ((4, 8),), (4, 8), {"eps": 1e-6}),
    "layer_norm_grad": ("layer_norm_grad", ((2, 3, 8), (2, 3, 8), (8,)), (2, 3, 8), {"eps": 1e-5}),
    "rms_norm_grad": ("rms_norm_grad", ((2, 3, 8), (2, 3, 8)), (2, 3, 8), {"eps": 1e-6}),
    "dropout": ("dropout", ((4, 6),), (4, 6), {"p": 0.3, "seed": 11}),
    "embedding": ("embedding", ("i:2,3", (5, 4)), (2, 3, 4), {}),
    "embedding_grad": ("embedding_grad", ((2, 3, 4), "i:2,3"), (5, 4), {}),
    # training options: the clipping factor of a sum of squares, clipped and not
    "clip_coef": ("clip_coef", ("abs:",), (), {"max_norm": 0.5}),
    "clip_coef_off": ("clip_coef", ("abs:",), (), {"max_norm": 40.0}),
}
OP_CASES = {**{op: (op, _X if op in ("add", "sub", "mul", "div") or op.endswith("_grad") else ((2, 3),),
                    (2, 3), {}) for op in COMPUTE_OPS}, **SHAPED_CASES}  # every op, default shapes


def _operand(rng, shape, i, op):
    if isinstance(shape, str):  # "i:2,3" labels, "abs:2,3" non-negative (AdamW's v)
        kind, dims = shape.split(":")
        dims = tuple(int(d) for d in dims.split(",") if d)
        return rng.integers(0, 5, dims) if kind == "i" else np.abs(rng.standard_normal(dims)).astype("f4")
    if op == "adamw_param" and i == 3:
        return np.array(3.0, "f4")  # the step number
    return (rng.standard_normal(shape).astype("f4") + (3 if op == "div" and i else 0)).astype("f4")


@pytest.mark.parametrize("case", sorted(OP_CASES))
def test_every_op_including_training_ops_matches_numpy(case):
    op, shapes, out, attrs = OP_CASES[case]
    rng = np.random.default_rng(0)
    xs = [_operand(rng, s, i, op) for i, s in enumerate(shapes)]
    node = Node("y", op, tuple(f"a{i}" for i in range(len(xs))), TensorType(out), make_attrs(**attrs))
    env = {"torch": torch, "DEVICE": torch.device("cpu")}
    exec(NORM_RUNTIME, env)  # noqa: S102 - the helpers program.py pastes (norms + embedding part)
    env.update({f"a{i}": torch.tensor(x) for i, x in enumerate(xs)})
    got = eval(node_code(node, [f"a{i}" for i in range(len(xs))]), env)  # noqa: S307 - our own table
    want = NUMPY_OPS[op](xs, node)
    assert tuple(got.shape) == tuple(np.shape(want)) and got.dtype == torch.float32
    assert_equivalent(got.numpy(), want, what=case)


# --- emitted text ----------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _model(name):
    from parcomp.frontends.loader import load_model

    if name == "gpt2_mlp":
        pytest.importorskip("transformers")
    return load_model(f"{MODELS}:{name}")  # (graph, module, example inputs); do not modify


def _compile(name, spec_text):
    return compile_graph(_model(name)[0], parse_spec(spec_text, "train.pcs"))


GPT2_TP2 = ("mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x replicated\n"
            "train loss=mse optimizer={opt} steps=3\n")


def test_training_program_text():
    c = _compile("gpt2_mlp", GPT2_TP2.format(opt="adamw(lr=0.01)"))
    text = emit_program(c, "cpu", model="models.py:gpt2_mlp")
    assert text == emit_program(c, "cpu", model="models.py:gpt2_mlp")
    compile(text, "program.py", "exec")
    assert "def train_step(p, inp):" in text and "def forward(" not in text
    assert "TRAIN_STEPS = 3  # default of --steps" in text and 'STEP_INPUT = "step"' in text
    assert 'INPUTS = ("target", "x")' in text  # the step number is not read from --input
    assert re.search(r'out\["c_fc.weight.exp_avg"\] = \(place\(take\(ckpt, "c_fc.weight.exp_avg", \(32, 128\), '
                     r'torch.float32\).narrow\(1, COORD\[0\] \* 64, 64\)\) if "c_fc.weight.exp_avg" in ckpt else\n'
                     r'        torch.zeros\(\(32, 64\), dtype=torch.float32', text)
    assert "all_reduce over tp (backward)" in text and "torch.no_grad()" in text
    facts = training_facts(c)
    assert facts.step == "step" and facts.steps == 3 and len(facts.state) == 8
    assert set(facts.carried) == {n.name for n in c.program.params}
    assert "TRAIN_STEPS = 3" in emit_program(c)  # the spec's steps=3, from the report
    assert "TRAIN_STEPS = 5" in emit_program(c, steps=5)
    forward = compile_graph(_model("gpt2_mlp")[0], parse_spec(
        "mesh tp=2\nc_fc.weight colwise\nc_proj.weight rowwise\ninput x replicated\n", "f.pcs"))
    assert training_facts(forward) is None and "def forward(p, inp):" in emit_program(forward)


# --- torchrun runs against torch.optim on one process -----------------------------------


def torch_training(module, make_opt, batches, loss_fn):
    """Train a copy of ``module`` on one process; returns (state_dict, grads, optimizer state, losses)."""
    ref = copy.deepcopy(module).train()
    opt = make_opt(ref.parameters())
    losses = []
    for b in batches:
        opt.zero_grad()
        loss = loss_fn(ref(b["x"]), b)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    names = dict(ref.named_parameters())
    state = {f"{n}.{k}": v.numpy() for n, p in names.items() for k, v in opt.state[p].items() if k != "step"}
    grads = {f"{n}.grad": p.grad.numpy() for n, p in names.items()}
    return {n: p.detach().numpy() for n, p in names.items()}, grads, state, losses


def train_run(tmp_path, compiled, nproc, module, inputs, extra=("--steps", str(STEPS))):
    """Emit, launch, assert success; returns (outputs, losses, process result)."""
    write_program(compiled, tmp_path)
    if isinstance(inputs, list):  # one dict per step: a .pt list, written here
        torch.save(inputs, tmp_path / "inputs.pt")
        inputs = str(tmp_path / "inputs.pt")
    res = run_torchrun(tmp_path, nproc, module, inputs, tmp_path / "out.pt",
                       ("--device", "cpu", *extra), timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    out, losses = assemble_training_outputs(tmp_path / "out.pt", compiled.program)
    return out, losses, res


def assert_trained_like_torch(out, losses, res, want):
    params, grads, state, want_losses = want
    assert len(losses) == len(want_losses) == STEPS
    assert_equivalent(np.array(losses, "float32"), np.array(want_losses, "float32"), what="losses")
    printed = re.findall(r"^step (\d+) loss (\S+)$", res.stdout, re.M)
    assert [int(k) for k, _ in printed] == list(range(1, STEPS + 1))
    assert [v for _, v in printed] == [f"{x:.6g}" for x in losses]  # rank 0 prints what it saves
    assert_all_equivalent(out, {**params, **grads, **state})


def _batches(example, seed, per_step, labels=None):
    g = torch.Generator().manual_seed(seed)
    x = example[0]
    out = []
    for k in range(STEPS if per_step else 1):
        b = {"x": x if k == 0 else torch.randn(x.shape, generator=g)}
        if labels:
            b["labels"] = torch.randint(0, labels, x.shape[:-1], generator=g)
        else:
            b["target"] = torch.randn(x.shape, generator=g)
        out.append(b)
    return out if per_step else out * STEPS


def _mse(y, b):
    return F.mse_loss(y, b["target"])


def _sgd(p):
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


@pytest.mark.slow
def test_gpt2_mlp_tp2_sgd_momentum_per_step_inputs(tmp_path):
    c = _compile("gpt2_mlp", GPT2_TP2.format(opt="sgd(lr=0.1, momentum=0.9)"))
    _, module, example = _model("gpt2_mlp")
    batches = _batches(example, 1, per_step=True)
    out, losses, res = train_run(tmp_path, c, 2, module, batches, extra=())  # the spec's steps=3
    assert_trained_like_torch(out, losses, res, torch_training(module, _sgd, batches, _mse))


@pytest.mark.slow
def test_gpt2_mlp_tp2_adamw(tmp_path):
    opt = "adamw(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05)"
    c = _compile("gpt2_mlp", GPT2_TP2.format(opt=opt))
    _, module, example = _model("gpt2_mlp")
    batches = _batches(example, 2, per_step=False)
    out, losses, res = train_run(tmp_path, c, 2, module, batches[0])  # one dict: every step

    def adamw(p):
        return torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)

    assert_trained_like_torch(out, losses, res, torch_training(module, adamw, batches, _mse))
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_torch_mlp_dp2_tp2_sgd_momentum_on_four_ranks(tmp_path):
    c = _compile("torch_mlp", "mesh dp=2 tp=2\n0.weight colwise over tp\n2.weight rowwise over tp\n"
                              "input x [S(0), R]\ntrain loss=mse optimizer=sgd(lr=0.1, momentum=0.9)\n")
    _, module, example = _model("torch_mlp")
    batches = _batches(example, 3, per_step=True)
    out, losses, res = train_run(tmp_path, c, 4, module, batches)
    assert_trained_like_torch(out, losses, res, torch_training(module, _sgd, batches, _mse))


@pytest.mark.slow
def test_cross_entropy_data_parallel(tmp_path):
    c = _compile("torch_mlp", "mesh dp=2\ninput x [S(0)]\ntrain loss=cross_entropy optimizer=sgd(lr=0.5)\n")
    _, module, example = _model("torch_mlp")
    classes = example[0].shape[-1]
    batches = _batches(example, 4, per_step=True, labels=classes)
    out, losses, res = train_run(tmp_path, c, 2, module, batches)

    def ce(y, b):
        return F.cross_entropy(y.reshape(-1, classes), b["labels"].reshape(-1))

    want = torch_training(module, lambda p: torch.optim.SGD(p, lr=0.5), batches, ce)
    assert_trained_like_torch(out, losses, res, want)


@pytest.mark.slow
def test_zero1_adamw_dp2_tp2(tmp_path):
    c = _compile("gpt2_mlp", "mesh dp=2 tp=2\nc_fc.weight colwise over tp\nc_proj.weight rowwise over tp\n"
                             "input x [S(0), R]\ntrain loss=mse optimizer=adamw(lr=0.01) zero=1\n")
    # optimizer state split over dp; the updated params gathered back over dp
    assert c.program["c_fc.weight.exp_avg"].layout[0] != c.program["c_fc.weight"].layout[0]
    assert any(r["kind"] == "all_gather" and r["axis"] == "dp" and r["phase"] == "optimizer"
               for r in c.report["collectives"])
    _, module, example = _model("gpt2_mlp")
    batches = _batches(example, 5, per_step=False)
    out, losses, res = train_run(tmp_path, c, 4, module, batches[0])
    want = torch_training(module, lambda p: torch.optim.AdamW(p, lr=0.01), batches, _mse)
    assert_trained_like_torch(out, losses, res, want)
    assert '        torch.zeros((16, 64),' in (tmp_path / "program.py").read_text()


@pytest.mark.slow
def test_replicated_outputs_one_file_with_losses_and_bench(tmp_path):
    c = _compile("torch_mlp", "mesh tp=2\ninput x replicated\n"
                              "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9)\n")
    _, module, example = _model("torch_mlp")
    batches = _batches(example, 6, per_step=True)
    out, losses, res = train_run(tmp_path, c, 2, module, batches, extra=("--steps", "3", "--bench", "1"))
    assert_trained_like_torch(out, losses, res, torch_training(module, _sgd, batches, _mse))
    assert sorted(f.name for f in tmp_path.glob("out*.pt")) == ["out.pt"]
    saved = torch.load(tmp_path / "out.pt", weights_only=True)
    assert saved["losses"] == losses and "0.weight.momentum_buffer" in saved
    assert len(re.findall(r'^\{"step_ms": \[[^,\]]+\]\}$', res.stdout, re.M)) == 1


@pytest.mark.slow
def test_per_step_inputs_must_match_steps(tmp_path):
    c = _compile("torch_mlp", "mesh tp=2\ninput x replicated\ntrain loss=mse optimizer=sgd(lr=0.1)\n")
    _, module, example = _model("torch_mlp")
    write_program(c, tmp_path)
    torch.save(_batches(example, 7, per_step=True)[:2], tmp_path / "inputs.pt")
    res = run_torchrun(tmp_path, 2, module, str(tmp_path / "inputs.pt"), None,
                       ("--device", "cpu", "--steps", "3"), timeout=TIMEOUT)
    assert res.returncode != 0
    assert "holds the inputs of 2 steps but --steps is 3" in res.stderr


# --- buffers and frozen params are never trained; several outputs; --steps bounds ---------------


def _factory(name):
    import train_models

    return getattr(train_models, name)()


@pytest.mark.parametrize("factory,frozen", [("buffer_mlp", {"s"}), ("frozen_bias_mlp", {"s", "fc1.bias"})])
def test_buffers_and_frozen_params_get_no_gradient_state_or_update(factory, frozen):
    from parcomp.frontends.torch.export import import_torch
    from train_models import BUFFER_SPEC

    graph = import_torch(*_factory(factory))
    assert {n.name for n in graph.params if n.attr("trainable") is False} == frozen
    c = compile_graph(graph, parse_spec(BUFFER_SPEC.replace("sgd(lr=0.5)", "sgd(lr=0.5, momentum=0.9)"),
                                        "buf.pcs"))
    names = set(c.program.output_names)
    for p in frozen:
        assert {p, f"{p}.grad", f"{p}.momentum_buffer"}.isdisjoint(names)
        assert f"{p}.momentum_buffer" not in c.program
    assert {"fc1.weight", "fc2.bias.grad", "fc2.weight.momentum_buffer"} <= names
    assert frozen.isdisjoint(training_facts(c).carried)  # program.py keeps them as loaded


def test_program_steps_out_of_range_is_an_argument_error(tmp_path):
    import subprocess
    import sys

    from train_models import BUFFER_SPEC

    from parcomp.frontends.torch.export import import_torch

    c = compile_graph(import_torch(*_factory("buffer_mlp")), parse_spec(BUFFER_SPEC, "buf.pcs"))
    program = write_program(c, tmp_path)
    for steps in ("100000000000", "0"):
        res = subprocess.run([sys.executable, program, "--checkpoint", "none.pt", "--input", "none.pt",
                              "--steps", steps], capture_output=True, text=True, timeout=TIMEOUT)
        assert res.returncode == 2 and "Traceback" not in res.stderr
        assert f"argument --steps: {steps}: give 1 to 1_000_000 training steps" in res.stderr


@pytest.mark.slow
def test_buffer_model_three_steps_on_two_ranks_like_torch(tmp_path):
    """``fc2(relu(fc1(x)) * s)`` with a buffer ``s``, tp=2, 3 SGD steps."""
    from train_models import BUFFER_SPEC

    from parcomp.frontends.torch.export import import_torch

    module, example, names = _factory("buffer_mlp")
    c = compile_graph(import_torch(module, example, names), parse_spec(BUFFER_SPEC, "buf.pcs"))
    batches = _batches(example, 8, per_step=False)
    s_before = module.s.clone()
    out, losses, res = train_run(tmp_path, c, 2, module, batches[0], extra=())  # the spec's steps=3
    want = torch_training(module, lambda p: torch.optim.SGD(p, lr=0.5), batches, _mse)
    assert_trained_like_torch(out, losses, res, want)  # every step
    assert "s" not in out and "s.grad" not in out  # s is neither updated nor differentiated
    assert torch.equal(module.s, s_before) and set(want[0]) == {"fc1.weight", "fc1.bias", "fc2.weight",
                                                                "fc2.bias"}


@pytest.mark.slow
def test_run_two_output_model_with_loss_on_the_named_output(tmp_path, capsys):
    import json

    from parcomp.cli.main import main
    from train_models import MODELS

    spec = tmp_path / "two.pcs"
    spec.write_text("mesh tp=2\nfc.weight colwise\ninput x replicated\n"
                    "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9) output=output_1 steps=2\n")
    assert main(["run", f"{MODELS}:two_outputs", "--spec", str(spec), "--nproc", "2", "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["steps"] == 2 and len(last["losses"]) == 2 and not last.get("missing")
    assert last["err_over_tol"] <= 1  # every step's loss and every carried value within its bound
