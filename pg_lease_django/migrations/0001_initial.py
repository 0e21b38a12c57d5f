"""The lease table and the SQL functions that implement the four operations.

The functions are the only implementation of the lease rules: the manager calls them, and so can
psql scripts or services in other languages (see docs/sql.md).
"""

from django.db import migrations, models
from django.db.models import F, Func, IntegerField, Q
from django.db.models.lookups import Range

from ._sql import schema_sql


def octet_length(field: str) -> Func:
    return Func(F(field), function="octet_length", output_field=IntegerField())


# {s} is the quoted schema the migration runs in; every function pins search_path to it so a
# caller's search_path cannot redirect the table or the helpers (SECURITY INVOKER throughout).
FUNCTIONS_SQL = r"""
-- Status of a lease row at a given server instant: the one rule every operation uses.
-- A lease is lapsed at its expires_at exactly (not a microsecond later).
-- No SET search_path here or in pg_lease_verdict: it would stop PostgreSQL from inlining these
-- hot helpers (~20 us a call). They touch no table and name only pg_catalog built-ins, which
-- are searched first whatever the caller's search_path.
CREATE FUNCTION {s}.pg_lease_status(p_owner text, p_expires_at timestamptz, p_now timestamptz)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT CASE WHEN p_owner IS NULL THEN 'free'
              WHEN p_expires_at > p_now THEN 'held'
              ELSE 'lapsed' END
$$;

-- Input rules, SQLSTATE 22023 (invalid_parameter_value). The Python side checks the same first.
CREATE FUNCTION {s}.pg_lease_check_name(p_kind text, p_value text)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, {s}, pg_temp
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

CREATE FUNCTION {s}.pg_lease_check_ttl(p_ttl interval)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, {s}, pg_temp
AS $$
BEGIN
  IF p_ttl IS NULL OR p_ttl < interval '1 millisecond' OR p_ttl > interval '365 days' THEN
    RAISE EXCEPTION 'invalid_input: ttl must be between 1 millisecond and 365 days, got %', p_ttl
      USING ERRCODE = '22023';
  END IF;
END $$;

CREATE FUNCTION {s}.pg_lease_check_epoch(p_epoch bigint)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, {s}, pg_temp
AS $$
BEGIN
  IF p_epoch IS NULL OR p_epoch < 1 THEN
    RAISE EXCEPTION 'invalid_input: epoch must be a positive integer, got %', p_epoch
      USING ERRCODE = '22023';
  END IF;
END $$;

-- Renew/release verdict, in the spec's precedence: holder, then lapse, then epoch.
-- Written so that any NULL argument yields a refusal, never 'ok'.
CREATE FUNCTION {s}.pg_lease_verdict(
  p_row_owner text, p_row_epoch bigint, p_row_expires_at timestamptz,
  p_owner text, p_epoch bigint, p_now timestamptz)
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT CASE
    WHEN p_owner IS NULL OR p_row_owner IS DISTINCT FROM p_owner THEN 'not_owner'
    WHEN {s}.pg_lease_status(p_row_owner, p_row_expires_at, p_now) <> 'held' THEN 'lapsed'
    WHEN p_epoch IS NULL OR p_row_epoch IS DISTINCT FROM p_epoch THEN 'epoch_mismatch'
    ELSE 'ok' END
$$;

-- Acquire (non-blocking). Granted if the key is free, lapsed, or held by this same owner
-- (self-takeover: a new epoch, so the owner's earlier incarnation is fenced).
CREATE FUNCTION {s}.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
BEGIN
  PERFORM pg_lease_check_name('key', p_key);
  PERFORM pg_lease_check_name('owner', p_owner);
  PERFORM pg_lease_check_ttl(p_ttl);
  -- An acknowledged grant must survive a crash, or the same epoch could be granted twice.
  -- Transaction-local, so it also covers a caller's enclosing transaction.
  PERFORM set_config('synchronous_commit', 'on', true);

  -- Look without locking first: refusing a held key takes no row lock and writes no WAL,
  -- so waiters polling a held key never slow down its holder's renewals.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  IF NOT FOUND THEN
    now_at := clock_timestamp();
    INSERT INTO {t} AS l (key, owner, epoch, acquired_at, expires_at)
      VALUES (p_key, p_owner, 1, now_at, now_at + p_ttl)
      ON CONFLICT ON CONSTRAINT pg_lease_django_lease_pkey DO NOTHING;
    IF FOUND THEN
      RETURN QUERY SELECT true, p_key, p_owner, 1::bigint, now_at + p_ttl, now_at;
      RETURN;
    END IF;
    -- A concurrent acquire inserted the key first: decide on its row below.
  ELSIF pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held'
        AND cur.owner <> p_owner THEN
    RETURN QUERY SELECT false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp();
    RETURN;
  END IF;

  -- It looked acquirable: lock the row, then read the clock, so the decision and the new
  -- expiry use server time after any wait for a concurrent transaction.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
  now_at := clock_timestamp();
  IF NOT FOUND THEN  -- the row vanished (rows are never deleted): refuse rather than grant epoch NULL
    RETURN QUERY SELECT false, p_key, NULL::text, NULL::bigint, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF pg_lease_status(cur.owner, cur.expires_at, now_at) = 'held' AND cur.owner <> p_owner THEN
    RETURN QUERY SELECT false, p_key, cur.owner, cur.epoch, cur.expires_at, now_at;
    RETURN;
  END IF;
  UPDATE {t} l SET owner = p_owner, epoch = l.epoch + 1, acquired_at = now_at,
                   expires_at = now_at + p_ttl
   WHERE l.key = p_key;
  RETURN QUERY SELECT true, p_key, p_owner, cur.epoch + 1, now_at + p_ttl, now_at;
END $$;

-- Acquire, waiting up to p_wait (NULL: no bound) for the key; SQLSTATE 57014 on timeout.
-- Polls inside one statement, sleeping until the holder's expiry (at most 100 ms at a time),
-- so it keeps a snapshot open while it waits: prefer the client-side wait (Python API) or
-- short bounds from SQL.
CREATE FUNCTION {s}.pg_lease_acquire(p_key text, p_owner text, p_ttl interval, p_wait interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
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
    SELECT * INTO attempt FROM pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
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
      - clock_timestamp())));
  END LOOP;
END $$;

-- Renew: extend a live lease held by (owner, epoch). Never changes the epoch.
CREATE FUNCTION {s}.pg_lease_renew(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
  verdict text;
BEGIN
  PERFORM pg_lease_check_name('key', p_key);
  PERFORM pg_lease_check_name('owner', p_owner);
  PERFORM pg_lease_check_epoch(p_epoch);
  PERFORM pg_lease_check_ttl(p_ttl);
  PERFORM set_config('synchronous_commit', 'on', true);
  -- Unlocked look first: a refused renew locks and writes nothing.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  verdict := pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
    now_at := clock_timestamp();
    verdict := pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, now_at);
  END IF;
  IF verdict <> 'ok' THEN
    RETURN QUERY SELECT verdict, NULL::timestamptz, clock_timestamp();
    RETURN;
  END IF;
  UPDATE {t} l SET expires_at = now_at + p_ttl WHERE l.key = p_key;
  RETURN QUERY SELECT 'ok'::text, now_at + p_ttl, now_at;
END $$;

-- Release: free a live lease held by (owner, epoch) and bump the epoch, fencing the old holder.
-- Notifies channel pg_lease_django with the key (delivered at commit; a hint for waiters).
CREATE FUNCTION {s}.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
RETURNS TABLE (outcome text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
  verdict text;
BEGIN
  PERFORM pg_lease_check_name('key', p_key);
  PERFORM pg_lease_check_name('owner', p_owner);
  PERFORM pg_lease_check_epoch(p_epoch);
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  verdict := pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
    now_at := clock_timestamp();
    verdict := pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, now_at);
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

-- Inspect: the state at the server clock (lazy expiry: a lapsed row is reported 'lapsed').
-- An unknown key is 'free' with epoch 0.
CREATE FUNCTION {s}.pg_lease_inspect(p_key text)
RETURNS TABLE (key text, status text, owner text, epoch bigint, expires_at timestamptz,
               acquired_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  now_at timestamptz;
BEGIN
  PERFORM pg_lease_check_name('key', p_key);
  now_at := clock_timestamp();
  RETURN QUERY
    SELECT p_key, pg_lease_status(l.owner, l.expires_at, now_at), l.owner,
           coalesce(l.epoch, 0::bigint), l.expires_at, l.acquired_at, now_at
      FROM (SELECT 1) AS one LEFT JOIN {t} l ON l.key = p_key;
END $$;

-- Lease rows are never deleted: deleting one would restart its epoch at 1 and un-fence every
-- stale holder. Free a lease with pg_lease_release (or `manage.py leases release --force`).
-- TRUNCATE (what `manage.py flush` and Django's TransactionTestCase run) is refused too, unless
-- the session or database sets pg_lease.allow_truncate = on: for test databases only.
CREATE FUNCTION {s}.pg_lease_forbid_delete()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, {s}, pg_temp
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

CREATE TRIGGER pg_lease_forbid_delete BEFORE DELETE ON {t}
  FOR EACH ROW EXECUTE FUNCTION {s}.pg_lease_forbid_delete();
CREATE TRIGGER pg_lease_forbid_truncate BEFORE TRUNCATE ON {t}
  FOR EACH STATEMENT EXECUTE FUNCTION {s}.pg_lease_forbid_delete();
"""

DROP_SQL = r"""
DROP TRIGGER IF EXISTS pg_lease_forbid_truncate ON {t};
DROP TRIGGER IF EXISTS pg_lease_forbid_delete ON {t};
DROP FUNCTION IF EXISTS {s}.pg_lease_forbid_delete();
DROP FUNCTION IF EXISTS {s}.pg_lease_inspect(text);
DROP FUNCTION IF EXISTS {s}.pg_lease_release(text, text, bigint);
DROP FUNCTION IF EXISTS {s}.pg_lease_renew(text, text, bigint, interval);
DROP FUNCTION IF EXISTS {s}.pg_lease_acquire(text, text, interval, interval);
DROP FUNCTION IF EXISTS {s}.pg_lease_acquire(text, text, interval);
DROP FUNCTION IF EXISTS {s}.pg_lease_verdict(text, bigint, timestamptz, text, bigint, timestamptz);
DROP FUNCTION IF EXISTS {s}.pg_lease_check_epoch(bigint);
DROP FUNCTION IF EXISTS {s}.pg_lease_check_ttl(interval);
DROP FUNCTION IF EXISTS {s}.pg_lease_check_name(text, text);
DROP FUNCTION IF EXISTS {s}.pg_lease_status(text, timestamptz, timestamptz);
"""


class Migration(migrations.Migration):
    initial = True

    dependencies = []

    operations = [
        migrations.CreateModel(
            name="Lease",
            fields=[
                ("key", models.TextField(primary_key=True, serialize=False)),
                ("owner", models.TextField(blank=True, null=True)),
                ("epoch", models.BigIntegerField(default=0)),
                ("acquired_at", models.DateTimeField(blank=True, null=True)),
                ("expires_at", models.DateTimeField(blank=True, null=True)),
            ],
            options={
                "db_table": "pg_lease_django_lease",
                "ordering": ["key"],
                "permissions": [("force_release_lease", "Can force-release a lease")],
                "constraints": [
                    models.CheckConstraint(
                        condition=Range(octet_length("key"), (1, 255)),
                        name="pg_lease_key_length",
                    ),
                    models.CheckConstraint(
                        condition=Q(owner__isnull=True) | Q(Range(octet_length("owner"), (1, 255))),
                        name="pg_lease_owner_length",
                    ),
                    models.CheckConstraint(condition=Q(epoch__gte=0), name="pg_lease_epoch_non_negative"),
                    models.CheckConstraint(
                        condition=Q(owner__isnull=True, expires_at__isnull=True, acquired_at__isnull=True)
                        | Q(owner__isnull=False, expires_at__isnull=False, acquired_at__isnull=False),
                        name="pg_lease_held_fields_together",
                    ),
                ],
            },
        ),
        # Renewals rewrite expires_at on every heartbeat: leaving room on each page keeps them
        # HOT updates (no index touched, no bloat). Hence also no index on owner/epoch/expires_at.
        migrations.RunSQL(
            "ALTER TABLE pg_lease_django_lease SET (fillfactor = 60)",
            "ALTER TABLE pg_lease_django_lease RESET (fillfactor)",
        ),
        schema_sql(FUNCTIONS_SQL, DROP_SQL),
    ]
