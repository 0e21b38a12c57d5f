"""Renew and release in one statement, judged under the row lock.

0009's renew (``pg_lease_heartbeat``) and ``pg_lease_release`` looked at the row, locked it with a
second statement, judged it again on a clock read after the lock, then wrote it with a third. Each
is now one ``UPDATE … WHERE key AND owner AND epoch AND expires_at > clock_timestamp() RETURNING``,
and the row is read afterwards only when that UPDATE found nothing, to name the verdict. A refused
call writes nothing; it locks nothing unless it waited for the row (an UPDATE does not lock a row
that fails its WHERE), and one that waited keeps the row lock until the caller's transaction ends,
as 0009's ``SELECT … FOR UPDATE`` did.

**Grants.** Acquire's UPDATE marks its grant (``acquired_at = -infinity``, ``expires_at`` = the Unix
epoch + TTL) and the trigger below stamps it with one clock read taken under the row lock: expiry =
server_now + TTL exactly, the server time returned is the row's ``acquired_at``, and a grant that
waited for a lock-only locker (the lapsed holder's fenced transaction) starts after that wait. The
SET list alone is computed before the wait, and two ``clock_timestamp()`` calls differ.

**Strictness kept.** PostgreSQL evaluates the WHERE before it locks the row. When the row was
*changed* meanwhile, READ COMMITTED judges it again on the new version, under the lock, on a new
clock read. When it was only *locked* meanwhile (``SELECT … FOR UPDATE`` by anyone, a force release
that found nothing to do), nothing is judged again, and the lease may have lapsed while the call
waited. A BEFORE UPDATE trigger closes that: PostgreSQL runs row triggers after it has locked the
row, so ``pg_lease_recheck_under_lock`` reads the clock there and skips the row (the UPDATE then
finds nothing) when

- a renewal (same epoch, later expiry) extends a lease whose expiry has passed: whoever sends it,
  so a plain ``UPDATE`` can no longer bring back a lapsed epoch either;
- a release (``pg_lease_release`` stamps ``released_at`` with ``-infinity``; the trigger replaces
  it with the clock it read) frees a lease whose expiry has passed.

``tests/test_judged_under_lock.py`` forces each interleaving.

The release's UPDATE names the key column (``SET key = l.key``): with row triggers on the table,
PostgreSQL then locks the row ``FOR UPDATE`` rather than ``FOR NO KEY UPDATE``, so a release still
waits for the holder's fenced transactions (``FOR KEY SHARE``), as 0004 made it.

The input checks (``pg_lease_inspect``'s too) are one inline condition, as in 0008's acquire (the
checking functions run only to raise), and ``synchronous_commit`` is set only when the call wrote.
"""

from importlib import import_module

from django.db import migrations

from ._sql import function_definitions, schema_sql

notify = import_module("pg_lease_django.migrations.0006_notify_waiters")
history = import_module("pg_lease_django.migrations.0009_history_and_handoff")
prune = import_module("pg_lease_django.migrations.0005_prune")
cheap = import_module("pg_lease_django.migrations.0008_cheap_refusal")

# Acquire: 0008's, with its locked attempt (SELECT … FOR UPDATE in a subtransaction, then UPDATE) made
# one UPDATE in the subtransaction.
ONE_UPDATE_ATTEMPT = r"""
    -- Acquirable at the look: one UPDATE in a subtransaction, rolled back when it finds the row taken
    -- meanwhile (an UPDATE that waited for the row and then fails its WHERE keeps the row locked; the
    -- rollback drops that lock). key = l.key: lock FOR UPDATE, which waits for the old holder's fenced
    -- transactions (FOR KEY SHARE). acquired_at = -infinity: pg_lease_recheck_under_lock stamps the
    -- grant with one clock read taken under the row lock, after any wait; the TTL reaches it as
    -- expires_at = the Unix epoch + TTL.
    ttl := make_interval(secs => extract(epoch FROM p_ttl)::double precision);  -- as pg_lease_ttl
    BEGIN
      UPDATE {t} l SET key = l.key, owner = p_owner, epoch = l.epoch + 1, acquired_at = '-infinity',
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
""".removeprefix("\n")


def _acquire_with_one_update(acquire: str) -> str:
    """0008's acquire with ``ONE_UPDATE_ATTEMPT`` in place of its locked attempt."""
    start = acquire.index(
        "    PERFORM set_config('synchronous_commit', 'on', true);\n    ttl := {s}.pg_lease_ttl(p_ttl);\n"
    )
    end = acquire.index("  END LOOP;", start)
    loop = "  LOOP  -- again only when the row is pruned between the unlocked look and the lock"
    assert acquire.count(loop) == 1 and acquire.count("  refused boolean;\n") == 1
    return "-- Acquire (0008): the locked attempt on an existing row is one UPDATE.\n" + (
        acquire[:start] + ONE_UPDATE_ATTEMPT + acquire[end:]
    ).replace("  refused boolean;\n", "  granted_until timestamptz;\n").replace(
        loop, "  LOOP  -- again when the row changed between the unlocked look and the UPDATE"
    )


ACQUIRE_SQL = _acquire_with_one_update(function_definitions(cheap.FUNCTIONS_SQL, "pg_lease_acquire"))

# Wake waiters: 0006's without its SET clause. Called on every release, only by the lease functions
# (revoked from PUBLIC), under their own SET search_path; it names only built-ins and {w}.
WAKE_WAITERS_SQL = function_definitions(notify.FUNCTIONS_SQL, "pg_lease_wake_waiters").replace(
    "SET search_path = pg_catalog, pg_temp\n", "", 1
)


# Inspect: 0005's with its input check inline, as above.
INSPECT_SQL = function_definitions(prune.FUNCTIONS_SQL, "pg_lease_inspect").replace(
    "  PERFORM {s}.pg_lease_check_name('key', p_key);\n",
    "  IF p_key IS NULL OR p_key = '' OR octet_length(p_key) > 255 THEN\n"
    "    PERFORM {s}.pg_lease_check_name('key', p_key);\n"
    "  END IF;\n",
    1,
)
assert "octet_length" in INSPECT_SQL

# {s}: the quoted schema; {t}: the quoted lease table; {f}: the epoch floor (0005); {w}: the waiters (0006).
FUNCTIONS_SQL = (
    r"""
CREATE FUNCTION {s}.pg_lease_recheck_under_lock()
RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
  now_at timestamptz := clock_timestamp();
BEGIN
  IF NEW.acquired_at = '-infinity' THEN  -- a grant by pg_lease_acquire: expiry = this clock read + TTL
    NEW.expires_at := now_at + make_interval(secs => extract(epoch FROM NEW.expires_at)::double precision);
    NEW.acquired_at := now_at;
    RETURN NEW;
  END IF;
  IF OLD.expires_at <= now_at THEN
    RETURN NULL;  -- it lapsed before the row lock was granted: refused, nothing written
  END IF;
  NEW.released_at := CASE WHEN NEW.released_at = '-infinity' THEN now_at ELSE NEW.released_at END;
  RETURN NEW;
END $$;
REVOKE EXECUTE ON FUNCTION {s}.pg_lease_recheck_under_lock() FROM PUBLIC;

CREATE OR REPLACE FUNCTION {s}.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval)
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
    PERFORM {s}.pg_lease_check_name('key', p_key);
    PERFORM {s}.pg_lease_check_name('owner', p_owner);
    PERFORM {s}.pg_lease_check_epoch(p_epoch);
    PERFORM {s}.pg_lease_ttl(p_ttl);
  END IF;
  ttl := make_interval(secs => extract(epoch FROM p_ttl)::double precision);  -- as pg_lease_ttl
  LOOP  -- again only if the row turned valid between the UPDATE and the look (it cannot, by the rules)
    UPDATE {t} l SET expires_at = clock_timestamp() + ttl
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING l.expires_at, l.handoff_requested_at IS NOT NULL INTO new_expiry, handoff;
    IF FOUND THEN
      PERFORM set_config('synchronous_commit', 'on', true);
      RETURN QUERY SELECT 'ok'::text, new_expiry, new_expiry - ttl, handoff;
      RETURN;
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
    IF verdict <> 'ok' THEN
      RETURN QUERY SELECT verdict, NULL::timestamptz, clock_timestamp(), false;
      RETURN;
    END IF;
  END LOOP;
END $$;

CREATE OR REPLACE FUNCTION {s}.pg_lease_release(p_key text, p_owner text, p_epoch bigint)
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
    PERFORM {s}.pg_lease_check_name('key', p_key);
    PERFORM {s}.pg_lease_check_name('owner', p_owner);
    PERFORM {s}.pg_lease_check_epoch(p_epoch);
  END IF;
  LOOP  -- as in pg_lease_heartbeat
    -- key = l.key: lock FOR UPDATE (waits for fenced transactions); -infinity: pg_lease_recheck_under_lock
    -- judges it again under the lock and stamps the clock it read.
    UPDATE {t} l SET key = l.key, owner = NULL, epoch = l.epoch + 1, acquired_at = NULL, expires_at = NULL,
                     released_at = '-infinity'
     WHERE l.key = p_key AND l.owner = p_owner AND l.epoch = p_epoch AND l.expires_at > clock_timestamp()
    RETURNING l.epoch, l.released_at INTO new_epoch, released;
    IF FOUND THEN
      PERFORM set_config('synchronous_commit', 'on', true);
      PERFORM {s}.pg_lease_wake_waiters(p_key);
      RETURN QUERY SELECT 'ok'::text, new_epoch, released;
      RETURN;
    END IF;
    SELECT l.owner, l.epoch, l.expires_at INTO cur FROM {t} l WHERE l.key = p_key;
    verdict := {s}.pg_lease_verdict(cur.owner, cur.epoch, cur.expires_at, p_owner, p_epoch, clock_timestamp());
    IF verdict <> 'ok' THEN
      RETURN QUERY SELECT verdict, cur.epoch, clock_timestamp();
      RETURN;
    END IF;
  END LOOP;
END $$;

"""
    + ACQUIRE_SQL
    + "\n"
    + WAKE_WAITERS_SQL
    + r"""
"""
    + INSPECT_SQL
    + r"""

-- After the row lock is granted (row triggers run then), with the clock read there.
CREATE TRIGGER pg_lease_recheck_under_lock BEFORE UPDATE ON {t}
  FOR EACH ROW
  WHEN ((NEW.epoch = OLD.epoch AND NEW.expires_at > OLD.expires_at AND OLD.expires_at <= clock_timestamp())
        OR NEW.released_at = '-infinity' OR NEW.acquired_at = '-infinity')
  EXECUTE FUNCTION {s}.pg_lease_recheck_under_lock();
"""
)

BACKWARD_SQL = (
    r"""
DROP TRIGGER IF EXISTS pg_lease_recheck_under_lock ON {t};
DROP FUNCTION IF EXISTS {s}.pg_lease_recheck_under_lock();
"""
    + function_definitions(history.FORWARD_SQL, "pg_lease_heartbeat")
    + function_definitions(notify.FUNCTIONS_SQL, "pg_lease_release")
    + function_definitions(prune.FUNCTIONS_SQL, "pg_lease_inspect")
    + function_definitions(cheap.FUNCTIONS_SQL, "pg_lease_acquire")
    + function_definitions(notify.FUNCTIONS_SQL, "pg_lease_wake_waiters")
)


class Migration(migrations.Migration):
    dependencies = [("pg_lease_django", "0009_history_and_handoff")]

    operations = [schema_sql(notify._tables(FUNCTIONS_SQL), notify._tables(BACKWARD_SQL))]
