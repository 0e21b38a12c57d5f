-- Every statement pg_lease_django sends, written once, each under its name (procrastinate's habit:
-- a line `-- name --`, then comment lines, then the statement). `pg_lease_django.sql.statements`
-- gives each its rows' decoder; `pg_lease_django.sql.run` (Django's connection) and
-- `pg_lease_django.sql.arun` (psycopg's async connection) send them. `{schema}` is the quoted schema
-- of the lease app, `{schema_name}` its name as a string literal, and every `{name}` an identifier or a fragment the executor composes with
-- psycopg.sql (never string formatting); `%(name)s` are parameters, which a call passes by name, and
-- `%s` only in the fragments composed into Django's own statements. Literal braces are doubled.
-- Every lease function is schema-qualified and every argument cast: PostgreSQL resolves an
-- unqualified call to an exact-type match anywhere on the search_path, so a lookalike in an earlier
-- schema could otherwise answer (docs/security.md, "Lookalike functions").

-- acquire --
-- One non-blocking acquire: granted, or refused naming who holds the key and until when.
SELECT granted, key, owner, epoch, expires_at, server_time
  FROM {schema}.pg_lease_acquire(%(key)s::text, %(owner)s::text, %(ttl)s::interval)

-- acquire_or_register --
-- A waiter's attempt while it LISTENs: acquire, and when refused, a registration that makes the next
-- release of the key notify, until the waiter's next attempt is due (the last argument) plus a margin.
SELECT granted, key, owner, epoch, expires_at, server_time
  FROM {schema}.pg_lease_acquire_or_register(%(key)s::text, %(owner)s::text, %(ttl)s::interval, %(within)s::interval)

-- acquire_within --
-- A polling waiter's attempt: acquire, every lock wait of it bounded by what is left of the waiter's
-- deadline (the last argument; NULL: no deadline), a wait that ran out answered as a refusal.
SELECT granted, key, owner, epoch, expires_at, server_time
  FROM {schema}.pg_lease_acquire_within(%(key)s::text, %(owner)s::text, %(ttl)s::interval, %(within)s::interval)

-- renew --
-- A renewal that also says whether a hand-off was requested (pg_lease_renew without that column).
-- server_time left out: nothing reads it, and each timestamp costs a parse per call.
SELECT outcome, expires_at, handoff_requested
  FROM {schema}.pg_lease_heartbeat(%(key)s::text, %(owner)s::text, %(epoch)s::bigint, %(ttl)s::interval)

-- release --
-- Only the verdict is read (the new epoch and the server time are not): nothing else to parse per call.
SELECT outcome FROM {schema}.pg_lease_release(%(key)s::text, %(owner)s::text, %(epoch)s::bigint)

-- inspect --
-- The columns the package reads (acquired_at left out: one timestamp fewer to parse per call).
SELECT key, status, owner, epoch, expires_at, server_time FROM {schema}.pg_lease_inspect(%(key)s::text)

-- force_release --
SELECT outcome, owner, epoch, server_time FROM {schema}.pg_lease_force_release(%(key)s::text, %(epoch)s::bigint, %(operator)s::text)

-- request_handoff --
-- Ask the holder to step down at its next renewal (advice: the grant is unchanged).
SELECT outcome, owner, epoch, expires_at, requested_at, server_time
  FROM {schema}.pg_lease_request_handoff(%(key)s::text, %(epoch)s::bigint)

-- prune --
SELECT key FROM {schema}.pg_lease_prune(%(free_for)s::interval, %(dry_run)s::boolean)

-- advance_epochs --
-- Raise every epoch and the epoch floor by N (after an asynchronous failover; the owner's, or a runbook role's).
SELECT leases, held, epoch_floor, max_epoch, server_time FROM {schema}.pg_lease_advance_epochs(%(by)s::bigint, %(dry_run)s::boolean)

-- present_fence --
-- Present a fence for this transaction (raises PL001-PL003 when it does not hold); the epoch.
SELECT {schema}.pg_lease_check_fence(%(key)s::text, %(owner)s::text, %(epoch)s::bigint)

-- fence_expression --
-- The same as a value, in the UPDATE or INSERT of one row that Django's save() sends
-- (fencing.statements): the epoch. A bare call, not a sub-select: a save writes one row (its UPDATE
-- names the primary key, its INSERT one row of values), so it runs once, after the row is found and
-- before it is locked or written; an UPDATE that finds no row runs nothing and Django's INSERT that
-- follows presents the fence. A sub-select would cost the statement an InitPlan to plan and run.
{schema}.pg_lease_check_fence(%s::text, %s::text, %s::bigint)

-- fence_presented --
-- The same as a condition, in the WHERE clause of Django's own UPDATE or DELETE: evaluated once,
-- before any row is read.
(SELECT {schema}.pg_lease_check_fence(%s::text, %s::text, %s::bigint)) IS NOT NULL

-- allow_unfenced --
-- Opt this transaction out of fencing (operators: revoked from PUBLIC).
SELECT {schema}.pg_lease_allow_unfenced()

-- end_unfenced --
-- End an opt-out before the transaction does (a built-in: nothing to qualify).
SELECT pg_catalog.set_config('pg_lease.unfenced', 'off', true)

-- listen --
-- What a blocking acquire waits on between attempts (outside a transaction); the channel is the
-- one the lease functions notify (pg_lease_wake_waiters).
LISTEN pg_lease_django

-- unlisten --
UNLISTEN pg_lease_django

-- listening --
-- How many channels this session listens on (a pooled lease connection must listen on none).
SELECT pg_catalog.count(*) FROM pg_catalog.pg_listening_channels()

-- set_role --
-- OPTIONS["assume_role"], on a connection of the package's own, as Django's backend sets it.
SET ROLE {role}

-- schema_lookup --
-- Every schema of the search_path holding a lease table: more than one is ambiguous (one of them
-- may be a decoy another role created to capture the calls), so the lookup refuses to guess.
SELECT n.nspname FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
 WHERE c.relname = 'pg_lease_django_lease' AND c.relkind IN ('r', 'p')
   AND n.nspname = ANY (pg_catalog.current_schemas(false))

-- current_schema --
-- The schema a migration creates its objects in: the first of the search_path that exists (NULL: none).
SELECT pg_catalog.current_schema()

-- server_now --
SELECT pg_catalog.clock_timestamp()

-- server_now_text --
-- The server clock in UTC as ISO 8601 text, always with microseconds (the listings' stable form).
SELECT pg_catalog.to_char(pg_catalog.clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"')

-- key_collation --
-- The collation of a table's key column as JSON {"provider", "collate"}. "default" means the
-- database's; to_jsonb() reads pg_database whatever columns this server version has.
SELECT CASE WHEN c.collname = 'default'
            THEN (SELECT pg_catalog.jsonb_build_object('provider', coalesce(pg_catalog.to_jsonb(d) ->> 'datlocprovider', 'c'),
                                                       'collate', d.datcollate)
                    FROM pg_catalog.pg_database d WHERE d.datname = pg_catalog.current_database())
            ELSE pg_catalog.jsonb_build_object('provider', c.collprovider::text, 'collate', c.collcollate)
       END
  FROM pg_catalog.pg_attribute a JOIN pg_catalog.pg_collation c ON c.oid = a.attcollation
 WHERE a.attrelid = %(table)s::pg_catalog.regclass AND a.attname = 'key'

-- readiness --
-- Whether this role may run every function a worker needs (the app migrated, the grants made), the
-- key prefixes it may use (NULL: every key; an empty array: none, every call refused), and whether
-- it may read the metrics (a monitor's seat, which calls no lease function).
SELECT coalesce(pg_catalog.bool_and(pg_catalog.has_function_privilege(p.object, 'EXECUTE'))
                  FILTER (WHERE p.role = 'worker'), false),
       {schema}.pg_lease_session_scope(),
       coalesce(pg_catalog.bool_and(pg_catalog.has_function_privilege(p.object, 'EXECUTE'))
                  FILTER (WHERE p.role = 'monitor'), false)
  FROM {schema}.pg_lease_privileges() p WHERE p.role IN ('worker', 'monitor') AND p.kind = 'FUNCTION'

-- lock_timeout_local --
-- A lock timeout for this transaction only (settling a release: it must not wait forever).
SELECT pg_catalog.set_config('lock_timeout', %(timeout)s, true)

-- statement_timeout_local --
SELECT pg_catalog.set_config('statement_timeout', %(timeout)s, true)

-- statement_timeout_session --
SELECT pg_catalog.set_config('statement_timeout', %(timeout)s, false)

-- statement_timeout_reset --
RESET statement_timeout

-- cancel_attempt --
-- An interrupted call's acquire still running, found by the marker its text carries (a comment
-- unique to the attempt, sql.run.first): a row per server process running it, cancelled when it
-- is the process the call ran in, or (behind PgBouncer, whose pids are its own) when it waits on a
-- lock (an attempt that does not wait ends on its own: the process may serve another client next).
-- Only processes this session may signal are cancelled; the others are reported all the same.
-- Directly connected, also a row for the interrupted session's own process (%(closed)s) while it
-- lives, whatever it runs: its client has closed the session, so it ends once it has answered
-- what it had read, and an attempt sent just before the close may not be read (nor marked active)
-- yet when the settling first looks; it would grant after the look.
SELECT CASE WHEN a.state = 'active' AND pg_catalog.strpos(a.query, %(attempt_marker)s) > 0
             AND (a.pid = %(pid)s OR a.wait_event_type = 'Lock') AND pg_catalog.pg_has_role(a.usesysid, 'MEMBER')
            THEN pg_catalog.pg_cancel_backend(a.pid) ELSE false END
  FROM pg_catalog.pg_stat_activity a
 WHERE a.pid <> pg_catalog.pg_backend_pid()
   AND ((a.state = 'active' AND pg_catalog.strpos(a.query, %(attempt_marker)s) > 0) OR a.pid = %(closed)s)

-- allow_truncate --
-- Let a test database be flushed (TRUNCATE of the lease and fenced tables), for roles that may opt out.
ALTER DATABASE {database} SET pg_lease.allow_truncate = on

-- metrics --
-- The database's view for Prometheus by label (pg_lease_metrics: the rule is the database's).
SELECT kind, label, state, count, oldest_lapse FROM {schema}.pg_lease_metrics()

-- status_function --
-- The lease functions' status rule, named for a Django Func over the lease table (querysets.StatusAt:
-- the ORM writes its arguments, owner, expires_at and the server clock).
{schema}.pg_lease_status

-- transitions --
-- The latest grants and ends of tenures under a prefix and a LIKE pattern (each NULL: any), newest first.
SELECT pg_catalog.to_char(e.at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"+00:00"'), e.key, e.epoch, e.owner, e.event
  FROM (SELECT t.granted_at AS at, t.key, t.epoch, t.owner, 'granted' AS event
          FROM {schema}.pg_lease_django_tenure t
         WHERE (%(prefix)s::text IS NULL OR pg_catalog.starts_with(t.key, %(prefix)s::text))
           AND (%(like)s::text IS NULL OR t.key LIKE %(like)s::text)
        UNION ALL
        SELECT t.ended_at, t.key, t.epoch, t.owner, coalesce(t.end_reason, 'ended')
          FROM {schema}.pg_lease_django_tenure t
         WHERE t.ended_at IS NOT NULL
           AND (%(prefix)s::text IS NULL OR pg_catalog.starts_with(t.key, %(prefix)s::text))
           AND (%(like)s::text IS NULL OR t.key LIKE %(like)s::text)) e
 ORDER BY e.at DESC, e.epoch DESC
 LIMIT %(limit)s

-- ================================================================================================
-- The catalog: migrations, scopes, privileges (checks, `migrate`, `manage.py leases grant`)
-- ================================================================================================

-- relation_exists --
SELECT EXISTS (
  SELECT FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace
   WHERE n.nspname = %(namespace)s AND c.relname = %(relation)s
)

-- seat --
-- Who this session logged in as, and who owns a relation (the lease table, django_migrations): a
-- refusal from the wrong seat names the role to use (NULL where the relation is not there).
SELECT session_user::text,
       (SELECT pg_catalog.pg_get_userbyid(c.relowner)::text
          FROM pg_catalog.pg_class c WHERE c.oid = pg_catalog.to_regclass(%(relation)s::text))

-- superuser_owner --
-- The lease tables' owner, when it is a superuser (migrated as one): its SECURITY DEFINER functions
-- then run as a superuser, and no membership check leaves anyone out of it.
SELECT r.rolname::text FROM pg_catalog.pg_class c JOIN pg_catalog.pg_roles r ON r.oid = c.relowner
 WHERE c.oid = pg_catalog.to_regclass(%(relation)s::text) AND r.rolsuper

-- function_exists --
SELECT pg_catalog.to_regprocedure(%(function)s) IS NOT NULL

-- history_scope --
SELECT prefix FROM {schema}.pg_lease_django_history_scope ORDER BY prefix

-- history_scope_keep --
-- Keep only these prefixes (the scope table's trigger re-flags every lease row, whoever writes).
DELETE FROM {schema}.pg_lease_django_history_scope WHERE NOT prefix = ANY (%(prefixes)s::text[])

-- history_scope_add --
INSERT INTO {schema}.pg_lease_django_history_scope (prefix) SELECT p FROM pg_catalog.unnest(%(prefixes)s::text[]) p
ON CONFLICT DO NOTHING

-- key_scopes --
SELECT role, prefix FROM {schema}.pg_lease_django_key_scope ORDER BY role, prefix

-- key_scopes_read_committed --
-- The scope table's trigger compiles it as committed, which a transaction reading as of its start
-- cannot see (pg_lease_compile_key_scope refuses it): the first statement of the transaction that
-- changes the scopes, whatever isolation the connection is set to.
SET TRANSACTION ISOLATION LEVEL READ COMMITTED

-- key_scopes_lock --
-- One sync of the scope table at a time (two deploys migrating at once): the second waits, then
-- replaces what the first committed instead of adding the same rows beside them. The mode the
-- table's trigger compiles under, which the writers' own ROW EXCLUSIVE does not conflict with.
LOCK TABLE {schema}.pg_lease_django_key_scope IN SHARE UPDATE EXCLUSIVE MODE

-- key_scopes_clear --
DELETE FROM {schema}.pg_lease_django_key_scope

-- key_scopes_add --
-- The key scopes PG_LEASE_KEY_SCOPES says (the table's trigger compiles them, statement by statement).
INSERT INTO {schema}.pg_lease_django_key_scope (role, prefix)
SELECT * FROM ROWS FROM (pg_catalog.unnest(%(roles)s::name[]), pg_catalog.unnest(%(prefixes)s::text[]))

-- role_limits --
SELECT role, max_leases, max_tenures_per_key FROM {schema}.pg_lease_django_role_limit ORDER BY role

-- role_limits_lock --
-- One sync of the limit table at a time, as key_scopes_lock. First in its transaction, so that
-- what follows reads the table as the previous sync committed it, whatever the isolation level.
LOCK TABLE {schema}.pg_lease_django_role_limit IN SHARE UPDATE EXCLUSIVE MODE

-- role_limits_clear --
DELETE FROM {schema}.pg_lease_django_role_limit

-- role_limits_add --
INSERT INTO {schema}.pg_lease_django_role_limit (role, max_leases, max_tenures_per_key)
SELECT * FROM ROWS FROM (pg_catalog.unnest(%(roles)s::name[]), pg_catalog.unnest(%(max_leases)s::int[]), pg_catalog.unnest(%(max_tenures_per_key)s::int[]))

-- metrics_rule --
-- The metrics' label rule the database holds: separator, label cap (no row before migration 0010).
SELECT separator, max_labels FROM {schema}.pg_lease_django_metrics_rule

-- metrics_rule_set --
-- Set it (one row, whoever syncs at once: the second write wins, as the settings are the same).
INSERT INTO {schema}.pg_lease_django_metrics_rule (id, separator, max_labels) VALUES (true, %(separator)s::text, %(max_labels)s::integer)
ON CONFLICT (id) DO UPDATE SET separator = excluded.separator, max_labels = excluded.max_labels

-- absent_roles --
-- Which of these names are no role of the cluster (a typo, a rename, a drop).
SELECT n FROM pg_catalog.unnest(%(names)s::text[]) n
 WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.rolname = n) ORDER BY n

-- missing_privileges --
-- For each declared role (name, its kinds' tiers as 'worker,operator'), each privilege of
-- pg_lease_privileges() of those tiers: whether the role exists, and whether it holds it.
SELECT d.name, r.rolname IS NOT NULL, p.kind, p.object, p.privilege,
       r.rolname IS NOT NULL AND CASE p.kind
         WHEN 'FUNCTION' THEN pg_catalog.has_function_privilege(r.oid, p.object, p.privilege)
         ELSE pg_catalog.has_table_privilege(r.oid, p.object, p.privilege) END
  FROM ROWS FROM (pg_catalog.unnest(%(roles)s::text[]), pg_catalog.unnest(%(tiers)s::text[])) AS d (name, tiers)
  LEFT JOIN pg_catalog.pg_roles r ON r.rolname = d.name
  JOIN {schema}.pg_lease_privileges() p ON p.role = ANY (pg_catalog.string_to_array(d.tiers, ','))
 ORDER BY d.name, p.kind, p.object

-- grant_privilege --
-- One privilege of pg_lease_privileges() (its kind, object and privilege are that function's own
-- text, composed as SQL; the role an identifier).
GRANT {privilege} ON {kind} {object} TO {role}

-- revoke_privilege --
-- What takes a grant back: printed by `manage.py leases grant --check`, never sent.
REVOKE {privilege} ON {kind} {object} FROM {role}

-- revoke_grant_option --
-- The same, when only the grant option is extra.
REVOKE GRANT OPTION FOR {privilege} ON {kind} {object} FROM {role}

-- revoke_replica_mode --
-- The remedies `privileges.bypasses` prints (never sent): a role that may turn triggers off,
REVOKE SET, ALTER SYSTEM ON PARAMETER session_replication_role FROM {role}

-- no_bypass_rls --
-- one that bypasses row-level security,
ALTER ROLE {role} NOBYPASSRLS

-- no_createrole --
-- one that may make itself a member of any role but a superuser (CREATEROLE before PostgreSQL 16),
ALTER ROLE {role} NOCREATEROLE

-- revoke_membership --
-- one that a predefined role ({predefined}) lets around the rules.
REVOKE {predefined} FROM {role}

-- held_privileges --
-- Who holds what on the package's objects, through every membership: per role (and PUBLIC), each
-- privilege held, whether WITH GRANT OPTION, the tiers of pg_lease_privileges() that name it, and
-- the tiers the role may hold through the declared roles it is a member of (itself included: a
-- login role in a declared group role holds what the group is granted, as PostgreSQL means it), and
-- whether the role was granted it itself (its ACL entry) rather than through a role it is a member of.
-- Privileges pg_read_all_data / pg_write_all_data explain are left to `bypasses` (their remedy is
-- the membership, not the table). Roles are checked by OID: by name, a role dropped after this
-- statement's snapshot is looked up in the current catalog and fails the whole read.
WITH lease_schema AS (SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname = {schema_name}),
owner AS (SELECT c.relowner AS oid FROM pg_catalog.pg_class c, lease_schema s
           WHERE c.relnamespace = s.oid AND c.relname = 'pg_lease_django_lease'),
objects AS (
  SELECT 'FUNCTION' AS kind, p.oid, p.oid::pg_catalog.regprocedure::text AS object,
         coalesce(p.proacl, pg_catalog.acldefault('f', p.proowner)) AS acl FROM pg_catalog.pg_proc p
   WHERE p.pronamespace = (SELECT s.oid FROM lease_schema s) AND p.proname LIKE 'pg\_lease\_%%'
     AND p.prorettype <> 'pg_catalog.trigger'::pg_catalog.regtype
  UNION ALL
  SELECT 'TABLE', c.oid, c.oid::pg_catalog.regclass::text, coalesce(c.relacl, pg_catalog.acldefault('r', c.relowner))
    FROM pg_catalog.pg_class c
   WHERE c.relnamespace = (SELECT s.oid FROM lease_schema s) AND c.relname LIKE 'pg\_lease\_django\_%%'
     AND c.relkind IN ('r', 'p')),
wanted AS (
  SELECT w.role AS tier, w.privilege,
         CASE w.kind WHEN 'FUNCTION' THEN w.object::pg_catalog.regprocedure::oid ELSE w.object::pg_catalog.regclass::oid END AS oid
    FROM {schema}.pg_lease_privileges() w),
declared AS (
  SELECT r.oid, d.tiers FROM ROWS FROM (pg_catalog.unnest(%(roles)s::text[]), pg_catalog.unnest(%(tiers)s::text[])) AS d (name, tiers)
    JOIN pg_catalog.pg_roles r ON r.rolname = d.name),
grantees AS (
  SELECT r.rolname::text AS name, r.oid,
         pg_catalog.string_to_array(pg_catalog.string_agg(d.tiers, ','), ',') AS allowed,
         bool_or(pg_catalog.pg_has_role(r.oid, 'pg_read_all_data', 'USAGE')) AS reads_all,
         bool_or(pg_catalog.pg_has_role(r.oid, 'pg_write_all_data', 'USAGE')) AS writes_all
    FROM pg_catalog.pg_roles r CROSS JOIN owner LEFT JOIN declared d ON pg_catalog.pg_has_role(r.oid, d.oid, 'USAGE')
   WHERE NOT r.rolsuper AND r.rolname !~ '^pg_' AND NOT pg_catalog.pg_has_role(r.oid, owner.oid, 'USAGE')
   GROUP BY r.rolname, r.oid
  UNION ALL SELECT 'PUBLIC', NULL, NULL, false, false),
privileges AS (
  SELECT v.kind, v.privilege, v.privilege || ' WITH GRANT OPTION' AS passing
    FROM (VALUES ('FUNCTION', 'EXECUTE'), ('TABLE', 'SELECT'), ('TABLE', 'INSERT'), ('TABLE', 'UPDATE'),
                 ('TABLE', 'DELETE'), ('TABLE', 'TRUNCATE'), ('TABLE', 'REFERENCES'), ('TABLE', 'TRIGGER')) v (kind, privilege)),
held AS (
  SELECT g.name, o.kind, o.object, o.oid, v.privilege, g.allowed,
         EXISTS (SELECT FROM pg_catalog.aclexplode(o.acl) a
                  WHERE a.grantee = coalesce(g.oid, 0) AND a.privilege_type = v.privilege) AS direct,
         CASE WHEN g.oid IS NULL AND o.kind = 'FUNCTION' THEN pg_catalog.has_function_privilege('public', o.oid, v.passing)
              WHEN g.oid IS NULL THEN pg_catalog.has_table_privilege('public', o.oid, v.passing)
              WHEN o.kind = 'FUNCTION' THEN pg_catalog.has_function_privilege(g.oid, o.oid, v.passing)
              ELSE pg_catalog.has_table_privilege(g.oid, o.oid, v.passing) END AS grantable
    FROM grantees g CROSS JOIN objects o JOIN privileges v ON v.kind = o.kind
   WHERE CASE WHEN g.oid IS NULL AND o.kind = 'FUNCTION' THEN pg_catalog.has_function_privilege('public', o.oid, v.privilege)
              WHEN g.oid IS NULL THEN pg_catalog.has_table_privilege('public', o.oid, v.privilege)
              WHEN o.kind = 'FUNCTION' THEN pg_catalog.has_function_privilege(g.oid, o.oid, v.privilege)
              ELSE pg_catalog.has_table_privilege(g.oid, o.oid, v.privilege) END
     AND NOT (o.kind = 'TABLE' AND v.privilege = 'SELECT' AND g.reads_all)
     AND NOT (o.kind = 'TABLE' AND v.privilege IN ('INSERT', 'UPDATE', 'DELETE') AND g.writes_all))
SELECT h.name, h.kind, h.object, h.privilege, h.grantable,
       pg_catalog.array_agg(w.tier) FILTER (WHERE w.tier IS NOT NULL), h.allowed, h.direct
  FROM held h LEFT JOIN wanted w ON w.oid = h.oid AND w.privilege = h.privilege
 GROUP BY 1, 2, 3, 4, 5, 7, 8 ORDER BY 1, 2, 3, 4

-- bypasses --
-- Roles PostgreSQL lets around the lease rules, beside table and function grants: SET or ALTER
-- SYSTEM on session_replication_role ({replica}: `replica_privileges` from PostgreSQL 15 on, when
-- parameter privileges arrived; else false), membership of pg_read_all_data, pg_write_all_data and
-- pg_maintain (PostgreSQL 17+), and BYPASSRLS with a way to read the secret. Each reported where it
-- was granted, not in every member that inherits it: revoking it there removes it from them all;
-- PUBLIC (oid 0) for a parameter granted to every role. And CREATEROLE ({createrole}: before
-- PostgreSQL 16, such a role may grant itself membership of any role but a superuser, the owner
-- included; else false). Superusers and the owner's members are trusted and left out.
WITH lease_schema AS (SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname = {schema_name}),
owner AS (SELECT c.relowner AS oid FROM pg_catalog.pg_class c, lease_schema s
           WHERE c.relnamespace = s.oid AND c.relname = 'pg_lease_django_lease'),
roles AS (
  SELECT r.rolname::text AS name, r.oid, r.rolbypassrls, {createrole} AS createrole FROM pg_catalog.pg_roles r, owner
   WHERE NOT r.rolsuper AND r.rolname !~ '^pg_' AND NOT pg_catalog.pg_has_role(r.oid, owner.oid, 'USAGE')
  UNION ALL SELECT 'PUBLIC', 0::pg_catalog.oid, false, false),
member_of AS (
  SELECT m.member, m.roleid::pg_catalog.regrole::text AS predefined FROM pg_catalog.pg_auth_members m
   WHERE m.roleid::pg_catalog.regrole::text IN ('pg_read_all_data', 'pg_write_all_data', 'pg_maintain'))
SELECT r.name, {replica},
       EXISTS (SELECT FROM member_of m WHERE m.member = r.oid AND m.predefined = 'pg_read_all_data'),
       EXISTS (SELECT FROM member_of m WHERE m.member = r.oid AND m.predefined = 'pg_write_all_data'),
       EXISTS (SELECT FROM member_of m WHERE m.member = r.oid AND m.predefined = 'pg_maintain'),
       CASE WHEN r.rolbypassrls THEN pg_catalog.pg_has_role(r.oid, 'pg_read_all_data', 'USAGE')
                                     OR pg_catalog.has_table_privilege(r.oid, secret.oid, 'SELECT') ELSE false END,
       r.createrole
  FROM roles r, (SELECT c.oid FROM pg_catalog.pg_class c, lease_schema s
                  WHERE c.relnamespace = s.oid AND c.relname = 'pg_lease_django_secret') secret
 ORDER BY r.name

-- replica_privileges --
-- Granted SET or ALTER SYSTEM on session_replication_role by name (pg_parameter_acl, PostgreSQL 15+).
EXISTS (SELECT FROM pg_catalog.pg_parameter_acl p, pg_catalog.aclexplode(p.paracl) a
         WHERE p.parname = 'session_replication_role' AND a.grantee = r.oid)

-- unscoped --
-- Roles that may call a lease function taking a key (the array) while key scopes are configured,
-- and that no scope applies to (their own, or a group's they are a member of). Reads the scope table.
WITH lease_schema AS (SELECT n.oid FROM pg_catalog.pg_namespace n WHERE n.nspname = {schema_name}),
owner AS (SELECT c.relowner AS oid FROM pg_catalog.pg_class c, lease_schema s
           WHERE c.relnamespace = s.oid AND c.relname = 'pg_lease_django_lease')
SELECT r.rolname::text FROM pg_catalog.pg_roles r, owner
 WHERE NOT r.rolsuper AND r.rolname !~ '^pg_' AND NOT pg_catalog.pg_has_role(r.oid, owner.oid, 'USAGE')
   AND EXISTS (SELECT FROM {schema}."pg_lease_django_key_scope")
   AND NOT EXISTS (SELECT FROM {schema}."pg_lease_django_key_scope" s
                    WHERE pg_catalog.pg_has_role(r.oid, pg_catalog.to_regrole(pg_catalog.quote_ident(s.role)), 'MEMBER'))
   AND EXISTS (SELECT FROM pg_catalog.unnest(%(functions)s::text[]) f
                WHERE pg_catalog.has_function_privilege(r.oid, f::pg_catalog.regprocedure, 'EXECUTE'))
 ORDER BY 1

-- lease_table_visible --
-- Whether the connection's search_path reaches a lease table (check W002).
SELECT pg_catalog.to_regclass('pg_lease_django_lease') IS NOT NULL

-- fence_triggers --
-- Whether a table exists, and its fence triggers of these names with their comments (check W006).
SELECT pg_catalog.to_regclass(%(table)s) IS NOT NULL,
       pg_catalog.array_agg(t.tgname) FILTER (WHERE t.oid IS NOT NULL),
       pg_catalog.array_agg(coalesce(pg_catalog.obj_description(t.oid, 'pg_trigger'), '')) FILTER (WHERE t.oid IS NOT NULL)
  FROM (SELECT 1) one
  LEFT JOIN pg_catalog.pg_trigger t ON t.tgrelid = pg_catalog.to_regclass(%(table)s) AND t.tgname = ANY (%(names)s)

-- ================================================================================================
-- A server, not a database: the Patroni callback (pg_lease_django.patroni)
-- ================================================================================================

-- recovery_state --
-- Whether the server is in recovery, its WAL received and replayed, its data directory and WAL segment size.
SELECT pg_catalog.pg_is_in_recovery(), pg_catalog.pg_last_wal_receive_lsn()::text,
       pg_catalog.pg_last_wal_replay_lsn()::text, pg_catalog.current_setting('data_directory'),
       (SELECT s.setting::bigint FROM pg_catalog.pg_settings s WHERE s.name = 'wal_segment_size')

-- in_recovery --
SELECT pg_catalog.pg_is_in_recovery()

-- read_only_gate --
SHOW default_transaction_read_only

-- close_read_only_gate --
ALTER SYSTEM SET default_transaction_read_only = on

-- open_read_only_gate --
ALTER SYSTEM RESET default_transaction_read_only

-- reload_configuration --
SELECT pg_catalog.pg_reload_conf()

-- databases --
SELECT datname FROM pg_catalog.pg_database WHERE datallowconn AND NOT datistemplate
