"""Rules of the norms + embedding part: sharding strategies and VJPs of
``layer_norm``, ``rms_norm`` (+ ``*_grad``), ``dropout``, ``embedding`` (+ grad).

Merged into the shared tables (:data:`parcomp.rules.sharding.STRATEGY_RULES`,
:data:`parcomp.rules.vjp.VJP_RULES`).

Sharding, one mesh axis:

- a norm (over the last dim) splits any other dim of x (batch, or seq: Megatron sequence
  parallel); weight and bias stay replicated. Its weight gradient ``sum(dy * xhat)`` over
  the split dim is then a partial sum that the planner reduces (an all_reduce over tp).
- dropout is linear in x with a mask fixed by the global element index: R, S(d) and P.
- embedding(ids, table): ids split on any dim (rows follow); table split on dim 1 (hidden)
  gives the output split on its last dim; table split on dim 0 (vocab-parallel) gives a
  partial sum (ids outside the rank's rows give zero rows: one all_reduce makes it whole);
  a partial table gives a partial output (a gather of rows is linear in the table).
- embedding_grad(dy, ids) -> table: dy split on hidden gives S(1); a replicated dy can give
  S(0) (each rank scatters only its own rows); dy and ids split on a token dim give P.
"""
from __future__ import annotations

from ..ir.types import P, R, Shard


# ---- sharding: (node, in types) -> [(in placements, out placement)] -------------------

def _norm(node, ts):
    k = len(ts)
    return [((R,) * k, R)] + [((Shard(d),) + (R,) * (k - 1), Shard(d)) for d in range(ts[0].rank - 1)]


def _norm_grad(node, ts):
    k = len(ts)
    return ([((R,) * k, R), ((P,) + (R,) * (k - 1), P)]
            + [((Shard(d), Shard(d)) + (R,) * (k - 2), Shard(d)) for d in range(ts[1].rank - 1)])


def _dropout(node, ts):
    step = (R,) * (len(ts) - 1)  # the step counter: a replicated scalar
    return [((R,) + step, R), ((P,) + step, P)] + [((Shard(d),) + step, Shard(d)) for d in range(ts[0].rank)]


def _embedding(node, ts):
    ids = ts[0]
    return ([((R, R), R), ((R, Shard(1)), Shard(ids.rank)), ((R, Shard(0)), P), ((R, P), P)]
            + [((Shard(d), R), Shard(d)) for d in range(ids.rank)])


def _embedding_grad(node, ts):
    ids = ts[1]
    return ([((R, R), R), ((Shard(ids.rank), R), Shard(1)), ((R, R), Shard(0)), ((P, R), P)]
            + [((Shard(d), Shard(d)), P) for d in range(ids.rank)])


NORM_STRATEGY_RULES = {"layer_norm": _norm, "rms_norm": _norm, "layer_norm_grad": _norm_grad,
                       "rms_norm_grad": _norm_grad, "dropout": _dropout, "embedding": _embedding,
                       "embedding_grad": _embedding_grad}


# ---- VJPs: (builder, node, grad) -> one gradient (or None) per operand ---------------

def _norm_vjp(b, n, g):
    x, eps = n.inputs[0], n.attr("eps")
    lead = tuple(range(b.type(x).rank - 1))
    out = [b.op(n.op + "_grad", [g, *n.inputs[:2]], eps=eps)]
    if len(n.inputs) > 1:  # weight: sum over the tokens of dy * xhat
        xhat = b.op(n.op, [x], eps=eps)
        out.append(b.op("sum", [b.op("mul", [g, xhat])], dims=lead, bucket="norm"))
    if len(n.inputs) > 2:  # bias
        out.append(b.op("sum", [g], dims=lead, bucket="norm"))  # bucket: parcomp/passes/lowering/bucket.py
    return tuple(out)


def _dropout_vjp(b, n, g):  # the same mask (same seed, step and global indices) on the gradient
    return (b.op("dropout", [g, *n.inputs[1:]], p=n.attr("p"), seed=n.attr("seed")),) + (None,) * (len(n.inputs) - 1)


def _embedding_vjp(b, n, g):
    ids, table = n.inputs
    pad = {} if n.attr("padding_idx") is None else {"padding_idx": n.attr("padding_idx")}
    return None, b.op("embedding_grad", [g, ids], type=b.type(table), **pad)


NORM_VJP_RULES = {"layer_norm": _norm_vjp, "rms_norm": _norm_vjp, "dropout": _dropout_vjp,
                  "embedding": _embedding_vjp}
