"""The spec package and the torch emitter were split into modules (spec/parser.py into syntax,
tree, builder and names; backends/torch/emit/__init__.py into nodes and sections), and the old
import paths keep working. Modules are cut by concept, not by a line count: no test
holds them to a size."""
import parcomp.spec as spec_pkg
import parcomp_backends.torch as torch_backend  # noqa: F401


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
