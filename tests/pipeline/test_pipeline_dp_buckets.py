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


def test_a_bad_cap_is_an_error_at_its_column():
    from parcomp.errors import SpecError

    with pytest.raises(SpecError) as e:
        _buckets("bucket_cap_mb=-1")
    assert "bucket_cap_mb=-1" in str(e.value) and "test.pcs:2:" in str(e.value)


# a launcher that logs, per rank, every dp collective started and every point-to-point slot
LOGGING = """\
import os, runpy, sys
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
sys.argv[0] = "program.py"
runpy.run_path("program.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("extra", ["bucket_cap_mb=0.0003", "bucket_cap_mb=0.0003 zero=1"])
def test_buckets_start_before_the_last_slot_and_the_step_equals_the_unsharded_one(tmp_path, extra):
    """dp=2 x pp=2 on 4 gloo ranks, several buckets a stage: on the last stage (1F1B: its last
    backward, then the slot sending that microbatch's input gradient, then the optimizer) every
    bucket's dp reduction starts asynchronously before that slot; the step equals the
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
