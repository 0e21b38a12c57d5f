-- 0003: least privilege by default (issue 27), and a TRUNCATE refusal that names the cure.
--
-- * Every function that locks, reveals or changes a lease is revoked from PUBLIC; the roles that
--   work with leases are declared in settings and granted what pg_lease_privileges() lists, by
--   `migrate` (post_migrate) and `manage.py leases grant`. A hand-off request is an operator's act.
-- * pg_lease_guard_key (which the fenced tables' triggers call as the writer) is a worker's
--   privilege: a role granted nothing can no longer lock a lease row or probe a fence with it.
-- * The opt-out of fencing is a token minted by pg_lease_allow_unfenced() from an owner-only
--   secret for the current role, this backend and this transaction: pg_lease.unfenced set by hand
--   never opts out, and an opt-out minted inside an owner-run function is not its caller's.
-- * pg_lease_prune also removes expired waiters' registrations.
-- * The TRUNCATE refusals (lease table 23001, fenced tables PL004) hint at the test runner and the
--   pytest plugin.

-- A random secret only the owner reads: what makes an opt-out of fencing (pg_lease_allow_unfenced)
-- a token no role can forge by setting pg_lease.unfenced by hand. One row, made at installation.
CREATE TABLE @extschema@."pg_lease_django_secret" (
  one boolean PRIMARY KEY DEFAULT true CHECK (one),
  secret text NOT NULL
);
REVOKE ALL ON @extschema@."pg_lease_django_secret" FROM PUBLIC;
INSERT INTO @extschema@."pg_lease_django_secret" (secret)
  VALUES (pg_catalog.encode(pg_catalog.sha256(pg_catalog.convert_to(
    pg_catalog.gen_random_uuid()::text || pg_catalog.gen_random_uuid()::text, 'UTF8')), 'hex'));


REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire(text, text, interval, interval) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_acquire_or_register(text, text, interval, interval) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_heartbeat(text, text, bigint, interval) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_renew(text, text, bigint, interval) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_release(text, text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_inspect(text) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_request_handoff(text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence(text, text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_fence_outcome(text, text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_fence(text, text, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_guard_key(text, jsonb, text) FROM PUBLIC;

CREATE FUNCTION @extschema@.pg_lease_opt_out_token(p_role name)
RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT encode(sha256(convert_to(s.secret || '/' || p_role::text || '/' || pg_backend_pid()::text || '/'
                                  || extract(epoch FROM now())::text, 'UTF8')), 'hex')
    FROM @extschema@."pg_lease_django_secret" s
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_opt_out_token(name) FROM PUBLIC;

-- Is p_token the opt-out of p_role in this backend and transaction? For any caller: it reveals
-- nothing a 256-bit token would not.
CREATE FUNCTION @extschema@.pg_lease_opt_out_valid(p_token text, p_role name)
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT p_token = @extschema@.pg_lease_opt_out_token(p_role) $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_allow_unfenced()
RETURNS boolean LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT set_config('pg_lease.unfenced', @extschema@.pg_lease_opt_out_token(current_user), true) IS NOT NULL $$;

CREATE OR REPLACE FUNCTION @extschema@.pg_lease_unfenced_allowed()
RETURNS boolean LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$ SELECT @extschema@.pg_lease_opt_out_valid(current_setting('pg_lease.unfenced', true), current_user) $$;

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
            HINT = 'Lease rows and fenced rows are never deleted wholesale (every epoch would restart). In tests, set TEST_RUNNER = ''pg_lease_django.testing.LeaseTestRunner'', or use pytest-django (the pg_lease_django pytest plugin): both allow TRUNCATE on test databases only.';
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
  -- Expired waiters' registrations go too (a takeover after expiry sends no release to remove
  -- them): the waiter table holds no more than the registrations live since the last prune.
  DELETE FROM @extschema@."pg_lease_django_waiter" w WHERE w.until < clock_timestamp();
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
CREATE FUNCTION @extschema@.pg_lease_privileges()
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
