"""``parcomp export`` / :func:`parcomp.cli.export.export_pretrained`: a saved training
checkpoint as a directory transformers' ``from_pretrained`` reads, tied weights included."""
from __future__ import annotations

import importlib.util
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.check.check64 import promote_compiled, promote_feeds, promote_graph
from parcomp.check.differential import compare
from parcomp.check.train_check import lockstep
from parcomp.check.training import train_steps
from parcomp.cli import commands
from parcomp.cli.main import main
from parcomp.frontends.loader import load_model
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import run_unsharded

from numerics import assert_equivalent

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..")
GPT2 = os.path.join(ROOT, "specs", "models.py") + ":gpt2_lm"
SPEC = os.path.join(ROOT, "specs", "gpt2_lm_tp2_train.pcs")
STEPS = 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """gpt2_lm's TP=2 training program run on its 2 ranks in the numpy interpreter, in float64
    (as ``parcomp check`` compares), the full state saved as a DCP checkpoint laid out as
    program.py --save's (``latest`` -> ``step-K``); the unsharded float64 run beside it."""
    import torch
    import torch.distributed.checkpoint as dcp

    c, module, example = commands.compile_model(SimpleNamespace(model=GPT2, spec=SPEC), numeric="check")
    narrow = commands.training_feeds(c, module, example, 0)
    wide, feeds = promote_compiled(c), promote_feeds(narrow)
    prog = wide.program
    tp2 = train_steps(lambda s: run_spmd(prog, s).outputs(prog), wide.logical, feeds, STEPS)["state"]
    ckpt = tmp_path_factory.mktemp("ckpt")
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tp2.items()}
    sd["step"] = torch.tensor(STEPS)
    dcp.save(sd, checkpoint_id=str(ckpt / f"step-{STEPS}"), no_dist=True)
    (ckpt / "latest").write_text(f"step-{STEPS}\n")
    return SimpleNamespace(compiled=c, wide=wide, module=module, feeds=feeds, tp2=tp2, ckpt=ckpt,
                           narrow_feeds=narrow)


def forward64(t, weights, input_ids):
    """The float64 logits of the unsharded model (the numpy interpreter) with ``weights``."""
    fwd = promote_graph(load_model(GPT2)[0])
    feeds = promote_feeds(commands.feeds_for(fwd, t.module, (input_ids,)))
    feeds.update({k: weights[k] for k in feeds if k in weights})
    feeds["input_ids"] = input_ids.numpy()
    return run_unsharded(fwd, feeds)[fwd.output_names[0]]


def test_gpt2_export_loads_with_from_pretrained_tied_and_equal(trained, tmp_path):
    """The export holds ``transformer.wte.weight`` once (no ``lm_head.weight``, as
    save_pretrained writes it) and a config.json; GPT2LMHeadModel.from_pretrained loads it
    with nothing missing or unexpected, its lm_head tied to the trained embedding, and its
    logits equal the unsharded model's with the TP=2 run's weights (float64 forward); the TP=2
    step equals the unsharded one."""
    import torch
    from safetensors.torch import load_file
    from transformers import GPT2LMHeadModel

    from parcomp.cli.export import export_pretrained

    out = tmp_path / "hf"
    done = export_pretrained(trained.compiled, str(trained.ckpt), str(out), trained.module)
    assert sorted(os.listdir(out)) == [".parcomp-output", "config.json", "model.safetensors"]
    assert sorted(done["files"]) == ["config.json", "model.safetensors"]
    sd = load_file(str(out / "model.safetensors"))
    assert "transformer.wte.weight" in sd and "lm_head.weight" not in sd
    assert sorted(sd) == sorted(k for k, _ in trained.module.named_parameters())  # each tensor once
    model, info = GPT2LMHeadModel.from_pretrained(str(out), dtype=torch.float64, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert model.lm_head.weight is model.transformer.wte.weight
    np.testing.assert_array_equal(model.transformer.wte.weight.detach().numpy(), trained.tp2["lm_head.weight"])
    ids = torch.randint(0, 101, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model.eval()(ids).logits.numpy()
    want = forward64(trained, trained.tp2, ids)
    assert_equivalent(got, want, what="logits of the from_pretrained export")
    r = lockstep(trained.compiled, None, None, trained.narrow_feeds, STEPS)["vs_unsharded"]
    assert r["ok"], r["why"]  # the TP=2 step equals the unsharded one, as check compares them
    with torch.no_grad():
        before = trained.module.double()(ids).logits.numpy()
    trained.module.float()
    assert not compare(before, want)["ok"]  # the comparison sees what one step changed


def test_export_refuses_an_existing_target_and_leaves_nothing_half_written(trained, tmp_path):
    from parcomp.errors import ParcompError
    from parcomp.cli.export import export_pretrained

    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(ParcompError, match="is not empty and was not written by parcomp") as e:
        export_pretrained(trained.compiled, str(trained.ckpt), str(taken), trained.module)
    assert e.value.where == str(taken) and os.listdir(taken) == ["notes.txt"]
    afile = tmp_path / "afile"
    afile.write_text("mine")
    with pytest.raises(ParcompError, match="a file of that name exists"):
        export_pretrained(trained.compiled, str(trained.ckpt), str(afile), trained.module)
    assert afile.read_text() == "mine"
    with pytest.raises(ParcompError, match="no torch.distributed.checkpoint") as e:
        export_pretrained(trained.compiled, str(tmp_path / "nockpt"), str(tmp_path / "new"), trained.module)
    assert not (tmp_path / "new").exists() and e.value.where == str(tmp_path / "nockpt")
    assert [p for p in os.listdir(tmp_path) if p.startswith(".parcomp")] == []


def test_export_files_get_the_modes_of_a_plain_write(trained, tmp_path):
    """Under umask 022 the directory is 0755 and its files 0644 (not mkstemp's / safetensors'
    0600); under 027, 0750 and 0640. export_safetensors' single file likewise."""
    from parcomp.cli.export import export_pretrained, export_safetensors

    for mask, dmode, fmode in ((0o022, 0o755, 0o644), (0o027, 0o750, 0o640)):
        old = os.umask(mask)
        try:
            out = tmp_path / f"hf{mask:o}"
            export_pretrained(trained.compiled, str(trained.ckpt), str(out), trained.module)
            export_safetensors(trained.compiled, str(trained.ckpt), str(tmp_path / f"w{mask:o}.safetensors"))
        finally:
            os.umask(old)
        assert os.stat(tmp_path / f"w{mask:o}.safetensors").st_mode & 0o777 == fmode
        assert os.stat(out).st_mode & 0o777 == dmode
        for name in os.listdir(out):
            assert os.stat(out / name).st_mode & 0o777 == fmode, (name, oct(os.stat(out / name).st_mode))


def test_export_marks_its_output_and_replaces_only_its_own(trained, tmp_path, capsys):
    """The export directory carries the ``.parcomp-output`` manifest (command ``export``, a
    hash per file); a second export to it replaces parcomp's files and keeps one the user
    added; a model.safetensors the user changed, or another command's output, is refused."""
    from parcomp.outdir import MARKER

    out = tmp_path / "hf"
    args = ["export", GPT2, "--spec", SPEC, str(trained.ckpt), "-o", str(out)]
    assert main(args) == 0
    manifest = json.loads((out / MARKER).read_text())
    assert manifest["command"] == "export" and sorted(manifest["files"]) == ["config.json", "model.safetensors"]
    assert all(isinstance(d, str) and len(d) == 64 for d in manifest["files"].values())
    first = (out / "model.safetensors").read_bytes()
    (out / "README.md").write_text("my notes")
    capsys.readouterr()
    assert main(args) == 0
    assert "kept 1 entry" in capsys.readouterr().out and (out / "README.md").read_text() == "my notes"
    assert (out / "model.safetensors").read_bytes() == first  # same checkpoint, same bytes
    assert sorted(os.listdir(out)) == [MARKER, "README.md", "config.json", "model.safetensors"]
    (out / "model.safetensors").write_bytes(b"the user's own")
    assert main(args + ["--json"]) == 2
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["where"] == str(out) and "model.safetensors is not parcomp's" in res["error"]
    assert (out / "model.safetensors").read_bytes() == b"the user's own"
    compiled_dir = tmp_path / "prog"
    assert main(["compile", GPT2, "--spec", SPEC, "-o", str(compiled_dir)]) == 0
    capsys.readouterr()
    assert main(["export", GPT2, "--spec", SPEC, str(trained.ckpt), "-o", str(compiled_dir), "--json"]) == 2
    assert "parcomp compile -o" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["error"]


def test_export_to_a_file_says_it_is_a_file_and_leaves_it(trained, tmp_path, capsys):
    afile = tmp_path / "weights"
    afile.write_bytes(b"mine")
    rc = main(["export", GPT2, "--spec", SPEC, str(trained.ckpt), "-o", str(afile)])
    err = capsys.readouterr().err
    assert rc == 2 and f"-o {afile}: a file of that name exists (a file, not a directory)" in err
    assert "Traceback" not in err and "empty directory" not in err
    assert afile.read_bytes() == b"mine" and sorted(os.listdir(tmp_path)) == ["weights"]


def test_export_cli_writes_the_directory_and_locates_errors(trained, tmp_path, capsys):
    out = tmp_path / "hf"
    rc = main(["export", GPT2, "--spec", SPEC, str(trained.ckpt), "-o", str(out), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and res["ok"] and res["files"] == ["model.safetensors", "config.json"]
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    rc = main(["export", GPT2, "--spec", SPEC, str(tmp_path / "missing"), "-o", str(tmp_path / "o2"), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and res["where"] == str(tmp_path / "missing") and not (tmp_path / "o2").exists()


def test_export_cli_names_a_spec_without_training_and_a_checkpoint_of_another_model(trained, tmp_path, capsys):
    mlp = os.path.join(ROOT, "specs", "models.py") + ":gpt2_mlp"
    spec = os.path.join(ROOT, "specs", "gpt2_mlp_tp2.pcs")
    rc = main(["export", mlp, "--spec", spec, str(trained.ckpt), "-o", str(tmp_path / "a"), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and res["where"] == spec and "no train line" in res["error"]
    train = os.path.join(ROOT, "specs", "gpt2_mlp_tp2_train.pcs")
    rc = main(["export", mlp, "--spec", train, str(trained.ckpt), "-o", str(tmp_path / "b"), "--json"])
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 2 and res["where"] == "c_fc.weight" and "lacks trained parameters" in res["error"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_tied_names_are_the_names_save_pretrained_writes(tmp_path):
    """GPT-2 and a Llama with tie_word_embeddings: the names export writes (each tensor once)
    are exactly the keys of transformers' own save_pretrained."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from parcomp.cli.export import tied_names

    spec = importlib.util.spec_from_file_location("models", os.path.join(ROOT, "specs", "models.py"))
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True))
    for name, m in (("gpt2", models.gpt2_lm()[0]), ("llama", llama)):
        m.save_pretrained(str(tmp_path / name))
        written = set(load_file(str(tmp_path / name / "model.safetensors")))
        alias = tied_names(m)
        assert len(set(alias.values())) < len(alias)  # something is tied
        assert set(alias.values()) == written, name
