-- Migration 0007: tenants apart for real (issue 42), and the monitoring view (issue 46).
--
-- * Key scopes follow role membership and fail closed: pg_lease_check_key_scope is compiled from the
--   scope table (pg_lease_compile_key_scope, run by the table's trigger), a session may use the
--   prefixes of every role its login role is a member of, and once any scope is configured a
--   session with none is refused; prefix '' spans every key. pg_lease_session_scope() says which.
-- * Input first: every lease function judges invalid_input before the key scope; acquire refuses
--   keys and owners with control, bidirectional or invisible formatting characters.
-- * An opt-out is minted only for a role the session may act as, by the owner's own grant
--   (pg_lease_opt_out_token); an opted-out write still stays within the writer's key scope.
-- * Every trigger of the package's tables, and of the fenced tables, fires ALWAYS: replica mode
--   (SET on session_replication_role, PostgreSQL 15+) turns none of them off, except for a trusted
--   replication apply (pg_lease_replication_apply).
-- * Row-level security keeps the secret from pg_read_all_data members and the scope and limit
--   tables from every writer but the owner.
-- * Per-role limits (pg_lease_django_role_limit): lease rows under a role's prefixes, and tenures
--   kept per key.
-- * pg_lease.fences set by hand and malformed: a typed refusal (PL004), not a JSON parse error.
-- * pg_lease_metrics: the database's view for Prometheus, counts by bounded labels, for monitoring roles.
--
-- Every function here is restated whole (CREATE OR REPLACE keeps its privileges); schema.sql is the source.


-- Per-role limits (PG_LEASE_ROLE_LIMITS, copied here like the scopes): the lease rows under a
-- role's key prefixes (a brand-new key is refused, SQLSTATE 53400, when they are max_leases
-- already), and the tenures kept per recorded key of those prefixes (the oldest go as new ones
-- come). So one tenant's rows stay below max_leases x (1 + max_tenures_per_key).
CREATE TABLE @extschema@."pg_lease_django_role_limit" (
  role name CONSTRAINT pg_lease_django_role_limit_pkey PRIMARY KEY,
  max_leases integer NULL CONSTRAINT pg_lease_role_limit_leases_positive CHECK (max_leases > 0),
  max_tenures_per_key integer NULL CONSTRAINT pg_lease_role_limit_tenures_positive CHECK (max_tenures_per_key > 0)
);
REVOKE ALL ON @extschema@."pg_lease_django_role_limit" FROM PUBLIC;

-- Row-level security on the tables that say who may do what, and on the secret: the owner (which
-- the lease functions run as) and superusers bypass it; everyone else reads the scopes and limits
-- only with a SELECT grant, and writes none of them, whatever they were granted, pg_write_all_data
-- included. The secret has no policy at all: a pg_read_all_data member reads no row of it, so it
-- cannot mint an opt-out (only a role with BYPASSRLS could; check W008 reports such roles).
ALTER TABLE @extschema@."pg_lease_django_secret" ENABLE ROW LEVEL SECURITY;
ALTER TABLE @extschema@."pg_lease_django_key_scope" ENABLE ROW LEVEL SECURITY;
CREATE POLICY pg_lease_read ON @extschema@."pg_lease_django_key_scope" FOR SELECT USING (true);
ALTER TABLE @extschema@."pg_lease_django_role_limit" ENABLE ROW LEVEL SECURITY;
CREATE POLICY pg_lease_read ON @extschema@."pg_lease_django_role_limit" FOR SELECT USING (true);

-- Characters a terminal or an editor acts on rather than shows: C0 and C1 controls (escape
-- sequences, carriage returns, line feeds), the bidirectional formatting characters (U+061C,
-- U+200E-U+200F, U+202A-U+202E, U+2066-U+2069), zero-width and invisible formatting characters
-- (U+200B-U+200D, U+2060-U+2064, U+FEFF) and the line and paragraph separators. A new key or
-- owner carrying one could forge or hide rows in an operator's view: refused by acquire
-- (pg_lease_check_new_name). A regular expression, one spelling; inlined (no SET clause).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_unshown_characters()
RETURNS text LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT '[\x01-\x1f\x7f\u0080-\u009f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069\ufeff]'::pg_catalog.text $$;

-- pg_lease_check_name for a name a grant stores (acquire's key and owner): also refuses the
-- characters of pg_lease_unshown_characters(). Keys stored before this rule keep working.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_new_name(p_kind text, p_value text)
RETURNS void LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  PERFORM @extschema@.pg_lease_check_name(p_kind, p_value);
  IF p_value ~ @extschema@.pg_lease_unshown_characters() THEN
    RAISE EXCEPTION 'invalid_input: % must not contain control, bidirectional or other invisible formatting characters', p_kind
      USING ERRCODE = '22023', HINT = 'Keys and owners are shown to operators: use printable characters.';
  END IF;
END $$;

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

-- Any change of the scope table recompiles the check, in the same transaction, whoever makes it.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_key_scope_changed()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  PERFORM @extschema@.pg_lease_compile_key_scope();
  RETURN NULL;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_key_scope_changed() FROM PUBLIC;

CREATE TRIGGER pg_lease_key_scope_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
  ON @extschema@."pg_lease_django_key_scope"
  FOR EACH STATEMENT EXECUTE FUNCTION @extschema@.pg_lease_key_scope_changed();
ALTER TABLE @extschema@."pg_lease_django_key_scope" ENABLE ALWAYS TRIGGER pg_lease_key_scope_changed;

-- The key prefixes this session may use, by the rule pg_lease_check_key_scope applies: NULL for
-- every key (no scope configured, the owner, a superuser, a role spanning every key), an empty
-- array for none. For readiness probes and for a role asking why it was refused; it reveals only
-- the session's own scope.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_session_scope()
RETURNS text[] LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  WITH mine AS (SELECT s.prefix FROM @extschema@."pg_lease_django_key_scope" s
                 WHERE pg_has_role(session_user, to_regrole(quote_ident(s.role)), 'MEMBER'))
  SELECT CASE WHEN NOT EXISTS (SELECT FROM @extschema@."pg_lease_django_key_scope")
                   OR pg_has_role(session_user, current_user, 'MEMBER')
                   OR EXISTS (SELECT FROM mine WHERE mine.prefix = '') THEN NULL
              ELSE ARRAY(SELECT DISTINCT mine.prefix FROM mine ORDER BY 1) END
$$;

-- PG_LEASE_ROLE_LIMITS' max_leases, for a brand-new key (acquire's insert path, whoever calls):
-- refused with SQLSTATE 53400 (configuration_limit_exceeded) when a limited role's prefixes hold the
-- key and max_leases lease rows already. The brand-new keys of one limited role are counted one
-- transaction at a time (a transaction-level advisory lock on the role), so concurrent grants cannot
-- pass the limit together. Counted through the key index (LIKE 'prefix%' on text_pattern_ops), in
-- one statement per limited role (overlapping prefixes count a row once). Free rows count until
-- `manage.py leases prune` deletes them. Called only on the way to a brand-new row: no other path.
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
    PERFORM pg_advisory_xact_lock(hashtextextended('pg_lease_django role limit ' || lim.role, 4187349731::bigint));
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

-- The token of p_role in this backend and transaction. Internal: revoked from PUBLIC.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_opt_out_hash(p_role name)
RETURNS text LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT encode(sha256(convert_to(s.secret || '/' || p_role::text || '/' || pg_backend_pid()::text || '/'
                                  || extract(epoch FROM now())::text, 'UTF8')), 'hex')
    FROM @extschema@."pg_lease_django_secret" s
$$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_opt_out_hash(name) FROM PUBLIC;

-- Mint p_role's opt-out token, or refuse (42501) unless both hold:
-- * the session may act as p_role: its login role is p_role or a member of it (SET ROLE to it
--   included). Inside an owner-run SECURITY DEFINER function called by another role, current_user
--   is the owner but the session is not: the owner's opt-out is never handed to its caller;
-- * p_role may opt out by the owner's own grant: it is the functions' owner (or a member of it, a
--   superuser), or holds EXECUTE on pg_lease_allow_unfenced() through a grant whose grantor is the
--   owner (migrate and `leases grant` make such grants; a superuser's grant is recorded as the
--   owner's). A grant passed on WITH GRANT OPTION names another grantor and counts for nothing.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_opt_out_token(p_role name)
RETURNS text LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
  IF to_regrole(quote_ident(p_role)) IS NULL
     OR NOT pg_has_role(session_user, to_regrole(quote_ident(p_role)), 'MEMBER')
     OR NOT (pg_has_role(to_regrole(quote_ident(p_role)), current_user, 'MEMBER')
             OR EXISTS (SELECT FROM pg_proc p, aclexplode(p.proacl) a
                         WHERE p.oid = '@extschema@.pg_lease_allow_unfenced()'::regprocedure
                           AND a.privilege_type = 'EXECUTE' AND a.grantor = p.proowner
                           AND (a.grantee = 0 OR pg_has_role(to_regrole(quote_ident(p_role)), a.grantee, 'USAGE')))) THEN
    RAISE EXCEPTION 'opt_out: session of role % may not opt out of fencing as role %', session_user, p_role
      USING ERRCODE = '42501',
            HINT = 'Only a role declared in PG_LEASE_OPERATOR_ROLES (granted by migrate or manage.py leases grant) opts out, for itself.';
  END IF;
  RETURN @extschema@.pg_lease_opt_out_hash(p_role);
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_opt_out_token(name) FROM PUBLIC;

-- The fences this transaction presented (pg_lease.fences, '{}' when none). The setting is written by
-- pg_lease_remember_fence; one set by hand that is not a JSON object is refused as 'unfenced'
-- (PL004) with a message that says so, never a raw JSON parse error. No SET clause (every fenced
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
  EXCEPTION WHEN invalid_text_representation THEN
    fences := NULL;
  END;
  IF pg_catalog.jsonb_typeof(fences) IS DISTINCT FROM 'object' THEN
    PERFORM @extschema@.pg_lease_refuse('unfenced', NULL, NULL, NULL,
      'pg_lease.fences is not a JSON object of lease key -> [owner, epoch]: pg_lease_check_fence() sets it, never a SET by hand');
  END IF;
  RETURN fences;
END $$;

-- Is this write a trusted replication apply? The fenced tables' triggers fire ALWAYS (also under
-- session_replication_role = replica, which PostgreSQL 15+ lets any role be granted SET on); in
-- replica mode they let rows through unchecked only for a session whose login role is a superuser
-- or a member of the lease functions' owner (current_user here): a logical replication apply worker
-- writing rows its publisher checked. Anyone else meets every check as in origin mode.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_replication_apply()
RETURNS boolean LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$ SELECT current_setting('session_replication_role') = 'replica' AND pg_has_role(session_user, current_user, 'MEMBER') $$;

-- pg_lease_check_key_scope for each of p_keys (NULLs skipped): what an opted-out write of a fenced
-- table still meets, so an opt-out never crosses a key scope.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_check_key_scopes(p_keys text[])
RETURNS void LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  k text;
BEGIN
  FOREACH k IN ARRAY coalesce(p_keys, '{}') LOOP
    IF k IS NOT NULL THEN
      PERFORM @extschema@.pg_lease_check_key_scope(k);
    END IF;
  END LOOP;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_check_key_scopes(text[]) FROM PUBLIC;

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
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_epoch IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  IF p_expected_epoch IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_epoch(p_expected_epoch);
  END IF;
  IF p_operator IS NOT NULL THEN
    PERFORM @extschema@.pg_lease_check_name('operator', p_operator);
  END IF;
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
  PERFORM @extschema@.pg_lease_check_name('key', p_key);
  PERFORM @extschema@.pg_lease_check_name('owner', p_owner);
  PERFORM @extschema@.pg_lease_check_epoch(p_epoch);
  PERFORM @extschema@.pg_lease_check_key_scope(p_key);
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
  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255 THEN
    PERFORM @extschema@.pg_lease_check_name('key', p_key);  -- a bad key is invalid_input, before the scope
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

-- Record a fence that holds as presented by this transaction (pg_lease.fences, a JSON object
-- key -> [owner, epoch]): what the fenced tables' triggers check their rows against. No SET
-- search_path (it costs a configuration switch per call on the hot path): its callers pin theirs,
-- it names only exact-typed built-ins, and called directly it only sets the caller's own setting.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_remember_fence(p_key text, p_owner text, p_epoch bigint)
RETURNS void LANGUAGE plpgsql VOLATILE
AS $$
DECLARE
  fences jsonb := @extschema@.pg_lease_presented_fences();
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
AS $$ SELECT p_token = @extschema@.pg_lease_opt_out_hash(p_role) $$;

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
  IF jsonb_typeof(presented) IS DISTINCT FROM 'array' OR jsonb_typeof(presented -> 0) IS DISTINCT FROM 'string'
     OR NOT coalesce(presented ->> 1 ~ '^[0-9]{1,18}$', false) THEN
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
  -- The triggers fire ALWAYS, in replica mode too: only a trusted replication apply passes unchecked.
  IF current_setting('session_replication_role') = 'replica' AND @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;
  END IF;
  -- coalesce: NULL AND f() still calls f() (the result could be false), and this runs on every write.
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
  keys text[];
BEGIN
  -- The triggers fire ALWAYS, in replica mode too: only a trusted replication apply passes unchecked.
  IF current_setting('session_replication_role') = 'replica' AND @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;
  END IF;
  rows_sql := CASE TG_OP WHEN 'INSERT' THEN format('SELECT %I AS pk FROM pg_lease_new', TG_ARGV[2])
                         WHEN 'DELETE' THEN format('SELECT %I AS pk FROM pg_lease_old', TG_ARGV[2])
                         ELSE format('SELECT %1$I AS pk FROM pg_lease_old UNION SELECT %1$I FROM pg_lease_new',
                                     TG_ARGV[2]) END;
  EXECUTE format('SELECT array_agg(DISTINCT a.lease_key) FROM (%s) r LEFT JOIN %s a ON a.%I = r.pk',
                 rows_sql, TG_ARGV[0], TG_ARGV[1]) INTO keys;
  -- coalesce: NULL AND f() still calls f() (the result could be false), and this runs on every write.
  IF coalesce(current_setting('pg_lease.unfenced', true), '') <> '' AND @extschema@.pg_lease_unfenced_allowed() THEN
    PERFORM @extschema@.pg_lease_check_key_scopes(keys);  -- opted out: still only the keys of its scope
    RETURN NULL;
  END IF;
  fences := @extschema@.pg_lease_presented_fences();
  FOREACH k IN ARRAY coalesce(keys, '{}') LOOP
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
  IF @extschema@.pg_lease_replication_apply() THEN
    RETURN NULL;  -- fires ALWAYS: only a trusted replication apply passes in replica mode
  END IF;
  -- Every key at once: only a session that spans every key (no key scope) may, opted out.
  IF (@extschema@.pg_lease_unfenced_allowed()
      OR (current_setting('pg_lease.allow_truncate', true) = 'on'
          AND has_function_privilege('@extschema@.pg_lease_allow_unfenced()', 'EXECUTE')))
     AND @extschema@.pg_lease_session_scope() IS NULL THEN
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
  keep integer;
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
    -- PG_LEASE_ROLE_LIMITS' max_tenures_per_key: a key under a limited role's prefixes keeps its
    -- newest tenures only (the smallest limit of the roles whose prefixes hold it).
    SELECT min(l.max_tenures_per_key) INTO keep
      FROM @extschema@."pg_lease_django_role_limit" l JOIN @extschema@."pg_lease_django_key_scope" s ON s.role = l.role
     WHERE l.max_tenures_per_key IS NOT NULL AND left(p_new.key, length(s.prefix)) = s.prefix;
    IF keep IS NOT NULL THEN
      DELETE FROM @extschema@."pg_lease_django_tenure" r
       WHERE r.key = p_new.key
         AND r.epoch < (SELECT k.epoch FROM @extschema@."pg_lease_django_tenure" k WHERE k.key = p_new.key
                         ORDER BY k.epoch DESC OFFSET keep - 1 LIMIT 1);
    END IF;
  END IF;
END $$;

REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_record_tenure(text, @extschema@."pg_lease_django_lease", @extschema@."pg_lease_django_lease") FROM PUBLIC;

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
    ('public', 'FUNCTION', '@extschema@.pg_lease_check_new_name(text, text)', 'EXECUTE'),
    ('public', 'FUNCTION', '@extschema@.pg_lease_unshown_characters()', 'EXECUTE'),
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

-- Every trigger of the package's tables fires ALWAYS, in replica mode too.
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_forbid_delete;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_forbid_truncate;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_insert_above_floor;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_guard_update;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_judge_renewal;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_record_grant;
ALTER TABLE @extschema@."pg_lease_django_lease" ENABLE ALWAYS TRIGGER pg_lease_record_prune;
ALTER TABLE @extschema@."pg_lease_django_epoch_floor" ENABLE ALWAYS TRIGGER pg_lease_floor_only_grows;
ALTER TABLE @extschema@."pg_lease_django_epoch_floor" ENABLE ALWAYS TRIGGER pg_lease_floor_kept;
ALTER TABLE @extschema@."pg_lease_django_history_scope" ENABLE ALWAYS TRIGGER pg_lease_rescope;

-- The scopes configured before this migration, compiled.
SELECT @extschema@.pg_lease_compile_key_scope();
