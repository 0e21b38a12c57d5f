-- Reverse of 0006: pg_lease_guard_update as 0005 made it (its body and its WHEN clause), without
-- pg_lease_judge_renewal.

DROP TRIGGER pg_lease_judge_renewal ON @extschema@."pg_lease_django_lease";
DROP FUNCTION @extschema@.pg_lease_judge_renewal();
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

  IF (NEW.epoch OPERATOR(pg_catalog.=) OLD.epoch AND NEW.expires_at OPERATOR(pg_catalog.<>) OLD.expires_at
      AND OLD.expires_at OPERATOR(pg_catalog.<=) pg_catalog.clock_timestamp())
     OR NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz
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

CREATE TRIGGER pg_lease_guard_update BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW
  WHEN (NEW.epoch <> OLD.epoch OR NEW.key <> OLD.key OR NEW.owner IS DISTINCT FROM OLD.owner
        OR NEW.recorded <> OLD.recorded
        OR (NEW.expires_at <> OLD.expires_at AND OLD.expires_at <= clock_timestamp())
        OR NEW.released_at = '-infinity' OR NEW.acquired_at = '-infinity')
  EXECUTE FUNCTION @extschema@.pg_lease_guard_update();
