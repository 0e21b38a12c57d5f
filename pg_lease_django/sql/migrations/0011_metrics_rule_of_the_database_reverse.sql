-- Reverse of migration 0011: each object as 0010_limits_locks_and_inputs_on_every_path left it,
-- what 0011_metrics_rule_of_the_database made dropped.

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

-- The database's view for Prometheus (pg_lease_django.metrics_db), in one statement: counts by key
-- label, never a key, an owner or an epoch, for monitoring roles granted nothing else. A key's
-- label is its part before p_separator, or '(none)' when it has none; the p_max_labels labels with
-- the most lease rows keep their own, the rest are counted as '(other)': a scrape has a bounded
-- number of series whatever keys tenants choose. Rows: ('lease', label, state, rows, seconds since
-- the oldest expiry of a lapsed row), ('waiter', label, '', keys with a live registration, NULL),
-- and with p_history ('tenure', label, end reason, ended tenures, NULL). The state is
-- pg_lease_status against one clock read. Raises work_mem to 32MB for its transaction (never lowers
-- it): the planner cannot estimate how many labels an expression yields, and sorts every row
-- without it; with it, it hashes (2-3x faster at 100k rows). Read-only: takes no row lock.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_metrics(p_separator text, p_max_labels integer, p_history boolean)
RETURNS TABLE (kind text, label text, state text, count double precision, oldest_lapse double precision)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_separator IS NULL OR length(p_separator) <> 1 OR p_max_labels IS NULL OR p_max_labels < 1 THEN
    RAISE EXCEPTION 'invalid_input: the separator must be one character and the label cap positive'
      USING ERRCODE = '22023';
  END IF;
  IF pg_size_bytes(current_setting('work_mem')) < 33554432 THEN
    PERFORM set_config('work_mem', '32MB', true);
  END IF;
  RETURN QUERY
    WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),
    leases AS MATERIALIZED (
      SELECT CASE WHEN strpos(l.key, p_separator) > 0 THEN split_part(l.key, p_separator, 1) ELSE '(none)' END AS label,
             @extschema@.pg_lease_status(l.owner, l.expires_at, now.t) AS state,
             extract(epoch FROM now.t - l.expires_at)::float8 AS lapse
        FROM @extschema@."pg_lease_django_lease" l, now),
    kept AS (SELECT g.label FROM leases g GROUP BY g.label ORDER BY count(*) DESC, g.label LIMIT p_max_labels)
    SELECT 'lease'::text, coalesce(k.label, '(other)'), g.state, count(*)::float8,
           max(g.lapse) FILTER (WHERE g.state = 'lapsed')
      FROM leases g LEFT JOIN kept k ON k.label = g.label
     GROUP BY 2, 3
    UNION ALL
    SELECT 'waiter', coalesce(k.label, '(other)'), '', count(*)::float8, NULL
      FROM @extschema@."pg_lease_django_waiter" w CROSS JOIN now
      LEFT JOIN kept k ON k.label = CASE WHEN strpos(w.key, p_separator) > 0 THEN split_part(w.key, p_separator, 1) ELSE '(none)' END
     WHERE w.until > now.t
     GROUP BY 2
    UNION ALL
    SELECT 'tenure', coalesce(k.label, '(other)'), t.end_reason, count(*)::float8, NULL
      FROM @extschema@."pg_lease_django_tenure" t
      LEFT JOIN kept k ON k.label = CASE WHEN strpos(t.key, p_separator) > 0 THEN split_part(t.key, p_separator, 1) ELSE '(none)' END
     WHERE p_history AND t.end_reason IS NOT NULL
     GROUP BY 2, 3;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_metrics(text, integer, boolean) FROM PUBLIC;

DROP FUNCTION @extschema@.pg_lease_metrics();

DROP FUNCTION @extschema@.pg_lease_metrics_label(text, text[], text);

DROP TABLE @extschema@."pg_lease_django_metrics_rule";
