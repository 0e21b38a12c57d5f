"""How a statement names things: schema-qualified names, parenthesised lists, function signatures.

Read from a statement's tokens (``text.Statement.tokens``); what is wrong raises ``StatementError``,
which the caller turns into a message naming the statement and its file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from devkit.sqlchange.text import PLACEHOLDER, Statement, Token, normal_form

_TYPE_ALIASES = {
    "timestamptz": "timestamp with time zone",
    "timestamp": "timestamp without time zone",
    "timetz": "time with time zone",
    "time": "time without time zone",
    "int": "integer",
    "int4": "integer",
    "int8": "bigint",
    "int2": "smallint",
    "bool": "boolean",
    "float8": "double precision",
    "float4": "real",
    "varchar": "character varying",
    "char": "character",
    "decimal": "numeric",
}
#: Types spelled in two or more words: their first word is not a parameter's name.
_TYPE_PHRASES = {
    "double": {"precision"},
    "character": {"varying"},
    "bit": {"varying"},
    "national": {"character"},
    "timestamp": {"with", "without"},
    "time": {"with", "without"},
}
#: Words that end a function's RETURNS clause.
_AFTER_RETURNS = frozenset(
    {
        *("LANGUAGE", "AS", "IMMUTABLE", "STABLE", "VOLATILE", "SECURITY", "EXTERNAL", "SET", "STRICT", "CALLED"),
        *("PARALLEL", "COST", "ROWS", "SUPPORT", "LEAKPROOF", "NOT", "WINDOW", "TRANSFORM", "BEGIN", "RETURN"),
        "RETURNS",
    }
)


class StatementError(ValueError):
    """What is wrong with a statement (its caller says which statement, in which file)."""


@dataclass(frozen=True)
class Name:
    """A name as a key uses it (schema placeholder dropped, quotes gone), and as written."""

    key: str
    written: str


@dataclass(frozen=True)
class Signature:
    """A function's interface: what CREATE OR REPLACE may not change, and how to name it."""

    identity: tuple[str, ...]  # the input types, normalised: the function's identity with its name
    written_types: tuple[str, ...]  # the same, as written (for DROP FUNCTION and GRANT)
    names: tuple[str, ...]  # the input parameters' names ("" for none)
    defaults: tuple[bool, ...]  # whether each input parameter has a default
    outputs: tuple[str, ...]  # OUT and INOUT parameters, normalised
    returns: str  # the RETURNS clause, normalised ("" without one)


def words(tokens: Sequence[Token]) -> list[str]:
    """The tokens as keywords (upper case words; other tokens as written)."""
    return [token.upper for token in tokens]


def name_at(statement: Statement, at: int) -> tuple[Name, int]:
    """The (possibly schema-qualified) name starting at token ``at``, and the index after it."""
    code = statement.tokens
    if at >= len(code) or code[at].kind not in ("word", "quoted"):
        raise StatementError(f"expected a name at token {at + 1}")
    end = at + 1
    while end + 1 < len(code) and code[end].text == "." and code[end + 1].kind in ("word", "quoted"):
        end += 2
    parts = [token.normal() for token in code[at:end:2]]
    if parts[0] == PLACEHOLDER.lower() and len(parts) > 1:
        parts = parts[1:]
    return Name(".".join(parts), statement.written(code[at], code[end - 1])), end


def after_word(code: Sequence[Token], word: str, start: int = 0) -> int:
    """The index after the first ``word`` (a keyword) from ``start``."""
    for at in range(start, len(code)):
        if code[at].kind == "word" and code[at].upper == word:
            return at + 1
    raise StatementError(f"expected {word}")


def parenthesised(code: Sequence[Token], at: int) -> tuple[list[Token], int]:
    """The tokens inside the parentheses opening at ``at``, and the index after the closing one."""
    if at >= len(code) or code[at].text != "(":
        raise StatementError("expected a parenthesis")
    depth = 0
    for end in range(at, len(code)):
        if code[end].kind == "punctuation" and code[end].text in "()":
            depth += 1 if code[end].text == "(" else -1
            if depth == 0:
                return list(code[at + 1 : end]), end + 1
    raise StatementError("unbalanced parentheses")


def comma_separated(code: Sequence[Token]) -> list[list[Token]]:
    """``code`` split at its top-level commas (empty parts left out)."""
    parts: list[list[Token]] = [[]]
    depth = 0
    for token in code:
        if token.kind == "punctuation" and token.text in "([":
            depth += 1
        elif token.kind == "punctuation" and token.text in ")]":
            depth -= 1
        elif token.kind == "punctuation" and token.text == "," and depth == 0:
            parts.append([])
            continue
        parts[-1].append(token)
    return [part for part in parts if part]


def signature(statement: Statement, arguments: list[Token], after: Sequence[Token]) -> Signature:
    """A function's signature from its parenthesised ``arguments`` and the tokens ``after`` them
    (its RETURNS clause, when there is one)."""
    identity: list[str] = []
    written: list[str] = []
    names: list[str] = []
    defaults: list[bool] = []
    outputs: list[str] = []
    for argument in comma_separated(arguments):
        mode = "IN"
        if argument[0].upper in ("IN", "OUT", "INOUT", "VARIADIC") and len(argument) > 1:
            mode, argument = argument[0].upper, argument[1:]
        default_at = next(
            (
                i
                for i, token in enumerate(argument)
                if token.upper == "DEFAULT" or (token.kind == "operator" and token.text == "=")
            ),
            len(argument),
        )
        declared, has_default = argument[:default_at], default_at < len(argument)
        named = (
            len(declared) > 1
            and declared[0].kind in ("word", "quoted")
            and declared[1].text not in ("[", "(", ".", "%")
            and declared[1].normal() not in _TYPE_PHRASES.get(declared[0].normal(), set())
        )
        name, type_tokens = (declared[0].normal(), declared[1:]) if named else ("", declared)
        type_name = _type(type_tokens)
        if mode in ("OUT", "INOUT"):
            outputs.append(f"{name} {type_name}".strip())
        if mode != "OUT":
            identity.append(type_name)
            written.append(statement.written(type_tokens[0], type_tokens[-1]))
            names.append(name)
            defaults.append(has_default)
    returns = ""
    said = words(after)
    if said[:1] == ["RETURNS"]:
        depth, end = 0, 1
        while end < len(after) and not (depth == 0 and said[end] in _AFTER_RETURNS):
            if after[end].kind == "punctuation":
                depth += {"(": 1, ")": -1}.get(after[end].text, 0)
            end += 1
        returns = normal_form(after[1:end])
    return Signature(tuple(identity), tuple(written), tuple(names), tuple(defaults), tuple(outputs), returns)


def _type(tokens: Sequence[Token]) -> str:
    """A type as PostgreSQL names it in a signature: aliases resolved, modifiers dropped."""
    parts: list[str] = []
    depth = 0
    for token in tokens:
        if token.text == "(" and token.kind == "punctuation":
            depth += 1
        elif token.text == ")" and token.kind == "punctuation":
            depth -= 1
        elif depth == 0:
            parts.append(token.normal())
    text = " ".join(parts).replace(" [ ]", "[]").replace(" . ", ".")
    base, brackets = (text[: text.index("[")], text[text.index("[") :]) if "[" in text else (text, "")
    return _TYPE_ALIASES.get(base, base) + brackets
