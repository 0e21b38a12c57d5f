"""The objects a sequence of SQL statements leaves behind, each with the statement that made it.

``Schema`` applies statements one by one, as PostgreSQL would, to a map of objects: functions (by
signature), tables (columns, constraints, options, row-level security, the rows the schema inserts),
indexes, triggers (with their firing: ``ALTER TABLE ... ENABLE ALWAYS TRIGGER``), policies, composite
types, comments, and each one's privileges (``GRANT`` / ``REVOKE``). ``schema.sql`` applied to an empty ``Schema``
is the schema as written; the migrations' forward files applied in order are what the migrations
build. Comparing the two object by object is ``plan``'s job.

Each statement is read from the tree PostgreSQL's parser built (``text``, ``grammar``). A
statement the model does not know raises ``SchemaError`` naming it: better no answer than a wrong
one. One-off statements of a migration (``UPDATE``, ``SELECT``, ``DO``, a temporary table it makes
and drops) leave no object and are skipped there; ``schema.sql`` holds objects only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from pglast import ast
from pglast.enums import AlterTableType, DropBehavior, GrantTargetType, ObjectType, RoleSpecType

from devkit.sqlchange.grammar import (
    Signature,
    StatementError,
    after_keyword,
    function_key,
    given,
    item,
    key,
    name_at,
    parts,
    relation,
    signature,
)
from devkit.sqlchange.text import PLACEHOLDER, Statement, normal_form, quoted_name, split

#: What a (privilege, grantee) pair holds.
GRANTED, GRANTABLE, REVOKED = "granted", "granted with grant option", "revoked"
_ONE_OFF = (
    ast.SelectStmt,
    ast.UpdateStmt,
    ast.DeleteStmt,
    ast.DoStmt,
    ast.VariableSetStmt,
    ast.VacuumStmt,
    ast.NotifyStmt,
)
_FIRING = {
    AlterTableType.AT_EnableTrig: "ENABLE",
    AlterTableType.AT_EnableAlwaysTrig: "ENABLE ALWAYS",
    AlterTableType.AT_EnableReplicaTrig: "ENABLE REPLICA",
    AlterTableType.AT_DisableTrig: "DISABLE",
}
_ROW_SECURITY = {
    AlterTableType.AT_EnableRowSecurity: (0, True),
    AlterTableType.AT_DisableRowSecurity: (0, False),
    AlterTableType.AT_ForceRowSecurity: (1, True),
    AlterTableType.AT_NoForceRowSecurity: (1, False),
}
#: The kinds of object a DROP or a COMMENT may name, by the parser's word for them.
_KINDS = {
    ObjectType.OBJECT_FUNCTION: "function",
    ObjectType.OBJECT_TABLE: "table",
    ObjectType.OBJECT_INDEX: "index",
    ObjectType.OBJECT_TRIGGER: "trigger",
    ObjectType.OBJECT_POLICY: "policy",
    ObjectType.OBJECT_TYPE: "type",
}


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
        try:
            if one_offs and self._temporary(statement):
                return
            match statement.node:
                case ast.CreateFunctionStmt() as node:
                    self._create_function(statement, node)
                case ast.CreateStmt() as node:
                    self._create_table(statement, node)
                case ast.IndexStmt() as node:
                    self._create_index(statement, node)
                case ast.CreateTrigStmt() as node:
                    self._create_trigger(statement, node)
                case ast.CreatePolicyStmt() as node:
                    self._create_policy(statement, node)
                case ast.CompositeTypeStmt() as node:
                    self._create_type(statement, node)
                case ast.DropStmt() as node:
                    self._drop(node)
                case ast.AlterTableStmt() as node:
                    self._alter_table(statement, node)
                case ast.GrantStmt() as node:
                    self._grant(statement, node)
                case ast.CommentStmt() as node:
                    self._comment(statement, node)
                case ast.InsertStmt() as node:
                    self._table(relation(statement, node.relation).key).rows.append(statement)
                case node if not (one_offs and isinstance(node, _ONE_OFF)):
                    raise StatementError(
                        f"{type(node).__name__} is not a statement devkit.sqlchange knows in this file"
                    )
        except StatementError as error:
            raise SchemaError(statement, source, str(error)) from None
        except (ValueError, IndexError, AttributeError, TypeError):
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

    def _create_function(self, statement: Statement, node: ast.CreateFunctionStmt) -> None:
        if node.is_procedure:
            raise StatementError("a procedure is not one of the objects devkit.sqlchange knows")
        name, _ = name_at(statement, after_keyword(statement, "FUNCTION"))
        interface = signature(statement, node)
        obj_key = f"function {key(node.funcname)}({', '.join(interface.identity)})"
        target = f"{name.written}({', '.join(interface.written_types)})"
        shape = normal_form(statement.tokens).replace("create or replace function", "create function", 1)
        obj = SqlObject("function", obj_key, statement, shape, drop=f"DROP FUNCTION {target}", signature=interface)
        obj.grant_target = f"FUNCTION {target}"
        if (kept := self.objects.get(obj_key)) is not None:  # CREATE OR REPLACE keeps the privileges (and the place)
            obj.privileges, obj.grant_target = kept.privileges, kept.grant_target
        self.objects[obj_key] = obj

    def _create_table(self, statement: Statement, node: ast.CreateStmt) -> None:
        made = given(node.relation, "a table")
        if made.relpersistence == "t":
            raise StatementError("a temporary table is a migration's one-off, not an object of the schema")
        code = statement.tokens
        name = relation(statement, made)
        at = statement.at(given(made.location, "a location"))
        table = Table(head=f"{normal_form(code[:at])} {name.key}", columns=[], constraints=[], options="")
        close = name_at(statement, at)[1] + 1  # the list's closing parenthesis, when it is empty
        for element in node.tableElts or ():
            if not isinstance(element, ast.ColumnDef | ast.Constraint):
                raise StatementError(f"a table's {type(element).__name__} is not known")
            tokens = item(statement, element.location)
            (table.constraints if isinstance(element, ast.Constraint) else table.columns).append(normal_form(tokens))
            close = statement.at(given(element.location, "a location")) + len(tokens)
        table.options = normal_form(code[close + 1 :])
        obj_key = f"table {name.key}"
        self.objects[obj_key] = SqlObject(
            "table", obj_key, statement, "", drop=f"DROP TABLE {name.written}", grant_target=name.written, table=table
        )

    def _alter_table(self, statement: Statement, node: ast.AlterTableStmt) -> None:
        if node.objtype != ObjectType.OBJECT_TABLE:
            raise StatementError(f"ALTER {given(node.objtype, 'a kind').name.removeprefix('OBJECT_')} is not known")
        name = relation(statement, node.relation)
        table = self._table(name.key)
        for command in node.cmds or ():
            subtype = command.subtype
            if subtype in (AlterTableType.AT_AddColumn, AlterTableType.AT_AddConstraint):
                made = command.def_
                if not isinstance(made, ast.ColumnDef | ast.Constraint):
                    raise StatementError(f"ALTER TABLE ... ADD {type(made).__name__} is not known")
                listed = table.constraints if isinstance(made, ast.Constraint) else table.columns
                listed.append(normal_form(item(statement, made.location)))
            elif subtype in (AlterTableType.AT_DropColumn, AlterTableType.AT_DropConstraint):
                if command.behavior == DropBehavior.DROP_CASCADE:
                    raise StatementError("DROP ... CASCADE: the model cannot see what it drops")
                gone = quoted_name(command.name)
                if subtype == AlterTableType.AT_DropConstraint:
                    table.constraints = [made for made in table.constraints if made.split()[:2] != ["constraint", gone]]
                else:
                    table.columns = [made for made in table.columns if made.split()[0] != gone]
            elif subtype in _ROW_SECURITY:
                which, value = _ROW_SECURITY[subtype]
                security = list(table.row_security)
                security[which] = value
                table.row_security = (security[0], security[1])
            elif subtype in _FIRING:
                trigger = self._object(f"trigger {quoted_name(command.name)} on {name.key}")
                trigger.firing = _FIRING[subtype]
            else:
                raise StatementError(f"ALTER TABLE ... {subtype.name.removeprefix('AT_')} is not known")

    # -- what hangs on a table --------------------------------------------------------------------

    def _create_index(self, statement: Statement, node: ast.IndexStmt) -> None:
        if node.idxname is None:
            raise StatementError("an index without a name: name it, so that a migration can drop it")
        name, _ = name_at(statement, after_keyword(statement, "ON") - 2)  # the name is written right before ON
        table = relation(statement, node.relation)
        schema = f"{PLACEHOLDER}." if table.written.startswith(f"{PLACEHOLDER}.") and "." not in name.key else ""
        obj_key = f"index {quoted_name(node.idxname)}"
        self.objects[obj_key] = SqlObject(
            "index",
            obj_key,
            statement,
            normal_form(statement.tokens),
            drop=f"DROP INDEX {schema}{name.written}",
            owner=f"table {table.key}",
        )

    def _create_trigger(self, statement: Statement, node: ast.CreateTrigStmt) -> None:
        name, _ = name_at(statement, after_keyword(statement, "TRIGGER"))
        table = relation(statement, node.relation)
        obj_key = f"trigger {quoted_name(given(node.trigname, 'a name'))} on {table.key}"
        shape = normal_form(statement.tokens).replace("create or replace ", "create ", 1)
        obj = SqlObject(
            "trigger",
            obj_key,
            statement,
            shape,
            drop=f"DROP TRIGGER {name.written} ON {table.written}",
            owner=f"table {table.key}",
        )
        obj.firing_sql = f"ALTER TABLE {table.written} {{firing}} TRIGGER {name.written}"
        self.objects[obj_key] = obj

    def _create_type(self, statement: Statement, node: ast.CompositeTypeStmt) -> None:
        name = relation(statement, node.typevar)
        obj_key = f"type {name.key}"
        self.objects[obj_key] = SqlObject(
            "type", obj_key, statement, normal_form(statement.tokens), drop=f"DROP TYPE {name.written}"
        )

    def _temporary(self, statement: Statement) -> bool:
        """Whether ``statement`` makes or drops a temporary table of the migration (a one-off)."""
        node = statement.node
        made = node.relation if isinstance(node, ast.CreateStmt) else None
        made = given(node.into, "a table").rel if isinstance(node, ast.CreateTableAsStmt) else made
        if made is not None and made.relpersistence == "t":
            self.temporary.add(relation(statement, made).key)
            return True
        if isinstance(node, ast.DropStmt) and node.removeType == ObjectType.OBJECT_TABLE and self.temporary:
            names = {key(named) for named in node.objects or ()}
            if names <= self.temporary:
                self.temporary -= names
                return True
        return False

    def _create_policy(self, statement: Statement, node: ast.CreatePolicyStmt) -> None:
        name, _ = name_at(statement, 2)
        table = relation(statement, node.table)
        obj_key = f"policy {quoted_name(given(node.policy_name, 'a name'))} on {table.key}"
        self.objects[obj_key] = SqlObject(
            "policy",
            obj_key,
            statement,
            normal_form(statement.tokens),
            drop=f"DROP POLICY {name.written} ON {table.written}",
            owner=f"table {table.key}",
        )

    def _comment(self, statement: Statement, node: ast.CommentStmt) -> None:
        code = statement.tokens
        target = code[2 : max(i for i, token in enumerate(code) if token.upper == "IS")]
        obj_key, owner = self._commented(node, normal_form(target))
        if node.comment is None:
            self.objects.pop(obj_key, None)
            return
        drop = f"COMMENT ON {statement.written(target[0], target[-1])} IS NULL"
        self.objects[obj_key] = SqlObject("comment", obj_key, statement, normal_form(code), drop=drop, owner=owner)

    def _commented(self, node: ast.CommentStmt, target: str) -> tuple[str, str | None]:
        """The key of a comment on ``target``, and the key of the object it is on (None when the
        model holds no such objects: nothing drops the comment then)."""
        kind, named = _KINDS.get(given(node.objtype, "a kind")), node.object
        if isinstance(named, ast.ObjectWithArgs):
            owner = function_key(named)
        elif node.objtype == ObjectType.OBJECT_COLUMN:
            column = key(named)
            return f"comment on column {column}", f"table {column.rsplit('.', 1)[0]}"
        elif kind in ("table", "index"):
            owner = f"{kind} {key(named)}"
        elif kind in ("trigger", "policy"):
            *table, name = parts(named)
            owner = f"{kind} {key([name])} on {key(table)}"
        else:
            return f"comment on {target}", None
        self._object(owner)
        return f"comment on {owner}", owner

    # -- privileges and drops ---------------------------------------------------------------------

    def _grant(self, statement: Statement, node: ast.GrantStmt) -> None:
        kind = _KINDS.get(given(node.objtype, "a kind"))
        if node.targtype != GrantTargetType.ACL_TARGET_OBJECT or kind not in ("function", "table"):
            raise StatementError(
                f"privileges ON {given(node.objtype, 'a kind').name.removeprefix('OBJECT_')} are not known"
            )
        if len(node.objects or ()) != 1 or any(privilege.cols for privilege in node.privileges or ()):
            raise StatementError("privileges on more than one object, or on columns, are not known")
        code = statement.tokens
        to = max(i for i, token in enumerate(code) if token.upper == ("TO" if node.is_grant else "FROM"))
        privileges = [privilege.priv_name.upper() for privilege in node.privileges or ()] or ["ALL"]
        [target] = node.objects or ()
        if isinstance(target, ast.ObjectWithArgs):
            obj, first = self._object(function_key(target)), after_keyword(statement, "ON")
            privileges = ["EXECUTE" if privilege == "ALL" else privilege for privilege in privileges]
        else:
            obj, first = self._table_object(relation(statement, target).key), statement.at(target.location)
        obj.grant_target = statement.written(code[first], code[to - 1])
        for privilege in privileges:
            for grantee in node.grantees or ():
                pair = (privilege, _grantee(grantee))
                if not node.is_grant:
                    value = GRANTED if node.grant_option and obj.privilege(pair) != REVOKED else REVOKED
                else:
                    value = GRANTABLE if node.grant_option or obj.privilege(pair) == GRANTABLE else GRANTED
                obj.privileges[pair] = value

    def _drop(self, node: ast.DropStmt) -> None:
        dropped = given(node.removeType, "a kind")
        kind = _KINDS.get(dropped)
        if kind is None:
            what = dropped.name.removeprefix("OBJECT_")
            raise StatementError(f"DROP {what} is not one of the objects devkit.sqlchange knows")
        if node.behavior == DropBehavior.DROP_CASCADE:
            raise StatementError("DROP ... CASCADE: the model cannot see what it drops")
        keys = []
        for named in node.objects or ():
            if isinstance(named, ast.ObjectWithArgs):
                keys.append(function_key(named))
            elif isinstance(named, ast.TypeName):
                keys.append(f"{kind} {key(named.names)}")
            elif kind in ("trigger", "policy"):
                *table, name = parts(named)
                keys.append(f"{kind} {key([name])} on {key(table)}")
            else:
                keys.append(f"{kind} {key(named)}")
        for gone in keys:
            self._object(gone)
            self.remove(gone)

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


def _grantee(role: ast.RoleSpec) -> str:
    """A grantee as a key: ``public``, a role's name, or ``current_user`` and its kin."""
    if role.roletype == RoleSpecType.ROLESPEC_CSTRING:
        return quoted_name(given(role.rolename, "a role"))
    return given(role.roletype, "a role").name.removeprefix("ROLESPEC_").lower()
