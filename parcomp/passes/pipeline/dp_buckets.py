"""The data-parallel gradient buckets of a pipelined step (``bucket_cap_mb``).

After a stage's microbatches each rank of it holds the sums of its parameter gradients over
its microbatches; the dp replicas of the stage then sum them (``all_reduce``, or with
``zero=1`` a ``reduce_scatter`` of the gradients the state split divides). As torch's
DistributedDataParallel, the runtime (``pipeline_main``) does that in buckets: flat buffers of
at most ``bucket_cap_mb`` MiB (DDP's name and default 25; ``0``: one call per gradient), one
collective each, started asynchronously inside the backward of the last microbatch that adds
to its gradients (the rank's last ``backward`` / ZB-H1 ``backward_weight`` of the stages
holding them) as soon as the last of them is final: the stage's parameter-gradient program
hands each gradient to ``ready(name, value)`` on the line after the statement computing it
(DDP's per-gradient hooks), so the first buckets' reductions overlap the rest of that backward
(the layers before theirs), then the rest of the schedule (the last gradient sends, the drain
of the other chunks, the stats program); the optimizer action waits for them.

:func:`dp_buckets` chooses the buckets, per pp coordinate: gradients held by the same stages
of the rank, reduced the same way and of one dtype share a bucket, filled in the order the
stage's parameter-gradient program makes them final (DDP's: the order a backward produces
them) up to the cap. A tied weight's gradient, summed over its stages' ranks before dp, is not
bucketed (the runtime reduces it after that sum, at the optimizer).
"""
from __future__ import annotations

__all__ = ["dp_buckets"]


def _grads(plan, t) -> dict:
    """``{param: local type of its gradient}`` on one rank of virtual stage ``t``, in the order
    the stage's parameter-gradient program (``backward``, ZB-H1's ``backward_weight``) makes
    them final: the outputs (this rank's tp shard; whole over dp) by the position of the node
    computing each."""
    st = plan.stages[t]
    bw = plan.split[t].backward_weight if plan.split else (plan.local[t].backward if plan.local else st.backward)
    at = {n.name: i for i, n in enumerate(bw.nodes)}
    outs = dict(bw.named_outputs())
    mine = [p for p in st.params if f"grad.{p}" in outs]
    return {p: bw[outs[f"grad.{p}"]].type for p in sorted(mine, key=lambda p: at[outs[f"grad.{p}"]])}


def _split_over_dp(plan, t, p) -> bool:
    """Whether ``zero=1`` splits param ``p``'s gradient over dp on virtual stage ``t``."""
    local = plan.local[t] if plan.local else None
    if local is None or not local.axes:
        return False
    return any(a == "dp" and hasattr(q, "dim") for a, q in zip(local.axes, local.layouts[f"grad.{p}"]))


def dp_buckets(plan, cap_bytes: int) -> tuple:
    """Per pp coordinate of ``plan`` (a :class:`~.pipeline_plan.PipelinePlan` with dp > 1), its
    buckets: ``((stages, kind, (grad name, ...)), ...)``, ``stages`` the rank's virtual stages
    holding the gradients (the bucket starts after the last backward of them), ``kind``
    ``"all_reduce"`` or ``"reduce_scatter"`` (``zero=1``); () when dp is 1."""
    if plan.dp < 2:
        return ()
    tied = {p for p, held in plan.tied if len({plan.rank_of_stage(t) for t in held}) > 1}
    out = []
    for r in range(plan.pp):
        chunks = list(range(r, len(plan.stages), plan.pp))
        holders, types, order = {}, {}, []
        for t in chunks:
            made = _grads(plan, t)
            types.update(made)
            for p in made:
                if p in tied:
                    continue
                if p not in holders:
                    order.append(p)
                holders.setdefault(p, []).append(t)
        groups = {}
        for p in order:
            kind = "reduce_scatter" if _split_over_dp(plan, holders[p][0], p) else "all_reduce"
            groups.setdefault((tuple(holders[p]), kind, types[p].dtype), []).append(p)
        buckets = []
        for (stages, kind, _), names in groups.items():
            current, size = [], 0
            for p in names:
                nbytes = types[p].nbytes
                if current and size + nbytes > cap_bytes:
                    buckets.append((stages, kind, tuple(current)))
                    current, size = [], 0
                current.append(f"grad.{p}")
                size += nbytes
            if current:
                buckets.append((stages, kind, tuple(current)))
        out.append(tuple(buckets))
    return tuple(out)
