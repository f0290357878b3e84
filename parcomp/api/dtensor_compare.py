"""Where a DTensor plan would communicate more than parcomp's program of the same plan.

``parcomp.explain(module, example, (plan, mesh))`` compiles the plan's translation
(:mod:`.dtensor_plan`) and, beside parcomp's collectives, *runs DTensor itself* on the plan:
``parallelize_module`` on a copy of the module over a 1-D ``tp`` DeviceMesh of a fake process
group (torch's ``fake`` backend: every collective is issued, none moves data, so one process
stands for the whole ``tp`` world), the example inputs forward, and (when the spec trains) a
backward of the sum of the outputs. Every functional collective DTensor issues is counted (a
``TorchDispatchMode``), by phase and by block: the modules a plan key's ``*`` names
(``model.layers.*`` -> ``model.layers.0``, ``model.layers.1``), found by module hooks (forward)
and full backward hooks (backward). parcomp's collectives over ``tp`` are counted the same way
from its explanation, one per call the program makes (a gradient bucket's members after its
first are steps of 0 bytes there, carried by the bucket's one all_reduce: not counted). The result says, per block and phase, which collective DTensor issues more
often than parcomp (DTensor's ``ColwiseParallel`` reduces the gradient of each projection's
input by itself: q, k and v three all_reduces where parcomp's program sums them first and
reduces once).

*Why run DTensor rather than derive its collectives from the placements:* what DTensor issues
depends on its sharding propagation and on each style's hooks (``use_local_output``, input
redistribution, the gradients' placements), which change between torch releases; counting what
it does is exact for the installed torch. A fake process group needs none of its own: the count
runs only when ``torch.distributed`` is not initialised in this process (otherwise the result
says so and counts nothing).
"""
from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass

from .dtensor_plan import is_loss_parallel

#: DTensor's functional collectives -> parcomp's collective names
KINDS = {"all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
         "all_gather_into_tensor_out": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
         "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast"}
#: what a collective outside every block is counted under
OUTSIDE = "(outside the blocks)"


@dataclass(frozen=True)
class BlockCollectives:
    """How many ``kind`` collectives over the plan's axis one block issues in ``phase``, under
    DTensor and under parcomp's program."""

    block: str
    phase: str
    kind: str
    dtensor: int
    parcomp: int


@dataclass(frozen=True)
class DTensorComparison:
    """DTensor's collectives on a plan against parcomp's, per block (see the module docstring).

    Attributes:
        axis: the mesh axis the plan applies over (``tp``).
        blocks: the blocks in model order (the module paths a plan key's ``*`` names).
        counts: every (block, phase, kind) either side issues (:class:`BlockCollectives`).
        ran: DTensor ran the plan; when False, ``why`` says why and ``counts`` is empty.
        why: the reason DTensor did not run, or "".
    """

    axis: str
    blocks: tuple
    counts: tuple
    ran: bool
    why: str = ""

    @property
    def more(self) -> tuple:
        """The counts where DTensor's plan issues more collectives than parcomp's program."""
        return tuple(c for c in self.counts if c.dtensor > c.parcomp)

    def per_block(self, phase: str | None = None, kind: str | None = None, side: str = "dtensor") -> dict:
        """``{block: count}`` of ``side`` (``"dtensor"`` or ``"parcomp"``), of ``kind`` in ``phase``."""
        out = {b: 0 for b in self.blocks}
        for c in self.counts:
            if (phase is None or c.phase == phase) and (kind is None or c.kind == kind):
                out[c.block] = out.get(c.block, 0) + getattr(c, side)
        return out

    def lines(self) -> list:
        """The comparison as text, one line per (block pattern, phase, kind) where DTensor issues
        more (blocks with the same counts folded into one line), or one line saying none does."""
        if not self.ran:
            return [f"DTensor's plan: not run ({self.why})"]
        if not self.more:
            return [f"DTensor's plan issues no more collectives over {self.axis} than parcomp's program"]
        folded = {}
        for c in self.more:
            key = (_pattern(c.block), c.phase, c.kind, c.dtensor, c.parcomp)
            folded.setdefault(key, []).append(c.block)
        out = []
        for (pattern, phase, kind, dt, pc), blocks in folded.items():
            where = pattern if len(blocks) > 1 else blocks[0]
            each = " each" if len(blocks) > 1 else ""
            out.append(f"DTensor's plan issues more: {where} ({len(blocks)} block{'s' if len(blocks) > 1 else ''}), "
                       f"{phase}: {dt} {kind} over {self.axis}{each} where parcomp's program issues {pc}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _pattern(block: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".*", block)


def block_regex(plan: dict) -> re.Pattern | None:
    """The module paths a plan's ``*`` keys repeat over: ``model.layers.*.mlp`` -> the regex of
    ``model.layers.<part>``; None when no key has a ``*`` (the whole model is one block)."""
    pats = []
    for key in plan:
        parts = key.split(".")
        if "*" not in parts and not any("*" in p for p in parts):
            continue
        i = next(i for i, p in enumerate(parts) if "*" in p)
        pats.append(r"\.".join(re.escape(p).replace(r"\*", r"[^.]+") for p in parts[:i + 1]))
    if not pats:
        return None
    return re.compile("^(" + "|".join(sorted(set(pats))) + r")(?=\.|$|\s)")


def block_of(path: str | None, regex) -> str:
    """The block a module path belongs to (``model.layers.0.mlp.up_proj`` -> ``model.layers.0``)."""
    if regex is None:
        return "(model)"
    m = regex.match(path or "")
    return m.group(1) if m else OUTSIDE


def parcomp_counts(explanation, axis: str, regex) -> Counter:
    """``{(block, phase, kind): n}`` of parcomp's collectives over ``axis`` that the program
    runs: a step of 0 bytes is a member of a bucket whose first member's all_reduce carries it
    (``explain`` lists it, priced at nothing), so it is not counted; DTensor's side counts the
    calls it issues, so both sides count calls."""
    out = Counter()
    for change in explanation.changes:
        for s in change.steps:
            if s.axis == axis and s.bytes > 0:
                out[(block_of(change.module, regex), s.phase, s.kind)] += 1
    return out


def dtensor_counts(module, example_inputs, plan: dict, size: int, regex, backward: bool) -> Counter:
    """``{(block, phase, kind): n}`` of the collectives DTensor issues running ``plan`` on a copy
    of ``module`` over a ``tp`` mesh of ``size`` fake ranks (see the module docstring).

    Raises:
        RuntimeError: torch.distributed is initialised in this process.
        Exception: whatever DTensor raises on the plan (the caller reports it).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is initialised in this process; DTensor's collectives are "
                           "counted on a fake process group of their own: call explain before "
                           "init_process_group (or in a process of its own)")
    state = {"phase": "forward", "stack": []}
    seen = Counter()

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace in ("_c10d_functional", "c10d_functional", "c10d") and func._opname in KINDS:
                block = state["stack"][-1] if state["stack"] else (OUTSIDE if regex is not None else "(model)")
                seen[(block, state["phase"], KINDS[func._opname])] += 1
            return func(*args, **(kwargs or {}))

    dist.init_process_group("fake", rank=0, world_size=size, store=FakeStore())
    try:
        mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
        styles = {k: v for k, v in plan.items() if not is_loss_parallel(k, v)}  # a loss choice, no module
        model = parallelize_module(copy.deepcopy(module), mesh, styles)
        hooks = []
        for name, mod in model.named_modules():
            if regex is None or not name or block_of(name, regex) != name:
                continue
            hooks.append(mod.register_forward_pre_hook(_enter(state, name, backward), with_kwargs=True))
            hooks.append(mod.register_forward_hook(_leave(state, name, backward)))
        with Count():
            out = model(*example_inputs)
            if backward:
                total = None
                for t in _tensors(out):
                    if t.is_floating_point() and t.requires_grad:
                        local = (t.to_local() if isinstance(t, DTensor) else t).float().sum()
                        total = local if total is None else total + local
                state["phase"], state["stack"] = "backward", []
                if total is not None:
                    total.backward()
        for h in hooks:
            h.remove()
    finally:
        dist.destroy_process_group()
    return seen


def _enter(state, name, backward):
    """A forward pre-hook: ``name`` is the block now (forward); in backward, the gradient of the
    block's input ends the block's backward (the block is left, unless a later block's output
    gradient, computed at the same moment, already named that block)."""
    def hook(module, args, kwargs):
        state["stack"].append(name)
        if backward:
            for t in _tensors((args, kwargs))[:1]:
                if t.requires_grad:
                    t.register_hook(lambda g: _set(state, OUTSIDE, only_if=name))
    return hook


def _leave(state, name, backward):
    """A forward hook: the block is left (forward); in backward, the gradient of the block's
    output starts the block's backward."""
    def hook(module, args, out):
        state["stack"].pop()
        if backward:
            for t in [t for t in _tensors(out) if t.is_floating_point() and t.requires_grad][:1]:
                t.register_hook(lambda g: _set(state, name))
    return hook


def _set(state, name, only_if=None):
    if state["phase"] == "backward" and (only_if is None or state["stack"][-1:] == [only_if]):
        state["stack"] = [name]


def _tensors(out):
    import torch

    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict) or hasattr(out, "values") and hasattr(out, "keys"):
        return [t for v in out.values() for t in _tensors(v)]
    if isinstance(out, (tuple, list)):
        return [t for v in out for t in _tensors(v)]
    return []


def compare(module, example_inputs, plan: dict, mesh: dict, explanation) -> DTensorComparison:
    """DTensor's collectives on ``plan`` against parcomp's ``explanation`` of its translation."""
    axis = "tp" if "tp" in mesh else list(mesh)[-1]
    regex = block_regex(plan)
    ours = parcomp_counts(explanation, axis, regex)
    blocks = sorted({b for b, _, _ in ours} - {OUTSIDE}, key=_natural)
    try:
        theirs = dtensor_counts(module, example_inputs, plan, mesh[axis], regex, explanation.training)
    except Exception as e:  # noqa: BLE001 - DTensor refusing the plan is a finding, not a failure of explain
        return DTensorComparison(axis, tuple(blocks), (), False, f"{type(e).__name__}: {e}")
    blocks = sorted(set(blocks) | {b for b, _, _ in theirs} - {OUTSIDE}, key=_natural)
    keys = sorted(set(ours) | set(theirs), key=lambda k: (_natural(k[0]), k[1] != "forward", k[2]))
    counts = tuple(BlockCollectives(b, p, k, theirs.get((b, p, k), 0), ours.get((b, p, k), 0)) for b, p, k in keys)
    return DTensorComparison(axis, tuple(blocks), counts, True)


def _natural(name: str):
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]
