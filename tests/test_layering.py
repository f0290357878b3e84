"""The layers of parcomp: which package may import which, written once, and checked.

Every import counts, function-level ones too: a lazy import hides a dependency from the import
time, not from the reader. A package may import its own modules and subpackages, and the
packages listed for it in :data:`MAY_IMPORT`; anything else is an upward import and fails,
naming file:line. :data:`KNOWN` lists the violations not yet removed, each with the change that
removes it; an entry that no longer occurs fails too, so the list only shrinks.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BASE = "parcomp"  # the top-level modules: errors, units, outdir
_LOW = (BASE, "parcomp.ir")

#: package -> the packages (or single modules) it may import, lowest layer first
MAY_IMPORT = {
    BASE: (),
    "parcomp.ir": (BASE,),
    "parcomp.cost": _LOW,
    "parcomp.spec": (*_LOW, "parcomp.cost"),
    "parcomp.reference": _LOW,
    "parcomp.rules": (*_LOW, "parcomp.reference"),
    "parcomp.passes": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules"),
    "parcomp.frontends": (*_LOW, "parcomp.spec", "parcomp.reference", "parcomp.passes"),
    "parcomp.report": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules", "parcomp.passes"),
    "parcomp.compile": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules", "parcomp.passes",
                        "parcomp.report"),
    "parcomp.check": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules", "parcomp.passes",
                      "parcomp.frontends", "parcomp.report", "parcomp.compile"),
    "parcomp.plan": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules", "parcomp.passes",
                     "parcomp.frontends", "parcomp.report", "parcomp.compile"),
    # backends read the IR and the Program, nothing else of the compiler
    "parcomp_backends": (*_LOW, "parcomp.compile.program"),
    "parcomp.cli": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules", "parcomp.passes",
                    "parcomp.frontends", "parcomp.report", "parcomp.compile", "parcomp.check", "parcomp.plan",
                    "parcomp_backends"),
    # the Python API (parallelize, check, explain, testing): a front end beside the CLI
    # (check reuses the CLI's command body, so its verdict is the CLI's)
    "parcomp.api": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules", "parcomp.passes",
                    "parcomp.frontends", "parcomp.report", "parcomp.compile", "parcomp.check", "parcomp.plan",
                    "parcomp_backends", "parcomp.cli"),
    "parcomp.testing": (*_LOW, "parcomp.cost", "parcomp.spec", "parcomp.reference", "parcomp.rules",
                        "parcomp.passes", "parcomp.frontends", "parcomp.report", "parcomp.compile", "parcomp.check",
                        "parcomp.api"),
}

#: single modules that may import more than their layer: ``parcomp/__init__.py`` re-exports the
#: Python API (``parcomp.parallelize``), imported on first use, not when ``parcomp`` is
FACADE = {"parcomp": ("parcomp.api",)}

#: (importing module, imported module) -> the change that removes it
KNOWN = {
    ("parcomp.frontends.torch.moe", "parcomp_backends.torch.runtime.program_moe"):
        "the MoE custom ops a torch model calls run the same torch functions program.py pastes in; "
        "move those functions to a torch-kernels module both may import (or allow the frontend the "
        "runtime by name here), without changing the pasted text",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = "parcomp_backends" if parts[0] == "backends" else parts[0]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> dict:
    return {_module_name(p): p for top in ("parcomp", "backends") for p in sorted((ROOT / top).rglob("*.py"))}


def imports() -> dict:
    """``{module: {imported parcomp module: first line}}``, function-level imports too."""
    files = _files()
    out = {}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for n in names:
                while n and n not in files:
                    n = n.rpartition(".")[0]
                if n and n != mod:
                    deps.setdefault(n, node.lineno)
        out[mod] = deps
    return out


def layer_of(mod: str) -> str:
    """The entry of :data:`MAY_IMPORT` a module belongs to: its longest package prefix."""
    best = BASE
    for key in MAY_IMPORT:
        if (mod == key or mod.startswith(key + ".")) and len(key) > len(best):
            best = key
    return best


def allowed(mod: str, dep: str) -> bool:
    own, theirs = layer_of(mod), layer_of(dep)
    if theirs in FACADE.get(mod, ()):
        return True
    if own == theirs:
        return True
    return any(theirs == a if a in MAY_IMPORT else (dep == a or dep.startswith(a + "."))
               for a in MAY_IMPORT[own])


def violations(graph: dict) -> dict:
    """``{(module, imported): line}`` of every import :data:`MAY_IMPORT` does not allow."""
    return {(m, d): line for m, deps in graph.items() for d, line in deps.items() if not allowed(m, d)}


def _where(mod: str, line: int) -> str:
    path = _files().get(mod)
    return f"{path.relative_to(ROOT) if path else mod}:{line}"


def test_no_upward_imports():
    found = violations(imports())
    new = sorted(k for k in found if k not in KNOWN)
    assert not new, "upward imports (see MAY_IMPORT):\n" + "\n".join(
        f"  {_where(m, found[(m, d)])}: {m} imports {d} ({layer_of(m)} may import: "
        f"{', '.join(MAY_IMPORT[layer_of(m)]) or 'nothing'})" for m, d in new)


def test_every_known_violation_still_occurs():
    gone = sorted(set(KNOWN) - set(violations(imports())))
    assert not gone, f"fixed: remove from KNOWN: {gone}"


def test_the_layer_map_is_acyclic_and_names_real_packages():
    files = _files()
    for layer, deps in MAY_IMPORT.items():
        assert layer in files, f"{layer}: no such package"
        for d in deps:
            assert d in files, f"{layer} may import {d}: no such package or module"
    assert find_cycle({k: {layer_of(d) for d in v} - {k} for k, v in MAY_IMPORT.items()}) is None


def find_cycle(graph) -> list | None:
    """One cycle of ``graph`` (``{node: set of nodes}``) as ``[a, b, ..., a]``, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_cycles():
    cycle = find_cycle({m: set(d) for m, d in imports().items()})
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_torch_backend_loads_no_pass_and_no_interpreter():
    code = ("import sys, parcomp_backends.torch\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('parcomp'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    loaded = out.split()
    assert "parcomp.compile.program" in loaded and "parcomp_backends.torch.emit" in loaded
    bad = [m for m in loaded if m.startswith(("parcomp.passes", "parcomp.reference.interpreter", "parcomp.check",
                                              "parcomp.frontends", "parcomp.cli"))]
    assert not bad, f"importing the torch backend loads {bad}"


def test_the_checks_can_fail():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert violations({"parcomp.ir.graph": {"parcomp.passes.verify": 3}}) == {
        ("parcomp.ir.graph", "parcomp.passes.verify"): 3}
    assert not violations({"parcomp.passes.verify": {"parcomp.ir.graph": 3}})
    assert violations({"parcomp.spec.model": {"parcomp.passes.verify": 3}})  # not allowed through BASE
    assert violations({"parcomp_backends.torch.emit": {"parcomp.compile.compiler": 1}})
    assert not violations({"parcomp_backends.torch.emit": {"parcomp.compile.program": 1}})
    graph = imports()
    assert "parcomp.ir.printer" in graph["parcomp.ir.graph"]  # a function-level import counts
