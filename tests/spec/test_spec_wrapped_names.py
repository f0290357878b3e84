"""A spec rule written for a model that the user then wrapped (``model.transformer.h.0...``,
DDP's ``module.layers.0...``) matches no parameter: the error names the wrapper prefix and
the rule to write, keeping the rule's wildcards, instead of "did you mean" one concrete
name."""
import pytest

from parcomp.cli.main import main
from parcomp.errors import SpecError
from parcomp.spec import check_names, parse_spec

WRAPPED = ["model.transformer.h.0.mlp.c_fc.weight", "model.transformer.h.0.mlp.c_proj.weight",
           "model.transformer.h.1.mlp.c_fc.weight", "model.transformer.h.1.mlp.c_proj.weight",
           "model.transformer.wte.weight"]


def _error(line: str, names: list) -> str:
    spec = parse_spec(f"mesh tp=2\n{line}\n", "t.pcs")
    with pytest.raises(SpecError) as info:
        check_names(spec, names, ["x"], ["output"], [])
    assert (info.value.loc.line, info.value.loc.col) == (2, 1)
    return str(info.value)


@pytest.mark.parametrize("line, shared, write", [
    ("transformer.h.*.mlp.c_fc.weight colwise", "model.", "model.transformer.h.*.mlp.c_fc.weight"),
    ("transformer.wte.weight colwise", "model.", "model.transformer.wte.weight"),
])
def test_a_rule_missing_the_wrapper_prefix_names_it(line, shared, write):
    msg = _error(line, WRAPPED)
    assert f"the model's parameter names start with `{shared}`; write `{write}`" in msg
    assert "did you mean" not in msg and "`*` stops at a `.`" not in msg


def test_the_shortest_prefix_that_makes_the_rule_match_is_written():
    msg = _error("h.*.mlp.c_proj.weight rowwise", WRAPPED)
    assert "start with `model.transformer.`; write `model.transformer.h.*.mlp.c_proj.weight`" in msg


def test_no_shared_prefix_keeps_the_did_you_mean():
    msg = _error("weight colwise", ["fc1.weight", "fc2.weight"])
    assert "did you mean fc2.weight?" in msg and "start with" not in msg


def test_a_typo_in_a_wrapped_model_is_still_a_did_you_mean():
    msg = _error("model.transformer.h.*.mlp.c_fc.weigth colwise", WRAPPED)
    assert "did you mean model.transformer.h.*.mlp.c_fc.weight?" in msg


FACTORY = '''
import torch
from torch import nn


class Wrapper(nn.Module):
    def __init__(self, name, inner):
        super().__init__()
        self.add_module(name, inner)
        self.inner = name

    def forward(self, x):
        return getattr(self, self.inner)(x)


def wrapped(name="model"):
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    return Wrapper(name, inner).eval(), (torch.randn(2, 4, 8),), ["x"]


def ddp():
    return wrapped("module")
'''


@pytest.mark.parametrize("factory, prefix", [("wrapped", "model."), ("ddp", "module.")])
def test_the_cli_names_the_prefix_of_a_wrapped_torch_module(tmp_path, capsys, factory, prefix):
    (tmp_path / "m.py").write_text(FACTORY)
    (tmp_path / "s.pcs").write_text("mesh tp=2\n0.weight colwise\n2.weight rowwise\n")
    assert main(["check", f"{tmp_path / 'm.py'}:{factory}", "--spec", str(tmp_path / "s.pcs")]) == 2
    err = capsys.readouterr().err
    assert "s.pcs:2:1" in err and "Traceback" not in err
    assert f"the model's parameter names start with `{prefix}`; write `{prefix}0.weight`" in err
    (tmp_path / "s.pcs").write_text(f"mesh tp=2\n{prefix}0.weight colwise\n{prefix}2.weight rowwise\n")
    assert main(["check", f"{tmp_path / 'm.py'}:{factory}", "--spec", str(tmp_path / "s.pcs")]) == 0
