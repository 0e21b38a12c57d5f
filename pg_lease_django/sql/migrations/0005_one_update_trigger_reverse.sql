-- Reverse of 0005: the five BEFORE UPDATE triggers, pg_lease_record_transition with its own body,
-- and the earlier pg_lease_check_key_scope, pg_lease_wake_waiters, pg_lease_acquire, pg_lease_release.

DROP TRIGGER pg_lease_guard_update ON @extschema@."pg_lease_django_lease";
DROP FUNCTION @extschema@.pg_lease_guard_update();

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
    UPDATE @extschema@."pg_lease_django_tenure" r
       SET ended_at = ended, end_reason = reason, ended_by = by_whom, ended_by_role = session_user
     WHERE r.key = OLD.key AND r.epoch = OLD.epoch AND r.ended_at IS NULL;
  END IF;

  IF TG_OP <> 'DELETE' AND NEW.owner IS NOT NULL
     AND (TG_OP = 'INSERT' OR NEW.acquired_at IS DISTINCT FROM OLD.acquired_at) THEN  -- a grant
    INSERT INTO @extschema@."pg_lease_django_tenure" (key, epoch, owner, granted_at) VALUES (NEW.key, NEW.epoch, NEW.owner, NEW.acquired_at);
  END IF;
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

DROP FUNCTION @extschema@.pg_lease_record_tenure(text, @extschema@."pg_lease_django_lease", @extschema@."pg_lease_django_lease");

CREATE TRIGGER pg_lease_record_transition BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW WHEN (NEW.epoch IS DISTINCT FROM OLD.epoch AND NEW.recorded) EXECUTE FUNCTION @extschema@.pg_lease_record_transition();

-- The lease table guards itself, whoever writes it: an UPDATE may never lower an epoch, change
-- the key, or hand the lease to another owner without raising the epoch (that would make a stale
-- fence current again). Checked in the trigger's WHEN clause, so legal updates call no function.
CREATE FUNCTION @extschema@.pg_lease_forbid_rewrite()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'lease rows keep their key, and their epoch only grows, with each new owner '
                  '(lease %: epoch % -> %, owner % -> %)', OLD.key, OLD.epoch, NEW.epoch, OLD.owner, NEW.owner
    USING ERRCODE = '23514',
          HINT = 'Use the lease functions (pg_lease_acquire, pg_lease_release, pg_lease_force_release).';
END $$;

CREATE TRIGGER pg_lease_forbid_rewrite BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW
  WHEN (NEW.key <> OLD.key OR NEW.epoch < OLD.epoch
        OR (NEW.owner IS DISTINCT FROM OLD.owner AND NEW.epoch = OLD.epoch))
  EXECUTE FUNCTION @extschema@.pg_lease_forbid_rewrite();

-- Judged under the row lock. PostgreSQL evaluates an UPDATE's WHERE before it locks the row: when the
-- row was *changed* meanwhile, READ COMMITTED judges it again on the new version, but when it was
-- only *locked* meanwhile (SELECT ... FOR UPDATE by anyone, a force release that found nothing to
-- do), nothing is judged again, and the lease may have lapsed while the call waited. Row triggers
-- run once the row is locked: this one reads the clock there and skips the row (the UPDATE then
-- finds nothing) when a renewal (same epoch, later expiry) or a release (released_at = -infinity,
-- replaced by the clock read) meets a lease that has lapsed, whoever sends it: a plain UPDATE can
-- no longer bring back a lapsed epoch either. It also stamps acquire's grants (see pg_lease_acquire).
-- tests/test_judged_under_lock.py forces each interleaving. No SET clause (it would cost a
-- configuration switch on every acquire and release): every built-in, operator and type is named
-- with its schema, so a writer's search_path cannot stand in for any of them.
CREATE FUNCTION @extschema@.pg_lease_recheck_under_lock()
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_recheck_under_lock() FROM PUBLIC;

-- After the row lock is granted (row triggers run then), with the clock read there.
CREATE TRIGGER pg_lease_recheck_under_lock BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW
  WHEN ((NEW.epoch = OLD.epoch AND NEW.expires_at > OLD.expires_at AND OLD.expires_at <= clock_timestamp())
        OR NEW.released_at = '-infinity' OR NEW.acquired_at = '-infinity')
  EXECUTE FUNCTION @extschema@.pg_lease_recheck_under_lock();

-- `recorded` follows the scope: a writer may change it only to what the scope says (the flag is
-- what keeps a key's history, so nobody turns it off by hand).
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

-- A hand-off request ends with the tenure it was made for: any change of epoch clears it, whoever
-- writes. The WHEN clause is true only while a request is pending, so it costs nothing otherwise.
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

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_key_scope(p_key text)
RETURNS void LANGUAGE plpgsql STABLE
AS $$
DECLARE
  allowed boolean;
BEGIN
  SELECT bool_or(left(p_key, length(s.prefix)) = s.prefix) INTO allowed
    FROM @extschema@."pg_lease_django_key_scope" s WHERE s.role = session_user;
  IF NOT allowed THEN
    RAISE EXCEPTION 'key_scope: role % may not use lease key %', session_user, p_key
      USING ERRCODE = '42501', HINT = 'PG_LEASE_KEY_SCOPES limits this role to the keys starting with its prefixes.';
  END IF;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_wake_waiters(p_key text)
RETURNS void LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
  last_until timestamptz;
BEGIN
  IF NOT pg_try_advisory_xact_lock(@extschema@.pg_lease_waiter_lock(p_key)) THEN
    -- A registration is in flight: it is not visible yet, so notify without looking.
    PERFORM pg_notify('pg_lease_django', p_key);
    RETURN;
  END IF;
  -- Every registration made before is committed and seen by this statement; a later one waits for
  -- this transaction and then finds the lease free. Every waiter is woken, so the rows go (a waiter
  -- still refused registers again); an expired row goes without a notification.
  WITH gone AS (DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.key = p_key RETURNING w.until)
  SELECT max(gone.until) INTO last_until FROM gone;
  IF last_until > clock_timestamp() THEN
    PERFORM pg_notify('pg_lease_django', p_key);
  END IF;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)
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
  granted_until timestamptz;
BEGIN
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  -- The rules of pg_lease_check_name and pg_lease_ttl as one condition; they raise when it fails.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    ttl := @extschema@.pg_lease_ttl(p_ttl);
  END IF;

  LOOP  -- again when the row changed between the unlocked look and the UPDATE
    -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF NOT FOUND THEN
      -- An acknowledged grant must survive a crash, or the same epoch could be granted twice.
      PERFORM set_config('synchronous_commit', 'on', true);
      ttl := @extschema@.pg_lease_ttl(p_ttl);
      -- Start above the floor. FOR SHARE waits for a prune in flight and keeps the next one (which
      -- locks the floor first) from committing until this grant does: no pruned epoch can slip in
      -- above the one read here. In a subtransaction, dropped with its lock when a concurrent
      -- acquire inserted the key first (only brand-new keys take this lock, and only a grant keeps it).
      BEGIN
        SELECT f.floor + 1 INTO first_epoch FROM @extschema@."pg_lease_django_epoch_floor" f FOR SHARE;
        now_at := clock_timestamp();
        INSERT INTO @extschema@."pg_lease_django_lease" AS l (key, owner, epoch, acquired_at, expires_at)
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
    ELSIF @extschema@.pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held'
          AND cur.owner <> p_owner THEN
      RETURN QUERY SELECT false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp();
      RETURN;
    END IF;

    -- Acquirable at the look: one UPDATE in a subtransaction, rolled back when it finds the row taken
    -- meanwhile (an UPDATE that waited for the row and then fails its WHERE keeps the row locked; the
    -- rollback drops that lock). key = l.key: lock FOR UPDATE, which waits for the old holder's fenced
    -- transactions (FOR KEY SHARE). acquired_at = -infinity: pg_lease_recheck_under_lock stamps the
    -- grant with one clock read taken under the row lock, after any wait; the TTL reaches it as
    -- expires_at = the Unix epoch + TTL.
    ttl := make_interval(secs => extract(epoch FROM p_ttl)::double precision);  -- as pg_lease_ttl
    BEGIN
      UPDATE @extschema@."pg_lease_django_lease" l SET key = l.key, owner = p_owner, epoch = l.epoch + 1, acquired_at = '-infinity',
                       expires_at = 'epoch'::timestamptz + ttl, released_at = NULL
       WHERE l.key = p_key AND (l.owner IS NULL OR l.owner = p_owner OR l.expires_at <= clock_timestamp())
      RETURNING l.epoch, l.acquired_at, l.expires_at INTO first_epoch, now_at, granted_until;
      IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PLR01';
      END IF;
      PERFORM set_config('synchronous_commit', 'on', true);
      RETURN QUERY SELECT true, p_key, p_owner, first_epoch, granted_until, now_at;
      RETURN;
    EXCEPTION WHEN SQLSTATE 'PLR01' THEN
      NULL;  -- taken (or pruned) since the look: look again
    END;
  END LOOP;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
RETURNS TABLE (outcome text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  new_epoch bigint;
  released timestamptz;
  cur record;
  verdict text;
BEGIN
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_epoch IS NULL OR p_epoch < 1 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  LOOP  -- as in pg_lease_heartbeat
    -- key = l.key: lock FOR UPDATE (waits for fenced transactions); -infinity: pg_lease_recheck_under_lock
    -- judges it again under the lock and stamps the clock it read.
    UPDATE @extschema@."pg_lease_django_lease" l SET key = l.key, owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                     released_at = '-infinity'
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING l.epoch, l.released_at INTO new_epoch, released;
    IF FOUND THEN
      PERFORM set_config('synchronous_commit', 'on', true);
      PERFORM @extschema@.pg_lease_wake_waiters(p_key);
      RETURN QUERY SELECT 'ok'::text, new_epoch, released;
      RETURN;
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
    IF verdict <> 'ok' THEN
      RETURN QUERY SELECT verdict, cur.epoch, clock_timestamp();
      RETURN;
    END IF;
  END LOOP;
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
  NEW.recorded := @extschema@.pg_lease_in_history_scope(NEW.key);  -- whatever the writer said
  RETURN NEW;
END $$;
