"""Output names of a torch.export-ed model, from the pytree of what ``forward`` returns.

- one tensor: ``output``;
- a tuple or list: ``output_0``, ``output_1``, ...;
- a dict, a ``ModelOutput`` (transformers) or another pytree node with string keys:
  the keys (``logits``, ``loss``); a namedtuple or a dataclass: its field names (a
  dataclass pytree does not know yet is registered with ``torch.export.register_dataclass``
  when torch.export asks for it);
- nested: the path, joined with ``.`` (``{"a": (x, {"b": y})}`` gives ``a.0`` and
  ``a.1.b``; ``((x, y), z)`` gives ``output_0.0``, ``output_0.1``, ``output_1``).

Leaves that are ``None`` (a ``ModelOutput``'s unset fields) are no outputs.  Characters
outside ``[A-Za-z0-9_]`` in a key become ``_``.  The order is torch.export's (pytree
leaf order), the one ``torch.utils._pytree.tree_leaves`` gives for the eager output.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import replace


def _children(spec) -> list:
    if hasattr(spec, "num_children") and hasattr(spec, "child"):
        return [spec.child(i) for i in range(spec.num_children)]
    return list(spec.children_specs)


def _keys(spec, count: int) -> list:
    """The name of each child of one pytree node: its key, field name or index."""
    ctx = spec.context
    if isinstance(ctx, type) and hasattr(ctx, "_fields") and len(ctx._fields) == count:
        return [str(f) for f in ctx._fields]  # namedtuple
    if (dataclasses.is_dataclass(spec.type) and isinstance(ctx, (list, tuple)) and len(ctx) == 2
            and isinstance(ctx[0], (list, tuple)) and len(ctx[0]) == count):
        return [str(f) for f in ctx[0]]  # a registered dataclass: (fields set, fields None)
    if (isinstance(ctx, (list, tuple)) and len(ctx) == count
            and all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in ctx)):
        return [str(k) for k in ctx]  # dict, ModelOutput
    return [str(i) for i in range(count)]


def _paths(spec) -> list:
    """Each leaf's path as a tuple of (key, is_index) parts."""
    if spec.is_leaf():
        return [()]
    kids = _children(spec)
    keys, indexed = _keys(spec, len(kids)), spec.type in (tuple, list)
    return [((k, indexed),) + p for k, kid in zip(keys, kids) for p in _paths(kid)]


def register_output_dataclasses(module, example_inputs) -> bool:
    """Register with torch's pytree (``torch.export.register_dataclass``) each dataclass
    type in what ``module(*example_inputs)`` returns that pytree does not know, so that
    torch.export can trace a model returning one.  Returns whether it registered any."""
    import torch
    from torch.utils import _pytree

    with torch.no_grad():
        out = module(*example_inputs)
    found, todo = [], [out]
    while todo:
        x = todo.pop()
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if type(x) not in _pytree.SUPPORTED_NODES and type(x) not in found:
                found.append(type(x))
            todo += [getattr(x, f.name) for f in dataclasses.fields(x)]
        elif isinstance(x, dict):
            todo += list(x.values())
        elif isinstance(x, (list, tuple)):
            todo += list(x)
    for cls in found:
        torch.export.register_dataclass(cls)
    return bool(found)


def output_names(ep, count: int) -> list:
    """The public names of the ``count`` flat outputs of ``ep`` (see the module doc)."""
    spec = getattr(getattr(ep, "call_spec", None), "out_spec", None)
    paths = _paths(spec) if spec is not None else []
    if len(paths) != count:
        return ["output"] if count == 1 else [f"output_{i}" for i in range(count)]
    if paths == [()]:
        return ["output"]
    names = []
    for path in paths:
        parts = [re.sub(r"[^A-Za-z0-9_]", "_", k) or "_" for k, _ in path]
        if path[0][1]:  # a tuple or list at the top: output_<i>
            parts[0] = f"output_{parts[0]}"
        names.append(".".join(parts))
    return names


def name_outputs(nodes: list, outs: list, wanted: list) -> tuple:
    """Rename each output's defining node to its wanted name (sources keep theirs)."""
    ops, ren = {n.name: n.op for n in nodes}, {}
    for v, w in zip(outs, wanted):
        if ops[v] not in ("input", "param"):
            ren.setdefault(v, w)
    if ren:  # nodes that neither are renamed nor use a renamed value stay as they are
        nodes = [replace(n, name=ren.get(n.name, n.name), inputs=tuple(ren.get(i, i) for i in n.inputs))
                 if n.name in ren or any(i in ren for i in n.inputs) else n for n in nodes]
    return nodes, [ren.get(v, v) for v in outs]
