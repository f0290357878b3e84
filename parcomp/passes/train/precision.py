"""Mixed precision: ``train ... precision=bf16|fp16|fp32 [grad_reduce=fp32|compute]``.

What it writes on the *global* graph (before the loss; :func:`lower_forward`), so the
planner places every collective and the interpreter checks it like any other op:

- **fp32 master parameters.** Every float32 parameter stays a float32 ``param`` (the
  carried value, the optimizer's state, the checkpoint); the forward reads a ``cast`` of it
  to the compute dtype (``<param>.low``), as torch.autocast's weight cast. Under ZeRO the
  trained parameters are laid out like their optimizer state (split over ``dp``): each rank
  keeps and updates only its fp32 slice, and the planner all_gathers the low-precision copy
  (half the bytes of gathering the fp32 one).
- **compute and collectives in the compute dtype.** Every float32 forward value becomes
  bfloat16 / float16 (float inputs are cast on entry), so the forward's collectives and the
  backward's activation-gradient collectives send 2-byte elements; the report's bytes are
  the dtype actually sent (``DTYPE_BYTES`` of the value).
- **the loss in float32**: the model's output is cast back to float32 before the loss
  (autocast runs mse/cross-entropy in float32), so backward starts in float32 and enters
  the model through the cast's gradient.
- **gradient reductions in float32** (``grad_reduce=fp32``, the default): the gradient of
  ``<param>.low`` is widened by ``grad_upcast`` before it reaches the optimizer. That op
  takes no replicated operand on the axes that split the batch (``partial_over``, see
  :func:`parcomp.rules.sharding.mesh_strategies`), so the per-rank partial sums are widened
  first and the dp all_reduce / ZeRO reduce_scatter sends float32 (Megatron's
  ``accumulate_allreduce_grads_in_fp32``). ``grad_reduce=compute`` lets the planner reduce
  in the compute dtype (half the bytes).

With ``accumulate=K``: gradients widened per microbatch, summed in float32, reduced once.
"""
from __future__ import annotations

from dataclasses import replace

from parcomp.ir.graph import Graph, Node
from parcomp.ir.names import NameGen
from parcomp.ir.types import TensorType, shard_axes
from parcomp.spec.train_options import PRECISIONS


# Ops torch.autocast runs in float32 whatever the compute dtype: a model's own loss
# (transformers' ``ForCausalLMLoss``: cross_entropy, then its sum over the counted tokens).
FLOAT32_OPS = frozenset({"cross_entropy", "label_mask"})


def compute_dtype(opts) -> str | None:
    """The low compute dtype of TrainOptions ``opts``, or None for float32."""
    return PRECISIONS.get(getattr(opts, "precision", "fp32"))


def lower_forward(graph: Graph, cfg, params, state_layout) -> tuple:
    """The forward graph in the compute dtype (see the module docstring).

    ``params``: the trained parameters; ``state_layout(node)``: their optimizer state's
    layout (ZeRO: split over dp), which their fp32 master copy takes.
    Returns ``(graph, {param: name of its low-precision copy})``; unchanged for fp32.
    With ``accumulate=K`` the cast nodes are copied per microbatch like every compute node
    (:mod:`parcomp.passes.train.accumulate`)."""
    check_low_params(graph, cfg, params)
    low = compute_dtype(cfg.options)
    if low is None:
        return graph, {}
    names, out, cast, outputs = NameGen(n.name for n in graph.nodes), [], {}, set(graph.outputs)

    def lowered(ty):
        return TensorType(ty.shape, low) if ty.dtype == "float32" else ty

    wide = set()  # values kept in float32: a model's own loss and what is computed from it only
    for n in graph.nodes:
        if n.op in ("input", "param"):
            if n.op == "param" and n.name in params and cfg.zero:
                n = replace(n, layout=state_layout(n))  # the fp32 master: split like its state
            out.append(n)
            if n.type.dtype == "float32":
                cast[n.name] = names.fresh(f"{n.name}.low")
                out.append(Node(cast[n.name], "cast", (n.name,), lowered(n.type), phase="forward"))
            continue
        ins = tuple(cast.get(i, i) for i in n.inputs)
        floats = [i for i in n.inputs if graph[i].type.dtype == "float32"]
        if n.type.dtype == "float32" and (n.op in FLOAT32_OPS or (floats and all(i in wide for i in floats))):
            wide.add(n.name)  # as autocast: the loss ops run in float32 on widened operands
            widened = []
            for i, v in zip(n.inputs, ins):
                if graph[i].type.dtype == "float32" and i not in wide:
                    w = names.fresh(f"{v}.f32")
                    out.append(Node(w, "cast", (v,), graph[i].type, phase="forward", source=n.source))
                    v = w
                widened.append(v)
            out.append(replace(n, inputs=tuple(widened)))
            continue
        if any(i in wide for i in n.inputs):  # a float32 loss value read by low-precision compute
            narrowed = []
            for i, v in zip(n.inputs, ins):
                if i in wide:
                    w = names.fresh(f"{v}.low")
                    out.append(Node(w, "cast", (v,), lowered(graph[i].type), phase="forward", source=n.source))
                    v = w
                narrowed.append(v)
            ins = tuple(narrowed)
        if n.name in outputs and n.type.dtype == "float32":  # the loss is taken in float32
            v = names.fresh(f"{ins[0]}.f32")
            out.append(Node(v, "cast", ins[:1], n.type, phase="forward", source=n.source))
            out.append(replace(n, inputs=(v,) + ins[1:]))
        else:
            out.append(replace(n, inputs=ins, type=lowered(n.type)))
    return graph.with_nodes(out), cast


def check_low_params(graph: Graph, cfg, params) -> None:
    """Refuse to train a bfloat16/float16 parameter without ``precision=pure``: it would train in
    pure low precision without a word (AdamW state and gradient sums in 2-byte floats, updates
    below the parameter's rounding step lost). The SpecError, at the train line's ``precision``
    option or the line, names the parameter and both ways out: float32 weights with
    ``precision=bf16`` (float32 master weights and optimizer state, torch.autocast's mixed
    precision), or ``precision=pure`` to train in the model's dtype on purpose."""
    if getattr(cfg.options, "precision", "fp32") == "pure":
        return
    trained = set(params)
    low = [n for n in graph.nodes if n.op == "param" and n.name in trained
           and n.type.dtype in ("bfloat16", "float16")]
    if not low:
        return
    from parcomp.errors import SpecError
    from parcomp.spec.option_loc import option_loc

    n = low[0]
    short = {"bfloat16": "bf16", "float16": "fp16"}[n.type.dtype]
    raise SpecError(
        f"parameter {n.name} is {n.type.dtype} ({len(low)} of the trained parameters are {short}): training "
        f"it as it is would keep its gradients, their sums and the optimizer state in {n.type.dtype} "
        f"(pure {short} training, updates smaller than its rounding step lost); load the model in float32 "
        f"and write precision={short} (float32 master weights and optimizer state, {short} compute), or "
        f"write precision=pure to train in {n.type.dtype} on purpose",
        option_loc(cfg.loc, "precision") or cfg.loc)


def batch_axes(graph: Graph) -> str:
    """Space-separated names of the mesh axes that split dim 0 of a model input."""
    axes = sorted({a for n in graph.inputs for a in shard_axes(n.layout, 0)})
    return " ".join(graph.mesh.names[a] for a in axes)


def upcast_grads(b, graph: Graph, grads: dict, cast: dict, cfg) -> dict:
    """``{param: float32 gradient}`` from the gradients of the low copies ``cast``;
    ``partial_over`` forces float32 reductions over the batch axes (``grad_reduce=fp32``)."""
    over = batch_axes(graph) if cfg.options.grad_reduce == "fp32" else ""
    out = {}
    for p, low in cast.items():
        if low in grads:
            b.prefix, b.phase = f"bw.{p}", "backward"
            out[p] = b.op("grad_upcast", [grads[low]], name=f"bw.{p}.f32", partial_over=over)
    return out


def wrt_names(params, cast: dict) -> list:
    """The values backward differentiates for ``params``: their low copies where cast."""
    return [cast.get(p, p) for p in params]


def precision_record(opts) -> dict:
    """report.json's ``precision`` entry of TrainOptions ``opts``."""
    low = compute_dtype(opts)
    if opts.precision == "pure":  # the model's own dtype throughout, chosen in the spec
        return {"precision": "pure", "compute_dtype": "model", "master_dtype": "model",
                "grad_reduce_dtype": "model"}
    return {"precision": opts.precision, "compute_dtype": low or "float32", "master_dtype": "float32",
            "grad_reduce_dtype": "float32" if low is None or opts.grad_reduce == "fp32" else low}
