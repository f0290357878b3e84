"""DTensor's own words as a parcomp spec: a ``parallelize_module`` plan dict and its mesh.

    plan = {"layers.*.attention.wq": ColwiseParallel(), "layers.*.attention.wo": RowwiseParallel(), ...}
    parcomp.parallelize(model, example, (plan, device_mesh))

Each entry becomes layout rules on the parameters of the modules its key names (keys are module
paths; ``*`` matches one path part, as in torch's plan keys):

- ``ColwiseParallel`` on an ``nn.Linear`` (weight ``[out, in]``): the weight split on dim 0, the
  bias with it; on transformers' ``Conv1D`` (weight ``[in, out]``): dim 1 and the bias; on an
  ``nn.Embedding``: the embedding dim (dim 1).
- ``RowwiseParallel``: ``nn.Linear`` weight split on dim 1 (``Conv1D``: dim 0), bias replicated
  (added once after the sum); ``nn.Embedding``: the vocab rows (dim 0).
- ``SequenceParallel`` (on norms), or ``input_layouts=Shard(1)`` / ``output_layouts=Shard(1)`` on
  the linear styles: parcomp's ``sequence-parallel`` statement (every norm on split-seq
  activations, an all_gather before and a reduce_scatter after each tensor-parallel region).
- ``PrepareModuleInput`` / ``PrepareModuleOutput`` on the root (key ``""``), and a style's
  ``output_layouts`` on the module that makes the model's output: the inputs' and outputs'
  layouts. Elsewhere they only move the boundaries parcomp's search places itself.

- ``loss_parallel`` (the key ``"loss_parallel": True``, or torch's ``loss_parallel`` function as
  a value): the model's first output (the logits) stays split over its last dim
  (``Shard(-1)`` over ``tp``, unless a style's ``output_layouts`` says otherwise), and
  ``ParallelModule.cross_entropy`` computes the loss without gathering it (:mod:`.loss`).

The mesh is a ``DeviceMesh`` (its dim names; a 1-D mesh without names is ``tp``) or a dict
``{"tp": 2}`` / ``{"dp": 2, "tp": 2}``. The plan applies over ``tp`` (the only axis, or the
one named ``tp``); a ``dp`` axis splits the inputs' batch (dim 0), as FSDP/DDP over the rest of
a 2-D mesh does. parcomp's search still decides where each collective goes and checks the
result, so a plan that would make DTensor communicate more than needed gets parcomp's minimum:
``parcomp.explain`` shows what runs.
"""
from __future__ import annotations

import fnmatch
import re

from ..errors import ParcompError
from ..spec import parse_spec

#: what the translated spec's messages say it came from
ORIGIN = "<DTensor plan>"


def mesh_axes(mesh) -> dict:
    """``{axis: size}`` of a DeviceMesh or a dict."""
    if isinstance(mesh, dict):
        return {str(k): int(v) for k, v in mesh.items()}
    if isinstance(mesh, int):
        return {"tp": mesh}
    names = getattr(mesh, "mesh_dim_names", None)
    shape = tuple(mesh.mesh.shape) if hasattr(mesh, "mesh") else None
    if shape is None:
        raise ParcompError(f"the plan's mesh must be a DeviceMesh or a dict {{axis: size}}; got "
                           f"{type(mesh).__name__}")
    if not names:
        if len(shape) != 1:
            raise ParcompError("a DeviceMesh of several dims needs mesh_dim_names (such as ('dp', 'tp'))")
        names = ("tp",)
    return dict(zip(names, shape))


def _kind(style) -> str:
    return type(style).__name__


def _placements(layouts):
    if layouts is None:
        return ()
    return tuple(layouts) if isinstance(layouts, (tuple, list)) else (layouts,)


def _is_seq_shard(p) -> bool:
    return type(p).__name__ in ("Shard", "_StridedShard") and getattr(p, "dim", None) == 1


def _layout(placement, tp_axis, axes, batch=False, rank=None) -> str:
    """A full parcomp layout: ``placement`` on ``tp_axis``, S(0) on ``dp`` when ``batch``."""
    out = []
    for a in axes:
        if a == tp_axis:
            kind = type(placement).__name__ if placement is not None else "Replicate"
            if kind == "Replicate":
                out.append("R")
            elif kind in ("Shard", "_StridedShard"):
                d = placement.dim
                if d < 0:
                    if rank is None:
                        raise ParcompError(f"Shard({d}) needs the tensor's rank")
                    d += rank
                out.append(f"S({d})")
            elif kind == "Partial":
                out.append("P")
            else:
                raise ParcompError(f"placement {placement!r} has no parcomp layout")
        else:
            out.append("S(0)" if batch and a == "dp" else "R")
    return "[" + ", ".join(out) + "]"


def plan_spec(plan, module=None, graph=None, mesh=None, train: str | None = None):
    """A parsed :class:`parcomp.spec.Spec` from a DTensor plan.

    Args:
        plan: ``(plan dict, mesh)``, or the dict with ``mesh=``.
        module: the model the keys name (its module types decide which dim a style splits).
        graph: the imported model (its input and output names and ranks), or None.
        train: a ``train ...`` line to add (DTensor's plan has none).

    Raises:
        ParcompError: a key that names no module, a style parcomp has no translation of, a
            module type a style does not apply to.
    """
    if isinstance(plan, tuple):
        plan, mesh = plan if isinstance(plan[0], dict) else plan[::-1]
    if mesh is None:
        raise ParcompError("a DTensor plan needs its mesh: pass (plan, device_mesh) or (plan, {'tp': 2})")
    if module is None:
        raise ParcompError("translating a DTensor plan needs the module its keys name")
    return parse_spec(plan_text(plan, mesh_axes(mesh), module, graph, train), ORIGIN)


def plan_text(plan: dict, mesh: dict, module, graph=None, train: str | None = None) -> str:
    """The ``.pcs`` text of a DTensor plan (see the module docstring)."""
    axes = list(mesh)
    tp = "tp" if "tp" in mesh else axes[-1]
    modules = dict(module.named_modules())
    lines = ["mesh " + " ".join(f"{a}={s}" for a, s in mesh.items())]
    seq_parallel = False
    inputs, outputs = {}, {}
    loss_parallel = False
    for key, style in plan.items():
        kind = _kind(style)
        if is_loss_parallel(key, style):
            loss_parallel = True
            continue
        if key == "" and kind in ("PrepareModuleInput", "PrepareModuleInputOutput"):
            for i, p in enumerate(_placements(getattr(style, "desired_input_layouts", None))):
                if p is not None:
                    inputs[i] = p
            continue
        if key == "" and kind == "PrepareModuleOutput":
            for i, p in enumerate(_placements(getattr(style, "desired_output_layouts", None))):
                outputs[i] = p
            continue
        names = [n for n in modules if n and (n == key or _matches(key, n))]
        if not names:
            raise ParcompError(f"plan key {key!r} names no module of {type(module).__name__}", where=key)
        if kind == "SequenceParallel":
            seq_parallel = True
            continue
        if kind in ("PrepareModuleInput", "PrepareModuleOutput", "PrepareModuleInputOutput"):
            continue  # inside the model: parcomp's search places these boundaries
        if kind not in ("ColwiseParallel", "RowwiseParallel"):
            raise ParcompError(f"plan key {key!r}: {kind} has no parcomp translation (parcomp reads "
                               f"ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput/Output)",
                               where=key)
        if any(_is_seq_shard(p) for p in _placements(getattr(style, "input_layouts", None))
               + _placements(getattr(style, "output_layouts", None))):
            seq_parallel = True
        first = names[0]
        pattern = key if "*" in key else first
        lines += _param_rules(kind, type(modules[first]).__name__, pattern, modules[first], tp, axes, key)
        last = _output_module(module)
        if last is not None and any(n == last for n in names):
            outs = _placements(getattr(style, "output_layouts", None))
            if outs:
                outputs.setdefault(0, outs[0])
    if seq_parallel:
        lines.append(f"sequence-parallel over {tp}" if len(axes) > 1 else "sequence-parallel")
    if loss_parallel:  # the logits stay split over the vocabulary (the last dim)
        from torch.distributed.tensor import Shard

        outputs.setdefault(0, Shard(-1))
    if graph is not None:
        for i, n in enumerate(graph.inputs):
            if i in inputs or "dp" in mesh:
                lines.append(f"input {n.name} {_layout(inputs.get(i), tp, axes, batch='dp' in mesh, rank=n.type.rank)}")
        for i, (pub, v) in enumerate(graph.named_outputs()):
            if i in outputs or "dp" in mesh:
                lines.append(f"output {_quote(pub)} "
                             f"{_layout(outputs.get(i), tp, axes, batch='dp' in mesh, rank=graph[v].type.rank)}")
    if train:
        lines.append(train.strip())
    return "\n".join(lines) + "\n"


def is_loss_parallel(key, style) -> bool:
    """A plan entry asking for DTensor's ``loss_parallel``: the key ``"loss_parallel"`` (value
    True or the ``loss_parallel`` function), or the function itself as a value."""
    named = getattr(style, "__name__", None) == "loss_parallel"
    if key == "loss_parallel":
        if style is True or named:
            return True
        raise ParcompError(f"plan key 'loss_parallel': give True or "
                           f"torch.distributed.tensor.parallel.loss_parallel; got {style!r}", where=key)
    return named


def plan_asks_loss_parallel(plan: dict) -> bool:
    """Whether the plan dict has a ``loss_parallel`` entry."""
    return any(is_loss_parallel(k, v) for k, v in plan.items())


def _quote(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_][\w.]*", name) else f'"{name}"'


def _matches(key: str, name: str) -> bool:
    """torch's plan-key match: ``*`` within one path part (``layers.*.attention``)."""
    if "*" not in key:
        return False
    return len(key.split(".")) == len(name.split(".")) and fnmatch.fnmatchcase(name, key)


def _output_module(module):
    """The path of the module that computes the model's output, when it is the last child
    (``lm_head``, ``output``), else None."""
    children = list(module.named_children())
    return children[-1][0] if children else None


def _param_rules(kind, mtype, pattern, mod, tp, axes, key) -> list:
    """The layout rules of one plan entry's parameters."""
    col = kind == "ColwiseParallel"
    if mtype == "Linear":
        wdim, bias_split = (0, True) if col else (1, False)
    elif mtype == "Conv1D":  # transformers' GPT-2 Conv1D: weight [in, out]
        wdim, bias_split = (1, True) if col else (0, False)
    elif mtype == "Embedding":
        wdim, bias_split = (1, False) if col else (0, False)
    else:
        raise ParcompError(f"plan key {key!r}: {kind} on a {mtype}; parcomp translates it on nn.Linear, "
                           f"nn.Embedding and transformers' Conv1D", where=key)

    def lay(d):
        return "[" + ", ".join(f"S({d})" if a == tp else "R" for a in axes) + "]"

    out = [f"{pattern}.weight {lay(wdim)}"]
    if bias_split and getattr(mod, "bias", None) is not None:
        out.append(f"{pattern}.bias {lay(0)}")
    return out
