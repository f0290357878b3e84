"""The IR verifier, run after every pass: invariants as a table of checks.

Checks, in order: SSA well-formedness; types agree with each op's shape rule
(global graphs); and, once layouts exist, the layout rules:
a nonlinear op never sees ``P``; a ``P(max)`` reaches only all_reduce(max), amax and
identity/movement ops (it is never summed); ``P + R`` never happens (an ``R`` addend must be
made ``P`` on one rank first, so it is counted once); a product has at most one
``P`` factor per axis; every op's (input layouts -> output layout) is a strategy
of the rule table; every layout-change node does exactly what its kind says.
"""
from __future__ import annotations

from operator import attrgetter, itemgetter

from ..errors import VerifyError
from ..ir.graph import Graph, describe
from ..ir.ops import OPS, attr_problem
from ..ir.transitions import JOINT_KINDS, TRANSITIONS
from ..ir.types import Partial, Shard, divisibility_problem, layout_str
from ..rules.sharding import is_valid_strategy


def verify(graph: Graph, memo: dict | None = None) -> None:
    """Raise :class:`VerifyError` naming the first node that breaks an invariant.

    ``memo`` (a dict the caller keeps across calls, as the pass pipeline does) holds the
    last graph that passed and its checks; a node object of that graph met again with
    operands of the same type and layout objects, stage, mesh and checks passed before and
    is not checked again (every check of a node reads only these). The order of definitions and the
    outputs are always checked, so the first failing node is the same with or without
    ``memo``.
    """
    checks = (graph.stage, graph.mesh,
              graph.mesh is not None and None not in map(_LAYOUT, graph.nodes))
    last = memo.get(_LAST) if memo is not None else None
    before = last[0]._index.get if last is not None and last[1] == checks else {}.get
    todo = _check_ssa(graph, before)
    alike = memo.setdefault(_ALIKE, {"values": {}}) if memo is not None else {"values": {}}
    passed = alike.setdefault(checks, set())  # keys of nodes that passed these checks
    # the first of each set of alike nodes, in order, less those alike one that passed
    distinct, keys = _distinct(graph, todo, passed, alike["values"])
    if graph.stage == "global":
        _check_types(graph, distinct)
    if graph.mesh is not None:
        check_layout_shapes(graph, graph.mesh, distinct)
    if checks[2]:
        for n in distinct:
            _check_layouts(graph, n)
    if memo is not None:
        memo[_LAST] = (graph, checks)
        passed.update(k for k in keys if k is not None)


_LAST = "verify.last"  # memo key: (the last graph that passed, its checks)
_ALIKE = "verify.alike"  # memo key: {"values": value -> token, checks: keys of nodes that passed}
_LAYOUT = attrgetter("layout")
_KEY = itemgetter(0)  # of an attribute pair
_TYPE = itemgetter(0, 1)  # of an operand's (shape, dtype, layout token): its type


def check_model_mesh(graph: Graph, mesh) -> None:
    """A model graph fits the spec's ``mesh``: it is a global graph, its own ``mesh``
    line (if any) is that mesh, and its layouts (pins) have that mesh's shape.

    Raises:
        VerifyError: with ``err.anchor`` (``"mesh"`` / ``"stage"``) or ``err.node``
            naming where in a ``.pcir`` text the problem is.
    """
    if graph.stage != "global":
        err = VerifyError(f"a model is a global graph (unsharded types); this one is stage "
                          f"{graph.stage}, a per-rank program: give the model it came from")
        err.anchor = "stage"
        raise err
    if graph.mesh is not None and graph.mesh != mesh:
        err = VerifyError(f"the model says mesh {graph.mesh} but the spec's mesh is {mesh}; "
                          f"drop the model's mesh line (the spec's is used) or make them equal")
        err.anchor = "mesh"
        raise err
    check_layout_shapes(graph, mesh)


def check_layout_shapes(graph: Graph, mesh, nodes=None) -> None:
    """Every layout in ``graph`` (of a value or an operand) has one placement per axis
    of ``mesh``, and every ``S(d)`` splits a dim its tensor has (``nodes``: only those
    of ``graph``'s nodes; all by default).

    Raises:
        VerifyError: naming the node (``err.node``, so a caller holding the
            ``.pcir`` text can point at its line).
    """
    for n in graph.nodes if nodes is None else nodes:
        pairs = [("layout", n.layout, n.type)]
        if n.in_layouts is not None:
            pairs += [(f"operand %{i}'s layout", lay, graph[i].type if i in graph else None)
                      for i, lay in zip(n.inputs, n.in_layouts)]
        for what, lay, ty in pairs:
            problem = None if lay is None else _layout_shape_problem(lay, ty, mesh)
            if problem:
                _fail(graph, n, f"{what} {layout_str(lay)}: {problem}")


def _layout_shape_problem(layout, ty, mesh) -> str | None:
    k, naxes = len(layout), len(mesh.axes)
    if k != naxes:
        return (f"{k} placement{'' if k == 1 else 's'} but mesh {mesh} has {naxes} "
                f"ax{'is' if naxes == 1 else 'es'} (one placement per axis, in mesh order)")
    for p in layout:
        if isinstance(p, Shard) and ty is not None and not 0 <= p.dim < ty.rank:
            return f"{p} splits dim {p.dim}, but {ty} has {ty.rank} dim{'' if ty.rank == 1 else 's'}"
    return None


def _fail(graph, node, msg):
    err = VerifyError(f"{msg}\n  at: {describe(node)}")
    err.node = node.name  # lets a caller with the source text point at the line
    raise err


def _check_ssa(graph, before) -> list:
    """Check definitions in order; return the nodes to check (in order): those that are not
    the object ``before`` (a name's node in the last graph that passed) gives, and those
    with an operand whose type or layout object is not that node's (a reader's checks read
    only these of an operand)."""
    seen, changed, todo = set(), set(), []  # changed: names whose type or layout object is new
    schemas = {}  # (op, attrs) -> the first node with them (the schema check reads only those)
    for n in graph.nodes:
        name, ins = n.name, n.inputs
        old = before(name)
        if old is not n:
            if old is None or old.type is not n.type or old.layout is not n.layout:
                changed.add(name)  # what a reader's checks read of it (type, layout) may differ
            fresh = True
        else:
            fresh = bool(changed) and not changed.isdisjoint(ins)
        if fresh and n.op not in OPS:
            _fail(graph, n, f"unknown op {n.op!r}")
        if name in seen:
            _fail(graph, n, f"%{name} is defined twice")
        if not seen.issuperset(ins):
            for i in ins:
                if i not in seen:
                    _fail(graph, n, f"%{i} is used before it is defined")
        if fresh:
            arity = OPS[n.op].arity
            if arity >= 0 and len(ins) != arity:
                _fail(graph, n, f"{n.op} takes {arity} operands, got {len(ins)}")
            if _first(schemas, (n.op, n.attrs), n):
                _check_attrs(graph, n)
            todo.append(n)
        seen.add(name)
    for o in graph.outputs:
        if o not in seen:
            raise VerifyError(f"output %{o} is not defined")
    return todo


def _check_attrs(graph, n):
    problem = attr_problem(n.op, n.attrs)  # the op's declared schema (parcomp/ir/ops.py)
    if problem:
        _fail(graph, n, problem)


def _check_types(graph, nodes):
    for n in nodes:
        if OPS[n.op].kind in ("source",):
            continue
        try:
            ty = OPS[n.op].infer([graph[i].type for i in n.inputs], n)
        except ValueError as e:
            _fail(graph, n, f"bad operand types: {e}")
        if ty != n.type:
            _fail(graph, n, f"type should be {ty}, not {n.type}")


def _operand_layouts(graph, n):
    return n.in_layouts if n.in_layouts is not None else tuple(graph[i].layout for i in n.inputs)


# ops that may take a P(max) operand (reductions part): the max reductions and
# ops that only move data; a layout op is checked against TRANSITIONS instead
MAX_PARTIAL_OPS = ("amax", "relayout", "reshape", "permute", "expand", "wait")


def _check_partial_rules(graph, n, ins):
    kind = OPS[n.op].kind
    for a, axis in enumerate(graph.mesh.names):
        if (n.op not in MAX_PARTIAL_OPS and n.op not in TRANSITIONS
                and any(lay[a] == Partial("max") for lay in ins)):
            _fail(graph, n, f"{n.op} gets a P(max) operand over mesh axis {axis}: a partial max "
                            f"is never summed or computed on; all_reduce it (reduce_op=max) first")
        if kind == "reduce_max" and any(lay[a] == Partial() for lay in ins):
            _fail(graph, n, f"{n.op} (a max) gets a partial-sum operand over mesh axis {axis}: "
                            f"reduce it (all_reduce) first")
        parts = [isinstance(lay[a], Partial) for lay in ins]
        if not any(parts):
            continue
        if kind == "nonlinear":
            _fail(graph, n, f"nonlinear op {n.op} gets a partial-sum operand over mesh axis "
                            f"{axis}: reduce it (all_reduce / reduce_scatter) first")
        if kind == "additive" and not all(parts):
            _fail(graph, n, f"{n.op} mixes a partial-sum and a non-partial operand over {axis}: "
                            f"the non-partial one would be counted {graph.mesh.sizes[a]} times")
        if kind == "bilinear" and sum(parts) > 1:
            _fail(graph, n, f"{n.op} of two partial sums over {axis} is not a partial sum")
        if kind == "linear0" and parts[1:] and any(parts[1:]):
            _fail(graph, n, f"{n.op} by a partial-sum divisor over {axis}")


def _move_axes(graph, n) -> tuple:
    """The mesh axes of layout op ``n`` (``axis="tp"``, or a joint group ``"dp,tp"`` of
    distinct axes in mesh order, only for the ops of ``JOINT_KINDS``)."""
    try:
        axes = graph.mesh.axes_of(n.attr("axis"))
    except ValueError:
        _fail(graph, n, f"{n.op} over {n.attr('axis')!r}: not an axis of mesh {graph.mesh}")
    if len(axes) > 1 and (n.op not in JOINT_KINDS or list(axes) != sorted(set(axes))):
        _fail(graph, n, f"{n.op} over {n.attr('axis')!r}: a joint group is only for "
                        f"{', '.join(JOINT_KINDS)}, its axes distinct and in mesh order")
    return axes


def _is_dim(d, ty) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and 0 <= d < ty.rank


#: attributes no type or layout check reads: words for reports and comments (a relayout's
#: spec rule, a collective's reason) and lower.py's liveness (``frees``); they differ per
#: node, so they are no part of the key that finds alike nodes (their schema is checked)
WORDS = frozenset({"origin", "reason", "frees"})


def _distinct(graph, nodes, passed=(), values=None) -> tuple:
    """``(nodes, keys)``: ``nodes`` less each node alike an earlier one, or alike one whose key
    is in ``passed`` (it passed these checks in an earlier call), in all that the type and
    layout checks read of it: op, attrs (less :data:`WORDS`), type, layout, operand layouts
    (and whether they are its own ``in_layouts``) and operand types, not names; and the
    keys of the nodes kept (None: unhashable). Alike nodes pass or fail alike, and a failing
    one is met first, so the first failing node is the same; the nodes of repeated blocks
    are checked once.

    A type enters a key as its shape and dtype, a layout as a token, equal for equal values
    (``values``: value -> token, kept by the caller across calls), looked up once per object
    (by ``id``: the graph keeps them alive): keys hash and compare without dataclass calls."""
    values = {} if values is None else values
    ids, pairs, get = {}, {}, graph._index.__getitem__

    def tok(x):
        t = ids.get(id(x))
        if t is None:
            t = ids[id(x)] = values.setdefault(x, len(values))
        return t

    def pair(name):  # a node's (shape, dtype, layout token), by name (it is also an operand)
        got = pairs.get(name)
        if got is None:
            m = get(name)
            ty = m.type  # a TensorType is equal to another when its shape and dtype are
            got = pairs[name] = (ty.shape, ty.dtype, tok(m.layout))
        return got

    first, out, keys = {}, [], []
    for n in nodes:
        try:
            ops = tuple(map(pair, n.inputs))  # operand (type, layout) tokens
            attrs = n.attrs
            if attrs and not WORDS.isdisjoint(map(_KEY, attrs)):
                attrs = tuple(kv for kv in attrs if kv[0] not in WORDS)
            if n.in_layouts is None:  # the operand layouts are the operands' own
                key = (n.op, attrs, pair(n.name), True, ops)
            else:
                key = (n.op, attrs, pair(n.name), False, tuple(map(tok, n.in_layouts)), tuple(map(_TYPE, ops)))
            if key in passed or first.setdefault(key, n) is not n:
                continue
        except (TypeError, AttributeError):  # an unhashable value, a type that is none: checked
            key = None
        out.append(n)
        keys.append(key)
    return out, keys


def _first(first: dict, key, n) -> bool:
    """Whether ``n`` is the first node met with ``key`` (recorded in ``first``); True for a
    key that cannot be hashed (an unhashable attribute value: such nodes are all checked)."""
    try:
        return first.setdefault(key, n) is n
    except TypeError:
        return True


def _check_layouts(graph, n):
    problem = divisibility_problem(n.type, n.layout, graph.mesh) if graph.stage == "global" else None
    if problem:
        _fail(graph, n, f"layout {layout_str(n.layout)}: {problem}")
    if OPS[n.op].kind == "source":
        return
    ins = _operand_layouts(graph, n)
    _check_partial_rules(graph, n, ins)
    if n.op in TRANSITIONS:
        axes = _move_axes(graph, n)
        for key in ("dim", "src_dim"):
            if key in OPS[n.op].attrs and not _is_dim(n.attr(key), n.type):
                _fail(graph, n, f"{n.op} needs {key}= a dim of {n.type}, not {n.attr(key)!r}")
        op = n.attr("reduce_op", "sum")
        if op not in TRANSITIONS[n.op].reduce_ops and op != "sum":
            _fail(graph, n, f"{n.op} has no reduce_op={op!r} (a P(max) is never reduce_scattered)")
        before, after = TRANSITIONS[n.op].placements(n.attr("dim"), n.attr("src_dim"), op)
        src = ins[0]
        expect = tuple(after if a in axes else p for a, p in enumerate(src))
        if any(src[a] != before for a in axes) or n.layout != expect:
            _fail(graph, n, f"{n.op} over {n.attr('axis')} must turn {before} into {after}; "
                            f"it goes {layout_str(src)} -> {layout_str(n.layout)}")
        return
    if graph.stage == "global":
        in_types = [graph[i].type for i in n.inputs]
        if not is_valid_strategy(n, in_types, ins, n.layout, graph.mesh):
            _fail(graph, n, f"{n.op} cannot take {', '.join(layout_str(x) for x in ins)} "
                            f"to {layout_str(n.layout)}")

