"""Spec rules on tied weights: torch.export keeps one name of a tied tensor (GPT-2's and a tied
Llama's ``lm_head.weight``), and a rule may name it by any of its names
(``named_parameters(remove_duplicate=False)``): ``transformer.wte.weight [S(0)]`` works tied or
not, as README says. Errors name the alias the rule used; ``export`` still writes the tied
tensor once, under the name save_pretrained keeps."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from parcomp.cli.main import main
from test_cli import write  # the suite's one file-writing helper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPT2 = os.path.join(ROOT, "specs", "models.py") + ":gpt2_lm"
BLOCKS = ("transformer.h.*.attn.c_attn.weight colwise\ntransformer.h.*.attn.c_proj.weight rowwise\n"
          "transformer.h.*.mlp.c_fc.weight colwise\ntransformer.h.*.mlp.c_proj.weight rowwise\n")
GPT2_VOCAB = "mesh tp=2\ntransformer.wte.weight [S(0)]\n" + BLOCKS
LLAMA = '''
import torch
def llama_tied():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                      attn_implementation="sdpa", tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval(), (torch.randint(0, 64, (2, 8)),), ["input_ids"]
'''
LLAMA_VOCAB = ("mesh tp=2\nmodel.embed_tokens.weight [S(0)]\n"
               "model.layers.*.self_attn.q_proj.weight colwise\nmodel.layers.*.self_attn.k_proj.weight colwise\n"
               "model.layers.*.self_attn.v_proj.weight colwise\nmodel.layers.*.self_attn.o_proj.weight rowwise\n")


def _json(capsys):
    cap = capsys.readouterr()
    return json.loads(cap.out.strip().splitlines()[-1]), cap.err


def _bound(model, spec_path):
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.loader import load_model
    from parcomp.spec import load_spec

    graph, module, example = load_model(model)
    return compile_graph(graph, load_spec(spec_path)), module, example


@pytest.mark.parametrize("case", ["gpt2", "llama"])
def test_rule_on_the_embedding_name_of_a_tied_table_binds_it(tmp_path, capsys, case):
    if case == "gpt2":
        model, spec = GPT2, write(tmp_path, "vocab.pcs", GPT2_VOCAB)
        kept, alias = "lm_head.weight", "transformer.wte.weight"
    else:
        model, spec = write(tmp_path, "llama.py", LLAMA) + ":llama_tied", write(tmp_path, "vocab.pcs", LLAMA_VOCAB)
        kept, alias = "lm_head.weight", "model.embed_tokens.weight"
    c, module, _ = _bound(model, spec)
    assert module.get_parameter(alias) is module.get_parameter(kept)  # tied, one name in the graph
    assert [n.name for n in c.unsharded.params if n.name in (kept, alias)] == [kept]
    table = c.sharded[kept]
    assert str(table.layout[0]) == "S(0)" and table.spec_loc.line == 2, (table.layout, table.spec_loc)
    assert main(["check", model, "--spec", spec, "--json"]) == 0
    res, err = _json(capsys)
    assert res["ok"] and res["verdict"] == "OK", (res, err[-2000:])


def test_rules_giving_two_names_of_one_tied_tensor_two_layouts_are_an_error(tmp_path, capsys):
    spec = write(tmp_path, "two.pcs", GPT2_VOCAB + "lm_head.weight [S(1)]\n")
    assert main(["compile", GPT2, "--spec", spec, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "two.pcs:7" in err and "lm_head.weight and transformer.wte.weight are one tied tensor" in err, err
    assert "two.pcs:2" in err and "Traceback" not in err and not (tmp_path / "out").exists()


def test_the_same_layout_under_both_names_is_fine(tmp_path):
    spec = write(tmp_path, "both.pcs", GPT2_VOCAB + "lm_head.weight [S(0)]\n")
    c, _, _ = _bound(GPT2, spec)
    assert str(c.sharded["lm_head.weight"].layout[0]) == "S(0)"


def test_an_error_through_an_alias_names_the_alias(tmp_path, capsys):
    spec = write(tmp_path, "col.pcs", "mesh tp=2\ntransformer.wte.weight colwise\n")
    assert main(["compile", GPT2, "--spec", spec, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "col.pcs:2" in err and "the rule names it transformer.wte.weight" in err, err
    assert "matches no parameter" not in err


def test_export_writes_the_vocab_parallel_tied_table_once(tmp_path):
    """One training step of the vocab-parallel spec (numpy interpreter, float64), saved as
    program.py --save does; export writes ``transformer.wte.weight`` (unpadded, the trained
    values) and no ``lm_head.weight``."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from parcomp.cli import commands
    from parcomp.check.check64 import promote_compiled, promote_feeds
    from parcomp.cli.export import export_pretrained
    from parcomp.reference.interpreter import run_spmd
    from parcomp.check.training import train_steps

    spec = write(tmp_path, "train.pcs", GPT2_VOCAB + "train loss=cross_entropy optimizer=sgd(lr=0.1) steps=1\n")
    c, module, example = commands.compile_model(SimpleNamespace(model=GPT2, spec=spec), numeric="check")
    assert c.sharded["lm_head.weight"].attr("stored_shape") == (101, 32)  # padded to 102 rows for tp=2
    wide, feeds = promote_compiled(c), promote_feeds(commands.training_feeds(c, module, example, 0))
    state = train_steps(lambda s: run_spmd(wide.program, s).outputs(wide.program), wide.logical, feeds, 1)["state"]
    sd = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()}
    sd["step"] = torch.tensor(1)
    dcp.save(sd, checkpoint_id=str(tmp_path / "ckpt" / "step-1"), no_dist=True)
    (tmp_path / "ckpt" / "latest").write_text("step-1\n")
    export_pretrained(c, str(tmp_path / "ckpt"), str(tmp_path / "hf"), module)
    out = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert "transformer.wte.weight" in out and "lm_head.weight" not in out
    trained = np.asarray(state["lm_head.weight"])[:101]
    assert out["transformer.wte.weight"].shape == (101, 32)
    np.testing.assert_array_equal(out["transformer.wte.weight"].numpy(), trained)
    assert not np.array_equal(trained, module.transformer.wte.weight.detach().numpy())  # it trained
