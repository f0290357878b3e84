"""``parcomp run`` of a pipelined training spec (a ``pp`` mesh axis, issue 10).

The pipelined ``program.py`` (:mod:`parcomp_backends.torch.pipeline_emit`) runs one training
step under torchrun on ``mesh.size`` gloo ranks, from the unsharded run's initial state
(optimizer state zeros, AdamW step 1); its stages' outputs (updated params, optimizer state,
gradients, loss) are compared with the unsharded step on the numpy interpreter, output by
output within :func:`parcomp.tolerance.output_bounds`.
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from .errors import ParcompError
from .report import plural


def run_pipeline(args, compiled, feeds: dict, write_work, end_work) -> dict:
    """Launch the pipelined step of ``compiled`` and compare it with the unsharded step.

    Args:
        args: the ``run`` command's arguments (``nproc``, ``keep``, ``steps``, ``json``).
        compiled: a :class:`parcomp.compiler.Compiled` whose ``program_.pipeline`` is set.
        feeds: the model inputs and loss data (``train_check.train_feeds``).
        write_work: ``write_work(dir)`` writes program.py and the run's files there
            (``commands._write_work``: never over a file parcomp did not write);
            ``end_work(dir)`` records ``--keep``'s run files or removes a temporary directory.

    Returns:
        :func:`parcomp.tolerance.compare_all`'s result plus ``world_size`` and ``losses``.

    Raises:
        ParcompError: ``--nproc`` is not the mesh size, ``--steps`` other than 1, a mesh axis
            besides ``pp`` and ``dp`` larger than 1 (sharding inside a stage is not emitted
            yet), or the program failed (its output is printed first).
    """
    from parcomp_backends.torch.pipeline_emit import pipeline_emittable

    from .reference.numpy_ops import run_unsharded
    from .reference.training import initial_state
    from .reference.pipeline import compare_pipeline_step
    from .tolerance import output_bounds
    from .train_check import verdict

    prog, size = compiled.program_, compiled.program.mesh.size
    if args.nproc != size:
        raise ParcompError(f"--nproc {args.nproc} but the spec's mesh {prog.mesh} has "
                           f"{plural(size, 'rank')}", where="--nproc")
    if args.steps not in (None, 1):
        raise ParcompError(f"--steps {args.steps}: the pipelined program runs one training step",
                           where="--steps")
    if not pipeline_emittable(prog):
        axis = next(a for a, n in prog.mesh.axes if a not in ("pp", "dp") and n > 1)
        raise ParcompError(f"parcomp run does not launch a pipeline with mesh axis {axis} > 1 yet "
                           f"(sharding inside a stage); 'parcomp check' runs it on the numpy "
                           f"interpreter", where="--spec")
    logical = compiled.logical
    state = initial_state(logical, feeds)
    if "step" in logical:
        state["step"] = np.array(1.0, "float32")
    got = _launch(args, compiled, (write_work, end_work), state, size)
    want = run_unsharded(logical, state)
    result = compare_pipeline_step(got, want, output_bounds(logical, state))
    result.update(world_size=size, losses=[float(got["loss"])] if "loss" in got else [],
                  verdict=verdict(result))
    if not args.json:
        word = "OK" if result["ok"] else result["verdict"] + ": " + result["why"]
        print(f"torchrun, {plural(size, 'gloo rank')}, one pipelined step ({prog.pipeline.schedule}, "
              f"{plural(prog.pipeline.microbatches, 'microbatch', 'microbatches')}) vs the unsharded "
              f"step: error/tolerance {result['err_over_tol']:.2g} {word}")
    return result


def _launch(args, compiled, work_fns, state, size) -> dict:
    """program.py under torchrun; ``{output: array}`` merged over the stages' files."""
    import torch

    from parcomp_backends.torch.launch import run_torchrun

    logical = compiled.logical
    work = args.keep or tempfile.mkdtemp(prefix="parcomp-run-")
    try:
        work_fns[0](work)
        ckpt = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()
                if k in logical and logical[k].op == "param"}
        data = {n.name: torch.from_numpy(np.asarray(state[n.name])) for n in logical.inputs
                if n.name in state}
        out = os.path.join(work, "outputs.pt")
        proc = run_torchrun(work, size, ckpt, data, out, timeout=300)
        if proc.returncode != 0:
            import sys

            sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
            raise ParcompError(f"the program failed on {plural(size, 'rank')} (exit "
                               f"{proc.returncode}); its output is above")
        got = {}
        for s in range(len(compiled.program_.pipeline.stages)):
            got.update({k: v.numpy() for k, v in torch.load(f"{out}.stage{s}").items()})
        return got
    finally:
        work_fns[1](work)
