"""``nn.Embedding(padding_idx=...)``: the padding row gets no gradient from the lookup.

torch's semantics, matched exactly: the lookup itself is unchanged; the embedding's gradient
skips every id equal to ``padding_idx``; a tied LM head (its weight IS the table) still gives
that row its own gradient; AdamW still applies weight decay to the row (its gradient is zero,
not absent). Under a vocab split only the rank holding the row sees ids equal to it.

Exact small integers on the interpreter, hypothesis over shapes, layouts and pad rows
(sharded == unsharded, float64), the torch module trained with torch.optim in float64 against
the sharded program, and the helper program.py runs against the numpy op.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.check.check64 import promote_compiled
from parcomp.check.training import numpy_train, train_steps
from parcomp.compile.compiler import compile_graph
from parcomp.ir import Node, TensorType, make_attrs, parse_graph
from parcomp.reference import norm_ops
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from graphs import spec

torch = pytest.importorskip("torch")

EMB_TRAIN = """\
%ids: i64[2,3] = input()
%dy: f64[2,3,2] = input()
%wte: f64[{v},2] = param()
%e: f64[2,3,2] = embedding(%ids, %wte) {{padding_idx={pad}}}
%ed: f64[2,3,2] = mul(%e, %dy)
%l: f64[] = sum(%ed) {{dims=(0, 1, 2)}}
return %l
"""


def _sharded_train(text, spec_text, feeds, steps=1):
    c = compile_graph(parse_graph(text), spec(spec_text))
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, steps)
    return c, got


@pytest.mark.parametrize("layout", ["[S(0)]", "[S(1)]", "[R]"])
@pytest.mark.parametrize("pad", [1, 2, 3])  # 1 and 2: either side of the two ranks' rows
def test_padding_row_gets_no_gradient_from_the_lookup_under_every_table_split(layout, pad):
    ids = np.array([[1, 2, 1], [3, 0, 2]])
    dy = np.arange(12, dtype="f8").reshape(2, 3, 2) - 5
    table = np.arange(8, dtype="f8").reshape(4, 2)
    feeds = {"ids": ids, "dy": dy, "wte": table}
    _, got = _sharded_train(EMB_TRAIN.format(v=4, pad=pad),
                            f"mesh tp=2\nwte {layout}\ninput ids replicated\ninput dy replicated\n"
                            "train loss=output optimizer=sgd(lr=0.5) input_grads=no\n", feeds)
    grad = np.zeros((4, 2))
    np.add.at(grad, ids, dy)
    grad[pad] = 0  # torch: the padding row's gradient is zero
    np.testing.assert_array_equal(got["outputs"]["wte.grad"], grad)
    np.testing.assert_array_equal(got["state"]["wte"], table - 0.5 * grad)
    np.testing.assert_array_equal(got["state"]["wte"][pad], table[pad])  # never moved by SGD


def test_padding_row_with_tokens_split_over_dp_sums_partial_gradients_without_it():
    ids = np.array([[2, 2, 1], [3, 2, 0]])  # every rank of dp has padding ids
    dy = np.arange(12, dtype="f8").reshape(2, 3, 2) + 1
    feeds = {"ids": ids, "dy": dy, "wte": np.zeros((4, 2))}
    _, got = _sharded_train(EMB_TRAIN.format(v=4, pad=2),
                            "mesh dp=2 tp=2\nwte [R, S(0)]\ninput ids [S(0), R]\ninput dy [S(0), R]\n"
                            "train loss=output optimizer=sgd(lr=1.0) input_grads=no\n", feeds)
    np.testing.assert_array_equal(got["outputs"]["wte.grad"],
                                  [[11, 12], [5, 6], [0, 0], [7, 8]])


def test_the_emitted_helper_equals_the_numpy_op_on_each_rank_block():
    from parcomp_backends.torch.emit.norms import NORM_RUNTIME

    env = {"torch": torch}
    exec(NORM_RUNTIME, env)  # noqa: S102 - the helpers program.py pastes
    ids = np.array([[5, 4, 5], [7, 0, 3]])
    dy = np.arange(12, dtype="f8").reshape(2, 3, 2) + 1
    for start, rows in [(0, 8), (0, 4), (4, 4), (4, 2), (6, 2)]:  # the row's owner and others
        node = Node("g", "embedding_grad", ("dy", "ids"), TensorType((rows, 2), "float64"),
                    make_attrs(vocab_start=start, padding_idx=5))
        grad = norm_ops.NORM_NUMPY_OPS["embedding_grad"]([dy, ids], node)
        got = env["embedding_grad_rows"](torch.tensor(dy), torch.tensor(ids), rows, start, padding_idx=5)
        np.testing.assert_array_equal(got.numpy(), grad)
        assert start > 5 or start + rows <= 5 or not grad[5 - start].any()


def test_the_program_passes_the_padding_row_to_the_helper():
    from parcomp_backends.torch.emit import emit_program

    c = compile_graph(parse_graph(EMB_TRAIN.format(v=4, pad=3)),
                      spec("mesh tp=2\nwte [S(0)]\ninput ids replicated\ninput dy replicated\n"
                           "train loss=output optimizer=sgd(lr=0.5) input_grads=no\n"))
    text = emit_program(c)
    (line,) = [ln for ln in text.splitlines() if "= embedding_grad_rows(" in ln]
    assert "embedding_grad_rows(bw_ed_mul, ids, 2, COORD[0] * 2, padding_idx=3)" in line


def _case_text(b, s, h, v, pad):
    return "\n".join([
        f"%ids: i64[{b},{s}] = input()", f"%wte: f64[{v},{h}] = param()",
        f"%w: f64[{h}] = param()",
        f"%x: f64[{b},{s},{h}] = embedding(%ids, %wte) {{padding_idx={pad}}}",
        f"%n: f64[{b},{s},{h}] = layer_norm(%x, %w) {{eps=1e-05}}",
        f"%y: f64[{b},{s},{h}] = mul(%n, %w)",
        "return %y as output"]) + "\n"


@settings(max_examples=25, deadline=None)
@given(b=st.sampled_from([2, 4]), s=st.sampled_from([2, 4]), h=st.sampled_from([4, 8]),
       v=st.sampled_from([4, 8]), pad=st.integers(0, 7), mesh=st.sampled_from(["tp=2", "dp=2 tp=2"]),
       ids_pl=st.sampled_from(["R", "S(0)", "S(1)"]), table_pl=st.sampled_from(["R", "S(0)", "S(1)"]),
       opt=st.sampled_from(["sgd(lr=0.1)", "adamw(lr=0.1, weight_decay=0.5)"]), seed=st.integers(0, 3))
def test_sharded_equals_unsharded_and_the_pad_row_follows_torch(b, s, h, v, pad, mesh, ids_pl,
                                                               table_pl, opt, seed):
    pad %= v
    lead = ["R"] * (len(mesh.split()) - 1)
    rules = [f"mesh {mesh}", f"wte [{', '.join(lead + [table_pl])}]",
             f"input ids [{', '.join(lead + [ids_pl])}]", "output output replicated",
             f"train loss=mse optimizer={opt} steps=2"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, v, (b, s))
    ids.flat[0] = pad  # the padding row is looked up at least once
    text = _case_text(b, s, h, v, pad)
    g = parse_graph(text)
    feeds = {"ids": ids, "wte": rng.standard_normal((v, h)), "w": rng.standard_normal(h),
             "target": rng.standard_normal((b, s, h))}
    c = compile_graph(g, spec("\n".join(rules) + "\n"))
    prog = c.program
    got = train_steps(lambda st_: run_spmd(prog, st_).outputs(prog), c.logical, feeds, 2)
    want = numpy_train(c.logical, feeds, 2)
    for k, val in want["state"].items():
        np.testing.assert_allclose(got["state"][k], val, rtol=1e-12, atol=1e-12, err_msg=k)
    # torch's padding row: SGD never moves it; AdamW only decays it (its gradient is zero)
    decay = 1.0 if opt.startswith("sgd") else (1 - 0.1 * 0.5) ** 2
    np.testing.assert_allclose(got["state"]["wte"][pad], feeds["wte"][pad] * decay, rtol=1e-14)


# --- against torch: the module as transformers builds it, trained by torch.optim -------------

class _LM(torch.nn.Module):
    """Embedding with a padding row -> LayerNorm -> a head, tied to the table or not."""

    def __init__(self, v, h, pad, tied):
        super().__init__()
        self.wte = torch.nn.Embedding(v, h, padding_idx=pad)
        self.ln = torch.nn.LayerNorm(h)
        self.head = torch.nn.Linear(h, v, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.ln(self.wte(ids)))


def _torch_steps(m, ids, labels, steps, lr, wd):
    m = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd)
    for _ in range(steps):
        opt.zero_grad()
        logits = m(ids)
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).backward()
        opt.step()
    return {k: p.detach().numpy() for k, p in m.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("pad", [0, 3, 4])  # rank 0's first and last row, rank 1's first
@pytest.mark.parametrize("table", ["[S(0)]", "[S(1)]", "[R]"])
def test_adamw_steps_equal_torch_in_float64(tied, pad, table):
    from parcomp.frontends.torch.export import import_torch

    torch.manual_seed(pad)
    m = _LM(8, 4, pad, tied).double()
    with torch.no_grad():  # a nonzero padding row: weight decay must visibly shrink it
        m.wte.weight[pad] = torch.arange(1.0, 5.0, dtype=torch.float64)
    ids = torch.tensor([[1, pad, 7, pad], [0, 4, pad, 6]])
    labels = torch.tensor([[2, 5, pad, 7], [1, 3, 3, 4]])
    g = import_torch(m, (ids,))
    (name,) = [n.name for n in g.params if n.type.shape == (8, 4)] if tied else ["wte.weight"]
    c = compile_graph(g, spec(f"mesh tp=2\n{name} {table}\ninput ids replicated\n"
                              "train loss=cross_entropy optimizer=adamw(lr=0.1, weight_decay=0.25) steps=3\n"))
    feeds = {**{k: v.detach().numpy() for k, v in m.state_dict().items() if k in c.logical},
             "ids": ids.numpy(), "labels": labels.numpy()}
    # promoted: the step counter (a float32 input of the graph) in float64 too, as torch's
    # AdamW computes its bias corrections in Python floats
    c = promote_compiled(c)
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, 3)["state"]
    want = _torch_steps(m, ids, labels, 3, 0.1, 0.25)
    for k in [n.name for n in c.logical.params if n.name in want]:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-10, atol=1e-12, err_msg=k)
    row = got[name][pad]
    if tied:  # the head's gradient still reaches the row: more than weight decay moved it
        assert np.abs(row - feeds[name][pad] * (1 - 0.1 * 0.25) ** 3).max() > 1e-3
    else:  # only weight decay: AdamW's moments of a zero gradient stay zero
        np.testing.assert_allclose(row, feeds[name][pad] * (1 - 0.1 * 0.25) ** 3, rtol=1e-14)


def test_the_frontend_keeps_padding_idx_and_a_plain_embedding_has_none():
    from parcomp.frontends.torch.export import import_torch

    ids = (torch.tensor([1, 2]),)
    (e,) = import_torch(torch.nn.Embedding(4, 2, padding_idx=-1), ids).by_op("embedding")
    assert e.attr("padding_idx") == 3  # torch wraps a negative index
    (e,) = import_torch(torch.nn.Embedding(4, 2), ids).by_op("embedding")
    assert e.attr("padding_idx") is None
    g = parse_graph(EMB_TRAIN.format(v=4, pad=0))
    assert run_unsharded(g, {"ids": np.zeros((2, 3), "i8"), "dy": np.ones((2, 3, 2)),
                             "wte": np.ones((4, 2))})["l"] == 12  # the lookup is unchanged


_TIED = '''\
import torch
from torch import nn


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(8, 4, padding_idx=5)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        return self.head(self.ln(self.wte(ids)))


def make():
    torch.manual_seed(0)
    return Tied().eval(), (torch.tensor([[1, 5, 7, 5], [0, 4, 5, 6]]),), ["ids"]
'''


@pytest.mark.slow
def test_vocab_parallel_tied_table_with_a_padding_row_trains_on_two_gloo_ranks(tmp_path, capsys):
    """program.py's lookup and scatter on each rank's rows (row 5 is rank 1's), pinned
    vocab-parallel: the emitted helper skips the padding row where the interpreter does."""
    import json

    from parcomp.cli.main import main

    (tmp_path / "m.py").write_text(_TIED)
    (tmp_path / "s.pcs").write_text("mesh tp=2\nhead.weight [S(0)]\ninput ids replicated\n"
                                    "activation embedding [P]\n"
                                    "train loss=cross_entropy optimizer=adamw(lr=0.1, weight_decay=0.25) steps=3\n")
    rc = main(["run", f"{tmp_path / 'm.py'}:make", "--spec", str(tmp_path / "s.pcs"), "--nproc", "2",
               "--keep", str(tmp_path / "out"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out
    text = (tmp_path / "out" / "program.py").read_text()
    assert "embedding_grad_rows(bw_layer_norm_layer_norm_grad, ids, 4, COORD[0] * 4, padding_idx=5)" in text
