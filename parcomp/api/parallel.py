"""``parcomp.parallelize``: a module compiled for this rank, trained from the user's own loop.

Every rank calls ``parallelize(module, example_inputs, spec)``. Rank 0 imports the module
(torch.export), compiles it (the CLI's compile, or the on-disk cache: :mod:`.compiling`) and
broadcasts the two programs to the others, which compile nothing; a compile error is raised on
every rank alike. The result, a :class:`ParallelModule`, holds this rank's shards of the
parameters (cut from rank 0's weights, broadcast, as DDP starts) and runs the forward program;
its backward is the backward program (:class:`_Step`), so ``loss.backward()``, ``torch.optim``
and the user's loss work as on one device.

Gradients: the backward program computes the gradient of ``sum_i <output_i, cotangent_i>`` where
the cotangent is assembled from the ranks' local output gradients in the output's layout (a
replicated output's gradient is taken once, a split one's pieces are put side by side). With
``grad_reduction="mean"`` (the default, as DDP) the gradients are divided by the number of ranks
that split the output's batch (dim 0): a loss that is each rank's mean over its own batch trains
as the mean over the global batch; ``"sum"`` keeps the plain product (a loss divided by the
global count).
"""
from __future__ import annotations

import math
import threading
import warnings

import torch
import torch.distributed as dist
from torch import nn

from ..errors import ParcompError
from ..ir.types import Replicate as PReplicate
from ..ir.types import Shard, parse_layout
from .compiling import Programs, compile_programs, compile_train_program
from .runtime import call, load_program
from .specs import mesh_text, resolve_spec

_MODULES = threading.local()  # a counter for the programs' module names


def _broadcast(obj, group=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def _compile_on_rank0(module, example_inputs, spec, *, gather, input_grads, cache, use_cache, profile):
    """Rank 0 compiles (or reads the cache) and broadcasts; every rank gets the same result or the
    same error."""
    return _on_rank0(lambda: compile_for(module, example_inputs, spec, gather=gather, input_grads=input_grads,
                                         cache=cache, use_cache=use_cache, profile=profile))


def _on_rank0(work):
    """``work()`` on rank 0, its result broadcast; a ParcompError (or a crash) there is raised on
    every rank alike, so no rank waits for one that failed."""
    payload, err = None, None
    if dist.get_rank() == 0:
        try:
            payload = ("ok", work())
        except ParcompError as e:
            payload, err = ("error", type(e), e.message, e.loc, e.where), e
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait for a rank that failed
            payload, err = ("crash", type(e).__name__, str(e), None, None), e
    payload = _broadcast(payload)
    if payload[0] == "ok":
        return payload[1]
    if err is not None:
        raise err
    kind, message, loc, where = payload[1:]
    if isinstance(kind, type) and issubclass(kind, ParcompError):
        raise kind(message, loc, where=where)
    raise ParcompError(f"compiling on rank 0 failed: {kind}: {message}")


def compile_for(module, example_inputs, spec, *, gather=False, input_grads=False, cache=None, use_cache=True,
                profile="cpu") -> Programs:
    """Import ``module`` and compile its two programs (one process; no torch.distributed)."""
    from ..frontends.torch.export import import_torch
    from ..frontends.torch.fold import module_sources

    graph = import_torch(module, tuple(example_inputs))
    spec = resolve_spec(spec, module, graph)
    if "pp" in spec.mesh.names:  # the stage programs and their schedule are program.py's runtime
        raise ParcompError(f"parcomp.parallelize runs one SPMD program; this spec's mesh has a pp axis "
                           f"({mesh_text(spec)}): compile it with `parcomp compile` and run its program.py "
                           f"under torchrun, or leave pp out of the mesh", where="spec")
    progs = compile_programs(graph, spec, gather=gather, input_grads=input_grads, cache=cache,
                             use_cache=use_cache, profile=profile)
    weights, sources = set(module.state_dict()), module_sources(module)
    progs.constants = {n.name: sources[n.name].detach().cpu().clone() for n in graph.params
                       if n.name not in weights and n.name in sources}
    return progs


def compile_train_for(module, example_inputs, spec, *, cache=None, use_cache=True, profile="cpu") -> tuple:
    """Import ``module`` and compile the spec's training step (its ``train`` line):
    ``(program text, key, cached)``; one process, no torch.distributed."""
    from ..frontends.torch.export import import_torch

    graph = import_torch(module, tuple(example_inputs))
    spec = resolve_spec(spec, module, graph)
    if spec.train is None:
        raise ParcompError(f"train_step runs the spec's training step, and this spec has no train line "
                           f"(in {spec.file}): add one such as 'train loss=mse optimizer=adamw(lr=1e-3)', "
                           f"or train from your own loop (forward and loss.backward())", where=spec.file)
    return compile_train_program(graph, spec, cache=cache, use_cache=use_cache, profile=profile)


def parallelize(module: nn.Module, example_inputs, spec, *, gather_outputs: bool = False,
                grad_reduction: str = "mean", input_grads: bool = False, cache_dir=None, use_cache: bool = True,
                sync_module_states: bool = True, timeout: int = 600, dtensor=False) -> "ParallelModule":
    """``module`` compiled under ``spec`` for this rank; call it on every rank.

    Args:
        module: the unsharded model (in the mode it will run: ``.train()`` or ``.eval()``).
        example_inputs: a tuple of tensors, the *global* shapes (every rank's local batch put
            together, as the spec's layouts split them).
        spec: a :class:`parcomp.spec.Spec`, a ``.pcs`` path, its text, or a DTensor plan
            (``(plan dict, DeviceMesh)``, :mod:`parcomp.api.dtensor_plan`). Its ``train`` line,
            if any, is what :meth:`ParallelModule.train_step` runs; ``forward`` and
            ``loss.backward()`` serve the user's own loop either way.
        gather_outputs: return every output whole on every rank (the program gathers it).
        grad_reduction: ``"mean"`` (DDP's) or ``"sum"``: see the module docstring.
        input_grads: also compute gradients of the float inputs (a module inside a larger model).
        cache_dir: where compiled programs are kept (default ``$PARCOMP_CACHE_DIR`` or
            ``~/.cache/parcomp``); ``use_cache=False`` compiles every time.
        sync_module_states: start from rank 0's weights (broadcast), as DDP does.
        timeout: seconds a collective may wait.
        dtensor: ``True``: the parameters (and buffers) are ``DTensor``s on the spec's mesh (a
            ``DeviceMesh`` over the program's own process groups), placed as the spec's layouts
            say (``Shard(d)`` / ``Replicate()`` per mesh axis), so ``torch.optim``,
            ``torch.nn.utils.clip_grad_norm_``, ``state_dict()`` and
            ``torch.distributed.checkpoint`` see whole tensors. A ``DeviceMesh`` instead of
            ``True`` is used as that mesh (its dim names and sizes the spec's, its ranks laid
            out row-major as the spec's mesh). ``False`` (the default): plain tensors holding
            this rank's slice.

    Raises:
        ParcompError: the spec does not fit the model (on every rank alike), torch.distributed is
            not initialised, or its world size is not the mesh's.
    """
    if grad_reduction not in ("mean", "sum"):
        raise ParcompError(f"grad_reduction={grad_reduction!r}: give 'mean' or 'sum'")
    if not dist.is_available() or not dist.is_initialized():
        raise ParcompError("parcomp.parallelize needs torch.distributed initialised (run under torchrun "
                           "and call torch.distributed.init_process_group first)")
    if isinstance(example_inputs, torch.Tensor):  # one input given bare, as torch.export's args would not take it
        example_inputs = (example_inputs,)
    _check_world(spec)
    progs = _compile_on_rank0(module, example_inputs, spec, gather=gather_outputs, input_grads=input_grads,
                              cache=cache_dir, use_cache=use_cache, profile="cpu")
    if sync_module_states:
        progs.constants = _broadcast(progs.constants if dist.get_rank() == 0 else None)
    par = ParallelModule(module, progs, grad_reduction=grad_reduction, sync_module_states=sync_module_states,
                         timeout=timeout, dtensor=dtensor)
    par._source = (module, tuple(example_inputs), spec, cache_dir, use_cache, timeout)
    return par


def _spec_mesh_size(spec) -> int | None:
    """The rank count of ``spec``'s mesh where it is known without importing the module (a Spec,
    a ``.pcs`` path or text, a DTensor plan with its mesh); None otherwise, or where the spec
    does not parse here (rank 0's compile then reports that, on every rank alike)."""
    from math import prod

    from .specs import resolve_spec

    try:
        if isinstance(spec, tuple) and len(spec) == 2 and any(isinstance(s, dict) for s in spec):
            from .dtensor_plan import mesh_axes

            return prod(mesh_axes(spec[1] if isinstance(spec[0], dict) else spec[0]).values())
        if isinstance(spec, dict):  # a plan dict alone: its mesh comes from the module's import
            return None
        return prod(resolve_spec(spec).mesh.sizes)
    except ParcompError:
        return None


def _check_world(spec) -> None:
    """A ParcompError, before any compile, where the spec's mesh does not have the process
    group's size (each rank finds it alike: no rank waits for another)."""
    size, world = _spec_mesh_size(spec), dist.get_world_size()
    if size is not None and size != world:
        raise ParcompError(f"the spec's mesh has {size} ranks but the process group has {world}; start {size} "
                           f"processes (torchrun --nproc-per-node {size}) or change the mesh", where="spec")


def _tree(root: nn.Module, name: str):
    """The submodule of ``root`` that holds attribute ``name`` (dotted), made if missing."""
    *path, leaf = name.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod, leaf


class ParallelModule(nn.Module):
    """This rank's part of a parallelized module (made by :func:`parallelize`).

    Its parameters are named as the original's (``c_fc.weight``) and hold this rank's local
    slice, laid out as the spec says (``layouts()``); ``full_state_dict()`` gathers them whole.
    ``forward(*inputs)`` takes this rank's local inputs and returns its local outputs (or whole
    ones with ``gather_outputs=True``), in the original's structure: one tensor, a tuple, or a
    dict by output name.
    """

    def __init__(self, module: nn.Module, progs: Programs, *, grad_reduction="mean", sync_module_states=True,
                 timeout=600, dtensor=False):
        super().__init__()
        device = next((p.device for p in module.parameters()), torch.device("cpu"))
        self._meta, self._key, self._cached = progs.meta, progs.key, progs.cached
        _MODULES.n = getattr(_MODULES, "n", 0) + 1
        groups = {"timeout": None}
        self._fwd = load_program(progs.forward, f"parcomp_forward_{_MODULES.n}", device, groups, timeout)
        for axis in self._fwd.MESH:  # every axis's group now, on every rank in the same order
            _group(self._fwd, axis)
        self._bwd = None if progs.backward is None else load_program(
            progs.backward, f"parcomp_backward_{_MODULES.n}", device, groups, timeout)
        full = {**_full_tensors(module), **progs.constants}
        self._shapes = {k: tuple(v.shape) for k, v in full.items()}  # the module's own (a fused weight's view differs)
        if sync_module_states:
            _sync_from_rank0(full, device)
        local = call(self._fwd, "load_params", full)
        self._param_names = [p["name"] for p in self._meta["params"]]
        self._trainable = {p["name"]: p["trainable"] and _requires_grad(module, p.get("part_of") or p["name"])
                           for p in self._meta["params"]}
        self.device_mesh = None if dtensor is False else _device_mesh(self._fwd, dtensor)
        for p in self._meta["params"]:
            name = p["name"]
            value = local[name]
            if self.device_mesh is not None:
                value = _as_dtensor(value, self.device_mesh, p)
            owner, leaf = _tree(self, name)
            if self._trainable[name]:
                owner.register_parameter(leaf, nn.Parameter(value, requires_grad=True))
            else:
                owner.register_buffer(leaf, value, persistent=name in module.state_dict())
        self._input_names = [i["name"] for i in self._meta["inputs"]]
        self._outputs = self._meta["outputs"]
        self._device, self._source, self._train, self._train_held, self._steps_run = device, None, None, {}, 0
        self._compiled_training = module.training
        self.training = module.training
        self.grad_reduction = grad_reduction
        self._scales = [_batch_scale(o["layout"], self._meta["mesh"]) if grad_reduction == "mean" else 1.0
                        for o in self._outputs]

    # ---- what the user reads ----
    @property
    def fingerprint(self) -> str:
        """The cache key of the compiled programs."""
        return self._key

    @property
    def from_cache(self) -> bool:
        """Whether the programs were read from the on-disk cache (no compile ran)."""
        return self._cached

    @property
    def mesh(self) -> dict:
        """``{axis: size}`` of the spec's mesh."""
        return dict(zip(self._meta["mesh"]["names"], self._meta["mesh"]["sizes"]))

    @property
    def coords(self) -> dict:
        """This rank's ``{axis: coordinate}`` on the mesh (row-major: the last axis varies fastest);
        a data loader reads the share of each batch that ``coords.get("dp", 0)`` names."""
        return dict(zip(self._meta["mesh"]["names"], self._fwd.COORD))

    def layouts(self) -> dict:
        """``{param name: layout}``, e.g. ``{"c_fc.weight": "[S(1)]"}``."""
        return {p["name"]: p["layout"] for p in self._meta["params"]}

    def output_layouts(self) -> dict:
        """``{output name: layout}`` of the outputs :meth:`forward` returns."""
        return {o["name"]: o["layout"] for o in self._outputs}

    def _local(self, name):
        owner, leaf = _tree(self, name)
        return getattr(owner, leaf)

    def train(self, mode: bool = True):
        """As ``nn.Module.train``; the compiled program keeps the mode the module was compiled in
        (dropout on or off), so switching is warned about: parallelize a copy in the other mode."""
        if bool(mode) != self._compiled_training:
            warnings.warn(f"parcomp.parallelize compiled the module in {'train' if self._compiled_training else 'eval'}"
                          f" mode; .{'train' if mode else 'eval'}() does not recompile it (dropout and other "
                          f"mode-dependent ops stay as compiled): parallelize a copy in "
                          f"{'train' if mode else 'eval'} mode for that", stacklevel=2)
        return super().train(mode)

    def _bind(self, inputs, named) -> tuple:
        """``inputs`` then ``named`` as the compiled inputs' tuple, in order; a ParcompError
        naming the inputs where one is missing, unknown or given twice."""
        names = self._input_names
        compiled = f"the module was compiled with {len(names)} inputs ({', '.join(names)})"
        if len(inputs) > len(names):
            raise ParcompError(f"{compiled}; got {len(inputs)} in order")
        if not named:
            if len(inputs) != len(names):
                raise ParcompError(f"{compiled}; got {len(inputs)}")
            return inputs
        unknown = [k for k in named if k not in names]
        twice = [k for k in named if k in names[:len(inputs)]]
        missing = [n for n in names[len(inputs):] if n not in named]
        if unknown or twice or missing:
            raise ParcompError(compiled + "".join(
                f"; {what} {', '.join(which)}" for what, which in
                (("no input named", unknown), ("given in order and by name", twice), ("missing", missing)) if which))
        return tuple(inputs) + tuple(named[n] for n in names[len(inputs):])

    def _check_inputs(self, inputs, what):
        """Each input's local shape and dtype are the compiled ones, else a ParcompError naming it."""
        for meta, x in zip(self._meta["inputs"], inputs):
            if not isinstance(x, torch.Tensor):
                raise ParcompError(f"{what}: input {meta['name']} must be a tensor; got {type(x).__name__}")
            want = _local_shape(meta, self)
            if tuple(x.shape) != want or str(x.dtype).removeprefix("torch.") != meta["dtype"]:
                raise ParcompError(
                    f"{what}: input {meta['name']} was compiled as this rank's {meta['dtype']} {list(want)} "
                    f"(global {meta['shape']}, laid out {meta['layout']}); got "
                    f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)}: parallelize again with example "
                    f"inputs of the new shape")

    def forward(self, *inputs, **named):
        """This rank's local outputs of this rank's local ``inputs``: in the compiled forward's
        order, or by its parameter names (``par(input_ids=ids)``), or the first ones in order and
        the rest by name, as a call of the original module would take them."""
        inputs = self._bind(inputs, named)
        self._check_inputs(inputs, "forward")
        if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs) \
                and not any(f"{n}.grad" in self._meta["grads"] for n in self._input_names):
            raise ParcompError("an input requires grad, but the module was compiled without input "
                               "gradients: parallelize(..., input_grads=True)")
        params = [_plain(self._local(n)) for n in self._param_names]  # DTensor.to_local: grads come back as DTensors
        outs = _Step.apply(self, len(params), *params, *inputs)
        names = [o["name"] for o in self._outputs]
        if names == ["output"]:
            return outs[0]
        if names == [f"output_{i}" for i in range(len(names))]:
            return tuple(outs)
        return dict(zip(names, outs))

    # ---- the spec's own training step ----
    def train_step(self, *inputs, **named) -> torch.Tensor:
        """One step of the spec's ``train`` line, as ``parcomp compile``'s program.py runs it:
        forward, the loss the line names, backward, gradient collectives, clipping and the
        optimizer update (with its learning-rate schedule, precision, recompute, accumulation),
        all in one compiled program; returns the step's loss (replicated, the global batch's).

        ``inputs`` are this rank's local slices of the model's inputs, in order; the loss's
        other inputs by name (``target=`` for ``loss=mse`` / ``cross_entropy``), local slices
        too. The parameters are updated in place (``torch.optim`` is not used); the optimizer's
        state is kept here (``train_state()``). The first call compiles the step (rank 0, cached
        on disk as the other programs) on every rank at once, as ``parallelize`` did.

        Raises:
            ParcompError: the spec has no ``train`` line (naming the spec), an input is missing
                or unknown, or the step's program lays out a parameter otherwise than the
                forward program (pin it in the spec).
        """
        prog = self._train_program()
        feeds = dict(zip(self._input_names, inputs))
        if len(inputs) > len(self._input_names):
            raise ParcompError(f"train_step takes the model's {len(self._input_names)} inputs "
                               f"({', '.join(self._input_names)}) in order; got {len(inputs)}")
        self._check_inputs(inputs, "train_step")
        feeds.update(named)
        wanted = [n for n in prog.INPUTS if n != prog.STEP_INPUT]
        missing, unknown = [n for n in wanted if n not in feeds], [n for n in feeds if n not in wanted]
        if missing or unknown:
            raise ParcompError(f"train_step: the spec's training step reads inputs {', '.join(wanted)}"
                               + (f"; missing {', '.join(missing)}" if missing else "")
                               + (f"; no input named {', '.join(unknown)}" if unknown else "")
                               + " (give the model's inputs in order and the others by name, e.g. target=...)")
        self._steps_run += 1
        if prog.STEP_INPUT is not None:
            feeds[prog.STEP_INPUT] = torch.tensor(float(self._steps_run), dtype=torch.float32)
        params = {n: _plain(self._local(n)).detach() for n in self._param_names if n in prog.PARAMS}
        params.update(self._train_held)
        with torch.no_grad():
            out = call(prog, "train_step", params, feeds)
            for name in prog.CARRIED:
                held, new = params[name], out[name]
                if new is not held and new.data_ptr() != held.data_ptr():
                    held.copy_(new)
        return out["loss"]

    def train_state(self) -> dict:
        """``{name: this rank's slice}`` of what the training step keeps besides the parameters
        (the optimizer's moments, ...); empty before the first ``train_step``."""
        return dict(self._train_held)

    def _train_program(self):
        if self._train is not None:
            return self._train
        module, example, spec, cache, use_cache, timeout = self._source
        text, _key, _cached = _on_rank0(lambda: compile_train_for(module, example, spec, cache=cache,
                                                                  use_cache=use_cache))
        prog = load_program(text, f"parcomp_train_{id(self)}", self._device, self._fwd.LINE_GROUPS, timeout)
        mine = self.layouts()
        for name in self._param_names:
            theirs = prog.OUTPUT_LAYOUTS.get(name)
            if name in prog.CARRIED and theirs is not None and theirs != mine[name]:
                raise ParcompError(f"train_step: the training step lays parameter {name} out {theirs}, the "
                                   f"forward program {mine[name]}: pin it in the spec (e.g. '{name} {mine[name]}')",
                                   where=name)
        local = call(prog, "load_params", self.full_state_dict())
        self._train_held = {k: v for k, v in local.items() if k not in self._param_names}
        self._train = prog
        return prog

    # ---- the loss of vocab-split logits ----
    def cross_entropy(self, logits, labels, *, output: str | None = None, ignore_index: int = -100,
                      reduction: str = "mean") -> torch.Tensor:
        """``torch.nn.functional.cross_entropy`` of this rank's ``logits`` (an output of
        :meth:`forward`, the class dim last) against ``labels`` (its shape less that dim).

        When the output is split over its last dim (a DTensor plan's ``loss_parallel`` with
        ``Shard(-1)`` logits, or a spec's ``output logits [S(2)]``), the loss is computed
        without gathering the logits (:mod:`parcomp.api.loss`: three all_reduces of one value
        per token); otherwise it is torch's own. ``reduction="mean"`` is the mean over this
        rank's counted tokens (labels not ``ignore_index``): with the default
        ``grad_reduction="mean"`` it trains as the global mean when every dp rank counts as many
        tokens, as with DDP.
        """
        out = self._output_named(output)
        rank, names = len(out["shape"]), self._meta["mesh"]["names"]
        axes = [a for a, pl in zip(names, parse_layout(out["layout"])) if pl == Shard(rank - 1)]
        if not axes:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                     ignore_index=ignore_index, reduction=reduction)
        if len(axes) > 1:
            raise ParcompError(f"cross_entropy: output {out['name']} is split over its last dim by "
                               f"{' and '.join(axes)}; vocab-parallel cross entropy takes one axis",
                               where=out["name"])
        from .loss import vocab_parallel_cross_entropy

        axis = axes[0]
        start = self.coords[axis] * logits.shape[-1]
        return vocab_parallel_cross_entropy(logits, labels, _group(self._fwd, axis), start,
                                            ignore_index=ignore_index, reduction=reduction)

    def _output_named(self, name):
        floats = [o for o in self._outputs if o["dtype"].startswith("float")]
        if name is None:
            pick = [o for o in floats if o["name"] == "logits"] or floats
            if len(pick) != 1:
                raise ParcompError(f"cross_entropy: say which output holds the logits: output= one of "
                                   f"{', '.join(o['name'] for o in floats)}")
            return pick[0]
        for o in self._outputs:
            if o["name"] == name:
                return o
        raise ParcompError(f"cross_entropy: no output named {name!r} (outputs: "
                           f"{', '.join(o['name'] for o in self._outputs)})", where=name)

    # ---- collectives the user's loop needs ----
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the *unsharded* parameters: every element of
        every parameter counted once however it is split; returns the total norm."""
        if norm_type != 2.0:
            raise ParcompError("clip_grad_norm_: only norm_type=2 is implemented")
        total = self.grad_norm()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in self.parameters():
            if p.grad is not None:
                g = _plain(p.grad)
                g.mul_(coef.to(g.device, g.dtype))
        return total

    def grad_norm(self) -> torch.Tensor:
        """The 2-norm of the unsharded gradients (one all_reduce per set of split axes)."""
        by_axes = {}
        for p in self._meta["params"]:
            if not self._trainable[p["name"]]:
                continue
            g = self._local(p["name"]).grad
            if g is None:
                continue
            g = _plain(g)
            axes = tuple(a for a, pl in zip(self._meta["mesh"]["names"], parse_layout(p["layout"]))
                         if isinstance(pl, Shard))
            sq = g.detach().float().pow(2).sum()
            by_axes[axes] = by_axes.get(axes, 0) + sq
        total = torch.zeros((), dtype=torch.float32)
        for axes, sq in sorted(by_axes.items()):
            sq = torch.as_tensor(sq, dtype=torch.float32)
            for a in axes:
                sq = _all_reduce(sq, self._fwd, a)
            total = total + sq
        return total.sqrt()

    def full_state_dict(self) -> dict:
        """``{name: whole tensor}`` of every parameter and buffer, gathered on every rank, in the
        original module's shapes (loadable by its ``load_state_dict``; a tied weight under the
        one name the program keeps)."""
        return self._gathered(lambda t: t.detach())

    def full_grads(self) -> dict:
        """``{name: whole gradient}`` of every parameter that has one, gathered on every rank."""
        return self._gathered(lambda t: None if t.grad is None else t.grad.detach())

    def _gathered(self, pick) -> dict:
        out = {}
        for p in self._meta["params"]:
            t = pick(self._local(p["name"]))
            if t is None:
                continue
            t = _plain(t)
            for a, pl in reversed(list(zip(self._meta["mesh"]["names"], parse_layout(p["layout"])))):
                if isinstance(pl, Shard):
                    t = _all_gather(t, pl.dim, self._fwd, a)
            if p.get("stored_order"):  # a grouped q|k|v: its heads back in the stored order
                t = _stored_order(t, self._shapes[p["name"]], p["stored_order"])
            if p.get("part_of"):  # a multi-query weight's part: joined below, in row order
                out[p["name"]] = t
                continue
            shape = self._shapes.get(p["name"], t.shape)
            if t.dim() and len(shape) and t.shape[0] > shape[0] and t.numel() > math.prod(shape):
                t = t[:shape[0]]  # a padded vocab (vocab_pad.py): the first rows are the real ones
            out[p["name"]] = t.reshape(shape)
        for stored in dict.fromkeys(p["part_of"] for p in self._meta["params"] if p.get("part_of")):
            rows = [out.pop(p["name"]) for p in self._meta["params"] if p.get("part_of") == stored and p["name"] in out]
            if rows:  # the query rows (named as the weight) come first, then the kv rows
                out[stored] = torch.cat(rows)
        return out


def _plain(t):
    """This rank's local tensor of ``t`` (a DTensor's ``to_local()``, differentiable)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _device_mesh(prog, given):
    """The DeviceMesh the parameters live on: the program's own (``given is True``: one
    DeviceMesh over its process groups, no new communicator), or ``given`` checked against the
    spec's mesh (dim names, sizes, and this rank's coordinate)."""
    from torch.distributed.device_mesh import DeviceMesh

    names, sizes = list(prog.MESH), list(prog.MESH.values())
    if given is True:
        return call(prog, "device_mesh", tuple(names))
    if not isinstance(given, DeviceMesh):
        raise ParcompError(f"dtensor= takes True or a DeviceMesh; got {type(given).__name__}")
    got_names = list(given.mesh_dim_names or ())
    if got_names != names or list(given.mesh.shape) != sizes:
        raise ParcompError(f"dtensor=: the DeviceMesh has dims {got_names or '(unnamed)'} of sizes "
                           f"{list(given.mesh.shape)}, the spec's mesh is {prog.MESH_TEXT}: give a DeviceMesh "
                           f"with mesh_dim_names={tuple(names)} and shape {tuple(sizes)}, or dtensor=True")
    coord = given.get_coordinate()
    if coord is None or tuple(coord) != tuple(prog.COORD):
        raise ParcompError(f"dtensor=: rank {prog.RANK} is at {coord} on the DeviceMesh but at "
                           f"{tuple(prog.COORD)} on the spec's mesh (row-major, the last axis varying fastest): "
                           f"lay the DeviceMesh's ranks out as torch.arange(world).reshape{tuple(sizes)}, as "
                           f"init_device_mesh does")
    return given


def _as_dtensor(local, mesh, param):
    """``local`` (this rank's slice of ``param``) as a DTensor of the parameter's global shape,
    placed per mesh axis as its layout says."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor import Shard as TShard

    placements = []
    for axis, pl in zip(mesh.mesh_dim_names, parse_layout(param["layout"])):
        if isinstance(pl, Shard):
            placements.append(TShard(pl.dim))
        elif isinstance(pl, PReplicate):
            placements.append(Replicate())
        else:
            raise ParcompError(f"parameter {param['name']} is laid out {param['layout']}: a DTensor holds a "
                               f"split or a replicated parameter, not {pl} over {axis}", where=param["name"])
    shape = torch.Size(param["shape"])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape,
                              stride=torch.empty(shape, device="meta").stride())


def _stored_order(t, stored, order):
    """A grouped q|k|v fused weight's view ``t`` with its head units in the stored order
    (the inverse of the loader's reorder: parcomp/passes/fused_weights.py)."""
    stored = tuple(stored)
    a = next(d for d in range(len(stored)) if d >= t.dim() or t.shape[d] != stored[d])
    back = sorted(range(len(order)), key=lambda i: order[i])
    units = t.reshape(stored[:a] + (len(order), -1) + stored[a + 1:])
    return units.index_select(a, torch.tensor(back, device=t.device))


def _group(mod, axis):
    if axis not in mod.GROUPS:
        mod.GROUPS[axis] = mod.line_group(mod.GROUP_RANKS[axis])
    return mod.GROUPS[axis]


def _all_reduce(x, mod, axis):
    _group(mod, axis)
    return mod.all_reduce(x, axis)


def _all_gather(x, dim, mod, axis):
    _group(mod, axis)
    return mod.all_gather(x, dim, axis)


def _requires_grad(module, name):
    p = dict(module.named_parameters()).get(name)
    return p is None or p.requires_grad


def _full_tensors(module) -> dict:
    """The module's whole tensors that every rank holds alike: its ``state_dict`` and buffers.
    The constants an import folded are left out: only rank 0 imports, and the program's own
    come with the compiled programs (``Programs.constants``)."""
    return {k: v.detach() for k, v in {**dict(module.named_buffers()), **module.state_dict()}.items()}


def _sync_from_rank0(full: dict, device) -> None:
    """Replace each tensor of ``full`` (whole tensors, by name) with rank 0's, in place. The
    names, shapes and dtypes are checked to agree first, so a rank whose module differs gets a
    ParcompError (on every rank alike) instead of a mismatched broadcast."""
    mine = {k: (tuple(v.shape), str(v.dtype)) for k, v in full.items()}
    theirs = _broadcast(mine if dist.get_rank() == 0 else None)
    diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    bad = torch.tensor([dist.get_rank() + 1 if diff else 0], device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    if bad.item():
        rank = bad.item() - 1
        where = f"{diff[0]}: rank 0 holds {theirs.get(diff[0])}, rank {dist.get_rank()} {mine.get(diff[0])}" \
            if diff else f"rank {rank}'s tensors differ from rank 0's"
        raise ParcompError(f"sync_module_states: the module's tensors are not the same on every rank "
                           f"({where}); build the same module on every rank, or pass "
                           f"sync_module_states=False", where="module")
    for name in sorted(full):
        t = full[name].detach().clone()
        dist.broadcast(t, src=0)
        full[name] = t


def _batch_scale(layout: str, mesh: dict) -> float:
    """1 / the ranks that split dim 0 of an output laid out ``layout``."""
    n = math.prod(s for s, p in zip(mesh["sizes"], parse_layout(layout)) if p == Shard(0))
    return 1.0 / n


class _Step(torch.autograd.Function):
    """The forward program forward, the backward program backward."""

    @staticmethod
    def forward(ctx, owner, nparams, *tensors):
        params = dict(zip(owner._param_names, tensors[:nparams]))
        inputs = dict(zip(owner._input_names, tensors[nparams:]))
        with torch.no_grad():
            out = call(owner._fwd, "forward", params, inputs)
        ctx.owner, ctx.nparams = owner, nparams
        ctx.save_for_backward(*tensors)
        results = tuple(out[o["name"]] for o in owner._outputs)
        ctx.mark_non_differentiable(*[r for r in results if not r.is_floating_point()])
        return results

    @staticmethod
    def backward(ctx, *grads):
        owner, nparams = ctx.owner, ctx.nparams
        tensors = ctx.saved_tensors
        none = (None, None) + (None,) * len(tensors)
        if owner._bwd is None:
            return none
        params = dict(zip(owner._param_names, tensors[:nparams]))
        inputs = dict(zip(owner._input_names, tensors[nparams:]))
        wanted = set(owner._meta["backward_inputs"])
        for o, g, scale, out in zip(owner._outputs, grads, owner._scales, owner._outputs):
            cot = o["cotangent"]
            if cot is None or cot not in wanted:
                continue
            if g is None:
                g = torch.zeros(_local_shape(o, owner), dtype=getattr(torch, o["dtype"]))
            inputs[cot] = g * scale if scale != 1.0 else g
        with torch.no_grad():
            res = call(owner._bwd, "train_step", params, {k: v for k, v in inputs.items() if k in wanted})
        pgrads = [res.get(f"{n}.grad") if owner._trainable[n] else None for n in owner._param_names]
        igrads = [res.get(f"{n}.grad") for n in owner._input_names]
        return (None, None, *pgrads, *igrads)


def _local_shape(out: dict, owner) -> tuple:
    shape = list(out["shape"])
    for size, p in zip(owner._meta["mesh"]["sizes"], parse_layout(out["layout"])):
        if isinstance(p, Shard):
            shape[p.dim] //= size
    return tuple(shape)
