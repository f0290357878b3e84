"""The spec package and the torch emitter stay in modules of about 400 lines (spec/parser.py
was 544: split into syntax, tree, builder and names; backends/torch/emit/__init__.py was 585: split
into emit_nodes and emit_sections), and the old import paths keep working."""
from pathlib import Path

import parcomp.spec as spec_pkg
import parcomp_backends.torch as torch_backend

MAX_LINES = 400  # the project's module size (P.md "Rules")


def test_every_spec_module_is_at_most_400_lines():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted(Path(spec_pkg.__file__).parent.glob("*.py"))}
    assert {n: k for n, k in sizes.items() if k > MAX_LINES} == {}


def test_every_torch_emit_module_is_at_most_400_lines():
    paths = sorted((Path(torch_backend.__file__).parent / "emit").glob("*.py"))
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in paths}
    assert {"__init__.py", "nodes.py", "sections.py"} <= set(sizes)
    assert {n: k for n, k in sizes.items() if k > MAX_LINES} == {}


def test_the_emit_module_still_exports_what_callers_import():
    from parcomp_backends.torch import EmitError, emit, emit_program
    from parcomp_backends.torch.emit import nodes as emit_nodes, sections as emit_sections

    assert emit.emit_program is emit_program and emit.EmitError is emit_nodes.EmitError is EmitError
    for name in ("OP_FORMATS", "IN_PLACE_FORMATS", "ASYNC_FORMATS", "ATTR_DEFAULTS", "TORCH_DTYPES", "node_code", "py_literal"):
        assert getattr(emit, name) is getattr(emit_nodes, name), name
    for name in ("python_names", "RESERVED", "COMMENT_WIDTH"):
        assert getattr(emit, name) is getattr(emit_sections, name), name
    assert emit.OP_FORMATS["relu"] == "torch.relu({0})" and "forward" in emit.RESERVED


def test_the_parser_module_still_exports_what_callers_import():
    from parcomp.passes import bind_layouts
    from parcomp.spec import parser
    from parcomp.spec.names import check_names

    assert parser.check_names is check_names is bind_layouts.check_names is spec_pkg.check_names
    assert parser.parse_spec is spec_pkg.parse_spec and parser.load_spec is spec_pkg.load_spec
    assert "PATTERN" in parser.WORDS and parser._PARSER.terminals
    assert parser.parse_spec("mesh tp=2\nw colwise\n").rules[0].pattern == "w"
