"""transformers models through torch.export (GPT-2, Llama and their neighbours, small configs,
random weights): training-mode dropout, sliding windows, label smoothing, ignored labels, in-place
writes, and token ids or sequences the model cannot take."""
import json

import pytest

from parcomp.cli.main import main
from test_cli import write  # the suite's one file-writing helper

pytest.importorskip("torch")

FACTORIES = '''
import torch
from torch import nn
def mlp_dropout():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(32, 128), nn.Dropout(0.5), nn.Linear(128, 32)).train()
    return m, (torch.randn(2, 8, 32),), ["x"]
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).eval(), (torch.randn(2, 4, 32),), ["x"]
def _gpt2(train=False, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = dict(vocab_size=101, n_positions=64, n_embd=32, n_layer=1, n_head=4, bos_token_id=0,
               eos_token_id=0, use_cache=False, attn_implementation="sdpa")
    m = GPT2LMHeadModel(GPT2Config(**{**cfg, **kw}))
    return (m.train() if train else m.eval()), (torch.randint(0, 101, (2, 8)),), ["input_ids"]
def gpt2_bad_id():
    m, (ids,), names = _gpt2()
    ids[0, 1] = 500
    return m, (ids,), names
def gpt2_too_long():
    m, _, names = _gpt2()
    return m, (torch.randint(0, 101, (2, 80)),), names
def gpt2_attn_dropout_train():
    return _gpt2(train=True, attn_pdrop=0.1)
def mistral(window=4):
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                        attn_implementation="sdpa", sliding_window=window)
    return MistralForCausalLM(cfg).eval(), (torch.randint(0, 64, (2, 8)),), ["input_ids"]
def mistral_window8():
    return mistral(8)
def gpt2_with_cache():
    return _gpt2(use_cache=True)
'''
MLP_TP2 = "mesh tp=2\n0.weight colwise\n2.weight rowwise\n"
GPT2_TP2 = ("mesh tp=2\ntransformer.h.*.attn.c_attn.weight colwise\ntransformer.h.*.attn.c_proj.weight rowwise\n"
            "transformer.h.*.mlp.c_fc.weight colwise\ntransformer.h.*.mlp.c_proj.weight rowwise\n")
MISTRAL_TP2 = ("mesh tp=2\nmodel.layers.*.self_attn.q_proj.weight colwise\n"
               "model.layers.*.self_attn.k_proj.weight colwise\nmodel.layers.*.self_attn.v_proj.weight colwise\n"
               "model.layers.*.self_attn.o_proj.weight rowwise\n")


@pytest.fixture
def play(tmp_path):
    (tmp_path / "hf_models.py").write_text(FACTORIES)
    return tmp_path


def _json(capsys) -> tuple:
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.err


# 1: a model with dropout in training mode was checked against the torch module (in eval
# mode for the forward, torch's own dropout masks for training): a correct sharding read as
# MISMATCH (error 1.0 on a tight bound). The reference is the unsharded graph with parcomp's
# dropout, and a note says why.
def test_training_mode_dropout_forward_check_is_ok_against_parcomps_dropout(play, capsys):
    spec = write(play, "mlp.pcs", MLP_TP2)
    assert main(["check", f"{play}/hf_models.py:mlp_dropout", "--spec", spec, "--json"]) == 0
    res, err = _json(capsys)
    assert res["ok"] and res["verdict"] == "OK" and res["err_over_tol"] < 1, res
    assert "not from torch's generator" in err and "not the torch module" in err


def test_training_mode_dropout_training_check_is_ok(play, capsys):
    spec = write(play, "mlp_t.pcs", MLP_TP2 + "train loss=mse optimizer=sgd(lr=0.1) steps=2\n")
    assert main(["check", f"{play}/hf_models.py:mlp_dropout", "--spec", spec, "--json"]) == 0
    res, err = _json(capsys)
    assert res["ok"] and "vs_torch" not in res, res
    assert "not the torch module" in err


def test_training_mode_dropout_still_catches_a_wrong_sharding(play, capsys, monkeypatch):
    """The numpy reference is a real check: a program that drops the all_reduce's sum is a MISMATCH."""
    import parcomp.cli.check_cmd as cc

    real = cc.run_spmd

    def halved(program, feeds):
        run = real(program, feeds)
        outs = run.outputs(program)
        run.outputs = lambda _p: {k: v * 0.5 for k, v in outs.items()}
        return run

    monkeypatch.setattr(cc, "run_spmd", halved)
    spec = write(play, "mlp.pcs", MLP_TP2)
    assert main(["check", f"{play}/hf_models.py:mlp_dropout", "--spec", spec, "--json"]) != 0
    res, _ = _json(capsys)
    assert not res["ok"] and res["verdict"] == "MISMATCH", res


def _fails(argv, capsys, *needles) -> str:
    """``main(argv)`` exits 2 with a located message holding every needle, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


# 2: GPT-2 in training mode with attention dropout said only "call module.eval()"; a user who
# wants to train with dropout is told which dropout is the unsupported one and what to set.
def test_attention_dropout_names_the_config_knob(play, capsys):
    spec = write(play, "g.pcs", GPT2_TP2)
    _fails(["check", f"{play}/hf_models.py:gpt2_attn_dropout_train", "--spec", spec], capsys,
           "dropout_p=0.1", "attn_pdrop", "call module.eval()", "modeling_gpt2.py:")


# 3: Mistral's sliding-window mask was reported as "padding or packed sequences?"; a window
# shorter than the sequence compiles to sdpa {window} (tests/rules/test_sliding_window.py checks its
# values), and a window covering the sequence compiles to the causal mask.
def test_sliding_window_shorter_than_the_sequence_compiles_to_a_windowed_sdpa(play, capsys):
    spec = write(play, "m.pcs", MISTRAL_TP2)
    assert main(["compile", f"{play}/hf_models.py:mistral", "--spec", spec, "-o", str(play / "out")]) == 0
    assert "window=4}" in (play / "out" / "sharded.pcir").read_text()


def test_sliding_window_covering_the_sequence_is_causal(play, capsys):
    spec = write(play, "m.pcs", MISTRAL_TP2)
    assert main(["check", f"{play}/hf_models.py:mistral_window8", "--spec", spec, "--json"]) == 0
    res, _ = _json(capsys)
    assert res["ok"], res


# 4: cross-entropy with label_smoothing: `check` said OK, but program.py died under torchrun
# ("more than one element of the written-to tensor refers to a single memory location"): the
# in-place pass wrote the smoothing gradient's add into an expand (a stride-0 view).
def test_label_smoothing_program_runs_under_torchrun(play, capsys):
    spec = write(play, "ls.pcs", MLP_TP2 + "train loss=cross_entropy(label_smoothing=0.1) optimizer=sgd(lr=0.1)\n")
    assert main(["run", f"{play}/hf_models.py:mlp", "--spec", spec, "--nproc", "2", "--json"]) == 0
    res, err = _json(capsys)
    assert res["ok"], (res, err[-3000:])


def test_in_place_never_writes_into_an_expanded_view(play):
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec

    spec = write(play, "ls.pcs", MLP_TP2 + "train loss=cross_entropy(label_smoothing=0.1) optimizer=sgd(lr=0.1)\n")
    graph, _, _ = load_model(f"{play}/hf_models.py:mlp")
    g = compile_graph(graph, load_spec(spec)).program  # the lowered per-rank graph
    expands = {n.name for n in g.nodes if n.op == "expand"}
    assert expands and not [n.name for n in g.nodes if n.attr("inplace") and n.inputs[0] in expands]


# 5: `check` draws labels in [0, classes), so cross_entropy's ignore_index never fires there: the
# global mean over the counted tokens (one count all_reduce over dp) went untested. Labels
# with ignored tokens, dp x tp, one step against torch (F.cross_entropy with the same options).
def test_ignored_labels_under_dp_tp_equal_torch(play):
    from parcomp.cli.common import feeds_for
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec
    from parcomp.check.train_check import lockstep, train_feeds

    spec = write(play, "ign.pcs", "mesh dp=2 tp=2\n0.weight colwise over tp\n2.weight rowwise over tp\n"
                 "input x [S(0), R]\ntrain loss=cross_entropy(ignore_index=-100, label_smoothing=0.1) "
                 "optimizer=sgd(lr=0.1)\n")
    graph, module, example = load_model(f"{play}/hf_models.py:mlp")
    c = compile_graph(graph, load_spec(spec))
    feeds = train_feeds(c, module, example, 0, feeds_for)
    labels = feeds["labels"].copy()
    labels[0, :3] = -100  # 3 of rank 0's 4 tokens ignored, 1 of rank 1's: unequal counts
    labels[1, 2] = -100
    ls = lockstep(c, module, example, {**feeds, "labels": labels}, 1)
    assert ls["vs_unsharded"]["ok"], ls["vs_unsharded"]
    assert ls["vs_torch"]["ok"], ls["vs_torch"]


# 6: an example with a token id past the vocab, or a sequence past n_positions: torch.export
# traced it, the numpy ranks ran it, then the eager torch reference raised IndexError with a
# traceback (exit 1). Now a located error before anything runs, for check and run.
@pytest.mark.parametrize("command", ["check", "run"])
def test_token_id_outside_the_vocab_is_a_located_error(play, capsys, command):
    spec = write(play, "g.pcs", GPT2_TP2)
    extra = ["--nproc", "2"] if command == "run" else []
    _fails([command, f"{play}/hf_models.py:gpt2_bad_id", "--spec", spec, *extra], capsys,
           "input input_ids holds 1 id(s) outside the 101 rows", "500, at [0, 1]", "[0, 101)")


def test_sequence_longer_than_the_positions_is_a_located_error(play, capsys):
    spec = write(play, "g.pcs", GPT2_TP2)
    _fails(["check", f"{play}/hf_models.py:gpt2_too_long", "--spec", spec], capsys,
           "param transformer.arange holds 16 id(s) outside the 64 rows", "transformer.wpe.weight",
           "sequence longer")


# 7: a config left with use_cache=True (transformers' default) stopped at import with torch's
# pytree message about DynamicCache; now a located error naming config.use_cache, and no spec
# written.
def test_a_model_returning_its_kv_cache_names_config_use_cache(play, capsys):
    out = play / "p.pcs"
    _fails(["plan", f"{play}/hf_models.py:gpt2_with_cache", "--mesh", "tp=2", "-o", str(out)], capsys,
           "GPT2LMHeadModel.config.use_cache is True", "DynamicCache", "use_cache=False")
    assert not out.exists()
