"""Export a training checkpoint as one full, unsharded ``.safetensors`` (issue 13).

``program.py --save DIR`` writes sharded torch.distributed.checkpoint directories
(``DIR/step-K``). :func:`export_safetensors` turns one into the file transformers'
``from_pretrained`` layout reads (``model.safetensors`` beside a ``config.json``): every
trained parameter under its state_dict name, full (the shards assembled by DCP), in the
checkpoint's stored shape (a fused weight viewed per part is reshaped back, a padded vocab
table loses its padding rows), contiguous, with ``{"format": "pt"}`` metadata. Optimizer
state and the step counter are left out (they stay in the DCP checkpoint).

Not done: tied-weight aliases (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``:
only the graph's name is written) and parameters that are not trained (frozen ones and
buffers keep the values of the checkpoint the run started from).
"""
from __future__ import annotations

import os
import tempfile

from .errors import ParcompError


def latest_step(directory: str) -> str:
    """The checkpoint ``directory``/latest names (``DIR/step-K``), or ``directory`` itself when it
    is a step directory. Raises ParcompError when neither."""
    latest = os.path.join(directory, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            return os.path.join(directory, f.read().strip())
    if os.path.isfile(os.path.join(directory, ".metadata")):
        return directory
    raise ParcompError(f"{directory}: no torch.distributed.checkpoint there (no 'latest', no '.metadata'); "
                       f"program.py --save DIR writes one")


def export_safetensors(compiled, checkpoint: str, out: str) -> list:
    """Write the trained parameters of the DCP ``checkpoint`` (a ``--save`` directory or one
    of its ``step-K``) as full tensors to ``out`` (.safetensors). ``compiled``: the program
    that saved it (any mesh's program of the model). Returns the names written.

    Raises ParcompError: ``out`` exists (parcomp never overwrites a file it did not write),
    no checkpoint, or a trained parameter missing from it."""
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if os.path.exists(out):
        raise ParcompError(f"{out} exists; parcomp does not overwrite it (export to a new path)")
    where = latest_step(checkpoint)
    graph, state = compiled.logical, set(compiled.program_.train.state)
    outputs = set(graph.output_names)  # a trained param is an output named like it
    names = [n.name for n in compiled.unsharded.params if n.name in outputs and n.name not in state]
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "full.pt")
        dcp_to_torch_save(where, full)
        saved = torch.load(full, weights_only=True)
    missing = [k for k in names if k not in saved]
    if missing:
        raise ParcompError(f"{where} lacks trained parameters of this program: {', '.join(missing[:8])}")
    tensors = {k: _stored(saved[k], graph[k].attr("stored_shape")) for k in names}
    directory = os.path.dirname(os.path.abspath(out))
    fd, tmp_out = tempfile.mkstemp(suffix=".safetensors.partial", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, tmp_out, metadata={"format": "pt"})
        os.link(tmp_out, out)  # fails if out appeared meanwhile: never replaces a file
    finally:
        os.unlink(tmp_out)
    return names


def _stored(t, stored):
    """``t`` in the checkpoint's stored shape: padding rows dropped, a per-part view reshaped."""
    if stored is None:
        return t.contiguous()
    stored = tuple(stored)
    n = 1
    for s in stored:
        n *= s
    if n < t.numel():  # a padded vocab table: the first rows are the real ones
        t = t[:stored[0]]
    return t.reshape(stored).contiguous()
