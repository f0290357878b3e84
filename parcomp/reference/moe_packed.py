"""Dropless MoE in the numpy reference: the experts compute only the routed tokens.

The graph keeps an MoE layer's static shapes (:mod:`.moe_ops`): ``moe_dispatch`` fills a
``[B, E, C, H]`` slot buffer, the experts are batched matmuls over ``E`` on it, ``moe_combine``
reads it back. Most slots are empty (E/k times the routed tokens without a capacity), so the
reference holds every value between a dispatch and its combine *packed*, as program.py's
dropless form does (backends/torch/emit/moe_dropless.py): a :class:`SlotRows`, one row per
routed (token, expert) pair that has a slot, sorted by expert, then row, then slot, its feature
dims after; the dense buffer is never allocated and a matmul with the expert weights
``[E, K, F]`` multiplies each expert's own rows by its own weight (:func:`apply`).

A dense value is its packed rows at the routed slots and whatever the ops make of an empty
slot elsewhere. The packed form is the same function wherever no empty slot is read: combine
and ``moe_combine_grad_c`` read the routed slots only; a matmul that sums over the slots
(a weight gradient ``slots^T @ grad``) reads empty slots too, so it is packed only where one
operand is exactly 0 on them (``zero_empty``: true of a dispatch, kept by the matmuls and by an
element-wise op whose value at 0 is 0, as the backward's ops on a gradient). Any other
statement on a slot value (a reduction over the slots, a reshape that cuts them, an
element-wise op with an unpacked operand, slots as an output) raises :class:`NotPacked`, and
the caller runs the whole program again with dense buffers (:data:`DENSE`): the result is
then the dense form's, by construction.

Atoms (as moe_dropless.py's): each dense dim is a row-major tuple of atoms ``(name, size)``:
the slot atoms ``"B"`` (rows of the routing group), ``"E"`` (experts), ``"C"`` (slots), or a
feature atom ``(("f", id), size)``; a :class:`Route` holds each packed row's coordinate in the
slot atoms. An ``all_to_all`` between rows-split and experts-split (expert parallel) moves
each row to the rank of its expert chunk and renumbers its coordinates (:func:`exchange`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ir.moe_slots import SLOT_ATOMS, SlotLayoutError, feature_atom, regroup
from ..ir.moe_slots import feature_dims as slot_feature_dims
from ..ir.moe_slots import is_slot_dim
from ..ir.moe_slots import signature as slot_signature
from .moe_ops import slots

ELEMENTWISE = frozenset({
    "relu", "gelu", "tanh", "exp", "sigmoid", "silu", "pow", "add_scalar", "neg", "scale", "cast",
    "add", "sub", "mul", "div", "add_scaled", "axpby", "relu_grad", "tanh_grad", "sigmoid_grad",
    "silu_grad", "pow_grad", "gelu_grad", "grad_upcast", "wait"})


class NotPacked(Exception):
    """A statement on a slot value the packed form does not cover: run the program dense."""


class _Mode:
    """Whether :func:`apply` packs (the default); ``with DENSE:`` runs the dense buffers."""

    def __init__(self):
        self.packed = True

    def __enter__(self):
        self._was, self.packed = self.packed, False
        return self

    def __exit__(self, *exc):
        self.packed = self._was
        return False


MODE = DENSE = _Mode()


@dataclass(eq=False)
class Route:
    """The routed pairs of one side of a layer: each packed row's coordinate in each slot atom
    (``coords[atom]``, int arrays of one length), sorted by E, then B, then C."""
    coords: dict

    @property
    def size(self) -> int:
        return len(self.coords["E"])

    def same(self, other) -> bool:
        return self is other or all(np.array_equal(self.coords[a], other.coords[a]) for a in SLOT_ATOMS)

    def counts(self, experts: int) -> np.ndarray:
        """Rows of each expert (the rows are sorted by expert)."""
        return np.bincount(self.coords["E"], minlength=experts)


def _route(b, e, pos):
    order = np.lexsort((pos, b, e))
    return Route({"B": b[order], "E": e[order], "C": pos[order]}), order


@dataclass(eq=False)
class SlotRows:
    """A slot value held packed: ``rows[N, *features]`` (the dense feature dims in order),
    ``dims``: the dense dims as atoms, ``route``: the rows' slot coordinates, ``zero_empty``:
    whether the dense value is exactly 0 on every empty slot."""
    rows: np.ndarray
    dims: tuple
    route: Route
    zero_empty: bool

    @property
    def shape(self) -> tuple:
        return tuple(int(np.prod([a[1] for a in d])) for d in self.dims)

    @property
    def dtype(self):
        return self.rows.dtype

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    def slot_dim(self, d) -> bool:
        return is_slot_dim(self.dims, d)

    def feature_dims(self) -> list:
        return slot_feature_dims(self.dims)

    def signature(self) -> tuple:
        return slot_signature(self.dims)

    def dense(self) -> np.ndarray:
        """The dense value (zeros on the empty slots; only what it is where ``zero_empty``)."""
        slot = [d for d in range(len(self.dims)) if self.slot_dim(d)]
        feats = self.feature_dims()
        idx = []
        for d in slot:
            i = np.zeros(self.route.size, np.int64)
            for name, size in self.dims[d]:
                i = i * size + self.route.coords[name]
            idx.append(i)
        shape = self.shape
        out = np.zeros([shape[d] for d in slot] + [shape[d] for d in feats], self.rows.dtype)
        out[tuple(idx)] = self.rows.reshape((self.route.size,) + tuple(shape[d] for d in feats))
        order = slot + feats
        return np.transpose(out, [order.index(d) for d in range(len(self.dims))])

    def with_rows(self, rows, dims=None, zero_empty=None):
        return SlotRows(rows, self.dims if dims is None else dims, self.route,
                        self.zero_empty if zero_empty is None else zero_empty)


def nbytes(x) -> int:
    """Bytes held by a value (a packed one: its rows)."""
    return x.nbytes if isinstance(x, SlotRows) else int(np.asarray(x).nbytes)


def _dispatch(x, c, node):
    b, s, e, pos = slots(c, node.attr("capacity"))
    route, order = _route(b, e, pos)
    b, s, e = b[order], s[order], e[order]
    rows = x[b, s] * c[b, s, e][:, None] if node.attr("weighted", False) else x[b, s]
    dims = (((("B", c.shape[0]),), (("E", c.shape[2]),), (("C", node.attr("capacity")),))
            + (((feature_atom(x.shape[2])),),))
    return SlotRows(np.ascontiguousarray(rows), dims, route, True), (b, s, e)


def _check_route(y, c, capacity):
    b, s, e, pos = slots(c, capacity)
    route, order = _route(b, e, pos)
    if y.dims[:3] != ((("B", c.shape[0]),), (("E", c.shape[2]),), (("C", capacity),)) or not route.same(y.route):
        raise NotPacked("slots combined by other weights than they were dispatched by")
    return b[order], s[order], e[order]


def _combine(y, c, node):
    b, s, e = _check_route(y, c, y.shape[2])
    rows = y.rows * c[b, s, e][:, None] if node.attr("weighted", True) else y.rows
    out = np.zeros((c.shape[0], c.shape[1], y.shape[3]), y.dtype)
    np.add.at(out, (b, s), rows)
    return out


def _combine_grad_c(g, y, c):
    b, s, e = _check_route(y, c, y.shape[2])
    out = np.zeros(c.shape, c.dtype)
    out[b, s, e] = np.sum(g[b, s] * y.rows, axis=-1)
    return out


def _relaid(p, dims):
    """``p`` with dense dims ``dims`` (a permute or reshape): its rows' feature axes reordered."""
    old = [p.dims[d] for d in p.feature_dims()]
    out = p.with_rows(p.rows, dims)
    new = [dims[d] for d in out.feature_dims()]
    if sorted(map(str, old)) != sorted(map(str, new)):
        raise NotPacked("a reshape or permute of the feature dims of slots")
    rows = p.rows if old == new else np.transpose(p.rows, [0] + [1 + old.index(d) for d in new])
    return out.with_rows(rows)


def _zero_at_zero(fn, args, node) -> bool:
    """Whether the element-wise op gives exactly 0 where every operand is 0."""
    zeros = [np.zeros((1,) + a.rows.shape[1:], a.dtype) for a in args]
    with np.errstate(all="ignore"):
        return not np.any(np.asarray(fn(zeros, node)))


def _matmul(node, a, w, stats):
    if isinstance(a, SlotRows) and not isinstance(w, SlotRows):
        w = np.asarray(w)
        if w.ndim == 3 and len(a.dims) == 3 and len(a.dims[0]) == 1 and a.dims[0][0][0] == "E" \
                and a.slot_dim(1) and not a.slot_dim(2):
            parts = np.split(a.rows, np.cumsum(a.route.counts(w.shape[0]))[:-1])  # by expert
            rows = np.concatenate([part @ w[i] for i, part in enumerate(parts)])
            _count(stats, a.rows.shape[0], w.shape[1] * w.shape[2])
            return a.with_rows(rows.astype(a.dtype, copy=False), a.dims[:2] + ((feature_atom(w.shape[2]),),))
        if w.ndim == 2 and not a.slot_dim(len(a.dims) - 1):
            _count(stats, a.rows.shape[0], w.shape[0] * w.shape[1])
            return a.with_rows(a.rows @ w, a.dims[:-1] + ((feature_atom(w.shape[1]),),))
    if isinstance(a, SlotRows) and isinstance(w, SlotRows) and len(a.dims) == 3 and len(w.dims) == 3:
        ok = (a.route.same(w.route) and a.dims[0] == w.dims[0] and len(a.dims[0]) == 1
              and a.dims[0][0][0] == "E" and a.slot_dim(2) and a.dims[2] == w.dims[1]
              and not a.slot_dim(1) and not w.slot_dim(2) and (a.zero_empty or w.zero_empty))
        if ok:  # a weight gradient: the sum over an expert's slots is over its routed rows
            experts = a.dims[0][0][1]
            cuts = np.cumsum(a.route.counts(experts))[:-1]
            _count(stats, a.rows.shape[0], a.rows.shape[1] * w.rows.shape[1])
            return np.stack([x.T @ g for x, g in zip(np.split(a.rows, cuts), np.split(w.rows, cuts))])
    raise NotPacked(f"%{node.name}: a matmul of slots the packed form does not cover")


def _count(stats, rows, per_row):
    if stats is not None:
        stats["expert_rows"] = stats.get("expert_rows", 0) + int(rows)
        stats["expert_flops"] = stats.get("expert_flops", 0) + 2 * int(rows) * int(per_row)


def apply(fn, node, args, stats=None):
    """``node``'s value from ``args`` (its operands' values, some :class:`SlotRows`):
    ``fn(args, node)`` (its numpy op) where no operand is packed and it is no dispatch;
    ``stats`` (a dict) adds ``expert_rows`` / ``expert_flops``: the rows multiplied by expert
    weights (forward and backward) and their FLOPs. Raises NotPacked (see the module doc)."""
    op = node.op
    packed = [a for a in args if isinstance(a, SlotRows)]
    if op == "moe_dispatch" and MODE.packed and not packed:
        return _dispatch(np.asarray(args[0]), np.asarray(args[1]), node)[0]
    if not packed:
        return fn(args, node)
    if op == "moe_combine" and isinstance(args[0], SlotRows) and len(packed) == 1:
        return _combine(args[0], np.asarray(args[1]), node)
    if op == "moe_combine_grad_c" and isinstance(args[1], SlotRows) and len(packed) == 1:
        return _combine_grad_c(np.asarray(args[0]), args[1], np.asarray(args[2]))
    p = packed[0]
    if op == "permute":
        return _relaid(p, tuple(p.dims[i] for i in node.attr("perm")))
    if op == "reshape":
        return _relaid(p, _regrouped(p.dims, node.type.shape))
    if op in ELEMENTWISE:
        if len(packed) != len(args) or any(q.signature() != p.signature() or not q.route.same(p.route)
                                           for q in packed):
            raise NotPacked(f"%{node.name}: {op} of slots with another layout or a non-slot operand")
        zero = all(q.zero_empty for q in packed) and _zero_at_zero(fn, packed, node)
        return p.with_rows(np.asarray(fn([q.rows for q in packed], node)), zero_empty=zero)
    if op == "matmul":
        return _matmul(node, args[0], args[1], stats)
    if op in ("slice", "slice_grad", "cat"):
        return _feature_op(node, p, packed, args)
    raise NotPacked(f"%{node.name}: {op} of slots")


def _feature_op(node, p, packed, args):
    d = node.attr("dim")
    if p.slot_dim(d) or len(packed) != len(args) or any(not q.route.same(p.route) for q in packed):
        raise NotPacked(f"%{node.name}: a {node.op} of the slot dims or with non-slots")
    pd = 1 + p.feature_dims().index(d)
    dims = p.dims[:d] + ((feature_atom(node.type.shape[d]),),) + p.dims[d + 1:]
    if node.op == "cat":
        return p.with_rows(np.concatenate([q.rows for q in packed], axis=pd), dims,
                           all(q.zero_empty for q in packed))
    idx = [slice(None)] * p.rows.ndim
    idx[pd] = slice(node.attr("start"), node.attr("stop"), node.attr("step", 1))
    if node.op == "slice":
        return p.with_rows(np.ascontiguousarray(p.rows[tuple(idx)]), dims)
    shape = list(p.rows.shape)
    shape[pd] = node.type.shape[d]
    out = np.zeros(shape, p.dtype)
    out[tuple(idx)] = p.rows
    return p.with_rows(out, dims)


# ---- collectives of packed values (the interpreter's layout ops) ----

def exchange(xs, node, sent=None, group=None):
    """The ``all_to_all`` of the group's packed values ``xs`` (coordinate order): chunk j of dim
    ``dim`` (the rows whose outer atom of that dim falls in chunk j) goes to coordinate j, which
    places what coordinate i sent at chunk i of ``src_dim`` (renumbering the outer atom of each).
    ``sent``: as :func:`parcomp.reference.moe_ops.ragged_all_to_all`'s (the rows a ragged
    exchange sends: the nonzero ones, and a byte per dense slot row of each chunk)."""
    n, dim, src = len(xs), node.attr("dim"), node.attr("src_dim")
    p = xs[0]
    if not all(isinstance(x, SlotRows) and x.signature() == p.signature() for x in xs) \
            or not (p.slot_dim(dim) and p.slot_dim(src)):
        raise NotPacked(f"%{node.name}: an all_to_all of slots that is not between slot dims")
    (to_atom, to_size), (from_atom, from_size) = p.dims[dim][0], p.dims[src][0]
    if to_size % n:
        raise NotPacked(f"%{node.name}: an all_to_all that cuts an atom of slots")
    per = to_size // n
    dims = list(p.dims)
    dims[dim] = ((to_atom, per),) + p.dims[dim][1:]
    dims[src] = ((from_atom, from_size * n),) + p.dims[src][1:]
    if p.slot_dim(len(p.dims) - 1):
        raise NotPacked(f"%{node.name}: an all_to_all of slots whose last dim is a slot dim")
    chunk = list(p.shape)
    chunk[dim] //= n
    mask = int(np.prod(chunk[:-1]))  # the ragged exchange's byte per dense row of a chunk
    out = []
    for j in range(n):
        coords = {a: [] for a in SLOT_ATOMS}
        rows = []
        for i, x in enumerate(xs):
            pick = x.route.coords[to_atom] // per == j
            for a in SLOT_ATOMS:
                c = x.route.coords[a][pick]
                c = c - j * per if a == to_atom else c
                c = c + i * from_size if a == from_atom else c
                coords[a].append(c)
            rows.append(x.rows[pick])
            if sent is not None and i != j:
                moved = x.rows[pick].reshape(-1, x.rows.shape[-1])
                packed_bytes = int(moved[np.any(moved != 0, axis=1)].nbytes)
                sent[group[i]] = sent.get(group[i], 0) + packed_bytes + mask
        coords = {a: np.concatenate(v) for a, v in coords.items()}
        route, order = _route(coords["B"], coords["E"], coords["C"])
        out.append(SlotRows(np.concatenate(rows)[order], tuple(dims), route,
                            all(x.zero_empty for x in xs)))
    return out


def summed(xs, node):
    """The ``all_reduce`` (sum) of the group's packed values: the same routed rows on every
    rank (tensor parallel inside the experts), their rows summed."""
    p = xs[0]
    if node.attr("reduce_op") == "max" or not all(
            isinstance(x, SlotRows) and x.signature() == p.signature() and x.route.same(p.route) for x in xs):
        raise NotPacked(f"%{node.name}: an all_reduce of slots routed differently on its ranks")
    total = xs[0].rows.copy()
    for x in xs[1:]:
        total = total + x.rows
    return [p.with_rows(total, zero_empty=all(x.zero_empty for x in xs))] * len(xs)


def masked(xs, node):
    """``partial_mask`` of packed values: coordinate 0 keeps its rows, the others zeros."""
    if node.attr("reduce_op") == "max":
        return list(xs)
    return [x if c == 0 else x.with_rows(np.zeros_like(x.rows)) for c, x in enumerate(xs)]


def _regrouped(dims, shape):
    """The atoms of ``dims`` regrouped into ``shape`` (parcomp/ir/moe_slots.py), or NotPacked."""
    try:
        return regroup(dims, shape)
    except SlotLayoutError as e:
        raise NotPacked(str(e)) from None
