"""GELU spelt out as elementwise ops (transformers' ``gelu_new``, GPT-2's activation) is
imported as one ``gelu{approximate=tanh}`` (``parcomp/frontends/torch/activations.py``): the
program runs ``torch.nn.functional.gelu`` and ``gelu_backward``, the numpy reference its
formula, and both equal torch in float64."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
activations = pytest.importorskip("transformers.activations")

from parcomp.frontends.torch.export import import_torch  # noqa: E402
from parcomp.reference.numpy_ops import NUMPY_OPS, run_unsharded  # noqa: E402



class _Mlp(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc = torch.nn.Linear(8, 16, dtype=torch.float64)
        self.act = activations.ACT2FN[act]

    def forward(self, x):
        return self.act(self.fc(x))


def _ops(graph):
    return [n.op for n in graph.nodes if n.op not in ("input", "param")]


@pytest.mark.parametrize("act,approx", [("gelu_new", "tanh"), ("gelu_python_tanh", "tanh"),
                                        ("gelu_accurate", "tanh"), ("gelu_python", "none")])
def test_spelt_out_gelu_imports_as_one_op_equal_to_torch_in_float64(act, approx):
    torch.manual_seed(0)
    m = _Mlp(act)
    x = torch.randn(2, 3, 8, dtype=torch.float64) * 3
    graph = import_torch(m, (x,))
    gelus = [n for n in graph.nodes if n.op == "gelu"]
    assert len(gelus) == 1 and gelus[0].attr("approximate") == approx, _ops(graph)
    assert not {"tanh", "pow", "erf", "mul", "scale", "add_scalar"} & set(_ops(graph)), _ops(graph)
    feeds = {"x": x.numpy(), **{k: v.detach().numpy() for k, v in m.state_dict().items()}}
    got = next(iter(run_unsharded(graph, feeds).values()))
    want = torch.nn.functional.gelu(m.fc(x), approximate=approx).detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-15)
    spelt = m(x).detach().numpy()  # the eight-op formula itself differs from torch's kernel by rounding only
    np.testing.assert_allclose(got, spelt, rtol=1e-13, atol=1e-15)


def test_gelu_tanh_gradient_of_the_reference_equals_torch_gelu_backward_in_float64():
    torch.manual_seed(1)
    x = torch.randn(64, dtype=torch.float64) * 4
    dy = torch.randn(64, dtype=torch.float64)
    graph = import_torch(_Mlp("gelu_new"), (torch.randn(2, 8, dtype=torch.float64),))
    node = next(n for n in graph.nodes if n.op == "gelu")
    got = NUMPY_OPS["gelu_grad"]([dy.numpy(), x.numpy()], node)
    want = torch.ops.aten.gelu_backward(dy, x, approximate="tanh").numpy()
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-15)
    xr = x.clone().requires_grad_(True)
    activations.ACT2FN["gelu_new"](xr).backward(dy)
    np.testing.assert_allclose(got, xr.grad.numpy(), rtol=1e-12, atol=1e-14)


def test_gelu_fast_grouping_is_left_as_written():
    """``gelu_fast`` writes the tanh argument as ``0.7978845608 x (1 + 0.044715 x^2)``: another
    formula (its constant is rounded), not matched."""
    graph = import_torch(_Mlp("gelu_fast"), (torch.randn(2, 8, dtype=torch.float64),))
    assert "gelu" not in _ops(graph) and "tanh" in _ops(graph)


def test_an_inner_value_read_elsewhere_is_kept():
    class Reuse(torch.nn.Module):
        def forward(self, x):
            t = torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0)))
            return 0.5 * x * (1.0 + t) + t

    x = torch.randn(4, 8, dtype=torch.float64)
    graph = import_torch(Reuse(), (x,))
    ops = _ops(graph)
    assert ops.count("gelu") == 1 and ops.count("tanh") == 1, ops
    got = next(iter(run_unsharded(graph, {"x": x.numpy()}).values()))
    np.testing.assert_allclose(got, Reuse()(x).numpy(), rtol=1e-13, atol=1e-15)
