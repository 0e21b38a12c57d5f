"""SQL text as PostgreSQL reads it: a file split into statements, each with its parse tree.

PostgreSQL's own lexer and parser do the reading, through pglast (libpg_query): where a statement
ends, however its strings, dollar quotes, comments or ``BEGIN ATOMIC`` body are written, and what
it says. Each statement keeps its text as written and the ``--`` lines right above it (its comment),
so that a tool can restate it whole.

``@extschema@`` is not SQL: it is read as a quoted name of the same length, so every offset the
parser reports is also one in the text as written.

``normal_form`` gives a statement's tokens with comments and layout removed and unquoted words
lower-cased, what two spellings of one statement share; strings and function bodies are kept
exactly, since PostgreSQL stores them as written.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pglast import ast, parse_sql
from pglast.parser import ParseError, scan

#: Where the package's SQL files say "the schema the lease app is installed in" (sql/files.py).
PLACEHOLDER = "@extschema@"
#: What the parser reads in its place: a name, as long as the placeholder.
STAND_IN = '"extschema"'
assert len(STAND_IN) == len(PLACEHOLDER)

_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_\u0080-\U0010ffff]*)?\$")
_PUNCTUATION = frozenset("(),;[].:")
#: An unquoted identifier as PostgreSQL folds it: such a quoted one means the same without quotes.
_PLAIN_NAME = re.compile(r"[a-z_][a-z0-9_$]*")
_KINDS = {"SQL_COMMENT": "comment", "C_COMMENT": "comment", "ICONST": "number", "FCONST": "number"}


class SqlSyntaxError(ValueError):
    """Text PostgreSQL's parser refuses, with the line it names."""


@dataclass(frozen=True)
class Token:
    """One token as PostgreSQL's lexer reads it: ``kind`` is ``comment``, ``word`` (a keyword or a
    plain name), ``quoted`` (an identifier in double quotes), ``string``, ``dollar`` (a
    dollar-quoted string), ``number``, ``parameter``, ``operator`` or ``punctuation``."""

    kind: str
    text: str
    start: int

    @property
    def end(self) -> int:
        return self.start + len(self.text)

    @property
    def upper(self) -> str:
        """A word as a keyword (upper case); any other token as written."""
        return self.text.upper() if self.kind == "word" else self.text

    def normal(self) -> str:
        """The token as two spellings of the same SQL share it."""
        if self.kind == "word":
            return self.text.lower()
        if self.kind == "quoted":
            return quoted_name(self.text[1:-1].replace('""', '"'))
        if self.kind == "dollar":
            tag = _DOLLAR_TAG.match(self.text)
            assert tag is not None
            return "$$" + self.text[tag.end() : len(self.text) - len(tag.group())] + "$$"
        return self.text


@dataclass(frozen=True)
class Statement:
    """One statement of a file: its parse tree, its text from its first token up to (not including)
    its semicolon, its tokens without comments, where it starts, and the ``--`` lines right above it."""

    node: ast.Node
    text: str
    tokens: tuple[Token, ...]
    offset: int  # where the text starts in its file
    line: int
    comment: str  # the comment lines, each ending in a newline ("" when none)

    def written(self, first: Token, last: Token) -> str:
        """The statement's text from ``first`` to ``last`` (tokens of it), as written."""
        return self.text[first.start - self.offset : last.end - self.offset]

    def at(self, location: int) -> int:
        """The index of the token that starts at ``location`` (an offset the parser gave)."""
        index = bisect.bisect_left([token.start for token in self.tokens], location)
        assert self.tokens[index].start == location
        return index

    def sql(self, *, with_comment: bool = True) -> str:
        """The statement, terminated, with its comment above it."""
        return (self.comment if with_comment else "") + self.text + ";"


def quoted_name(name: str) -> str:
    """A name as the normal form writes it: bare when PostgreSQL would fold it to itself."""
    return name if _PLAIN_NAME.fullmatch(name) else '"' + name.replace('"', '""') + '"'


def tokens(text: str) -> list[Token]:
    """``text`` as PostgreSQL's lexer reads it, comments included, layout left out."""
    read = text.replace(PLACEHOLDER, STAND_IN)
    return [_token(text, found.start, found.end + 1, found.name, found.kind) for found in scan(read)]


def split(text: str) -> list[Statement]:
    """The statements of ``text`` (a script as psql runs it), in order; empty ones left out."""
    try:
        raw_statements = parse_sql(text.replace(PLACEHOLDER, STAND_IN))
    except ParseError as error:
        message, at = error.args if len(error.args) == 2 else (str(error), 0)
        raise SqlSyntaxError(f"line {_line(text, at)}: {message}") from None
    every = tokens(text)
    starts = [token.start for token in every]
    found: list[Statement] = []
    gap_start = 0  # where the text between the previous statement and this one starts
    for raw in raw_statements:
        start = raw.stmt_location or 0
        stop = start + raw.stmt_len if raw.stmt_len else len(text)
        within = every[bisect.bisect_left(starts, start) : bisect.bisect_left(starts, stop)]
        code = [token for token in within if token.kind != "comment"]
        while code[-1].text == ";":  # the last statement's, when the parser counts it in
            code.pop()
        first, last = code[0].start, code[-1].end
        found.append(
            Statement(
                node=_given(raw.stmt),
                text=text[first:last],
                tokens=tuple(code),
                offset=first,
                line=_line(text, first),
                comment=_comment_above(text[gap_start:first], at_file_start=gap_start == 0),
            )
        )
        after = every[bisect.bisect_left(starts, last) :]
        gap_start = next((token.end for token in after if token.text == ";"), len(text))
    return found


def normal_form(tokens: Sequence[Token]) -> str:
    """``tokens`` with layout and comments gone, unquoted words lower case, strings as written."""
    return " ".join(token.normal() for token in tokens if token.kind != "comment")


def _given(node: ast.Node | None) -> ast.Node:
    assert node is not None  # a statement the parser read always has its tree
    return node


def _token(text: str, start: int, end: int, name: str, keyword: str) -> Token:
    written = text[start:end]
    if written == PLACEHOLDER or keyword != "NO_KEYWORD" or (name == "IDENT" and not written.startswith('"')):
        kind = "word"
    elif name == "IDENT":
        kind = "quoted"
    elif name in ("SCONST", "USCONST", "BCONST", "XCONST"):
        kind = "dollar" if written.startswith("$") else "string"
    elif name == "PARAM":
        kind = "parameter"
    else:
        kind = _KINDS.get(name, "punctuation" if written in _PUNCTUATION else "operator")
    return Token(kind, written, start)


def _comment_above(gap: str, *, at_file_start: bool) -> str:
    """The ``--`` lines that end right above a statement (no blank line between), from the text
    between it and the statement before; the first line of that text ends the statement before."""
    lines = gap.split("\n")
    candidates = lines[:-1] if at_file_start else lines[1:-1]
    kept: list[str] = []
    for line in reversed(candidates):
        if not line.lstrip().startswith("--"):
            break
        kept.append(line.rstrip() + "\n")
    return "".join(reversed(kept))


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1
