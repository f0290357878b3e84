"""Run an emitted ``program.py`` with torchrun on this machine, and read back what it wrote.

:func:`run_torchrun` starts ``python -m torch.distributed.run`` on a free
localhost port with ``OMP_NUM_THREADS=1`` and a hard timeout (the launcher and
every worker under it are killed).  :func:`run_torchrun_multinode` simulates a
multi-node job: one torchrun launcher per node, c10d or static rendezvous on
127.0.0.1.  :func:`write_checkpoint` / :func:`write_inputs` write the files the
program reads; :func:`assemble_outputs` rebuilds full output arrays from either
output form the program writes; :func:`read_losses` and
:func:`assemble_training_outputs` read what a training program wrote.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

from parcomp.compile.program import assemble, cp_outputs
from parcomp.ir.types import Replicate, layout_str

from .emit import emit_program


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (``ip_local_port_range``; 32768 if unknown)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's --master-port).

    Drawn at random below the kernel's ephemeral range, not ``bind(0)``: a port from the ephemeral
    range can be taken by any outgoing connection (gloo opens many) between this check and the
    store's bind, and two launchers asking the kernel at once tend to get neighbouring ports."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every draw taken: the kernel's
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list:
    """Every live process under ``pid`` (children first level first), read from /proc; [] without /proc."""
    children = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), ()):
            out.append(child)
            todo.append(child)
    return out


def _kill_tree(proc) -> None:
    """SIGKILL a launcher started with ``start_new_session=True`` and every process under it.

    torchrun starts each worker in a session of its own, so killing the launcher's
    process group alone would leave the workers running: the launcher is stopped
    first (it can start nothing more), then its descendants and their groups are
    killed by pid, then the launcher's group.
    """
    def signal_group(pgid, sig):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    signal_group(proc.pid, signal.SIGSTOP)
    for pid in _descendants(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
            if os.getpgid(pid) == pid:
                signal_group(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    signal_group(proc.pid, signal.SIGKILL)
    proc.wait()


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
    """Write inputs for ``--input``: a dict name -> tensor/array, one tensor, or (training)
    a list of such dicts, one per step. Returns ``path``."""
    torch = _torch()
    if isinstance(inputs, dict):
        return write_checkpoint(inputs, path)
    if isinstance(inputs, list):
        torch.save([{k: torch.as_tensor(v).detach().cpu().contiguous() for k, v in step.items()}
                    for step in inputs], str(path))
        return str(path)
    torch.save(torch.as_tensor(inputs).detach().cpu().contiguous(), str(path))
    return str(path)


def write_program(compiled, directory, profile="cpu", model: str | None = None,
                  steps: int | None = None, functional: bool = False) -> str:
    """Emit ``compiled`` into ``directory/program.py`` (``functional``: see
    :func:`.emit.emit_program`); returns the file's path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(str(directory), "program.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(emit_program(compiled, profile, model, steps, functional))
    return path


def _file_arg(value, directory, name, writer):
    if value is None or isinstance(value, (str, os.PathLike)):
        return None if value is None else os.path.abspath(value)
    return writer(value, os.path.join(str(directory), name))


def _program_args(program_dir, checkpoint, inputs, output) -> list:
    args = []
    for flag, value, name, writer in (("--checkpoint", checkpoint, "model.pt", write_checkpoint),
                                      ("--input", inputs, "inputs.pt", write_inputs),
                                      ("--output", output, None, None)):
        path = _file_arg(value, program_dir, name, writer)
        if path is not None:
            args += [flag, path]
    return args


def run_torchrun(program_dir, nproc: int, checkpoint=None, inputs=None, output=None, extra_args=(),
                 timeout: float = 120, nnodes: int = 1, program: str = "program.py",
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """Launch ``program_dir/program.py`` on ``nproc`` local processes with torchrun.

    Args:
        checkpoint: a file path, or a module/state_dict (written to program_dir/model.pt).
        inputs: a file path, or a dict/tensor (written to program_dir/inputs.pt).
        output: where the program writes its outputs (``--output``), or None.
        extra_args: more program arguments, e.g. ``("--device", "cpu")`` or ``("--bench", "5")``.
        timeout: seconds before the launcher and every worker under it are killed.
        env: extra environment variables (``OMP_NUM_THREADS=1`` is the default).

    Returns:
        ``CompletedProcess`` with text ``stdout``/``stderr`` and ``returncode`` (not raised on).

    Raises:
        subprocess.TimeoutExpired: the run exceeded ``timeout`` (carries the output so far).
    """
    program_dir = os.path.abspath(program_dir)
    args = _program_args(program_dir, checkpoint, inputs, output)
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
        _kill_tree(proc)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_torchrun_multinode(program_dir, nnodes: int, nproc_per_node: int, checkpoint=None,
                           inputs=None, output=None, extra_args=(), timeout: float = 120,
                           rdzv: str = "c10d", program: str = "program.py", env: dict | None = None,
                           grace: float = 15) -> list:
    """Simulate a ``nnodes``-node torchrun job on this machine: one launcher per node, started together.

    Launcher ``i`` is what a user starts on node ``i``; all run ``program_dir/program.py``
    with ``--nnodes nnodes --nproc-per-node nproc_per_node`` and a rendezvous on 127.0.0.1:

    - ``rdzv="c10d"``: ``--rdzv-backend c10d --rdzv-endpoint 127.0.0.1:PORT --rdzv-id ID``
      (one shared id, a free port).  torchrun ignores ``--node-rank`` here, so none is
      passed: the rendezvous numbers the nodes (sorted by host name, then launcher pid),
      so which launcher gets ranks ``0..nproc_per_node-1`` is not fixed; each launcher
      still gets a contiguous block of ``nproc_per_node`` global ranks.
    - ``rdzv="static"``: ``--node-rank i --master-addr 127.0.0.1 --master-port PORT``;
      launcher ``i`` gets global ranks ``i*nproc_per_node .. (i+1)*nproc_per_node-1``.

    Every launcher (and so every worker it starts) has ``PARCOMP_SIM_NODE=i`` in its
    environment, so a worker can tell which simulated node it runs on.

    Args:
        checkpoint, inputs, output, extra_args, env: as for :func:`run_torchrun`
            (files are written once, before any launcher starts).
        timeout: seconds for the whole job; then every launcher and its workers are killed.
        grace: once one launcher has failed, seconds the others get to exit before they
            are killed (a peer of a failed node may otherwise wait for the rendezvous).

    Returns:
        One ``CompletedProcess`` per launcher, in launcher order (not raised on; a launcher
        killed after another failed has a negative ``returncode``).

    Raises:
        subprocess.TimeoutExpired: the job exceeded ``timeout``; every launcher was killed
            (its ``output``/``stderr`` hold all launchers' output, each under a header).
        ValueError: unknown ``rdzv``.
    """
    if rdzv not in ("c10d", "static"):
        raise ValueError(f"rdzv must be 'c10d' or 'static', not {rdzv!r}")
    program_dir = os.path.abspath(program_dir)
    args = _program_args(program_dir, checkpoint, inputs, output)
    port, run_id = free_port(), f"parcomp-{uuid.uuid4().hex[:12]}"
    base = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc_per_node)]
    procs, cmds, logs = [], [], []
    try:
        for i in range(nnodes):
            if rdzv == "c10d":
                how = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--rdzv-id", run_id]
            else:
                how = ["--node-rank", str(i), "--master-addr", "127.0.0.1", "--master-port", str(port)]
            cmd = [*base, *how, program, *args, *map(str, extra_args)]
            full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                            PARCOMP_SIM_NODE=str(i))
            full_env.update(env or {})
            out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
            logs.append((out, err))
            cmds.append(cmd)
            procs.append(subprocess.Popen(cmd, cwd=program_dir, env=full_env, stdout=out, stderr=err,
                                          text=True, start_new_session=True))
        deadline, timed_out = time.monotonic() + timeout, False
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline:
                timed_out = not any(p.returncode not in (None, 0) for p in procs)
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
    texts = []
    for out, err in logs:
        out.seek(0)
        err.seek(0)
        texts.append((out.read(), err.read()))
        out.close()
        err.close()
    if timed_out:
        both = ["".join(f"==== launcher {i} ====\n{t[k]}" for i, t in enumerate(texts)) for k in (0, 1)]
        raise subprocess.TimeoutExpired(cmds[0], timeout, output=both[0], stderr=both[1])
    return [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(cmds, procs, texts)]


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
    with :func:`parcomp.reference.assemble.assemble`.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a file belongs to another program (names, rank or layouts differ), or
            two replicas of the same block differ.
    """
    torch = _torch()
    outs = program.named_outputs()
    if all(isinstance(p, Replicate) for _, v in outs for p in program[v].layout):
        data = torch.load(str(output_path), map_location="cpu", weights_only=True)
        data = {k: v for k, v in data.items() if k != "losses"}  # a training program's loss history
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
    return cp_outputs(program, result)  # balanced chunking: natural order


def read_losses(output_path) -> list:
    """The per-step losses a training ``program.py --output PATH`` wrote (floats, step 1 first).

    Reads ``PATH`` (replicated outputs) or, if absent, rank 0's ``PATH`` with ``.rank0``.
    """
    import torch

    path = output_path
    if not os.path.exists(path):
        root, ext = os.path.splitext(str(path))
        path = f"{root}.rank0{ext}"
    return list(torch.load(str(path), map_location="cpu", weights_only=True)["losses"])


def assemble_training_outputs(output_path, program) -> tuple:
    """``(outputs, losses)`` from what a training ``program.py --output PATH`` wrote.

    ``outputs`` is :func:`parcomp_backends.torch.launch.assemble_outputs` of the last
    step (``{public name: full np.ndarray}``), ``losses`` is :func:`read_losses`.
    """
    import torch

    losses = read_losses(output_path)
    outs = program.named_outputs()
    if not all(isinstance(p, Replicate) for _, v in outs for p in program[v].layout):
        return assemble_outputs(output_path, program), losses
    # one file {name: tensor, "losses": [...]}; assemble_outputs wants the names alone
    data = torch.load(str(output_path), map_location="cpu", weights_only=True)
    data.pop("losses", None)
    if sorted(data) != sorted(pub for pub, _ in outs):
        raise ValueError(f"{output_path} holds {sorted(data)}, expected {[p for p, _ in outs]}")
    full = {}
    for pub, _ in outs:
        t = data[pub]
        full[pub] = (t.float() if t.dtype == torch.bfloat16 else t).numpy()
    return full, losses
