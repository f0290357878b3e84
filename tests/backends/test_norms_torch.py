"""The norms + embedding part against torch: the dropout mask bit for bit, the
aten lowerings (LayerNorm, RMSNorm, LlamaRMSNorm, Embedding, dropout, native ops), tied
embeddings against autograd, and the
emitted program of a sequence- and vocab-parallel block under torchrun."""
import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.ir import parse_graph
from parcomp.reference import norm_ops
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from graphs import spec
from numerics import assert_all_equivalent, assert_equivalent
from test_norms import DROP

torch = pytest.importorskip("torch")


def test_dropout_mask_numpy_equals_torch_bit_for_bit():
    torch = pytest.importorskip("torch")
    from parcomp_backends.torch.emit.norms import NORM_RUNTIME

    env = {"torch": torch}
    exec(NORM_RUNTIME, env)  # noqa: S102 - the helpers program.py pastes
    node = parse_graph(DROP)["y"]
    # blocks of small and huge tensors: flat indices beyond 2**32 and 2**40
    for shape, gshape, start, p, seed in [((4, 8, 8), (4, 8, 8), (0, 0, 0), 0.5, 5),
                                          ((3, 5), (9, 10), (6, 5), 0.1, 2**31 + 7),
                                          ((2, 7), (2**20, 2**21), (2**20 - 2, 2**21 - 7), 0.9, 0),
                                          ((5,), (2**45,), (2**45 - 5,), 0.3, 123)]:
        n = node.with_attrs(p=p, seed=seed, index_start=start, index_shape=gshape)
        want = norm_ops.dropout_keep(n, shape)
        got = env["dropout_keep"](shape, p, seed, gshape, start).numpy()
        np.testing.assert_array_equal(got, want)
        for step in (1, 7, 2**24):  # a training step's mask: the step counter is a float32 tensor
            want = norm_ops.dropout_keep(n, shape, step)
            got = env["dropout_keep"](shape, p, seed, gshape, start, step=torch.tensor(float(step))).numpy()
            np.testing.assert_array_equal(got, want)
    x = np.arange(1, 13, dtype="f4").reshape(3, 4)
    n = node.with_attrs(p=0.25, seed=3)
    got = env["dropout_by_index"](torch.tensor(x), 0.25, 3, (3, 4), (0, 0)).numpy()
    np.testing.assert_array_equal(got, norm_ops.NORM_NUMPY_OPS["dropout"]([x], n))
    got = env["dropout_by_index"](torch.tensor(x), 0.25, 3, (3, 4), (0, 0), step=torch.tensor(2.0)).numpy()
    np.testing.assert_array_equal(got, norm_ops.NORM_NUMPY_OPS["dropout"]([x, np.float32(2)], n))



def _aten_ops(fn, *args):
    """(result, [aten overload names]) of ``fn(*args)``: every aten op it dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    with Record() as rec:
        out = fn(*args)
    return out, rec.ops


def test_layer_norm_grad_helper_runs_torch_fused_backward_kernel():
    """program.py's layer_norm dx: native_layer_norm (its mean, rstd) + the fused backward,
    as autograd runs it, not an elementwise chain over the tokens; equal to autograd's dx."""
    from parcomp_backends.torch.emit.norms import NORM_RUNTIME

    env = {"torch": torch}
    exec(NORM_RUNTIME, env)  # noqa: S102 - the helpers program.py pastes
    g = torch.Generator().manual_seed(0)
    x, dy, w = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g), torch.randn(16, generator=g)
    dx, ops = _aten_ops(env["norm_grad"], dy, x, w, 1e-5, False)
    assert ops == ["aten.native_layer_norm", "aten.native_layer_norm_backward"], ops
    xr = x.clone().requires_grad_(True)
    torch.nn.functional.layer_norm(xr, (16,), w, None, 1e-5).backward(dy)
    torch.testing.assert_close(dx, xr.grad, rtol=1e-5, atol=1e-5)
    dx_plain, _ = _aten_ops(env["norm_grad"], dy, x, None, 1e-5, False)  # no weight
    xr.grad = None
    torch.nn.functional.layer_norm(xr, (16,), None, None, 1e-5).backward(dy)
    torch.testing.assert_close(dx_plain, xr.grad, rtol=1e-5, atol=1e-5)
    dr, _ = _aten_ops(env["norm_grad"], dy, x, w, 1e-6, True)  # rms_norm keeps its formula
    xr.grad = None
    torch.nn.functional.rms_norm(xr, (16,), w, 1e-6).backward(dy)
    torch.testing.assert_close(dr, xr.grad, rtol=1e-5, atol=1e-5)



LN_MODEL = """\
%x: {t}[4,6,16] = input()
%ln.weight: {t}[16] = param()
%ln.bias: {t}[16] = param()
%h: {t}[4,6,16] = layer_norm(%x, %ln.weight, %ln.bias) {{eps=1e-05}}
%fc.weight: {t}[8,16] = param()
%fc.wt: {t}[16,8] = permute(%fc.weight) {{perm=(1, 0)}}
%y: {t}[4,6,8] = matmul(%h, %fc.wt)
return %y as output
"""


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_layer_norm_gradients_are_one_fused_backward_in_the_step_and_equal_autograd(tmp_path, dtype):
    """A training step of LayerNorm -> Linear: the layer norm's dx, dweight and dbias come from
    one ``layer_norm_grads`` statement (one native_layer_norm_backward with its output mask, as
    autograd runs it, on the mean and rstd the forward's kernel kept), not dx alone plus a
    layer_norm of x, a mul and two sums; the memory report counts the kept mean and rstd;
    every gradient equals torch's autograd."""
    import importlib.util

    from parcomp_backends.torch.emit import RUNTIME_MARK, emit_program

    short = {"float64": "f64", "float32": "f32"}[dtype]
    c = compile_graph(parse_graph(LN_MODEL.format(t=short)), spec("mesh tp=1\ntrain loss=mse optimizer=sgd(lr=0.1)\n"))
    text = emit_program(c, "cpu")
    step = text.split("def train_step")[1].split(RUNTIME_MARK)[0]
    assert step.count(" = layer_norm_grads(") == 1 and step.count("saved=h_saved)") == 1, step
    assert step.count("h, h_saved = layer_norm_forward(") == 1 and "del h_saved" in step
    assert "torch.nn.functional.layer_norm(" not in step and "norm_grad(" not in step
    from parcomp.ir.liveness import layer_norm_saved_bytes, saved_layer_norm

    forward = c.program_.graph
    assert list(saved_layer_norm(forward)) == ["h"]
    width = {"float64": 8, "float32": 4}[dtype]
    assert layer_norm_saved_bytes(forward["h"].type, forward["h"].type.nbytes) == 4 * 6 * 2 * width
    (tmp_path / "program.py").write_text(text)
    mod_spec = importlib.util.spec_from_file_location("parcomp_layer_norm_program", tmp_path / "program.py")
    program = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(program)
    rng = np.random.default_rng(0)
    feeds = {n.name: torch.from_numpy(rng.standard_normal(n.type.shape).astype(dtype))
             for n in c.logical.nodes if n.op in ("input", "param")}
    params = {n.name: feeds[n.name].clone() for n in c.logical.params}
    inputs = {n.name: feeds[n.name].clone() for n in c.logical.inputs}
    ops = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record(), torch.no_grad():
        out = program.train_step(params, inputs)
    # the forward's layer_norm and its backward: mean and rstd not computed again
    assert ops.count("native_layer_norm") == 1 and ops.count("native_layer_norm_backward") == 1, ops
    x = feeds["x"].clone().requires_grad_(True)
    w, b, fw = (feeds[k].clone().requires_grad_(True) for k in ("ln.weight", "ln.bias", "fc.weight"))
    y = torch.nn.functional.layer_norm(x, (16,), w, b, 1e-5) @ fw.T
    torch.nn.functional.mse_loss(y, feeds["target"]).backward()
    tol = {"float64": 1e-12, "float32": 1e-5}[dtype]
    for name, t in (("x", x), ("ln.weight", w), ("ln.bias", b), ("fc.weight", fw)):
        torch.testing.assert_close(out[name + ".grad"], t.grad, rtol=tol, atol=tol * float(t.grad.abs().max()))


# --- tied input/output embeddings (GPT-2's lm_head.weight is wte.weight) -------------------

def _tied_module():
    """Embedding -> LayerNorm -> head whose weight IS the embedding table (GPT-2's tying)."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(8, 4)
            self.ln = torch.nn.LayerNorm(4)
            self.head = torch.nn.Linear(4, 8, bias=False)
            self.head.weight = self.wte.weight

        def forward(self, ids):
            return self.head(self.ln(self.wte(ids)))

    torch.manual_seed(0)
    return Tied()


def test_tied_embedding_gradient_sums_both_uses_once():
    from parcomp.frontends.torch.export import import_torch

    m = _tied_module()
    ids = torch.tensor([[1, 4, 7, 3], [0, 4, 2, 6]])
    g = import_torch(m, (ids,))
    (table,) = [n.name for n in g.params if n.type.shape == (8, 4)]  # one parameter, used twice
    assert len(g.users()[table]) == 2
    c = compile_graph(g, spec(f"mesh tp=2\n{table} [S(0)]\ninput ids replicated\n"
                              "train loss=cross_entropy optimizer=sgd(lr=0.0)\n"))
    labels = np.array([[2, 5, 0, 7], [1, 3, 3, 4]])
    feeds = {**{k: v.detach().numpy() for k, v in m.state_dict().items() if k in c.logical},
             "ids": ids.numpy(), "labels": labels}
    got = run_spmd(c.program, feeds).outputs(c.program)
    logits = m(ids)
    torch.nn.functional.cross_entropy(logits.reshape(-1, 8), torch.tensor(labels).reshape(-1)).backward()
    want = m.wte.weight.grad.numpy()  # autograd: both uses summed
    assert_equivalent(got[f"{table}.grad"], want)
    emb_only = [n for n in c.logical.nodes if n.op == "embedding_grad"]
    assert len(emb_only) == 1  # the embedding's scatter-add, added to the head's matmul gradient


def test_torch_reference_names_a_tied_weight_as_export_does_and_resumes_its_state():
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec.train_config import train_config
    from parcomp.check.training import torch_train

    m = _tied_module()
    ids, labels = torch.tensor([[1, 4, 7, 3]]), np.array([[2, 5, 0, 7]])
    names = {n.name for n in import_torch(m, (ids,)).params}
    cfg = train_config(spec("mesh tp=2\ntrain loss=cross_entropy optimizer=adamw(lr=0.01)\n"))
    two = torch_train(m, (ids,), ["ids"], {"labels": labels}, cfg, 2)
    assert set(two["params"]) == names and "head.weight.exp_avg" in two["state"]  # not wte.weight
    one = torch_train(m, (ids,), ["ids"], {"labels": labels}, cfg, 1)
    resumed = torch_train(m, (ids,), ["ids"], {"labels": labels}, cfg, 1,
                          start={**one["params"], **one["state"]}, first=2)
    for k in names:  # step 2 from step 1's state (the tied weight's moments included) is step 2
        np.testing.assert_array_equal(resumed["params"][k], two["params"][k])


# --- torch.export frontend --------------------------------------------------------------

def _norms_module(torch, dropout=0.0):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(16, 8)
            self.ln = torch.nn.LayerNorm(8)
            self.rms = torch.nn.RMSNorm(8, eps=1e-6)
            self.llama = LlamaRMSNorm(8, eps=1e-6)
            self.plain = torch.nn.LayerNorm(8, elementwise_affine=False)
            self.drop = torch.nn.Dropout(dropout)
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, ids):
            h = self.drop(self.ln(self.wte(ids)))
            return self.plain(self.fc(self.llama(self.rms(h))))

    torch.manual_seed(0)
    m = Block()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return m


def test_frontend_lowers_norms_embedding_and_llama_rmsnorm_pattern():
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from parcomp.frontends.torch.export import import_torch

    m = _norms_module(torch)
    ids = torch.tensor([[1, 15, 7, 8], [0, 3, 12, 4]])
    g = import_torch(m, (ids,))
    ops = [n.op for n in g.nodes if n.op not in ("param", "input")]
    assert ops == ["embedding", "layer_norm", "rms_norm", "rms_norm", "permute", "matmul", "add", "layer_norm"]
    assert g[g.by_op("rms_norm")[1].name].inputs[1] == "llama.weight"  # w * (x * rsqrt(...)) folded
    assert [n.name for n in g.by_op("rms_norm")] == ["rms_norm", "rms_norm_2"]  # a spec can name them
    feeds = {**{k: v.detach().numpy() for k, v in m.state_dict().items()}, "ids": ids.numpy()}
    got = run_unsharded(g, feeds)["output"]
    assert_equivalent(got, m(ids).detach().numpy())


def test_frontend_dropout_in_training_mode_and_native_ops_after_decomposition():
    torch = pytest.importorskip("torch")
    from parcomp.frontends.torch.export import import_torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(8)
            self.drop = torch.nn.Dropout(0.2)

        def forward(self, x):
            h = self.drop(self.ln(x))
            h.relu_()  # an in-place op: export decomposes to native_dropout / getitem
            return self.drop(h)

    g = import_torch(M(), (torch.randn(2, 4, 8),))
    drops = g.by_op("dropout")
    assert [(n.attr("p"), n.attr("seed")) for n in drops] == [(0.2, 0), (0.2, 1)]  # one seed per site
    assert len(g.by_op("layer_norm")) == 1
    assert not import_torch(M().eval(), (torch.randn(2, 4, 8),)).by_op("dropout")


def test_frontend_rejects_a_non_last_dim_norm_with_a_location():
    torch = pytest.importorskip("torch")
    from parcomp.errors import FrontendError
    from parcomp.frontends.torch.export import import_torch

    with pytest.raises(FrontendError, match=r"normalized_shape \[3, 4\].*last dim only"):
        import_torch(torch.nn.LayerNorm([3, 4]), (torch.randn(2, 3, 4),))


# --- the emitted program under torchrun ---------------------------------------------------

@pytest.mark.slow
def test_sequence_parallel_vocab_parallel_program_on_two_gloo_ranks(tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from parcomp.frontends.torch.export import import_torch
    from parcomp.check.training import train_steps
    from parcomp_backends.torch import assemble_training_outputs, run_torchrun
    from parcomp_backends.torch.launch import write_program

    m = _norms_module(torch, dropout=0.25).train()
    ids = torch.tensor([[1, 15, 7, 8], [0, 3, 12, 4]])
    g = import_torch(m, (ids,))
    # Megatron's SP plan: `sequence-parallel` pins the norm regions split along the sequence
    c = compile_graph(g, spec("mesh tp=2\nwte.weight [S(0)]\nfc.weight colwise\ninput ids replicated\n"
                              "sequence-parallel\ntrain loss=mse optimizer=sgd(lr=0.1) steps=2\n"))
    assert c.program.by_op("bucket_cat") and c.program.by_op("dropout")
    target = np.random.default_rng(1).standard_normal(c.logical["target"].type.shape).astype("f4")
    feeds = {**{k: v.detach().numpy() for k, v in m.state_dict().items() if k in c.logical},
             "ids": ids.numpy(), "target": target}
    write_program(c, tmp_path)
    res = run_torchrun(tmp_path, 2, m, {"ids": ids, "target": torch.tensor(target)}, tmp_path / "out.pt",
                       ("--device", "cpu", "--steps", "2"), timeout=180)
    assert res.returncode == 0, res.stderr[-4000:]
    out, losses = assemble_training_outputs(tmp_path / "out.pt", c.program)
    want = train_steps(lambda s: run_unsharded(c.logical, s), c.logical, feeds, 2)
    assert_all_equivalent(out, want["outputs"])
    assert_equivalent(np.array(losses), np.array(want["losses"]))


def test_frontend_native_layer_norm_value_and_its_stats_rejected():
    torch = pytest.importorskip("torch")
    from parcomp.errors import FrontendError
    from parcomp.frontends.torch.export import import_torch

    class Native(torch.nn.Module):
        def __init__(self, stats):
            super().__init__()
            self.w, self.b, self.stats = torch.nn.Parameter(torch.randn(8)), torch.nn.Parameter(torch.randn(8)), stats

        def forward(self, x):
            y, mean, rstd = torch.native_layer_norm(x, [8], self.w, self.b, 1e-5)
            return y * rstd if self.stats else y

    x = torch.randn(2, 3, 8)
    g = import_torch(Native(False), (x,))
    assert [n.op for n in g.nodes if n.op not in ("param", "input")] == ["layer_norm"]
    m = Native(False)
    feeds = {"w": m.w.detach().numpy(), "b": m.b.detach().numpy(), "x": x.numpy()}
    assert_equivalent(run_unsharded(g, feeds)["output"], m(x).detach().numpy())
    with pytest.raises(FrontendError, match="output 2 of aten.native_layer_norm"):
        import_torch(Native(True), (x,))
