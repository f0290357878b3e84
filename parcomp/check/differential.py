"""How ``parcomp check`` decides: a differential comparison, scale-relative (docs/design/check.md,
"How check decides").

The sharded Program (every rank on the numpy interpreter) and the unsharded graph run in
float64 from the same state; every value the program carries (outputs, loss, gradients,
parameters, optimizer state) is compared elementwise with a tolerance relative to the value's
scale:

    |got - want| <= rtol * scale,   scale = max(row scale, ROW_FLOOR * value scale,
                                                GROUP_FLOOR * group scale)

where the value scale is max |want| over the value, the row scale max |want| over its last
dim (rows of one value may differ in scale by orders of magnitude: an error confined to a
row of small elements must still show), and the group scale the largest value scale among
the values of the same kind of one module (its parameters' gradients, their ``exp_avg``,
...: :func:`group_of`): a value that is zero up to rounding (the gradient of a key bias,
which softmax cancels) is compared at the scale of its module's, not at the scale of its
own rounding, while a deep layer's small gradients keep their own scale.

``rtol`` is :data:`THRESHOLD` for float64 runs: correct programs stay below it by a wide
margin (their differences are rounding, ~1e-12 of the scale at most), a sharding bug
(a collective off by 1e-6, a dropped partial sum, a missing all_gather) shows far above it.
Comparisons made in a narrower dtype (``parcomp run``: float32 torch on real ranks against
the unsharded torch run; ``check`` against torch.optim) use :data:`DTYPE_TOLERANCE` of that
dtype, each value's scale at least GROUP_FLOOR of the largest of its kind across modules and
the tolerance at least the dtype's smallest normal number: a sanity check, while the
sharding itself is proven by the float64 check of the same Program.

Non-finite values must match exactly (same NaN positions, same infinities with the same
sign), and then pass: a skipped fp16 step is right when both sides skip it. Integer and bool
values (argmax, routing indices, labels) compare exactly. A discrete choice made on a near
tie (two candidates of an ``argmax`` or a top-k routing within the tolerance of each other)
can flip between two correct computations; when a comparison fails and the reference made
such a choice, the verdict is CANNOT VOUCH, naming the element (:func:`near_ties`).
"""
from __future__ import annotations

import numpy as np

#: scale-relative tolerance of a float64 differential comparison (docs/design/check.md, "How check
#: decides": the noise floor of every shipped spec and the smallest injected error it catches)
THRESHOLD = 1e-9
#: scale-relative tolerance of a comparison computed in a narrower dtype (``run``, torch.optim)
DTYPE_TOLERANCE = {"float64": THRESHOLD, "float32": 1e-3, "float16": 2e-2, "bfloat16": 1e-1}
#: a row's scale is at least this fraction of its value's scale
ROW_FLOOR = 1e-3
#: a value's scale is at least this fraction of the largest scale of its group (:func:`group_of`;
#: in a narrower dtype also of its kind, :func:`kind_of`)
GROUP_FLOOR = 1e-3
#: the suffixes that name a value's kind (a parameter's gradient, its optimizer state)
KIND_SUFFIXES = (".grad", ".momentum_buffer", ".exp_avg_sq", ".exp_avg")


def tolerance_for(dtype) -> float:
    """The scale-relative tolerance of a comparison computed in ``dtype`` (float64 by default)."""
    name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
    return DTYPE_TOLERANCE.get(name, THRESHOLD)


def group_of(key: str) -> str:
    """The group of a carried value: a module's gradients (``attn.k_proj.weight.grad`` and
    ``attn.k_proj.bias.grad``: ``attn.k_proj`` + ``.grad``), likewise each optimizer state
    (``.exp_avg``, ...); any other value (the loss, a parameter, a model output) is its own
    group. The gradient of a key bias is zero up to rounding (softmax cancels it); the
    gradient of its weight sums the same terms times the layer's inputs and has their scale."""
    suffix = next((s for s in KIND_SUFFIXES if key.endswith(s)), None)
    if suffix is None:
        return key
    return key[:-len(suffix)].rsplit(".", 1)[0] + suffix


def _f64(x) -> np.ndarray:
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind in "fc" or x.dtype.name == "bfloat16" else x


def _finite_abs(x: np.ndarray) -> np.ndarray:
    return np.where(np.isfinite(x), np.abs(x), 0.0)


def value_scale(want) -> float:
    """max |want| over its finite elements (0 for none)."""
    w = _f64(want)
    return float(_finite_abs(w).max()) if w.size and w.dtype.kind == "f" else 0.0


def element_scale(want, floor: float = 0.0) -> np.ndarray:
    """The scale each element of ``want`` is compared at: its row's (last dim) max |want|,
    at least :data:`ROW_FLOOR` of the value's and ``floor`` (the group's share)."""
    w = _finite_abs(_f64(want))
    vs = float(w.max()) if w.size else 0.0
    rows = w.max(axis=-1, keepdims=True) if w.ndim >= 2 and w.size else np.float64(vs)
    return np.maximum(np.maximum(rows, ROW_FLOOR * vs), floor) * np.ones_like(w)


def _tiny(*arrays) -> float:
    """The smallest normal number of the least precise float dtype among ``arrays`` (0 if none
    is a float): below it a dtype holds no relative precision (subnormals)."""
    out = 0.0
    for a in arrays:
        dt = np.asarray(a).dtype
        if dt.kind == "f" or dt.name == "bfloat16":
            out = max(out, float(np.finfo(dt).tiny))
    return out


def compare(got, want, rtol: float = THRESHOLD, floor: float = 0.0) -> dict:
    """Compare two computations of one value elementwise, scale-relative.

    Allowed per element: ``rtol * element_scale(want, floor)``, and at least the smallest
    normal number of the less precise dtype of the two (a difference among subnormals, the
    vanishing gradients of a deep float32 chain, is no relative difference). Returns ``max_abs_err``
    (over elements where both are finite; inf where the non-finite positions differ),
    ``scale`` (the value's), ``rel_err`` (max error over the element's scale),
    ``tolerance`` (allowed at the worst element), ``err_over_tol`` (``rel_err / rtol``;
    <= 1 passes), ``worst`` (its index), ``nonfinite_mismatch``, ``nonfinite`` (matching
    inf/NaN: they pass), ``ok``, ``why`` (empty when ok) and ``unbounded`` (False: only a
    near tie makes a comparison unable to vouch, :func:`near_ties`).
    """
    tiny = _tiny(got, want)
    g, w = _f64(got), _f64(want)
    if g.shape != w.shape:
        return _result(np.inf, 0.0, np.inf, np.inf, None, 0, 0, f"shape {g.shape} != {w.shape}")
    if w.dtype.kind != "f" or g.dtype.kind != "f":  # ids, indices, masks: exactly
        g, w = g.astype(np.int64), w.astype(np.int64)
        diff = g != w
        worst = tuple(int(i) for i in np.argwhere(diff)[0]) if diff.any() else None
        why = (f"{int(diff.sum())} element(s) differ (integer values compare exactly; {int(g[worst])} != "
               f"{int(w[worst])} at {list(worst)})") if worst is not None else ""
        err = float(np.abs(g - w).max()) if g.size else 0.0
        return _result(err, 0.0, np.inf if why else 0.0, np.inf if why else 0.0, worst, 0, 0, why)
    fin = np.isfinite(g) & np.isfinite(w)
    same = ~fin & ((np.isnan(g) & np.isnan(w)) | (g == w))
    bad = int(np.count_nonzero(~fin & ~same))
    scale = np.maximum(element_scale(w, floor), tiny / rtol if rtol > 0 else 0.0)
    with np.errstate(all="ignore"):
        err = np.where(fin, np.abs(g - w), 0.0)
        rel = np.where(err == 0, 0.0, np.where(scale > 0, err / np.where(scale > 0, scale, 1.0), np.inf))
    at = np.unravel_index(int(np.argmax(rel)), g.shape) if g.size else None
    r = float(rel[at]) if g.size else 0.0
    why = []
    if bad:
        first = tuple(int(i) for i in np.argwhere(~fin & ~same)[0])
        why.append(f"{bad} inf/NaN value(s) where the other side differs (first at {list(first)}: "
                   f"{g[first]!r} vs {w[first]!r})")
    if r > rtol:
        why.append(f"error {float(err[at]):.3e} at {[int(i) for i in at]} is {r:.2e} of the scale "
                   f"{float(scale[at]):.3e} (tolerance {rtol:.0e})")
    max_err = np.inf if bad else (float(err.max()) if g.size else 0.0)
    return _result(max_err, value_scale(w), r, r / rtol if rtol > 0 else (np.inf if r else 0.0),
                   at, bad, int(np.count_nonzero(same)), "; ".join(why),
                   tol=rtol * float(scale[at]) if g.size else 0.0)


def _result(max_err, scale, rel, ratio, worst, bad, nonfinite, why, tol=0.0) -> dict:
    return {"max_abs_err": max_err, "scale": scale, "rel_err": rel, "tolerance": tol, "err_over_tol": ratio,
            "worst": None if worst is None else [int(i) for i in worst], "nonfinite_mismatch": bad,
            "nonfinite": nonfinite, "ok": not why, "why": why, "unbounded": False}


def kind_of(key: str) -> str:
    """The kind of a carried value across modules: ``.grad``, ``.exp_avg``, ... (the suffix), or
    the value itself."""
    return next((s for s in KIND_SUFFIXES if key.endswith(s)), key)


def group_floors(want: dict, keys, narrow: bool = False) -> dict:
    """``{key: floor}``: :data:`GROUP_FLOOR` times the largest value scale of the key's group
    (:func:`group_of`); with ``narrow`` (a comparison in a dtype narrower than float64) at
    least that of its kind across modules (:func:`kind_of`): a deep float32 chain's vanishing
    gradients (1e-30 of the largest, computed through subnormals) have no float32 digits to
    compare, and their sharding is the float64 check's."""
    top = {}
    for k in keys:
        for g in (group_of(k), "kind:" + kind_of(k)):
            top[g] = max(top.get(g, 0.0), value_scale(want[k]))
    return {k: GROUP_FLOOR * max(top[group_of(k)], top["kind:" + kind_of(k)] if narrow else 0.0) for k in keys}


def compare_all(got: dict, want: dict, keys=None, rtol: float = THRESHOLD) -> dict:
    """:func:`compare` over ``keys`` (default: every key of ``want``), each at its group's
    floor (:func:`group_floors`; a comparison within more than :data:`THRESHOLD` is one in a
    narrower dtype), summarised: ``max_abs_err``, ``rel_err`` (max over keys),
    the ``tolerance`` / ``err_over_tol`` / ``worst`` (``"name[i, j]"``) of the key with the
    largest error over tolerance, ``ok``, ``why`` (the failing keys' reasons, the first few)
    and ``per_key``. A key missing from ``got`` is a failure."""
    keys = list(want) if keys is None else list(keys)
    floors = group_floors(want, keys, narrow=rtol > THRESHOLD)
    per = {}
    for k in keys:
        if k not in got:
            per[k] = _result(np.inf, 0.0, np.inf, np.inf, None, 0, 0, "missing")
        else:
            per[k] = compare(got[k], want[k], rtol, floors[k])
    if not per:
        return {"max_abs_err": 0.0, "rel_err": 0.0, "tolerance": 0.0, "err_over_tol": 0.0, "worst": None,
                "ok": True, "why": "", "per_key": per, "unbounded": False, "rtol": rtol}
    top = max(per, key=lambda k: per[k]["err_over_tol"])
    t = per[top]
    where = top + (str(t["worst"]).replace(" ", "") if t["worst"] else "")  # 0-d: the bare name
    return {"max_abs_err": max(p["max_abs_err"] for p in per.values()),
            "rel_err": max(p["rel_err"] for p in per.values()), "tolerance": t["tolerance"],
            "err_over_tol": t["err_over_tol"], "worst": where, "ok": all(p["ok"] for p in per.values()),
            "why": first_reasons([f"{k}: {p['why']}" for k, p in per.items() if p["why"]]), "per_key": per,
            "unbounded": False, "rtol": rtol}


def first_reasons(reasons: list, most: int = 3) -> str:
    """The first ``most`` reasons, one line each, then how many more values failed."""
    more = len(reasons) - most
    return "\n".join(reasons[:most] + ([f"and {more} more value{'s' if more > 1 else ''}"] if more > 0 else []))


# ---- discrete choices: a near tie is the one thing a differential check cannot vouch for ------

def _top_margin(x: np.ndarray, axis: int, k: int):
    """Per position along the other axes: (gap between the k-th and (k+1)-th largest of ``x``
    along ``axis``, the scale of that slice). Non-finite entries (a padded vocab's -inf) do
    not count as candidates."""
    x = np.moveaxis(_f64(x), axis, -1)
    if x.shape[-1] <= k:
        return None, None
    s = -np.sort(-np.where(np.isfinite(x), x, -np.inf), axis=-1)
    gap = s[..., k - 1] - s[..., k]
    gap = np.where(np.isfinite(gap), gap, np.inf)
    return gap, _finite_abs(x).max(axis=-1)


def _choices(node, graph):
    """``(operand, axis, k)`` of a discrete choice ``node`` makes, or None."""
    if node.op in ("argmax", "argmax_key"):
        return node.inputs[0], node.attr("dim"), 1
    if node.op == "moe_route":
        return node.inputs[0], -1, int(node.attr("top_k"))
    if node.op in ("topk", "topk_index"):  # which k are chosen (their order follows their values)
        return node.inputs[0], node.attr("dim"), int(node.attr("k"))
    if node.op == "amax_grad":  # the gradient goes to the maxima: a near tie splits it differently
        dims = node.attr("dims")
        return (node.inputs[1], dims[0], 1) if len(dims) == 1 else None
    return None


def near_ties(graph, env: dict, rtol: float = THRESHOLD, most: int = 3) -> list:
    """Where the reference run ``env`` (``{value: array}`` of every node of ``graph``) made a
    discrete choice on a near tie: an ``argmax`` whose best two candidates, or a top-k routing
    whose k-th and (k+1)-th, are within ``rtol`` of the slice's scale. Returns up to ``most``
    strings ``"%node at [i, j]: candidates 1.2e-17 apart (scale 3.1e-01)"``."""
    out = []
    for n in graph.nodes:
        c = _choices(n, graph)
        if c is None or c[0] not in env:
            continue
        x = np.asarray(env[c[0]])
        if x.dtype.kind != "f" or x.ndim == 0:
            continue
        gap, scale = _top_margin(x, c[1] % x.ndim, c[2])
        if gap is None:
            continue
        tie = gap <= rtol * scale
        for idx in np.argwhere(tie)[: most - len(out)]:
            i = tuple(int(j) for j in idx)
            out.append(f"%{n.name} ({n.op}) at {list(i)}: its candidates are {float(gap[i]):.1e} apart "
                       f"(scale {float(scale[i]):.1e})")
        if len(out) >= most:
            break
    return out


def tie_verdict(result: dict, ties: list) -> dict:
    """``result`` (a failing comparison) made CANNOT VOUCH when the reference chose on a tie."""
    if result["ok"] or not ties:
        return result
    return {**result, "unbounded": True, "ties": ties,
            "why": (f"a discrete choice was made on a near tie, which rounding may flip: {'; '.join(ties)}"
                    f"\n(with it: {result['why']})")}


def verdict(*results) -> str:
    """``OK``, ``CANNOT VOUCH`` (every failure is a comparison whose reference chose on a near
    tie) or ``MISMATCH``, over the comparison results given (None entries skipped)."""
    failed = [r for r in results if r is not None and not r["ok"]]
    if not failed:
        return "OK"
    return "CANNOT VOUCH" if all(r.get("unbounded") for r in failed) else "MISMATCH"


def compare_outputs(got: dict, want: dict, rtol: float = THRESHOLD) -> dict:
    """The verdict of a forward program: :func:`compare_all` over every output of ``want``,
    plus ``output_scale`` (max |want| over them)."""
    res = compare_all(got, want, None, rtol)
    scale = max((value_scale(want[k]) for k in want), default=0.0)
    return {"output_scale": scale, **{k: res[k] for k in ("max_abs_err", "rel_err", "tolerance", "err_over_tol",
                                                          "worst", "ok", "why", "unbounded", "rtol")}}


def least_precise(graph) -> str:
    """The least precise float dtype a graph computes in (``float32`` for most models)."""
    order = ("bfloat16", "float16", "float32", "float64")
    floats = {n.type.dtype for n in graph.nodes if n.type.dtype in order}
    return min(floats, key=order.index, default="float32")
