"""Every sharding strategy of every op, checked against numpy ground truth.

DTensor's ``strategy_validation`` idea: for each op and each single-axis strategy
(in placements -> out placement) of the rule table, split random inputs by the
strategy (partial inputs with sign-varying offsets), run the op on each rank's
local pieces, rebuild the output from its claimed placement, and compare with
the op on the full inputs. A wrong rule (claimed valid but not) fails here.
"""
import numpy as np
import pytest

from parcomp.ir import Mesh, Partial, TensorType, parse_graph
from parcomp.ir.types import Shard
from parcomp.ir.types import local_shape
from parcomp.reference.assemble import assemble
from parcomp.reference.cp_ops import Q_OPERAND, needs_q_start
from parcomp.reference.interpreter import split_for_ranks
from parcomp.reference.norm_ops import rank_attrs
from parcomp.reference.numpy_ops import NUMPY_OPS
from parcomp.rules.sharding import STRATEGY_RULES, axis_strategies

from numerics import assert_equivalent

MESH = Mesh((("tp", 2),))
_QKV = "".join(f"%{x}: f64[2,2,4,2] = input()\n" for x in "qkv")  # attention part
CASES = {  # op -> pcir lines defining %a [%b %c %d] and %y; every dim divisible by 2
    "relu": "%y: f64[4,6] = relu(%a)",
    "gelu": '%y: f64[4,6] = gelu(%a) {approximate="tanh"}',
    "tanh": "%y: f64[4,6] = tanh(%a)",
    "exp": "%y: f64[4,6] = exp(%a)",
    "sigmoid": "%y: f64[4,6] = sigmoid(%a)",
    "silu": "%y: f64[4,6] = silu(%a)",
    "pow": "%y: f64[4,6] = pow(%a) {exponent=3.0}",
    "add_scalar": "%y: f64[4,6] = add_scalar(%a) {value=1.5}",
    "neg": "%y: f64[4,6] = neg(%a)",
    "scale": "%y: f64[4,6] = scale(%a) {value=-2.0}",
    "add": "%b: f64[6] = input()\n%y: f64[4,6] = add(%a, %b)",
    "sub": "%b: f64[4,6] = input()\n%y: f64[4,6] = sub(%a, %b)",
    "mul": "%b: f64[1,6] = input()\n%y: f64[4,6] = mul(%a, %b)",
    "div": "%b: f64[4,6] = input()\n%y: f64[4,6] = div(%a, %b)",
    "matmul": "%b: f64[6,2] = input()\n%y: f64[4,2] = matmul(%a, %b)",
    "matmul_batched": "%b: f64[4,6,2] = input()\n%a3: f64[4,2,6] = input()\n%y: f64[4,2,2] = matmul(%a3, %b)",
    "permute": "%y: f64[6,4] = permute(%a) {perm=(1, 0)}",
    "reshape": "%y: f64[2,2,6] = reshape(%a)",
    "sum": "%y: f64[6] = sum(%a) {dims=(0,)}",
    "expand": "%b: f64[6] = input()\n%y: f64[4,6] = expand(%b) {dims=(0,)}",
    "relu_grad": "%b: f64[4,6] = input()\n%y: f64[4,6] = relu_grad(%a, %b)",
    "gelu_grad": '%b: f64[4,6] = input()\n%y: f64[4,6] = gelu_grad(%a, %b) {approximate="none"}',
    "tanh_grad": "%b: f64[4,6] = input()\n%y: f64[4,6] = tanh_grad(%a, %b)",
    "sigmoid_grad": "%b: f64[4,6] = input()\n%y: f64[4,6] = sigmoid_grad(%a, %b)",
    "silu_grad": "%b: f64[4,6] = input()\n%y: f64[4,6] = silu_grad(%a, %b)",
    "pow_grad": "%b: f64[4,6] = input()\n%y: f64[4,6] = pow_grad(%a, %b) {exponent=2.0}",
    "cross_entropy": "%l: i64[4] = input()\n%y: f64[4] = cross_entropy(%a, %l)",
    "cross_entropy_grad": ("%g: f64[4] = input()\n%l: i64[4] = input()\n"
                           "%y: f64[4,6] = cross_entropy_grad(%g, %a, %l)"),
    "adamw_param": ("%m: f64[4,6] = input()\n%v: f64[4,6] = input()\n%t: f64[] = input()\n"
                    "%y: f64[4,6] = adamw_param(%a, %m, %v, %t) {beta1=0.9, beta2=0.99, eps=1e-08, "
                    "lr=0.1, weight_decay=0.01}"),
    "ones": "%y: f64[4,6] = ones()",
    "clip_coef": "%v: f64[4,6] = input()\n%y: f64[4,6] = clip_coef(%v) {max_norm=1.5}",
    "grad_upcast": "%v: f16[4,6] = input()\n%y: f32[4,6] = grad_upcast(%v)",  # mixed precision
    "nonfinite": "%y: f32[4,6] = nonfinite(%a)",  # fp16 loss scaling
    "amp_select": "%f: f64[] = input()\n%b: f64[4,6] = input()\n%y: f64[4,6] = amp_select(%f, %a, %b)",
    "amp_ratio": "%f: f64[] = input()\n%r: f64[] = input()\n%t: f64[] = input()\n"
                 "%y: f64[] = amp_ratio(%f, %r, %t) {interval=3}",
    "amp_tracker": "%f: f64[] = input()\n%t: f64[] = input()\n%y: f64[] = amp_tracker(%f, %t) {interval=3}",
    # attention part
    "slice": "%y: f64[4,3] = slice(%a) {dim=1, start=1, stop=6, step=2}",
    "slice_whole": "%y: f64[4,6] = slice(%a) {dim=1, start=0, stop=6, step=1}",
    "slice_grad": "%b: f64[2,6] = input()\n%y: f64[4,6] = slice_grad(%b) {dim=0, start=1, stop=4, step=2}",
    "cat": "%b: f64[4,2] = input()\n%y: f64[4,8] = cat(%a, %b) {dim=1}",
    # loss part: a constant pad of one dim; a zero fill keeps partial sums partial
    "pad": "%y: f64[4,9] = pad(%a) {after=2, before=1, dim=1, value=-100.0}",
    "pad_zero": "%y: f64[7,6] = pad(%a) {after=0, before=3, dim=0, value=0.0}",
    "sdpa": _QKV + "%y: f64[2,2,4,2] = sdpa(%q, %k, %v) {causal=true, scale=0.7}",
    "sdpa_full": _QKV + "%y: f64[2,2,4,2] = sdpa(%q, %k, %v) {scale=0.7}",
    **{f"sdpa_grad_{w}{c}": _QKV + f"%g: f64[2,2,4,2] = input()\n%y: f64[2,2,4,2] = sdpa_grad(%g, %q, %k, %v) "
       f"{{causal={c == ''}, scale=0.7, wrt=\"{w}\"}}".replace("True", "true").replace("False", "false")
       for w in "qkv" for c in ("", "_full")},
    # context parallel: causal with the query rows split, the mask at each rank's q_start
    "sdpa_cp": _QKV + '%y: f64[2,2,4,2] = sdpa(%q, %k, %v) {causal=true, cp="all_gather", scale=0.7}',
    **{f"sdpa_grad_{w}_cp": _QKV + f"%g: f64[2,2,4,2] = input()\n%y: f64[2,2,4,2] = sdpa_grad(%g, %q, %k, %v) "
       f'{{causal=true, cp="all_gather", scale=0.7, wrt="{w}"}}' for w in "qkv"},
    "cos": "%y: f64[4,6] = cos(%a)",
    "sin": "%y: f64[4,6] = sin(%a)",
    "cast": "%y: f32[4,6] = cast(%a)",
    "arange": "%y: f64[6] = arange() {start=1, step=0.5}",
    # norms + embedding part
    "layer_norm": "%w: f64[6] = input()\n%c: f64[6] = input()\n%y: f64[4,6] = layer_norm(%a, %w, %c) {eps=1e-05}",
    "layer_norm_plain": "%y: f64[4,6] = layer_norm(%a) {eps=1e-05}",
    "rms_norm": "%w: f64[6] = input()\n%y: f64[4,6] = rms_norm(%a, %w) {eps=1e-06}",
    "layer_norm_grad": ("%g: f64[4,6] = input()\n%w: f64[6] = input()\n"
                        "%y: f64[4,6] = layer_norm_grad(%g, %a, %w) {eps=1e-05}"),
    "rms_norm_grad": "%g: f64[4,6] = input()\n%y: f64[4,6] = rms_norm_grad(%g, %a) {eps=1e-06}",
    "dropout": "%y: f64[4,6] = dropout(%a) {p=0.5, seed=7}",
    "embedding": "%ids: i64[2,4] = input()\n%y: f64[2,4,6] = embedding(%ids, %a)",
    "embedding_grad": "%g: f64[2,4,6] = input()\n%ids: i64[2,4] = input()\n%y: f64[4,6] = embedding_grad(%g, %ids)",
    # reductions part: a max over a split dim is a P(max), never summed
    "log": "%b: f64[4,6] = input()\n%y: f64[4,6] = log(%b)",
    "amax": "%y: f64[4] = amax(%a) {dims=(1,)}",
    "amax_both": "%y: f64[] = amax(%a) {dims=(0, 1)}",
    "amax_grad": "%g: f64[4] = input()\n%m: f64[4] = input()\n%y: f64[4,6] = amax_grad(%g, %a, %m) {dims=(1,)}",
    "argmax": "%y: i64[4] = argmax(%a) {dim=1}",
    "topk": "%y: f64[4,2] = topk(%a) {dim=1, k=2}",
    "topk_index": "%y: i64[4,2] = topk_index(%a) {dim=1, k=2}",
    "take_along": "%i: i64[4,2] = input()\n%y: f64[4,2] = take_along(%a, %i) {dim=1}",
    "put_along": ("%g: f64[4,2] = input()\n%i: i64[4,2] = input()\n"
                  "%y: f64[4,6] = put_along(%g, %i) {dim=1, size=6}"),
    "argmax_key": "%y: i64[6] = argmax_key(%a) {dim=0}",
    "argmax_index": "%k: i64[4] = input()\n%y: i64[4] = argmax_index(%k)",
    "mean": "%y: f64[6] = mean(%a) {dims=(0,)}",
    "softmax": "%y: f64[4,6] = softmax(%a) {dim=1}",
    "log_softmax": "%y: f64[4,6] = log_softmax(%a) {dim=0}",
    "pick": "%l: i64[4] = input()\n%y: f64[4] = pick(%a, %l) {ignore_index=2}",
    "pick_grad": "%g: f64[4] = input()\n%l: i64[4] = input()\n%y: f64[4,6] = pick_grad(%g, %l)",
    "label_mask": '%l: i64[4,6] = input()\n%y: f64[4,6] = label_mask(%l) {dtype="float64", ignore_index=3}',
    "mask_pad": "%y: f64[4,6] = mask_pad(%a) {size=5}",
    "cross_entropy_smooth": ("%l: i64[4] = input()\n"
                             "%y: f64[4] = cross_entropy(%a, %l) {ignore_index=2, label_smoothing=0.1}"),
    # expert parallel MoE: rows, experts or hidden split; capacity 3 < seq 4 drops
    **{f"moe_route{c}": f"%z: f64[2,4,4] = input()\n%y: f64[2,4,4] = moe_route(%z) {{capacity={c}, top_k=2}}"
       for c in (0, 3)},
    "moe_route_grad": ("%g: f64[2,4,4] = input()\n%z: f64[2,4,4] = input()\n"
                       "%y: f64[2,4,4] = moe_route_grad(%g, %z) {capacity=3, top_k=2}"),
    **{f"moe_dispatch_{w}": ("%x: f64[2,4,2] = input()\n%c: f64[2,4,4] = input()\n"
                             f"%y: f64[2,4,2,2] = moe_dispatch(%x, %c) {{capacity=2, weighted={w}}}")
       for w in ("true", "false")},
    **{f"moe_combine_{w}": ("%s: f64[2,4,2,2] = input()\n%c: f64[2,4,4] = input()\n"
                            f"%y: f64[2,4,2] = moe_combine(%s, %c) {{weighted={w}}}") for w in ("true", "false")},
    "moe_combine_grad_c": ("%g: f64[2,4,2] = input()\n%s: f64[2,4,2,2] = input()\n%c: f64[2,4,4] = input()\n"
                           "%y: f64[2,4,4] = moe_combine_grad_c(%g, %s, %c)"),
}


def _node_and_inputs(case):
    g = parse_graph("%a: f64[4,6] = input()\n" + CASES[case] + "\nreturn %y\n")
    y = g["y"]
    return y, [g[i] for i in y.inputs]


def _feed(node, rng):
    if node.type.dtype == "int64":
        return rng.integers(0, 4 if node.name == "ids" else 6, node.type.shape)
    x = rng.uniform(0.5, 1.5, node.type.shape) * rng.choice([-1.0, 1.0], node.type.shape)
    return np.abs(x) if node.name in ("v", "b") and node.type.shape == (4, 6) else x


def _at_index(local, r, ins, in_pl, out_pl):
    """``local`` with ``index_start`` of rank r for an op that indexes a split dim."""
    from parcomp.ir.ops import RANKED_OPS
    if local.op not in RANKED_OPS:
        return local
    which, dim = RANKED_OPS[local.op]
    ty, pl = (local.type, out_pl) if which is None else (ins[which].type, in_pl[which])
    d = (local.attr(dim) if isinstance(dim, str) else dim) % ty.rank
    size = ty.shape[d] // (MESH.size if which is not None else 1)  # local is already local
    return local.with_attrs(index_start=r * size) if pl == Shard(d) else local


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_strategy_of_the_rule_table_is_sound(case):
    y, ins = _node_and_inputs(case)
    rng = np.random.default_rng(0)
    full = [_feed(n, rng) for n in ins]
    if case == "adamw_param":
        full[3] = np.array(2.0)
    if case == "amax_grad":  # y = amax(a), with a tie in row 0
        full[1][0, 3] = full[1][0].max()
        full[2] = full[1].max(axis=1)
    want = NUMPY_OPS[y.op](full, y)
    strategies = axis_strategies(y, [n.type for n in ins])
    assert strategies, f"{y.op} has no strategy"
    for in_pl, out_pl in strategies:
        assert not any(isinstance(p, Partial) for n, p in zip(ins, in_pl) if n.type.dtype == "int64")
        split = [split_for_ranks(x, (p,), MESH, np.random.default_rng(1)) for x, p in zip(full, in_pl)]
        lty = TensorType(local_shape(y.type, (out_pl,), MESH), y.type.dtype)
        local = y.__class__(y.name, y.op, y.inputs, lty, y.attrs)
        outs = [NUMPY_OPS[y.op]([s[r] for s in split], _at_rank(local, split, ins, in_pl, out_pl, r))
                for r in range(MESH.size)]
        got = assemble(list(outs), (out_pl,), y.type.shape, MESH,
                       "float64" if y.type.dtype.startswith("float") else y.type.dtype)
        assert_equivalent(got, want, what=f"{y.op}: {[str(p) for p in in_pl]} -> {out_pl}")


def _at_rank(local, split, ins, in_pl, out_pl, r):
    """``local`` as rank r runs it: where its block lies (dropout, vocab-parallel embedding)
    and the index of its first element along a split dim it indexes (pick, argmax_key, ...)."""
    types = [TensorType(s[r].shape, n.type.dtype) for s, n in zip(split, ins)]
    local = rank_attrs(local, types, [(p,) for p in in_pl], (out_pl,), MESH, MESH.coords(r))
    if needs_q_start(local) and in_pl[Q_OPERAND[local.op]] == Shard(2):  # context parallel
        local = local.with_attrs(q_start=r * types[Q_OPERAND[local.op]].shape[2])
    return _at_index(local, r, ins, in_pl, out_pl)


def test_every_op_kind_with_strategies_has_a_case():
    from parcomp.ir.ops import OPS
    covered = {CASES[c].split(" = ")[-1].split("(")[0] for c in CASES}
    needing = {op for op, d in OPS.items()  # lowered ops exist only after sharding (passes/lowering/lower.py)
               if d.kind not in ("source", "collective", "local", "relayout", "lowered")}
    assert needing <= covered, needing - covered
    assert set(STRATEGY_RULES)  # the table exists
