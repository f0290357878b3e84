"""ONNX frontend, transformer op set: GPT-2 and Llama exported with torch.onnx
compile with the shipped LM specs, run at TP=2 on the interpreter and equal onnxruntime on
the unsharded file; attention, RMSNorm and position ids are recognised; what is not
supported is a located error.

The exports use ``torch.onnx.export(..., dynamo=True, optimize=False)`` (names kept). The
TorchScript exporter (``dynamo=False``) cannot export transformers' models in torch 2.13:
their mask functions call ``aten::diff``, which it has no symbolic for.
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from parcomp.cli.main import main as cli  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.errors import FrontendError  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.frontends.onnx.frontend import load_onnx  # noqa: E402
from parcomp.reference.interpreter import run_spmd  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402

from numerics import assert_equivalent, assert_check_ok  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_onnx_lm_models", ROOT / "specs" / "models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

TRAIN_SPECS = {"gpt2_lm": "gpt2_lm_tp2_train.pcs", "llama_lm": "llama_lm_tp2_train.pcs"}
#: the Megatron plan's forward collectives: 2 all_reduce per block (attention out, MLP out)
PINNED = {"gpt2_lm": [("all_reduce", "tp", None, "forward", 2048, [16, 32])] * 4,
          "llama_lm": [("all_reduce", "tp", None, "forward", 4096, [2, 8, 64])] * 4}
#: IR ops each import must contain (how many): attention, norms, embeddings
OPS = {"gpt2_lm": {"sdpa": 2, "layer_norm": 5, "embedding": 2, "gelu": 2, "arange": 1},
       "llama_lm": {"sdpa": 2, "rms_norm": 5, "embedding": 1, "cos": 1, "sin": 1, "arange": 1}}


def forward_spec(name: str):
    """The shipped train spec's rules without its train line: the same TP=2 plan, one forward."""
    text = (ROOT / "specs" / TRAIN_SPECS[name]).read_text()
    return parse_spec("\n".join(l for l in text.splitlines() if not l.startswith("train")), TRAIN_SPECS[name])


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{factory name: (onnx path, module, input ids)}."""
    out = {}
    for name in TRAIN_SPECS:
        module, inputs, names = getattr(models, name)()
        path = tmp_path_factory.mktemp(name) / f"{name}.onnx"
        torch.onnx.export(module, inputs, dynamo=True, optimize=False, input_names=names,
                          output_names=["logits"], verbose=False).save(str(path))
        out[name] = (str(path), module, inputs[0])
    return out


def _collectives(compiled) -> list:
    return [(r["kind"], r["axis"], r.get("dim"), r["phase"], r["bytes"], list(r["local_shape"]))
            for r in compiled.report["collectives"]]


@pytest.mark.parametrize("name", sorted(TRAIN_SPECS))
def test_lm_export_at_tp2_equals_onnxruntime(exported, name):
    """GPT-2 / Llama from ONNX: attention becomes causal sdpa, norms one op each; the TP=2
    plan of the shipped spec (initializer names = state_dict names) has exactly the Megatron
    collectives, the same as the torch.export import; the sharded run equals onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    path, module, ids = exported[name]
    graph, model, _ = load_onnx(path)
    ops = [n.op for n in graph.nodes]
    assert {op: ops.count(op) for op in OPS[name]} == OPS[name]
    assert all(n.attr("causal") for n in graph.nodes if n.op == "sdpa")
    attn = "transformer.h.{}.attn" if name == "gpt2_lm" else "model.layers.{}.self_attn"
    assert [n.source for n in graph.nodes if n.op == "sdpa"] == [attn.format(i) for i in range(2)]
    assert {p.name for p in graph.params} <= set(module.state_dict()) | {"model.rotary_emb.inv_freq"}
    frozen = {p.name for p in graph.params if p.attr("trainable", True) is False}  # buffers
    assert frozen == ({"model.rotary_emb.inv_freq"} if name == "llama_lm" else set())
    spec = forward_spec(name)
    got = compile_graph(graph, spec)
    ref = compile_graph(load_model(f"{ROOT / 'specs' / 'models.py'}:{name}")[0], spec)
    assert _collectives(got) == PINNED[name]
    assert [c[:5] for c in _collectives(got)] == [c[:5] for c in _collectives(ref)]
    feeds = {**model.feeds(graph), "input_ids": ids.numpy()}
    out = run_spmd(got.program, feeds).outputs(got.program)["logits"]
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = sess.run(None, {"input_ids": ids.numpy()})[0]
    assert_equivalent(out, want, what="onnxruntime")
    with torch.no_grad():
        assert_equivalent(out, module(ids).logits.numpy())


@pytest.mark.parametrize("name", sorted(TRAIN_SPECS))
def test_shipped_train_spec_checks_the_onnx_export(exported, name, capsys):
    """``parcomp check model.onnx --spec specs/<lm>_tp2_train.pcs``: the natural spec, unchanged;
    4 all_reduce per block (2 forward, 2 backward), steps equal the unsharded ones."""
    rc = cli(["check", exported[name][0], "--spec", str(ROOT / "specs" / TRAIN_SPECS[name]), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert_check_ok(res)
    assert rc == 0 and res["steps"] == 2
    kinds = [(c["kind"], c["phase"]) for c in res["collectives"]]
    assert kinds == [("all_reduce", "forward")] * 4 + [("all_reduce", "backward")] * 4


# ---- small hand-written models: the patterns and the errors ----

def _attention_model(path, mask=None, key="transpose", scale_split=True, mask_input=False):
    """out = softmax(q k^T * s [+ mask]) v with q, k, v inputs [1, 2, 4, 8] (torch.onnx's form)."""
    shape = [1, 2, 4, 8]
    n = helper.make_node
    ins = [helper.make_tensor_value_info(v, TensorProto.FLOAT, shape) for v in "qkv"]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)
    inits = [numpy_helper.from_array(np.array(8 ** -0.25 if scale_split else 8 ** -0.5, np.float32), "s"),
             numpy_helper.from_array(np.array(0.0, np.float32), "zero")]
    nodes = [n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])] if key == "transpose" else [
        n("Reshape", ["k", "s3"], ["k3"]), n("Transpose", ["k3"], ["k3t"], perm=[0, 2, 1]),
        n("Reshape", ["k3t", "s4"], ["kt"])]
    inits += [numpy_helper.from_array(np.array([2, 4, 8]), "s3"),
              numpy_helper.from_array(np.array([1, 2, 8, 4]), "s4")]
    if scale_split:
        nodes += [n("Mul", ["q", "s"], ["qs"]), n("Mul", ["kt", "s"], ["ks"]), n("MatMul", ["qs", "ks"], ["sc"])]
    else:
        nodes += [n("MatMul", ["q", "kt"], ["mm"]), n("Mul", ["mm", "s"], ["sc"])]
    scores = "sc"
    if mask is not None:
        if mask_input:
            ins.append(helper.make_tensor_value_info("mask", TensorProto.FLOAT, list(mask.shape)))
        else:
            inits.append(numpy_helper.from_array(mask.astype(np.float32), "mask"))
        nodes.append(n("Add", ["sc", "mask"], ["masked"]))
        scores = "masked"
    nodes += [n("Softmax", [scores], ["p"], "attn_softmax", axis=-1), n("IsNaN", ["p"], ["nan"]),
              n("Where", ["nan", "zero", "p"], ["pz"]), n("MatMul", ["pz", "v"], ["out"], "attn_out")]
    g = helper.make_graph(nodes, "attn", ins, [out], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return str(path)


def _causal_bias(s=4):
    return np.where(np.tril(np.ones((s, s), bool)), 0.0, -np.inf)[None, None]


@pytest.mark.parametrize("mask, key, split, causal", [
    (None, "transpose", True, False), ("causal", "transpose", True, True),
    ("causal", "reshape", True, True), ("causal", "transpose", False, True),
    ("zeros", "reshape", False, False)])
def test_attention_formula_becomes_one_sdpa(tmp_path, mask, key, split, causal):
    m = {"causal": _causal_bias(), "zeros": np.zeros((1, 1, 4, 4)), None: None}[mask]
    graph, model, _ = load_onnx(_attention_model(tmp_path / "a.onnx", m, key, split))
    ops = [n.op for n in graph.nodes if n.op != "input"]
    assert ops == ["sdpa"]
    assert graph.nodes[-1].attr("causal") is causal and math.isclose(graph.nodes[-1].attr("scale"), 8 ** -0.5,
                                                                       rel_tol=1e-6)
    feeds = model.feeds(graph)
    assert_equivalent(run_unsharded(graph, feeds)["out"], model.reference_outputs(graph, feeds)["out"], what="reference")


@pytest.mark.parametrize("kind, words", [
    ("padding", "attention's mask is neither causal nor all kept"),
    ("bias", "attention's mask is a float bias, not 0 / -inf"),
    ("input", "attention's mask 'mask' is computed at run time")])
def test_unsupported_attention_masks_are_located_errors(tmp_path, kind, words):
    m = _causal_bias()
    if kind == "padding":
        m = np.zeros((1, 1, 4, 4))
        m[..., 3] = -np.inf
    elif kind == "bias":
        m = np.full((1, 1, 4, 4), 0.5)
    path = _attention_model(tmp_path / "a.onnx", m, mask_input=kind == "input")
    with pytest.raises(FrontendError) as e:
        load_onnx(path)
    assert f"{path}: node 'attn_out' (parcomp.Attention -> out)" in e.value.message and words in e.value.message


def _rms_model(path, form: str):
    """y = w * x / sqrt(mean(x^2, -1) + eps), x [2, 3, 8], in one of the written-out forms."""
    n = helper.make_node
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8])
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "norm.weight"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
             numpy_helper.from_array(np.array([-1]), "axes"),
             numpy_helper.from_array(np.array(-0.5, np.float32), "mhalf")]
    nodes = [n("Pow", ["x", "two"], ["x2"]) if form != "mulxx" else n("Mul", ["x", "x"], ["x2"]),
             n("ReduceMean", ["x2", "axes"], ["ms"], keepdims=1), n("Add", ["eps", "ms"], ["s"])]
    if form == "div":
        nodes += [n("Sqrt", ["s"], ["r"]), n("Div", ["x", "r"], ["xn"])]
    elif form == "pow":
        nodes += [n("Pow", ["s", "mhalf"], ["r"]), n("Mul", ["r", "x"], ["xn"])]
    else:
        nodes += [n("Sqrt", ["s"], ["sq"]), n("Reciprocal", ["sq"], ["r"]), n("Mul", ["x", "r"], ["xn"])]
    nodes.append(n("Mul", ["norm.weight", "xn"], ["y"]))
    g = helper.make_graph(nodes, "rms", [x], [y], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
    return str(path)


@pytest.mark.parametrize("form", ["reciprocal", "div", "pow", "mulxx"])
def test_rms_norm_written_out_becomes_one_rms_norm(tmp_path, form):
    graph, model, _ = load_onnx(_rms_model(tmp_path / "r.onnx", form))
    assert [(n.op, n.inputs) for n in graph.nodes if n.op not in ("input", "param")] == \
        [("rms_norm", ("x", "norm.weight"))]
    assert math.isclose(graph.nodes[-1].attr("eps"), 1e-6, rel_tol=1e-6)
    feeds = model.feeds(graph)
    assert_equivalent(run_unsharded(graph, feeds)["y"], model.reference_outputs(graph, feeds)["y"], what="reference")


def test_position_ids_become_arange_and_other_constant_tensors_are_located_errors(tmp_path):
    """A constant that is an arange along one axis (position ids) is rebuilt as ops; any
    other constant tensor operand is an error naming the node and the operand."""
    n = helper.make_node
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    for values, ok in ((np.arange(4.0)[None].repeat(2, 0), True), (np.array([[1., 5, 2, 0]] * 2), False)):
        c = numpy_helper.from_array(values.astype(np.float32))
        g = helper.make_graph([n("Constant", [], ["pos"], value=c), n("Add", ["x", "pos"], ["y"], "add_pos")],
                              "g", [x], [y])
        path = tmp_path / f"p{ok}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), str(path))
        if ok:
            graph, model, _ = load_onnx(str(path))
            assert [n.op for n in graph.nodes] == ["input", "arange", "expand", "add"]
            feeds = model.feeds(graph)
            np.testing.assert_array_equal(run_unsharded(graph, feeds)["y"], model.reference_outputs(graph, feeds)["y"])
        else:
            with pytest.raises(FrontendError) as e:
                load_onnx(str(path))
            assert "node 'add_pos' (Add -> y): operand 'pos' is a constant float32[2, 4]" in e.value.message


def test_unsupported_op_in_an_lm_is_located_and_lists_the_transformer_ops(tmp_path, capsys):
    n = helper.make_node
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    g = helper.make_graph([n("Softmax", ["x"], ["p"], "sm", axis=-1), n("Erf", ["p"], ["y"], "blk.erf")],
                          "g", [x], [y])
    path = str(tmp_path / "e.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), path)
    assert cli(["compile", path, "--spec", str(ROOT / "specs" / "torch_mlp_tp2.pcs"), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: node 'blk.erf' (Erf -> y): no rule for ONNX op Erf" in err and "Traceback" not in err
    for op in ("Gather", "LayerNormalization", "RMSNormalization", "Softmax", "Slice", "Split", "Concat",
               "Expand", "Where", "ReduceMean", "Cos", "Sin"):
        assert op in err


@pytest.mark.slow
def test_gpt2_onnx_under_torchrun_two_gloo_ranks_equals_onnxruntime(exported, tmp_path):
    """The GPT-2 export's TP=2 program under torchrun (weights read from the .onnx file,
    fused c_attn sliced per part on load) equals onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    from parcomp_backends.torch import emit_program
    from parcomp_backends.torch.launch import assemble_outputs, run_torchrun

    path, module, ids = exported["gpt2_lm"]
    graph, model, _ = load_onnx(path)
    c = compile_graph(graph, forward_spec("gpt2_lm"))
    (tmp_path / "program.py").write_text(emit_program(c, "cpu", model=Path(path).name))
    proc = run_torchrun(tmp_path, 2, path, {"input_ids": ids}, tmp_path / "out.pt", extra_args=("--device", "cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = assemble_outputs(tmp_path / "out.pt", c.program)["logits"]
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input_ids": ids.numpy()})[0]
    feeds = {**model.feeds(graph), "input_ids": ids.numpy()}
    assert_equivalent(out, want, what="onnxruntime")


@pytest.mark.parametrize("name", sorted(TRAIN_SPECS))
def test_eager_attention_export_becomes_sdpa_too(tmp_path, name):
    """transformers' eager attention (``matmul * scaling + mask``, softmax in float32 cast
    back, eval-mode dropout as Identity, a finfo.min mask) exports to another formula; it
    is recognised as causal sdpa as well and equals onnxruntime."""
    ort = pytest.importorskip("onnxruntime")
    module, inputs, names = getattr(models, name)()
    module.config._attn_implementation = "eager"
    path = str(tmp_path / f"{name}_eager.onnx")
    torch.onnx.export(module, inputs, dynamo=True, optimize=False, input_names=names,
                      output_names=["logits"], verbose=False).save(path)
    assert "IsNaN" not in {n.op_type for n in onnx.load(path).graph.node}  # not the sdpa formula
    graph, model, _ = load_onnx(path)
    assert [n.attr("causal") for n in graph.nodes if n.op == "sdpa"] == [True, True]
    feeds = {**model.feeds(graph), "input_ids": inputs[0].numpy()}
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = sess.run(None, {"input_ids": feeds["input_ids"]})[0]
    assert_equivalent(run_unsharded(graph, feeds)["logits"], want, what="onnxruntime")


def test_buffers_are_frozen_scaled_weights_are_not(tmp_path):
    """y = x @ (W * 0.5) + cos(inv * [1, 2, 3, 4]): ``inv`` (combined with a constant tensor,
    as RoPE's ``inv_freq``) is a ``{trainable=false}`` param; ``W`` (scaled by a scalar, then a
    MatMul operand) stays trainable."""
    n = helper.make_node
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "inv"),
             numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    pos = numpy_helper.from_array(np.arange(1, 5).astype(np.float32))
    nodes = [n("Mul", ["W", "half"], ["Ws"]), n("MatMul", ["x", "Ws"], ["mm"]),
             n("Constant", [], ["pos"], value=pos), n("Mul", ["inv", "pos"], ["f"]), n("Cos", ["f"], ["c"]),
             n("Add", ["mm", "c"], ["y"])]
    path = str(tmp_path / "b.onnx")
    onnx.save(helper.make_model(helper.make_graph(nodes, "g", [x], [y], inits),
                                opset_imports=[helper.make_opsetid("", 18)]), path)
    graph, model, _ = load_onnx(path)
    assert {p.name: p.attr("trainable", True) for p in graph.params} == {"W": True, "inv": False}
    feeds = model.feeds(graph)
    assert_equivalent(run_unsharded(graph, feeds)["y"], model.reference_outputs(graph, feeds)["y"], what="reference")
