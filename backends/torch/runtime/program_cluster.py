"""The cluster part of every emitted ``program.py`` (sections pasted by :mod:`parcomp_backends.torch.runtime`).

- :func:`agree`: a step every rank runs (loading, writing outputs), then an ok flag per
  rank agreed over the world (through torchrun's key-value store).  A rank whose step failed
  still reaches it, so no rank waits in a collective for one that has left: if any rank
  failed, every rank prints which ranks failed and why (the messages, gathered) and exits 2
  within seconds.
- :func:`check_placement`: once at start, every rank's host name (one
  ``all_gather_object``); a group of a ``HOST_AXES`` axis (``tp``) on more than one host is
  refused (or, with ``--placement warn``, reported by rank 0).
- :func:`print_launch`: ``--print-launch``, the environment and torchrun lines per node.

Real, importable Python; it runs with :mod:`.program_common` and the stand-ins below for
what the emitter generates.
"""
# flake8: noqa: E402,F403,F405 (program.py is one namespace: the common sections are in it)
import datetime
import shlex
import signal
import socket
import threading
import time
import traceback

from .program_common import *

# ---- stand-ins for what the emitter generates (never pasted) ----
HOST_AXES = ()
PLACEMENT = "refuse"
TIMEOUT_S = 600
TOPOLOGY = None
LAUNCH_ENV = ()
BIND_DEVICE_ID = False


# >>> program.py: cluster
HOSTS = []  # every rank's host, by rank, set by check_placement()


def add_cluster_args(ap):
    """The options every program has for running on a cluster."""
    ap.add_argument("--timeout", type=timeout_arg, default=TIMEOUT_S, metavar="S",
                    help=f"seconds a collective may wait for the other ranks (default {TIMEOUT_S:g})")
    ap.add_argument("--placement", choices=("refuse", "warn"), default=PLACEMENT,
                    help=f"a {'/'.join(HOST_AXES) or 'tp'} group on several hosts: stop, or only warn "
                         f"(default {PLACEMENT})")
    ap.add_argument("--compile", action="store_true",
                    help="run the step under torch.compile (capture, fuse and reorder it)")
    ap.add_argument("--tf32", action="store_true",
                    help="CUDA: float32 matmuls and convolutions in TF32 (10-bit mantissa, faster on "
                         "Ampere and newer); off by default, the float32 rounding parcomp run checks")
    ap.add_argument("--print-launch", nargs="?", const="", metavar="NODESxDEVICES",
                    help="print the environment and the torchrun line of every node (with the options "
                         "given with it, else the run hint's), then exit "
                         f"(default topology: {TOPOLOGY_TEXT})")
# <<< program.py


# >>> program.py: faults
FAULT_WAIT_S = 10  # after a collective failed here, how long to wait for the other ranks' reports
FAULT_POLL_S = 5  # how often each rank looks for another rank's report in the launcher's store
FAULT_KEY = "parcomp/fault/"  # the reports' keys in the launcher's store
FAULT = {"store": None, "timeout": None, "where": "starting", "lock": threading.Lock(), "agreeing": False}


def watch_faults(timeout):
    """Make a failure during the run end with one line on every rank naming the ranks that
    failed or stopped answering (:func:`report_fault`). Three paths lead there: main's handler
    of an exception (a collective that timed out after ``timeout`` seconds or lost a peer, or
    this rank's own error), the launcher's SIGTERM (torchrun stops every rank once one has
    exited), and another rank's report found in the launcher's store (every FAULT_POLL_S
    seconds: a rank that failed on its own, such as on a bad --data sample, ends the others
    within seconds even where their collective would wait for it until ``timeout``: NCCL, or a
    rank whose exit hangs). The last two run on a thread: the main thread may be blocked in a
    collective."""
    FAULT.update(store=dist.distributed_c10d._get_default_store(), timeout=timeout)
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.signal(signal.SIGTERM, lambda *_: ask_stop())  # the main thread, when it is free
    signal.set_wakeup_fd(write)  # the signal's number is written here, whatever the main thread does

    def watch():
        import select

        while True:
            if not select.select([read], [], [], FAULT_POLL_S)[0]:
                if peer_reported():
                    report_fault("stopped, since another rank's failure ended the run")
                continue
            if signal.SIGTERM in os.read(read, 64):
                if not ask_stop() or peer_failed():
                    report_fault("stopped by the launcher (SIGTERM)")
                late = threading.Timer(timeout + FAULT_WAIT_S, report_fault,  # every wait is bounded
                                       ["stopped by SIGTERM; the step and its checkpoint did not end in time"])
                late.daemon = True
                late.start()

    threading.Thread(target=watch, name="faults", daemon=True).start()


# SIGTERM (what SLURM and Kubernetes send before they kill a job) while a training loop that
# saves runs: every rank ends the step, saves it and exits (program_train's stop_after)
STOP = {"armed": False, "asked": False, "flag": None}


def ask_stop():
    """Note this rank's SIGTERM for the training loop; whether one runs that can act on it
    (``STOP["armed"]``: training with --save), else the fault path stops this rank."""
    if STOP["armed"]:
        STOP["asked"] = True
    return STOP["armed"]


def peer_failed():
    """Whether another rank has posted a failure (its SIGTERM is then torchrun stopping the
    survivors, not a request to save): those go the fault path, naming it."""
    try:
        return FAULT["store"].check([f"{FAULT_KEY}ranks"])
    except Exception:  # noqa: BLE001 - the store is gone: the launcher is stopping everything
        return True


def peer_reported():
    """Whether a rank has posted its own failure (an error, not a collective that stopped: a
    hung rank must not take its peers' timeouts for a failure and so report itself present)
    while this rank runs on: not while this rank agrees with the others on a step (agree():
    every rank learns that outcome itself), nor once it has failed itself (its own path exits).
    A store that does not answer (the run has ended, the launcher is stopping everything) is no
    report."""
    if FAILED or FAULT["agreeing"]:
        return False
    try:
        return FAULT["store"].check([f"{FAULT_KEY}error"])
    except Exception:  # noqa: BLE001
        return False


def collective_error(error):
    """Whether ``error`` is a collective's failure (it timed out, or a peer closed the
    connection) rather than an error of this rank's own."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        word in text for word in ("gloo", "NCCL", "HCCL", "Timed out", "Connection closed", "Connection reset"))


def first_line(error):
    """The first line of an error's message, without the C++ source location gloo puts first."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    text = text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
    return text.split(". ")[0][:300]


def report_fault(cause):
    """Post what stopped this rank (``cause``: an exception, or a text) to the launcher's
    key-value store, learn what stopped the others, print one line and exit; never returns.

    This rank's own error (not a collective's) is printed with its traceback and posted, and
    the rank exits 1 at once. A failed collective or the launcher's SIGTERM waits for the other
    ranks' reports until every rank has posted or none has for FAULT_WAIT_S seconds; the ranks
    that have not posted by then are the ones that stopped answering (hung, or gone without a
    word: killed, crashed). The first rank to decide writes that verdict and every rank uses
    it, so a hung rank that the launcher's SIGTERM wakes later is still named. Exit 2 (143:
    SIGTERM and nothing found wrong). The store's own failure leaves this rank's line alone."""
    if not FAULT["lock"].acquire(blocking=False):  # the other path is reporting: it exits
        while True:
            time.sleep(60)
    own = isinstance(cause, BaseException) and not collective_error(cause)
    text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {first_line(cause)}"
    if own:
        sys.stderr.write("".join(traceback.format_exception(cause)))
    store, key, silent, others = FAULT["store"], FAULT_KEY, [], {}
    try:
        count, quiet = post_fault("error" if own else "stopped", text), time.monotonic()
        while not own and count < WORLD_SIZE and not store.check([f"{key}silent"]) \
                and time.monotonic() - quiet < FAULT_WAIT_S:
            time.sleep(0.5)  # every rank polls: at 1,000 ranks, 2,000 store calls a second
            now = store.add(f"{key}count", 0)
            count, quiet = now, quiet if now == count else time.monotonic()
        reported = {int(r) for r in store.get(f"{key}ranks").decode().split()}
        if not own:
            mine = " ".join(str(r) for r in range(WORLD_SIZE) if r not in reported) or "-"
            silent = [int(r) for r in store.compare_set(f"{key}silent", "", mine).decode().split() if r != "-"]
        others = {r: store.get(f"{key}rank{r}").decode(errors="replace")
                  for r in sorted(reported - {RANK})[:64]}
    except Exception as e:  # noqa: BLE001 - the store is gone too: say what this rank knows
        text += f"; the launcher's store failed too ({type(e).__name__}: {first_line(e)})"
    errors = {r: m[len("error "):] for r, m in others.items() if m.startswith("error ")}
    sys.stderr.write(f"program.py (rank {RANK}): error: {FAULT['where']}: "
                     f"{fault_summary(text, silent, errors)}\n")
    plain_stop = text.startswith("stopped by the launcher") and not silent and not errors
    exit_now(1 if own else 143 if plain_stop else 2)


def post_fault(kind, text):
    """Post this rank's report (``kind`` "error": its own failure, which the others name;
    "stopped": it was stopped) to the launcher's store; the number of reports so far."""
    store = FAULT["store"]
    store.set(f"{FAULT_KEY}rank{RANK}", f"{kind} {text} ({FAULT['where']})")
    store.append(f"{FAULT_KEY}ranks", f"{RANK} ")
    count = store.add(f"{FAULT_KEY}count", 1)
    if kind == "error":  # what the other ranks' watch threads look for (peer_reported)
        store.set(f"{FAULT_KEY}error", str(RANK))
    return count


def note_exit(code):
    """This rank leaves with ``code`` (2: fail() printed why): post fail()'s message as this
    rank's own error, once, so the ranks the launcher then stops name it and why instead of
    counting it as gone without a word. The store's failure is let pass (the line is printed)."""
    if code == 2 and FAILED and FAULT["store"] is not None and FAULT["lock"].acquire(blocking=False):
        try:
            post_fault("error", FAILED[-1])
        except Exception:  # noqa: BLE001 - the store is gone too
            pass


def fault_summary(text, silent, errors):
    """The line of :func:`report_fault`: the ranks that stopped answering, the other ranks'
    own errors (``{rank: message}``), then this rank's ``text``."""
    parts = []
    if silent:
        who = "this rank" if silent == [RANK] else rank_text(silent)
        parts.append(f"{who} stopped answering (hung, or gone without a word: killed or crashed); "
                     f"each collective waits at most --timeout {FAULT['timeout']:g} s")
    if errors:
        parts.append(failure_summary("the run", sorted(errors), errors))
    parts.append(f"this rank: {text}")
    return "; ".join(parts)
# <<< program.py


# >>> program.py: timeout
def timeout_arg(text):
    """``--timeout S``: seconds, finite, in (0, MAX_TIMEOUT_S], else an argparse error (exit 2)."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_TIMEOUT_S:  # NaN fails too
        raise argparse.ArgumentTypeError(f"{text}: give a number of seconds above 0 and at most {MAX_TIMEOUT_S:_}")
    return seconds


MAX_TIMEOUT_S = 10_000_000  # ~116 days; datetime.timedelta and c10d's milliseconds hold it
# <<< program.py


# >>> program.py: cluster_run
def compiled_step(step, args):
    """``step`` under torch.compile with ``--compile`` (fullgraph on a functional program), else ``step``.
    The started collectives trace as ``torch.distributed._functional_collectives`` (imported here,
    so the compiler finds it as ``dist._functional_collectives``): a tensor-parallel step is one graph."""
    if not args.compile:
        return step
    importlib.import_module("torch.distributed._functional_collectives")
    compile_settings()
    return torch.compile(step, fullgraph="funcol" in globals())


def compile_settings():
    """The torch.compile settings this program needs: a dropless MoE layer reads its expert
    counts to the host once (``moe_route_plan``), and those ints are captured in the graph
    (unbacked sizes) instead of ending it."""
    if "moe_route_plan" in globals():
        torch._dynamo.config.capture_scalar_outputs = True


def set_tf32(on):
    """``--tf32``: TF32 float32 matmuls and convolutions (CUDA), which the cuda profile turns off
    by default; rank 0 says so, since float32 results then differ from the checked rounding."""
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    if on and RANK == 0:
        print("note: --tf32: float32 matmuls and convolutions run in TF32 (10-bit mantissa); their "
              "results differ from float32 by up to ~1e-3 of their scale", flush=True)


def launch_request(argv):
    """The value of ``--print-launch`` ("" without a topology), or None when not given."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--print-launch", nargs="?", const="")
    return ap.parse_known_args(argv)[0].print_launch


def launch_args(argv):
    """``(options, timeout)`` for the lines of ``--print-launch``: the program's options given
    with it (checked as a run checks them: a bad or missing one is argparse's error, exit 2)
    and their ``--timeout``, else RUN_HINT's options and the default timeout."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--print-launch", nargs="?", const="")
    rest = ap.parse_known_args(argv)[1]
    if not rest:
        return RUN_HINT.split(" program.py", 1)[1], TIMEOUT_S
    return " " + " ".join(shlex.quote(a) for a in rest), parse_args(rest).timeout


def init_dist(backend, args):
    """init_process_group with an explicit timeout, bound to DEVICE where the profile allows
    (the communicators then start now, not at the first collective after loading)."""
    bind = BIND_DEVICE_ID and args.device != "cpu"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout),
                            device_id=DEVICE if bind else None)


def check_output(args):
    """Exit 2 unless the directory of ``--output`` exists and no file this run writes there
    (``out.pt``, or every rank's ``out.rank{r}.pt``) is a file it reads: the checkpoint, the
    inputs, the replay states or program.py itself (run under agree())."""
    path = args.output
    if not path:
        return
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        fail(f"--output {path}: its directory does not exist")
    reads = {os.path.realpath(__file__): "program.py"}
    for flag in ("replay", "input", "checkpoint"):
        if getattr(args, flag, None) and os.path.isfile(getattr(args, flag)):
            reads[os.path.realpath(getattr(args, flag))] = f"--{flag}"
    writes = [rank_path(path, r) for r in range(WORLD_SIZE)] if SHARDED_OUTPUT else [path]
    for target in writes:
        if os.path.realpath(target) in reads:
            fail(f"--output {path}: it would write {target}, the file given as "
                 f"{reads[os.path.realpath(target)]}; give another name")


def this_host():
    """This rank's host name; tests simulate hosts on one machine with PARCOMP_SIM_NODE
    (set by parcomp_backends.torch.launch.run_torchrun_multinode)."""
    node = os.environ.get("PARCOMP_SIM_NODE")
    return f"sim-node{node}" if node is not None else socket.gethostname()


def check_placement(mode):
    """Gather every rank's host (once, at start); a group of a HOST_AXES axis on more than one
    host exits 2 on every rank (``mode`` refuse) or is reported by rank 0 (``mode`` warn)."""
    HOSTS[:] = [None] * WORLD_SIZE
    dist.all_gather_object(HOSTS, this_host())
    for axis in HOST_AXES:
        for ranks in GROUP_RANKS[axis]:
            if len({HOSTS[r] for r in ranks}) > 1:
                message = spanning_message(axis, ranks)
                if mode == "refuse":
                    fail(message + "; or rerun with --placement warn to run it anyway")
                if RANK == 0:
                    sys.stderr.write(f"program.py: warning: {message}\n")
                    sys.stderr.flush()
                return


def spanning_message(axis, ranks):
    """Why a group of ``axis`` must not span hosts, with the hosts and the launch that fits."""
    where = ", ".join(f"rank {r} on {HOSTS[r]}" for r in ranks)
    block = MESH[axis] * math.prod(list(MESH.values())[AXIS[axis] + 1:])
    local = os.environ.get("LOCAL_WORLD_SIZE", "?")
    return (f"the {axis} group {ranks} spans hosts ({where}); {axis} communicates in every layer "
            f"and needs the links inside one host, but torchrun started LOCAL_WORLD_SIZE={local} "
            f"per node: start a multiple of {block} ranks per host (--nproc-per-node; see "
            f"--print-launch)")


def agree(step, what):
    """``step()`` on every rank, then every rank learns whether every rank succeeded.

    Returns ``step()``'s value when every rank succeeded.  Otherwise every rank prints which
    ranks failed ``what`` and why (their messages, gathered) and exits 2; a rank's own failure
    (fail() or any exception) does not leave the others waiting in a collective.  The flags
    and messages go through the launcher's key-value store, not the device communicator: it
    works when that is broken, and no collective is in flight when a rank exits.
    """
    error, FAULT["agreeing"] = None, True
    try:
        result = step()
    except SystemExit as e:
        if e.code != 2:
            raise
        error = FAILED[-1] if FAILED else f"{what} failed"
    except Exception as e:  # noqa: BLE001 - any failure becomes this rank's message
        error = f"{type(e).__name__}: {e}"
        sys.stderr.write(f"program.py (rank {RANK}): error: {what}: {error}\n")
    store, key = dist.distributed_c10d._get_default_store(), f"parcomp/agree/{what}/"
    if error is not None:
        store.set(f"{key}error{RANK}", error)
        store.append(f"{key}failed", f"{RANK} ")
    if store.add(f"{key}arrived", 1) == WORLD_SIZE:  # the last rank to arrive opens the gate
        store.set(f"{key}done", "1")
    store.wait([f"{key}done"])  # at most the store's timeout (--timeout)
    if not store.check([f"{key}failed"]):
        FAULT["agreeing"] = False
        return result
    failed = sorted(int(r) for r in store.get(f"{key}failed").decode().split())
    messages = {r: store.get(f"{key}error{r}").decode(errors="replace") for r in failed[:64]}
    import signal  # every rank exits 2 now: torchrun's SIGTERM to the others once the first has
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # exited must not turn their exit 2 into -15
    fail(failure_summary(what, failed, messages))


def failure_summary(what, failed, messages):
    """One line: the ``failed`` ranks, then ``messages`` ({rank: text}) grouped by text (4 shown)."""
    by_message = {}
    for rank, message in sorted(messages.items()):
        by_message.setdefault(message, []).append(rank)
    parts = [f"{rank_text(ranks, hosts=False)}: {message}" for message, ranks in list(by_message.items())[:4]]
    more = "; and other messages" if len(by_message) > 4 or len(messages) < len(failed) else ""
    return (f"{what} failed on {rank_text(failed)} of {WORLD_SIZE}, so every rank stops: "
            + "; ".join(parts) + more)


def rank_text(ranks, hosts=True):
    """``rank 3`` / ``ranks 0-3, 6 (on host-a, host-b)``: sorted ranks as ranges, with hosts."""
    spans, start = [], ranks[0]
    for prev, cur in zip(ranks, ranks[1:] + [None]):
        if cur != prev + 1:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    hosts = sorted({HOSTS[r] for r in ranks}) if hosts and len(HOSTS) == WORLD_SIZE else []
    on = f" (on {', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''})" if hosts else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(spans)}{on}"


TOPOLOGY_TEXT = f"{TOPOLOGY[0]}x{TOPOLOGY[1]}" if TOPOLOGY else f"1x{MESH_SIZE}"


def print_launch(text, program_args, timeout):
    """``--print-launch [NODESxDEVICES]``: the environment to set and one torchrun line per node,
    each running ``program.py`` with ``program_args`` (``timeout``: seconds; :func:`launch_args`)."""
    nodes, per_node = parse_topology(text or TOPOLOGY_TEXT)
    lines = [f"# mesh {MESH_TEXT} on {nodes} node(s) x {per_node} devices, profile {PROFILE} "
             f"({DIST_BACKEND}); rank r runs on node r // {per_node}",
             "# on every node, before torchrun (see docs/deploy.md):",
             *(line.format(devices=",".join(map(str, range(per_node))), timeout=f"{timeout:g}")
               for line in LAUNCH_ENV)]
    if nodes == 1:
        lines.append(f"torchrun --standalone --nproc-per-node {per_node} program.py{program_args}")
    for node in range(nodes if nodes > 1 else 0):
        lines += [f"# node {node}: ranks {node * per_node}-{(node + 1) * per_node - 1}",
                  f"torchrun --nnodes {nodes} --node-rank {node} --nproc-per-node {per_node} "
                  f"--master-addr NODE0_ADDR --master-port 29500 program.py{program_args}"]
    print("\n".join(lines), flush=True)


def parse_topology(text):
    """``NODESxDEVICES`` -> (nodes, devices per node); exits 2 unless it holds MESH_SIZE ranks
    with every HOST_AXES group inside one node."""
    try:
        nodes, per_node = (int(v) for v in text.lower().split("x"))
    except ValueError:
        fail(f"--print-launch {text}: give NODESxDEVICES, such as 2x8")
    if nodes < 1 or per_node < 1 or nodes * per_node != MESH_SIZE:
        fail(f"--print-launch {text}: {nodes}x{per_node} devices, but mesh {MESH_TEXT} has "
             f"{MESH_SIZE} ranks")
    for axis in HOST_AXES:
        for ranks in GROUP_RANKS[axis]:
            if len({r // per_node for r in ranks}) > 1:
                fail(f"--print-launch {text}: the {axis} group {ranks} would span nodes; give "
                     f"each node a multiple of its ranks")
    return nodes, per_node
# <<< program.py
