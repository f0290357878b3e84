"""parcomp from Python: :func:`parallelize` a module inside the user's own training loop."""
from .parallel import ParallelModule, parallelize

__all__ = ["parallelize", "ParallelModule"]
