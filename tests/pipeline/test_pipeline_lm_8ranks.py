"""The 8-card layout on transformers' GPT-2 and Llama: ``mesh dp=2 pp=2 tp=2`` (2 nodes x 4
devices), 1F1B and interleaved 1F1B, program.py on 8 gloo ranks running 3 free-running
training steps (SGD with momentum, a global clip_grad_norm over every stage and tp shard, a cosine lr
schedule) equal to the unsharded steps: the losses of the 3 steps judged, every other carried
value's drift reported (parcomp/check/pipeline.py: compare_steps).

Both models are traced at batch 4 (2 samples per dp replica, 2 microbatches of 1) in float64
(as tests/pipeline/test_pipeline_schedules_torch.py), built as a user builds them
(specs/models.py: no stage line names Llama's rotary module)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from parcomp.check.pipeline import compare_steps  # noqa: E402
from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp_backends.torch.emit import emit_program  # noqa: E402
from parcomp_backends.torch.launch import run_torchrun  # noqa: E402

from graphs import spec  # noqa: E402
from test_pipeline import _models  # noqa: E402
from test_pipeline_schedules_torch import derived, gpt2_64_batch4  # noqa: E402
from test_pipeline_tied import lm_pipelined  # noqa: E402

#: SGD with momentum, not AdamW: Adam divides by sqrt(v), so a gradient that is zero up to
#: rounding takes a full lr step whose sign is that rounding; torch's float64 kernels and numpy's
#: round differently, and after 3 AdamW steps Llama's losses part by ~5e-9 of their scale (over the
#: float64 verdict's 1e-9) while the interpreter's pipelined steps equal the unsharded ones to
#: 1e-13. With momentum SGD both stay within rounding.
OPTIONS = "optimizer=sgd(lr=0.1, momentum=0.9) clip_grad_norm=0.5 lr_schedule=cosine(T_max=3)"
LLAMA_HEAD = """mesh dp=2 pp=2 tp=2
topology nodes=2 devices_per_node=4
model.layers.*.self_attn.q_proj.weight colwise over tp
model.layers.*.self_attn.k_proj.weight colwise over tp
model.layers.*.self_attn.v_proj.weight colwise over tp
model.layers.*.self_attn.o_proj.weight rowwise over tp
model.layers.*.mlp.gate_proj.weight colwise over tp
model.layers.*.mlp.up_proj.weight colwise over tp
model.layers.*.mlp.down_proj.weight rowwise over tp
input input_ids [S(0), R, R]
"""


def llama_64_batch4():
    """specs/models.py:llama_lm traced at batch 4, in float64."""
    from parcomp.check.check64 import promote_graph
    from parcomp.frontends.torch.export import import_torch

    module, _, names = _models().llama_lm()
    return promote_graph(import_torch(module, (torch.randint(0, 128, (4, 8)),), names))


def case(model, schedule):
    """(graph, spec head, train line) of ``model`` under dp=2 x pp=2 x tp=2 with ``schedule``."""
    train = (f"train loss=cross_entropy {OPTIONS} input_grads=no microbatches=2 "
             f"schedule={schedule}")
    if model == "gpt2":
        head, _ = derived("gpt2_lm_dp2_pp2_tp2_train.pcs", schedule, "8")
        return gpt2_64_batch4(), head, train
    return llama_64_batch4(), LLAMA_HEAD, train


# each model under one schedule, both schedules covered: eight ranks cost 40 s (GPT-2) to 150 s
# (Llama) a run on 2 cores, and tests/pipeline/test_pipeline_schedules_torch.py runs GPT-2 on
# eight ranks under both schedules already (AdamW, no clipping)
@pytest.mark.slow
@pytest.mark.parametrize("model,schedule", [("gpt2", "1f1b"), ("llama", "interleaved")])
def test_three_steps_on_eight_ranks_equal_the_unsharded_steps(tmp_path, model, schedule):
    g, head, train = case(model, schedule)
    _, _, plan, ref, feeds = lm_pipelined(g, head, train)
    assert plan.dp == 2 and plan.pp == 2 and len(plan.local) == len(plan.stages) == (4 if schedule == "interleaved" else 2)
    text = emit_program(compile_graph(g, spec(f"{head}{train}\n")))
    assert f"schedule {schedule}" in text and "STATS = {" in text
    (tmp_path / "program.py").write_text(text)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("input_ids", "labels")}
    res = run_torchrun(tmp_path, 8, ck, inp, str(tmp_path / "out.pt"), extra_args=("--steps", "3"),
                       timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    got = {}
    for s in range(len(plan.stages)):
        got.update({k: v.numpy() for k, v in torch.load(str(tmp_path / f"out.pt.stage{s}")).items()})
    assert len(got["losses"]) == 3
    result = compare_steps(None, ref, feeds, 3, got)
    assert result["ok"], result["why"]
    off = {**got, "losses": got["losses"] * (1 + 1e-6)}  # the verdict has power: 1e-6 is caught
    assert not compare_steps(None, ref, feeds, 3, off)["ok"]
