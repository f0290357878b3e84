"""Run an emitted ``program.py`` with torchrun on this machine, and read back what it wrote.

:func:`run_torchrun` starts ``python -m torch.distributed.run`` on a free
localhost port with ``OMP_NUM_THREADS=1`` and a hard timeout (the whole process
group is killed).  :func:`write_checkpoint` / :func:`write_inputs` write the
files the program reads; :func:`assemble_outputs` rebuilds full output arrays
from either output form the program writes.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys

import numpy as np

from parcomp.ir.types import Replicate, layout_str
from parcomp.reference.interpreter import assemble

from .emit import emit_program


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's --master-port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torch():
    import torch

    return torch


def write_checkpoint(module_or_state_dict, path) -> str:
    """Write an ``nn.Module``'s state_dict (or a dict name -> tensor/array) to ``path``.

    ``.safetensors`` paths use safetensors, anything else ``torch.save``. Returns ``path``.
    """
    torch = _torch()
    sd = module_or_state_dict
    if hasattr(sd, "state_dict"):
        sd = sd.state_dict()
    sd = {k: torch.as_tensor(v).detach().cpu().contiguous().clone() for k, v in sd.items()}
    if str(path).endswith(".safetensors"):
        from safetensors.torch import save_file

        save_file(sd, str(path))
    else:
        torch.save(sd, str(path))
    return str(path)


def write_inputs(inputs, path) -> str:
    """Write inputs (dict name -> tensor/array, or one tensor) for ``--input``. Returns ``path``."""
    torch = _torch()
    if isinstance(inputs, dict):
        return write_checkpoint(inputs, path)
    torch.save(torch.as_tensor(inputs).detach().cpu().contiguous(), str(path))
    return str(path)


def write_program(compiled, directory, profile="cpu", model: str | None = None) -> str:
    """Emit ``compiled`` into ``directory/program.py``; returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), "program.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(emit_program(compiled, profile, model))
    return path


def _file_arg(value, directory, name, writer):
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value is None else os.path.abspath(value)
    return writer(value, os.path.join(str(directory), name))


def run_torchrun(program_dir, nproc: int, checkpoint=None, inputs=None, output=None, extra_args=(),
                 timeout: float = 120, nnodes: int = 1, program: str = "program.py",
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``program_dir/program.py`` on ``nproc`` local processes with torchrun.

    Args:
        checkpoint: a file path, or a module/state_dict (written to program_dir/model.pt).
        inputs: a file path, or a dict/tensor (written to program_dir/inputs.pt).
        output: where the program writes its outputs (``--output``), or None.
        extra_args: more program arguments, e.g. ``("--device", "cpu")`` or ``("--bench", "5")``.
        timeout: seconds before the whole process group is killed.
        env: extra environment variables (``OMP_NUM_THREADS=1`` is the default).

    Returns:
        ``CompletedProcess`` with text ``stdout``/``stderr`` and ``returncode`` (not raised on).

    Raises:
        subprocess.TimeoutExpired: the run exceeded ``timeout`` (carries the output so far).
    """
    program_dir = os.path.abspath(program_dir)
    args = []
    for flag, value, name, writer in (("--checkpoint", checkpoint, "model.pt", write_checkpoint),
                                      ("--input", inputs, "inputs.pt", write_inputs),
                                      ("--output", output, None, None)):
        path = _file_arg(value, program_dir, name, writer)
        if path is not None:
            args += [flag, path]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
           "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), program, *args, *map(str, extra_args)]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=program_dir, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def rank_path(path, rank: int) -> str:
    """``out.pt`` -> ``out.rank{rank}.pt`` (same rule as the emitted program)."""
    root, ext = os.path.splitext(str(path))
    return f"{root}.rank{rank}{ext}"


def _numpy(t) -> np.ndarray:
    torch = _torch()
    return (t.float() if t.dtype == torch.bfloat16 else t).numpy()


def assemble_outputs(output_path, program) -> dict:
    """Full outputs ``{public name: np.ndarray}`` from what ``program.py --output`` wrote.

    ``program`` is the local graph the program was emitted from (``compiled.program``).
    Replicated outputs: one file written by rank 0.  Otherwise one file per rank
    (``rank_path``), whose slices are put back together (``Partial`` axes summed)
    with :func:`parcomp.reference.interpreter.assemble`.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file belongs to another program (names, rank or layouts differ), or
            two replicas of the same block differ.
    """
    torch = _torch()
    outs = program.named_outputs()
    if all(isinstance(p, Replicate) for _, v in outs for p in program[v].layout):
        data = torch.load(str(output_path), map_location="cpu", weights_only=True)
        if sorted(data) != sorted(pub for pub, _ in outs):
            raise ValueError(f"{output_path} holds {sorted(data)}, expected {[p for p, _ in outs]}")
        return {pub: _numpy(data[pub]) for pub, _ in outs}
    mesh, per_rank = program.mesh, []
    for r in range(mesh.size):
        data = torch.load(rank_path(output_path, r), map_location="cpu", weights_only=True)
        want = {pub: layout_str(program[v].layout) for pub, v in outs}
        if data.get("rank") != r or data.get("layouts") != want:
            raise ValueError(f"{rank_path(output_path, r)} was not written by rank {r} of this "
                             f"program (layouts {data.get('layouts')}, expected {want})")
        per_rank.append(data)
    result = {}
    for pub, v in outs:
        node = program[v]
        dtype = "float32" if node.type.dtype == "bfloat16" else node.type.dtype
        gshape = tuple(per_rank[0]["global_shapes"][pub])
        result[pub] = assemble([_numpy(d["outputs"][pub]) for d in per_rank], node.layout, gshape,
                               mesh, dtype)
    return result
