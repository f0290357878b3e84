"""The ``main`` of a pipelined ``program.py`` (printed by :mod:`parcomp_backends.torch.emit.pipeline`), as text."""

MAIN = '''
def coords(rank):
    """``{axis: coordinate}`` of a global rank (row-major, the last axis fastest)."""
    return dict(zip(MESH, mesh_coords(rank)))


def local_shard(t, splits):
    """This rank's block of a full tensor: ``splits`` = ``[(dim, axis), ...]`` of its layout."""
    for dim, axis in splits:
        t = t.chunk(MESH[axis], dim)[COORD[AXIS[axis]]]
    return t.contiguous()


def whole_value(t, splits):
    """The full tensor from this rank's block (an all_gather per split axis, every rank of
    the group calls it)."""
    for dim, axis in reversed(splits):
        t = all_gather(t, dim, axis)
    return t


def tag(m, direction, stage, j):
    """The p2p tag of value j of microbatch m to virtual stage ``stage``, direction 0
    forward, 1 backward."""
    return ((m * 2 + direction) * len(FORWARD) + stage) * 1000 + j


def send(tensors, peer, m, direction, stage):
    """``[(handle, peer), ...]``: the isends of ``tensors``, waited for before the update."""
    what = f"{('send_fwd', 'send_bwd')[direction]} of microbatch {m} for stage {stage} to rank {peer}"
    return [(waiting(what, dist.isend, t.contiguous(), peer, tag=tag(m, direction, stage, j)), peer)
            for j, t in enumerate(tensors)]


def recv(specs, peer, m, direction, stage):
    what = f"{('recv_fwd', 'recv_bwd')[direction]} of microbatch {m} for stage {stage} from rank {peer}"
    out = {}
    for j, (name, shape, dtype) in enumerate(specs):
        buf = torch.empty(shape, dtype=getattr(torch, dtype))
        waiting(what, dist.recv, buf, peer, tag=tag(m, direction, stage, j))
        out[name] = buf
    return out


def reduce_over(t, group, lines, rank, what):
    """``all_reduce`` of ``t`` (in place) over ``group``, the line of ``lines`` holding ``rank``."""
    ranks = next(r for r in lines if rank in r)
    waiting(f"the {what} all_reduce with ranks {ranks}", dist.all_reduce, t, group=group)


def setup(rank, timeout):
    """This rank's pp coordinate, dp coordinate and dp group; each group made by one call per
    rank (line_group), every collective on it waiting at most ``timeout`` seconds."""
    c = coords(rank)
    coord, d = c["pp"], c.get("dp", 0)
    make_groups(timeout)  # the groups of the axes inside a stage (tp): COMM_AXES
    dp_group = line_group(DP_GROUPS) if DP_GROUPS else None
    for i, lines in enumerate(TIED_SETS):  # tied weights: the ranks of the stages holding a copy
        group = line_group(lines)
        if group is not None:
            TIED_GROUP[i] = group
    if STATS:  # the stages' shares of the sums every update reads (clip_grad_norm)
        PP_GROUP[0] = line_group(PP_GROUPS)
    return coord, d, dp_group


def add_grads(sums, s, out):
    """Add stage ``s``'s parameter gradients of one microbatch to the step's sums."""
    for k in GRADS[s]:
        sums[k] = out[k] if k not in sums else sums[k] + out[k]


def step(rank, coord, d, dp_group, p, data):
    """One training step of this rank: its action list in order; the updated state (and the
    loss on the last stage).  An action names its virtual stage (the pp coordinate unless
    interleaved: STAGES[coord], the model chunks this rank holds)."""
    rows = MICRO_BATCH * MICROBATCHES

    def micro(m, s):
        lo = d * rows + m * MICRO_BATCH
        return {k: data[k][lo:lo + MICRO_BATCH] for k in BATCH_INPUTS[s]}

    stash, got, grads_in, grads_out, wstash, sums, handles, losses = {}, {}, {}, {}, {}, {}, [], []
    result = {}
    for kind, m, peer, s in ACTIONS[rank]:
        if kind == "recv_fwd":
            got[s, m] = recv(RECV[s], peer, m, 0, s)
        elif kind == "forward":
            stash[s, m] = FORWARD[s](p, {**micro(m, s), **got.pop((s, m), {})})
            if "loss" in stash[s, m]:
                losses.append(stash[s, m]["loss"])
        elif kind == "send_fwd":
            handles += send([stash[s, m][v] for v, _, _ in SEND[s]], peer, m, 0, s + 1)
        elif kind == "recv_bwd":
            grads_in[s, m] = recv([("grad." + v, sh, t) for v, sh, t in SEND[s]], peer, m, 1, s)
        elif kind in ("backward", "backward_input"):
            saved = {k[len("saved."):]: v for k, v in stash[s, m].items() if k.startswith("saved.")}
            inp = {**micro(m, s), **saved, **grads_in.pop((s, m), {})}
            if kind == "backward":
                del stash[s, m]
                out = BACKWARD[s](p, inp)
                add_grads(sums, s, out)
            else:  # ZB-H1: the input gradient now; W reads the stash and the output gradients
                out = BACKWARD_INPUT[s](p, inp)
                wstash[s, m] = {**inp, **{k[len("wstash."):]: v for k, v in out.items()
                                          if k.startswith("wstash.")}}
            grads_out[s, m] = [out["grad." + v] for v, _, _ in RECV[s]]
        elif kind == "backward_weight":
            del stash[s, m]
            add_grads(sums, s, BACKWARD_WEIGHT[s](p, wstash.pop((s, m))))
        elif kind == "send_bwd":
            handles += send(grads_out.pop((s, m)), peer, m, 1, s - 1)
        elif kind == "optimizer":
            for h, to in handles:
                waiting(f"a send to rank {to} (its wait)", h.wait)
            mine = sorted(sums)  # this rank's gradients, every chunk's (a param twice here: one sum)
            for k in mine:  # collectives reduce in place: a strided sum (a transpose's) is copied
                sums[k] = sums[k].contiguous()
            for k, i in TIED.get(coord, []):  # a tied weight: its stages' sum, before dp
                reduce_over(sums[k], TIED_GROUP[i], TIED_SETS[i], rank, "tied-weight")
            for k in mine:  # the gradient of the global batch: sum, then scale once
                if dp_group is not None:
                    reduce_over(sums[k], dp_group, DP_GROUPS, rank, "dp")
                sums[k] = sums[k] * SCALE
            agreed = {}  # clip_grad_norm's sum of squares: this rank's stages', then over pp
            for t in STAGES[coord]:
                for k, v in (STATS[t](p, sums).items() if t in STATS else ()):
                    agreed[k] = v if k not in agreed else agreed[k] + v
            for k in sorted(agreed):
                reduce_over(agreed[k], PP_GROUP[0], PP_GROUPS, rank, "pp")
            for t in STAGES[coord]:
                result.update(OPTIMIZER[t](p, {**sums, **agreed, "step": torch.tensor(STEP[0])}))
    if losses:
        loss = torch.stack(losses).sum()
        if dp_group is not None:
            reduce_over(loss, dp_group, DP_GROUPS, rank, "dp")
        result["loss"] = loss * SCALE
    return result


def count_arg(low):
    """An argparse type: a whole number from ``low`` to 1,000,000 (``--steps``, ``--bench``)."""
    def parse(text):
        n = int(text)  # argparse reports a ValueError as an invalid value
        if not low <= n <= 1_000_000:
            raise argparse.ArgumentTypeError(f"{text}: give {low} to 1_000_000")
        return n
    return parse


def check_tensors(found, want, what, path):
    """Exit 2 (every rank reads the same file, so every rank stops) unless ``found`` holds
    each name of ``want`` ({name: (full shape, dtype)}) with that shape and dtype; never casts."""
    if not isinstance(found, dict):
        fail(f"{what} file {path} holds a {type(found).__name__}, not a dict of named tensors")
    for name, (shape, dtype) in want.items():
        t = found.get(name)
        if not isinstance(t, torch.Tensor):
            near = difflib.get_close_matches(name, [str(k) for k in found], n=3) or sorted(map(str, found))[:8]
            fail(f"{what} {name!r} (full shape {shape}) is missing from {path}; it has: {', '.join(near)}")
        if list(t.shape) != shape:
            fail(f"{what} {name!r} in {path} has shape {list(t.shape)}, expected the full "
                 f"(unsharded) shape {shape}")
        if t.dtype != getattr(torch, dtype):
            fail(f"{what} {name!r} in {path} is {str(t.dtype).replace('torch.', '')}, compiled for "
                 f"{dtype}; convert the file (program.py never casts)")


def check_output(args):
    """Exit 2 unless ``--output``'s directory exists and no file it writes is one it reads."""
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        fail(f"--output {args.output}: its directory does not exist")
    reads = {os.path.realpath(f): flag for f, flag in ((args.checkpoint, "--checkpoint"),
             (args.input, "--input"), (__file__, "program.py"))}
    for t in range(len(FORWARD)):
        target = os.path.realpath(f"{args.output}.stage{t}")
        if target in reads:
            fail(f"--output {args.output}: it would write {args.output}.stage{t}, which is "
                 f"{reads[target]}; give another name")


def load_checked(args):
    """(full checkpoint dict, input dict), every name, shape and dtype checked, or exit 2."""
    check_output(args)
    sd = read_tensors(args.checkpoint, "checkpoint")
    constants = os.path.join(os.path.dirname(os.path.abspath(__file__)), "constants.safetensors")
    if os.path.isfile(constants):  # what parcomp computed at import, if the checkpoint lacks it
        from safetensors.torch import load_file

        sd = {**load_file(constants), **sd}
    check_tensors(sd, PARAM_SHAPES, "param", args.checkpoint)
    data = read_tensors(args.input, "input")
    check_tensors(data, INPUT_SHAPES, "input", args.input)
    return sd, data


def parse_args():
    """Command line (``--help``)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\\n")[0])
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--steps", type=count_arg(1), default=1, metavar="K",
                    help="training steps, each from the last one's state")
    ap.add_argument("--bench", type=count_arg(0), default=0, metavar="N",
                    help="then time N more steps (ms per step)")
    ap.add_argument("--save", metavar="DIR",
                    help="after the last step, save every stage's params and optimizer state and the "
                         "step number as a torch.distributed.checkpoint in DIR/step-K (atomic: "
                         "DIR/latest names it; DIR/step-K/stages.json names each stage's ranks)")
    ap.add_argument("--resume", metavar="DIR",
                    help="start from the checkpoint DIR/latest names: its params, optimizer state "
                         "and step; --steps more steps follow")
    ap.add_argument("--timeout", type=timeout_arg, default=TIMEOUT_S, metavar="S",
                    help=f"seconds a send, recv or collective may wait for the other ranks "
                         f"(default {TIMEOUT_S:g}): a rank that exited or hung stops every rank")
    return ap.parse_args()


def train(args, rank, coord, d, dp_group, p, data, first):
    """``--steps`` free-running steps numbered from ``first`` (updated params and state carry
    over in ``p``); the last step's result, with "losses".  A wait that fails (a peer that
    exited, or none answered within ``--timeout``) exits 2 naming the peer."""
    losses = []
    for k in range(first, first + args.steps):
        STEP[0] = float(k)
        try:
            result = step(rank, coord, d, dp_group, p, data)
        except RuntimeError as e:  # gloo: connection closed, or timed out
            if not WAITING:
                raise
            fail(peer_failure(k, e, args.timeout))
        losses += [result["loss"]] if "loss" in result else []
        p.update({q: result[q] for q in p if q in result})
    if losses:
        result["losses"] = torch.stack(losses)
    return result


def main():
    args = parse_args()
    if "WORLD_SIZE" not in os.environ or WORLD_SIZE != WORLD:
        fail(f"program compiled for mesh {MESH_TEXT} ({WORLD} ranks) but started with "
             f"WORLD_SIZE={os.environ.get('WORLD_SIZE', 'unset')}; run: torchrun "
             f"--nproc-per-node {WORLD} program.py --checkpoint ... --input ... --output ...")
    sd, data = load_checked(args)  # before any process group: a bad file stops every rank now
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    coord, d, dp_group = setup(rank, args.timeout)
    p = {k: local_shard(sd[k], SPLITS.get(k, [])) if k in sd else
         torch.zeros(STATE_SHAPES[k][0], dtype=getattr(torch, STATE_SHAPES[k][1]))
         for t in STAGES[coord] for k in PARAMS[t]}
    first = resume_stages(args.resume, p, coord) if args.resume else 1
    if args.save:  # before the first step: a save that cannot succeed is found now
        check_save(args.save, first + args.steps - 1)
    result = train(args, rank, coord, d, dp_group, p, data, first)
    if args.save:
        save_stages(args.save, p, coord, first + args.steps - 1)
    result = {k: whole_value(v, SPLITS.get(k, [])) for k, v in result.items()}
    if all(c == 0 for a, c in coords(rank).items() if a != "pp"):  # one rank per stage writes
        for t in STAGES[coord]:  # each (virtual) stage's file: this rank's outputs
            torch.save({k: v.detach().clone() for k, v in result.items()}, f"{args.output}.stage{t}")
    if args.bench:  # every step from the same state: the time of one step, not a trajectory
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.bench):
            step(rank, coord, d, dp_group, p, data)
        dist.barrier()
        if rank == 0:
            print(f"bench: {(time.perf_counter() - t0) * 1e3 / args.bench:.3f} ms per step")
    dist.barrier()
    dist.destroy_process_group()
'''
