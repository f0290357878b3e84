"""Export a training checkpoint as full, unsharded ``.safetensors``.

``program.py --save DIR`` writes sharded torch.distributed.checkpoint directories
(``DIR/step-K``). :func:`export_safetensors` turns one into the file transformers'
``from_pretrained`` reads: every trained parameter under its state_dict name, full (the
shards assembled by DCP), in the checkpoint's stored shape (a fused weight viewed per part
is reshaped back, a padded vocab table loses its padding rows), contiguous, with
``{"format": "pt"}`` metadata. Optimizer state and the step counter are left out (they stay
in the DCP checkpoint). :func:`export_pretrained` writes a whole ``from_pretrained``
directory (``model.safetensors`` and, for a transformers model, ``config.json``), all or
nothing, marked as parcomp's output (``parcomp export``; :mod:`parcomp.outdir`).

Tied weights: torch.export keeps one name of a tensor several module attributes share
(GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``). Given the model, the tensor is
written once, under the name the module lists first (``named_parameters``' order, which is
the name transformers' ``save_pretrained`` keeps: the input embedding); ``from_pretrained``
ties the others to it.

Frozen parameters (``requires_grad=False``, loaded by program.py as constant weights:
``param() {trainable=false}``) are not carried, so the DCP checkpoint lacks them; training
never changes them, so they are written with the model's own
value (:func:`untrained_tensors`; the value the run read from ``--checkpoint`` when that was
this model's weights, as ``parcomp run --keep`` writes them), and ``from_pretrained`` finds
nothing missing. Not done: buffers (persistent ones are not written; ``from_pretrained``
keeps the model's), trainable parameters the loss never reaches, and frozen parameters of a
model without a torch module (``.pcir``, ONNX): those exports hold the trained parameters only.
"""
from __future__ import annotations

import copy
import os
import tempfile

from ..errors import ParcompError
from ..outdir import check_target, write_dir_atomic
from ..passes.fused_weights import parts_to_stored
from ..reference.numpy_attn import view_to_stored

WEIGHTS, CONFIG = "model.safetensors", "config.json"


def latest_step(directory: str) -> str:
    """The checkpoint ``directory``/latest names (``DIR/step-K``), or ``directory`` itself when it
    is a step directory, its index and data files checked as program.py's ``--resume`` checks
    them (:func:`checkpoint_damage`). Raises ParcompError naming the damaged file (``latest``
    naming a missing step, ``.metadata`` missing or unreadable, a ``.distcp`` file missing or
    truncated), or ``directory`` when it holds no checkpoint at all."""
    from parcomp_backends.torch.runtime.program_train import checkpoint_damage, latest_checkpoint

    latest = os.path.join(directory, "latest")
    if os.path.isfile(latest):
        where, problem = latest_checkpoint(directory)
        if problem:
            raise ParcompError(problem, where=latest)  # the message names latest
    elif os.path.isdir(directory) and any(f == ".metadata" or f.endswith(".distcp") for f in os.listdir(directory)):
        where = directory
    else:
        raise ParcompError(f"{directory}: no torch.distributed.checkpoint there (no 'latest', no '.metadata'); "
                           f"program.py --save DIR writes one", where=directory)
    damage = checkpoint_damage(where)
    if damage is not None:
        raise ParcompError(damage[1], where=damage[0])  # the message names the file
    return where


def tied_names(module) -> dict:
    """``{parameter name: the name its tensor is written under}`` for torch module ``module``:
    names sharing one tensor map to the first of them in ``named_parameters`` order; ``{}``
    without a module."""
    if module is None or not hasattr(module, "named_parameters"):
        return {}
    first, out = {}, {}
    for name, p in module.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def full_tensors(compiled, checkpoint: str, module=None) -> dict:
    """``{state_dict name: full torch tensor}`` of the trained parameters in the DCP
    ``checkpoint`` (a ``--save`` directory or one of its ``step-K``); ``compiled``: a program of
    the model that saved it (any mesh); ``module``: the model, for tied-weight names.

    Raises ParcompError: no checkpoint, an unreadable one, a trained parameter missing from it
    or of another shape (naming the parameter)."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from parcomp_backends.torch.runtime.program_train import dcp_failure

    where = latest_step(checkpoint)
    graph, names = compiled.logical, trained_names(compiled)
    with tempfile.TemporaryDirectory() as tmp:
        full = os.path.join(tmp, "full.pt")
        try:
            dcp_to_torch_save(where, full)
        except (Exception, CheckpointException) as e:  # BaseException: not an Exception
            raise ParcompError(f"{where}: cannot read the checkpoint: {dcp_failure(e)}", where=where) from None
        saved = torch.load(full, weights_only=True)
    missing = [k for k in names if k not in saved]
    if missing:
        raise ParcompError(f"{where} lacks trained parameters of this program: {', '.join(missing[:8])}",
                           where=missing[0])
    for k in names:
        if tuple(saved[k].shape) != tuple(graph[k].type.shape):
            raise ParcompError(f"parameter {k}: the checkpoint {where} holds shape {tuple(saved[k].shape)}, "
                               f"the program {tuple(graph[k].type.shape)} (a checkpoint of another model?)",
                               where=k)
    alias = tied_names(module)
    trained = {alias.get(k, k): _stored(saved[k], graph[k].attr("stored_shape"), graph[k].attr("stored_order")) for k in names}
    trained = parts_to_stored(trained, graph, derived=False)  # a multi-query weight's parts joined
    return {**trained, **untrained_tensors(module, trained)}


def trained_names(compiled) -> list:
    """The parameters ``compiled``'s training program updates and ``--save`` writes (its
    CARRIED values less the optimizer state), in the unsharded graph's order."""
    state, outputs = set(compiled.program_.train.state), set(compiled.logical.output_names)
    return [n.name for n in compiled.unsharded.params if n.name in outputs and n.name not in state]


def untrained_tensors(module, trained) -> dict:
    """``{name: tensor}`` of torch ``module``'s frozen parameters (``requires_grad=False``) not in
    ``trained`` (the names written from the checkpoint), each tensor once under its
    :func:`tied_names` name, in ``named_parameters`` order. The training program reads them
    from ``--checkpoint`` and never changes them, so their value is the model's own; ``{}``
    without a torch module."""
    if module is None or not hasattr(module, "named_parameters"):
        return {}
    alias, out = tied_names(module), {}
    for name, p in module.named_parameters(remove_duplicate=False):
        key = alias.get(name, name)
        if not p.requires_grad and key not in trained and key not in out:
            out[key] = p.detach().cpu().contiguous()
    return out


def export_safetensors(compiled, checkpoint: str, out: str, module=None) -> list:
    """Write the trained parameters of the DCP ``checkpoint`` as full tensors to the file ``out``
    (.safetensors); see :func:`full_tensors`. Returns the names written.

    Raises ParcompError: ``out`` exists (parcomp never overwrites a file it did not write),
    and :func:`full_tensors`' errors."""
    from safetensors.torch import save_file

    if os.path.lexists(out):
        raise ParcompError(f"{out} exists; parcomp does not overwrite it (export to a new path)", where=out)
    tensors = full_tensors(compiled, checkpoint, module)
    directory = os.path.dirname(os.path.abspath(out))
    fd, tmp_out = tempfile.mkstemp(suffix=".safetensors.partial", dir=directory)
    os.close(fd)
    try:
        save_file(tensors, tmp_out, metadata={"format": "pt"})
        os.chmod(tmp_out, 0o666 & ~_umask())  # as open() makes it (mkstemp, save_file: 0600)
        os.link(tmp_out, out)  # fails if out appeared meanwhile: never replaces a file
    finally:
        os.unlink(tmp_out)
    return list(tensors)


def export_pretrained(compiled, checkpoint: str, out: str, module=None) -> dict:
    """Write directory ``out`` for ``from_pretrained``: ``model.safetensors`` (:func:`full_tensors`)
    and, when ``module`` is a transformers model (it has a ``config``), its ``config.json``.
    Written as parcomp's other output directories are (:func:`parcomp.outdir.write_dir_atomic`,
    command ``export``): all or nothing, with a ``.parcomp-output`` manifest, so exporting to
    the same ``out`` again replaces parcomp's own earlier export and keeps files the user
    added; the files get the modes a plain write gives (0666 less the umask).

    Returns ``{"out": absolute path, "files": names written, "tensors": names, "from_model":
    the names written with the model's own value (:func:`untrained_tensors`), "kept": names
    in ``out`` that are not parcomp's, left alone}``.
    Raises ParcompError naming ``out``: it is a file, a non-empty directory parcomp did not
    write (or another command's output), or cannot be written; and :func:`full_tensors`' errors."""
    from safetensors.torch import save

    out = os.path.abspath(out)
    check_target(out, "-o")  # before reading the checkpoint: fail fast
    tensors = full_tensors(compiled, checkpoint, module)
    config = _config_json(module)
    files = {WEIGHTS: save(tensors, metadata={"format": "pt"})}
    if config is not None:
        files[CONFIG] = config
    kept = write_dir_atomic(out, files, flag="-o", command="export")
    trained = set(tied_names(module).get(k, k) for k in trained_names(compiled))
    return {"out": out, "files": list(files), "tensors": list(tensors),
            "from_model": [k for k in tensors if k not in trained], "kept": kept}


def _config_json(module) -> str | None:
    """transformers' ``config.json`` text of ``module`` (as ``save_pretrained`` writes it:
    the model class in ``architectures``), or None for a model without a config."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "to_json_string"):
        return None
    config = copy.deepcopy(config)
    config.architectures = [type(module).__name__]
    return config.to_json_string(use_diff=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _stored(t, stored, order=None):
    """``t`` in the checkpoint's stored shape: padding rows dropped, a per-part view reshaped
    (a grouped q|k|v's head units put back in their stored ``order``: fused_weights.py)."""
    if stored is None:
        return t.contiguous()
    stored = tuple(stored)
    n = 1
    for s in stored:
        n *= s
    if n < t.numel():  # a padded vocab table: the first rows are the real ones
        t = t[:stored[0]]
    if order:
        import torch
        return torch.from_numpy(view_to_stored(t.detach().cpu().numpy(), stored, order).copy())
    return t.reshape(stored).contiguous()
