"""The copies program.py's all_gather and reduce_scatter make around the collective when the
split dim is not dim 0 (sequence parallel's dim 1): one, of the full tensor, counted in bytes
(``aten.clone``) on 2 gloo ranks, and the results equal the concatenation / the summed chunk."""
from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")

from parcomp_backends.torch.launch import free_port  # noqa: E402
from parcomp_backends.torch.runtime import program_common as rt  # noqa: E402


def _rank(rank, port, out_dir):
    from torch.utils._python_dispatch import TorchDispatchMode

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        rt.GROUPS.update(x=torch.distributed.group.WORLD)
        rt.MESH.clear()
        rt.MESH.update(x=2)

        class Copies(TorchDispatchMode):
            nbytes = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is torch.ops.aten.clone.default:
                    Copies.nbytes += out.numel() * out.element_size()
                return out

        got = {}
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(2, 6, 4, generator=g) for _ in range(2)]  # each rank's whole value
        for dim in (0, 1, 2):
            shard = full[0].chunk(2, dim)[rank].contiguous()  # as program.py holds a shard
            Copies.nbytes = 0
            with Copies():
                gathered = rt.all_gather(shard, dim, "x")
            got[f"all_gather{dim}"] = (gathered, Copies.nbytes)
            Copies.nbytes = 0
            with Copies():
                scattered = rt.reduce_scatter(full[rank], dim, "x")
            got[f"reduce_scatter{dim}"] = (scattered, Copies.nbytes)
        torch.save(got, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def test_collectives_on_dim_1_and_2_copy_once_and_equal_torch(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(2, 6, 4, generator=g) for _ in range(2)]
    whole = 2 * 6 * 4 * 4  # bytes of the full f32[2, 6, 4]
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for dim in (0, 1, 2):
            gathered, copied = got[f"all_gather{dim}"]
            assert torch.equal(gathered, full[0]) and gathered.is_contiguous()
            assert copied == (0 if dim == 0 else whole), (dim, copied)  # was: + the shard's bytes
            scattered, copied = got[f"reduce_scatter{dim}"]
            torch.testing.assert_close(scattered, (full[0] + full[1]).chunk(2, dim)[rank])
            assert scattered.is_contiguous()
            assert copied == (0 if dim == 0 else whole), (dim, copied)  # was: + the chunk's bytes
