"""Parser of the parallel spec language (``.pcs``), grammar in ``grammar.lark``.

Lark (LALR, contextual lexer) builds the tree; :class:`SpecTree` turns it into raw
statements that still carry their tokens; :class:`SpecBuilder` checks them against
the mesh and makes the frozen :class:`~parcomp.spec.model.Spec`.  Every problem
is a :class:`~parcomp.errors.SpecError` at ``file:line:col`` with a caret; a
syntax error says in words (:data:`WORDS`, one phrase per grammar terminal) what
was expected, a character that cannot be in a name says which one.  A leading
UTF-8 byte order mark is skipped.

The words of its errors are in :mod:`.syntax`, the tree transformer in :mod:`.tree`,
the checks against the mesh in :mod:`.builder`, the check of rules against a model's
names in :mod:`.names` (re-exported here: :func:`check_names`).
"""
from __future__ import annotations

from importlib import resources

from lark import Lark, UnexpectedInput
from lark.exceptions import VisitError

from ..errors import SpecError, source_lines
from .builder import SpecBuilder
from .model import Spec
from .names import check_names
from .syntax import WORDS, source_loc, syntax_error
from .tree import SpecTree

__all__ = ["parse_spec", "load_spec", "check_names", "WORDS"]

_GRAMMAR = resources.files(__package__).joinpath("grammar.lark").read_text(encoding="utf-8")
_PARSER = Lark(_GRAMMAR, parser="lalr", propagate_positions=True, maybe_placeholders=True)


def parse_spec(text: str, file: str = "<string>") -> Spec:
    """Parse the text of a ``.pcs`` spec into a :class:`Spec`.

    Raises:
        SpecError: a syntax error (saying what was expected), an unknown layout
            word or mesh axis, a layout with the wrong number of placements, a
            missing, misplaced or repeated ``mesh``, a bad mesh axis size or a
            repeated axis name, a bad ``topology``, a repeated ``train`` or a
            train option out of its range (see :mod:`parcomp.spec.train_config`).
    """
    text = text[1:] if text.startswith("\ufeff") else text
    lines = source_lines(text)
    try:
        tree = _PARSER.parse(text if text.endswith("\n") else text + "\n")
    except UnexpectedInput as e:
        raise syntax_error(e, file, lines) from None
    try:
        stmts = SpecTree(file, lines).transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, SpecError):
            raise e.orig_exc from None
        meta = getattr(e.obj, "meta", e.obj)  # a Tree's meta, or the Token itself
        raise SpecError(f"cannot read this {e.rule}: {type(e.orig_exc).__name__}: {e.orig_exc}",
                        source_loc(file, lines, getattr(meta, "line", 1), getattr(meta, "column", 1))
                        ) from None
    return SpecBuilder(file, lines).build(stmts)


def load_spec(path) -> Spec:
    """Read and parse the spec file at ``path``.

    Raises:
        SpecError: the file cannot be read (naming the path), or any error of
            :func:`parse_spec`.
    """
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError(f"spec file {str(path)!r} does not exist", where=str(path)) from None
    except UnicodeDecodeError as e:
        raise SpecError(f"spec file {str(path)!r} is not UTF-8 text: byte 0x{e.object[e.start]:02x}"
                        f" at offset {e.start}", where=str(path)) from None
    except OSError as e:
        raise SpecError(f"cannot read spec file {str(path)!r}: {e.strerror or e}",
                        where=str(path)) from None
    return parse_spec(text, str(path))

