"""Binding the spec's rules to the model: layouts on params, inputs, outputs, activations.

The binding is a run of passes of the one list (:mod:`parcomp.passes.pass_list`), each one
job: ``bind-layouts`` (params and inputs), ``bias-follows``, ``fused-bias-follows``,
``attention-heads``, ``pad-vocab``, ``check-even``, ``pin-activations``, ``pin-outputs``; a
bound rule travels between them as the node's ``layout`` and ``spec_loc`` (:func:`bound_rules`).

``colwise`` / ``rowwise`` are resolved by *use*, not by storage order:
the pass follows the weight through ``permute`` / ``reshape`` to the matmul that
consumes it as right operand ``b[k, n]``; colwise splits ``n`` (the output
features, DTensor ColwiseParallel), rowwise splits ``k`` (the input features,
RowwiseParallel), and the split is mapped back to the stored tensor's dim.  A
bias added to a colwise matmul's output follows its weight unless the spec
names it.  Outputs and pinned activations get a ``relayout`` node holding the
layout the spec asks for; everything unnamed is replicated.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace

from ..errors import SpecError
from ..ir.graph import Graph, Node, make_attrs
from ..ir.names import NameGen
from ..ir.ops import LAYOUT_OPS
from ..ir.types import P, R, Shard, divisibility_problem, layout_str, replicated
from ..rules.sharding import reshape_dim_map
from ..spec import Spec
from ..spec.parser import check_names
from .attention.ctxpar import pin_context_parallel  # context parallel
from .attention.heads import check_heads  # attention part
from .attention.seqpar import pin_sequence_parallel  # sequence parallel
from .fused_weights import fused_bias_follows, fused_split_dim  # attention part
from .vocab_pad import pad_vocab_tables  # padded vocab


def bind_param_layouts(graph: Graph, spec: Spec) -> Graph:
    """The pass ``bind-layouts``: every param and input of ``graph`` (an unsharded model graph)
    gets the layout of its spec rule (replicated when none names it) and the rule's location;
    the graph gets the spec's mesh. The rules are checked first: each names something in the
    model and none is shadowed by an earlier one.

    Raises:
        SpecError: a rule names nothing in the model, ``colwise`` on a tensor that is not a
            matmul weight, an ``S(d)`` naming a dim the tensor does not have (at the rule's line).
    """
    inserted = [n for n in graph.nodes if n.op in LAYOUT_OPS + ("relayout",)]
    if inserted:
        raise SpecError(f"%{inserted[0].name} is a {inserted[0].op}: layout changes are inserted by "
                        f"parcomp; a model graph given to it cannot contain them")
    values = [n.name for n in graph.nodes if n.op not in ("input", "param")]
    params = [name for n in graph.params for name in names_of(n)]  # a tied weight's aliases too
    check_names(spec, params, [n.name for n in graph.inputs], list(graph.output_names), values)
    _check_shadowed(spec, {"param": params,
                           "input": [n.name for n in graph.inputs],
                           "output": list(graph.output_names), "activation": values})
    graph = replace(graph, mesh=spec.mesh)
    users, nodes = graph.users(), []
    for n in graph.nodes:
        if n.op in ("input", "param"):
            rule, used = _rule_of(spec, n)
            with _tied_note(n, used):
                lay = _resolve(graph, spec, rule, n, users) if rule else replicated(len(spec.mesh.axes))
                _check_dims(n, lay, rule)  # before any later pass reads a dim
            n = replace(n, layout=lay, spec_loc=rule.loc if rule else None)
        nodes.append(n)
    return graph.with_nodes(nodes)


def bound_rules(graph: Graph, spec: Spec) -> tuple:
    """``(layouts, bound_by)`` of the params and inputs of a graph after ``bind-layouts``, in
    node order: ``{name: layout}`` and ``{name: the spec rule that bound it, or None}`` (a rule
    is found by its location, which the binding passes set as the node's ``spec_loc``; a bias
    that follows its weight carries the weight's rule)."""
    by_loc = {}
    for r in spec.rules:
        by_loc.setdefault(id(r.loc), r)
    layouts, bound_by = {}, {}
    for n in graph.nodes:
        if n.op in ("input", "param"):
            layouts[n.name] = n.layout
            bound_by[n.name] = by_loc.get(id(n.spec_loc)) if n.spec_loc is not None else None
    return layouts, bound_by


def with_bound(graph: Graph, layouts: dict, bound_by: dict) -> Graph:
    """``graph`` with the params and inputs whose layout or rule changed in ``layouts`` /
    ``bound_by`` (as :func:`bound_rules` gives them) rebound; ``graph`` itself when none did."""
    nodes, changed = [], False
    for n in graph.nodes:
        if n.name in layouts:
            rule = bound_by[n.name]
            loc = rule.loc if rule else None
            if layouts[n.name] != n.layout or loc is not n.spec_loc:
                n, changed = replace(n, layout=layouts[n.name], spec_loc=loc), True
        nodes.append(n)
    return graph.with_nodes(nodes) if changed else graph


def bias_follows(graph: Graph, spec: Spec) -> Graph:
    """The pass ``bias-follows``: a bias no rule names, added to a colwise weight's matmul
    output, takes the weight's split (on its last dim) and rule."""
    layouts, bound_by = bound_rules(graph, spec)
    _bias_follows(graph, spec, layouts, bound_by)
    return with_bound(graph, layouts, bound_by)


def fused_bias_layouts(graph: Graph, spec: Spec) -> Graph:
    """The pass ``fused-bias-follows``: an unnamed fused bias follows its colwise fused weight
    (:func:`parcomp.passes.fused_weights.fused_bias_follows`)."""
    layouts, bound_by = bound_rules(graph, spec)
    fused_bias_follows(graph, layouts, bound_by)
    return with_bound(graph, layouts, bound_by)


def attention_heads(graph: Graph, spec: Spec) -> Graph:
    """The pass ``attention-heads``: a colwise weight's heads split evenly over its axis, or a
    grouped-query kv projection with fewer heads than ranks is replicated on that axis
    (:func:`parcomp.passes.attention.heads.check_heads`).

    Raises:
        SpecError: heads that cannot be split evenly (not a GQA repeat).
    """
    layouts, bound_by = bound_rules(graph, spec)
    check_heads(graph, spec, layouts, bound_by)
    return with_bound(graph, layouts, bound_by)


def pad_vocab(graph: Graph, spec: Spec) -> Graph:
    """The pass ``pad-vocab``: a vocab table split unevenly is padded (:mod:`.vocab_pad`)."""
    layouts, _ = bound_rules(graph, spec)
    return pad_vocab_tables(graph, spec.mesh, layouts, _ce_loss(spec))


def check_even(graph: Graph, spec: Spec) -> Graph:
    """The check ``check-even``: every param's and input's layout splits its dims evenly.

    On a mesh with a ``pp`` axis, also: no param splits over ``pp`` or ``dp`` (a pipeline
    stage holds its params whole over both; ``zero=1`` splits only their optimizer state).

    Raises:
        SpecError: the message names tensor, dim, sizes and mesh axis, at the rule's line; a
            param split over ``pp`` or ``dp`` under pp, at its rule.
    """
    _, bound_by = bound_rules(graph, spec)
    if "pp" in spec.mesh.names:
        _check_whole_over_pipeline(graph, spec, bound_by)
    for n in graph.nodes:
        if n.name in bound_by:
            with _tied_note(n, _rule_of(spec, n)[1]):
                _check_even(n, n.layout, spec, bound_by[n.name])
    return graph


def _check_whole_over_pipeline(graph: Graph, spec: Spec, bound_by: dict) -> None:
    """A SpecError at its rule for the first param whose layout splits over ``pp`` or ``dp``."""
    inner = [a for a in spec.mesh.names if a not in ("pp", "dp")]
    for n in graph.params:
        outer = [(a, pl) for a, pl in zip(spec.mesh.names, n.layout) if a in ("pp", "dp") and pl != R]
        if outer:
            a, pl = outer[0]
            rule = bound_by.get(n.name)
            may = f"a param may split only over {', '.join(inner)}" if inner else "no param may split"
            raise SpecError(f"param {n.name} is split over {a} ({a}={pl}): inside a pipeline (mesh "
                            f"{spec.mesh}) {may} (pp cuts the model into stages, not tensors; a "
                            f"stage holds its params whole over dp, zero=1 splits their optimizer "
                            f"state)",
                            rule.loc if rule else n.spec_loc)


def pin_activations(graph: Graph, spec: Spec) -> Graph:
    """The pass ``pin-activations``: each activation a rule names gets a ``relayout`` to it."""
    return _pin_activations(graph, spec)


def pin_outputs(graph: Graph, spec: Spec) -> Graph:
    """The pass ``pin-outputs``: each model output gets a ``relayout`` to the spec's layout
    (replicated when no rule names it)."""
    return _pin_outputs(graph, spec)


def _ce_loss(spec) -> bool:
    """Whether the spec trains with a cross-entropy loss (on the model's logits)."""
    loss = spec.train.get("loss") if spec.train else None
    return (loss[0] if isinstance(loss, tuple) else loss) == "cross_entropy"


def _check_shadowed(spec, names_by_target):
    """The first matching rule wins; a rule that never wins is a mistake, so say so."""
    for i, rule in enumerate(spec.rules):
        names = [n for n in names_by_target[rule.target] if rule.matches(n)]
        if not names:
            continue
        winners = [n for n in names if _first(spec, rule.target, n) is rule]
        if not winners:
            first = _first(spec, rule.target, names[0])
            if first.pattern == rule.pattern:  # the same pattern twice: not a matter of order
                raise SpecError(f"duplicate rule: {rule.target} '{rule.pattern}' already has a rule at "
                                f"{first.loc} (the first matching rule wins, so this one never applies); "
                                f"remove one of the two", rule.loc)
            raise SpecError(f"this rule never applies: {names[0]} is matched first by "
                            f"'{first.pattern}' at {first.loc} (the first matching rule wins); "
                            f"put the more specific rule first", rule.loc)


def _first(spec, target, name):
    return next((r for r in spec.rules if r.target == target and r.matches(name)), None)


def names_of(node) -> tuple:
    """Every name a spec rule may give ``node``: its own, then a tied weight's other names
    (the ``aliases`` attr the torch frontend sets from ``named_parameters(remove_duplicate=False)``:
    torch.export keeps one name of GPT-2's tied ``lm_head.weight`` / ``transformer.wte.weight``)."""
    aliases = node.attr("aliases") if node.op == "param" else None
    return (node.name,) + tuple(a for a in (aliases or "").split(",") if a)


def _rule_of(spec, node) -> tuple:
    """``(rule, the name it matched)`` for an input or param: the first rule in file order that
    matches any of :func:`names_of` (``(None, node.name)`` when none does).

    Raises:
        SpecError: at a later rule that gives another name of the same tied tensor another
            layout (one tensor has one layout).
    """
    firsts = [(_first(spec, node.op, name), name) for name in names_of(node)]
    order = {id(r): i for i, r in enumerate(spec.rules)}
    hits = sorted(((order[id(r)], r, name) for r, name in firsts if r is not None), key=lambda h: h[0])
    if not hits:
        return None, node.name
    _, rule, used = hits[0]
    for _, other, name in hits[1:]:
        if other is not rule and other.layout != rule.layout:
            raise SpecError(f"param {name} and {used} are one tied tensor (the model's {node.name}); "
                            f"this rule gives it {_layout_text(other.layout)}, the rule at "
                            f"{where(rule.loc)} {_layout_text(rule.layout)}: give a tied weight one "
                            f"layout (one rule, for either name)", other.loc)
    return rule, used


def _layout_text(lay) -> str:
    text = lay.word if lay.word is not None else layout_str(lay.explicit)
    return text + (f" over {lay.axis}" if lay.axis else "")


@contextlib.contextmanager
def _tied_note(node, used: str):
    """A SpecError about ``node`` raised inside, when the spec named it by a tied alias
    ``used``: the same message, saying which name the rule used."""
    try:
        yield
    except SpecError as e:
        if used == node.name:
            raise
        raise SpecError(f"{e.message} (the rule names it {used}: the same tensor as {node.name}, "
                        f"tied)", e.loc) from None


def _word_layout(spec, rule, ty):
    lay = rule.layout
    if lay.explicit is not None:
        return tuple(lay.explicit)
    a = spec.mesh.axis_index(lay.axis)
    placement = {"replicated": R, "partial-sum": P,
                 "split-hidden": Shard(max(ty.rank - 1, 0)),
                 "split-seq": Shard(max(ty.rank - 2, 0))}.get(lay.word)
    if placement is None:
        raise SpecError(f"'{lay.word}' applies to matmul weights (params), not to this tensor",
                        rule.loc)
    out = list(replicated(len(spec.mesh.axes)))
    out[a] = placement
    return tuple(out)


def _resolve(graph, spec, rule, node, users):
    if rule.layout.word not in ("colwise", "rowwise"):
        return _word_layout(spec, rule, node.type)
    if node.op != "param":
        raise SpecError(f"'{rule.layout.word}' applies to weights, but {node.name} is an input",
                        rule.loc)
    if node.attr("stored_shape"):  # attention part: a fused weight, split per part
        dim = fused_split_dim(node, rule.layout.word)
    else:
        dim = weight_split_dim(graph, node, rule, users)
    out = list(replicated(len(spec.mesh.axes)))
    out[spec.mesh.axis_index(rule.layout.axis)] = Shard(dim)
    return tuple(out)


def weight_split_dim(graph, node, rule, users) -> int:
    """Stored dim of ``node`` that colwise/rowwise splits, found through its uses
    (``users``: ``graph.users()``)."""
    chain, cur = [], node.name
    while True:
        us = users[cur]
        mm = [u for u in us if graph[u].op == "matmul" and graph[u].inputs[1] == cur]
        if mm:
            rb = graph[cur].type.rank
            dim = rb - 1 if rule.layout.word == "colwise" else rb - 2
            break
        nxt = [u for u in us if graph[u].op in ("permute", "reshape")]
        if len(us) > 1:
            used = ", ".join(f"{graph[u].op} %{u}" for u in us)
            raise SpecError(f"'{rule.layout.word}' follows {node.name} along one chain of uses to "
                            f"its matmul, but it is used {len(us)} times ({used}); give it an "
                            f"explicit layout such as [S(0)] instead", rule.loc)
        if not nxt:
            used = ", ".join(f"{graph[u].op} %{u}" for u in us) or "nothing"
            raise SpecError(f"'{rule.layout.word}' needs {node.name} to be the right operand of "
                            f"a matmul (a weight); it is used by {used}", rule.loc)
        chain.append(graph[nxt[0]])
        cur = nxt[0]
    for n in reversed(chain):  # map the matmul-side dim back to the stored dim
        if n.op == "permute":
            dim = n.attr("perm")[dim]
        else:
            inv = {o: i for i, o in reshape_dim_map(graph[n.inputs[0]].type.shape, n.type.shape).items()}
            if dim not in inv:
                raise SpecError(f"cannot split {node.name} {rule.layout.word}: the reshape "
                                f"%{n.name} merges the split dim with others", rule.loc)
            dim = inv[dim]
    return dim


def _bias_follows(graph, spec, layouts, bound_by):
    users = graph.users()
    for name, rule in bound_by.items():
        if rule is None or rule.layout.word != "colwise":
            continue
        for mm in _matmuls_of(graph, users, name):
            adds = [u for u in users[mm] if graph[u].op == "add"]
            for a in adds:
                other = [i for i in graph[a].inputs if i != mm]
                if len(other) == 1 and graph[other[0]].op == "param" and bound_by.get(other[0]) is None:
                    b = graph[other[0]]
                    if b.type.shape and b.type.shape[-1] == graph[mm].type.shape[-1]:
                        layouts[b.name] = tuple(Shard(b.type.rank - 1) if isinstance(p, Shard) else p
                                                for p in layouts[name])
                        bound_by[b.name] = rule


def _matmuls_of(graph, users, name):
    out, frontier = [], [name]
    while frontier:
        cur = frontier.pop()
        for u in users[cur]:
            if graph[u].op == "matmul":
                out.append(u)
            elif graph[u].op in ("permute", "reshape"):
                frontier.append(u)
    return out


def _fused_note(node) -> str:
    """For a fused weight (GPT-2's ``c_attn``), how its layouts are written: on the view of
    its parts, not the stored shape (:mod:`parcomp.passes.fused_weights`)."""
    stored = tuple(node.attr("stored_shape") or ())
    if not stored:
        return ""
    view = node.type.shape
    parts = next(d for d in range(len(view)) if d >= len(stored) or view[d] != stored[d])
    return (f". {node.name} is a fused weight stored as [{','.join(map(str, stored))}] and laid out "
            f"on the view of its {view[parts]} parts {node.type} (dim {parts} picks the part): a "
            f"layout names a dim of that view; 'colwise' / 'rowwise' split each part as Megatron does")


def _check_dims(node, layout, rule):
    """Every ``S(d)`` of ``layout`` names a dim ``node`` has. Checked as soon as a rule's layout
    is resolved, so the passes that run before ``check-even`` (bias and fused-bias following,
    the heads, vocab padding) index only dims the tensor has."""
    bad = next((p.dim for p in layout if isinstance(p, Shard) and not 0 <= p.dim < node.type.rank), None)
    if bad is not None:
        raise SpecError(f"{node.op} {node.name} {node.type} as {layout_str(layout)}: S({bad}) names a "
                        f"dim a rank-{node.type.rank} tensor does not have{_fused_note(node)}",
                        rule.loc if rule else None)


def _check_even(node, layout, spec, rule):
    problem = divisibility_problem(node.type, layout, spec.mesh)
    if problem:
        note = " (uneven sharding is not supported yet)" if "not divisible" in problem else ""
        note += _fused_note(node)
        raise SpecError(f"{node.op} {node.name} {node.type} as {layout_str(layout)}: {problem}{note}",
                        rule.loc if rule else None)


def _pin(graph, name, layout, origin, suffix, rule):
    """Insert ``relayout(name) -> layout`` and route every consumer through it."""
    new = NameGen(n.name for n in graph.nodes).fresh(f"{name}.{suffix}")
    node = Node(new, "relayout", (name,), graph[name].type, make_attrs(origin=origin), layout,
                source=graph[name].source, spec_loc=rule.loc)
    nodes = []
    for n in graph.nodes:
        if n.name != name:
            n = replace(n, inputs=tuple(new if i == name else i for i in n.inputs))
        nodes.append(n)
        if n.name == name:
            nodes.append(node)
    return graph.with_nodes(nodes, [new if o == name else o for o in graph.outputs])


def where(loc) -> str:
    """``file.pcs:LINE`` of a spec rule: the basename, so no machine path reaches a program."""
    return f"{os.path.basename(loc.file)}:{loc.line}"


def _pin_activations(graph, spec):
    for n in list(graph.nodes):
        if n.op in ("input", "param", "relayout"):
            continue
        rule = _first(spec, "activation", n.name)
        if rule:
            lay = _word_layout(spec, rule, n.type)
            _check_even(n, lay, spec, rule)
            graph = _pin(graph, n.name, lay, f"the spec's activation rule at {where(rule.loc)}",
                         "as_spec", rule)
    return graph


def _pin_outputs(graph, spec):
    for public, value in graph.named_outputs():
        rule = _first(spec, "output", public)
        lay = _word_layout(spec, rule, graph[value].type) if rule else replicated(len(spec.mesh.axes))
        if rule:
            _check_even(graph[value], lay, spec, rule)
        said = f" (spec {where(rule.loc)})" if rule else " (replicated by default)"
        attrs = make_attrs(origin=f"output {public}{said}", **({} if rule else {"default": True}))
        new = NameGen(n.name for n in graph.nodes).fresh(f"{public}.as_output")
        node = Node(new, "relayout", (value,), graph[value].type, attrs, lay,
                    source=graph[value].source, spec_loc=rule.loc if rule else None)
        outs = [new if (p, v) == (public, value) else v for p, v in graph.named_outputs()]
        graph = graph.with_nodes(list(graph.nodes) + [node], outs)
    return graph
