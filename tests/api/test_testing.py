"""parcomp.testing: hypothesis strategies over a user's model and assert_equivalent."""
import os
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

import parcomp.testing as pt
from parcomp.ir.types import P, R, parse_layout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "specs"))
from models import gpt2_mlp  # noqa: E402

MODEL, EXAMPLE, NAMES = gpt2_mlp()


# 30 drawn specs in the suite (~1 s each on 2 cores); PARCOMP_SPEC_EXAMPLES=300 for a longer hunt
@settings(max_examples=int(os.environ.get("PARCOMP_SPEC_EXAMPLES", "30")), deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(spec=pt.specs(MODEL, EXAMPLE, input_names=NAMES))
def test_every_drawn_spec_of_the_gpt2_mlp_is_equivalent(spec):
    pt.assert_equivalent(MODEL, EXAMPLE, spec, input_names=NAMES)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(spec=pt.specs(MODEL, EXAMPLE, input_names=NAMES), data=pt.inputs(EXAMPLE))
def test_drawn_inputs_keep_the_example_shapes(spec, data):
    assert [x.shape for x in data] == [x.shape for x in EXAMPLE]
    assert spec.startswith("mesh ") and "input x [" in spec


@settings(max_examples=50, deadline=None, derandomize=True)
@given(mesh=pt.meshes(8), data=pt.layouts((6, 8, 4), {"dp": 2, "tp": 4}))
def test_drawn_meshes_and_layouts_are_legal(mesh, data):
    assert 2 <= __import__("math").prod(mesh.values()) <= 8
    lay = parse_layout(data)
    dims = [p.dim for p in lay if hasattr(p, "dim")]
    assert len(dims) == len(set(dims))


def test_a_broken_sharding_rule_is_found_with_a_shrunk_spec(monkeypatch, capsys):
    from parcomp.rules import sharding

    # wrong on purpose, Megatron's classic bug: a replicated addend (a bias) added to partial sums
    # on every rank, so the sum counts it once per rank
    right = sharding.STRATEGY_RULES["additive"]
    monkeypatch.setitem(sharding.STRATEGY_RULES, "additive",
                        lambda n, ts: right(n, ts) + [((P, R), P), ((R, P), P)])

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(spec=pt.specs(MODEL, EXAMPLE, input_names=NAMES))
    def search(spec):
        pt.assert_equivalent(MODEL, EXAMPLE, spec, input_names=NAMES)

    with pytest.raises(AssertionError) as e:
        search()
    message = str(e.value)
    assert "add mixes a partial-sum and a non-partial operand" in message  # the verifier after shard-prop
    shrunk = message.rsplit("spec:", 1)[1].split("\n")
    # shrunk: one mesh axis, no parameter split, the input replicated, a partial-sum output
    lines = [line.strip() for line in shrunk if line.strip()]
    assert lines[0] in ("mesh tp=2", "mesh tp=4") and lines[1:] == ["input x [R]", "output output [P]"], message
    print(message)
