"""SQL functions that check a fence: is (key, owner, epoch) the live lease, right now?

``pg_lease_fence`` is the check FencedModel puts inside its writes; ``pg_lease_check_fence`` is the
raising form for raw SQL and triggers; ``pg_lease_fence_outcome`` tells a writer whose guarded
statement wrote nothing why. All three use ``pg_lease_verdict`` (0001): one rule, one place.
"""

from django.db import migrations

from ._sql import schema_sql

# {s} is the quoted schema the migration runs in (see 0001); {t} the quoted lease table.
FUNCTIONS_SQL = r"""
-- The fence check. Returns 'ok', 'not_owner', 'lapsed' or 'epoch_mismatch' and never raises for
-- a stale fence, so a guarded write can put it in its WHERE clause without aborting the caller's
-- transaction: UPDATE ... WHERE (SELECT pg_lease_fence(k, o, e)) = 'ok'. Written as an uncorrelated
-- sub-select it runs once per statement, before any row is touched (an InitPlan gating the scan).
--
-- On 'ok' the lease row stays locked FOR SHARE until the caller's transaction ends. That lock
-- conflicts with the FOR NO KEY UPDATE that acquire, renew and release take, so no ownership
-- change can commit between this check and the guarded write's commit: a takeover waits for the
-- guarded transaction, and a check that waited for a takeover sees the new epoch and refuses.
-- The clock is read after the lock, so the lapse decision uses server time after any wait.
--
-- The verdict is also left in the transaction-local setting pg_lease.fence_verdict, for a writer
-- that needs to know why its guarded statement wrote nothing (see pg_lease_fence_outcome).
CREATE FUNCTION {s}.pg_lease_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  -- NULLs would slip through pg_lease_verdict's comparisons: refuse them as invalid input.
  PERFORM pg_lease_check_name('key', p_key);
  PERFORM pg_lease_check_name('owner', p_owner);
  PERFORM pg_lease_check_epoch(p_epoch);
  -- Unlocked look first: a stale fence (the common rejection) takes no lock and never waits,
  -- so a fenced-out writer cannot delay the new holder's renewals or a takeover. The look is only
  -- a filter for "worth locking"; pg_lease_verdict decides, once.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  IF pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()) = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key FOR SHARE;
  END IF;
  verdict := pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  PERFORM set_config('pg_lease.fence_verdict', verdict, true);
  RETURN verdict;
END $$;

-- Why did a guarded statement write nothing? The verdict its pg_lease_fence call left in this
-- transaction (then cleared, so a later statement cannot read a stale one), or, when there is
-- none (the statement ran in its own transaction, or never reached the check), a fresh check.
-- A fresh check is faithful: a fence that was refused is never accepted later (epochs only grow
-- and a lapsed grant cannot be renewed); only the cause may have moved on (lapsed -> not_owner).
CREATE FUNCTION {s}.pg_lease_fence_outcome(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
DECLARE
  verdict text := nullif(current_setting('pg_lease.fence_verdict', true), '');
BEGIN
  IF verdict IS NULL THEN
    verdict := pg_lease_fence(p_key, p_owner, p_epoch);
  END IF;
  PERFORM set_config('pg_lease.fence_verdict', '', true);
  RETURN verdict;
END $$;

-- The raising form, for raw SQL and triggers: returns p_epoch when the fence holds (and keeps the
-- lease row locked FOR SHARE until the transaction ends, exactly as pg_lease_fence), else raises
--   PL001 not_owner, PL002 lapsed, PL003 epoch_mismatch   (22023 for invalid input).
-- Raising aborts the transaction: use it where a stale writer must fail, not where the caller
-- wants to carry on (use pg_lease_fence in the WHERE clause there).
CREATE FUNCTION {s}.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY INVOKER
SET search_path = pg_catalog, {s}, pg_temp
AS $$
DECLARE
  verdict text := pg_lease_fence(p_key, p_owner, p_epoch);
BEGIN
  IF verdict = 'ok' THEN
    RETURN p_epoch;
  END IF;
  RAISE EXCEPTION '%: lease % is not held by % at epoch %', verdict, p_key, p_owner, p_epoch
    USING ERRCODE = CASE verdict WHEN 'not_owner' THEN 'PL001' WHEN 'lapsed' THEN 'PL002' ELSE 'PL003' END,
          HINT = 'The lease was lost: stop acting on its behalf, or re-acquire it (new epoch) to continue.';
END $$;
"""

DROP_SQL = r"""
DROP FUNCTION IF EXISTS {s}.pg_lease_check_fence(text, text, bigint);
DROP FUNCTION IF EXISTS {s}.pg_lease_fence_outcome(text, text, bigint);
DROP FUNCTION IF EXISTS {s}.pg_lease_fence(text, text, bigint);
"""


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0001_initial")]

    operations = [schema_sql(FUNCTIONS_SQL, DROP_SQL)]
