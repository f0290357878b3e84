"""torch.export frontend and model loader: numerics against torch, names, errors."""
from __future__ import annotations

import importlib.util
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from parcomp.errors import FrontendError  # noqa: E402
from parcomp.frontends.loader import load_model  # noqa: E402
from parcomp.frontends.torch.export import import_torch, supported_ops  # noqa: E402
from parcomp.ir.text import parse_graph, print_graph  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402

from numerics import assert_equivalent  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_test_specs_models", ROOT / "specs" / "models.py")
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)

FACTORIES = {
    "gpt2_mlp": models.gpt2_mlp,
    "torch_mlp": models.torch_mlp,
    "tiny_relu_mlp": models.tiny_relu_mlp,
    "mlp_chain": lambda: models.mlp_chain(blocks=2),
}


def graph_feeds(graph, module, inputs):
    feeds = {k: v.detach().numpy() for k, v in module.state_dict().items()}
    feeds.update({n.name: t.numpy() for n, t in zip(graph.inputs, inputs)})
    return feeds


def run_graph(graph, module, inputs):
    return run_unsharded(graph, graph_feeds(graph, module, inputs))


def assert_close(got, want, graph, module, inputs, name="output"):
    """numpy's run of ``graph`` equals torch's, within float32's tolerance."""
    want = want.detach().numpy()
    assert got.shape == want.shape and got.dtype == want.dtype
    assert_equivalent(got, want, what=name)


def check_against_torch(module, inputs, names=None):
    graph = import_torch(module, inputs, names)
    outs = run_graph(graph, module, inputs)
    want = module(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    assert len(graph.outputs) == len(want)
    for name, w in zip(graph.outputs, want):
        assert_close(outs[name], w, graph, module, inputs, name)
    return graph


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_factory_matches_torch(name):
    module, inputs, names = FACTORIES[name]()
    graph = check_against_torch(module, inputs, names)
    assert graph.outputs == ("output",)
    assert [n.name for n in graph.inputs] == ["x"]
    assert {p.name for p in graph.params} == set(module.state_dict())
    assert parse_graph(print_graph(graph)) == graph


def test_worked_example_gives_17_10():
    module, inputs, names = models.tiny_relu_mlp()
    graph = import_torch(module, inputs, names)
    out = run_graph(graph, module, inputs)["output"]
    np.testing.assert_array_equal(out, np.array([[17.0, 10.0]], dtype=np.float32))
    np.testing.assert_array_equal(module(*inputs).detach().numpy(), out)
    assert [p.name for p in graph.params] == ["fc1.weight", "fc2.weight"]


def test_linear_weight_chain_is_param_permute_matmul_rhs():
    module, inputs, names = models.torch_mlp()
    graph = import_torch(module, inputs, names)
    users = graph.users()
    for w in ("0.weight", "2.weight"):
        (perm,) = users[w]
        assert graph[perm].op == "permute" and graph[perm].attr("perm") == (1, 0)
        (mm,) = users[perm]
        assert graph[mm].op == "matmul" and graph[mm].inputs[1] == perm


def test_gpt2_conv1d_is_reshape_matmul_add_reshape():
    module, inputs, names = models.gpt2_mlp()
    graph = import_torch(module, inputs, names)
    ops = [n.op for n in graph.nodes if n.op not in ("param", "input")]
    assert ops[:4] == ["reshape", "matmul", "add", "reshape"]
    assert graph[graph.users()["c_fc.weight"][0]].op == "matmul"
    assert "gelu" in {n.op for n in graph.nodes}  # gelu_new's eight ops, as one (frontends/torch/activations.py)


def test_gelu_tanh_attr_and_identity_ops():
    module = nn.Sequential(nn.Linear(8, 16), nn.GELU(approximate="tanh"), nn.Dropout(0.3),
                           nn.ReLU(), nn.Linear(16, 8, bias=False))
    trained = import_torch(module, (torch.randn(3, 8),))  # training mode: parcomp's dropout
    assert [(n.attr("p"), n.attr("seed")) for n in trained.by_op("dropout")] == [(0.3, 0)]
    assert module.training  # the user's module is not switched to eval behind their back
    graph = check_against_torch(module.eval(), (torch.randn(3, 8),))
    gelus = graph.by_op("gelu")
    assert len(gelus) == 1 and gelus[0].attr("approximate") == "tanh"
    assert not any("dropout" in n.name for n in graph.nodes)
    assert [n.name for n in graph.inputs] == ["input"]  # Sequential.forward(self, input)


class Scalars(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(6, 4))
        self.register_buffer("shift", torch.randn(4))
        self.act = nn.ReLU(inplace=True)

    def forward(self, x, y):
        h = torch.matmul(x, self.w)             # matmul
        h = h.transpose(0, 1).contiguous().t()  # transpose, contiguous, t
        h = 1 - h                               # rsub
        h = h / 4 + 3 - 0.5                     # div scalar, add/sub scalar
        h = 2 / (h * h + 1) - self.shift        # reciprocal, mul, sub tensor
        h = self.act(h * y)                     # in-place relu
        h += 1                                  # in-place add
        h = torch.sigmoid(h) + nn.functional.silu(h) * torch.exp(-h) + torch.tanh(h).pow(2)
        z = h.reshape(3, 2, 4).permute(2, 0, 1).clone()
        h = h.add(y, alpha=0.5).detach()        # add with alpha, detach
        return h, z


def test_scalar_inplace_and_layout_ops_match_torch():
    torch.manual_seed(0)
    module = Scalars()
    x, y = torch.randn(6, 6), torch.randn(6, 4)
    graph = check_against_torch(module, (x, y))
    assert graph.outputs == ("output_0", "output_1")
    assert [n.name for n in graph.inputs] == ["x", "y"]
    assert {p.name for p in graph.params} == {"w", "shift"}
    for n in graph.nodes:
        for _, v in n.attrs:
            assert type(v) in (float, str, tuple, int, bool)
            assert not isinstance(v, tuple) or all(type(i) is int for i in v)
    # the buffer is marked: training never updates it; the mark survives the text form
    assert graph["shift"].attrs == (("trainable", False),) and graph["w"].attrs == ()
    assert "%shift: f32[4] = param() {trainable=false}" in print_graph(graph)
    assert parse_graph(print_graph(graph)) == graph


class MoreViews(nn.Module):
    """The frontend part's lowerings onto existing ops."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.rand(3, 4) + 0.5)

    def forward(self, x, y):
        a = (x * self.w).flatten(1).unflatten(1, (4, 3)).view_as(x).type_as(x)  # [2,3,4]
        a = a.swapaxes(0, 1).movedim(0, 2).swapdims(1, 2)                       # [3,4,2]
        a = (a * a + 1).sqrt().square().rsqrt()
        b = torch.baddbmm(y, x, x.transpose(1, 2), beta=0.5, alpha=2.0)         # [2,3,3]
        c = torch.baddbmm(y, x, x.transpose(1, 2), beta=0.0)
        s = x.sum(-1, keepdim=True) + x.sum() + x.sum((0, 2)).reshape(1, 3, 1)
        return a, b + c, s


def test_frontend_part_lowerings_match_torch():
    torch.manual_seed(0)
    graph = check_against_torch(MoreViews(), (torch.rand(2, 3, 4) + 0.5, torch.randn(2, 3, 3)))
    ops = {n.op for n in graph.nodes}
    assert ops == {"input", "param", "mul", "reshape", "permute", "add_scalar", "pow", "matmul", "scale",
                   "add", "sum"}
    assert {n.attr("exponent") for n in graph.by_op("pow")} == {0.5, 2.0, -0.5}
    assert len(graph.by_op("permute")) == 3 + 2  # swapaxes, movedim, swapdims; x^T twice
    (sum_keep,) = [n for n in graph.by_op("sum") if graph.users()[n.name] and
                   graph[graph.users()[n.name][0]].op == "reshape" and n.attr("dims") == (2,)]
    assert graph[graph.users()[sum_keep.name][0]].type.shape == (2, 3, 1)  # keepdim


def test_output_that_is_an_input_keeps_its_name():
    class Two(nn.Module):
        def forward(self, a):
            return a, a * 2

    graph = check_against_torch(Two(), (torch.randn(2, 3),), ["a"])
    assert graph.outputs == ("a", "output_1")


class CumsumBlock(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=-1)


class SortBlock(nn.Module):
    def forward(self, x):
        return torch.sort(x, dim=-1).values


@pytest.mark.parametrize("block,op,line,near", [  # a rewrite, or nothing: sort is not sqrt
    (CumsumBlock, "aten.cumsum", "torch.cumsum(x, dim=-1)", "; rewrite it with supported ops: x @ torch.ones(n, n).triu()"),
    (SortBlock, "aten.sort", "torch.sort(x, dim=-1)", "; no supported op is close to it (")])
def test_unsupported_op_names_op_module_nearest_op_and_line(block, op, line, near):
    module = nn.Sequential(OrderedDict(fc=nn.Linear(4, 4), body=nn.Sequential(block())))
    with pytest.raises(FrontendError) as info:
        import_torch(module, (torch.randn(2, 4),))
    err, msg = info.value, str(info.value)
    assert op in msg and "'body.0'" in msg and block.__name__ in msg
    assert f"parcomp has no lowering for it{near}" in msg and "nearest supported op" not in msg
    assert err.loc.file == __file__ and err.loc.text.strip().startswith(f"return {line}")
    assert msg.startswith(f"{__file__}:{err.loc.line}:9\n            return {line}")
    assert "\n            ^\nerror: unsupported op" in msg
    assert "Traceback" not in msg and "aten.linear.default" not in msg  # one suggestion, not the table


def test_supported_ops_lists_the_table():
    ops = supported_ops()
    assert "aten.addmm.default" in ops and "aten.gelu.default" in ops and ops == sorted(ops)


def test_input_names_count_mismatch():
    with pytest.raises(FrontendError, match="2 input names given for 1"):
        import_torch(nn.ReLU(), (torch.randn(2),), ["a", "b"])


# ---- loader ---------------------------------------------------------------------

def test_load_model_file_factory(monkeypatch):
    monkeypatch.chdir(ROOT)
    graph, module, inputs = load_model("specs/models.py:torch_mlp")
    assert isinstance(module, nn.Module) and inputs[0].shape == (2, 8, 32)
    assert_close(run_graph(graph, module, inputs)["output"], module(*inputs), graph, module, inputs)


def test_load_model_module_factory(tmp_path, monkeypatch):
    (tmp_path / "my_models_pkg").mkdir()
    (tmp_path / "my_models_pkg" / "__init__.py").write_text("")
    (tmp_path / "my_models_pkg" / "zoo.py").write_text(
        "import torch\n"
        "def relu():\n    return torch.nn.ReLU(), (torch.randn(2, 3),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph, module, inputs = load_model("my_models_pkg.zoo:relu")
    assert [n.op for n in graph.nodes] == ["input", "relu"] and graph.outputs == ("output",)
    with pytest.raises(FrontendError, match="no module named"):
        load_model("parcomp_no_such_pkg.models:f")


def test_load_model_missing_factory(monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(FrontendError) as info:
        load_model("specs/models.py:nonexistent")
    msg = str(info.value)
    assert "specs/models.py:nonexistent" in msg and "'nonexistent' does not exist" in msg
    assert "did you mean" not in msg and "torch_mlp" in msg  # lists the factories
    with pytest.raises(FrontendError, match="did you mean 'torch_mlp'"):
        load_model("specs/models.py:torch_mpl")


def test_load_model_bad_refs(tmp_path):
    with pytest.raises(FrontendError, match="no file"):
        load_model(str(tmp_path / "nope.py") + ":f")
    with pytest.raises(FrontendError, match="FILE.pcir, FILE.py:FACTORY"):
        load_model("just_a_name")
    with pytest.raises(FrontendError, match="cannot read model"):
        load_model(str(tmp_path / "missing.pcir"))
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\n"
                   "def not_a_pair():\n    return torch.nn.ReLU()\n"
                   "def no_tensors():\n    return torch.nn.ReLU(), ([1, 2],)\n")
    with pytest.raises(FrontendError, match="must return"):
        load_model(f"{bad}:not_a_pair")
    with pytest.raises(FrontendError, match="example inputs"):
        load_model(f"{bad}:no_tensors")


def test_load_model_pcir(tmp_path):
    module, inputs, names = models.tiny_relu_mlp()
    graph = import_torch(module, inputs, names)
    path = tmp_path / "tiny.pcir"
    path.write_text(print_graph(graph))
    loaded, mod, ex = load_model(str(path))
    assert loaded == graph and mod is None and ex == ()
