"""Every VJP rule against central finite differences in float64."""
import numpy as np
import pytest

from parcomp.ir import parse_graph
from parcomp.ir.graph import Graph
from parcomp.passes.autodiff import Builder, backward
from parcomp.reference.numpy_ops import run_unsharded
from parcomp.rules.vjp import VJP_RULES

_ATTN = ("%q: f64[1,1,3,4] = reshape(%a)\n%k: f64[1,1,5,4] = input()\n"  # attention part
         "%v: f64[1,1,5,2] = input()\n")
CASES = {  # op -> (pcir body with inputs %a [%b], output %y), inputs positive where needed
    "relu": "%y: f64[3,4] = relu(%a)",
    "gelu": '%y: f64[3,4] = gelu(%a) {approximate="none"}',
    "gelu_tanh": '%y: f64[3,4] = gelu(%a) {approximate="tanh"}',
    "silu": "%y: f64[3,4] = silu(%a)",
    "pow": "%y: f64[3,4] = pow(%a) {exponent=3.0}",
    "tanh": "%y: f64[3,4] = tanh(%a)",
    "sigmoid": "%y: f64[3,4] = sigmoid(%a)",
    "exp": "%y: f64[3,4] = exp(%a)",
    "add_scalar": "%y: f64[3,4] = add_scalar(%a) {value=2.0}",
    "neg": "%y: f64[3,4] = neg(%a)",
    "scale": "%y: f64[3,4] = scale(%a) {value=-1.5}",
    "add": "%b: f64[4] = input()\n%y: f64[3,4] = add(%a, %b)",
    "sub": "%b: f64[1,4] = input()\n%y: f64[3,4] = sub(%a, %b)",
    "mul": "%b: f64[4] = input()\n%y: f64[3,4] = mul(%a, %b)",
    "div": "%b: f64[3,4] = input()\n%y: f64[3,4] = div(%a, %b)",
    "matmul": "%b: f64[4,5] = input()\n%y: f64[3,5] = matmul(%a, %b)",
    "permute": "%y: f64[4,3] = permute(%a) {perm=(1, 0)}",
    "reshape": "%y: f64[2,6] = reshape(%a)",
    "sum": "%y: f64[4] = sum(%a) {dims=(0,)}",
    "expand": "%b: f64[4] = input()\n%y: f64[3,4] = expand(%b) {dims=(0,)}",
    "cross_entropy": "%l: i64[3] = input()\n%y: f64[3] = cross_entropy(%a, %l)",
    # attention part
    "slice": "%y: f64[3,2] = slice(%a) {dim=1, start=1, stop=4, step=2}",
    "slice_grad": "%y: f64[6,4] = slice_grad(%a) {dim=0, start=1, stop=6, step=2}",
    "cat": "%b: f64[3,2] = input()\n%y: f64[3,6] = cat(%b, %a) {dim=1}",
    "pad": "%y: f64[3,7] = pad(%a) {dim=1, before=1, after=2, value=0.5}",  # a model's own loss (loss17)
    "sdpa": _ATTN + "%y: f64[1,1,3,2] = sdpa(%q, %k, %v) {causal=true, scale=0.8}",
    "sdpa_full": _ATTN + "%y: f64[1,1,3,2] = sdpa(%q, %k, %v) {scale=0.8}",
    "cos": "%y: f64[3,4] = cos(%a)",
    "sin": "%y: f64[3,4] = sin(%a)",
    "cast": "%y: f64[3,4] = cast(%a)",
    "arange": "%r: f64[4] = arange() {start=1, step=0.5}\n%y: f64[3,4] = mul(%a, %r)",
    # norms + embedding part
    "layer_norm": "%b: f64[4] = input()\n%c: f64[4] = input()\n%y: f64[3,4] = layer_norm(%a, %b, %c) {eps=1e-05}",
    "rms_norm": "%b: f64[4] = input()\n%y: f64[3,4] = rms_norm(%a, %b) {eps=1e-06}",
    "dropout": "%y: f64[3,4] = dropout(%a) {p=0.25, seed=3}",
    "embedding": "%l: i64[2,5] = input()\n%y: f64[2,5,4] = embedding(%l, %a)",
    # reductions part
    "cross_entropy_smooth": ("%l: i64[3] = input()\n"
                             "%y: f64[3] = cross_entropy(%a, %l) {ignore_index=1, label_smoothing=0.2}"),
    "log": "%y: f64[3,4] = log(%a)",
    "amax": "%y: f64[3] = amax(%a) {dims=(1,)}",
    "mean": "%y: f64[4] = mean(%a) {dims=(0,)}",
    "softmax": "%y: f64[3,4] = softmax(%a) {dim=1}",
    "log_softmax": "%y: f64[3,4] = log_softmax(%a) {dim=0}",
    "pick": "%l: i64[3] = input()\n%y: f64[3] = pick(%a, %l) {ignore_index=2}",
    "topk": "%y: f64[3,2] = topk(%a) {dim=1, k=2}",
    "take_along": "%i: i64[3,2] = input()\n%y: f64[3,2] = take_along(%a, %i) {dim=1}",
    "put_along": "%i: i64[3,4] = input()\n%y: f64[3,6] = put_along(%a, %i) {dim=1, size=6}",
    "pick_grad": "%g: f64[3] = input()\n%l: i64[3] = input()\n%y: f64[3,4] = pick_grad(%g, %l)",
    "mask_pad": "%y: f64[3,4] = mask_pad(%a) {fill=\"0\", size=3}",  # lowest * w would overflow
}
# integer results: no gradient flows through them (their VJP gives None)
NO_GRADIENT = {"argmax", "argmax_key", "argmax_index", "label_mask", "topk_index"}
#: MoE ops: their VJPs need routing operands (combine weights, capacities); they are
#: checked against torch autograd and the real Mixtral block in tests/moe/test_moe.py
MOE_OPS = {"moe_route", "moe_dispatch", "moe_combine"}


def _graph(body):
    text = "%a: f64[3,4] = input()\n" + body + "\n%w: f64[" + _out_shape(body) + "] = input()\n"
    text += "%yw: f64[" + _out_shape(body) + "] = mul(%y, %w)\n"
    text += "%loss: f64[] = sum(%yw) {dims=(" + ", ".join(str(d) for d in range(_out_rank(body))) + \
        ("," if _out_rank(body) == 1 else "") + ")}\nreturn %loss\n"
    return parse_graph(text)


def _out_shape(body):
    line = [x for x in body.splitlines() if x.startswith("%y")][0]
    return line.split("[")[1].split("]")[0]


def _out_rank(body):
    return len(_out_shape(body).split(","))


@pytest.mark.parametrize("case", sorted(CASES))
def test_vjp_matches_central_differences(case):
    g = _graph(CASES[case])
    rng = np.random.default_rng(0)
    feeds = {}
    for n in g.inputs:
        if n.type.dtype == "int64":
            feeds[n.name] = rng.integers(0, 4, n.type.shape)
        else:
            feeds[n.name] = rng.uniform(0.5, 1.5, n.type.shape) * rng.choice([-1, 1], n.type.shape) \
                if case not in ("div", "pow", "log") else rng.uniform(0.5, 1.5, n.type.shape)
    wrt = [n.name for n in g.inputs if n.type.dtype == "float64" and n.name != "w"]
    b = Builder(g)
    seed = b.op("ones", [], type=g["loss"].type)
    grads = backward(b, g, {"loss": seed}, wrt)
    gg = Graph(tuple(b.nodes), tuple(grads[w] for w in wrt))
    got = run_unsharded(gg, feeds)
    eps = 1e-6
    loss = float(np.max(np.abs(run_unsharded(g, feeds)["loss"])))
    for w, gname in zip(wrt, gg.outputs):
        num, num2 = _central(g, feeds, w, eps), _central(g, feeds, w, 2 * eps)
        allowed = _fd_error(loss, feeds, w, eps, num, num2) + 1e-9 * np.max(np.abs(num))
        err = np.abs(got[gname] - num)
        assert (err <= allowed).all(), (f"d/d{w}", float(err.max()), float(allowed.min()))


def _central(g, feeds, w, eps):
    num = np.zeros_like(feeds[w])
    for idx in np.ndindex(feeds[w].shape):
        for sign in (1, -1):
            f = dict(feeds)
            f[w] = feeds[w].copy()
            f[w][idx] += sign * eps
            num[idx] += sign * run_unsharded(g, f)["loss"] / (2 * eps)
    return num


def _fd_error(loss, feeds, w, eps, num, num2):
    """Error of a central difference with step eps: truncation |D(2h) - D(h)| (3x Richardson's
    estimate of the h**2 term), the loss's rounding over 2h (64 roundings of its scale: these
    graphs are a few ops deep), and the rounding of x +- h."""
    u = 2.0 ** -53  # float64's unit roundoff
    return np.abs(num2 - num) + 64 * u * loss / eps + u * np.abs(feeds[w]) / eps * np.abs(num)


def test_every_differentiable_op_has_a_case():
    assert set(VJP_RULES) - {"relayout"} - NO_GRADIENT - MOE_OPS <= {c.split("_tanh")[0].split("_full")[0] for c in CASES}
