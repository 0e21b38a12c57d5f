-- Reverse of migration 0007: the functions as 0006 left them, the new objects dropped, the
-- triggers back to firing in origin and local mode only, row-level security off.

ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_forbid_delete;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_forbid_truncate;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_insert_above_floor;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_guard_update;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_judge_renewal;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_record_grant;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE TRIGGER pg_lease_record_prune;
ALTER TABLE @extschema@."pg_lease_django_epoch_floor" ENABLE TRIGGER pg_lease_floor_only_grows;
ALTER TABLE @extschema@."pg_lease_django_epoch_floor" ENABLE TRIGGER pg_lease_floor_kept;
ALTER TABLE @extschema@."pg_lease_django_history_scope" ENABLE TRIGGER pg_lease_rescope;

-- Acquire (non-blocking). Granted when the key is free, lapsed, or held by this same owner
-- (self-takeover: a new epoch, so the owner's earlier incarnation is fenced). A key without a row
-- starts above the epoch floor.
-- * It looks without locking first: refusing a held key takes no row lock and writes no WAL, so
--   waiters polling a held key never slow down its holder's renewals. The input checks are one
--   inline condition; the TTL is converted and synchronous_commit set only on the way to a grant.
-- * The attempt on an existing row is one UPDATE in a subtransaction, rolled back when the row was
--   taken meanwhile: rolling back a subtransaction is the only way to drop a row lock before the
--   transaction ends, so a refused waiter never keeps the winner from renewing.
-- * That UPDATE names the key column, so it locks FOR UPDATE, the one mode that conflicts with a
--   fence's FOR KEY SHARE: a takeover waits for every fenced transaction of the old holder to end.
-- * It marks its grant (acquired_at = -infinity, expires_at = the Unix epoch + TTL), and
--   pg_lease_guard_update stamps it with one clock read taken under the row lock, after any
--   wait: expiry = server_now + TTL exactly. (The SET list is computed before the wait, and two
--   clock_timestamp() calls differ.)
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval) FROM PUBLIC;

-- The attempt of a waiter that LISTENs on pg_lease_django: pg_lease_acquire(key, owner, ttl), and
-- when refused, a registration so that the next release of the key notifies, lasting until the
-- waiter's next attempt is due (p_retry_within, or the holder's expiry if sooner) plus a second.
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_or_register(text, text, interval, interval) FROM PUBLIC;

-- Renew (heartbeat): extend a live lease held by (owner, epoch) to server_now + TTL, never changing
-- the epoch, and say whether a hand-off was requested: what the package sends for every renewal.
-- One UPDATE ... WHERE key AND owner AND epoch AND expires_at > clock_timestamp(), judged again
-- under the row lock (pg_lease_guard_update); the row is read afterwards only when it found
-- nothing, to name the verdict in the spec's precedence. A refused renewal writes nothing, and locks
-- nothing unless it waited for the row (then the lock lasts until the caller's transaction ends).
-- It sets no key column, so it locks FOR NO KEY UPDATE, which does not conflict with a fence's FOR
-- KEY SHARE: a long fenced transaction never starves its own heartbeat. A renewal that waited on a
-- lock-only locker extends from its clock read before the wait: a little early, never late.
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval) FROM PUBLIC;

-- Release: free a live lease held by (owner, epoch) and bump the epoch, fencing the old holder;
-- wake waiters (pg_lease_wake_waiters). One UPDATE as in pg_lease_heartbeat, judged again under the
-- row lock, which stamps released_at with the clock it read. It sets the key column, so it locks
-- FOR UPDATE and waits for the holder's fenced transactions (FOR KEY SHARE).
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_release(text, text, bigint) FROM PUBLIC;

-- Inspect: the state at the server clock (lazy expiry: a lapsed row is reported 'lapsed'). A key
-- without a row is free at the epoch floor's epoch (0 until something is pruned).
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
  END IF;
  now_at := clock_timestamp();
  RETURN QUERY
    SELECT p_key, @extschema@.pg_lease_status(l.owner, l.expires_at, now_at), l.owner,
           coalesce(l.epoch, f.floor), l.expires_at, l.acquired_at, now_at
      FROM @extschema@."pg_lease_django_epoch_floor" f LEFT JOIN @extschema@."pg_lease_django_lease" l ON l.key = p_key;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_inspect(text) FROM PUBLIC;

-- Ask the holder of p_key (at p_epoch, when given) to step down at its next renewal. Advice only:
-- the grant is unchanged. Outcome 'ok' (requested now, or already), or why nobody can be asked:
-- 'not_found', 'free', 'lapsed', 'epoch_mismatch'. Locks like a renewal (FOR NO KEY UPDATE).
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_request_handoff(text, bigint) FROM PUBLIC;

-- Force release: free a held or lapsed lease and bump its epoch, fencing whoever held it; for a
-- human or a script breaking a stuck lease, never for workers. p_expected_epoch (NULL: any) makes
-- it conditional: refused with 'epoch_mismatch' when the lease moved on since the operator looked.
-- p_operator (NULL: the database role) is recorded in the history. Outcomes, in this order:
--   'not_found'      no row: the key was never acquired (epoch = the floor's)
--   'free'           nothing to release (epoch = the current one)
--   'epoch_mismatch' p_expected_epoch is not the current epoch (epoch = the current one)
--   'ok'             released; owner = the former holder, epoch = the new epoch
-- Locks FOR UPDATE like release. Operators only: revoked from PUBLIC.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_force_release(p_key text, p_expected_epoch bigint, p_operator text)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
BEGIN
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_force_release(text, bigint, text) FROM PUBLIC;

-- The fence check. Returns 'ok', 'not_owner', 'lapsed' or 'epoch_mismatch' and never raises for a
-- stale fence, so a guarded write can put it in its WHERE clause without aborting the caller's
-- transaction: UPDATE ... WHERE (SELECT pg_lease_fence(k, o, e)) = 'ok' (an uncorrelated sub-select
-- runs once per statement, before any row is touched).
-- * An unlocked look first: a stale fence (the common rejection) takes no lock and never waits.
-- * On 'ok' the lease row stays locked FOR KEY SHARE until the transaction ends: the holder's
--   renewals (FOR NO KEY UPDATE) go on, a takeover or a release (FOR UPDATE) waits for it.
-- * A fence that looks lapsed while its renewal may still be committing (decided before expiry,
--   not yet visible) waits for that renewal before answering, so a fence never answers 'lapsed'
--   and later 'ok'. The wait takes FOR SHARE (which conflicts with the renewal's lock) inside a
--   subtransaction that is always rolled back: nothing stays locked by the wait.
-- * On 'ok' the presented fence is recorded for this transaction in pg_lease.fences (a JSON object
--   key -> [owner, epoch]), which the fenced tables' triggers check their rows against. A refused
--   fence records nothing and leaves no lock, except when the lease changed between the unlocked
--   look and the lock (then the lock stays until the transaction ends, which a refused writer's
--   does promptly).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS text LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence(text, text, bigint) FROM PUBLIC;

-- Present a fence (the raising form, for raw SQL): returns p_epoch, so a write can both present the
-- fence and record it in one expression: SET lease_epoch = (SELECT pg_lease_check_fence(k, o, e)).
-- Raises PL001 not_owner, PL002 lapsed, PL003 epoch_mismatch; DETAIL carries the fence as JSON.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  verdict text;
BEGIN
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_fence(text, text, bigint) FROM PUBLIC;

-- Record a fence that holds as presented by this transaction (pg_lease.fences, a JSON object
-- key -> [owner, epoch]): what the fenced tables' triggers check their rows against. No SET
-- search_path (it costs a configuration switch per call on the hot path): its callers pin theirs,
-- it names only exact-typed built-ins, and called directly it only sets the caller's own setting.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_remember_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS void LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
  fences jsonb := coalesce(nullif(current_setting('pg_lease.fences', true), '')::jsonb, '{}'::jsonb);
BEGIN
  IF fences -> p_key IS DISTINCT FROM jsonb_build_array(p_owner, p_epoch) THEN
    PERFORM set_config('pg_lease.fences',
                       jsonb_set(fences, ARRAY[p_key], jsonb_build_array(p_owner, p_epoch))::text, true);
  END IF;
END $$;

-- Is p_token the opt-out of p_role in this backend and transaction? For any caller: it reveals
-- nothing a 256-bit token would not.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_opt_out_valid(p_token text, p_role name)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT p_token = @extschema@.pg_lease_opt_out_token(p_role) $$;

-- Check one lease key written by a statement: the transaction presented a fence for it, and that
-- fence holds now (locking the lease row FOR KEY SHARE until the transaction ends).
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_key(text, jsonb, text) FROM PUBLIC;

-- Trigger of a fenced table (one carrying lease_key and lease_epoch), after each INSERT, UPDATE
-- and DELETE statement, over its transition tables: every lease key the statement wrote or
-- removed (old and new keys: moving a row to another lease needs both) has a live fence in this
-- transaction; every written row records that fence's epoch; no row's epoch goes backwards.
-- Once per statement, not per row: all or nothing, and cheap for large writes.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_guard_rows()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  fences jsonb;
  r record;
  epoch bigint;
  rows_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
BEGIN
  -- coalesce: NULL AND f() still calls f() (the result could be false), and this runs on every write.
  IF coalesce(current_setting('pg_lease.unfenced', true), '') <> '' AND @extschema@.pg_lease_unfenced_allowed() THEN
    RETURN NULL;
  END IF;
  fences := coalesce(nullif(current_setting('pg_lease.fences', true), '')::jsonb, '{}'::jsonb);
  IF TG_OP = 'INSERT' THEN
    FOR r IN SELECT n.lease_key AS key, NULL::bigint AS old_max, min(n.lease_epoch) AS new_min,
                    max(n.lease_epoch) AS new_max, count(*) - count(n.lease_epoch) AS new_nulls
               FROM pg_lease_new n GROUP BY n.lease_key LOOP
      epoch := @extschema@.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.new_nulls > 0 OR r.new_min <> epoch OR r.new_max <> epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows must record lease_epoch %s, the epoch of the fence presented for lease %s',
                 rows_table, epoch, r.key));
      END IF;
    END LOOP;
  ELSIF TG_OP = 'UPDATE' THEN
    FOR r IN SELECT k.key, max(k.old_epoch) AS old_max, min(k.new_epoch) AS new_min,
                    max(k.new_epoch) AS new_max, count(*) FILTER (WHERE k.is_new AND k.new_epoch IS NULL) AS new_nulls,
                    count(*) FILTER (WHERE k.is_new) AS new_rows
               FROM (SELECT o.lease_key AS key, o.lease_epoch AS old_epoch, NULL::bigint AS new_epoch, false AS is_new
                       FROM pg_lease_old o
                     UNION ALL
                     SELECT n.lease_key, NULL, n.lease_epoch, true FROM pg_lease_new n) k
              GROUP BY k.key LOOP
      IF r.key IS NULL AND r.new_rows = 0 THEN
        CONTINUE;  -- rows stored before they named a lease (upgraded tables) may take a key
      END IF;
      epoch := @extschema@.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.new_nulls > 0 OR r.new_min <> epoch OR r.new_max <> epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows must record lease_epoch %s, the epoch of the fence presented for lease %s',
                 rows_table, epoch, r.key));
      END IF;
      IF r.old_max > epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows of lease %s were written at epoch %s, above the fence''s %s: row epochs never go backwards',
                 rows_table, r.key, r.old_max, epoch));
      END IF;
    END LOOP;
  ELSE  -- DELETE
    FOR r IN SELECT o.lease_key AS key, max(o.lease_epoch) AS old_max FROM pg_lease_old o GROUP BY o.lease_key LOOP
      epoch := @extschema@.pg_lease_guard_key(r.key, fences, rows_table);
      IF r.old_max > epoch THEN
        PERFORM @extschema@.pg_lease_refuse('epoch_mismatch', r.key, fences -> r.key ->> 0, epoch,
          format('%s rows of lease %s were written at epoch %s, above the fence''s %s',
                 rows_table, r.key, r.old_max, epoch));
      END IF;
    END LOOP;
  END IF;
  RETURN NULL;
END $$;

-- Trigger of a multi-table-inheritance child of a fenced model: its rows carry no lease columns,
-- so their keys are read from the fenced ancestor's table, joined on the shared primary key
-- (TG_ARGV: the ancestor table, its primary key column, this table's primary key column). The
-- epoch is recorded and checked on the ancestor's row; here, every key needs a live fence.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_guard_inherited_rows()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  fences jsonb;
  k text;
  rows_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
  rows_sql text;
BEGIN
  -- coalesce: NULL AND f() still calls f() (the result could be false), and this runs on every write.
  IF coalesce(current_setting('pg_lease.unfenced', true), '') <> '' AND @extschema@.pg_lease_unfenced_allowed() THEN
    RETURN NULL;
  END IF;
  fences := coalesce(nullif(current_setting('pg_lease.fences', true), '')::jsonb, '{}'::jsonb);
  rows_sql := CASE TG_OP WHEN 'INSERT' THEN format('SELECT %I AS pk FROM pg_lease_new', TG_ARGV[2])
                         WHEN 'DELETE' THEN format('SELECT %I AS pk FROM pg_lease_old', TG_ARGV[2])
                         ELSE format('SELECT %1$I AS pk FROM pg_lease_old UNION SELECT %1$I FROM pg_lease_new',
                                     TG_ARGV[2]) END;
  FOR k IN EXECUTE format('SELECT DISTINCT a.lease_key FROM (%s) r LEFT JOIN %s a ON a.%I = r.pk',
                          rows_sql, TG_ARGV[0], TG_ARGV[1]) LOOP
    PERFORM @extschema@.pg_lease_guard_key(k, fences, rows_table);
  END LOOP;
  RETURN NULL;
END $$;

-- TRUNCATE of a fenced table: refused, like any unfenced write, unless this transaction opted
-- out or the database allows truncation (test databases, as for the lease table).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_guard_truncate()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF @extschema@.pg_lease_unfenced_allowed()
     OR (current_setting('pg_lease.allow_truncate', true) = 'on'
         AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE')) THEN
    RETURN NULL;
  END IF;
  RAISE EXCEPTION 'unfenced: TRUNCATE of fenced table %.% without opting out',
                  quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
    USING ERRCODE = 'PL004', DETAIL = json_build_object('key', NULL, 'owner', NULL, 'epoch', NULL)::text,
          HINT = 'Lease rows and fenced rows are never deleted wholesale (every epoch would restart). In tests, set TEST_RUNNER = ''pg_lease_django.testing.LeaseTestRunner'', or use pytest-django (the pg_lease_django pytest plugin): both allow TRUNCATE on test databases only. Data repair: a role that may opt out runs SELECT pg_lease_allow_unfenced() first, in the same transaction.';
END $$;

-- Record a transition of a recorded lease row in its tenures: p_op is 'INSERT' (a grant to a new
-- key, p_old NULL), 'UPDATE' (the row's epoch changed) or 'DELETE' (a prune, p_new NULL). Runs as
-- the owner, in the statement of the transition: called by pg_lease_guard_update and by the
-- INSERT and DELETE triggers (pg_lease_record_transition), only for recorded keys.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_record_tenure(
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

-- What each declared role is granted (PG_LEASE_WORKER_ROLES, PG_LEASE_OPERATOR_ROLES; applied by
-- `migrate` and `manage.py leases grant`): every function above that locks, reveals or changes a
-- lease is revoked from PUBLIC. A worker runs the four operations and writes fenced rows (the
-- fenced tables' triggers call pg_lease_guard_key as the writer); an operator may do what a worker
-- may, plus force release, ask for a hand-off, opt out of fencing and read the lease and history
-- tables. 'runbook' rows (pg_lease_prune, pg_lease_advance_epochs) are granted to nobody: they stay
-- with the owner unless granted by hand to an operator. 'public' rows are what every role may run.
-- Check W008 reports any other privilege on the package's functions and tables. A migration that
-- adds a function restates this one. By hand:
--   SELECT format('GRANT %s ON %s %s TO app_worker', privilege, kind, object)
--     FROM pg_lease_privileges() WHERE role = 'worker' \gexec
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_privileges()
RETURNS TABLE (role text, kind text, object text, privilege text)
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT w.role, w.kind, w.object, w.privilege FROM (VALUES
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire(text, text, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire(text, text, interval, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire_or_register(text, text, interval, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_heartbeat(text, text, bigint, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_renew(text, text, bigint, interval)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_release(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_inspect(text)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_fence(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_fence_outcome(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_check_fence(text, text, bigint)', 'EXECUTE'),
    ('worker', 'FUNCTION', '@extschema@.pg_lease_guard_key(text, jsonb, text)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_request_handoff(text, bigint)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_force_release(text, bigint)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_force_release(text, bigint, text)', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_allow_unfenced()', 'EXECUTE'),
    ('operator', 'FUNCTION', '@extschema@.pg_lease_opt_out_token(name)', 'EXECUTE'),
    ('operator', 'TABLE', '@extschema@."pg_lease_django_lease"', 'SELECT'),
    ('operator', 'TABLE', '@extschema@."pg_lease_django_tenure"', 'SELECT'),
    -- The runbook's (failover, restore, maintenance): granted to nobody, an operator may be granted them.
    ('runbook', 'FUNCTION', '@extschema@.pg_lease_prune(interval, boolean)', 'EXECUTE'),
    ('runbook', 'FUNCTION', '@extschema@.pg_lease_advance_epochs(bigint, boolean)', 'EXECUTE'),
    -- What every role may run, through PUBLIC: pure helpers, and what the triggers call as the writer.
    ('public', 'FUNCTION', '@extschema@.pg_lease_status(text, timestamptz, timestamptz)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_name(text, text)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_ttl(interval)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_epoch(bigint)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_ttl(interval)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_verdict(text, bigint, timestamptz, text, bigint, timestamptz)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_remember_fence(text, text, bigint)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_refuse(text, text, text, bigint, text)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_unfenced_allowed()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_opt_out_valid(text, name)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_privileges()', 'EXECUTE')
  ) w (role, kind, object, privilege)
$$;

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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_key_scope(text) FROM PUBLIC;

-- The explicit opt-out: fenced tables accept this transaction's writes without a fence (data
-- repair, fixtures, admin edits), for the role that opted out. pg_lease_allow_unfenced() sets
-- pg_lease.unfenced to a token minted from the owner's secret for the current role, this backend
-- and this transaction; pg_lease_unfenced_allowed() (what the triggers ask) checks it for the role
-- writing. The variable set by hand (to anything) never opts out, and a token minted inside an
-- owner-run function is the owner's: it does not outlive that function for its caller.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_opt_out_token(p_role name)
RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT encode(sha256(convert_to(s.secret || '/' || p_role::text || '/' || pg_backend_pid()::text || '/'
                                  || extract(epoch FROM now())::text, 'UTF8')), 'hex')
    FROM @extschema@."pg_lease_django_secret" s
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_opt_out_token(name) FROM PUBLIC;

DROP TRIGGER pg_lease_key_scope_changed ON @extschema@."pg_lease_django_key_scope";
DROP FUNCTION @extschema@.pg_lease_key_scope_changed();
DROP FUNCTION @extschema@.pg_lease_compile_key_scope();
DROP FUNCTION @extschema@.pg_lease_session_scope();
DROP FUNCTION @extschema@.pg_lease_check_lease_quota(text);
DROP FUNCTION @extschema@.pg_lease_opt_out_hash(name);
DROP FUNCTION @extschema@.pg_lease_presented_fences();
DROP FUNCTION @extschema@.pg_lease_replication_apply();
DROP FUNCTION @extschema@.pg_lease_check_key_scopes(text[]);
DROP FUNCTION @extschema@.pg_lease_check_new_name(text, text);
DROP FUNCTION @extschema@.pg_lease_unshown_characters();
DROP FUNCTION @extschema@.pg_lease_metrics(text, integer, boolean);
DROP POLICY pg_lease_read ON @extschema@."pg_lease_django_key_scope";
ALTER TABLE @extschema@."pg_lease_django_key_scope" DISABLE ROW LEVEL SECURITY;
ALTER TABLE @extschema@."pg_lease_django_secret" DISABLE ROW LEVEL SECURITY;
DROP TABLE @extschema@."pg_lease_django_role_limit";
