"""The compile report: every collective, why it is there, and what it costs.

``report.json`` is this dict.  Bytes are bytes sent per rank by a ring
algorithm (:func:`parcomp.redistribute.step_bytes`); shapes are per-rank.
"""
from __future__ import annotations

from .ir.ops import COLLECTIVES
from .ir.types import layout_str
from .redistribute import Step, step_bytes


PHASES = (("bw.", "backward"), ("opt.", "optimizer"))


def phase_of(value: str) -> str:
    """forward | backward | optimizer, from the autodiff naming convention."""
    return next((ph for prefix, ph in PHASES if value.startswith(prefix)), "forward")


def collective_records(sharded, program) -> list:
    """One dict per collective node of ``sharded`` (global) / ``program`` (local), in order."""
    users = sharded.users()
    outs = {v: p for p, v in sharded.named_outputs()}
    recs = []
    for n in sharded.nodes:
        if n.op not in COLLECTIVES:
            continue
        src = sharded[n.inputs[0]]
        a = sharded.mesh.names.index(n.attr("axis"))
        step = Step(n.op, a, n.attr("dim"), n.attr("src_dim"), src.layout, n.layout)
        consumers = [f"{sharded[u].op} %{u}" for u in users[n.name]]
        if n.name in outs:
            consumers.append(f"output {outs[n.name]}")
        recs.append({
            "name": n.name, "kind": n.op, "axis": n.attr("axis"), "dim": n.attr("dim"),
            "dtype": n.type.dtype, "local_shape": list(program[src.name].type.shape),
            "from": layout_str(src.layout), "to": layout_str(n.layout),
            "bytes": step_bytes(step, n.type, sharded.mesh), "phase": phase_of(src.name),
            "producer": src.name, "consumers": consumers, "reason": n.attr("reason"),
        })
    return recs


def memory(program, model_params) -> dict:
    """Per-rank bytes: weights, gradients, optimizer state, saved activations, peak live.

    Saved activations are forward values (not params) that a backward op reads:
    what autograd would keep alive between forward and backward. ``peak_live`` is the
    most bytes live at once while the (lowered) program runs, by the liveness the
    interpreter and program.py's ``del`` lines follow (:func:`parcomp.passes.lower.peak_bytes`).
    """
    from .passes.lower import peak_bytes

    users = program.users()
    grads = {v for p, v in program.named_outputs() if p.endswith(".grad") and p[:-5] in model_params}

    def nbytes(names):
        return int(sum(program[n].type.nbytes for n in set(names)))

    saved = [n.name for n in program.nodes
             if n.op not in ("input", "param") and phase_of(n.name) == "forward"
             and any(phase_of(u) == "backward" for u in users[n.name])]
    saved += [n.name for n in program.inputs if any(phase_of(u) == "backward" for u in users[n.name])]
    return {"weights": nbytes(p for p in model_params if p in program),
            "gradients": nbytes(grads),
            "optimizer_state": nbytes(n.name for n in program.params if n.name not in model_params),
            "saved_activations": nbytes(saved), "peak_live": peak_bytes(program)}


def training_summary(spec, program) -> dict | None:
    """Loss, optimizer and batch arithmetic: global batch = microbatch x dp."""
    if getattr(spec, "train", None) is None:
        return None
    from .passes.train_config import train_config

    cfg = train_config(spec)
    dp = spec.mesh.sizes[spec.mesh.axis_index("dp")] if "dp" in spec.mesh.names else 1
    batch = cfg.batch or next((n.attr("global_shape")[0] for n in program.inputs
                               if n.attr("global_shape")), None)
    return {"loss": cfg.loss, "optimizer": cfg.optimizer, "hyperparameters": dict(cfg.hyper),
            "zero": cfg.zero, "steps": cfg.steps, "dp": dp, "global_batch": batch,
            "microbatch_per_dp_rank": None if batch is None else batch // dp,
            "batch_note": f"global batch {batch} = microbatch {None if batch is None else batch // dp}"
                          f" x dp {dp}"}


def build_report(sharded, program, spec, model_params=()) -> dict:
    """The whole report: mesh, collectives, per-axis totals, memory, training."""
    recs = collective_records(sharded, program)
    totals = {}
    for r in recs:
        t = totals.setdefault(r["axis"], {"count": 0, "bytes": 0})
        t["count"] += 1
        t["bytes"] += r["bytes"]
    return {
        "mesh": dict(sharded.mesh.axes),
        "world_size": sharded.mesh.size,
        "spec": getattr(spec, "file", None),
        "collectives": recs,
        "totals_per_axis": totals,
        "memory_bytes_per_rank": memory(program, set(model_params)),
        "training": training_summary(spec, program),
    }


_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(n) -> str:
    """A byte count for people: ``"512 B"``, ``"1.5 MiB"``, ``"7.3 TiB"``.

    Below 1024 the exact count in B; above, one decimal in the largest binary
    unit (KiB = 1024 B ... TiB) whose value is below 1024 after rounding, so
    1048575 B is ``"1.0 MiB"``, never ``"1024.0 KiB"``.  TiB is the largest unit.

    Raises:
        ValueError: ``n`` is negative.
    """
    n = int(n)
    if n < 0:
        raise ValueError(f"a byte count is never negative; got {n}")
    if n < 1024:
        return f"{n} B"
    for power, unit in enumerate(_UNITS[1:], start=1):
        value = round(n / 1024 ** power, 1)
        if value < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def plural(count: int, word: str, many: str | None = None) -> str:
    """``"1 rank"``, ``"2 ranks"``: a count with its noun in the right number."""
    return f"{count} {word if count == 1 else many or word + 's'}"


def format_collectives(recs) -> str:
    """A plain-text table of collectives, one row each, then the reasons (bytes in human units)."""
    if not recs:
        return "collectives: none"
    head = ("#", "kind", "axis", "dim", "local shape", "bytes/rank", "phase", "value")
    rows = [(str(i), r["kind"], r["axis"], "-" if r["dim"] is None else str(r["dim"]),
             "x".join(map(str, r["local_shape"])), format_bytes(r["bytes"]), r["phase"], r["producer"])
            for i, r in enumerate(recs)]
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]
    lines = [f"collectives: {len(recs)}", "  ".join(h.ljust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines += [f"  [{i}] why: {r['reason']}" for i, r in enumerate(recs)]
    return "\n".join(lines)


def format_memory(report) -> str:
    """One line of per-rank memory in human units (:func:`format_bytes`), plus the batch
    arithmetic when training."""
    m = report["memory_bytes_per_rank"]
    line = "memory per rank: " + ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in m.items())
    if report.get("training"):
        line += "\n" + report["training"]["batch_note"]
    return line
