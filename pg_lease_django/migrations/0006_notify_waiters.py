"""Release and force release notify only when someone waits.

``NOTIFY`` takes a database-wide lock at commit and holds it until the commit is flushed: releasing
transactions that notify commit one after another, and group commit is lost (docs/performance.md,
scale-out). Now a waiter that LISTENs says so: its attempts are ``pg_lease_acquire_or_register``,
which, when refused, registers the key in ``pg_lease_django_waiter`` until the waiter's next attempt
is due (plus a margin). A release notifies only when it finds a live registration for its key, and
removes the key's registrations (every waiter of the key is woken, and one still refused registers
again with its next attempt).

No wake-up is lost between a registration and a release, whichever comes first: they meet on a
transaction-level advisory lock of the key. A registering attempt takes it *shared* before it reads
the lease, and keeps it until its transaction ends; a release *tries* it exclusively after freeing
the lease. Either the release gets it, and then every registration made before is committed and
visible to it, and every later one waits for the release to commit and then finds the lease free;
or it does not (a registration is in flight), and it notifies without looking. A release never waits
for it. The table is UNLOGGED: a registration writes no WAL, and a refused attempt that registers
does not wait for a WAL flush; after a crash the registrations are gone and waiters wake at the
holder's expiry or their poll interval, as they do when a notification is lost. Nothing here is
session state: it works through a transaction pooler (though LISTEN itself does not).
"""

from importlib import import_module

from django.db import migrations

from ._sql import function_definitions, schema_sql

prune = import_module("pg_lease_django.migrations.0005_prune")

# {s}: the quoted schema; {t}: the quoted lease table; {f}: the epoch floor (0005); {w}: the waiters.
FUNCTIONS_SQL = r"""
-- Who waits for which key, and until when (an UNLOGGED table: see the module docstring). One row
-- per key; written only by the functions below, which run as their owner.
CREATE UNLOGGED TABLE {w} (
  key text CONSTRAINT pg_lease_django_waiter_pkey PRIMARY KEY,
  until timestamptz NOT NULL
);
REVOKE ALL ON {w} FROM PUBLIC;

-- The advisory lock a registration and a release of the key meet on (64 bits of the key's hash, seeded:
-- a collision with another key or another application's lock only costs a spurious notification).
-- No SET clause (inlined); names only an exact-typed built-in.
CREATE FUNCTION {s}.pg_lease_waiter_lock(p_key text)
RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT pg_catalog.hashtextextended(p_key, 4187349731::bigint) $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_waiter_lock(text) FROM PUBLIC;

-- Called by release and force release once the lease is free: notify only if someone waits. Never
-- waits itself, so no waiter (nor a role holding the same advisory lock) can hold up a release.
CREATE FUNCTION {s}.pg_lease_wake_waiters(p_key text)
RETURNS void LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  last_until timestamptz;
BEGIN
  IF NOT pg_try_advisory_xact_lock({s}.pg_lease_waiter_lock(p_key)) THEN
    -- A registration is in flight: it is not visible yet, so notify without looking.
    PERFORM pg_notify('pg_lease_django', p_key);
    RETURN;
  END IF;
  -- Every registration made before is committed and seen by this statement; a later one waits for
  -- this transaction and then finds the lease free. Every waiter is woken, so the rows go (a waiter
  -- still refused registers again); an expired row goes without a notification.
  WITH gone AS (DELETE FROM {w} w WHERE w.key = p_key RETURNING w.until)
  SELECT max(gone.until) INTO last_until FROM gone;
  IF last_until > clock_timestamp() THEN
    PERFORM pg_notify('pg_lease_django', p_key);
  END IF;
END $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_wake_waiters(text) FROM PUBLIC;

-- The attempt of a waiter that LISTENs on pg_lease_django: pg_lease_acquire(key, owner, ttl), and
-- when refused, a registration so that the next release of the key notifies, lasting until the
-- waiter's next attempt is due (p_retry_within, or the holder's expiry if sooner) plus a second.
CREATE FUNCTION {s}.pg_lease_acquire_or_register(p_key text, p_owner text, p_ttl interval, p_retry_within interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  attempt record;
  -- Whether this transaction wrote anything before this call (then its commit must stay durable).
  wrote_before boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
  saved_lock_timeout text := current_setting('lock_timeout');
  wait_ms double precision;
  locked boolean := false;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  IF p_retry_within IS NULL OR extract(year FROM p_retry_within) <> 0 OR extract(month FROM p_retry_within) <> 0
     OR extract(epoch FROM p_retry_within) < 0 OR extract(epoch FROM p_retry_within) > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: retry_within must be between 0 and 365 days, without months, got %',
      p_retry_within USING ERRCODE = '22023';
  END IF;
  -- A release of this key in flight holds the lock exclusively until it commits: wait for it, then
  -- the attempt finds the lease free. At most p_retry_within (and the caller's lock_timeout): the
  -- waiter would have slept that long anyway. Past it, attempt without registering: the table is
  -- written only under the key's lock (registrations shared, a release's deletions exclusive), so
  -- neither ever waits for the other's rows.
  wait_ms := greatest(1, ceil(extract(epoch FROM p_retry_within) * 1000));
  IF saved_lock_timeout::interval > interval '0' THEN
    wait_ms := least(wait_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
  END IF;
  BEGIN
    PERFORM set_config('lock_timeout', least(wait_ms, 2147483647)::bigint::text, true);
    PERFORM pg_advisory_xact_lock_shared({s}.pg_lease_waiter_lock(p_key));
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    locked := true;
  EXCEPTION WHEN lock_not_available THEN
    NULL;  -- the subtransaction's rollback restored lock_timeout
  END;

  SELECT * INTO attempt FROM {s}.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
  IF NOT attempt.granted AND locked THEN
    -- A refusal wrote nothing that must survive a crash, and a registration is gone after a crash
    -- anyway: unless the caller's transaction wrote before, its commit need not wait for a flush.
    IF NOT wrote_before THEN
      PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    INSERT INTO {w} AS w (key, until)
      VALUES (p_key, least(clock_timestamp() + p_retry_within, attempt.expires_at) + interval '1 second')
      ON CONFLICT ON CONSTRAINT pg_lease_django_waiter_pkey DO UPDATE SET until = greatest(w.until, EXCLUDED.until);
  END IF;
  RETURN QUERY SELECT attempt.granted, attempt.key, attempt.owner, attempt.epoch,
                      attempt.expires_at, attempt.server_time;
END $$;

-- Release (0005): notifies only when someone waits.
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
  UPDATE {t} l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                   released_at = now_at
   WHERE l.key = p_key;
  PERFORM {s}.pg_lease_wake_waiters(p_key);
  RETURN QUERY SELECT 'ok'::text, cur.epoch + 1, now_at;
END $$;

-- Force release (0005): notifies only when someone waits. Operators only (revoked from PUBLIC in 0004).
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
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM {f} f), clock_timestamp();
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
  UPDATE {t} l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                   released_at = clock_timestamp()
   WHERE l.key = p_key;
  PERFORM {s}.pg_lease_wake_waiters(p_key);
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch + 1, clock_timestamp();
END $$;
"""

DROP_SQL = r"""
DROP FUNCTION IF EXISTS {s}.pg_lease_acquire_or_register(text, text, interval, interval);
DROP FUNCTION IF EXISTS {s}.pg_lease_wake_waiters(text);
DROP FUNCTION IF EXISTS {s}.pg_lease_waiter_lock(text);
DROP TABLE IF EXISTS {w};
"""

# Unapplying restores 0005's release and force release (which notify on every release) first.
BACKWARD_SQL = function_definitions(prune.FUNCTIONS_SQL, "pg_lease_release", "pg_lease_force_release") + DROP_SQL


def _tables(template: str) -> str:
    """Name the floor table as {f} and the waiter table as {w} beside 0001's {s} and {t}."""
    return template.replace("{f}", '{s}."pg_lease_django_epoch_floor"').replace("{w}", '{s}."pg_lease_django_waiter"')


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0005_prune")]

    operations = [schema_sql(_tables(FUNCTIONS_SQL), _tables(BACKWARD_SQL))]
