"""The Program: phases as fields (never from names), provenance, loop facts, the import graph."""
from __future__ import annotations

from pathlib import Path

import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.compile.program import Program
from parcomp.ir import parse_graph
from parcomp.spec import load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[1].parent
SPECS = ROOT / "specs"

# a model whose modules are called ``opt`` and ``bw``: the old name-prefix rule called its
# forward traffic optimizer / backward traffic
OPT_BW_MODEL = """\
%x: f32[2,8] = input()
%opt.weight: f32[16,8] = param()
%bw.weight: f32[8,16] = param()
%opt.wt: f32[8,16] = permute(%opt.weight) {perm=(1, 0)}
%opt.h: f32[2,16] = matmul(%x, %opt.wt)
%bw.a: f32[2,16] = relu(%opt.h)
%bw.wt: f32[16,8] = permute(%bw.weight) {perm=(1, 0)}
%bw.y: f32[2,8] = matmul(%bw.a, %bw.wt)
return %bw.y
"""
OPT_BW_SPEC = "mesh tp=2\nopt.weight colwise\nbw.weight rowwise\ninput x replicated\n"


def _tiny():
    graph = parse_graph((SPECS / "tiny_relu_mlp.pcir").read_text())
    return compile_graph(graph, load_spec(SPECS / "tiny_relu_mlp_tp2.pcs"))


def test_user_modules_named_opt_and_bw_are_forward_code():
    c = compile_graph(parse_graph(OPT_BW_MODEL), parse_spec(OPT_BW_SPEC, "f.pcs"))
    assert set(c.program_.phases.values()) == {"forward"}
    assert [(r["kind"], r["producer"], r["phase"]) for r in c.report["collectives"]] == [
        ("all_reduce", "bw.y", "forward")]


def test_training_phases_are_marked_by_autodiff_not_read_from_names():
    spec = parse_spec(OPT_BW_SPEC + "train loss=mse optimizer=sgd(lr=0.1, momentum=0.9)\n", "t.pcs")
    c = compile_graph(parse_graph(OPT_BW_MODEL), spec)
    prog, graph = c.program_, c.program
    phases = [(r["producer"], r["phase"]) for r in c.report["collectives"]]
    assert phases[0] == ("bw.y", "forward")  # the model's bw.y is forward code
    assert {ph for _, ph in phases[1:]} <= {"loss", "backward", "optimizer"} and len(phases) > 1
    for name in ("opt.h", "bw.a", "bw.y", "opt.wt"):
        assert prog.phases[name] == "forward"
    assert prog.phases["loss"] == "loss" and prog.phases["target"] == "loss"
    assert {prog.phases[f"{p}.momentum_buffer"] for p in ("opt.weight", "bw.weight")} == {"optimizer"}
    assert any(ph == "backward" for n, ph in prog.phases.items()
               if graph[n].op in ("matmul", "matmul_t", "dense", "addmm"))
    t = prog.train
    assert t.state == ("opt.weight.momentum_buffer", "bw.weight.momentum_buffer")
    assert set(t.carried) == {n.name for n in graph.params} and t.step is None
    assert (t.optimizer, dict(t.hyperparameters)["momentum"], t.loss_output) == ("sgd", 0.9, "loss")


def test_default_output_layout_is_a_flag_not_words():
    c = compile_graph(parse_graph(OPT_BW_MODEL), parse_spec(OPT_BW_SPEC, "f.pcs"))
    pin = c.logical["bw.y.as_output"]
    assert pin.attr("default") is True
    named = compile_graph(parse_graph(OPT_BW_MODEL),
                          parse_spec(OPT_BW_SPEC + "output bw.y replicated\n", "f.pcs"))
    assert named.logical["bw.y.as_output"].attr("default") is None


def test_provenance_names_the_spec_rule_by_basename_and_line():
    c = _tiny()
    prog = c.program_
    assert isinstance(prog, Program) and prog.graph is c.program
    assert prog.provenance["fc1.weight"].spec_ref == "tiny_relu_mlp_tp2.pcs:4"
    assert prog.provenance["fc2.weight"].spec_ref == "tiny_relu_mlp_tp2.pcs:5"
    (coll,) = prog.collectives
    assert (coll.kind, coll.provenance.spec_ref, coll.bytes) == ("all_reduce", "tiny_relu_mlp_tp2.pcs:7", 8)
    assert str(SPECS) not in coll.reason and "tiny_relu_mlp_tp2.pcs:7" in coll.reason
    assert c.report["collectives"][0]["spec_line"] == "tiny_relu_mlp_tp2.pcs:7"
    assert prog.group_ranks("tp") == [[0, 1]]


def test_emitted_lines_carry_their_spec_rule():
    pytest.importorskip("torch")
    from parcomp_backends.torch import emit_program

    text = emit_program(_tiny(), "cpu")
    lines = text.splitlines()
    coll = [ln for ln in lines if "= all_reduce" in ln]
    assert coll and all(ln.endswith("tiny_relu_mlp_tp2.pcs:7") for ln in coll)
    for p, line in (("fc1.weight", 4), ("fc2.weight", 5)):
        (load,) = [ln for ln in lines if ln.strip().startswith(f'out["{p}"] = place(')]
        assert load.endswith(f"# tiny_relu_mlp_tp2.pcs:{line}")
    assert str(SPECS) not in text


def test_emitted_names_come_from_module_paths():
    torch = pytest.importorskip("torch")
    from parcomp.frontends.torch.export import import_torch
    from parcomp_backends.torch import emit_program

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = torch.nn.Linear(4, 8), torch.nn.Linear(8, 4)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)))

    graph = import_torch(MLP(), (torch.zeros(2, 4),))
    c = compile_graph(graph, parse_spec("mesh tp=2\nup.weight colwise\ndown.weight rowwise\n", "m.pcs"))
    text = emit_program(c, "cpu")
    assert text == emit_program(c, "cpu")
    assert " up = " in text and " down = " in text and "down_all_reduce = all_reduce" in text
