-- Migration 0011: metrics rule of the database.
--
-- Written by `python -m devkit.sqlchange metrics_rule_of_the_database` from sql/schema.sql, the source:
-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).
-- * new table pg_lease_django_metrics_rule
-- * new function pg_lease_metrics_label(text, text[], text)
-- * new function pg_lease_metrics()
-- * changed function pg_lease_privileges() (definition)
-- * dropped function pg_lease_metrics(text, integer, boolean)

-- How the metrics label a key (PG_LEASE_METRICS_KEY_LABEL's separator and PG_LEASE_METRICS_MAX_LABELS,
-- copied here like the scopes by `migrate` and `manage.py leases grant`): one row. The owner's
-- settings decide it and the database holds it, so that pg_lease_metrics takes no rule from its
-- caller: a monitor choosing the separator and the cap could read keys back a character at a time.
CREATE TABLE @extschema@."pg_lease_django_metrics_rule" (
  id boolean CONSTRAINT pg_lease_django_metrics_rule_pkey PRIMARY KEY DEFAULT true CONSTRAINT pg_lease_metrics_rule_one CHECK (id),
  separator text NOT NULL CONSTRAINT pg_lease_metrics_rule_separator CHECK (length(separator) = 1),
  max_labels integer NOT NULL CONSTRAINT pg_lease_metrics_rule_cap CHECK (max_labels > 0)
);
REVOKE ALL ON @extschema@."pg_lease_django_metrics_rule" FROM PUBLIC;
INSERT INTO @extschema@."pg_lease_django_metrics_rule" (separator, max_labels) VALUES (':', 16);

-- A key's metrics label (pg_lease_metrics): the first of p_prefixes (longest first) it starts with,
-- else its part before p_separator, else '(none)'. Pure; no SET search_path, as pg_lease_status: it
-- names only pg_catalog built-ins, searched first whatever the caller's search_path.
CREATE FUNCTION @extschema@.pg_lease_metrics_label(p_key text, p_prefixes text[], p_separator text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT coalesce(
    (SELECT p FROM unnest(p_prefixes) p WHERE starts_with(p_key, p) LIMIT 1),
    CASE WHEN strpos(p_key, p_separator) > 0 THEN split_part(p_key, p_separator, 1) ELSE '(none)' END)
$$;

-- The database's view for Prometheus (pg_lease_django.metrics.database_view), in one statement: counts by key
-- label, never a key, an owner or an epoch, for monitoring roles granted nothing else. The rule is
-- the database's, never the caller's: a key's label is the longest declared scope prefix it starts
-- with (pg_lease_django_key_scope: each tenant its own series), else its part before the separator
-- of pg_lease_django_metrics_rule, or '(none)' when it has none; the max_labels labels with the most
-- lease rows keep their own, the rest are counted as '(other)': a scrape has a bounded number of
-- series whatever keys tenants choose. Rows: ('lease', label, state, rows, seconds since the oldest
-- expiry of a lapsed row), ('waiter', label, '', keys with a live registration, NULL), and while
-- history is recorded (pg_lease_django_history_scope) ('tenure', label, end reason, ended tenures,
-- NULL). The state is pg_lease_status against one clock read. Raises work_mem to 32MB for its
-- transaction (never lowers it): the planner cannot estimate how many labels an expression yields,
-- and sorts every row without it; with it, it hashes (2-3x faster at 100k rows). Read-only: takes no
-- row lock.
CREATE FUNCTION @extschema@.pg_lease_metrics()
RETURNS TABLE (kind text, label text, state text, count double precision, oldest_lapse double precision)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_separator text := ':';
  v_max_labels integer := 16;
  v_history boolean := EXISTS (SELECT FROM @extschema@."pg_lease_django_history_scope");
  v_prefixes text[];
BEGIN
  SELECT r.separator, r.max_labels INTO v_separator, v_max_labels FROM @extschema@."pg_lease_django_metrics_rule" r;
  -- Longest first: a key under 'tenant:a:' and 'tenant:' is labelled by the narrower scope.
  SELECT coalesce(array_agg(DISTINCT s.prefix ORDER BY s.prefix), '{}') INTO v_prefixes
    FROM @extschema@."pg_lease_django_key_scope" s WHERE s.prefix <> '';
  SELECT coalesce(array_agg(p ORDER BY length(p) DESC, p), '{}') INTO v_prefixes FROM unnest(v_prefixes) p;
  IF pg_size_bytes(current_setting('work_mem')) < 33554432 THEN
    PERFORM set_config('work_mem', '32MB', true);
  END IF;
  RETURN QUERY
    WITH now AS MATERIALIZED (SELECT clock_timestamp() AS t),
    leases AS MATERIALIZED (
      SELECT @extschema@.pg_lease_metrics_label(l.key, v_prefixes, v_separator) AS label,
             @extschema@.pg_lease_status(l.owner, l.expires_at, now.t) AS state,
             extract(epoch FROM now.t - l.expires_at)::float8 AS lapse
        FROM @extschema@."pg_lease_django_lease" l, now),
    kept AS (SELECT g.label FROM leases g GROUP BY g.label ORDER BY count(*) DESC, g.label LIMIT v_max_labels)
    SELECT 'lease'::text, coalesce(k.label, '(other)'), g.state, count(*)::float8,
           max(g.lapse) FILTER (WHERE g.state = 'lapsed')
      FROM leases g LEFT JOIN kept k ON k.label = g.label
     GROUP BY 2, 3
    UNION ALL
    SELECT 'waiter', coalesce(k.label, '(other)'), '', count(*)::float8, NULL
      FROM @extschema@."pg_lease_django_waiter" w CROSS JOIN now
      LEFT JOIN kept k ON k.label = @extschema@.pg_lease_metrics_label(w.key, v_prefixes, v_separator)
     WHERE w.until > now.t
     GROUP BY 2
    UNION ALL
    SELECT 'tenure', coalesce(k.label, '(other)'), t.end_reason, count(*)::float8, NULL
      FROM @extschema@."pg_lease_django_tenure" t
      LEFT JOIN kept k ON k.label = @extschema@.pg_lease_metrics_label(t.key, v_prefixes, v_separator)
     WHERE v_history AND t.end_reason IS NOT NULL
     GROUP BY 2, 3;
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_metrics() FROM PUBLIC;

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

DROP FUNCTION @extschema@.pg_lease_metrics(text, integer, boolean);
