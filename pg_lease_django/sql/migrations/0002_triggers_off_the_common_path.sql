-- 0002: the lease table's triggers cost nothing on the common path; every guarantee kept.
--
-- * History: each lease row carries `recorded` (its key is in the history scope), set by the
--   database: on insert by pg_lease_insert_above_floor, and for every row whenever the scope table
--   changes (pg_lease_rescope); no writer may set it otherwise (pg_lease_recorded_follows_scope).
--   The history triggers test it in their WHEN clause, which PostgreSQL evaluates without entering
--   PL/pgSQL: a transition of a key nobody records calls no function.
-- * Hand-off requests are cleared on every change of epoch by pg_lease_clear_handoff, whose WHEN
--   clause is true only while a request is pending (it was pg_lease_record_transition's job).
-- * pg_lease_recheck_under_lock carries no SET clause (it cost a configuration switch per acquire
--   and release) and names every built-in, operator and type with its schema.

ALTER TABLE @extschema@."pg_lease_django_lease" ADD COLUMN "recorded" boolean DEFAULT false NOT NULL;

-- Is p_key's history recorded? The one spelling of the scope rule ('' records every key). SHARE
-- conflicts with the ROW EXCLUSIVE of any write to the scope table: a scope change in flight is
-- waited for and then seen (each statement reads a new snapshot), and a later one waits for this
-- transaction, so its pg_lease_rescope sees a row inserted here. Owner-run: the writer of a lease
-- row needs no privilege on the scope table.
CREATE FUNCTION @extschema@.pg_lease_in_history_scope(p_key text)
RETURNS boolean LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  LOCK TABLE @extschema@."pg_lease_django_history_scope" IN SHARE MODE;
  RETURN EXISTS (SELECT 1 FROM @extschema@."pg_lease_django_history_scope" h WHERE left(p_key, length(h.prefix)) = h.prefix);
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_in_history_scope(text) FROM PUBLIC;

UPDATE @extschema@."pg_lease_django_lease" l SET recorded = true WHERE @extschema@.pg_lease_in_history_scope(l.key);

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_insert_above_floor()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NEW.epoch <= (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f) THEN
    RAISE EXCEPTION 'lease % may not start at epoch %: the epoch floor is above it', NEW.key, NEW.epoch
      USING ERRCODE = '23514', HINT = 'Acquire the lease instead (pg_lease_acquire).';
  END IF;
  NEW.recorded := @extschema@.pg_lease_in_history_scope(NEW.key);  -- whatever the writer said
  RETURN NEW;
END $$;

CREATE FUNCTION @extschema@.pg_lease_recorded_follows_scope()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF NEW.recorded IS DISTINCT FROM @extschema@.pg_lease_in_history_scope(NEW.key) THEN
    RAISE EXCEPTION 'lease %: recorded follows the history scope (pg_lease_django_history_scope)', NEW.key
      USING ERRCODE = '23514', HINT = 'Change the scope (PG_LEASE_HISTORY, then migrate), not the flag.';
  END IF;
  RETURN NEW;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_recorded_follows_scope() FROM PUBLIC;

CREATE TRIGGER pg_lease_recorded_follows_scope BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.recorded IS DISTINCT FROM OLD.recorded)
  EXECUTE FUNCTION @extschema@.pg_lease_recorded_follows_scope();

CREATE FUNCTION @extschema@.pg_lease_rescope()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  UPDATE @extschema@."pg_lease_django_lease" l SET recorded = NOT l.recorded
   WHERE l.recorded IS DISTINCT FROM @extschema@.pg_lease_in_history_scope(l.key);
  RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_rescope() FROM PUBLIC;

CREATE TRIGGER pg_lease_rescope AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
  ON @extschema@."pg_lease_django_history_scope"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_rescope();

CREATE FUNCTION @extschema@.pg_lease_clear_handoff()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  NEW.handoff_requested_at := NULL;
  RETURN NEW;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_clear_handoff() FROM PUBLIC;

CREATE TRIGGER pg_lease_clear_handoff BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.epoch IS DISTINCT FROM OLD.epoch AND NEW.handoff_requested_at IS NOT NULL)
  EXECUTE FUNCTION @extschema@.pg_lease_clear_handoff();

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_recheck_under_lock()
RETURNS trigger LANGUAGE plpgsql
AS $$
DECLARE
  now_at pg_catalog.timestamptz := pg_catalog.clock_timestamp();
BEGIN
  IF NEW.acquired_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
    -- a grant by pg_lease_acquire: expiry = this clock read + TTL
    NEW.expires_at := now_at OPERATOR(pg_catalog.+)
      pg_catalog.make_interval(secs => pg_catalog.date_part('epoch', NEW.expires_at));
    NEW.acquired_at := now_at;
    RETURN NEW;
  END IF;
  IF OLD.expires_at OPERATOR(pg_catalog.<=) now_at THEN
    RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
  END IF;
  IF NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
    NEW.released_at := now_at;
  END IF;
  RETURN NEW;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_record_transition()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  now_at timestamptz;
  reason text;
  ended timestamptz;
  by_whom text;
BEGIN
  -- Fired only for recorded keys (the triggers' WHEN clauses test the row's `recorded`).
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

DROP TRIGGER pg_lease_record_grant ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_record_transition ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_record_prune ON @extschema@."pg_lease_django_lease";

CREATE TRIGGER pg_lease_record_grant AFTER INSERT ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.owner IS NOT NULL AND NEW.recorded)
  EXECUTE FUNCTION @extschema@.pg_lease_record_transition();

CREATE TRIGGER pg_lease_record_transition BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.epoch IS DISTINCT FROM OLD.epoch AND NEW.recorded)
  EXECUTE FUNCTION @extschema@.pg_lease_record_transition();

CREATE TRIGGER pg_lease_record_prune AFTER DELETE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (OLD.owner IS NOT NULL AND OLD.recorded)
  EXECUTE FUNCTION @extschema@.pg_lease_record_transition();
