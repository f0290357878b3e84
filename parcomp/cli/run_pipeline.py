"""``parcomp run`` of a pipelined training spec (a ``pp`` mesh axis).

The pipelined ``program.py`` (:mod:`parcomp_backends.torch.emit.pipeline`) runs ``--steps``
training steps (free-running, default 1) under torchrun on ``mesh.size`` gloo ranks, from
the unsharded run's initial state (optimizer state zeros, AdamW step 1); its stages' outputs
of the last step (updated params, optimizer state, gradients, loss) and every step's loss are
compared with the unsharded steps on the numpy interpreter within the dtype's tolerance
(:func:`parcomp.check.pipeline.compare_steps`: every output for one step, the losses for
several).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

from ..errors import ParcompError
from ..spec.train_config import check_steps, train_config
from ..units import plural
from .common import input_feeds


def run_pipeline(args, compiled, feeds: dict, write_work, end_work) -> dict:
    """Launch the pipelined step of ``compiled`` and compare it with the unsharded step.

    Args:
        args: the ``run`` command's arguments (``nproc``, ``keep``, ``steps``, ``json``).
        compiled: a :class:`parcomp.compile.compiler.Compiled` whose ``program_.pipeline`` is set.
        feeds: the model inputs and loss data (``train_check.train_feeds``).
        write_work: ``write_work(dir)`` writes program.py and the run's files there
            (``commands.write_work``: never over a file parcomp did not write);
            ``end_work(dir)`` records ``--keep``'s run files or removes a temporary directory.

    Returns:
        :func:`parcomp.check.differential.compare_all`'s result plus ``world_size`` and ``losses``.

    Raises:
        ParcompError: ``--nproc`` is not the mesh size, a mesh axis the pipeline emitter
            cannot print, or the program failed (its output is printed first).
    """
    from parcomp_backends.torch.emit.pipeline import pipeline_emittable

    from ..check.pipeline import compare_steps
    from ..check.training import initial_state
    from ..check.differential import tolerance_for, verdict
    from ..check.train_check import compute_dtype

    prog, size = compiled.program_, compiled.program.mesh.size
    if args.nproc != size:
        raise ParcompError(f"--nproc {args.nproc} but the spec's mesh {prog.mesh} has "
                           f"{plural(size, 'rank')}", where="--nproc")
    if not pipeline_emittable(prog):
        axis = next(a for a, n in prog.mesh.axes if a not in ("pp", "dp") and n > 1)
        raise ParcompError(f"parcomp run does not launch a pipeline with mesh axis {axis} > 1 yet "
                           f"(sharding inside a stage); 'parcomp check' runs it on the numpy "
                           f"interpreter", where="--spec")
    logical = compiled.logical
    steps = train_config(compiled.spec).steps if args.steps is None else check_steps(args.steps)
    state = initial_state(logical, feeds)
    if "step" in logical:
        state["step"] = np.array(1.0, "float32")
    got = _launch(args, compiled, (write_work, end_work), state, size, steps)
    low = compute_dtype(compiled)  # a mixed-precision step: within its compute dtype's tolerance
    result = compare_steps(None, logical, state, steps, got, tolerance_for(low) if low else None)
    result.update(world_size=size, losses=[float(x) for x in np.atleast_1d(got.get("losses", []))],
                  verdict=verdict(result))
    if not args.json:
        word = "OK" if result["ok"] else f"{result['verdict']}: " + result["why"]
        print(f"torchrun, {plural(size, 'gloo rank')}, {plural(steps, 'pipelined step')} "
              f"({prog.pipeline.schedule}, {plural(prog.pipeline.microbatches, 'microbatch', 'microbatches')}"
              f") vs the unsharded steps: error/tolerance {result['err_over_tol']:.2g} {word}")
    return result


def _launch(args, compiled, work_fns, state, size, steps: int = 1) -> dict:
    """program.py under torchrun; ``{output: array}`` merged over the stages' files."""
    import torch

    from parcomp_backends.torch.launch import run_torchrun

    logical = compiled.logical
    work = args.keep or tempfile.mkdtemp(prefix="parcomp-run-")
    try:
        work_fns[0](work)
        ckpt = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()
                if k in logical and logical[k].op == "param"}
        data = {k: torch.from_numpy(np.asarray(v)) for k, v in input_feeds(compiled, state, logical).items()}
        out = os.path.join(work, "outputs.pt")
        proc = run_torchrun(work, size, ckpt, data, out, extra_args=("--steps", steps), timeout=300)
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
