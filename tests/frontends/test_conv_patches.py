"""Patch convolutions (stride equal to the kernel: a ViT's patch embedding) lowered by the
torch frontend to reshape/permute + matmul: the forward and its gradients against torch in
float64 (1-, 2- and 3-D, with and without bias, unbatched, spatial sizes the kernel does not
divide), sharded == unsharded with the weight split either way, the located error of every
other convolution, and transformers' ViTForImageClassification trained at TP=2."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from parcomp.check.check64 import promote_compiled
from parcomp.check.training import numpy_train, train_steps
from parcomp.cli.main import main
from parcomp.compile.compiler import compile_graph
from parcomp.errors import FrontendError
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import NUMPY_OPS, run_unsharded

from graphs import spec

torch = pytest.importorskip("torch")

_CONV = {1: torch.nn.Conv1d, 2: torch.nn.Conv2d, 3: torch.nn.Conv3d}


class _Patches(torch.nn.Module):
    """A patch convolution followed by a nonlinearity (so a wrong sum would show)."""

    def __init__(self, dims, c, o, kernel, bias):
        super().__init__()
        self.proj = _CONV[dims](c, o, kernel_size=kernel, stride=kernel, bias=bias)

    def forward(self, x):
        return torch.tanh(self.proj(x))


def _import(m, x):
    from parcomp.frontends.torch.export import import_torch

    return import_torch(m, (x,), ["x"])


def _feeds(m, g, x):
    return {**{k: v.detach().numpy() for k, v in m.state_dict().items() if k in g}, "x": x.numpy()}


@settings(max_examples=30, deadline=None)
@given(dims=st.sampled_from([1, 2, 3]), c=st.integers(1, 3), o=st.integers(1, 4),
       k=st.lists(st.integers(1, 3), min_size=3, max_size=3), extra=st.lists(st.integers(0, 2), min_size=3, max_size=3),
       batch=st.sampled_from([None, 1, 2]), bias=st.booleans(), seed=st.integers(0, 9))
def test_forward_and_gradients_equal_torch_in_float64(dims, c, o, k, extra, batch, bias, seed):
    kernel = tuple(k[:dims])
    spatial = tuple(kk * (1 + e) + e % kk for kk, e in zip(kernel, extra))  # remainders dropped
    torch.manual_seed(seed)
    m = _Patches(dims, c, o, kernel, bias).double()
    x = torch.randn(((batch,) if batch else ()) + (c,) + spatial, dtype=torch.float64)
    g = _import(m, x)
    assert not [n for n in g.nodes if "conv" in n.op]
    feeds = _feeds(m, g, x)
    got = run_unsharded(g, feeds)["output"]
    np.testing.assert_allclose(got, m(x).detach().numpy(), rtol=1e-12, atol=1e-13)
    # gradients: the loss sum(output * dy), torch autograd against the training graph's
    wrapped = _Loss(m, torch.randn(m(x).shape, dtype=torch.float64))
    c_ = compile_graph(_import(wrapped, x),
                       spec("mesh tp=1\ninput x replicated\ntrain loss=output optimizer=sgd(lr=0.0)\n"))
    out = run_unsharded(c_.logical, _feeds(wrapped, c_.logical, x))
    xt = x.clone().requires_grad_(True)
    wrapped(xt).backward()
    np.testing.assert_allclose(out["x.grad"], xt.grad.numpy(), rtol=1e-12, atol=1e-13)
    for name, p in wrapped.named_parameters():
        np.testing.assert_allclose(out[f"{name}.grad"], p.grad.numpy(), rtol=1e-12, atol=1e-13, err_msg=name)


class _Loss(torch.nn.Module):
    """``sum(module(x) * dy)``: its gradients are the VJP of ``module`` at ``dy``."""

    def __init__(self, m, dy):
        super().__init__()
        self.m = m
        self.register_buffer("dy", dy)

    def forward(self, x):
        return (self.m(x) * self.dy).sum()


def test_the_patches_are_rows_of_a_matmul_in_the_weights_order():
    m = _Patches(2, 2, 3, (2, 2), True).double()
    x = torch.arange(2 * 4 * 6, dtype=torch.float64).reshape(1, 2, 4, 6)
    g = _import(m, x)
    ops = [n.op for n in g.nodes if n.op not in ("input", "param")]
    assert ops == ["reshape", "permute", "reshape", "reshape", "permute", "matmul", "add", "permute", "tanh"]
    env = dict(_feeds(m, g, x))
    for n in g.nodes:  # every value, not only the outputs
        if n.op not in ("input", "param"):
            env[n.name] = NUMPY_OPS[n.op]([env[i] for i in n.inputs], n)
    rows = env[[n.name for n in g.nodes if n.op == "matmul"][0]]
    assert rows.shape == (1, 2, 3, 3)  # [batch, 2 x 3 patches, out channels]
    # the patch at (1, 2): rows 2..3, columns 4..5 of both channels, as torch's weight reads them
    patch = x[0, :, 2:4, 4:6].reshape(-1).numpy()
    want = m.proj.weight.detach().reshape(3, -1).numpy() @ patch
    np.testing.assert_array_equal(rows[0, 1, 2], want)


@pytest.mark.parametrize("weight", ["[S(0)]", "[S(1)]", "[R]", "colwise", "rowwise"])
@pytest.mark.parametrize("x_layout", ["replicated", "[S(0)]"])
def test_sharded_equals_unsharded_in_float64(weight, x_layout):
    torch.manual_seed(0)
    m = _Patches(2, 4, 6, (2, 2), True)
    x = torch.randn(2, 4, 4, 6)
    g = _import(m, x)
    c = compile_graph(g, spec(f"mesh tp=2\nproj.weight {weight}\ninput x {x_layout}\n"
                              "train loss=mse optimizer=adamw(lr=0.1) steps=2\n"))
    c = promote_compiled(c)
    feeds = {k: np.asarray(v, np.float64) for k, v in _feeds(m, g, x).items()}
    feeds["target"] = np.random.default_rng(1).standard_normal((2, 6, 2, 3))
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, 2)
    want = numpy_train(c.logical, feeds, 2)
    for k, v in want["state"].items():
        np.testing.assert_allclose(got["state"][k], v, rtol=1e-12, atol=1e-13, err_msg=k)
    for k, v in want["outputs"].items():
        np.testing.assert_allclose(got["outputs"][k], v, rtol=1e-12, atol=1e-13, err_msg=k)


@pytest.mark.parametrize("conv, needle", [
    (torch.nn.Conv2d(3, 4, 3, stride=2), "kernel [3, 3] and stride [2, 2]"),
    (torch.nn.Conv2d(3, 4, 2, stride=2, padding=1), "kernel [2, 2] and padding [1, 1]"),
    (torch.nn.Conv2d(3, 4, 2, stride=2, dilation=2), "dilation [2, 2]"),
    (torch.nn.Conv2d(4, 4, 2, stride=2, groups=2), "groups=2"),
    (torch.nn.Conv1d(3, 4, 3, padding="same"), "padding='same'"),
    (torch.nn.ConvTranspose2d(3, 4, 2, stride=2), "transposed"),
])
def test_other_convolutions_are_a_located_error(conv, needle):
    x = torch.randn(1, conv.in_channels, *([8] * (conv.weight.dim() - 2)))
    with pytest.raises(FrontendError) as info:
        _import(torch.nn.Sequential(conv), x)
    assert needle in str(info.value) and "patch convolutions" in str(info.value)


_STRIDED = '''\
import torch
from torch import nn


class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=1, padding=1)

    def forward(self, x):
        return self.conv(x)


def make():
    return Stem().eval(), (torch.randn(1, 3, 8, 8),), ["x"]
'''


def test_an_overlapping_convolution_stops_the_cli_at_the_users_line(tmp_path, capfd):
    (tmp_path / "stem.py").write_text(_STRIDED)
    rc = main(["plan", f"{tmp_path / 'stem.py'}:make", "--mesh", "tp=2", "-o", str(tmp_path / "p.pcs"),
               "--json"])
    out, err = capfd.readouterr()
    assert rc == 2 and "Traceback" not in err and not (tmp_path / "p.pcs").exists()
    assert "stem.py:11:9\n            return self.conv(x)\n" in err, err
    assert "kernel [3, 3] and stride [1, 1], padding [1, 1] in module 'conv'" in err and "patch convolutions" in err
    assert json.loads(out.strip().splitlines()[-1])["ok"] is False


def test_vit_for_image_classification_as_it_comes_equals_torch_and_trains_at_tp2():
    """transformers' ViT (its Conv2d patch embedding untouched): the import equals the module
    in float64; the TP=2 training spec's program equals the unsharded steps in float64."""
    pytest.importorskip("transformers")
    import copy
    import pathlib
    import sys

    from parcomp.spec import load_spec

    root = pathlib.Path(__file__).resolve().parents[1].parent
    sys.path.insert(0, str(root / "specs"))
    try:
        import models
    finally:
        sys.path.remove(str(root / "specs"))
    m, (x,), names = models.vit_classifier()
    wide = copy.deepcopy(m).double()
    g = _import(wide, x.double())
    feeds = {**{k: v.detach().numpy() for k, v in wide.state_dict().items() if k in g}, "x": x.double().numpy()}
    np.testing.assert_allclose(run_unsharded(g, feeds)["logits"], wide(x.double()).logits.detach().numpy(),
                               rtol=1e-10, atol=1e-12)
    from parcomp.frontends.torch.export import import_torch

    c = promote_compiled(compile_graph(import_torch(m, (x,), names),
                                       load_spec(root / "specs" / "vit_classifier_tp2_train.pcs")))
    assert [(r["kind"], r["phase"]) for r in c.report["collectives"]].count(("all_reduce", "forward")) == 4
    feeds = {**{k: v.detach().double().numpy() for k, v in m.state_dict().items() if k in c.logical},
             "pixel_values": x.double().numpy(), "labels": np.array([3, 7])}
    prog = c.program
    got = train_steps(lambda s: run_spmd(prog, s).outputs(prog), c.logical, feeds, 2)
    want = numpy_train(c.logical, feeds, 2)
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=1e-12)
    for k, v in want["state"].items():
        np.testing.assert_allclose(got["state"][k], v, rtol=1e-10, atol=1e-12, err_msg=k)


VIT17 = """
import torch
def vit17():
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    config = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return ViTForImageClassification(config).eval(), (torch.randn(2, 3, 16, 16),), ["pixel_values"]
"""


def test_vit_with_17_tokens_trains_under_sequence_parallel_like_torch(tmp_path, capsys):
    """16x16 images in 4x4 patches and the class token: 17 tokens, which tp=2 does not divide.
    ``sequence-parallel`` pads each norm's input to 18 positions (zeros at the end), runs the norm
    split 9 per rank and cuts its output back to 17 (parcomp/passes/attention/seqpar.py; before:
    a located error asking for the padding). ``parcomp check`` (2 AdamW steps) equals torch,
    with Megatron's sequence-parallel collectives: each of the 4 block norms' input
    reduce-scattered (the embeddings' need nothing) and every norm's output gathered forward,
    the mirrors backward, and the norm weights' gradients summed once."""
    pytest.importorskip("transformers")
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1].parent
    (tmp_path / "vit17.py").write_text(VIT17)
    (tmp_path / "s.pcs").write_text((root / "specs" / "vit_classifier_tp2_train.pcs").read_text()
                                    + "\nsequence-parallel\n")
    rc = main(["check", f"{tmp_path}/vit17.py:vit17", "--spec", str(tmp_path / "s.pcs"), "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["ok"], out
    kinds = {}
    for c in out["collectives"]:
        kinds[(c["kind"], c["phase"])] = kinds.get((c["kind"], c["phase"]), 0) + 1
    assert kinds == {("all_gather", "forward"): 5, ("reduce_scatter", "forward"): 4,
                     ("all_gather", "backward"): 5, ("reduce_scatter", "backward"): 4,
                     ("all_reduce", "backward"): 1}, kinds
