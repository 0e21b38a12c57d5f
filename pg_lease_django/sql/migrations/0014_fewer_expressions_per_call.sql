-- Migration 0014: fewer expressions per call.
--
-- Written by `python -m devkit.sqlchange fewer_expressions_per_call` from sql/schema.sql, the source:
-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).
-- * changed function pg_lease_acquire(text, text, interval) (definition)
-- * changed function pg_lease_heartbeat(text, text, bigint, interval) (definition)
-- * changed function pg_lease_release(text, text, bigint) (definition)
-- * changed function pg_lease_guard_update() (definition)

-- Acquire (non-blocking). Granted when the key is free, lapsed, or held by this same owner
-- (self-takeover: a new epoch, so the owner's earlier incarnation is fenced). A key without a row
-- starts above the epoch floor.
-- * It looks without locking first: refusing a held key takes no row lock and writes no WAL, so
--   waiters polling a held key never slow down its holder's renewals. The input checks and the key
--   scope are one inline condition; the TTL is converted and durability asked for only on the way
--   to a grant.
-- * The attempt on an existing row is one UPDATE in a subtransaction, rolled back when the row was
--   taken meanwhile: rolling back a subtransaction is the only way to drop a row lock before the
--   transaction ends, so a refused waiter never keeps the winner from renewing.
-- * That UPDATE names the key column, so it locks FOR UPDATE, the one mode that conflicts with a
--   fence's FOR KEY SHARE: a takeover waits for every fenced transaction of the old holder to end.
-- * It marks its grant (acquired_at = -infinity) and hands the TTL over as released_at = the Unix
--   epoch + TTL; pg_lease_guard_update stamps it with one clock read taken under the row lock, after
--   any wait: expiry = server_now + TTL exactly. (The SET list is computed before the wait, and two
--   clock_timestamp() calls differ.) It leaves expires_at out of its SET list, so the renewal rule
--   (pg_lease_judge_renewal) is not even looked at.
-- * Durability: an acknowledged grant must survive a crash, or the same epoch could be granted
--   twice; synchronous_commit is raised to 'on' for this transaction when it is lower.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  cur record;
  now_at timestamptz;
  ttl interval;
  first_epoch bigint;
  result @extschema@.pg_lease_attempt;
BEGIN
  -- The owner's and the TTL's rules (pg_lease_check_name, pg_lease_ttl) and the key scope, as one
  -- condition; they raise when it fails. Input first, then the key scope: a bad key is invalid_input
  -- whoever sends it. A key or an owner is any non-empty text (PostgreSQL's text holds no NUL): what a
  -- person reads of it is escaped where it is shown (pg_lease_django.display), not refused here. The
  -- key's own rules are tested only where no row has it (the table's constraints hold every row to
  -- them): each test here would be compiled for every call (~2,000 instructions a function).
  IF p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
     OR p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400
     OR NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    ttl := @extschema@.pg_lease_ttl(p_ttl);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;

  LOOP  -- again when the row changed between the unlocked look and the UPDATE
    -- Look without locking first: refusing a held key takes no row lock and writes no WAL.
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF NOT FOUND THEN
      IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255 THEN  -- no row has it: is it a key?
        PERFORM @extschema@.pg_lease_check_name('key', p_key);
      END IF;
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
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
        result := ROW(true, p_key, p_owner, first_epoch, now_at + ttl, now_at);
        RETURN NEXT result;
        RETURN;
      EXCEPTION WHEN SQLSTATE 'PLR03' THEN
        NULL;  -- a concurrent acquire inserted the key first: decide on its row below
      END;
    ELSIF cur.owner <> p_owner THEN  -- (nested: a free row never compiles the status)
      IF @extschema@.pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held' THEN
        result := ROW(false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp());
        RETURN NEXT result;
        RETURN;
      END IF;
    END IF;

    -- Acquirable at the look: one UPDATE in a subtransaction, rolled back when it finds the row taken
    -- meanwhile (an UPDATE that waited for the row and then fails its WHERE keeps the row locked; the
    -- rollback drops that lock). key = l.key: lock FOR UPDATE, which waits for the old holder's fenced
    -- transactions (FOR KEY SHARE). acquired_at = -infinity: pg_lease_guard_update stamps the grant
    -- with one clock read taken under the row lock, after any wait; the TTL reaches it as released_at
    -- = the Unix epoch + TTL (exact seconds, as pg_lease_ttl makes it).
    BEGIN
      UPDATE @extschema@."pg_lease_django_lease" l
         SET key = l.key, owner = p_owner, epoch = l.epoch + 1, acquired_at = '-infinity',
             released_at = 'epoch'::timestamptz + make_interval(secs => extract(epoch FROM p_ttl)::double precision)
       WHERE l.key = p_key AND (l.owner IS NULL OR l.owner = p_owner OR l.expires_at <= clock_timestamp())
      RETURNING true, p_key, p_owner, l.epoch, l.expires_at, l.acquired_at INTO result;
      IF NOT FOUND THEN
        RAISE EXCEPTION USING ERRCODE = 'PLR01';
      END IF;
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      RETURN NEXT result;
      RETURN;
    EXCEPTION WHEN SQLSTATE 'PLR01' THEN
      NULL;  -- taken (or pruned) since the look: look again
    END;
  END LOOP;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval) FROM PUBLIC;

-- Renew (heartbeat): extend a live lease held by (owner, epoch) to server_now + TTL, never changing
-- the epoch, and say whether a hand-off was requested: what the package sends for every renewal.
-- One UPDATE ... WHERE key AND owner AND epoch AND expires_at > clock_timestamp(), judged again
-- under the row lock (pg_lease_judge_renewal); the row is read afterwards only when it found
-- nothing, to name the verdict in the spec's precedence. A refused renewal writes nothing, and locks
-- nothing unless it waited for the row (then the lock lasts until the caller's transaction ends).
-- It sets no key column, so it locks FOR NO KEY UPDATE, which does not conflict with a fence's FOR
-- KEY SHARE: a long fenced transaction never starves its own heartbeat. A renewal that waited on a
-- lock-only locker extends from its clock read before the wait: a little early, never late.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS SETOF @extschema@.pg_lease_renewal
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  result @extschema@.pg_lease_renewal;
  cur record;
BEGIN
  -- The TTL's rules (pg_lease_ttl) and the key scope, as one condition; the checks raise when it
  -- fails, inputs first. A key, owner or epoch that breaks an input rule matches no row (the table's
  -- constraints hold every row to them, and epochs start at 1), so they are checked on the way to a
  -- refusal, before the verdict: each test here would be compiled for every call (~2,000
  -- instructions a function). The TTL is written into the row, so it is tested before the UPDATE.
  IF p_ttl IS NULL OR extract(month FROM p_ttl) <> 0 OR extract(year FROM p_ttl) <> 0
     OR NOT extract(epoch FROM p_ttl) BETWEEN 0.001 AND 365 * 86400
     OR NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    PERFORM @extschema@.pg_lease_ttl(p_ttl);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;
  LOOP  -- again only if the row turned valid between the UPDATE and the look (it cannot, by the rules)
    -- The TTL in exact seconds, as pg_lease_ttl makes it; the clock read is the new expiry less it.
    UPDATE @extschema@."pg_lease_django_lease" l
       SET expires_at = clock_timestamp() + make_interval(secs => extract(epoch FROM p_ttl)::double precision)
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING 'ok', l.expires_at, l.expires_at - make_interval(secs => extract(epoch FROM p_ttl)::double precision),
              l.handoff_requested_at IS NOT NULL INTO result;
    IF FOUND THEN
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      RETURN NEXT result;
      RETURN;
    END IF;
    IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
       OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
       OR p_epoch IS NULL OR p_epoch < 1 THEN  -- matched no row: the inputs' rules first
      PERFORM @extschema@.pg_lease_check_name('key', p_key);
      PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
      PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    result := ROW(@extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()),
                  NULL, clock_timestamp(), false);
    IF result.outcome <> 'ok' THEN
      RETURN NEXT result;
      RETURN;
    END IF;
  END LOOP;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval) FROM PUBLIC;

-- Release: free a live lease held by (owner, epoch) and bump the epoch, fencing the old holder;
-- wake waiters. One UPDATE as in pg_lease_heartbeat, judged again under the row lock by
-- pg_lease_guard_update, which stamps released_at with the clock it read and clears expires_at (left
-- out of the SET list, so the renewal rule is not even looked at). It sets the key column, so it
-- locks FOR UPDATE and waits for the holder's fenced transactions (FOR KEY SHARE). The waiters are
-- woken as pg_lease_wake_waiters says, written out here (a call costs a statement of its own).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
RETURNS SETOF @extschema@.pg_lease_release_outcome
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  result @extschema@.pg_lease_release_outcome;
  cur record;
  last_until timestamptz;
BEGIN
  -- Only the key scope before the UPDATE: a key, owner or epoch that breaks an input rule matches no
  -- row (the table's constraints hold every row to them, and epochs start at 1), so they are checked
  -- on the way to a refusal, before the verdict, in the same order. Each input test here would be
  -- compiled for every call (~2,000 instructions a function).
  IF NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  END IF;
  LOOP  -- as in pg_lease_heartbeat
    -- key = l.key: lock FOR UPDATE (waits for fenced transactions); -infinity: pg_lease_guard_update
    -- judges it again under the lock and stamps the clock it read.
    UPDATE @extschema@."pg_lease_django_lease" l
       SET key = l.key, owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, released_at = '-infinity'
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING 'ok', l.epoch, l.released_at INTO result;
    IF FOUND THEN
      IF current_setting('synchronous_commit') <> 'on' THEN
        PERFORM set_config('synchronous_commit', 'on', true);
      END IF;
      -- pg_lease_wake_waiters, inline.
      IF pg_try_advisory_xact_lock(@extschema@.pg_lease_waiter_lock(p_key)) THEN
        DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.key = p_key RETURNING w.until INTO last_until;
        IF FOUND THEN  -- (nested: with nobody waiting, the comparison is never compiled)
          IF last_until > clock_timestamp() THEN
            PERFORM pg_notify('pg_lease_django', p_key);
          END IF;
        END IF;
      ELSE
        PERFORM pg_notify('pg_lease_django', p_key);
      END IF;
      RETURN NEXT result;
      RETURN;
    END IF;
    IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
       OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
       OR p_epoch IS NULL OR p_epoch < 1 THEN  -- matched no row: the inputs' rules first
      PERFORM @extschema@.pg_lease_check_name('key', p_key);
      PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
      PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    result := ROW(@extschema@.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp()),
                  cur.epoch, clock_timestamp());
    IF result.outcome <> 'ok' THEN
      RETURN NEXT result;
      RETURN;
    END IF;
  END LOOP;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_release(text, text, bigint) FROM PUBLIC;

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
--    grants (acquired_at = -infinity, the TTL handed over as released_at = the Unix epoch + TTL)
--    with that clock read, and clears a release's expiry.
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
  -- The expressions a statement reaches are compiled for it, each function in them looked up and
  -- its EXECUTE privilege checked (~2,000 instructions a function): the common cases, a grant and a
  -- release (a new epoch, the same key), reach the fewest, and a key nobody records one test of
  -- its flags.
  IF NEW.epoch OPERATOR(pg_catalog.>) OLD.epoch AND NEW.key OPERATOR(pg_catalog.=) OLD.key THEN
    NEW.handoff_requested_at := NULL;
    IF NEW.acquired_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
      -- a grant by pg_lease_acquire: expiry = this clock read + the TTL it handed over in released_at
      now_at := pg_catalog.clock_timestamp();
      NEW.expires_at := now_at OPERATOR(pg_catalog.+)
        pg_catalog.make_interval(secs => pg_catalog.date_part('epoch', NEW.released_at));
      NEW.acquired_at := now_at;
      NEW.released_at := NULL;
    END IF;
  ELSIF NEW.key OPERATOR(pg_catalog.<>) OLD.key OR NEW.epoch OPERATOR(pg_catalog.<) OLD.epoch
        OR (NEW.owner IS NULL) OPERATOR(pg_catalog.<>) (OLD.owner IS NULL) OR NEW.owner OPERATOR(pg_catalog.<>) OLD.owner THEN
    -- (the epoch did not rise here: a change of owner is a rewrite)
    RAISE EXCEPTION 'lease rows keep their key, and their epoch only grows, with each new owner '
                    '(lease %: epoch % -> %, owner % -> %)', OLD.key, OLD.epoch, NEW.epoch, OLD.owner, NEW.owner
      USING ERRCODE = '23514',
            HINT = 'Use the lease functions (pg_lease_acquire, pg_lease_release, pg_lease_force_release).';
  END IF;

  -- A marker left (a release's, or either on the same epoch): -infinity is the least timestamptz, so
  -- LEAST (which skips NULLs and compares with the type's own order, no operator looked up) finds it.
  IF LEAST(NEW.released_at, NEW.acquired_at) OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
    now_at := pg_catalog.clock_timestamp();
    IF OLD.expires_at OPERATOR(pg_catalog.<=) now_at THEN
      RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
    END IF;
    IF NEW.released_at OPERATOR(pg_catalog.=) '-infinity'::pg_catalog.timestamptz THEN
      -- a release: stamped with this clock read; pg_lease_release leaves the expiry to this trigger
      NEW.released_at := now_at;
      IF NEW.owner IS NULL THEN
        NEW.expires_at := NULL;
      END IF;
    END IF;
  END IF;

  IF NEW.recorded OR OLD.recorded THEN  -- rules 4 and 5 concern recorded rows only
    IF NEW.recorded AND NEW.epoch OPERATOR(pg_catalog.<>) OLD.epoch THEN
      PERFORM @extschema@.pg_lease_record_tenure('UPDATE'::pg_catalog.text, OLD, NEW);
    END IF;
    IF NEW.recorded OPERATOR(pg_catalog.<>) OLD.recorded THEN
      IF NEW.recorded OPERATOR(pg_catalog.<>) @extschema@.pg_lease_in_history_scope(NEW.key) THEN
        RAISE EXCEPTION 'lease %: recorded follows the history scope (pg_lease_django_history_scope)', NEW.key
          USING ERRCODE = '23514', HINT = 'Change the scope (PG_LEASE_HISTORY, then migrate), not the flag.';
      END IF;
    END IF;
  END IF;
  RETURN NEW;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_update() FROM PUBLIC;
