"""ONNX frontend: a ``.onnx`` file becomes a parcomp :class:`Graph`.

:func:`load_onnx` reads the file with ``onnx.load`` (external data stays on disk
until a weight is needed), runs ``onnx.checker`` (a failure is an error with the
checker's message) and ``onnx.shape_inference`` (strict), and needs opset 17 or
later of the default domain.  Every node is then lowered (:mod:`.graph`) through
:data:`parcomp.frontends.onnx.ops.TABLE` (the MLP ops; the transformer ops of
:mod:`.transformer`), after GELU formulas (:mod:`.patterns`), attention
(:mod:`.attention`, -> ``sdpa``) and RMSNorm (:mod:`.norms`) are recognised
and nodes no output needs are dropped; fused q|k|v weights are then split per part
(:mod:`parcomp.passes.fused_weights`), as for torch.

- Initializers read as tensors become ``param`` nodes named as in the file
  (``c_fc.weight``: torch.onnx.export keeps the ``state_dict`` names when exporting with
  ``optimize=False``; its optimizer folds ``Transpose(0.weight)`` into a new initializer
  ``val_0``), so a spec written for the torch model fits its ONNX export.  A character
  outside ``[A-Za-z0-9_.-]`` becomes ``_`` (:func:`ir_name`); ``program.py`` applies the
  same rule when it reads the ``.onnx`` file as its checkpoint.
- Graph inputs that are not initializers become ``input`` nodes; outputs keep their names.
- Integer initializers, one-element initializers and ``Constant`` outputs are constants:
  a node whose inputs are all constants is computed at import (``onnx.reference``), and
  ``Shape``/``Size`` read the static shape.  A constant tensor a computed node reads is
  rebuilt as ``arange`` (+ ``reshape``/``expand``) when it is one (position ids); causal
  masks are read by the attention lowering; any other is an error.
- A float initializer only combined, elementwise, with constants (RoPE's ``inv_freq``) is
  a buffer: ``{trainable=false}``.
- A weight keeps its stored orientation: ``Gemm(transB=1)``/``Transpose -> MatMul``
  lower to ``param -> permute -> matmul``, so ``colwise``/``rowwise`` resolve by use.

Every failure is a :class:`FrontendError` naming the file and, for a node, its name,
op type, outputs and the model module it was exported from.
"""
from __future__ import annotations

import os

import numpy as np

from parcomp.errors import FrontendError
from parcomp.passes.fused_weights import stored_to_parts  # multi-query part params
from ..model_file import ModelFile
from .graph import OnnxImport, import_onnx, ir_name  # noqa: F401 - the frontend's API

MIN_OPSET = 17


class OnnxModel(ModelFile):
    """An imported ``.onnx`` file: its weights, and onnx's reference evaluator as the
    unsharded answer (see :class:`parcomp.frontends.model_file.ModelFile`)."""

    def __init__(self, path: str, model, params: dict):
        self.path, self.model, self.params = path, model, params

    def feeds(self, graph, seed: int = 0) -> dict:
        """Params from the file's initializers (external data read now), inputs seeded
        standard-normal (integers: 0 or 1)."""
        from onnx import numpy_helper

        inits = {t.name: t for t in self.model.graph.initializer}
        base, rng, out = os.path.dirname(os.path.abspath(self.path)), np.random.default_rng(seed), {}
        for n in graph.nodes:
            if n.op == "param":
                # a multi-query weight's part: the stored tensor, cut below
                out[n.name] = numpy_helper.to_array(inits[self.params[n.attr("part_of") or n.name]], base)
            elif n.op == "input":
                x = rng.standard_normal(n.type.shape) if "float" in n.type.dtype else \
                    rng.integers(0, 2, n.type.shape)
                out[n.name] = np.asarray(x).astype(n.type.dtype)
        return stored_to_parts(out, graph)

    def reference_outputs(self, graph, feeds: dict) -> dict:
        """``onnx.reference.ReferenceEvaluator``'s outputs on ``feeds``' inputs."""
        import onnx
        from onnx.reference import ReferenceEvaluator

        model = onnx.load(self.path)  # with its external data
        names = {ir_name(i.name): i.name for i in model.graph.input}
        outs = ReferenceEvaluator(model).run(None, {names[n.name]: feeds[n.name] for n in graph.inputs})
        return dict(zip(graph.output_names, (np.asarray(o) for o in outs)))


def load_onnx(path: str) -> tuple:
    """``(graph, OnnxModel, ())`` for the ONNX file at ``path`` (checked, shapes inferred).

    Raises:
        FrontendError: the file is missing or not ONNX, fails ``onnx.checker`` (its
            message), has an opset below 17, a dynamic shape, an op without a rule
            (op type, node name, module and the supported ops named), or an output
            that is a constant.
    """
    if not os.path.isfile(path):
        raise FrontendError(f"cannot load {path!r}: no such file", where=path)
    try:
        import onnx
    except ImportError as e:
        raise FrontendError(f"reading {path} needs the onnx package ({e}); install parcomp's "
                            f"onnx extra: pip install 'parcomp[onnx]'", where=path) from None
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:  # noqa: BLE001 - protobuf raises DecodeError and others
        raise FrontendError(f"{path} is not an ONNX model: {type(e).__name__}: {e}", where=path) from None
    checked(model, path, path)
    got = import_onnx(model, path)
    if got.constants:
        name = next(iter(got.constants))
        raise FrontendError(f"{path}: output {name!r} is a constant ({got.constants[name].shape}); "
                            f"parcomp compiles outputs computed from inputs or weights", where=path)
    return got.graph, OnnxModel(path, model, got.params), ()


def checked(model, path: str, source=None):
    """Run ``onnx.checker`` on ``source`` (a path: external data is checked too; default the
    model) and require opset >= 17; FrontendError with the checker's message."""
    import onnx

    try:
        onnx.checker.check_model(source if source is not None else model)
    except (onnx.checker.ValidationError, ValueError) as e:
        msg = str(e).strip().replace("\n\n", "\n")
        raise FrontendError(f"{path} fails onnx.checker: {msg}", where=path) from None
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset is None or opset < MIN_OPSET:
        raise FrontendError(f"{path} uses opset {opset} of the default domain; parcomp reads opset "
                            f"{MIN_OPSET} to {onnx.defs.onnx_opset_version()}: convert it with "
                            f"onnx.version_converter.convert_version(model, {MIN_OPSET})", where=path)
    return model


