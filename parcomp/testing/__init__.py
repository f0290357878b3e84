"""Property-based testing of a user's own model with parcomp: hypothesis strategies and an assertion.

    from hypothesis import given, settings
    import parcomp.testing as pt

    @settings(max_examples=100, deadline=None)
    @given(spec=pt.specs(model, example))
    def test_every_layout_is_equivalent(spec):
        pt.assert_equivalent(model, example, spec)

:func:`specs` draws a mesh and a layout for every parameter and input of the model, among the
layouts whose split dims divide evenly; :func:`assert_equivalent` runs ``parcomp check`` on it
(every rank in float64 on the numpy interpreter against the unsharded model) and fails with the
spec's text, ready to save as a ``.pcs`` file, when the program differs or when the compiler
broke its own IR (the verifier after every pass); a spec the compiler refuses as the user's
error (a layout that cannot be run) is skipped (``hypothesis.assume``). Hypothesis shrinks a failure towards the smallest
mesh and the fewest splits: the layouts are drawn replicated-first.
"""
from __future__ import annotations

from hypothesis import strategies as st

from ..api.results import check, imported_graph
from ..api.specs import resolve_spec
from ..check.drawn_specs import AXES, graph_specs, layouts, meshes, output_layouts  # noqa: F401 (re-exported)
from ..errors import ParcompError, VerifyError

__all__ = ["meshes", "layouts", "specs", "inputs", "assert_equivalent", "SpecText", "NotLegal"]


class SpecText(str):
    """A drawn spec's text; its repr is the text itself, so hypothesis's falsifying example
    prints a spec one can copy into a ``.pcs`` file."""

    def __repr__(self) -> str:
        return "SpecText('''\n" + str(self) + "''')"


class NotLegal(Exception):
    """The compiler refused a drawn spec (assert_equivalent(..., legal_only=True) tells
    hypothesis to draw another with ``assume``)."""


@st.composite
def specs(draw, module, example_inputs, mesh=None, input_names=None, max_ranks: int = 4, split_inputs: bool = True):
    """A spec (:class:`SpecText`) for ``module``: a mesh (``mesh``, or one of :func:`meshes`),
    a layout for every parameter (:func:`layouts`) and every input (replicated or its batch,
    dim 0, split: ``split_inputs``), and every output left to the search, replicated, or a
    partial sum over some axes (:func:`output_layouts`). The same strategy as
    ``parcomp check --examples N`` (:func:`parcomp.check.drawn_specs.graph_specs`)."""
    graph = imported_graph(module, example_inputs, input_names)
    return SpecText(draw(graph_specs(graph, mesh, max_ranks, split_inputs)))


@st.composite
def inputs(draw, example_inputs, scales=(1.0, 1e-3, 1e3)):
    """Tensors shaped and typed as ``example_inputs``: float ones normal with a drawn seed and
    scale (signs vary), integer ones uniform in the example's own range (token ids stay ids)."""
    import torch

    seed = draw(st.integers(0, 2 ** 31 - 1))
    scale = draw(st.sampled_from(scales))
    gen = torch.Generator().manual_seed(seed)
    out = []
    for x in example_inputs:
        if x.is_floating_point():
            out.append((torch.randn(x.shape, generator=gen, dtype=torch.float64) * scale).to(x.dtype))
        else:
            lo, hi = int(x.min()), int(x.max())
            out.append(torch.randint(lo, hi + 1, x.shape, generator=gen, dtype=x.dtype))
    return tuple(out)


def assert_equivalent(module, example_inputs, spec, *, input_names=None, steps=None, legal_only: bool = True):
    """``parcomp check`` of ``module`` under ``spec``: AssertionError, with the spec's text and
    the worst element, unless the sharded program equals the unsharded model.

    A spec the compiler refuses (a layout it cannot run) is ``hypothesis.assume(False)`` with
    ``legal_only`` (the default: the strategies draw some such), else it raises.
    """
    try:
        result = check(module, example_inputs, spec, input_names=input_names, steps=steps)
    except VerifyError as e:  # the compiler broke its own IR on a legal spec: a bug, never skipped
        raise AssertionError("\n".join(["parcomp's compiler produced invalid IR for this spec:",
                                         *("  " + line for line in e.render().splitlines()),
                                         "spec:", *("    " + line for line in _text(spec).splitlines())])) from None
    except ParcompError as e:
        if not legal_only:
            raise
        from hypothesis import assume

        assume(False)
        raise NotLegal(str(e)) from None  # outside a hypothesis test: assume() raised already
    if not result.ok:
        text = _text(spec)
        r = result.result
        lines = [f"parcomp check: {result.verdict}: the sharded program differs from the unsharded model",
                 f"  worst: {r.worst}; max abs error {r.max_abs_err:.3e}; error/tolerance {r.err_over_tol:.3g}",
                 *([f"  why: {r.why}"] if r.why else []),
                 *([f"  vs the torch module: {result.vs_model.why}"] if result.vs_model and result.vs_model.why
                   else []),
                 "spec:", *("    " + line for line in str(text).splitlines())]
        raise AssertionError("\n".join(lines))
    return result


def _text(spec) -> str:
    """The spec's text for a message: the text itself, or the spec's file."""
    return spec if isinstance(spec, str) else str(getattr(resolve_spec(spec), "file", spec))
