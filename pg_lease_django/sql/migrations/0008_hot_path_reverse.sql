-- Reverse of migration 0008: each object as 0007_tenants_apart left it; what 0008 made dropped.

-- Their privileges, kept across the DROP (a role granted EXECUTE by hand keeps it).
CREATE TEMPORARY TABLE pg_lease_kept_acl AS
SELECT p.oid::pg_catalog.regprocedure::pg_catalog.text AS signature, a.grantee, a.is_grantable
  FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
 WHERE p.oid IN ('@extschema@.pg_lease_acquire(text, text, interval)'::pg_catalog.regprocedure, '@extschema@.pg_lease_acquire(text, text, interval, interval)'::pg_catalog.regprocedure, '@extschema@.pg_lease_acquire_or_register(text, text, interval, interval)'::pg_catalog.regprocedure, '@extschema@.pg_lease_heartbeat(text, text, bigint, interval)'::pg_catalog.regprocedure, '@extschema@.pg_lease_release(text, text, bigint)'::pg_catalog.regprocedure, '@extschema@.pg_lease_inspect(text)'::pg_catalog.regprocedure) AND a.grantee <> p.proowner AND a.privilege_type = 'EXECUTE';

DROP FUNCTION @extschema@.pg_lease_acquire(text, text, interval);
DROP FUNCTION @extschema@.pg_lease_acquire(text, text, interval, interval);
DROP FUNCTION @extschema@.pg_lease_acquire_or_register(text, text, interval, interval);
DROP FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval);
DROP FUNCTION @extschema@.pg_lease_release(text, text, bigint);
DROP FUNCTION @extschema@.pg_lease_inspect(text);

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
CREATE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)
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
  -- The rules of pg_lease_check_new_name and pg_lease_ttl as one condition; they raise when it
  -- fails. Input first, then the key scope: a bad key is invalid_input whoever sends it.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_key ~ @extschema@.pg_lease_unshown_characters()
     OR p_owner ~ @extschema@.pg_lease_unshown_characters()
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400 THEN
    PERFORM @extschema@.pg_lease_check_new_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_new_name('owner', p_owner);
    ttl := @extschema@.pg_lease_ttl(p_ttl);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);

  LOOP  -- again when the row changed between the unlocked look and the UPDATE
    -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF NOT FOUND THEN
      -- An acknowledged grant must survive a crash, or the same epoch could be granted twice.
      PERFORM set_config('synchronous_commit', 'on', true);
      ttl := @extschema@.pg_lease_ttl(p_ttl);
      PERFORM @extschema@.pg_lease_check_lease_quota(p_key);  -- a new row: within PG_LEASE_ROLE_LIMITS
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

-- Acquire, waiting up to p_wait (NULL: no bound) for the key; SQLSTATE 57014 on timeout.
-- Polls inside one statement, sleeping until the holder's expiry (at most 100 ms at a time), so it
-- keeps a snapshot open while it waits: prefer the client-side wait (Python API) or short bounds
-- from SQL. A refused attempt leaves no row lock (see above): a waiter never slows the holder.
CREATE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval, p_wait interval)
RETURNS TABLE (granted boolean, key text, owner text, epoch bigint,
               expires_at timestamptz, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt record;
  deadline timestamptz;
BEGIN
  IF p_wait < interval '0' THEN
    RAISE EXCEPTION 'invalid_input: wait must not be negative, got %', p_wait USING ERRCODE = '22023';
  END IF;
  deadline := clock_timestamp() + p_wait;
  LOOP
    SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
    IF attempt.granted THEN
      RETURN QUERY SELECT attempt.granted, attempt.key, attempt.owner, attempt.epoch,
                          attempt.expires_at, attempt.server_time;
      RETURN;
    END IF;
    IF clock_timestamp() >= deadline THEN
      RAISE EXCEPTION 'timeout: lease % still held by % after waiting %', p_key, attempt.owner, p_wait
        USING ERRCODE = '57014';
    END IF;
    PERFORM pg_sleep(greatest(0.001, extract(epoch FROM
      least(attempt.expires_at, deadline, clock_timestamp() + interval '100 milliseconds')
      - clock_timestamp()))::double precision);
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval, interval) FROM PUBLIC;

-- The attempt of a waiter that LISTENs on pg_lease_django: pg_lease_acquire(key, owner, ttl), and
-- when refused, a registration so that the next release of the key notifies, lasting until the
-- waiter's next attempt is due (p_retry_within, or the holder's expiry if sooner) plus a second.
CREATE FUNCTION @extschema@.pg_lease_acquire_or_register(p_key text, p_owner text, p_ttl interval, p_retry_within interval)
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
CREATE FUNCTION @extschema@.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
CREATE FUNCTION @extschema@.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
CREATE FUNCTION @extschema@.pg_lease_inspect(p_key text)
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
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  now_at := clock_timestamp();
  RETURN QUERY
    SELECT p_key, @extschema@.pg_lease_status(l.owner, l.expires_at, now_at), l.owner,
           coalesce(l.epoch, f.floor), l.expires_at, l.acquired_at, now_at
      FROM @extschema@."pg_lease_django_epoch_floor" f LEFT JOIN @extschema@."pg_lease_django_lease" l ON l.key = p_key;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_inspect(text) FROM PUBLIC;

-- Renew: pg_lease_heartbeat without its hand-off column, for SQL clients, and for processes still
-- running a version before hand-offs during a rolling deploy.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_renew(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT h.outcome, h.expires_at, h.server_time FROM @extschema@.pg_lease_heartbeat(p_key, p_owner, p_epoch, p_ttl) h
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_renew(text, text, bigint, interval) FROM PUBLIC;

DO $$
DECLARE
  r record;
BEGIN
  FOR r IN SELECT * FROM pg_lease_kept_acl LOOP
    EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO %s%s', r.signature,
                              CASE WHEN r.grantee = 0 THEN 'PUBLIC' ELSE r.grantee::pg_catalog.regrole::pg_catalog.text END,
                              CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
  END LOOP;
END $$;
DROP TABLE pg_lease_kept_acl;

-- The lease table guards itself, whoever writes it (the owner and superusers included), with two
-- BEFORE UPDATE triggers that PostgreSQL filters before entering PL/pgSQL: this one by a column list
-- (it fires for an UPDATE that sets a column it guards: a bitmap test, nothing parsed), and
-- pg_lease_judge_renewal by a one-comparison WHEN (a change of expiry on a lease already past it).
-- A WHEN clause is parsed from its stored text and compiled for every UPDATE statement: the seven
-- conditions this trigger had cost each statement more than the function call they saved. A
-- renewal, which sets only expires_at, enters no PL/pgSQL. The rules, in this order:
-- 1. A hand-off request ends with the tenure it was made for: any change of epoch clears it.
-- 2. A row keeps its key, its epoch only grows, and the lease changes owner only with a new epoch
--    (else a stale fence would be current again).
-- 3. Judged under the row lock. PostgreSQL evaluates an UPDATE's WHERE before it locks the row: when
--    the row was *changed* meanwhile, READ COMMITTED judges it again on the new version, but when it
--    was only *locked* meanwhile (SELECT ... FOR UPDATE by anyone, a force release that found nothing
--    to do), nothing is judged again, and the lease may have lapsed while the call waited. Row
--    triggers run once the row is locked: this one reads the clock there and skips the row (the
--    UPDATE then finds nothing) when a release (released_at = -infinity, replaced by the clock read)
--    meets a lease that has lapsed, whoever sends it; a renewal, and any other change of the expiry
--    on the same epoch, is judged by pg_lease_judge_renewal (below), so a plain UPDATE cannot bring
--    back a lapsed epoch either (a grant marker counts only with a new epoch). It stamps acquire's
--    grants (acquired_at = -infinity, expires_at = the Unix epoch + TTL) with that clock read.
--    tests/test_judged_under_lock.py forces each interleaving.
-- 4. A change of epoch of a recorded key is written to its tenures (pg_lease_record_tenure), with
--    the values stamped above.
-- 5. `recorded` follows the history scope: a writer may change it only to what the scope says.
-- It runs as the owner, as the triggers that wrote the history did: a role granted UPDATE on the
-- table by hand moves leases, and has them recorded, without EXECUTE on the owner's helpers. No SET
-- clause (it would cost a configuration switch on every acquire and release): every built-in,
-- operator, type and function is named with its schema (and the literal typed), so a writer's
-- search_path cannot stand in for any of them; the functions it calls pin their own.
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

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_update() FROM PUBLIC;

-- Refuse a key outside the session's key scope (pg_lease_django_key_scope), SQLSTATE 42501. Called
-- by every lease function after its input checks. Its body is compiled from the scope table by
-- pg_lease_compile_key_scope (below), run by that table's trigger in the transaction that changes
-- it: no table is read per call, and no session can change what it runs (the owner's function).
-- Without scopes it is empty. With scopes, a key passes when it is under a prefix of a role the
-- session's login role is a member of (pg_has_role ... 'MEMBER', evaluated per call: a membership
-- granted or revoked counts at once; a role dropped or renamed matches nothing), or when the session
-- is the functions' owner (current_user inside them) or a member of it, superusers included.
-- Anything else is refused: a session with no effective scope cannot use any key. No SET clause:
-- only the lease functions call it (revoked from PUBLIC), under their pinned search_path, and the
-- compiled body names every function and operator with its schema.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_key_scope(p_key text)
RETURNS void LANGUAGE plpgsql STABLE
AS $$BEGIN END$$;

-- The body of pg_lease_check_key_scope for the scope table's rows (one condition per row, tested
-- prefix first so that only the rows whose prefix matches look at memberships). Owner-run: only
-- the owner may replace the function, and RLS keeps every other role from writing the table.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_compile_key_scope()
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  conditions text;
  body text := 'BEGIN END';
BEGIN
  SELECT string_agg(
           format('(%s pg_catalog.pg_has_role(session_user, pg_catalog.to_regrole(%L), ''MEMBER''))',
                  CASE WHEN s.prefix = '' THEN ''
                       ELSE format('pg_catalog.left(p_key, %s) OPERATOR(pg_catalog.=) %L AND', length(s.prefix), s.prefix) END,
                  quote_ident(s.role)),
           E'\n     OR ' ORDER BY s.role, s.prefix)
    INTO conditions FROM @extschema@."pg_lease_django_key_scope" s;
  IF conditions IS NOT NULL THEN
    body := format($body$
BEGIN
  IF %s THEN
    RETURN;
  END IF;
  IF pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
    RETURN;  -- the lease functions' owner (current_user in them) or a member of it; superusers
  END IF;
  RAISE EXCEPTION 'key_scope: role %% may not use lease key %%', session_user,
                  pg_catalog.left(p_key, 64) OPERATOR(pg_catalog.||) CASE WHEN pg_catalog.length(p_key) OPERATOR(pg_catalog.>) 64 THEN '...' ELSE '' END
    USING ERRCODE = '42501',
          HINT = 'PG_LEASE_KEY_SCOPES limits every role to the keys under the prefixes of the roles it is a member of.';
END$body$, conditions);
  END IF;
  EXECUTE format('CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_key_scope(p_key text) '
                 'RETURNS void LANGUAGE plpgsql STABLE AS %L', body);
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_compile_key_scope() FROM PUBLIC;

SELECT @extschema@.pg_lease_compile_key_scope();

DROP FUNCTION @extschema@.pg_lease_key_allowed(text);

DROP TYPE @extschema@.pg_lease_attempt, @extschema@.pg_lease_renewal, @extschema@.pg_lease_release_outcome, @extschema@.pg_lease_state;
