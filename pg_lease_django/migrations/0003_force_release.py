"""The operator override: free a lease whoever holds it, bumping the epoch so the holder is fenced.

``pg_lease_force_release`` backs ``Lease.objects.force_release()``, ``manage.py leases release
--force`` and the admin's "Force release" action. It takes no owner: it is for a human (or a
script) breaking a stuck lease, never for workers, which release with their own (owner, epoch).
"""

from django.db import migrations

from ._sql import schema_sql

# {s} is the quoted schema the migration runs in (see 0001); {t} the quoted lease table.
FUNCTIONS_SQL = r"""
-- Force release: free a held or lapsed lease and bump its epoch, fencing whoever held it.
-- p_expected_epoch (NULL: any) makes it conditional: refused with 'epoch_mismatch' when the lease
-- moved on since the operator looked, so an override never frees a grant nobody has seen.
-- Outcomes, checked in this order:
--   'not_found'      no row: the key was never acquired (epoch 0)
--   'free'           nothing to release (epoch = the current one)
--   'epoch_mismatch' p_expected_epoch is not the current epoch (epoch = the current one)
--   'ok'             released; owner = the former holder, epoch = the new epoch
-- Notifies channel pg_lease_django with the key, exactly like pg_lease_release, so waiters wake.
CREATE FUNCTION {s}.pg_lease_force_release(p_key text, p_expected_epoch bigint)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
BEGIN
  PERFORM pg_lease_check_name('key', p_key);
  IF p_expected_epoch IS NOT NULL THEN
    PERFORM pg_lease_check_epoch(p_expected_epoch);
  END IF;
  -- An acknowledged release must survive a crash: a lost one would hand the old epoch back.
  PERFORM set_config('synchronous_commit', 'on', true);
  -- Rare, operator-driven: lock straight away (no unlocked look first). The lock orders this
  -- against acquire/renew/release and fence checks (FOR SHARE), which all lock the row.
  SELECT l.owner, l.epoch INTO cur FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
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
"""

DROP_SQL = r"""
DROP FUNCTION IF EXISTS {s}.pg_lease_force_release(text, bigint);
"""


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0002_fence")]

    operations = [schema_sql(FUNCTIONS_SQL, DROP_SQL)]
