"""ONNX frontend: torch.onnx exports compile with the torch specs, equal results
(interpreter, onnx's reference evaluator, onnxruntime, torchrun), weight orientation by
use, GELU patterns, located errors.

The ONNX files are exported at test time into temporary directories
(``torch.onnx.export(..., dynamo=True, optimize=False)``: the optimizer would fold
``Transpose(0.weight)`` into a new initializer and lose the state_dict name).
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
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from parcomp.cli.main import main as cli  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.errors import FrontendError  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.frontends.onnx.frontend import OnnxModel, load_onnx  # noqa: E402
from parcomp.reference.interpreter import run_spmd  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402
from parcomp.spec import load_spec, parse_spec  # noqa: E402

from numerics import assert_equivalent  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_onnx_test_models", ROOT / "specs" / "models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

SPECS = {"gpt2_mlp": "gpt2_mlp_tp2.pcs", "torch_mlp": "torch_mlp_tp2.pcs"}
#: the one collective each Megatron MLP needs: (kind, axis, dim, phase, bytes/rank, local shape)
PINNED = {"gpt2_mlp": [("all_reduce", "tp", None, "forward", 2048, [16, 32])],
          "torch_mlp": [("all_reduce", "tp", None, "forward", 2048, [2, 8, 32])]}


def export(module, inputs, names, path, external=False) -> str:
    """``module`` exported with torch.onnx (dynamo, names kept) to ``path``."""
    prog = torch.onnx.export(module, inputs, dynamo=True, optimize=False, input_names=names,
                             output_names=["output"], verbose=False)
    prog.save(str(path), external_data=external)
    return str(path)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{factory name: (onnx path, module, inputs, names)}; gpt2_mlp's weights as external data."""
    out = {}
    for name in SPECS:
        module, inputs, names = getattr(models, name)()
        d = tmp_path_factory.mktemp(name)
        out[name] = (export(module, inputs, names, d / f"{name}.onnx", external=name == "gpt2_mlp"),
                     module, inputs, names)
    return out


def _collectives(compiled) -> list:
    return [(r["kind"], r["axis"], r.get("dim"), r["phase"], r["bytes"], list(r["local_shape"]))
            for r in compiled.report["collectives"]]


def _torch_out(module, inputs) -> np.ndarray:
    with torch.no_grad():
        return module(*inputs).numpy()


@pytest.mark.parametrize("name", sorted(SPECS))
def test_export_compiles_with_the_torch_spec(exported, name):
    """Same spec, same params (state_dict names), same collectives as the torch version;
    the sharded program on the interpreter equals the torch module."""
    path, module, inputs, names = exported[name]
    spec = load_spec(str(ROOT / "specs" / SPECS[name]))
    graph, model, _ = load_onnx(path)
    assert isinstance(model, OnnxModel)
    assert {p.name for p in graph.params} == set(module.state_dict())
    assert [n.name for n in graph.inputs] == ["x"] and graph.output_names == ("output",)
    got = compile_graph(graph, spec)
    ref = compile_graph(load_model(f"{ROOT / 'specs' / 'models.py'}:{name}")[0], spec)
    assert _collectives(got) == _collectives(ref) == PINNED[name]
    feeds = model.feeds(graph)
    feeds["x"] = inputs[0].numpy()
    for p in graph.params:  # the file holds the module's weights
        np.testing.assert_array_equal(feeds[p.name], module.state_dict()[p.name].numpy())
    out = run_spmd(got.program, feeds).outputs(got.program)["output"]
    assert_equivalent(out, _torch_out(module, inputs))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_unsharded_import_equals_onnx_reference_and_onnxruntime(exported, name):
    """The imported graph on the numpy interpreter equals onnx.reference.ReferenceEvaluator
    and onnxruntime on the same inputs."""
    ort = pytest.importorskip("onnxruntime")
    path = exported[name][0]
    graph, model, _ = load_onnx(path)
    feeds = model.feeds(graph, seed=3)
    got = run_unsharded(graph, feeds)["output"]
    assert_equivalent(got, model.reference_outputs(graph, feeds)["output"], what="reference")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert_equivalent(got, sess.run(None, {"x": feeds["x"]})[0], what="onnxruntime")


def _write(model, path) -> str:
    onnx.save(model, str(path))
    return str(path)


def _linear_model(stored: str, path, opset=17):
    """x[4,8] -> (Gemm transB=1 with W1 [16,8] | MatMul with W1 [8,16]) -> Relu -> MatMul W2 [16,8]."""
    rng = np.random.default_rng(0)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w1 = rng.standard_normal((16, 8) if stored == "out_in" else (8, 16)).astype(np.float32)
    first = (helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], "fc1", transB=1)
             if stored == "out_in" else helper.make_node("MatMul", ["x", "fc1.weight"], ["h0"], "fc1")
             )
    nodes = [first] if stored == "out_in" else [first, helper.make_node("Add", ["h0", "fc1.bias"], ["h"], "b1")]
    nodes += [helper.make_node("Relu", ["h"], ["r"], "relu"),
              helper.make_node("MatMul", ["r", "fc2.weight"], ["y"], "fc2")]
    inits = [numpy_helper.from_array(w1, "fc1.weight"),
             numpy_helper.from_array(rng.standard_normal(16).astype(np.float32), "fc1.bias"),
             numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "fc2.weight")]
    g = helper.make_graph(nodes, "mlp", [x], [y], inits)
    return _write(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), path)


@pytest.mark.parametrize("stored, dim", [("out_in", 0), ("in_out", 1)])
def test_colwise_rowwise_resolve_by_use(tmp_path, stored, dim):
    """Gemm transB=1 (weight [out, in]) and MatMul (weight [in, out]): colwise splits the
    output features wherever they are stored; rowwise the input features; one all_reduce."""
    path = _linear_model(stored, tmp_path / "m.onnx")
    graph, model, _ = load_onnx(path)
    spec = parse_spec("mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\ninput x replicated\n"
                      "output y replicated\n", "t.pcs")
    c = compile_graph(graph, spec)
    layout = {n.name: str(n.layout) for n in c.sharded.nodes}
    assert c.sharded["fc1.weight"].layout[0].dim == dim
    assert c.sharded["fc1.bias"].layout[0].dim == 0, layout
    assert c.sharded["fc2.weight"].layout[0].dim == 0
    assert [r["kind"] for r in c.report["collectives"]] == ["all_reduce"]
    feeds = model.feeds(graph)
    out = run_spmd(c.program, feeds).outputs(c.program)["y"]
    assert_equivalent(out, model.reference_outputs(graph, feeds)["y"])


def _gelu_model(kind: str, path) -> str:
    """y = GELU(x) written out as exporters do, in a few orders; x [2, 16]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 16])

    def c(name, v):
        return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v, np.float32)))
    n = helper.make_node
    if kind == "erf_div":  # torch.onnx (TorchScript): x * (1 + erf(x / sqrt2)) * 0.5
        nodes = [c("s", math.sqrt(2)), n("Div", ["x", "s"], ["d"]), n("Erf", ["d"], ["e"]),
                 c("one", 1.0), n("Add", ["e", "one"], ["a"]), n("Mul", ["x", "a"], ["m"]),
                 c("h", 0.5), n("Mul", ["m", "h"], ["y"], "gelu_root")]
    elif kind == "erf_mul":  # 0.5 * x first, then (1 + erf(x * 0.7071))
        nodes = [c("h", 0.5), n("Mul", ["h", "x"], ["hx"]), c("r", 1 / math.sqrt(2)),
                 n("Mul", ["x", "r"], ["d"]), n("Erf", ["d"], ["e"]), c("one", 1.0),
                 n("Add", ["one", "e"], ["a"]), n("Mul", ["hx", "a"], ["y"], "gelu_root")]
    elif kind == "tanh_cube":  # x * x * x instead of Pow
        nodes = [n("Mul", ["x", "x"], ["x2"]), n("Mul", ["x2", "x"], ["x3"]), c("k", 0.044715),
                 n("Mul", ["x3", "k"], ["kx3"]), n("Add", ["x", "kx3"], ["s"]),
                 c("c", math.sqrt(2 / math.pi)), n("Mul", ["c", "s"], ["t"]), n("Tanh", ["t"], ["th"]),
                 c("one", 1.0), n("Add", ["th", "one"], ["a"]), c("h", 0.5), n("Mul", ["x", "h"], ["hx"]),
                 n("Mul", ["hx", "a"], ["y"], "gelu_root")]
    else:  # "erf_wrong": 0.6 instead of 0.5 is not GELU
        nodes = [c("s", math.sqrt(2)), n("Div", ["x", "s"], ["d"]), n("Erf", ["d"], ["e"], "the_erf"),
                 c("one", 1.0), n("Add", ["e", "one"], ["a"]), n("Mul", ["x", "a"], ["m"]),
                 c("h", 0.6), n("Mul", ["m", "h"], ["y"])]
    g = helper.make_graph(nodes, "gelu", [x], [y])
    return _write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.mark.parametrize("kind, approx", [("erf_div", "none"), ("erf_mul", "none"), ("tanh_cube", "tanh")])
def test_gelu_exporter_patterns_become_one_gelu(tmp_path, kind, approx):
    graph, model, _ = load_onnx(_gelu_model(kind, tmp_path / "g.onnx"))
    assert [(n.op, n.attr("approximate")) for n in graph.nodes] == [("input", None), ("gelu", approx)]
    feeds = model.feeds(graph)
    got = run_unsharded(graph, feeds)["y"]
    assert_equivalent(got, model.reference_outputs(graph, feeds)["y"])


def test_a_formula_that_is_not_gelu_is_not_rewritten(tmp_path):
    with pytest.raises(FrontendError) as e:
        load_onnx(_gelu_model("erf_wrong", tmp_path / "g.onnx"))
    assert "node 'the_erf' (Erf -> e)" in e.value.message and "no rule for ONNX op Erf" in e.value.message


def test_op_without_rule_is_a_located_error(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["r"], "act"),
                           helper.make_node("Hardmax", ["r"], ["y"], "attn_hardmax", axis=-1)], "g", [x], [y])
    path = _write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "s.onnx")
    with pytest.raises(FrontendError) as e:
        load_onnx(path)
    msg = e.value.message
    assert f"{path}: node 'attn_hardmax' (Hardmax -> y): no rule for ONNX op Hardmax" in msg
    assert "supported ops: Add, Cast, CastLike, Concat, Constant," in msg and "MatMul" in msg
    assert "Softmax" in msg and "LayerNormalization" in msg and "Gather" in msg
    assert e.value.where == f"{path}: node attn_hardmax"
    assert cli(["check", path, "--spec", str(ROOT / "specs" / "torch_mlp_tp2.pcs"), "--json"]) == 2
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["kind"] == "FrontendError" and "Hardmax" in last["error"]


def test_file_failing_the_checker_exits_2_with_its_message(tmp_path, capsys):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    g = helper.make_graph([helper.make_node("Relu", ["nowhere"], ["y"], "bad")], "g", [x], [y])
    path = _write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "bad.onnx")
    assert cli(["compile", path, "--spec", str(ROOT / "specs" / "torch_mlp_tp2.pcs"),
                "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path} fails onnx.checker:" in err and "nowhere" in err and "Traceback" not in err


@pytest.mark.parametrize("make, words", [
    (lambda p: _linear_model("in_out", p, opset=13), "uses opset 13 of the default domain"),
    (lambda p: p.write_bytes(b"not a protobuf at all \xff\xfe") and str(p), "is not an ONNX model"),
])
def test_old_opset_and_non_onnx_files_are_refused(tmp_path, make, words):
    path = make(tmp_path / "m.onnx")
    with pytest.raises(FrontendError) as e:
        load_onnx(path)
    assert words in e.value.message


def test_program_reads_the_onnx_initializers(exported):
    """program.py's reader (backends/torch/runtime/program_common.py): every initializer as the
    importer names it, equal to the file; external data is memory-mapped (numpy.memmap,
    so a rank's narrow() + copy touches only its slice), never read whole."""
    import types

    from parcomp_backends.torch.runtime import program_common as pc

    mapped = []

    def memmap(*a, **kw):
        mapped.append((kw["offset"], kw["shape"]))
        return np.memmap(*a, **kw)

    path = exported["gpt2_mlp"][0]
    got = pc.read_onnx(path, types.SimpleNamespace(memmap=memmap, uint8=np.uint8), onnx)
    for t in onnx.load(path).graph.initializer:
        np.testing.assert_array_equal(got[t.name].numpy(), numpy_helper.to_array(t))
    ext = [t for t in onnx.load(path, load_external_data=False).graph.initializer
           if t.data_location == TensorProto.EXTERNAL]
    assert len(mapped) == len(ext) >= 2  # the weights at least


def test_cli_compile_writes_a_program_that_reads_the_onnx_file(exported, tmp_path, capsys):
    path = exported["torch_mlp"][0]
    assert cli(["compile", path, "--spec", str(ROOT / "specs" / "torch_mlp_tp2.pcs"),
                "-o", str(tmp_path / "out"), "--json"]) == 0
    text = (tmp_path / "out" / "program.py").read_text()
    assert "def read_onnx(" in text and "--checkpoint torch_mlp.onnx" in text
    assert cli(["check", path, "--spec", str(ROOT / "specs" / "torch_mlp_tp2.pcs"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] and res["verdict"] == "OK"
    assert [(c["kind"], c["axis"], c["bytes"]) for c in res["collectives"]] == [("all_reduce", "tp", 2048)]


@pytest.mark.slow
def test_torchrun_two_gloo_ranks_equal_the_torch_modules(exported, tmp_path):
    """Both exports under torchrun on 2 gloo ranks, weights read from the .onnx file (gpt2_mlp:
    external data), equal the torch modules' outputs."""
    from parcomp_backends.torch import emit_program
    from parcomp_backends.torch.launch import assemble_outputs, run_torchrun

    for name, (path, module, inputs, names) in sorted(exported.items()):
        graph, model, _ = load_onnx(path)
        c = compile_graph(graph, load_spec(str(ROOT / "specs" / SPECS[name])))
        work = tmp_path / name
        work.mkdir()
        (work / "program.py").write_text(emit_program(c, "cpu", model=Path(path).name))
        proc = run_torchrun(work, 2, path, {"x": inputs[0]}, work / "out.pt", extra_args=("--device", "cpu"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = assemble_outputs(work / "out.pt", c.program)["output"]
        feeds = {**model.feeds(graph), "x": inputs[0].numpy()}
        assert_equivalent(out, _torch_out(module, inputs))


def _cast_model(path, to) -> str:
    """y = Cast(x, to) * Cast(Shape(x)[-1]) (the shape arithmetic exporters write, folded)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", to, [2, 3])
    n = helper.make_node
    nodes = [n("Shape", ["x"], ["s"], start=-1), n("Cast", ["s"], ["sf"], to=to),
             n("Cast", ["x"], ["xc"], "the_cast", to=to), n("Mul", ["xc", "sf"], ["y"])]
    g = helper.make_graph(nodes, "cast", [x], [y])
    return _write(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_cast_of_a_constant_folds_cast_to_the_same_dtype_is_identity(tmp_path):
    graph, model, _ = load_onnx(_cast_model(tmp_path / "c.onnx", TensorProto.FLOAT))
    assert [(n.op, n.attr("value")) for n in graph.nodes] == [("input", None), ("scale", 3.0)]
    feeds = model.feeds(graph)
    np.testing.assert_array_equal(run_unsharded(graph, feeds)["y"], model.reference_outputs(graph, feeds)["y"])


def test_cast_to_another_dtype_is_a_cast_node(tmp_path):
    """A Cast of a computed value between float dtypes lowers to parcomp's ``cast``."""
    graph, model, _ = load_onnx(_cast_model(tmp_path / "c.onnx", TensorProto.DOUBLE))
    assert [(n.op, str(n.type)) for n in graph.nodes] == [("input", "f32[2,3]"), ("cast", "f64[2,3]"),
                                                          ("scale", "f64[2,3]")]
    feeds = model.feeds(graph)
    np.testing.assert_array_equal(run_unsharded(graph, feeds)["y"], model.reference_outputs(graph, feeds)["y"])


def test_training_spec_checks_an_onnx_model(exported, capsys):
    """A train spec on the ONNX export: 3 AdamW steps on dp=2 x tp=2 equal the unsharded steps."""
    path = exported["gpt2_mlp"][0]
    assert cli(["check", path, "--spec", str(ROOT / "specs" / "gpt2_mlp_dp2_tp2_train.pcs"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] and res["steps"] == 3 and res["world_size"] == 4 and "vs_torch" not in res
