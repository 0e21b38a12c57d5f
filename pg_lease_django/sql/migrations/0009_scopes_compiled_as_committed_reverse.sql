-- Reverse of migration 0009: each object as 0008_hot_path left it,
-- what 0009_scopes_compiled_as_committed made dropped.

-- The body of pg_lease_key_allowed for the scope table's rows (one condition per row, tested
-- prefix first so that only the rows whose prefix matches look at memberships). Owner-run: only
-- the owner may replace the function, and RLS keeps every other role from writing the table.
CREATE OR REPLACE FUNCTION @extschema@.pg_lease_compile_key_scope()
RETURNS void LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  conditions text;
BEGIN
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
