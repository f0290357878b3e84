"""The spec package stays in modules of about 400 lines (parser.py was 544: split into
syntax, tree, builder and names), and the old import paths keep working."""
from pathlib import Path

import parcomp.spec as spec_pkg

MAX_LINES = 400  # the project's module size (P.md "Rules")


def test_every_spec_module_is_at_most_400_lines():
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted(Path(spec_pkg.__file__).parent.glob("*.py"))}
    assert {n: k for n, k in sizes.items() if k > MAX_LINES} == {}


def test_the_parser_module_still_exports_what_callers_import():
    from parcomp.passes import bind_layouts
    from parcomp.spec import parser
    from parcomp.spec.names import check_names

    assert parser.check_names is check_names is bind_layouts.check_names is spec_pkg.check_names
    assert parser.parse_spec is spec_pkg.parse_spec and parser.load_spec is spec_pkg.load_spec
    assert "PATTERN" in parser.WORDS and parser._PARSER.terminals
    assert parser.parse_spec("mesh tp=2\nw colwise\n").rules[0].pattern == "w"
