"""Compile time against the mesh's rank count: a 2-block MLP training step on dp x sq x tp.

Model: ``nn.Sequential`` of 2 blocks (Linear(64, 256), GELU, Linear(256, 64)), input x
(16, 64, 64): batch split over ``dp``, sequence over ``sq``, the blocks Megatron over ``tp``::

    mesh dp=D sq=S tp=T
    0.weight colwise over tp
    2.weight rowwise over tp
    3.weight colwise over tp
    5.weight rowwise over tp
    input x [S(0), S(1), R]
    train loss=mse optimizer=sgd(lr=0.1)

For each mesh (default 2x2x2 = 8 ranks and 16x8x8 = 1,024 ranks), in one process with 1
thread: ``compile_graph`` (of which the layout search, ``report["search"]["seconds"]``), which
search ran and whether it proved its plan optimal, the plan's estimated step time,
``emit_program``, and the process groups one rank of program.py makes (the program's
``make_groups`` run against a counting stand-in for ``torch.distributed``).

Run:  .venv/bin/python bench/mesh_compile_time.py [--meshes 2x2x2,16x8x8] [--json F] [--plain]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import time  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

from parcomp.compile.compiler import compile_graph  # noqa: E402
from parcomp.frontends.torch.export import import_torch  # noqa: E402
from parcomp.spec import parse_spec  # noqa: E402
from parcomp_backends.torch import emit_program  # noqa: E402

SPEC = """\
mesh dp={} sq={} tp={}
0.weight colwise over tp
2.weight rowwise over tp
3.weight colwise over tp
5.weight rowwise over tp
input x [S(0), S(1), R]
train loss=mse optimizer=sgd(lr=0.1)
"""


def model():
    torch.manual_seed(0)
    layers = []
    for _ in range(2):
        layers += [torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)]
    return torch.nn.Sequential(*layers), torch.randn(16, 64, 64)


class CountingDist:
    """What program.py's make_groups calls, counted (rank 0 of the mesh, gloo)."""

    def __init__(self):
        self.made = 0
        self.group = types.SimpleNamespace(WORLD=types.SimpleNamespace(bound_device_id=None))

    def get_backend(self):
        return "gloo"

    def new_group(self, ranks, **kwargs):
        self.made += 1
        return tuple(ranks)

    def split_group(self, split_ranks, **kwargs):
        self.made += 1
        return split_ranks[0]


def groups_per_rank(text: str) -> int:
    """The process groups rank 0 of the emitted ``text`` makes (WORLD not counted)."""
    ns = {"__name__": "program"}
    exec(compile(text, "program.py", "exec"), ns)  # noqa: S102 - the emitted program, as a module
    fake = CountingDist()
    ns.update(dist=fake, RANK=0, WORLD_SIZE=ns["MESH_SIZE"])
    ns["make_groups"](60)
    return fake.made


def measure(mesh: tuple, graph) -> dict:
    spec = parse_spec(SPEC.format(*mesh), "mesh.pcs")
    t0 = time.perf_counter()
    compiled = compile_graph(graph, spec)
    t1 = time.perf_counter()
    text = emit_program(compiled, "cpu")
    t2 = time.perf_counter()
    search = compiled.report["search"]
    return {"mesh": "x".join(map(str, mesh)), "ranks": mesh[0] * mesh[1] * mesh[2],
            "compile_s": round(t1 - t0, 2), "search_s": round(search["seconds"], 2),
            "search": search["search"], "proven": search["proven_optimal"],
            "step_us": round(search["cost_s"] * 1e6, 1), "emit_s": round(t2 - t1, 3),
            "groups_per_rank": groups_per_rank(text)}


def main():
    torch.set_num_threads(1)
    meshes = [tuple(int(v) for v in m.split("x")) for m in (C.arg_value("--meshes") or "2x2x2,16x8x8").split(",")]
    module, x = model()
    graph = import_torch(module, (x,), ["x"])
    print(C.env_line())
    rows = [measure(m, graph) for m in meshes]
    cols = [("mesh", "mesh dp x sq x tp"), ("ranks", "ranks"), ("compile_s", "compile_graph s"),
            ("search_s", "of it layout search s"), ("search", "search"), ("proven", "proven optimal"),
            ("step_us", "plan's step estimate us"), ("emit_s", "emit_program s"),
            ("groups_per_rank", "groups made per rank")]
    C.print_table("2-block MLP training step on dp x sq x tp: compile time by rank count", cols, rows)
    C.dump_json({"meshes": rows, "env": C.env_line()})


if __name__ == "__main__":
    main()
