-- Undoes 0003_least_privilege.sql: the functions as 0002 left them, executable by PUBLIC again.

DROP FUNCTION @extschema@.pg_lease_privileges();

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_allow_unfenced()
RETURNS boolean LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT set_config('pg_lease.unfenced', 'on', true) = 'on' $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_unfenced_allowed()
RETURNS boolean LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT current_setting('pg_lease.unfenced', true) = 'on'
     AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE')
$$;

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
  IF current_setting('pg_lease.unfenced', true) = 'on' AND @extschema@.pg_lease_unfenced_allowed() THEN
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
  IF current_setting('pg_lease.unfenced', true) = 'on' AND @extschema@.pg_lease_unfenced_allowed() THEN
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
  PERFORM @extschema@.pg_lease_refuse('unfenced', NULL, NULL, NULL,
                          format('TRUNCATE of fenced table %I.%I without opting out', TG_TABLE_SCHEMA, TG_TABLE_NAME));
  RETURN NULL;
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_forbid_delete()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    IF current_setting('pg_lease.allow_truncate', true) = 'on'
       AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE') THEN
      RETURN NULL;
    END IF;
    RAISE EXCEPTION 'lease rows are never deleted (TRUNCATE would reset every epoch)'
      USING ERRCODE = '23001',
            HINT = 'Release leases instead. Test databases may SET pg_lease.allow_truncate = on.';
  END IF;
  IF @extschema@.pg_lease_status(OLD.owner, OLD.expires_at, clock_timestamp()) <> 'held'
     AND (SELECT f.floor FROM @extschema@."pg_lease_django_epoch_floor" f) >= OLD.epoch THEN
    RETURN OLD;
  END IF;
  RAISE EXCEPTION 'a lease row may be deleted only when it is not held and the epoch floor covers it '
                  '(pg_lease_prune does both; deleting % would reset its epoch)', OLD.key
    USING ERRCODE = '23001', HINT = 'Release the lease instead, or prune leases free for long enough.';
END $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_prune(p_free_for interval, p_dry_run boolean DEFAULT false)
RETURNS TABLE (key text, epoch bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cutoff timestamptz;
  doomed text[];
  top bigint;
BEGIN
  IF p_free_for IS NULL OR extract(year FROM p_free_for) <> 0 OR extract(month FROM p_free_for) <> 0
     OR extract(epoch FROM p_free_for) < 0 THEN
    RAISE EXCEPTION 'invalid_input: free_for must be a non-negative duration without months, got %', p_free_for
      USING ERRCODE = '22023';
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  cutoff := clock_timestamp() - make_interval(secs => extract(epoch FROM p_free_for)::double precision);
  IF p_dry_run THEN
    RETURN QUERY SELECT l.key, l.epoch FROM @extschema@."pg_lease_django_lease" l
      WHERE (l.owner IS NULL AND l.released_at <= cutoff) OR (l.owner IS NOT NULL AND l.expires_at <= cutoff)
      ORDER BY l.key;
    RETURN;
  END IF;
  -- The floor first, then the rows: the order acquire's insert path takes them in (no deadlock).
  PERFORM 1 FROM @extschema@."pg_lease_django_epoch_floor" f FOR UPDATE;
  SELECT array_agg(d.key), max(d.epoch) INTO doomed, top
    FROM (SELECT l.key, l.epoch FROM @extschema@."pg_lease_django_lease" l
           WHERE (l.owner IS NULL AND l.released_at <= cutoff) OR (l.owner IS NOT NULL AND l.expires_at <= cutoff)
           FOR UPDATE SKIP LOCKED) d;
  IF doomed IS NULL THEN
    RETURN;
  END IF;
  UPDATE @extschema@."pg_lease_django_epoch_floor" f SET floor = greatest(f.floor, top);
  RETURN QUERY DELETE FROM @extschema@."pg_lease_django_lease" l WHERE l.key = ANY (doomed) RETURNING l.key, l.epoch;
END $$;

DROP FUNCTION @extschema@.pg_lease_opt_out_valid(text, name);
DROP FUNCTION @extschema@.pg_lease_opt_out_token(name);
DROP TABLE @extschema@."pg_lease_django_secret";

GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_or_register(text, text, interval, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_renew(text, text, bigint, interval) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_release(text, text, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_inspect(text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_request_handoff(text, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_fence(text, text, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_fence_outcome(text, text, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_check_fence(text, text, bigint) TO PUBLIC;
GRANT EXECUTE ON FUNCTION @extschema@.pg_lease_guard_key(text, jsonb, text) TO PUBLIC;
