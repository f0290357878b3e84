"""Run a function on N local gloo ranks, each its own process: 127.0.0.1, a free port, a timeout,
the process group destroyed at the end; each rank's return value comes back as JSON.

``run_ranks("api_workers:train_equal", 2, spec="...")`` starts ``python -m gloo_ranks`` N times;
the named function is called as ``fn(rank, world, **kwargs)`` after ``init_process_group``.
"""
from __future__ import annotations

import datetime
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from parcomp_backends.torch.launch import free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def run_ranks(target: str, world: int, timeout: float = 600, env=None, **kwargs) -> list:
    """``[rank 0's result, rank 1's, ...]``; AssertionError with every rank's stderr if one failed."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="parcomp-gloo-") as tmp:
        procs = []
        for rank in range(world):
            e = {**os.environ, **(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
                 "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE), str(HERE.parent),
                                                os.environ.get("PYTHONPATH", "")])}
            args = [sys.executable, str(Path(__file__)), target, json.dumps(kwargs), f"{tmp}/r{rank}.json"]
            procs.append(subprocess.Popen(args, env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=timeout))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise AssertionError(f"{target} on {world} ranks did not finish in {timeout} s")
        bad = [(r, p.returncode, o) for r, (p, o) in enumerate(zip(procs, outs)) if p.returncode != 0]
        assert not bad, "\n".join(f"rank {r} exited {code}:\n{o[1][-4000:]}" for r, code, o in bad)
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(world)]


def _main(target, kwargs, out):
    import torch.distributed as dist

    mod, fn = target.split(":")
    func = getattr(importlib.import_module(mod), fn)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result = func(rank, world, **json.loads(kwargs))
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(*sys.argv[1:4])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads torn down at exit sometimes abort a clean run (program.py does the same)
