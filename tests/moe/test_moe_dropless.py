"""Dropless MoE in program.py (backends/torch/emit/moe_dropless.py): without a capacity the
experts compute only the routed tokens, packed and sorted by expert. The training step equals
torch autograd of transformers' own Mixtral block and of the hand-built blocks; its matmul
FLOPs and dispatch bytes are those of the routed work (the dense slot buffer's are E/k times
more); with a capacity the dense buffer stays; under ep the counts travel once per layer."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.frontends.loader import load_model
from parcomp.frontends.torch.export import import_torch
from parcomp.spec import parse_spec
from parcomp_backends.torch.emit import emit_program

from numerics import assert_equivalent

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
MODELS = os.path.join(ROOT, "specs", "models.py")
SPECS = os.path.join(ROOT, "specs")
sys.path.insert(0, SPECS)
import models  # noqa: E402

TRAIN = "train loss=mse optimizer=sgd(lr=0.1) batch={batch}\n"
ONE_RANK = "mesh ep=1\nexperts.* ep=S(0)\ninput x ep=S(0)\n"


def _program(graph, spec_text, tmp_path, name="program"):
    """(compiled, program.py imported as a module, its text) of a world-size-1 spec."""
    c = compile_graph(graph, parse_spec(spec_text, "train.pcs"))
    text = emit_program(c, "cpu")
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"parcomp_moe_{name}_{id(tmp_path)}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return c, mod, text


def _step(mod, module, x, target):
    """program.py's train_step on ``module``'s params: its loss and gradients."""
    p = {k: v.detach().clone() for k, v in module.named_parameters()}
    return mod.train_step(p, {"x": x.clone(), "target": target.clone()})


def _torch_step(module, x, target):
    """torch autograd of the same MSE step: (loss, {param: grad})."""
    module.zero_grad()
    out = module(x.clone())
    out = out[0] if isinstance(out, tuple) else out
    loss = torch.nn.functional.mse_loss(out, target)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in module.named_parameters()}


def _assert_step_equal(got, module, x, target):
    loss, grads = _torch_step(module, x, target)
    assert_equivalent(got["loss"].detach().numpy(), loss.numpy(), what="loss")
    for name, want in grads.items():
        assert_equivalent(got[name + ".grad"].detach().numpy(), want.numpy(), what=name + ".grad")


@pytest.mark.parametrize("routing", ["random", "skewed"])
def test_dropless_step_equals_transformers_mixtral_block(tmp_path, routing):
    """transformers' own MixtralSparseMoeBlock (its experts module traced by the frontend):
    loss and every gradient of the packed program equal torch autograd; with the skewed
    routing an expert gets no token (an empty group)."""
    moe = models.mixtral_moe()
    x, target = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    if routing == "skewed":
        models.skew_routing(moe, x)
    _, mod, text = _program(import_torch(moe, (x,), ["x"]), ONE_RANK + TRAIN.format(batch=4), tmp_path)
    step = text.split("def train_step")[1].split("\ndef ")[0]
    assert "# MoE: dropless" in step and "moe_grouped_mm(" in step and "moe_dispatch(" not in step
    _assert_step_equal(_step(mod, moe, x, target), moe, x, target)


@pytest.mark.parametrize("factory", ["moe_block", "moe_block_skewed", "moe_block_shared"])
def test_dropless_step_equals_the_hand_built_blocks(tmp_path, factory):
    """specs/models.py's blocks (the MoE custom ops; Qwen-MoE's shared expert beside)."""
    graph, module, (x,) = load_model(f"{MODELS}:{factory}")
    target = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    _, mod, text = _program(graph, ONE_RANK + TRAIN.format(batch=4), tmp_path)
    assert "# MoE: dropless" in text
    _assert_step_equal(_step(mod, module, x, target), module, x, target)


def test_a_spec_capacity_keeps_the_dense_slot_buffer(tmp_path):
    """``moe capacity_factor=...``: the capacity form (slots a bound the user set), as before."""
    graph, module, (x,) = load_model(f"{MODELS}:moe_block")
    _, mod, text = _program(graph, ONE_RANK + "moe capacity_factor=4\n" + TRAIN.format(batch=4), tmp_path)
    assert "# MoE: the dense slot buffer [B, E, C, H]: a capacity is set" in text
    assert "moe_pack(" not in text and "moe_dispatch(x, moe_route_, 8, False)" in text
    _assert_step_equal(_step(mod, module, x, torch.zeros_like(x)), module, x, torch.zeros_like(x))


# ---- the work the program does: FLOPs and dispatch bytes against the routed work ----------

E, K, H, F, B, S = 8, 2, 32, 64, 4, 16


def measured_work(mod, module, x, target) -> dict:
    """Matmul FLOPs (torch's FlopCounterMode) and dispatch-buffer bytes (what moe_dispatch /
    moe_pack return) of one train_step, each over the routed work: 18 H F FLOPs per routed
    (token, expert) pair (3 matmuls forward, 6 backward) and H floats per pair per dispatch."""
    made = []

    def counted(fn):
        def wrapper(*args):
            out = fn(*args)
            made.append(out.numel() * out.element_size())
            return out
        return wrapper

    for name in ("moe_dispatch", "moe_pack"):
        if hasattr(mod, name):
            setattr(mod, name, counted(getattr(mod, name)))
    with FlopCounterMode(display=False) as flops:
        _step(mod, module, x, target)
    pairs = x.shape[0] * x.shape[1] * K
    h, f = module.experts.down_proj.shape[1:]
    return {"flops": flops.get_total_flops() / (pairs * 18 * h * f),
            "dispatch_bytes": sum(made) / (len(made) * pairs * h * x.element_size()), "dispatches": len(made)}


def _work(tmp_path, capacity_line, name):
    module, (x,), names = models.moe_block(batch=B, seq=S, experts=E, top_k=K, hidden=H, inter=F)
    _, mod, _ = _program(import_torch(module, (x,), names), ONE_RANK + capacity_line + TRAIN.format(batch=B),
                         tmp_path, name)
    return measured_work(mod, module, x, torch.zeros_like(x))


def test_eight_experts_top2_flops_and_dispatch_bytes_within_1_3x_of_the_routed_work(tmp_path):
    """8 experts, top-2: the dropless program's matmul FLOPs (the router's included) and its
    dispatch buffers are within 1.3x of the routed work; the dense slot buffer of the same
    layer (capacity = the row's tokens, nothing dropped) is E/k = 4x on both, which this
    bound rejects."""
    dropless = _work(tmp_path, "", "dropless")
    assert dropless["dispatches"] == 2  # the tokens forward, their gradients backward
    assert dropless["flops"] <= 1.3 and dropless["dispatch_bytes"] <= 1.3, dropless
    dense = _work(tmp_path, f"moe capacity_factor={E / K}\n", "dense")
    assert dense["flops"] > 1.3 and dense["dispatch_bytes"] > 1.3, dense
    assert dense["dispatch_bytes"] == pytest.approx(E / K)


# ---- expert parallel: the exchange --------------------------------------------------------

@pytest.mark.parametrize("factory, spec, layers", [
    ("moe_block", "moe_ep2_train.pcs", 1), ("moe_block", "moe_ep2_tp2_train.pcs", 1),
    ("moe_block_shared", "moe_shared_dp2_ep2_train.pcs", 1)])
def test_ep_programs_exchange_counts_once_per_layer_and_only_routed_rows(factory, spec, layers):
    """Under ep the per-expert counts cross by one all_to_all per layer and step (the way back
    and the backward's exchanges reuse them); the rows by all_to_all_single with split sizes;
    no dense buffer, no ragged mask exchange is left in the step."""
    graph, _, _ = load_model(f"{MODELS}:{factory}")
    with open(os.path.join(SPECS, spec)) as f:
        text = emit_program(compile_graph(graph, parse_spec(f.read(), spec)), "cpu")
    step = text.split("def train_step")[1].split("\ndef ")[0]
    assert len(re.findall(r"= moe_expert_plan\(", step)) == layers
    # the counts cross ep before the rows plan's one host copy, which carries both
    assert len(re.findall(r"= moe_route_plan\(\w+, 'ep'\)", step)) == layers
    assert len(re.findall(r"= moe_to_experts\(", step)) == 2 * layers  # tokens, their gradients
    assert len(re.findall(r"= moe_to_rows\(", step)) == 2 * layers
    assert "all_to_all_ragged(" not in step and "moe_dispatch(" not in step


def test_report_names_the_dropless_exchange_and_its_routed_bytes():
    """report.json's all_to_all records of the slot buffer keep the dense buffer's bytes (a
    compile-time bound); ``moe_exchange`` names them as the dropless exchange program.py runs,
    with the even routing's bytes (top_k / E of them); with a capacity there is none."""
    graph, _, _ = load_model(f"{MODELS}:moe_block")
    with open(os.path.join(SPECS, "moe_ep2_train.pcs")) as f:
        text = f.read()
    report = compile_graph(graph, parse_spec(text, "moe_ep2_train.pcs")).report
    (rec,) = report["moe_exchange"]
    a2a = {r["name"]: r["bytes"] for r in report["collectives"] if r["kind"] == "all_to_all"}
    assert rec["form"] == "dropless" and sorted(rec["collectives"]) == sorted(a2a)  # 2 forward, 2 backward
    assert rec["dense_bytes"] == sum(a2a.values()) and rec["even_routing_bytes"] * 4 == rec["dense_bytes"] * 2
    capped = compile_graph(graph, parse_spec(text + "moe capacity_factor=1.0\n", "c.pcs")).report
    assert "moe_exchange" not in capped


@pytest.mark.slow
def test_transformers_mixtral_lm_ep2_runs_dropless_under_torchrun_like_unsharded(capsys):
    """transformers' own MixtralForCausalLM (2 MoE layers, experts traced with one token per
    routing group) on 2 gloo ranks, dropless, compared with the unsharded step."""
    rc = main(["run", f"{MODELS}:mixtral_lm", "--spec", os.path.join(SPECS, "mixtral_lm_ep2_train.pcs"),
               "--nproc", "2", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["verdict"] == "OK" and out["world_size"] == 2, out.get("why")


# ---- the packed forms against the numpy reference, and the dense fallback -----------------

def _forward_program(text, tmp_path, name, spec="mesh ep=1\ninput x replicated\n"):
    from parcomp.ir import parse_graph

    c, mod, program = _program(parse_graph(text), spec, tmp_path, name)
    return c, mod, program


@pytest.mark.parametrize("experts, top_k, skew", [(4, 1, 0.0), (4, 4, 0.0), (6, 2, 3.0), (8, 3, 0.0)])
def test_dropless_forward_equals_the_reference_for_any_routing(tmp_path, experts, top_k, skew):
    """top-1, every expert (top_k = E), a skewed router (experts without a token), odd counts:
    program.py's dropless forward equals the numpy interpreter's dense buffer."""
    from moe_cases import MoeCase, feeds, model_text
    from parcomp.reference.numpy_ops import run_unsharded

    case = MoeCase(experts=experts, top_k=top_k, batch=3, seq=5, hidden=4, inter=6, capacity=0, ep=1, skew=skew)
    c, mod, text = _forward_program(model_text(case), tmp_path, f"fw{experts}{top_k}")
    assert "# MoE: dropless" in text
    f = feeds(c.logical, case, 0)
    want = run_unsharded(c.logical, f)["output"]
    p = {n.name: torch.from_numpy(f[n.name]) for n in c.logical.params}
    got = mod.forward(p, {"x": torch.from_numpy(f["x"])})["output"]
    assert_equivalent(got.numpy(), want, what="output")


def test_a_reduction_over_the_slots_keeps_the_program_dense(tmp_path):
    """A sum over the slot dim has no packed form here: the whole program keeps the dense
    buffer and its first comment line names the statement."""
    from moe_cases import MoeCase, feeds, model_text
    from parcomp.reference.numpy_ops import run_unsharded

    case = MoeCase(experts=4, top_k=2, batch=2, seq=4, hidden=4, inter=6, capacity=0, ep=1)
    text = model_text(case).replace("return %output\n", "%load: f32[4,6] = sum(%a) {dims=(1,)}\n"
                                    "return %output, %load\n")
    c, mod, program = _forward_program(text, tmp_path, "fallback")
    assert "# MoE: the dense slot buffer [B, E, C, H]: %load: sum of slots" in program
    f = feeds(c.logical, case, 0)
    p = {n.name: torch.from_numpy(f[n.name]) for n in c.logical.params}
    got = mod.forward(p, {"x": torch.from_numpy(f["x"])})
    for name, want in run_unsharded(c.logical, f).items():
        assert_equivalent(got[name].numpy(), want, what=name)
