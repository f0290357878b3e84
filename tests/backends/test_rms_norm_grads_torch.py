"""An RMS norm's dx and dweight in the emitted training step: one ``rms_norm_grads`` statement
(one rstd, one normalised x) instead of dx's formula plus a second rms_norm of x and a mul for
dweight; every gradient equal to torch's autograd."""
import importlib.util

import numpy as np
import pytest

from parcomp.compile.compiler import compile_graph
from parcomp.ir import parse_graph

from graphs import spec

torch = pytest.importorskip("torch")

RMS_MODEL = """\
%x: {t}[4,6,16] = input()
%rms.weight: {t}[16] = param()
%h: {t}[4,6,16] = rms_norm(%x, %rms.weight) {{eps=1e-06}}
%fc.weight: {t}[8,16] = param()
%fc.wt: {t}[16,8] = permute(%fc.weight) {{perm=(1, 0)}}
%y: {t}[4,6,8] = matmul(%h, %fc.wt)
return %y as output
"""


def _step_ops(program, params, inputs):
    ops = []

    class Record(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Record(), torch.no_grad():
        out = program.train_step(params, inputs)
    return out, ops


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_rms_norm_dx_and_dweight_are_one_statement_and_equal_autograd(tmp_path, dtype):
    from parcomp_backends.torch.emit import RUNTIME_MARK, emit_program

    short = {"float64": "f64", "float32": "f32"}[dtype]
    c = compile_graph(parse_graph(RMS_MODEL.format(t=short)), spec("mesh tp=1\ntrain loss=mse optimizer=sgd(lr=0.1)\n"))
    text = emit_program(c, "cpu")
    step = text.split("def train_step")[1].split(RUNTIME_MARK)[0]
    assert step.count(" = rms_norm_grads(") == 1, step
    assert "norm_grad(" not in step.replace("rms_norm_grads(", "")
    assert step.count("torch.nn.functional.rms_norm(") == 1  # the forward's; dweight's second one is gone
    assert "not needed (the RMS norm's backward" in step
    (tmp_path / "program.py").write_text(text)
    mod_spec = importlib.util.spec_from_file_location(f"parcomp_rms_norm_program_{dtype}", tmp_path / "program.py")
    program = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(program)
    rng = np.random.default_rng(0)
    feeds = {n.name: torch.from_numpy(rng.standard_normal(n.type.shape).astype(dtype))
             for n in c.logical.nodes if n.op in ("input", "param")}
    params = {n.name: feeds[n.name].clone() for n in c.logical.params}
    inputs = {n.name: feeds[n.name].clone() for n in c.logical.inputs}
    out, ops = _step_ops(program, params, inputs)
    # x * x and its mean once for the norm's backward (the rstd of dx and dweight), once in the forward
    assert ops.count("mean") == 1 + 2, ops  # the forward's mean(x*x); backward: rstd, mean(g * xhat)
    x = feeds["x"].clone().requires_grad_(True)
    w, fw = (feeds[k].clone().requires_grad_(True) for k in ("rms.weight", "fc.weight"))
    y = torch.nn.functional.rms_norm(x, (16,), w, 1e-6) @ fw.T
    torch.nn.functional.mse_loss(y, feeds["target"]).backward()
    tol = {"float64": 1e-12, "float32": 1e-5}[dtype]
    for name, t in (("x", x), ("rms.weight", w), ("fc.weight", fw)):
        torch.testing.assert_close(out[name + ".grad"], t.grad, rtol=tol, atol=tol * float(t.grad.abs().max()))
