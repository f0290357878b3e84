"""The search record's note in report.json: it counts the activations gathered over a batch axis,
never the params that ``zero=1`` under bf16 gathers over dp in the forward."""
from __future__ import annotations

from graphs import mlp_text

from parcomp.compile.compiler import compile_graph
from parcomp.ir.text import parse_graph
from parcomp.spec import parse_spec


def _compiled(train):
    g = parse_graph(mlp_text((8,), [8, 16, 8], [True, True], ["relu", "none"], torch_layout=True))
    return compile_graph(g, parse_spec(f"mesh dp=2\ninput x [S(0)]\ntrain {train}\n", "t.pcs"))


def test_zero_param_gathers_in_the_forward_are_not_called_activation_gathers():
    c = _compiled("loss=mse optimizer=adamw(lr=0.001) zero=1 precision=bf16 input_grads=no")
    gathers = [r for r in c.report["collectives"] if r["kind"] == "all_gather" and r["axis"] == "dp"
               and r["phase"] == "forward"]
    assert gathers, "bf16 zero=1 gathers the params' low-precision copies in the forward"
    assert c.report["search"]["data_parallel"] is True
    assert "note" not in c.report["search"], c.report["search"]["note"]
