"""Shapes that carry the batch size split into microbatches: a folded constant built for each
sequence of the batch (Gemma-2's eager attention masks) is imported as one row expanded over the
batch, an ``expand`` that inserts the batch dim (that row; a ViT's class token) takes the
microbatch, and a reshape scales the dims its operand's changed dims flow into, wherever the
batch went (Mixtral's expert-major token buffers). Each 2-stage, 2-microbatch step, in float64 on the interpreter, equals the unsharded
step, and its loss and gradients equal torch's on the whole batch."""
import numpy as np
import pytest

from parcomp.passes.pipeline.split_stages import rebatch

from numerics import assert_all_equivalent, assert_equivalent
from test_pipeline import ROOT, reference
from test_pipeline_models import model64

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TRAIN = "train loss=cross_entropy optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"


def _steps(factory: str, with_torch: bool = True):
    """(pipelined step, unsharded step, graph, torch's (loss, {param: gradient})) of
    ``factory``'s model in float64 from random weights and its own folded constants, on random
    token ids (or the example images) and labels; torch runs transformers' model with the same
    weights on the whole batch."""
    from parcomp.check.check64 import promote_graph
    from parcomp.check.pipeline import run_pipeline_step
    from parcomp.frontends.loader import load_model
    from parcomp.frontends.torch.fold import module_sources
    from parcomp.passes.pass_list import plan_pipeline
    from parcomp.reference.numpy_ops import run_unsharded

    from graphs import spec

    g, module, inputs = load_model(str(ROOT / "specs" / "models.py") + f":{factory}")
    g = promote_graph(g)
    ref, feeds, _ = reference(g, TRAIN, 0)
    state = {k: v.detach().double().numpy() if v.is_floating_point() else v.numpy()
             for k, v in module_sources(module).items()}
    feeds.update({p.name: state[p.name] for p in g.params  # the model's constants (masks, RoPE)
                  if not dict(p.attrs).get("trainable", True)})
    rng = np.random.default_rng(0)
    if "input_ids" in feeds:
        feeds["input_ids"] = rng.integers(0, module.config.vocab_size, np.shape(feeds["input_ids"])).astype("int64")
        x = torch.from_numpy(feeds["input_ids"])
    else:
        feeds["pixel_values"] = inputs[0].double().numpy()
        x = inputs[0].double()
    classes = g[g.outputs[0]].type.shape[-1]  # the logits' last dim
    feeds["labels"] = rng.integers(0, classes, np.shape(feeds["labels"])).astype("int64")
    got = run_pipeline_step(plan_pipeline(g, spec(f"mesh pp=2\n{TRAIN}\n")), feeds)
    if not with_torch:
        return got, run_unsharded(ref, feeds), g, None
    module = module.double()
    with torch.no_grad():
        for name, p in module.named_parameters(remove_duplicate=False):  # a tied one: by any name
            if name in feeds:
                p.copy_(torch.from_numpy(np.asarray(feeds[name])))
    logits = module(x).logits
    labels = torch.from_numpy(feeds["labels"])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in module.named_parameters(remove_duplicate=False) if p.grad is not None}
    return got, run_unsharded(ref, feeds), g, (loss.item(), grads)


def _matches_torch(got: dict, torch_step) -> None:
    """Within 1e-5 of the scale: the folded constants (RoPE tables) were computed in float32 at import,
    torch's float64 model computes them in float64."""
    loss, grads = torch_step
    assert_equivalent(np.asarray(got["loss"]), np.asarray(loss), what="loss", rtol=1e-5)
    # a key bias's gradient is zero (it shifts all of a query's scores alike: softmax cancels
    # it); what both compute there is rounding noise
    checked = [n for n in grads if f"{n}.grad" in got and np.abs(grads[n]).max() > 1e-12]
    assert len(checked) > 10
    for n in checked:
        assert_equivalent(got[f"{n}.grad"], grads[n], what=f"{n}.grad", rtol=1e-5)


def test_gemma2_masks_are_a_row_expanded_over_the_batch():
    g = model64("gemma2_lm")
    masks = [n for n in g.params if n.name.startswith("model.where")]
    assert len(masks) == 2 and all(m.type.shape == (1, 8, 8) for m in masks)  # not [2, 1, 8, 8]
    users = [n for n in g.nodes if set(n.inputs) & {m.name for m in masks}]
    assert [(u.op, u.attr("dims"), u.type.shape) for u in users] == [("expand", (0,), (2, 1, 8, 8))] * 2
    small = rebatch(g, 1)
    assert {small[u.name].type.shape for u in users} == {(1, 1, 8, 8)}


def test_gemma2_pp2_two_microbatches_equals_the_unsharded_step_and_torch():
    got, want, _, torch_step = _steps("gemma2_lm")
    assert_all_equivalent(got, want)
    _matches_torch(got, torch_step)


def test_vit_class_token_expanded_over_the_batch_takes_the_microbatch():
    got, want, g, torch_step = _steps("vit_classifier")
    cls = [n for n in g.nodes if n.op == "expand" and 0 in n.attr("dims")]
    assert cls and rebatch(g, 1)[cls[0].name].type.shape[0] == 1
    assert_all_equivalent(got, want)
    _matches_torch(got, torch_step)


def test_mixtral_expert_major_reshape_keeps_its_expert_dim():
    """Mixtral's experts run on ``[experts, tokens, 1, hidden] -> [experts, tokens, hidden]``
    (4 experts, a batch of 4): the tokens halve, the experts stay (before, the reshape's dim 0
    was scaled, giving 2 experts of 32 tokens). Against the unsharded step only: torch's
    grouped_mm has no float64 (the zoo checks the unsharded Mixtral step against torch)."""
    got, want, g, _ = _steps("mixtral_lm", with_torch=False)  # its grouped_mm has no float64
    small = rebatch(g, 2)
    moe = [n for n in g.nodes if n.op == "reshape" and n.type.shape == (4, 32, 16)]
    assert moe and all(small[n.name].type.shape == (4, 16, 16) for n in moe)
    assert_all_equivalent(got, want)
