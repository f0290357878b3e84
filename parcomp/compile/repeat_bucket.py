"""Stamping sequences, and the norm-gradient bucket (block-plan reuse).

:func:`stamp_seq` repeats each run of template-owned items of a sequence (a stage's nodes, an
operand list) next to itself (:mod:`parcomp.compile.repeat_stamp`).

A norm-gradient bucket (:func:`is_norm_bucket`: ``bucket-norm-grads`` under sequence parallel, one
``bucket_cat`` reading every block's norm-weight gradients) is the one unowned node allowed to
read the template: its operand list and its ``frees`` list are stamped as a sequence of nodes
is (template runs repeated next to themselves), its flat size and its all_reduce's (and a
``wait``'s) grow by the copies' members, the reason's member count follows, and its
``bucket_part`` offsets are laid again in program order (the reduced stage's must be so laid).
"""
from __future__ import annotations

from dataclasses import replace

from ..ir.graph import Graph, evolve
from ..passes.lowering.bucket import NORM_BUCKET, NORM_REASON

# ``st`` below is a :class:`parcomp.compile.repeat_stamp.Stamper` (not imported: repeat_stamp imports this)


def runs(owners, t):
    """``(start, end)`` of each maximal run of ``t`` in ``owners``."""
    k = 0
    while k < len(owners):
        if owners[k] != t:
            k += 1
            continue
        end = k
        while end < len(owners) and owners[end] == t:
            end += 1
        yield k, end
        k = end


def stamp_seq(items, owners, t, copies, last, head=None):
    """``items`` with each run of template-owned ones repeated by ``copies`` (one function per
    copy, or one function of a run giving every copy's: ``repeat_stamp._copier``; ascending or
    descending as the run's neighbours say) and ``last`` applied to those of later blocks
    or none; None where a run's direction is not told."""
    out, k = [], 0
    while k < len(items):
        b = owners[k]
        if b is not None and b < t:
            out.append(head(items[k]) if head is not None and last is not None else items[k])
            k += 1
        elif b != t:
            out.append(last(items[k]) if last is not None else items[k])
            k += 1
        else:
            end = k
            while end < len(items) and owners[end] == t:
                end += 1
            run = items[k:end]
            if head is not None and last is not None:
                run = [head(x) for x in run]
            asc = ascending(owners, k, end, t)
            if asc is None:
                return None
            stamped = copies(run) if callable(copies) else [[f(x) for x in run] for f in copies]
            if not asc:
                stamped.reverse()
            for chunk in ([run] + stamped if asc else stamped + [run]):
                out.extend(chunk)
            k = end
    return out


def ascending(owners, start, end, t):
    """Whether the blocks ascend around ``owners[start:end]`` (a template run): the nearest
    block-owned node before is an earlier block or the nearest after a later; None when the
    neighbours disagree or say nothing."""
    before = next((b for b in reversed(owners[:start]) if b is not None), None)
    after = next((b for b in owners[end:] if b is not None), None)
    votes = set()
    if before is not None:
        votes.add(before < t)
    if after is not None:
        votes.add(after > t)
    return votes.pop() if len(votes) == 1 else None


def is_norm_bucket(x) -> bool:
    """Whether node ``x`` is a norm-gradient bucket (reads every block; module docstring)."""
    return x.op == "bucket_cat" and x.name.startswith(NORM_BUCKET)


def _frees(x) -> list:
    v = x.attr("frees")
    return v.split(" ") if type(v) is str and v else []


def bucket_fits(st, x) -> bool:
    """Whether bucket ``x``'s operand and ``frees`` lists have a told direction per template run."""
    for seq in (x.inputs, _frees(x)):
        owners = [st.owner(i) for i in seq]
        if any(ascending(owners, k, e, st.t) is None for k, e in runs(owners, st.t)):
            return False
    return True


def stamp_buckets(st, graph: Graph, nodes: list, n: int, names) -> list | None:
    """``nodes`` (``graph``'s stamp, its buckets renamed as any unowned node) with each
    norm-gradient bucket stamped (module docstring); None where a bucket is not laid out as
    ``bucket-norm-grads`` lays it (one all_reduce reading it, parts in offset order)."""
    users, fix, sources = graph.users(), {}, set()
    for cat in filter(is_norm_bucket, graph.by_op("bucket_cat")):
        got = _bucket_fixes(st, graph, cat, users, n, names)
        if got is None:
            return None
        fix.update(got[0])
        sources.update(got[1])
    out, offset = [], {}
    for x in nodes:
        f = fix.get(x.name)
        if f is not None:
            x = f(x)
        elif x.op == "bucket_part" and x.inputs[0] in sources:
            at = offset.get(x.inputs[0], 0)
            offset[x.inputs[0]] = at + x.attr("numel")
            x = x.with_attrs(offset=at)
        out.append(x)
    return out


def _bucket_fixes(st, graph: Graph, cat, users, n: int, names) -> tuple | None:
    """``({name: stamped node -> fixed node}, {names the parts read})`` for bucket ``cat``."""
    copies, last, head = names
    t, m = st.t, st.m

    def seq(items):
        return stamp_seq(list(items), [st.owner(i) for i in items], t, copies, last, head)

    ins, frees = seq(cat.inputs), seq(_frees(cat))
    grow = (n - m) * sum(graph[i].type.numel for i in cat.inputs if st.owner(i) == t)
    flat = replace(cat.type, shape=(cat.type.numel + grow,))
    ars = users[cat.name]
    if ins is None or frees is None or len(ars) != 1 or graph[ars[0]].op != "all_reduce":
        return None
    ar = graph[ars[0]]
    reason, was = ar.attr("reason", ""), f"{NORM_REASON}{len(cat.inputs)} "
    if not reason.startswith(was):
        return None
    reason = f"{NORM_REASON}{len(ins)} " + reason[len(was):]
    fix = {cat.name: lambda x: evolve(x, inputs=tuple(ins), type=flat, **(
               {"attrs": tuple(sorted({**dict(x.attrs), "frees": " ".join(frees)}.items()))}
               if frees else {})),
           ar.name: lambda x: evolve(x.with_attrs(reason=reason), type=flat)}
    sources = {ar.name}
    for w in users[ar.name]:
        if graph[w].op == "wait":
            fix[w] = lambda x: evolve(x, type=flat)
            sources.add(w)
    at = 0
    for p in graph.nodes:
        if p.op == "bucket_part" and p.inputs[0] in sources:
            if p.attr("offset") != at:
                return None
            at += p.attr("numel")
    return (fix, sources) if at == cat.type.numel else None
