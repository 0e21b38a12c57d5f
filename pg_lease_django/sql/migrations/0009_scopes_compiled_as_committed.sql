-- Migration 0009: scopes compiled as committed.
--
-- Written by `python -m devkit.sqlchange scopes_compiled_as_committed` from sql/schema.sql, the source:
-- each object restated whole (CREATE OR REPLACE keeps a function's privileges, restated anyway).
-- * changed function pg_lease_compile_key_scope() (definition)

-- The body of pg_lease_key_allowed for the scope table's rows (one condition per row, tested
-- prefix first so that only the rows whose prefix matches look at memberships). Owner-run: only
-- the owner may replace the function, and RLS keeps every other role from writing the table.
-- It must compile the table as committed, or a narrowing committed meanwhile is undone: so one
-- compilation at a time (SHARE UPDATE EXCLUSIVE conflicts with itself, not with the writers' own
-- ROW EXCLUSIVE; a role without a write privilege on the table cannot take it), each reading the
-- table once it holds the lock, which only READ COMMITTED does (a REPEATABLE READ or SERIALIZABLE
-- transaction reads as of its start, so a scope change there is refused, 0A000).
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_compile_key_scope()
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  conditions text;
BEGIN
  IF pg_catalog.current_setting('transaction_isolation') NOT IN ('read committed', 'read uncommitted') THEN
    RAISE EXCEPTION 'key scopes change only in a READ COMMITTED transaction (this one is %)',
                    pg_catalog.current_setting('transaction_isolation')
      USING ERRCODE = 'feature_not_supported',
            HINT = 'A transaction that reads as of its start could compile the scope from rows another has changed since; change the scope table in READ COMMITTED (manage.py leases grant does).';
  END IF;
  LOCK TABLE @extschema@."pg_lease_django_key_scope" IN SHARE UPDATE EXCLUSIVE MODE;
  SELECT string_agg(
           format('(%s pg_catalog.pg_has_role(session_user, pg_catalog.to_regrole(%L), ''MEMBER''))',
                  CASE WHEN s.prefix = '' THEN ''
                       ELSE format('pg_catalog.left(p_key, %s) OPERATOR(pg_catalog.=) %L AND', length(s.prefix), s.prefix) END,
                  quote_ident(s.role)),
           E'\n    OR ' ORDER BY s.role, s.prefix)
    INTO conditions FROM @extschema@."pg_lease_django_key_scope" s;
  EXECUTE format('CREATE OR REPLACE FUNCTION @extschema@.pg_lease_key_allowed(p_key text) '
                 'RETURNS boolean LANGUAGE sql STABLE AS %L',
                 CASE WHEN conditions IS NULL THEN ' SELECT true '
                      ELSE format(E'\n  SELECT %s\n    OR pg_catalog.pg_has_role(session_user, current_user, ''MEMBER'')\n', conditions) END);
END $$;
REVOKE EXECUTE ON FUNCTION @extschema@.pg_lease_compile_key_scope() FROM PUBLIC;
