"""The compiler's passes, in order: the one list ``compile_graph`` runs.

:data:`PASSES` is the whole compile, from the model graph to the per-rank program (and, for a
``pp`` mesh axis, the pipeline's stages), written once, in order, as tinygrad writes its
rewrite pipeline in one function. Each entry is a :class:`Pass`: a name (what
``--print-ir-after-all`` prints), a function ``run(graph, ctx) -> Graph`` (pure; ``ctx`` a
:class:`PassContext`: the spec, and the search's options), a condition ``when(spec)`` for the
passes only some specs run (training, pipeline, MoE, sequence and context parallel), and the
group it belongs to. A *check* returns its input unchanged or raises a located error.

:func:`run_passes` runs a list (verifying the IR after every pass that changed it, xDSL's
contract) and hands each graph to ``after`` (``--print-ir-after-all``). Everything that runs
passes runs this list, or a part of it picked by name or group: ``compile_graph``, block
reuse (the same list on a few blocks, :mod:`parcomp.compile.repeat_compile`), the pipeline's
per-stage sharding (group ``shard``) and lowering (group ``lower``), :func:`bind_layouts` (group ``bind``) and
:func:`plan_pipeline`. ``docs/ARCHITECTURE.md``'s table is :func:`pass_table`'s text.

The list lives in ``passes/`` (not ``compile/``) because the pipeline's per-stage sharding and
the planner run parts of it, and ``passes`` may not import ``compile``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable

from ..cost.topology import check_topology
from ..errors import VerifyError
from ..ir.graph import Graph
from . import bind_layouts as bind
from .attention.ctxpar import pin_context_parallel
from .attention.heads import check_heads
from .attention.seqpar import pin_sequence_parallel
from .autodiff import add_training_step
from .decompose import decompose_reductions
from .fused_weights import fused_bias_follows
from .insert_collectives import insert_collectives
from .localize import localize
from .lowering.bucket import bucket_norm_grads
from .lowering.dp_buckets import bucket_dp_grads
from .lowering.fuse_reductions import fuse_reductions
from .lowering.group_updates import group_updates
from .lowering.lower import fuse_matmuls, fuse_mse, fuse_updates, free_dead, in_place, overlap_collectives
from .lowering.moe_ragged import moe_ragged
from .moe_capacity import apply_moe_spec
from .pipeline.pipeline_plan import PipelinePlan, make_plan
from .pipeline.stage_lower import lower_stages
from .shard_prop import shard_prop
from .verify import check_model_mesh, verify
from .vocab_pad import pad_vocab_tables

__all__ = ["Pass", "PassContext", "PASSES", "passes_for", "run_passes", "group", "bind_layouts",
           "plan_pipeline", "logical_stage", "model_stage", "program_stage", "pass_table"]


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides its graph.

    Attributes:
        spec: the parsed spec (None: no spec, as in a pipeline stage's sharding: no memory limit).
        heuristic: shard-prop skips the ILP (block reuse).
        problem: shard-prop's problem, already built (block reuse).
        stages: ``{pass name: its result}`` of the passes run before, read-only (``split-stages``
            reads the model and the bound graph from it).
    """

    spec: object = None
    heuristic: bool = False
    problem: object = None
    stages: object = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Pass:
    """One entry of the list: ``run(graph, ctx) -> Graph`` under ``name``, for the specs where
    ``when(spec)`` holds (every spec when None)."""

    name: str
    run: Callable
    group: str
    what: str
    when: Callable | None = None
    condition: str = ""  # ``when`` in words (the docs' table)

    def applies(self, spec) -> bool:
        return self.when is None or bool(self.when(spec))


def _doing(fn):
    """Marks a ``run(graph, ctx)`` as doing its work by ``fn`` (the module the docs name)."""
    def mark(run):
        run.impl = fn
        return run
    return mark


def _spec_pass(fn):
    """A pass ``fn(graph, spec)`` as ``run(graph, ctx)``."""
    return _doing(fn)(lambda graph, ctx: fn(graph, ctx.spec))


def _graph_pass(fn):
    """A pass ``fn(graph)`` as ``run(graph, ctx)``."""
    return _doing(fn)(lambda graph, ctx: fn(graph))


@_doing(apply_moe_spec)
def _moe_capacity(graph, ctx):
    return apply_moe_spec(graph, ctx.spec)[0]  # the changes, for the report: compile_graph


@_doing(check_model_mesh)
def _check_model_mesh(graph, ctx):
    check_model_mesh(graph, ctx.spec.mesh)
    return graph


@_doing(check_topology)
def _check_topology(graph, ctx):
    check_topology(ctx.spec)
    return graph


# binding passes whose work is done in a module of its own (the docs name that module)
_fused_bias = _doing(fused_bias_follows)(_spec_pass(bind.fused_bias_layouts))
_heads = _doing(check_heads)(_spec_pass(bind.attention_heads))
_pad_vocab = _doing(pad_vocab_tables)(_spec_pass(bind.pad_vocab))


@_doing(shard_prop)
def _shard_prop(graph, ctx):
    spec = ctx.spec
    if ctx.problem is not None:  # block reuse: the reduced model's problem, the heuristic
        return shard_prop(graph, heuristic=True, problem=ctx.problem)
    return shard_prop(graph, memory=getattr(spec, "memory", None), memory_loc=getattr(spec, "memory_loc", None),
                      heuristic=ctx.heuristic)


@_doing(make_plan)
def _split_stages(graph, ctx) -> PipelinePlan:
    """The pipeline's plan: the model (before ``decompose-reductions``) cut into stages, each
    stage's programs made and, with axes inside a stage, sharded by group ``shard`` of the list;
    the param layouts read from the bound graph (the last pass of group ``bind``)."""
    return make_plan(model_stage(ctx.stages), ctx.spec, _last_of(ctx.stages, "bind"), _shard_stage)


def _shard_stage(graph: Graph) -> tuple:
    """``(sharded, local)``: a pipeline stage's program through group ``shard`` (no spec: the
    stage's sources and outputs are already pinned)."""
    stages = run_passes(graph, None, group("shard"))
    return stages["insert-collectives"], stages["localize"]


@_doing(lower_stages)
def _lower_stages(graph, ctx) -> PipelinePlan:
    """The pipeline's plan with each stage's programs (per-rank with tp inside the stages)
    through group ``lower`` of the list, as the SPMD program: ``graph`` (the SPMD program) is
    not read."""
    return lower_stages(ctx.stages["split-stages"], _lower_stage)


def _lower_stage(graph: Graph) -> Graph:
    """A pipeline stage's program through group ``lower`` (no spec: a stage program has no dp
    axis, so ``bucket-dp-grads`` finds nothing to bucket)."""
    return program_stage(run_passes(graph, None, group("lower")))


def _has_moe(spec):
    return getattr(spec, "moe", None) is not None


def _training(spec):
    return getattr(spec, "train", None) is not None


def _pipelined(spec):
    return "pp" in spec.mesh.names and _training(spec)


def _sequence_parallel(spec):
    return getattr(spec, "sequence_parallel", None) is not None


def _context_parallel(spec):
    return getattr(spec, "context_parallel", None) is not None


#: The compile, in order. Groups: ``model`` (the model as given: the spec's MoE capacity, the
#: checks), ``forward`` (the forward graph's rewrites), ``bind`` (the spec's rules become
#: layouts), ``train`` (the training step), ``shard`` (the SPMD program), ``lower`` (the op
#: sequence every backend runs), ``pipeline`` (the stages of a ``pp`` mesh axis).
PASSES = (
    Pass("moe-capacity", _moe_capacity, "model",
         "the spec's `moe` line: each MoE layer's capacity, every value between dispatch and combine re-typed",
         _has_moe, "a `moe` line"),
    Pass("check-model-mesh", _check_model_mesh, "model",
         "check: the model is a global graph and its own mesh and layouts fit the spec's mesh"),
    Pass("check-topology", _check_topology, "model",
         "check: no `tp` group spans nodes of the spec's `topology`"),
    Pass("decompose-reductions", _graph_pass(decompose_reductions), "forward",
         "softmax, mean, cross-entropy, ... as primitive reductions"),
    Pass("bind-layouts", _spec_pass(bind.bind_param_layouts), "bind",
         "the spec's rules checked, then params and inputs get their rule's layout (replicated if none)"),
    Pass("bias-follows", _spec_pass(bind.bias_follows), "bind",
         "an unnamed bias of a colwise matmul follows its weight"),
    Pass("fused-bias-follows", _fused_bias, "bind",
         "an unnamed fused bias follows its colwise fused weight"),
    Pass("attention-heads", _heads, "bind",
         "check: heads split evenly over the axis; a GQA kv projection with fewer heads is replicated"),
    Pass("pad-vocab", _pad_vocab, "bind",
         "a vocab table split unevenly padded to a multiple of the ranks, its logits masked and sliced"),
    Pass("check-even", _spec_pass(bind.check_even), "bind",
         "check: every param and input splits evenly"),
    Pass("pin-activations", _spec_pass(bind.pin_activations), "bind",
         "a `relayout` to each activation rule's layout"),
    Pass("pin-outputs", _spec_pass(bind.pin_outputs), "bind",
         "a `relayout` to each output's layout (replicated if no rule)"),
    Pass("pin-sequence-parallel", _spec_pass(pin_sequence_parallel), "bind",
         "norms' inputs and outputs split along the sequence (padded to a multiple of the axis at "
         "the norm)", _sequence_parallel, "`sequence-parallel`"),
    Pass("pin-context-parallel", _spec_pass(pin_context_parallel), "bind",
         "sdpa's q, k, v and output split along the sequence, the sdpa marked", _context_parallel,
         "`context-parallel`"),
    Pass("autodiff", _spec_pass(add_training_step), "train",
         "loss, backward and optimizer update on the global graph", _training, "a `train` line"),
    Pass("shard-prop", _shard_prop, "shard",
         "a layout for every value, a strategy for every op (ILP, DP or heuristic)"),
    Pass("insert-collectives", _graph_pass(insert_collectives), "shard",
         "every layout mismatch becomes explicit layout ops (collectives)"),
    Pass("localize", _graph_pass(localize), "shard", "global types become per-rank types"),
    Pass("fuse-reductions", _graph_pass(fuse_reductions), "lower", "softmax, norms, ... fused back"),
    Pass("fuse-matmuls", _graph_pass(fuse_matmuls), "lower", "`dense`, `addmm`, `matmul_t`"),
    Pass("fuse-mse", _graph_pass(fuse_mse), "lower", "`mse_sum`, `mse_grad`"),
    Pass("fuse-updates", _graph_pass(fuse_updates), "lower", "the optimizer's `add_scaled`, `axpby`"),
    Pass("bucket-norm-grads", _graph_pass(bucket_norm_grads), "lower",
         "sequence parallel's norm-weight gradients in one all_reduce"),
    Pass("bucket-dp-grads", _spec_pass(bucket_dp_grads), "lower",
         "dp gradient all_reduces in buckets of `bucket_cap_mb`"),
    Pass("moe-ragged", _graph_pass(moe_ragged), "lower",
         "expert parallel all_to_alls send only the routed rows"),
    Pass("overlap-collectives", _graph_pass(overlap_collectives), "lower",
         "all_reduce, all_gather, reduce_scatter started early, waited for at first use"),
    Pass("group-updates", _graph_pass(group_updates), "lower",
         "each group of per-parameter optimizer updates one multi-tensor call runs made contiguous"),
    Pass("in-place", _graph_pass(in_place), "lower", "updates and reductions into their operand's buffer"),
    Pass("free-dead", _graph_pass(free_dead), "lower", "`frees` where values die"),
    Pass("split-stages", _split_stages, "pipeline",
         "the model cut into stages; each stage's forward, backward and optimizer programs, sharded "
         "inside the stage by group `shard`", _pipelined, "a `pp` mesh axis and a `train` line"),
    Pass("lower-stages", _lower_stages, "pipeline",
         "each stage's forward, backward and optimizer programs through group `lower`, as the SPMD "
         "program", _pipelined, "a `pp` mesh axis and a `train` line"),
)


def passes_for(spec) -> tuple:
    """The entries of :data:`PASSES` that ``spec`` runs, in order."""
    return tuple(p for p in PASSES if p.applies(spec))


def group(name: str, spec=None) -> tuple:
    """The entries of group ``name``, in order (with ``spec``: those it runs)."""
    return tuple(p for p in PASSES if p.group == name and (spec is None or p.applies(spec)))


def run_passes(graph: Graph, spec, passes=None, after: Callable | None = None, *, heuristic: bool = False,
               problem=None, check: bool = True) -> dict:
    """Run ``passes`` (default: :func:`passes_for` ``spec``) in order on ``graph``; returns
    ``{"input": graph, pass name: its result}``. With ``check``, the graph the first pass
    after group ``model`` reads (the model with the spec's MoE capacity; the input when that
    group does not run) and each new graph after it are verified (a pass returning its input
    object unchanged is not: it passed already).
    ``after(name, graph)`` sees every result (each of a pipeline plan's stage programs).

    Raises:
        VerifyError: a pass produced invalid IR (names the pass and the node).
    """
    passes = passes_for(spec) if passes is None else passes
    out = {"input": graph}
    ctx = PassContext(spec, heuristic, problem, MappingProxyType(out))
    memo = {}  # nodes verified unchanged are not checked again (verify's memo)
    verified = False  # group model's passes take the model as given: its checks speak first
    for p in passes:
        if check and not verified and p.group != "model":
            verify(graph, memo)
            verified = True
        got = p.run(graph, ctx)
        if not isinstance(got, Graph):  # split-stages: a pipeline plan of several graphs
            out[p.name] = got
            for g in _plan_graphs(got):
                if after is not None:
                    after(p.name, g)
            continue
        before, graph = graph, got
        try:
            if verified and graph is not before:
                verify(graph, memo)
        except VerifyError as e:
            err = VerifyError(f"after pass {p.name}: {e.message}")
            err.node = getattr(e, "node", None)  # lets a caller point at a .pcir line
            raise err from None
        out[p.name] = graph
        if after is not None:
            after(p.name, graph)
    if check and not verified:
        verify(graph, memo)
    return out


def _plan_graphs(plan) -> list:
    """A pipeline plan's graphs: each stage's forward, backward and optimizer programs (the
    per-rank ones when the stages are sharded inside)."""
    if plan.lowered:
        return [g for st in plan.lowered for g in st.programs.values()]
    return [getattr(st, kind) for st in (plan.local or plan.stages) for kind in ("forward", "backward", "optimizer")]


def _last_of(stages, name: str) -> Graph:
    """The result of the last pass of group ``name`` that ran."""
    names = {p.name for p in group(name)}
    return next(stages[k] for k in reversed(list(stages)) if k in names)


def model_stage(stages) -> Graph:
    """The model graph the compile works on: the input after group ``model`` (with the spec's
    MoE capacity), the result just before ``decompose-reductions``."""
    keys = list(stages)
    first = next((k for k in keys if k in {p.name for p in group("forward")}), None)
    return stages[keys[keys.index(first) - 1]] if first else stages["input"]


def logical_stage(stages) -> Graph:
    """The unsharded graph of what the program computes (the ground truth): the result just
    before ``shard-prop`` (``autodiff``'s with a train line, else the binding's)."""
    names = {p.name for p in PASSES if p.group in ("forward", "bind", "train")}
    return next(stages[k] for k in reversed(list(stages)) if k in names)


def program_stage(stages) -> Graph:
    """The lowered per-rank program: the last pass of group ``lower``."""
    return _last_of(stages, "lower")


def bind_layouts(graph: Graph, spec) -> Graph:
    """``graph`` (an unsharded model graph) with the spec's rules bound: the passes of group
    ``bind`` that ``spec`` runs, in order (not verified between them)."""
    stages = run_passes(graph, spec, group("bind", spec), check=False)
    return list(stages.values())[-1]


def plan_pipeline(graph: Graph, spec) -> PipelinePlan:
    """The pipeline plan of a model ``graph`` (after group ``model``) under a spec with a ``pp``
    axis and a ``train`` line: ``decompose-reductions``, group ``bind`` and group ``pipeline``
    (``split-stages``, then ``lower-stages``).

    Raises:
        SpecError: as :func:`parcomp.passes.pipeline.pipeline_plan.make_plan`.
    """
    passes = [p for p in passes_for(spec) if p.group in ("forward", "bind", "pipeline")]
    return run_passes(graph, spec, passes, check=False)["lower-stages"]


def pass_table() -> str:
    """The Markdown table of :data:`PASSES` that ``docs/ARCHITECTURE.md`` holds."""
    rows = ["| # | pass | group | runs when | module | what it does |",
            "|---|------|-------|-----------|--------|--------------|"]
    rows += [f"| {i} | `{p.name}` | {p.group} | {p.condition or 'always'} | `{_module(p)}` | {p.what} |"
             for i, p in enumerate(PASSES, 1)]
    return "\n".join(rows)


def _module(p: Pass) -> str:
    """The file of the function doing ``p``'s work, under ``parcomp/``."""
    mod = getattr(p.run, "impl", p.run).__module__
    return mod.removeprefix("parcomp.").replace(".", "/") + ".py"
