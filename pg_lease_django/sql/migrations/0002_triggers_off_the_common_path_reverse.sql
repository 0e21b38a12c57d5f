-- Unapplies 0002: the lease table's triggers as 0001_baseline made them.

DROP TRIGGER pg_lease_record_grant ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_record_transition ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_record_prune ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_clear_handoff ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_recorded_follows_scope ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_rescope ON @extschema@."pg_lease_django_history_scope";
DROP FUNCTION @extschema@.pg_lease_clear_handoff();
DROP FUNCTION @extschema@.pg_lease_recorded_follows_scope();
DROP FUNCTION @extschema@.pg_lease_rescope();

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_record_transition()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  row_key text;
  now_at timestamptz;
  reason text;
  ended timestamptz;
  by_whom text;
BEGIN
  IF TG_OP = 'UPDATE' THEN
    NEW.handoff_requested_at := NULL;
    row_key := NEW.key;
  ELSIF TG_OP = 'INSERT' THEN
    row_key := NEW.key;
  ELSE
    row_key := OLD.key;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM @extschema@."pg_lease_django_history_scope" h WHERE left(row_key, length(h.prefix)) = h.prefix) THEN
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
  END IF;

  IF TG_OP <> 'INSERT' AND OLD.owner IS NOT NULL THEN  -- the tenure of OLD ends here
    now_at := CASE WHEN NEW.owner IS NULL THEN coalesce(NEW.released_at, clock_timestamp())  -- a release
                   WHEN NEW.acquired_at IS DISTINCT FROM OLD.acquired_at THEN NEW.acquired_at  -- a grant
                   ELSE clock_timestamp() END;  -- an epoch advance
    IF TG_OP = 'DELETE' OR OLD.expires_at <= now_at THEN
      -- It had lapsed: it ended at its expiry, whatever cleared the row (a take-over: by the new
      -- owner; a prune, an epoch advance: nobody; a force release: pg_lease_force_release adds who).
      reason := 'lapsed'; ended := OLD.expires_at;
      by_whom := CASE WHEN TG_OP = 'UPDATE' AND NEW.owner IS DISTINCT FROM OLD.owner THEN NEW.owner END;
    ELSIF NEW.owner IS NULL THEN  -- a release (pg_lease_force_release relabels its own afterwards)
      reason := CASE WHEN OLD.handoff_requested_at IS NOT NULL THEN 'handed_off' ELSE 'released' END;
      ended := now_at; by_whom := OLD.owner;
    ELSIF NEW.acquired_at IS NOT DISTINCT FROM OLD.acquired_at THEN  -- epochs advanced under it
      reason := 'epochs_advanced'; ended := now_at; by_whom := session_user;
    ELSE
      reason := 'reacquired'; ended := NEW.acquired_at; by_whom := NEW.owner;
    END IF;
    UPDATE @extschema@."pg_lease_django_tenure" r SET ended_at = ended, end_reason = reason, ended_by = by_whom
     WHERE r.key = OLD.key AND r.epoch = OLD.epoch AND r.ended_at IS NULL;
  END IF;

  IF TG_OP <> 'DELETE' AND NEW.owner IS NOT NULL
     AND (TG_OP = 'INSERT' OR NEW.acquired_at IS DISTINCT FROM OLD.acquired_at) THEN  -- a grant
    INSERT INTO @extschema@."pg_lease_django_tenure" (key, epoch, owner, granted_at) VALUES (NEW.key, NEW.epoch, NEW.owner, NEW.acquired_at);
  END IF;
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_recheck_under_lock()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  now_at timestamptz := clock_timestamp();
BEGIN
  IF NEW.acquired_at = '-infinity' THEN  -- a grant by pg_lease_acquire: expiry = this clock read + TTL
    NEW.expires_at := now_at + make_interval(secs => extract(epoch FROM NEW.expires_at)::double precision);
    NEW.acquired_at := now_at;
    RETURN NEW;
  END IF;
  IF OLD.expires_at <= now_at THEN
    RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
  END IF;
  NEW.released_at := CASE WHEN NEW.released_at = '-infinity' THEN now_at ELSE NEW.released_at END;
  RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_insert_above_floor()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NEW.epoch <= (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f) THEN
    RAISE EXCEPTION 'lease % may not start at epoch %: the epoch floor is above it', NEW.key, NEW.epoch
      USING ERRCODE = '23514', HINT = 'Acquire the lease instead (pg_lease_acquire).';
  END IF;
  RETURN NEW;
END $$;

CREATE TRIGGER pg_lease_record_grant AFTER INSERT ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.owner IS NOT NULL) EXECUTE FUNCTION @extschema@.pg_lease_record_transition();

CREATE TRIGGER pg_lease_record_transition BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.epoch IS DISTINCT FROM OLD.epoch) EXECUTE FUNCTION @extschema@.pg_lease_record_transition();

CREATE TRIGGER pg_lease_record_prune AFTER DELETE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (OLD.owner IS NOT NULL) EXECUTE FUNCTION @extschema@.pg_lease_record_transition();

DROP FUNCTION @extschema@.pg_lease_in_history_scope(text);
ALTER TABLE @extschema@."pg_lease_django_lease" DROP COLUMN "recorded";
