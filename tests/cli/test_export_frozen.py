"""A frozen parameter (``requires_grad=False``: GPT-2's position embedding here) is loaded by
the training program as a constant weight (``param() {trainable=false}``: no gradient, no
optimizer state, not carried), so ``program.py --save`` leaves it out of the checkpoint.
``parcomp export`` still writes it, with the model's own value (training never changes it),
so ``from_pretrained`` finds nothing missing instead of initializing it at random."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.cli import commands
from parcomp.cli.main import main

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
FACTORY = f'''
import importlib.util

_spec = importlib.util.spec_from_file_location("models", {os.path.join(ROOT, "specs", "models.py")!r})
models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(models)


def gpt2_frozen_wpe():
    module, example, names = models.gpt2_lm()
    module.transformer.wpe.weight.requires_grad_(False)
    return module, example, names
'''
SPEC = os.path.join(ROOT, "specs", "gpt2_lm_tp2_train.pcs")
FROZEN = "transformer.wpe.weight"


def _program_shape(t, shape):
    """``t`` as the program holds it: a fused weight viewed per part (GPT-2's c_attn
    [32, 96] as [32, 3, 32]), a vocab table padded with rows at the end."""
    import torch

    out = torch.zeros(tuple(shape), dtype=t.dtype)
    out.view(-1)[:t.numel()] = t.reshape(-1)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The frozen-wpe model compiled for TP=2 training and a DCP checkpoint laid out as
    program.py --save's, holding what it carries: every trained parameter (here its value
    plus 1, as if trained), not the frozen one."""
    import torch
    import torch.distributed.checkpoint as dcp

    from parcomp.frontends.torch.fold import module_sources

    tmp = tmp_path_factory.mktemp("frozen")
    (tmp / "m.py").write_text(FACTORY)
    model = f"{tmp / 'm.py'}:gpt2_frozen_wpe"
    c, module, _ = commands.compile_model(SimpleNamespace(model=model, spec=SPEC), numeric="check")
    assert c.logical[FROZEN].attr("trainable") is False and FROZEN not in c.program_.train.carried
    sources = module_sources(module)
    trained = [n.name for n in c.unsharded.params if n.name in set(c.logical.output_names)
               and n.name not in set(c.program_.train.state)]
    assert trained and FROZEN not in trained
    sd = {k: sources[k].detach().clone() + 1 for k in trained}  # in the module's (stored) shapes
    dcp.save({**{k: _program_shape(v, c.logical[k].type.shape) for k, v in sd.items()},
              "step": torch.tensor(1)}, checkpoint_id=str(tmp / "ckpt" / "step-1"), no_dist=True)
    (tmp / "ckpt" / "latest").write_text("step-1\n")
    return SimpleNamespace(model=model, compiled=c, module=module, ckpt=tmp / "ckpt", trained=sd)


def test_export_writes_the_frozen_parameter_and_from_pretrained_misses_nothing(saved, tmp_path):
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from parcomp.cli.export import export_pretrained

    done = export_pretrained(saved.compiled, str(saved.ckpt), str(tmp_path / "hf"), saved.module)
    sd = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sorted(sd) == sorted(k for k, _ in saved.module.named_parameters())
    np.testing.assert_array_equal(sd[FROZEN].numpy(), saved.module.transformer.wpe.weight.detach().numpy())
    for k, v in saved.trained.items():  # trained ones from the checkpoint (lm_head: tied to wte)
        np.testing.assert_array_equal(sd["transformer.wte.weight" if k == "lm_head.weight" else k].numpy(),
                                      v.numpy())
    model, info = GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert torch.equal(model.transformer.wpe.weight, saved.module.transformer.wpe.weight)
    assert done["from_model"] == [FROZEN] and FROZEN in done["tensors"]


def test_the_cli_says_which_parameters_came_from_the_model(saved, tmp_path, capsys):
    out = tmp_path / "hf"
    assert main(["export", saved.model, "--spec", SPEC, str(saved.ckpt), "-o", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"{FROZEN}" in said and "not trained" in said and "the model's own value" in said
    assert main(["export", saved.model, "--spec", SPEC, str(saved.ckpt), "-o", str(tmp_path / "j"),
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["ok"] and res["from_model"] == [FROZEN] and FROZEN in res["tensors"]
