"""How a statement names things: keys from the parse tree, and the same names as written.

A key is read from the tree PostgreSQL's parser built (``text.Statement.node``): a name with the
schema placeholder dropped, a function with the types of its inputs as PostgreSQL names them. A
name or a type as written is the text at the location the parser gave, so that the statements a
tool writes spell it as the author did. What is wrong raises ``StatementError``, which the caller
turns into a message naming the statement and its file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

from pglast import ast, keywords
from pglast.enums import FunctionParameterMode

from devkit.sqlchange.text import PLACEHOLDER, STAND_IN, Statement, Token, quoted_name

#: PostgreSQL's internal type names, as a signature spells them.
_TYPE_NAMES = {
    "int4": "integer",
    "int8": "bigint",
    "int2": "smallint",
    "bool": "boolean",
    "float8": "double precision",
    "float4": "real",
    "varchar": "character varying",
    "bpchar": "character",
    "timestamptz": "timestamp with time zone",
    "timestamp": "timestamp without time zone",
    "timetz": "time with time zone",
    "time": "time without time zone",
}
_KEYWORDS = keywords.RESERVED_KEYWORDS | keywords.COL_NAME_KEYWORDS | keywords.TYPE_FUNC_NAME_KEYWORDS
_OUTPUTS = frozenset({FunctionParameterMode.FUNC_PARAM_OUT, FunctionParameterMode.FUNC_PARAM_TABLE})
_RETURNED = _OUTPUTS | {FunctionParameterMode.FUNC_PARAM_INOUT}


T = TypeVar("T")


class StatementError(ValueError):
    """What is wrong with a statement (its caller says which statement, in which file)."""


def given(value: T | None, what: str) -> T:
    """A field of the parse tree that the statement must have: pglast types every field optional."""
    if value is None:
        raise StatementError(f"expected {what}")
    return value


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
    outputs: tuple[str, ...]  # OUT, INOUT and TABLE parameters, normalised
    returns: str  # the RETURNS type, normalised ("" without one)


def parts(node: object) -> list[str]:
    """The parts of a dotted name of the tree: a list of its ``String`` nodes, or of strings."""
    if not isinstance(node, tuple | list) or not node:
        raise StatementError("expected a name")
    return [part if isinstance(part, str) else given(part.sval, "a name") for part in node]


def key(node: object) -> str:
    """A dotted name from the tree as a key: the schema placeholder dropped, odd names quoted."""
    names = parts(node)
    if len(names) > 1 and names[0] == STAND_IN.strip('"'):
        names = names[1:]
    return ".".join(quoted_name(name) for name in names)


def name_at(statement: Statement, at: int) -> tuple[Name, int]:
    """The (possibly schema-qualified) name starting at token ``at``, and the index after it."""
    code = statement.tokens
    if at >= len(code) or code[at].kind not in ("word", "quoted"):
        raise StatementError(f"expected a name at token {at + 1}")
    end = at + 1
    while end + 1 < len(code) and code[end].text == "." and code[end + 1].kind in ("word", "quoted"):
        end += 2
    parts = [token.normal() for token in code[at:end:2]]
    if parts[0] == PLACEHOLDER and len(parts) > 1:
        parts = parts[1:]
    return Name(".".join(parts), statement.written(code[at], code[end - 1])), end


def relation(statement: Statement, node: ast.RangeVar | None) -> Name:
    """The table ``node`` names: its key from the tree, its text as written from its location."""
    node = given(node, "a table")
    written = name_at(statement, statement.at(given(node.location, "a location")))[0].written
    return Name(key([part for part in (node.catalogname, node.schemaname, node.relname) if part]), written)


def after_keyword(statement: Statement, keyword: str, start: int = 0) -> int:
    """The index of the token after the first ``keyword`` from token ``start``."""
    for at in range(start, len(statement.tokens)):
        if statement.tokens[at].kind == "word" and statement.tokens[at].upper == keyword:
            return at + 1
    raise StatementError(f"expected {keyword}")


def item(statement: Statement, location: int | None, *, stops: frozenset[str] = frozenset()) -> list[Token]:
    """The tokens of a list item starting at ``location``: up to a comma outside parentheses, the
    parenthesis that closes the list, the end, or a keyword of ``stops``."""
    code = statement.tokens
    depth, at = 0, statement.at(given(location, "a location"))
    start = at
    while at < len(code):
        token = code[at]
        if token.kind == "punctuation" and token.text in "([":
            depth += 1
        elif token.kind == "punctuation" and token.text in ")]":
            depth -= 1
            if depth < 0:
                break
        elif depth == 0 and (token.text == "," or token.upper in stops or (token.text == "=" and "=" in stops)):
            break
        at += 1
    return list(code[start:at])


def type_name(node: ast.TypeName) -> str:
    """A type as PostgreSQL names it in a signature: internal names spelled out, modifiers dropped."""
    if node.pct_type:
        raise StatementError("a %TYPE parameter is not known")
    names = parts(node.names)
    if len(names) == 2 and names[0] == "pg_catalog":  # how the grammar writes a standard type (int, char)
        text = _TYPE_NAMES.get(names[1], names[1])
    elif len(names) == 1:  # a keyword as a type's name was quoted ("char"), and still needs its quotes
        text = _TYPE_NAMES.get(names[0], f'"{names[0]}"' if names[0] in _KEYWORDS else quoted_name(names[0]))
    else:
        text = ".".join(PLACEHOLDER if name == STAND_IN.strip('"') else quoted_name(name) for name in names)
    return ("setof " if node.setof else "") + text + "[]" * len(node.arrayBounds or ())


def signature(statement: Statement, node: ast.CreateFunctionStmt) -> Signature:
    """The signature ``node`` (the statement's CREATE FUNCTION) declares."""
    identity: list[str] = []
    written: list[str] = []
    names: list[str] = []
    defaults: list[bool] = []
    outputs: list[str] = []
    for parameter in node.parameters or ():
        type_tokens = item(statement, parameter.argType.location, stops=frozenset({"DEFAULT", "="}))
        if parameter.mode in _RETURNED:
            outputs.append(f"{quoted_name(parameter.name or '')} {type_name(parameter.argType)}".strip())
        if parameter.mode not in _OUTPUTS:
            identity.append(type_name(parameter.argType))
            written.append(statement.written(type_tokens[0], type_tokens[-1]))
            names.append(quoted_name(parameter.name) if parameter.name else "")
            defaults.append(parameter.defexpr is not None)
    returns = type_name(node.returnType) if node.returnType is not None else ""
    return Signature(tuple(identity), tuple(written), tuple(names), tuple(defaults), tuple(outputs), returns)


def function_key(node: ast.ObjectWithArgs) -> str:
    """The key of the function ``name(types)`` that DROP FUNCTION, GRANT and COMMENT name."""
    if node.args_unspecified:
        raise StatementError("a function named without its argument types")
    return f"function {key(node.objname)}({', '.join(type_name(arg) for arg in node.objargs or ())})"
