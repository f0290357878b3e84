"""The op registry: every op of ``parcomp.ir.ops.OPS`` is in every table it must be in.

Adding an op (softmax, say) is a checklist: run this file and it lists the missing
``(op, table)`` pairs.  An op may be left out of a table only by an entry of
:data:`EXEMPT` that says why.  The same order is docs/design/ir.md's "How to add an op".
"""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest

import parcomp.frontends
from parcomp.ir import Graph, Mesh, Node, TensorType, parse_graph, print_graph
from parcomp.ir.ops import OPS
from parcomp.ir.redistribute import plan, step_bytes
from parcomp.ir.transitions import TRANSITIONS
from parcomp.reference.assemble import assemble
from parcomp.reference.interpreter import _LAYOUT_OPS, split_for_ranks
from parcomp.reference.numpy_ops import NUMPY_OPS
from parcomp.rules.sharding import STRATEGY_RULES
from parcomp.rules.vjp import VJP_RULES
from parcomp_backends.torch.emit import OP_FORMATS


# frontend modules that emit no op (their strings name aten ops: torch_fold's view list)
_NO_LOWERINGS = ("fold.py", "outputs.py")


def _torch_frontend_ops() -> set:
    """Ops the torch.export frontend can produce: op names written as string constants in
    its lowering modules, ``aten_table.py`` and every ``parcomp/frontends/torch/*.py`` but
    :data:`_NO_LOWERINGS` (``b.emit("matmul", ...)``, ``_unary(op)`` tuples), not counting
    subscripts such as ``a["input"]`` (aten argument names)."""
    here = pathlib.Path(parcomp.frontends.__file__).parent / "torch"
    out = set()
    for path in [here / "aten_table.py"] + [p for p in sorted(here.glob("*.py"))
                                            if p.name not in _NO_LOWERINGS]:
        tree = ast.parse(path.read_text())
        keys = {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
        out |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                and isinstance(n.value, str) and n.value in OPS and id(n) not in keys}
    return out


_SAMPLE = {"number": 0.5, "int": 0, "bool": False, "str": "tp", "ints": (1, 0)}


def _text_round_trips(op) -> bool:
    """A node of ``op`` with every declared attribute survives print -> parse (.pcir)."""
    d = OPS[op]
    arity = max(d.arity, 1) if d.arity else 0
    ins = [Node(f"a{i}", "input", (), TensorType((2, 2))) for i in range(arity)]
    attrs = tuple(sorted((k, a.choices[0] if a.choices else _SAMPLE[a.type]) for k, a in d.attrs.items()))
    node = Node("y", op, tuple(x.name for x in ins), TensorType((2, 2)), attrs)
    g = Graph(tuple(ins) + (node,), ("y",))
    return parse_graph(print_graph(g)) == g


# table -> test "op is in it"; in the order docs/design/ir.md's "How to add an op" lists them
TABLES = {
    "transition (parcomp/ir/transitions.py TRANSITIONS)": lambda op: op in TRANSITIONS,
    "IR text (parcomp/ir/text.py print -> parse)": _text_round_trips,
    "sharding rule (parcomp/rules/sharding.py STRATEGY_RULES, by op or kind)":
        lambda op: op in STRATEGY_RULES or OPS[op].kind in STRATEGY_RULES,
    "VJP (parcomp/rules/vjp.py VJP_RULES)": lambda op: op in VJP_RULES,
    "numpy (parcomp/reference/numpy_ops.py NUMPY_OPS; interpreter _LAYOUT_OPS)":
        lambda op: op in NUMPY_OPS or op in _LAYOUT_OPS,
    "torch emitter (backends/torch/emit/__init__.py OP_FORMATS)": lambda op: op in OP_FORMATS,
    "torch frontend (parcomp/frontends/torch/aten_table.py TABLE)": lambda op: op in _torch_frontend_ops(),
}
_T = {name.split(" ")[0] + ("_frontend" if "frontend" in name else ""): name for name in TABLES}

_LAYOUT_KINDS = ("kind:collective", "kind:local")
_GRADS = ("relu_grad", "gelu_grad", "tanh_grad", "sigmoid_grad", "silu_grad", "pow_grad",
          "cross_entropy_grad")
_AFTER_AUTODIFF = "inserted by insert-collectives after autodiff; never differentiated"
_BY_AUTODIFF = "made by autodiff (loss, gradients, optimizer), never by a model frontend"

# (table, op or "kind:<kind>") -> why the op is not in that table
EXEMPT = {
    **{(_T["transition"], k): "only layout ops change a layout"
       for k in ("kind:" + kd for kd in {d.kind for d in OPS.values()}) if k not in _LAYOUT_KINDS},
    **{(_T["sharding"], k): "inserted after shard-prop; the verifier checks each against TRANSITIONS"
       for k in _LAYOUT_KINDS},
    (_T["sharding"], "kind:source"): "a source's layout is the spec's (bind-layouts), not derived",
    **{(_T["VJP"], k): _AFTER_AUTODIFF for k in _LAYOUT_KINDS},
    (_T["VJP"], "kind:source"): "a leaf: its gradient is the result, nothing flows further",
    (_T["VJP"], "ones"): "a constant with no operands: nothing to differentiate",
    **{(_T["VJP"], op): "gradients are not differentiated again (no second derivatives)"
       for op in _GRADS},
    (_T["VJP"], "adamw_param"): "the optimizer update comes after the backward pass",
    (_T["numpy"], "kind:source"): "fed by the caller (split_for_ranks), nothing to compute",
    (_T["torch"], "kind:source"): "emitted as load_params / load_inputs, not as a formula",
    **{(_T["torch_frontend"], k): _AFTER_AUTODIFF for k in _LAYOUT_KINDS},
    **{(_T["torch_frontend"], op): _BY_AUTODIFF
       for op in _GRADS + ("adamw_param",)},  # cross_entropy: the loss part's; ones: a routing mask's
    (_T["torch_frontend"], "relayout"): "made by bind-layouts from the spec's output/activation rules",
    **{(_T[t], "kind:lowered"): why for t, why in (
        ("sharding", "made after sharding by parcomp/passes/lowering/lower.py from ops whose layouts were checked"),
        ("VJP", "made by lowering, after autodiff; never differentiated"),
        ("torch_frontend", "made by lowering (parcomp/passes/lowering/lower.py), never by a frontend"))},
    # norms + embedding part: the gradient ops are made by their forward op's VJP
    **{(_T[t], op): why for op in ("layer_norm_grad", "rms_norm_grad", "embedding_grad") for t, why in (
        ("VJP", "gradients are not differentiated again (no second derivatives)"),
        ("torch_frontend", _BY_AUTODIFF))},
    # attention part
    **{(_T["torch_frontend"], op): _BY_AUTODIFF for op in ("slice_grad", "sdpa_grad")},
    **{(_T["VJP"], op): "gradients are not differentiated again (no second derivatives)"
       for op in ("sdpa_grad",)},
    # reductions part
    (_T["VJP"], "amax_grad"): "gradients are not differentiated again (no second derivatives)",
    **{(_T["torch_frontend"], op): "made by decompose-reductions / autodiff (parcomp/passes/decompose.py)"
       for op in ("amax_grad", "argmax_key", "argmax_index", "pick_grad")},  # pick, label_mask: loss part
    (_T["torch_frontend"], "mask_pad"): "vocab padding: written in a model (.pcir) around padded logits",
    # training options: gradient clipping's factor, made by autodiff after backward
    (_T["VJP"], "clip_coef"): "the optimizer update comes after the backward pass",
    (_T["torch_frontend"], "clip_coef"): _BY_AUTODIFF,
    # expert parallel MoE: the gradient ops are made by their forward op's VJP
    **{(_T[t], op): why for op in ("moe_route_grad", "moe_combine_grad_c") for t, why in (
        ("VJP", "gradients are not differentiated again (no second derivatives)"),
        ("torch_frontend", _BY_AUTODIFF))},
    (_T["VJP"], "grad_upcast"): "mixed precision: made by autodiff after backward, never differentiated",
    (_T["torch_frontend"], "grad_upcast"): _BY_AUTODIFF,
    **{(_T[t], op): why for op in ("nonfinite", "amp_select", "amp_ratio", "amp_tracker") for t, why in (
        ("VJP", "fp16 loss scaling: made by autodiff after backward, never differentiated"),
        ("torch_frontend", _BY_AUTODIFF))},
}


def _exempt(table, op):
    return (table, op) in EXEMPT or (table, "kind:" + OPS[op].kind) in EXEMPT


def missing_pairs() -> list:
    """``(op, table)`` pairs where the op is absent and no exemption says why."""
    return [(op, table) for op in OPS for table, has in TABLES.items()
            if not _exempt(table, op) and not has(op)]


def test_every_op_is_in_every_table_it_must_be_in():
    missing = missing_pairs()
    assert not missing, "ops missing from tables (add the entry, or an EXEMPT line saying why):\n" + \
        "\n".join(f"  {op}: {table}" for op, table in missing)


def test_exemptions_are_not_stale():
    kinds = {"kind:" + d.kind for d in OPS.values()}
    for (table, what), reason in EXEMPT.items():
        assert table in TABLES and reason
        assert what in OPS or what in kinds, f"EXEMPT names {what!r}, which is no op or kind"
        ops = [what] if what in OPS else [op for op in OPS if "kind:" + OPS[op].kind == what]
        present = [op for op in ops if TABLES[table](op)]
        assert not present, f"{present} are in {table}: drop the EXEMPT entry for {what!r}"


@pytest.mark.parametrize("table, op", [
    ("VJP", "relu"), ("numpy", "matmul"), ("torch", "gelu"), ("transition", "all_gather"),
])
def test_a_deleted_entry_is_listed(monkeypatch, table, op):
    tables = {"VJP": VJP_RULES, "numpy": NUMPY_OPS, "torch": OP_FORMATS,
              "transition": TRANSITIONS}
    monkeypatch.delitem(tables[table], op)
    assert (op, _T[table]) in missing_pairs()


@pytest.mark.parametrize("op", sorted(TRANSITIONS))
def test_planner_verifier_and_interpreter_agree_with_the_transition_table(op):
    """One axis of 4 ranks: the planner picks ``op`` for its table placements, charges its
    table bytes, and the interpreter's simulation turns the ``before`` split into ``after``."""
    t, mesh = TRANSITIONS[op], Mesh((("tp", 4),))
    before, after = t.placements(1, 0)
    (step,) = plan((before,), (after,), 2)
    assert step.kind == op and step.is_collective == t.collective
    ty = TensorType((8, 8))
    local = {p: 4 * 8 * 8 // (4 if hasattr(p, "dim") else 1) for p in (before, after)}
    assert step_bytes(step, ty, mesh) == t.sent(4, local[before], local[after])
    full = np.arange(64, dtype=np.float32).reshape(8, 8)
    node = Node("y", op, ("x",), ty, (("axis", "tp"), ("dim", 1), ("src_dim", 0)))
    ys = _LAYOUT_OPS[op](split_for_ranks(full, (before,), mesh), node)
    np.testing.assert_array_equal(assemble(ys, (after,), full.shape, mesh), full)


def test_one_fresh_name_generator_gives_each_name_once():
    from parcomp.ir.names import NameGen
    names = NameGen(["h", "h_2"])
    assert [names.fresh("h"), names.fresh("h"), names.fresh("y"), names.fresh("y")] == ["h_3", "h_4", "y", "y_2"]
    assert names.take("w") == "w" and names.fresh("w") == "w_2" and "w" in names


def test_a_pinned_output_never_takes_a_models_value_name(tmp_path, capsys):
    from parcomp.cli.main import main
    (tmp_path / "m.pcir").write_text("%x: f32[2,4] = input()\n%x.as_output: f32[2,4] = relu(%x)\n"
                                     "return %x, %x.as_output as z\n")
    (tmp_path / "s.pcs").write_text("mesh tp=2\n")
    rc = main(["check", str(tmp_path / "m.pcir"), "--spec", str(tmp_path / "s.pcs")])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.parametrize("text", ["[S(0), R]", "[R, P]", "[S(1), S(0)]"])
def test_one_layout_notation_in_ir_text_specs_and_reports(text):
    from parcomp.ir.types import layout_str, parse_layout
    from parcomp.spec import parse_spec
    lay = parse_layout(text)
    assert layout_str(lay) == text
    ir = parse_graph(f"mesh dp=2 tp=2\n%x: f32[4,4] {text} = input()\nreturn %x\n")
    assert ir["x"].layout == lay and f"%x: f32[4,4] {text} = input()" in print_graph(ir)
    spec = parse_spec(f"mesh dp=2 tp=2\ninput x {text}\n")
    assert spec.rules[0].layout.explicit == lay
