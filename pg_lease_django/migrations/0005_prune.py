"""Bounded growth: rows of leases free for long enough may be pruned, and epochs still never go back.

Rows were never deleted because a key's epoch restarts at 1 when its row does. Now the database
keeps an *epoch floor*: the highest epoch of any row ever pruned (``pg_lease_django_epoch_floor``,
one row, which only grows). A key without a row starts above it, so a key that comes back starts
above every epoch it ever had, and ``pg_lease_inspect`` reports the floor for it. A lease row may
be deleted only when it is not held and the floor already covers its epoch (the DELETE trigger
checks that, whoever deletes); ``pg_lease_prune`` (operators) raises the floor and deletes, in one
transaction. ``released_at`` records when a lease was last freed, so "free for 30 days" can be told.
"""

from importlib import import_module

from django.db import migrations, models

from ._sql import replaced_functions, schema_sql

airtight = import_module("pg_lease_django.migrations.0004_airtight")

# {s}: the quoted schema; {t}: the quoted lease table. {f} below: the floor table.
FUNCTIONS_SQL = r"""
CREATE TABLE {f} (
  one boolean PRIMARY KEY DEFAULT true CONSTRAINT pg_lease_epoch_floor_one_row CHECK (one),
  floor bigint NOT NULL CONSTRAINT pg_lease_epoch_floor_non_negative CHECK (floor >= 0)
);
INSERT INTO {f} (one, floor) VALUES (true, 0);

-- The floor only grows, and is never deleted: either would let a pruned key restart below its past.
-- (A test database, which may truncate the lease table anyway, may also lower it: allow_truncate,
-- for a role that may opt out of fencing, as for the fenced tables' TRUNCATE.)
CREATE FUNCTION {s}.pg_lease_forbid_floor_change()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'the epoch floor only grows and is never deleted' USING ERRCODE = '23514';
END $$;
CREATE TRIGGER pg_lease_floor_only_grows BEFORE UPDATE ON {f}
  FOR EACH ROW WHEN ((NEW.floor < OLD.floor
                     AND NOT (current_setting('pg_lease.allow_truncate', true) = 'on'
                              AND has_function_privilege('{s}.pg_lease_allow_unfenced()', 'EXECUTE')))
                    OR NEW.one IS DISTINCT FROM OLD.one)
  EXECUTE FUNCTION {s}.pg_lease_forbid_floor_change();
CREATE TRIGGER pg_lease_floor_kept BEFORE DELETE OR TRUNCATE ON {f}
  FOR EACH STATEMENT EXECUTE FUNCTION {s}.pg_lease_forbid_floor_change();

-- Rows freed before this migration count as freed now.
UPDATE {t} SET released_at = clock_timestamp() WHERE owner IS NULL;

-- Acquire (0004), with two changes: a key without a row starts at floor + 1, not 1; and a row
-- pruned between the unlocked look and the lock sends the attempt back to the insert path.
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
  first_epoch bigint;
  refused boolean;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  PERFORM {s}.pg_lease_check_name('owner', p_owner);
  ttl := {s}.pg_lease_ttl(p_ttl);
  -- An acknowledged grant must survive a crash, or the same epoch could be granted twice.
  PERFORM set_config('synchronous_commit', 'on', true);

  LOOP  -- again only when the row is pruned between the unlocked look and the lock
    -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
    IF NOT FOUND THEN
      -- Start above the floor. FOR SHARE waits for a prune in flight and keeps the next one (which
      -- locks the floor first) from committing until this grant does: no pruned epoch can slip in
      -- above the one read here. In a subtransaction, dropped with its lock when a concurrent
      -- acquire inserted the key first (only brand-new keys take this lock, and only a grant keeps it).
      BEGIN
        SELECT f.floor + 1 INTO first_epoch FROM {f} f FOR SHARE;
        now_at := clock_timestamp();
        INSERT INTO {t} AS l (key, owner, epoch, acquired_at, expires_at)
          VALUES (p_key, p_owner, first_epoch, now_at, now_at + ttl)
          ON CONFLICT ON CONSTRAINT pg_lease_django_lease_pkey DO NOTHING;
        IF NOT FOUND THEN
          RAISE EXCEPTION USING ERRCODE = 'PLR03';
        END IF;
        RETURN QUERY SELECT true, p_key, p_owner, first_epoch, now_at + ttl, now_at;
        RETURN;
      EXCEPTION WHEN SQLSTATE 'PLR03' THEN
        NULL;  -- a concurrent acquire inserted the key first: decide on its row below
      END;
    ELSIF {s}.pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held'
          AND cur.owner <> p_owner THEN
      RETURN QUERY SELECT false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp();
      RETURN;
    END IF;

    -- The locked attempt runs in a subtransaction rolled back when refused: no row lock stays.
    refused := NULL;
    BEGIN
      SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR UPDATE;
      now_at := clock_timestamp();
      IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PLR02';  -- pruned meanwhile: try again from the top
      END IF;
      IF {s}.pg_lease_status(cur.owner, cur.expires_at, now_at) = 'held' AND cur.owner <> p_owner THEN
        RAISE EXCEPTION USING ERRCODE = 'PLR01';
      END IF;
      UPDATE {t} l SET owner = p_owner, epoch = l.epoch + 1, acquired_at = now_at,
                       expires_at = now_at + ttl, released_at = NULL
       WHERE l.key = p_key;
      refused := false;
    EXCEPTION
      WHEN SQLSTATE 'PLR01' THEN refused := true;
      WHEN SQLSTATE 'PLR02' THEN refused := NULL;
    END;
    IF refused IS NOT NULL THEN
      -- cur keeps what the locked read saw (PL/pgSQL variables are not rolled back).
      RETURN QUERY SELECT NOT refused, p_key, CASE WHEN refused THEN cur.owner ELSE p_owner END,
                          cur.epoch + CASE WHEN refused THEN 0 ELSE 1 END,
                          CASE WHEN refused THEN cur.expires_at ELSE now_at + ttl END, now_at;
      RETURN;
    END IF;
  END LOOP;
END $$;

-- Release and force release (0004) also record when the lease was freed.
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
  PERFORM pg_notify('pg_lease_django', p_key);
  RETURN QUERY SELECT 'ok'::text, cur.epoch + 1, now_at;
END $$;

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
  PERFORM pg_notify('pg_lease_django', p_key);
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch + 1, clock_timestamp();
END $$;

-- Inspect (0004): a key without a row is free at the floor's epoch (0 until something is pruned).
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
           coalesce(l.epoch, f.floor), l.expires_at, l.acquired_at, now_at
      FROM {f} f LEFT JOIN {t} l ON l.key = p_key;
END $$;

-- The lease table's DELETE guard (0001/0004): a row may go only when it is not held and the floor
-- already covers its epoch, whoever deletes it. TRUNCATE stays refused (test databases aside).
CREATE OR REPLACE FUNCTION {s}.pg_lease_forbid_delete()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF current_setting('pg_lease.allow_truncate', true) = 'on'
       AND has_function_privilege('{s}.pg_lease_allow_unfenced()', 'EXECUTE') THEN
      RETURN NULL;
    END IF;
    RAISE EXCEPTION 'lease rows are never deleted (TRUNCATE would reset every epoch)'
      USING ERRCODE = '23001',
            HINT = 'Release leases instead. Test databases may SET pg_lease.allow_truncate = on.';
  END IF;
  IF {s}.pg_lease_status(OLD.owner, OLD.expires_at, clock_timestamp()) <> 'held'
     AND (SELECT f.floor FROM {f} f) >= OLD.epoch THEN
    RETURN OLD;
  END IF;
  RAISE EXCEPTION 'a lease row may be deleted only when it is not held and the epoch floor covers it '
                  '(pg_lease_prune does both; deleting % would reset its epoch)', OLD.key
    USING ERRCODE = '23001', HINT = 'Release the lease instead, or prune leases free for long enough.';
END $$;

-- A lease row may be inserted only above the floor, whoever inserts it: a pruned key must not come
-- back below its past (acquire starts new keys at floor + 1).
CREATE FUNCTION {s}.pg_lease_insert_above_floor()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NEW.epoch <= (SELECT f.floor FROM {f} f) THEN
    RAISE EXCEPTION 'lease % may not start at epoch %: the epoch floor is above it', NEW.key, NEW.epoch
      USING ERRCODE = '23514', HINT = 'Acquire the lease instead (pg_lease_acquire).';
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER pg_lease_insert_above_floor BEFORE INSERT ON {t}
  FOR EACH ROW EXECUTE FUNCTION {s}.pg_lease_insert_above_floor();

-- Prune: delete the rows of leases free (released, or lapsed) for at least p_free_for, raising the
-- floor to their highest epoch first, in this transaction. Rows locked right now are skipped. With
-- p_dry_run, only lists what would go. Operators only: revoked from PUBLIC.
CREATE FUNCTION {s}.pg_lease_prune(p_free_for interval, p_dry_run boolean DEFAULT false)
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
    RETURN QUERY SELECT l.key, l.epoch FROM {t} l
      WHERE (l.owner IS NULL AND l.released_at <= cutoff) OR (l.owner IS NOT NULL AND l.expires_at <= cutoff)
      ORDER BY l.key;
    RETURN;
  END IF;
  -- The floor first, then the rows: the order acquire's insert path takes them in (no deadlock).
  PERFORM 1 FROM {f} f FOR UPDATE;
  SELECT array_agg(d.key), max(d.epoch) INTO doomed, top
    FROM (SELECT l.key, l.epoch FROM {t} l
           WHERE (l.owner IS NULL AND l.released_at <= cutoff) OR (l.owner IS NOT NULL AND l.expires_at <= cutoff)
           FOR UPDATE SKIP LOCKED) d;
  IF doomed IS NULL THEN
    RETURN;
  END IF;
  UPDATE {f} f SET floor = greatest(f.floor, top);
  RETURN QUERY DELETE FROM {t} l WHERE l.key = ANY (doomed) RETURNING l.key, l.epoch;
END $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_prune(interval, boolean) FROM PUBLIC;
"""

DROP_SQL = r"""
DO $$
BEGIN
  IF (SELECT f.floor FROM {f} f) > 0 THEN
    RAISE EXCEPTION 'cannot unapply 0005_prune: leases were pruned, and without the epoch floor their keys '
                    'would start again at epoch 1' USING ERRCODE = '55000';
  END IF;
END $$;
DROP TRIGGER IF EXISTS pg_lease_insert_above_floor ON {t};
DROP FUNCTION IF EXISTS {s}.pg_lease_insert_above_floor();
DROP FUNCTION IF EXISTS {s}.pg_lease_prune(interval, boolean);
DROP TABLE IF EXISTS {f};
DROP FUNCTION IF EXISTS {s}.pg_lease_forbid_floor_change();
"""

# Unapplying restores 0004's bodies (which do not know the floor) before dropping it.
BACKWARD_SQL = replaced_functions(airtight.FUNCTIONS_SQL) + DROP_SQL


def _floor(template: str) -> str:
    """Name the floor table as {f} beside 0001's {s} and {t} (filled in by schema_sql)."""
    return template.replace("{f}", '{s}."pg_lease_django_epoch_floor"')


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0004_airtight")]

    operations = [
        migrations.AddField(
            model_name="lease",
            name="released_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        schema_sql(_floor(FUNCTIONS_SQL), _floor(BACKWARD_SQL)),
    ]
