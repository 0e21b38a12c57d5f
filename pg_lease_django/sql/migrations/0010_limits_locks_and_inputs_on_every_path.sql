-- Migration 0010: limits locks and inputs on every path.
--
-- Written by `python -m devkit.sqlchange limits_locks_and_inputs_on_every_path` from sql/schema.sql, the source:
-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).
-- * changed function pg_lease_check_lease_quota(text) (definition)
-- * changed function pg_lease_acquire(text, text, interval) (definition)
-- * changed function pg_lease_acquire(text, text, interval, interval) (definition)
-- * changed function pg_lease_acquire_or_register(text, text, interval, interval) (definition)
-- * changed function pg_lease_check_fence(text, text, bigint) (definition)
-- * changed function pg_lease_presented_fences() (definition)
-- * changed function pg_lease_guard_key(text, jsonb, text) (definition)
-- * changed function pg_lease_in_history_scope(text) (definition)
-- * changed function pg_lease_rescope() (definition)
-- * changed function pg_lease_privileges() (definition)
-- * dropped function pg_lease_unshown_characters()
-- * dropped function pg_lease_check_new_name(text, text)

-- PG_LEASE_ROLE_LIMITS' max_leases, for a brand-new key (acquire's insert path, whoever calls):
-- refused with SQLSTATE 53400 (configuration_limit_exceeded) when a limited role's prefixes hold the
-- key and max_leases lease rows already. Counted through the key index (LIKE 'prefix%' on
-- text_pattern_ops), in one statement per limited role (overlapping prefixes count a row once). Free
-- rows count until `manage.py leases prune` deletes them. Called only on the way to a brand-new row.
-- * One count at a time per limited role: each locks its role's row of the limits table (FOR NO KEY
--   UPDATE, until its transaction ends) before counting. Row-level security lets no other role lock
--   that row (a locking SELECT needs an UPDATE policy, and there is none), so only the lease
--   functions take this lock; an advisory lock on a computable number could be taken by anyone.
-- * The count must see every grant committed before the lock was granted: only READ COMMITTED reads
--   a new snapshot per statement. A REPEATABLE READ or SERIALIZABLE transaction (or one that imported
--   a snapshot) counts as of its start, however it serialises, so a limited role's brand-new key is
--   refused there (0A000), as a key-scope change is; existing keys, and unlimited prefixes, are not.
--   (A counter row would conflict instead, but every prune, scope and limit change would have to
--   keep it exact; the refusal costs nothing and says what to do.)
-- * The lock wait is bounded by the caller's lock_timeout, which a waiter sets to its deadline
--   (pg_lease_acquire_or_register, and the SQL wait of pg_lease_acquire(..., p_wait)).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_lease_quota(p_key text)
RETURNS void LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  lim record;
  used bigint;
BEGIN
  FOR lim IN SELECT l.role, l.max_leases,
                    string_agg(format('l.key LIKE %L', replace(replace(replace(s.prefix, '\', '\\'), '%', '\%'), '_', '\_') || '%'),
                               ' OR ') AS condition
               FROM @extschema@."pg_lease_django_role_limit" l
               JOIN @extschema@."pg_lease_django_key_scope" s ON s.role = l.role
              WHERE l.max_leases IS NOT NULL
              GROUP BY l.role, l.max_leases
             HAVING bool_or(left(p_key, length(s.prefix)) = s.prefix)
              ORDER BY l.role LOOP
    IF current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
      RAISE EXCEPTION 'quota: a brand-new lease key under the limits of role % is made only in a READ COMMITTED transaction (this one is %)',
                      lim.role, current_setting('transaction_isolation')
        USING ERRCODE = 'feature_not_supported',
              HINT = 'A transaction that reads as of its start cannot count what PG_LEASE_ROLE_LIMITS allows; acquire new keys in READ COMMITTED (existing keys work at any level).';
    END IF;
    PERFORM 1 FROM @extschema@."pg_lease_django_role_limit" l WHERE l.role = lim.role FOR NO KEY UPDATE;
    EXECUTE format('SELECT count(*) FROM @extschema@."pg_lease_django_lease" l WHERE %s', lim.condition) INTO used;
    IF used >= lim.max_leases THEN
      RAISE EXCEPTION 'quota: role % may keep % lease rows under its key prefixes, and has % (lease key %)',
                      lim.role, lim.max_leases, used,
                      left(p_key, 64) || CASE WHEN length(p_key) > 64 THEN '...' ELSE '' END
        USING ERRCODE = '53400',
              HINT = 'Release and prune leases no longer used (manage.py leases prune), or raise PG_LEASE_ROLE_LIMITS.';
    END IF;
  END LOOP;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_lease_quota(text) FROM PUBLIC;

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
  -- The rules of pg_lease_check_name and pg_lease_ttl, and the key scope, as one condition;
  -- they raise when it fails. Input first, then the key scope: a bad key is invalid_input whoever
  -- sends it. A key or an owner is any non-empty text (PostgreSQL's text holds no NUL): what a
  -- person reads of it is escaped where it is shown (pg_lease_django.display), not refused here.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255
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
    ELSIF @extschema@.pg_lease_status(cur.owner, cur.expires_at, clock_timestamp()) = 'held'
          AND cur.owner <> p_owner THEN
      result := ROW(false, p_key, cur.owner, cur.epoch, cur.expires_at, clock_timestamp());
      RETURN NEXT result;
      RETURN;
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

-- Acquire, waiting up to p_wait (NULL: no bound) for the key; SQLSTATE 57014 on timeout.
-- Polls inside one statement, sleeping until the holder's expiry (at most 100 ms at a time), so it
-- keeps a snapshot open while it waits: prefer the client-side wait (Python API) or short bounds
-- from SQL. A refused attempt leaves no row lock (see above): a waiter never slows the holder. Every
-- lock wait of an attempt is bounded by what is left of p_wait (and the caller's lock_timeout):
-- never granted past the deadline.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval, p_wait interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt @extschema@.pg_lease_attempt;
  deadline timestamptz;
  saved_lock_timeout text := current_setting('lock_timeout');
  left_ms double precision;
BEGIN
  IF p_wait < interval '0' THEN
    RAISE EXCEPTION 'invalid_input: wait must not be negative, got %', p_wait USING ERRCODE = '22023';
  END IF;
  deadline := clock_timestamp() + p_wait;
  LOOP
    left_ms := greatest(1, ceil(extract(epoch FROM deadline - clock_timestamp()) * 1000));
    IF saved_lock_timeout::interval > interval '0' THEN
      left_ms := least(left_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
    END IF;
    IF deadline IS NOT NULL THEN
      PERFORM set_config('lock_timeout', least(left_ms, 2147483647)::bigint::text, true);
    END IF;
    BEGIN
      SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
    EXCEPTION WHEN lock_not_available THEN
      IF deadline IS NULL THEN
        RAISE;  -- the caller's own lock_timeout, with no deadline of its own
      END IF;
      attempt := ROW(false, p_key, NULL, NULL, clock_timestamp(), clock_timestamp());  -- busy: a refusal
    END;
    PERFORM set_config('lock_timeout', saved_lock_timeout, true);
    IF attempt.granted THEN
      RETURN NEXT attempt;
      RETURN;
    END IF;
    IF clock_timestamp() >= deadline THEN
      RAISE EXCEPTION 'timeout: lease % still held by % after waiting %', p_key, coalesce(attempt.owner, '(a lock it needs)'), p_wait
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
-- p_retry_within is never past the waiter's deadline, so it bounds every lock wait of the attempt
-- (with the caller's own lock_timeout, when shorter): the waiter lock, the limit row of a brand-new
-- key, the lease row a takeover waits for. An attempt whose lock wait ran out is answered as a
-- refusal naming the key's holder (NULL when nobody holds it: a lock it needs was busy), expiring
-- now: the waiter tries again, or times out at its deadline. Never granted past the deadline.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_acquire_or_register(p_key text, p_owner text, p_ttl interval, p_retry_within interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt @extschema@.pg_lease_attempt;
  -- Whether this transaction wrote anything before this call (then its commit must stay durable).
  wrote_before boolean := pg_current_xact_id_if_assigned() IS NOT NULL;
  saved_lock_timeout text := current_setting('lock_timeout');
  wait_ms double precision;
  locked boolean := false;
BEGIN
  -- Every input first (22023), then the key scope (42501), as in every lease function.
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
  PERFORM @extschema@.pg_lease_ttl(p_ttl);
  IF p_retry_within IS NULL OR extract(year FROM p_retry_within) <> 0 OR extract(month FROM p_retry_within) <> 0
     OR extract(epoch FROM p_retry_within) < 0 OR extract(epoch FROM p_retry_within) > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: retry_within must be between 0 and 365 days, without months, got %',
      p_retry_within USING ERRCODE = '22023';
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  -- A release of this key in flight holds the lock exclusively until it commits: wait for it, then
  -- the attempt finds the lease free. Past the bound, attempt without registering: the table is
  -- written only under the key's lock (registrations shared, a release's deletions exclusive), so
  -- neither ever waits for the other's rows.
  wait_ms := greatest(1, ceil(extract(epoch FROM p_retry_within) * 1000));
  IF saved_lock_timeout::interval > interval '0' THEN
    wait_ms := least(wait_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
  END IF;
  PERFORM set_config('lock_timeout', least(wait_ms, 2147483647)::bigint::text, true);
  BEGIN
    PERFORM pg_advisory_xact_lock_shared(@extschema@.pg_lease_waiter_lock(p_key));
    locked := true;
  EXCEPTION WHEN lock_not_available THEN
    NULL;
  END;

  BEGIN
    SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
  EXCEPTION WHEN lock_not_available THEN
    -- Busy past the bound: a refusal, naming the holder if there is one, to try again now.
    attempt := ROW(false, p_key, NULL, NULL, NULL, clock_timestamp());
    SELECT l.owner, l.epoch INTO attempt.owner, attempt.epoch FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF attempt.epoch IS NULL THEN
      SELECT f.floor INTO attempt.epoch FROM @extschema@."pg_lease_django_epoch_floor" f;
    END IF;
    attempt.expires_at := attempt.server_time;
    locked := false;
  END;
  IF NOT attempt.granted AND locked THEN
    -- A refusal wrote nothing that must survive a crash, and a registration is gone after a crash
    -- anyway: unless the caller's transaction wrote before, its commit need not wait for a flush.
    IF NOT wrote_before THEN
      PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    BEGIN  -- another registration of the key in an open transaction: not waited for past the bound
      INSERT INTO @extschema@."pg_lease_django_waiter" AS w (key, until)
        VALUES (p_key, least(clock_timestamp() + p_retry_within, attempt.expires_at) + interval '1 second')
        ON CONFLICT ON CONSTRAINT pg_lease_django_waiter_pkey DO UPDATE SET until = greatest(w.until, EXCLUDED.until);
    EXCEPTION WHEN lock_not_available THEN
      NULL;  -- that registration notifies this waiter too (one channel, the key as payload)
    END;
  END IF;
  PERFORM set_config('lock_timeout', saved_lock_timeout, true);
  RETURN NEXT attempt;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_or_register(text, text, interval, interval) FROM PUBLIC;

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
  -- Input first (22023), then the key scope (42501), then the lease: one condition, raising when it fails.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255 OR p_epoch IS NULL OR p_epoch < 1 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  -- Fast path, the holder presenting its live fence: an unlocked look (a stale fence takes no lock
  -- and writes nothing), then the lock and the decision. The match itself validates the owner and epoch.
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

-- The fences this transaction presented (pg_lease.fences, '{}' when none). The setting is written by
-- pg_lease_remember_fence; one set by hand that is not a JSON object (not JSON, too large, nested
-- too deep) is refused as 'unfenced' (PL004) with a message that says so, never a raw parse error. No SET clause (every fenced
-- write reads it): it names only exact-typed built-ins and its callers pin their search_path.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_presented_fences()
RETURNS jsonb LANGUAGE plpgsql STABLE
AS $$
DECLARE
  raw text := pg_catalog.current_setting('pg_lease.fences', true);
  fences jsonb;
BEGIN
  IF raw IS NULL OR raw OPERATOR(pg_catalog.=) '' THEN
    RETURN '{}'::jsonb;
  END IF;
  BEGIN
    fences := raw::jsonb;
  EXCEPTION WHEN data_exception OR program_limit_exceeded THEN
    fences := NULL;  -- not JSON, too large, or nested too deep (classes 22 and 54): malformed all the same
  END;
  IF pg_catalog.jsonb_typeof(fences) IS DISTINCT FROM 'object' THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', NULL, NULL, NULL,
      'pg_lease.fences is not a JSON object of lease key -> [owner, epoch]: pg_lease_check_fence() sets it, never a SET by hand');
  END IF;
  RETURN fences;
END $$;

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
  -- [owner, epoch] as pg_lease_remember_fence writes them, or PL004: a non-empty owner of at most 255
  -- bytes, an epoch from 1 (0 and -1 alike are no fence; anything else would meet the input checks).
  IF jsonb_typeof(presented) IS DISTINCT FROM 'array' OR jsonb_typeof(presented -> 0) IS DISTINCT FROM 'string'
     OR NOT octet_length(presented ->> 0) BETWEEN 1 AND 255
     OR NOT coalesce(presented ->> 1 ~ '^[1-9][0-9]{0,17}$', false) THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', p_key, NULL, NULL,
                            format('the fence presented for lease %s in pg_lease.fences is not [owner, epoch]', p_key));
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

-- Is p_key's history recorded? The one spelling of the scope rule ('' records every key). Reads the
-- scope table without a lock of its own (ACCESS SHARE, which no write of the table waits for; VOLATILE:
-- each call reads the scope as committed then): a
-- tenant that made a brand-new key and keeps its transaction open holds up neither `migrate` nor a
-- scope sync. A scope change meets brand-new keys on the epoch floor's row instead (pg_lease_rescope).
-- Owner-run: the writer of a lease row needs no privilege on the scope table. (Not compiled into a
-- function body as the key scopes are: a session sees a replaced body only when it next takes a
-- lock it does not hold yet, so a transaction that had written the lease table before could flag a
-- new key by the old scope after the change committed.)
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_in_history_scope(p_key text)
RETURNS boolean LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  RETURN EXISTS (SELECT 1 FROM @extschema@."pg_lease_django_history_scope" h WHERE left(p_key, length(h.prefix)) = h.prefix);
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_in_history_scope(text) FROM PUBLIC;

-- Any change of the scope table re-flags every lease row in the same transaction, whoever makes it.
-- A brand-new key is flagged by its insert trigger, which reads the scope as committed when it
-- runs; the two meet on the epoch floor's row, which every brand-new key locks FOR SHARE until its
-- transaction ends: this rewrites it (FOR NO KEY UPDATE), so it waits for the brand-new keys in
-- flight and then re-flags them, and a later one waits for this commit and reads the new scope (or,
-- in a transaction that reads as of its start, fails with 40001 rather than flag by the old one).
-- Waiting here queues nobody: a FOR SHARE request is granted beside other FOR SHARE holders
-- whoever waits, and nothing else a tenant needs is locked by a scope change.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_rescope()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  UPDATE @extschema@."pg_lease_django_epoch_floor" f SET floor = f.floor;
  UPDATE @extschema@."pg_lease_django_lease" l SET recorded = NOT l.recorded
   WHERE l.recorded IS DISTINCT FROM @extschema@.pg_lease_in_history_scope(l.key);
  RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_rescope() FROM PUBLIC;

-- What each declared role is granted (PG_LEASE_WORKER_ROLES, PG_LEASE_OPERATOR_ROLES,
-- PG_LEASE_MONITOR_ROLES; applied by `migrate` and `manage.py leases grant`): every function above
-- that locks, reveals or changes a lease is revoked from PUBLIC. A worker runs the four operations
-- and writes fenced rows (the fenced tables' triggers call pg_lease_guard_key as the writer); a
-- monitor reads the counts of pg_lease_metrics and nothing else; an operator may do what a worker
-- and a monitor may, plus force release, ask for a hand-off, opt out of fencing (within its key
-- scope) and read the lease and history tables. 'runbook' rows (pg_lease_prune, pg_lease_advance_epochs) are granted to nobody: they stay
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
    ('operator', 'FUNCTION', '@extschema@.pg_lease_check_key_scopes(text[])', 'EXECUTE'),
    ('operator', 'TABLE', '@extschema@."pg_lease_django_lease"', 'SELECT'),
    ('operator', 'TABLE', '@extschema@."pg_lease_django_tenure"', 'SELECT'),
    ('monitor', 'FUNCTION', '@extschema@.pg_lease_metrics(text, integer, boolean)', 'EXECUTE'),
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
    ('public', 'FUNCTION', '@extschema@.pg_lease_presented_fences()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_replication_apply()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_session_scope()', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_privileges()', 'EXECUTE')
  ) w (role, kind, object, privilege)
$$;

DROP FUNCTION @extschema@.pg_lease_check_new_name(text, text);

DROP FUNCTION @extschema@.pg_lease_unshown_characters();
