"""Output directories: parcomp replaces the files it wrote and keeps everything else.

Every directory parcomp writes holds a marker file, ``.parcomp-output``: a JSON
manifest of the files parcomp wrote there, name -> sha256 of the content (or
``null`` for a file a program writes afterwards, such as ``run --keep``'s
``model.pt``).  Writing into such a directory again replaces only the files of
the manifest that are still what parcomp wrote (a regular file with that
content); it never deletes or overwrites anything else:

- a file or directory the user added (a checkpoint, notes) is kept, and the
  caller reports it (``kept``);
- a manifest file the user has since edited, or replaced by a directory or a
  link, is the user's now: kept if the new output does not have that name,
  otherwise the write is refused, naming it;
- a marker that is not a manifest (garbage) lists nothing, so nothing is
  replaced and a name clash is refused; a marker from before manifests
  (``written by parcomp; ...``) lists the files ``compile`` wrote then;
- a directory another kind of output was written into (``compile -o`` vs
  ``explain --plots`` vs ``run --keep`` vs ``export -o``: the manifest's ``command``)
  is refused as a whole: one command never removes another's output.

Files a program writes afterwards are listed without a hash first; once the
caller has written them, :func:`record_written` puts their hashes in, so a later
edit of them is noticed like any other.

All or nothing for parcomp's own files: the new files go to temporary files
in the directory first, the old ones are moved aside, the new ones renamed into
place, and only then are the old ones deleted; any failure puts the old set back.
A directory that does not exist yet is written as a temporary sibling and
renamed into place.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile

from .errors import ParcompError

MARKER = ".parcomp-output"
TEMP_PREFIX = ".parcomp-tmp-"  # parcomp's temporary files: never the user's entries
LEGACY = ("report.json", "sharded.pcir", "program.pcir", "program.py")  # before manifests
_NOTE = ("written by parcomp: writing into this directory again replaces only the files listed "
         "here, if unchanged; everything else is left alone")


def write_dir_atomic(out: str, files: dict, later=(), flag: str = "-o", command: str = "compile") -> list:
    """Write ``{name: text or bytes}`` into directory ``out``; returns what it kept (sorted names).
    The files and a new directory get the modes a plain write gives (0666 / 0777 less the umask).

    Args:
        out: the directory (created with its parents if missing).
        files: file name -> text (written as UTF-8) or bytes (written as they are).
        later: names of files the caller writes into ``out`` afterwards; they go
            into the manifest (without a hash), and an old one of parcomp's is removed.
        flag: the option that named ``out``, for messages (``-o``, ``--keep``).
        command: the kind of output (``compile``, ``plots``, ``run``, ``export``), kept in the manifest.

    Returns:
        The names in ``out`` that are not parcomp's (kept untouched), sorted.

    Raises:
        ParcompError: naming ``out`` (``where``): it is a file, a file stands where
            a parent directory should be, it is or holds the current directory, it
            is a non-empty directory parcomp did not write, it holds another command's
            output, it holds a file of the new output's name that is not parcomp's, or
            writing fails (the OS's reason).
    """
    out = os.path.abspath(out)
    check_target(out, flag)
    try:
        with _locked(os.path.dirname(out)):
            if not os.path.lexists(out):
                _write_fresh(out, files, later, command)
                return []
            return _write_into(out, files, later, flag, command)
    except OSError as e:
        at = f" ({e.filename})" if isinstance(e.filename, str) and e.filename != out else ""
        raise ParcompError(f"{flag} {out}: cannot write the output there: {e.strerror or e}{at}",
                           where=out) from None


@contextlib.contextmanager
def _locked(parent: str):
    """Hold an exclusive ``flock`` on directory ``parent`` (created if missing): parcomp
    processes writing outputs into one directory take turns instead of racing (a lock on
    the directory itself, so no lock file is left behind)."""
    os.makedirs(parent, exist_ok=True)
    fd = os.open(parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _fail(flag, out, msg) -> ParcompError:
    return ParcompError(f"{flag} {out}: {msg}", where=out)


def check_target(out: str, flag: str = "-o") -> None:
    """Refuse an output directory ``out`` (absolute) that :func:`write_dir_atomic` would refuse
    before looking inside it: the current directory, a file, a file in place of a parent.
    Callers that compute the output first call it to fail fast.

    Raises:
        ParcompError: naming ``out`` (``where``) and ``flag``.
    """
    cwd = os.getcwd()
    if out == cwd or cwd.startswith(out.rstrip(os.sep) + os.sep):
        raise _fail(flag, out, "that is the current directory (or holds it); give a new one")
    if os.path.lexists(out) and not os.path.isdir(out):
        kind = "a link" if os.path.islink(out) else "a file"
        raise _fail(flag, out, f"a file of that name exists ({kind}, not a directory); parcomp never "
                               f"overwrites what it did not write and left it alone: give a directory name")
    parent = os.path.dirname(out)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise _fail(flag, out, f"{parent} is a file, not a directory")


def _write_fresh(out: str, files: dict, later, command: str) -> None:
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".parcomp-", dir=parent)
    try:
        os.chmod(tmp, 0o777 & ~_umask())
        for name, text in files.items():
            _write(os.path.join(tmp, name), text)
        _write(os.path.join(tmp, MARKER), _manifest(files, later, command))
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_into(out: str, files: dict, later, flag: str, command: str) -> list:
    entries = set(os.listdir(out))
    marker = os.path.join(out, MARKER)
    if entries and MARKER not in entries:
        raise _fail(flag, out, "the directory exists, is not empty and was not written by "
                               "parcomp; it is left alone. Give a new or empty directory.")
    if MARKER in entries and (os.path.islink(marker) or not os.path.isfile(marker)):
        raise _fail(flag, out, f"its {MARKER} is not parcomp's marker file (a directory or a "
                               f"link); the directory is left alone")
    listed = _read_manifest(marker) if MARKER in entries else {}
    before = _read_command(marker) if MARKER in entries else None
    if before is not None and before != command:
        raise _fail(flag, out, f"it holds the output of {_COMMANDS.get(before, before)}, and this "
                               f"command writes {_COMMANDS.get(command, command)}; one never "
                               f"replaces the other: give another directory")
    ours = {n for n, digest in listed.items()
            if n in entries and _unchanged(os.path.join(out, n), digest)}
    new = set(files) | set(later)
    blocked = sorted(n for n in new if n in entries and n not in ours)
    if blocked:
        raise _fail(flag, out, f"{', '.join(blocked)} {'is' if len(blocked) == 1 else 'are'} not "
                               f"parcomp's (not written by it, or changed or replaced since) and "
                               f"would be overwritten; move {'it' if len(blocked) == 1 else 'them'}"
                               f" away or give another directory"
                               + ("" if listed else f" ({MARKER} lists no files of parcomp's)"))
    replaced = sorted(ours) + ([MARKER] if MARKER in entries else [])
    _swap(out, {**files, MARKER: _manifest(files, later, command)}, replaced)
    return sorted(n for n in set(os.listdir(out)) - new - {MARKER} if not n.startswith(TEMP_PREFIX))


def _swap(out: str, texts: dict, old: list) -> None:
    """Write ``texts`` to temporary files, move ``old`` aside, rename the new ones in;
    on any failure put ``old`` back.  Then delete ``old``."""
    temps, aside, placed = {}, {}, []
    try:
        for name, text in texts.items():
            temps[name] = _temp(out)
            _write(temps[name], text)
        for name in old:
            tmp = _temp(out)
            try:
                os.replace(os.path.join(out, name), tmp)
            except BaseException:
                _remove(tmp)
                raise
            aside[name] = tmp  # only once it holds the old file
        for name, tmp in temps.items():
            os.replace(tmp, os.path.join(out, name))
            placed.append(name)
    except BaseException:
        for name in placed:
            _remove(os.path.join(out, name))
        for name, tmp in aside.items():
            try:
                os.replace(tmp, os.path.join(out, name))
            except OSError:  # left under its temporary name: moved, not lost
                pass
        for name, tmp in temps.items():
            if name not in placed:
                _remove(tmp)
        raise
    for tmp in aside.values():
        _remove(tmp)


_COMMANDS = {"compile": "`parcomp compile -o` (a program)", "plots": "`parcomp explain --plots` (plots)",
             "run": "`parcomp run --keep` (a program and its run's files)",
             "export": "`parcomp export -o` (a from_pretrained directory)"}


def _manifest(files: dict, later, command: str) -> str:
    listed = {n: _digest(_bytes(t)) for n, t in files.items()}
    listed.update({n: None for n in later})
    return _manifest_text(listed, command)


def _manifest_text(listed: dict, command: str) -> str:
    return json.dumps({"note": _NOTE, "command": command, "files": listed}, indent=1,
                      sort_keys=True) + "\n"


def record_written(out: str, names) -> None:
    """Put the hashes of ``names`` (files the caller wrote into ``out`` after
    :func:`write_dir_atomic` listed them as ``later``) into ``out``'s manifest, so an
    edit of them afterwards makes them the user's.  Names not in the manifest, or not
    regular files now, are left as they are.  Raises nothing a caller must handle:
    an unreadable marker is left alone (its files then stay hash-less)."""
    out = os.path.abspath(out)
    marker = os.path.join(out, MARKER)
    with _locked(os.path.dirname(out)):
        listed, command = _read_manifest(marker), _read_command(marker)
        if command is None:
            return
        for n in names:
            path = os.path.join(out, n)
            if n in listed and listed[n] is None and os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    listed[n] = _digest(f.read())
        tmp = _temp(out)
        try:
            _write(tmp, _manifest_text(listed, command))
            os.replace(tmp, marker)
        except BaseException:
            _remove(tmp)
            raise


def _read_command(marker: str) -> str | None:
    """The ``command`` a manifest names (``None``: none, or not a manifest)."""
    try:
        with open(marker, "rb") as f:
            data = json.loads(f.read(1 << 20).decode("utf-8"))
    except (OSError, ValueError):
        return None
    c = data.get("command") if isinstance(data, dict) else None
    return c if isinstance(c, str) else None


def _read_manifest(marker: str) -> dict:
    """``{name: sha256 or None}`` of the files parcomp wrote, from the marker file
    (``{}`` for a missing, unreadable or garbage marker)."""
    try:
        with open(marker, "rb") as f:
            raw = f.read(1 << 20)
    except OSError:
        return {}
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError:  # not JSON (or not UTF-8)
        return dict.fromkeys(LEGACY) if raw.startswith(b"written by parcomp;") else {}
    files = data.get("files") if isinstance(data, dict) else None
    if not isinstance(files, dict):
        return {}
    return {n: d for n, d in files.items()
            if _plain_name(n) and n != MARKER and (d is None or isinstance(d, str))}


def _plain_name(name) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "\0" not in name
            and os.path.basename(name) == name and "/" not in name and os.sep not in name)


def _unchanged(path: str, digest: str | None) -> bool:
    """``path`` is still the regular file parcomp wrote (same content, if it has a digest)."""
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    if digest is None:
        return True
    with open(path, "rb") as f:
        return _digest(f.read()) == digest


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bytes(content) -> bytes:
    return content if isinstance(content, (bytes, bytearray, memoryview)) else content.encode("utf-8")


def _write(path: str, content) -> None:
    with open(path, "wb") as f:
        f.write(_bytes(content))


def _temp(out: str) -> str:
    fd, path = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=out)
    os.close(fd)
    os.chmod(path, 0o666 & ~_umask())
    return path


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_own_file(path: str, header: str, writer: str) -> None:
    """Refuse (ParcompError naming ``-o``) unless ``path`` may take a file ``writer`` writes
    with the checksum ``header``: a new file in an existing directory, or one that ``writer``
    wrote and nobody changed since (its first line: ``header`` + sha256 of the rest)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise ParcompError(f"{path}: " + ("a directory; give a file name for the spec" if os.path.isdir(path)
                                          else f"its directory {folder} does not exist"), where="-o")
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            first, rest = f.readline(), f.read()
        if not first.startswith(header) or first[len(header):].strip() != _text_digest(rest):
            raise ParcompError(f"{path} exists and was not written by {writer} (or was changed since): "
                               "parcomp never overwrites it; choose another -o or remove it", where="-o")


def write_own_file(path: str, text: str, header: str, writer: str) -> None:
    """Write ``text`` to ``path`` under ``header`` + its checksum, all or nothing (a fresh
    temporary name, then one rename), after :func:`check_own_file`.

    Raises:
        ParcompError: see :func:`check_own_file`; or the directory cannot be written."""
    check_own_file(path, header, writer)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".parcomp-tmp-", dir=folder)
    except OSError as e:
        raise ParcompError(f"{path}: cannot write in {folder} ({e.strerror})", where="-o") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(f"{header}{_text_digest(text)}\n{text}")
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(tmp, 0o666 & ~mask)  # as open() would have made it (mkstemp: 0600)
    os.replace(tmp, path)


def _text_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
