"""Findings of a trial by a Megatron user with a hand-written GPT, each pinned: a model file
imports its neighbours as ``python FILE.py`` would; an unsupported op's hint names only a
related op or rewrite; a complex dtype is located like other frontend errors; report lines
never show an infinite tolerance as if it were what an OK rests on; a fused parameter's
index and part count are the user's."""
import os
import sys

import pytest

from parcomp.cli import main
from parcomp.errors import FrontendError
from parcomp.frontends.loader import load_model

NEIGHBOUR = '''import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(4, 8, bias=False)

    def forward(self, x):
        return self.w(x)
'''


def _two_files(folder, tag):
    """``folder/m.py`` whose top level imports its neighbour ``folder/<tag>.py``."""
    folder.mkdir()
    (folder / f"{tag}.py").write_text(NEIGHBOUR)
    (folder / "m.py").write_text(f"import torch\nimport {tag}\n\n\n"
                                 f"def net():\n    torch.manual_seed(0)\n"
                                 f"    return {tag}.Net(), (torch.randn(2, 4),), ['x']\n")
    return folder / "m.py"


def test_a_model_file_imports_its_neighbour_from_any_directory(tmp_path, monkeypatch):
    """``parcomp check models/m.py:net`` from another directory: m.py's ``import <tag>``
    finds models/<tag>.py, and sys.path is as it was after loading."""
    tag = "trialf_neighbour_a"
    path = _two_files(tmp_path / "models", tag)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    before = list(sys.path)
    try:
        graph, module, _ = load_model(os.path.relpath(path) + ":net")
    finally:
        sys.modules.pop(tag, None)
    assert type(module).__name__ == "Net" and graph.params
    assert sys.path == before


def test_compile_of_a_model_file_with_a_neighbour_records_the_same_reference(tmp_path, monkeypatch, capsys):
    tag = "trialf_neighbour_b"
    path = _two_files(tmp_path / "models", tag)
    (tmp_path / "s.pcs").write_text("mesh tp=2\nw.weight colwise\n")
    monkeypatch.chdir(tmp_path)
    before = list(sys.path)
    try:
        rc = main(["compile", "models/m.py:net", "--spec", "s.pcs", "-o", "out"])
    finally:
        sys.modules.pop(tag, None)
    assert rc == 0, capsys.readouterr().err
    program = (tmp_path / "out" / "program.py").read_text()
    assert "model: m.py:net" in program and str(tmp_path) not in program
    assert str(tmp_path) not in (tmp_path / "out" / "report.json").read_text()
    assert sys.path == before
