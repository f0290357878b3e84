"""A pipeline stage's attention backward on what its forward kernel kept: the stage forward
returns the kernel's saved tuple (output, logsumexp) as one more stashed value per microbatch,
``saved.<sdpa>:kernel``, and the stage backward runs the kernel's own backward on it
(``attention_backward``), no forward again (emit/attention.py, emit/pipeline.py). The stage's
stash bytes count the logsumexp (and the output where no stashed value holds its buffer). A tiny GPT-2
on pp=2 with 2 microbatches: the interpreter's pipelined step and one gloo run of the emitted
program.py equal the unsharded step."""
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir.liveness import attention_saved_bytes, layer_norm_saved_bytes, storage_roots  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402

from graphs import spec  # noqa: E402
from numerics import assert_all_equivalent  # noqa: E402
from test_pipeline_tied import STAGES, gpt2_64, lm_pipelined  # noqa: E402

TRAIN = "train loss=cross_entropy optimizer=sgd(lr=0.1, momentum=0.9) input_grads=no microbatches=2 schedule=1f1b"
HEAD = f"mesh pp=2\n{STAGES}"


def stage_function(text, name):
    """The source of ``def name(...)`` in a program's text."""
    return re.search(rf"^def {name}\(.*?(?=^\S)", text, re.S | re.M).group(0)


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_64()


def test_stage_backward_reads_the_forward_kernels_stash(gpt2):
    c = compile_graph(gpt2, spec(f"{HEAD}{TRAIN}\n"))
    text = emit_program(c)
    for s in (0, 1):
        fwd, bwd = stage_function(text, f"stage{s}_forward"), stage_function(text, f"stage{s}_backward")
        assert "= attention_forward(" in fwd and re.search(r'"saved\.[\w.]+:kernel": \w+_saved[,}]', fwd)
        key = re.search(r'"saved\.([\w.]+:kernel)"', fwd).group(1)
        took = re.search(rf'^    (\w+) = inp.pop\("{re.escape(key)}"\)', bwd, re.M).group(1)
        assert re.search(rf"= attention_backward\([^\n]*, {took}, \"qkv\"", bwd)
        assert f"    del {took}\n" in bwd  # freed once the backward has read it
        assert "attention_grads(" not in bwd and "torch.func.vjp" not in bwd  # no forward recompute


def test_stash_bytes_count_the_kernels_logsumexp(gpt2):
    _, _, plan, _, _ = lm_pipelined(gpt2, HEAD, TRAIN)
    report = plan.report()["stages"]
    for st, rec in zip(plan.stages, report):
        g = st.forward
        sdpa = [n for n in g.nodes if n.op == "sdpa"]
        assert len(sdpa) == 1
        ty = sdpa[0].type
        assert sdpa[0].name not in st.saved  # its output is stashed through a view (c_proj's input)
        assert any(storage_roots(g)[v] == sdpa[0].name for v in st.saved)
        norms = sum(layer_norm_saved_bytes(n.type, n.type.nbytes) for n in g.nodes if n.op == "layer_norm")
        assert st.saved_bytes == (sum(g[v].type.nbytes for v in st.saved) + attention_saved_bytes(ty, ty.nbytes)
                                  + norms)  # and each layer norm's mean and rstd
        assert rec["peak_inflight_bytes"] == rec["peak_inflight_microbatches"] * st.saved_bytes


def test_interpreter_pipelined_step_equals_the_unsharded_step(gpt2):
    got, want, _, _, _ = lm_pipelined(gpt2, HEAD, TRAIN)
    assert_all_equivalent(got, want)


def test_gloo_run_equals_the_unsharded_step(tmp_path, gpt2):
    from test_pipeline import assert_detects_a_wrong_scale
    from test_pipeline_schedules_torch import _launch

    _, want, _, ref, feeds = lm_pipelined(gpt2, HEAD, TRAIN)
    got, text, _ = _launch(tmp_path, gpt2, HEAD, TRAIN, 2, feeds, ref, ("input_ids", "labels"))
    assert "attention_backward(" in stage_function(text, "stage0_backward")
    assert_all_equivalent(got, want)
    assert_detects_a_wrong_scale(got, want)


def test_zb_h1_split_backward_reads_the_stash_where_it_differentiates_the_attention(gpt2):
    """ZB-H1: stage 0 (no input gradient) differentiates its attention in W, stage 1 in B; the
    whole backward (also printed) reads the stash too."""
    c = compile_graph(gpt2, spec(f"{HEAD}{TRAIN.replace('schedule=1f1b', 'schedule=zb-h1')}\n"))
    text = emit_program(c)
    for s, half in ((0, "backward_weight"), (1, "backward_input")):
        for fn in (f"stage{s}_backward", f"stage{s}_{half}"):
            body = stage_function(text, fn)
            assert ':kernel")' in body and "= attention_backward(" in body, fn
            assert "attention_grads(" not in body, fn


def test_a_stage_program_printed_again_without_the_stash_recomputes(gpt2):
    """The stash is the pipeline printer's argument, not a fact of the program: the same stage
    backward printed on its own (no stash) differentiates with the vjp over sdpa."""
    from parcomp_backends.torch.emit import step_function

    c = compile_graph(gpt2, spec(f"{HEAD}{TRAIN}\n"))
    emit_program(c)
    alone = step_function(c.program_.stages[0]["backward"], "backward", "alone", pop_inputs=True)
    assert "= attention_grads(" in alone and ":kernel" not in alone
