"""Pipeline schedules as explicit per-stage action lists, and their simulator.

An action list says, in order, what one rank of a stage does in one training step:
``recv_fwd m`` (wait for microbatch m's activations from the previous stage),
``forward m``, ``send_fwd m``, ``recv_bwd m`` (wait for the gradient of what it sent),
``backward m``, ``send_bwd m``, and last ``optimizer`` (one update from the gradients
summed over all microbatches).  Sends do not block (``isend``); receives do.

* GPipe: every forward, then every backward (peak stash: all microbatches).
* 1F1B (PipeDream-flush, Megatron's default): stage s runs ``pp - 1 - s`` warm-up
  forwards, then alternates one forward and one backward, then drains the backwards
  (peak stash: ``pp - s`` microbatches).

Both have the bubble fraction ``(pp - 1) / (microbatches + pp - 1)`` when every stage
takes the same time.  :func:`simulate` runs the lists of all stages together before
anything is emitted: every send must meet its receive, nothing may wait forever, a
forward or backward must have its inputs; it measures the makespan, the bubble and the
peak number of stashed microbatches per stage.

* ZB-H1 (zero bubble, Qi et al. 2023, the schedule with 1F1B's memory): the backward is
  split into ``backward_input m`` (the gradient sent back; it alone is on the critical
  path) and ``backward_weight m`` (the parameter gradients, deferred into what would be
  bubble: stage s holds back up to ``s`` of them in the steady phase and runs one after
  each ``backward_input`` of the drain, the rest last).  With a backward twice a forward
  split evenly, its simulated bubble is the paper's ``(pp-1) / (3 microbatches + pp-1)``
  (:func:`analytic_bubble_zb_h1`), a third of 1F1B's idle time, at 1F1B's peak stash (the
  first stage's ``pp``; a microbatch counts until its weight gradients are made).  Both
  runtimes execute it: the stage's backward program is split in two
  (:mod:`.zb_split`), the weight gradient reading the stashed activations and output
  gradients.
* Interleaved 1F1B (:func:`interleaved`, virtual stages): each rank holds several model
  chunks; the simulator runs it over virtual stages (an action's ``chunk``), a chunk's
  forward taking ``1 / chunks`` of the stage's.  Both runtimes execute it: the model is
  cut into ``pp x chunks`` stages, virtual stage ``chunk * pp + rank`` on rank ``rank``.
"""
from __future__ import annotations

from dataclasses import dataclass

from parcomp.errors import ParcompError

__all__ = ["Action", "ScheduleError", "Simulation", "schedule", "simulate", "analytic_bubble",
           "rank_actions", "SCHEDULES", "analytic_bubble_zb_h1", "interleaved", "build", "analytic",
           "p2p_slots"]

KINDS = ("recv_fwd", "forward", "send_fwd", "recv_bwd", "backward", "send_bwd", "optimizer",
         "backward_input", "backward_weight")
SCHEDULES = ("gpipe", "1f1b", "zb-h1")  # what :func:`schedule` builds; :func:`interleaved` the fourth


@dataclass(frozen=True)
class Action:
    """One step of an action list: ``kind`` (one of :data:`KINDS`), microbatch ``micro``
    (None for ``optimizer``), ``peer``: the stage (or, in :func:`rank_actions`, the
    rank) sent to or received from, None for compute; ``chunk``: the model chunk of this
    rank it acts for (virtual stage ``chunk * pp + stage``; 0 but in interleaved 1F1B)."""

    kind: str
    micro: int | None = None
    peer: int | None = None
    chunk: int = 0  # interleaved 1F1B: which of the rank's model chunks (virtual stages)

    def __str__(self) -> str:
        if self.kind == "optimizer":
            return "optimizer"
        arrow = {"recv_fwd": " <- ", "recv_bwd": " <- ", "send_fwd": " -> ", "send_bwd": " -> "}
        return f"{self.kind} m={self.micro}" + (f" c={self.chunk}" if self.chunk else "") + \
            (f"{arrow[self.kind]}{self.peer}" if self.peer is not None else "")


class ScheduleError(ParcompError):
    """An action list that cannot run: ``rank`` and ``step`` (0-based) say where."""

    def __init__(self, message: str, rank: int, step: int):
        self.rank, self.step = rank, step
        super().__init__(message, where=f"rank {rank} step {step}")


def _forward(s, m, pp) -> list:
    return ([Action("recv_fwd", m, s - 1)] if s else []) + [Action("forward", m)] + \
           ([Action("send_fwd", m, s + 1)] if s < pp - 1 else [])


def _backward(s, m, pp) -> list:
    return ([Action("recv_bwd", m, s + 1)] if s < pp - 1 else []) + [Action("backward", m)] + \
           ([Action("send_bwd", m, s - 1)] if s else [])


def schedule(name: str, pp: int, micro: int) -> tuple:
    """The action list of every stage (a tuple of tuples of :class:`Action`, stage order)
    for schedule ``name`` (one of :data:`SCHEDULES`)."""
    out = []
    for s in range(pp):
        if name == "gpipe":
            acts = [a for m in range(micro) for a in _forward(s, m, pp)]
            acts += [a for m in range(micro) for a in _backward(s, m, pp)]
        elif name == "1f1b":
            warm = min(pp - 1 - s, micro)
            acts = [a for m in range(warm) for a in _forward(s, m, pp)]
            for m in range(warm, micro):
                acts += _forward(s, m, pp) + _backward(s, m - warm, pp)
            acts += [a for m in range(micro - warm, micro) for a in _backward(s, m, pp)]
        elif name == "zb-h1":
            acts = _zb_h1(s, pp, micro)
        else:
            raise ParcompError(f"unknown schedule {name!r}", where="schedule")
        out.append(tuple(acts + [Action("optimizer")]))
    return tuple(out)


def interleaved(pp: int, micro: int, chunks: int) -> tuple:
    """Interleaved 1F1B (Megatron's virtual pipeline): each rank holds ``chunks`` model
    chunks, virtual stage ``c * pp + rank``; microbatches go in groups of ``pp``, every
    chunk of a group forward before the next group, backwards in reverse chunk order;
    rank r warms up with ``2 (pp - r - 1) + (chunks - 1) pp`` chunk forwards (1F1B's
    ``pp - r - 1`` for one chunk: the lists are then 1F1B's).  One list per rank (peers are
    ranks; :class:`Action` ``chunk`` says which chunk).  Simulated bubble with equal chunks:
    ``(pp-1) / (chunks * micro + pp-1)``.

    Raises:
        ParcompError: ``micro`` not a multiple of ``pp`` (as Megatron requires)."""
    if micro % pp:
        raise ParcompError(f"interleaved 1F1B needs microbatches ({micro}) to be a multiple of "
                           f"pp ({pp})", where="microbatches")
    nvs, total = pp * chunks, micro * chunks

    def unit(k, backward):
        group, idx = divmod(k, pp * chunks)
        c = idx // pp
        return group * pp + idx % pp, (chunks - 1 - c if backward else c)

    out = []
    for r in range(pp):
        def fwd(k):
            m, c = unit(k, False)
            vs = c * pp + r
            return ([Action("recv_fwd", m, (r - 1) % pp, c)] if vs else []) + [Action("forward", m, None, c)] + \
                ([Action("send_fwd", m, (r + 1) % pp, c)] if vs < nvs - 1 else [])

        def bwd(k):
            m, c = unit(k, True)
            vs = c * pp + r
            return ([Action("recv_bwd", m, (r + 1) % pp, c)] if vs < nvs - 1 else []) + \
                [Action("backward", m, None, c)] + ([Action("send_bwd", m, (r - 1) % pp, c)] if vs else [])

        warm = min(2 * (pp - r - 1) + (chunks - 1) * pp if chunks > 1 else pp - r - 1, total)
        acts = [a for k in range(warm) for a in fwd(k)]
        for k in range(total - warm):
            acts += fwd(warm + k) + bwd(k)
        acts += [a for k in range(total - warm, total) for a in bwd(k)]
        out.append(tuple(acts + [Action("optimizer")]))
    return tuple(out)


def _zb_h1(s, pp, micro) -> list:
    """ZB-H1's list for stage ``s``: 1F1B's order with ``backward_input`` in place of the
    backward, weight gradients deferred (see the module docstring)."""
    def b_in(m):
        return ([Action("recv_bwd", m, s + 1)] if s < pp - 1 else []) + [Action("backward_input", m)] + \
               ([Action("send_bwd", m, s - 1)] if s else [])

    warm, lag, pending = min(pp - 1 - s, micro), s, []
    acts = [a for m in range(warm) for a in _forward(s, m, pp)]
    for m in range(warm, micro):
        acts += _forward(s, m, pp) + b_in(m - warm)
        pending.append(m - warm)
        if len(pending) > lag:
            acts.append(Action("backward_weight", pending.pop(0)))
    for m in range(micro - warm, micro):
        acts += b_in(m)
        pending.append(m)
        acts.append(Action("backward_weight", pending.pop(0)))
    return acts + [Action("backward_weight", m) for m in pending]


def analytic_bubble_zb_h1(pp: int, micro: int) -> float:
    """ZB-H1's idle fraction with a forward 1, input- and weight-gradient 1 each:
    (pp-1) / (3 micro + pp-1)."""
    return (pp - 1) / (3 * micro + pp - 1)


def analytic_bubble(pp: int, micro: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal stage times: (pp-1)/(micro+pp-1)."""
    return (pp - 1) / (micro + pp - 1)


@dataclass(frozen=True)
class Simulation:
    """What :func:`simulate` found.

    Attributes:
        order: ``(stage, step, Action)`` in an order the stages can run them.
        makespan: time of the whole step, in units of one microbatch's forward on one stage.
        busy: per stage, the time spent in forward and backward.
        bubble: idle fraction, ``1 - sum(busy) / (pp * makespan)``.
        peak_inflight: per stage, the most microbatches stashed at once (forward done,
            backward not).
        slots: per stage, the order its sends and receives run in (:func:`p2p_slots`).
    """

    order: tuple
    makespan: float
    busy: tuple
    bubble: float
    peak_inflight: tuple
    slots: tuple = ()


class _Rank:
    def __init__(self):
        self.pc, self.clock, self.done = 0, 0.0, set()
        self.inflight, self.peak, self.busy = set(), 0, 0.0


def simulate(actions, t_fwd=1.0, t_bwd=2.0) -> Simulation:
    """Run the action lists of all stages together (sends buffered, receives blocking).

    ``t_fwd`` / ``t_bwd``: the time of one microbatch's forward / backward, a number or
    one per stage.

    Raises:
        ScheduleError: naming the rank and step: a compute before its inputs arrived or a
            send of something not computed yet; a send no one receives; a receive that
            waits forever (deadlock: every blocked rank is named); a microbatch whose
            forward or backward is missing or repeated.
    """
    pp = len(actions)
    nvs = pp * (1 + max((a.chunk for acts in actions for a in acts), default=0))  # virtual stages
    tf = t_fwd if isinstance(t_fwd, (list, tuple)) else [t_fwd] * pp
    tb = t_bwd if isinstance(t_bwd, (list, tuple)) else [t_bwd] * pp
    ranks, sent, order = [_Rank() for _ in range(pp)], {}, []
    progress = True
    while progress:
        progress = False
        for s, r in enumerate(ranks):
            while r.pc < len(actions[s]) and _step(s, r, actions[s][r.pc], sent, tf[s] * pp / nvs,
                                                              tb[s] * pp / nvs, (pp, nvs)):
                order.append((s, r.pc, actions[s][r.pc]))
                r.pc += 1
                progress = True
    blocked = [(s, r.pc) for s, r in enumerate(ranks) if r.pc < len(actions[s])]
    if blocked:
        s, k = blocked[0]
        waits = "; ".join(f"rank {t} step {j} waits on {actions[t][j]}" for t, j in blocked)
        raise ScheduleError(f"deadlock: {waits}", s, k)
    if sent:
        (src, dst, kind, m, _), (_, step) = next(iter(sent.items()))
        raise ScheduleError(f"rank {src} step {step}: {kind} m={m} to rank {dst} is never "
                            f"received", src, step)
    _check_complete(actions, ranks)
    slots = p2p_slots(actions)
    makespan = max(r.clock for r in ranks)
    busy = tuple(r.busy for r in ranks)
    bubble = 1 - sum(busy) / (pp * makespan) if makespan else 0.0
    return Simulation(tuple(order), makespan, busy, bubble, tuple(r.peak for r in ranks), slots)


def _step(s, r, a, sent, tf, tb, sizes) -> bool:
    """Run action ``a`` of stage ``s`` if it can; False if it must wait (a receive).
    ``sizes``: (ranks, virtual stages); ``tf`` / ``tb``: one chunk's times."""
    k, (pp, nvs), mk = r.pc, sizes, (a.micro, a.chunk)
    vs = a.chunk * pp + s
    if a.kind in ("recv_fwd", "recv_bwd"):
        key = (a.peer, s, "send_" + a.kind[5:], a.micro, (vs - 1 if a.kind == "recv_fwd" else vs + 1) // pp)
        if key not in sent:
            return False
        r.clock = max(r.clock, sent.pop(key)[0])
        r.done.add((a.kind, mk))
    elif a.kind in ("send_fwd", "send_bwd"):
        need = "forward" if a.kind == "send_fwd" else "backward"
        if (need, mk) not in r.done and not (need == "backward" and ("backward_input", mk) in r.done):
            raise ScheduleError(f"rank {s} step {k}: {a} sends microbatch {a.micro} before its "
                                f"{need} ran", s, k)
        key = (s, a.peer, a.kind, a.micro, a.chunk)
        if key in sent:
            raise ScheduleError(f"rank {s} step {k}: {a} is sent twice", s, k)
        sent[key] = (r.clock, k)
    elif a.kind == "forward":
        if vs and ("recv_fwd", mk) not in r.done:
            raise ScheduleError(f"rank {s} step {k}: {a} runs before its activations were "
                                f"received (recv_fwd m={a.micro})", s, k)
        r.clock += tf
        r.busy += tf
        r.inflight.add(mk)
        r.peak = max(r.peak, len(r.inflight))
    elif a.kind in ("backward", "backward_input"):
        if ("forward", mk) not in r.done or (vs < nvs - 1 and ("recv_bwd", mk) not in r.done):
            raise ScheduleError(f"rank {s} step {k}: {a} runs before its forward ran and its "
                                f"gradient was received", s, k)
        t = tb if a.kind == "backward" else tb / 2
        r.clock += t
        r.busy += t
        if a.kind == "backward":
            r.inflight.discard(mk)
    elif a.kind == "backward_weight":  # the stash is kept until the weight gradients are made
        if ("backward_input", mk) not in r.done:
            raise ScheduleError(f"rank {s} step {k}: {a} runs before backward_input m={a.micro}", s, k)
        r.clock += tb / 2
        r.busy += tb / 2
        r.inflight.discard(mk)
    if a.kind in ("forward", "backward", "backward_input", "backward_weight"):
        if (a.kind, mk) in r.done:
            raise ScheduleError(f"rank {s} step {k}: {a} runs twice", s, k)
        r.done.add((a.kind, mk))
    return True


def _check_complete(actions, ranks) -> None:
    micros = {a.micro for acts in actions for a in acts if a.micro is not None}
    chunks = {a.chunk for acts in actions for a in acts}
    for s, r in enumerate(ranks):
        for kind in ("forward", "backward"):
            missing = sorted(m for m in ((m, c) for m in micros for c in chunks)
                             if (kind, m) not in r.done and not (kind == "backward" and {
                                 ("backward_input", m), ("backward_weight", m)} <= r.done))
            if missing:
                m, c = missing[0]
                raise ScheduleError(f"rank {s}: no {kind} of microbatch {m}"
                                    f"{f' chunk {c}' if len(chunks) > 1 else ''}", s, len(actions[s]) - 1)
        if actions[s][-1].kind != "optimizer":
            raise ScheduleError(f"rank {s}: the list must end with the optimizer step", s,
                                len(actions[s]) - 1)


COMM = ("recv_fwd", "send_fwd", "recv_bwd", "send_bwd")


def _message(s, a, pp) -> tuple:
    """What a send or receive of stage ``s`` carries: (direction, microbatch, the receiving
    virtual stage); a send and the receive that gets it have the same."""
    vs, d = a.chunk * pp + s, a.kind[5:]
    if a.kind.startswith("send"):
        vs += 1 if d == "fwd" else -1
    return (d, a.micro, vs)


def p2p_slots(actions) -> tuple:
    """The order program.py runs each rank's point-to-point in: per rank, a tuple of entries,
    ``k`` (the index of a compute action of its list) or a slot ``(k, ...)``: the indices of the
    sends and receives it posts together in one ``batch_isend_irecv`` and waits for together
    (Megatron's ``send_forward_recv_backward``), in posting order.

    A slot starts as a run of consecutive sends and receives of the list.  Then the slots are
    run as NCCL and HCCL run them: a rank posts its slot's operations and waits until each has
    met its partner in the peer's posted slot; where that waits forever, the partner receive is
    posted earlier, in the peer's slot then posted (a receive posted early only holds its buffer
    longer; a send is never moved).  Last, the receives of a slot from one peer are put in the
    order that peer sends them: between two ranks the k-th send meets the k-th receive.

    Raises:
        ScheduleError: slots that wait on each other forever (every blocked rank named), or a
            receive that would get (by order) another message than its own.
    """
    pp = len(actions)
    slots = []
    for acts in actions:
        out, run = [], []
        for k, a in enumerate(acts):
            if a.kind in COMM:
                run.append(k)
                continue
            if run:
                out.append(run)
                run = []
            out.append(k)
        if run:
            out.append(run)
        slots.append(out)
    msg = [{k: _message(s, a, pp) for k, a in enumerate(acts) if a.kind in COMM}
           for s, acts in enumerate(actions)]
    where = {}  # (stage, message, "send"/"recv") -> the stage's action index
    for s, acts in enumerate(actions):
        for k, m in msg[s].items():
            where[s, m, acts[k].kind[:4]] = k
    while True:
        stuck = _rendezvous(actions, slots, msg)
        if stuck is None:
            break
        moved = False
        for s, i in stuck:  # the blocked ops whose partner is a receive not posted yet: post it now
            for k in slots[s][i]:
                a = actions[s][k]
                if not a.kind.startswith("send"):
                    continue
                peer, m = a.peer, msg[s][k]
                j, pos = where[peer, m, "recv"], next((t for t, p in stuck if t == peer), None)
                pos = [i2 for t, i2 in stuck if t == peer]
                if not pos or j in slots[peer][pos[0]]:
                    continue
                for e in slots[peer][pos[0] + 1:]:
                    if isinstance(e, list) and j in e:
                        e.remove(j)
                        break
                slots[peer][pos[0]].append(j)
                moved = True
        slots = [[e for e in out if e != []] for out in slots]
        if not moved:
            waits = "; ".join(f"rank {t} waits in its slot {[str(actions[t][k]) for k in slots[t][i]]}"
                              for t, i in stuck)
            raise ScheduleError(f"point-to-point deadlock: {waits}", stuck[0][0], stuck[0][1])
    order = {}  # (sender, receiver) -> {message: its place in the sender's sends}
    for s, out in enumerate(slots):
        for e in out:
            for k in (e if isinstance(e, list) else ()):
                a = actions[s][k]
                if a.kind.startswith("send"):
                    mine = order.setdefault((s, a.peer), {})
                    mine[msg[s][k]] = len(mine)
    for s, out in enumerate(slots):
        for e in out:
            if isinstance(e, list):
                sends = [k for k in e if actions[s][k].kind.startswith("send")]
                recvs = sorted((k for k in e if not actions[s][k].kind.startswith("send")),
                               key=lambda k: (actions[s][k].peer,
                                              order.get((actions[s][k].peer, s), {}).get(msg[s][k], -1)))
                e[:] = sends + recvs
    _check_pair_order(actions, slots, msg)
    return tuple(tuple(tuple(e) if isinstance(e, list) else e for e in out) for out in slots)


def _rendezvous(actions, slots, msg):
    """Run the slots together; None when every rank finishes, else the blocked ``[(rank,
    slot index)]``.  A posted op meets its partner once both ranks have posted it."""
    pp = len(actions)
    pos = [0] * pp
    left = [None] * pp

    def advance(s):  # to the next slot (compute entries run at once)
        while pos[s] < len(slots[s]) and not isinstance(slots[s][pos[s]], list):
            pos[s] += 1
        left[s] = None if pos[s] >= len(slots[s]) else {
            (actions[s][k].kind[:4], msg[s][k]) for k in slots[s][pos[s]]}
    for s in range(pp):
        advance(s)
    progress = True
    while progress:
        progress = False
        posted = [set(left[s] or ()) for s in range(pp)]
        peers = [{actions[s][k].peer for k in slots[s][pos[s]]} if left[s] else set() for s in range(pp)]
        for s in range(pp):
            if not left[s]:
                continue
            met = {(kind, m) for kind, m in left[s]
                   if any(("recv" if kind == "send" else "send", m) in posted[t] for t in peers[s])}
            left[s] -= met
        for s in range(pp):
            if left[s] is not None and not left[s]:
                pos[s] += 1
                advance(s)
                progress = True
    stuck = [(s, pos[s]) for s in range(pp) if left[s]]
    return stuck or None


def _check_pair_order(actions, slots, msg) -> None:
    """Between two ranks the k-th send posted must be the message of the k-th receive."""
    sends, recvs = {}, {}
    for s, out in enumerate(slots):
        for e in out:
            for k in (e if isinstance(e, list) else ()):
                a = actions[s][k]
                if a.kind.startswith("send"):
                    sends.setdefault((s, a.peer), []).append((k, a, msg[s][k]))
                else:
                    recvs.setdefault((a.peer, s), []).append((k, a, msg[s][k]))
    for pair in sorted(set(sends) | set(recvs)):
        out, got = sends.get(pair, []), recvs.get(pair, [])
        for (ks, a, m), (kr, b, n) in zip(out, got):
            if m != n:
                raise ScheduleError(f"rank {pair[1]} step {kr}: {b} would receive (point-to-point "
                                    f"meets in order) rank {pair[0]} step {ks}: {a}", pair[1], kr)
        if len(out) != len(got):
            who, (k, a, _) = (pair[0], out[len(got)]) if len(out) > len(got) else (pair[1], got[len(out)])
            raise ScheduleError(f"rank {who} step {k}: {a} has no partner", who, k)


def rank_actions(mesh, actions, rank: int) -> tuple:
    """The action list of global ``rank`` of a mesh with a ``pp`` axis: its stage's list
    with every peer stage replaced by the peer's global rank (same coordinates on the
    other axes)."""
    a = mesh.axis_index("pp")
    coords = list(mesh.coords(rank))

    def peer(stage):
        c = list(coords)
        c[a] = stage
        return mesh.rank_of(c)

    return tuple(Action(x.kind, x.micro, None if x.peer is None else peer(x.peer), x.chunk)
                 for x in actions[coords[a]])


def build(name: str, pp: int, micro: int, virtual: int = 1) -> tuple:
    """The action lists of the train line's ``schedule=name``: :func:`interleaved` with
    ``virtual`` chunks per rank for ``interleaved``, else :func:`schedule`."""
    return interleaved(pp, micro, virtual) if name == "interleaved" else schedule(name, pp, micro)


def analytic(name: str, pp: int, micro: int, virtual: int = 1) -> float:
    """The idle fraction of schedule ``name`` with equal stage times: ZB-H1's
    ``(pp-1)/(3m+pp-1)``, interleaved's ``(pp-1)/(virtual m+pp-1)``, else ``(pp-1)/(m+pp-1)``."""
    if name == "zb-h1":
        return analytic_bubble_zb_h1(pp, micro)
    return (pp - 1) / (virtual * micro + pp - 1)
