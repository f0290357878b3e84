"""No module of parcomp or its backends uses another module's private ``_names``.

A leading underscore says "this module's business": a name another module needs is public in the
module that owns it by concept. The test reads every module under ``parcomp/`` and ``backends/``
with :mod:`ast` and fails on ``from X import _name`` and on ``X._name`` where ``X`` is another
parcomp or backend module (imported by any spelling: absolute, relative, aliased, or as a
package's attribute). Dunder names (``__version__``) are public.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = "parcomp_backends" if parts[0] == "backends" else parts[0]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_files() -> dict:
    return {module_name(p): p for top in ("parcomp", "backends") for p in sorted((ROOT / top).rglob("*.py"))}


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(mod: str, source: str, modules: dict) -> list:
    """``[(line, col, text)]``: each use in ``source`` (module ``mod``) of another module's private name."""
    pkg = mod if str(modules.get(mod, "")).endswith("__init__.py") else mod.rpartition(".")[0]
    tree = ast.parse(source)
    aliases = {}  # local name -> the module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    aliases[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            if base not in modules:
                continue
            for a in node.names:
                if f"{base}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif is_private(a.name) and base != mod:
                    found.append((node.lineno, node.col_offset, f"from {base} import {a.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        chain, inner = [], node.value
        while isinstance(inner, ast.Attribute):
            chain.append(inner.attr)
            inner = inner.value
        if not isinstance(inner, ast.Name) or inner.id not in aliases:
            continue
        target = ".".join([aliases[inner.id], *reversed(chain)])
        if target in modules and target != mod:
            found.append((node.lineno, node.col_offset, f"{target}.{node.attr}"))
    return sorted(found)


def violations() -> list:
    files = module_files()
    return [f"{path.relative_to(ROOT)}:{line}:{col + 1}: {text}"
            for mod, path in files.items()
            for line, col, text in private_uses(mod, path.read_text(encoding="utf-8"), files)]


def test_no_module_uses_another_modules_private_names():
    found = violations()
    assert not found, (f"{len(found)} uses of another module's private name (make the name public in the "
                       "module that owns it, or move it there):\n  " + "\n  ".join(found))


def test_the_check_can_fail():
    modules = {"parcomp": Path("parcomp/__init__.py"), "parcomp.a": Path("parcomp/a.py"), "parcomp.b": Path("parcomp/b.py"),
               "parcomp.pkg": Path("parcomp/pkg/__init__.py"), "parcomp.pkg.c": Path("parcomp/pkg/c.py")}
    src = ("from parcomp.a import _x, y, __version__\n"
           "import parcomp.a\nimport parcomp.pkg.c as cc\nfrom parcomp import a as aa\n"
           "from .pkg import c\n"
           "def f():\n    return parcomp.a._p, cc._q, aa._r, c._s, aa.__doc__, aa.pub, _own\n")
    assert [t for _, _, t in private_uses("parcomp.b", src, modules)] == [
        "from parcomp.a import _x", "parcomp.a._p", "parcomp.pkg.c._q", "parcomp.a._r", "parcomp.pkg.c._s"]
    assert private_uses("parcomp.a", "from parcomp.a import _x\n", modules) == []
    assert [t for _, _, t in private_uses("parcomp.pkg", "from .c import _z\n", modules)] == [
        "from parcomp.pkg.c import _z"]
