"""Shared test set-up: hypothesis profiles (bounded in CI) and small graph builders."""
import inspect
import os
import re
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings


# every test folder on sys.path: the tests sit in folders by subsystem (tests/ir, tests/passes, ...)
# and share helpers: the modules of tests/ (graphs, numerics, ...) and a few test modules'
# fixtures (test_pipeline's chain_graph, test_cli's write), imported by name from any folder.
_TESTS = Path(__file__).resolve().parent
sys.path[:0] = [str(_TESTS)] + sorted(str(d) for d in _TESTS.iterdir() if d.is_dir() and any(d.glob("test_*.py")))

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=100, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# `make test` runs the suite on two pytest-xdist workers (--dist loadgroup). A test that starts ranks
# (marked slow, or calling torchrun, mp.spawn or `parcomp run --nproc` itself) is put in one group,
# so one worker runs those one after another while the other worker takes the in-process tests: two
# 4- or 8-rank runs do not compete for the two cores of a CI machine.
_STARTS_RANKS = re.compile(r"mp\.spawn|run_torchrun|torchrun\(|\"--nproc\"|gloo_ranks|run_ranks")


def _starts_ranks(item) -> bool:
    if item.get_closest_marker("slow"):
        return True
    try:
        return bool(_STARTS_RANKS.search(inspect.getsource(item.obj)))
    except (OSError, TypeError):
        return False


def pytest_collection_modifyitems(config, items):
    for item in items:
        if _starts_ranks(item):
            item.add_marker(pytest.mark.xdist_group("ranks"))
