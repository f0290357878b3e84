"""Megatron MLP TRAINING step, TP=2 on 2 gloo ranks: parcomp's emitted train_step vs its peers.

Model: ``nn.Sequential(Linear(h, 4h), GELU(), Linear(4h, h))`` with biases, x and a fixed
target of shape (8, 128, h), fp32, MSE loss (mean), plain SGD lr=0.01 (no momentum, no weight
decay), h in {256, 1024}. One timed step = forward + loss + backward + parameter update, and
it reads the loss (``.item()``), so nothing is left in flight.

What every variant computes per step (the same work, so the times compare):
the loss, the gradient of every parameter, the updated parameters, AND the gradient of the
input x (parcomp's training program returns ``x.grad`` because x is a float input; the
others run with ``x.requires_grad_(True)``). In Megatron TP this costs a second all_reduce
(``f`` in backward) on top of the forward one (``g``): 2 all_reduce per step (parcomp picks
another plan at h=1024 from the spec as given: see parcomp-pinned).

Variants, all timed in ONE ``torch.multiprocessing`` spawn of 2 gloo ranks, interleaved
(rounds of k steps per variant, the order reversed every other round):

  parcomp      the program.py parcomp emits for the spec
               ``mesh tp=2 / 0.weight colwise / 2.weight rowwise / input x replicated /
               train loss=mse optimizer=sgd(lr=0.01)``, imported as a module in the worker:
               ``make_groups()``, ``load_params(state_dict)``, ``load_inputs({"x", "target"})``;
               a step is ``train_step(params, inputs)`` under ``torch.no_grad()`` followed by
               feeding the CARRIED outputs (the updated params) back as the next step's params,
               exactly like the program's own ``train()`` loop, then ``loss.item()``
  dtensor      ``parallelize_module(mlp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})``;
               ``F.mse_loss(out, target)`` (out: the Replicate output as a local tensor),
               ``loss.backward()``, ``torch.optim.SGD`` on the DTensor params; the step reads
               ``loss.item()`` and one element of ``x.grad`` (waits DTensor's async collectives)
  hand         hand-written Megatron: column shard W1/b1, row shard W2, autograd Functions
               ``f`` (identity fwd, all_reduce bwd) and ``g`` (all_reduce fwd, identity bwd),
               b2 added after the reduce, ``F.mse_loss``, backward, ``torch.optim.SGD``
  ref-1t       the unsharded module + ``torch.optim.SGD`` in one process with 1 thread
               (rank 0 runs it while rank 1 waits in a barrier)
Diagnostic variants (not products):
  ref-2t          the unsharded module with 2 intra-op threads (what one process gets from
                  2 cores; a noise check: it should be ~0.5x ref-1t)
  hand-nocomm     hand with both all_reduces skipped (wrong numbers: its compute floor)
  parcomp-nocomm  the emitted program with its collectives replaced by local stand-ins of the
                  right shapes (``strip_comm``; wrong numbers: the emitted code's compute floor)
  parcomp-pinned  the program emitted for the spec plus ``activation output replicated``: at
                  h=1024 the spec as given makes parcomp choose reduce_scatter + 4-byte
                  all_reduce forward and all_gather + all_reduce backward (its alpha-beta cost
                  model prefers it); the pin forces Megatron's 2 all_reduce (at h=256 the
                  programs are identical, so parcomp vs parcomp-pinned shows the noise)
  parcomp-tuned   parcomp-pinned with five text edits made by THIS script (``tune_program``:
                  pow(x, 1) -> x, no expanded 0-d scale, fused SGD update, weight gradients
                  computed in the weight's layout, dx's all_reduce started asynchronously and
                  overlapped with dW1 + the update): what the suggested emitter changes would
                  give; not something parcomp emits

The torch variants use the torch.optim defaults on CPU (for-loop SGD, ``p.add_(grad,
alpha=-lr)``), ``zero_grad(set_to_none=True)`` at the start of each step.

Correctness: (1) before timing, every variant does one step from the same initial weights
and is compared (on every rank, its shards) with an unsharded one-step reference: loss,
x.grad, parameter grads, updated parameters (max abs error, worst over ranks); (2) after
timing, every variant has done the same number of steps as rank 0's ``ref-1t`` model (check
step, profiler step, warm-up, timed steps); rank 0 broadcasts the reference parameters and
each rank compares its shards. Collectives are counted with torch.profiler (``c10d::*``
events) on one extra untimed step per variant and compared with parcomp's compile report.

A second table ("emitted-code pieces") times, in the parent process with 1 thread and no
communication, the emitted ``train_step`` and the hand-written local step next to pieces of
both (min over interleaved calls): where the emitted code spends its time.

With ``--torchrun`` (default in the full run, off with ``--quick`` / ``--no-torchrun``) the
emitted program is ALSO launched on its own with ``torchrun ... --steps 1 --bench N`` (its own
loop: barrier before every step, training steps timed but not applied, ``mallopt`` set at
start), as a cross-check of the in-process number.

Run:  .venv/bin/python bench/tp_mlp_train.py [--quick] [--json out.json] [--no-torchrun] [--plain]
          [--malloc-tuned] [--hidden 256,1024]
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import copy  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

B, S = 8, 128
LR = 0.01
QUICK = "--quick" in sys.argv
HIDDENS = [256] if QUICK else [256, 1024]
if C.arg_value("--hidden"):
    HIDDENS = [int(v) for v in C.arg_value("--hidden").split(",")]
WARMUP = {256: 1, 1024: 1} if QUICK else {256: 2, 1024: 1}
ROUNDS = {256: (3, 3), 1024: (1, 2)} if QUICK else {256: (10, 4), 1024: (4, 3)}  # (rounds, steps/round)
TORCHRUN = ("--torchrun" in sys.argv) or (not QUICK and "--no-torchrun" not in sys.argv)
TORCHRUN_STEPS = {256: 20, 1024: 6}
MICRO_REPS = {256: 10, 1024: 3} if QUICK else {256: 30, 1024: 8}
SPEC = """\
mesh tp=2
0.weight  colwise     # Linear(h, 4h): column parallel, 0.bias follows
2.weight  rowwise     # Linear(4h, h): row parallel, partial sums, 2.bias after the sum
input  x  replicated
train loss=mse optimizer=sgd(lr=0.01)
"""
PIN = "activation output replicated  # diagnostic: force Megatron's plan (see parcomp-pinned)\n"
MAIN = ["parcomp", "dtensor", "hand", "ref-1t"]
DIAG = ["ref-2t", "hand-nocomm", "parcomp-nocomm", "parcomp-pinned", "parcomp-tuned"]
# how each parameter is split over tp (dim, or None = replicated): Megatron column/row
SHARD_DIM = {"0.weight": 0, "0.bias": 0, "2.weight": 1, "2.bias": None}


def build_model(h: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))


def make_data(h: int):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, h, generator=g), torch.randn(B, S, h, generator=g)  # x, target


def shard(t, name, rank, world):
    d = SHARD_DIM[name]
    return t if d is None else t.chunk(world, d)[rank]


def emit(h: int, directory: str) -> tuple:
    """Compile the h-MLP training spec (and the spec + PIN); write program.py,
    program_pinned.py and program_tuned.py (the pinned one edited by :func:`tune_program`);
    return (path, compile report, pinned compile report, tuned edits applied)."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    x, _ = make_data(h)
    graph = import_torch(build_model(h), (x,), ["x"])
    compiled = compile_graph(graph, parse_spec(SPEC, "tp_mlp_train.pcs"))
    pinned = compile_graph(graph, parse_spec(SPEC + PIN, "tp_mlp_train_pinned.pcs"))
    text = emit_program(compiled, "cpu", f"bench/tp_mlp_train.py h={h}")
    text_pinned = emit_program(pinned, "cpu", f"bench/tp_mlp_train.py h={h} (pinned)")
    tuned, applied = tune_program(text_pinned)
    for name, t in (("program.py", text), ("program_pinned.py", text_pinned), ("program_tuned.py", tuned)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            f.write(t)
    return os.path.join(directory, "program.py"), compiled.report, pinned.report, applied


TUNED_HELPER = '''
def bench_all_reduce_start(x, axis):
    """Start an in-place all_reduce of a fresh value; the caller waits on the handle (bench patch)."""
    return dist.all_reduce(x, op=dist.ReduceOp.SUM, group=GROUPS[axis], async_op=True)
'''


def tune_program(text: str) -> tuple:
    """The emitted program with the peepholes this benchmark suggests, applied as text edits
    to ``train_step`` (a diagnostic of what they would give; parcomp itself is unchanged).

    Returns (new text, list of the edits that matched). Edits:
      pow1     ``torch.pow(v, 2.0 - 1)`` (the mse gradient's pow with exponent 1) -> ``v``
      bcast    ``s.reshape((1, 1, 1)).expand(shape)`` of a 0-d scale -> ``s`` (broadcast in
               the one multiply that reads it instead of materialising a full tensor)
      sgd      ``a = g * lr`` + ``w2 = w - a`` -> ``w2 = torch.add(w, g, alpha=-lr)``
               (one pass and one new tensor per parameter instead of two)
      wgrad    ``y = torch.matmul(a, b)`` + ``z = y.permute(1, 0)`` (the weight gradient computed
               as [in, out] and then viewed as [out, in]) -> ``z = torch.matmul(b.T, a.T)``: the
               gradient comes out contiguous in the weight's layout, so the update does not
               read it transposed (at h=1024 that strided read is ~8 ms per weight matrix)
      overlap  an in-place ``all_reduce_`` whose operand is computed earlier than the line
               before it is started asynchronously right after the operand is computed and
               waited where the value is used (here: dx's all_reduce overlaps dW1 + the update)
    """
    head, sep, rest = text.partition("def train_step(p, inp):")
    body, sep2, tail = rest.partition("\n    return {")
    applied = []
    body, n = re.subn(r"torch\.pow\((\w+), 2\.0 - 1\)", r"\1", body)
    if n:
        applied.append(f"pow1 x{n}")
    body, n = re.subn(r"= (\w+)\.reshape\(\((?:1, )*1\)\)\.expand\(\([\d, ]+\)\)", r"= \1", body)
    if n:
        applied.append(f"bcast x{n}")
    body, n = re.subn(r"(?m)^    (\w+) = (\w+) \* ([\d.e-]+)(  #[^\n]*)?\n    (\w+) = (\w+) - \1(  #[^\n]*)?$",
                      r"    \5 = torch.add(\6, \2, alpha=-\3)\7", body)
    if n:
        applied.append(f"sgd x{n}")
    lines, k = body.split("\n"), 0
    for i, line in enumerate(lines):  # wgrad: Y = A @ B; Z = Y.permute(1, 0) -> Z = B^T @ A^T
        m = re.match(r"    (\w+) = torch\.matmul\((\w+), (\w+)\)(.*)$", line)
        if not m or len(re.findall(rf"\b{m.group(1)}\b", body)) != 2:
            continue
        y, a, b, _ = m.groups()
        j = next((j for j in range(i + 1, len(lines)) if re.search(rf"\b{y}\b", lines[j])), None)
        mz = re.match(rf"    (\w+) = {y}\.permute\(1, 0\)(.*)$", lines[j]) if j is not None else None
        if mz:
            lines[i] = f"    # bench patch: {y} folded into {mz.group(1)}"
            lines[j] = f"    {mz.group(1)} = torch.matmul({b}.permute(1, 0), {a}.permute(1, 0)){mz.group(2)}"
            k += 1
    if k:
        applied.append(f"wgrad x{k}")
    k = 0
    for i, line in enumerate(list(lines)):
        m = re.match(r"    (\w+) = all_reduce_\((\w+), (\"\w+\")\)(.*)$", line)
        if not m:
            continue
        out, src, axis, cmt = m.groups()
        j = next((j for j, ln in enumerate(lines) if ln.startswith(f"    {src} = ")), None)
        between = [ln for ln in lines[j + 1:i] if not ln.lstrip().startswith("#")] if j is not None else []
        if j is None or not between:
            continue
        lines[i] = f"    {src}_work.wait()\n    {out} = {src}{cmt}"
        lines[j] += f"\n    {src}_work = bench_all_reduce_start({src}, {axis})  # bench patch: overlap"
        k += 1
    if k:
        applied.append(f"overlap x{k}")
    body = "\n".join(lines)
    return head + TUNED_HELPER + "\n\n" + sep + body + sep2 + tail, applied


class NoWork:
    """A finished collective (the tuned program's async all_reduce, without communication)."""

    @staticmethod
    def wait():
        return True


def strip_comm(prog):
    """Replace the program's collectives by local stand-ins of the right shapes (wrong numbers:
    the emitted code's compute floor): all_reduce = identity, reduce_scatter = this rank's
    chunk, all_gather = the shard repeated, the bench's async all_reduce = a finished handle."""
    n = 2
    prog.all_reduce = prog.all_reduce_ = lambda t, axis: t
    prog.reduce_scatter = lambda t, dim, axis: t.chunk(n, dim)[0].contiguous()
    prog.all_gather = lambda t, dim, axis: torch.cat([t] * n, dim)
    prog.bench_all_reduce_start = lambda t, axis: NoWork
    prog.all_reduce_start = prog.all_reduce_start_ = lambda t, axis: (t, NoWork)  # wait() returns t
    return prog


def load_program(path: str, name: str, groups: bool = True):
    """Import an emitted program.py as a module (RANK/WORLD_SIZE are already in os.environ)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if groups:
        mod.make_groups(C.PG_TIMEOUT_S)  # collective: every rank creates the program's groups in the same order
    return mod


# ----------------------------------------------------------------------------- variants
class ParcompStep:
    """The emitted train_step, carried values fed back like program.py's own train() loop."""

    def __init__(self, prog, sd, x, target):
        self.prog = prog
        self.params = prog.load_params(sd)
        self.inputs = prog.load_inputs({"x": x, "target": target})
        self.out = None

    def __call__(self):
        with torch.no_grad():  # as program.py's run(): the backward pass is explicit code
            out = self.prog.train_step(self.params, self.inputs)
            self.params = {**self.params, **{n: out[n] for n in self.prog.CARRIED}}
        self.out = out
        return out["loss"].item()

    def params_local(self):
        return {n: self.params[n] for n in SHARD_DIM}

    def grads_local(self):
        return {n: self.out[f"{n}.grad"] for n in SHARD_DIM}

    def xgrad(self):
        return self.out["x.grad"]


class TorchStep:
    """forward, F.mse_loss, backward, torch.optim.SGD step on a torch module (any front end)."""

    def __init__(self, model, x, target, names, read_xgrad=False):
        self.model, self.target, self.names = model, target, names
        self.x = x.clone().requires_grad_(True)  # the input gradient is computed, as parcomp's
        self.opt = torch.optim.SGD(model.parameters(), lr=LR)
        self.read_xgrad = read_xgrad

    def __call__(self):
        self.opt.zero_grad(set_to_none=True)
        self.x.grad = None
        loss = F.mse_loss(self.model(self.x), self.target)
        loss.backward()
        self.opt.step()
        if self.read_xgrad:  # DTensor: its backward collective may still be in flight
            self.x.grad.reshape(-1)[0].item()
        return loss.item()

    def _local(self, t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.wait() if hasattr(t, "wait") else t

    def params_local(self):
        ps = dict(self.model.named_parameters())
        return {n: self._local(ps[k]).detach() for n, k in self.names.items()}

    def grads_local(self):
        ps = dict(self.model.named_parameters())
        return {n: self._local(ps[k].grad) for n, k in self.names.items()}

    def xgrad(self):
        return self._local(self.x.grad)


class CopyToTP(torch.autograd.Function):
    """Megatron ``f``: identity forward, all_reduce backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad)
        return grad


class ReduceFromTP(torch.autograd.Function):
    """Megatron ``g``: all_reduce forward (in place on the fresh partial sum), identity backward."""

    @staticmethod
    def forward(ctx, y):
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad


class MegatronMLP(nn.Module):
    def __init__(self, ref, rank, world, comm=True):
        super().__init__()
        n = ref[0].out_features // world
        sl = slice(rank * n, (rank + 1) * n)
        self.comm = comm
        self.w1 = nn.Parameter(ref[0].weight.detach()[sl].clone())
        self.b1 = nn.Parameter(ref[0].bias.detach()[sl].clone())
        self.w2 = nn.Parameter(ref[2].weight.detach()[:, sl].contiguous())
        self.b2 = nn.Parameter(ref[2].bias.detach().clone())

    def forward(self, x):
        if self.comm:
            x = CopyToTP.apply(x)
        y = F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2)
        if self.comm:
            y = ReduceFromTP.apply(y)
        return y + self.b2


HAND_NAMES = {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}
MODULE_NAMES = {n: n for n in SHARD_DIM}


def worker(rank, world, h, program_path, rounds, per_round, warmup):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.set_num_threads(1)
    init = build_model(h)
    sd = {k: v.detach().clone() for k, v in init.state_dict().items()}
    x, target = make_data(h)

    # one-step reference on this rank (unsharded, from the same initial weights)
    r1 = copy.deepcopy(init)
    chk = TorchStep(r1, x, target, MODULE_NAMES)
    chk_loss = chk()
    chk_grads = {n: shard(g, n, rank, world) for n, g in chk.grads_local().items()}
    chk_params = {n: shard(p, n, rank, world) for n, p in chk.params_local().items()}
    chk_xgrad = chk.xgrad()

    prog = load_program(program_path, f"parcomp_train_h{h}")
    prog_nc = load_program(program_path, f"parcomp_train_h{h}_nocomm")
    strip_comm(prog_nc)  # compute floor (wrong numbers)
    here = os.path.dirname(program_path)
    prog_p = load_program(os.path.join(here, "program_pinned.py"), f"parcomp_train_h{h}_pinned")
    prog_t = load_program(os.path.join(here, "program_tuned.py"), f"parcomp_train_h{h}_tuned")
    mesh = init_device_mesh("cpu", (world,))
    dt = parallelize_module(copy.deepcopy(init), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    steps = {
        "parcomp": ParcompStep(prog, sd, x, target),
        "dtensor": TorchStep(dt, x, target, MODULE_NAMES, read_xgrad=True),
        "hand": TorchStep(MegatronMLP(init, rank, world), x, target, HAND_NAMES),
        "ref-1t": TorchStep(copy.deepcopy(init), x, target, MODULE_NAMES),
        "ref-2t": TorchStep(copy.deepcopy(init), x, target, MODULE_NAMES),
        "hand-nocomm": TorchStep(MegatronMLP(init, rank, world, comm=False), x, target, HAND_NAMES),
        "parcomp-nocomm": ParcompStep(prog_nc, sd, x, target),
        "parcomp-pinned": ParcompStep(prog_p, sd, x, target),
        "parcomp-tuned": ParcompStep(prog_t, sd, x, target),
    }
    solo = {"ref-1t": 1, "ref-2t": 2}
    out = {name: {} for name in steps}

    # (1) one step from the initial weights vs the unsharded reference (every rank, its shards)
    for name, st in steps.items():
        if name in solo and rank != 0:
            continue  # the solo models step on rank 0 only (as in the timed blocks)
        loss = st()
        o = out[name]
        o["err_loss"] = abs(loss - chk_loss)
        o["err_dx"] = C.max_abs(st.xgrad(), chk_xgrad)
        g, p = st.grads_local(), st.params_local()
        if name not in solo:
            o["err_dw"] = max(C.max_abs(g[n], chk_grads[n]) for n in SHARD_DIM)
            o["err_p1"] = max(C.max_abs(p[n], chk_params[n]) for n in SHARD_DIM)
        else:
            o["err_dw"] = max(C.max_abs(g[n], chk.grads_local()[n]) for n in SHARD_DIM)
            o["err_p1"] = max(C.max_abs(p[n], chk.params_local()[n]) for n in SHARD_DIM)

    # collectives per step: one extra untimed step under torch.profiler (solo: rank 0 only)
    dist.barrier()
    for name, st in steps.items():
        if name in solo:
            if rank == 0:
                st()
            continue
        out[name]["coll"] = C.count_collectives(st)
    dist.barrier()

    times = C.interleaved([(n, steps[n], solo.get(n)) for n in MAIN + DIAG], warmup, rounds, per_round)
    for name, ts in times.items():
        out[name]["time"] = C.stats_ms(ts["wall"])
        out[name]["cpu"] = C.stats_ms(ts["cpu"])
        out[name]["raw_ms"] = [t * 1e3 for t in ts["wall"]]
        out[name]["raw_cpu_ms"] = [t * 1e3 for t in ts["cpu"]]
        out[name]["faults"] = statistics.median(ts["faults"])

    # (2) after the timed steps: rank 0's ref-1t model has done as many steps as every variant
    src = steps["ref-1t"].params_local() if rank == 0 else init.state_dict()
    ref_final = {n: src[n].detach().clone().contiguous() for n in SHARD_DIM}
    for n in SHARD_DIM:
        dist.broadcast(ref_final[n], src=0)
    n_steps = 2 + warmup + rounds * per_round
    for name in MAIN + DIAG:
        if name in solo:
            out[name]["err_pN"] = 0.0 if name == "ref-1t" else float("nan")
            continue
        p = steps[name].params_local()
        out[name]["err_pN"] = max(C.max_abs(p[n], shard(ref_final[n], n, rank, world)) for n in SHARD_DIM)
    out["_n_steps"] = n_steps
    out["_ref_param_change"] = max(C.max_abs(ref_final[n], sd[n]) for n in SHARD_DIM)
    return out


# ------------------------------------------------------------------------ single process
def micro(h: int, program_path: str, reps: int) -> dict:
    """Single-process, 1-thread costs of the emitted train_step and its pieces (no comm).

    The emitted program is imported in the parent (no process group; its all_reduce is the
    identity); params are NOT carried (every call starts from the same weights). Interleaved,
    one call per case per round; min and median, page faults per call.
    """
    torch.set_num_threads(1)
    init = build_model(h)
    x, target = make_data(h)
    prog = load_program(program_path, f"parcomp_train_h{h}_micro", groups=False)
    strip_comm(prog)
    here = os.path.dirname(program_path)
    prog_p = strip_comm(load_program(os.path.join(here, "program_pinned.py"), f"parcomp_train_h{h}_pinned_micro",
                                     groups=False))
    prog_t = strip_comm(load_program(os.path.join(here, "program_tuned.py"), f"parcomp_train_h{h}_tuned_micro",
                                     groups=False))
    params, inputs = prog.load_params(init.state_dict()), prog.load_inputs({"x": x, "target": target})
    hand = TorchStep(MegatronMLP(init, 0, 2, comm=False), x, target, HAND_NAMES)
    w1, b1, w2, b2 = (p.detach().clone() for p in hand.model.parameters())
    n = x.numel()
    y = torch.randn_like(x)
    a = F.gelu(F.linear(x, w1, b1))
    dy = torch.randn_like(x)
    dy2 = dy.reshape(-1, h)
    grads = [torch.randn_like(p) for p in (w1, b1, w2, b2)]
    grads_t = [grads[0].t().contiguous().t(), grads[1], grads[2].t().contiguous().t(), grads[3]]
    ws = [w1.clone(), b1.clone(), w2.clone(), b2.clone()]

    def emitted_loss():  # the loss + loss-gradient chain emitted before the lowering passes
        sub = y - target
        loss = torch.sum(torch.pow(sub, 2.0), dim=(0, 1, 2)) * (1.0 / n)
        one = torch.ones((), dtype=torch.float32) * (1.0 / n)
        return loss, one.reshape((1, 1, 1)).expand(x.shape) * 2.0 * torch.pow(sub, 2.0 - 1)

    def fused_loss():  # what a fused mse fwd+bwd needs: one subtraction, one reduction, one scale
        sub = y - target
        return torch.dot(sub.reshape(-1), sub.reshape(-1)) / n, sub.mul_(2.0 / n)

    def emitted_update():  # SGD as emitted: w - g * lr, the weight grads being transposed views
        return [w - g * LR for w, g in zip(ws, grads_t)]

    def tuned_update():  # parcomp-tuned: torch.add(w, g, alpha=-lr), grads contiguous (wgrad edit)
        return [torch.add(w, g, alpha=-LR) for w, g in zip(ws, grads)]

    def inplace_update():  # torch.optim.SGD (for-loop): w.add_(g, alpha=-lr)
        for w, g in zip(ws, grads):
            w.add_(g, alpha=-LR)

    def emitted_dw2():  # emitted: [4h/2, h] = a^T-view @ dy, then a permute view
        return torch.matmul(a.reshape(-1, a.shape[-1]).permute(1, 0), dy2).permute(1, 0)

    def autograd_dw2():  # autograd's linear backward: dy^T @ a -> [h, 4h/2] directly
        return dy2.t().mm(a.reshape(-1, a.shape[-1]))

    cases = [
        ("emitted train_step (spec as given), no comm", lambda: prog.train_step(params, inputs)),
        ("pinned train_step (+ activation output replicated), no comm", lambda: prog_p.train_step(params, inputs)),
        ("tuned train_step (pinned + bench edits), no comm", lambda: prog_t.train_step(params, inputs)),
        ("hand step (autograd + SGD), no comm", hand),
        ("  loss + dloss/dy, pre-lowering emission (sub, pow, sum, scale, expand, *2, pow^1)", emitted_loss),
        ("  loss + dloss/dy, fused (sub, dot, scale in place; ~ lowered mse_sum/mse_grad)", fused_loss),
        ("  SGD update, pre-lowering emission (w - g*lr, dW transposed: 8 new tensors)", emitted_update),
        ("  SGD update, tuned (torch.add(w, g, alpha=-lr), dW contiguous)", tuned_update),
        ("  SGD update, in place (torch.optim; lowered add_scaled emits the same)", inplace_update),
        ("  dW2 matmul, pre-lowering emission (matmul(a^T, dy) then a permute view)", emitted_dw2),
        ("  dW2 matmul, autograd / lowered matmul_t (dy^T @ a, contiguous)", autograd_dw2),
    ]
    ts = {name: [] for name, _ in cases}
    faults = {name: [] for name, _ in cases}
    def ctx(name):  # the hand step needs autograd; everything else runs as program.py does
        return torch.enable_grad() if name.startswith("hand") else torch.no_grad()

    for name, fn in cases:
        with ctx(name):
            fn()
    for r in range(reps):
        for name, fn in (cases if r % 2 == 0 else cases[::-1]):
            with ctx(name):
                f0, t0 = C.minflt(), time.perf_counter()
                fn()
                ts[name].append(time.perf_counter() - t0)
                faults[name].append(C.minflt() - f0)
    return {name: dict(C.stats_ms(v), faults=statistics.median(faults[name])) for name, v in ts.items()}


def torchrun_bench(h: int, directory: str, program_path: str, steps: int) -> dict:
    """The emitted program launched by torchrun with --steps 1 --bench N (separate launch)."""
    from parcomp_backends.torch import run_torchrun, write_checkpoint, write_inputs

    x, target = make_data(h)
    ckpt = write_checkpoint(build_model(h), os.path.join(directory, "model.pt"))
    xin = write_inputs({"x": x, "target": target}, os.path.join(directory, "inputs.pt"))
    t0 = time.perf_counter()
    proc = run_torchrun(directory, 2, checkpoint=ckpt, inputs=xin, program=os.path.basename(program_path),
                        extra_args=("--device", "cpu", "--steps", "1", "--bench", str(steps)), timeout=150,
                        env={"MKL_NUM_THREADS": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": f"rc={proc.returncode}: {proc.stderr.strip()[-500:]}"}
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    ts = [t / 1e3 for t in json.loads(line)["step_ms"]]
    return {"time": C.stats_ms(ts), "raw_ms": [t * 1e3 for t in ts], "launch_wall_s": wall}


# ---------------------------------------------------------------------------------- main
WHAT = {
    "parcomp": "emitted train_step: loss, dW, dx, in-place SGD; params carried (collectives: see report)",
    "dtensor": "DTensor fwd, mse_loss, backward (dx too), torch.optim.SGD on DTensor params",
    "hand": "Megatron f/g autograd, mse_loss, backward (dx too), torch.optim.SGD",
    "ref-1t": "unsharded, 1 process, 1 thread: loss, backward (dx too), SGD",
    "ref-2t": "unsharded, 1 process, 2 threads",
    "hand-nocomm": "hand with both all_reduces skipped (wrong numbers)",
    "parcomp-nocomm": "emitted train_step, collectives = local stand-ins (wrong numbers)",
    "parcomp-pinned": "emitted from the spec + 'activation output replicated' (forces Megatron's 2 all_reduce)",
    "parcomp-tuned": "parcomp-pinned + the bench's text edits (tune_program; not parcomp's output)",
}


def main():
    t_start = time.perf_counter()
    malloc = ", ".join(f"{k}={os.environ[k]}" for k in C.MALLOC_TUNED if k in os.environ) or "glibc defaults"
    print(f"tp_mlp_train: Linear(h,4h)+GELU+Linear(4h,h), x/target {B}x{S}xh, fp32, mse, SGD lr={LR}, "
          f"fwd+bwd+update, TP=2 on gloo; {C.env_line()}; malloc: {malloc}", flush=True)
    results, rows = {"_env": {"loadavg_start": C.loadavg(), "malloc": malloc}}, []
    for h in HIDDENS:
        with tempfile.TemporaryDirectory(prefix=f"tp_mlp_train_h{h}_") as tmp:
            t0 = time.perf_counter()
            path, report, report_pinned, applied = emit(h, tmp)
            compile_s = time.perf_counter() - t0
            rounds, per_round = ROUNDS[h]
            per_rank = C.spawn(worker, 2, (h, path, rounds, per_round, WARMUP[h]), deadline_s=240)
            res = per_rank[0]
            for name in MAIN + DIAG:  # errors: worst over ranks (times are already max over ranks)
                for k in ("err_loss", "err_dx", "err_dw", "err_p1", "err_pN"):
                    vals = [pr[name][k] for pr in per_rank if k in pr[name]]
                    res[name][k] = max(vals) if vals else float("nan")
            res["_compile_s"] = compile_s
            res["_tuned_edits"] = applied
            res["_collectives_in_report"] = [(r["kind"], r["axis"], r["phase"], r["bytes"])
                                             for r in report["collectives"]]
            res["_collectives_in_pinned_report"] = [(r["kind"], r["axis"], r["phase"], r["bytes"])
                                                    for r in report_pinned["collectives"]]
            if TORCHRUN:
                res["parcomp-torchrun"] = torchrun_bench(h, tmp, path, TORCHRUN_STEPS[h])
            res["_micro"] = micro(h, path, MICRO_REPS[h])
        results[h] = res
        base = res["ref-1t"]["time"]["median"]
        for name in MAIN + DIAG + (["parcomp-torchrun"] if TORCHRUN else []):
            d = res[name]
            if "error" in d:
                rows.append({"h": h, "variant": name, "median": d["error"]})
                continue
            t = d["time"]
            diag = name in DIAG
            rows.append({
                "h": h, "variant": name + (" (diag)" if diag else ""),
                "median": t["median"], "min": t["min"], "max": t["max"], "n": t["n"],
                "x_ref": t["median"] / base, "x_parcomp": res["parcomp"]["time"]["median"] / t["median"],
                "cpu": d["cpu"]["median"] if "cpu" in d else "-",
                "cpu_x": (res["parcomp"]["cpu"]["median"] / d["cpu"]["median"]) if "cpu" in d else "-",
                "faults": int(d["faults"]) if "faults" in d else "-",
                "coll": C.fmt_counts(d["coll"]["c10d"]) if "coll" in d else "-",
                "e1": (f"{d['err_loss']:.1e} / {d['err_dx']:.1e} / {d['err_dw']:.1e} / {d['err_p1']:.1e}"
                       if "err_loss" in d else "(separate launch)"),
                "eN": d.get("err_pN", "-"),
            })
        print(f"  h={h} done ({time.perf_counter() - t_start:.0f} s so far; load {C.loadavg()})", flush=True)

    C.print_table(
        "tp_mlp_train: one training step (fwd+bwd+SGD), ms (per step: max over the 2 ranks; interleaved)",
        [("h", "h"), ("variant", "variant"), ("median", "median ms"), ("min", "min"), ("max", "max"),
         ("n", "n"), ("x_ref", "x ref-1t"), ("x_parcomp", "parcomp / this"),
         ("cpu", "CPU ms (sum of ranks)"), ("cpu_x", "parcomp / this (CPU)"),
         ("faults", "page faults/step"), ("coll", "c10d calls/step"),
         ("e1", "step-1 max abs err: loss / dx / dW / W"), ("eN", "max abs err W after all steps")],
        rows)
    mrows = []
    for h in HIDDENS:
        mic = results[h]["_micro"]
        base = mic["hand step (autograd + SGD), no comm"]
        for name, t in mic.items():
            mrows.append({"h": h, "what": name, "min": t["min"], "median": t["median"], "n": t["n"],
                          "faults": int(t["faults"]),
                          "dmin": t["min"] - base["min"] if not name.startswith("  ") else ""})
    C.print_table(
        "emitted-code pieces, single process, 1 thread, no communication (ms; interleaved)",
        [("h", "h"), ("what", "what"), ("min", "min ms"), ("median", "median ms"), ("n", "n"),
         ("dmin", "min - hand min"), ("faults", "page faults/call")],
        mrows)
    print()
    for name in MAIN + DIAG:
        print(f"  {name:15s} {WHAT[name]}")
    print()
    for h in HIDDENS:
        r = results[h]
        for metric, stat, unit in (("time", "median", "wall median, max over ranks"),
                                   ("time", "min", "wall min, max over ranks"),
                                   ("cpu", "median", "CPU median, sum over ranks")):
            m = {k: v[metric][stat] for k, v in r.items() if isinstance(v, dict) and metric in v}
            line = (f"h={h} [{unit}]: parcomp/dtensor = {m['parcomp'] / m['dtensor']:.3f}, "
                    f"parcomp/hand = {m['parcomp'] / m['hand']:.3f}, "
                    f"parcomp/ref-1t = {m['parcomp'] / m['ref-1t']:.3f}, "
                    f"dtensor/hand = {m['dtensor'] / m['hand']:.3f}, "
                    f"ref-2t/ref-1t = {m['ref-2t'] / m['ref-1t']:.3f}; "
                    f"parcomp - hand = {m['parcomp'] - m['hand']:+.2f} ms, "
                    f"parcomp-nocomm - hand-nocomm = {m['parcomp-nocomm'] - m['hand-nocomm']:+.2f} ms, "
                    f"hand - hand-nocomm = {m['hand'] - m['hand-nocomm']:+.2f} ms, "
                    f"parcomp-pinned/parcomp = {m['parcomp-pinned'] / m['parcomp']:.3f}, "
                    f"parcomp-tuned/parcomp-pinned = {m['parcomp-tuned'] / m['parcomp-pinned']:.3f}, "
                    f"parcomp-tuned/hand = {m['parcomp-tuned'] / m['hand']:.3f}")
            if "parcomp-torchrun" in m:
                line += f"; torchrun --bench {stat} {m['parcomp-torchrun']:.2f} ms"
            print(line)
        coll = ", ".join(f"{k} over {a} ({ph}, {b} B)" for k, a, ph, b in r["_collectives_in_report"])
        pcoll = ", ".join(f"{k} over {a} ({ph}, {b} B)" for k, a, ph, b in r["_collectives_in_pinned_report"])
        print(f"       compile+emit {r['_compile_s']:.2f} s; report collectives: {coll}; pinned: {pcoll}; "
              f"{r['_n_steps']} steps per variant, reference weights moved by up to "
              f"{r['_ref_param_change']:.2e}")
    print(f"parcomp-tuned = program_pinned.py with these edits (bench/tp_mlp_train.py:tune_program): "
          f"{'; '.join(f'h={h}: ' + ', '.join(results[h]['_tuned_edits']) for h in HIDDENS)}")
    print(f"total {time.perf_counter() - t_start:.0f} s; load avg at the end {C.loadavg()}")
    results["_env"]["loadavg_end"] = C.loadavg()
    C.dump_json(results)


if __name__ == "__main__":
    main()
