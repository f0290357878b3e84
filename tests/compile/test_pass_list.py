"""The one pass list: ``--print-ir-after-all`` shows every pass of it, in its order, for a
training, a pipeline and an MoE spec; no other module holds a second list or runs passes in
sequence; docs/ARCHITECTURE.md's table is the list's."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from parcomp.cli.main import main
from parcomp.ir.text import print_graph
from parcomp.passes import pass_list
from parcomp.spec import load_spec

try:  # imported here, not under capsys: transformers' log handler keeps the stderr it met first
    import transformers
except ImportError:
    transformers = None

ROOT = Path(__file__).resolve().parents[2]
SPECS = ROOT / "specs"
MODELS = SPECS / "models.py"
HEADER = re.compile(r"^# ----- IR after (\S+)(?: \(unchanged\))? -----$", re.M)


def printed_passes(tmp_path, capsys, model: str, spec: Path) -> list:
    """The pass names ``parcomp compile --print-ir-after-all`` prints, in order (a pass that
    prints several graphs, as split-stages one per stage program, counted once)."""
    rc = main(["compile", model, "--spec", str(spec), "-o", str(tmp_path / "out"), "--print-ir-after-all"])
    out = capsys.readouterr().out
    assert rc == 0, out[-2000:]
    names = []
    for name in HEADER.findall(out):
        if not names or names[-1] != name:
            names.append(name)
    return names


def expected(spec: Path) -> list:
    return [p.name for p in pass_list.passes_for(load_spec(spec))]


def test_a_training_spec_prints_every_pass_of_the_list_in_order(tmp_path, capsys):
    if transformers is None:
        pytest.skip("the shipped GPT-2 MLP spec imports transformers' GPT2MLP; transformers is not installed")
    spec = SPECS / "gpt2_mlp_tp2_train.pcs"
    got = printed_passes(tmp_path, capsys, f"{MODELS}:gpt2_mlp", spec)
    assert got == expected(spec)
    assert {"autodiff", "pad-vocab", "bind-layouts", "shard-prop", "free-dead"} <= set(got)
    assert "split-stages" not in got and "moe-capacity" not in got  # conditions: no pp, no moe line


def test_a_pipeline_spec_prints_every_pass_of_the_list_in_order(tmp_path, capsys):
    from test_pipeline import TRAIN, chain_graph
    from test_pipeline_tp import HEAD

    (tmp_path / "chain.pcir").write_text(print_graph(chain_graph(blocks=4)))
    spec = tmp_path / "pp.pcs"
    spec.write_text(f"{HEAD}{TRAIN} microbatches=2\n")
    got = printed_passes(tmp_path, capsys, str(tmp_path / "chain.pcir"), spec)
    assert got == expected(spec)
    assert got[-2:] == ["split-stages", "lower-stages"] and "autodiff" in got


def test_an_moe_spec_prints_every_pass_of_the_list_in_order(tmp_path, capsys):
    if transformers is None:
        pytest.skip("the MoE block of specs/models.py imports transformers; it is not installed")
    spec = tmp_path / "moe.pcs"
    spec.write_text((SPECS / "moe_ep2_train.pcs").read_text() + "moe capacity_factor=1.0\n")
    got = printed_passes(tmp_path, capsys, f"{MODELS}:moe_block", spec)
    assert got == expected(spec)
    assert got[0] == "moe-capacity" and "moe-ragged" in got


def test_the_list_holds_the_rewrites_once_hidden_inside_other_steps():
    names = [p.name for p in pass_list.PASSES]
    assert len(names) == len(set(names))
    for name in ("moe-capacity", "pad-vocab", "bias-follows", "fused-bias-follows", "attention-heads",
                 "check-even", "split-stages", "lower-stages", "fuse-reductions", "fuse-matmuls", "bucket-dp-grads",
                 "moe-ragged", "overlap-collectives", "in-place", "free-dead"):
        assert name in names
    lower = [p.name for p in pass_list.group("lower")]
    assert lower == names[names.index("fuse-reductions"):names.index("free-dead") + 1]
    conditional = {p.name for p in pass_list.PASSES if p.when is not None}
    assert conditional == {"moe-capacity", "pin-sequence-parallel", "pin-context-parallel", "autodiff",
                           "split-stages", "lower-stages"}
    assert all(p.condition for p in pass_list.PASSES if p.when is not None)  # said in the list and the docs


#: what the compile order was once spread over: a second list, or passes run in sequence
SECOND_LISTS = re.compile(r"\b(forward_pipeline|SPEC_LOWERING)\b|\bLOWERING\s*=|import .*\bLOWERING\b")
SEQUENCE = re.compile(r"\b(?:shard_prop|insert_collectives|localize|decompose_reductions|bind_param_layouts|"
                      r"add_training_step)\([^()]*\b(?:shard_prop|insert_collectives|localize|"
                      r"decompose_reductions|bind_param_layouts|add_training_step|bind_layouts)\(")


def offenders(files) -> list:
    """``path:line`` of each second pass list or nested pass call outside the pass-list file."""
    out = []
    for path in files:
        if path.name == "pass_list.py" and path.parent.name == "passes":
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if SECOND_LISTS.search(line) or SEQUENCE.search(line):
                out.append(f"{path}:{i}: {line.strip()}")
    return out


def test_no_other_module_holds_a_pass_list_or_runs_passes_in_sequence():
    files = [p for top in ("parcomp", "backends") for p in sorted((ROOT / top).rglob("*.py"))]
    assert offenders(files) == []


def test_the_sequence_check_can_fail(tmp_path):
    bad = tmp_path / "stage_shard.py"
    bad.write_text("def f(g):\n    return localize(insert_collectives(shard_prop(g)))\n"
                   "LOWERING = ()\n")
    assert [o.split(": ")[0] for o in offenders([bad])] == [f"{bad}:2", f"{bad}:3"]


def test_the_architecture_doc_shows_the_list():
    doc = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    assert pass_list.pass_table() in doc, "regenerate the table: python -c 'from parcomp.passes.pass_list " \
                                          "import pass_table; print(pass_table())'"
