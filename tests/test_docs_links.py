"""The docs point only at files in the repository: every ``docs/...md`` path and every relative
Markdown link in the docs, README, sources and tests names a file that exists; nothing names
the old single ``docs/design.md`` or a design document outside the repository."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_PATH = re.compile(r"\bdocs/[\w/.-]*\w")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\.md|docs/design\.md")


def tracked() -> list:
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.split()
    return [p for p in out if p.endswith((".py", ".md", ".pcs", ".lark")) and not p.startswith("tests/golden/")
            and p != "tests/test_docs_links.py" and (ROOT / p).is_file()]


def broken(files: dict) -> list:
    """Each bad reference in ``files`` (``{path relative to the root: its text}``), as file:line: why."""
    found = []
    for rel, text in files.items():
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{rel}:{n}: names the old single design file or one outside the repository: {OUTSIDE.search(line).group(0)}")
            for m in DOC_PATH.finditer(line):
                if not (ROOT / m.group(0)).exists():
                    found.append(f"{rel}:{n}: no such file: {m.group(0)}")
            if rel.endswith(".md"):
                for m in MD_LINK.finditer(line):
                    target = m.group(1)
                    if "://" not in target and not (ROOT / rel).parent.joinpath(target).exists():
                        found.append(f"{rel}:{n}: broken link: {target}")
    return found


def test_every_docs_path_and_link_names_a_file_in_the_repository():
    found = broken({rel: (ROOT / rel).read_text(encoding="utf-8") for rel in tracked()})
    assert not found, "\n".join(found)


def test_the_check_can_fail():
    found = broken({"docs/design/probe.md": "see docs/design.md, [x](nowhere.md), docs/design/none.md\n"
                                            "and [check](check.md), docs/design/check.md\n"})
    assert [f.split(": ", 1)[1] for f in found] == [
        "names the old single design file or one outside the repository: docs/design.md", "no such file: docs/design.md",
        "no such file: docs/design/none.md", "broken link: nowhere.md"], found
