"""A lease's history, and hand-off requests.

- **History** (opt-in per key prefix, ``PG_LEASE_HISTORY``): every tenure of a recorded key is a row
  of ``pg_lease_django_tenure``, written by triggers on the lease table in the very statement that
  grants or ends it, whoever sends that statement (the manager, psql, another language): an AFTER
  INSERT trigger for a key's first grant, a BEFORE UPDATE trigger for every change of epoch (grant,
  release, force release, epoch advance) and an AFTER DELETE trigger for a lapsed row pruned. A
  renewal changes no epoch and fires nothing. Which keys are recorded is a table the database reads
  (``pg_lease_django_history_scope``, one row per prefix), which ``migrate`` fills from the setting.
- **Hand-off**: ``pg_lease_request_handoff`` stamps ``handoff_requested_at`` on a held lease; the
  holder's renewals return it (``pg_lease_heartbeat``: ``pg_lease_renew`` with a fourth column,
  ``handoff_requested``; ``pg_lease_renew`` keeps its three for SQL clients and for processes of the
  previous version during a rolling deploy) and its release is recorded as ``handed_off``. Any
  grant clears the stamp (the BEFORE UPDATE trigger). It is advice: nothing else changes, and a
  holder that ignores it keeps its lease.
- ``pg_lease_force_release(key, epoch, operator)`` records who forced the release; the two-argument
  form calls it with no operator (the database role is recorded). It gets the two-argument form's
  grants, as ``pg_lease_heartbeat`` gets ``pg_lease_renew``'s.
"""

from importlib import import_module

from django.db import migrations, models
from django.db.backends.base.schema import BaseDatabaseSchemaEditor
from django.db.migrations.state import StateApps

from ._sql import function_definitions, run_template

airtight = import_module("pg_lease_django.migrations.0004_airtight")
notify = import_module("pg_lease_django.migrations.0006_notify_waiters")

RENEW = "pg_lease_renew(text, text, bigint, interval)"
HEARTBEAT = "pg_lease_heartbeat(text, text, bigint, interval)"
FORCE_RELEASE = "pg_lease_force_release(text, bigint)"
FORCE_RELEASE_BY = "pg_lease_force_release(text, bigint, text)"

# {s}: the quoted schema; {t}: the lease table; {h}: the history scope; {r}: the tenures; {f}: the floor.
FORWARD_SQL = r"""
-- The key prefixes whose tenures are recorded ('' records every key); migrate copies PG_LEASE_HISTORY here.
CREATE TABLE {h} (
  prefix text CONSTRAINT pg_lease_django_history_scope_pkey PRIMARY KEY
              CONSTRAINT pg_lease_history_prefix_length CHECK (octet_length(prefix) <= 255)
);

-- Record a transition of a lease row in its tenures, and clear a hand-off request on every change
-- of epoch. Runs as the owner (the lease functions do too), in the statement of the transition.
CREATE FUNCTION {s}.pg_lease_record_transition()
RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  row_key text;
  now_at timestamptz;
  reason text;
  ended timestamptz;
  by_whom text;
BEGIN
  IF TG_OP = 'UPDATE' THEN
    NEW.handoff_requested_at := NULL;
    row_key := NEW.key;
  ELSIF TG_OP = 'INSERT' THEN
    row_key := NEW.key;
  ELSE
    row_key := OLD.key;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM {h} h WHERE left(row_key, length(h.prefix)) = h.prefix) THEN
    RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
  END IF;

  IF TG_OP <> 'INSERT' AND OLD.owner IS NOT NULL THEN  -- the tenure of OLD ends here
    now_at := CASE WHEN NEW.owner IS NULL THEN coalesce(NEW.released_at, clock_timestamp())  -- a release
                   WHEN NEW.acquired_at IS DISTINCT FROM OLD.acquired_at THEN NEW.acquired_at  -- a grant
                   ELSE clock_timestamp() END;  -- an epoch advance
    IF TG_OP = 'DELETE' OR OLD.expires_at <= now_at THEN
      -- It had lapsed: it ended at its expiry, whatever cleared the row (a take-over: by the new
      -- owner; a prune, an epoch advance: nobody; a force release: pg_lease_force_release adds who).
      reason := 'lapsed'; ended := OLD.expires_at;
      by_whom := CASE WHEN TG_OP = 'UPDATE' AND NEW.owner IS DISTINCT FROM OLD.owner THEN NEW.owner END;
    ELSIF NEW.owner IS NULL THEN  -- a release (pg_lease_force_release relabels its own afterwards)
      reason := CASE WHEN OLD.handoff_requested_at IS NOT NULL THEN 'handed_off' ELSE 'released' END;
      ended := now_at; by_whom := OLD.owner;
    ELSIF NEW.acquired_at IS NOT DISTINCT FROM OLD.acquired_at THEN  -- epochs advanced under it
      reason := 'epochs_advanced'; ended := now_at; by_whom := session_user;
    ELSE
      reason := 'reacquired'; ended := NEW.acquired_at; by_whom := NEW.owner;
    END IF;
    UPDATE {r} r SET ended_at = ended, end_reason = reason, ended_by = by_whom
     WHERE r.key = OLD.key AND r.epoch = OLD.epoch AND r.ended_at IS NULL;
  END IF;

  IF TG_OP <> 'DELETE' AND NEW.owner IS NOT NULL
     AND (TG_OP = 'INSERT' OR NEW.acquired_at IS DISTINCT FROM OLD.acquired_at) THEN  -- a grant
    INSERT INTO {r} (key, epoch, owner, granted_at) VALUES (NEW.key, NEW.epoch, NEW.owner, NEW.acquired_at);
  END IF;
  RETURN CASE WHEN TG_OP = 'DELETE' THEN OLD ELSE NEW END;
END $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_record_transition() FROM PUBLIC;

CREATE TRIGGER pg_lease_record_grant AFTER INSERT ON {t}
  FOR EACH ROW WHEN (NEW.owner IS NOT NULL) EXECUTE FUNCTION {s}.pg_lease_record_transition();
CREATE TRIGGER pg_lease_record_transition BEFORE UPDATE ON {t}
  FOR EACH ROW WHEN (NEW.epoch IS DISTINCT FROM OLD.epoch) EXECUTE FUNCTION {s}.pg_lease_record_transition();
CREATE TRIGGER pg_lease_record_prune AFTER DELETE ON {t}
  FOR EACH ROW WHEN (OLD.owner IS NOT NULL) EXECUTE FUNCTION {s}.pg_lease_record_transition();

-- Ask the holder of p_key (at p_epoch, when given) to step down at its next renewal. Advice only:
-- the grant is unchanged. Outcome 'ok' (requested now, or already), or why nobody can be asked:
-- 'not_found', 'free', 'lapsed', 'epoch_mismatch'. Locks like a renewal (FOR NO KEY UPDATE).
CREATE FUNCTION {s}.pg_lease_request_handoff(p_key text, p_epoch bigint DEFAULT NULL)
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
  PERFORM {s}.pg_lease_check_name('key', p_key);
  IF p_epoch IS NOT NULL THEN
    PERFORM {s}.pg_lease_check_epoch(p_epoch);
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at, l.handoff_requested_at INTO cur
    FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
  now_at := clock_timestamp();
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM {f} f), NULL::timestamptz,
                        NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF {s}.pg_lease_status(cur.owner, cur.expires_at, now_at) <> 'held' THEN
    RETURN QUERY SELECT {s}.pg_lease_status(cur.owner, cur.expires_at, now_at), cur.owner, cur.epoch,
                        cur.expires_at, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF p_epoch IS NOT NULL AND cur.epoch <> p_epoch THEN
    RETURN QUERY SELECT 'epoch_mismatch'::text, cur.owner, cur.epoch, cur.expires_at, NULL::timestamptz, now_at;
    RETURN;
  END IF;
  IF cur.handoff_requested_at IS NULL THEN
    UPDATE {t} l SET handoff_requested_at = now_at WHERE l.key = p_key;
  END IF;
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch, cur.expires_at,
                      coalesce(cur.handoff_requested_at, now_at), now_at;
END $$;

-- Renew (0004), also saying whether a hand-off was requested (read under the row lock it takes): what
-- the package sends for every renewal. pg_lease_renew keeps its three columns, for SQL clients and for
-- processes still running the previous version during a rolling deploy: it calls this one.
CREATE FUNCTION {s}.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz, handoff_requested boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
  now_at timestamptz;
  verdict text;
  ttl interval;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  PERFORM {s}.pg_lease_check_name('owner', p_owner);
  PERFORM {s}.pg_lease_check_epoch(p_epoch);
  ttl := {s}.pg_lease_ttl(p_ttl);
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
  verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
  IF verdict = 'ok' THEN
    SELECT l.owner, l.epoch, l.expires_at, l.handoff_requested_at INTO cur
      FROM {t} l WHERE l.key = p_key FOR NO KEY UPDATE;
    now_at := clock_timestamp();
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, now_at);
  END IF;
  IF verdict <> 'ok' THEN
    RETURN QUERY SELECT verdict, NULL::timestamptz, clock_timestamp(), false;
    RETURN;
  END IF;
  UPDATE {t} l SET expires_at = now_at + ttl WHERE l.key = p_key;
  RETURN QUERY SELECT 'ok'::text, now_at + ttl, now_at, cur.handoff_requested_at IS NOT NULL;
END $$;

CREATE OR REPLACE FUNCTION {s}.pg_lease_renew(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
RETURNS TABLE (outcome text, expires_at timestamptz, server_time timestamptz)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT h.outcome, h.expires_at, h.server_time FROM {s}.pg_lease_heartbeat(p_key, p_owner, p_epoch, p_ttl) h
$$;

-- Force release (0006), recording who forced it (p_operator, else the database role) in the history.
CREATE FUNCTION {s}.pg_lease_force_release(p_key text, p_expected_epoch bigint, p_operator text)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  cur record;
BEGIN
  PERFORM {s}.pg_lease_check_name('key', p_key);
  IF p_expected_epoch IS NOT NULL THEN
    PERFORM {s}.pg_lease_check_epoch(p_expected_epoch);
  END IF;
  IF p_operator IS NOT NULL THEN
    PERFORM {s}.pg_lease_check_name('operator', p_operator);
  END IF;
  PERFORM set_config('synchronous_commit', 'on', true);
  SELECT l.owner, l.epoch INTO cur FROM {t} l WHERE l.key = p_key FOR UPDATE;
  IF NOT FOUND THEN
    RETURN QUERY SELECT 'not_found'::text, NULL::text, (SELECT f.floor FROM {f} f), clock_timestamp();
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
  UPDATE {t} l SET owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                   released_at = clock_timestamp()
   WHERE l.key = p_key;
  -- The history trigger recorded a release (or a lapse); say who forced it. Only this function can:
  -- nothing a caller sets makes the trigger record a force release.
  UPDATE {r} r SET end_reason = CASE WHEN r.end_reason = 'lapsed' THEN 'lapsed' ELSE 'force_released' END,
                   ended_by = coalesce(p_operator, session_user::text)
   WHERE r.key = p_key AND r.epoch = cur.epoch AND r.ended_at IS NOT NULL;
  PERFORM {s}.pg_lease_wake_waiters(p_key);
  RETURN QUERY SELECT 'ok'::text, cur.owner, cur.epoch + 1, clock_timestamp();
END $$;

CREATE OR REPLACE FUNCTION {s}.pg_lease_force_release(p_key text, p_expected_epoch bigint)
RETURNS TABLE (outcome text, owner text, epoch bigint, server_time timestamptz)
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
  SELECT * FROM {s}.pg_lease_force_release(p_key, p_expected_epoch, NULL::text)
$$;
"""

BACKWARD_SQL = (
    r"""
DROP TRIGGER IF EXISTS pg_lease_record_grant ON {t};
DROP TRIGGER IF EXISTS pg_lease_record_transition ON {t};
DROP TRIGGER IF EXISTS pg_lease_record_prune ON {t};
DROP FUNCTION IF EXISTS {s}.pg_lease_record_transition();
DROP FUNCTION IF EXISTS {s}.pg_lease_request_handoff(text, bigint);
"""
    + function_definitions(airtight.FUNCTIONS_SQL, "pg_lease_renew")
    + function_definitions(notify.FUNCTIONS_SQL, "pg_lease_force_release")
    + r"""
DROP FUNCTION IF EXISTS {s}.pg_lease_force_release(text, bigint, text);
DROP FUNCTION IF EXISTS {s}.pg_lease_heartbeat(text, text, bigint, interval);
DROP TABLE IF EXISTS {h};
"""
)


def _tables(template: str) -> str:
    return (
        template.replace("{h}", '{s}."pg_lease_django_history_scope"')
        .replace("{r}", '{s}."pg_lease_django_tenure"')
        .replace("{f}", '{s}."pg_lease_django_epoch_floor"')
    )


def _grants(schema_editor: BaseDatabaseSchemaEditor, function: str) -> list[tuple[str, bool]] | None:
    """The EXECUTE grants of ``function`` in the current schema: (grantee, with grant option), the grantee
    quoted (``PUBLIC`` for everyone); None when it has the default privileges (EXECUTE for PUBLIC)."""
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT p.proacl IS NULL FROM pg_catalog.pg_proc p WHERE p.oid = "
            "pg_catalog.to_regprocedure(pg_catalog.quote_ident(current_schema()) || '.' || %s)",
            [function],
        )
        row = cursor.fetchone()
        if row is None or row[0]:
            return None
        cursor.execute(
            "SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END, a.is_grantable "
            "FROM pg_catalog.pg_proc p, pg_catalog.aclexplode(p.proacl) a WHERE p.oid = "
            "pg_catalog.to_regprocedure(pg_catalog.quote_ident(current_schema()) || '.' || %s) "
            "AND a.privilege_type = 'EXECUTE'",
            [function],
        )
        return [(grantee, grantable) for grantee, grantable in cursor.fetchall()]


def _grant_like(schema_editor: BaseDatabaseSchemaEditor, grants: list[tuple[str, bool]] | None, function: str) -> None:
    """Give ``function`` the EXECUTE grants ``_grants`` read (an operator's REVOKE and GRANT carry over)."""
    if grants is None:
        return
    statements = [f"REVOKE EXECUTE ON FUNCTION {{s}}.{function} FROM PUBLIC;"]
    for grantee, grantable in grants:
        option = " WITH GRANT OPTION" if grantable else ""
        statements.append(f"GRANT EXECUTE ON FUNCTION {{s}}.{function} TO {grantee}{option};")
    run_template("\n".join(statements), schema_editor)


def forward(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    renew_grants = _grants(schema_editor, RENEW)
    force_grants = _grants(schema_editor, FORCE_RELEASE)
    run_template(_tables(FORWARD_SQL), schema_editor)
    _grant_like(schema_editor, renew_grants, HEARTBEAT)
    _grant_like(schema_editor, force_grants, FORCE_RELEASE_BY)


def backward(apps: StateApps, schema_editor: BaseDatabaseSchemaEditor) -> None:
    run_template(_tables(BACKWARD_SQL), schema_editor)


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0008_cheap_refusal")]

    operations = [
        migrations.AddField(
            model_name="lease",
            name="handoff_requested_at",
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.CreateModel(
            name="LeaseTenure",
            fields=[
                ("id", models.BigAutoField(auto_created=True, primary_key=True, serialize=False, verbose_name="ID")),
                ("key", models.TextField()),
                ("epoch", models.BigIntegerField()),
                ("owner", models.TextField()),
                ("granted_at", models.DateTimeField()),
                ("ended_at", models.DateTimeField(blank=True, null=True)),
                (
                    "end_reason",
                    models.TextField(
                        blank=True,
                        choices=[
                            ("released", "released by its holder"),
                            ("handed_off", "handed off (released after a hand-off request)"),
                            ("lapsed", "lapsed (then taken over, or pruned)"),
                            ("reacquired", "re-acquired by its holder under a new epoch"),
                            ("force_released", "force-released by an operator"),
                            ("epochs_advanced", "fenced by an epoch advance"),
                        ],
                        null=True,
                    ),
                ),
                ("ended_by", models.TextField(blank=True, null=True)),
            ],
            options={
                "db_table": "pg_lease_django_tenure",
                "ordering": ["key", "epoch"],
                "indexes": [models.Index(fields=["key", "epoch"], name="pg_lease_tenure_key_epoch")],
            },
        ),
        migrations.RunPython(forward, backward),
    ]
