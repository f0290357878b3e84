"""GPT-2-style block, forward + backward step, TP=2 and TP+SP on 2 gloo ranks:
parcomp's emitted ``train_step`` vs DTensor and hand-written Megatron (torch.distributed).

Block (the anchor's, ``shared/anchors/bench/tp_sp_block.py``): ``x = x + o(attn(ln1(x)))``;
``x = x + fc2(gelu(fc1(ln2(x))))``, separate q/k/v Linears, 4 heads, causal sdpa, fp32,
tokens B x S. A step: zero grads, forward, ``loss = (block(x) * dy).sum()``, backward (for SP
also the all_reduce that completes the replicated params' gradients), the optimizer update,
read ``x.grad``. Every variant updates its parameters with the same optimizer (``--optimizer
sgd`` (default) or ``adamw``, lr=0: the update runs in full but leaves the weights as they were,
so every step does the same work): parcomp's is the spec's ``train`` line, hand-written and
DTensor's the ``torch.optim`` optimizer a user would write, ``foreach=True`` (torch's default on
GPU; on CPU torch's default is the per-tensor loop, which is slower). Every variant computes
``x.grad`` and no ``dy.grad`` (parcomp: ``input_grads=x``; torch: only ``x`` requires grad),
and the step's loss: under SP each rank's ``(y * dy).sum()`` covers its sequence slice, so
parcomp's step all_reduces the scalar (its ``loss`` output), and hand-sp / dtensor-sp do the
same (``--local-loss``: they keep their rank's partial loss, as the anchor's step did).

Variants:
  parcomp-tp    program.py's ``train_step`` for ``mesh tp=2`` + q,k,v,fc1 colwise, o,fc2
                rowwise, ``train loss=output optimizer=sgd(lr=0) input_grads=x``; x, dy
                replicated
  parcomp-sp    the same spec + ``sequence-parallel``; x, dy split along the sequence
  dtensor-tp    ``parallelize_module``, the tutorial plan (Colwise q,k,v,fc1; Rowwise o,fc2)
  dtensor-sp    torchtitan's plan: SequenceParallel norms, PrepareModuleInput, Rowwise(Shard(1))
  hand-tp       Megatron f/g autograd functions (all_reduce), local heads
  hand-sp       Megatron-SP: all_gather / reduce_scatter of the sequence, one coalesced
                all_reduce of the replicated params' gradients, one of the loss
  ref-1t        the unsharded block, one process, 1 thread

Each variant's x.grad and loss are compared with the unsharded block's (max |err|). Times: interleaved rounds (``_common.interleaved``), wall = max over ranks. Ratios
printed: parcomp / hand and parcomp / dtensor, TP and SP, of the wall median and of the CPU
time median (summed over the ranks; the trustworthy one on a shared machine), and the CPU
time's spread (25th-75th percentile) per variant.

Run:  .venv/bin/python bench/tp_block_train.py [--quick] [--hidden 256,1024] [--optimizer sgd|adamw]
      [--rounds R] [--input-grads x|yes] [--local-loss] [--json out.json] [--plain]
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402,I001  (sets the thread environment before torch is imported)

import copy  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tp_block_hand import HandBlock, dtensor_finalize, dtensor_plan, local  # noqa: E402

QUICK = "--quick" in sys.argv
B, S, NH = 8, 128, 4
HIDDENS = [int(h) for h in C.arg_value("--hidden", "256" if QUICK else "256,1024").split(",")]
ROUNDS = {256: (1, 2), 1024: (1, 1)} if QUICK else {256: (6, 4), 1024: (3, 3)}
if C.arg_value("--rounds"):
    ROUNDS = {h: (int(C.arg_value("--rounds")), per) for h, (_, per) in ROUNDS.items()}
OPTIMIZER = C.arg_value("--optimizer", "sgd")
# hand-sp / dtensor-sp all_reduce their loss as parcomp does (the step's loss); --local-loss: not
REDUCE_LOSS = "--local-loss" not in sys.argv
# parcomp's input_grads: x (as torch: only x requires grad); "yes" also computes dy.grad
INPUT_GRADS = C.arg_value("--input-grads", "x")
if OPTIMIZER not in ("sgd", "adamw"):
    sys.exit(f"--optimizer {OPTIMIZER}: sgd or adamw")
WARMUP = 1 if QUICK else 2
TP_RULES = ("mesh tp=2\n{sp}block.attn.q.weight colwise\nblock.attn.k.weight colwise\n"
            "block.attn.v.weight colwise\nblock.attn.o.weight rowwise\nblock.mlp.fc1.weight colwise\n"
            "block.mlp.fc2.weight rowwise\ninput x {lay}\ninput dy {lay}\n"
            "train loss=output optimizer={opt}(lr=0) input_grads={igrads}\n")
VARIANTS = ["ref-1t", "parcomp-tp", "dtensor-tp", "hand-tp", "parcomp-sp", "dtensor-sp", "hand-sp"]


class Attention(nn.Module):
    def __init__(self, h, nh):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(h, h) for _ in range(4))
        self.hd = h // nh

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]
        q = self.q(x).view(b, s, -1, self.hd).transpose(1, 2)
        k = self.k(x).view(b, s, -1, self.hd).transpose(1, 2)
        v = self.v(x).view(b, s, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, h, nh=NH):
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(h), Attention(h, nh), nn.LayerNorm(h), MLP(h)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Loss(nn.Module):
    """What parcomp compiles: the block and the step's loss ``(block(x) * dy).sum()``."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x, dy):
        return (self.block(x) * dy).sum()


def build_ref(h):
    torch.manual_seed(0)
    m = Block(h)
    with torch.no_grad():  # non-trivial LayerNorm affine params
        for ln in (m.norm1, m.norm2):
            ln.weight.add_(0.1 * torch.randn(h))
            ln.bias.add_(0.1 * torch.randn(h))
    return m


def make_inputs(h):
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, S, h, generator=g), torch.randn(B, S, h, generator=g)


def emit(h, directory):
    """program_tp.py and program_sp.py for the block; their compile reports."""
    from parcomp.compile.compiler import compile_graph
    from parcomp.frontends.torch.export import import_torch
    from parcomp.spec import parse_spec
    from parcomp_backends.torch import emit_program

    graph = import_torch(Loss(build_ref(h)), make_inputs(h), ["x", "dy"])
    reports = {}
    for kind, sp, lay in (("tp", "", "replicated"), ("sp", "sequence-parallel\n", "split-seq")):
        c = compile_graph(graph, parse_spec(TP_RULES.format(sp=sp, lay=lay, opt=OPTIMIZER, igrads=INPUT_GRADS), f"tp_block_{kind}.pcs"))
        with open(os.path.join(directory, f"program_{kind}.py"), "w", encoding="utf-8") as f:
            f.write(emit_program(c, "cpu", f"bench/tp_block_train.py h={h} {kind}"))
        reports[kind] = [(r["kind"], r["phase"]) for r in c.report["collectives"]]
    return reports


class ParcompStep:
    """The emitted train_step; its outputs hold loss, every .grad and x.grad."""

    def __init__(self, path, name, sd, x, dy):
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, path)
        self.prog = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.prog)
        self.prog.make_groups(C.PG_TIMEOUT_S)
        self.params = self.prog.load_params({f"block.{k}": v for k, v in sd.items()})
        self.inputs = self.prog.load_inputs({"x": x, "dy": dy})
        self.out, self.k = None, 0

    def __call__(self):
        self.k += 1
        if self.prog.STEP_INPUT:  # adamw's step number k (0-d float32), as program.py's main feeds it
            self.inputs[self.prog.STEP_INPUT] = torch.tensor(float(self.k))
        with torch.no_grad():
            self.out = self.prog.train_step(self.params, self.inputs)
            self.params = {**self.params, **{n: self.out[n] for n in self.prog.CARRIED}}
        self.out["x.grad"].reshape(-1)[0].item()


def torch_optimizer(params):
    """The update a user writes, the same as the parcomp spec's (lr=0, torch's other defaults).
    DTensor parameters and plain ones (the TP plan leaves the norms' unsharded) go in two
    param groups: one foreach call cannot mix them."""
    from torch.distributed.tensor import DTensor

    cls = torch.optim.AdamW if OPTIMIZER == "adamw" else torch.optim.SGD
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return cls([{"params": g} for g in groups if g], lr=0.0, foreach=True)


def make_step(model, x, dy, finalize=None, partial_loss=False):
    """One training step of ``model``; ``step.loss`` is the step's loss. ``partial_loss``: each
    rank's ``(y * dy).sum()`` covers its sequence slice (SP), so the loss, as parcomp's step
    returns it, is their sum: one all_reduce of the scalar, started after the forward and
    waited for at the end (as program.py does; Megatron reduces its reported loss each step)."""
    opt = torch_optimizer(list(model.parameters()))

    def step():
        opt.zero_grad(set_to_none=True)
        x.grad = None
        y = model(x)
        loss = (y * dy).sum()
        total = loss.detach().clone() if partial_loss and REDUCE_LOSS else loss.detach()
        work = dist.all_reduce(total, async_op=True) if partial_loss and REDUCE_LOSS else None
        loss.backward()
        if finalize is not None:
            finalize()
        opt.step()
        if work is not None:
            work.wait()
        x.grad.reshape(-1)[0].item()
        step.y, step.loss = y, total

    return step


def worker(rank, world, h, directory, rounds, per_round, warmup):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    torch.set_num_threads(1)
    x0, dy0 = make_inputs(h)
    ref = build_ref(h)
    sd = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    xr = x0.clone().requires_grad_(True)
    yr = ref(xr)
    yr.backward(dy0)
    ss = slice(rank * S // world, (rank + 1) * S // world)
    mesh = init_device_mesh("cpu", (world,))
    steps, errs = {}, {}
    for name in VARIANTS[1:]:
        sp = name.endswith("sp")
        x = (x0[:, ss] if sp else x0).clone().requires_grad_(True)
        dy = (dy0[:, ss] if sp else dy0).contiguous()
        if name.startswith("parcomp"):
            # program.py takes the full inputs and keeps its own slices
            step = ParcompStep(os.path.join(directory, f"program_{name[-2:]}.py"), f"pc_{name}_{h}", sd, x0, dy0)
        elif name.startswith("dtensor"):
            model = parallelize_module(build_ref(h), mesh, dtensor_plan(name[-2:]))
            step = make_step(model, x, dy, (lambda m=model: dtensor_finalize(m.parameters())) if sp else None, sp)
        else:
            model = HandBlock(build_ref(h), rank, world, sp)
            step = make_step(model, x, dy, model.finalize_grads if sp else None, sp)
        step()
        dx = step.out["x.grad"] if name.startswith("parcomp") else local(x.grad)
        loss = step.out["loss"] if name.startswith("parcomp") else local(step.loss)
        errs[name] = {"err_dx": C.max_abs(dx, xr.grad[:, ss] if sp else xr.grad),
                      "err_loss": C.max_abs(loss, (yr * dy0).sum()) if REDUCE_LOSS or not sp else "-",
                      "coll": C.count_collectives(step)}
        steps[name] = step
    ref_step = make_step(copy.deepcopy(build_ref(h)), x0.clone().requires_grad_(True), dy0)
    times = C.interleaved([("ref-1t", ref_step, 1)] + [(n, steps[n], None) for n in steps],
                          warmup, rounds, per_round)
    return {"times": times, "errs": errs}


def quartiles(ts):
    """25th and 75th percentile of ``ts`` (seconds) in ms."""
    q = statistics.quantiles(ts, n=4) if len(ts) > 1 else [ts[0]] * 3
    return q[0] * 1e3, q[2] * 1e3


def round_ratios(a, b, per_round):
    """Per round, median of ``a``'s steps over median of ``b``'s (the two ran in the same round)."""
    return [statistics.median(a[i:i + per_round]) / statistics.median(b[i:i + per_round])
            for i in range(0, len(a), per_round)]


def main():
    print(f"tp_block_train: GPT-2-style block, tokens {B}x{S}, {NH} heads, fp32, fwd+bwd+{OPTIMIZER} update "
          f"(lr=0), TP=2 on gloo; {C.env_line()}", flush=True)
    print(f"every variant: loss (block(x) * dy).sum() (SP: summed over the ranks{'' if REDUCE_LOSS else ', parcomp only'}), "
          f"backward, x.grad (no dy.grad), {OPTIMIZER} update of every "
          f"param (parcomp: the spec's train line; hand / dtensor / ref-1t: torch.optim."
          f"{'AdamW' if OPTIMIZER == 'adamw' else 'SGD'}(lr=0, foreach=True))", flush=True)
    rows, results = [], {}
    for h in HIDDENS:
        with tempfile.TemporaryDirectory(prefix=f"tp_block_h{h}_") as tmp:
            reports = emit(h, tmp)
            rounds, per_round = ROUNDS[h]
            per_rank = C.spawn(worker, 2, (h, tmp, rounds, per_round, WARMUP), deadline_s=600)
        res = per_rank[0]
        results[h] = {"reports": reports, **res}
        med = {n: C.stats_ms(res["times"][n]["wall"])["median"] for n in VARIANTS}
        for n in VARIANTS:
            t = C.stats_ms(res["times"][n]["wall"])
            e = res["errs"].get(n, {})
            rows.append({"h": h, "variant": n, "median": t["median"], "min": t["min"], "max": t["max"],
                         "cpu": C.stats_ms(res["times"][n]["cpu"])["median"],
                         "cpu_iqr": "{:.1f}-{:.1f}".format(*quartiles(res["times"][n]["cpu"])),
                         "vs_ref": t["median"] / med["ref-1t"],
                         "err_dx": max((pr["errs"][n]["err_dx"] for pr in per_rank), default=0.0) if e else "-",
                         "err_loss": e["err_loss"] if e else "-",
                         "c10d": C.fmt_counts(e.get("coll", {}).get("c10d", {})) if e else "-"})
        cpu = {n: C.stats_ms(res["times"][n]["cpu"])["median"] for n in VARIANTS}
        results[h]["ratios"] = {f"parcomp/{peer}-{k}": med[f"parcomp-{k}"] / med[f"{peer}-{k}"]
                                for k in ("tp", "sp") for peer in ("hand", "dtensor")}
        # CPU time summed over the ranks: not inflated when another process takes the core
        results[h]["cpu_ratios"] = {f"parcomp/{peer}-{k}": cpu[f"parcomp-{k}"] / cpu[f"{peer}-{k}"]
                                    for k in ("tp", "sp") for peer in ("hand", "dtensor")}
        # the same ratio round by round (the variants of one round ran back to back)
        results[h]["cpu_round_ratios"] = {
            f"parcomp/{peer}-{k}": round_ratios(res["times"][f"parcomp-{k}"]["cpu"],
                                                res["times"][f"{peer}-{k}"]["cpu"], ROUNDS[h][1])
            for k in ("tp", "sp") for peer in ("hand", "dtensor")}
    C.print_table("GPT-2 block fwd+bwd step (ms; wall = max over ranks)",
                  [("h", "hidden"), ("variant", "variant"), ("median", "median ms"), ("min", "min"),
                   ("max", "max"), ("cpu", "CPU ms (sum of ranks)"),
                   ("cpu_iqr", "CPU p25-p75"), ("vs_ref", "x ref-1t"), ("err_dx", "max|err| dx"), ("err_loss", "|err| loss"), ("c10d", "c10d ops/step")],
                  rows)
    for h in HIDDENS:
        r = results[h]
        print(f"h={h} wall: " + ", ".join(f"{k} = {v:.3f}" for k, v in r["ratios"].items()))
        print(f"h={h} CPU:  " + ", ".join(f"{k} = {v:.3f}" for k, v in r["cpu_ratios"].items()))
        print(f"h={h} CPU per round (median [min-max] of the rounds' median ratios): " + ", ".join(
            f"{k} = {statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for k, v in r["cpu_round_ratios"].items()))
        print(f"   parcomp collectives: TP {r['reports']['tp']}\n   SP {r['reports']['sp']}")
    C.dump_json(results)


if __name__ == "__main__":
    main()
