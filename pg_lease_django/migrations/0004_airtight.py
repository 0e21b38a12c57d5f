"""Airtight leases: the database refuses stale writes from every writer, and guards its own table.

- Fenced tables get triggers (installed per model by `FenceTrigger`, see fencing.py) that check, in
  the statement that writes, the fence the transaction presented (``pg_lease_check_fence``/
  ``pg_lease_fence`` record it) against the lease of every row written; ``pg_lease_guard_rows`` and
  ``pg_lease_guard_inherited_rows`` below are those trigger functions.
- Row-lock modes chosen so a fence never blocks its holder's renewal but does hold off a takeover:
  fences lock the lease row FOR KEY SHARE; renew takes FOR NO KEY UPDATE (no conflict); acquire,
  release and force release take FOR UPDATE (conflict: they wait for fenced transactions to end).
- A refused acquire keeps no lock on the lease row (its locked attempt runs in a subtransaction
  rolled back on refusal), so waiters never hold up the winner's renewals.
- The lease table refuses any UPDATE that lowers an epoch or changes owner without raising it.
- The functions run as their owner (SECURITY DEFINER), so workers need no privilege on the table;
  ``pg_lease_force_release`` and ``pg_lease_allow_unfenced`` are revoked from PUBLIC (operators).
- TTLs with a month part are refused, and a TTL adds exact seconds (a day is 86,400 s, whatever
  the session's time zone does at a DST change).
"""

from importlib import import_module

from django.db import migrations

from ._sql import replaced_functions, schema_sql

initial = import_module("pg_lease_django.migrations.0001_initial")
fence = import_module("pg_lease_django.migrations.0002_fence")
force_release = import_module("pg_lease_django.migrations.0003_force_release")

# {s} is the quoted schema the migration runs in (see 0001); {t} the quoted lease table.
FUNCTIONS_SQL = r"""
-- Every function with a body of its own pins search_path to pg_catalog (and pg_temp, which is
-- never searched for functions or operators) and names the package's own objects with their
-- schema: nothing another role creates in that schema (PostgreSQL 14 lets every role CREATE in
-- public) can stand in for a built-in that needs an implicit cast, above all inside the functions
-- that run as their owner. 0001's helpers and the functions 0004 does not otherwise change are
-- redefined here the same way. The exceptions carry no SET clause on purpose and name only
-- exact-typed built-ins: pg_lease_status and pg_lease_verdict (inlined by the planner) and
-- pg_lease_remember_fence (hot path).
CREATE OR REPLACE FUNCTION {s}.pg_lease_check_name(p_kind text, p_value text)
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

CREATE OR REPLACE FUNCTION {s}.pg_lease_check_epoch(p_epoch bigint)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF p_epoch IS NULL OR p_epoch < 1 THEN
    RAISE EXCEPTION 'invalid_input: epoch must be a positive integer, got %', p_epoch
      USING ERRCODE = '22023';
  END IF;
END $$;

-- Acquire with a bounded wait (0001), owner-run like every operation. Each refused attempt leaves
-- no row lock (see pg_lease_acquire), so a waiter never slows the holder's renewals.
CREATE OR REPLACE FUNCTION {s}.pg_lease_acquire(p_key text, p_owner text, p_ttl interval, p_wait interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt record;
  deadline timestamptz;
BEGIN
  IF p_wait < interval '0' THEN
    RAISE EXCEPTION 'invalid_input: wait must not be negative, got %', p_wait USING ERRCODE = '22023';
  END IF;
  deadline := clock_timestamp() + p_wait;
  LOOP
    SELECT * INTO attempt FROM {s}.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
    IF attempt.granted THEN
      RETURN QUERY SELECT attempt.granted, attempt.key, attempt.owner, attempt.epoch,
                          attempt.expires_at, attempt.server_time;
      RETURN;
    END IF;
    IF clock_timestamp() >= deadline THEN
      RAISE EXCEPTION 'timeout: lease % still held by % after waiting %', p_key, attempt.owner, p_wait
        USING ERRCODE = '57014';
    END IF;
    PERFORM pg_sleep(greatest(0.001, extract(epoch FROM
      least(attempt.expires_at, deadline, clock_timestamp() + interval '100 milliseconds')
      - clock_timestamp()))::double precision);
  END LOOP;
END $$;

-- Inspect (0001), owner-run.
CREATE OR REPLACE FUNCTION {s}.pg_lease_inspect(p_key text)
RETURNS TABLE (key text, status text, owner text, epoch bigint, expires_at timestamptz,
               acquired_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  now_at timestamptz;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  now_at := clock_timestamp();
  RETURN QUERY
    SELECT p_key, {s}.pg_lease_status(l.owner, l.expires_at, now_at), l.owner,
           coalesce(l.epoch, 0::bigint), l.expires_at, l.acquired_at, now_at
      FROM (SELECT 1) AS one LEFT JOIN {t} l ON l.key = p_key;
END $$;

-- The lease table's DELETE/TRUNCATE guard (0001), with the pinned path.
CREATE OR REPLACE FUNCTION {s}.pg_lease_forbid_delete()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF current_setting('pg_lease.allow_truncate', true) = 'on' THEN
      RETURN NULL;
    END IF;
    RAISE EXCEPTION 'lease rows are never deleted (TRUNCATE would reset every epoch)'
      USING ERRCODE = '23001',
            HINT = 'Release leases instead. Test databases may SET pg_lease.allow_truncate = on.';
  END IF;
  RAISE EXCEPTION 'lease rows are never deleted (it would reset the epoch of %)', OLD.key
    USING ERRCODE = '23001', HINT = 'Release the lease instead; its epoch must keep increasing.';
END $$;
-- TTL check and normalisation: refuse month parts (a month has no fixed length) and return the
-- TTL as exact seconds, so now + ttl never depends on the calendar or the session's time zone.
CREATE FUNCTION {s}.pg_lease_ttl(p_ttl interval)
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

CREATE OR REPLACE FUNCTION {s}.pg_lease_check_ttl(p_ttl interval)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  PERFORM {s}.pg_lease_ttl(p_ttl);
END $$;

-- Acquire (non-blocking): as in 0001, with two changes.
-- * The row is locked FOR UPDATE, the one mode that conflicts with a fence's FOR KEY SHARE: a
--   takeover waits for every fenced transaction of the old holder to end.
-- * The locked attempt runs in a subtransaction that is rolled back when refused (the row was
--   taken between the unlocked look and the lock): rolling back a subtransaction is the only way
--   to drop a row lock before the transaction ends, so a refused waiter never keeps the winner
--   from renewing (in the bounded wait below, or in a caller's transaction).
CREATE OR REPLACE FUNCTION {s}.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
  ttl interval;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  PERFORM {s}.pg_lease_check_name('owner', p_owner);
  ttl := {s}.pg_lease_ttl(p_ttl);
  -- An acknowledged grant must survive a crash, or the same epoch could be granted twice.
  PERFORM set_config('synchronous_commit', 'on', true);

  -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  IF NOT FOUND THEN
    now_at := clock_timestamp();
    INSERT INTO {t} AS l (key, owner, epoch, acquired_at, expires_at)
      VALUES (p_key, p_owner, 1, now_at, now_at + ttl)
      ON CONFLICT ON CONSTRAINT pg_lease_django_lease_pkey DO NOTHING;
    IF FOUND THEN
      RETURN QUERY SELECT true, p_key, p_owner, 1::bigint, now_at + ttl, now_at;
      RETURN;
    END IF;
    -- A concurrent acquire inserted the key first: decide on its row below.
  ELSIF {s}.pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held'
        AND cur.owner <> p_owner THEN
    RETURN QUERY SELECT false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp();
    RETURN;
  END IF;

  BEGIN
    -- Lock, then read the clock: the decision uses server time after any wait.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR UPDATE;
    now_at := clock_timestamp();
    IF NOT FOUND OR ({s}.pg_lease_status(cur.owner, cur.expires_at, now_at) = 'held' AND cur.owner <> p_owner) THEN
      RAISE EXCEPTION USING ERRCODE = 'PLR01';  -- refused: roll the lock back with the subtransaction
    END IF;
    UPDATE {t} l SET owner = p_owner, epoch = l.epoch + 1, acquired_at = now_at, expires_at = now_at + ttl
     WHERE l.key = p_key;
  EXCEPTION WHEN SQLSTATE 'PLR01' THEN
    -- cur keeps what the locked read saw (PL/pgSQL variables are not rolled back).
    RETURN QUERY SELECT false, p_key, cur.owner, cur.epoch, cur.expires_at, now_at;
    RETURN;
  END;
  RETURN QUERY SELECT true, p_key, p_owner, cur.epoch + 1, now_at + ttl, now_at;
END $$;


-- Renew: as in 0001; FOR NO KEY UPDATE does not conflict with a fence's FOR KEY SHARE, so a long
-- fenced transaction never starves its own heartbeat.
CREATE OR REPLACE FUNCTION {s}.pg_lease_renew(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
  verdict text;
  ttl interval;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  PERFORM {s}.pg_lease_check_name('owner', p_owner);
  PERFORM {s}.pg_lease_check_epoch(p_epoch);
  ttl := {s}.pg_lease_ttl(p_ttl);
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
    now_at := clock_timestamp();
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, now_at);
  END IF;
  IF verdict <> 'ok' THEN
    RETURN QUERY SELECT verdict, NULL::timestamptz, clock_timestamp();
    RETURN;
  END IF;
  UPDATE {t} l SET expires_at = now_at + ttl WHERE l.key = p_key;
  RETURN QUERY SELECT 'ok'::text, now_at + ttl, now_at;
END $$;

-- Release: as in 0001, locking FOR UPDATE so it waits for the holder's fenced transactions.
CREATE OR REPLACE FUNCTION {s}.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
RETURNS TABLE (outcome text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
  verdict text;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  PERFORM {s}.pg_lease_check_name('owner', p_owner);
  PERFORM {s}.pg_lease_check_epoch(p_epoch);
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR UPDATE;
    now_at := clock_timestamp();
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, now_at);
  END IF;
  IF verdict <> 'ok' THEN
    RETURN QUERY SELECT verdict, cur.epoch, clock_timestamp();
    RETURN;
  END IF;
  UPDATE {t} l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL
   WHERE l.key = p_key;
  PERFORM pg_notify('pg_lease_django', p_key);
  RETURN QUERY SELECT 'ok'::text, cur.epoch + 1, now_at;
END $$;

-- Force release (0003), locking FOR UPDATE like release. Operators only: revoked from PUBLIC.
CREATE OR REPLACE FUNCTION {s}.pg_lease_force_release(p_key text, p_expected_epoch bigint)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  IF p_expected_epoch IS NOT NULL THEN
    PERFORM {s}.pg_lease_check_epoch(p_expected_epoch);
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch INTO cur FROM {t} l WHERE l.key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, 0::bigint, clock_timestamp();
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
  UPDATE {t} l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL
   WHERE l.key = p_key;
  PERFORM pg_notify('pg_lease_django', p_key);
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch + 1, clock_timestamp();
END $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_force_release(text, bigint) FROM PUBLIC;


-- The fence check (0002), now monotonic and tied to what it checked.
-- * FOR KEY SHARE, not FOR SHARE: the holder's renewals (FOR NO KEY UPDATE) go on while its fenced
--   transaction is open; a takeover or a release (FOR UPDATE) waits for that transaction to end.
-- * A fence that looks lapsed while its renewal may still be committing (decided before expiry,
--   not yet visible) waits for that renewal before answering, so a fence never answers 'lapsed'
--   and later 'ok'. The wait takes FOR SHARE (which conflicts with the renewal's lock) inside a
--   subtransaction that is always rolled back: nothing stays locked by the wait.
-- * On 'ok' the presented fence is recorded for this transaction in pg_lease.fences (a JSON object
--   key -> [owner, epoch]), which the fenced tables' triggers check their rows against. A refused
--   fence records nothing and leaves no lock, except when the lease changed between the unlocked
--   look and the lock (then the lock stays until the transaction ends, which a refused writer's
--   does promptly).
CREATE OR REPLACE FUNCTION {s}.pg_lease_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  PERFORM {s}.pg_lease_check_name('owner', p_owner);
  PERFORM {s}.pg_lease_check_epoch(p_epoch);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'lapsed' AND cur.epoch = p_epoch THEN
    BEGIN
      PERFORM 1 FROM {t} l WHERE l.key = p_key FOR SHARE;
      RAISE EXCEPTION USING ERRCODE = 'PLR01';
    EXCEPTION WHEN SQLSTATE 'PLR01' THEN
      NULL;  -- waited for any renewal in flight; the rollback dropped the lock
    END;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  END IF;
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR KEY SHARE;
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  END IF;
  IF verdict = 'ok' THEN
    PERFORM {s}.pg_lease_remember_fence(p_key, p_owner, p_epoch);
  END IF;
  RETURN verdict;
END $$;

-- Record a fence that holds as presented by this transaction (pg_lease.fences, a JSON object
-- key -> [owner, epoch]): what the fenced tables' triggers check their rows against. No SET
-- search_path (it costs a configuration switch per call on the hot path): its callers pin theirs,
-- it names only exact-typed built-ins, and called directly it only sets the caller's own setting.
CREATE FUNCTION {s}.pg_lease_remember_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS void LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
  fences jsonb := coalesce(nullif(current_setting('pg_lease.fences', true), '')::jsonb, '{{}}'::jsonb);
BEGIN
  IF fences -> p_key IS DISTINCT FROM jsonb_build_array(p_owner, p_epoch) THEN
    PERFORM set_config('pg_lease.fences',
                       jsonb_set(fences, ARRAY[p_key], jsonb_build_array(p_owner, p_epoch))::text, true);
  END IF;
END $$;

-- Why did a guarded statement write nothing? A fresh check of exactly this fence: faithful, since
-- a refused fence is never accepted later (epochs only grow, a lapsed grant cannot be renewed, and
-- a fence waits for a renewal in flight before answering 'lapsed').
CREATE OR REPLACE FUNCTION {s}.pg_lease_fence_outcome(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT {s}.pg_lease_fence(p_key, p_owner, p_epoch) $$;

-- Present a fence (raising form; see 0002): returns p_epoch, so a write can both present the
-- fence and record it in one expression: SET lease_epoch = (SELECT pg_lease_check_fence(k, o, e)).
-- Raises PL001 not_owner, PL002 lapsed, PL003 epoch_mismatch; DETAIL carries the fence as JSON.
CREATE OR REPLACE FUNCTION {s}.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  -- Fast path, the holder presenting its live fence: an unlocked look (a stale fence takes no lock
  -- and writes nothing), then the lock and the decision. The match itself validates the inputs.
  -- Anything else takes pg_lease_fence's way: input checks, a renewal in flight awaited, the cause.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  IF {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()) = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR KEY SHARE;
    IF {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()) = 'ok' THEN
      PERFORM {s}.pg_lease_remember_fence(p_key, p_owner, p_epoch);
      RETURN p_epoch;
    END IF;
  END IF;
  verdict := {s}.pg_lease_fence(p_key, p_owner, p_epoch);
  IF verdict = 'ok' THEN
    RETURN p_epoch;
  END IF;
  PERFORM {s}.pg_lease_refuse(verdict, p_key, p_owner, p_epoch,
                          format('lease %s is not held by %s at epoch %s', p_key, p_owner, p_epoch));
  RETURN NULL;
END $$;

-- The one way a fenced write is refused: SQLSTATE by cause, DETAIL = {{key, owner, epoch}} as JSON
-- (what the Python side turns into a typed error), HINT = what the writer does next.
CREATE FUNCTION {s}.pg_lease_refuse(p_verdict text, p_key text, p_owner text, p_epoch bigint, p_message text)
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
-- repair, fixtures, admin edits). Revoked from PUBLIC; the triggers also check the writer may run
-- it, so setting pg_lease.unfenced by hand gives nothing to a role that was not granted it.
CREATE FUNCTION {s}.pg_lease_allow_unfenced()
RETURNS boolean LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT set_config('pg_lease.unfenced', 'on', true) = 'on' $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_allow_unfenced() FROM PUBLIC;

CREATE FUNCTION {s}.pg_lease_unfenced_allowed()
RETURNS boolean LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT current_setting('pg_lease.unfenced', true) = 'on'
     AND has_function_privilege('{s}.pg_lease_allow_unfenced()', 'EXECUTE')
$$;

-- Check one lease key written by a statement: the transaction presented a fence for it, and that
-- fence holds now (locking the lease row FOR KEY SHARE until the transaction ends).
CREATE FUNCTION {s}.pg_lease_guard_key(p_key text, p_fences jsonb, p_table text)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  presented jsonb := p_fences -> p_key;
  cur record;
  verdict text;
BEGIN
  IF p_key IS NULL THEN
    PERFORM {s}.pg_lease_refuse('unfenced', NULL, NULL, NULL,
                            format('a row of %s names no lease key', p_table));
  END IF;
  IF presented IS NULL THEN
    PERFORM {s}.pg_lease_refuse('unfenced', p_key, NULL, NULL,
                            format('%s rows guarded by lease %s were written without a fence for it', p_table, p_key));
  END IF;
  -- One locked read decides the usual case (the fence was presented moments ago, and this
  -- transaction may already hold the lock); otherwise pg_lease_fence gives the exact cause.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR KEY SHARE;
  verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, presented ->> 0,
                                  (presented ->> 1)::bigint, clock_timestamp());
  IF verdict <> 'ok' THEN
    verdict := {s}.pg_lease_fence(p_key, presented ->> 0, (presented ->> 1)::bigint);
  END IF;
  IF verdict <> 'ok' THEN
    PERFORM {s}.pg_lease_refuse(verdict, p_key, presented ->> 0, (presented ->> 1)::bigint,
                            format('lease %s is not held by %s at epoch %s', p_key, presented ->> 0, presented ->> 1));
  END IF;
  RETURN (presented ->> 1)::bigint;
END $$;

-- Trigger of a fenced table (one carrying lease_key and lease_epoch), after each INSERT, UPDATE
-- and DELETE statement, over its transition tables: every lease key the statement wrote or
-- removed (old and new keys: moving a row to another lease needs both) has a live fence in this
-- transaction; every written row records that fence's epoch; no row's epoch goes backwards.
-- Once per statement, not per row: all or nothing, and cheap for large writes.
CREATE FUNCTION {s}.pg_lease_guard_rows()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  fences jsonb;
  r record;
  epoch bigint;
  rows_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
BEGIN
  IF current_setting('pg_lease.unfenced', true) = 'on' AND {s}.pg_lease_unfenced_allowed() THEN
    RETURN NULL;
  END IF;
  fences := coalesce(nullif(current_setting('pg_lease.fences', true), '')::jsonb, '{{}}'::jsonb);
  IF TG_OP = 'INSERT' THEN
    FOR r IN SELECT n.lease_key AS key, NULL::bigint AS old_max, min(n.lease_epoch) AS new_min,
                    max(n.lease_epoch) AS new_max, count(*) - count(n.lease_epoch) AS new_nulls
               FROM pg_lease_new n GROUP BY n.lease_key LOOP
      epoch := {s}.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.new_nulls > 0 OR r.new_min <> epoch OR r.new_max <> epoch THEN
        PERFORM {s}.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
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
      epoch := {s}.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.new_nulls > 0 OR r.new_min <> epoch OR r.new_max <> epoch THEN
        PERFORM {s}.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows must record lease_epoch %s, the epoch of the fence presented for lease %s',
                 rows_table, epoch, r.key));
      END IF;
      IF r.old_max > epoch THEN
        PERFORM {s}.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows of lease %s were written at epoch %s, above the fence''s %s: row epochs never go backwards',
                 rows_table, r.key, r.old_max, epoch));
      END IF;
    END LOOP;
  ELSE  -- DELETE
    FOR r IN SELECT o.lease_key AS key, max(o.lease_epoch) AS old_max FROM pg_lease_old o GROUP BY o.lease_key LOOP
      epoch := {s}.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.old_max > epoch THEN
        PERFORM {s}.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
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
CREATE FUNCTION {s}.pg_lease_guard_inherited_rows()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  fences jsonb;
  k text;
  rows_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
  rows_sql text;
BEGIN
  IF current_setting('pg_lease.unfenced', true) = 'on' AND {s}.pg_lease_unfenced_allowed() THEN
    RETURN NULL;
  END IF;
  fences := coalesce(nullif(current_setting('pg_lease.fences', true), '')::jsonb, '{{}}'::jsonb);
  rows_sql := CASE TG_OP WHEN 'INSERT' THEN format('SELECT %I AS pk FROM pg_lease_new', TG_ARGV[2])
                         WHEN 'DELETE' THEN format('SELECT %I AS pk FROM pg_lease_old', TG_ARGV[2])
                         ELSE format('SELECT %1$I AS pk FROM pg_lease_old UNION SELECT %1$I FROM pg_lease_new',
                                     TG_ARGV[2]) END;
  FOR k IN EXECUTE format('SELECT DISTINCT a.lease_key FROM (%s) r LEFT JOIN %s a ON a.%I = r.pk',
                          rows_sql, TG_ARGV[0], TG_ARGV[1]) LOOP
    PERFORM {s}.pg_lease_guard_key(k, fences, rows_table);
  END LOOP;
  RETURN NULL;
END $$;

-- TRUNCATE of a fenced table: refused, like any unfenced write, unless this transaction opted
-- out or the database allows truncation (test databases, as for the lease table).
CREATE FUNCTION {s}.pg_lease_guard_truncate()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF {s}.pg_lease_unfenced_allowed()
     OR (current_setting('pg_lease.allow_truncate', true) = 'on'
         AND has_function_privilege('{s}.pg_lease_allow_unfenced()', 'EXECUTE')) THEN
    RETURN NULL;
  END IF;
  PERFORM {s}.pg_lease_refuse('unfenced', NULL, NULL, NULL,
                          format('TRUNCATE of fenced table %I.%I without opting out', TG_TABLE_SCHEMA, TG_TABLE_NAME));
  RETURN NULL;
END $$;

-- The lease table guards itself, whoever writes it: an UPDATE may never lower an epoch, change
-- the key, or hand the lease to another owner without raising the epoch (that would make a stale
-- fence current again). Checked in the trigger's WHEN clause, so legal updates call no function.
CREATE FUNCTION {s}.pg_lease_forbid_rewrite()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'lease rows keep their key, and their epoch only grows, with each new owner '
                  '(lease %: epoch % -> %, owner % -> %)', OLD.key, OLD.epoch, NEW.epoch, OLD.owner, NEW.owner
    USING ERRCODE = '23514',
          HINT = 'Use the lease functions (pg_lease_acquire, pg_lease_release, pg_lease_force_release).';
END $$;

CREATE TRIGGER pg_lease_forbid_rewrite BEFORE UPDATE ON {t}
  FOR EACH ROW
  WHEN (NEW.key <> OLD.key OR NEW.epoch < OLD.epoch
        OR (NEW.owner IS DISTINCT FROM OLD.owner AND NEW.epoch = OLD.epoch))
  EXECUTE FUNCTION {s}.pg_lease_forbid_rewrite();
"""

DROP_SQL = r"""
GRANT EXECUTE ON FUNCTION {s}.pg_lease_force_release(text, bigint) TO PUBLIC;
DROP TRIGGER IF EXISTS pg_lease_forbid_rewrite ON {t};
DROP FUNCTION IF EXISTS {s}.pg_lease_forbid_rewrite();
DROP FUNCTION IF EXISTS {s}.pg_lease_guard_truncate();
DROP FUNCTION IF EXISTS {s}.pg_lease_guard_inherited_rows();
DROP FUNCTION IF EXISTS {s}.pg_lease_guard_rows();
DROP FUNCTION IF EXISTS {s}.pg_lease_guard_key(text, jsonb, text);
DROP FUNCTION IF EXISTS {s}.pg_lease_unfenced_allowed();
DROP FUNCTION IF EXISTS {s}.pg_lease_remember_fence(text, text, bigint);
DROP FUNCTION IF EXISTS {s}.pg_lease_allow_unfenced();
DROP FUNCTION IF EXISTS {s}.pg_lease_refuse(text, text, text, bigint, text);
DROP FUNCTION IF EXISTS {s}.pg_lease_ttl(interval);
"""
# Unapplying restores the earlier bodies (owner rights, lock modes, fence) of 0001-0003.
BACKWARD_SQL = "\n".join([replaced_functions(m.FUNCTIONS_SQL) for m in (initial, fence, force_release)] + [DROP_SQL])


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0003_force_release")]

    operations = [schema_sql(FUNCTIONS_SQL, BACKWARD_SQL)]
