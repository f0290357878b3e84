"""What a pipelined stage's backward keeps alive: each parameter gradient, once handed to
``ready`` (which adds it to the step's sums, pipeline_main.py), is not held by the backward
until it returns, so a rank holds its params, the sums and one gradient in the making rather
than a third set of gradients (bench/pipeline_memory.py measures the peak)."""
import weakref

import torch

from graphs import spec
from test_pipeline import chain_graph

PIPE = "train loss=mse optimizer=sgd(lr=0.01) input_grads=no microbatches=2 schedule=1f1b"


def _program(extra=""):
    from parcomp.compile.compiler import compile_graph
    from parcomp_backends.torch.emit import emit_program

    c = compile_graph(chain_graph(blocks=4, batch=4, hidden=16), spec(f"mesh pp=2\n{PIPE} {extra}\n"))
    ns = {"__name__": "program"}
    exec(emit_program(c), ns)  # noqa: S102 - the emitted stage functions, run on this process
    return ns


def _params(ns, s):
    torch.manual_seed(0)
    return {k: torch.randn(shape) for k, (shape, _) in ns["PARAM_SHAPES"].items() if k in ns["STAGE_PARAMS"][s]}


def test_a_gradient_handed_to_ready_is_freed_before_the_backward_returns():
    """Every stage's backward: at each ``ready`` call, of the gradients handed over before,
    none is alive but through the sums' own references (here none: ready keeps weak ones); the
    returned dict holds the input gradient to send, not the gradients already summed (the
    statements are unchanged: the pipeline tests against the unsharded step check the values)."""
    ns = _program()
    rows = ns["MICRO_BATCH"]
    torch.manual_seed(1)
    x = torch.randn(rows, 8, 16)
    target = torch.randn(rows, 8, 16)
    fwd0 = ns["stage0_forward"](_params(ns, 0), {"x": x})
    send = {v: fwd0[v] for v, _, _ in ns["SEND"][0]}
    feeds = {1: {**send, **{k: target for k in ns["BATCH_INPUTS"][1]}}, 0: {"x": x}}
    for s in (1, 0):
        p = _params(ns, s)
        out = ns[f"stage{s}_forward"](p, dict(feeds[s]))
        saved = {n[len("saved."):]: v for n, v in out.items() if n.startswith("saved.")}
        if s == 0:
            saved.update({f"grad.{v}": torch.randn(fwd0[v].shape) for v, _, _ in ns["SEND"][0]})
        handed, alive, values = [], [], {}

        def ready(name, value):
            alive.append(sum(r() is not None for r in handed))
            handed.append(weakref.ref(value))
            values[name] = value.clone()
        got = ns[f"stage{s}_backward"](p, {**({"x": x} if s == 0 else {k: target for k in ns["BATCH_INPUTS"][1]}),
                                            **saved}, ready)
        assert sorted(values) == sorted(ns["GRADS"][s]), values
        assert alive == [0] * len(alive), f"stage {s}: gradients held after ready at each call: {alive}"
        assert not set(got) & set(values), sorted(got)
        assert set(got) == {"grad." + v for v, _, _ in ns["RECV"][s]}


def test_output_writes_a_whole_tensor_without_a_copy_and_a_view_compacted():
    """``--output`` (pipeline_main.host_copy): a tensor owning its whole storage is written as
    is (no second copy of every param and gradient at the end of the run, which was the
    program's peak); a view of a larger storage is copied, so the file holds only its bytes."""
    from parcomp_backends.torch.runtime.pipeline_main import host_copy

    whole = torch.arange(12.0).reshape(3, 4)
    assert host_copy(whole).data_ptr() == whole.data_ptr()
    part = torch.arange(24.0).reshape(6, 4)[2:4]
    got = host_copy(part)
    assert torch.equal(got, part) and got.untyped_storage().nbytes() == 8 * 4
    t = torch.arange(12.0).reshape(3, 4).t()  # a transpose owns its storage: written as is
    assert torch.equal(host_copy(t), t)
