"""SQL text as PostgreSQL reads it: tokens, and a file split into statements.

Enough of PostgreSQL's lexer for the package's SQL files, and for what psql does when it splits a
script: a semicolon ends a statement unless it is inside a string (``'...'``, ``E'...'`` with its
backslash escapes), a dollar-quoted string (``$$...$$``, ``$body$...$body$``), a quoted identifier,
a comment (``--`` to the end of the line, ``/* ... */`` nested) or the ``BEGIN ATOMIC ... END`` body
of a routine. Each statement keeps the ``--`` lines written right above it (its comment), and its
text as written, so that a tool can restate it whole.

Not a parser: ``normal_form`` gives a statement's tokens with comments and layout removed and
unquoted words lower-cased, what two spellings of one statement share; strings and function bodies
are kept exactly, since PostgreSQL stores them as written.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

#: Where the package's SQL files say "the schema the lease app is installed in" (sql/files.py).
PLACEHOLDER = "@extschema@"

_SPACE = re.compile(r"\s+")
_WORD = re.compile(r"[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_$\u0080-\U0010ffff]*")
_NUMBER = re.compile(r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_PARAMETER = re.compile(r"\$\d+")
_DOLLAR_TAG = re.compile(r"\$(?:[A-Za-z_\u0080-\U0010ffff][A-Za-z0-9_\u0080-\U0010ffff]*)?\$")
_OPERATOR_CHARACTERS = frozenset("+-*/<>=~!@#%^&|`?")
_PUNCTUATION = frozenset("(),;[].:")
#: An unquoted identifier as PostgreSQL folds it: such a quoted one means the same without quotes.
_PLAIN_NAME = re.compile(r"[a-z_][a-z0-9_$]*")


class SqlSyntaxError(ValueError):
    """Text the lexer cannot read: an unterminated string, comment or dollar quote."""


@dataclass(frozen=True)
class Token:
    """One token: ``kind`` is ``space``, ``comment``, ``word``, ``quoted`` (an identifier in double
    quotes), ``string``, ``dollar`` (a dollar-quoted string), ``number``, ``parameter``, ``operator``
    or ``punctuation``."""

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
            name = self.text[1:-1].replace('""', '"')
            return name if _PLAIN_NAME.fullmatch(name) else self.text
        if self.kind == "dollar":
            tag = _DOLLAR_TAG.match(self.text)
            assert tag is not None
            return "$$" + self.text[tag.end() : len(self.text) - len(tag.group())] + "$$"
        return self.text


@dataclass(frozen=True)
class Statement:
    """One statement of a file: its text from its first token up to (not including) its semicolon,
    its tokens without spaces and comments, where it starts, and the ``--`` lines right above it."""

    text: str
    tokens: tuple[Token, ...]
    offset: int  # where the text starts in its file
    line: int
    comment: str  # the comment lines, each ending in a newline ("" when none)

    def written(self, first: Token, last: Token) -> str:
        """The statement's text from ``first`` to ``last`` (tokens of it), as written."""
        return self.text[first.start - self.offset : last.end - self.offset]

    def sql(self, *, with_comment: bool = True) -> str:
        """The statement, terminated, with its comment above it."""
        return (self.comment if with_comment else "") + self.text + ";"


def tokens(text: str) -> Iterator[Token]:
    """``text`` as PostgreSQL's lexer reads it, every character in exactly one token."""
    at = 0
    while at < len(text):
        char = text[at]
        if char.isspace():
            match = _SPACE.match(text, at)
            assert match is not None
            end = match.end()
            kind = "space"
        elif text.startswith("--", at):
            newline = text.find("\n", at)
            end = len(text) if newline < 0 else newline
            kind = "comment"
        elif text.startswith("/*", at):
            end, kind = _block_comment_end(text, at), "comment"
        elif text.startswith(PLACEHOLDER, at):
            end, kind = at + len(PLACEHOLDER), "word"
        elif char in "Ee" and text.startswith("'", at + 1):
            end, kind = _string_end(text, at + 1, backslashes=True), "string"
        elif char == "'":
            end, kind = _string_end(text, at, backslashes=False), "string"
        elif char == '"':
            end, kind = _quoted_end(text, at), "quoted"
        elif char == "$" and (tag := _DOLLAR_TAG.match(text, at)):
            close = text.find(tag.group(), tag.end())
            if close < 0:
                raise SqlSyntaxError(f"line {_line(text, at)}: unterminated dollar-quoted string {tag.group()}")
            end, kind = close + len(tag.group()), "dollar"
        elif match := _PARAMETER.match(text, at):
            end, kind = match.end(), "parameter"
        elif match := _WORD.match(text, at):
            end, kind = match.end(), "word"
        elif match := _NUMBER.match(text, at):
            end, kind = match.end(), "number"
        elif char in _OPERATOR_CHARACTERS:
            end = at + 1
            while end < len(text) and text[end] in _OPERATOR_CHARACTERS and text[end : end + 2] not in ("--", "/*"):
                end += 1
            kind = "operator"
        else:
            end, kind = at + 1, "punctuation" if char in _PUNCTUATION else "operator"
        yield Token(kind, text[at:end], at)
        at = end


def split(text: str) -> list[Statement]:
    """The statements of ``text`` (a script as psql runs it), in order; empty ones left out."""
    found: list[Statement] = []
    current: list[Token] = []  # the statement's tokens so far, spaces and comments included
    code: list[Token] = []
    begin_depth = paren_depth = 0
    gap_start = 0  # where the text between the previous statement and this one starts
    for token in tokens(text):
        if not code and token.kind in ("space", "comment"):
            continue
        if token.kind == "punctuation" and token.text == ";" and begin_depth == 0:
            if code:
                found.append(_statement(text, current, code, gap_start))
            current, code, begin_depth, paren_depth, gap_start = [], [], 0, 0, token.end
            continue
        current.append(token)
        if token.kind in ("space", "comment"):
            continue
        code.append(token)
        if token.text in ("(", ")") and token.kind == "punctuation":
            paren_depth += 1 if token.text == "(" else -1
        elif token.kind == "word" and paren_depth == 0 and _is_routine(code):
            # psql's rule: inside CREATE [OR REPLACE] FUNCTION/PROCEDURE, semicolons between BEGIN
            # and its END (a BEGIN ATOMIC body) end nothing; CASE ... END nests inside one.
            word = token.upper
            if word == "BEGIN" or (word == "CASE" and begin_depth > 0):
                begin_depth += 1
            elif word == "END" and begin_depth > 0:
                begin_depth -= 1
    if code:
        found.append(_statement(text, current, code, gap_start))
    return found


def normal_form(tokens: Sequence[Token]) -> str:
    """``tokens`` with layout and comments gone, unquoted words lower case, strings as written."""
    return " ".join(token.normal() for token in tokens if token.kind not in ("space", "comment"))


def _statement(text: str, current: list[Token], code: list[Token], gap_start: int) -> Statement:
    last = max(i for i, token in enumerate(current) if token.kind not in ("space", "comment"))
    start, end = current[0].start, current[last].end
    return Statement(
        text=text[start:end],
        tokens=tuple(code),
        offset=start,
        line=_line(text, start),
        comment=_comment_above(text[gap_start:start], at_file_start=gap_start == 0),
    )


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


def _is_routine(code: list[Token]) -> bool:
    words = [token.upper for token in code[:4]]
    return words[:1] == ["CREATE"] and (
        words[1:2] in (["FUNCTION"], ["PROCEDURE"])
        or (words[1:3] == ["OR", "REPLACE"] and words[3:4] in (["FUNCTION"], ["PROCEDURE"]))
    )


def _string_end(text: str, quote: int, *, backslashes: bool) -> int:
    at = quote + 1
    while at < len(text):
        if backslashes and text[at] == "\\":
            at += 2
        elif text[at] == "'":
            if text.startswith("'", at + 1):
                at += 2
            else:
                return at + 1
        else:
            at += 1
    raise SqlSyntaxError(f"line {_line(text, quote)}: unterminated string")


def _quoted_end(text: str, quote: int) -> int:
    at = quote + 1
    while (close := text.find('"', at)) >= 0:
        if not text.startswith('"', close + 1):
            return close + 1
        at = close + 2
    raise SqlSyntaxError(f"line {_line(text, quote)}: unterminated quoted identifier")


def _block_comment_end(text: str, start: int) -> int:
    depth, at = 0, start
    while at < len(text):
        if text.startswith("/*", at):
            depth, at = depth + 1, at + 2
        elif text.startswith("*/", at):
            depth, at = depth - 1, at + 2
            if depth == 0:
                return at
        else:
            at += 1
    raise SqlSyntaxError(f"line {_line(text, start)}: unterminated /* comment")


def _line(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1
