-- 0005: the lease table's BEFORE UPDATE rules as one trigger with one small WHEN clause; a cheaper
-- key-scope check and waiter wake-up (issue 31). Every rule is kept, whoever writes.
--
-- * PostgreSQL parses and compiles each trigger's WHEN clause for every UPDATE statement: the five
--   BEFORE UPDATE triggers (pg_lease_clear_handoff, pg_lease_forbid_rewrite,
--   pg_lease_recheck_under_lock, pg_lease_record_transition, pg_lease_recorded_follows_scope) cost an
--   acquire+release pair about 30 us of server CPU and a renewal 12 us, against 14 and 5 us for one
--   trigger, pg_lease_guard_update, whose WHEN holds whenever one of the rules may apply. Its body
--   applies the five rules in the order the five triggers fired (their names' order). It runs as the
--   owner (SECURITY DEFINER, no SET clause: every name in it carries its schema), as the triggers that
--   wrote the history did: a role granted UPDATE on the table by hand keeps moving leases on.
-- * pg_lease_record_tenure(op, old, new): the tenure bookkeeping, called by that trigger for an
--   UPDATE and by pg_lease_record_transition for INSERT and DELETE.
-- * pg_lease_check_key_scope: an index probe, and the prefixes only for a role that has some (was
--   an aggregate: 4.5 -> 3.0 us a call, two calls a pair).
-- * pg_lease_wake_waiters: DELETE ... RETURNING INTO (the key is the primary key), no aggregate.
-- * pg_lease_acquire and pg_lease_release: restated for their comments, which name the new trigger.
-- * pg_lease_insert_above_floor refuses the markers ('-infinity'): a raw INSERT stored them, and every
--   later UPDATE of the row was then stamped or skipped.
-- * A grant marker counts only with a new epoch, and any change of the expiry on the same epoch of a
--   lapsed lease is judged under the lock (a shorter renewal too): neither brings a lapsed epoch back.

DROP TRIGGER pg_lease_clear_handoff ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_forbid_rewrite ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_recheck_under_lock ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_record_transition ON @extschema@."pg_lease_django_lease";
DROP TRIGGER pg_lease_recorded_follows_scope ON @extschema@."pg_lease_django_lease";
DROP FUNCTION @extschema@.pg_lease_clear_handoff();
DROP FUNCTION @extschema@.pg_lease_forbid_rewrite();
DROP FUNCTION @extschema@.pg_lease_recheck_under_lock();
DROP FUNCTION @extschema@.pg_lease_recorded_follows_scope();

-- Record a transition of a recorded lease row in its tenures: p_op is 'INSERT' (a grant to a new
-- key, p_old NULL), 'UPDATE' (the row's epoch changed) or 'DELETE' (a prune, p_new NULL). Runs as
-- the owner, in the statement of the transition: called by pg_lease_guard_update and by the
-- INSERT and DELETE triggers (pg_lease_record_transition), only for recorded keys.
CREATE FUNCTION @extschema@.pg_lease_record_tenure(
  p_op text, p_old @extschema@."pg_lease_django_lease", p_new @extschema@."pg_lease_django_lease")
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  now_at timestamptz;
  reason text;
  ended timestamptz;
  by_whom text;
BEGIN
  IF p_op <> 'INSERT' AND p_old.owner IS NOT NULL THEN  -- the tenure of p_old ends here
    now_at := CASE WHEN p_new.owner IS NULL THEN coalesce(p_new.released_at, clock_timestamp())  -- a release
                   WHEN p_new.acquired_at IS DISTINCT FROM p_old.acquired_at THEN p_new.acquired_at  -- a grant
                   ELSE clock_timestamp() END;  -- an epoch advance
    IF p_op = 'DELETE' OR p_old.expires_at <= now_at THEN
      -- It had lapsed: it ended at its expiry, whatever cleared the row (a take-over: by the new
      -- owner; a prune, an epoch advance: nobody; a force release: pg_lease_force_release adds who).
      reason := 'lapsed'; ended := p_old.expires_at;
      by_whom := CASE WHEN p_op = 'UPDATE' AND p_new.owner IS DISTINCT FROM p_old.owner THEN p_new.owner END;
    ELSIF p_new.owner IS NULL THEN  -- a release (pg_lease_force_release relabels its own afterwards)
      reason := CASE WHEN p_old.handoff_requested_at IS NOT NULL THEN 'handed_off' ELSE 'released' END;
      ended := now_at; by_whom := p_old.owner;
    ELSIF p_new.acquired_at IS NOT DISTINCT FROM p_old.acquired_at THEN  -- epochs advanced under it
      reason := 'epochs_advanced'; ended := now_at; by_whom := session_user;
    ELSE
      reason := 'reacquired'; ended := p_new.acquired_at; by_whom := p_new.owner;
    END IF;
    UPDATE @extschema@."pg_lease_django_tenure" r
       SET ended_at = ended, end_reason = reason, ended_by = by_whom, ended_by_role = session_user
     WHERE r.key = p_old.key AND r.epoch = p_old.epoch AND r.ended_at IS NULL;
  END IF;

  IF p_op <> 'DELETE' AND p_new.owner IS NOT NULL
     AND (p_op = 'INSERT' OR p_new.acquired_at IS DISTINCT FROM p_old.acquired_at) THEN  -- a grant
    INSERT INTO @extschema@."pg_lease_django_tenure" (key, epoch, owner, granted_at)
      VALUES (p_new.key, p_new.epoch, p_new.owner, p_new.acquired_at);
  END IF;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_record_tenure(text, @extschema@."pg_lease_django_lease", @extschema@."pg_lease_django_lease") FROM PUBLIC;

-- The INSERT and DELETE triggers' side of pg_lease_record_tenure (an UPDATE's is pg_lease_guard_update).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_record_transition()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  -- Fired only for recorded keys (the triggers' WHEN clauses test the row's `recorded`).
  PERFORM @extschema@.pg_lease_record_tenure(TG_OP, OLD, NEW);
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_record_transition() FROM PUBLIC;

-- The lease table guards itself, whoever writes it (the owner and superusers included), with one
-- BEFORE UPDATE trigger. PostgreSQL parses and compiles every trigger's WHEN clause for each UPDATE
-- statement: one small WHEN, true only when a rule below may apply, costs a renewal nothing else
-- (it enters no PL/pgSQL), and an acquire or a release one function. The rules, in this order:
-- 1. A hand-off request ends with the tenure it was made for: any change of epoch clears it.
-- 2. A row keeps its key, its epoch only grows, and the lease changes owner only with a new epoch
--    (else a stale fence would be current again).
-- 3. Judged under the row lock. PostgreSQL evaluates an UPDATE's WHERE before it locks the row: when
--    the row was *changed* meanwhile, READ COMMITTED judges it again on the new version, but when it
--    was only *locked* meanwhile (SELECT ... FOR UPDATE by anyone, a force release that found nothing
--    to do), nothing is judged again, and the lease may have lapsed while the call waited. Row
--    triggers run once the row is locked: this one reads the clock there and skips the row (the
--    UPDATE then finds nothing) when a renewal (same epoch, later expiry) or a release
--    (released_at = -infinity, replaced by the clock read) meets a lease that has lapsed, whoever
--    sends it: a plain UPDATE cannot bring back a lapsed epoch either (any change of the expiry on
--    the same epoch is judged, a shorter one too, and a grant marker counts only with a new epoch).
--    It stamps acquire's grants (acquired_at = -infinity, expires_at = the Unix epoch + TTL) with
--    that clock read.
--    tests/test_judged_under_lock.py forces each interleaving.
-- 4. A change of epoch of a recorded key is written to its tenures (pg_lease_record_tenure), with
--    the values stamped above.
-- 5. `recorded` follows the history scope: a writer may change it only to what the scope says.
-- It runs as the owner, as the triggers that wrote the history did: a role granted UPDATE on the
-- table by hand moves leases, and has them recorded, without EXECUTE on the owner's helpers. No SET
-- clause (it would cost a configuration switch on every acquire and release): every built-in,
-- operator, type and function is named with its schema (and the literal typed), so a writer's
-- search_path cannot stand in for any of them; the functions it calls pin their own.
CREATE FUNCTION @extschema@.pg_lease_guard_update()
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_update() FROM PUBLIC;

-- The WHEN clause holds whenever one of the rules above may apply (a superset of each rule's own
-- condition); a live renewal, and a hand-off request, pass it by.
CREATE TRIGGER pg_lease_guard_update BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW
  WHEN (NEW.epoch <> OLD.epoch OR NEW.key <> OLD.key OR NEW.owner IS DISTINCT FROM OLD.owner
        OR NEW.recorded <> OLD.recorded
        OR (NEW.expires_at <> OLD.expires_at AND OLD.expires_at <= clock_timestamp())
        OR NEW.released_at = '-infinity' OR NEW.acquired_at = '-infinity')
  EXECUTE FUNCTION @extschema@.pg_lease_guard_update();

-- Refuse a key outside the session role's key scope (pg_lease_django_key_scope). Called first by
-- every lease function: one index probe decides the usual case (a role without rows may use any
-- key); the prefixes are read only for a role that has some. No SET clause (every operation pays
-- it): only the lease functions call it (revoked from PUBLIC), under their pinned search_path, and
-- it names only exact-typed built-ins and its table.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_key_scope(p_key text)
RETURNS void LANGUAGE plpgsql STABLE
AS $$
BEGIN
  PERFORM FROM @extschema@."pg_lease_django_key_scope" s WHERE s.role = session_user LIMIT 1;
  IF FOUND THEN
    IF p_key IS NOT NULL AND NOT EXISTS (SELECT FROM @extschema@."pg_lease_django_key_scope" s
                                         WHERE s.role = session_user AND left(p_key, length(s.prefix)) = s.prefix) THEN
      RAISE EXCEPTION 'key_scope: role % may not use lease key %', session_user, p_key
        USING ERRCODE = '42501', HINT = 'PG_LEASE_KEY_SCOPES limits this role to the keys starting with its prefixes.';
    END IF;
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
  -- still refused registers again); an expired row goes without a notification. One row at most: the
  -- key is the waiter table's primary key.
  DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.key = p_key RETURNING w.until INTO last_until;
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
    -- transactions (FOR KEY SHARE). acquired_at = -infinity: pg_lease_guard_update stamps the
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
    -- key = l.key: lock FOR UPDATE (waits for fenced transactions); -infinity: pg_lease_guard_update
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
  IF NEW.acquired_at = '-infinity' OR NEW.released_at = '-infinity' THEN
    -- the lease functions' markers (pg_lease_guard_update stamps them on UPDATE): never stored
    RAISE EXCEPTION 'lease %: -infinity marks a grant or a release for the update trigger; it is not a time', NEW.key
      USING ERRCODE = '23514', HINT = 'Acquire the lease instead (pg_lease_acquire).';
  END IF;
  NEW.recorded := @extschema@.pg_lease_in_history_scope(NEW.key);  -- whatever the writer said
  RETURN NEW;
END $$;
