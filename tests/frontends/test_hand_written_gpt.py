"""A Megatron user's hand-written GPT through the torch frontend: a model file imports its neighbours as ``python FILE.py`` would; an unsupported op's hint names only a
related op or rewrite; a complex dtype is located like other frontend errors; report lines
never show an infinite tolerance as if it were what an OK rests on; a fused parameter's
index and part count are the user's."""
import os
import sys

import pytest

from parcomp.cli.main import main
from parcomp.errors import FrontendError
from parcomp.frontends.loader import load_model

NEIGHBOUR = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 8, bias=False)

    def forward(self, x):
        return self.w(x)
'''


def _two_files(folder, tag):
    """``folder/m.py`` whose top level imports its neighbour ``folder/<tag>.py``."""
    folder.mkdir()
    (folder / f"{tag}.py").write_text(NEIGHBOUR)
    (folder / "m.py").write_text(f"import torch\nimport {tag}\n\n\n"
                                 f"def net():\n    torch.manual_seed(0)\n"
                                 f"    return {tag}.Net(), (torch.randn(2, 4),), ['x']\n")
    return folder / "m.py"


def test_a_model_file_imports_its_neighbour_from_any_directory(tmp_path, monkeypatch):
    """``parcomp check models/m.py:net`` from another directory: m.py's ``import <tag>``
    finds models/<tag>.py, and sys.path is as it was after loading."""
    tag = "gpt_neighbour_a"
    path = _two_files(tmp_path / "models", tag)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    before = list(sys.path)
    try:
        graph, module, _ = load_model(os.path.relpath(path) + ":net")
    finally:
        sys.modules.pop(tag, None)
    assert type(module).__name__ == "Net" and graph.params
    assert sys.path == before


def test_compile_of_a_model_file_with_a_neighbour_records_the_same_reference(tmp_path, monkeypatch, capsys):
    tag = "gpt_neighbour_b"
    path = _two_files(tmp_path / "models", tag)
    (tmp_path / "s.pcs").write_text("mesh tp=2\nw.weight colwise\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    try:
        rc = main(["compile", "models/m.py:net", "--spec", "s.pcs", "-o", "out"])
    finally:
        sys.modules.pop(tag, None)
    assert rc == 0, capsys.readouterr().err
    program = (tmp_path / "out" / "program.py").read_text()
    assert "model: m.py:net" in program and str(tmp_path) not in program
    assert str(tmp_path) not in (tmp_path / "out" / "report.json").read_text()
    assert sys.path == before


# ---- 2: an unsupported op's hint is a related op or rewrite, or nothing ------------------

import math  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from parcomp.frontends.torch.export import import_torch, supported_ops  # noqa: E402
from parcomp.frontends.torch.fold import module_sources  # noqa: E402
from parcomp.frontends.torch.hints import REWRITES, unsupported_hint  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402

from numerics import assert_equivalent  # noqa: E402


def check_against_torch(module, inputs):
    """The imported graph run by numpy (its folded constants fed too) equals torch's
    forward within float32's tolerance."""
    graph = import_torch(module, inputs)
    feeds = {k: v.detach().numpy() for k, v in module_sources(module).items()}
    feeds.update({n.name: t.numpy() for n, t in zip(graph.inputs, inputs)})
    (name,) = graph.outputs
    want = module(*inputs).detach().numpy()
    assert_equivalent(run_unsharded(graph, feeds)[name], want, what=name)


class Attn(nn.Module):
    """4 query heads of 8 over [2, 8, 32]; ``scores(att, q, k, v)`` gives the attention
    output from q [2, 4, 8, 8] and k, v [2, kv, 8, 8]."""

    def __init__(self, how, kv=4):
        super().__init__()
        self.how, self.kv = how, kv
        self.q, self.k, self.v = nn.Linear(32, 32), nn.Linear(32, 8 * kv), nn.Linear(32, 8 * kv)

    def forward(self, x):
        q = self.q(x).view(2, 8, 4, 8).transpose(1, 2)
        k, v = (f(x).view(2, 8, self.kv, 8).transpose(1, 2) for f in (self.k, self.v))
        return self.how(q, k, v).transpose(1, 2).reshape(2, 8, 32)


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(8)


def _causal():
    return torch.ones(8, 8, dtype=torch.bool).tril()


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _rope_tables():
    inv = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))
    freqs = torch.outer(torch.arange(8).float(), inv)
    return freqs, torch.cat((freqs, freqs), -1)


def _rope_complex(q, k, v):
    freqs, _ = _rope_tables()
    fc = torch.polar(torch.ones(8, 4), freqs)
    q = torch.view_as_real(torch.view_as_complex(q.reshape(2, 4, 8, 4, 2)) * fc).flatten(3)
    return _sdpa(q, k, v)


def _rope_real(q, k, v):
    _, emb = _rope_tables()
    return _sdpa(q * emb.cos() + _rotate_half(q) * emb.sin(), k, v)


def _gqa_expand(q, k, v):
    k, v = (t[:, :, None].expand(2, 2, 2, 8, 8).reshape(2, 4, 8, 8) for t in (k, v))
    return _sdpa(q, k, v)


class Elementwise(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.fc = how, nn.Linear(16, 16)

    def forward(self, x):
        return self.how(self.fc(x))


class Rows(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how, self.w = how, nn.Parameter(torch.randn(8, 16))

    def forward(self, idx):
        return self.how(self.w, idx)


X = torch.randn(2, 8, 16)
X32 = torch.randn(2, 8, 32)
IDX = torch.randint(0, 8, (2, 8))
_M = (lambda a: a.squeeze(-1) + torch.log(torch.exp(X - a).sum(-1)))
ATT = [  # (what a user writes, the rewrite the hint names)
    ("masked_fill", lambda q, k, v: _scores(q, k).masked_fill(~_causal(), float("-inf")).softmax(-1) @ v, _sdpa),
    ("where", lambda q, k, v: torch.where(_causal(), _scores(q, k), float("-inf")).softmax(-1) @ v,
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_causal())),
    ("tril", lambda q, k, v: (torch.tril(_scores(q, k)) - 1e9 * (~_causal())).softmax(-1) @ v, _sdpa),
]
ELEMENTWISE = [
    ("roll", lambda x: torch.roll(x, 1, dims=1), lambda x: torch.cat((x[:, -1:], x[:, :-1]), dim=1)),
    ("cumsum", lambda x: torch.cumsum(x, -1), lambda x: x @ torch.ones(16, 16).triu()),
    ("max", lambda x: torch.max(x, -1).values, lambda x: x.amax(-1)),
    ("min", lambda x: torch.min(x, -1).values, lambda x: -(-x).amax(-1)),
    ("amin", lambda x: x.amin(-1), lambda x: -(-x).amax(-1)),
    ("var", lambda x: x.var(-1), lambda x: ((x - x.mean(-1, keepdim=True)) ** 2).mean(-1) * 16 / 15),
    ("std", lambda x: x.std(-1), lambda x: (((x - x.mean(-1, keepdim=True)) ** 2).mean(-1) * 16 / 15).sqrt()),
    ("logsumexp", lambda x: torch.logsumexp(x, -1),
     lambda x: (lambda m: m.squeeze(-1) + torch.log(torch.exp(x - m).sum(-1)))(x.amax(-1, keepdim=True))),
    ("outer", lambda x: torch.outer(x[0, 0], x[0, 1]), lambda x: x[0, 0][:, None] * x[0, 1][None, :]),
    ("einsum", lambda x: torch.einsum("bsd,bse->bde", x, x), lambda x: x.transpose(1, 2) @ x),
    ("expm1", torch.expm1, lambda x: torch.exp(x) - 1),
    ("exp2", torch.exp2, lambda x: torch.exp(x * math.log(2))),
    ("log1p", lambda x: torch.log1p(x * x), lambda x: torch.log(1 + x * x)),
]


def _copied_into_zeros(x):
    buf = torch.zeros(x.shape)
    buf[:] = x
    return buf


def _hint_of(module, inputs, op):
    with pytest.raises(FrontendError) as e:
        import_torch(module, inputs)
    msg = e.value.message
    assert f"unsupported op aten.{op}." in msg and "nearest supported op" not in msg, msg
    assert unsupported_hint(op, supported_ops()) in msg
    return msg


@pytest.mark.parametrize("op,wrote,rewrite", ATT, ids=[c[0] for c in ATT])
def test_an_attention_op_s_hint_is_a_rewrite_that_imports(op, wrote, rewrite):
    torch.manual_seed(0)
    assert "rewrite it with supported ops: " + REWRITES[op] in _hint_of(Attn(wrote), (X32,), op)
    torch.manual_seed(0)
    check_against_torch(Attn(rewrite), (X32,))


@pytest.mark.parametrize("wrote,rewrite", [
    (lambda q, k, v: _sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)), _gqa_expand),
    (lambda q, k, v: _sdpa(q, k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)),
     lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))])
def test_repeat_interleave_of_kv_heads_names_both_gqa_rewrites(wrote, rewrite):
    torch.manual_seed(0)
    msg = _hint_of(Attn(wrote, kv=2), (X32,), "repeat_interleave")
    assert ".expand(b, kv_heads, rep, s, d).reshape(" in msg and "enable_gqa=True" in msg
    torch.manual_seed(0)
    check_against_torch(Attn(rewrite, kv=2), (X32,))


@pytest.mark.parametrize("op,wrote,rewrite", ELEMENTWISE, ids=[c[0] for c in ELEMENTWISE])
def test_an_op_s_hint_is_a_rewrite_that_imports(op, wrote, rewrite):
    torch.manual_seed(0)
    assert "rewrite it with supported ops: " + REWRITES[op] in _hint_of(Elementwise(wrote), (X,), op)
    torch.manual_seed(0)
    check_against_torch(Elementwise(rewrite), (X,))


def _written_in_parts(x):  # DeepSeek-V3's MLA keys: an empty buffer, two slices copied in
    buf = x.new_empty(x.shape[:-1] + (24,))
    buf[..., :16].copy_(x)
    buf[..., 16:].copy_(x[..., :1])  # broadcast along the slice
    return buf * 2


# allocations shaped like a tensor: folded at import whatever the tensor (only its shape counts)
ALLOCATIONS = [
    lambda x: x + torch.zeros_like(x), lambda x: x * torch.ones_like(x),
    lambda x: x + x.new_empty(x.shape).fill_(1.5), lambda x: x + torch.empty_like(x).fill_(1.5),
    lambda x: x + x.new_full(x.shape, 1.5), lambda x: x + x.new_zeros(x.shape[-1:]),
    lambda x: x * x.new_ones(x.shape[-1:]), lambda x: x * torch.full_like(x, 2.5),
    lambda x: _copied_into_zeros(x) * 2, _written_in_parts,
]



@pytest.mark.parametrize("wrote", ALLOCATIONS, ids=["zeros_like", "ones_like", "new_empty", "empty_like",
                                                     "new_full", "new_zeros", "new_ones", "full_like",
                                                     "copy", "copy_slices"])
def test_an_allocation_shaped_like_a_tensor_imports_as_written(wrote):
    torch.manual_seed(0)
    check_against_torch(Elementwise(wrote), (X,))


def test_index_select_of_rows_is_an_embedding():
    _hint_of(Rows(lambda w, i: torch.index_select(w, 0, i.flatten()).view(2, 8, 16)), (IDX,), "index_select")
    check_against_torch(Rows(lambda w, i: F.embedding(i, w)), (IDX,))


def test_every_rewrite_is_pinned_by_a_test():
    tested = {c[0] for c in ATT + ELEMENTWISE} | {"repeat_interleave", "index_select"}
    # the rest are the same rewrite as a tested one: triu as tril
    assert set(REWRITES) - tested == {"triu"}


@pytest.mark.parametrize("op,hint", [
    ("aten.sort.default", "; no supported op is close to it"),
    ("aten.sign.default", "; no supported op is close to it"),  # not sin
    ("aten.flip.default", "; no supported op is close to it"),
    ("aten.pow.Scalar", "; supported overloads of pow: aten.pow.Tensor_Scalar"),
    ("aten.relu6.default", "; nearest supported op by name only: aten.relu.default")])
def test_without_a_rewrite_only_an_overload_or_a_close_name_is_named(op, hint):
    assert unsupported_hint(op, supported_ops()) == hint


# ---- 3: complex rotary embeddings as real arithmetic; other complex ops located --------------

def _rope_complex_abs(q, k, v):
    freqs, _ = _rope_tables()
    z = torch.view_as_complex(q.reshape(2, 4, 8, 4, 2)) * torch.polar(torch.ones(8, 4), freqs)
    return _sdpa(torch.cat((z.abs(), z.abs()), -1), k, v)


def test_a_complex_rotary_embedding_imports_equal_to_torch():
    """view_as_complex, a complex product with the folded polar table, view_as_real: each
    complex value a pair of real ones; the table two frozen params (real, imaginary)."""
    torch.manual_seed(0)
    check_against_torch(Attn(_rope_complex), (X32,))
    torch.manual_seed(0)
    graph = import_torch(Attn(_rope_complex), (X32,))
    assert sorted(p.name.rsplit(".", 1)[-1] for p in graph.params if "polar" in p.name) == ["imag", "real"]


def test_another_complex_op_is_located_and_names_the_real_rewrite():
    """The message names the op and the user's line, with the real-arithmetic RoPE."""
    torch.manual_seed(0)
    with pytest.raises(FrontendError) as e:
        import_torch(Attn(_rope_complex_abs), (X32,))
    err, text = e.value, str(e.value)
    assert "aten.abs.default on a complex value is not supported" in err.message
    assert "rotate_half(q) * sin" in err.message
    assert err.loc is not None and err.loc.file == __file__ and "self.how(q, k, v)" in err.loc.text
    assert text.startswith(f"{__file__}:{err.loc.line}:{err.loc.col}\n") and "\n  at " not in text
    torch.manual_seed(0)
    check_against_torch(Attn(_rope_real), (X32,))


# ---- 4: report lines: the ratio, the place, the tolerance; the user's indices --------------

import re  # noqa: E402
from pathlib import Path  # noqa: E402

from parcomp.cli.common import vs_tolerance  # noqa: E402

GPT_FILE = Path(__file__).resolve().parents[1] / "handwritten_gpt.py"
TP2 = ("mesh tp=2\nblocks.*.attn.qkv.weight colwise\nblocks.*.attn.proj.weight rowwise\n"
       "blocks.*.mlp.w1.weight colwise\nblocks.*.mlp.w3.weight colwise\nblocks.*.mlp.w2.weight rowwise\n")


def test_a_report_line_gives_the_ratio_the_place_and_the_tolerance():
    text = vs_tolerance({"err_over_tol": 0.0042, "rel_err": 4.2e-12, "rtol": 1e-9, "worst": "step 1: w.grad[0]"})
    assert text == "error/tolerance 0.0042 at step 1: w.grad[0]: error 4.2e-12 of the scale, tolerance 1e-09"


def test_a_mismatch_in_a_fused_qkv_gpt_is_reported_at_the_user_s_indices(tmp_path, capsys, monkeypatch):
    """The hand-written GPT with bias-free LayerNorms under TP=2 training, its qkv gradient made
    wrong: every index of qkv.weight ([96, 32] as stored, a [3, 32, 32] view inside) is 2-D."""
    from parcomp.check import train_check

    real = train_check.run_spmd

    class Wrong:
        def __init__(self, run):
            self.run = run

        def outputs(self, prog):
            out = self.run.outputs(prog)
            return {k: v + 1e-3 if k.endswith("qkv.weight.grad") else v for k, v in out.items()}

    monkeypatch.setattr(train_check, "run_spmd", lambda prog, state: Wrong(real(prog, state)))
    (tmp_path / "s.pcs").write_text(TP2 + "train loss=cross_entropy optimizer=adamw(lr=0.001) steps=1\n")
    assert main(["check", f"{GPT_FILE}:gpt_ln_nobias", "--spec", str(tmp_path / "s.pcs")]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "tolerance inf" not in out
    indices = re.findall(r"qkv\.weight(?:\.\w+)*(?:\[([\d,]+)\]|: [^;]*? at \[([\d, ]+)\])", out)
    assert indices and all(len((a or b).split(",")) == 2 for a, b in indices), indices


def test_plan_says_how_many_parts_a_fused_weight_has(tmp_path):
    assert main(["plan", f"{GPT_FILE}:gpt", "--mesh", "tp=2", "-o", str(tmp_path / "p.pcs")]) == 0
    line = next(x for x in (tmp_path / "p.pcs").read_text().splitlines() if "qkv.weight" in x)
    assert "view of the fused [96,32]" in line and "each of its 3 parts split" in line, line


# ---- 5: run --keep's model.pt of a tied plain-torch model is the model's state_dict --------

def test_model_pt_holds_a_tied_weight_under_each_name(tmp_path):
    """The hand-written GPT (head.weight is tok.weight): model.pt holds both names, one storage,
    so load_state_dict(strict=True) finds tok.weight too."""
    from parcomp.cli.run_cmd import checkpoint_file
    from parcomp.frontends.loader import load_model

    graph, module, _ = load_model(f"{GPT_FILE}:gpt")
    feeds = {n.name: module.state_dict()[n.name].numpy() for n in graph.params}
    sd = torch.load(checkpoint_file(str(tmp_path), graph, feeds, module), weights_only=True)
    assert sd["head.weight"].data_ptr() == sd["tok.weight"].data_ptr()
    fresh = type(module)()
    fresh.load_state_dict(sd, strict=True)
    assert fresh.head.weight is fresh.tok.weight and torch.equal(fresh.tok.weight, module.tok.weight)


def test_the_readme_s_tied_load_line_loads_an_export_strictly(tmp_path, monkeypatch):
    """README's one-liner for a plain-torch tied export (tok.weight written once), run as written."""
    import safetensors.torch

    from handwritten_gpt import GPT

    readme = (Path(__file__).resolve().parents[1].parent / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("`sd = safetensors.torch.load_file("))
    trained = GPT()
    sd = {k: v for k, v in trained.state_dict().items() if k != "head.weight"}  # as export writes it
    (tmp_path / "out").mkdir()
    safetensors.torch.save_file(sd, str(tmp_path / "out" / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    model = GPT()
    exec(line.rstrip(".").strip("`"), {"safetensors": safetensors, "model": model})
    assert torch.equal(model.head.weight, trained.tok.weight) and model.head.weight is model.tok.weight
