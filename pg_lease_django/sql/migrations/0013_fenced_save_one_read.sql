-- Migration 0013: fenced save one read.
--
-- Written by `python -m devkit.sqlchange fenced_save_one_read` from sql/schema.sql, the source:
-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).
-- * changed function pg_lease_check_fence(text, text, bigint) (definition)
-- * changed function pg_lease_guard_key(text, jsonb, text) (definition)
-- * new function pg_lease_guard_one_key(text, text, bigint, bigint, text)
-- * changed function pg_lease_guard_rows() (definition)
-- * changed function pg_lease_privileges() (definition)

-- Present a fence (the raising form, for raw SQL): returns p_epoch, so a write can both present the
-- fence and record it in one expression: SET lease_epoch = (SELECT pg_lease_check_fence(k, o, e)).
-- Raises PL001 not_owner, PL002 lapsed, PL003 epoch_mismatch; DETAIL carries the fence as JSON.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS bigint LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  expires timestamptz;
  verdict text;
  recorded text;
BEGIN
  -- Fast path, the holder presenting its live fence of a key in the session's scope: one read that
  -- locks the row only when it matches (a stale fence takes no lock and writes nothing), judged
  -- again on the clock once the lock is held (the read may have waited behind a lock-only locker).
  -- A stored row that matches implies valid inputs. The first fence of the transaction is written
  -- as is (the text pg_lease_guard_one_key compares with); any other through pg_lease_remember_fence.
  -- An assignment, not PERFORM: PERFORM runs a query, an assignment evaluates an expression.
  SELECT l.expires_at INTO expires FROM @extschema@."pg_lease_django_lease" l
   WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
     AND @extschema@.pg_lease_key_allowed(p_key)
     FOR KEY SHARE;
  IF expires > clock_timestamp() AND coalesce(current_setting('pg_lease.fences', true), '') = '' THEN
    recorded := set_config('pg_lease.fences', jsonb_build_object(p_key, jsonb_build_array(p_owner, p_epoch))::text, true);
    RETURN p_epoch;
  ELSIF expires > clock_timestamp() THEN
    PERFORM @extschema@.pg_lease_remember_fence(p_key, p_owner, p_epoch);
    RETURN p_epoch;
  END IF;
  -- Anything else: input first (22023), then the key scope (42501), then pg_lease_fence's way (a
  -- renewal in flight awaited, the cause), raising when it fails.
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255
     OR p_owner IS NULL OR p_owner = '' OR octet_length(p_owner) > 255 OR p_epoch IS NULL OR p_epoch < 1 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);
    PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
  verdict := @extschema@.pg_lease_fence(p_key, p_owner, p_epoch);
  IF verdict = 'ok' THEN
    RETURN p_epoch;
  END IF;
  PERFORM @extschema@.pg_lease_refuse(verdict, p_key, p_owner, p_epoch,
                          format('lease %s is not held by %s at epoch %s', p_key, p_owner, p_epoch));
  RETURN NULL;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_fence(text, text, bigint) FROM PUBLIC;

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
  IF NOT @extschema@.pg_lease_key_allowed(p_key) THEN
    PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_key(text, jsonb, text) FROM PUBLIC;

-- The common case of a fenced statement, decided in one locked read (pg_lease_guard_rows passes
-- what one pass over its transition tables found): true when every row written or removed names
-- one lease key (p_lo, the least key with a missing one counted as '', equals p_hi, the greatest),
-- the transaction presented one fence, for that key, pg_lease.fences (p_fences) is still the text
-- pg_lease_check_fence wrote for it ({key: [owner, epoch]}), that fence holds now, every row
-- written records its epoch (p_new_min, the least written, NULL when none is; a NULL epoch counts
-- as 0) and none written or removed is above it (p_top); true also when no row was written or
-- removed. The read compares the setting with the live lease row's own fence, so nothing is parsed,
-- and a setting forged by hand passes only when it names the live holder and epoch (what
-- presenting the fence would have checked); the row is locked FOR KEY SHARE only when everything
-- matches, and the clock is read again once the lock is held. Never raises: false (or NULL) sends
-- the trigger the full way (pg_lease_guard_key), which refuses with the cause.
CREATE FUNCTION @extschema@.pg_lease_guard_one_key(p_lo text, p_hi text, p_new_min bigint, p_top bigint, p_fences text)
RETURNS boolean LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  expires timestamptz;
BEGIN
  IF p_lo IS NULL OR p_lo <> p_hi OR NOT @extschema@.pg_lease_key_allowed(p_lo) THEN
    RETURN p_lo IS NULL;
  END IF;
  SELECT l.expires_at INTO expires FROM @extschema@."pg_lease_django_lease" l
   WHERE l.key = p_lo AND l.expires_at > clock_timestamp()
     AND jsonb_build_object(l.key, jsonb_build_array(l.owner, l.epoch))::text = p_fences
     AND (p_new_min IS NULL OR p_new_min = l.epoch) AND (p_top IS NULL OR p_top <= l.epoch)
     FOR KEY SHARE;
  RETURN expires > clock_timestamp();
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_one_key(text, text, bigint, bigint, text) FROM PUBLIC;

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
  rows_table text;
  done boolean;
BEGIN
  -- The common case first, in one query: no opt-out and no replica mode (NULL otherwise: asked
  -- about below), and every row written or removed names the one lease key of the one fence the
  -- transaction presented, which holds (pg_lease_guard_one_key). One pass over the transition
  -- tables gives what that needs: the least key (a missing one counted as '', which no lease has)
  -- and the greatest (an UPDATE leaves out old rows without a key, as below), the least epoch
  -- written (a NULL one counts as 0, which no fence has) and the greatest written or removed.
  -- Anything else, or a refusal, takes the full way below.
  IF TG_OP = 'UPDATE' THEN
    SELECT CASE WHEN current_setting('session_replication_role') = 'replica'
                  OR coalesce(current_setting('pg_lease.unfenced', true), '') <> '' THEN NULL
                ELSE @extschema@.pg_lease_guard_one_key(min(coalesce(k.key, '') COLLATE "C"), max(k.key COLLATE "C"),
                       min(k.new_epoch), max(k.top), current_setting('pg_lease.fences', true)) END
      INTO done
      FROM (SELECT o.lease_key AS key, NULL::bigint AS new_epoch, o.lease_epoch AS top
              FROM pg_lease_old o WHERE o.lease_key IS NOT NULL
            UNION ALL
            SELECT n.lease_key, coalesce(n.lease_epoch, 0), coalesce(n.lease_epoch, 0) FROM pg_lease_new n) k;
  ELSIF TG_OP = 'INSERT' THEN
    SELECT CASE WHEN current_setting('session_replication_role') = 'replica'
                  OR coalesce(current_setting('pg_lease.unfenced', true), '') <> '' THEN NULL
                ELSE @extschema@.pg_lease_guard_one_key(min(coalesce(n.lease_key, '') COLLATE "C"), max(n.lease_key COLLATE "C"),
                       min(coalesce(n.lease_epoch, 0)), max(coalesce(n.lease_epoch, 0)), current_setting('pg_lease.fences', true)) END
      INTO done FROM pg_lease_new n;
  ELSE
    SELECT CASE WHEN current_setting('session_replication_role') = 'replica'
                  OR coalesce(current_setting('pg_lease.unfenced', true), '') <> '' THEN NULL
                ELSE @extschema@.pg_lease_guard_one_key(min(coalesce(o.lease_key, '') COLLATE "C"), max(o.lease_key COLLATE "C"),
                       NULL, max(o.lease_epoch), current_setting('pg_lease.fences', true)) END
      INTO done FROM pg_lease_old o;
  END IF;
  IF done THEN
    RETURN NULL;
  END IF;
  -- The triggers fire ALWAYS, in replica mode too: only a trusted replication apply passes unchecked.
  IF current_setting('session_replication_role') = 'replica' AND @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;
  END IF;
  -- coalesce: NULL AND f() still calls f() (the result could be false).
  IF coalesce(current_setting('pg_lease.unfenced', true), '') <> '' AND @extschema@.pg_lease_unfenced_allowed() THEN
    -- Opted out: no fence asked, but a session with a key scope writes only rows of its keys.
    IF TG_OP = 'INSERT' THEN
      PERFORM @extschema@.pg_lease_check_key_scopes(ARRAY(SELECT DISTINCT n.lease_key FROM pg_lease_new n));
    ELSIF TG_OP = 'UPDATE' THEN
      PERFORM @extschema@.pg_lease_check_key_scopes(ARRAY(SELECT o.lease_key FROM pg_lease_old o
                                                           UNION SELECT n.lease_key FROM pg_lease_new n));
    ELSE
      PERFORM @extschema@.pg_lease_check_key_scopes(ARRAY(SELECT DISTINCT o.lease_key FROM pg_lease_old o));
    END IF;
    RETURN NULL;
  END IF;
  rows_table := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
  fences := @extschema@.pg_lease_presented_fences();
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
    ('worker', 'FUNCTION', '@extschema@.pg_lease_guard_one_key(text, text, bigint, bigint, text)', 'EXECUTE'),
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
