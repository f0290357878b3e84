"""numpy semantics of every compute op: the ground truth of the reference interpreter.

One entry per op of :data:`parcomp.ir.ops.OPS` that computes (sources and layout
changes are handled by the interpreter). Each takes the list of operand arrays
and the node (for attributes and the result type) and returns an array.
Modelled on the ONNX reference evaluator's one-function-per-op tables.
"""
from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _gelu(x, node):
    if node.attr("approximate", "none") == "tanh":
        c = math.sqrt(2.0 / math.pi)
        return 0.5 * x * (1.0 + np.tanh(c * (x + 0.044715 * x ** 3)))
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))).astype(x.dtype)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


NUMPY_OPS = {
    "relu": lambda a, n: np.maximum(a[0], 0).astype(a[0].dtype),
    "gelu": lambda a, n: _gelu(a[0], n).astype(a[0].dtype),
    "tanh": lambda a, n: np.tanh(a[0]),
    "exp": lambda a, n: np.exp(a[0]),
    "sigmoid": lambda a, n: _sigmoid(a[0]).astype(a[0].dtype),
    "silu": lambda a, n: (a[0] * _sigmoid(a[0])).astype(a[0].dtype),
    "pow": lambda a, n: np.power(a[0], a[0].dtype.type(n.attr("exponent"))),
    "add_scalar": lambda a, n: a[0] + a[0].dtype.type(n.attr("value")),
    "neg": lambda a, n: -a[0],
    "scale": lambda a, n: a[0] * a[0].dtype.type(n.attr("value")),
    "add": lambda a, n: a[0] + a[1],
    "sub": lambda a, n: a[0] - a[1],
    "mul": lambda a, n: a[0] * a[1],
    "div": lambda a, n: a[0] / a[1],
    "matmul": lambda a, n: np.matmul(a[0], a[1]),
    "permute": lambda a, n: np.ascontiguousarray(np.transpose(a[0], n.attr("perm"))),
    "reshape": lambda a, n: a[0].reshape(n.type.shape),
}


def run_unsharded(graph, feeds: dict) -> dict:
    """Evaluate a global graph on one process: ``feeds`` maps input/param names to arrays.

    Returns ``{public output name: array}``. Raises KeyError naming a missing feed.
    """
    env = {}
    for n in graph.nodes:
        if n.op in ("input", "param"):
            if n.name not in feeds:
                raise KeyError(f"no value given for {n.op} {n.name!r}")
            env[n.name] = np.asarray(feeds[n.name])
        else:
            env[n.name] = NUMPY_OPS[n.op]([env[i] for i in n.inputs], n)
    return {name: env[v] for name, v in graph.named_outputs()}
