"""The node test cases that ship inside the onnx package, through importer + interpreter.

``onnx.backend.test.case.node`` builds each small model with its inputs and expected
outputs. Every case of a supported op (named ``test_<op>`` or ``test_<op>_...``, its
``_expanded`` function-body variants included) is imported by parcomp's ONNX frontend and
run on the reference interpreter; the outputs must equal onnx's within the tolerance of their
dtype (constant outputs, computed at import: exactly).

parcomp compiles static programs, so what ONNX lets be a run-time input but parcomp needs
at compile time is given as an initializer: integer inputs (shapes, axes) and
one-element inputs (a Pow exponent, a scalar bias). Models of an opset below 17 are
converted with ``onnx.version_converter`` first.

A case may be refused (a located FrontendError: an integer or 8-bit dtype, a Cast between
dtypes, a sequence type...), never answered wrongly: a mismatch fails the test.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import numpy_helper, version_converter  # noqa: E402
from onnx.backend.test.case.node import collect_testcases  # noqa: E402

from parcomp.check.differential import compare  # noqa: E402
from parcomp.errors import ParcompError  # noqa: E402
from parcomp.frontends.onnx.frontend import MIN_OPSET, checked, import_onnx, ir_name  # noqa: E402
from parcomp.frontends.onnx.ops import supported_ops  # noqa: E402
from parcomp.reference.numpy_ops import run_unsharded  # noqa: E402

from numerics import rtol_of  # noqa: E402


#: supported ops no onnx node case can show, and why (tested in test_frontend_onnx.py instead)
EXEMPT = {"SplitToSequence": "its cases return a sequence (no numpy type); GPT-2's fused q|k|v "
                             "split is tested in test_frontend_onnx.py",
          "SequenceAt": "as SplitToSequence"}


def _op_of(case) -> str | None:
    """The supported op a case tests: its name is ``test_<op>`` or ``test_<op>_...`` with the
    op lower-cased (``logsoftmax``) or snake-cased (``layer_normalization``); the longest wins."""
    best = None
    for op in supported_ops():
        for word in {op.lower(), re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", "_", op).lower()}:
            if re.match(rf"test_{word}(_|$)", case.name) and (best is None or len(word) > len(best[1])):
                best = (op, word)
    return best and best[0]


def _static_inputs(model, inputs):
    """The model with integer and one-element inputs turned into initializers (their test
    values); returns (model, {input name: value} of the inputs left)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    g, left = model.graph, {}
    keep = []
    for vi, x in zip(list(g.input), inputs):
        x = np.asarray(x)
        if x.dtype.kind in "iub" or x.size == 1:
            g.initializer.append(numpy_helper.from_array(x, vi.name))
        else:
            keep.append(vi)
            left[vi.name] = x
    del g.input[:]
    g.input.extend(keep)
    return model, left


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _array(x):
    """A test datum as a numpy array (a TensorProto of a numpy dtype converted), else None."""
    if isinstance(x, onnx.TensorProto):
        x = numpy_helper.to_array(x) if x.data_type in (1, 10, 11, 6, 7, 9) else None
    return np.asarray(x) if isinstance(x, (np.ndarray, np.generic)) else None


def run_case(case) -> str | None:
    """None when parcomp's run equals onnx's expected outputs, else why not (a refusal
    starts with 'refused:', anything else is a wrong answer)."""
    inputs, want = case.data_sets[0]
    inputs, want = [_array(x) for x in inputs], [_array(x) for x in want]
    if any(x is None for x in inputs + want):
        return "refused: data of a type numpy lacks (float8/int4/...) or a sequence"
    model, feeds = _static_inputs(case.model, inputs)
    try:
        if _opset(model) < MIN_OPSET:
            model = version_converter.convert_version(model, MIN_OPSET)
    except Exception as e:  # noqa: BLE001 - the converter raises many types
        return f"refused: onnx.version_converter: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
    try:
        checked(model, case.name)
        got = import_onnx(model, case.name)
    except ParcompError as e:
        return "refused: " + e.message.split(": ", 1)[-1][:160]
    outs = [ir_name(o.name) for o in model.graph.output]
    values = dict(got.constants)
    if got.graph is not None:
        graph = got.graph
        feeds = {ir_name(k): v for k, v in feeds.items()}
        inits = {t.name: t for t in model.graph.initializer}
        feeds.update({p: numpy_helper.to_array(inits[name]) for p, name in got.params.items()})
        values.update(run_unsharded(graph, feeds))
    for name, w in zip(outs, want):
        w, g = np.asarray(w), values[name]
        if g.dtype != w.dtype or g.shape != w.shape:
            return f"output {name}: {g.dtype}{list(g.shape)}, onnx expects {w.dtype}{list(w.shape)}"
        if np.array_equal(g, w, equal_nan=True):  # identical (inf/NaN where onnx has them too)
            continue
        if name in got.constants:
            if not np.array_equal(g, w):
                return f"constant output {name} differs"
            continue
        res = compare(g, w, rtol_of(g, w))
        if not res["ok"]:
            return f"output {name}: {res['why']}"
    return None


def test_onnx_node_cases_pass_for_every_supported_op():
    results = {}
    with np.errstate(all="ignore"):  # onnx builds some cases' data with overflowing casts
        cases = collect_testcases()
    for case in cases:
        op = _op_of(case)
        if op is not None and case.kind == "node" and case.data_sets:
            results.setdefault(op, []).append((case.name, run_case(case)))
    print("\nonnx.backend.test.case.node through parcomp (importer + reference interpreter):")
    for op in supported_ops():
        rows = results.get(op, [])
        print(f"  {op:10} {sum(r is None for _, r in rows):3} of {len(rows):3} cases pass")
    failing = [(op, n, r) for op, rows in sorted(results.items()) for n, r in rows if r is not None]
    for op, name, why in failing:
        print(f"    {op}: {name}: {why}")
    none_pass = [op for op in supported_ops() if op not in EXEMPT
                 and not any(r is None for _, r in results.get(op, []))]
    assert not none_pass, f"supported ops with no passing onnx node case: {none_pass}"
    wrong = [(n, r) for _, n, r in failing if not r.startswith("refused:")]
    assert not wrong, f"cases parcomp answered wrongly (a refusal is fine, a wrong answer is not): {wrong}"
