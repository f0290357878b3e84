"""Pipeline stages lowered and printed as the SPMD program: each stage's programs go through the
pass list's group ``lower`` (pass ``lower-stages``) and the SPMD step's printer, so the
pipelined program.py has a reason above every collective (tp inside a stage, the point-to-point
slots, the dp gradient reduction), fused linears, in-place updates and the spec's provenance.
That the lowered stages compute the unpipelined step is what every in-process pipeline test
checks (the interpreter runs ``plan.lowered``)."""
import re

import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.passes.pass_list import plan_pipeline
from parcomp_backends.torch.emit import RUNTIME_MARK, emit_program

from graphs import spec
from test_pipeline import TRAIN, chain_graph
from test_pipeline_tp import HEAD, TP_LAYOUTS

#: a statement that communicates: a collective of the op table (in place, started, or not) or a
#: point-to-point slot of ACTIONS
COMMUNICATES = re.compile(r"= (all_reduce_?|all_reduce_start_?|all_gather|reduce_scatter|all_to_all|"
                          r"shard_slice|partial_mask)\(|\('p2p', ")

#: statements of the lowered SPMD program's forms: fused linears, collectives and updates in place
FORMS = ("torch.nn.functional.linear(", "torch.matmul(", "all_reduce_(", ".add_(", "    fused_sgd_(")


def _program(head: str, train: str) -> str:
    """program.py of the 4-block chain under ``head`` and ``train``, up to the runtime line."""
    return emit_program(compile_graph(chain_graph(blocks=4), spec(f"{head}{train}\n"))).split(RUNTIME_MARK)[0]


@pytest.fixture(scope="module")
def pipelined() -> str:
    return _program(HEAD, f"{TRAIN} microbatches=2")


def test_every_collective_of_a_pp_tp_program_has_its_reason_above(pipelined):
    lines = pipelined.splitlines()
    talks = [i for i, line in enumerate(lines) if COMMUNICATES.search(line)]
    assert sum("('p2p', " in lines[i] for i in talks) >= 8 and sum("all_reduce" in lines[i] for i in talks) >= 6
    for i in talks:
        above = lines[i - 1].strip()
        assert above.startswith("#"), f"line {i + 1} communicates without a reason above it:\n{lines[i]}"
        k = i - 1
        while lines[k].strip().startswith("#   "):  # a wrapped comment: its first line
            k -= 1
        head = lines[k].strip()
        assert re.match(r"# (all_reduce|all_gather|reduce_scatter|all_to_all|shard_slice|partial_mask) over "
                        r"|# send/recv over pp, bytes/rank \d+: ", head), head
        if "('p2p', " in lines[i]:
            assert "starts from" in " ".join(lines[k:i])  # why: the neighbour's step reads it
        elif "local, no communication" not in head:
            assert "bytes/rank" in head and ":" in head.split("bytes/rank", 1)[1]
    # the reductions step() runs between the stage functions: the dp gradient and loss sums
    text = " ".join(line.strip("# ") for line in lines if line.startswith("#"))
    assert "all_reduce over dp of stage 0's 8 gradients (GRADS), in the buckets of DP_BUCKETS, bytes/rank" in text
    assert "all_reduce over dp of stage 1's 8 gradients (GRADS), in the buckets of DP_BUCKETS, bytes/rank" in text
    assert "all_reduce over dp of the loss" in text


def test_stage_functions_hold_the_spmd_programs_lowered_forms(pipelined):
    """The SPMD program of the same layouts (no pp) and the stages: the same fused linears,
    in-place all_reduces and one fused SGD update (momentum and param in place); each statement
    a spec rule caused names that rule, as in the SPMD program."""
    spmd = _program(f"mesh dp=2 tp=2\n{TP_LAYOUTS}", TRAIN)
    assert all(form in spmd for form in FORMS)
    stages = pipelined.split("def stage0_forward", 1)[1]
    for form in FORMS:
        assert form in stages, f"the SPMD program has {form!r}, the stage functions do not"
    update = stages.split("def stage0_optimizer", 1)[1].split("\ndef ", 1)[0]
    assert update.count("fused_sgd_(") == 1 and "momentum=0.9, lr=0.1" in update
    assert re.search(r"all_reduce_\(.*\)  # \[R, R, R\] f32\[\d+,8,4\]; test\.pcs:\d+", stages)


@pytest.mark.parametrize("head", ["mesh pp=2\n", HEAD])
def test_every_stage_program_went_through_the_lowering(head):
    plan = plan_pipeline(chain_graph(blocks=4), spec(f"{head}{TRAIN} microbatches=2 schedule=zb-h1\n"))
    for st in plan.lowered:
        assert set(st.programs) == {"forward", "backward", "backward_input", "backward_weight", "optimizer"}
        ops = {n.op for g in st.programs.values() for n in g.nodes}
        assert {"dense", "matmul_t", "axpby", "add_scaled"} <= ops and "matmul" not in ops
        assert any(n.attr("frees") for g in st.programs.values() for n in g.nodes)
        assert all(n.attr("inplace") for n in st.optimizer.nodes if n.op in ("axpby", "add_scaled"))


def test_a_tied_param_two_chunks_of_one_rank_update_is_updated_out_of_place():
    """Interleaved: virtual stages 0 and 2 both on pp coordinate 0. Were a param tied between
    them, each chunk's update must read the step's old value (program.py runs both updates
    before it takes their results), so neither writes it, or its momentum, in place."""
    from dataclasses import replace

    from parcomp.passes.pass_list import group, program_stage, run_passes
    from parcomp.passes.pipeline.stage_lower import lower_stages

    plan = plan_pipeline(chain_graph(blocks=4), spec(f"mesh pp=2\n{TRAIN} microbatches=2 schedule=interleaved\n"))
    assert plan.rank_of_stage(0) == plan.rank_of_stage(2)

    def written(p):  # the params and state whose buffer an update of stage 0 writes
        return {n.inputs[0] for n in p.lowered[0].optimizer.nodes if n.attr("inplace")}

    assert {"0.weight", "0.weight.momentum_buffer"} <= written(plan)
    tied = lower_stages(replace(plan, tied=(("0.weight", (0, 2)),)),
                        lambda g: program_stage(run_passes(g, None, group("lower"))))
    got = written(tied)
    assert "0.weight" not in got and "0.weight.momentum_buffer" not in got and "0.bias" in got
