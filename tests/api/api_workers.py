"""What each gloo rank runs in tests/api (through gloo_ranks.run_ranks)."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

import parcomp
import parcomp.errors

MLP_TP = """mesh tp=2
0.weight colwise
2.weight rowwise
input  input replicated
output output replicated
"""

MLP_DP_TP = """mesh dp=2 tp=2
0.weight colwise over tp
2.weight rowwise over tp
input  input [S(0), R]
output output [S(0), R]
"""

GPT2_TP = """mesh tp=2
transformer.h.*.attn.c_attn.weight  colwise
transformer.h.*.attn.c_proj.weight  rowwise
transformer.h.*.mlp.c_fc.weight     colwise
transformer.h.*.mlp.c_proj.weight   rowwise
"""

GPT2_DP_TP = """mesh dp=2 tp=2
transformer.h.*.attn.c_attn.weight  colwise over tp
transformer.h.*.attn.c_proj.weight  rowwise over tp
transformer.h.*.mlp.c_fc.weight     colwise over tp
transformer.h.*.mlp.c_proj.weight   rowwise over tp
input input_ids [S(0), R]
output logits [S(0), R]
"""

LLAMA_HEAD_TP = """mesh tp=2
model.embed_tokens.weight  [S(0)]
model.layers.*.self_attn.q_proj.weight  colwise
model.layers.*.self_attn.k_proj.weight  colwise
model.layers.*.self_attn.v_proj.weight  colwise
model.layers.*.self_attn.o_proj.weight  rowwise
lm_head.weight  colwise
"""

SPECS = {"tp": MLP_TP, "dp_tp": MLP_DP_TP, "gpt2_tp": GPT2_TP, "gpt2_dp_tp": GPT2_DP_TP,
         "llama_head_tp": LLAMA_HEAD_TP}


def tiny_gpt2():
    """transformers' GPT2LMHeadModel, 2 blocks, n_embd 32, vocab 101, tied embeddings, no dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=101, n_positions=16, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, use_cache=False,
                        attn_implementation="sdpa")
    return GPT2LMHeadModel(config).eval()


def tiny_llama_odd_vocab():
    """transformers' LlamaForCausalLM, 1 block, hidden 32, vocab 97 (tp=2 pads it to 98), untied lm_head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1, pad_token_id=None, use_cache=False,
                         attn_implementation="sdpa", tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


LMS = {"gpt2": (tiny_gpt2, 101), "llama_odd_vocab": (tiny_llama_odd_vocab, 97)}


def _lm_batches(steps, batch=4, seq=8, vocab=101):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def train_lm_equal(rank, world, spec="gpt2_tp", steps=3, cache_dir=None, clip=None, lm="gpt2"):
    """train_equal for a tiny LM (``LMS``): cross-entropy on its logits, AdamW, 3 steps."""
    text = SPECS[spec]
    make, vocab = LMS[lm]
    model = make()
    ref = copy.deepcopy(model)
    batches = _lm_batches(steps, vocab=vocab)

    def loss_of(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses, ref_norms, norms, ref_grads, grad_err = [], [], [], None, None
    for ids, labels in batches:
        loss = loss_of(ref(ids).logits, labels)
        loss.backward()
        ref_grads = ref_grads or {k: p.grad.clone() for k, p in ref.named_parameters()}
        if clip:
            ref_norms.append(nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    par = parcomp.parallelize(model, (batches[0][0],), text, cache_dir=cache_dir)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    dp, coord = _dp_coord(text, rank)
    losses = []
    for ids, labels in batches:
        loss = loss_of(par(ids.chunk(dp)[coord])["logits"], labels.chunk(dp)[coord])
        loss.backward()
        if grad_err is None:  # the first step's gradients, before clipping: the scale is seen here
            full = par.full_grads()
            grad_err = max(((full[k] - g).abs().max() / g.abs().max()).item() for k, g in ref_grads.items()
                           if k in full)
        if clip:
            norms.append(par.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    full = par.full_state_dict()
    param_err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items() if k in full)
    return {"ref_losses": ref_losses, "losses": losses, "param_err": param_err,
            "loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
            "grad_err": grad_err, "norm_err": max((abs(a - b) / a for a, b in zip(ref_norms, norms)), default=0.0), "norms": norms,
            "compared": len([k for k in ref.state_dict() if k in full]), "params": len(ref.state_dict()),
            "output_layouts": par.output_layouts(),
            "shapes": {k: list(v.shape) for k, v in full.items()}}


def small_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))


def _batches(steps, batch=4, seq=3, width=16):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, seq, width, generator=g), torch.randn(batch, seq, width, generator=g))
            for _ in range(steps)]


def _dp_coord(spec_text, rank):
    """(dp size, this rank's dp coordinate) for a spec whose mesh is ``dp=D tp=T`` or ``tp=T``."""
    mesh = dict(kv.split("=") for kv in spec_text.splitlines()[0].split()[1:])
    dp, tp = int(mesh.get("dp", 1)), int(mesh.get("tp", 1))
    return dp, rank // tp


def train_equal(rank, world, spec="tp", steps=3, cache_dir=None, clip=None):
    """3 AdamW steps of the unsharded MLP and of parcomp.parallelize(MLP), from the same start:
    max abs differences of losses and of the final parameters."""
    text = SPECS[spec]
    model = small_mlp()
    ref = copy.deepcopy(model)
    batches = _batches(steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses, ref_norms, norms, ref_grads, grad_err = [], [], [], None, None
    for x, t in batches:
        loss = nn.functional.mse_loss(ref(x), t)
        loss.backward()
        ref_grads = ref_grads or {k: p.grad.clone() for k, p in ref.named_parameters()}
        if clip:
            ref_norms.append(nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    par = parcomp.parallelize(model, (batches[0][0],), text, cache_dir=cache_dir)
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    dp, coord = _dp_coord(text, rank)
    losses = []
    for x, t in batches:
        xl, tl = x.chunk(dp)[coord], t.chunk(dp)[coord]
        loss = nn.functional.mse_loss(par(xl), tl)
        loss.backward()
        if grad_err is None:  # the first step's gradients, before clipping: the scale is seen here
            full = par.full_grads()
            grad_err = max(((full[k] - g).abs().max() / g.abs().max()).item() for k, g in ref_grads.items()
                           if k in full)
        if clip:
            norms.append(par.clip_grad_norm_(clip).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    # every tp rank of a dp group holds the same loss: the mean over ranks is the mean over dp
    full = par.full_state_dict()
    param_err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return {"ref_losses": ref_losses, "losses": losses, "param_err": param_err,
            "loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
            "grad_err": grad_err, "norm_err": max((abs(a - b) / a for a, b in zip(ref_norms, norms)), default=0.0), "norms": norms,
            "from_cache": par.from_cache, "fingerprint": par.fingerprint}


def options(rank, world, cache_dir=None):
    """input_grads=True: the input's gradient equals torch's; gather_outputs=True: a split
    output comes back whole; an input needing grad without input_grads is a clear error."""
    model = small_mlp()
    x = torch.randn(4, 3, 16)
    xr = x.clone().requires_grad_(True)
    model(xr).pow(2).sum().backward()
    par = parcomp.parallelize(model, (x,), MLP_TP, input_grads=True, cache_dir=cache_dir)
    xp = x.clone().requires_grad_(True)
    par(xp).pow(2).sum().backward()
    split = MLP_TP.replace("output output replicated", "output output split-hidden")
    local = parcomp.parallelize(model, (x,), split, cache_dir=cache_dir)
    whole = parcomp.parallelize(model, (x,), split, gather_outputs=True, cache_dir=cache_dir)
    with torch.no_grad():
        want = model(x)
        got_local, got_whole = local(x), whole(x)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    planned = parcomp.parallelize(model, (x,), (plan, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))),
                                  cache_dir=cache_dir)
    with torch.no_grad():
        plan_err = (planned(x) - want).abs().max().item()
    try:
        local(x.clone().requires_grad_(True))
        refused = ""
    except parcomp.errors.ParcompError as e:
        refused = str(e)
    try:  # another batch size than compiled: a located error, not the program's reshape error
        local(x[:2])
        other_batch = ""
    except parcomp.errors.ParcompError as e:
        other_batch = str(e)
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        local.eval()
    return {"x_grad_err": (xp.grad - xr.grad).abs().max().item(), "other_batch": other_batch,
            "eval_warned": [str(w.message) for w in caught],
            "local_shape": list(got_local.shape), "layouts": [local.output_layouts(), whole.output_layouts()],
            "whole_err": (got_whole - want).abs().max().item(),
            "local_err": (got_local - want.chunk(2, -1)[rank]).abs().max().item(), "refused": refused,
            "plan_err": plan_err, "plan_layouts": planned.layouts()}


def train_dtensor_equal(rank, world, spec="tp", steps=3, cache_dir=None, clip=0.05, ckpt_dir=None):
    """parallelize(..., dtensor=True): stock AdamW and torch.nn.utils.clip_grad_norm_ on the
    DTensor parameters for 3 steps, against the unsharded loop; then a torch.distributed.checkpoint
    save of the model's and the optimizer's state, the parameters overwritten, and a load back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.tensor import DTensor

    text = SPECS[spec]
    model = small_mlp()
    ref = copy.deepcopy(model)
    batches = _batches(steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses, ref_norms = [], []
    for x, t in batches:
        loss = nn.functional.mse_loss(ref(x), t)
        loss.backward()
        ref_norms.append(nn.utils.clip_grad_norm_(ref.parameters(), clip).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())

    par = parcomp.parallelize(model, (batches[0][0],), text, cache_dir=cache_dir, dtensor=True)
    placements = {k: [str(p) for p in v.placements] for k, v in par.named_parameters()}
    all_dtensors = all(isinstance(v, DTensor) for v in par.state_dict().values())
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2, weight_decay=0.1)
    dp, coord = _dp_coord(text, rank)
    losses, norms = [], []
    for x, t in batches:
        loss = nn.functional.mse_loss(par(x.chunk(dp)[coord]), t.chunk(dp)[coord])
        loss.backward()
        grads_are_dtensors = all(isinstance(p.grad, DTensor) for p in par.parameters())
        norms.append(nn.utils.clip_grad_norm_(par.parameters(), clip).item())
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    full = {k: v.full_tensor() for k, v in par.state_dict().items()}
    param_err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())

    # checkpoint round trip: model and optimizer state through torch.distributed.checkpoint
    model_sd, optim_sd = get_state_dict(par, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
    saved_exp_avg = {k: v.full_tensor().clone() for k, v in opt.state_dict()["state"][0].items()
                     if isinstance(v, DTensor)}
    with torch.no_grad():
        for p in par.parameters():
            p.zero_()
        for st in opt.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor) and v.is_floating_point():
                    v.zero_()
    zeroed = max(p.full_tensor().abs().max().item() for p in par.parameters())
    model_sd, optim_sd = get_state_dict(par, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(par, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded = {k: v.full_tensor() for k, v in par.state_dict().items()}
    load_err = max((loaded[k] - full[k]).abs().max().item() for k in full)
    state_err = max((opt.state_dict()["state"][0][k].full_tensor() - v).abs().max().item()
                    for k, v in saved_exp_avg.items())
    from torch.distributed.device_mesh import init_device_mesh

    try:  # a DeviceMesh whose dims are not the spec's
        parcomp.parallelize(model, (batches[0][0],), text, cache_dir=cache_dir,
                            dtensor=init_device_mesh("cpu", (world,), mesh_dim_names=("x",)))
        wrong_mesh = ""
    except parcomp.errors.ParcompError as e:
        wrong_mesh = str(e)
    return {"ref_losses": ref_losses, "losses": losses, "param_err": param_err,
            "loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
            "norm_err": max(abs(a - b) / a for a, b in zip(ref_norms, norms)), "norms": norms,
            "placements": placements, "all_dtensors": all_dtensors, "grads_are_dtensors": grads_are_dtensors,
            "zeroed": zeroed, "load_err": load_err, "state_err": state_err, "state_keys": sorted(saved_exp_avg),
            "wrong_mesh": wrong_mesh}


TRAIN_LINE = "train loss=mse optimizer=adamw(lr=1e-2, weight_decay=0.1) clip_grad_norm=0.05\n"


def train_step_equal(rank, world, spec="tp", steps=3, cache_dir=None):
    """par.train_step: the spec's train line (mse, AdamW, clipping) run as one compiled step for 3
    steps, against torch's unsharded loop; and a spec without a train line refused."""
    text = SPECS[spec] + TRAIN_LINE
    model = small_mlp()
    ref = copy.deepcopy(model)
    batches = _batches(steps)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for x, t in batches:
        loss = nn.functional.mse_loss(ref(x), t)
        loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    par = parcomp.parallelize(model, (batches[0][0],), text, cache_dir=cache_dir)
    dp, coord = _dp_coord(text, rank)
    losses = [par.train_step(x.chunk(dp)[coord], target=t.chunk(dp)[coord]).item() for x, t in batches]
    full = par.full_state_dict()
    param_err = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    with torch.no_grad():  # the module's forward sees the trained parameters
        fwd_err = (par(batches[0][0].chunk(dp)[coord]) - ref(batches[0][0]).chunk(dp)[coord]).abs().max().item()
    try:
        par.train_step(batches[0][0].chunk(dp)[coord])
        missing = ""
    except parcomp.errors.ParcompError as e:
        missing = str(e)
    plain = parcomp.parallelize(model, (batches[0][0],), SPECS[spec], cache_dir=cache_dir)
    try:
        plain.train_step(batches[0][0].chunk(dp)[coord], target=batches[0][1].chunk(dp)[coord])
        no_line = ""
    except parcomp.errors.ParcompError as e:
        no_line = str(e)
    return {"ref_losses": ref_losses, "losses": losses, "param_err": param_err, "fwd_err": fwd_err,
            "loss_err": max(abs(a - b) for a, b in zip(ref_losses, losses)),
            "state": sorted(par.train_state()), "missing": missing, "no_line": no_line}


def loss_parallel_equal(rank, world, cache_dir=None):
    """The DTensor tutorial's Llama plan with lm_head ColwiseParallel(Shard(-1)) and loss_parallel:
    the logits come back split over the vocabulary, par.cross_entropy (no gather) equals torch's
    cross entropy of the unsharded model, and so do the gradients."""
    import sys
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "specs"))
    from models import llama_lm
    from test_dtensor_plan import TP_PLAN

    model, (ids,), _ = llama_lm()
    labels = torch.randint(0, 128, ids.shape, generator=torch.Generator().manual_seed(3))
    labels[0, :3] = -100  # ignored tokens
    ref = copy.deepcopy(model)
    want = nn.functional.cross_entropy(ref(ids).logits.flatten(0, 1), labels.flatten())
    want.backward()
    plan = {**TP_PLAN, "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
            "loss_parallel": loss_parallel}
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    par = parcomp.parallelize(model, (ids,), (plan, mesh), cache_dir=cache_dir)
    logits = par(ids)["logits"]
    loss = par.cross_entropy(logits, labels)
    loss.backward()
    grads = par.full_grads()
    grad_err = max(((grads[k] - p.grad).abs().max() / p.grad.abs().max()).item()
                   for k, p in ref.named_parameters() if k in grads)
    return {"layout": par.output_layouts()["logits"], "local_shape": list(logits.shape),
            "loss": loss.item(), "want": want.item(), "grad_err": grad_err,
            "compared": len([k for k, _ in ref.named_parameters() if k in grads])}


def moe_lm_synced_equal(rank, world, cache_dir=None):
    """transformers' Mixtral (specs/models.py:mixtral_lm) under specs/mixtral_lm_ep2_train.pcs
    with the default ``sync_module_states=True``: rank 1 starts from other weights, so the
    logits and gradients equal the unsharded model's only if rank 0's weights reach it."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "specs"))
    import models

    model, (ids,), _ = models.mixtral_lm()
    ref = copy.deepcopy(model)
    if rank != 0:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    labels = torch.randint(0, 64, ids.shape, generator=torch.Generator().manual_seed(1))

    def loss_of(logits, labels):
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))

    ref_logits = ref(ids).logits
    loss_of(ref_logits, labels).backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}
    par = parcomp.parallelize(model, (ids,), str(root / "specs" / "mixtral_lm_ep2_train.pcs"), cache_dir=cache_dir)
    logits = par(ids.chunk(world)[rank])["logits"]  # the spec names no output: [R], every row
    loss_of(logits, labels).backward()
    full = par.full_grads()
    return {"logits_err": (logits - ref_logits).abs().max().item(), "layouts": par.output_layouts(),
            "grad_err": max(((full[k] - g).abs().max() / g.abs().max()).item() for k, g in ref_grads.items()
                            if k in full),
            "compared": len([k for k in ref_grads if k in full]), "params": len(ref_grads)}
