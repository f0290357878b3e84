"""Lowering (parcomp/passes/lowering/lower.py): the interpreter runs exactly what program.py runs.

For every shipped spec, the op sequence the reference interpreter executed equals the
statements of the emitted ``forward`` / ``train_step`` (parsed with ``ast``, each mapped
back to its node through the variable it assigns), its ``del`` lines free what the
interpreter freed, and the interpreter's peak live bytes are the report's ``peak_live``.
Then the passes one by one, on small graphs: each rewrite and each refusal.
"""
from __future__ import annotations

import ast
import re
import functools
from pathlib import Path

import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.ir import parse_graph
from parcomp.ir.liveness import frees_of, peak_bytes
from parcomp.ir.ops import LAYOUT_OPS
from parcomp.passes.lowering.lower import in_place, overlap_collectives
from parcomp.reference import moe_packed
from parcomp.reference.interpreter import run_spmd
from parcomp.reference.numpy_ops import NUMPY_OPS, run_unsharded
from parcomp.spec import load_spec, parse_spec

from faults import model_of
from graphs import mlp_graph, random_feeds
from numerics import assert_all_equivalent

ROOT = Path(__file__).resolve().parents[1].parent
SPECS = ROOT / "specs"
MODELS = str(SPECS / "models.py")
SHIPPED = sorted(p.stem for p in SPECS.glob("*.pcs"))


@functools.lru_cache(maxsize=None)
def _model(spec_name):
    from parcomp.frontends.loader import load_model

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    return load_model(model_of(spec_name))[0]


def _compiled(spec_name):
    return compile_graph(_model(spec_name), load_spec(SPECS / f"{spec_name}.pcs"))


def _feeds(c):
    feeds = random_feeds(c.logical, 0)
    for n in c.logical.params:
        if n.name.endswith("exp_avg_sq"):
            feeds[n.name] = np.abs(feeds[n.name])
    if "step" in feeds:
        feeds["step"] = np.array(2.0, "f4")
    if "labels" in feeds:
        feeds["labels"] = np.zeros(feeds["labels"].shape, "int64")
    return feeds


def _multi_tensor_runs(program, names) -> tuple:
    """The optimizer's multi-tensor calls (emit/updates.py): ``(runs, plan)``, ``runs`` the node
    names each group's call computes, in program order (a group's nodes are contiguous)."""
    from parcomp_backends.torch.emit.updates import update_plan

    plan = update_plan(program.graph, names)
    runs = []
    for n in program.graph.nodes:
        if n.name in plan.skipped:
            if n.name in plan.lines or not runs:
                runs.append([])
            runs[-1].append(n.name)
    return runs, plan


def _statements(text, program):
    """``[(node name, [variables deleted after it])]`` of the emitted step function, in order.
    An optimizer group's multi-tensor call (``fused_adamw_(...)``, ``fused_sgd_(...)``)
    counts as its nodes' statements, its one ``del`` as the last one's."""
    from parcomp_backends.torch.emit import python_names

    pynames = python_names(program)
    var_to_node = {v: k for k, v in pynames.items()}
    runs, plan = _multi_tensor_runs(program, pynames)
    # one attention's gradients are one statement at the first of them (``a, b, c =
    # attention_grads(...)``); the others keep their place as a comment "X: computed above with
    # A", read here as the statement ``X = X``
    above = re.compile(r"^(\s+)# (\w+): computed above with \w+ \(one backward of the (?:attention|layer norm|RMS norm)\)$",
                       re.M)
    # a layer or RMS norm's gradients likewise (``dx, dw, db = layer_norm_grads(...)``); the nodes that only
    # served its weight gradient (``layer_norm(x)``, the ``mul``) keep their place as a comment
    # "X: not needed (...)", read as ``X = X``, and their values are never made, so never deleted
    unmade = re.compile(r"^(\s+)# (\w+): not needed \(the (?:layer norm|RMS norm)'s backward at \w+ gives its weight gradient\)$",
                        re.M)
    later = {v for _, v in above.findall(text)}
    skipped = {var_to_node[v] for _, v in unmade.findall(text)}
    tree = ast.parse(unmade.sub(r"\1\2 = \2", above.sub(r"\1\2 = \2", text)))
    fn = next(f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in ("forward", "train_step"))
    out = []
    for st in fn.body:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            continue  # the docstring
        call = st.value if isinstance(st, (ast.Expr, ast.Assign)) else None
        if isinstance(call, ast.Call) and re.match(r"fused_(adamw|sgd)_$", ast.unparse(call.func)):
            out += [(m, []) for m in runs.pop(0)]  # the group's nodes, in order
            continue
        if isinstance(st, ast.Assign):
            assert len(st.targets) == 1, ast.unparse(st)
            target = st.targets[0]
            names = [e.id for e in target.elts] if isinstance(target, ast.Tuple) else [target.id]
            # an attention's forward keeps its kernel's tensors beside its output (``y, y_saved =
            # attention_forward(...)``): no node of their own, deleted after the backward reads them
            names = [v for v in names if v in var_to_node or not v.endswith("_saved")]
            if not any(v in var_to_node for v in names):
                # the dropless MoE program's routing plans (``X_route_plan = moe_route_plan(X)``):
                # no node of their own, computed just before the statement that reads them
                assert all("_plan" in v for v in names), ast.unparse(st)
                continue
            here = [v for v in names if v not in later] if len(names) > 1 else names
            assert len(here) == 1, ast.unparse(st)
            out.append((var_to_node[here[0]], []))
        elif isinstance(st, ast.Delete):
            out[-1][1].extend(t.id for t in st.targets if t.id in var_to_node or not t.id.endswith("_saved"))
        else:
            assert isinstance(st, ast.Return), f"unexpected statement {ast.unparse(st)}"
    assert not runs, runs
    return out, skipped | plan.unmade | plan.kept, {**pynames, **plan.alias}


@pytest.mark.parametrize("spec_name", [s for s in SHIPPED if "_pp" not in s])  # a pp spec emits the
def test_interpreter_runs_the_emitted_statements_in_order(spec_name):  # pipelined program (test_pipeline*)
    from parcomp_backends.torch import emit_program

    c = _compiled(spec_name)
    run = run_spmd(c.program, _feeds(c))
    stmts, unmade, var = _statements(emit_program(c, "cpu"), c.program_)
    assert [s for s, _ in stmts] == run.ops == [n.name for n in c.program.nodes]
    want = [[var[v] for v in frees_of(c.program[s]) if v not in unmade] for s, _ in stmts]
    runs, _ = _multi_tensor_runs(c.program_, var)
    at = {s: i for i, (s, _) in enumerate(stmts)}
    for run_nodes in runs:  # a group's values die in one del after its call
        last = at[run_nodes[-1]]
        for m in run_nodes[:-1]:
            want[last] += want[at[m]]
            want[at[m]] = []
    assert [sorted(d) for _, d in stmts] == [sorted(w) for w in want]
    peak = c.report["memory_bytes_per_rank"]["peak_live"]
    if any(run.moe):  # MoE slots held as routed rows: below the memory model's dense slot buffers,
        assert all(p <= peak for p in run.peak_bytes)  # which the reference's dense form holds
        with moe_packed.DENSE:
            run = run_spmd(c.program, _feeds(c))
    assert run.peak_bytes == [peak] * c.program.mesh.size
    # the lowered program computes what the unlowered one does (the interpreter is the judge)
    assert any(n.op in ("dense", "addmm") for n in c.program.nodes)


@pytest.mark.parametrize("spec_name", [s for s in SHIPPED if s.endswith("_train")])
def test_training_programs_update_in_place_and_fuse_the_loss(spec_name):
    c = _compiled(spec_name)
    updates = [n for n in c.program.nodes if n.phase == "optimizer" and n.op in ("add_scaled", "axpby",
                                                                                     "adamw_param")]
    assert updates and all(n.attr("inplace") for n in updates if not n.name.endswith(".grad"))
    if "loss.sub" not in c.logical:  # a cross-entropy loss: no mse to fuse
        return
    moved = [n for n in c.program.nodes if n.op in LAYOUT_OPS and n.inputs[0] == "loss.sub"]
    if moved:  # the plan changes the difference's layout before squaring it (e.g. slices it
        # over tp to square a part per rank, then one joint all_reduce): nothing to fuse
        assert [n.op for n in c.program.nodes if n.name == "loss.pow"] == ["pow"]
        return
    assert c.program.by_op("mse_sum") and c.program.by_op("mse_grad")
    assert not [n for n in c.program.by_op("pow", "pow_grad") if n.attr("exponent") == 2.0]  # mse's pieces


def test_interpreter_honours_frees_and_in_place():
    c = _compiled("tiny_relu_mlp_tp2")
    prog = c.program
    ar = prog.by_op("all_reduce")[0]
    assert ar.attr("inplace")  # the partial sum is fresh and read by nothing else
    # drop the frees: the interpreter then holds more at its peak
    kept = prog.with_nodes([n.with_attrs(frees="") for n in prog.nodes])
    feeds = random_feeds(c.logical, 0)
    assert run_spmd(kept, feeds).peak_bytes[0] > run_spmd(prog, feeds).peak_bytes[0] == peak_bytes(prog)
    # a program that reads a value after freeing it fails in the interpreter
    h = next(n for n in prog.nodes if n.op == "relu")
    bad = prog.with_nodes([n.with_attrs(frees=n.attr("frees", "") + " " + h.name) if n.op == "relu" else n
                           for n in prog.nodes])
    with pytest.raises(KeyError):
        run_spmd(bad, feeds)


MEGATRON_TRAIN = """\
mesh tp=2
l0.weight colwise
l1.weight rowwise
input x replicated
train loss=mse optimizer=sgd(lr=0.1, momentum=0.9, weight_decay=0.01)
"""


def _mlp_train():
    g = mlp_graph((2, 8), [16, 64, 16], [True, True], ["gelu"])
    return compile_graph(g, parse_spec(MEGATRON_TRAIN, "t.pcs"))


def test_input_gradient_all_reduce_overlaps_the_weight_gradient():
    c = _mlp_train()
    order = [n.name for n in c.program.nodes]
    start = next(n for n in c.program.by_op("all_reduce") if n.attr("async_op"))
    wait = c.program[f"{start.name}.wait"]
    between = order[order.index(start.name) + 1:order.index(wait.name)]
    wgrad = dict(c.program.named_outputs())["l0.weight.grad"]
    assert wgrad in between and "opt.l0.weight.sub" in between  # dW and updates while dx is summed
    assert order.index(start.name) == order.index(start.inputs[0]) + 1  # started at once
    assert start.attr("inplace") and c.program.outputs[-1] == wait.name  # x.grad is the wait


def test_sgd_momentum_weight_decay_lowered_like_torch_optim():
    c = _mlp_train()
    p = c.program
    for name in ("l0.weight", "l1.bias"):
        upd = p[next(v for pub, v in p.named_outputs() if pub == name)]
        buf = p[next(v for pub, v in p.named_outputs() if pub == f"{name}.momentum_buffer")]
        d_p = p[buf.inputs[1]]
        assert (upd.op, upd.inputs[0], upd.attr("b"), upd.attr("inplace")) == ("add_scaled", name, -0.1, True)
        assert (buf.op, buf.inputs[0], buf.attr("a"), buf.attr("inplace")) == (
            "axpby", f"{name}.momentum_buffer", 0.9, True)
        # grad + wd * p is a new tensor: the grad itself is an output (torch.optim: grad.add(p, alpha=wd))
        assert (d_p.op, d_p.inputs[1], d_p.attr("b"), d_p.attr("inplace")) == ("add_scaled", name, 0.01, None)


def test_in_place_refused_when_the_buffer_is_read_later_or_is_an_output():
    text = """\
mesh tp=2
stage local
%a: f32[4] [P] = input() {global_shape=(4,)}
%b: f32[4] [P] = input() {global_shape=(4,)}
%s: f32[4] [P] = add(%a, %b)
%r: f32[4] [R] = all_reduce(%s) {axis="tp"}
%t: f32[4] [P] = add(%s, %a)
%u: f32[4] [P] = add(%a, %b)
%q: f32[4] [R] = all_reduce(%u) {axis="tp"}
return %r, %t, %u, %q
"""
    g = in_place(parse_graph(text))
    assert not g["r"].attr("inplace")  # %s is read after the all_reduce
    assert not g["q"].attr("inplace")  # %u is an output



def test_all_reduce_in_place_into_a_sum_built_in_place():
    """The dx of q, k and v summed in place (``a.add_(b).add_(c)``) is the fresh buffer of
    the first: its all_reduce runs in place too (no clone); through a view it does not."""
    text = """\
mesh tp=2
stage local
%a: f32[4] [P] = input() {global_shape=(4,)}
%b: f32[4] [P] = input() {global_shape=(4,)}
%m: f32[4] [P] = mul(%a, %b)
%n: f32[4] [P] = mul(%a, %a)
%s: f32[4] [P] = add(%m, %n)
%s2: f32[4] [P] = add(%s, %b)
%r: f32[4] [R] = all_reduce(%s2) {axis="tp"}
%v: f32[2,2] [P] = reshape(%n) {shape=(2,2)}
%q: f32[2,2] [R] = all_reduce(%v) {axis="tp"}
return %r, %q
"""
    g = in_place(parse_graph(text))
    assert g["s"].attr("inplace") and g["s2"].attr("inplace")
    assert g["r"].attr("inplace")  # %s2 is %m's tensor itself
    assert not g["q"].attr("inplace")  # a view: maybe not contiguous


ZERO_TRAIN = """\
mesh dp=2
input x [S(0)]
train loss=mse optimizer=adamw(lr=0.01) zero=1
"""


def test_zero_gathers_overlap_each_other_and_reduce_scatters_the_backward():
    """ZeRO: the param shards are updated together (one fused AdamW group, group-updates), then
    their all_gathers are all started at once, each waited for after the others started; the
    gradients' reduce_scatters are started where the gradient is made and waited for after other
    backward work. The interpreter's float64 run still equals the unsharded steps."""
    g = mlp_graph((4, 8), [16, 32, 16], [True, True], ["relu"])
    c = compile_graph(g, parse_spec(ZERO_TRAIN, "z.pcs"))
    order = [n.name for n in c.program.nodes]

    def between(start):
        wait = c.program[f"{start.name}.wait"]
        return [c.program[m] for m in order[order.index(start.name) + 1:order.index(wait.name)]]

    gathers = [n for n in c.program.by_op("all_gather") if n.attr("async_op")]
    last_update = max(order.index(n.name) for n in c.program.by_op("adamw_param"))
    assert len(gathers) >= 2 and all(order.index(n.name) > last_update for n in gathers)
    assert [order.index(n.name) for n in gathers] == list(range(last_update + 1, last_update + 1 + len(gathers)))
    assert all(any(m.op == "all_gather" for m in between(n)) for n in gathers[:-1]), gathers
    scatters = [n for n in c.program.by_op("reduce_scatter") if n.attr("async_op")]
    assert any(any(m.phase == "backward" and m.op in ("matmul", "matmul_t", "dense") for m in between(n))
               for n in scatters), scatters
    from parcomp_backends.torch import emit_program

    lines = [ln.strip() for ln in emit_program(c, "cpu").split("def train_step", 1)[1].splitlines()]
    started = [i for i, ln in enumerate(lines) if "= all_gather_start(" in ln]
    assert started and any("= reduce_scatter_start(" in ln for ln in lines)
    var = lines[started[0]].split(" = ")[0]  # program.py: the update, the gathers started, waited
    waited = next(i for i, ln in enumerate(lines) if f"= wait({var})" in ln)
    assert len([i for i in started if i < waited]) == len(started) >= 2
    assert sum(ln.startswith("fused_adamw_(") for ln in lines[:started[0]]) == 1
    feeds = random_feeds(c.logical, 0)
    feeds["step"] = np.array(3.0, "f4")
    for n in c.logical.params:
        if n.name.endswith("exp_avg_sq"):
            feeds[n.name] = np.abs(feeds[n.name])
    got, want = run_spmd(c.program, feeds).outputs(c.program), run_unsharded(c.logical, feeds)
    assert_all_equivalent(got, want)


def test_no_overlap_without_independent_work():
    text = """\
mesh tp=2
stage local
%a: f32[4] [P] = input() {global_shape=(4,)}
%s: f32[4] [P] = add(%a, %a)
%r: f32[4] [R] = all_reduce(%s) {axis="tp"}
%t: f32[4] [R] = relu(%r)
return %t
"""
    g = parse_graph(text)
    assert overlap_collectives(g) == g


# every lowered op and its in-place form, evaluated with torch, equals the numpy reference
_ADAMW = {"lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.05}
LOWERED_CASES = {  # case: (op, operand shapes, result shape, attrs); "abs:" non-negative, "t": step 3
    "dense": ("dense", ((2, 5, 3), (4, 3)), (2, 5, 4), {}),
    "dense_bias": ("dense", ((2, 3), (4, 3), (4,)), (2, 4), {}),
    "addmm": ("addmm", ((4,), (2, 3), (3, 4)), (2, 4), {}),
    "matmul_t": ("matmul_t", ((2, 3), (3, 4)), (4, 2), {}),
    "add_scaled": ("add_scaled", ((2, 3), (2, 3)), (2, 3), {"b": -0.1}),
    "add_scaled_inplace": ("add_scaled", ((2, 3), (2, 3)), (2, 3), {"b": -0.1, "inplace": True}),
    "add_inplace": ("add", ((2, 3), (3,)), (2, 3), {"inplace": True}),
    "axpby": ("axpby", ((2, 3), (2, 3)), (2, 3), {"a": 0.9, "b": 0.1}),
    "axpby_inplace": ("axpby", ((2, 3), (2, 3)), (2, 3), {"a": 0.9, "b": 1.0, "inplace": True}),
    "mse_sum": ("mse_sum", ((2, 3), (2, 3)), (), {}),
    "mse_grad": ("mse_grad", ((), (2, 3), (2, 3)), (2, 3), {}),
    "adamw_param_inplace": ("adamw_param", ((2, 3), (2, 3), "abs", "t"), (2, 3), {**_ADAMW, "inplace": True}),
    # norms part: the bucketed all_reduce of norm-weight gradients (passes/lowering/bucket.py)
    "bucket_cat": ("bucket_cat", ((2, 3), (4,), (3,)), (13,), {}),
    "bucket_part": ("bucket_part", ((13,),), (2, 3), {"offset": 4, "numel": 6}),
}


def test_every_lowered_op_has_a_case():
    from parcomp.ir.ops import OPS

    lowered = {op for op, d in OPS.items() if d.kind == "lowered"} - {"wait"}  # wait: torchrun tests
    assert lowered <= {c[0] for c in LOWERED_CASES.values()}


@pytest.mark.parametrize("case", sorted(LOWERED_CASES))
def test_lowered_op_matches_numpy(case):
    torch = pytest.importorskip("torch")
    from numerics import assert_equivalent
    from parcomp.ir import Node, TensorType, make_attrs
    from parcomp_backends.torch.emit import node_code

    op, shapes, out, attrs = LOWERED_CASES[case]
    rng = np.random.default_rng(0)
    xs = [np.array(3.0, "f4") if s == "t" else np.abs(rng.standard_normal((2, 3))).astype("f4") if s == "abs"
          else rng.standard_normal(s).astype("f4") for s in shapes]
    node = Node("y", op, tuple(f"a{i}" for i in range(len(xs))), TensorType(out), make_attrs(**attrs))
    env = {"torch": torch, **{f"a{i}": torch.tensor(x) for i, x in enumerate(xs)}}
    code = node_code(node, [f"a{i}" for i in range(len(xs))])
    got = eval(code, env)  # noqa: S307 - our own table
    want = NUMPY_OPS[node.op](xs, node)
    assert tuple(got.shape) == tuple(np.shape(want)) and got.dtype == torch.float32
    assert_equivalent(got.numpy(), want, what=case)
    if attrs.get("inplace"):
        assert got.data_ptr() == env["a0"].data_ptr(), code  # written into the first operand
