"""A pipeline stage's LayerNorm backward on what its forward kernel kept: the stage forward
prints ``y, y_saved = layer_norm_forward(...)`` and returns the kernel's (mean, rstd) as one more
stashed value per microbatch, ``saved.<layer_norm>:stats``; the stage backward's statement of
the layer norm's gradients (one ``native_layer_norm_backward``) reads it, no
``native_layer_norm`` again. ZB-H1's halves read it too: the input half asks the kernel for dx
alone, the weight half for dweight and dbias alone (before, each computed the normalised x
again, and the weight half summed it by hand). The stage's stash bytes count the mean and rstd.

A tiny GPT-2 (float64) on pp=2 with 2 microbatches on 2 gloo ranks: every aten op of each rank
is counted (a TorchDispatchMode around program.py), each LayerNorm runs exactly one
``native_layer_norm`` per microbatch and its backward kernel computes dx, dweight and dbias
once each; the step equals the unsharded step."""
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.ir.liveness import attention_saved_bytes, layer_norm_saved_bytes  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from numerics import assert_all_equivalent  # noqa: E402
from test_pipeline import assert_detects_a_wrong_scale  # noqa: E402
from test_pipeline_attention_stash import stage_function  # noqa: E402
from test_pipeline_tied import STAGES, gpt2_64, lm_pipelined  # noqa: E402

TRAIN = "train loss=cross_entropy optimizer=sgd(lr=0.1, momentum=0.9) input_grads=no microbatches=2 schedule={}"
HEAD = f"mesh pp=2\n{STAGES}"
LAYER_NORMS = {0: 2, 1: 3}  # per stage: h.0's ln_1, ln_2; h.1's ln_1, ln_2 and ln_f

# runs program.py as torchrun's worker under a dispatch mode recording every layer norm kernel
COUNTING = '''
import json, os, runpy, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode

calls = {"native_layer_norm": 0, "native_layer_norm_backward": [], "layer_norm": 0}


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket).split(".")[-1]
        if name == "native_layer_norm_backward":
            calls[name].append([bool(m) for m in args[7]])
        elif name in calls:
            calls[name] += 1
        return func(*args, **(kwargs or {}))


sys.argv[0] = "program.py"
program = runpy.run_path("program.py", run_name="program")  # its functions; main() below
with Count():
    program["main"]()
with open(f"calls.rank{os.environ['RANK']}.json", "w") as f:
    json.dump(calls, f)
program["exit_now"](0)
'''


@pytest.fixture(scope="module")
def gpt2():
    return gpt2_64()


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_stage_forward_stashes_the_stats_and_the_backward_reads_them(gpt2, schedule):
    text = emit_program(compile_graph(gpt2, spec(f"{HEAD}{TRAIN.format(schedule)}\n")))
    halves = ("backward",) + (("backward_input", "backward_weight") if schedule == "zb-h1" else ())
    for s, count in LAYER_NORMS.items():
        fwd = stage_function(text, f"stage{s}_forward")
        assert fwd.count("= layer_norm_forward(") == count and "functional.layer_norm(" not in fwd
        assert len(re.findall(r'"saved\.[\w.]+:stats": \w+_saved', fwd)) == count
        for half in halves:
            body = stage_function(text, f"stage{s}_{half}")
            took = re.findall(r'^    (\w+) = inp.pop\("[\w.]+:stats"\)', body, re.M)
            for var in took:  # read by one statement of the layer norm's gradients, then deleted
                assert re.search(rf"= layer_norm_grads\([^\n]*, saved={var}\)", body), (half, var)
                assert re.search(rf"^    del [^\n]*\b{var}\b", body, re.M)
            assert "norm_grad(" not in body and "functional.layer_norm(" not in body, (s, half)
            if half != "backward_input" or s == 1:  # stage 0's input half computes nothing
                assert len(took) == count, (s, half)
    if schedule == "zb-h1":  # stage 1's halves: dx alone, then dweight and dbias alone
        assert stage_function(text, "stage1_backward_input").count("(True, False, False), saved=") == 3
        weight = stage_function(text, "stage1_backward_weight")
        assert weight.count(", None, 1e-05, (False, True, True), saved=") == 3


def test_stash_bytes_count_the_layer_norms_mean_and_rstd(gpt2):
    _, _, plan, _, _ = lm_pipelined(gpt2, HEAD, TRAIN.format("1f1b"))
    for st, rec in zip(plan.stages, plan.report()["stages"]):
        g = st.forward
        norms = [n for n in g.nodes if n.op == "layer_norm"]
        sdpa = next(n for n in g.nodes if n.op == "sdpa")
        assert len(norms) == LAYER_NORMS[st.index]
        stats = sum(layer_norm_saved_bytes(n.type, n.type.nbytes) for n in norms)
        assert stats == len(norms) * 8 * 2 * 8  # 8 rows, a float64 mean and rstd each
        assert st.saved_bytes == (sum(g[v].type.nbytes for v in st.saved)
                                  + attention_saved_bytes(sdpa.type, sdpa.type.nbytes) + stats)
        assert rec["stash_bytes_per_microbatch"] == st.saved_bytes


def _launch(tmp_path, g, schedule, feeds, ref):
    """program.py of ``schedule`` run on 2 gloo ranks under the counting wrapper: (outputs,
    {rank: the layer norm kernels it called})."""
    d = tmp_path / schedule
    d.mkdir()
    (d / "program.py").write_text(emit_program(compile_graph(g, spec(f"{HEAD}{TRAIN.format(schedule)}\n"))))
    (d / "count.py").write_text(COUNTING)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("input_ids", "labels")}
    res = run_torchrun(d, 2, ck, inp, str(d / "out.pt"), timeout=300, program="count.py")
    assert res.returncode == 0, res.stderr[-3000:]
    got = {}
    for s in LAYER_NORMS:
        got.update({k: v.numpy() for k, v in torch.load(str(d / f"out.pt.stage{s}")).items()})
    return got, {r: json.loads((d / f"calls.rank{r}.json").read_text()) for r in LAYER_NORMS}


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_each_layer_norm_runs_its_kernels_once_per_microbatch_on_gloo(tmp_path, gpt2, schedule):
    """Per LayerNorm and microbatch: one ``native_layer_norm``; 1F1B: one
    ``native_layer_norm_backward`` computing all three gradients; ZB-H1 (stage 1, which sends
    an input gradient): one in each half, their output masks disjoint and together all three.
    Before: two (three under ZB-H1: the weight half normalised x again) ``native_layer_norm``
    and the weight half's gradients by hand. The step equals the unsharded step."""
    _, want, _, ref, feeds = lm_pipelined(gpt2, HEAD, TRAIN.format(schedule))
    got, calls = _launch(tmp_path, gpt2, schedule, feeds, ref)
    for rank, count in LAYER_NORMS.items():
        runs = count * 2  # layer norms x microbatches (one step)
        c = calls[rank]
        assert c["native_layer_norm"] == runs, (rank, c)
        masks = c["native_layer_norm_backward"]
        for k in range(3):  # dx, dweight, dbias: each computed once
            assert sum(m[k] for m in masks) == runs, (rank, masks)
        if schedule == "1f1b" or rank == 0:  # stage 0 has no input half: its weight half does all
            assert masks == [[True, True, True]] * runs
        else:
            assert sorted(map(tuple, masks)) == [(False, True, True)] * runs + [(True, False, False)] * runs
    assert_all_equivalent(got, want)
    assert_detects_a_wrong_scale(got, want)
