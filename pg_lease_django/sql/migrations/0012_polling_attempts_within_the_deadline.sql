-- Migration 0012: polling attempts within the deadline.
--
-- Written by `python -m devkit.sqlchange polling_attempts_within_the_deadline` from sql/schema.sql, the source:
-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).
-- * new function pg_lease_acquire_within(text, text, interval, interval)
-- * changed function pg_lease_privileges() (definition)

-- The attempt of a waiter that polls (behind a transaction pooler, PG_LEASE_LISTEN = False, inside
-- the caller's transaction): pg_lease_acquire(key, owner, ttl), every lock wait of it bounded by
-- p_within, what is left of the waiter's deadline, counted on the server from the call's start (and
-- by the caller's own lock_timeout, when shorter): the lease row a takeover waits for, the limit row
-- of a brand-new key, a concurrent insert of the same key, the epoch floor. A wait that ran out is
-- answered as a refusal that changed nothing (its subtransaction rolled back, with every lock taken
-- in it): naming the key's holder when it is held, none ("busy": a lock it needs was) otherwise,
-- expiring now; the waiter, at its deadline by then, times out. Never granted past the deadline; the
-- caller's transaction, inside atomic(), goes on. p_within NULL: no bound of its own (a waiter with
-- no deadline), as the plain acquire.
CREATE FUNCTION @extschema@.pg_lease_acquire_within(p_key text, p_owner text, p_ttl interval, p_within interval)
RETURNS SETOF @extschema@.pg_lease_attempt
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  attempt @extschema@.pg_lease_attempt;
  saved_lock_timeout text;
  wait_ms double precision;
BEGIN
  -- Every input first (22023): the key, owner and TTL are judged by pg_lease_acquire, input before
  -- the key scope, as in every lease function.
  IF extract(year FROM p_within) <> 0 OR extract(month FROM p_within) <> 0
     OR extract(epoch FROM p_within) < 0 OR extract(epoch FROM p_within) > 365 * 86400 THEN
    RAISE EXCEPTION 'invalid_input: within must be between 0 and 365 days, without months, got %',
      p_within USING ERRCODE = '22023';
  END IF;
  IF p_within IS NULL THEN
    RETURN QUERY SELECT * FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl);
    RETURN;
  END IF;
  saved_lock_timeout := current_setting('lock_timeout');
  wait_ms := greatest(1, ceil(extract(epoch FROM p_within) * 1000));  -- 0 would mean no bound at all
  IF saved_lock_timeout::interval > interval '0' THEN
    wait_ms := least(wait_ms, extract(epoch FROM saved_lock_timeout::interval) * 1000);
  END IF;
  PERFORM set_config('lock_timeout', least(wait_ms, 2147483647)::bigint::text, true);
  BEGIN
    SELECT * INTO attempt FROM @extschema@.pg_lease_acquire(p_key, p_owner, p_ttl) AS a;
  EXCEPTION WHEN lock_not_available THEN
    -- Busy until the deadline: a refusal, naming the holder if the key is held, to time out now.
    attempt := ROW(false, p_key, NULL, NULL, NULL, clock_timestamp());
    SELECT CASE WHEN @extschema@.pg_lease_status(l.owner, l.expires_at, attempt.server_time) = 'held' THEN l.owner END,
           l.epoch
      INTO attempt.owner, attempt.epoch
      FROM @extschema@."pg_lease_django_lease" l WHERE l.key = p_key;
    IF attempt.epoch IS NULL THEN
      SELECT f.floor INTO attempt.epoch FROM @extschema@."pg_lease_django_epoch_floor" f;
    END IF;
    attempt.expires_at := attempt.server_time;
  END;
  PERFORM set_config('lock_timeout', saved_lock_timeout, true);
  RETURN NEXT attempt;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_within(text, text, interval, interval) FROM PUBLIC;

-- Whoever may attempt as a LISTENing waiter may attempt as a polling one: the roles granted
-- pg_lease_acquire_or_register (by `migrate`, `leases grant` or by hand from pg_lease_privileges())
-- are granted the new function now, so that no waiter of theirs meets 42501 between this migration
-- and the next grant.
DO $$
DECLARE
  r record;
BEGIN
  FOR r IN SELECT DISTINCT a.grantee, a.is_grantable
             FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a
            WHERE p.oid = '@extschema@.pg_lease_acquire_or_register(text, text, interval, interval)'::pg_catalog.regprocedure
              AND a.privilege_type = 'EXECUTE' AND a.grantee <> 0 AND a.grantee <> p.proowner LOOP
    EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_within(text, text, interval, interval) TO %s%s',
                              r.grantee::pg_catalog.regrole::pg_catalog.text,
                              CASE WHEN r.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END);
  END LOOP;
END $$;

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
    ('worker', 'FUNCTION', '@extschema@.pg_lease_acquire_within(text, text, interval, interval)', 'EXECUTE'),
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
    ('monitor', 'FUNCTION', '@extschema@.pg_lease_metrics()', 'EXECUTE'),
    -- The runbook's (failover, restore, maintenance): granted to nobody, an operator may be granted them.
    ('runbook', 'FUNCTION', '@extschema@.pg_lease_prune(interval, boolean)', 'EXECUTE'),
    ('runbook', 'FUNCTION', '@extschema@.pg_lease_advance_epochs(bigint, boolean)', 'EXECUTE'),
    -- What every role may run, through PUBLIC: pure helpers, and what the triggers call as the writer.
    ('public', 'FUNCTION', '@extschema@.pg_lease_status(text, timestamptz, timestamptz)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_metrics_label(text, text[], text)', 'EXECUTE'),
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
