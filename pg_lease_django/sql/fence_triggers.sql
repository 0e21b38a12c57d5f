-- What a fenced table carries: the DDL `FenceTrigger` (pg_lease_django.fencing.schema), a constraint
-- written into users' migrations, runs when a migration adds or removes it. The format is
-- queries.sql's (a line `-- name --`, comment lines, then the template), read by the same parser.
-- `{schema}` is the quoted schema of the lease functions; every other `{name}` is an identifier, a
-- literal or a fragment composed with psycopg.sql. DDL has no parameters: a `%` is literal.
-- FENCE_TRIGGER_VERSION is a hash of the templates that say what is installed (every one but
-- `fence_triggers_drop`): changing one changes it, and `makemigrations` then writes a migration that
-- replaces the triggers in every app with a fenced model.

-- fence_triggers_create --
-- The triggers of a fenced table ({table}): after each INSERT, UPDATE and DELETE statement, {guard}
-- (`fence_guard_rows` or `fence_guard_inherited_rows`) checks every row's lease against the fence the
-- transaction presented; TRUNCATE is refused unless the transaction opted out. They fire ALWAYS:
-- session_replication_role = replica (which PostgreSQL 15+ lets any role be granted) does not turn
-- them off; the guard lets a trusted replication apply through (pg_lease_replication_apply).
-- {comment} names the version that installed them (check W006 reads it).
CREATE TRIGGER pg_lease_fence_insert AFTER INSERT ON {table}
  REFERENCING NEW TABLE AS pg_lease_new FOR EACH STATEMENT EXECUTE FUNCTION {guard};
CREATE TRIGGER pg_lease_fence_update AFTER UPDATE ON {table}
  REFERENCING OLD TABLE AS pg_lease_old NEW TABLE AS pg_lease_new FOR EACH STATEMENT EXECUTE FUNCTION {guard};
CREATE TRIGGER pg_lease_fence_delete AFTER DELETE ON {table}
  REFERENCING OLD TABLE AS pg_lease_old FOR EACH STATEMENT EXECUTE FUNCTION {guard};
CREATE TRIGGER pg_lease_fence_truncate BEFORE TRUNCATE ON {table}
  FOR EACH STATEMENT EXECUTE FUNCTION {schema}.pg_lease_guard_truncate();
ALTER TABLE {table} ENABLE ALWAYS TRIGGER pg_lease_fence_insert, ENABLE ALWAYS TRIGGER pg_lease_fence_update,
  ENABLE ALWAYS TRIGGER pg_lease_fence_delete, ENABLE ALWAYS TRIGGER pg_lease_fence_truncate;
COMMENT ON TRIGGER pg_lease_fence_insert ON {table} IS {comment};
COMMENT ON TRIGGER pg_lease_fence_update ON {table} IS {comment};
COMMENT ON TRIGGER pg_lease_fence_delete ON {table} IS {comment};
COMMENT ON TRIGGER pg_lease_fence_truncate ON {table} IS {comment}

-- fence_guard_rows --
-- The guard of a table that stores its rows' lease keys.
{schema}.pg_lease_guard_rows()

-- fence_guard_inherited_rows --
-- The guard of a multi-table child, whose rows' keys are stored in the fenced ancestor's table: the
-- ancestor ({ancestor}, its quoted name), its primary key column and the child's that points to it,
-- each a literal (a trigger's arguments are text).
{schema}.pg_lease_guard_inherited_rows({ancestor}, {ancestor_pk}, {child_pk})

-- fence_derive_key --
-- The lease key derived by the database, for a fenced table whose model declares its key
-- (lease_key_expression, or a class-level lease_key): before each row is inserted, and updated in a
-- column the key is made of or in the key itself ({columns}), lease_key is set by {function}, the
-- table's own trigger function ({body}: `fence_derive_key_body`, as a literal), whatever the writer
-- sent, ORM or raw SQL. The function pins its search_path, so that no writer's schema can answer for
-- an operator or function of the expression. Rows already stored get their derived key first
-- ({stored}: the declaration compiled over the table), before the fence triggers exist.
CREATE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS {body};
CREATE TRIGGER pg_lease_derive_key BEFORE INSERT OR UPDATE OF {columns} ON {table}
  FOR EACH ROW EXECUTE FUNCTION {function}();
ALTER TABLE {table} ENABLE ALWAYS TRIGGER pg_lease_derive_key;
COMMENT ON TRIGGER pg_lease_derive_key ON {table} IS {comment};
UPDATE {table} SET lease_key = lease_key WHERE lease_key IS DISTINCT FROM ({stored});

-- fence_derive_key_body --
-- The body of `fence_derive_key`'s function: {expression} is the declaration compiled over the row
-- (NEW).
BEGIN NEW.lease_key := {expression}; RETURN NEW; END

-- fence_triggers_drop --
-- What `FenceTrigger` removes: every trigger above, and the table's derive function ({function}).
-- Django runs it with parameters (none): a `%` here would need doubling.
DROP TRIGGER IF EXISTS pg_lease_fence_insert ON {table};
DROP TRIGGER IF EXISTS pg_lease_fence_update ON {table};
DROP TRIGGER IF EXISTS pg_lease_fence_delete ON {table};
DROP TRIGGER IF EXISTS pg_lease_fence_truncate ON {table};
DROP TRIGGER IF EXISTS pg_lease_derive_key ON {table};
DROP FUNCTION IF EXISTS {function}()
