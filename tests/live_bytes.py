"""Measured peak of live CPU tensor bytes while torch code runs (torch.cuda's
max_memory_allocated does not exist on a CPU build).

A ``TorchDispatchMode`` sees every tensor an aten op returns; each storage is counted once
(views and in-place results share it) from its first tensor until the last Python tensor
object referring to it dies (``weakref.finalize``; CPython frees at ``del``). Storages made
outside the mode (parameters, inputs) are not counted. Temporaries inside one statement
count while they live, so this is what the process really holds, not the compiler's model.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``with LiveBytes(external) as m: ...``; then ``m.peak`` (bytes). ``external``: tensors
    made before (their storages are never counted)."""

    def __init__(self, external=()):
        super().__init__()
        self.skip = {t.untyped_storage().data_ptr() for t in external}
        self.refs, self.size, self.live, self.peak = {}, {}, 0, 0

    def _drop(self, key):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= self.size.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key == 0 or key in self.skip:
                continue
            if key not in self.refs:
                self.refs[key], self.size[key] = 0, st.nbytes()
                self.live += st.nbytes()
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out


def step_peak(program_py: str, params: dict, inputs: dict) -> int:
    """Peak live bytes of one ``train_step`` of a world-size-1 ``program.py`` (imported as a
    module, no process group) on the given full tensors (copied first)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("parcomp_measured_program", program_py)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    p = {k: v.clone() for k, v in params.items()}
    inp = {k: v.clone() for k, v in inputs.items()}
    with LiveBytes([*p.values(), *inp.values()]) as m:
        out = mod.train_step(p, inp)
        del out
    return m.peak
