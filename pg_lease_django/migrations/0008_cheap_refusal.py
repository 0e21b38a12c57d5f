"""A refused acquire costs little more than reading the row.

The acquire of 0005, with three changes on its way to a refusal, which profiling showed costs about
half of its time before it reads the row (pgbench, 8 clients on one held key):

- The input checks are one inline condition; the checking functions (each a PL/pgSQL call with its
  own ``SET search_path``) run only when it fails, to raise their error. They stay the one place
  where a rule's error is written; ``tests/test_validation.py`` checks the limits at their edges.
- The TTL is converted (``pg_lease_ttl``) only on the way to a grant.
- ``synchronous_commit`` is set ``on`` only on the way to a write: a refusal writes nothing.

Everything else (the unlocked look, the subtransaction of the locked attempt, the epoch floor) is as
in 0005.
"""

from importlib import import_module

from django.db import migrations

from ._sql import function_definitions, schema_sql

prune = import_module("pg_lease_django.migrations.0005_prune")

# {s}: the quoted schema; {t}: the quoted lease table; {f}: the epoch floor (0005).
FUNCTIONS_SQL = r"""
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
  -- The rules of pg_lease_check_name and pg_lease_ttl as one condition; they raise when it fails.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400 THEN
    PERFORM {s}.pg_lease_check_name('key', p_key);
    PERFORM {s}.pg_lease_check_name('owner', p_owner);
    ttl := {s}.pg_lease_ttl(p_ttl);
  END IF;

  LOOP  -- again only when the row is pruned between the unlocked look and the lock
    -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
    IF NOT FOUND THEN
      -- An acknowledged grant must survive a crash, or the same epoch could be granted twice.
      PERFORM set_config('synchronous_commit', 'on', true);
      ttl := {s}.pg_lease_ttl(p_ttl);
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

    PERFORM set_config('synchronous_commit', 'on', true);
    ttl := {s}.pg_lease_ttl(p_ttl);
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
"""

# Unapplying restores 0005's acquire.
BACKWARD_SQL = function_definitions(prune.FUNCTIONS_SQL, "pg_lease_acquire")


def _floor(template: str) -> str:
    """Name the floor table as {f} beside 0001's {s} and {t}."""
    return template.replace("{f}", '{s}."pg_lease_django_epoch_floor"')


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0007_advance_epochs")]

    operations = [schema_sql(_floor(FUNCTIONS_SQL), _floor(BACKWARD_SQL))]
