"""Resolve a model reference (``.pcir`` or ``.onnx`` file, ``FILE.py:FACTORY``, ``pkg.mod:factory``).

A factory is a zero-argument callable returning ``(module, example_inputs)`` or
``(module, example_inputs, input_names)``; the module is imported with
:func:`parcomp.frontends.torch.export.import_torch`.  ``pkg.mod`` is imported
as ``python -m`` would find it: from ``sys.path`` and, failing that, from the
current directory.  ``FILE.py`` is imported as ``python FILE.py`` runs it: its folder
is first on ``sys.path`` while it is imported and its factory called (so it imports its
neighbours), and taken off again after.  Every failure is a :class:`FrontendError` (or the
``.pcir`` parser's :class:`IRParseError`), located where possible: the line of
the ``.pcir`` file, of a ``.py`` file that does not compile, or of the
factory's own code that raised.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import os
import sys
import traceback

from ..errors import FrontendError, SourceLoc, VerifyError, closest, source_lines
from ..ir.graph import Graph
from ..ir.text import parse_graph
from ..passes.verify import verify

USAGE = "a model reference is FILE.pcir, FILE.py:FACTORY, package.module:factory or FILE.onnx"


def load_model(ref: str) -> tuple:
    """Load ``ref`` as ``(graph, module, example_inputs)``.

    ``FILE.pcir`` is parsed (module ``None``, example_inputs ``()``); ``FILE.onnx`` is
    imported by :func:`parcomp.frontends.onnx.frontend.load_onnx` (module: its
    :class:`~parcomp.frontends.model_file.ModelFile`); otherwise the factory is called and
    its module traced (torch is imported only then).

    Raises:
        FrontendError: the file or module does not exist, the factory is missing
            (with the nearest name as a suggestion), the factory fails or returns
            something other than ``(nn.Module, tuple of tensors[, names])``, or the
            model cannot be imported; an ``.onnx`` file fails (see ``load_onnx``).
        IRParseError: a ``.pcir`` file does not parse.
    """
    if ref.endswith(".pcir"):
        return _read_pcir(ref), None, ()
    if ref.endswith(".onnx"):
        from .onnx.frontend import load_onnx

        return load_onnx(ref)
    if ":" not in ref:
        hint = f"; name the factory, as {ref}:FACTORY" if ref.endswith(".py") else ""
        raise FrontendError(f"cannot load {ref!r}: {USAGE}{hint}", where=ref)
    where, name = ref.rsplit(":", 1)
    if not name.isidentifier() or not where:
        raise FrontendError(f"cannot load {ref!r}: {USAGE} (FACTORY is a Python name)", where=ref)
    with _folder_on_path(where):
        mod = _import(where, ref)
        factory = getattr(mod, name, None)
        if not callable(factory):
            raise FrontendError(_missing(mod, name, ref), where=ref)
        module, inputs, names = _call(factory, ref)
    from .torch.export import import_torch

    return import_torch(module, inputs, names), module, inputs


def _read_pcir(path: str) -> Graph:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FrontendError(f"cannot read model {path!r}: {e.strerror or e}", where=path) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise FrontendError(f"model {path!r} is not UTF-8 text: byte 0x{data[e.start]:02x} at "
                            f"offset {e.start}", SourceLoc(path, line, col)) from None
    graph = parse_graph(text, file=path)
    if not graph.outputs:
        lines = source_lines(text)
        at = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith("return")), 0)
        raise FrontendError("the model returns nothing: name its outputs, as `return %value`",
                            SourceLoc(path, at + 1, 1, lines[at]))
    _declared_attrs_only(graph, path, source_lines(text[1:] if text.startswith("\ufeff") else text))
    with pointing_into(path, text):
        verify(graph)
    return graph


def _declared_attrs_only(graph: Graph, path: str, lines: list) -> None:
    """FrontendError at the attribute when a node of a model ``.pcir`` carries an attribute
    its op does not declare (:data:`parcomp.ir.ops.OPS`; passes' annotations such as
    ``reason`` are not the user's to write)."""
    from ..ir.ops import OPS

    for n in graph.nodes:
        extra = [k for k, _ in n.attrs if k not in OPS[n.op].attrs]
        if not extra:
            continue
        at = next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(f"%{n.name}:")), 0)
        line = lines[at] if at < len(lines) else ""
        col = line.find(f"{extra[0]}=", line.find("{") + 1) + 1 or 1
        takes = OPS[n.op].attrs
        hint = (f"it takes {', '.join(sorted(takes))}" if takes else "it takes none")
        if n.op == "reshape":
            hint += " (the result type gives the shape)"
        elif extra[0] == "trainable":
            hint += " (trainable=false is for a param)"
        raise FrontendError(f"{n.op} has no attribute {extra[0]}; {hint}", SourceLoc(path, at + 1, col, line))


def _line_of(err: VerifyError, lines: list) -> int | None:
    """The index of the ``.pcir`` line ``err`` is about (its node's or its anchor's)."""
    name, anchor = getattr(err, "node", None), getattr(err, "anchor", None)
    head = f"%{name}:" if name else (anchor + " " if anchor else None)
    if head is None:
        return None
    return next((i for i, ln in enumerate(lines) if ln.lstrip().startswith(head)), None)


@contextlib.contextmanager
def pointing_into(ref: str, text: str | None = None):
    """Re-raise a :class:`VerifyError` that names a node (``err.node``) or a header line
    (``err.anchor``) of the ``.pcir`` model ``ref`` at that line of the file.

    ``text`` is the file's text if the caller has it (else the file is read on error).
    """
    try:
        yield
    except VerifyError as e:
        if e.loc is not None or not ref.endswith(".pcir"):
            raise
        if text is None:
            try:
                with open(ref, encoding="utf-8", errors="replace") as f:
                    text = f.read()
            except OSError:
                raise e from None
        lines = source_lines(text[1:] if text.startswith("\ufeff") else text)
        at = _line_of(e, lines)
        if at is None:
            raise
        col = len(lines[at]) - len(lines[at].lstrip()) + 1
        raise VerifyError(e.message, SourceLoc(ref, at + 1, col, lines[at])) from None


def _is_file_ref(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where


@contextlib.contextmanager
def _folder_on_path(where: str):
    """For a ``FILE.py`` reference, ``FILE``'s folder first on ``sys.path`` (as ``python
    FILE.py`` has it) for the duration; removed after unless it was already there."""
    folder = os.path.dirname(os.path.abspath(where)) if _is_file_ref(where) else None
    if folder is None or (sys.path and sys.path[0] == folder):
        yield
        return
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        if sys.path and sys.path[0] == folder:
            del sys.path[0]
        elif folder in sys.path:
            sys.path.remove(folder)


def _import(where: str, ref: str):
    if _is_file_ref(where):
        return _import_file(where, ref)
    if not all(part.isidentifier() for part in where.split(".")):
        raise FrontendError(f"cannot load {ref!r}: {where!r} is neither a module name "
                            f"(package.module) nor a .py file", where=ref)
    try:
        return _import_module(where)
    except ModuleNotFoundError as e:
        if e.name and (where + ".").startswith(e.name + "."):
            raise FrontendError(f"cannot load {ref!r}: no module named {e.name!r} on the Python "
                                f"path or in the current directory {os.getcwd()}; give its file "
                                f"instead, as path/to/{where.replace('.', '/')}.py:FACTORY",
                                where=ref) from None
        raise _failed(ref, f"importing {where}", e) from e
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module may raise anything
        raise _failed(ref, f"importing {where}", e) from e


def _import_module(where: str):
    """``importlib.import_module``, retried with the current directory first on the path
    (as ``python -m`` has it) when the top-level package is not found."""
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        top, cwd = where.split(".")[0], os.getcwd()
        if e.name != top or cwd in sys.path or "" in sys.path:
            raise
    sys.path.insert(0, cwd)
    try:
        return importlib.import_module(where)
    finally:
        if cwd in sys.path:
            sys.path.remove(cwd)


def _failed(ref: str, doing: str, e: BaseException, file: str | None = None) -> FrontendError:
    """A FrontendError for an exception the user's code raised, at the user's line: the
    last frame in ``file`` (else the last outside parcomp, the standard library and
    installed packages), or the line a SyntaxError names."""
    msg = f"cannot load {ref!r}: {doing} failed: {type(e).__name__}: {e}"
    if isinstance(e, SyntaxError) and e.filename and e.lineno:
        text = (e.text or "").rstrip("\n")
        return FrontendError(msg, SourceLoc(e.filename, e.lineno, e.offset or 1, text))
    frames = traceback.extract_tb(e.__traceback__)
    ours = [f for f in frames if f.filename == file] or [f for f in frames if _is_users(f.filename)]
    if not ours:
        return FrontendError(msg, where=ref)
    f = ours[-1]
    return FrontendError(msg, SourceLoc(f.filename, f.lineno or 1, 1, f.line or ""))


_NOT_USERS = tuple({os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    sys.prefix, sys.base_prefix, sys.exec_prefix})


def _is_users(filename: str) -> bool:
    return not filename.startswith("<") and not os.path.abspath(filename).startswith(_NOT_USERS)


def _import_file(path: str, ref: str):
    if not os.path.isfile(path):
        what = f"{path!r} is a directory" if os.path.isdir(path) else f"no file {path!r}"
        raise FrontendError(f"cannot load {ref!r}: {what}; give a .py file", where=ref)
    full = os.path.abspath(path)
    name = "parcomp_models_" + hashlib.sha1(full.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    if spec is None or spec.loader is None:
        raise FrontendError(f"cannot load {ref!r}: {path!r} is not a Python file (.py)", where=ref)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    try:
        spec.loader.exec_module(mod)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the user's module may raise anything
        del sys.modules[name]
        raise _failed(ref, f"running {path}", e, full) from e
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
    except (Exception, SystemExit) as e:  # noqa: BLE001 - the factory may raise anything
        err = _failed(ref, "the factory", e, getattr(getattr(factory, "__code__", None),
                                                    "co_filename", None))
        raise FrontendError(f"factory {ref!r} failed: {type(e).__name__}: {e}", err.loc,
                            where=ref) from e
    bad = f"factory {ref!r} must return (nn.Module, tuple of tensors[, input names])"
    if not isinstance(got, (tuple, list)) or len(got) not in (2, 3):
        raise FrontendError(f"{bad}, got {type(got).__name__}", where=ref)
    module, inputs = got[0], got[1]
    names = got[2] if len(got) == 3 else None
    if names is not None and (not isinstance(names, (tuple, list))
                              or not all(isinstance(n, str) for n in names)):
        raise FrontendError(f"{bad}: input names must be a list of strings, got {names!r:.60}",
                            where=ref)
    names = list(names) if names is not None else None
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    if not isinstance(module, torch.nn.Module):
        raise FrontendError(f"{bad}, got a {type(module).__name__} as the module", where=ref)
    if not isinstance(inputs, (tuple, list)) or not all(isinstance(t, torch.Tensor)
                                                        for t in inputs):
        raise FrontendError(f"{bad}, got {type(inputs).__name__} as example inputs", where=ref)
    return module, tuple(inputs), names
