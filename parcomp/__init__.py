"""parcomp: a compiler for parallel model execution.

From Python: ``parcomp.parallelize(module, example_inputs, spec)`` (and ``check``, ``explain``,
``parcomp.testing``), imported when first used (:mod:`parcomp.api`), so ``import parcomp`` stays
free of torch.
"""
__version__ = "0.1.0"

#: the names ``parcomp`` exports from :mod:`parcomp.api`, loaded on first use
API = ("parallelize", "ParallelModule", "check", "explain", "CheckResult", "Explanation")


def __getattr__(name):
    if name in API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'parcomp' has no attribute {name!r}")
