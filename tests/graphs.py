"""Builders of small global graphs and specs for the tests (text in, Graph out)."""
from __future__ import annotations

import numpy as np

from parcomp.ir import parse_graph
from parcomp.spec import parse_spec


def mlp_text(batch, dims, bias, acts, torch_layout=False, act_approx="none") -> str:
    """A chain of linears ``x[batch, dims[0]] -> ... -> [batch, dims[-1]]``.

    Linear i has weight ``l{i}.weight`` ([in, out], or [out, in] + permute when
    ``torch_layout``), an optional bias ``l{i}.bias`` and, between linears, the
    activation ``acts[i]`` (relu | gelu | tanh | none).  Output is named output.
    """
    bshape = ",".join(str(b) for b in batch)
    lines = [f"%x: f32[{bshape},{dims[0]}] = input()"]
    cur = "x"
    for i in range(len(dims) - 1):
        din, dout = dims[i], dims[i + 1]
        w = f"l{i}.weight"
        if torch_layout:
            lines.append(f"%{w}: f32[{dout},{din}] = param()")
            lines.append(f"%l{i}.wt: f32[{din},{dout}] = permute(%{w}) {{perm=(1, 0)}}")
            rhs = f"l{i}.wt"
        else:
            lines.append(f"%{w}: f32[{din},{dout}] = param()")
            rhs = w
        lines.append(f"%l{i}.mm: f32[{bshape},{dout}] = matmul(%{cur}, %{rhs})")
        cur = f"l{i}.mm"
        if bias[i]:
            lines.append(f"%l{i}.bias: f32[{dout}] = param()")
            lines.append(f"%l{i}.out: f32[{bshape},{dout}] = add(%{cur}, %l{i}.bias)")
            cur = f"l{i}.out"
        if i < len(dims) - 2 and acts[i] != "none":
            attrs = f' {{approximate="{act_approx}"}}' if acts[i] == "gelu" else ""
            lines.append(f"%l{i}.act: f32[{bshape},{dout}] = {acts[i]}(%{cur}){attrs}")
            cur = f"l{i}.act"
    lines.append(f"return %{cur} as output")
    return "\n".join(lines) + "\n"


def mlp_graph(*args, **kw):
    return parse_graph(mlp_text(*args, **kw))


def random_feeds(graph, seed=0, scale=1.0) -> dict:
    rng = np.random.default_rng(seed)
    return {n.name: (rng.standard_normal(n.type.shape) * scale).astype(n.type.dtype)
            for n in graph.nodes if n.op in ("input", "param")}


def spec(text: str):
    return parse_spec(text, "test.pcs")


def megatron_spec(mesh="tp=2", output="replicated", extra="") -> object:
    """Megatron column -> row spec for the 2-linear ``mlp_text`` graph."""
    return spec(f"mesh {mesh}\nl0.weight colwise\nl1.weight rowwise\n"
                f"input x replicated\noutput output {output}\n{extra}")
