"""Bad input to the CLI: each is a clear error, exit 2, no traceback."""
import numpy as np
import re

import pytest

from parcomp.cli.main import main
from parcomp.ir import Mesh, R
from parcomp.reference.assemble import assemble

BASE = """\
%x: f32[4,8] = input()
%w1: f32[8,16] = param()
%w2: f32[16,8] = param()
%h: f32[4,16] = matmul(%x, %w1)
%r: f32[4,16] = relu(%h)
%y: f32[4,8] = matmul(%r, %w2)
return %y
"""
SPEC = "mesh tp=2\nw1 colwise\nw2 rowwise\ninput x replicated\noutput y replicated\n"


def run_cli(tmp_path, capsys, pcir, spec, cmd="check"):
    (tmp_path / "m.pcir").write_text(pcir)
    (tmp_path / "s.pcs").write_text(spec)
    rc = main([cmd, str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs")]
              + (["-o", str(tmp_path / "out"), "--target", "reference"] if cmd == "compile" else []))
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("edit,needle", [
    (("relu(%h)", "pow(%h)"), "pow needs the attribute exponent"),
    (("relu(%h)", 'gelu(%h) {approximate="bogus"}'), "choose one of none, tanh"),
    (("relu(%h)", 'add_scalar(%h) {value="x"}'), "attribute value of add_scalar must be a number"),
    (("relu(%h)", 'all_reduce(%h) {axis="tp"}'), "layout changes are inserted by parcomp"),
    (("%w2: f32[16,8] = param()", '%w2: f32[16,8] = param() {trainable="no"}'),
     "attribute trainable of param must be true or false, not 'no'"),
])
def test_bad_ir_attributes_and_ops(tmp_path, capsys, edit, needle):
    rc, err = run_cli(tmp_path, capsys, BASE.replace(*edit), SPEC)
    assert rc == 2 and needle in err and "Traceback" not in err


@pytest.mark.parametrize("line,needle", [
    ("train loss=mse optimizer=sgd(lr=abc)", "sgd(lr=...) must be a number, not 'abc'"),
    ("train loss=mse steps=0", "steps=0 is out of range: it must be at least 1 and at most 1,000,000"),
    ("train loss=mse zero=1.5", "zero must be a whole number"),
    ("train loss=mse batch=many", "batch must be a whole number"),
    ("train loss=mse optimizer=sgd(lr=-1)", "must not be negative"),
    ("train optimizer=adamw(lr=1e-3, beta1=1.5)", "adamw(beta1=1.5) must be less than 1"),
    ("train optimizer=sgd(lr=1e400)", "sgd(lr=...) must be a finite number, not inf"),
    ("train steps=100000000000", "steps=100000000000 is out of range"),
    ("train loss=mse output=z", "output='z' is not an output of the model (its outputs: y)"),
])
def test_bad_train_options_are_located(tmp_path, capsys, line, needle):
    rc, err = run_cli(tmp_path, capsys, BASE, SPEC.replace("output y replicated\n", "") + line + "\n")
    col = int(re.search(r"s\.pcs:5:(\d+)", err).group(1))
    key = re.search(r"\((?:lr=[^,]*, )?(\w+)=", line) or re.search(r" (\w+)=\S*$", line)
    assert col in (1, line.index(key.group(1) + "=") + 1)  # the option's column (or the line's)
    assert rc == 2 and needle in err and "Traceback" not in err


def test_bfloat16_model_compiles(tmp_path, capsys):
    rc, err = run_cli(tmp_path, capsys, BASE.replace("f32", "bf16"), SPEC, cmd="compile")
    assert rc == 0, err


@pytest.mark.parametrize("dtype,short", [("bf16", "bf16"), ("f16", "fp16")])
def test_low_precision_model_with_a_train_line_is_refused_unless_precision_pure(tmp_path, capsys, dtype, short):
    """A bf16/fp16 model with a train line would train in pure 2-byte floats (optimizer state and
    gradient sums included) without a word: a located error naming the parameter and both
    ways out; ``precision=pure`` compiles it on purpose, and report.json says so."""
    import json

    train = SPEC.replace("output y replicated\n", "") + "train loss=mse optimizer=adamw(lr=0.01){opts}\n"
    for opts in ("", " precision=" + short):
        rc, err = run_cli(tmp_path, capsys, BASE.replace("f32", dtype), train.format(opts=opts), cmd="compile")
        assert rc == 2 and "Traceback" not in err and re.search(r"s\.pcs:5:\d+", err), err
        assert "parameter w1 is " in err and "precision=pure" in err and f"precision={short}" in err
        assert not (tmp_path / "out").exists()
    rc, err = run_cli(tmp_path, capsys, BASE.replace("f32", dtype), train.format(opts=" precision=pure"),
                      cmd="compile")
    assert rc == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["training"]["options"]["master_dtype"] == "model"


def test_nan_outputs_identical_on_every_replica_are_not_a_divergence():
    mesh = Mesh((("tp", 2),))
    x = np.array([1.0, np.nan], "f4")
    np.testing.assert_array_equal(assemble([x, x.copy()], (R,), (2,), mesh), x)
    with pytest.raises(ValueError, match="replicas differ"):
        assemble([x, np.array([2.0, np.nan], "f4")], (R,), (2,), mesh)


def test_a_rule_shadowed_by_an_earlier_one_is_an_error(tmp_path, capsys):
    rc, err = run_cli(tmp_path, capsys, BASE, "mesh tp=2\nw* colwise\nw2 rowwise\n")
    assert rc == 2 and "s.pcs:3:1" in err and "never applies" in err and "'w*' at " in err


def test_ir_verify_errors_point_at_the_line(tmp_path, capsys):
    rc, err = run_cli(tmp_path, capsys, BASE.replace("%h: f32[4,16]", "%h: f32[4,15]"), SPEC)
    assert rc == 2 and "m.pcir:4:1" in err and "type should be f32[4,16], not f32[4,15]" in err


def test_model_returning_one_tensor_twice(tmp_path, capsys):
    model = tmp_path / "twice.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "class Twice(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__(); self.fc1 = nn.Linear(8, 16); self.fc2 = nn.Linear(16, 8)\n"
        "    def forward(self, x):\n"
        "        y = self.fc2(torch.relu(self.fc1(x)))\n"
        "        return y, y\n"
        "def make():\n"
        "    torch.manual_seed(0)\n"
        "    return Twice().eval(), (torch.randn(2, 8),), ['x']\n")
    (tmp_path / "s.pcs").write_text("mesh tp=2\nfc1.weight colwise\nfc2.weight rowwise\n")
    assert main(["check", f"{model}:make", "--spec", str(tmp_path / "s.pcs"), "--json"]) == 0
    import json
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ok"] and [c["kind"] for c in last["collectives"]] == ["all_reduce"]


# ---- .pcir text: strings, numbers, repeated things, layouts that do not fit the mesh ----------

def pcir_error(text: str):
    from parcomp.errors import IRParseError
    from parcomp.ir.text import parse_graph
    with pytest.raises(IRParseError) as info:
        parse_graph(text, "m.pcir")
    return info.value


def test_pcir_string_with_a_raw_tab_is_a_tab_and_prints_escaped():
    from parcomp.ir.text import parse_graph, print_graph
    g = parse_graph(BASE.replace("relu(%h)", 'relu(%h) {note="a\tb"}'))
    assert g["r"].attr("note") == "a\tb"
    assert '{note="a\\tb"}' in print_graph(g) and parse_graph(print_graph(g)) == g


@pytest.mark.parametrize("attr, col, needle", [
    ('{note="\\q"}', 33, "unknown escape `\\q` in a string; the escapes are"),
    ('{note="ab\\x41"}', 35, "unknown escape `\\x`"),
    ('{note="\\ud800"}', 32, "half a surrogate pair"),
])
def test_pcir_bad_string_is_located(attr, col, needle):
    err = pcir_error(BASE.replace("relu(%h)", f"relu(%h) {attr}"))
    assert (err.loc.line, err.loc.col) == (5, col) and needle in err.message


@pytest.mark.parametrize("edit, line, col, needle", [
    (("f32[4,8] = input", "f32[4" + "0" * 30 + ",8] = input"), 1, 9, "a dim has 31 digits; at most 18"),
    (("relu(%h)", 'pow(%h) {exponent=2, exponent="x"}'), 5, 38, "attribute exponent is given twice"),
    (("return %y", "return %y, %r as y"), 7, 8, "output name 'y' is given twice"),
    (("%x: f32", "mesh tp=0\n%x: f32"), 1, 9, "mesh axis tp has size 0"),
    (("%x: f32", "mesh tp=2 tp=2\n%x: f32"), 1, 11, "mesh axis tp is given twice"),
    (("%x: f32", "mesh tp=2\nmesh tp=4\n%x: f32"), 2, 1, "a second mesh line (the first is on line 1)"),
    (("%x: f32", "stage sharded\n%x: f32"), 1, 7, "stage global` (the default"),
    (("relu(%h)", "relu(%h) {s=(1" + "0" * 20 + ",)}"), 5, 30, "a tuple entry has 21 digits"),
])
def test_pcir_transformer_errors_are_located(edit, line, col, needle):
    err = pcir_error(BASE.replace(*edit))
    assert (err.loc.line, err.loc.col) == (line, col) and needle in err.message, err


@pytest.mark.parametrize("text, line, needle", [
    ("%x: f32[1,2] [] = input()\n%y: f32[1,2] = relu(%x)\nreturn %y\n", 1,
     "layout []: 0 placements but mesh tp=2 has 1 axis"),
    ("%x: f32[1,2] = input()\n%y: f32[1,2] [R, R] = relu(%x)\nreturn %y\n", 2,
     "layout [R, R]: 2 placements but mesh tp=2 has 1 axis"),
    ("%x: f32[1,2] [S(5)] = input()\n%y: f32[1,2] = relu(%x)\nreturn %y\n", 1,
     "S(5) splits dim 5, but f32[1,2] has 2 dims"),
    ("mesh tp=2\n%x: f32[1,2] [R] = input()\n%y: f32[1,2] [R] = relu(%x [R, R])\nreturn %y\n", 3,
     "operand %x's layout [R, R]: 2 placements"),
    ("mesh tp=2\n%x: f32[1,2] [] = input()\n%y: f32[1,2] [] = relu(%x)\nreturn %y\n", 2,
     "layout []: 0 placements"),
    ("mesh tp=4\n%x: f32[1,4] = input()\n%y: f32[1,4] = relu(%x)\nreturn %y\n", 1,
     "the model says mesh tp=4 but the spec's mesh is tp=2"),
    ("stage local\n%x: f32[1,4] = input()\n%y: f32[1,4] = relu(%x)\nreturn %y\n", 1,
     "a model is a global graph"),
    ("%x: f32[2] = input()\nreturn\n", 2, "the model returns nothing"),
])
def test_a_layout_or_mesh_that_does_not_fit_is_located(tmp_path, capsys, text, line, needle):
    rc, err = run_cli(tmp_path, capsys, text, "mesh tp=2\n")
    assert rc == 2 and f"m.pcir:{line}:1\n" in err and needle in err and "Traceback" not in err


@pytest.mark.parametrize("text, line, col, words", [
    ("%x: f32[1,2] = input()\n", 1, 23, "expected a line `%name: dtype[shape] = op(%operands)`, a line "
     "`return %value` or attributes `{key=value, ...}`; got the end of the file"),
    ("%x: f32[1,2] = input()\nreturn %x return\n", 2, 11, "expected `as NAME` or `,`; got `return`"),
    ("%x: f32[1,2] = input()\n%y: f32[1,2] = relu(x)\nreturn %y\n", 2, 21,
     "expected a value name such as `%x`"),
    ("%x: f32[1,2] [Q] = input()\nreturn %x\n", 1, 15, "expected a placement R, S(d) or P or `]`; got `Q`"),
    ("%x: f32[1,2] <S(0)> = input()\nreturn %x\n", 1, 14, "layouts are written [S(0), R], not <S(0), R>"),
    ("%x: f32[1,2] @ = input()\nreturn %x\n", 1, 14, "expected `=` or a layout such as `[S(0), R]`"),
    ("%x f32[1,2] = input()\nreturn %x\n", 1, 4, "expected `:` and the type; got `f32`"),
])
def test_pcir_syntax_errors_in_words(text, line, col, words):
    err = pcir_error(text)
    assert (err.loc.line, err.loc.col) == (line, col) and words in err.message, err.message
    assert not [t for t in ("LBRACE", "RETURN", "VALUE", "COMMA", "$END", "CNAME") if t in err.message]


@pytest.mark.parametrize("text", ["", "\n\n  \n", "# just a comment\n", "\ufeff"])
def test_an_empty_pcir_says_it_is_empty(text):
    err = pcir_error(text)
    assert err.message.startswith("the file is empty: a .pcir has one line per value")


def test_pcir_byte_order_mark_non_ascii_and_line_numbers(tmp_path, capsys):
    from parcomp.ir.text import parse_graph
    assert parse_graph("\ufeff" + BASE) == parse_graph(BASE)
    err = pcir_error(BASE.replace("%w1: f32", "%w\u00e91: f32"))
    assert (err.loc.line, err.loc.col) == (2, 3)
    assert "the character '\u00e9' (U+00E9) is not allowed in a name" in err.message
    err = pcir_error(BASE.replace("%x: f32[4,8] = input()", "%x: f32[4,8] = input()\x0c"
                                  ).replace("relu(%h)", "relu(%nope)"))
    assert err.loc.line == 5 and "%nope" in err.loc.text  # \f is no line break for lark
    (tmp_path / "b.pcir").write_bytes(b"%x: f32[2] = input()\nreturn %\xffx\n")
    (tmp_path / "s.pcs").write_text(SPEC)
    assert main(["check", str(tmp_path / "b.pcir"), "--spec", str(tmp_path / "s.pcs")]) == 2
    err = capsys.readouterr().err
    assert "b.pcir:2:9" in err and "not UTF-8 text: byte 0xff at offset 29" in err


def test_source_lines_render_printable_and_windowed():
    from parcomp.errors import SourceLoc
    shown = SourceLoc("f", 1, 4, "a\tb\x00c\x1b[2J").render().splitlines()
    assert shown[1] == "    a\tb?c?[2J" and shown[2] == "     \t ^"  # the caret under the NUL
    shown = SourceLoc("f", 1, 5000, "y" * 4999 + "!" + "z" * 5000).render().splitlines()
    assert len(shown[1]) < 120 and shown[2].index("^") == shown[1].index("!")


@pytest.mark.parametrize("attrs, needle", [
    ("{perm=5}", "attribute perm of permute must be a tuple of whole numbers"),
    ('{perm="ab"}', "attribute perm of permute must be a tuple of whole numbers"),
])
def test_tuple_attributes_of_the_wrong_kind(tmp_path, capsys, attrs, needle):
    text = "%x: f32[2,4] = input()\n%y: f32[4,2] = permute(%x) " + attrs + "\nreturn %y\n"
    rc, err = run_cli(tmp_path, capsys, text, "mesh tp=2\n")
    assert rc == 2 and "m.pcir:2:1" in err and needle in err and "Traceback" not in err


@pytest.mark.parametrize("line, needle", [
    ('%y: f32[2,4] [R] = all_gather(%x) {axis="tp"}', "all_gather needs the attribute dim"),
    ('%y: f32[2,4] [R] = all_reduce(%x) {axis=1}', "attribute axis of all_reduce must be a string"),
    ('%y: f32[2,4] [R] = all_gather(%x) {axis="tp", dim=0.5}',
     "attribute dim of all_gather must be a whole number, not 0.5"),
])
def test_layout_op_attributes_are_checked_by_the_schema(tmp_path, capsys, line, needle):
    text = "mesh tp=2\n%x: f32[2,4] [P] = input()\n" + line + "\nreturn %y\n"
    rc, err = run_cli(tmp_path, capsys, text, "mesh tp=2\n")
    assert rc == 2 and "m.pcir:3:1" in err and needle in err and "Traceback" not in err


def test_a_collective_over_an_unknown_axis_is_located(tmp_path, capsys):
    text = ("mesh tp=2\n%x: f32[2,4] [P] = input()\n"
            '%y: f32[2,4] [R] = all_reduce(%x) {axis="dp"}\nreturn %y\n')
    rc, err = run_cli(tmp_path, capsys, text, "mesh tp=2\n")
    assert rc == 2 and "m.pcir:3:1" in err and "all_reduce over 'dp': not an axis of mesh tp=2" in err


# ---- a spec's S(d) naming a dim the tensor does not have: located before any rewrite reads it --

_ROOT = __import__("pathlib").Path(__file__).resolve().parents[1].parent
_MODELS = str(_ROOT / "specs" / "models.py")
_ATTENTION = str(_ROOT / "tests" / "attention_models.py")
_BIASED = """\
%x: f32[4,8] = input()
%w1: f32[8,16] = param()
%b1: f32[16] = param()
%h: f32[4,16] = matmul(%x, %w1)
%hb: f32[4,16] = add(%h, %b1)
%y: f32[4,16] = relu(%hb)
return %y
"""
_TIED_VOCAB = """\
%ids: i64[2,4] = input()
%wte: f32[7,4] = param()
%x: f32[2,4,4] = embedding(%ids, %wte)
%wt: f32[4,7] = permute(%wte) {perm=(1, 0)}
%logits: f32[2,4,7] = matmul(%x, %wt)
return %logits as logits
"""


def _chain_pcir(blocks: int = 8) -> str:
    """``blocks`` x (matmul, relu), block b's weight ``h.{b}.w``: enough blocks for block-plan
    reuse (parcomp/compile/repeat_compile.py), which compiles a reduced graph before binding the rest."""
    lines, cur = ["%x: f32[4,8] = input()"], "x"
    for b in range(blocks):
        lines += [f"%h.{b}.w: f32[8,8] = param()", f"%mm{b}: f32[4,8] = matmul(%{cur}, %h.{b}.w)",
                  f"%act{b}: f32[4,8] = relu(%mm{b})"]
        cur = f"act{b}"
    return "\n".join(lines) + f"\nreturn %{cur}\n"


# (model: pcir text or FILE:FACTORY, spec, the param named, the layout shown). Each reaches a
# rewrite bind-layouts or the compile driver runs before the layouts' checks: vocab padding
# (every split param; an embedding table under a cross-entropy loss), bias following, a fused
# weight's view (and its bias), the attention-heads check, block-plan reuse's reduced graph.
_BAD_DIMS = [
    (BASE, "mesh tp=2\nw1 [S(5)]\n", "w1", "[S(5)]"),
    (BASE, "mesh tp=2\nw1 tp=S(9)\n", "w1", "[S(9)]"),
    (BASE, "mesh dp=2 tp=2\nw1 S(3) over tp\n", "w1", "[R, S(3)]"),
    (f"{_MODELS}:tiny_relu_mlp", "mesh tp=2\nfc1.weight [S(5)]\n", "fc1.weight", "[S(5)]"),
    (f"{_MODELS}:tiny_relu_mlp", "mesh tp=2\nfc1.weight tp=S(9)\n", "fc1.weight", "[S(9)]"),
    (_BIASED, "mesh tp=2\nw1 [S(2)]\n", "w1", "[S(2)]"),
    (_BIASED, "mesh tp=2\nw1 colwise\nb1 [S(1)]\n", "b1", "[S(1)]"),
    (_TIED_VOCAB, "mesh tp=2\nwte [S(2)]\ntrain loss=cross_entropy\n", "wte", "[S(2)]"),
    (f"{_ATTENTION}:gpt2_attention", "mesh tp=2\nattn.c_attn.weight [S(3)]\n", "attn.c_attn.weight",
     "[S(3)]"),
    (f"{_ATTENTION}:gpt2_attention", "mesh tp=2\nattn.c_attn.weight colwise\nattn.c_attn.bias [S(2)]\n",
     "attn.c_attn.bias", "[S(2)]"),
    (f"{_ATTENTION}:llama_attention", "mesh tp=2\nattn.q_proj.weight [S(2)]\n", "attn.q_proj.weight",
     "[S(2)]"),
    (_chain_pcir(), "mesh tp=2\nh.*.w [S(2)]\n", "h.0.w", "[S(2)]"),
]


_BAD_DIM_IDS = ["S5", "tp=S9", "over-tp", "torch-S5", "torch-tp=S9", "bias-weight", "bias", "vocab-table",
                "fused-weight", "fused-bias", "heads", "block-reuse"]


def _model_ref(tmp_path, model: str) -> str:
    if model.startswith("%"):
        (tmp_path / "m.pcir").write_text(model)
        return str(tmp_path / "m.pcir")
    if "attention_models" in model:
        pytest.importorskip("transformers")
    return model


@pytest.mark.parametrize("model, spec_text, param, layout", _BAD_DIMS, ids=_BAD_DIM_IDS)
def test_a_split_of_a_dim_the_param_lacks_is_located_by_the_cli(tmp_path, capsys, model, spec_text,
                                                                 param, layout):
    (tmp_path / "s.pcs").write_text(spec_text)
    line = spec_text.count("\n", 0, spec_text.index(param.replace("h.0.", "h.*.") + " ")) + 1
    rc = main(["compile", _model_ref(tmp_path, model), "--spec", str(tmp_path / "s.pcs"),
               "-o", str(tmp_path / "out"), "--target", "reference"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert f"s.pcs:{line}:1\n" in err and f"param {param} " in err and f"as {layout}" in err, err
    assert "names a dim a rank-" in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("model, spec_text, param, layout", _BAD_DIMS, ids=_BAD_DIM_IDS)
def test_a_split_of_a_dim_the_param_lacks_is_located_by_compile_graph(tmp_path, model, spec_text,
                                                                      param, layout):
    from parcomp.compile.compiler import compile_graph
    from parcomp.errors import SpecError
    from parcomp.frontends.loader import load_model
    from parcomp.spec import parse_spec

    graph, _, _ = load_model(_model_ref(tmp_path, model))
    with pytest.raises(SpecError) as info:
        compile_graph(graph, parse_spec(spec_text, "s.pcs"))
    line = spec_text.count("\n", 0, spec_text.index(param.replace("h.0.", "h.*.") + " ")) + 1
    assert (info.value.loc.file, info.value.loc.line, info.value.loc.col) == ("s.pcs", line, 1)
    assert f"param {param} " in info.value.message and "names a dim a rank-" in info.value.message


def test_the_chain_case_of_the_bad_dims_reaches_the_reduced_compile(monkeypatch):
    """The chain case above is bound first in block-plan reuse's reduced graph (else it
    would test nothing new)."""
    from parcomp.compile import repeat_compile
    from parcomp.compile.compiler import compile_graph
    from parcomp.errors import SpecError
    from parcomp.ir.text import parse_graph
    from parcomp.spec import parse_spec

    calls, real = [], repeat_compile.reduced
    monkeypatch.setattr(repeat_compile, "reduced", lambda *a: calls.append(a[2]) or real(*a))
    with pytest.raises(SpecError, match="h.0.w"):
        compile_graph(parse_graph(_chain_pcir()), parse_spec("mesh tp=2\nh.*.w [S(2)]\n"))
    assert calls == [repeat_compile.REDUCED]


def test_vocab_padding_leaves_a_split_of_a_missing_dim_alone():
    """pad_vocab_tables indexes only dims a param has (bind-layouts reports the rule)."""
    from parcomp.ir import Shard
    from parcomp.ir.text import parse_graph
    from parcomp.passes.vocab_pad import pad_vocab_tables

    g = parse_graph(_TIED_VOCAB)
    assert pad_vocab_tables(g, Mesh((("tp", 2),)), {"wte": (Shard(2),)}, True) is g
    assert pad_vocab_tables(g, Mesh((("tp", 2),)), {"wte": (Shard(0),)}, True)["wte"].type.shape == (8, 4)


# ---- torch models: where a trace fails --------------------------------------------------------

_BRANCHY = '''\
import torch
from torch import nn


class Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:
            return h * 2
        return h


def make():
    return Gate().eval(), (torch.randn(2, 8),), ["x"]
'''


def test_a_data_dependent_branch_names_the_users_line_without_torchs_graph_dump(tmp_path, capfd):
    pytest.importorskip("torch")
    import json

    (tmp_path / "branchy.py").write_text(_BRANCHY)
    (tmp_path / "s.pcs").write_text("mesh tp=2\n")
    rc = main(["compile", f"{tmp_path / 'branchy.py'}:make", "--spec", str(tmp_path / "s.pcs"),
               "-o", str(tmp_path / "out"), "--json"])
    out, err = capfd.readouterr()  # fd level: torch prints its partial graph to sys.stderr
    assert rc == 2 and "Traceback" not in err and not (tmp_path / "out").exists()
    assert f"branchy.py:12:12\n            if h.sum() > 0:\n" in err, err
    assert "depends on a tensor's value" in err and "torch.where(cond, a, b)" in err
    assert "def forward(self" not in err and "torch.ops.aten" not in err, err  # no dump
    assert json.loads(out.strip().splitlines()[-1])["where"] == f"{tmp_path / 'branchy.py'}:12:12"
