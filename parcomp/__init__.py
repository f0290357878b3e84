"""parcomp: a compiler for parallel model execution.

From Python: ``parcomp.parallelize(module, example_inputs, spec)``, ``parcomp.check(...)``,
``parcomp.explain(...)`` (:mod:`parcomp.api`) and ``parcomp.testing``, each imported when first
used, so ``import parcomp`` stays free of torch.
"""
import sys as _sys
import types as _types

from .version import __version__  # noqa: F401 (the package's version)

#: the names ``parcomp`` exports from :mod:`parcomp.api`, loaded on first use
API = ("parallelize", "ParallelModule", "check", "explain", "CheckResult", "Explanation", "Collective",
       "spec_from_plan")


def __getattr__(name):
    if name in API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'parcomp' has no attribute {name!r}")


class _CheckEntry:
    """``parcomp.check``: the package :mod:`parcomp.check` (its modules are its attributes)
    and, called, the Python API's :func:`parcomp.api.check` (``parcomp.check(module, inputs,
    spec)``). Python makes a subpackage an attribute of its parent; this keeps both meanings."""

    def __init__(self, package):
        object.__setattr__(self, "_package", package)

    def __call__(self, *args, **kwargs):
        from .api import check

        return check(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(object.__getattribute__(self, "_package"), name)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_package"), name, value)

    def __repr__(self):
        return f"<parcomp.check: the package {object.__getattribute__(self, '_package')!r} and the function>"


class _Parcomp(_types.ModuleType):
    """The ``parcomp`` module object: wraps the ``check`` subpackage as :class:`_CheckEntry`
    when the import system sets it as an attribute."""

    def __setattr__(self, name, value):
        if name == "check" and isinstance(value, _types.ModuleType):
            value = _CheckEntry(value)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Parcomp
