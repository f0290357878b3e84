"""A torchtitan-style training loop over ``parcomp.parallelize``: transformers' GPT-2 (a tiny
config), AdamW, warmup + cosine learning rate, gradient clipping, a checkpoint every N steps
(resumed from the latest), loss and throughput logged.

    torchrun --nproc-per-node 2 examples/train_loop.py --steps 8                  # tp=2
    torchrun --nproc-per-node 4 examples/train_loop.py --mesh dp=2,tp=2 --steps 8 # dp=2 x tp=2
    torchrun --nproc-per-node 2 examples/train_loop.py --spec my.pcs              # your own spec

On CPUs it runs on gloo (``--backend nccl`` on GPUs). Every rank builds the same model; parcomp
compiles it once (rank 0; cached in ``$PARCOMP_CACHE_DIR`` or ``~/.cache/parcomp``) and each rank
keeps its own shards. Each rank reads only its data-parallel share of each batch.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import parcomp


def tp_spec(mesh: dict) -> str:
    """Megatron's GPT-2 plan: attention and MLP column -> row parallel over tp; the batch split
    over dp."""
    over = " over tp" if len(mesh) > 1 else ""
    lines = ["mesh " + " ".join(f"{a}={s}" for a, s in mesh.items()),
             f"transformer.h.*.attn.c_attn.weight  colwise{over}",
             f"transformer.h.*.attn.c_proj.weight  rowwise{over}",
             f"transformer.h.*.mlp.c_fc.weight     colwise{over}",
             f"transformer.h.*.mlp.c_proj.weight   rowwise{over}"]
    if "dp" in mesh:
        lines += ["input input_ids [S(0), R]", "output logits [S(0), R]"]
    return "\n".join(lines) + "\n"


def build_model(vocab: int, seq: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # every rank builds the same weights (parallelize also starts from rank 0's)
    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()  # eval: no dropout (parcomp's mask is not torch's)


class TokenData(torch.utils.data.Dataset):
    """A map-style dataset of (input_ids, labels) rows: random tokens (a stand-in for yours)."""

    def __init__(self, rows: int, seq: int, vocab: int, seed: int = 1):
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (rows, seq + 1), generator=g)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def local_batches(data, global_batch: int, dp: int, dp_rank: int):
    """This rank's share of each global batch: rows [dp_rank * b, (dp_rank + 1) * b) of it."""
    per = global_batch // dp
    step = 0
    while True:
        start = (step * global_batch) % (len(data) - global_batch + 1)
        rows = range(start + dp_rank * per, start + (dp_rank + 1) * per)
        ids, labels = zip(*(data[i] for i in rows))
        yield torch.stack(ids), torch.stack(labels)
        step += 1


def lr_lambda(warmup: int, total: int):
    def factor(step):  # linear warmup, then cosine to 10%
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))
    return factor


def save(path, step, model, opt, sched):
    """Each rank writes its own shards and optimizer state: ``step-N/rank{r}.pt``."""
    folder = os.path.join(path, f"step-{step}")
    os.makedirs(folder, exist_ok=True)
    torch.save({"step": step, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "scheduler": sched.state_dict()}, os.path.join(folder, f"rank{dist.get_rank()}.pt.tmp"))
    os.replace(os.path.join(folder, f"rank{dist.get_rank()}.pt.tmp"), os.path.join(folder, f"rank{dist.get_rank()}.pt"))
    dist.barrier()


def resume(path, model, opt, sched) -> int:
    """The step after the latest checkpoint every rank wrote (0: none)."""
    done = [d for d in glob.glob(os.path.join(path, "step-*"))
            if len(glob.glob(os.path.join(d, "rank*.pt"))) == dist.get_world_size()]
    if not done:
        return 0
    latest = max(done, key=lambda d: int(d.rsplit("-", 1)[1]))
    state = torch.load(os.path.join(latest, f"rank{dist.get_rank()}.pt"), weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state["step"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mesh", default=None, help="dp=2,tp=2 (default: tp=WORLD_SIZE)")
    ap.add_argument("--spec", default=None, help="a .pcs file (default: Megatron's GPT-2 plan on --mesh)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-norm", type=float, default=1.0)
    ap.add_argument("--ckpt-dir", default="checkpoints")
    ap.add_argument("--ckpt-every", type=int, default=4)
    ap.add_argument("--backend", default="gloo")
    args = ap.parse_args()

    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=300))
    try:
        world = dist.get_world_size()
        mesh = (dict((k, int(v)) for k, v in (kv.split("=") for kv in args.mesh.split(",")))
                if args.mesh else {"tp": world})
        model = build_model(args.vocab, args.seq)
        example = (torch.zeros(args.batch, args.seq, dtype=torch.long),)  # global shapes
        par = parcomp.parallelize(model, example, args.spec or tp_spec(mesh))
        dp, dp_rank = par.mesh.get("dp", 1), par.coords.get("dp", 0)
        opt = torch.optim.AdamW(par.parameters(), lr=args.lr, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
        start = resume(args.ckpt_dir, par, opt, sched)
        if dist.get_rank() == 0:
            print(f"mesh {par.mesh}; {'cached' if par.from_cache else 'compiled'} program {par.fingerprint}; "
                  f"starting at step {start + 1}", flush=True)
        data = local_batches(TokenData(64, args.seq, args.vocab), args.batch, dp, dp_rank)
        for _ in range(start):  # the batches the resumed steps already read
            next(data)
        for step in range(start + 1, args.steps + 1):
            t0 = time.perf_counter()
            ids, labels = next(data)
            logits = par(ids)["logits"]
            loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            loss.backward()
            norm = par.clip_grad_norm_(args.max_norm)  # the norm of the unsharded gradients
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            seconds = time.perf_counter() - t0
            if dist.get_rank() == 0:
                print(f"step {step:4d}  loss {mean.item():.4f}  grad_norm {norm.item():.3f}  "
                      f"lr {lr:.2e}  {args.batch * args.seq / seconds:,.0f} tokens/s", flush=True)
            if step % args.ckpt_every == 0 or step == args.steps:
                save(args.ckpt_dir, step, par, opt, sched)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
