"""The torch backend: emitted program.py text (golden, determinism, profiles) and torchrun runs.

Every run launches real processes with torchrun under gloo on CPU and compares the
assembled outputs with the unsharded model (numpy reference or the torch module).
Set PARCOMP_ACCEPT=1 to rewrite the golden program after a deliberate change.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from parcomp.cli.commands import feeds_for  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir import LAYOUT_OPS, OPS, Node, TensorType, make_attrs, parse_graph  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402
from parcomp.reference.numpy_ops import NUMPY_OPS  # noqa: E402
from parcomp.spec import load_spec, parse_spec  # noqa: E402
from parcomp_backends.torch import PROFILES, assemble_outputs, emit_program, run_torchrun  # noqa: E402
from parcomp_backends.torch.emit import OP_FORMATS, node_code  # noqa: E402
from parcomp_backends.torch.emit.norms import NORM_FORMATS  # noqa: E402
from parcomp_backends.torch.emit.reduce import REDUCE_FORMATS  # noqa: E402
from parcomp_backends.torch.launch import write_checkpoint, write_program  # noqa: E402

from numerics import assert_equivalent  # noqa: E402

ROOT = Path(__file__).resolve().parents[1].parent
SPECS = ROOT / "specs"
GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "tiny_relu_mlp_tp2.program.py"
TIMEOUT = 180

TINY = """\
%x: f32[1,2] = input()
%fc1.weight: f32[4,2] = param()
%t: f32[2,4] = permute(%fc1.weight) {perm=(1, 0)}
%h: f32[1,4] = matmul(%x, %t)
%r: f32[1,4] = relu(%h)
%fc2.weight: f32[2,4] = param()
%t2: f32[4,2] = permute(%fc2.weight) {perm=(1, 0)}
%output: f32[1,2] = matmul(%r, %t2)
return %output
"""
TINY_PARAMS = {"fc1.weight": np.array([[1, 2, 0, 1], [0, 1, 3, 2]], "f4").T,
               "fc2.weight": np.array([[1, 0], [0, 1], [1, 1], [2, 0]], "f4").T}
TINY_X = np.array([[1, 2]], "f4")

MLP = """\
%x: f32[4,8] = input()
%fc1.weight: f32[16,8] = param()
%fc1.bias: f32[16] = param()
%t1: f32[8,16] = permute(%fc1.weight) {perm=(1, 0)}
%mm1: f32[4,16] = matmul(%x, %t1)
%h: f32[4,16] = add(%mm1, %fc1.bias)
%a: f32[4,16] = gelu(%h) {approximate="tanh"}
%fc2.weight: f32[8,16] = param()
%fc2.bias: f32[8] = param()
%t2: f32[16,8] = permute(%fc2.weight) {perm=(1, 0)}
%mm2: f32[4,8] = matmul(%a, %t2)
%y: f32[4,8] = add(%mm2, %fc2.bias)
return %y as output
"""
MLP_TP4 = "mesh tp=4\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\noutput output replicated\n"

# every layout op on a 2x2 mesh: nested shards, all_gather on dims 0 and 1, all_to_all,
# reduce_scatter of a partial-sum param, shard_slice on both axes, a partial output
MIX = """\
%x: f32[4,8] = input()
%w: f32[4,8] = input()
%x2: f32[4,8] = input()
%b: f32[8] = param()
%y: f32[4,8] = relu(%x)
%z: f32[4,8] = tanh(%x2)
%v: f32[4,8] = sigmoid(%w)
%u: f32[4,8] = add(%v, %b)
%m: f32[4,8] = exp(%w)
return %y as gathered, %z as swapped, %u as sliced, %m as masked
"""
MIX_SPEC = """\
mesh dp=2 tp=2
input x [S(0), S(0)]
input w [S(1), R]
input x2 [S(0), R]
param b partial-sum over tp
output gathered replicated
output swapped [S(1), R]
output sliced [S(0), S(1)]
output masked [R, P]
"""


def tiny_compiled():
    return compile_graph(parse_graph(TINY, "tiny_relu_mlp.pcir"), load_spec(SPECS / "tiny_relu_mlp_tp2.pcs"))


def run_ok(compiled, tmp_path, nproc, checkpoint, inputs, extra_args=(), profile="cpu"):
    """Emit, launch, assert success, return (assembled outputs, program text, process result)."""
    write_program(compiled, tmp_path, profile)
    res = run_torchrun(tmp_path, nproc, checkpoint, inputs, tmp_path / "out.pt", extra_args,
                       timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    return assemble_outputs(tmp_path / "out.pt", compiled.program), res


def unsharded(graph, feeds) -> dict:
    """numpy reference outputs by public name."""
    out = run_unsharded(graph, feeds)
    return {pub: out[pub] if pub in out else out[val] for pub, val in graph.named_outputs()}




# --- program text ---------------------------------------------------------------------


def test_worked_example_text_matches_golden_and_is_deterministic():
    text = emit_program(tiny_compiled(), "cpu", model="tiny_relu_mlp.pcir")
    assert text == emit_program(tiny_compiled(), "cpu", model="tiny_relu_mlp.pcir")
    calls = [ln for ln in text.splitlines() if re.search(r"=\s*all_reduce_?\(", ln)]
    assert len(calls) == 1 and "# [R] f32[1,2]" in calls[0]
    assert not re.search(r"^\s*(import|from) parcomp", text, re.M)
    assert "bytes/rank 8" in text and str(ROOT) not in text
    compile(text, "program.py", "exec")
    if os.environ.get("PARCOMP_ACCEPT") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(text)
    assert GOLDEN.exists(), "no golden yet: run with PARCOMP_ACCEPT=1"
    assert text == GOLDEN.read_text(), "program changed; rerun with PARCOMP_ACCEPT=1 if intended"


def test_collective_comments_name_the_programs_variables():
    """A reason names values as program.py spells them (``c_proj_matmul``), not as IR values
    (``%addmm_1_mm``) the reader cannot find; an IR name survives only if the program lacks it."""
    text = (GOLDEN.parent / "gpt2_mlp_tp2.cpu.program.py").read_text()
    comments = " ".join(ln for ln in text.splitlines() if ln.strip().startswith("#"))
    assert "c_proj_matmul: its matmul contracts" in comments and "add c_proj_add needs" in comments
    defined = set(re.findall(r"^\s+(\w+) = ", text, re.M))
    assert not [m for m in re.findall(r"%([\w.]+)", comments) if m in defined]


def test_profiles_differ_only_inside_the_profile_block():
    texts = {name: emit_program(tiny_compiled(), name) for name in PROFILES}
    assert {"cpu", "cuda", "ascend"} <= set(texts)

    def outside(text):
        return re.sub(r"# ---- PROFILE .*?# ---- end of PROFILE ----", "", text, flags=re.S)

    assert len({outside(t) for t in texts.values()}) == 1
    assert 'DIST_BACKEND = "nccl"' in texts["cuda"] and 'PRELUDE = ("torch_npu",)' in texts["ascend"]


def test_names_are_valid_unique_identifiers():
    g = parse_graph("%0.in: f32[2] = input()\n%lambda: f32[2] = relu(%0.in)\n"
                    "%lambda_: f32[2] = tanh(%lambda)\n%all_reduce: f32[2] = neg(%lambda_)\n"
                    "return %all_reduce as out\n")
    c = compile_graph(g, parse_spec("mesh tp=2\ninput 0.in replicated\noutput out replicated\n", "n.pcs"))
    text = emit_program(c)
    compile(text, "program.py", "exec")
    assert "_0_in = inp[" in text and "lambda_ = torch.relu(_0_in)" in text
    assert "lambda__1 = torch.tanh(lambda_)" in text and "all_reduce_ = torch.neg(lambda__1)" in text


def test_op_without_torch_mapping_is_an_emit_error():
    from parcomp_backends.torch import EmitError

    node = Node("loss", "no_such_op", ("a0", "a1"), TensorType((2,)))
    with pytest.raises(EmitError, match="'no_such_op' .* no torch mapping"):
        node_code(node, ["a0", "a1"])


# every compute op of the table, evaluated with torch, equals the numpy reference
LOWERED = [op for op, d in OPS.items() if d.kind == "lowered"]
_UNARY = ((2, 3),)
_BINARY = ((2, 3), (2, 3))
OP_CASES = {  # op: (operand shapes, result shape, attrs)
    "gelu": (_UNARY, (2, 3), {}), "gelu_tanh": (_UNARY, (2, 3), {"approximate": "tanh"}),
    "pow": (_UNARY, (2, 3), {"exponent": 3.0}), "add_scalar": (_UNARY, (2, 3), {"value": 1.5}),
    "scale": (_UNARY, (2, 3), {"value": -0.5}), "matmul": (((2, 3), (3, 4)), (2, 4), {}),
    "permute": (((2, 3, 4),), (4, 2, 3), {"perm": (2, 0, 1)}), "reshape": (_UNARY, (3, 2), {}),
    "sum": (((2, 3, 4),), (2,), {"dims": (1, 2)}), "sum_none": (_UNARY, (2, 3), {"dims": ()}),
    "expand": (((2,),), (2, 3), {"dims": (1,)}), "ones": ((), (2, 3), {}),
    "pow_grad": (_BINARY, (2, 3), {"exponent": 3.0}),
    # attention part
    "slice": (_UNARY, (2, 1), {"dim": 1, "start": 1, "stop": 3, "step": 2}),
    "slice_grad": (((2, 2),), (2, 4), {"dim": 1, "start": 1, "stop": 4, "step": 2}),
    "cat": (((2, 3), (2, 1), (2, 2)), (2, 6), {"dim": 1}),
    "sdpa": (((2, 2, 3, 4),) * 3, (2, 2, 3, 4), {"causal": True, "scale": 0.4}),
    "sdpa_grad": (((2, 2, 3, 4),) * 4, (2, 2, 3, 4), {"causal": True, "scale": 0.4, "wrt": "k"}),
    "arange": ((), (5,), {"start": 1, "step": 0.5}),
    # model-computed loss: transformers pads the labels before shifting them
    "pad": (_UNARY, (2, 6), {"dim": 1, "before": 1, "after": 2, "value": 0.5}),
}


# ops with int64 or 3-4 operands are checked with proper operands in test_torch_training.py
# (lowered ops: tests/passes/test_lowering.py)
COMPUTE_OPS = sorted(set(OP_FORMATS) - set(LAYOUT_OPS) - {"relayout", "adamw_param", "cross_entropy",
                                                            "cross_entropy_grad"} - set(LOWERED)
                     - set(NORM_FORMATS)  # norms + embedding part: in test_torch_training.py
                     - set(REDUCE_FORMATS)  # reductions part: tests/rules/test_reductions.py
                     - {"clip_coef"}  # a sum of squares (>= 0), in test_torch_training.py
                     # fp16 loss scaling: scalar scaler state operands; program.py runs them
                     # against torch's GradScaler in tests/training/test_precision.py
                     - {"amp_ratio", "amp_select", "amp_tracker"}
                     # MoE: routing weights, int capacities and ragged sizes as operands;
                     # program.py runs them against the interpreter in tests/moe/test_moe.py (torchrun)
                     - {"moe_route", "moe_route_grad", "moe_dispatch", "moe_combine", "moe_combine_grad_c",
                        "all_to_all_ragged"}
                     # ring attention / balanced chunking: point-to-point inside the op, a
                     # process group; program.py runs them in tests/context_parallel/test_cp_ring.py (torchrun)
                     - {"sdpa_ring", "sdpa_grad_ring", "arange_balanced"})


@pytest.mark.parametrize("case", sorted(set(OP_CASES) | set(COMPUTE_OPS)))
def test_op_table_matches_numpy(case):
    op = case.split("_tanh")[0].replace("sum_none", "sum")
    binary = op in ("add", "sub", "mul", "div") or op.endswith("_grad")
    shapes, out, attrs = OP_CASES.get(case, (_BINARY if binary else _UNARY, (2, 3), {}))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal(s).astype("f4") + (3 if op == "div" and i else 0) for i, s in enumerate(shapes)]
    node = Node("y", op, tuple(f"a{i}" for i in range(len(xs))), TensorType(out), make_attrs(**attrs))
    env = {"torch": torch, "DEVICE": torch.device("cpu")}
    env.update({f"a{i}": torch.tensor(x) for i, x in enumerate(xs)})
    got = eval(node_code(node, [f"a{i}" for i in range(len(xs))]), env)  # noqa: S307 - our own table
    want = NUMPY_OPS[node.op](xs, node)
    assert tuple(got.shape) == tuple(np.shape(want))
    assert_equivalent(got.numpy(), want, what=case)


# --- torchrun runs --------------------------------------------------------------------


@pytest.mark.slow
def test_worked_example_on_two_gloo_ranks(tmp_path):
    out, _ = run_ok(tiny_compiled(), tmp_path, 2, TINY_PARAMS, {"x": TINY_X})
    assert out["output"].tolist() == [[17.0, 10.0]]


@pytest.mark.slow
def test_cuda_profile_runs_on_cpu_with_safetensors_and_bench(tmp_path):
    ckpt = write_checkpoint(TINY_PARAMS, tmp_path / "model.safetensors")
    torch.save(torch.tensor(TINY_X), tmp_path / "x.pt")  # a bare tensor: the only input
    out, res = run_ok(tiny_compiled(), tmp_path, 2, ckpt, str(tmp_path / "x.pt"),
                      ("--device", "cpu", "--bench", "2"), profile="cuda")
    assert out["output"].tolist() == [[17.0, 10.0]]
    steps = [json.loads(ln) for ln in res.stdout.splitlines() if ln.startswith('{"step_ms"')]
    assert len(steps) == 1 and len(steps[0]["step_ms"]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [3])
def test_world_size_mismatch_is_a_clear_error(tmp_path, nproc):
    write_program(tiny_compiled(), tmp_path)
    res = run_torchrun(tmp_path, nproc, TINY_PARAMS, {"x": TINY_X}, timeout=TIMEOUT)
    assert res.returncode != 0
    assert (f"program compiled for mesh tp=2 (2 ranks) but started with WORLD_SIZE={nproc}; "
            "run: torchrun --nproc-per-node 2 program.py") in res.stderr


@pytest.mark.slow
def test_output_into_a_missing_directory_fails_before_computing(tmp_path):
    write_program(tiny_compiled(), tmp_path)
    res = run_torchrun(tmp_path, 2, TINY_PARAMS, {"x": TINY_X}, str(tmp_path / "nodir" / "out.pt"),
                       timeout=TIMEOUT)
    assert res.returncode != 0 and "its directory does not exist" in res.stderr


@pytest.mark.slow
def test_missing_or_misshapen_param_is_a_clear_error(tmp_path):
    write_program(tiny_compiled(), tmp_path)
    bad = {"fc1.weight": TINY_PARAMS["fc1.weight"], "fc2.weight": np.zeros((4, 2), "f4")}
    res = run_torchrun(tmp_path, 2, bad, {"x": TINY_X}, timeout=TIMEOUT)
    assert res.returncode != 0
    assert "param 'fc2.weight' has shape [4, 2], expected the full (unsharded) shape [2, 4]" in res.stderr


@pytest.mark.slow
def test_mlp_on_four_ranks_matches_numpy(tmp_path):
    g = parse_graph(MLP, "mlp.pcir")
    c = compile_graph(g, parse_spec(MLP_TP4, "mlp_tp4.pcs"))
    rng = np.random.default_rng(0)
    feeds = {n.name: rng.standard_normal(n.type.shape).astype("f4") for n in g.inputs + g.params}
    out, _ = run_ok(c, tmp_path, 4, {n.name: feeds[n.name] for n in g.params}, {"x": feeds["x"]})
    assert_equivalent(out["output"], unsharded(g, feeds)["output"])


@pytest.mark.slow
def test_every_layout_op_on_a_2x2_mesh_matches_numpy(tmp_path):
    g = parse_graph(MIX, "mix.pcir")
    c = compile_graph(g, parse_spec(MIX_SPEC, "mix.pcs"))
    kinds = {n.op for n in c.program.nodes}
    assert {"all_gather", "all_to_all", "reduce_scatter", "shard_slice", "partial_mask"} <= kinds
    rng = np.random.default_rng(1)
    feeds = {n.name: rng.standard_normal(n.type.shape).astype("f4") for n in g.inputs + g.params}
    out, _ = run_ok(c, tmp_path, 4, {"b": feeds["b"]}, {"x": feeds["x"], "w": feeds["w"], "x2": feeds["x2"]})
    assert sorted(p.name for p in tmp_path.glob("out.rank*.pt")) == [f"out.rank{r}.pt" for r in range(4)]
    want = unsharded(g, feeds)
    for public in g.output_names:
        assert_equivalent(out[public], want[public], what=public)


# --- real torch modules through the torch.export frontend ------------------------------


def _factory(name):
    pytest.importorskip("parcomp.frontends.torch.export")
    spec = importlib.util.spec_from_file_location("parcomp_test_models", SPECS / "models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


@pytest.mark.slow
@pytest.mark.parametrize("factory,spec_name,nproc", [
    ("torch_mlp", "torch_mlp_tp2", 2),
    ("torch_mlp", "torch_mlp_tp4", 4),
    ("gpt2_mlp", "gpt2_mlp_tp2", 2),
    ("gpt2_mlp", "gpt2_mlp_tp2_seq", 2),
    ("gpt2_mlp", "gpt2_mlp_dp2_tp2", 4),
])
def test_real_module_matches_torch(tmp_path, factory, spec_name, nproc):
    if factory == "gpt2_mlp":
        pytest.importorskip("transformers")
    from parcomp.frontends.torch.export import import_torch

    module, example, names = _factory(factory)()
    c = compile_graph(import_torch(module, example, names), load_spec(SPECS / f"{spec_name}.pcs"))
    assert c.program.mesh.size == nproc
    out, _ = run_ok(c, tmp_path, nproc, module, dict(zip(names, example)))
    with torch.no_grad():
        want = module(*example).numpy()
    assert_equivalent(out["output"], want)
    sharded = any(f.name.startswith("out.rank") for f in tmp_path.iterdir())
    assert sharded == (spec_name in ("gpt2_mlp_tp2_seq", "gpt2_mlp_dp2_tp2"))
    if spec_name == "gpt2_mlp_tp2_seq":
        assert "= reduce_scatter(" in (tmp_path / "program.py").read_text()
