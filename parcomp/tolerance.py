"""How far two computations of one graph may differ: forward error bounds and the comparison.

Every numerical check (``parcomp check``/``run``, the test suite) goes through
:func:`compare`: the allowed difference per element is

    SAFETY * (bound_a + bound_b)

where ``bound`` is a first-order forward error bound of the computation against
exact arithmetic, propagated through the *global logical graph* with the rule
table :data:`parcomp.rules.error.ERROR_RULES` (Higham, "Accuracy and Stability of
Numerical Algorithms", 2nd ed., ch. 2-3; e.g. a matmul contributes
``gamma_k |A||B|``). The bound holds for every summation order, so one bound
serves the numpy interpreter, the sharded program, torch and any BLAS kernel
(OpenBLAS Haswell vs SkylakeX sum in different orders); comparing two of them
allows twice the bound. ``SAFETY = 2`` covers what first-order analysis drops
(products of errors, library functions a little worse than the ulps charged,
torch writing a formula in a different but equivalent way).

Inf and NaN are never within tolerance: positions where either side is not
finite must match exactly (same NaN positions, same infs with the same sign),
and matching non-finite values still fail unless ``allow_nonfinite=True``: a
check cannot vouch for a result that overflowed. See docs/design.md.
"""
from __future__ import annotations

import numpy as np

from .reference.numpy_attn import source_array
from .resolution import LOOSE_TAIL, RESOLVE, loose_element, loose_reason
from .reference.numpy_ops import NUMPY_OPS
from .reference.training import initial_state
from .rules.error import ERROR_RULES, GRAPH_RULES as _OP_GRAPH_RULES, gamma, unit_roundoff
from .rules.softmax_bounds import SOFTMAX_GRAPH_RULES
from .segment_bounds import refine
from .tied_bounds import refine_detached

# joint rules: AdamW (rules/error.py) and the decomposed softmax family (rules/softmax_bounds.py)
GRAPH_RULES = {**_OP_GRAPH_RULES, **SOFTMAX_GRAPH_RULES}

SAFETY = 2.0
#: the explanation an overflowed bound's reason ends with (said once when several values fail)
OVERFLOW_TAIL = "the worst-case rounding analysis overflowed there, so parcomp cannot vouch for it"


def _f64(x):
    x = np.asarray(x)
    return x.astype(np.float64) if x.dtype.kind in "fc" else x


def propagate(graph, feeds: dict, errors: dict | None = None, refined: bool = True) -> tuple[dict, dict]:
    """Evaluate a global graph (as :func:`run_unsharded`) and bound every value's error.

    ``errors`` maps input/param names to initial error bounds (default 0: a feed is
    exact). Returns ``(values, bounds)``, both ``{value name: array}``; values are
    in the graph's dtypes, bounds float64 arrays of the same shapes. ``refined=False``:
    the op-by-op boxes only, not refined by :func:`refine_bounds` (a check refines only
    when the boxes cannot vouch, docs/design.md).

    Raises KeyError naming a missing feed or an op without an error rule.
    """
    errors = errors or {}
    env, err = {}, {}
    for n in graph.nodes:
        if n.op in ("input", "param"):
            if n.name not in feeds:
                raise KeyError(f"no value given for {n.op} {n.name!r}")
            env[n.name] = source_array(n, feeds[n.name])  # a fused weight's view (issue 17)
            err[n.name] = np.broadcast_to(np.asarray(errors.get(n.name, 0.0), np.float64),
                                          env[n.name].shape)
            continue
        if n.op not in ERROR_RULES:
            raise KeyError(f"op {n.op!r} (%{n.name}) has no error rule in parcomp.rules.error")
        env[n.name], err[n.name] = op_bound(n, [env[i] for i in n.inputs], [err[i] for i in n.inputs])
        if n.op in GRAPH_RULES:
            with np.errstate(all="ignore"):
                e = GRAPH_RULES[n.op](n, graph, env, err, unit_roundoff(n.type.dtype))
            if e is not None:
                err[n.name] = np.broadcast_to(_no_nan(e), np.shape(env[n.name]))
    return env, (refine_bounds(graph, env, err) if refined else err)


def refine_bounds(graph, env, err, needed=None) -> dict:
    """:func:`propagate`'s boxes ``err`` (of the values ``env``) with the backward and the
    forward refined by linear maps between cuts (:func:`parcomp.segment_bounds.refine`,
    :mod:`parcomp.forward_bounds`); ``needed``:
    the value names wanted tighter (None: all), only the cuts they depend on are run.
    A tied weight's late gradient sum is handled by :func:`parcomp.tied_bounds.refine_detached`.
    Returns a new dict, every bound <= the box's."""
    return refine_detached(refine, graph, env, err,
                           lambda n, ops, es: op_bound(n, ops, es, env[n.name])[1],
                           lambda n, es: _graph_rule(n, graph, env, es), needed)


def _graph_rule(node, graph, env, errors):
    """The :data:`GRAPH_RULES` bound of ``node`` (None: none applies), as :func:`propagate` takes it."""
    if node.op not in GRAPH_RULES:
        return None
    with np.errstate(all="ignore"):
        e = GRAPH_RULES[node.op](node, graph, env, errors, unit_roundoff(node.type.dtype))
    return None if e is None else np.broadcast_to(_no_nan(e), np.shape(env[node.name]))


def output_bounds(graph, feeds: dict, errors: dict | None = None) -> dict:
    """``{public output name: error bound}`` of ``graph`` evaluated on ``feeds``."""
    _, err = propagate(graph, feeds, errors)
    return {name: err[v] for name, v in graph.named_outputs()}


def training_bounds(graph, feeds, steps: int, first: int = 1, refined: bool = True) -> dict:
    """Error bounds of ``steps`` training steps, run as :func:`train_steps` runs them.

    ``feeds``: one dict for every step, or a list of one dict per step. Outputs named
    like a ``param`` of ``graph`` (updated params, optimizer state) replace it for the
    next step, with their bounds, so step k's bound includes the error of the state it
    starts from. Returns ``{"losses": [bound per step], "outputs": {public name: bound
    of the last step}, "state": {param name: bound after the last step}}`` (buffers and
    frozen params keep bound 0). ``first``: the number of the first step (AdamW's
    ``step``); a lockstep check bounds one step from a recorded state with ``steps=1``.
    ``refined=False``: the boxes (:func:`propagate`), and ``"refine"``: a function of public
    output names giving ``{public name: bound}`` of the last step refined (:func:`refine_bounds`)
    where those names depend on it (earlier steps' carried bounds stay boxes).
    """
    per_step = feeds if isinstance(feeds, (list, tuple)) else [feeds] * steps
    state = initial_state(graph, per_step[0])
    carried = {n.name for n in graph.params}
    errs = {}
    losses, out, unbounded = [], {}, None
    for k in range(1, steps + 1):
        state.update({key: v for key, v in per_step[k - 1].items() if key not in carried})
        if "step" in graph:
            state["step"] = np.array(float(first + k - 1), graph["step"].type.dtype)
        env, err = propagate(graph, state, errs, refined)
        out = {name: err[v] for name, v in graph.named_outputs()}
        losses.append(float(out["loss"]))
        for name, v in graph.named_outputs():
            if name in carried:
                state[name], errs[name] = env[v], err[v]
        if unbounded is None and not all(np.isfinite(e).all() for e in out.values()):
            unbounded = k
    zeros = {n.name: np.zeros(n.type.shape) for n in graph.params}
    res = {"losses": losses, "outputs": out, "state": {p: errs.get(p, zeros[p]) for p in zeros},
           "unbounded_from": unbounded}
    if not refined:
        res["refine"] = lambda names: _refined_outputs(graph, env, err, names)
    return res


def _refined_outputs(graph, env, err, names) -> dict:
    """``{public output name: bound}`` refined for the outputs ``names``."""
    outs = graph.named_outputs()
    new = refine_bounds(graph, env, err, {v for name, v in outs if name in set(names)})
    return {name: new[v] for name, v in outs}


def spmd_errors(program, run, split_inputs: bool = False) -> list:
    """Per-rank error bounds of a local program as the interpreter ran it.

    ``run`` is the :class:`SPMDRun` of :func:`run_spmd`. Propagates per rank through
    compute ops (local shapes) and layout ops (a reducing collective adds
    ``gamma_{n-1}`` times the summed magnitudes). With ``split_inputs`` (the run used
    ``partial_rng``), a partial-sum input starts with the rounding of its random split
    (:func:`split_bound` of its pieces). Returns ``[{value name: bound}]`` by rank.
    """
    from .reference.interpreter import _LAYOUT_OPS
    from .reference.ranked import at_rank

    mesh = program.mesh
    errs = [{} for _ in range(mesh.size)]
    for n in program.nodes:
        u = unit_roundoff(n.type.dtype)
        if n.op in ("input", "param"):
            for r, e in enumerate(_input_errors(n, run, mesh, split_inputs)):
                errs[r][n.name] = e
        elif n.op in _LAYOUT_OPS:
            for group in mesh.groups(mesh.axes_of(n.attr("axis"))):
                es = _LAYOUT_OPS[n.op]([errs[r][n.inputs[0]] for r in group], n)
                if n.op in ("all_reduce", "reduce_scatter") and n.attr("reduce_op") != "max":  # max: exact
                    mags = _LAYOUT_OPS[n.op]([np.abs(_f64(run.env[r][n.inputs[0]])) for r in group], n)
                    es = [e + gamma(len(group) - 1, u) * m for e, m in zip(es, mags)]
                for r, e in zip(group, es):
                    errs[r][n.name] = np.array(e, np.float64)
        else:
            for r in range(mesh.size):
                errs[r][n.name] = op_bound(at_rank(program, n, r), [run.env[r][i] for i in n.inputs],
                                           [errs[r][i] for i in n.inputs], run.env[r][n.name])[1]
    return errs


def spmd_bounds(program, run, split_inputs: bool = False) -> dict:
    """``{public output name: bound}`` of ``run.outputs(program)`` (see :func:`spmd_errors`)."""
    errs, full = spmd_errors(program, run, split_inputs), run.outputs(program)
    out = {}
    for public, value in program.named_outputs():
        node = program[value]
        out[public] = assemble_bound([e[value] for e in errs], [e[value] for e in run.env], node.layout,
                                     full[public].shape, program.mesh, node.type.dtype)
    return out


def assemble_bound(local_bounds, local_values, layout, shape, mesh, dtype) -> np.ndarray:
    """The bound of :func:`assemble` of ``local_values``: the locals' bounds assembled the
    same way, plus the rounding of the sum of partial pieces, gamma_n sum |piece|."""
    from .ir.types import Partial
    from .reference.interpreter import assemble

    b = assemble(local_bounds, layout, shape, mesh, "float64")  # P(max): the max of the bounds
    if any(p == Partial("sum") for p in layout):
        mags = assemble([np.abs(_f64(x)) for x in local_values], layout, shape, mesh, "float64")
        b = b + gamma(mesh.size, unit_roundoff(dtype)) * mags
    return b


def op_bound(node, operands, errors=None, out=None) -> tuple:
    """One op on ``operands`` (arrays): ``(value, error bound)``; ``errors`` default 0.

    ``out`` is the op's value if already computed (else NUMPY_OPS computes it)."""
    out = NUMPY_OPS[node.op](list(operands), node) if out is None else out
    errors = [0.0] * len(operands) if errors is None else errors
    with np.errstate(all="ignore"):
        e = ERROR_RULES[node.op]([_f64(x) for x in operands], [np.asarray(e, np.float64) for e in errors],
                                 node, _f64(out), unit_roundoff(node.type.dtype))
    return out, np.broadcast_to(_no_nan(e), np.shape(out))


def _no_nan(e) -> np.ndarray:
    """A bound as float64 with NaN (inf - inf, 0 * inf of a bound that overflowed) made inf:
    an unknown error is an unbounded one, never a NaN tolerance."""
    e = np.asarray(e, np.float64)
    return np.where(np.isnan(e), np.inf, e) if np.isnan(e).any() else e


def _input_errors(n, run, mesh, split_inputs) -> list:
    from .ir.types import Partial

    locs = [run.env[r][n.name] for r in range(mesh.size)]
    axes = [a for a, p in enumerate(n.layout) if isinstance(p, Partial)]
    if not axes or not split_inputs:
        return [np.zeros(np.shape(x)) for x in locs]
    groups = {}
    for r in range(mesh.size):
        groups.setdefault(tuple(c for a, c in enumerate(mesh.coords(r)) if a not in axes), []).append(locs[r])
    return [split_bound(groups[tuple(c for a, c in enumerate(mesh.coords(r)) if a not in axes)], n.type.dtype)
            for r in range(mesh.size)]


def split_bound(pieces, dtype) -> np.ndarray:
    """Bound on |sum(pieces) - x| for the n pieces of a random partial split of x
    (:func:`split_for_ranks` with ``rng``: x/n + o_c rounded, the last offset minus the
    sum of the others): ``2 (n + 1) u sum |piece|``."""
    mags = sum(np.abs(_f64(p)) for p in pieces)
    return 2 * (len(pieces) + 1) * unit_roundoff(dtype) * mags


def compare(got, want, bound, bound_want=None, allow_nonfinite: bool = False, resolve=None) -> dict:
    """Compare two computations of one value elementwise.

    ``bound`` / ``bound_want``: error bounds of ``got`` and ``want`` against exact
    arithmetic (``bound_want`` defaults to ``bound``: both computed the same graph).
    Allowed per element: ``SAFETY * (bound + bound_want)``.

    Returns a dict: ``max_abs_err`` (over elements where both are finite; inf when
    the non-finite positions differ), ``tolerance`` (allowed error at the worst
    element), ``err_over_tol`` (max error/allowed; <= 1 passes; an error where
    nothing is allowed is inf), ``worst`` (its index), ``nonfinite_mismatch``,
    ``nonfinite`` (matching inf/NaN), ``ok`` and ``why`` (empty when ok).

    ``resolve`` (a fraction, e.g. :data:`parcomp.resolution.RESOLVE`): also fail, as
    ``unbounded`` and ``loose`` (CANNOT VOUCH), when every error is within tolerance but
    the tolerance somewhere exceeds that fraction of max |want| (the bound is vacuous).
    """
    g, w = _exact(_f64(got)), _exact(_f64(want))  # ints and bools: compared exactly (bound 0)
    if g.shape != w.shape:
        return _result(np.inf, 0.0, np.inf, None, 0, 0, f"shape {g.shape} != {w.shape}")
    bw = bound if bound_want is None else bound_want
    allowed = SAFETY * (np.broadcast_to(bound, g.shape) + np.broadcast_to(bw, g.shape))
    fin = np.isfinite(g) & np.isfinite(w)
    same = ~fin & ((np.isnan(g) & np.isnan(w)) | (g == w))
    bad = int(np.count_nonzero(~fin & ~same))
    with np.errstate(all="ignore"):
        err = np.where(fin, np.abs(g - w), 0.0)
        bounded = np.isfinite(allowed) & (allowed > 0)
        ratio = np.where(err == 0, 0.0, np.where(bounded, err / np.where(bounded, allowed, 1.0), np.inf))
    worst = np.unravel_index(int(np.argmax(ratio)), g.shape) if g.size else None
    r = float(ratio[worst]) if g.size else 0.0
    tol = float(allowed[worst]) if g.size else 0.0
    why = []
    if bad:
        why.append(f"{bad} inf/NaN value(s) where the other side differs")
    if r > 1 and np.isfinite(tol):
        why.append(f"error {float(err[worst]):.3e} > tolerance {tol:.3e} at {[int(i) for i in worst]}")
    elif r > 1:
        why.append(f"error {float(err[worst]):.3e} at {[int(i) for i in worst]} where the error bound is not "
                   f"finite: {OVERFLOW_TAIL}")
    nonfinite = int(np.count_nonzero(same))
    if nonfinite and not allow_nonfinite:
        why.append(f"{nonfinite} inf/NaN value(s) on both sides (overflow?): nothing to vouch for")
    max_err = np.inf if bad else (float(err.max()) if g.size else 0.0)
    res = _result(max_err, tol, r, worst, bad, nonfinite, "; ".join(why))
    res["unbounded"] = len(why) == 1 and r > 1 and not np.isfinite(tol) and not bad
    loose = loose_element(allowed, w, resolve) if resolve and not why and g.size else None
    if loose is not None:  # within a bound that cannot tell a wrong result from rounding
        res.update(ok=False, unbounded=True, loose=True, why=loose_reason("", loose, resolve))
    return res


def _exact(x: np.ndarray) -> np.ndarray:
    """Bools as int64 (0/1), so that differences exist; other arrays unchanged."""
    return x.astype(np.int64) if x.dtype.kind == "b" else x


def _result(max_err, tol, ratio, worst, bad, nonfinite, why):
    return {"max_abs_err": max_err, "tolerance": tol, "err_over_tol": ratio,
            "worst": None if worst is None else [int(i) for i in worst],
            "nonfinite_mismatch": bad, "nonfinite": nonfinite, "ok": not why, "why": why,
            "unbounded": False}


def compare_all(got: dict, want: dict, bounds: dict, keys=None, resolve_keys=None, **kw) -> dict:
    """:func:`compare` over ``keys`` (default: every key of ``want``), summarised.

    Returns ``max_abs_err`` (max over keys), the ``tolerance``/``err_over_tol``/
    ``worst`` of the key with the largest error/tolerance (``worst`` is
    ``"name[i, j]"``), ``ok`` (every key ok), ``why`` (the failing keys' reasons) and
    ``per_key`` ({key: compare result}). A key missing from ``got`` is a failure.
    ``resolve_keys``: the keys a ``resolve`` keyword applies to (default: all).
    """
    keys = list(want) if keys is None else list(keys)
    per = {}
    for k in keys:
        if k not in got:
            per[k] = _result(np.inf, 0.0, np.inf, None, 0, 0, "missing")
        elif k not in bounds:
            per[k] = _result(np.inf, 0.0, np.inf, None, 0, 0, "no error bound for it")
        else:
            per[k] = compare(got[k], want[k], bounds[k],
                             **(kw if resolve_keys is None or k in resolve_keys else {**kw, "resolve": None}))
    if not per:
        return {"max_abs_err": 0.0, "tolerance": 0.0, "err_over_tol": 0.0, "worst": None,
                "ok": True, "why": "", "per_key": per, "unbounded": False, "loose": False}
    top = max(per, key=lambda k: per[k]["err_over_tol"])
    t = per[top]
    where = top + (str(t["worst"]).replace(" ", "") if t["worst"] else "")  # 0-d: the bare name
    ok = all(p["ok"] for p in per.values())
    return {"max_abs_err": max(p["max_abs_err"] for p in per.values()), "tolerance": t["tolerance"],
            "err_over_tol": t["err_over_tol"], "worst": where, "ok": ok,
            "why": _first_reasons([f"{k}: {p['why']}" for k, p in per.items() if p["why"]]), "per_key": per,
            # failing only where the bound overflowed: no error seen, but nothing vouched for
            "unbounded": not ok and all(p["ok"] or p["unbounded"] for p in per.values()),
            "loose": any(p.get("loose") for p in per.values())}


def max_abs(x) -> float:
    """max |x| over the finite elements (0 for none): the output scale the CLI reports."""
    x = _f64(x)
    fin = np.abs(x[np.isfinite(x)]) if x.size else x
    return float(fin.max()) if fin.size else 0.0


def compare_outputs(got: dict, want: dict, bounds: dict) -> dict:
    """The verdict of ``parcomp check``/``run`` on a forward program: :func:`compare_all`
    over every output, plus ``output_scale`` (max |want|) and ``rel_err`` (error/scale)."""
    res = compare_all(got, want, bounds, resolve=RESOLVE)
    scale = max((max_abs(want[k]) for k in want), default=0.0)
    return {"max_abs_err": res["max_abs_err"], "output_scale": scale,
            "rel_err": res["max_abs_err"] / max(scale, 1e-30),
            **{k: res[k] for k in ("tolerance", "err_over_tol", "worst", "ok", "why", "unbounded", "loose")}}


def training_errors(got: dict, want: dict, params, bounds: dict, resolve=None) -> dict:
    """Max abs errors of the loss (``loss``, and ``losses``: one per step), gradients
    (``*.grad`` of params) and updated params, and the verdict of :func:`compare_all` over
    every key both sides have (``bounds``: per key). ``resolve``: the fraction the bounds of
    the loss and gradients must resolve (docs/design.md, "Resolution"); the optimizer's
    outputs are exempt (AdamW moves a weight by ~lr for a gradient that is pure rounding)."""
    keys = [k for k in want if k in got]
    res = compare_all(got, want, bounds, keys, resolve=resolve,
                      resolve_keys={"loss", "losses", *(f"{p}.grad" for p in params)})

    def err(names):
        return max((res["per_key"][k]["max_abs_err"] for k in names if k in res["per_key"]), default=0.0)

    return {"max_loss_err": err(["loss", "losses"]), "max_grad_err": err([f"{p}.grad" for p in params]),
            "max_param_err": err(params), "max_abs_err": res["max_abs_err"],
            **{k: res[k] for k in ("tolerance", "err_over_tol", "worst", "ok", "why", "unbounded", "loose")}}


def loss_errors(losses, ref_losses, loss_bounds) -> dict:
    """Per-step losses against the reference's, each within its step's bound
    (:func:`training_bounds`); a different number of steps is a failure."""
    if len(losses) != len(ref_losses) or len(losses) > len(loss_bounds):
        return _result(np.inf, 0.0, np.inf, None, 0, 0,
                       f"{len(losses)} losses against {len(ref_losses)} reference losses")
    return compare(np.array(losses, np.float64), np.array(ref_losses, np.float64),
                   np.array(loss_bounds[:len(losses)], np.float64))


def _first_reasons(reasons: list, most: int = 3) -> str:
    """The first ``most`` reasons, one line each, then how many more values failed, then each
    explanation the listed reasons shared (said once, not per value): a 60-value failure is
    a few readable lines, not a 6 KB line."""
    lines, tails = [], []
    for r in reasons[:most]:
        for tail in (LOOSE_TAIL, OVERFLOW_TAIL):
            if r.endswith(": " + tail):
                r = r[:-len(tail) - 2]
                tails += [tail] if tail not in tails else []
        lines.append(r)
    more = len(reasons) - most
    lines += [f"and {more} more value{'s' if more > 1 else ''}"] if more > 0 else []
    return "\n".join(lines + [f"({t})" for t in tails])
