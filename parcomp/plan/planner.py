"""``parcomp plan``: choose every layout for a mesh and write it as a spec.

No rules are given: the search (shard-prop's DP or ILP, :mod:`parcomp.passes.shard_prop`)
chooses the layout of every parameter too, under these conventions, which are what the
axis names mean to a user:

- an axis named ``dp`` (data parallel) splits dim 0 (the batch) of every input and
  output and replicates every parameter;
- every other axis is a model-parallel axis: every parameter of rank >= 2 is split
  over it along some dim the search chooses (that is what the axis is for: without
  the rule, replicated weights would always look cheapest, since compute is cheap at
  these sizes); rank-1 parameters (biases, norms) may also stay replicated, and so
  may the model's two ends and its buffers (:func:`may_stay_replicated`): tables read
  by an ``embedding`` lookup (a lookup does no arithmetic to split; Megatron keeps its
  position embeddings replicated), the weight of a matmul whose product is a model
  output (the LM head: no next layer for its split to pair with), and non-trainable
  buffers (RoPE tables); so may an MoE router (:func:`_router`), as in Megatron.
  Splitting those saves only memory, which a ``memory`` limit prices.  Inputs and
  outputs are replicated over a model-parallel axis.

With a memory limit, Megatron's ``sequence-parallel`` statement is one more candidate
(:mod:`parcomp.plan.seqpar`): written when the compiled plan without it misses the
limit and the plan with it fits. When neither fits, the search runs again for the
least resident memory it can reach, and without a limit; of those plans, with and
without the statement, the one with the smallest compiled peak is written if it fits
the limit, else the error gives that smallest peak: a figure that does not depend on
the limit asked for (:func:`_nothing_fits`).

With ``--train`` the parameters are chosen on the forward graph (``autodiff`` pins the
updated parameters and optimizer state to the parameters' layouts before the search, so
a search over the training graph could not move them together); the written spec then
carries the train line, and compiling it plans the backward and the update exactly.

The written spec pins the parameters (in Megatron's words where they apply:
:mod:`parcomp.plan.spec_text`), inputs and outputs; the activations' chosen layouts are
listed as comments (compiling the spec re-derives them: the search is
deterministic).  It starts with a header line carrying a checksum of the rest, so
``plan`` overwrites only a spec it wrote and nobody changed since
(docs/design/plan.md: parcomp never overwrites a file it did not write).
"""
from __future__ import annotations

import itertools
import textwrap

from ..cost.memory import MemoryLimitError, over_limit
from ..errors import ParcompError, SourceLoc
from ..outdir import write_own_file
from ..ir.types import R, Shard, divisibility_problem, layout_str
from ..passes.pass_list import bind_layouts
from ..passes.search.layout_ilp import DEFAULT_SECONDS
from ..passes.shard_prop import shard_prop
from ..spec import parse_spec
from ..units import format_bytes
from .seqpar import choose_seqpar, least_peak, set_memory, with_sp
from .spec_text import bound_params, io_phrase, param_lines

HEADER = "# written by parcomp plan; sha256 of the lines below: "
#: the header's estimate: the search's cost model (local compute + each layout change at
#: :func:`parcomp.ir.redistribute.plan_cost`), not ``parcomp explain``'s per-link comm estimate
ESTIMATE = "# search estimate (compute + layout changes): "


def mesh_text(arg: str) -> str:
    """``dp=2,tp=4`` -> ``dp=2 tp=4`` (the spec's mesh line).

    Raises:
        ParcompError: not ``NAME=SIZE`` pairs (names the ``--mesh`` option).
    """
    pairs = [p.strip() for p in arg.split(",") if p.strip()]
    if not pairs or not all(p.count("=") == 1 and p.split("=")[1].isdigit() for p in pairs):
        raise ParcompError(f"--mesh {arg!r}: write axis sizes such as dp=2,tp=4", where="--mesh")
    return " ".join(pairs)


def base_spec_text(graph, mesh: str, memory: str | None, train: str | None) -> str:
    """The spec before the search: mesh, memory, train line, input and output rules."""
    spec = parse_spec(f"mesh {mesh}\n", "--mesh")
    if memory:
        _parse_line(mesh, f"memory {memory}", "--memory")
    if train:
        if train.split(None, 1)[0] != "train":
            raise ParcompError(f"--train {train!r}: give the spec's train line, starting with "
                               f"'train' (e.g. \"train loss=mse optimizer=sgd(lr=0.1)\")", where="--train")
        _parse_line(mesh, train, "--train")
    lines = [f"mesh {mesh}"] + ([f"memory {memory}"] if memory else [])
    lines += [f"input {n.name} {io_phrase(_io_layout(spec.mesh, n.type))}" for n in graph.inputs
              if n.type.rank]
    lines += [f"output {pub} {io_phrase(_io_layout(spec.mesh, graph[v].type))}"
              for pub, v in graph.named_outputs() if graph[v].type.rank]
    return "\n".join(lines + ([train] if train else [])) + "\n"


def _parse_line(mesh: str, line: str, option: str) -> None:
    """Parse one spec line given on the command line, so its errors point at ``option``
    (column in the option's own text), not at the spec plan builds from it."""
    try:
        parse_spec(f"mesh {mesh}\n{line}\n", option)
    except ParcompError as e:
        if e.loc is None or e.loc.line != 2:
            raise
        loc = SourceLoc(option, 1, e.loc.col, e.loc.text)
        raise type(e)(e.message, loc) from None


def _io_layout(mesh, ty):
    lay = tuple(Shard(0) if a == "dp" else R for a in mesh.names)
    return lay if not divisibility_problem(ty, lay, mesh) else tuple(R for _ in mesh.names)


def may_stay_replicated(graph, ranks: int | None = None) -> set:
    """Params of ``graph`` that a model-parallel axis need not split (module docstring):
    ``embedding`` tables, weights of a matmul making a model output (reached through
    permutes and reshapes, as ``colwise`` follows them), non-trainable buffers; with
    ``ranks`` (the smallest model-parallel axis), the kv projections of multi-query /
    grouped-query attention whose kv heads ``ranks`` does not divide (:func:`_shared_kv`); the
    weight of a matmul with one output feature (a gate, Qwen2-MoE's ``shared_expert_gate``: no
    column split exists, a row split is all-reduced); low-rank (down) projections such as MLA's (:func:`_low_rank`); MoE routers
    (:func:`_router`)."""
    users, outputs = graph.users(), set(graph.outputs)
    out = {n.inputs[1] for n in graph.nodes if n.op == "embedding"}
    for p in graph.params:
        if p.attr("trainable") is False:
            out.add(p.name)
        frontier = [p.name]
        while frontier:
            cur = frontier.pop()
            for u in users[cur]:
                node = graph[u]
                if node.op in ("permute", "reshape"):
                    frontier.append(u)
                elif node.op == "matmul" and node.inputs[1] == cur and (
                        _reaches_output(graph, users, u, outputs) or _low_rank(graph, users, u)
                        or _router(graph, users, u)
                        or node.type.shape[-1] == 1  # a one-feature gate: no column split exists
                        or (ranks and (_shared_kv(graph, users, u) or ranks) % ranks)):
                    out.add(p.name)
    return out


def _router(graph, users, name, depth: int = 12) -> bool:
    """Whether matmul ``name`` is an MoE router: its product (each token's expert logits)
    reaches a ``topk`` / ``topk_index`` before any other matmul (Mixtral's and Qwen2-MoE's
    softmax then top-k, DeepSeek's sigmoid, bias and group-limited top-k). Megatron keeps the
    router replicated, computed on the replicated hidden input: split by experts (colwise),
    its logits are gathered for the softmax over all experts; split by rows (rowwise), its
    partial sums are reduced: one collective a block either way, where the replicated router
    costs ``2 * tokens * hidden * experts`` FLOPs, a small part of one expert's matmul."""
    return _reaches(users, name, depth, lambda cur, u: graph[u].op in ("topk", "topk_index"),
                    lambda cur, u: graph[u].op not in ("matmul", "sdpa", "embedding"))


def _reaches(users, name, depth, found, through) -> bool:
    """Whether a walk from ``name`` along ``users``, at most ``depth`` steps, meets a user ``u``
    of a node ``cur`` with ``found(cur, u)``, going on only through users with ``through(cur, u)``."""
    frontier, seen = [name], {name}
    while frontier and depth:
        depth -= 1
        nxt = []
        for cur in frontier:
            for u in users[cur]:
                if found(cur, u):
                    return True
                if through(cur, u) and u not in seen:
                    seen.add(u)
                    nxt.append(u)
        frontier = nxt
    return False


#: ops a low-rank projection's product passes through on its way to the up projection
_TO_UP = ("slice", "reshape", "permute", "rms_norm", "layer_norm")


def _low_rank(graph, users, name, depth: int = 12) -> bool:
    """Whether matmul ``name`` is a low-rank (down) projection: fewer output than input
    features, and its product reaches the activation operand of another matmul through
    slices, reshapes, permutes and norms only (MLA's ``q_a_proj`` -> ``q_a_layernorm`` ->
    ``q_b_proj`` and ``kv_a_proj_with_mqa`` -> ``kv_a_layernorm`` -> ``kv_b_proj``; a LoRA
    pair). Megatron keeps those replicated and splits the up projections by heads; split,
    the latent would be gathered every block (its norm needs the whole row). A residual
    ``add`` ends the walk, so an MLP's down projection is no such weight."""
    node = graph[name]
    x = graph[node.inputs[0]].type
    if not x.rank or node.type.shape[-1] >= x.shape[-1]:
        return False
    return _reaches(users, name, depth,
                    lambda cur, u: (graph[u].op == "matmul" and graph[u].inputs[0] == cur
                                    and graph[graph[u].inputs[1]].op in ("param", "permute")),
                    lambda cur, u: graph[u].op in _TO_UP and graph[u].inputs[0] == cur)


def _shared_kv(graph, users, name, depth: int = 40) -> int | None:
    """The kv heads of the ``sdpa`` whose keys or values matmul product ``name`` becomes
    before any other matmul, when they are fewer than its query heads (multi-query /
    grouped-query attention: the sdpa's k/v has fewer heads than its q, or transformers'
    ``repeat_kv`` repeated them by an ``expand`` on the way), else None. Megatron keeps
    such kv projections replicated when the ranks do not divide the kv heads (every rank
    computes the shared heads; their gradients are summed) instead of gathering them."""
    frontier, seen = [(name, None)], {name}
    while frontier and depth:
        depth -= 1
        nxt = []
        for cur, heads in frontier:
            for u in users[cur]:
                node = graph[u]
                if node.op == "sdpa":
                    q, k = graph[node.inputs[0]].type, graph[node.inputs[1]].type
                    if cur in node.inputs[1:3] and (heads or q.shape[-3] > k.shape[-3]):
                        return heads or k.shape[-3]
                elif node.op not in ("matmul", "sdpa_grad") and u not in seen:
                    seen.add(u)
                    src = graph[node.inputs[0]].type if node.inputs else None
                    rep = node.op == "expand" and src is not None and src.rank == 4
                    nxt.append((u, src.shape[-3] if rep else heads))
        frontier = nxt
    return None


def _reaches_output(graph, users, name, outputs) -> bool:
    """Whether ``name`` is a model output, directly or through reshapes and a bias add
    (or a spec pin's relayout)."""
    while name not in outputs:
        nxt = [u for u in users[name] if graph[u].op in ("reshape", "add", "relayout")]
        if len(users[name]) != 1 or not nxt:
            return False
        name = nxt[0]
    return True


def param_layouts(ty, mesh, name: str = "", table: bool = False) -> list:
    """The layouts a parameter ``name`` of type ``ty`` may take (module docstring), evenly
    split; an integer tensor (a buffer such as position ids) stays replicated.  ``table``:
    one of :func:`may_stay_replicated` (it may also stay replicated).

    Raises:
        ParcompError: no layout splits ``name`` evenly over ``mesh`` (named).
    """
    if not ty.dtype.startswith("float"):
        return [tuple(R for _ in mesh.names)]
    per_axis = []
    for a in mesh.names:
        if a == "dp":
            per_axis.append([R])
        else:
            per_axis.append(([R] if ty.rank < 2 or table else []) + [Shard(d) for d in range(ty.rank)])
    out = [lay for lay in itertools.product(*per_axis) if not divisibility_problem(ty, lay, mesh)]
    if not out:
        raise ParcompError(f"parameter {name} {ty} cannot be split evenly over the mesh {mesh} "
                           f"(no dim of it divides by the axis sizes); pick other sizes",
                           where="--mesh")
    return out


def check_seconds(seconds: float | None) -> None:
    """``--seconds``, the exact search's time budget, is None or a positive number.

    Raises:
        ParcompError: naming ``--seconds``.
    """
    if seconds is not None and not seconds > 0:
        raise ParcompError(f"--seconds {seconds}: the search needs a positive time budget", where="--seconds")


def plan(graph, mesh: str, memory: str | None = None, train: str | None = None,
         seconds: float | None = None):
    """Choose the layouts of ``graph`` on ``mesh``; returns ``(spec text, planned graph)``.
    ``seconds``: the exact search's time budget (default :data:`DEFAULT_SECONDS`).

    Raises:
        ParcompError: a bad mesh or memory size, a parameter that no layout splits evenly.
        MemoryLimitError: nothing fits the memory (with ``sequence-parallel`` either); its
            ``need`` (and message) is the smallest peak found, whatever the limit
            (:func:`_nothing_fits`).
    """
    text = base_spec_text(graph, mesh, memory, train)
    spec = parse_spec(text, "plan.pcs")
    bound = bind_layouts(graph, spec)  # the forward graph: see the module docstring
    model_params = {n.name for n in graph.params}
    model_axes = [size for name, size in zip(spec.mesh.names, spec.mesh.sizes) if name != "dp"]
    ends = may_stay_replicated(bound, min(model_axes) if model_axes else None)
    free = {n.name: param_layouts(n.type, spec.mesh, n.name, n.name in ends) for n in bound.params
            if n.name in model_params}
    check_seconds(seconds)
    memory_loc = memory and SourceLoc("--memory", 1, 1, memory)
    seconds = DEFAULT_SECONDS if seconds is None else seconds
    try:
        chosen = shard_prop(bound, seconds, memory=spec.memory, memory_loc=memory_loc, free=free)
        text = _spec_text(text, chosen, graph, spec)
        if spec.memory is not None:
            text = choose_seqpar(graph, text, memory_loc)
    except MemoryLimitError as e:
        if e.where != str(memory_loc):
            raise
        return _nothing_fits(graph, bound, free, (mesh, memory, train), seconds, spec.memory, memory_loc, e)
    return text, chosen


def _candidates(graph, bound, free, mesh: str, train, seconds) -> list:
    """``(spec text, chosen graph, what)`` of the plans to fall back on when the limit's own
    misses it, none depending on the limit: the layouts searched for the least resident
    bytes the search can reach (``memory`` that many bytes) and searched without a limit."""
    out, least = [], None
    try:
        shard_prop(bound, seconds, memory=0, free=free)
    except MemoryLimitError as e:  # the least resident bytes: a bound the search may reach
        least = e.need
    for limit in ([least] if least is not None else []) + [None]:
        base = base_spec_text(graph, mesh, None if limit is None else f"{limit}B", train)
        spec = parse_spec(base, "plan.pcs")
        try:
            chosen = shard_prop(bound, seconds, memory=limit, free=free)
        except ParcompError:  # the resident bound is not reachable in one plan
            continue
        what = "parameters laid out without a limit" if limit is None else \
            "parameters laid out for the least memory"
        out.append((_spec_text(base, chosen, graph, spec), chosen, what))
    return out


def _nothing_fits(graph, bound, free, args: tuple, seconds, limit: int, memory_loc, first):
    """Neither the plan searched under ``limit`` nor it with ``sequence-parallel`` fits: the
    smallest compiled peak of :func:`_candidates` (each with and without the statement).
    Returns ``(spec text, chosen)`` of a candidate that compiles within ``limit``.

    Raises:
        MemoryLimitError: at ``memory_loc``, none does; ``need``: the smallest peak (the same
            figure for every limit below it), or ``first`` when no candidate compiles at all.
    """
    mesh, memory, train = args
    found = []  # (peak, what, text, chosen)
    for text, chosen, what in _candidates(graph, bound, free, mesh, train, seconds):
        for sp in (False, True):
            got = least_peak(graph, with_sp(text, []) if sp else text)
            if got is not None:
                found.append((got[0], f"{what}; {got[1]}" + ("; with sequence-parallel" if sp else ""), text, chosen))
    if not found:
        raise first
    found.sort(key=lambda f: f[0])
    peak, what = found[0][:2]
    for p, _, text, chosen in found:  # compiled under the limit asked for, activations are re-searched
        if p <= limit:
            try:
                return choose_seqpar(graph, set_memory(text, memory), memory_loc), chosen
            except MemoryLimitError:
                pass
    zero = ", or ZeRO (train ... zero=1)" if train else ""
    what = f"no plan fits: the smallest peak of live values among parcomp's plans ({what})"
    if peak > limit:
        said = over_limit(limit, peak, what)
    else:
        said = (f"{what} needs {format_bytes(peak)} per rank ({peak:,} B), within the memory limit "
                f"{format_bytes(limit)} only with those layouts, which a spec cannot ask for apart from "
                f"its memory limit; under this limit the search lays the activations out otherwise and "
                f"every plan peaks over it")
    raise MemoryLimitError(f"{said}; use more ranks, a smaller batch{zero}",
                           memory_loc, need=peak, peak=True) from None


def _spec_text(base: str, chosen, graph, spec) -> str:
    s = chosen.search
    proof = "proven optimal" if s["proven_optimal"] else "best found, not proven optimal"
    base_lines, cut = base.rstrip("\n").split("\n"), 1 + bool(spec.memory)
    head, tail = base_lines[:cut], base_lines[cut:]  # (mesh, memory), (inputs, outputs, train)
    lines = [f"# parcomp plan: layouts chosen by the {s['search']} search ({proof} under the cost model)",
             f"{ESTIMATE}{_us(s['cost_s'])} for the forward pass.",
             "# Edit freely, then `parcomp compile MODEL --spec THIS_FILE -o DIR`.", ""] + head + [""]
    layouts = {n.name: chosen[n.name].layout for n in graph.params}
    lines += param_lines(graph, layouts, spec.mesh,
                         lambda rules: bound_params(graph, "\n".join(head + rules + tail) + "\n"))
    lines += [""] + tail
    acts = [n for n in graph.nodes if n.op not in ("input", "param") and n.name in chosen]
    if acts:
        lines += ["", "# activations (chosen by the search; uncomment a line to pin it):"]
        lines += [f"# activation {n.name}  {layout_str(chosen[n.name].layout)}" for n in acts]
    return "\n".join(lines) + "\n"


def write_spec(path: str, text: str) -> None:
    """Write ``text`` to ``path`` with the checksum header; refuse to replace a file parcomp
    did not write, or one changed since it did.

    Raises:
        ParcompError: ``path`` exists and is not an unchanged ``parcomp plan`` spec, is a
            directory, or its directory does not exist or cannot be written (names ``-o``).
    """
    write_own_file(path, text, HEADER, "parcomp plan")


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} us"


def step_estimate(chosen, compiled) -> str:
    """What the search's estimate covers, in words: the plan's figure (``chosen``: the forward
    graph the parameters were chosen on) and, for a training spec, the figure of the training
    step ``compiled`` from the written spec -- forward, backward and update, every gradient
    reduction priced on its own (before the buckets of passes/lowering/bucket.py and dp_buckets.py):
    the figure ``parcomp check`` prints for that spec."""
    fwd = f"{_us(chosen.search['cost_s'])} for the forward pass"
    if compiled.report.get("training") is None:
        return fwd
    return (f"{fwd} (the parameters are chosen on it), "
            f"{_us(compiled.report['search']['cost_s'])} for the training step compiled from it "
            f"(forward, backward, update; what `parcomp check` prints)")


def with_step_estimate(text: str, chosen, compiled) -> str:
    """Spec ``text`` (:func:`plan`'s) with its header's estimate saying what it covers
    (:func:`step_estimate`); ``compiled``: ``text`` compiled."""
    lines = text.split("\n")
    at = next((i for i, ln in enumerate(lines) if ln.startswith(ESTIMATE)), None)
    if at is None or compiled.report.get("training") is None:
        return text
    lines[at:at + 1] = textwrap.wrap(ESTIMATE + step_estimate(chosen, compiled) + ".", 94,
                                     subsequent_indent="#   ")
    return "\n".join(lines)


def summary(chosen, compiled=None) -> str:
    """One line about the plan for the terminal (``compiled``: the written spec compiled, for
    the training step's estimate)."""
    s = chosen.search
    extra = f", resident {format_bytes(s['resident_bytes'])} per rank" if "resident_bytes" in s else ""
    est = step_estimate(chosen, compiled) if compiled is not None else f"{_us(s['cost_s'])} for the forward pass"
    return (f"plan: {s['search']} search, {'proven optimal' if s['proven_optimal'] else 'not proven optimal'}"
            f", search estimate {est}{extra}, searched in {s['seconds']:.2f} s")
