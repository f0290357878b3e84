"""A model read from a file that carries its own weights (ONNX), as the commands use it.

``load_model`` returns ``(graph, module, example_inputs)``; for a torch factory
``module`` is the ``nn.Module``, for a ``.pcir`` file None, and for a model file
(``.onnx``) a :class:`ModelFile`: the weights come from the file, and the file's own
framework computes the unsharded answer.
"""
from __future__ import annotations


class ModelFile:
    """The interface of an imported model file (subclassed by
    :class:`parcomp.frontends.onnx.frontend.OnnxModel`).

    Attributes:
        path: the file; ``program.py`` reads its weights from it (``--checkpoint``).
    """

    path: str

    def feeds(self, graph, seed: int = 0) -> dict:
        """``{name: array}`` for every ``param`` (from the file) and ``input`` (seeded random)."""
        raise NotImplementedError

    def reference_outputs(self, graph, feeds: dict) -> dict:
        """``{public output name: array}``: the unsharded model run by its own framework."""
        raise NotImplementedError
