"""The graph IR: an SSA list of immutable nodes (Thunder-style, not FX's linked list).

A :class:`Graph` is a tuple of :class:`Node` in topological order plus the
names of its outputs.  Every value is the single result of one node and is
referred to by the node's name.  Passes never mutate: they build new graphs
(``dataclasses.replace``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from .types import Layout, Mesh, TensorType, layout_str


#: the phases of a training step, in order; a forward program is all ``forward``
PHASES = ("forward", "loss", "backward", "optimizer")


@dataclass(frozen=True)
class Node:
    """One operation and the value it defines.

    Attributes:
        name: SSA name of the value (parameters keep their state_dict names).
        op: op name, a key of :data:`parcomp.ir.ops.OPS`.
        inputs: names of operand values, in order.
        type: global (unsharded) type, or the per-rank type after ``localize``.
        attrs: sorted ``(key, value)`` pairs; values are int, float, bool, str or
            tuples of ints.
        layout: one placement per mesh axis, or None before ``shard-prop``.
        in_layouts: the layout the op needs of each input (set by ``shard-prop``,
            consumed and cleared by ``insert-collectives``), or None.
        phase: which part of a step computes it: one of :data:`PHASES` (set by
            ``autodiff``; collectives take their operand's). Not part of equality.
        source: the model module path the frontend traced it from (``mlp.c_fc``), or None.
        spec_loc: the :class:`parcomp.errors.SourceLoc` of the spec rule that caused it
            (a layout rule, or the rule behind a collective), or None.
    """

    name: str
    op: str
    inputs: tuple
    type: TensorType
    attrs: tuple = ()
    layout: Layout | None = None
    in_layouts: tuple | None = None
    phase: str = field(default="forward", compare=False)
    source: str | None = field(default=None, compare=False)
    spec_loc: object = field(default=None, compare=False)

    def attr(self, key: str, default=None):
        """The value of attribute ``key``, or ``default``."""
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    def with_attrs(self, **kw) -> "Node":
        """A copy with attributes added or replaced (kept sorted)."""
        d = dict(self.attrs)
        d.update(kw)
        return evolve(self, attrs=tuple(sorted(d.items())))


def evolve(node: Node, **changes) -> Node:
    """``dataclasses.replace(node, **changes)``, several times faster: a :class:`Node` has
    no ``__post_init__`` and no validating ``__init__``, so the copy is its fields with
    ``changes`` over them (the passes copy ~75k nodes compiling a 48-block GPT-2).

    Raises:
        TypeError: ``changes`` names something not a field of ``node`` (as ``replace``)."""
    if type(node) is not Node or not _NODE_FIELDS.issuperset(changes):
        return replace(node, **changes)
    new = object.__new__(Node)
    fields = new.__dict__
    fields.update(node.__dict__)
    fields.update(changes)
    return new


_NODE_FIELDS = frozenset(Node.__dataclass_fields__)


def make_attrs(**kw) -> tuple:
    """Canonical (sorted) attribute tuple."""
    return tuple(sorted(kw.items()))


@dataclass(frozen=True)
class Graph:
    """A whole program: nodes in topological order, outputs, and the mesh (if any).

    ``stage`` names what the graph is: ``global`` (unsharded types) or ``local``
    (per-rank types, after ``localize``).
    """

    nodes: tuple
    outputs: tuple
    mesh: Mesh | None = None
    stage: str = "global"
    output_names: tuple | None = None  # public output names (default: the value names)
    # shard-prop's account of its search (which, cost, proven optimal); not part of equality
    search: dict | None = field(default=None, compare=False, repr=False, hash=False)
    _index: dict = field(default=None, compare=False, repr=False, hash=False)
    # facts derived from the (immutable) nodes, computed once: see :meth:`memo`
    _memo: dict = field(default=None, init=False, compare=False, repr=False, hash=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", {n.name: n for n in self.nodes})
        object.__setattr__(self, "_memo", {})
        if self.output_names is None:
            object.__setattr__(self, "output_names", tuple(self.outputs))

    def named_outputs(self) -> list:
        """``(public name, value name)`` pairs."""
        return list(zip(self.output_names, self.outputs))

    def __getitem__(self, name: str) -> Node:
        return self._index[name]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def memo(self, key, compute):
        """``compute(self)``, computed once per graph object and kept under ``key`` (a graph is
        immutable, so a fact derived from its nodes stays true; a new graph starts empty).
        ``compute`` must depend on the graph alone; callers must not mutate the result."""
        got = self._memo.get(key, self._memo)
        if got is self._memo:
            got = self._memo[key] = compute(self)
        return got

    def by_op(self, *ops: str) -> list:
        """Nodes whose op is one of ``ops``, in program order."""
        return [n for n in self.nodes if n.op in ops]

    @property
    def inputs(self) -> list:
        """The ``input`` nodes in program order (a new list; the scan is done once per graph)."""
        return list(self.memo("graph.inputs", lambda g: g.by_op("input")))

    @property
    def params(self) -> list:
        """The ``param`` nodes in program order (a new list; the scan is done once per graph)."""
        return list(self.memo("graph.params", lambda g: g.by_op("param")))

    def users(self) -> dict:
        """name -> list of consumer node names (in program order)."""
        out = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.name)
        return out

    def with_nodes(self, nodes, outputs=None, **kw) -> "Graph":
        """A copy with new nodes (and optionally new output values, same public names)."""
        return replace(self, nodes=tuple(nodes),
                       outputs=tuple(self.outputs if outputs is None else outputs), **kw)

    def __str__(self) -> str:
        from .printer import print_graph

        return print_graph(self)


def describe(node: Node) -> str:
    """One-line human summary used in error messages."""
    lay = f" {layout_str(node.layout)}" if node.layout is not None else ""
    return f"%{node.name} = {node.op}({', '.join('%' + i for i in node.inputs)}) : {node.type}{lay}"
