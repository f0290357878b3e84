"""torch.export frontend: constant folding, the causal-mask rewrite, and output names
(dicts, ModelOutput, dataclasses, namedtuples, nested tuples) on small modules."""
from __future__ import annotations

import collections
import dataclasses
import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
CausalLMOutputWithPast = pytest.importorskip("transformers.modeling_outputs").CausalLMOutputWithPast

from parcomp.cli.main import main  # noqa: E402
from parcomp.errors import FrontendError  # noqa: E402
from parcomp.frontends.torch.export import _bind, export_module, folded_constants, import_torch  # noqa: E402
from parcomp.frontends.torch.fold import causal_attention, fold, module_sources  # noqa: E402
from parcomp.ir.text import parse_graph, print_graph  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402

from numerics import assert_equivalent  # noqa: E402


def feeds(graph, module, inputs):
    state = {k: v.detach().numpy() for k, v in module_sources(module).items()}
    out = {n.name: state[n.name] for n in graph.params}
    out.update({n.name: t.numpy() for n, t in zip(graph.inputs, inputs)})
    return out


def check(module, inputs, names=None):
    """Import ``module``, run the graph in numpy and compare every output with torch's
    (pytree leaf order); returns the graph."""
    graph = import_torch(module, inputs, names)
    fed = feeds(graph, module, inputs)
    got = run_unsharded(graph, fed)
    with torch.no_grad():
        want = [w for w in torch.utils._pytree.tree_leaves(module(*inputs)) if w is not None]
    assert len(want) == len(graph.output_names)
    for name, value, w in zip(graph.output_names, graph.outputs, want):
        assert got[value].shape == tuple(w.shape)
        assert_equivalent(got[value], w.numpy(), what=name)
    assert parse_graph(print_graph(graph)) == graph
    return graph


def frozen(graph) -> dict:
    return {p.name: p for p in graph.params if p.attr("trainable") is False}


# ---- constant folding -------------------------------------------------------------

class Positions(nn.Module):
    """x + positions * w, positions from arange (no op for arange is needed)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=torch.float32).unsqueeze(0).unsqueeze(-1)
        return x + pos * self.w


def test_arange_positions_fold_into_one_frozen_param():
    torch.manual_seed(0)
    module, x = Positions(), torch.randn(2, 5, 4)
    graph = check(module, (x,))
    (name,) = frozen(graph)
    assert graph[name].type.shape == (1, 5, 1) and name == "arange"  # named after the op below the views
    np.testing.assert_array_equal(folded_constants(module)[name].numpy(),
                                  np.arange(5, dtype=np.float32).reshape(1, 5, 1))
    assert {n.op for n in graph.nodes} == {"input", "param", "mul", "add"}
    assert "%arange: f32[1,5,1] = param() {trainable=false}" in print_graph(graph)


class MaskedScores(nn.Module):
    """Attention scores plus an additive causal mask built with full/triu/where."""

    def forward(self, q, k):
        s = q.shape[1]
        upper = torch.full((s, s), 1.0).triu(1).bool()
        mask = torch.where(upper, torch.tensor(-1e4), torch.tensor(0.0))
        return torch.matmul(q, k.transpose(1, 2)) + mask


def test_causal_mask_from_full_triu_where_is_folded():
    torch.manual_seed(0)
    module, q, k = MaskedScores(), torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    graph = check(module, (q, k))
    (name,) = frozen(graph)
    want = np.where(np.triu(np.ones((6, 6)), 1) > 0, -1e4, 0.0).astype(np.float32)
    np.testing.assert_array_equal(folded_constants(module)[name].numpy(), want)
    assert {n.op for n in graph.nodes} == {"input", "param", "permute", "matmul", "add"}


class Rotary(nn.Module):
    """RoPE's tables from a non-persistent ``inv_freq`` buffer, used by two layers."""

    def __init__(self, dim=8, seq=6):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim),
                             persistent=False)
        self.layers = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(2))
        self.seq = seq

    def forward(self, x):
        freqs = torch.outer(torch.arange(self.seq, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            x = x * cos.unsqueeze(0) + layer(x) * sin.unsqueeze(0)
        return x


def test_rope_tables_fold_once_for_all_layers():
    torch.manual_seed(0)
    module, x = Rotary(), torch.randn(2, 6, 8)
    graph = check(module, (x,))
    consts = folded_constants(module)
    assert sorted(frozen(graph)) == sorted(consts) == ["cos", "sin"]  # one each, not per layer
    pos = np.arange(6, dtype=np.float32)[:, None] * module.inv_freq.numpy()[None, :]
    emb = np.concatenate([pos, pos], axis=-1)
    assert_equivalent(consts["cos"].numpy()[0], np.cos(emb))
    assert "inv_freq" not in graph  # only the folded tables remain
    assert not {"cos", "sin", "cat"} & {n.op for n in graph.nodes}


class FrozenWeight(nn.Module):
    """A requires_grad=False parameter is not a constant: a checkpoint may change it."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x):
        return x * (self.w * 2)


def test_frozen_parameter_is_not_folded():
    torch.manual_seed(0)
    module = FrozenWeight()
    graph = check(module, (torch.randn(3, 4),))
    assert list(frozen(graph)) == ["w"] and folded_constants(module) == {}
    assert [n.op for n in graph.nodes].count("scale") == 1


class RandomConst(nn.Module):
    def forward(self, x):
        return x + F.dropout(torch.ones(4), 0.5, training=True)


def test_random_ops_are_not_folded():
    ep = export_module(RandomConst(), (torch.randn(2, 4),))
    consts = fold(ep)
    (drop,) = [n for n in ep.graph.nodes if "dropout" in str(n.target)]
    assert drop not in consts and drop.args[0] in consts  # ones(4) is folded, its dropout not


# ---- sdpa with a constant causal mask becomes is_causal ---------------------------

class Attention(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(q.shape[2], k.shape[2]))


def _tril(lq, lk):
    return torch.ones(lq, lk, dtype=torch.bool).tril()


MASKS = {
    "bool tril": (_tril, True),
    "bool tril broadcast over batch and heads": (lambda a, b: _tril(a, b)[None, None].expand(2, 1, a, b), True),
    "additive -inf": (lambda a, b: torch.zeros(a, b).masked_fill(~_tril(a, b), float("-inf")), True),
    "additive finfo.min": (lambda a, b: torch.zeros(a, b).masked_fill(~_tril(a, b), torch.finfo(torch.float32).min), True),
    "bool triu (not causal)": (lambda a, b: torch.ones(a, b, dtype=torch.bool).triu(), False),
    "additive -1e4 (not -inf)": (lambda a, b: torch.zeros(a, b).masked_fill(~_tril(a, b), -1e4), False),
    "bottom-right aligned (lq < lk)": (lambda a, b: torch.ones(a, b, dtype=torch.bool).tril(b - a), False),
    "all true (no mask)": (lambda a, b: torch.ones(1, 1, a, b, dtype=torch.bool), None),
    "all zero additive (no mask)": (lambda a, b: torch.zeros(a, b), None),
}


@pytest.mark.parametrize("case", sorted(MASKS))
def test_sdpa_causal_mask_rewritten_to_is_causal(case):  # causal: True, False, None (mask dropped)
    make, causal = MASKS[case]
    lq = 3 if "lq < lk" in case else 5
    q, k, v = torch.randn(2, 4, lq, 8), torch.randn(2, 4, 5, 8), torch.randn(2, 4, 5, 8)
    ep = export_module(Attention(make), (q, k, v))
    consts = fold(ep)
    assert causal_attention(ep, consts, _bind) == int(causal is not False)
    (n,) = [n for n in ep.graph.nodes if "scaled_dot_product" in str(n.target)]
    a = _bind(n)
    assert (a["attn_mask"] is None, a["is_causal"]) == (causal is not False, bool(causal))
    if causal is not False:  # the rewritten graph computes what the masked one did
        want = Attention(make)(q, k, v)
        assert_equivalent(ep.module()(q, k, v).numpy(), want.numpy())


# ---- outputs by name ----------------------------------------------------------------

def _body(x, w):
    h = x @ w
    return h, (h * h).sum()


class DictOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        logits, loss = _body(x, self.w)
        return {"logits": logits, "loss": loss, "none": None}


class NestedOut(DictOut):
    def forward(self, x):
        logits, loss = _body(x, self.w)
        return (logits, (loss, logits * 2)), {"a": {"b-c": loss}}


Pair = collections.namedtuple("Pair", "logits loss")


class NamedTupleOut(DictOut):
    def forward(self, x):
        return Pair(*_body(x, self.w))


@dataclasses.dataclass
class PlainOut:
    logits: torch.Tensor
    loss: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class DataclassOut(DictOut):
    def forward(self, x):
        return PlainOut(*_body(x, self.w))


class ModelOutputOut(DictOut):
    def forward(self, x):
        logits, loss = _body(x, self.w)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


OUTPUTS = {
    DictOut: ("logits", "loss"),
    NestedOut: ("output_0.0", "output_0.1.0", "output_0.1.1", "output_1.a.b_c"),
    NamedTupleOut: ("logits", "loss"),
    DataclassOut: ("logits", "loss"),
    ModelOutputOut: ("loss", "logits"),  # ModelOutput's field order
}


@pytest.mark.parametrize("cls", list(OUTPUTS), ids=lambda c: c.__name__)
def test_structured_outputs_are_named_by_their_keys(cls):
    torch.manual_seed(0)
    graph = check(cls(), (torch.randn(3, 4),))
    assert graph.output_names == OUTPUTS[cls]


TRAIN_MODEL = '''
import torch
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        s = x.shape[0]
        mask = torch.where(torch.ones(s, 6).tril().bool(), 0.0, -3.0)  # folded
        logits = self.fc(x) + mask
        return {"logits": logits, "loss": (logits * logits).sum()}


def make():
    torch.manual_seed(0)
    return M(), (torch.randn(6, 4),), ["x"]
'''


@pytest.mark.parametrize("train", ["output logits replicated\n",
                                   "train loss=output output=loss optimizer=sgd(lr=0.01) steps=2\n",
                                   "train loss=mse output=logits optimizer=sgd(lr=0.01) steps=2\n"])
def test_check_names_dict_outputs_and_feeds_folded_constants(tmp_path, capsys, train):
    (tmp_path / "m.py").write_text(TRAIN_MODEL)
    (tmp_path / "s.pcs").write_text("mesh tp=2\nfc.weight colwise\ninput x replicated\n" + train)
    assert main(["check", f"{tmp_path / 'm.py'}:make", "--spec", str(tmp_path / "s.pcs"), "--json"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and last["err_over_tol"] <= 1
    if "train" in train:
        assert len(last["losses"]) == 2 and not last.get("missing")
        assert math.isfinite(last["max_grad_err"])
