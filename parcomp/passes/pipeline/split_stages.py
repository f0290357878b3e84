"""split-stages: a global forward graph cut into pipeline (``pp``) stages.

Which stage a node belongs to comes from the spec's ``stage K: ITEM ...`` statements
(an item is a module path prefix: a node traced from module ``h.3.attn`` belongs to the
stage of ``h.3``) or, without them, from a cost model that balances FLOPs over the
stages (:func:`balanced_rules`).  A node without a module path (a loss, a reshape the
frontend made) follows its inputs: the latest stage among them.

A value crossing a cut is *relayed*: a value of stage 0 used on stage 2 is sent 0 -> 1
and 1 -> 2, so every point-to-point transfer is between neighbouring stages, and a
value used by several later stages travels once.  On the way back its gradient
contributions are summed on each stage before they are sent on (autodiff adds the
gradient a stage receives for a relayed value to its own uses of it).  Model inputs
(data, targets) are read directly by every stage that uses them.

Everything here is pure: graphs in, graphs and name lists out.
"""
from __future__ import annotations

from dataclasses import dataclass

from parcomp.errors import ParcompError, SpecError, closest
from parcomp.ir.graph import Graph, Node
from parcomp.ir.ops import OPS
from parcomp.ir.types import TensorType
from parcomp.spec.model import StageRule
from parcomp.spec.stages import expand_item, open_range

__all__ = ["StageGraph", "assign_stages", "balanced_rules", "split_stages", "rebatch", "node_path",
           "node_flops", "param_stages"]


@dataclass(frozen=True)
class StageGraph:
    """One stage's forward program for one microbatch.

    Attributes:
        index: the stage (its coordinate on the ``pp`` mesh axis).
        graph: inputs are the model inputs it reads and the values it receives
            (``input`` nodes named as the value they carry), params are its own;
            outputs are the values it sends (public name = value name) and, on the
            last stage, the model's outputs.
        recv: values received from stage ``index - 1``, in graph order.
        send: values sent to stage ``index + 1``, in graph order (a relayed value is
            in both ``recv`` and ``send``).
        params: the params this stage holds.
    """

    index: int
    graph: Graph
    recv: tuple
    send: tuple
    params: tuple


def node_path(node: Node) -> str | None:
    """The module path a node came from: its ``source``, or a param's name less its last
    component (``h.0.mlp.c_fc.weight`` -> ``h.0.mlp.c_fc``); None when unknown."""
    if node.source:
        return node.source
    if node.op == "param" and "." in node.name:
        return node.name.rsplit(".", 1)[0]
    return None


def module_path(node: Node, graph: Graph) -> str | None:
    """:func:`node_path`, or for a node without one (a ``.pcir`` model) the path of its
    first param operand that has one: ``matmul(%x, %l0.weight)`` belongs to ``l0``."""
    if node.op in ("input", "param"):
        return node_path(node)
    return node_path(node) or next((node_path(graph[i]) for i in node.inputs
                                    if graph[i].op == "param" and node_path(graph[i])), None)


def _prefixes(path: str):
    parts = path.split(".")
    return (".".join(parts[:i]) for i in range(len(parts), 0, -1))


def node_flops(node: Node, types: dict) -> int:
    """FLOPs of one node: ``2*M*N*K`` for a matmul, one per output element otherwise,
    0 for inputs and params."""
    if node.op in ("input", "param"):
        return 0
    out = node.type.numel if node.type.rank else 1
    if node.op == "matmul":
        return 2 * out * types[node.inputs[0]].shape[-1]
    return out


def assign_stages(graph: Graph, rules: tuple, pp: int) -> dict:
    """``{node name: stage}`` for every param and compute node of ``graph`` (inputs are
    read directly and get none).

    Raises:
        SpecError: at a stage statement: an item that matches no module, a module in
            no stage (a param of a module no stage names, such as rotary embeddings'
            cos/sin tables, is held by every stage that reads it instead), a module that uses a value of a later stage, a stage with no computation, the model output not on the last stage.
    """
    owner = {p: r for r in rules for p in r.items if open_range(p) is None}
    opened = [(open_range(p), p, r) for r in rules for p in r.items if open_range(p) is not None]
    hit, stage = set(), {}
    for n in graph.nodes:  # every item must name a module before any module is blamed
        if n.op != "input":
            _rule_of(module_path(n, graph), owner, hit, opened)
    _check_items(graph, rules, hit)
    for n in graph.nodes:
        if n.op == "input":
            continue
        rule = _rule_of(module_path(n, graph), owner, hit, opened)
        if rule is None and n.source and rules and n.op != "param":
            raise SpecError(f"module {n.source} (%{n.name}) is in no stage; add it to a stage "
                            f"statement", rules[-1].loc)
        ins = [stage[i] for i in n.inputs if i in stage]  # a param is in only when a rule placed it
        latest = max(ins, default=0)
        computed = max((stage[i] for i in n.inputs if i in stage and graph[i].op != "param"), default=0)
        if rule is not None and rule.index < computed:  # a param on a later stage is tied, not late
            latest = computed
            src = next(i for i in n.inputs if stage.get(i) == latest and graph[i].op != "param")
            raise SpecError(f"module {module_path(n, graph)} is on stage {rule.index} but uses %{src} "
                            f"computed on stage {latest}: stages must follow the data flow "
                            f"(stage k may use only values of stages 0..k)", rule.loc)
        if n.op != "param" or rule is not None:
            stage[n.name] = rule.index if rule is not None else latest
    _place_params(graph, stage, rules)
    _check_cover(graph, rules, hit, stage, pp)
    return stage


def _rule_of(path, owner, hit, opened=()):
    for p in _prefixes(path) if path else ():
        if p in owner:
            hit.add(p)
            return owner[p]
        for (prefix, first), item, rule in opened:  # h.12-end owns h.12, h.13, ...
            head, _, last = p.rpartition(".")
            if head == prefix and last.isdigit() and int(last) >= first:
                hit.add(item)
                return rule
    return None


def _place_params(graph, stage, rules) -> None:
    """A param without a stage of its own goes to the first stage of its users; a param
    used on several stages (tied weights) is held by each of them (:func:`param_stages`)."""
    users = graph.users()
    for p in graph.params:
        if p.name not in stage:
            stage[p.name] = min((stage[u] for u in users[p.name] if u in stage), default=0)


def param_stages(graph: Graph, stage: dict) -> dict:
    """``{param: (stage, ...)}``: the stages holding each param, those of its users (its own
    stage when it has none).  A param on more than one stage is *tied*: each holds a copy,
    computes its gradient contribution, and the contributions are summed over exactly those
    stages' ranks before the dp reduction, so every copy takes the same update."""
    users = graph.users()
    return {p.name: tuple(sorted({stage[u] for u in users[p.name] if u in stage} or {stage[p.name]}))
            for p in graph.params}


def _check_items(graph, rules, hit) -> None:
    """A SpecError at the first item (in file order) of a stage statement that names no
    module of the model, with the closest module path as a hint."""
    missed = [(r.locs[k] if k < len(r.locs) else r.loc, r, p)
              for r in rules for k, p in enumerate(r.items) if p not in hit]
    if not missed:
        return
    loc, r, item = min(missed, key=lambda m: (m[0].line, m[0].col) if m[0] else (0, 0))
    known = sorted({q for n in graph.nodes if n.op != "input" and module_path(n, graph)
                    for q in _prefixes(module_path(n, graph))})
    written = next((w for w in r.raw if w != item and item in (expand_item(w) or ())), None)
    prefix, _, last = (open_range(item)[0] + ".0" if open_range(item) else item).rpartition(".")
    numbered = sorted(int(q.rpartition(".")[2]) for q in known
                      if q.rpartition(".")[0] == prefix and q.rpartition(".")[2].isdigit())
    if last.isdigit() and numbered:
        hint = f"; the model's {prefix} modules are {prefix}.{numbered[0]} to {prefix}.{numbered[-1]}"
    else:
        near = closest(item, known)
        hint = f"; did you mean {near}?" if near else ""
    raise SpecError(f"stage {r.index}: {item}{f' (of {written})' if written else ''} matches no "
                    f"module of the model{hint}", loc)


def _check_cover(graph, rules, hit, stage, pp) -> None:
    compute = [n for n in graph.nodes if n.op not in ("input", "param")]
    empty = sorted(set(range(pp)) - {stage[n.name] for n in compute})
    if empty:
        loc = next((r.loc for r in rules if r.index == empty[0]), None)
        raise SpecError(f"stage {empty[0]} computes nothing: every stage needs some of the "
                        f"model's modules", loc)
    late = [v for v in graph.outputs if v in stage and stage[v] != pp - 1]
    if late:
        loc = rules[-1].loc if rules else None
        raise SpecError(f"the model output %{late[0]} is computed on stage {stage[late[0]]}, not "
                        f"on the last stage {pp - 1}: the loss runs on the last stage", loc)


def _unit(path: str, above: frozenset = frozenset()) -> str:
    """The balancing unit of a module path: up to its first numbered component
    (``h.3.attn`` -> ``h.3``, ``12`` -> ``12``), else its shortest prefix that is not in
    ``above`` (the paths above numbered units: ``transformer.ln_f`` stays apart from
    ``transformer.h.0``), ``ln_f`` for a top-level module."""
    parts = path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[:i + 1])
    return next((".".join(parts[:i]) for i in range(1, len(parts) + 1)
                 if ".".join(parts[:i]) not in above), path)


def _above_numbered(paths) -> frozenset:
    """Every proper prefix of a numbered unit (``transformer``, ``transformer.h`` for
    ``transformer.h.0``)."""
    out = set()
    for path in paths:
        parts = _unit(path).split(".")
        if parts[-1].isdigit():
            out.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return frozenset(out)


def module_units(graph: Graph) -> dict:
    """``{node name: balancing unit}`` (:func:`_unit`) of every op node with a module path
    (params and inputs follow their users, so they are not listed), the units in data-flow
    order: a unit stands where its first node that reads a model input (through any chain of
    nodes) stands in the graph, and a unit with no such node where its first node stands; within
    a unit, graph order. A node computed from params alone may stand anywhere before its users
    (DeepSeek's attention fills a ``new_empty`` buffer expanded over the batch: the tracer puts
    both layers' expands before the embedding), so graph order alone would put ``layers.1``
    before ``embed_tokens`` and a balanced cut would give stage 1 the embedding that stage 0's
    layer reads."""
    paths = {n.name: module_path(n, graph) for n in graph.nodes if n.op not in ("input", "param")}
    above = _above_numbered(p for p in paths.values() if p)
    of = {name: _unit(p, above) for name, p in paths.items() if p}
    data, first, seen = set(), {}, {}
    for i, n in enumerate(graph.nodes):
        if n.op == "input" or any(x in data for x in n.inputs):
            data.add(n.name)
        u = of.get(n.name)
        if u is not None:
            seen.setdefault(u, i)
            if n.name in data:
                first.setdefault(u, i)
    rank = {u: first.get(u, seen[u]) for u in seen}
    order = sorted(of, key=lambda name: rank[of[name]])  # stable: graph order within a unit
    return {name: of[name] for name in order}


def balanced_rules(graph: Graph, pp: int, virtual=None) -> tuple:
    """Stage rules that split the model's modules, in graph order, into ``pp`` contiguous
    groups minimizing the largest group's FLOPs (:func:`node_flops`; a linear partition,
    O(units^2 * pp)). ``virtual``: ``(K, loc of virtual=)`` when the ``pp`` groups are the
    ``ranks x K`` chunks of interleaved 1F1B, else None.

    Raises:
        ParcompError: the model has fewer modules than stages.
        SpecError: at ``virtual=``, with ``virtual``, when the model has fewer modules than
            chunks (saying how many chunks per rank it can make).
    """
    types = {n.name: n.type for n in graph.nodes}
    units, cost = [], {}
    for name, u in module_units(graph).items():
        if u not in cost:
            units.append(u)
            cost[u] = 0
        cost[u] += node_flops(graph[name], types)
    if virtual is not None and virtual[0] > 1 and len(units) < pp:
        k, loc = virtual
        ranks, most = pp // k, len(units) // (pp // k)
        can = (f"give virtual={most} or fewer" if most > 1 else
               "too few to interleave (it needs 2 per rank): use schedule=1f1b")
        raise SpecError(f"virtual={k} cuts the model into pp {ranks} x {k} = {pp} chunks, but it has "
                        f"{len(units)} module(s) ({', '.join(units[:8])}{', ...' if len(units) > 8 else ''})"
                        f" and a chunk holds at least one: it can make {most} chunk(s) per rank; {can}", loc)
    if len(units) < pp:
        raise ParcompError(f"the model has {len(units)} module(s) ({', '.join(units)}) to split "
                           f"into pp={pp} stages; give fewer stages", where="pp")
    cuts = _partition([cost[u] for u in units], pp)
    bounds = [0, *cuts, len(units)]
    return tuple(StageRule(s, tuple(units[bounds[s]:bounds[s + 1]]), (), None) for s in range(pp))


def _partition(costs: list, k: int) -> list:
    """Cut points ``[c1 < ... < c_{k-1}]`` splitting ``costs`` into ``k`` non-empty runs
    with the smallest largest sum (ties: the earliest cuts)."""
    n = len(costs)
    pre = [0]
    for c in costs:
        pre.append(pre[-1] + c)
    best = {(0, 0): (0, None)}  # (runs, items) -> (largest run, previous cut)
    for j in range(1, k + 1):
        for i in range(j, n - (k - j) + 1):
            best[j, i] = min(((max(best[j - 1, c][0], pre[i] - pre[c]), c)
                              for c in range(j - 1, i) if (j - 1, c) in best), key=lambda t: t[0])
    cuts, i = [], n
    for j in range(k, 0, -1):
        i = best[j, i][1]
        cuts.append(i)
    return sorted(cuts)[1:]


def split_stages(graph: Graph, stage: dict, pp: int) -> tuple:
    """The :class:`StageGraph` of every stage (see :func:`assign_stages` for ``stage``)."""
    users, held = graph.users(), param_stages(graph, stage)
    compute = [n for n in graph.nodes if n.op not in ("input", "param")]
    last_use = {n.name: max((stage[u] for u in users[n.name]), default=stage[n.name]) for n in compute}
    live = [[n.name for n in compute if stage[n.name] <= c < last_use[n.name]] for c in range(pp)]
    out = []
    for s in range(pp):
        mine = [n for n in compute if stage[n.name] == s]
        recv = tuple(live[s - 1]) if s else ()
        params = [n for n in graph.params if s in held[n.name]]
        used = {i for n in mine for i in n.inputs}
        inputs = [n for n in graph.inputs if n.name in used]
        nodes = [*inputs, *(Node(v, "input", (), graph[v].type, (), graph[v].layout) for v in recv),
                 *params, *mine]
        outs = list(live[s])
        names = list(outs)
        if s == pp - 1:
            outs += list(graph.outputs)
            names += list(graph.output_names)
        g = Graph(tuple(nodes), tuple(outs), graph.mesh, graph.stage, tuple(names))
        out.append(StageGraph(s, g, recv, tuple(live[s]), tuple(p.name for p in params)))
    return tuple(out)


def rebatch(graph: Graph, batch: int) -> Graph:
    """``graph`` with dim 0 of every input set to ``batch`` (a microbatch) and every
    other type inferred again; the entries of shape attributes that carry the batch rescale
    (:func:`_rebatch_reshape`: GPT-2's ``[2,8,32] -> [16,32]`` becomes ``[1,8,32] -> [8,32]``);
    a constant made from nothing (``ones``) takes the changed dims of the operand it pairs with
    in its first user (:func:`_follow_operand`).

    Raises:
        ParcompError: an input has no batch dim, or an op's inferred type fails (an op
            with a fixed shape attribute that names the batch).
    """
    types, nodes = {}, []
    full = {n.type.shape[0] for n in graph.nodes if n.op == "input" and n.type.rank}  # the batch
    for n in graph.nodes:
        if n.op == "input":
            if not n.type.rank:
                raise ParcompError(f"input {n.name} is a scalar: microbatches split dim 0 of "
                                   f"every input", where=n.name)
            ty = TensorType((batch, *n.type.shape[1:]), n.type.dtype)
        elif n.op == "param":
            ty = n.type
        else:
            _follow_operand(n, graph, types, nodes)
            n = _rebatch_reshape(n, graph, types, full, batch)
            try:
                ty = OPS[n.op].infer([types[i] for i in n.inputs], n)
            except Exception as e:  # noqa: BLE001 - any inference failure is the same user error
                raise ParcompError(f"cannot split the batch into microbatches of {batch}: "
                                   f"{n.op} %{n.name} does not take the smaller batch ({e})",
                                   where=n.name) from None
        types[n.name] = ty
        nodes.append(Node(n.name, n.op, n.inputs, ty, n.attrs, n.layout, n.in_layouts, n.phase,
                          n.source, n.spec_loc))
    return graph.with_nodes(nodes)


def _follow_operand(node: Node, graph: Graph, types: dict, nodes: list) -> None:
    """Retype, in ``types`` and ``nodes``, each operand of ``node`` that is a constant made
    from nothing (``ones`` of the frontend: the value a ``scatter`` writes at topk indices,
    shaped as the indices) so that each of its dims that equalled a changed dim of another
    operand of the same rank follows that dim, as :func:`_rebatch_reshape` does for a node's
    own type (DeepSeek-V3's group mask: ``put_along(ones [tokens, 1], indices [tokens, 1])``)."""
    changed = [i for i in node.inputs if graph[i].inputs and types[i].shape != graph[i].type.shape]
    for i in node.inputs:
        c = graph[i]
        if c.inputs or c.op in ("input", "param") or not c.type.rank or types[i] != c.type:
            continue
        other = next((j for j in changed if graph[j].type.rank == c.type.rank), None)
        if other is None:
            continue
        shape = tuple(now if was != now and mine == was else mine
                      for mine, was, now in zip(c.type.shape, graph[other].type.shape, types[other].shape))
        if shape != c.type.shape:
            types[i] = c.type.with_shape(shape)
            k = next(k for k, m in enumerate(nodes) if m.name == i)
            m = nodes[k]
            nodes[k] = Node(m.name, m.op, m.inputs, types[i], m.attrs, m.layout, m.in_layouts, m.phase,
                            m.source, m.spec_loc)


def _rebatch_reshape(node: Node, graph: Graph, types: dict, full: set = frozenset(), batch: int = 0) -> Node:
    """``node`` with the entries of its type that carry the batch rescaled, where its type is
    its own attribute (``reshape``, ``expand``, ``cast``, ``slice_grad``...; for other ops the
    type is inferred again anyway). One rule per kind of shape, wherever the batch dim went:

    - a ``reshape``: its operand's dims and its own are matched in groups of equal element count
      (``[2,8,32] -> [16,32]``: ``(2,8)->(16)``, ``(32)->(32)``); a group whose operand dims
      changed scales the first of its own dims that takes the ratio (``[1,8,32] -> [8,32]``;
      an MoE's ``[E,T,1,H] -> [E,T,H]`` keeps ``E`` and scales the tokens ``T``);
    - any other node: each dim that equalled a changed operand dim follows it (GQA's ``expand``
      of the kv heads, a ``cast``; an expand's operand dims are its dims outside ``dims``; a
      ``slice``'s sliced dim keeps its own size);
    - an ``expand`` that inserts dim 0 at the full batch (``full``: the inputs' dim 0)
      broadcasts over the batch and takes ``batch`` (a folded mask's row, a ViT's class token).

    Any other node is returned as is (its inference then says what does not fit)."""
    if not node.inputs or not node.type.rank:
        return node
    old, new = graph[node.inputs[0]].type, types[node.inputs[0]]
    shape = list(node.type.shape)
    if node.op == "reshape":
        if old.numel != new.numel:
            shape = _regroup(old.shape, new.shape, node.type.shape) or shape
    elif old.rank == new.rank:
        inserted = node.attr("dims") if node.op == "expand" else ()
        outer = [d for d in range(node.type.rank) if d not in inserted]  # the operand's dims, in order
        fixed = node.attr("dim") if node.op in ("slice", "slice_grad") else None
        if len(outer) == old.rank:
            for d, (was, now) in enumerate(zip(old.shape, new.shape)):
                if was != now and shape[outer[d]] == was and outer[d] != fixed:
                    shape[outer[d]] = now
        if (node.op == "expand" and 0 in inserted and shape[0] in full and batch
                and shape[0] != batch):
            shape[0] = batch
    if tuple(shape) == node.type.shape:
        return node
    return Node(node.name, node.op, node.inputs, node.type.with_shape(tuple(shape)), node.attrs, node.layout,
                node.in_layouts, node.phase, node.source, node.spec_loc)


def _regroup(was: tuple, now: tuple, out: tuple) -> tuple | None:
    """``out`` (a reshape of shape ``was``) as the reshape of ``now`` (``was`` with some dims
    changed): ``was`` and ``out`` split into consecutive groups of equal element count; a
    group whose dims changed scales the first of its ``out`` dims that the ratio divides
    evenly. None where no such grouping or dim exists."""
    import math

    res, i, j = list(out), 0, 0
    while i < len(was) and j < len(out):
        gi, gj = [i], [j]
        pi, pj = was[i], out[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj and i < len(was):
                pi, gi = pi * was[i], gi + [i]
                i += 1
            elif pj < pi and j < len(out):
                pj, gj = pj * out[j], gj + [j]
                j += 1
            else:
                return None
        before, after = pi, math.prod(now[k] for k in gi)
        if before != after:
            k = next((k for k in gj if (out[k] * after) % before == 0 and out[k] * after // before >= 1), None)
            if k is None:
                return None
            res[k] = out[k] * after // before
    if any(now[k] != 1 for k in range(i, len(was))) or any(out[k] != 1 for k in range(j, len(out))):
        return None
    return tuple(res)
