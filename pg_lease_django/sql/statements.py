"""Every statement of ``queries.sql`` as a value: its name, its rows' decoder, whether it confirms its commit.

The executors (``sql.run``, ``sql.arun``) take these, and nothing the package sends is spelled
anywhere else (the admin only shows an example ``pg_lease_inspect`` call as text). A statement's
parameters are named in its SQL (`Statement.parameters`): a call passes them as keywords, and its
decoder (``sql.rows``) and its map of SQLSTATEs to the package's errors (``sql.errors``) are given
them as keywords too. The templates of ``fence_triggers.sql``, the DDL of users' fenced tables, are
here too: `sql.run.render` composes them and Django's schema editor runs them (``FenceTrigger``).
Two fragments composed into Django's own statements, ``fence_expression`` and ``fence_presented``,
keep positional ``%s``: Django's compiler joins their parameters to its own by position.
"""

from __future__ import annotations

from typing import Any

from . import Statement, errors, rows

# ---- the lease operations (confirmed: a lease write's commit must reach the synchronous standby) ----

ACQUIRE: Statement[rows.Attempt] = Statement("acquire", rows.attempt, confirms=True, errors=errors.ACQUIRE_ERRORS)
ACQUIRE_OR_REGISTER: Statement[rows.Attempt] = Statement(
    "acquire_or_register", rows.attempt, confirms=True, errors=errors.ACQUIRE_ERRORS
)
ACQUIRE_WITHIN: Statement[rows.Attempt] = Statement(
    "acquire_within", rows.attempt, confirms=True, errors=errors.ACQUIRE_ERRORS
)
RENEW: Statement[rows.Renewal] = Statement("renew", rows.renewal, confirms=True)
RELEASE: Statement[None] = Statement("release", rows.released, confirms=True)
INSPECT: Statement[rows.LeaseState] = Statement("inspect", rows.state, confirms=True)
FORCE_RELEASE: Statement[int] = Statement("force_release", rows.forced, confirms=True)
REQUEST_HANDOFF: Statement[rows.HandoffRequest] = Statement("request_handoff", rows.handoff, confirms=True)
PRUNE: Statement[str] = Statement("prune", rows.scalar, confirms=True)
ADVANCE_EPOCHS: Statement[rows.EpochAdvance] = Statement(
    "advance_epochs", rows.advance, confirms=True, errors=errors.ADVANCE_ERRORS
)

# ---- fencing ---------------------------------------------------------------------------------------

PRESENT_FENCE: Statement[int] = Statement("present_fence", rows.scalar)
#: An expression inside Django's own UPDATE or INSERT, and its WHERE-clause form (never sent alone).
FENCE_EXPRESSION: Statement[Any] = Statement("fence_expression")
FENCE_PRESENTED: Statement[Any] = Statement("fence_presented")
ALLOW_UNFENCED: Statement[Any] = Statement("allow_unfenced")
END_UNFENCED: Statement[Any] = Statement("end_unfenced")

# ---- users' fenced tables: the DDL FenceTrigger runs in their migrations (fence_triggers.sql) -------

_FENCE = "fence_triggers.sql"
FENCE_TRIGGERS_CREATE: Statement[Any] = Statement(
    "fence_triggers_create", parts=("table", "guard", "comment"), source=_FENCE
)
FENCE_GUARD_ROWS: Statement[Any] = Statement("fence_guard_rows", source=_FENCE)
FENCE_GUARD_INHERITED_ROWS: Statement[Any] = Statement(
    "fence_guard_inherited_rows", parts=("ancestor", "ancestor_pk", "child_pk"), source=_FENCE
)
FENCE_DERIVE_KEY: Statement[Any] = Statement(
    "fence_derive_key", parts=("function", "body", "columns", "table", "comment", "stored"), source=_FENCE
)
FENCE_DERIVE_KEY_BODY: Statement[Any] = Statement("fence_derive_key_body", parts=("expression",), source=_FENCE)
FENCE_TRIGGERS_DROP: Statement[Any] = Statement("fence_triggers_drop", parts=("table", "function"), source=_FENCE)

# ---- sessions: waiting, the lease connections, settling ----------------------------------------------

LISTEN: Statement[Any] = Statement("listen")
UNLISTEN: Statement[Any] = Statement("unlisten")
LISTENING: Statement[int] = Statement("listening", rows.scalar)
SET_ROLE: Statement[Any] = Statement("set_role", parts=("role",))
LOCK_TIMEOUT_LOCAL: Statement[Any] = Statement("lock_timeout_local")
STATEMENT_TIMEOUT_LOCAL: Statement[Any] = Statement("statement_timeout_local")
STATEMENT_TIMEOUT_SESSION: Statement[Any] = Statement("statement_timeout_session")
STATEMENT_TIMEOUT_RESET: Statement[Any] = Statement("statement_timeout_reset")
CANCEL_ATTEMPT: Statement[Any] = Statement("cancel_attempt", rows.scalar)

# ---- reading: the server clock, listings, the operators' views, probes, metrics ----------------------

SCHEMA_LOOKUP: Statement[str] = Statement("schema_lookup", rows.scalar)
CURRENT_SCHEMA: Statement[str | None] = Statement("current_schema", rows.scalar)
SERVER_NOW: Statement[Any] = Statement("server_now", rows.scalar)
SERVER_NOW_TEXT: Statement[str] = Statement("server_now_text", rows.scalar)
KEY_COLLATION: Statement[Any] = Statement("key_collation", rows.scalar)
READINESS: Statement[tuple[Any, ...]] = Statement("readiness")
METRICS: Statement[tuple[Any, ...]] = Statement("metrics")
TRANSITIONS: Statement[tuple[Any, ...]] = Statement("transitions")
#: A function's name, for a Django Func (never sent alone).
STATUS_FUNCTION: Statement[Any] = Statement("status_function")

# ---- the catalog: migrations, scopes, limits, privileges ---------------------------------------------

RELATION_EXISTS: Statement[bool] = Statement("relation_exists", rows.scalar)
FUNCTION_EXISTS: Statement[bool] = Statement("function_exists", rows.scalar)
SEAT: Statement[tuple[Any, ...]] = Statement("seat")
SUPERUSER_OWNER: Statement[str] = Statement("superuser_owner", rows.scalar)
LEASE_TABLE_VISIBLE: Statement[bool] = Statement("lease_table_visible", rows.scalar)
FENCE_TRIGGERS: Statement[tuple[Any, ...]] = Statement("fence_triggers")
HISTORY_SCOPE: Statement[str] = Statement("history_scope", rows.scalar)
HISTORY_SCOPE_KEEP: Statement[Any] = Statement("history_scope_keep")
HISTORY_SCOPE_ADD: Statement[Any] = Statement("history_scope_add")
KEY_SCOPES: Statement[tuple[Any, ...]] = Statement("key_scopes")
KEY_SCOPES_READ_COMMITTED: Statement[Any] = Statement("key_scopes_read_committed")
KEY_SCOPES_LOCK: Statement[Any] = Statement("key_scopes_lock")
KEY_SCOPES_CLEAR: Statement[Any] = Statement("key_scopes_clear")
KEY_SCOPES_ADD: Statement[Any] = Statement("key_scopes_add")
ROLE_LIMITS: Statement[tuple[Any, ...]] = Statement("role_limits")
ROLE_LIMITS_LOCK: Statement[Any] = Statement("role_limits_lock")
ROLE_LIMITS_CLEAR: Statement[Any] = Statement("role_limits_clear")
ROLE_LIMITS_ADD: Statement[Any] = Statement("role_limits_add")
METRICS_RULE: Statement[tuple[Any, ...]] = Statement("metrics_rule")
METRICS_RULE_SET: Statement[Any] = Statement("metrics_rule_set")
ABSENT_ROLES: Statement[str] = Statement("absent_roles", rows.scalar)
MISSING_GRANTS: Statement[tuple[Any, ...]] = Statement("missing_grants")
GRANT: Statement[Any] = Statement("grant", parts=("privilege", "kind", "object", "role"))
REVOKE: Statement[Any] = Statement("revoke", parts=("privilege", "kind", "object", "role"))
REVOKE_GRANT_OPTION: Statement[Any] = Statement("revoke_grant_option", parts=("privilege", "kind", "object", "role"))
REVOKE_REPLICA_MODE: Statement[Any] = Statement("revoke_replica_mode", parts=("role",))
NO_BYPASS_RLS: Statement[Any] = Statement("no_bypass_rls", parts=("role",))
NO_CREATEROLE: Statement[Any] = Statement("no_createrole", parts=("role",))
REVOKE_MEMBERSHIP: Statement[Any] = Statement("revoke_membership", parts=("predefined", "role"))
HELD_PRIVILEGES: Statement[tuple[Any, ...]] = Statement("held_privileges")
BYPASSES: Statement[tuple[Any, ...]] = Statement("bypasses", parts=("replica", "createrole"))
#: A fragment of BYPASSES from PostgreSQL 15 on (parameter privileges arrived then).
REPLICA_GRANTS: Statement[Any] = Statement("replica_grants")
UNSCOPED: Statement[str] = Statement("unscoped", rows.scalar)
ALLOW_TRUNCATE: Statement[Any] = Statement("allow_truncate", parts=("database",))

# ---- a server, not a database: the Patroni callback ------------------------------------------------------

RECOVERY_STATE: Statement[tuple[Any, ...]] = Statement("recovery_state")
IN_RECOVERY: Statement[bool] = Statement("in_recovery", rows.scalar)
READ_ONLY_GATE: Statement[str] = Statement("read_only_gate", rows.scalar)
CLOSE_READ_ONLY_GATE: Statement[Any] = Statement("close_read_only_gate")
OPEN_READ_ONLY_GATE: Statement[Any] = Statement("open_read_only_gate")
RELOAD_CONFIGURATION: Statement[Any] = Statement("reload_configuration")
DATABASES: Statement[str] = Statement("databases", rows.scalar)
