"""Fuzz the text a user writes: .pcir models, .pcs specs and `train` options.

Valid texts from ``specs/`` are mutated by characters, tokens and whole lines; every
outcome must be a success whose numbers ``parcomp check`` proves equal to the unsharded
model, or a :class:`ParcompError` (never another exception, never a MISMATCH). Errors
found while reading a file must be located (``file:line:col``). The count of each
outcome is printed, so a run shows how many cases got past the parsers.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import io
import json
import os
import re
from argparse import Namespace
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from parcomp.cli import commands, common as commands_common
from parcomp.cli.main import main
from parcomp.errors import ParcompError
from parcomp.frontends.loader import load_model
from parcomp.spec import load_spec

SPECS = Path(__file__).resolve().parents[1].parent / "specs"
PCIR = (SPECS / "tiny_relu_mlp.pcir").read_text()
PCIR_BIAS = """\
%x: f32[2,4] = input()
%fc1.weight: f32[8,4] = param()
%fc1.bias: f32[8] = param()
%fc1.wt: f32[4,8] = permute(%fc1.weight) {perm=(1, 0)}
%h0: f32[2,8] = matmul(%x, %fc1.wt)
%h: f32[2,8] = add(%h0, %fc1.bias)
%r: f32[2,8] = gelu(%h) {approximate="tanh"}
%fc2.weight: f32[4,8] = param()
%fc2.wt: f32[8,4] = permute(%fc2.weight) {perm=(1, 0)}
%output: f32[2,4] = matmul(%r, %fc2.wt)
return %output
"""
TINY_SPEC = (SPECS / "tiny_relu_mlp_tp2.pcs").read_text()
# (model reference, spec text) pairs that compile and check as shipped
CORPUS = [("tiny.pcir", TINY_SPEC), ("bias.pcir", TINY_SPEC),
          ("bias.pcir", TINY_SPEC + "train loss=mse optimizer=adamw(lr=0.01) steps=2\n")]
CORPUS += [(f"{SPECS / 'models.py'}:gpt2_mlp", (SPECS / f).read_text()) for f in
           ("gpt2_mlp_tp2.pcs", "gpt2_mlp_tp2_seq.pcs", "gpt2_mlp_dp2_tp2.pcs",
            "gpt2_mlp_tp2_train.pcs", "gpt2_mlp_dp2_tp2_train.pcs")]
CORPUS += [(f"{SPECS / 'models.py'}:torch_mlp", (SPECS / "torch_mlp_tp2.pcs").read_text())]

# words of both languages and the characters that break tokenizers
TOKENS = ["mesh", "tp=2", "dp=2", "tp=1", "tp=0", "tp=-1", "tp=3", "tp=1000000000000", "topology",
          "nodes=2", "devices_per_node=2", "colwise", "rowwise", "replicated", "split-seq",
          "split-hidden", "partial-sum", "[S(0), R]", "[R, S(1)]", "S(5)", "S(-1)", "P", "R",
          "over", "dp", "tp", "input", "output", "activation", "train", "loss=mse",
          "loss=cross_entropy", "loss=output", "optimizer=sgd(lr=0.1)", "optimizer=adamw(beta1=1.5)",
          "steps=3", "steps=100000000000", "batch=2", "zero=1", "trainable=\"fc1.*\"",
          "input_grads=no", "%x", "%h", "%output", "%nope", "f32", "f64", "i64", "bf16", "[1,2]",
          "[0]", "[]", "[4,4]", "=", "(", ")", "{", "}", "<R>", "<S(0)>", "<P>", "<>", "<R, R>",
          "return", "as", "#", "\"", "\\", "1e400", "nan", "inf", "-0", "999999999999", "é",
          "\ufeff", "\x00", "\t", " ", ",", ":", ".", "*", "**", "matmul", "relu", "param()",
          "input()", "permute", "{perm=(1, 0)}", '{note="\\q"}', "fc1.weight", "fc2.weight",
          "c_fc.weight", "c_proj.weight", "0.weight", "2.weight"]
CHARS = st.sampled_from(list("%{}[]<>()=,:#\"\\\t\n .-_*0123456789abcdeSPRx") + ["é", "\x00", "\ufeff"])
TOKEN_RE = re.compile(r"\s+|[A-Za-z_%.][\w.%*-]*|\d+(?:\.\d*)?(?:e-?\d+)?|.", re.S)


@st.composite
def mutated(draw, text: str, extra_lines: list[str]):
    """``text`` changed by 1-3 character, token or line edits."""
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["char", "token", "line"]))
        if kind == "char":
            i = draw(st.integers(0, len(text)))
            op = draw(st.sampled_from(["insert", "delete", "replace"]))
            c = draw(CHARS)
            text = (text[:i] + c + text[i:] if op == "insert" else
                    text[:i] + text[i + 1:] if op == "delete" else text[:i] + c + text[i + 1:])
        elif kind == "token":
            toks = TOKEN_RE.findall(text) or [""]
            i = draw(st.integers(0, len(toks) - 1))
            op = draw(st.sampled_from(["replace", "delete", "duplicate", "insert"]))
            t = draw(st.sampled_from(TOKENS + toks))
            toks = (toks[:i] + [t] + toks[i + 1:] if op == "replace" else toks[:i] + toks[i + 1:]
                    if op == "delete" else toks[:i] + [toks[i]] + toks[i:] if op == "duplicate"
                    else toks[:i] + [t, " "] + toks[i:])
            text = "".join(toks)
        else:
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            op = draw(st.sampled_from(["delete", "duplicate", "swap", "insert"]))
            if op == "delete":
                del lines[i]
            elif op == "duplicate":
                lines.insert(i, lines[i])
            elif op == "swap":
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            else:
                lines.insert(i, draw(st.sampled_from(extra_lines)))
            text = "\n".join(lines)
    return text


COUNTS: dict = collections.defaultdict(collections.Counter)


@functools.lru_cache(maxsize=None)
def _cached_model(ref: str):
    return load_model(ref)


def _outcome(tmp: Path, model: str, model_text: str | None, spec_text: str) -> str:
    """Run ``parcomp check`` in process; return "ok" or the error class, asserting the rules."""
    spec_path = tmp / "s.pcs"
    spec_path.write_bytes(spec_text.encode("utf-8", "surrogatepass"))
    if model_text is not None:
        model = str(tmp / "m.pcir")
        Path(model).write_bytes(model_text.encode("utf-8", "surrogatepass"))
    # phase 1: reading the files; every error is located in the file it read
    try:
        if model_text is not None:
            load_model(model)
        load_spec(str(spec_path))
    except ParcompError as e:
        assert e.loc is not None, f"unlocated error while reading a file: {e.render()}"
        assert e.loc.file in (model, str(spec_path)), e.render()
        return "read:" + type(e).__name__
    # phase 2: compile and check every rank against the unsharded model
    args = Namespace(model=model, spec=str(spec_path), json=True, seed=0)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = commands.check(args)
    except ParcompError as e:
        assert e.message.strip(), "an error without a message"
        return "compile:" + type(e).__name__
    assert result["ok"], f"check says MISMATCH on a compiled program: {result}"
    return "ok"


@pytest.fixture(scope="module")
def cached_loader():
    original = commands_common.load_model  # what commands.compile_model calls
    commands_common.load_model = lambda ref: load_model(ref) if ref.endswith(".pcir") else _cached_model(ref)
    yield
    commands_common.load_model = original


# 400 cases a test in the suite; PARCOMP_FUZZ_EXAMPLES=5000 for a longer hunt.
FUZZ = settings(max_examples=int(os.environ.get("PARCOMP_FUZZ_EXAMPLES", "400")), deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much, HealthCheck.data_too_large])


@FUZZ
@given(data=st.data())
def test_fuzz_pcir_text(tmp_path, cached_loader, data):
    base = data.draw(st.sampled_from([PCIR, PCIR_BIAS]))
    text = data.draw(mutated(base, PCIR_BIAS.splitlines() + ["mesh tp=2", "return %h", ""]))
    COUNTS["pcir"][_outcome(tmp_path, "", text, TINY_SPEC)] += 1


@FUZZ
@given(data=st.data())
def test_fuzz_spec_text(tmp_path, cached_loader, data):
    model, spec = data.draw(st.sampled_from(CORPUS))
    text = data.draw(mutated(spec, [s for _, s in CORPUS for s in s.splitlines()]))
    model_text = {"tiny.pcir": PCIR, "bias.pcir": PCIR_BIAS}.get(model)
    COUNTS["spec"][_outcome(tmp_path, model, model_text, text)] += 1


GOOD = {"lr": ["0.1", "1e-3", "0.5", "0"], "momentum": ["0.9", "0"], "weight_decay": ["0", "0.01"],
        "beta1": ["0.9", "0.5"], "beta2": ["0.999", "0.99"], "eps": ["1e-8", "1e-6"],
        "batch": ["2"], "steps": ["1", "2", "3"], "zero": ["0"]}
BAD = ["-1", "1e400", "-1e400", "nan", "inf", "1.5", "100000000000", "abc", '"x"', "0", "1e-12"]


def _value(draw, key):
    """Mostly a legal value of ``key`` (so cases get past the parser), sometimes anything."""
    if key in GOOD and draw(st.integers(0, 3)):
        return draw(st.sampled_from(GOOD[key]))
    return draw(st.sampled_from(BAD + GOOD.get(key, [])))


@st.composite
def train_lines(draw):
    """A `train` line with known (mostly legal) and unknown options and values of every kind."""
    opts = []
    keys = ["loss", "optimizer", "batch", "steps", "zero", "trainable", "input_grads"]
    for key in draw(st.lists(st.sampled_from(keys * 3 + ["lr", "output", "bogus"]), max_size=4)):
        if key == "loss":
            val = draw(st.sampled_from(["mse", "mse", "cross_entropy", "output", "hinge", "1"]))
        elif key == "optimizer":
            name = draw(st.sampled_from(["sgd", "adamw", "sgd", "adamw", "adam"]))
            hyper = draw(st.lists(st.sampled_from(
                ["lr", "momentum", "weight_decay"] if name == "sgd" else
                ["lr", "beta1", "beta2", "eps", "weight_decay"]) | st.just("nesterov"), max_size=3))
            val = name + ("(" + ", ".join(f"{k}={_value(draw, k)}" for k in hyper) + ")"
                          if hyper or draw(st.booleans()) else "")
        elif key in ("trainable", "output"):
            val = draw(st.sampled_from(['"fc1.*"', '"nothing"', "fc2.weight", '"**"', "output"]))
        elif key == "input_grads":
            val = draw(st.sampled_from(["yes", "no", "maybe"]))
        else:
            val = _value(draw, key)
        opts.append(f"{key}={val}")
    return "train " + " ".join(opts)


@FUZZ
@given(data=st.data())
def test_fuzz_train_options(tmp_path, cached_loader, data):
    model = data.draw(st.sampled_from(["bias.pcir", f"{SPECS / 'models.py'}:torch_mlp"]))
    spec = TINY_SPEC if model == "bias.pcir" else (SPECS / "torch_mlp_tp2.pcs").read_text()
    spec = spec.replace("output output  replicated", "") + data.draw(train_lines()) + "\n"
    COUNTS["train"][_outcome(tmp_path, model, PCIR_BIAS if model == "bias.pcir" else None, spec)] += 1


def test_fuzz_json_error_line(tmp_path, capsys):
    """With --json, a bad input still ends with one JSON line saying where."""
    (tmp_path / "s.pcs").write_text("mesh tp=2\nfc1.weight colwse\n")
    rc = main(["check", str(SPECS / "tiny_relu_mlp.pcir"), "--spec", str(tmp_path / "s.pcs"), "--json"])
    out = capsys.readouterr().out.strip().splitlines()
    last = json.loads(out[-1])
    assert rc == 2 and last["ok"] is False and "s.pcs:2" in last["where"]


def test_fuzz_print_counts(capsys):
    """Print how many fuzz cases ended how (runs after the fuzz tests in file order)."""
    with capsys.disabled():
        for target, counts in sorted(COUNTS.items()):
            total = sum(counts.values())
            parts = ", ".join(f"{k} {v}" for k, v in counts.most_common())
            print(f"\nfuzz {target}: {total} cases: {parts}")
    assert sum(sum(c.values()) for c in COUNTS.values()) > 0 or not COUNTS
