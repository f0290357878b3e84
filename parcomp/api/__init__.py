"""parcomp from Python: :func:`parallelize` a module inside the user's own training loop;
:func:`check` and :func:`explain` give the CLI's results as objects."""
from .dtensor_compare import BlockCollectives, DTensorComparison
from .parallel import ParallelModule, parallelize
from .results import CheckResult, Collective, Comparison, Explanation, check, explain, spec_from_plan

__all__ = ["parallelize", "ParallelModule", "check", "explain", "CheckResult", "Explanation", "Collective",
           "Comparison", "spec_from_plan", "DTensorComparison", "BlockCollectives"]
