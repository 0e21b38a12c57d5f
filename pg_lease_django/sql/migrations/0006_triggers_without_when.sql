-- 0006: the lease table's update rules filtered without a WHEN clause to parse (issue 31). Every rule
-- is kept, whoever writes.
--
-- PostgreSQL parses a trigger's WHEN clause from its stored text and compiles it for every UPDATE
-- statement. pg_lease_guard_update's seven conditions cost about 110,000 instructions a statement
-- (callgrind, PostgreSQL 15): more than calling the function they were there to avoid (~45,000), and
-- a renewal, for which they were false, paid them too. Now:
-- * pg_lease_guard_update fires for an UPDATE that sets key, owner, epoch, acquired_at, released_at
--   or recorded (a column list: a bitmap test against the statement's SET list, nothing parsed). Its
--   body is unchanged: it applies every rule as before, each guarded by its own condition.
-- * pg_lease_judge_renewal, after it, for an UPDATE that sets expires_at, with a one-comparison WHEN
--   (OLD.expires_at <= clock_timestamp()): the renewal of a lapsed lease (same epoch, a new expiry)
--   is judged under the row lock and skipped, as pg_lease_guard_update did for it.
-- Per acquire+release pair of the SQL functions: 1,385,000 -> 1,195,000 instructions; per renewal
-- 591,000 -> 497,000; the hand-written UPDATE pair on the lease table 1,190,000 -> 1,003,000 against
-- 874,000 on a plain table.

DROP TRIGGER pg_lease_guard_update ON @extschema@."pg_lease_django_lease";

-- Fires for every UPDATE that sets a column one of the rules above is about: no column changes
-- unless the statement sets it (only these triggers change NEW). A renewal (expires_at) and a
-- hand-off request (handoff_requested_at) pass it by.
CREATE TRIGGER pg_lease_guard_update
  BEFORE UPDATE OF "key", "owner", "epoch", "acquired_at", "released_at", "recorded"
  ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW EXECUTE FUNCTION @extschema@.pg_lease_guard_update();

-- Rule 3 for an UPDATE that sets only the expiry (a renewal, whoever sends it): judged under the row
-- lock, it skips the row when the lease has lapsed and the epoch is unchanged (a lapsed epoch is not
-- brought back, a shorter expiry included). Its WHEN clause is one comparison, cheap to parse for each
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
