"""``--save`` / ``--resume`` of a pipelined ``program.py`` (text
printed by :mod:`parcomp_backends.torch.emit.pipeline` before :mod:`.pipeline_main`'s ``main``, which calls it).

The checkpoint is the non-pipelined program's (:mod:`.program_train`): a
torch.distributed.checkpoint directory ``DIR/step-K`` written as ``step-K.partial`` and
renamed once every rank has written its part, then ``DIR/latest`` replaced (one line
``step-K``).  Each rank gives DCP the CARRIED values (params and optimizer state) of the
stages it holds, under their own names: a value split inside the stage (``SPLITS``, tp) as a
DTensor of its full shape on the stage's inner mesh, any other as a plain tensor (ranks holding
the same value, dp replicas or the stages of a tied weight, write it once).  The keys are the
global names and shapes, so the checkpoint reads like one of the non-pipelined program (and
``parcomp export`` / ``dcp_to_torch_save`` read it); rank 0 adds ``stages.json``, which names
every stage's ranks and values.  Before the rename nothing in ``DIR`` changes.

Every wait of a step (a point-to-point slot, the tied and dp ``all_reduce``) says what it waits
for in ``FAULT["where"]`` (:mod:`.program_cluster`): every group's ``--timeout`` bounds it, and
a peer that exited or hung makes every rank stop with a line naming that wait and the peer.
"""

CHECKPOINT = '''
DEVICE_MESH = {}  # the stages' inner mesh (tp; dp too under zero=1), made by every rank when a value is split


def inner_mesh():
    """The device mesh of the axes inside a stage (COMM_AXES), made once by every rank."""
    if "mesh" not in DEVICE_MESH:
        DEVICE_MESH["mesh"] = device_mesh(tuple(a for a in COMM_AXES if "," not in a))
    return DEVICE_MESH["mesh"]


def as_global(local, splits):
    """This rank's block of a value split inside a stage as a DTensor of its full shape."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if len({dim for dim, _ in splits}) < len(splits):  # DTensor's order of two Shard(d) may not be ours
        fail(f"--save/--resume: a value split twice along one dim ({splits}) is not saved yet")
    shape = list(local.shape)
    for dim, axis in splits:
        shape[dim] *= MESH[axis]
    by_axis = dict((axis, dim) for dim, axis in splits)
    placements = [Shard(by_axis[a]) if a in by_axis else Replicate() for a in COMM_AXES if "," not in a]
    return DTensor.from_local(local, inner_mesh(), placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def carried_state(p, coord, step):
    """What this rank saves and loads: the CARRIED values of its stages, and ``step``."""
    if SPLITS:
        inner_mesh()  # every rank, in the same order, whatever its stages hold
    state = {k: as_global(p[k], SPLITS[k]) if SPLITS.get(k) else p[k]
             for t in STAGES[coord] for k in CARRIED[t]}
    return {**state, "step": torch.tensor(step)}


def stage_table():
    """``stages.json``: every (virtual) stage's ranks and the values it saves."""
    return {"format": "torch.distributed.checkpoint", "mesh": MESH, "stages": [
        {"stage": t, "ranks": [r for r in range(MESH_SIZE) if t in STAGES[coords(r)["pp"]]],
         "values": CARRIED[t]} for t in sorted(CARRIED)]}


def save_stages(path, p, coord, step):
    """Save this rank's CARRIED values and ``step`` to ``path``/step-<step> (atomic: written as
    step-<step>.partial with the checksums of its data files, renamed by rank 0 once every rank
    has written, then ``latest`` replaced)."""
    import json

    import torch.distributed.checkpoint as dcp

    final = os.path.join(path, f"step-{step}")
    dcp.save(carried_state(p, coord, step), checkpoint_id=final + ".partial")
    dist.barrier()
    write_checksums(final + ".partial")  # before the rename: a committed step always has them
    if RANK == 0:
        with open(os.path.join(final + ".partial", "stages.json"), "w") as f:
            f.write(json.dumps({**stage_table(), "step": step}, indent=1) + "\\n")
        os.rename(final + ".partial", final)
        with open(os.path.join(path, "latest.partial"), "w") as f:
            f.write(f"step-{step}\\n")
        os.replace(os.path.join(path, "latest.partial"), os.path.join(path, "latest"))
        print(f"saved step {step} to {final}", flush=True)
    dist.barrier()


def resume_stages(path, where, p, coord):
    """Load this rank's CARRIED values from the checkpoint ``where`` (the step directory of the
    --resume ``path``, checked by every rank first: program_train's resume_location; any mesh's
    program of this model may have saved it) into ``p``; the first step to run (saved step + 1)."""
    import torch.distributed.checkpoint as dcp

    state = carried_state(p, coord, 0)
    check_resume(path, where, state)
    try:
        dcp.load(state, checkpoint_id=where)
    except (Exception, dcp.api.CheckpointException) as e:  # BaseException: not an Exception
        fail(f"--resume {path}: cannot load {where} into this program: {dcp_failure(e)}")
    p.update({k: v.to_local() if hasattr(v, "to_local") else v for k, v in state.items() if k != "step"})
    return int(state["step"]) + 1
'''
