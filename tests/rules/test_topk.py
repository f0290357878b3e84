"""``topk`` / ``topk_index`` (torch.topk's values and indices), ``take_along`` (torch.gather) and
``put_along`` (scatter_add into zeros): numpy against torch (values exact, indices where no two
candidates tie), the tie order (the lower index first) against torch's stable sort, the
emitted torch expressions against numpy, the gradient of a top-k router against torch's, and a
router's training step at dp=2 equal to the unsharded one.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.check.training import numpy_train, train_steps
from parcomp.compile.compiler import compile_graph
from parcomp.ir import Node, TensorType, make_attrs
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import NUMPY_OPS, run_unsharded

from graphs import spec

torch = pytest.importorskip("torch")


def _node(op, shape, dtype="float64", n_in=1, **attrs):
    return Node("y", op, tuple(f"a{i}" for i in range(n_in)), TensorType(shape, dtype), make_attrs(**attrs))


def _emitted(node, args):
    from parcomp_backends.torch.emit.nodes import _code
    from parcomp_backends.torch.runtime.program_reduce import put_along

    env = {"torch": torch, "put_along": put_along, **{f"a{i}": torch.tensor(x) for i, x in enumerate(args)}}
    return eval(_code(node, [f"a{i}" for i in range(len(args))]), env).numpy()  # noqa: S307 - our own table


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 4), n=st.integers(1, 70), data=st.data(), seed=st.integers(0, 1000))
def test_topk_equals_torch_without_ties(rows, n, data, seed):
    k = data.draw(st.integers(1, n))
    dim = data.draw(st.sampled_from([0, 1]))
    x = np.random.default_rng(seed).permutation(rows * n).reshape(rows, n).astype(np.float64) / 7
    x = x.T.copy() if dim == 0 else x  # distinct values: one right order
    shape = list(x.shape)
    shape[dim] = k
    vals = NUMPY_OPS["topk"]([x], _node("topk", tuple(shape), k=k, dim=dim))
    idx = NUMPY_OPS["topk_index"]([x], _node("topk_index", tuple(shape), "int64", k=k, dim=dim))
    want = torch.topk(torch.tensor(x), k, dim=dim)
    np.testing.assert_array_equal(vals, want.values.numpy())
    np.testing.assert_array_equal(idx, want.indices.numpy())
    assert idx.dtype == np.int64
    # program.py's rows compute the same
    np.testing.assert_array_equal(_emitted(_node("topk", tuple(shape), k=k, dim=dim), [x]), vals)
    np.testing.assert_array_equal(_emitted(_node("topk_index", tuple(shape), "int64", k=k, dim=dim), [x]), idx)


def test_ties_go_to_the_lower_index_and_nan_counts_as_largest():
    """torch.topk leaves the order of equal values to its kernel (on CPU a heap or a
    selection, depending on k and the size); parcomp's reference takes the lower index first,
    as torch's stable descending sort does; the values are the same either way."""
    x = np.array([[1.0, 2.0, 2.0, 0.0, 2.0], [np.nan, 3.0, np.nan, 3.0, -np.inf]])
    idx = NUMPY_OPS["topk_index"]([x], _node("topk_index", (2, 4), "int64", k=4, dim=1))
    np.testing.assert_array_equal(idx, [[1, 2, 4, 0], [0, 2, 1, 3]])
    stable = torch.sort(torch.tensor(x), dim=1, descending=True, stable=True).indices[:, :4]
    np.testing.assert_array_equal(idx, stable.numpy())
    vals = NUMPY_OPS["topk"]([x], _node("topk", (2, 4), k=4, dim=1))
    np.testing.assert_array_equal(vals, torch.topk(torch.tensor(x), 4, dim=1).values.numpy())


def test_take_along_and_put_along_are_gather_and_scatter_add():
    rng = np.random.default_rng(0)
    x, g = rng.standard_normal((3, 6)), rng.standard_normal((3, 4))
    idx = np.array([[5, 0, 2, 2], [1, 1, 1, 1], [0, 3, 4, 5]])  # repeated indices add up
    got = NUMPY_OPS["take_along"]([x, idx], _node("take_along", (3, 4), n_in=2, dim=1))
    np.testing.assert_array_equal(got, torch.gather(torch.tensor(x), 1, torch.tensor(idx)).numpy())
    node = _node("put_along", (3, 6), n_in=2, dim=1, size=6)
    put = NUMPY_OPS["put_along"]([g, idx], node)
    want = torch.zeros(3, 6, dtype=torch.float64).scatter_add(1, torch.tensor(idx), torch.tensor(g))
    np.testing.assert_allclose(put, want.numpy(), rtol=1e-15)
    np.testing.assert_allclose(_emitted(node, [g, idx]), put, rtol=1e-15)
    np.testing.assert_array_equal(_emitted(_node("take_along", (3, 4), n_in=2, dim=1), [x, idx]), got)


class Router(torch.nn.Module):
    """Mixtral's router: softmax over the experts, the top-k, renormalised; outputs the weights,
    the indices and the router probabilities gathered at the indices (DeepSeek's gather)."""

    def __init__(self, hidden=8, experts=6, k=2):
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.k = k

    def forward(self, x):
        p = torch.softmax(self.gate(x), dim=-1)
        top, idx = torch.topk(p, self.k, dim=-1)
        w = top / top.sum(dim=-1, keepdim=True)
        picked = p.gather(-1, idx)
        spread = torch.zeros_like(p).scatter_add(-1, idx, w)  # the combine weights [.., E]
        return w, idx, picked, spread


def _import(module, x):
    from parcomp.frontends.torch.export import import_torch

    return import_torch(module, (x,), ["x"])


def test_a_top_k_router_imports_equal_to_torch_and_its_gradient_is_torchs():
    torch.manual_seed(0)
    m, x = Router().double(), torch.randn(4, 5, 8, dtype=torch.float64)
    g = _import(m, x)
    assert {n.op for n in g.nodes} >= {"topk", "topk_index", "take_along", "put_along"}
    feeds = {"x": x.numpy(), "gate.weight": m.gate.weight.detach().numpy()}
    got = run_unsharded(g, feeds)
    for name, want in zip(g.outputs, m(x)):
        np.testing.assert_allclose(got[name], want.detach().numpy(), rtol=1e-12, err_msg=name)
    # the gradient of the router weight through topk's values, gather and scatter_add
    loss_m = RouterLoss().double()
    loss_m.load_state_dict(m.state_dict())
    gl = _import(loss_m, x)
    from parcomp.frontends.torch.fold import folded_constants

    feeds = {**feeds, **{k: v.numpy() for k, v in folded_constants(loss_m).items() if k in gl}}
    c = compile_graph(gl, spec("mesh dp=2\ninput x [S(0)]\ntrain loss=output optimizer=sgd(lr=1.0) steps=1\n"))
    assert c.logical.by_op("put_along") and c.logical.by_op("take_along")
    loss_m.zero_grad()
    loss_m(x).backward()
    want = numpy_train(c.logical, feeds, 1)
    np.testing.assert_allclose(want["state"]["gate.weight"],
                               (loss_m.gate.weight - loss_m.gate.weight.grad).detach().numpy(),
                               rtol=1e-10, atol=1e-12)
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, 1)
    np.testing.assert_allclose(got["state"]["gate.weight"], want["state"]["gate.weight"], rtol=1e-12)


class RouterLoss(Router):
    """A scalar of :class:`Router`'s weights, indices' gathered probabilities and combine
    weights, each weighted by a fixed pattern (a plain sum of the combine weights is 1 per token)."""

    def forward(self, x):
        w, idx, picked, spread = super().forward(x)
        e = torch.arange(spread.shape[-1], dtype=x.dtype)
        return (spread * e).sum() + (picked * picked).sum() + (w[..., 0] * 3).sum()


def test_largest_false_is_a_located_error():
    from parcomp.errors import FrontendError

    class Smallest(torch.nn.Module):
        def forward(self, x):
            return torch.topk(x, 2, dim=-1, largest=False).values

    with pytest.raises(FrontendError, match=r"largest=False.*torch.topk\(-x, k, dim\)") as e:
        _import(Smallest(), torch.randn(3, 5))
    assert "test_topk.py" in str(e.value.loc)
