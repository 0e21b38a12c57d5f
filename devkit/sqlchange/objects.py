"""The objects a sequence of SQL statements leaves behind, each with the statement that made it.

``Schema`` applies statements one by one, as PostgreSQL would, to a map of objects: functions (by
signature), tables (columns, constraints, options, row-level security, the rows the schema inserts),
indexes, triggers (with their firing: ``ALTER TABLE ... ENABLE ALWAYS TRIGGER``), policies, composite
types, comments, and each one's privileges (``GRANT`` / ``REVOKE``). ``schema.sql`` applied to an empty ``Schema``
is the schema as written; the migrations' forward files applied in order are what the migrations
build. Comparing the two object by object is ``plan``'s job.

A statement the model does not know raises ``SchemaError`` naming it: better no answer than a wrong
one. One-off statements of a migration (``UPDATE``, ``SELECT``, ``DO``, a temporary table it makes
and drops) leave no object and are skipped there; ``schema.sql`` holds objects only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from devkit.sqlchange.grammar import (
    Signature,
    StatementError,
    after_word,
    comma_separated,
    name_at,
    parenthesised,
    signature,
    words,
)
from devkit.sqlchange.text import PLACEHOLDER, Statement, Token, normal_form, split

#: What a (privilege, grantee) pair holds.
GRANTED, GRANTABLE, REVOKED = "granted", "granted with grant option", "revoked"
_ONE_OFF = frozenset({"SELECT", "UPDATE", "DELETE", "DO", "SET", "RESET", "ANALYZE", "VACUUM", "NOTIFY"})
_CONSTRAINT_WORDS = frozenset({"CONSTRAINT", "PRIMARY", "UNIQUE", "CHECK", "FOREIGN", "EXCLUDE"})
_NOT_KINDS = frozenset({"OR", "REPLACE", "UNIQUE", "UNLOGGED", "CONSTRAINT"})


class SchemaError(ValueError):
    """A statement the model cannot apply (unknown, or naming an object it does not hold)."""

    def __init__(self, statement: Statement, source: str, problem: str) -> None:
        super().__init__(f"{source}, line {statement.line} ({statement.text.splitlines()[0][:80]}): {problem}")


@dataclass
class Table:
    """What a table is made of, beyond its name."""

    head: str  # CREATE [UNLOGGED] TABLE name, normalised
    columns: list[str]  # column definitions in order, normalised
    constraints: list[str]  # table constraints, normalised
    options: str  # what follows the column list (WITH (...)), normalised
    row_security: tuple[bool, bool] = (False, False)  # enabled, forced
    rows: list[Statement] = field(default_factory=list)  # the INSERTs the schema makes


@dataclass
class SqlObject:
    """One object: its kind, its key (``function pg_lease_x(text)``), the statement that made it and
    what is compared of it (``shape``), what drops it, and its privileges."""

    kind: str  # function, table, index, trigger, policy, comment
    key: str
    statement: Statement
    shape: str
    drop: str  # the statement that drops it (no semicolon)
    owner: str | None = None  # the object whose DROP drops this one too (a trigger's table, a comment's object)
    grant_target: str = ""  # how GRANT names it: FUNCTION @extschema@.f(text), or the table's name
    # (privilege, grantee) -> value, for each pair a GRANT or REVOKE named: a REVOKE of what a new object
    # lacks anyway is kept too (default privileges of the database may have given it).
    privileges: dict[tuple[str, str], str] = field(default_factory=dict)
    signature: Signature | None = None
    table: Table | None = None
    firing: str = "ENABLE"  # a trigger's: ENABLE, ENABLE ALWAYS, ENABLE REPLICA or DISABLE
    firing_sql: str = ""  # ALTER TABLE <its table> {firing} TRIGGER <its name>, {firing} left to fill

    def default_privilege(self, key: tuple[str, str]) -> str:
        """What ``key`` holds in a new object (PostgreSQL gives EXECUTE on a function to PUBLIC)."""
        return GRANTED if self.kind == "function" and key == ("EXECUTE", "public") else REVOKED

    def privilege(self, key: tuple[str, str]) -> str:
        """What ``key`` holds now."""
        return self.privileges.get(key, self.default_privilege(key))


class Schema:
    """Objects by key, in the order they were made: an order PostgreSQL can make them in."""

    def __init__(self) -> None:
        self.objects: dict[str, SqlObject] = {}
        self.temporary: set[str] = set()  # a migration's temporary tables, made and dropped by it

    @classmethod
    def of(cls, sources: Iterable[tuple[str, str]], *, one_offs: bool) -> Schema:
        """The objects ``sources`` (name, SQL text) leave, applied in order; with ``one_offs``,
        statements that leave no object (a migration's UPDATE) are skipped, else refused."""
        schema = cls()
        for source, text in sources:
            for statement in split(text):
                schema.apply(statement, source, one_offs=one_offs)
        return schema

    def apply(self, statement: Statement, source: str, *, one_offs: bool = False) -> None:
        """What ``statement`` (of file ``source``) does to the objects."""
        said = words(statement.tokens[:5])
        try:
            if one_offs and self._temporary(statement, said):
                return
            if said[0] in ("CREATE", "DROP"):
                kind = next((word for word in said[1:] if word not in _NOT_KINDS), "")
                if kind not in ("FUNCTION", "TABLE", "INDEX", "TRIGGER", "POLICY", "TYPE"):
                    raise StatementError(f"{said[0]} {kind} is not one of the objects devkit.sqlchange knows")
                made = {
                    "FUNCTION": self._create_function,
                    "TABLE": self._create_table,
                    "INDEX": self._create_index,
                    "TRIGGER": self._create_trigger,
                    "POLICY": self._create_policy,
                    "TYPE": self._create_type,
                }
                (made[kind] if said[0] == "CREATE" else self._drop)(statement)
            elif said[:2] == ["ALTER", "TABLE"]:
                self._alter_table(statement)
            elif said[0] in ("GRANT", "REVOKE"):
                self._grant(statement)
            elif said[:2] == ["COMMENT", "ON"]:
                self._comment(statement)
            elif said[:2] == ["INSERT", "INTO"]:
                self._table(name_at(statement, 2)[0].key).rows.append(statement)
            elif not (one_offs and said[0] in _ONE_OFF):
                raise StatementError(f"{said[0]} is not a statement devkit.sqlchange knows in this file")
        except StatementError as error:
            raise SchemaError(statement, source, str(error)) from None
        except (ValueError, IndexError):
            raise SchemaError(statement, source, "not understood by devkit.sqlchange") from None

    def remove(self, key: str) -> None:
        """Drop ``key`` and what goes with it (a table's triggers, policies and indexes; comments)."""
        gone = {key}
        while more := {k for k, obj in self.objects.items() if obj.owner in gone and k not in gone}:
            gone |= more
        for k in gone:
            del self.objects[k]

    def owners(self, key: str) -> list[str]:
        """The keys of the objects whose DROP would drop ``key`` too, nearest first."""
        found: list[str] = []
        owner = self.objects[key].owner
        while owner is not None and owner not in found and owner in self.objects:
            found.append(owner)
            owner = self.objects[owner].owner
        return found

    # -- functions and tables ---------------------------------------------------------------------

    def _create_function(self, statement: Statement) -> None:
        code = statement.tokens
        name, at = name_at(statement, after_word(code, "FUNCTION"))
        arguments, at = parenthesised(code, at)
        interface = signature(statement, arguments, code[at:])
        key = f"function {name.key}({', '.join(interface.identity)})"
        target = f"{name.written}({', '.join(interface.written_types)})"
        shape = normal_form(code).replace("create or replace function", "create function", 1)
        obj = SqlObject("function", key, statement, shape, drop=f"DROP FUNCTION {target}", signature=interface)
        obj.grant_target = f"FUNCTION {target}"
        if (kept := self.objects.get(key)) is not None:  # CREATE OR REPLACE keeps the privileges (and the place)
            obj.privileges, obj.grant_target = kept.privileges, kept.grant_target
        self.objects[key] = obj

    def _create_table(self, statement: Statement) -> None:
        code = statement.tokens
        at = after_word(code, "TABLE")
        if words(code[at : at + 3]) == ["IF", "NOT", "EXISTS"]:
            at += 3
        head = normal_form(code[:at])
        name, at = name_at(statement, at)
        inside, after = parenthesised(code, at)
        table = Table(head=f"{head} {name.key}", columns=[], constraints=[], options=normal_form(code[after:]))
        for item in comma_separated(inside):
            (table.constraints if item[0].upper in _CONSTRAINT_WORDS else table.columns).append(normal_form(item))
        key = f"table {name.key}"
        self.objects[key] = SqlObject(
            "table", key, statement, "", drop=f"DROP TABLE {name.written}", grant_target=name.written, table=table
        )

    def _alter_table(self, statement: Statement) -> None:
        code = statement.tokens
        at = 2
        while code[at].upper in ("IF", "EXISTS", "ONLY"):
            at += 1
        name, at = name_at(statement, at)
        table = self._table(name.key)
        for action in comma_separated(code[at:]):
            said = words(action)
            if said[0] == "ADD":
                rest = action[1 + (said[1:2] == ["COLUMN"]) :]
                if words(rest[:3]) == ["IF", "NOT", "EXISTS"]:
                    rest = rest[3:]
                (table.constraints if rest[0].upper in _CONSTRAINT_WORDS else table.columns).append(normal_form(rest))
            elif said[0] == "DROP":
                rest = [token for token in action[1:] if token.upper not in ("COLUMN", "IF", "EXISTS")]
                if rest[-1].upper in ("CASCADE", "RESTRICT"):
                    raise StatementError("DROP ... CASCADE/RESTRICT: the model cannot see what it drops")
                if rest[0].upper == "CONSTRAINT":
                    gone = ["constraint", rest[1].normal()]
                    table.constraints = [item for item in table.constraints if item.split()[:2] != gone]
                else:
                    table.columns = [item for item in table.columns if item.split()[0] != rest[0].normal()]
            elif said[-3:] == ["ROW", "LEVEL", "SECURITY"] and said[:-3] in (["ENABLE"], ["DISABLE"]):
                table.row_security = (said[0] == "ENABLE", table.row_security[1])
            elif said[-3:] == ["ROW", "LEVEL", "SECURITY"] and said[:-3] in (["FORCE"], ["NO", "FORCE"]):
                table.row_security = (table.row_security[0], said[0] == "FORCE")
            elif len(said) >= 3 and said[-2] == "TRIGGER" and said[0] in ("ENABLE", "DISABLE"):
                trigger = self._object(f"trigger {action[-1].normal()} on {name.key}")
                trigger.firing = " ".join(said[:-2])
            else:
                raise StatementError(f"ALTER TABLE ... {' '.join(said[:4])} is not known")

    # -- what hangs on a table --------------------------------------------------------------------

    def _create_index(self, statement: Statement) -> None:
        code = statement.tokens
        at = after_word(code, "INDEX")
        while code[at].upper in ("CONCURRENTLY", "IF", "NOT", "EXISTS"):
            at += 1
        if code[at].upper == "ON":
            raise StatementError("an index without a name: name it, so that a migration can drop it")
        name, at = name_at(statement, at)
        at = after_word(code, "ON", at)
        table, _ = name_at(statement, at + (code[at].upper == "ONLY"))
        schema = f"{PLACEHOLDER}." if table.written.startswith(f"{PLACEHOLDER}.") and "." not in name.key else ""
        key = f"index {name.key}"
        self.objects[key] = SqlObject(
            "index",
            key,
            statement,
            normal_form(code),
            drop=f"DROP INDEX {schema}{name.written}",
            owner=f"table {table.key}",
        )

    def _create_trigger(self, statement: Statement) -> None:
        code = statement.tokens
        name, at = name_at(statement, after_word(code, "TRIGGER"))
        table, _ = name_at(statement, after_word(code, "ON", at))
        key = f"trigger {name.key} on {table.key}"
        shape = normal_form(code).replace("create or replace ", "create ", 1)
        obj = SqlObject(
            "trigger",
            key,
            statement,
            shape,
            drop=f"DROP TRIGGER {name.written} ON {table.written}",
            owner=f"table {table.key}",
        )
        obj.firing_sql = f"ALTER TABLE {table.written} {{firing}} TRIGGER {name.written}"
        self.objects[key] = obj

    def _create_type(self, statement: Statement) -> None:
        code = statement.tokens
        name, at = name_at(statement, after_word(code, "TYPE"))
        if code[at].upper != "AS" or code[at + 1].text != "(":
            raise StatementError("only composite types (CREATE TYPE name AS (...)) are known")
        key = f"type {name.key}"
        self.objects[key] = SqlObject("type", key, statement, normal_form(code), drop=f"DROP TYPE {name.written}")

    def _temporary(self, statement: Statement, said: list[str]) -> bool:
        """Whether ``statement`` makes or drops a temporary table of the migration (a one-off)."""
        if said[0] == "CREATE" and said[1] in ("TEMP", "TEMPORARY") and said[2] == "TABLE":
            self.temporary.add(name_at(statement, 3)[0].key)
            return True
        if said[:2] == ["DROP", "TABLE"] and self.temporary:
            names = {
                name_at(statement, statement.tokens.index(item[0]))[0].key
                for item in comma_separated(statement.tokens[2:])
            }
            if names <= self.temporary:
                self.temporary -= names
                return True
        return False

    def _create_policy(self, statement: Statement) -> None:
        name, at = name_at(statement, 2)
        table, _ = name_at(statement, after_word(statement.tokens, "ON", at))
        key = f"policy {name.key} on {table.key}"
        self.objects[key] = SqlObject(
            "policy",
            key,
            statement,
            normal_form(statement.tokens),
            drop=f"DROP POLICY {name.written} ON {table.written}",
            owner=f"table {table.key}",
        )

    def _comment(self, statement: Statement) -> None:
        code = statement.tokens
        is_at = max(i for i, token in enumerate(code) if token.upper == "IS")
        target = code[2:is_at]
        key, owner = self._commented(statement, target)
        if words(code[is_at + 1 :]) == ["NULL"]:
            self.objects.pop(key, None)
            return
        drop = f"COMMENT ON {statement.written(target[0], target[-1])} IS NULL"
        self.objects[key] = SqlObject("comment", key, statement, normal_form(code), drop=drop, owner=owner)

    def _commented(self, statement: Statement, target: Sequence[Token]) -> tuple[str, str | None]:
        """The key of a comment on ``target``, and the key of the object it is on (None when the
        model holds no such objects: nothing drops the comment then)."""
        kind, at = target[0].upper, statement.tokens.index(target[0]) + 1
        if kind == "FUNCTION":
            owner = self._function_named(statement, at)
        elif kind in ("TABLE", "INDEX"):
            owner = f"{kind.lower()} {name_at(statement, at)[0].key}"
        elif kind == "COLUMN":
            column = name_at(statement, at)[0].key
            return f"comment on column {column}", f"table {column.rsplit('.', 1)[0]}"
        elif kind in ("TRIGGER", "POLICY"):
            name, at = name_at(statement, at)
            owner = f"{kind.lower()} {name.key} on {name_at(statement, after_word(statement.tokens, 'ON', at))[0].key}"
        else:
            return f"comment on {normal_form(target)}", None
        self._object(owner)
        return f"comment on {owner}", owner

    # -- privileges and drops ---------------------------------------------------------------------

    def _grant(self, statement: Statement) -> None:
        code = statement.tokens
        said = words(code)
        grant = said[0] == "GRANT"
        option_only = said[1:4] == ["GRANT", "OPTION", "FOR"]
        on = said.index("ON")
        to = max(i for i, word in enumerate(said) if word == ("TO" if grant else "FROM"))
        privileges = [normal_form(item).upper() for item in comma_separated(code[1 + 3 * option_only : on])]
        privileges = ["ALL" if privilege == "ALL PRIVILEGES" else privilege for privilege in privileges]
        target = code[on + 1 : to]
        if target[0].upper == "FUNCTION":
            obj = self._object(self._function_named(statement, on + 2))
            privileges = ["EXECUTE" if privilege == "ALL" else privilege for privilege in privileges]
        elif target[0].upper in ("SCHEMA", "SEQUENCE", "ALL", "DATABASE", "TYPE", "LANGUAGE", "DOMAIN", "PROCEDURE"):
            raise StatementError(f"privileges ON {target[0].upper} are not known")
        else:
            if target[0].upper == "TABLE":  # a table is named without TABLE
                target = target[1:]
            obj = self._table_object(name_at(statement, statement.tokens.index(target[0]))[0].key)
        rest = [token for token in code[to + 1 :] if token.upper not in ("CASCADE", "RESTRICT")]
        with_option = words(rest[-3:]) == ["WITH", "GRANT", "OPTION"]
        obj.grant_target = statement.written(target[0], target[-1])
        for privilege in privileges:
            for grantee in comma_separated(rest[:-3] if with_option else rest):
                key = (privilege, normal_form(grantee))
                if not grant:
                    value = GRANTED if option_only and obj.privilege(key) != REVOKED else REVOKED
                else:
                    value = GRANTABLE if with_option or obj.privilege(key) == GRANTABLE else GRANTED
                obj.privileges[key] = value

    def _drop(self, statement: Statement) -> None:
        code = statement.tokens
        kind = code[1].upper
        at = 2
        while code[at].upper in ("IF", "EXISTS", "CONCURRENTLY"):
            at += 1
        if code[-1].upper == "CASCADE":
            raise StatementError("DROP ... CASCADE: the model cannot see what it drops")
        if kind == "FUNCTION":
            keys = [self._function_named(statement, code.index(item[0])) for item in comma_separated(code[at:])]
        elif kind in ("TRIGGER", "POLICY"):
            name, after = name_at(statement, at)
            keys = [f"{kind.lower()} {name.key} on {name_at(statement, after_word(code, 'ON', after))[0].key}"]
        else:
            keys = [
                f"{kind.lower()} {name_at(statement, code.index(item[0]))[0].key}"
                for item in comma_separated(code[at:])
            ]
        for key in keys:
            self._object(key)
            self.remove(key)

    # -- lookups ----------------------------------------------------------------------------------

    def _object(self, key: str) -> SqlObject:
        if key not in self.objects:
            raise StatementError(f"names {key}, which does not exist at this point")
        return self.objects[key]

    def _table_object(self, key: str) -> SqlObject:
        obj = self._object(f"table {key}")
        assert obj.table is not None
        return obj

    def _table(self, key: str) -> Table:
        table = self._table_object(key).table
        assert table is not None
        return table

    def _function_named(self, statement: Statement, at: int) -> str:
        """The key of ``name(types)`` at token ``at``, as DROP FUNCTION, GRANT and COMMENT write it."""
        name, at = name_at(statement, at)
        arguments, _ = parenthesised(statement.tokens, at)
        return f"function {name.key}({', '.join(signature(statement, arguments, ()).identity)})"
