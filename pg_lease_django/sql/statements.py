"""Every statement of ``queries.sql`` as a value: its name, its decoder, its error maps, whether it confirms.

The executors, ``sql.run`` and ``sql.arun``, take these. Nothing the package sends is spelled
anywhere else; the admin only shows an example ``pg_lease_inspect`` call as text.

A statement's parameters are named in its SQL (`Statement.parameters`). A call passes them as
keywords, and its decoder in ``sql.rows`` and its maps in ``sql.errors`` are given them as keywords
too. Those maps turn a SQLSTATE or a lease function's verdict into the package's error.

The templates of ``fence_triggers.sql``, the DDL of users' fenced tables, are here too.
`sql.run.render` composes them and Django's schema editor runs them through ``FenceTrigger``. Two
fragments composed into Django's own statements, ``fence_expression`` and ``fence_presented``, keep
positional ``%s``: Django's compiler joins their parameters to its own by position.
"""

from __future__ import annotations

from datetime import datetime

from . import Statement, errors, rows

# ---- the lease operations (confirmed: a lease write's commit must reach the synchronous standby) ----

ACQUIRE: Statement[rows.Attempt] = Statement(
    "acquire", rows.attempt, confirms=True, fast_path=True, errors=errors.ACQUIRE_ERRORS
)
ACQUIRE_OR_REGISTER: Statement[rows.Attempt] = Statement(
    "acquire_or_register", rows.attempt, confirms=True, fast_path=True, errors=errors.ACQUIRE_ERRORS
)
ACQUIRE_WITHIN: Statement[rows.Attempt] = Statement(
    "acquire_within", rows.attempt, confirms=True, fast_path=True, errors=errors.ACQUIRE_ERRORS
)
RENEW: Statement[rows.Renewal] = Statement(
    "renew", rows.renewal, confirms=True, fast_path=True, verdicts=errors.RENEW_VERDICTS
)
RELEASE: Statement[None] = Statement(
    "release", rows.released, confirms=True, fast_path=True, verdicts=errors.RELEASE_VERDICTS
)
INSPECT: Statement[rows.LeaseState] = Statement("inspect", rows.state, fast_path=True)
FORCE_RELEASE: Statement[int] = Statement(
    "force_release", rows.forced, confirms=True, fast_path=True, verdicts=errors.FORCE_RELEASE_VERDICTS
)
REQUEST_HANDOFF: Statement[rows.HandoffRequest] = Statement(
    "request_handoff", rows.handoff, confirms=True, fast_path=True, verdicts=errors.HANDOFF_VERDICTS
)
PRUNE: Statement[str] = Statement("prune", rows.scalar, confirms=True, fast_path=True)
ADVANCE_EPOCHS: Statement[rows.EpochAdvance] = Statement(
    "advance_epochs", rows.epoch_advance, confirms=True, fast_path=True, errors=errors.ADVANCE_ERRORS
)

# ---- fencing ---------------------------------------------------------------------------------------

PRESENT_FENCE: Statement[int] = Statement("present_fence", rows.scalar)
#: An expression inside Django's own UPDATE or INSERT, and its WHERE-clause form (never sent alone).
FENCE_EXPRESSION: Statement[None] = Statement("fence_expression")
FENCE_PRESENTED: Statement[None] = Statement("fence_presented")
ALLOW_UNFENCED: Statement[None] = Statement("allow_unfenced")
END_UNFENCED: Statement[None] = Statement("end_unfenced")

# ---- users' fenced tables: the DDL FenceTrigger runs in their migrations (fence_triggers.sql) -------

_FENCE = "fence_triggers.sql"
FENCE_TRIGGERS_CREATE: Statement[None] = Statement(
    "fence_triggers_create", parts=("table", "guard", "comment"), source=_FENCE
)
FENCE_GUARD_ROWS: Statement[None] = Statement("fence_guard_rows", source=_FENCE)
FENCE_GUARD_INHERITED_ROWS: Statement[None] = Statement(
    "fence_guard_inherited_rows", parts=("ancestor", "ancestor_pk", "child_pk"), source=_FENCE
)
FENCE_DERIVE_KEY: Statement[None] = Statement(
    "fence_derive_key", parts=("function", "body", "columns", "table", "comment", "stored"), source=_FENCE
)
FENCE_DERIVE_KEY_BODY: Statement[None] = Statement("fence_derive_key_body", parts=("expression",), source=_FENCE)
FENCE_TRIGGERS_DROP: Statement[None] = Statement("fence_triggers_drop", parts=("table", "function"), source=_FENCE)

# ---- sessions: waiting, the lease connections, settling ----------------------------------------------

LISTEN: Statement[None] = Statement("listen")
UNLISTEN: Statement[None] = Statement("unlisten")
LISTENING: Statement[int] = Statement("listening", rows.scalar)
SET_ROLE: Statement[None] = Statement("set_role", parts=("role",))
LOCK_TIMEOUT_LOCAL: Statement[None] = Statement("lock_timeout_local")
STATEMENT_TIMEOUT_LOCAL: Statement[None] = Statement("statement_timeout_local")
STATEMENT_TIMEOUT_SESSION: Statement[None] = Statement("statement_timeout_session")
STATEMENT_TIMEOUT_RESET: Statement[None] = Statement("statement_timeout_reset")
CANCEL_ATTEMPT: Statement[bool] = Statement("cancel_attempt", rows.scalar)

# ---- reading: the server clock, listings, the operators' views, probes, metrics ----------------------

SCHEMA_LOOKUP: Statement[str] = Statement("schema_lookup", rows.scalar)
CURRENT_SCHEMA: Statement[str | None] = Statement("current_schema", rows.scalar)
SERVER_NOW: Statement[datetime] = Statement("server_now", rows.scalar)
SERVER_NOW_TEXT: Statement[str] = Statement("server_now_text", rows.scalar)
KEY_COLLATION: Statement[dict[str, str] | str] = Statement("key_collation", rows.scalar)
READINESS: Statement[rows.Readiness] = Statement("readiness", rows.shaped(rows.Readiness))
METRICS: Statement[rows.LeaseCount] = Statement("metrics", rows.shaped(rows.LeaseCount))
TRANSITIONS: Statement[rows.Transition] = Statement("transitions", rows.shaped(rows.Transition))
#: A function's name, for a Django Func (never sent alone).
STATUS_FUNCTION: Statement[None] = Statement("status_function")

# ---- the catalog: migrations, scopes, limits, privileges ---------------------------------------------

RELATION_EXISTS: Statement[bool] = Statement("relation_exists", rows.scalar)
FUNCTION_EXISTS: Statement[bool] = Statement("function_exists", rows.scalar)
SEAT: Statement[rows.Seat] = Statement("seat", rows.shaped(rows.Seat))
SUPERUSER_OWNER: Statement[str] = Statement("superuser_owner", rows.scalar)
LEASE_TABLE_VISIBLE: Statement[bool] = Statement("lease_table_visible", rows.scalar)
FENCE_TRIGGERS: Statement[rows.FenceTriggers] = Statement("fence_triggers", rows.shaped(rows.FenceTriggers))
HISTORY_SCOPE: Statement[str] = Statement("history_scope", rows.scalar)
HISTORY_SCOPE_KEEP: Statement[None] = Statement("history_scope_keep")
HISTORY_SCOPE_ADD: Statement[None] = Statement("history_scope_add")
KEY_SCOPES: Statement[rows.KeyScope] = Statement("key_scopes", rows.shaped(rows.KeyScope))
KEY_SCOPES_READ_COMMITTED: Statement[None] = Statement("key_scopes_read_committed")
KEY_SCOPES_LOCK: Statement[None] = Statement("key_scopes_lock")
KEY_SCOPES_CLEAR: Statement[None] = Statement("key_scopes_clear")
KEY_SCOPES_ADD: Statement[None] = Statement("key_scopes_add")
ROLE_LIMITS: Statement[rows.RoleLimit] = Statement("role_limits", rows.shaped(rows.RoleLimit))
ROLE_LIMITS_LOCK: Statement[None] = Statement("role_limits_lock")
ROLE_LIMITS_CLEAR: Statement[None] = Statement("role_limits_clear")
ROLE_LIMITS_ADD: Statement[None] = Statement("role_limits_add")
METRICS_RULE: Statement[rows.MetricsRule] = Statement("metrics_rule", rows.shaped(rows.MetricsRule))
METRICS_RULE_SET: Statement[None] = Statement("metrics_rule_set")
ABSENT_ROLES: Statement[str] = Statement("absent_roles", rows.scalar)
MISSING_PRIVILEGES: Statement[rows.MissingPrivilege] = Statement(
    "missing_privileges", rows.shaped(rows.MissingPrivilege)
)
GRANT_PRIVILEGE: Statement[None] = Statement("grant_privilege", parts=("privilege", "kind", "object", "role"))
REVOKE_PRIVILEGE: Statement[None] = Statement("revoke_privilege", parts=("privilege", "kind", "object", "role"))
REVOKE_GRANT_OPTION: Statement[None] = Statement("revoke_grant_option", parts=("privilege", "kind", "object", "role"))
REVOKE_REPLICA_MODE: Statement[None] = Statement("revoke_replica_mode", parts=("role",))
NO_BYPASS_RLS: Statement[None] = Statement("no_bypass_rls", parts=("role",))
NO_CREATEROLE: Statement[None] = Statement("no_createrole", parts=("role",))
REVOKE_MEMBERSHIP: Statement[None] = Statement("revoke_membership", parts=("predefined", "role"))
HELD_PRIVILEGES: Statement[rows.HeldPrivilege] = Statement("held_privileges", rows.shaped(rows.HeldPrivilege))
BYPASSES: Statement[rows.RoleBypasses] = Statement(
    "bypasses", rows.shaped(rows.RoleBypasses), parts=("replica", "createrole")
)
#: A fragment of BYPASSES from PostgreSQL 15 on (parameter privileges arrived then).
REPLICA_PRIVILEGES: Statement[None] = Statement("replica_privileges")
UNSCOPED: Statement[str] = Statement("unscoped", rows.scalar)
ALLOW_TRUNCATE: Statement[None] = Statement("allow_truncate", parts=("database",))

# ---- a server, not a database: the Patroni callback ------------------------------------------------------

RECOVERY_STATE: Statement[rows.RecoveryState] = Statement("recovery_state", rows.shaped(rows.RecoveryState))
IN_RECOVERY: Statement[bool] = Statement("in_recovery", rows.scalar)
READ_ONLY_GATE: Statement[str] = Statement("read_only_gate", rows.scalar)
CLOSE_READ_ONLY_GATE: Statement[None] = Statement("close_read_only_gate")
OPEN_READ_ONLY_GATE: Statement[None] = Statement("open_read_only_gate")
RELOAD_CONFIGURATION: Statement[None] = Statement("reload_configuration")
DATABASES: Statement[str] = Statement("databases", rows.scalar)
