-- Reverse of 0006: pg_lease_guard_update with its WHEN clause, without pg_lease_judge_renewal.

DROP TRIGGER pg_lease_judge_renewal ON @extschema@."pg_lease_django_lease";
DROP FUNCTION @extschema@.pg_lease_judge_renewal();
DROP TRIGGER pg_lease_guard_update ON @extschema@."pg_lease_django_lease";

CREATE TRIGGER pg_lease_guard_update BEFORE UPDATE ON @extschema@."pg_lease_django_lease"
  FOR EACH ROW
  WHEN (NEW.epoch <> OLD.epoch OR NEW.key <> OLD.key OR NEW.owner IS DISTINCT FROM OLD.owner
        OR NEW.recorded <> OLD.recorded
        OR (NEW.expires_at <> OLD.expires_at AND OLD.expires_at <= clock_timestamp())
        OR NEW.released_at = '-infinity' OR NEW.acquired_at = '-infinity')
  EXECUTE FUNCTION @extschema@.pg_lease_guard_update();
