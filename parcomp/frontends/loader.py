"""Resolve a model reference (``.pcir`` file, ``FILE.py:FACTORY``, ``pkg.mod:factory``).

A factory is a zero-argument callable returning ``(module, example_inputs)`` or
``(module, example_inputs, input_names)``; the module is imported with
:func:`parcomp.frontends.torch_export.import_torch`.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from ..errors import FrontendError, SourceLoc, VerifyError, closest
from ..ir.graph import Graph
from ..ir.text import parse_graph
from ..passes.verify import verify

USAGE = "a model reference is FILE.pcir, FILE.py:FACTORY or package.module:factory"


def load_model(ref: str) -> tuple:
    """Load ``ref`` as ``(graph, module, example_inputs)``.

    ``FILE.pcir`` is parsed (module ``None``, example_inputs ``()``); otherwise the
    factory is called and its module traced (torch is imported only then).

    Raises:
        FrontendError: the file or module does not exist, the factory is missing
            (with the nearest name as a suggestion), the factory fails or returns
            something other than ``(nn.Module, tuple of tensors[, names])``, or the
            model cannot be imported.
        IRParseError: a ``.pcir`` file does not parse.
    """
    if ref.endswith(".pcir"):
        return _read_pcir(ref), None, ()
    if ":" not in ref:
        raise FrontendError(f"cannot load {ref!r}: {USAGE}")
    where, name = ref.rsplit(":", 1)
    mod = _import(where, ref)
    factory = getattr(mod, name, None)
    if not callable(factory):
        raise FrontendError(_missing(mod, name, ref))
    module, inputs, names = _call(factory, ref)
    from .torch_export import import_torch

    return import_torch(module, inputs, names), module, inputs


def _read_pcir(path: str) -> Graph:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise FrontendError(f"cannot read model {path!r}: {e.strerror}") from None
    graph = parse_graph(text, file=path)
    try:
        verify(graph)
    except VerifyError as e:  # point at the offending line of the file
        name = getattr(e, "node", None)
        lines = text.splitlines()
        at = next((i for i, ln in enumerate(lines) if name and ln.lstrip().startswith(f"%{name}:")), None)
        if at is None:
            raise
        col = len(lines[at]) - len(lines[at].lstrip()) + 1
        raise VerifyError(e.message, SourceLoc(path, at + 1, col, lines[at])) from None
    return graph


def _import(where: str, ref: str):
    if where.endswith(".py") or os.sep in where or "/" in where:
        return _import_file(where, ref)
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        if e.name and where.startswith(e.name):
            raise FrontendError(f"cannot load {ref!r}: no module named {where!r}") from None
        raise FrontendError(f"cannot load {ref!r}: importing {where} failed: {e}") from e


def _import_file(path: str, ref: str):
    if not os.path.isfile(path):
        raise FrontendError(f"cannot load {ref!r}: no file {path!r}")
    full = os.path.abspath(path)
    name = "parcomp_models_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:
        del sys.modules[name]
        raise FrontendError(f"cannot load {ref!r}: running {path} failed: "
                            f"{type(e).__name__}: {e}") from e
    return mod


def _missing(mod, name: str, ref: str) -> str:
    factories = sorted(k for k, v in vars(mod).items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) == mod.__name__)
    hint = closest(name, factories)
    where = getattr(mod, "__file__", None) or mod.__name__
    what = "is not callable" if hasattr(mod, name) else "does not exist"
    msg = f"cannot load {ref!r}: factory {name!r} {what} in {where}"
    if hint:
        return msg + f"; did you mean {hint!r}?"
    return msg + (f"; factories there: {', '.join(factories)}" if factories else "")


def _call(factory, ref: str) -> tuple:
    import torch

    try:
        got = factory()
    except Exception as e:
        raise FrontendError(f"factory {ref!r} failed: {type(e).__name__}: {e}") from e
    bad = f"factory {ref!r} must return (nn.Module, tuple of tensors[, input names])"
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        raise FrontendError(f"{bad}, got {type(got).__name__}")
    module, inputs = got[0], got[1]
    names = list(got[2]) if len(got) == 3 and got[2] is not None else None
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(module, torch.nn.Module):
        raise FrontendError(f"{bad}, got a {type(module).__name__} as the module")
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor)
                                                        for t in inputs):
        raise FrontendError(f"{bad}, got {type(inputs).__name__} as example inputs")
    if names is not None and not all(isinstance(n, str) for n in names):
        raise FrontendError(f"{bad}: input names must be strings")
    return module, tuple(inputs), names
