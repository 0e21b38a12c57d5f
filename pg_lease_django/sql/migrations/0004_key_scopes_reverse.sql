-- Undoes 0004_key_scopes.sql: every function as 0003 left it, without key scopes.

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

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_acquire_or_register(p_key text, p_owner text, p_ttl interval, p_retry_within interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  attempt record;
  -- Whether this transaction wrote anything before this call (then its commit must stay durable).
  wrote_before boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
  saved_lock_timeout text := current_setting('lock_timeout');
  wait_ms double precision;
  locked boolean := false;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_retry_within IS NULL OR extract(year FROM p_retry_within) <> 0 OR extract(month FROM p_retry_within) <> 0
     OR extract(epoch FROM p_retry_within) < 0 OR extract(epoch FROM p_retry_within) > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: retry_within must be between 0 and 365 days, without months, got %',
      p_retry_within USING ERRCODE = '22023';
  END IF;
  -- A release of this key in flight holds the lock exclusively until it commits: wait for it, then
  -- the attempt finds the lease free. At most p_retry_within (and the caller's lock_timeout): the
  -- waiter would have slept that long anyway. Past it, attempt without registering: the table is
  -- written only under the key's lock (registrations shared, a release's deletions exclusive), so
  -- neither ever waits for the other's rows.
  wait_ms := greatest(1, ceil(extract(epoch FROM p_retry_within) * 1000));
  IF saved_lock_timeout::interval > interval '0' THEN
    wait_ms := least(wait_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
  END IF;
  BEGIN
    PERFORM set_config('lock_timeout', least(wait_ms, 2147483647)::bigint::text, true);
    PERFORM pg_advisory_xact_lock_shared(@extschema@.pg_lease_waiter_lock(p_key));
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    locked := true;
  EXCEPTION WHEN lock_not_available THEN
    NULL;  -- the subtransaction's rollback restored lock_timeout
  END;

  SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
  IF NOT attempt.granted AND locked THEN
    -- A refusal wrote nothing that must survive a crash, and a registration is gone after a crash
    -- anyway: unless the caller's transaction wrote before, its commit need not wait for a flush.
    IF NOT wrote_before THEN
      PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    INSERT INTO @extschema@."pg_lease_django_waiter" AS w (key, until)
      VALUES (p_key, least(clock_timestamp() + p_retry_within, attempt.expires_at) + interval '1 second')
      ON CONFLICT ON CONSTRAINT pg_lease_django_waiter_pkey DO UPDATE SET until = greatest(w.until, EXCLUDED.until);
  END IF;
  RETURN QUERY SELECT attempt.granted, attempt.key, attempt.owner, attempt.epoch,
                      attempt.expires_at, attempt.server_time;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz, handoff_requested boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  ttl interval;
  new_expiry timestamptz;
  handoff boolean;
  cur record;
  verdict text;
BEGIN
  -- The rules of pg_lease_check_name, pg_lease_check_epoch and pg_lease_ttl as one condition.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_epoch IS NULL OR p_epoch < 1
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    PERFORM @extschema@.pg_lease_ttl(p_ttl);
  END IF;
  ttl := make_interval(secs => extract(epoch FROM p_ttl)::double precision);  -- as pg_lease_ttl
  LOOP  -- again only if the row turned valid between the UPDATE and the look (it cannot, by the rules)
    UPDATE @extschema@."pg_lease_django_lease" l SET expires_at = clock_timestamp() + ttl
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING l.expires_at, l.handoff_requested_at IS NOT NULL INTO new_expiry, handoff;
    IF FOUND THEN
      PERFORM set_config('synchronous_commit', 'on', true);
      RETURN QUERY SELECT 'ok'::text, new_expiry, new_expiry - ttl, handoff;
      RETURN;
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
    IF verdict <> 'ok' THEN
      RETURN QUERY SELECT verdict, NULL::timestamptz, clock_timestamp(), false;
      RETURN;
    END IF;
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

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_inspect(p_key text)
RETURNS TABLE (key text, status text, owner text, epoch bigint, expires_at timestamptz,
               acquired_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  now_at timestamptz;
BEGIN
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
  END IF;
  now_at := clock_timestamp();
  RETURN QUERY
    SELECT p_key, @extschema@.pg_lease_status(l.owner, l.expires_at, now_at), l.owner,
           coalesce(l.epoch, f.floor), l.expires_at, l.acquired_at, now_at
      FROM @extschema@."pg_lease_django_epoch_floor" f LEFT JOIN @extschema@."pg_lease_django_lease" l ON l.key = p_key;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_request_handoff(p_key text, p_epoch bigint DEFAULT NULL)
RETURNS TABLE (outcome text, owner text, epoch bigint, expires_at timestamptz,
               requested_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_epoch IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at, l.handoff_requested_at INTO cur
    FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR NO KEY UPDATE;
  now_at := clock_timestamp();
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f), NULL::timestamptz,
                        NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF @extschema@.pg_lease_status(cur.owner, cur.expires_at, now_at) <> 'held' THEN
    RETURN QUERY SELECT @extschema@.pg_lease_status(cur.owner, cur.expires_at, now_at), cur.owner, cur.epoch,
                        cur.expires_at, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF p_epoch IS NOT NULL AND cur.epoch <> p_epoch THEN
    RETURN QUERY SELECT 'epoch_mismatch'::text, cur.owner, cur.epoch, cur.expires_at, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF cur.handoff_requested_at IS NULL THEN
    UPDATE @extschema@."pg_lease_django_lease" l SET handoff_requested_at = now_at WHERE l.key = p_key;
  END IF;
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch, cur.expires_at,
                      coalesce(cur.handoff_requested_at, now_at), now_at;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_force_release(p_key text, p_expected_epoch bigint, p_operator text)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_expected_epoch IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_epoch(p_expected_epoch);
  END IF;
  IF p_operator IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_name('operator', p_operator);
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f), clock_timestamp();
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
  UPDATE @extschema@."pg_lease_django_lease" l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                   released_at = clock_timestamp()
   WHERE l.key = p_key;
  -- The history trigger recorded a release (or a lapse); say who forced it. Only this function can:
  -- nothing a caller sets makes the trigger record a force release.
  UPDATE @extschema@."pg_lease_django_tenure" r SET end_reason = CASE WHEN r.end_reason = 'lapsed' THEN 'lapsed' ELSE 'force_released' END,
                   ended_by = coalesce(p_operator, session_user::text)
   WHERE r.key = p_key AND r.epoch = cur.epoch AND r.ended_at IS NOT NULL;
  PERFORM @extschema@.pg_lease_wake_waiters(p_key);
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch + 1, clock_timestamp();
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
  PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
  verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'lapsed' AND cur.epoch = p_epoch THEN
    BEGIN
      PERFORM 1 FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR SHARE;
      RAISE EXCEPTION USING ERRCODE = 'PLR01';
    EXCEPTION WHEN SQLSTATE 'PLR01' THEN
      NULL;  -- waited for any renewal in flight; the rollback dropped the lock
    END;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  END IF;
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR KEY SHARE;
    verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  END IF;
  IF verdict = 'ok' THEN
    PERFORM @extschema@.pg_lease_remember_fence(p_key, p_owner, p_epoch);
  END IF;
  RETURN verdict;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  -- Fast path, the holder presenting its live fence: an unlocked look (a stale fence takes no lock
  -- and writes nothing), then the lock and the decision. The match itself validates the inputs.
  -- Anything else takes pg_lease_fence's way: input checks, a renewal in flight awaited, the cause.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
  IF @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()) = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR KEY SHARE;
    IF @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()) = 'ok' THEN
      PERFORM @extschema@.pg_lease_remember_fence(p_key, p_owner, p_epoch);
      RETURN p_epoch;
    END IF;
  END IF;
  verdict := @extschema@.pg_lease_fence(p_key, p_owner, p_epoch);
  IF verdict = 'ok' THEN
    RETURN p_epoch;
  END IF;
  PERFORM @extschema@.pg_lease_refuse(verdict, p_key, p_owner, p_epoch,
                          format('lease %s is not held by %s at epoch %s', p_key, p_owner, p_epoch));
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_guard_key(p_key text, p_fences jsonb, p_table text)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  presented jsonb := p_fences -> p_key;
  cur record;
  verdict text;
BEGIN
  IF p_key IS NULL THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', NULL, NULL, NULL,
                            format('a row of %s names no lease key', p_table));
  END IF;
  IF presented IS NULL THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', p_key, NULL, NULL,
                            format('%s rows guarded by lease %s were written without a fence for it', p_table, p_key));
  END IF;
  -- One locked read decides the usual case (the fence was presented moments ago, and this
  -- transaction may already hold the lock); otherwise pg_lease_fence gives the exact cause.
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key FOR KEY SHARE;
  verdict := @extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, presented ->> 0,
                                  (presented ->> 1)::bigint, clock_timestamp());
  IF verdict <> 'ok' THEN
    verdict := @extschema@.pg_lease_fence(p_key, presented ->> 0, (presented ->> 1)::bigint);
  END IF;
  IF verdict <> 'ok' THEN
    PERFORM @extschema@.pg_lease_refuse(verdict, p_key, presented ->> 0, (presented ->> 1)::bigint,
                            format('lease %s is not held by %s at epoch %s', p_key, presented ->> 0, presented ->> 1));
  END IF;
  RETURN (presented ->> 1)::bigint;
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

DROP FUNCTION @extschema@.pg_lease_check_key_scope(text);
ALTER TABLE @extschema@."pg_lease_django_tenure" DROP COLUMN "ended_by_role";
DROP TABLE @extschema@."pg_lease_django_key_scope";
