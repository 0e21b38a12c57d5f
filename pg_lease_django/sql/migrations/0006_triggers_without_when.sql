-- 0006: the lease table's update rules filtered without a WHEN clause to parse (issue 31). Every rule
-- is kept, whoever writes.
--
-- PostgreSQL parses a trigger's WHEN clause from its stored text and compiles it for every UPDATE
-- statement. pg_lease_guard_update's seven conditions cost about 110,000 instructions a statement
-- (callgrind, PostgreSQL 15): more than calling the function they were there to avoid (~45,000), and
-- a renewal, for which they were false, paid them too. Now:
-- * pg_lease_guard_update fires for an UPDATE that sets key, owner, epoch, acquired_at, released_at
--   or recorded (a column list: a bitmap test against the statement's SET list, nothing parsed). It
--   applies every rule as before but one, restated here without it:
-- * pg_lease_judge_renewal, after it, for an UPDATE that sets expires_at, with a one-comparison WHEN
--   (OLD.expires_at <= clock_timestamp()), is that rule's one place: the renewal of a lapsed lease
--   (same epoch, a new expiry) is judged under the row lock and skipped.
-- Per acquire+release pair of the SQL functions: 1,396,000 -> 1,193,000 instructions; per renewal
-- 600,000 -> 506,000; the hand-written UPDATE pair on the lease table 1,195,000 -> 995,000 against
-- 878,000 on a plain table (make bench-instructions, PostgreSQL 15).

DROP TRIGGER pg_lease_guard_update ON @extschema@."pg_lease_django_lease";

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_guard_update()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
AS $$
DECLARE
  now_at pg_catalog.timestamptz;
BEGIN
  IF NEW.epoch OPERATOR(pg_catalog.<>) OLD.epoch AND NEW.handoff_requested_at IS NOT NULL THEN
    NEW.handoff_requested_at := NULL;
  END IF;

  IF NEW.key OPERATOR(pg_catalog.<>) OLD.key OR NEW.epoch OPERATOR(pg_catalog.<) OLD.epoch
     OR (NEW.epoch OPERATOR(pg_catalog.=) OLD.epoch
         AND ((NEW.owner IS NULL) OPERATOR(pg_catalog.<>) (OLD.owner IS NULL)
              OR NEW.owner OPERATOR(pg_catalog.<>) OLD.owner)) THEN
    RAISE EXCEPTION 'lease rows keep their key, and their epoch only grows, with each new owner '
                    '(lease %: epoch % -> %, owner % -> %)', OLD.key, OLD.epoch, NEW.epoch, OLD.owner, NEW.owner
      USING ERRCODE = '23514',
            HINT = 'Use the lease functions (pg_lease_acquire, pg_lease_release, pg_lease_force_release).';
  END IF;

  IF NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz
     OR NEW.acquired_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
    now_at := pg_catalog.clock_timestamp();
    IF NEW.acquired_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz
       AND NEW.epoch OPERATOR(pg_catalog.<>) OLD.epoch THEN
      -- a grant by pg_lease_acquire (always a new epoch): expiry = this clock read + TTL
      NEW.expires_at := now_at OPERATOR(pg_catalog.+)
        pg_catalog.make_interval(secs => pg_catalog.date_part('epoch', NEW.expires_at));
      NEW.acquired_at := now_at;
    ELSIF OLD.expires_at OPERATOR(pg_catalog.<=) now_at THEN
      RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
    ELSIF NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
      NEW.released_at := now_at;
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
