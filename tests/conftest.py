"""Shared test set-up: hypothesis profiles (bounded in CI) and small graph builders."""
import os
import sys
from pathlib import Path

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
