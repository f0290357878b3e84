"""Checks the raw statements of a ``.pcs`` spec (from :mod:`.tree`) against the mesh:
mesh axes and sizes, topology and launch keys, options given once, rules and their
layouts; builds the frozen :class:`~parcomp.spec.model.Spec`."""
from __future__ import annotations

from lark import Token

from ..cost.links import LINK_KEYS, LINKS
from ..cost.memory import parse_size
from ..errors import SourceLoc, SpecError
from ..ir.types import Mesh, R
from .ctxpar import make_context_parallel  # context parallel
from .model import LAYOUT_WORDS, LayoutSpec, Rule, Spec, TrainSpec, check_mesh_size, default_axis
from .moe import make_moe  # MoE capacity policy
from .stages import make_stage, check_stages
from .syntax import LAYOUT_WORDS_TEXT, did_you_mean, spec_int, source_loc
from .train_config import train_config

_TOPOLOGY = ("nodes", "devices_per_node")
# how program.py runs on a cluster: key -> the words it takes, or None: whole seconds
_LAUNCH_KEYS = {"placement": ("refuse", "warn"), "timeout": None}
MAX_TIMEOUT_S = 10_000_000  # seconds (~116 days): program.py's --timeout takes at most this
#: the statements whose payload is ``key=value`` options (each key at most once: SpecBuilder.no_repeats)
_OPTION_STATEMENTS = ("train", "moe", "context-parallel", "topology")


class SpecBuilder:
    """Checks raw statements against the mesh and builds the :class:`Spec`."""

    def __init__(self, file: str, lines: list):
        self.file, self.lines = file, lines

    def loc(self, tok) -> SourceLoc:
        return source_loc(self.file, self.lines, tok.line, tok.column)

    def err(self, tok, msg) -> SpecError:
        return SpecError(msg, self.loc(tok))

    def err_at(self, loc, msg) -> SpecError:
        return SpecError(msg, loc)

    def build(self, stmts: list) -> Spec:
        if not stmts:
            raise SpecError("the spec is empty: it has no statements, so no mesh statement; "
                            "start it with one such as 'mesh tp=2'",
                            source_loc(self.file, self.lines, 1, 1))
        kind, tok, _ = stmts[0]
        if kind != "mesh":
            raise self.err(tok, "the first statement must be the mesh, such as 'mesh tp=2' "
                                "(one size per axis; the last axis varies fastest)")
        self.mesh = self.make_mesh(stmts[0][2])
        seen, rules, topology, train, links, memory, stages = {"mesh": tok}, [], None, None, (), None, []
        seqpar = ctxpar = moe = None
        for kind, tok, payload in stmts[1:]:
            if kind == "stage":
                stages.append(make_stage(self, tok, payload, stages))
            elif kind != "rule":
                if kind in seen:
                    raise self.err(tok, f"{kind} is given twice (first on line {seen[kind].line}); "
                                        f"a spec has at most one {kind} statement")
                seen[kind] = tok
            if kind in _OPTION_STATEMENTS:
                self.no_repeats(kind, payload)
            if kind == "topology":
                topology, links = self.make_topology(tok, payload)
            elif kind == "memory":
                memory = parse_size(str(payload[0]), lambda m: self.err(payload[0], m))
            elif kind == "stage":
                pass
            elif kind == "sequence-parallel":  # transformer SP
                seqpar = (default_axis(self.mesh) if payload[0] is None
                          else self.axis(payload[0], "'sequence-parallel over'"), self.loc(tok))
            elif kind == "context-parallel":  # context parallel attention
                ctxpar = make_context_parallel(self, tok, payload)
            elif kind == "moe":  # MoE capacity policy
                moe = make_moe(self, tok, payload)
            elif kind == "train":
                train = TrainSpec(self.options(payload, "option"), self.loc(tok))
                train_config(Spec(self.mesh, (), self.file, train=train))  # options and ranges
            else:
                rules.append(self.make_rule(*payload))
        topo_loc = self.loc(seen["topology"]) if "topology" in seen else None
        return Spec(self.mesh, tuple(rules), self.file, topology, train, topo_loc, links, memory,
                    self.loc(seen["memory"]) if "memory" in seen else None,
                    check_stages(self, stages, train),
                    launch=getattr(self, "launch", ()), sequence_parallel=seqpar,
                    context_parallel=ctxpar, moe=moe)

    def make_mesh(self, axes) -> Mesh:
        check_mesh_size(axes, self.err)
        names = {}
        for name, size in axes:
            spec_int(size, self.file, self.lines)
            if str(name) in names:
                raise self.err(name, f"mesh axis {name} is given twice (axis names must differ)")
            if int(size) < 1:
                raise self.err(size, f"mesh axis {name} has size {int(size)}; a size must be >= 1")
            names[str(name)] = int(size)
        return Mesh(tuple(names.items()))

    def make_topology(self, tok, items) -> tuple:
        """``((nodes, devices_per_node) or None, link pairs)``: node keys need both or neither."""
        vals, links = {}, {}
        items = self.launch_keys(items)
        for key, val in items:
            k = str(key)
            if k not in _TOPOLOGY and k not in LINK_KEYS:
                keys = (*_TOPOLOGY, *LINK_KEYS, *_LAUNCH_KEYS)
                raise self.err(key, f"unknown topology key {k!r}{did_you_mean(k, keys)} (keys: {', '.join(keys)})")
            links_key = k in LINK_KEYS
            self.check_topo_value(k, val, LINK_KEYS.get(k, "a count"))
            (links if links_key else vals)[k] = str(val) if val.type == "NAME" else int(val)
        if not vals and (links or self.launch):
            return None, tuple(sorted(links.items()))
        if len(vals) != 2:
            raise self.err(tok, "topology needs both nodes=N and devices_per_node=N")
        nodes, per = vals["nodes"], vals["devices_per_node"]
        if nodes * per != self.mesh.size:
            raise self.err(tok, f"topology has {nodes}x{per}={nodes * per} devices but mesh "
                                f"{self.mesh} has {self.mesh.size} ranks")
        return (nodes, per), tuple(sorted(links.items()))

    def launch_keys(self, items) -> list:
        """The topology items other than ``placement=refuse|warn`` and ``timeout=SECONDS``,
        which go to ``self.launch`` (sorted pairs; the emitted program's defaults)."""
        rest, launch = [], {}
        for key, val in items:
            k = str(key)
            if k not in _LAUNCH_KEYS:
                rest.append((key, val))
                continue
            words = _LAUNCH_KEYS[k]
            if words and str(val) not in words:
                raise self.err(val, f"topology {k}={val}: give {' or '.join(words)}")
            if not words:
                self.check_topo_value(k, val, "seconds")
                if spec_int(val, self.file, self.lines) > MAX_TIMEOUT_S:  # program.py's --timeout bound
                    raise self.err(val, f"topology {k}={val}: at most {MAX_TIMEOUT_S:_} seconds")
            launch[k] = str(val) if words else int(val)
        self.launch = tuple(sorted(launch.items()))
        return rest

    def check_topo_value(self, key, val, wants: str) -> None:
        """A topology value of the right kind: a link class name, or a whole number >= 1."""
        if wants == "a link class":
            if val.type != "NAME" or str(val) not in LINKS:
                raise self.err(val, f"topology {key}={val}: not a link class{did_you_mean(str(val), LINKS)} "
                                    f"(classes: {', '.join(LINKS)})")
            return
        if val.type == "NAME":
            raise self.err(val, f"topology {key}={val}: give a whole number ({wants}), such as {key}=2")
        spec_int(val, self.file, self.lines)
        if int(val) < 1:
            raise self.err(val, f"topology {key} is {int(val)}; it must be >= 1")

    def no_repeats(self, kind: str, payload) -> None:
        """Every ``key=value`` option of a statement once: ``context-parallel lowering=ring
        lowering=all_to_all`` is an error at the second ``lowering``, never "the last one wins".

        Raises:
            SpecError: at the repeated key, naming the column of the first.
        """
        first = {}
        for item in payload:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], Token)):
                continue  # 'over AXIS' of context-parallel, a memory size
            k = str(item[0])
            if k in first:
                raise self.err(item[0], f"{kind} option {k} is given twice (first at column "
                                        f"{first[k].column}); give it once")
            first[k] = item[0]

    def options(self, items, what: str) -> tuple:
        out = {}
        for key, val in items:
            if str(key) in out:
                raise self.err(key, f"{what} {key} is given twice")
            if isinstance(val, tuple):  # a call: name(k=v, ...)
                val = (str(val[0]), self.options(val[1], "argument"))
            out[str(key)] = val
        return tuple(sorted(out.items()))

    def axis(self, tok, where: str) -> str:
        names = self.mesh.names
        if str(tok) not in names:
            raise self.err(tok, f"unknown mesh axis {str(tok)!r} in {where}{did_you_mean(str(tok), names)}"
                                f" (the mesh has axes: {', '.join(names)})")
        return str(tok)

    def axes_text(self) -> str:
        n = len(self.mesh.axes)
        return f"the mesh has {n} {'axis' if n == 1 else 'axes'}: {', '.join(self.mesh.names)}"

    def make_rule(self, target, pattern, layout) -> Rule:
        pat = str(pattern)
        if "" in pat.split("."):
            raise self.err(pattern, f"pattern {pat!r} has an empty dotted component")
        return Rule(str(target) if target is not None else "param", pat,
                    self.make_layout(layout), self.loc(pattern))

    def make_layout(self, layout) -> LayoutSpec:
        form, tok, body = layout
        naxes = len(self.mesh.axes)
        if form == "word":
            axis = default_axis(self.mesh) if body is None else self.axis(body, "'over'")
            if isinstance(tok, Token):
                if str(tok) not in LAYOUT_WORDS:
                    raise self.err(tok, f"unknown layout word {str(tok)!r}"
                                        f"{did_you_mean(str(tok), LAYOUT_WORDS)} "
                                        f"(layout words: {LAYOUT_WORDS_TEXT}; placements: R, S(d), P)")
                return LayoutSpec(str(tok), None, axis)
            full = [R] * naxes
            full[self.mesh.axis_index(axis)] = tok
            return LayoutSpec(None, tuple(full), axis)
        if form == "list":
            if len(body) != naxes:
                raise self.err(tok, f"the layout has {len(body)} placement"
                                    f"{'' if len(body) == 1 else 's'} but {self.axes_text()} "
                                    "(one placement per axis, in mesh order)")
            return LayoutSpec(None, tuple(body), None)
        given = {}
        for name, placement in body:
            axis = self.axis(name, "an axis=placement layout")
            if axis in given:
                raise self.err(name, f"mesh axis {axis} is given twice in the layout")
            given[axis] = placement
        return LayoutSpec(None, tuple(given.get(a, R) for a in self.mesh.names), None)
