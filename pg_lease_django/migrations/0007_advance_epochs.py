"""The remedy for an asynchronous failover: raise every epoch, and the epoch floor, by N at once.

A standby promoted without the last lease writes the old primary acknowledged stands at lower
epochs than that primary granted, and would grant those epochs again, to other owners
(docs/high-availability.md, "The asynchronous gap"). ``pg_lease_advance_epochs(N)``, run on the
promoted server before the application reconnects, raises the epoch of every lease row and the
epoch floor of 0005 (where keys without a row start) by N in one transaction. With N above the
number of grants per key the lost primary could have made since the last replicated point, every
grant made afterwards is above every grant it could have acknowledged, pruned keys included.

Holders keep their rows' owner and expiry (the key stays unavailable to others until then, as the
holder may still be acting), but at a new epoch nobody was granted: their renewals, releases and
fenced writes at the old epoch are refused (``epoch_mismatch``), so a stale worker can never write;
they re-acquire to go on. Operators only: revoked from PUBLIC.
"""

from django.db import migrations

from ._sql import schema_sql

#: The highest epoch or floor an advance may leave (2**62), so that at least 2**62 - 1 grants per key
#: remain before bigint overflows; also the largest N. validation.MAX_ADVANCE spells it in Python.
MAX_ADVANCED_EPOCH = 2**62

# {s}: the quoted schema; {t}: the quoted lease table; {f}: the floor table (0005).
FUNCTIONS_SQL = rf"""
-- Advance every epoch and the floor by p_by, in one transaction. The floor is locked first, then
-- every row (FOR UPDATE: waits for acquires, renewals, releases and fenced writes in flight, whose
-- fence checks lock rows FOR KEY SHARE), the order acquire's insert path and prune take them in.
-- Refuses (SQLSTATE 22023) a p_by outside 1..{MAX_ADVANCED_EPOCH}, and (22003, numeric_value_out_of_range)
-- an advance that would leave an epoch or the floor above {MAX_ADVANCED_EPOCH}: nothing is changed then.
-- Returns one row: the rows advanced, how many of them were held (their holders are now fenced),
-- the new floor and the new highest epoch (the floor when there is no row). p_dry_run: change nothing.
CREATE FUNCTION {{s}}.pg_lease_advance_epochs(p_by bigint, p_dry_run boolean DEFAULT false)
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
  IF p_by IS NULL OR p_by < 1 OR p_by > {MAX_ADVANCED_EPOCH} THEN
    RAISE EXCEPTION 'invalid_input: by must be between 1 and {MAX_ADVANCED_EPOCH}, got %', p_by
      USING ERRCODE = '22023';
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  IF p_dry_run THEN
    SELECT f.floor INTO old_floor FROM {{f}} f;
  ELSE
    SELECT f.floor INTO old_floor FROM {{f}} f FOR UPDATE;
    PERFORM 1 FROM {{t}} l ORDER BY l.key FOR UPDATE;
  END IF;
  now_at := clock_timestamp();
  SELECT count(*), count(*) FILTER (WHERE {{s}}.pg_lease_status(l.owner, l.expires_at, now_at) = 'held'),
         greatest(max(l.epoch), old_floor)
    INTO n_rows, n_held, top FROM {{t}} l;
  IF top > {MAX_ADVANCED_EPOCH} - p_by THEN
    RAISE EXCEPTION 'epoch_overflow: advancing by % would raise epoch % to %, above the limit {MAX_ADVANCED_EPOCH}',
                    p_by, top, top::numeric + p_by
      USING ERRCODE = '22003', HINT = 'Advance by less: nothing was changed.';
  END IF;
  IF NOT p_dry_run THEN
    UPDATE {{f}} f SET floor = f.floor + p_by;
    UPDATE {{t}} l SET epoch = l.epoch + p_by;
  END IF;
  RETURN QUERY SELECT n_rows, n_held, old_floor + p_by, top + p_by, now_at;
END $$;
REVOKE EXECUTE ON FUNCTION {{s}}.pg_lease_advance_epochs(bigint, boolean) FROM PUBLIC;
"""

DROP_SQL = r"""
DROP FUNCTION IF EXISTS {s}.pg_lease_advance_epochs(bigint, boolean);
"""


def _floor(template: str) -> str:
    """Name the floor table as {f} beside 0001's {s} and {t} (filled in by schema_sql)."""
    return template.replace("{f}", '{s}."pg_lease_django_epoch_floor"')


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0006_notify_waiters")]

    operations = [schema_sql(_floor(FUNCTIONS_SQL), DROP_SQL)]
