"""The dp gradient reduction of a pipelined step in buckets (``bucket_cap_mb``), each started
asynchronously after the last backward adding to its gradients and waited for at the
optimizer (parcomp/passes/pipeline/dp_buckets.py, runtime/pipeline_main.py)."""
import numpy as np
import pytest

from parcomp.passes.pass_list import plan_pipeline

from graphs import spec
from test_pipeline import TRAIN, chain_graph, reference

HEAD = "mesh dp=2 pp=2\n"
PIPE = f"{TRAIN} microbatches=2 schedule=1f1b"


def _buckets(extra="", head=HEAD, g=None):
    return plan_pipeline(g or chain_graph(blocks=4), spec(f"{head}{PIPE} {extra}\n")).dp_buckets


def test_the_default_cap_puts_a_stage_in_one_bucket_and_a_small_cap_splits_it():
    whole = _buckets()
    assert [len(b) for b in whole] == [1, 1]
    stages, kind, names = whole[0][0]
    assert stages == (0,) and kind == "all_reduce"
    assert names[0] == "grad.5.bias" and names[-1] == "grad.0.weight"  # DDP's order: the backward's
    # 16 x 4 float32 weights (256 bytes) and 16- / 64-byte biases: at most 300 bytes a bucket
    small = _buckets("bucket_cap_mb=0.0003")
    assert all(len(b) > 1 for b in small)
    assert [n for b in small[0] for n in b[2]] == list(names)  # the same gradients, in order
    one = _buckets("bucket_cap_mb=0")
    assert all(len(b[2]) == 1 for r in one for b in r) and sum(map(len, one)) == 8 * 2


def test_zero1_buckets_reduce_scatter_and_without_dp_there_are_none():
    assert {b[1] for r in _buckets("zero=1") for b in r} == {"reduce_scatter"}
    assert _buckets(head="mesh pp=2\n") == ()


def test_a_tied_gradient_is_reduced_alone_after_its_stages_sum():
    from test_pipeline_tied import STAGES, gpt2_64

    train = "train loss=cross_entropy optimizer=sgd(lr=0.1) input_grads=no microbatches=1"
    plan = plan_pipeline(gpt2_64(), spec(f"mesh dp=2 pp=2\n{STAGES}{train}\n"))
    names = {n for r in plan.dp_buckets for b in r for n in b[2]}
    assert "grad.lm_head.weight" not in names and "grad.transformer.wpe.weight" in names
    counts = [{(c["kind"], c["axis"]): c["count"] for c in rank if c["phase"] == "optimizer"}
              for rank in plan.collective_counts()]
    assert all(c[("all_reduce", "dp")] == 2 for c in counts)  # one bucket + the tied gradient


def _program(extra, g=None):
    from parcomp.compile.compiler import compile_graph
    from parcomp_backends.torch.emit import emit_program

    pipe = PIPE.replace(" schedule=1f1b", "") if "schedule=" in extra else PIPE
    c = compile_graph(g or chain_graph(blocks=4), spec(f"{HEAD}{pipe} {extra}\n"))
    return c.program_.pipeline, emit_program(c)


def _function(text, name):
    return (f"def {name}(" + text.split(f"\ndef {name}(")[1].split("\ndef ")[0]).split("\n")


@pytest.mark.parametrize("extra,fn", [("", "backward"), ("zero=1", "backward"),
                                      ("schedule=zb-h1", "backward_weight")],
                         ids=["1f1b", "zero1", "zb-h1"])
def test_each_gradient_is_handed_over_once_final_and_buckets_follow_that_order(extra, fn):
    """The stage's parameter-gradient program hands each gradient to ``ready`` on the line
    after the statement making it final, in the order the buckets are filled, so a bucket
    starts inside the backward of the last microbatch while the layers before it are still
    differentiated (DDP's per-gradient hooks): the first bucket's last gradient is ready
    before the backward's last matmul."""
    plan, text = _program(f"bucket_cap_mb=0.0003 {extra}")
    for s in range(2):
        lines = _function(text, f"stage{s}_{fn}")
        assert lines[0].endswith("(p, inp, ready):")
        ready = [x.split('"')[1] for x in lines if x.startswith("    ready(")]
        buckets = plan.dp_buckets[s]
        assert ready == [n for b in buckets for n in b[2]]  # every gradient, in the buckets' order
        first = max(ready.index(n) for n in buckets[0][2])
        at = [i for i, x in enumerate(lines) if x.startswith("    ready(")][first]
        assert any("matmul(" in x or "linear(" in x for x in lines[at:]), lines
    for kind in ("forward", "optimizer") + (("backward_input",) if "zb" in extra else ()):
        assert _function(text, f"stage0_{kind}")[0].endswith("(p, inp):")


def test_dp_buckets_print_one_bucket_a_line():
    """DP_BUCKETS in program.py: one bucket a line, a long bucket's gradients wrapped, no line
    over 100 characters; the text is the plan's buckets."""
    import ast

    plan, text = _program("bucket_cap_mb=0.0003")
    block = text.split("\nDP_BUCKETS = {\n")[1].split("\n}\n")[0].split("\n")
    assert len(block) == sum(len(bs) + 2 for bs in plan.dp_buckets)  # "r: [", its buckets, "],"
    assert all(len(x) <= 100 for x in block)
    value = ast.literal_eval("{" + "\n".join(block) + "\n}")
    assert value == {r: [[list(st), k, list(n)] for st, k, n in bs] for r, bs in enumerate(plan.dp_buckets)}
    whole = _program("")[1].split("\nDP_BUCKETS = {\n")[1].split("\n}\n")[0].split("\n")
    assert all(len(x) <= 100 for x in whole) and len(whole) > 5  # one bucket of 8 gradients: wrapped


LOW = {"bf16": "bfloat16", "fp16": "float16"}
ADAMW = "train optimizer=adamw(lr=0.01) input_grads=no microbatches=2 schedule=1f1b clip_grad_norm=0.05"


@pytest.mark.parametrize("extra", ["", "zero=1", "bucket_cap_mb=0"])
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_grad_reduce_compute_reduces_the_summed_gradients_in_the_compute_dtype(precision, extra):
    """grad_reduce=compute with pp: each dp rank's float32 gradient sums (over its
    microbatches) rounded to the compute dtype, summed in it over dp, widened back (DDP's
    bf16/fp16 compress hook); the step equals the unsharded step accumulating the same
    microbatches within the compute dtype's tolerance and differs from the float32 reduction
    (the rounding is there). Without dp, or in check's float64, nothing is narrowed."""
    from parcomp.check.check64 import promote_graph
    from parcomp.check.differential import compare_all, tolerance_for
    from parcomp.check.pipeline import run_pipeline_step

    train = f"{ADAMW} precision={precision} {extra}"
    _, feeds, want = reference(chain_graph(blocks=4, batch=2), f"{train.replace('zero=1', '')} accumulate=4",
                               lowered=True)
    plan, fp32 = (plan_pipeline(chain_graph(blocks=4, batch=8), spec(f"{HEAD}{train} {r}\n"))
                  for r in ("grad_reduce=compute", ""))
    assert (plan.dp_reduce_dtype, fp32.dp_reduce_dtype) == (LOW[precision], None)
    got = run_pipeline_step(plan, feeds)
    assert compare_all(got, want, sorted(got), tolerance_for(LOW[precision]))["ok"]
    assert not compare_all(got, run_pipeline_step(fp32, feeds), sorted(got), 1e-6)["ok"]
    assert plan_pipeline(chain_graph(blocks=4), spec(f"mesh pp=2\n{train} grad_reduce=compute\n"
                                                     .replace("zero=1", ""))).dp_reduce_dtype is None
    wide = plan_pipeline(promote_graph(chain_graph(blocks=4)), spec(f"{HEAD}{train} grad_reduce=compute\n"))
    assert wide.dp_reduce_dtype is None


def test_grad_reduce_compute_in_program_py():
    """program.py says the dtype its dp reduction sends (DP_REDUCE_DTYPE, COLLECTIVE_DTYPES)
    and the bytes of the reduction's comment are the compute dtype's: half the float32 ones."""
    texts = [_program(f"precision=bf16 {r}")[1] for r in ("grad_reduce=compute", "")]
    assert "DP_REDUCE_DTYPE = 'bfloat16'" in texts[0] and "DP_REDUCE_DTYPE = None" in texts[1]
    bytes_ = [int(t.split("over dp of stage 0's")[1].split("bytes/rank ")[1].split(" ")[0].rstrip(","))
              for t in texts]
    assert 2 * bytes_[0] == bytes_[1]


def test_a_bad_cap_is_an_error_at_its_column():
    from parcomp.errors import SpecError

    with pytest.raises(SpecError) as e:
        _buckets("bucket_cap_mb=-1")
    assert "bucket_cap_mb=-1" in str(e.value) and "test.pcs:2:" in str(e.value)


# a launcher that logs, per rank, every dp collective started, every point-to-point slot and
# every matmul (a backward's compute)
LOGGING = """\
import os, runpy, sys
import torch
import torch.distributed as dist
log = open(os.environ["LOG"] + "." + os.environ["RANK"], "w")
def wrap(name, f):
    def inner(*a, **kw):
        log.write(f"{name} async={kw.get('async_op', False)}\\n")
        log.flush()
        return f(*a, **kw)
    return inner
for name in ("all_reduce", "reduce_scatter_tensor", "batch_isend_irecv"):
    setattr(dist, name, wrap(name, getattr(dist, name)))
torch.matmul = wrap("matmul", torch.matmul)
torch.nn.functional.linear = wrap("matmul", torch.nn.functional.linear)
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["bucket_cap_mb=0.0003", "bucket_cap_mb=0.0003 zero=1"])
def test_buckets_start_before_the_last_slot_and_the_step_equals_the_unsharded_one(tmp_path, extra):
    """dp=2 x pp=2 on 4 gloo ranks, several buckets a stage: on the last stage (1F1B: its last
    backward, then the slot sending that microbatch's input gradient, then the optimizer) every
    bucket's dp reduction starts asynchronously before that slot, the first one inside the
    last backward (matmuls of the layers before it still to run); the step equals the
    unsharded step."""
    torch = pytest.importorskip("torch")
    from parcomp.compile.compiler import compile_graph
    from parcomp_backends.torch.emit import emit_program
    from parcomp_backends.torch.launch import run_torchrun

    from numerics import assert_all_equivalent

    g = chain_graph(blocks=4)
    c = compile_graph(g, spec(f"{HEAD}{PIPE} {extra}\n"))
    (tmp_path / "program.py").write_text(emit_program(c))
    (tmp_path / "log_calls.py").write_text(LOGGING)
    ref, feeds, want = reference(g)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    res = run_torchrun(tmp_path, 4, ck, inp, str(tmp_path / "out.pt"), timeout=300, program="log_calls.py",
                       env={"LOG": str(tmp_path / "log")})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = {}
    for s in range(2):
        got.update({k: v.numpy() for k, v in torch.load(str(tmp_path / f"out.pt.stage{s}")).items()})
    assert_all_equivalent(got, want)
    nbuckets = len(c.program_.pipeline.dp_buckets[1])
    kind = "reduce_scatter_tensor" if "zero" in extra else "all_reduce"
    for rank in (1, 3):  # the last stage's two dp ranks
        lines = (tmp_path / f"log.{rank}").read_text().splitlines()
        last_slot = max(i for i, x in enumerate(lines) if x.startswith("batch_isend_irecv"))
        early = [x for x in lines[:last_slot] if x == f"{kind} async=True"]
        assert len(early) == nbuckets > 1, lines
        first = lines.index(f"{kind} async=True")
        assert "matmul async=False" in lines[first:last_slot], lines  # overlapped by backward


# a launcher that logs, per rank, the dtype of every asynchronous dp collective
DTYPES = """\
import os, runpy, sys
import torch.distributed as dist
log = open(os.environ["LOG"] + "." + os.environ["RANK"], "w")
def wrap(name, f, at):
    def inner(*a, **kw):
        if kw.get("async_op"):
            log.write(f"{name} {a[at].dtype}\\n")
            log.flush()
        return f(*a, **kw)
    return inner
dist.all_reduce = wrap("all_reduce", dist.all_reduce, 0)
dist.reduce_scatter_tensor = wrap("reduce_scatter_tensor", dist.reduce_scatter_tensor, 1)
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["", "zero=1"])
def test_grad_reduce_compute_program_sends_bfloat16_and_equals_the_interpreter(tmp_path, extra):
    """dp=2 x pp=2 on 4 gloo ranks, precision=bf16 grad_reduce=compute: every dp bucket's
    collective sends bfloat16; the step equals the interpreter's pipelined step (which
    rounds the same sums) and the unsharded accumulating step, within bfloat16's tolerance."""
    torch = pytest.importorskip("torch")
    from parcomp.check.differential import tolerance_for
    from parcomp.check.pipeline import run_pipeline_step
    from parcomp.compile.compiler import compile_graph
    from parcomp_backends.torch.emit import emit_program
    from parcomp_backends.torch.launch import run_torchrun

    from numerics import assert_all_equivalent

    train = f"{ADAMW} precision=bf16 grad_reduce=compute bucket_cap_mb=0.0003 {extra}"
    c = compile_graph(chain_graph(blocks=4, batch=8), spec(f"{HEAD}{train}\n"))
    (tmp_path / "program.py").write_text(emit_program(c))
    (tmp_path / "log_calls.py").write_text(DTYPES)
    ref, feeds, want = reference(chain_graph(blocks=4, batch=2),
                                 f"{ADAMW} precision=bf16 accumulate=4", lowered=True)
    ck = {k: torch.from_numpy(np.asarray(v)) for k, v in feeds.items() if ref[k].op == "param"}
    inp = {k: torch.from_numpy(np.asarray(feeds[k])) for k in ("x", "target")}
    res = run_torchrun(tmp_path, 4, ck, inp, str(tmp_path / "out.pt"), timeout=300, program="log_calls.py",
                       env={"LOG": str(tmp_path / "log")})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    got = {}
    for s in range(2):
        got.update({k: v.float().numpy() for k, v in torch.load(str(tmp_path / f"out.pt.stage{s}")).items()})
    mine = run_pipeline_step(c.program_.pipeline, feeds)
    assert_all_equivalent(got, {k: v for k, v in mine.items() if k in got}, rtol=tolerance_for("bfloat16"))
    assert_all_equivalent(got, {k: v for k, v in want.items() if k in got}, rtol=tolerance_for("bfloat16"))
    kind = "reduce_scatter_tensor" if extra else "all_reduce"
    for rank in range(4):
        lines = (tmp_path / f"log.{rank}").read_text().splitlines()
        assert lines and set(lines) == {f"{kind} torch.bfloat16"}, lines
