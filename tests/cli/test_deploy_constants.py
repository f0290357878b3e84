"""The documented deploy flow with a user's own ``state_dict``: ``parcomp compile`` writes the
constants it computed at import (GPT-2's position ids, Llama's RoPE cos/sin; not weights of
the module) to ``constants.safetensors`` beside program.py, which reads them from there when
``--checkpoint`` lacks them. A checkpoint that lacks a real weight is still a LoadError."""
import json
import os
import sys

import numpy as np
import pytest

from parcomp.cli.main import main
from test_cli import write  # the suite's one file-writing helper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2_TP2 = ("mesh tp=2\ntransformer.h.*.attn.c_attn.weight colwise\ntransformer.h.*.attn.c_proj.weight rowwise\n"
            "transformer.h.*.mlp.c_fc.weight colwise\ntransformer.h.*.mlp.c_proj.weight rowwise\n")
LLAMA_TP2 = "mesh tp=2\n" + "".join(
    f"model.layers.*.{m}.weight {kind}\n" for m, kind in (
        ("self_attn.q_proj", "colwise"), ("self_attn.k_proj", "colwise"), ("self_attn.v_proj", "colwise"),
        ("self_attn.o_proj", "rowwise"), ("mlp.gate_proj", "colwise"), ("mlp.up_proj", "colwise"),
        ("mlp.down_proj", "rowwise")))
CASES = {"gpt2_lm": (GPT2_TP2, ["transformer.arange"]),
         "llama_lm": (LLAMA_TP2, ["model.rotary_emb.cos", "model.rotary_emb.sin"])}


def _factory(name):
    sys.path.insert(0, os.path.join(ROOT, "specs"))
    try:
        import models
    finally:
        sys.path.pop(0)
    return getattr(models, name)()


def _compile(tmp_path, name, capsys) -> str:
    spec = write(tmp_path, f"{name}.pcs", CASES[name][0])
    out = str(tmp_path / "out")
    assert main(["compile", os.path.join(ROOT, "specs", "models.py") + f":{name}", "--spec", spec,
                 "-o", out, "--json"]) == 0
    capsys.readouterr()
    return out


def _launch(out, ckpt, ids, tmp_path):
    from parcomp_backends.torch.launch import run_torchrun, write_inputs

    inputs = write_inputs({"input_ids": ids}, str(tmp_path / "inputs.pt"))
    return run_torchrun(out, 2, ckpt, inputs, str(tmp_path / "logits.pt"), extra_args=("--device", "cpu"),
                        timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_state_dict_checkpoint_runs_and_equals_the_torch_module(tmp_path, capsys, name):
    from parcomp.frontends.loader import load_model

    from numerics import assert_equivalent

    out = _compile(tmp_path, name, capsys)
    with open(os.path.join(out, ".parcomp-output"), encoding="utf-8") as f:
        assert "constants.safetensors" in json.load(f)["files"]
    from safetensors.torch import load_file

    assert sorted(load_file(os.path.join(out, "constants.safetensors"))) == CASES[name][1]
    module, (ids,), _ = _factory(name)
    ckpt = str(tmp_path / "model.pt")
    torch.save(module.state_dict(), ckpt)  # the user's weights, exactly as documented
    assert not set(CASES[name][1]) & set(module.state_dict())
    proc = _launch(out, ckpt, ids, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "logits.pt")["logits"].numpy()
    # the same program with every value in the checkpoint (the manual way): same bytes
    from parcomp.frontends.torch.fold import module_sources

    graph, mod, example = load_model(os.path.join(ROOT, "specs", "models.py") + f":{name}")
    full = module_sources(mod)  # imported here: the folded constants too
    assert set(CASES[name][1]) <= set(full)
    torch.save(full, str(tmp_path / "full.pt"))
    proc = _launch(out, str(tmp_path / "full.pt"), ids, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(torch.load(tmp_path / "logits.pt")["logits"].numpy(), got)
    with torch.no_grad():
        want = module(ids).logits.numpy()
    assert_equivalent(got, want, what="logits")


def test_checkpoint_lacking_a_weight_is_still_a_load_error(tmp_path, capsys):
    out = _compile(tmp_path, "llama_lm", capsys)
    module, (ids,), _ = _factory("llama_lm")
    sd = module.state_dict()
    del sd["model.layers.1.mlp.up_proj.weight"]
    ckpt = str(tmp_path / "model.pt")
    torch.save(sd, ckpt)
    proc = _launch(out, ckpt, ids, tmp_path)
    assert proc.returncode != 0
    assert "LoadError: param 'model.layers.1.mlp.up_proj.weight'" in proc.stderr, proc.stderr[-3000:]
    assert "program.py\", line" not in proc.stderr  # a located error, no traceback of the program


def test_missing_constants_file_is_a_load_error_naming_it(tmp_path, capsys):
    out = _compile(tmp_path, "gpt2_lm", capsys)
    os.rename(os.path.join(out, "constants.safetensors"), str(tmp_path / "elsewhere.safetensors"))
    module, (ids,), _ = _factory("gpt2_lm")
    ckpt = str(tmp_path / "model.pt")
    torch.save(module.state_dict(), ckpt)
    proc = _launch(out, ckpt, ids, tmp_path)
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "'transformer.arange' is a constant parcomp computed" in proc.stderr
    assert "constants.safetensors does not exist" in proc.stderr
    assert "program.py\", line" not in proc.stderr


def test_save_pretrained_directory_of_a_tied_model_loads(tmp_path, capsys):
    """save_pretrained writes GPT-2's tied table once, as ``transformer.wte.weight``; the
    graph names it ``lm_head.weight``: program.py reads it under either name (and the
    position ids from constants.safetensors). Same logits as from the full state_dict."""
    spec = write(tmp_path, "vocab.pcs", "mesh tp=2\ntransformer.wte.weight [S(0)]\n" + GPT2_TP2.split("\n", 1)[1])
    out = str(tmp_path / "out")
    assert main(["compile", os.path.join(ROOT, "specs", "models.py") + ":gpt2_lm", "--spec", spec, "-o", out,
                 "--json"]) == 0
    capsys.readouterr()
    module, (ids,), _ = _factory("gpt2_lm")
    module.save_pretrained(str(tmp_path / "hf"))
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(str(tmp_path / "hf" / "model.safetensors"))
    proc = _launch(out, str(tmp_path / "hf"), ids, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "logits.pt")["logits"].numpy()
    torch.save(module.state_dict(), str(tmp_path / "model.pt"))
    proc = _launch(out, str(tmp_path / "model.pt"), ids, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert np.array_equal(torch.load(tmp_path / "logits.pt")["logits"].numpy(), got)


SCALED = '''
import torch
from torch import nn
class Scaled(nn.Module):
    """Gemma's embedding scale: a 0-d non-persistent buffer read through ``.to(dtype)``, a
    scalar constant parcomp computes at import."""
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)
        self.register_buffer("scale", torch.tensor(8.0), persistent=False)
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x * self.scale.to(x.dtype))))
def scaled():
    torch.manual_seed(0)
    return Scaled().eval(), (torch.randn(2, 4, 32),), ["x"]
'''


def test_run_keeps_a_scalar_constant_zero_dimensional(tmp_path, capsys):
    """``parcomp run`` writes the program's checkpoint from the params' values; a 0-d constant
    (Gemma-2's ``embed_scale.to(dtype)``) stays 0-d there (``np.ascontiguousarray`` makes it
    1-d, a shape program.py refuses)."""
    (tmp_path / "scaled.py").write_text(SCALED)
    spec = write(tmp_path, "s.pcs", "mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\n")
    assert main(["run", f"{tmp_path}/scaled.py:scaled", "--spec", spec, "--nproc", "2", "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["ok"], cap.err[-3000:]
