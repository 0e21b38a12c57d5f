-- pg_lease_django: the current schema, every table, function, trigger and privilege written once.
--
-- @extschema@ stands for the schema the lease app is installed in, quoted ("public"); nothing else
-- varies. Django's migrations render it for the schema they run in (pg_lease_django.sql.files.render);
-- by hand, in one transaction:
--
--   sed 's/@extschema@/"public"/g' schema.sql | psql -v ON_ERROR_STOP=1 --single-transaction
--
-- Every function with a body of its own pins search_path to pg_catalog (and pg_temp, which is never
-- searched for functions or operators) and names the package's objects with their schema: nothing
-- another role creates in that schema (PostgreSQL 14 and older let every role CREATE in public) can
-- stand in for a built-in that needs an implicit cast, least of all inside the functions that run as
-- their owner. The exceptions carry no SET clause on purpose and name only exact-typed built-ins:
-- pg_lease_status, pg_lease_verdict, pg_lease_waiter_lock and pg_lease_key_allowed (inlined by the
-- planner; a SET clause stops that, ~20 us a call), pg_lease_remember_fence, pg_lease_wake_waiters
-- and the lease table's update trigger pg_lease_guard_update (hot paths; the trigger names even its
-- operators with their schema).
--
-- The operations run as their owner (SECURITY DEFINER): workers need EXECUTE, no privilege on the
-- tables. Functions for operators, and internal helpers, are revoked from PUBLIC beside them.
--
-- Every trigger of the package's tables fires ALWAYS (ALTER TABLE ... ENABLE ALWAYS TRIGGER), also
-- under session_replication_role = replica, which PostgreSQL 15+ lets any role be granted SET on:
-- a role so granted meets every rule as in origin mode. (The fenced tables' triggers, which users'
-- migrations install, fire ALWAYS too, and let a trusted replication apply through:
-- pg_lease_replication_apply.)
--
-- Changing this file: docs/architecture.md ("Changing the SQL"). A change ships as a migration
-- that restates each object it changes whole, in its own file under sql/migrations/;
-- tests/test_sql_source.py checks that the migrations and this file build the same catalog.

-- ================================================================================================
-- Tables
-- ================================================================================================

-- One row per key, never deleted while it could matter (see pg_lease_forbid_delete): the epoch is
-- the fencing token and must keep growing. Renewals rewrite expires_at on every heartbeat: free
-- room on each page (fillfactor 60) and no index on owner, epoch or expires_at keep them HOT
-- updates (no index touched, no bloat). `recorded` says the key's history is recorded: the
-- database keeps it (see pg_lease_rescope), so the history triggers can test it in their WHEN
-- clauses, without entering PL/pgSQL. The columns and constraints are the Lease model's.
CREATE TABLE @extschema@."pg_lease_django_lease" (
  "key" text NOT NULL PRIMARY KEY,
  "owner" text NULL,
  "epoch" bigint NOT NULL,
  "acquired_at" timestamp with time zone NULL,
  "expires_at" timestamp with time zone NULL,
  "released_at" timestamp with time zone NULL,
  "handoff_requested_at" timestamp with time zone NULL,
  "recorded" boolean DEFAULT false NOT NULL,
  CONSTRAINT "pg_lease_key_length" CHECK (octet_length("key") BETWEEN 1 AND 255),
  CONSTRAINT "pg_lease_owner_length" CHECK (("owner" IS NULL OR octet_length("owner") BETWEEN 1 AND 255)),
  CONSTRAINT "pg_lease_epoch_non_negative" CHECK ("epoch" >= 0),
  CONSTRAINT "pg_lease_held_fields_together" CHECK (
    (("acquired_at" IS NULL AND "expires_at" IS NULL AND "owner" IS NULL)
     OR ("acquired_at" IS NOT NULL AND "expires_at" IS NOT NULL AND "owner" IS NOT NULL)))
) WITH (fillfactor = 60);
-- Django's index for LIKE 'prefix%' on a text primary key (key__startswith, the history scope).
CREATE INDEX "pg_lease_django_lease_key_bb513f7d_like" ON @extschema@."pg_lease_django_lease" ("key" text_pattern_ops);

-- The epoch floor: the highest epoch of any lease row ever pruned (one row, which only grows). A
-- key without a row starts above it, so a key that comes back starts above every epoch it had.
CREATE TABLE @extschema@."pg_lease_django_epoch_floor" (
  one boolean PRIMARY KEY DEFAULT true CONSTRAINT pg_lease_epoch_floor_one_row CHECK (one),
  floor bigint NOT NULL CONSTRAINT pg_lease_epoch_floor_non_negative CHECK (floor >= 0)
);
INSERT INTO @extschema@."pg_lease_django_epoch_floor" (one, floor) VALUES (true, 0);

-- Who waits for which key, and until when: a release notifies only when someone waits (NOTIFY
-- serialises commits; see pg_lease_acquire_or_register). UNLOGGED: a registration writes no WAL;
-- after a crash the rows are gone and waiters wake at the holder's expiry or their poll interval,
-- as when a notification is lost. Written only by the functions, which run as their owner.
CREATE UNLOGGED TABLE @extschema@."pg_lease_django_waiter" (
  key text CONSTRAINT pg_lease_django_waiter_pkey PRIMARY KEY,
  until timestamptz NOT NULL
);
REVOKE ALL ON @extschema@."pg_lease_django_waiter" FROM PUBLIC;

-- The key prefixes whose tenures are recorded ('' records every key); migrate copies PG_LEASE_HISTORY here.
CREATE TABLE @extschema@."pg_lease_django_history_scope" (
  prefix text CONSTRAINT pg_lease_django_history_scope_pkey PRIMARY KEY
              CONSTRAINT pg_lease_history_prefix_length CHECK (octet_length(prefix) <= 255)
);

-- Every tenure of a recorded key, written by the lease table's triggers in the statement that
-- grants or ends it, whoever sends it. The LeaseTenure model's table, as Django would create it.
-- ended_by names the lease owner (or operator) that ended a tenure; ended_by_role the database
-- role (session_user) that sent the statement.
CREATE TABLE @extschema@."pg_lease_django_tenure" (
  "id" bigint NOT NULL PRIMARY KEY GENERATED BY DEFAULT AS IDENTITY,
  "key" text NOT NULL,
  "epoch" bigint NOT NULL,
  "owner" text NOT NULL,
  "granted_at" timestamp with time zone NOT NULL,
  "ended_at" timestamp with time zone NULL,
  "end_reason" text NULL,
  "ended_by" text NULL,
  "ended_by_role" text NULL
);
CREATE INDEX "pg_lease_tenure_key_epoch" ON @extschema@."pg_lease_django_tenure" ("key", "epoch");

-- A random secret only the owner reads: what makes an opt-out of fencing (pg_lease_allow_unfenced)
-- a token no role can forge by setting pg_lease.unfenced by hand. One row, made at installation.
CREATE TABLE @extschema@."pg_lease_django_secret" (
  one boolean PRIMARY KEY DEFAULT true CHECK (one),
  secret text NOT NULL
);
REVOKE ALL ON @extschema@."pg_lease_django_secret" FROM PUBLIC;
INSERT INTO @extschema@."pg_lease_django_secret" (secret)
  VALUES (pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
    pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, 'UTF8')), 'hex'));

-- The key prefixes a database role may use (PG_LEASE_KEY_SCOPES, copied here by `migrate` and
-- `manage.py leases grant`; prefix '' spans every key). Once it holds any row, a session may name
-- only keys under the prefixes of the roles its login role (session_user; SET ROLE does not change
-- it) is a member of, directly or through groups, as PostgreSQL's own privileges are inherited; a
-- session with none is refused (fail closed). The lease functions' owner and superusers span every
-- key. What pg_lease_check_key_scope runs is compiled from these rows (pg_lease_compile_key_scope).
CREATE TABLE @extschema@."pg_lease_django_key_scope" (
  role name NOT NULL,
  prefix text NOT NULL,
  CONSTRAINT pg_lease_django_key_scope_pkey PRIMARY KEY (role, prefix)
);
REVOKE ALL ON @extschema@."pg_lease_django_key_scope" FROM PUBLIC;

-- Per-role limits (PG_LEASE_ROLE_LIMITS, copied here like the scopes): the lease rows under a
-- role's key prefixes (a brand-new key is refused, SQLSTATE 53400, when they are max_leases
-- already), and the tenures kept per recorded key of those prefixes (the oldest go as new ones
-- come). So one tenant's rows stay below max_leases x (1 + max_tenures_per_key).
CREATE TABLE @extschema@."pg_lease_django_role_limit" (
  role name CONSTRAINT pg_lease_django_role_limit_pkey PRIMARY KEY,
  max_leases integer NULL CONSTRAINT pg_lease_role_limit_leases_positive CHECK (max_leases > 0),
  max_tenures_per_key integer NULL CONSTRAINT pg_lease_role_limit_tenures_positive CHECK (max_tenures_per_key > 0)
);
REVOKE ALL ON @extschema@."pg_lease_django_role_limit" FROM PUBLIC;

-- How the metrics label a key (PG_LEASE_METRICS_KEY_LABEL's separator and PG_LEASE_METRICS_MAX_LABELS,
-- copied here like the scopes by `migrate` and `manage.py leases grant`): one row. The owner's
-- settings decide it and the database holds it, so that pg_lease_metrics takes no rule from its
-- caller: a monitor choosing the separator and the cap could read keys back a character at a time.
CREATE TABLE @extschema@."pg_lease_django_metrics_rule" (
  id boolean CONSTRAINT pg_lease_django_metrics_rule_pkey PRIMARY KEY DEFAULT true CONSTRAINT pg_lease_metrics_rule_one CHECK (id),
  separator text NOT NULL CONSTRAINT pg_lease_metrics_rule_separator CHECK (length(separator) = 1),
  max_labels integer NOT NULL CONSTRAINT pg_lease_metrics_rule_cap CHECK (max_labels > 0)
);
INSERT INTO @extschema@."pg_lease_django_metrics_rule" (separator, max_labels) VALUES (':', 16);
REVOKE ALL ON @extschema@."pg_lease_django_metrics_rule" FROM PUBLIC;

-- Row-level security on the tables that say who may do what, and on the secret: the owner (which
-- the lease functions run as) and superusers bypass it; everyone else reads the scopes and limits
-- only with a SELECT grant, and writes none of them, whatever they were granted, pg_write_all_data
-- included. The secret has no policy at all: a pg_read_all_data member reads no row of it, so it
-- cannot mint an opt-out (only a role with BYPASSRLS could; check W008 reports such roles).
ALTER TABLE @extschema@."pg_lease_django_secret" ENABLE ROW LEVEL SECURITY;
ALTER TABLE @extschema@."pg_lease_django_key_scope" ENABLE ROW LEVEL SECURITY;
CREATE POLICY pg_lease_read ON @extschema@."pg_lease_django_key_scope" FOR SELECT USING (true);
ALTER TABLE @extschema@."pg_lease_django_role_limit" ENABLE ROW LEVEL SECURITY;
CREATE POLICY pg_lease_read ON @extschema@."pg_lease_django_role_limit" FOR SELECT USING (true);

-- ================================================================================================
-- The rules every operation uses
-- ================================================================================================

-- Status of a lease row at a given server instant: the one rule every operation uses.
-- A lease is lapsed at its expires_at exactly (not a microsecond later).
-- No SET search_path here or in pg_lease_verdict: it would stop PostgreSQL from inlining these
-- hot helpers (~20 us a call). They touch no table and name only pg_catalog built-ins, which
-- are searched first whatever the caller's search_path.
CREATE FUNCTION @extschema@.pg_lease_status(p_owner text, p_expires_at timestamptz, p_now timestamptz)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT CASE WHEN p_owner IS NULL THEN 'free'
              WHEN p_expires_at > p_now THEN 'held'
              ELSE 'lapsed' END
$$;

-- Input rules, SQLSTATE 22023 (invalid_parameter_value); the Python side checks the same first
-- (tests/test_validation.py holds both to the same limits). The operations test their inputs with
-- one inline condition and call these only to raise: each error is written here, once.
CREATE FUNCTION @extschema@.pg_lease_check_name(p_kind text, p_value text)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF p_value IS NULL OR p_value = '' THEN
    RAISE EXCEPTION 'invalid_input: % must not be empty', p_kind USING ERRCODE = '22023';
  END IF;
  IF octet_length(p_value) > 255 THEN
    RAISE EXCEPTION 'invalid_input: % is % bytes long; the limit is 255', p_kind, octet_length(p_value)
      USING ERRCODE = '22023';
  END IF;
END $$;

CREATE FUNCTION @extschema@.pg_lease_check_ttl(p_ttl interval)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  PERFORM @extschema@.pg_lease_ttl(p_ttl);
END $$;

CREATE FUNCTION @extschema@.pg_lease_check_epoch(p_epoch bigint)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF p_epoch IS NULL OR p_epoch < 1 THEN
    RAISE EXCEPTION 'invalid_input: epoch must be a positive integer, got %', p_epoch
      USING ERRCODE = '22023';
  END IF;
END $$;

-- Whether the session may use p_key, by its key scope (pg_lease_django_key_scope). Its body is
-- compiled from the scope table by pg_lease_compile_key_scope (below), run by that table's trigger
-- in the transaction that changes it: no table is read per call, and no session can change what it
-- runs (the owner's function). Without scopes it is `true`. With scopes, a key passes when it is
-- under a prefix of a role the session's login role is a member of (pg_has_role ... 'MEMBER',
-- evaluated per call: a membership granted or revoked counts at once; a role dropped or renamed
-- matches nothing), or when the session is the functions' owner (current_user inside them) or a
-- member of it, superusers included. Anything else is refused: a session with no effective scope
-- cannot use any key. A one-expression SQL function with no SET clause, so the planner inlines it
-- into the lease functions' own conditions (a constant without scopes), and the plans that inlined
-- it are invalidated when it is replaced; it names every function and operator with its schema.
-- Only the lease functions call it (revoked from PUBLIC), under their pinned search_path.
CREATE FUNCTION @extschema@.pg_lease_key_allowed(p_key text)
RETURNS boolean LANGUAGE sql STABLE
AS $$ SELECT true $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_key_allowed(text) FROM PUBLIC;

-- Refuse a key outside the session's key scope (pg_lease_key_allowed), SQLSTATE 42501. The lease
-- functions test pg_lease_key_allowed in their input condition and call this only when it fails
-- (after the input checks: a bad key is invalid_input whoever sends it).
CREATE FUNCTION @extschema@.pg_lease_check_key_scope(p_key text)
RETURNS void LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    RAISE EXCEPTION 'key_scope: role % may not use lease key %', session_user,
                    left(p_key, 64) || CASE WHEN length(p_key) > 64 THEN '...' ELSE '' END
      USING ERRCODE = '42501',
            HINT = 'PG_LEASE_KEY_SCOPES limits every role to the keys under the prefixes of the roles it is a member of.';
  END IF;
END $$;

-- The body of pg_lease_key_allowed for the scope table's rows (one condition per row, tested
-- prefix first so that only the rows whose prefix matches look at memberships). Owner-run: only
-- the owner may replace the function, and RLS keeps every other role from writing the table.
-- It must compile the table as committed, or a narrowing committed meanwhile is undone: so one
-- compilation at a time (SHARE UPDATE EXCLUSIVE conflicts with itself, not with the writers' own
-- ROW EXCLUSIVE; a role without a write privilege on the table cannot take it), each reading the
-- table once it holds the lock, which only READ COMMITTED does (a REPEATABLE READ or SERIALIZABLE
-- transaction reads as of its start, so a scope change there is refused, 0A000).
CREATE FUNCTION @extschema@.pg_lease_compile_key_scope()
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  conditions text;
BEGIN
  IF pg_catalog.current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
    RAISE EXCEPTION 'key scopes change only in a READ COMMITTED transaction (this one is %)',
                    pg_catalog.current_setting('transaction_isolation')
      USING ERRCODE = 'feature_not_supported',
            HINT = 'A transaction that reads as of its start could compile the scope from rows another has changed since; change the scope table in READ COMMITTED (manage.py leases grant does).';
  END IF;
  LOCK TABLE @extschema@."pg_lease_django_key_scope" IN SHARE UPDATE EXCLUSIVE MODE;
  SELECT string_agg(
           format('(%s pg_catalog.pg_has_role(session_user, pg_catalog.to_regrole(%L), ''MEMBER''))',
                  CASE WHEN s.prefix = '' THEN ''
                       ELSE format('pg_catalog.left(p_key, %s) OPERATOR(pg_catalog.=) %L AND', length(s.prefix), s.prefix) END,
                  quote_ident(s.role)),
           E'\n    OR ' ORDER BY s.role, s.prefix)
    INTO conditions FROM @extschema@."pg_lease_django_key_scope" s;
  EXECUTE format('CREATE OR REPLACE FUNCTION @extschema@.pg_lease_key_allowed(p_key text) '
                 'RETURNS boolean LANGUAGE sql STABLE AS %L',
                 CASE WHEN conditions IS NULL THEN ' SELECT true '
                      ELSE format(E'\n  SELECT %s\n    OR pg_catalog.pg_has_role(session_user, current_user, ''MEMBER'')\n', conditions) END);
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_compile_key_scope() FROM PUBLIC;

-- Any change of the scope table recompiles the check, in the same transaction, whoever makes it.
CREATE FUNCTION @extschema@.pg_lease_key_scope_changed()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  PERFORM @extschema@.pg_lease_compile_key_scope();
  RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_key_scope_changed() FROM PUBLIC;

CREATE TRIGGER pg_lease_key_scope_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
  ON @extschema@."pg_lease_django_key_scope"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_key_scope_changed();
ALTER TABLE @extschema@."pg_lease_django_key_scope" ENABLE ALWAYS TRIGGER pg_lease_key_scope_changed;

-- The key prefixes this session may use, by the rule pg_lease_check_key_scope applies: NULL for
-- every key (no scope configured, the owner, a superuser, a role spanning every key), an empty
-- array for none. For readiness probes and for a role asking why it was refused; it reveals only
-- the session's own scope.
CREATE FUNCTION @extschema@.pg_lease_session_scope()
RETURNS text[] LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  WITH mine AS (SELECT s.prefix FROM @extschema@."pg_lease_django_key_scope" s
                 WHERE pg_has_role(session_user, to_regrole(quote_ident(s.role)), 'MEMBER'))
  SELECT CASE WHEN NOT EXISTS (SELECT FROM @extschema@."pg_lease_django_key_scope")
                   OR pg_has_role(session_user, current_user, 'MEMBER')
                   OR EXISTS (SELECT FROM mine WHERE mine.prefix = '') THEN NULL
              ELSE ARRAY(SELECT DISTINCT mine.prefix FROM mine ORDER BY 1) END
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_key_scope(text) FROM PUBLIC;

-- TTL check and normalisation: refuse month parts (a month has no fixed length) and return the
-- TTL as exact seconds, so now + ttl never depends on the calendar or the session's time zone.
CREATE FUNCTION @extschema@.pg_lease_ttl(p_ttl interval)
RETURNS interval LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  seconds numeric;
BEGIN
  IF p_ttl IS NULL THEN
    RAISE EXCEPTION 'invalid_input: ttl must not be NULL' USING ERRCODE = '22023';
  END IF;
  IF extract(year FROM p_ttl) <> 0 OR extract(month FROM p_ttl) <> 0 THEN
    RAISE EXCEPTION 'invalid_input: ttl must not have a month or year part, got %', p_ttl
      USING ERRCODE = '22023', HINT = 'Give the TTL in days, hours, minutes or seconds.';
  END IF;
  seconds := extract(epoch FROM p_ttl);
  IF seconds < 0.001 OR seconds > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: ttl must be between 0.001 s and 365 days, got % s', seconds
      USING ERRCODE = '22023';
  END IF;
  RETURN make_interval(secs => seconds::double precision);
END $$;

-- Renew/release verdict, in the spec's precedence: holder, then lapse, then epoch.
-- Written so that any NULL argument yields a refusal, never 'ok'.
CREATE FUNCTION @extschema@.pg_lease_verdict(
  p_row_owner text, p_row_epoch bigint, p_row_expires_at timestamptz,
  p_owner text, p_epoch bigint, p_now timestamptz)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT CASE
    WHEN p_owner IS NULL OR p_row_owner IS DISTINCT FROM p_owner THEN 'not_owner'
    WHEN @extschema@.pg_lease_status(p_row_owner, p_row_expires_at, p_now) <> 'held' THEN 'lapsed'
    WHEN p_epoch IS NULL OR p_row_epoch IS DISTINCT FROM p_epoch THEN 'epoch_mismatch'
    ELSE 'ok' END
$$;

-- PG_LEASE_ROLE_LIMITS' max_leases, for a brand-new key (acquire's insert path, whoever calls):
-- refused with SQLSTATE 53400 (configuration_limit_exceeded) when a limited role's prefixes hold the
-- key and max_leases lease rows already. Counted through the key index (LIKE 'prefix%' on
-- text_pattern_ops), in one statement per limited role (overlapping prefixes count a row once). Free
-- rows count until `manage.py leases prune` deletes them. Called only on the way to a brand-new row.
-- * One count at a time per limited role: each locks its role's row of the limits table (FOR NO KEY
--   UPDATE, until its transaction ends) before counting. Row-level security lets no other role lock
--   that row (a locking SELECT needs an UPDATE policy, and there is none), so only the lease
--   functions take this lock; an advisory lock on a computable number could be taken by anyone.
-- * The count must see every grant committed before the lock was granted: only READ COMMITTED reads
--   a new snapshot per statement. A REPEATABLE READ or SERIALIZABLE transaction (or one that imported
--   a snapshot) counts as of its start, however it serialises, so a limited role's brand-new key is
--   refused there (0A000), as a key-scope change is; existing keys, and unlimited prefixes, are not.
--   (A counter row would conflict instead, but every prune, scope and limit change would have to
--   keep it exact; the refusal costs nothing and says what to do.)
-- * The lock wait is bounded by the caller's lock_timeout, which a waiter sets to its deadline
--   (pg_lease_acquire_or_register, pg_lease_acquire_within, and the SQL wait of
--   pg_lease_acquire(..., p_wait)).
CREATE FUNCTION @extschema@.pg_lease_check_lease_quota(p_key text)
RETURNS void LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  lim record;
  used bigint;
BEGIN
  FOR lim IN SELECT l.role, l.max_leases,
                    string_agg(format('l.key LIKE %L', replace(replace(replace(s.prefix, '\', '\\'), '%', '\%'), '_', '\_') || '%'),
                               ' OR ') AS condition
               FROM @extschema@."pg_lease_django_role_limit" l
               JOIN @extschema@."pg_lease_django_key_scope" s ON s.role = l.role
              WHERE l.max_leases IS NOT NULL
              GROUP BY l.role, l.max_leases
             HAVING bool_or(left(p_key, length(s.prefix)) = s.prefix)
              ORDER BY l.role LOOP
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
      RAISE EXCEPTION 'quota: a brand-new lease key under the limits of role % is made only in a READ COMMITTED transaction (this one is %)',
                      lim.role, current_setting('transaction_isolation')
        USING ERRCODE = 'feature_not_supported',
              HINT = 'A transaction that reads as of its start cannot count what PG_LEASE_ROLE_LIMITS allows; acquire new keys in READ COMMITTED (existing keys work at any level).';
    END IF;
    PERFORM 1 FROM @extschema@."pg_lease_django_role_limit" l WHERE l.role = lim.role FOR NO KEY UPDATE;
    EXECUTE format('SELECT count(*) FROM @extschema@."pg_lease_django_lease" l WHERE %s', lim.condition) INTO used;
    IF used >= lim.max_leases THEN
      RAISE EXCEPTION 'quota: role % may keep % lease rows under its key prefixes, and has % (lease key %)',
                      lim.role, lim.max_leases, used,
                      left(p_key, 64) || CASE WHEN length(p_key) > 64 THEN '...' ELSE '' END
        USING ERRCODE = '53400',
              HINT = 'Release and prune leases no longer used (manage.py leases prune), or raise PG_LEASE_ROLE_LIMITS.';
    END IF;
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_lease_quota(text) FROM PUBLIC;

-- ================================================================================================
-- Waiters
-- ================================================================================================

-- The advisory lock a registration and a release of the key meet on (64 bits of the key's hash, seeded:
-- a collision with another key or another application's lock only costs a spurious notification).
-- No SET clause (inlined); names only an exact-typed built-in.
CREATE FUNCTION @extschema@.pg_lease_waiter_lock(p_key text)
RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.hashtextextended(p_key, 4187349731::bigint) $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_waiter_lock(text) FROM PUBLIC;

-- Called by release and force release once the lease is free: notify only if someone waits. Never
-- waits itself, so no waiter (nor a role holding the same advisory lock) can hold up a release.
-- A registration and a release meet on pg_lease_waiter_lock's transaction-level advisory lock: a
-- registering attempt holds it shared until its transaction ends; a release tries it here. Either
-- the release gets it, and every registration made before is committed and visible, and every later
-- one waits for this commit and then finds the lease free; or it does not, and it notifies blind.
-- No SET clause: called on every release, only by the lease functions (revoked from PUBLIC), under
-- their own pinned search_path; it names only built-ins and the waiter table.
CREATE FUNCTION @extschema@.pg_lease_wake_waiters(p_key text)
RETURNS void LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
  last_until timestamptz;
BEGIN
  IF NOT pg_try_advisory_xact_lock(@extschema@.pg_lease_waiter_lock(p_key)) THEN
    -- A registration is in flight: it is not visible yet, so notify without looking.
    PERFORM pg_notify('pg_lease_django', p_key);
    RETURN;
  END IF;
  -- Every registration made before is committed and seen by this statement; a later one waits for
  -- this transaction and then finds the lease free. Every waiter is woken, so the rows go (a waiter
  -- still refused registers again); an expired row goes without a notification. One row at most: the
  -- key is the waiter table's primary key.
  DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.key = p_key RETURNING w.until INTO last_until;
  IF last_until > clock_timestamp() THEN
    PERFORM pg_notify('pg_lease_django', p_key);
  END IF;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_wake_waiters(text) FROM PUBLIC;

-- ================================================================================================
-- The four operations
-- ================================================================================================

-- The rows the operations return, as named types: PostgreSQL reads a named type's columns from its
-- type cache, where it builds a RETURNS TABLE's from the function's argument arrays on every call.
CREATE TYPE @extschema@.pg_lease_attempt AS (
  granted boolean, key text, owner text, epoch bigint, expires_at timestamptz, server_time timestamptz);
CREATE TYPE @extschema@.pg_lease_renewal AS (
  outcome text, expires_at timestamptz, server_time timestamptz, handoff_requested boolean);
CREATE TYPE @extschema@.pg_lease_release_outcome AS (outcome text, epoch bigint, server_time timestamptz);
CREATE TYPE @extschema@.pg_lease_state AS (
  key text, status text, owner text, epoch bigint, expires_at timestamptz, acquired_at timestamptz,
  server_time timestamptz);

-- Acquire (non-blocking). Granted when the key is free, lapsed, or held by this same owner
-- (self-takeover: a new epoch, so the owner's earlier incarnation is fenced). A key without a row
-- starts above the epoch floor.
-- * It looks without locking first: refusing a held key takes no row lock and writes no WAL, so
--   waiters polling a held key never slow down its holder's renewals. The input checks and the key
--   scope are one inline condition; the TTL is converted and durability asked for only on the way
--   to a grant.
-- * The attempt on an existing row is one UPDATE in a subtransaction, rolled back when the row was
--   taken meanwhile: rolling back a subtransaction is the only way to drop a row lock before the
--   transaction ends, so a refused waiter never keeps the winner from renewing.
-- * That UPDATE names the key column, so it locks FOR UPDATE, the one mode that conflicts with a
--   fence's FOR KEY SHARE: a takeover waits for every fenced transaction of the old holder to end.
-- * It marks its grant (acquired_at = -infinity) and hands the TTL over as released_at = the Unix
--   epoch + TTL; pg_lease_guard_update stamps it with one clock read taken under the row lock, after
--   any wait: expiry = server_now + TTL exactly. (The SET list is computed before the wait, and two
--   clock_timestamp() calls differ.) It leaves expires_at out of its SET list, so the renewal rule
--   (pg_lease_judge_renewal) is not even looked at.
-- * Durability: an acknowledged grant must survive a crash, or the same epoch could be granted
--   twice; synchronous_commit is raised to 'on' for this transaction when it is lower.
CREATE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  now_at timestamptz;
  ttl interval;
  first_epoch bigint;
  result @extschema@.pg_lease_attempt;
BEGIN
  -- The rules of pg_lease_check_name and pg_lease_ttl, and the key scope, as one condition;
  -- they raise when it fails. Input first, then the key scope: a bad key is invalid_input whoever
  -- sends it. A key or an owner is any non-empty text (PostgreSQL's text holds no NUL): what a
  -- person reads of it is escaped where it is shown (pg_lease_django.display), not refused here.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400
     OR NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    ttl := @extschema@.pg_lease_ttl(p_ttl);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;

  LOOP  -- again when the row changed between the unlocked look and the UPDATE
    -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF NOT FOUND THEN
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      ttl := @extschema@.pg_lease_ttl(p_ttl);
      PERFORM @extschema@.pg_lease_check_lease_quota(p_key);  -- a new row: within PG_LEASE_ROLE_LIMITS
      -- Start above the floor. FOR SHARE waits for a prune in flight and keeps the next one (which
      -- locks the floor first) from committing until this grant does: no pruned epoch can slip in
      -- above the one read here. In a subtransaction, dropped with its lock when a concurrent
      -- acquire inserted the key first (only brand-new keys take this lock, and only a grant keeps it).
      BEGIN
        SELECT f.floor + 1 INTO first_epoch FROM @extschema@."pg_lease_django_epoch_floor" f FOR SHARE;
        now_at := clock_timestamp();
        INSERT INTO @extschema@."pg_lease_django_lease" AS l (key, owner, epoch, acquired_at, expires_at)
          VALUES (p_key, p_owner, first_epoch, now_at, now_at + ttl)
          ON CONFLICT ON CONSTRAINT pg_lease_django_lease_pkey DO NOTHING;
        IF NOT FOUND THEN
          RAISE EXCEPTION USING ERRCODE = 'PLR03';
        END IF;
        result := ROW(true, p_key, p_owner, first_epoch, now_at + ttl, now_at);
        RETURN NEXT result;
        RETURN;
      EXCEPTION WHEN SQLSTATE 'PLR03' THEN
        NULL;  -- a concurrent acquire inserted the key first: decide on its row below
      END;
    ELSIF @extschema@.pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held'
          AND cur.owner <> p_owner THEN
      result := ROW(false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp());
      RETURN NEXT result;
      RETURN;
    END IF;

    -- Acquirable at the look: one UPDATE in a subtransaction, rolled back when it finds the row taken
    -- meanwhile (an UPDATE that waited for the row and then fails its WHERE keeps the row locked; the
    -- rollback drops that lock). key = l.key: lock FOR UPDATE, which waits for the old holder's fenced
    -- transactions (FOR KEY SHARE). acquired_at = -infinity: pg_lease_guard_update stamps the grant
    -- with one clock read taken under the row lock, after any wait; the TTL reaches it as released_at
    -- = the Unix epoch + TTL (exact seconds, as pg_lease_ttl makes it).
    BEGIN
      UPDATE @extschema@."pg_lease_django_lease" l
         SET key = l.key, owner = p_owner, epoch = l.epoch + 1, acquired_at = '-infinity',
             released_at = 'epoch'::timestamptz + make_interval(secs => extract(epoch FROM p_ttl)::double precision)
       WHERE l.key = p_key AND (l.owner IS NULL OR l.owner = p_owner OR l.expires_at <= clock_timestamp())
      RETURNING true, p_key, p_owner, l.epoch, l.expires_at, l.acquired_at INTO result;
      IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PLR01';
      END IF;
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      RETURN NEXT result;
      RETURN;
    EXCEPTION WHEN SQLSTATE 'PLR01' THEN
      NULL;  -- taken (or pruned) since the look: look again
    END;
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval) FROM PUBLIC;

-- Acquire, waiting up to p_wait (NULL: no bound) for the key; SQLSTATE 57014 on timeout.
-- Polls inside one statement, sleeping until the holder's expiry (at most 100 ms at a time), so it
-- keeps a snapshot open while it waits: prefer the client-side wait (Python API) or short bounds
-- from SQL. A refused attempt leaves no row lock (see above): a waiter never slows the holder. Every
-- lock wait of an attempt is bounded by what is left of p_wait (and the caller's lock_timeout):
-- never granted past the deadline.
CREATE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval, p_wait interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt @extschema@.pg_lease_attempt;
  deadline timestamptz;
  saved_lock_timeout text := current_setting('lock_timeout');
  left_ms double precision;
BEGIN
  IF p_wait < interval '0' THEN
    RAISE EXCEPTION 'invalid_input: wait must not be negative, got %', p_wait USING ERRCODE = '22023';
  END IF;
  deadline := clock_timestamp() + p_wait;
  LOOP
    left_ms := greatest(1, ceil(extract(epoch FROM deadline - clock_timestamp()) * 1000));
    IF saved_lock_timeout::interval > interval '0' THEN
      left_ms := least(left_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
    END IF;
    IF deadline IS NOT NULL THEN
      PERFORM set_config('lock_timeout', least(left_ms, 2147483647)::bigint::text, true);
    END IF;
    BEGIN
      SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
    EXCEPTION WHEN lock_not_available THEN
      IF deadline IS NULL THEN
        RAISE;  -- the caller's own lock_timeout, with no deadline of its own
      END IF;
      attempt := ROW(false, p_key, NULL, NULL, clock_timestamp(), clock_timestamp());  -- busy: a refusal
    END;
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    IF attempt.granted THEN
      RETURN NEXT attempt;
      RETURN;
    END IF;
    IF clock_timestamp() >= deadline THEN
      RAISE EXCEPTION 'timeout: lease % still held by % after waiting %', p_key, coalesce(attempt.owner, '(a lock it needs)'), p_wait
        USING ERRCODE = '57014';
    END IF;
    PERFORM pg_sleep(greatest(0.001, extract(epoch FROM
      least(attempt.expires_at, deadline, clock_timestamp() + interval '100 milliseconds')
      - clock_timestamp()))::double precision);
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval, interval) FROM PUBLIC;

-- The attempt of a waiter that polls (behind a transaction pooler, PG_LEASE_LISTEN = False, inside
-- the caller's transaction): pg_lease_acquire(key, owner, ttl), every lock wait of it bounded by
-- p_within, what is left of the waiter's deadline, counted on the server from the call's start (and
-- by the caller's own lock_timeout, when shorter): the lease row a takeover waits for, the limit row
-- of a brand-new key, a concurrent insert of the same key, the epoch floor. A wait that ran out is
-- answered as a refusal that changed nothing (its subtransaction rolled back, with every lock taken
-- in it): naming the key's holder when it is held, none ("busy": a lock it needs was) otherwise,
-- expiring now; the waiter, at its deadline by then, times out. Never granted past the deadline; the
-- caller's transaction, inside atomic(), goes on. p_within NULL: no bound of its own (a waiter with
-- no deadline), as the plain acquire.
CREATE FUNCTION @extschema@.pg_lease_acquire_within(p_key text, p_owner text, p_ttl interval, p_within interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt @extschema@.pg_lease_attempt;
  saved_lock_timeout text;
  wait_ms double precision;
BEGIN
  -- Every input first (22023): the key, owner and TTL are judged by pg_lease_acquire, input before
  -- the key scope, as in every lease function.
  IF extract(year FROM p_within) <> 0 OR extract(month FROM p_within) <> 0
     OR extract(epoch FROM p_within) < 0 OR extract(epoch FROM p_within) > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: within must be between 0 and 365 days, without months, got %',
      p_within USING ERRCODE = '22023';
  END IF;
  IF p_within IS NULL THEN
    RETURN QUERY SELECT * FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl);
    RETURN;
  END IF;
  saved_lock_timeout := current_setting('lock_timeout');
  wait_ms := greatest(1, ceil(extract(epoch FROM p_within) * 1000));  -- 0 would mean no bound at all
  IF saved_lock_timeout::interval > interval '0' THEN
    wait_ms := least(wait_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
  END IF;
  PERFORM set_config('lock_timeout', least(wait_ms, 2147483647)::bigint::text, true);
  BEGIN
    SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
  EXCEPTION WHEN lock_not_available THEN
    -- Busy until the deadline: a refusal, naming the holder if the key is held, to time out now.
    attempt := ROW(false, p_key, NULL, NULL, NULL, clock_timestamp());
    SELECT CASE WHEN @extschema@.pg_lease_status(l.owner, l.expires_at, attempt.server_time) = 'held' THEN l.owner END,
           l.epoch
      INTO attempt.owner, attempt.epoch
      FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF attempt.epoch IS NULL THEN
      SELECT f.floor INTO attempt.epoch FROM @extschema@."pg_lease_django_epoch_floor" f;
    END IF;
    attempt.expires_at := attempt.server_time;
  END;
  PERFORM set_config('lock_timeout', saved_lock_timeout, true);
  RETURN NEXT attempt;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_within(text, text, interval, interval) FROM PUBLIC;

-- The attempt of a waiter that LISTENs on pg_lease_django: pg_lease_acquire(key, owner, ttl), and
-- when refused, a registration so that the next release of the key notifies, lasting until the
-- waiter's next attempt is due (p_retry_within, or the holder's expiry if sooner) plus a second.
-- p_retry_within is never past the waiter's deadline, so it bounds every lock wait of the attempt
-- (with the caller's own lock_timeout, when shorter): the waiter lock, the limit row of a brand-new
-- key, the lease row a takeover waits for. An attempt whose lock wait ran out is answered as a
-- refusal naming the key's holder (NULL when nobody holds it: a lock it needs was busy), expiring
-- now: the waiter tries again, or times out at its deadline. Never granted past the deadline.
CREATE FUNCTION @extschema@.pg_lease_acquire_or_register(p_key text, p_owner text, p_ttl interval, p_retry_within interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt @extschema@.pg_lease_attempt;
  -- Whether this transaction wrote anything before this call (then its commit must stay durable).
  wrote_before boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
  saved_lock_timeout text := current_setting('lock_timeout');
  wait_ms double precision;
  locked boolean := false;
BEGIN
  -- Every input first (22023), then the key scope (42501), as in every lease function.
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
  PERFORM @extschema@.pg_lease_ttl(p_ttl);
  IF p_retry_within IS NULL OR extract(year FROM p_retry_within) <> 0 OR extract(month FROM p_retry_within) <> 0
     OR extract(epoch FROM p_retry_within) < 0 OR extract(epoch FROM p_retry_within) > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: retry_within must be between 0 and 365 days, without months, got %',
      p_retry_within USING ERRCODE = '22023';
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  -- A release of this key in flight holds the lock exclusively until it commits: wait for it, then
  -- the attempt finds the lease free. Past the bound, attempt without registering: the table is
  -- written only under the key's lock (registrations shared, a release's deletions exclusive), so
  -- neither ever waits for the other's rows.
  wait_ms := greatest(1, ceil(extract(epoch FROM p_retry_within) * 1000));
  IF saved_lock_timeout::interval > interval '0' THEN
    wait_ms := least(wait_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
  END IF;
  PERFORM set_config('lock_timeout', least(wait_ms, 2147483647)::bigint::text, true);
  BEGIN
    PERFORM pg_advisory_xact_lock_shared(@extschema@.pg_lease_waiter_lock(p_key));
    locked := true;
  EXCEPTION WHEN lock_not_available THEN
    NULL;
  END;

  BEGIN
    SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
  EXCEPTION WHEN lock_not_available THEN
    -- Busy past the bound: a refusal, naming the holder if there is one, to try again now.
    attempt := ROW(false, p_key, NULL, NULL, NULL, clock_timestamp());
    SELECT l.owner, l.epoch INTO attempt.owner, attempt.epoch FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF attempt.epoch IS NULL THEN
      SELECT f.floor INTO attempt.epoch FROM @extschema@."pg_lease_django_epoch_floor" f;
    END IF;
    attempt.expires_at := attempt.server_time;
    locked := false;
  END;
  IF NOT attempt.granted AND locked THEN
    -- A refusal wrote nothing that must survive a crash, and a registration is gone after a crash
    -- anyway: unless the caller's transaction wrote before, its commit need not wait for a flush.
    IF NOT wrote_before THEN
      PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    BEGIN  -- another registration of the key in an open transaction: not waited for past the bound
      INSERT INTO @extschema@."pg_lease_django_waiter" AS w (key, until)
        VALUES (p_key, least(clock_timestamp() + p_retry_within, attempt.expires_at) + interval '1 second')
        ON CONFLICT ON CONSTRAINT pg_lease_django_waiter_pkey DO UPDATE SET until = greatest(w.until, EXCLUDED.until);
    EXCEPTION WHEN lock_not_available THEN
      NULL;  -- that registration notifies this waiter too (one channel, the key as payload)
    END;
  END IF;
  PERFORM set_config('lock_timeout', saved_lock_timeout, true);
  RETURN NEXT attempt;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_or_register(text, text, interval, interval) FROM PUBLIC;

-- Renew (heartbeat): extend a live lease held by (owner, epoch) to server_now + TTL, never changing
-- the epoch, and say whether a hand-off was requested: what the package sends for every renewal.
-- One UPDATE ... WHERE key AND owner AND epoch AND expires_at > clock_timestamp(), judged again
-- under the row lock (pg_lease_judge_renewal); the row is read afterwards only when it found
-- nothing, to name the verdict in the spec's precedence. A refused renewal writes nothing, and locks
-- nothing unless it waited for the row (then the lock lasts until the caller's transaction ends).
-- It sets no key column, so it locks FOR NO KEY UPDATE, which does not conflict with a fence's FOR
-- KEY SHARE: a long fenced transaction never starves its own heartbeat. A renewal that waited on a
-- lock-only locker extends from its clock read before the wait: a little early, never late.
CREATE FUNCTION @extschema@.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS SETOF @extschema@.pg_lease_renewal
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  result @extschema@.pg_lease_renewal;
  cur record;
BEGIN
  -- The rules of pg_lease_check_name, pg_lease_check_epoch and pg_lease_ttl, and the key scope, as
  -- one condition.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_epoch IS NULL OR p_epoch < 1
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400
     OR NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    PERFORM @extschema@.pg_lease_ttl(p_ttl);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;
  LOOP  -- again only if the row turned valid between the UPDATE and the look (it cannot, by the rules)
    -- The TTL in exact seconds, as pg_lease_ttl makes it; the clock read is the new expiry less it.
    UPDATE @extschema@."pg_lease_django_lease" l
       SET expires_at = clock_timestamp() + make_interval(secs => extract(epoch FROM p_ttl)::double precision)
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING 'ok', l.expires_at, l.expires_at - make_interval(secs => extract(epoch FROM p_ttl)::double precision),
              l.handoff_requested_at IS NOT NULL INTO result;
    IF FOUND THEN
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      RETURN NEXT result;
      RETURN;
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    result := ROW(@extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()),
                  NULL, clock_timestamp(), false);
    IF result.outcome <> 'ok' THEN
      RETURN NEXT result;
      RETURN;
    END IF;
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval) FROM PUBLIC;

-- Renew: pg_lease_heartbeat without its hand-off column, for SQL clients, and for processes still
-- running a version before hand-offs during a rolling deploy.
CREATE FUNCTION @extschema@.pg_lease_renew(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT h.outcome, h.expires_at, h.server_time FROM @extschema@.pg_lease_heartbeat(p_key, p_owner, p_epoch, p_ttl) h
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_renew(text, text, bigint, interval) FROM PUBLIC;

-- Release: free a live lease held by (owner, epoch) and bump the epoch, fencing the old holder;
-- wake waiters. One UPDATE as in pg_lease_heartbeat, judged again under the row lock by
-- pg_lease_guard_update, which stamps released_at with the clock it read and clears expires_at (left
-- out of the SET list, so the renewal rule is not even looked at). It sets the key column, so it
-- locks FOR UPDATE and waits for the holder's fenced transactions (FOR KEY SHARE). The waiters are
-- woken as pg_lease_wake_waiters says, written out here (a call costs a statement of its own).
CREATE FUNCTION @extschema@.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
RETURNS SETOF @extschema@.pg_lease_release_outcome
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  result @extschema@.pg_lease_release_outcome;
  cur record;
  last_until timestamptz;
BEGIN
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_epoch IS NULL OR p_epoch < 1
     OR NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;
  LOOP  -- as in pg_lease_heartbeat
    -- key = l.key: lock FOR UPDATE (waits for fenced transactions); -infinity: pg_lease_guard_update
    -- judges it again under the lock and stamps the clock it read.
    UPDATE @extschema@."pg_lease_django_lease" l
       SET key = l.key, owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, released_at = '-infinity'
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING 'ok', l.epoch, l.released_at INTO result;
    IF FOUND THEN
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      -- pg_lease_wake_waiters, inline.
      IF pg_try_advisory_xact_lock(@extschema@.pg_lease_waiter_lock(p_key)) THEN
        DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.key = p_key RETURNING w.until INTO last_until;
        IF last_until > clock_timestamp() THEN
          PERFORM pg_notify('pg_lease_django', p_key);
        END IF;
      ELSE
        PERFORM pg_notify('pg_lease_django', p_key);
      END IF;
      RETURN NEXT result;
      RETURN;
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    result := ROW(@extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()),
                  cur.epoch, clock_timestamp());
    IF result.outcome <> 'ok' THEN
      RETURN NEXT result;
      RETURN;
    END IF;
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_release(text, text, bigint) FROM PUBLIC;

-- Inspect: the state at the server clock (lazy expiry: a lapsed row is reported 'lapsed'). A key
-- without a row is free at the epoch floor's epoch (0 until something is pruned).
CREATE FUNCTION @extschema@.pg_lease_inspect(p_key text)
RETURNS SETOF @extschema@.pg_lease_state
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  now_at timestamptz;
BEGIN
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;
  now_at := clock_timestamp();
  RETURN QUERY
    SELECT p_key, @extschema@.pg_lease_status(l.owner, l.expires_at, now_at), l.owner, l.epoch, l.expires_at,
           l.acquired_at, now_at
      FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
  IF NOT FOUND THEN  -- never acquired, or pruned: free, at the floor's epoch
    RETURN QUERY SELECT p_key, 'free'::text, NULL::text, f.floor, NULL::timestamptz, NULL::timestamptz, now_at
                   FROM @extschema@."pg_lease_django_epoch_floor" f;
  END IF;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_inspect(text) FROM PUBLIC;

-- Ask the holder of p_key (at p_epoch, when given) to step down at its next renewal. Advice only:
-- the grant is unchanged. Outcome 'ok' (requested now, or already), or why nobody can be asked:
-- 'not_found', 'free', 'lapsed', 'epoch_mismatch'. Locks like a renewal (FOR NO KEY UPDATE).
CREATE FUNCTION @extschema@.pg_lease_request_handoff(p_key text, p_epoch bigint DEFAULT NULL)
RETURNS TABLE (outcome text, owner text, epoch bigint, expires_at timestamptz,
               requested_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_epoch IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at, l.handoff_requested_at INTO cur
    FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR NO KEY UPDATE;
  now_at := clock_timestamp();
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f), NULL::timestamptz,
                        NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF @extschema@.pg_lease_status(cur.owner, cur.expires_at, now_at) <> 'held' THEN
    RETURN QUERY SELECT @extschema@.pg_lease_status(cur.owner, cur.expires_at, now_at), cur.owner, cur.epoch,
                        cur.expires_at, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF p_epoch IS NOT NULL AND cur.epoch <> p_epoch THEN
    RETURN QUERY SELECT 'epoch_mismatch'::text, cur.owner, cur.epoch, cur.expires_at, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF cur.handoff_requested_at IS NULL THEN
    UPDATE @extschema@."pg_lease_django_lease" l SET handoff_requested_at = now_at WHERE l.key = p_key;
  END IF;
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch, cur.expires_at,
                      coalesce(cur.handoff_requested_at, now_at), now_at;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_request_handoff(text, bigint) FROM PUBLIC;

-- ================================================================================================
-- Operators
-- ================================================================================================

-- Force release: free a held or lapsed lease and bump its epoch, fencing whoever held it; for a
-- human or a script breaking a stuck lease, never for workers. p_expected_epoch (NULL: any) makes
-- it conditional: refused with 'epoch_mismatch' when the lease moved on since the operator looked.
-- p_operator (NULL: the database role) is recorded in the history. Outcomes, in this order:
--   'not_found'      no row: the key was never acquired (epoch = the floor's)
--   'free'           nothing to release (epoch = the current one)
--   'epoch_mismatch' p_expected_epoch is not the current epoch (epoch = the current one)
--   'ok'             released; owner = the former holder, epoch = the new epoch
-- Locks FOR UPDATE like release. Operators only: revoked from PUBLIC.
CREATE FUNCTION @extschema@.pg_lease_force_release(p_key text, p_expected_epoch bigint, p_operator text)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_expected_epoch IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_epoch(p_expected_epoch);
  END IF;
  IF p_operator IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_name('operator', p_operator);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f), clock_timestamp();
    RETURN;
  END IF;
  IF cur.owner IS NULL THEN
    RETURN QUERY SELECT 'free'::text, NULL::text, cur.epoch, clock_timestamp();
    RETURN;
  END IF;
  IF p_expected_epoch IS NOT NULL AND cur.epoch <> p_expected_epoch THEN
    RETURN QUERY SELECT 'epoch_mismatch'::text, cur.owner, cur.epoch, clock_timestamp();
    RETURN;
  END IF;
  UPDATE @extschema@."pg_lease_django_lease" l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                   released_at = clock_timestamp()
   WHERE l.key = p_key;
  -- The history trigger recorded a release (or a lapse); say who forced it. Only this function can:
  -- nothing a caller sets makes the trigger record a force release.
  UPDATE @extschema@."pg_lease_django_tenure" r SET end_reason = CASE WHEN r.end_reason = 'lapsed' THEN 'lapsed' ELSE 'force_released' END,
                   ended_by = coalesce(p_operator, session_user::text)
   WHERE r.key = p_key AND r.epoch = cur.epoch AND r.ended_at IS NOT NULL;
  PERFORM @extschema@.pg_lease_wake_waiters(p_key);
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch + 1, clock_timestamp();
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_force_release(text, bigint, text) FROM PUBLIC;

-- Force release, recording the database role as the operator (see the three-argument form).
CREATE FUNCTION @extschema@.pg_lease_force_release(p_key text, p_expected_epoch bigint)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT * FROM @extschema@.pg_lease_force_release(p_key, p_expected_epoch, NULL::text)
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_force_release(text, bigint) FROM PUBLIC;

-- Prune: delete the rows of leases free (released, or lapsed) for at least p_free_for, raising the
-- floor to their highest epoch first, in this transaction, and the expired waiters' registrations.
-- Rows locked right now are skipped. With p_dry_run, only lists what would go. Operators only: revoked from PUBLIC.
CREATE FUNCTION @extschema@.pg_lease_prune(p_free_for interval, p_dry_run boolean DEFAULT false)
RETURNS TABLE (key text, epoch bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cutoff timestamptz;
  doomed text[];
  top bigint;
BEGIN
  IF p_free_for IS NULL OR extract(year FROM p_free_for) <> 0 OR extract(month FROM p_free_for) <> 0
     OR extract(epoch FROM p_free_for) < 0 THEN
    RAISE EXCEPTION 'invalid_input: free_for must be a non-negative duration without months, got %', p_free_for
      USING ERRCODE = '22023';
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  cutoff := clock_timestamp() - make_interval(secs => extract(epoch FROM p_free_for)::double precision);
  IF p_dry_run THEN
    RETURN QUERY SELECT l.key, l.epoch FROM @extschema@."pg_lease_django_lease" l
      WHERE (l.owner IS NULL AND l.released_at <= cutoff) OR (l.owner IS NOT NULL AND l.expires_at <= cutoff)
      ORDER BY l.key;
    RETURN;
  END IF;
  -- Expired waiters' registrations go too (a takeover after expiry sends no release to remove
  -- them): the waiter table holds no more than the registrations live since the last prune.
  DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.until < clock_timestamp();
  -- The floor first, then the rows: the order acquire's insert path takes them in (no deadlock).
  PERFORM 1 FROM @extschema@."pg_lease_django_epoch_floor" f FOR UPDATE;
  SELECT array_agg(d.key), max(d.epoch) INTO doomed, top
    FROM (SELECT l.key, l.epoch FROM @extschema@."pg_lease_django_lease" l
           WHERE (l.owner IS NULL AND l.released_at <= cutoff) OR (l.owner IS NOT NULL AND l.expires_at <= cutoff)
           FOR UPDATE SKIP LOCKED) d;
  IF doomed IS NULL THEN
    RETURN;
  END IF;
  UPDATE @extschema@."pg_lease_django_epoch_floor" f SET floor = greatest(f.floor, top);
  RETURN QUERY DELETE FROM @extschema@."pg_lease_django_lease" l WHERE l.key = ANY (doomed) RETURNING l.key, l.epoch;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_prune(interval, boolean) FROM PUBLIC;

-- Advance every epoch and the floor by p_by, in one transaction. The floor is locked first, then
-- every row (FOR UPDATE: waits for acquires, renewals, releases and fenced writes in flight, whose
-- fence checks lock rows FOR KEY SHARE), the order acquire's insert path and prune take them in.
-- Refuses (SQLSTATE 22023) a p_by outside 1..4611686018427387904, and (22003, numeric_value_out_of_range)
-- an advance that would leave an epoch or the floor above 4611686018427387904: nothing is changed then.
-- Returns one row: the rows advanced, how many of them were held (their holders are now fenced),
-- the new floor and the new highest epoch (the floor when there is no row). p_dry_run: change nothing.
CREATE FUNCTION @extschema@.pg_lease_advance_epochs(p_by bigint, p_dry_run boolean DEFAULT false)
RETURNS TABLE (leases bigint, held bigint, epoch_floor bigint, max_epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  old_floor bigint;
  top bigint;
  n_rows bigint;
  n_held bigint;
  now_at timestamptz;
BEGIN
  IF p_by IS NULL OR p_by < 1 OR p_by > 4611686018427387904 THEN
    RAISE EXCEPTION 'invalid_input: by must be between 1 and 4611686018427387904, got %', p_by
      USING ERRCODE = '22023';
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  IF p_dry_run THEN
    SELECT f.floor INTO old_floor FROM @extschema@."pg_lease_django_epoch_floor" f;
  ELSE
    SELECT f.floor INTO old_floor FROM @extschema@."pg_lease_django_epoch_floor" f FOR UPDATE;
    PERFORM 1 FROM @extschema@."pg_lease_django_lease" l ORDER BY l.key FOR UPDATE;
  END IF;
  now_at := clock_timestamp();
  SELECT count(*), count(*) FILTER (WHERE @extschema@.pg_lease_status(l.owner, l.expires_at, now_at) = 'held'),
         greatest(max(l.epoch), old_floor)
    INTO n_rows, n_held, top FROM @extschema@."pg_lease_django_lease" l;
  IF top > 4611686018427387904 - p_by THEN
    RAISE EXCEPTION 'epoch_overflow: advancing by % would raise epoch % to %, above the limit 4611686018427387904',
                    p_by, top, top::numeric + p_by
      USING ERRCODE = '22003', HINT = 'Advance by less: nothing was changed.';
  END IF;
  IF NOT p_dry_run THEN
    UPDATE @extschema@."pg_lease_django_epoch_floor" f SET floor = f.floor + p_by;
    UPDATE @extschema@."pg_lease_django_lease" l SET epoch = l.epoch + p_by;
  END IF;
  RETURN QUERY SELECT n_rows, n_held, old_floor + p_by, top + p_by, now_at;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_advance_epochs(bigint, boolean) FROM PUBLIC;

-- ================================================================================================
-- Fencing
-- ================================================================================================

-- The fence check. Returns 'ok', 'not_owner', 'lapsed' or 'epoch_mismatch' and never raises for a
-- stale fence, so a guarded write can put it in its WHERE clause without aborting the caller's
-- transaction: UPDATE ... WHERE (SELECT pg_lease_fence(k, o, e)) = 'ok' (an uncorrelated sub-select
-- runs once per statement, before any row is touched).
-- * An unlocked look first: a stale fence (the common rejection) takes no lock and never waits.
-- * On 'ok' the lease row stays locked FOR KEY SHARE until the transaction ends: the holder's
--   renewals (FOR NO KEY UPDATE) go on, a takeover or a release (FOR UPDATE) waits for it.
-- * A fence that looks lapsed while its renewal may still be committing (decided before expiry,
--   not yet visible) waits for that renewal before answering, so a fence never answers 'lapsed'
--   and later 'ok'. The wait takes FOR SHARE (which conflicts with the renewal's lock) inside a
--   subtransaction that is always rolled back: nothing stays locked by the wait.
-- * On 'ok' the presented fence is recorded for this transaction in pg_lease.fences (a JSON object
--   key -> [owner, epoch]), which the fenced tables' triggers check their rows against. A refused
--   fence records nothing and leaves no lock, except when the lease changed between the unlocked
--   look and the lock (then the lock stays until the transaction ends, which a refused writer's
--   does promptly).
CREATE FUNCTION @extschema@.pg_lease_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
  PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
  verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'lapsed' AND cur.epoch = p_epoch THEN
    BEGIN
      PERFORM 1 FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR SHARE;
      RAISE EXCEPTION USING ERRCODE = 'PLR01';
    EXCEPTION WHEN SQLSTATE 'PLR01' THEN
      NULL;  -- waited for any renewal in flight; the rollback dropped the lock
    END;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  END IF;
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR KEY SHARE;
    verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  END IF;
  IF verdict = 'ok' THEN
    PERFORM @extschema@.pg_lease_remember_fence(p_key, p_owner, p_epoch);
  END IF;
  RETURN verdict;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence(text, text, bigint) FROM PUBLIC;

-- Why did a guarded statement write nothing? A fresh check of exactly this fence: faithful, since
-- a refused fence is never accepted later (epochs only grow, a lapsed grant cannot be renewed, and
-- a fence waits for a renewal in flight before answering 'lapsed').
CREATE FUNCTION @extschema@.pg_lease_fence_outcome(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT @extschema@.pg_lease_fence(p_key, p_owner, p_epoch) $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence_outcome(text, text, bigint) FROM PUBLIC;

-- Present a fence (the raising form, for raw SQL): returns p_epoch, so a write can both present the
-- fence and record it in one expression: SET lease_epoch = (SELECT pg_lease_check_fence(k, o, e)).
-- Raises PL001 not_owner, PL002 lapsed, PL003 epoch_mismatch; DETAIL carries the fence as JSON.
CREATE FUNCTION @extschema@.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  expires timestamptz;
  verdict text;
  recorded text;
BEGIN
  -- Fast path, the holder presenting its live fence of a key in the session's scope: one read that
  -- locks the row only when it matches (a stale fence takes no lock and writes nothing), judged
  -- again on the clock once the lock is held (the read may have waited behind a lock-only locker).
  -- A stored row that matches implies valid inputs. The first fence of the transaction is written
  -- as is (the text pg_lease_guard_one_key compares with); any other through pg_lease_remember_fence.
  -- An assignment, not PERFORM: PERFORM runs a query, an assignment evaluates an expression.
  SELECT l.expires_at INTO expires FROM @extschema@."pg_lease_django_lease" l
   WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
     AND @extschema@.pg_lease_key_allowed(p_key)
     FOR KEY SHARE;
  IF expires > clock_timestamp() AND coalesce(current_setting('pg_lease.fences', true), '') = '' THEN
    recorded := set_config('pg_lease.fences', jsonb_build_object(p_key, jsonb_build_array(p_owner, p_epoch))::text, true);
    RETURN p_epoch;
  ELSIF expires > clock_timestamp() THEN
    PERFORM @extschema@.pg_lease_remember_fence(p_key, p_owner, p_epoch);
    RETURN p_epoch;
  END IF;
  -- Anything else: input first (22023), then the key scope (42501), then pg_lease_fence's way (a
  -- renewal in flight awaited, the cause), raising when it fails.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255 OR p_epoch IS NULL OR p_epoch < 1 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  verdict := @extschema@.pg_lease_fence(p_key, p_owner, p_epoch);
  IF verdict = 'ok' THEN
    RETURN p_epoch;
  END IF;
  PERFORM @extschema@.pg_lease_refuse(verdict, p_key, p_owner, p_epoch,
                          format('lease %s is not held by %s at epoch %s', p_key, p_owner, p_epoch));
  RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_fence(text, text, bigint) FROM PUBLIC;

-- Record a fence that holds as presented by this transaction (pg_lease.fences, a JSON object
-- key -> [owner, epoch]): what the fenced tables' triggers check their rows against. No SET
-- search_path (it costs a configuration switch per call on the hot path): its callers pin theirs,
-- it names only exact-typed built-ins, and called directly it only sets the caller's own setting.
CREATE FUNCTION @extschema@.pg_lease_remember_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS void LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
  fences jsonb := @extschema@.pg_lease_presented_fences();
BEGIN
  IF fences -> p_key IS DISTINCT FROM jsonb_build_array(p_owner, p_epoch) THEN
    PERFORM set_config('pg_lease.fences',
                       jsonb_set(fences, ARRAY[p_key], jsonb_build_array(p_owner, p_epoch))::text, true);
  END IF;
END $$;

-- The fences this transaction presented (pg_lease.fences, '{}' when none). The setting is written by
-- pg_lease_remember_fence; one set by hand that is not a JSON object (not JSON, too large, nested
-- too deep) is refused as 'unfenced' (PL004) with a message that says so, never a raw parse error. No SET clause (every fenced
-- write reads it): it names only exact-typed built-ins and its callers pin their search_path.
CREATE FUNCTION @extschema@.pg_lease_presented_fences()
RETURNS jsonb LANGUAGE plpgsql STABLE
AS $$
DECLARE
  raw text := pg_catalog.current_setting('pg_lease.fences', true);
  fences jsonb;
BEGIN
  IF raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN
    RETURN '{}'::jsonb;
  END IF;
  BEGIN
    fences := raw::jsonb;
  EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
    fences := NULL;  -- not JSON, too large, or nested too deep (classes 22 and 54): malformed all the same
  END;
  IF pg_catalog.jsonb_typeof(fences) IS DISTINCT FROM 'object' THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', NULL, NULL, NULL,
      'pg_lease.fences is not a JSON object of lease key -> [owner, epoch]: pg_lease_check_fence() sets it, never a SET by hand');
  END IF;
  RETURN fences;
END $$;

-- The one way a fenced write is refused: SQLSTATE by cause, DETAIL = {key, owner, epoch} as JSON
-- (what the Python side turns into a typed error), HINT = what the writer does next.
CREATE FUNCTION @extschema@.pg_lease_refuse(p_verdict text, p_key text, p_owner text, p_epoch bigint, p_message text)
RETURNS void LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION '%: %', p_verdict, p_message
    USING ERRCODE = CASE p_verdict WHEN 'not_owner' THEN 'PL001' WHEN 'lapsed' THEN 'PL002'
                                   WHEN 'epoch_mismatch' THEN 'PL003' ELSE 'PL004' END,
          DETAIL = json_build_object('key', p_key, 'owner', p_owner, 'epoch', p_epoch)::text,
          HINT = CASE p_verdict WHEN 'unfenced'
            THEN 'Present the lease: SELECT pg_lease_check_fence(key, owner, epoch) in this transaction.'
            ELSE 'The lease was lost: stop acting on its behalf, or re-acquire it (new epoch) to continue.' END;
END $$;

-- The explicit opt-out: fenced tables accept this transaction's writes without a fence (data
-- repair, fixtures, admin edits), for the role that opted out. pg_lease_allow_unfenced() sets
-- pg_lease.unfenced to a token minted from the owner's secret for the current role, this backend
-- and this transaction; pg_lease_unfenced_allowed() (what the triggers ask) checks it for the role
-- writing. The variable set by hand (to anything) never opts out, and a token is minted only for a
-- role the session itself may act as, that may opt out by the owner's own grant: no role can mint,
-- borrow or pass on another role's opt-out (see pg_lease_opt_out_token).

-- The token of p_role in this backend and transaction. Internal: revoked from PUBLIC.
CREATE FUNCTION @extschema@.pg_lease_opt_out_hash(p_role name)
RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT encode(sha256(convert_to(s.secret || '/' || p_role::text || '/' || pg_backend_pid()::text || '/'
                                  || extract(epoch FROM now())::text, 'UTF8')), 'hex')
    FROM @extschema@."pg_lease_django_secret" s
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_opt_out_hash(name) FROM PUBLIC;

-- Mint p_role's opt-out token, or refuse (42501) unless both hold:
-- * the session may act as p_role: its login role is p_role or a member of it (SET ROLE to it
--   included). Inside an owner-run SECURITY DEFINER function called by another role, current_user
--   is the owner but the session is not: the owner's opt-out is never handed to its caller;
-- * p_role may opt out by the owner's own grant: it is the functions' owner (or a member of it, a
--   superuser), or holds EXECUTE on pg_lease_allow_unfenced() through a grant whose grantor is the
--   owner (migrate and `leases grant` make such grants; a superuser's grant is recorded as the
--   owner's). A grant passed on WITH GRANT OPTION names another grantor and counts for nothing.
CREATE FUNCTION @extschema@.pg_lease_opt_out_token(p_role name)
RETURNS text LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF to_regrole(quote_ident(p_role)) IS NULL
     OR NOT pg_has_role(session_user, to_regrole(quote_ident(p_role)), 'MEMBER')
     OR NOT (pg_has_role(to_regrole(quote_ident(p_role)), current_user, 'MEMBER')
             OR EXISTS (SELECT FROM pg_proc p, aclexplode(p.proacl) a
                         WHERE p.oid = '@extschema@.pg_lease_allow_unfenced()'::regprocedure
                           AND a.privilege_type = 'EXECUTE' AND a.grantor = p.proowner
                           AND (a.grantee = 0 OR pg_has_role(to_regrole(quote_ident(p_role)), a.grantee, 'USAGE')))) THEN
    RAISE EXCEPTION 'opt_out: session of role % may not opt out of fencing as role %', session_user, p_role
      USING ERRCODE = '42501',
            HINT = 'Only a role declared in PG_LEASE_OPERATOR_ROLES (granted by migrate or manage.py leases grant) opts out, for itself.';
  END IF;
  RETURN @extschema@.pg_lease_opt_out_hash(p_role);
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_opt_out_token(name) FROM PUBLIC;

-- Is p_token the opt-out of p_role in this backend and transaction? For any caller: it reveals
-- nothing a 256-bit token would not.
CREATE FUNCTION @extschema@.pg_lease_opt_out_valid(p_token text, p_role name)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT p_token = @extschema@.pg_lease_opt_out_hash(p_role) $$;

CREATE FUNCTION @extschema@.pg_lease_allow_unfenced()
RETURNS boolean LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT set_config('pg_lease.unfenced', @extschema@.pg_lease_opt_out_token(current_user), true) IS NOT NULL $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_allow_unfenced() FROM PUBLIC;

-- Did the current role opt out in this transaction with pg_lease_allow_unfenced()? Runs as the
-- caller (the writer, in the triggers), so current_user is the role writing.
CREATE FUNCTION @extschema@.pg_lease_unfenced_allowed()
RETURNS boolean LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT @extschema@.pg_lease_opt_out_valid(current_setting('pg_lease.unfenced', true), current_user) $$;

-- Is this write a trusted replication apply? The fenced tables' triggers fire ALWAYS (also under
-- session_replication_role = replica, which PostgreSQL 15+ lets any role be granted SET on); in
-- replica mode they let rows through unchecked only for a session whose login role is a superuser
-- or a member of the lease functions' owner (current_user here): a logical replication apply worker
-- writing rows its publisher checked. Anyone else meets every check as in origin mode.
CREATE FUNCTION @extschema@.pg_lease_replication_apply()
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT current_setting('session_replication_role') = 'replica' AND pg_has_role(session_user, current_user, 'MEMBER') $$;

-- pg_lease_check_key_scope for each of p_keys (NULLs skipped): what an opted-out write of a fenced
-- table still meets, so an opt-out never crosses a key scope.
CREATE FUNCTION @extschema@.pg_lease_check_key_scopes(p_keys text[])
RETURNS void LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  k text;
BEGIN
  FOREACH k IN ARRAY coalesce(p_keys, '{}') LOOP
    IF k IS NOT NULL THEN
      PERFORM @extschema@.pg_lease_check_key_scope(k);
    END IF;
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_key_scopes(text[]) FROM PUBLIC;

-- Check one lease key written by a statement: the transaction presented a fence for it, and that
-- fence holds now (locking the lease row FOR KEY SHARE until the transaction ends).
CREATE FUNCTION @extschema@.pg_lease_guard_key(p_key text, p_fences jsonb, p_table text)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  presented jsonb := p_fences -> p_key;
  cur record;
  verdict text;
BEGIN
  IF p_key IS NULL THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', NULL, NULL, NULL,
                            format('a row of %s names no lease key', p_table));
  END IF;
  IF presented IS NULL THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', p_key, NULL, NULL,
                            format('%s rows guarded by lease %s were written without a fence for it', p_table, p_key));
  END IF;
  -- [owner, epoch] as pg_lease_remember_fence writes them, or PL004: a non-empty owner of at most 255
  -- bytes, an epoch from 1 (0 and -1 alike are no fence; anything else would meet the input checks).
  IF jsonb_typeof(presented) IS DISTINCT FROM 'array' OR jsonb_typeof(presented -> 0) IS DISTINCT FROM 'string'
     OR NOT octet_length(presented ->> 0) BETWEEN 1 AND 255
     OR NOT coalesce(presented ->> 1 ~ '^[1-9][0-9]{0,17}$', false) THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', p_key, NULL, NULL,
                            format('the fence presented for lease %s in pg_lease.fences is not [owner, epoch]', p_key));
  END IF;
  IF NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;
  -- One locked read decides the usual case (the fence was presented moments ago, and this
  -- transaction may already hold the lock); otherwise pg_lease_fence gives the exact cause.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR KEY SHARE;
  verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, presented ->> 0,
                                  (presented ->> 1)::bigint, clock_timestamp());
  IF verdict <> 'ok' THEN
    verdict := @extschema@.pg_lease_fence(p_key, presented ->> 0, (presented ->> 1)::bigint);
  END IF;
  IF verdict <> 'ok' THEN
    PERFORM @extschema@.pg_lease_refuse(verdict, p_key, presented ->> 0, (presented ->> 1)::bigint,
                            format('lease %s is not held by %s at epoch %s', p_key, presented ->> 0, presented ->> 1));
  END IF;
  RETURN (presented ->> 1)::bigint;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_key(text, jsonb, text) FROM PUBLIC;

-- The common case of a fenced statement, decided in one locked read (pg_lease_guard_rows passes
-- what one pass over its transition tables found): true when every row written or removed names
-- one lease key (p_lo, the least key with a missing one counted as '', equals p_hi, the greatest),
-- the transaction presented one fence, for that key, pg_lease.fences (p_fences) is still the text
-- pg_lease_check_fence wrote for it ({key: [owner, epoch]}), that fence holds now, every row
-- written records its epoch (p_new_min, the least written, NULL when none is; a NULL epoch counts
-- as 0) and none written or removed is above it (p_top); true also when no row was written or
-- removed. The read compares the setting with the live lease row's own fence, so nothing is parsed,
-- and a setting forged by hand passes only when it names the live holder and epoch (what
-- presenting the fence would have checked); the row is locked FOR KEY SHARE only when everything
-- matches, and the clock is read again once the lock is held. Never raises: false (or NULL) sends
-- the trigger the full way (pg_lease_guard_key), which refuses with the cause.
CREATE FUNCTION @extschema@.pg_lease_guard_one_key(p_lo text, p_hi text, p_new_min bigint, p_top bigint, p_fences text)
RETURNS boolean LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  expires timestamptz;
BEGIN
  IF p_lo IS NULL OR p_lo <> p_hi OR NOT @extschema@.pg_lease_key_allowed(p_lo) THEN
    RETURN p_lo IS NULL;
  END IF;
  SELECT l.expires_at INTO expires FROM @extschema@."pg_lease_django_lease" l
   WHERE l.key = p_lo AND l.expires_at > clock_timestamp()
     AND jsonb_build_object(l.key, jsonb_build_array(l.owner, l.epoch))::text = p_fences
     AND (p_new_min IS NULL OR p_new_min = l.epoch) AND (p_top IS NULL OR p_top <= l.epoch)
     FOR KEY SHARE;
  RETURN expires > clock_timestamp();
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_one_key(text, text, bigint, bigint, text) FROM PUBLIC;

-- Trigger of a fenced table (one carrying lease_key and lease_epoch), after each INSERT, UPDATE
-- and DELETE statement, over its transition tables: every lease key the statement wrote or
-- removed (old and new keys: moving a row to another lease needs both) has a live fence in this
-- transaction; every written row records that fence's epoch; no row's epoch goes backwards.
-- Once per statement, not per row: all or nothing, and cheap for large writes.
CREATE FUNCTION @extschema@.pg_lease_guard_rows()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  fences jsonb;
  r record;
  epoch bigint;
  rows_table text;
  done boolean;
BEGIN
  -- The common case first, in one query: no opt-out and no replica mode (NULL otherwise: asked
  -- about below), and every row written or removed names the one lease key of the one fence the
  -- transaction presented, which holds (pg_lease_guard_one_key). One pass over the transition
  -- tables gives what that needs: the least key (a missing one counted as '', which no lease has)
  -- and the greatest (an UPDATE leaves out old rows without a key, as below), the least epoch
  -- written (a NULL one counts as 0, which no fence has) and the greatest written or removed.
  -- Anything else, or a refusal, takes the full way below.
  IF TG_OP = 'UPDATE' THEN
    SELECT CASE WHEN current_setting('session_replication_role') = 'replica'
                  OR coalesce(current_setting('pg_lease.unfenced', true), '') <> '' THEN NULL
                ELSE @extschema@.pg_lease_guard_one_key(min(coalesce(k.key, '') COLLATE "C"), max(k.key COLLATE "C"),
                       min(k.new_epoch), max(k.top), current_setting('pg_lease.fences', true)) END
      INTO done
      FROM (SELECT o.lease_key AS key, NULL::bigint AS new_epoch, o.lease_epoch AS top
              FROM pg_lease_old o WHERE o.lease_key IS NOT NULL
            UNION ALL
            SELECT n.lease_key, coalesce(n.lease_epoch, 0), coalesce(n.lease_epoch, 0) FROM pg_lease_new n) k;
  ELSIF TG_OP = 'INSERT' THEN
    SELECT CASE WHEN current_setting('session_replication_role') = 'replica'
                  OR coalesce(current_setting('pg_lease.unfenced', true), '') <> '' THEN NULL
                ELSE @extschema@.pg_lease_guard_one_key(min(coalesce(n.lease_key, '') COLLATE "C"), max(n.lease_key COLLATE "C"),
                       min(coalesce(n.lease_epoch, 0)), max(coalesce(n.lease_epoch, 0)), current_setting('pg_lease.fences', true)) END
      INTO done FROM pg_lease_new n;
  ELSE
    SELECT CASE WHEN current_setting('session_replication_role') = 'replica'
                  OR coalesce(current_setting('pg_lease.unfenced', true), '') <> '' THEN NULL
                ELSE @extschema@.pg_lease_guard_one_key(min(coalesce(o.lease_key, '') COLLATE "C"), max(o.lease_key COLLATE "C"),
                       NULL, max(o.lease_epoch), current_setting('pg_lease.fences', true)) END
      INTO done FROM pg_lease_old o;
  END IF;
  IF done THEN
    RETURN NULL;
  END IF;
  -- The triggers fire ALWAYS, in replica mode too: only a trusted replication apply passes unchecked.
  IF current_setting('session_replication_role') = 'replica' AND @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;
  END IF;
  -- coalesce: NULL AND f() still calls f() (the result could be false).
  IF coalesce(current_setting('pg_lease.unfenced', true), '') <> '' AND @extschema@.pg_lease_unfenced_allowed() THEN
    -- Opted out: no fence asked, but a session with a key scope writes only rows of its keys.
    IF TG_OP = 'INSERT' THEN
      PERFORM @extschema@.pg_lease_check_key_scopes(ARRAY(SELECT DISTINCT n.lease_key FROM pg_lease_new n));
    ELSIF TG_OP = 'UPDATE' THEN
      PERFORM @extschema@.pg_lease_check_key_scopes(ARRAY(SELECT o.lease_key FROM pg_lease_old o
                                                           UNION SELECT n.lease_key FROM pg_lease_new n));
    ELSE
      PERFORM @extschema@.pg_lease_check_key_scopes(ARRAY(SELECT DISTINCT o.lease_key FROM pg_lease_old o));
    END IF;
    RETURN NULL;
  END IF;
  rows_table := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
  fences := @extschema@.pg_lease_presented_fences();
  IF TG_OP = 'INSERT' THEN
    FOR r IN SELECT n.lease_key AS key, NULL::bigint AS old_max, min(n.lease_epoch) AS new_min,
                    max(n.lease_epoch) AS new_max, count(*) - count(n.lease_epoch) AS new_nulls
               FROM pg_lease_new n GROUP BY n.lease_key LOOP
      epoch := @extschema@.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.new_nulls > 0 OR r.new_min <> epoch OR r.new_max <> epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows must record lease_epoch %s, the epoch of the fence presented for lease %s',
                 rows_table, epoch, r.key));
      END IF;
    END LOOP;
  ELSIF TG_OP = 'UPDATE' THEN
    FOR r IN SELECT k.key, max(k.old_epoch) AS old_max, min(k.new_epoch) AS new_min,
                    max(k.new_epoch) AS new_max, count(*) FILTER (WHERE k.is_new AND k.new_epoch IS NULL) AS new_nulls,
                    count(*) FILTER (WHERE k.is_new) AS new_rows
               FROM (SELECT o.lease_key AS key, o.lease_epoch AS old_epoch, NULL::bigint AS new_epoch, false AS is_new
                       FROM pg_lease_old o
                     UNION ALL
                     SELECT n.lease_key, NULL, n.lease_epoch, true FROM pg_lease_new n) k
              GROUP BY k.key LOOP
      IF r.key IS NULL AND r.new_rows = 0 THEN
        CONTINUE;  -- rows stored before they named a lease (upgraded tables) may take a key
      END IF;
      epoch := @extschema@.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.new_nulls > 0 OR r.new_min <> epoch OR r.new_max <> epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows must record lease_epoch %s, the epoch of the fence presented for lease %s',
                 rows_table, epoch, r.key));
      END IF;
      IF r.old_max > epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows of lease %s were written at epoch %s, above the fence''s %s: row epochs never go backwards',
                 rows_table, r.key, r.old_max, epoch));
      END IF;
    END LOOP;
  ELSE  -- DELETE
    FOR r IN SELECT o.lease_key AS key, max(o.lease_epoch) AS old_max FROM pg_lease_old o GROUP BY o.lease_key LOOP
      epoch := @extschema@.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.old_max > epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows of lease %s were written at epoch %s, above the fence''s %s',
                 rows_table, r.key, r.old_max, epoch));
      END IF;
    END LOOP;
  END IF;
  RETURN NULL;
END $$;

-- Trigger of a multi-table-inheritance child of a fenced model: its rows carry no lease columns,
-- so their keys are read from the fenced ancestor's table, joined on the shared primary key
-- (TG_ARGV: the ancestor table, its primary key column, this table's primary key column). The
-- epoch is recorded and checked on the ancestor's row; here, every key needs a live fence.
CREATE FUNCTION @extschema@.pg_lease_guard_inherited_rows()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  fences jsonb;
  k text;
  rows_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
  rows_sql text;
  keys text[];
BEGIN
  -- The triggers fire ALWAYS, in replica mode too: only a trusted replication apply passes unchecked.
  IF current_setting('session_replication_role') = 'replica' AND @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;
  END IF;
  rows_sql := CASE TG_OP WHEN 'INSERT' THEN format('SELECT %I AS pk FROM pg_lease_new', TG_ARGV[2])
                         WHEN 'DELETE' THEN format('SELECT %I AS pk FROM pg_lease_old', TG_ARGV[2])
                         ELSE format('SELECT %1$I AS pk FROM pg_lease_old UNION SELECT %1$I FROM pg_lease_new',
                                     TG_ARGV[2]) END;
  EXECUTE format('SELECT array_agg(DISTINCT a.lease_key) FROM (%s) r LEFT JOIN %s a ON a.%I = r.pk',
                 rows_sql, TG_ARGV[0], TG_ARGV[1]) INTO keys;
  -- coalesce: NULL AND f() still calls f() (the result could be false), and this runs on every write.
  IF coalesce(current_setting('pg_lease.unfenced', true), '') <> '' AND @extschema@.pg_lease_unfenced_allowed() THEN
    PERFORM @extschema@.pg_lease_check_key_scopes(keys);  -- opted out: still only the keys of its scope
    RETURN NULL;
  END IF;
  fences := @extschema@.pg_lease_presented_fences();
  FOREACH k IN ARRAY coalesce(keys, '{}') LOOP
    PERFORM @extschema@.pg_lease_guard_key(k, fences, rows_table);
  END LOOP;
  RETURN NULL;
END $$;

-- TRUNCATE of a fenced table: refused, like any unfenced write, unless this transaction opted
-- out or the database allows truncation (test databases, as for the lease table).
CREATE FUNCTION @extschema@.pg_lease_guard_truncate()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;  -- fires ALWAYS: only a trusted replication apply passes in replica mode
  END IF;
  -- Every key at once: only a session that spans every key (no key scope) may, opted out.
  IF (@extschema@.pg_lease_unfenced_allowed()
      OR (current_setting('pg_lease.allow_truncate', true) = 'on'
          AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE')))
     AND @extschema@.pg_lease_session_scope() IS NULL THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION 'unfenced: TRUNCATE of fenced table %.% without opting out',
                  quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
    USING ERRCODE = 'PL004', DETAIL = json_build_object('key', NULL, 'owner', NULL, 'epoch', NULL)::text,
          HINT = 'Lease rows and fenced rows are never deleted wholesale (every epoch would restart). In tests, set TEST_RUNNER = ''pg_lease_django.testing.LeaseTestRunner'', or use pytest-django (the pg_lease_django pytest plugin): both allow TRUNCATE on test databases only. Data repair: a role that may opt out runs SELECT pg_lease_allow_unfenced() first, in the same transaction.';
END $$;

-- ================================================================================================
-- The lease table's guards
-- ================================================================================================

-- The lease table's DELETE guard: a row may go only when it is not held and the floor already
-- covers its epoch, whoever deletes it (deleting one would otherwise restart its epoch and un-fence
-- every stale holder). TRUNCATE (what `manage.py flush` and Django's TransactionTestCase run) is
-- refused too, unless the session or database sets pg_lease.allow_truncate = on (test databases).
CREATE FUNCTION @extschema@.pg_lease_forbid_delete()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF current_setting('pg_lease.allow_truncate', true) = 'on'
       AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE') THEN
      RETURN NULL;
    END IF;
    RAISE EXCEPTION 'lease rows are never deleted (TRUNCATE would reset every epoch)'
      USING ERRCODE = '23001',
            HINT = 'Lease rows and fenced rows are never deleted wholesale (every epoch would restart). In tests, set TEST_RUNNER = ''pg_lease_django.testing.LeaseTestRunner'', or use pytest-django (the pg_lease_django pytest plugin): both allow TRUNCATE on test databases only.';
  END IF;
  IF @extschema@.pg_lease_status(OLD.owner, OLD.expires_at, clock_timestamp()) <> 'held'
     AND (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f) >= OLD.epoch THEN
    RETURN OLD;
  END IF;
  RAISE EXCEPTION 'a lease row may be deleted only when it is not held and the epoch floor covers it '
                  '(pg_lease_prune does both; deleting % would reset its epoch)', OLD.key
    USING ERRCODE = '23001', HINT = 'Release the lease instead, or prune leases free for long enough.';
END $$;

CREATE TRIGGER pg_lease_forbid_delete BEFORE DELETE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW EXECUTE FUNCTION @extschema@.pg_lease_forbid_delete();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_forbid_delete;

CREATE TRIGGER pg_lease_forbid_truncate BEFORE TRUNCATE ON @extschema@."pg_lease_django_lease"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_forbid_delete();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_forbid_truncate;

-- A lease row may be inserted only above the floor, whoever inserts it: a pruned key must not come
-- back below its past (acquire starts new keys at floor + 1).
CREATE FUNCTION @extschema@.pg_lease_insert_above_floor()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NEW.epoch <= (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f) THEN
    RAISE EXCEPTION 'lease % may not start at epoch %: the epoch floor is above it', NEW.key, NEW.epoch
      USING ERRCODE = '23514', HINT = 'Acquire the lease instead (pg_lease_acquire).';
  END IF;
  IF NEW.acquired_at = '-infinity' OR NEW.released_at = '-infinity' THEN
    -- the lease functions' markers (pg_lease_guard_update stamps them on UPDATE): never stored
    RAISE EXCEPTION 'lease %: -infinity marks a grant or a release for the update trigger; it is not a time', NEW.key
      USING ERRCODE = '23514', HINT = 'Acquire the lease instead (pg_lease_acquire).';
  END IF;
  NEW.recorded := @extschema@.pg_lease_in_history_scope(NEW.key);  -- whatever the writer said
  RETURN NEW;
END $$;

CREATE TRIGGER pg_lease_insert_above_floor BEFORE INSERT ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW EXECUTE FUNCTION @extschema@.pg_lease_insert_above_floor();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_insert_above_floor;

-- The lease table guards itself, whoever writes it (the owner and superusers included), with two
-- BEFORE UPDATE triggers that PostgreSQL filters before entering PL/pgSQL: this one by a column list
-- (it fires for an UPDATE that sets a column it guards: a bitmap test, nothing parsed), and
-- pg_lease_judge_renewal by a one-comparison WHEN (a change of expiry on a lease already past it).
-- A WHEN clause is parsed from its stored text and compiled for every UPDATE statement: the seven
-- conditions this trigger had cost each statement more than the function call they saved. A
-- renewal, which sets only expires_at, enters no PL/pgSQL. The rules, in this order:
-- 1. A hand-off request ends with the tenure it was made for: any change of epoch clears it.
-- 2. A row keeps its key, its epoch only grows, and the lease changes owner only with a new epoch
--    (else a stale fence would be current again).
-- 3. Judged under the row lock. PostgreSQL evaluates an UPDATE's WHERE before it locks the row: when
--    the row was *changed* meanwhile, READ COMMITTED judges it again on the new version, but when it
--    was only *locked* meanwhile (SELECT ... FOR UPDATE by anyone, a force release that found nothing
--    to do), nothing is judged again, and the lease may have lapsed while the call waited. Row
--    triggers run once the row is locked: this one reads the clock there and skips the row (the
--    UPDATE then finds nothing) when a release (released_at = -infinity, replaced by the clock read)
--    meets a lease that has lapsed, whoever sends it; a renewal, and any other change of the expiry
--    on the same epoch, is judged by pg_lease_judge_renewal (below), so a plain UPDATE cannot bring
--    back a lapsed epoch either (a grant marker counts only with a new epoch). It stamps acquire's
--    grants (acquired_at = -infinity, the TTL handed over as released_at = the Unix epoch + TTL)
--    with that clock read, and clears a release's expiry.
--    tests/test_judged_under_lock.py forces each interleaving.
-- 4. A change of epoch of a recorded key is written to its tenures (pg_lease_record_tenure), with
--    the values stamped above.
-- 5. `recorded` follows the history scope: a writer may change it only to what the scope says.
-- It runs as the owner, as the triggers that wrote the history did: a role granted UPDATE on the
-- table by hand moves leases, and has them recorded, without EXECUTE on the owner's helpers. No SET
-- clause (it would cost a configuration switch on every acquire and release): every built-in,
-- operator, type and function is named with its schema (and the literal typed), so a writer's
-- search_path cannot stand in for any of them; the functions it calls pin their own.
CREATE FUNCTION @extschema@.pg_lease_guard_update()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
  now_at pg_catalog.timestamptz;
BEGIN
  IF NEW.key OPERATOR(pg_catalog.<>) OLD.key OR NEW.epoch OPERATOR(pg_catalog.<) OLD.epoch
     OR (NEW.epoch OPERATOR(pg_catalog.=) OLD.epoch
         AND ((NEW.owner IS NULL) OPERATOR(pg_catalog.<>) (OLD.owner IS NULL)
              OR NEW.owner OPERATOR(pg_catalog.<>) OLD.owner)) THEN
    RAISE EXCEPTION 'lease rows keep their key, and their epoch only grows, with each new owner '
                    '(lease %: epoch % -> %, owner % -> %)', OLD.key, OLD.epoch, NEW.epoch, OLD.owner, NEW.owner
      USING ERRCODE = '23514',
            HINT = 'Use the lease functions (pg_lease_acquire, pg_lease_release, pg_lease_force_release).';
  END IF;

  IF NEW.epoch OPERATOR(pg_catalog.<>) OLD.epoch THEN
    NEW.handoff_requested_at := NULL;
    IF NEW.acquired_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
      -- a grant by pg_lease_acquire: expiry = this clock read + the TTL it handed over in released_at
      now_at := pg_catalog.clock_timestamp();
      NEW.expires_at := now_at OPERATOR(pg_catalog.+)
        pg_catalog.make_interval(secs => pg_catalog.date_part('epoch', NEW.released_at));
      NEW.acquired_at := now_at;
      NEW.released_at := NULL;
    END IF;
  END IF;

  IF NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz
     OR NEW.acquired_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
    now_at := pg_catalog.clock_timestamp();
    IF OLD.expires_at OPERATOR(pg_catalog.<=) now_at THEN
      RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
    END IF;
    IF NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
      -- a release: stamped with this clock read; pg_lease_release leaves the expiry to this trigger
      NEW.released_at := now_at;
      IF NEW.owner IS NULL THEN
        NEW.expires_at := NULL;
      END IF;
    END IF;
  END IF;

  IF NEW.epoch OPERATOR(pg_catalog.<>) OLD.epoch AND NEW.recorded THEN
    PERFORM @extschema@.pg_lease_record_tenure('UPDATE'::pg_catalog.text, OLD, NEW);
  END IF;

  IF NEW.recorded OPERATOR(pg_catalog.<>) OLD.recorded THEN
    IF NEW.recorded OPERATOR(pg_catalog.<>) @extschema@.pg_lease_in_history_scope(NEW.key) THEN
      RAISE EXCEPTION 'lease %: recorded follows the history scope (pg_lease_django_history_scope)', NEW.key
        USING ERRCODE = '23514', HINT = 'Change the scope (PG_LEASE_HISTORY, then migrate), not the flag.';
    END IF;
  END IF;
  RETURN NEW;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_update() FROM PUBLIC;

-- Fires for every UPDATE that sets a column one of the rules above is about: no column changes
-- unless the statement sets it (only these triggers change NEW). A renewal (expires_at) and a
-- hand-off request (handoff_requested_at) pass it by.
CREATE TRIGGER pg_lease_guard_update
  BEFORE UPDATE OF "key", "owner", "epoch", "acquired_at", "released_at", "recorded"
  ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW EXECUTE FUNCTION @extschema@.pg_lease_guard_update();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_guard_update;

-- Rule 3 for an UPDATE that sets the expiry (a renewal, whoever sends it; its one place): judged under
-- the row lock, it skips the row when the lease has lapsed and the epoch is unchanged (a lapsed epoch
-- is not brought back, a shorter expiry included). Its WHEN clause is one comparison, cheap to parse for each
-- statement, and holds only for a lease already past its expiry, so a live renewal calls nothing. It
-- fires after pg_lease_guard_update (names in order), so a rewrite is refused by rule 2 first and a
-- grant or a release is stamped (a new epoch) before it looks. It reads no table and runs as the writer.
CREATE FUNCTION @extschema@.pg_lease_judge_renewal()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NEW.epoch = OLD.epoch AND NEW.expires_at <> OLD.expires_at AND OLD.expires_at <= clock_timestamp() THEN
    RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
  END IF;
  RETURN NEW;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_judge_renewal() FROM PUBLIC;

CREATE TRIGGER pg_lease_judge_renewal
  BEFORE UPDATE OF "expires_at" ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (OLD.expires_at <= clock_timestamp())
  EXECUTE FUNCTION @extschema@.pg_lease_judge_renewal();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_judge_renewal;

-- The floor only grows, and is never deleted: either would let a pruned key restart below its past.
-- (A test database, which may truncate the lease table anyway, may also lower it: allow_truncate,
-- for a role that may opt out of fencing, as for the fenced tables' TRUNCATE.)
CREATE FUNCTION @extschema@.pg_lease_forbid_floor_change()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'the epoch floor only grows and is never deleted' USING ERRCODE = '23514';
END $$;

CREATE TRIGGER pg_lease_floor_only_grows BEFORE UPDATE ON @extschema@."pg_lease_django_epoch_floor"
  FOR EACH ROW WHEN ((NEW.floor < OLD.floor
                     AND NOT (current_setting('pg_lease.allow_truncate', true) = 'on'
                              AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE')))
                    OR NEW.one IS DISTINCT FROM OLD.one)
  EXECUTE FUNCTION @extschema@.pg_lease_forbid_floor_change();
ALTER TABLE @extschema@."pg_lease_django_epoch_floor" ENABLE ALWAYS TRIGGER pg_lease_floor_only_grows;

CREATE TRIGGER pg_lease_floor_kept BEFORE DELETE OR TRUNCATE ON @extschema@."pg_lease_django_epoch_floor"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_forbid_floor_change();
ALTER TABLE @extschema@."pg_lease_django_epoch_floor" ENABLE ALWAYS TRIGGER pg_lease_floor_kept;

-- ================================================================================================
-- History
-- ================================================================================================

-- Record a transition of a recorded lease row in its tenures: p_op is 'INSERT' (a grant to a new
-- key, p_old NULL), 'UPDATE' (the row's epoch changed) or 'DELETE' (a prune, p_new NULL). Runs as
-- the owner, in the statement of the transition: called by pg_lease_guard_update and by the
-- INSERT and DELETE triggers (pg_lease_record_transition), only for recorded keys.
CREATE FUNCTION @extschema@.pg_lease_record_tenure(
  p_op text, p_old @extschema@."pg_lease_django_lease", p_new @extschema@."pg_lease_django_lease")
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  now_at timestamptz;
  reason text;
  ended timestamptz;
  by_whom text;
  keep integer;
BEGIN
  IF p_op <> 'INSERT' AND p_old.owner IS NOT NULL THEN  -- the tenure of p_old ends here
    now_at := CASE WHEN p_new.owner IS NULL THEN coalesce(p_new.released_at, clock_timestamp())  -- a release
                   WHEN p_new.acquired_at IS DISTINCT FROM p_old.acquired_at THEN p_new.acquired_at  -- a grant
                   ELSE clock_timestamp() END;  -- an epoch advance
    IF p_op = 'DELETE' OR p_old.expires_at <= now_at THEN
      -- It had lapsed: it ended at its expiry, whatever cleared the row (a take-over: by the new
      -- owner; a prune, an epoch advance: nobody; a force release: pg_lease_force_release adds who).
      reason := 'lapsed'; ended := p_old.expires_at;
      by_whom := CASE WHEN p_op = 'UPDATE' AND p_new.owner IS DISTINCT FROM p_old.owner THEN p_new.owner END;
    ELSIF p_new.owner IS NULL THEN  -- a release (pg_lease_force_release relabels its own afterwards)
      reason := CASE WHEN p_old.handoff_requested_at IS NOT NULL THEN 'handed_off' ELSE 'released' END;
      ended := now_at; by_whom := p_old.owner;
    ELSIF p_new.acquired_at IS NOT DISTINCT FROM p_old.acquired_at THEN  -- epochs advanced under it
      reason := 'epochs_advanced'; ended := now_at; by_whom := session_user;
    ELSE
      reason := 'reacquired'; ended := p_new.acquired_at; by_whom := p_new.owner;
    END IF;
    UPDATE @extschema@."pg_lease_django_tenure" r
       SET ended_at = ended, end_reason = reason, ended_by = by_whom, ended_by_role = session_user
     WHERE r.key = p_old.key AND r.epoch = p_old.epoch AND r.ended_at IS NULL;
  END IF;

  IF p_op <> 'DELETE' AND p_new.owner IS NOT NULL
     AND (p_op = 'INSERT' OR p_new.acquired_at IS DISTINCT FROM p_old.acquired_at) THEN  -- a grant
    INSERT INTO @extschema@."pg_lease_django_tenure" (key, epoch, owner, granted_at)
      VALUES (p_new.key, p_new.epoch, p_new.owner, p_new.acquired_at);
    -- PG_LEASE_ROLE_LIMITS' max_tenures_per_key: a key under a limited role's prefixes keeps its
    -- newest tenures only (the smallest limit of the roles whose prefixes hold it).
    SELECT min(l.max_tenures_per_key) INTO keep
      FROM @extschema@."pg_lease_django_role_limit" l JOIN @extschema@."pg_lease_django_key_scope" s ON s.role = l.role
     WHERE l.max_tenures_per_key IS NOT NULL AND left(p_new.key, length(s.prefix)) = s.prefix;
    IF keep IS NOT NULL THEN
      DELETE FROM @extschema@."pg_lease_django_tenure" r
       WHERE r.key = p_new.key
         AND r.epoch < (SELECT k.epoch FROM @extschema@."pg_lease_django_tenure" k WHERE k.key = p_new.key
                         ORDER BY k.epoch DESC OFFSET keep - 1 LIMIT 1);
    END IF;
  END IF;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_record_tenure(text, @extschema@."pg_lease_django_lease", @extschema@."pg_lease_django_lease") FROM PUBLIC;

-- The INSERT and DELETE triggers' side of pg_lease_record_tenure (an UPDATE's is pg_lease_guard_update).
CREATE FUNCTION @extschema@.pg_lease_record_transition()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  -- Fired only for recorded keys (the triggers' WHEN clauses test the row's `recorded`).
  PERFORM @extschema@.pg_lease_record_tenure(TG_OP, OLD, NEW);
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_record_transition() FROM PUBLIC;

CREATE TRIGGER pg_lease_record_grant AFTER INSERT ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.owner IS NOT NULL AND NEW.recorded) EXECUTE FUNCTION @extschema@.pg_lease_record_transition();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_record_grant;

CREATE TRIGGER pg_lease_record_prune AFTER DELETE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (OLD.owner IS NOT NULL AND OLD.recorded) EXECUTE FUNCTION @extschema@.pg_lease_record_transition();
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_record_prune;

-- Is p_key's history recorded? The one spelling of the scope rule ('' records every key). Reads the
-- scope table without a lock of its own (ACCESS SHARE, which no write of the table waits for; VOLATILE:
-- each call reads the scope as committed then): a
-- tenant that made a brand-new key and keeps its transaction open holds up neither `migrate` nor a
-- scope sync. A scope change meets brand-new keys on the epoch floor's row instead (pg_lease_rescope).
-- Owner-run: the writer of a lease row needs no privilege on the scope table. (Not compiled into a
-- function body as the key scopes are: a session sees a replaced body only when it next takes a
-- lock it does not hold yet, so a transaction that had written the lease table before could flag a
-- new key by the old scope after the change committed.)
CREATE FUNCTION @extschema@.pg_lease_in_history_scope(p_key text)
RETURNS boolean LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RETURN EXISTS (SELECT 1 FROM @extschema@."pg_lease_django_history_scope" h WHERE left(p_key, length(h.prefix)) = h.prefix);
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_in_history_scope(text) FROM PUBLIC;

-- Any change of the scope table re-flags every lease row in the same transaction, whoever makes it.
-- A brand-new key is flagged by its insert trigger, which reads the scope as committed when it
-- runs; the two meet on the epoch floor's row, which every brand-new key locks FOR SHARE until its
-- transaction ends: this rewrites it (FOR NO KEY UPDATE), so it waits for the brand-new keys in
-- flight and then re-flags them, and a later one waits for this commit and reads the new scope (or,
-- in a transaction that reads as of its start, fails with 40001 rather than flag by the old one).
-- Waiting here queues nobody: a FOR SHARE request is granted beside other FOR SHARE holders
-- whoever waits, and nothing else a tenant needs is locked by a scope change.
CREATE FUNCTION @extschema@.pg_lease_rescope()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  UPDATE @extschema@."pg_lease_django_epoch_floor" f SET floor = f.floor;
  UPDATE @extschema@."pg_lease_django_lease" l SET recorded = NOT l.recorded
   WHERE l.recorded IS DISTINCT FROM @extschema@.pg_lease_in_history_scope(l.key);
  RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_rescope() FROM PUBLIC;

CREATE TRIGGER pg_lease_rescope AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
  ON @extschema@."pg_lease_django_history_scope"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_rescope();
ALTER TABLE @extschema@."pg_lease_django_history_scope" ENABLE ALWAYS TRIGGER pg_lease_rescope;

-- ================================================================================================
-- Monitoring
-- ================================================================================================

-- A key's metrics label (pg_lease_metrics): the first of p_prefixes (longest first) it starts with,
-- else its part before p_separator, else '(none)'. Pure; no SET search_path, as pg_lease_status: it
-- names only pg_catalog built-ins, searched first whatever the caller's search_path.
CREATE FUNCTION @extschema@.pg_lease_metrics_label(p_key text, p_prefixes text[], p_separator text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT coalesce(
    (SELECT p FROM unnest(p_prefixes) p WHERE starts_with(p_key, p) LIMIT 1),
    CASE WHEN strpos(p_key, p_separator) > 0 THEN split_part(p_key, p_separator, 1) ELSE '(none)' END)
$$;

-- The database's view for Prometheus (pg_lease_django.metrics.database_view), in one statement: counts by key
-- label, never a key, an owner or an epoch, for monitoring roles granted nothing else. The rule is
-- the database's, never the caller's: a key's label is the longest declared scope prefix it starts
-- with (pg_lease_django_key_scope: each tenant its own series), else its part before the separator
-- of pg_lease_django_metrics_rule, or '(none)' when it has none; the max_labels labels with the most
-- lease rows keep their own, the rest are counted as '(other)': a scrape has a bounded number of
-- series whatever keys tenants choose. Rows: ('lease', label, state, rows, seconds since the oldest
-- expiry of a lapsed row), ('waiter', label, '', keys with a live registration, NULL), and while
-- history is recorded (pg_lease_django_history_scope) ('tenure', label, end reason, ended tenures,
-- NULL). The state is pg_lease_status against one clock read. Raises work_mem to 32MB for its
-- transaction (never lowers it): the planner cannot estimate how many labels an expression yields,
-- and sorts every row without it; with it, it hashes (2-3x faster at 100k rows). Read-only: takes no
-- row lock.
CREATE FUNCTION @extschema@.pg_lease_metrics()
RETURNS TABLE (kind text, label text, state text, count double precision, oldest_lapse double precision)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_separator text := ':';
  v_max_labels integer := 16;
  v_history boolean := EXISTS (SELECT FROM @extschema@."pg_lease_django_history_scope");
  v_prefixes text[];
BEGIN
  SELECT r.separator, r.max_labels INTO v_separator, v_max_labels FROM @extschema@."pg_lease_django_metrics_rule" r;
  -- Longest first: a key under 'tenant:a:' and 'tenant:' is labelled by the narrower scope.
  SELECT coalesce(array_agg(DISTINCT s.prefix ORDER BY s.prefix), '{}') INTO v_prefixes
    FROM @extschema@."pg_lease_django_key_scope" s WHERE s.prefix <> '';
  SELECT coalesce(array_agg(p ORDER BY length(p) DESC, p), '{}') INTO v_prefixes FROM unnest(v_prefixes) p;
  IF pg_size_bytes(current_setting('work_mem')) < 33554432 THEN
    PERFORM set_config('work_mem', '32MB', true);
  END IF;
  RETURN QUERY
    WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),
    leases AS MATERIALIZED (
      SELECT @extschema@.pg_lease_metrics_label(l.key, v_prefixes, v_separator) AS label,
             @extschema@.pg_lease_status(l.owner, l.expires_at, now.t) AS state,
             extract(epoch FROM now.t - l.expires_at)::float8 AS lapse
        FROM @extschema@."pg_lease_django_lease" l, now),
    kept AS (SELECT g.label FROM leases g GROUP BY g.label ORDER BY count(*) DESC, g.label LIMIT v_max_labels)
    SELECT 'lease'::text, coalesce(k.label, '(other)'), g.state, count(*)::float8,
           max(g.lapse) FILTER (WHERE g.state = 'lapsed')
      FROM leases g LEFT JOIN kept k ON k.label = g.label
     GROUP BY 2, 3
    UNION ALL
    SELECT 'waiter', coalesce(k.label, '(other)'), '', count(*)::float8, NULL
      FROM @extschema@."pg_lease_django_waiter" w CROSS JOIN now
      LEFT JOIN kept k ON k.label = @extschema@.pg_lease_metrics_label(w.key, v_prefixes, v_separator)
     WHERE w.until > now.t
     GROUP BY 2
    UNION ALL
    SELECT 'tenure', coalesce(k.label, '(other)'), t.end_reason, count(*)::float8, NULL
      FROM @extschema@."pg_lease_django_tenure" t
      LEFT JOIN kept k ON k.label = @extschema@.pg_lease_metrics_label(t.key, v_prefixes, v_separator)
     WHERE v_history AND t.end_reason IS NOT NULL
     GROUP BY 2, 3;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_metrics() FROM PUBLIC;

-- ================================================================================================
-- Privileges
-- ================================================================================================

-- What each declared role is granted (PG_LEASE_WORKER_ROLES, PG_LEASE_OPERATOR_ROLES,
-- PG_LEASE_MONITOR_ROLES; applied by `migrate` and `manage.py leases grant`): every function above
-- that locks, reveals or changes a lease is revoked from PUBLIC. A worker runs the four operations
-- and writes fenced rows (the fenced tables' triggers call pg_lease_guard_key as the writer); a
-- monitor reads the counts of pg_lease_metrics and nothing else; an operator may do what a worker
-- and a monitor may, plus force release, ask for a hand-off, opt out of fencing (within its key
-- scope) and read the lease and history tables. 'runbook' rows (pg_lease_prune, pg_lease_advance_epochs) are granted to nobody: they stay
-- with the owner unless granted by hand to an operator. 'public' rows are what every role may run.
-- Check W008 reports any other privilege on the package's functions and tables. A migration that
-- adds a function restates this one. By hand:
--   SELECT format('GRANT %s ON %s %s TO app_worker', privilege, kind, object)
--     FROM pg_lease_privileges() WHERE role = 'worker' \gexec
CREATE FUNCTION @extschema@.pg_lease_privileges()
RETURNS TABLE (role text, kind text, object text, privilege text)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT w.role, w.kind, w.object, w.privilege FROM (VALUES
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire(text, text, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire(text, text, interval, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire_or_register(text, text, interval, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire_within(text, text, interval, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_heartbeat(text, text, bigint, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_renew(text, text, bigint, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_release(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_inspect(text)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_fence(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_fence_outcome(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_check_fence(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_guard_key(text, jsonb, text)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_guard_one_key(text, text, bigint, bigint, text)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_request_handoff(text, bigint)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_force_release(text, bigint)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_force_release(text, bigint, text)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_allow_unfenced()', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_opt_out_token(name)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_check_key_scopes(text[])', 'EXECUTE'),
    ('operator', 'TABLE', '@extschema@."pg_lease_django_lease"', 'SELECT'),
    ('operator', 'TABLE', '@extschema@."pg_lease_django_tenure"', 'SELECT'),
    ('monitor', 'FUNCTION', '@extschema@.pg_lease_metrics()', 'EXECUTE'),
    -- The runbook's (failover, restore, maintenance): granted to nobody, an operator may be granted them.
    ('runbook', 'FUNCTION', '@extschema@.pg_lease_prune(interval, boolean)', 'EXECUTE'),
    ('runbook', 'FUNCTION', '@extschema@.pg_lease_advance_epochs(bigint, boolean)', 'EXECUTE'),
    -- What every role may run, through PUBLIC: pure helpers, and what the triggers call as the writer.
    ('public', 'FUNCTION', '@extschema@.pg_lease_status(text, timestamptz, timestamptz)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_metrics_label(text, text[], text)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_name(text, text)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_ttl(interval)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_epoch(bigint)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_ttl(interval)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_verdict(text, bigint, timestamptz, text, bigint, timestamptz)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_remember_fence(text, text, bigint)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_refuse(text, text, text, bigint, text)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_unfenced_allowed()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_opt_out_valid(text, name)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_presented_fences()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_replication_apply()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_session_scope()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_privileges()', 'EXECUTE')
  ) w (role, kind, object, privilege)
$$;
