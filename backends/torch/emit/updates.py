"""The optimizer phase as torch.optim's multi-tensor kernels: each group of per-parameter
updates (:func:`parcomp.ir.update_groups.update_groups`, made contiguous by the pass
``group-updates``) printed as one call over the group's tensor lists:

- AdamW: one ``fused_adamw_(...)``: ``torch._fused_adamw_``, the kernel of
  ``torch.optim.AdamW(fused=True)`` (the runtime's helper, :mod:`..runtime.program_train`, runs
  the same update per tensor under torch.compile, which cannot functionalize the fused kernel);
- SGD: one ``fused_sgd_(...)``: ``torch._fused_sgd_`` (``torch.optim.SGD(fused=True)``): weight decay,
  momentum and step in one pass over each tensor. (``torch._foreach_*`` ops, torch.optim's
  foreach form, pass over every tensor once per op: on CPU 6x slower than the fused kernel and
  3x slower than one statement per parameter, whose tensors stay in cache; docs/design.)

Both write each parameter and its state in place, so a unit is printed so only where the
per-node program writes them in place too (``inplace=true`` on its nodes), or where the
parameter is a ZeRO shard read by nothing else (the kernel writes the shard, which the
all_gather after it reads). Any other unit, and a group whose nodes are not contiguous, is
printed one statement per node (:func:`parcomp_backends.torch.emit.nodes.node_code`).
The values each unit's nodes make are the param's and state's variables themselves (the
kernel wrote them), so the step's returned dict names those.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from parcomp.ir.update_groups import param_of, update_groups

from .nodes import py_literal
from .sections import comment_lines


@dataclass
class UpdatePlan:
    """``lines``: node -> the statements printed in its place (the group's call, at its first
    fused node); ``skipped``: nodes no statement of their own prints; ``alias``: node -> the
    variable holding its value; ``unmade``: values no statement makes (never deleted);
    ``kept``: values whose buffer a fused value took over (their ``del`` is left to it);
    ``ends``: the last fused node of each group (the group's ``del`` follows it)."""
    lines: dict = field(default_factory=dict)
    skipped: set = field(default_factory=set)
    alias: dict = field(default_factory=dict)
    unmade: set = field(default_factory=set)
    kept: set = field(default_factory=set)
    ends: set = field(default_factory=set)


def update_plan(program, names) -> UpdatePlan:
    """The multi-tensor calls of ``program``'s optimizer phase (module docstring)."""
    plan = UpdatePlan()
    if not any(n.op in ("adamw_param", "add_scaled") for n in program.nodes):
        return plan
    pos = {n.name: i for i, n in enumerate(program.nodes)}
    users = program.users()
    for units in update_groups(program):
        members = sorted((pos[m] for u in units for m in u.nodes))
        if members[-1] - members[0] + 1 != len(members):
            continue  # not contiguous: per node
        fused = [u for u in units if _in_place(program, u, pos, users)]
        if not fused:
            continue
        first = min(pos[u.nodes[0]] for u in fused)
        var = names.__getitem__
        code = (_adamw_lines if fused[0].kind == "adamw" else _sgd_lines)(program, fused, var)
        plan.lines[program.nodes[first].name] = code
        plan.ends.add(program.nodes[max(pos[m] for u in fused for m in u.nodes)].name)
        for u in fused:
            plan.skipped.update(u.nodes)
            plan.alias.update({node: var(value) for node, value in u.made})
            plan.unmade.update(m for m in u.nodes if m not in dict(u.made))
            plan.kept.add(u.param)
    return plan


def _in_place(program, u, pos, users) -> bool:
    """May the kernel write ``u``'s param and state? Where the per-node program does (every node
    writing one is ``inplace=true``), or the param is a ZeRO shard only this update reads and
    whose param no later node reads."""
    for node, value in u.made:
        if not program[node].attr("inplace") and value != u.param:
            return False
    final = next(node for node, value in u.made if value == u.param)
    if program[final].attr("inplace"):
        return True
    shard = program[u.param]
    if shard.op != "shard_slice" or users[u.param] != [final] or u.param in program.outputs:
        return False
    return all(pos[r] < pos[final] for r in users[shard.inputs[0]])


def _names(program, units) -> str:
    return ", ".join(param_of(program, u) for u in units)


def _list(values) -> str:
    return "[" + ", ".join(values) + "]"


# ops whose value is a fresh contiguous tensor (or, a collective, its contiguous operand's buffer)
_CONTIGUOUS = frozenset({"matmul", "matmul_t", "dense", "addmm", "bucket_part", "bucket_cat", "all_reduce",
                         "reduce_scatter", "shard_slice"})


def _contiguous(program, v) -> bool:
    """Is ``v`` surely contiguous in program.py? (An elementwise op keeps its operand's strides:
    only the ops above, a reduction over dims, and the identities of them are sure.)"""
    n = program[v]
    while n.op in ("wait", "relayout"):
        n = program[n.inputs[0]]
    return n.op in _CONTIGUOUS or (n.op == "sum" and bool(n.attr("dims")))


def _grad(program, u, var) -> str:
    """The gradient as the fused kernel reads it: in its param's (contiguous) memory order, as
    autograd's are; the CPU and CUDA kernels read the raw buffer, ignoring strides."""
    return var(u.grad) if _contiguous(program, u.grad) else f"{var(u.grad)}.contiguous()"


def _adamw_lines(program, units, var) -> list:
    h, step = units[0].hyper(), units[0].key[3]
    ps, gs = _list(var(u.param) for u in units), _list(_grad(program, u, var) for u in units)
    ms, vs = _list(var(u.state[0]) for u in units), _list(var(u.state[1]) for u in units)
    n = len(units)
    head = (f"torch's fused AdamW (torch.optim.AdamW(fused=True)'s kernel, fused_adamw_ below) over {n} "
            f"parameter{'s' if n != 1 else ''}, in place on each and its exp_avg, exp_avg_sq: "
            f"{_names(program, units)}")
    kw = ", ".join(f"{k}={py_literal(h[k])}" for k in ("lr", "beta1", "beta2", "weight_decay", "eps"))
    return [*comment_lines(head, "    "), f"    fused_adamw_({ps}, {gs}, {ms}, {vs}, {var(step)}, {kw})"]


def _sgd_lines(program, units, var) -> list:
    h, n = units[0].hyper(), len(units)
    ps, gs = _list(var(u.param) for u in units), _list(_grad(program, u, var) for u in units)
    bufs = _list(var(u.state[0]) for u in units) if "momentum" in h else "[]"
    head = (f"torch's fused SGD (torch.optim.SGD(fused=True)'s kernel, fused_sgd_ below) over {n} parameter"
            f"{'s' if n != 1 else ''}, in place on each{' and its momentum_buffer' if 'momentum' in h else ''}: "
            f"{_names(program, units)}")
    kw = ", ".join(f"{k}={py_literal(float(h.get(k, 0.0)))}" for k in ("weight_decay", "momentum", "lr"))
    return [*comment_lines(head, "    "), f"    fused_sgd_({ps}, {gs}, {bufs}, {kw})"]
