"""Tests of the parallel spec language (.pcs): parsing, patterns, errors, name checks."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parcomp.errors import SourceLoc, SpecError
from parcomp.ir.types import Mesh, P, R, Shard
from parcomp.spec import LayoutSpec, Rule, Spec, TrainSpec, check_names, load_spec, parse_spec
from parcomp.spec.model import MAX_MESH_RANKS

SPECS = sorted((Path(__file__).resolve().parents[1].parent / "specs").glob("*.pcs"))
WORDS = ("replicated", "split-hidden", "split-seq", "partial-sum", "colwise", "rowwise")


def spec_error(text: str, file: str = "t.pcs") -> SpecError:
    with pytest.raises(SpecError) as info:
        parse_spec(text, file)
    return info.value


def assert_at(err: SpecError, line: int, col: int, *fragments: str) -> None:
    """``err`` renders as file:line:col, the source line, a caret under col, the message."""
    rendered = str(err).split("\n")
    assert rendered[0] == f"t.pcs:{line}:{col}"
    text = err.loc.text.rstrip()
    if len(text) <= 100 and text.isprintable():
        assert rendered[1] == "    " + text
        assert rendered[2] == "    " + " " * (col - 1) + "^"
    else:  # shown printable, as a window around the column: the caret under its character
        assert len(rendered[1]) < 120 and rendered[1][rendered[2].index("^")] in text[col - 1:col] + "?"
    assert rendered[3].startswith("error: ")
    for frag in fragments:
        assert frag in err.message, (frag, err.message)


# --- the example specs ---------------------------------------------------------------


def test_specs_dir_has_the_examples():
    names = {p.name for p in SPECS}
    assert {"gpt2_mlp_tp2.pcs", "torch_mlp_tp2.pcs", "torch_mlp_tp4.pcs", "gpt2_mlp_tp2_seq.pcs",
            "gpt2_mlp_dp2_tp2.pcs", "tiny_relu_mlp_tp2.pcs"} <= names


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_every_example_spec_parses(path):
    spec = load_spec(path)
    assert spec.file == str(path)
    assert spec.rules and spec.mesh.size >= 2
    for rule in spec.rules:
        assert rule.loc.file == str(path) and rule.loc.text.lstrip().startswith(
            (rule.pattern, rule.target))


def test_gpt2_mlp_tp2_exact():
    spec = load_spec(next(p for p in SPECS if p.name == "gpt2_mlp_tp2.pcs"))
    assert spec.mesh == Mesh((("tp", 2),))
    assert [(r.target, r.pattern, r.layout) for r in spec.rules] == [
        ("param", "c_fc.weight", LayoutSpec("colwise", None, "tp")),
        ("param", "c_proj.weight", LayoutSpec("rowwise", None, "tp")),
        ("input", "x", LayoutSpec("replicated", None, "tp")),
        ("output", "output", LayoutSpec("replicated", None, "tp")),
    ]
    assert spec.topology is None and spec.train is None


def test_dp2_tp2_example():
    spec = load_spec(next(p for p in SPECS if p.name == "gpt2_mlp_dp2_tp2.pcs"))
    assert spec.mesh == Mesh((("dp", 2), ("tp", 2))) and spec.topology == (2, 2)
    lay = {r.pattern: r.layout for r in spec.rules}
    assert lay["c_fc.weight"] == LayoutSpec("colwise", None, "tp")
    assert lay["x"] == lay["output"] == LayoutSpec(None, (Shard(0), R), None)


def test_torch_patterns_start_with_digits():
    spec = load_spec(next(p for p in SPECS if p.name == "torch_mlp_tp4.pcs"))
    assert spec.mesh.size == 4
    assert [r.pattern for r in spec.rules_for("param")] == ["0.weight", "2.weight"]


# --- exact results of single statements ---------------------------------------------


def test_rule_exact_dataclass():
    spec = parse_spec("mesh tp=2\nc_fc.weight   colwise  # comment\n", "t.pcs")
    assert spec == Spec(
        mesh=Mesh((("tp", 2),)),
        rules=(Rule("param", "c_fc.weight", LayoutSpec("colwise", None, "tp"),
                    SourceLoc("t.pcs", 2, 1, "c_fc.weight   colwise  # comment")),),
        file="t.pcs", topology=None, train=None)


@pytest.mark.parametrize("line, layout", [
    ("x replicated", LayoutSpec("replicated", None, "tp")),
    ("x split-hidden over dp", LayoutSpec("split-hidden", None, "dp")),
    ("x [S(0), R]", LayoutSpec(None, (Shard(0), R), None)),
    ("x [P(sum), S(1)]", LayoutSpec(None, (P, Shard(1)), None)),
    ("x tp=S(1)", LayoutSpec(None, (R, Shard(1)), None)),
    ("x dp=S(0) tp=R", LayoutSpec(None, (Shard(0), R), None)),
    ("x tp = P  dp = S(2)", LayoutSpec(None, (Shard(2), P), None)),
    ("x S(1) over tp", LayoutSpec(None, (R, Shard(1)), "tp")),
    ("x S(0) over dp", LayoutSpec(None, (Shard(0), R), "dp")),
    ("x P", LayoutSpec(None, (R, P), "tp")),
    ("x R", LayoutSpec(None, (R, R), "tp")),
])
def test_layout_forms(line, layout):
    spec = parse_spec(f"mesh dp=2 tp=2\n{line}\n")
    assert spec.rules[0].layout == layout


@pytest.mark.parametrize("line, target, pattern, col", [
    ("param h.*.attn.c_attn.weight colwise", "param", "h.*.attn.c_attn.weight", 7),
    ("input  x  replicated", "input", "x", 8),
    ("output output replicated", "output", "output", 8),
    ("activation act split-hidden", "activation", "act", 12),
    ("input input_ids replicated", "input", "input_ids", 7),
    ("output_proj.weight rowwise", "param", "output_proj.weight", 1),
    ("param input rowwise", "param", "input", 7),
    ("0.weight colwise", "param", "0.weight", 1),
    ("  **.weight replicated", "param", "**.weight", 3),
])
def test_targets_and_patterns(line, target, pattern, col):
    rule = parse_spec(f"mesh tp=2\n{line}").rules[0]
    assert (rule.target, rule.pattern) == (target, pattern)
    assert (rule.loc.line, rule.loc.col, rule.loc.text) == (2, col, line)


def test_every_layout_word():
    text = "mesh tp=2\n" + "\n".join(f"p{i} {w}" for i, w in enumerate(WORDS))
    assert tuple(r.layout.word for r in parse_spec(text).rules) == WORDS


def test_topology_and_train():
    spec = parse_spec("# header\n\nmesh dp=2 tp=2 # rank order: tp fastest\n"
                      "topology nodes=1 devices_per_node=4\n"
                      "train loss=mse optimizer=sgd(momentum=0.9, lr=3e-4) batch=8 steps=3"
                      ' trainable="a b" output=out\n')
    assert spec.topology == (1, 4)
    assert spec.train == TrainSpec(
        (("batch", 8), ("loss", "mse"), ("optimizer", ("sgd", (("lr", 3e-4), ("momentum", 0.9)))),
         ("output", "out"), ("steps", 3), ("trainable", "a b")),
        SourceLoc("<string>", 5, 1, spec.train.loc.text))
    assert parse_spec("mesh tp=2\ntrain optimizer=adamw()\n").train.get("optimizer") == ("adamw", ())
    assert spec.train.get("batch") == 8 and spec.train.get("nope", 7) == 7
    assert spec.rules == ()


@pytest.mark.parametrize("mesh, axis", [
    ("tp=2", "tp"), ("dp=4", "dp"), ("dp=2 tp=2", "tp"), ("tp=2 dp=2", "tp"),
    ("dp=2 pp=2", "pp"), ("a=1 b=2 c=3", "c"),
])
def test_default_axis(mesh, axis):
    spec = parse_spec(f"mesh {mesh}\nw colwise\n")
    assert spec.default_axis() == axis and spec.rules[0].layout.axis == axis


def test_windows_line_endings_and_no_final_newline():
    spec = parse_spec("mesh tp=2\r\nw colwise\r\nx rowwise")
    assert [r.pattern for r in spec.rules] == ["w", "x"]


# --- patterns -------------------------------------------------------------------------


@pytest.mark.parametrize("pattern, name, ok", [
    ("h.*.mlp.c_fc.weight", "h.0.mlp.c_fc.weight", True),
    ("h.*.mlp.c_fc.weight", "h.11.mlp.c_fc.weight", True),
    ("h.*.mlp.c_fc.weight", "h.0.x.mlp.c_fc.weight", False),
    ("h.*.mlp.c_fc.weight", "h..mlp.c_fc.weight", False),
    ("c_fc.weight", "c_fc.weight", True),
    ("c_fc.weight", "c_fcxweight", False),
    ("c_fc.weight", "h.0.c_fc.weight", False),
    ("c_fc.weight", "c_fc.weight2", False),
    ("c_*.weight", "c_fc.weight", True),
    ("c_*.weight", "c_.weight", False),
    ("*.weight", "0.weight", True),
    ("*.weight", "a.b.weight", False),
    ("**.weight", "a.b.weight", True),
    ("**.weight", "weight", False),
    ("h.**.weight", "h.0.mlp.weight", True),
    ("h.**.weight", "h.0.weight", True),
    ("h.**", "h.0.mlp.c_fc.bias", True),
    ("h.**", "wte.weight", False),
])
def test_pattern_matching(pattern, name, ok):
    rule = parse_spec(f"mesh tp=2\n{pattern} replicated\n").rules[0]
    assert rule.matches(name) is ok


# --- errors ---------------------------------------------------------------------------


def test_error_missing_layout():
    err = spec_error("mesh tp=2\nc_fc.weight   # no layout\n")
    assert_at(err, 2, 12, "expected a layout", "replicated, split-hidden",
              "got the end of the line")


def test_error_bad_character():
    assert_at(spec_error("mesh tp=2\nx @colwise\n"), 2, 3, "expected a layout", "character '@'")


def test_error_trailing_junk():
    assert_at(spec_error("mesh tp=2\nx colwise extra\n"), 2, 11,
              "expected 'over AXIS' or the end of the line; got 'extra'")


def test_error_per_axis_list_over_an_axis_names_the_one_axis_syntax():
    """``[S(0)] over dp``: a per-axis list already gives every axis; the error says how to
    write one axis's placement (as ``rowwise over dp`` is written)."""
    assert_at(spec_error("mesh dp=2 tp=2\nc_fc.weight [S(0)] over dp\n"), 2, 20,
              "takes no 'over dp'", "'S(0) over dp' or 'dp=S(0)'", "[S(0), R]")
    assert parse_spec("mesh dp=2 tp=2\nc_fc.weight S(0) over dp\n", "t.pcs").rules[0].layout == \
        LayoutSpec(None, (Shard(0), R), "dp")


def test_error_bad_statement_start():
    assert_at(spec_error("mesh tp=2\n= x\n"), 2, 1, "expected a statement", "got '='")
    assert_at(spec_error("mesh tp=2\ninput\n"), 2, 6, "expected a name pattern")


def test_error_mesh_without_axes():
    assert_at(spec_error("mesh\n"), 1, 5, "expected a mesh axis such as tp=2")


def test_error_placement_expected():
    assert_at(spec_error("mesh tp=2\nx tp=colwise\n"), 2, 6,
              "expected a placement (R, S(d) or P); got 'colwise'")


def test_error_unknown_layout_word():
    assert_at(spec_error("mesh tp=2\nc_fc.weight colwize\n"), 2, 13,
              "unknown layout word 'colwize'; did you mean colwise?", "split-seq")


def test_error_unknown_axis_in_over():
    assert_at(spec_error("mesh dp=2 tp=2\nw colwise over pp\n"), 2, 16,
              "unknown mesh axis 'pp' in 'over'", "the mesh has axes: dp, tp")


def test_error_unknown_axis_in_axis_layout():
    assert_at(spec_error("mesh dp=2 tp=2\nx tpp=S(0)\n"), 2, 3,
              "unknown mesh axis 'tpp'", "did you mean tp?", "the mesh has axes: dp, tp")


def test_error_repeated_axis_in_layout():
    assert_at(spec_error("mesh dp=2 tp=2\nx tp=S(0) tp=R\n"), 2, 11, "tp is given twice")


@pytest.mark.parametrize("layout, n", [("[S(0)]", 1), ("[R, R, R]", 3)])
def test_error_wrong_number_of_placements(layout, n):
    assert_at(spec_error(f"mesh dp=2 tp=2\nx {layout}\n"), 2, 3,
              f"has {n} placement", "the mesh has 2 axes: dp, tp")


def test_error_wrong_number_of_placements_one_axis():
    assert_at(spec_error("mesh tp=2\nx [R, R]\n"), 2, 3, "the mesh has 1 axis: tp")


def test_error_missing_mesh():
    assert_at(spec_error("c_fc.weight colwise\nmesh tp=2\n"), 1, 1,
              "the first statement must be the mesh")
    err = spec_error("# nothing here\n\n")
    assert_at(err, 1, 1, "no mesh statement")
    assert str(spec_error("")) == "t.pcs:1:1\nerror: the spec is empty: it has no statements, " \
                                  "so no mesh statement; start it with one such as 'mesh tp=2'"


def test_error_repeated_mesh():
    assert_at(spec_error("mesh tp=2\nw colwise\nmesh tp=4\n"), 3, 1,
              "mesh is given twice (first on line 1)")


@pytest.mark.parametrize("size", ["0", "-1"])
def test_error_mesh_axis_size(size):
    assert_at(spec_error(f"mesh dp=2 tp={size}\n"), 1, 14, f"tp has size {size}", ">= 1")


def test_error_duplicate_axis_names():
    assert_at(spec_error("mesh tp=2 tp=2\n"), 1, 11, "mesh axis tp is given twice")


def test_error_topology():
    assert_at(spec_error("mesh tp=2\ntopology nodes=2 devices_per_node=2\n"), 2, 1,
              "2x2=4 devices", "has 2 ranks")
    assert_at(spec_error("mesh tp=2\ntopology node=1 devices_per_node=2\n"), 2, 10,
              "unknown topology key 'node'; did you mean nodes?")
    assert_at(spec_error("mesh tp=2\ntopology nodes=1\n"), 2, 1, "needs both")
    assert_at(spec_error("mesh tp=2\ntopology nodes=1 devices_per_node=2\ntopology nodes=1 "
                         "devices_per_node=2\n"), 3, 1, "topology is given twice")


def test_error_train():
    assert_at(spec_error("mesh tp=2\ntrain a=1 a=2\n"), 2, 11, "option a is given twice")
    assert_at(spec_error("mesh tp=2\ntrain o=sgd(lr=1, lr=2)\n"), 2, 19,
              "argument lr is given twice")
    assert_at(spec_error("mesh tp=2\ntrain batch=\n"), 2, 13, "expected a value")
    assert_at(spec_error("mesh tp=2\ntrain\ntrain\n"), 3, 1, "train is given twice")


BIG = "1" * 500  # a whole number too large for a float


@pytest.mark.parametrize("options,msg", [
    ("optimizer=adamw(lr=1e-3, beta1=1.5)", "adamw(beta1=1.5) must be less than 1 (legal: 0 <= x < 1)"),
    ("optimizer=adamw(beta2=1)", "adamw(beta2=1) must be less than 1 (legal: 0 <= x < 1)"),
    ("optimizer=adamw(beta1=-0.1)", "adamw(beta1=-0.1) must not be negative (legal: 0 <= x < 1)"),
    ("optimizer=adamw(eps=-1e-8)", "adamw(eps=-1e-08) must not be negative (legal: 0 <= x)"),
    ("optimizer=adamw(weight_decay=-0.01)", "adamw(weight_decay=-0.01) must not be negative"),
    ("optimizer=sgd(lr=-1)", "sgd(lr=-1) must not be negative (legal: 0 <= x)"),
    ("optimizer=sgd(momentum=-0.5)", "sgd(momentum=-0.5) must not be negative"),
    ("optimizer=sgd(lr=1e400)", "sgd(lr=...) must be a finite number, not inf"),
    (f"optimizer=sgd(lr={BIG})", "sgd(lr=...) must be a finite number, not inf"),
    ("steps=100000000000", "steps=100000000000 is out of range: it must be at least 1 and at most 1,000,000"),
    ("steps=1e400", "steps must be a finite number, not inf"),
    (f"steps={BIG}", "steps must be a finite number, not inf"),
    ("steps=-3", "steps=-3 is out of range"),
    ("batch=0", "batch=0 is out of range: it must be at least 1 and at most 16,777,216"),
    ("batch=16777217", "batch=16777217 is out of range"),
    ("zero=1e400", "zero must be a finite number"),
    ("output=3", "output=3: name a model output"),
    ("loss=hinge", "loss 'hinge' is not supported"),
    ("optimiser=sgd", "unknown train option 'optimiser'; did you mean 'optimizer'?"),
])
def test_train_options_are_checked_with_their_ranges_when_parsed(options, msg):
    line = f"train loss=mse {options}".replace("loss=mse loss=", "loss=")
    key = re.search(r"\((?:lr=[^,]*, )?(\w+)=", options) or re.match(r"(\w+)=", options)
    assert_at(spec_error(f"mesh tp=2\n{line}\n"), 2, line.index(key.group(1) + "=") + 1, msg)


def test_train_options_at_their_limits_are_accepted():
    spec = parse_spec("mesh dp=2\ntrain optimizer=adamw(lr=0, beta1=0, beta2=0.999999, eps=0, "
                      "weight_decay=0) steps=1000000 batch=16777216 zero=2 output=\"a.b\"\n")
    assert spec.train.get("steps") == 1_000_000 and spec.train.get("output") == "a.b"


def test_error_partial_op_and_empty_component():
    assert_at(spec_error("mesh tp=2\nx P(min)\n"), 2, 5, "only P(sum) and P(max) are supported")
    assert_at(spec_error("mesh tp=2\na..b R\n"), 2, 1, "empty dotted component")


def test_load_spec_missing_file(tmp_path):
    missing = tmp_path / "nope.pcs"
    with pytest.raises(SpecError) as info:
        load_spec(missing)
    assert str(missing) in str(info.value) and info.value.loc is None


def test_load_spec_reports_the_file_name(tmp_path):
    path = tmp_path / "bad.pcs"
    path.write_text("mesh tp=2\nw colwize\n")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}:2:3\n    w colwize\n      ^\n")


# --- careless text: BOM, non-ASCII, control characters, huge numbers, words ----------


def test_a_leading_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.pcs"
    path.write_bytes(b"\xef\xbb\xbfmesh tp=2\nw colwise\n")
    spec = load_spec(path)
    assert spec.mesh == Mesh((("tp", 2),)) and [r.pattern for r in spec.rules] == ["w"]
    assert_at(spec_error("\ufeffmesh tp=2\nw colwize\n"), 2, 3, "unknown layout word")


def test_a_non_ascii_character_in_a_name_is_named_with_its_column():
    err = spec_error("mesh tp=2\nfc1.w\u00e9ight colwise\n")
    assert_at(err, 2, 6, "the character '\u00e9' (U+00E9) is not allowed in a name",
              "names use A-Z, a-z, 0-9, _ and .")
    assert "expected a layout" not in err.message


@pytest.mark.parametrize("text, line, col, needle", [
    ("mesh tp=2\nx\x00 R\n", 2, 2, "the character '\\x00' (U+0000) is not allowed in a name"),
    ("mesh tp=2\n\u2003x R\n", 2, 1, "the character '\\u2003' (U+2003) is not allowed outside"),
    ("mesh tp=2\nx R \x1b[31m\n", 2, 5, "the character '\\x1b' (U+001B) is not allowed outside"),
])
def test_control_and_odd_characters_are_named(text, line, col, needle):
    err = spec_error(text)
    assert err.loc.line == line and err.loc.col == col and needle in err.message
    assert all(c == "\n" or c.isprintable() for c in str(err))  # shown, never sent to the terminal


def test_a_form_feed_does_not_shift_line_numbers():
    # str.splitlines() breaks at \f and \x1c; lark does not: the caret must show lark's line
    err = spec_error("mesh tp=2\f\nw\x1c colwise\nx colwize\n")
    assert err.loc.line == 2 and "w" in err.loc.text
    err = spec_error("mesh tp=2\f\nw colwise\fq\nx R\n")
    assert str(err) == ("t.pcs:2:11\n    w colwise?q\n              ^\n"
                        "error: expected 'over AXIS' or the end of the line; got 'q'")


@pytest.mark.parametrize("text, col", [
    ("mesh tp=2\nx tp=S(" + "9" * 5000 + ")\n", 8),
    ("mesh tp=2\nx [S(" + "9" * 30 + ")]\n", 6),
    ("mesh tp=2\ntopology nodes=1 devices_per_node=" + "7" * 20 + "\n", 35),
])
def test_numbers_too_large_are_located(text, col):
    err = spec_error(text)
    assert err.loc.col == col and "digits; at most 18" in err.message
    assert max(len(x) for x in str(err).splitlines()) < 140  # the long line shown as a window


def test_a_very_long_line_is_shown_as_a_window_around_the_column():
    err = spec_error("mesh tp=2\n" + "x" * 10000 + " @\n")
    shown = str(err).splitlines()
    assert shown[0] == "t.pcs:2:10002" and shown[1].endswith("x @") and shown[1].startswith("    ...")
    assert shown[2].index("^") == shown[1].index("@")


def test_every_terminal_of_both_grammars_has_words():
    from parcomp.ir import text as pcir
    from parcomp.spec import parser as pcs
    for mod in (pcir, pcs):
        names = {t.name for t in mod._PARSER.terminals} | {"$END"}
        assert names - set(mod.WORDS) == set(), mod.__name__
        assert not [w for w in mod.WORDS.values() if re.fullmatch(r"[A-Z_$]+", w)]  # words


TERMINALS = ("LSQB", "RSQB", "LPAR", "EQUAL", "_NL", "$END", "ESCAPED_STRING", "SIGNED_INT",
             "PATTERN ", "NAME,", "OVER,", "MESH", "WS_INLINE", "__IGNORE")


@pytest.mark.parametrize("text", ["mesh tp=2\nx [R,\n", "mesh tp=2\nx tp=S(\n", "mesh tp=\n",
                                  "mesh tp=2\ntrain a=b(c=)\n", "mesh tp=2\nx colwise over\n",
                                  "mesh tp=2\ntopology nodes\n", "mesh tp=2\nx P(\n", "mesh tp=2\n)\n"])
def test_syntax_errors_never_name_grammar_tokens(text):
    err = spec_error(text)
    assert err.message.startswith(("expected ", "unexpected ")), err.message
    assert not [t for t in TERMINALS if t in err.message], err.message


def test_an_empty_spec_says_it_is_empty():
    for text in ("", "\n\n", "# only a comment\n", "\ufeff"):
        assert "the spec is empty" in spec_error(text).message


def test_load_spec_not_utf8(tmp_path):
    path = tmp_path / "b.pcs"
    path.write_bytes(b"mesh tp=2\n\xff\n")
    with pytest.raises(SpecError, match="is not UTF-8 text: byte 0xff at offset 10") as info:
        load_spec(path)
    assert info.value.where == str(path)


# --- check_names ----------------------------------------------------------------------

PARAMS = ["h.0.mlp.c_fc.weight", "h.0.mlp.c_fc.bias", "h.1.mlp.c_fc.weight", "c_proj.weight"]


def test_check_names_ok():
    spec = parse_spec("mesh tp=2\nh.*.mlp.c_fc.weight colwise\nc_proj.weight rowwise\n"
                      "input x replicated\noutput output replicated\nactivation h* split-hidden\n")
    check_names(spec, PARAMS, ["x"], ["output"], ["h1", "h2"])


@pytest.mark.parametrize("line, col, hint", [
    ("c_proj.weigth rowwise", 1, "did you mean c_proj.weight?"),
    ("h.*.mlp.c_fc.weigth colwise", 1, "did you mean h.*.mlp.c_fc.weight?"),
    ("input  xx replicated", 8, "input rule 'xx' matches no input of the model; did you mean x?"),
    ("output out replicated", 8, "did you mean output?"),
    ("activation zzz split-hidden", 12, "(the model's values: h1, h2)"),
    ("* colwise", 1, "`*` stops at a `.` and `**` crosses it"),
])
def test_check_names_errors(line, col, hint):
    spec = parse_spec(f"mesh tp=2\n{line}\n", "t.pcs")
    with pytest.raises(SpecError) as info:
        check_names(spec, PARAMS, ["x"], ["output"], ["h1", "h2"])
    assert_at(info.value, 2, col, hint)


# --- properties -----------------------------------------------------------------------

AXIS = st.from_regex(r"[a-z][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda a: a not in ("over",))
PLACEMENT = st.one_of(st.just(R), st.just(P), st.builds(Shard, st.integers(0, 5)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(AXIS, st.integers(1, 64)), min_size=1, max_size=4,
                unique_by=lambda a: a[0]))
def test_mesh_property(axes):
    text = "mesh " + "  ".join(f"{a}={n}" for a, n in axes) + "\nw colwise\n"
    if math.prod(n for _, n in axes) > MAX_MESH_RANKS:  # the bound, at the mesh line
        with pytest.raises(SpecError, match=f"more than parcomp's limit of {MAX_MESH_RANKS}") as info:
            parse_spec(text)
        assert info.value.loc.line == 1
        return
    spec = parse_spec(text)
    assert spec.mesh == Mesh(tuple(axes))
    names = [a for a, _ in axes]
    expect = names[0] if len(names) == 1 else ("tp" if "tp" in names else names[-1])
    assert spec.default_axis() == expect


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_layout_round_trip_property(data):
    axes = data.draw(st.lists(AXIS, min_size=1, max_size=3, unique=True))
    rules, lines = [], []
    for i in range(data.draw(st.integers(1, 5))):
        target = data.draw(st.sampled_from(["param", "input", "output", "activation"]))
        form = data.draw(st.sampled_from(["word", "list", "axes", "single"]))
        if form == "word":
            word, axis = data.draw(st.sampled_from(WORDS)), data.draw(st.sampled_from(axes))
            text, lay = f"{word} over {axis}", LayoutSpec(word, None, axis)
        elif form == "single":
            p, axis = data.draw(PLACEMENT), data.draw(st.sampled_from(axes))
            full = tuple(p if a == axis else R for a in axes)
            text, lay = f"{p} over {axis}", LayoutSpec(None, full, axis)
        else:
            full = tuple(data.draw(PLACEMENT) for _ in axes)
            text = ("[" + ", ".join(map(str, full)) + "]" if form == "list"
                    else " ".join(f"{a}={p}" for a, p in zip(axes, full)))
            lay = LayoutSpec(None, full, None)
        lines.append(f"{target} n{i}.*.w {text}")
        rules.append((target, f"n{i}.*.w", lay))
    spec = parse_spec("mesh " + " ".join(f"{a}=2" for a in axes) + "\n" + "\n".join(lines))
    assert [(r.target, r.pattern, r.layout) for r in spec.rules] == rules
    assert [r.loc.line for r in spec.rules] == list(range(2, 2 + len(lines)))


def test_a_dotted_name_with_a_digit_unquoted_says_to_quote_it():
    """'output=a.0' lexes '.0' as a number: the error says to write the whole name quoted, and
    the quoted form parses to that name."""
    with pytest.raises(SpecError) as e:
        parse_spec("mesh tp=2\ntrain loss=mse output=a.0 steps=2\n", "t.pcs")
    msg = str(e.value)
    assert msg.startswith("t.pcs:2:24\n") and 'written quoted: "a.0"' in msg
    assert parse_spec('mesh tp=2\ntrain loss=mse output="a.0" steps=2\n', "t.pcs").train.get("output") == "a.0"


def test_a_rule_missing_an_onnx_models_renamed_weights_says_why():
    """torch.onnx's dynamo export with optimize=True names folded weights val_N: the error for a
    rule written with module names says so and how to keep them."""
    s = parse_spec("mesh tp=2\nq.weight colwise\n", "t.pcs")
    with pytest.raises(SpecError, match="generated names such as val_3: .*optimize=False"):
        check_names(s, ["ln1.weight", "val_3", "val_7"], ["x"], ["y"], [])
    with pytest.raises(SpecError) as e:  # a model without generated names: no such note
        check_names(s, ["ln1.weight", "k.weight"], ["x"], ["y"], [])
    assert "generated names" not in str(e.value)


# ---- a memory size above any device ----

@pytest.mark.parametrize("value", ["10000000TiB", "1025TiB", "2000000TB"])
def test_a_memory_size_above_any_device_is_a_located_error(value):
    with pytest.raises(SpecError, match=r"is above 1024.0 TiB, more than any one device holds") as e:
        parse_spec(f"mesh tp=2\nmemory {value}\n", "s.pcs")
    assert (e.value.loc.line, e.value.loc.col) == (2, 8)
    assert parse_spec("mesh tp=2\nmemory 1024TiB\n", "s.pcs").memory == 2**50
