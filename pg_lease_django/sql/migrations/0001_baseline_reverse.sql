-- Unapplies 0001_baseline: drops every object of the lease app (its rows and epochs with them).
-- Users' fenced tables must go first: their triggers call pg_lease_guard_rows (their migrations
-- depend on this one, so Django unapplies them first).
DROP TABLE @extschema@."pg_lease_django_tenure", @extschema@."pg_lease_django_history_scope",
  @extschema@."pg_lease_django_waiter", @extschema@."pg_lease_django_epoch_floor", @extschema@."pg_lease_django_lease";
DROP FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval);
DROP FUNCTION @extschema@.pg_lease_acquire(p_key text, p_owner text, p_ttl interval, p_wait interval);
DROP FUNCTION @extschema@.pg_lease_acquire_or_register(p_key text, p_owner text, p_ttl interval, p_retry_within interval);
DROP FUNCTION @extschema@.pg_lease_advance_epochs(p_by bigint, p_dry_run boolean);
DROP FUNCTION @extschema@.pg_lease_allow_unfenced();
DROP FUNCTION @extschema@.pg_lease_check_epoch(p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_check_fence(p_key text, p_owner text, p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_check_name(p_kind text, p_value text);
DROP FUNCTION @extschema@.pg_lease_check_ttl(p_ttl interval);
DROP FUNCTION @extschema@.pg_lease_fence(p_key text, p_owner text, p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_fence_outcome(p_key text, p_owner text, p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_forbid_delete();
DROP FUNCTION @extschema@.pg_lease_forbid_floor_change();
DROP FUNCTION @extschema@.pg_lease_forbid_rewrite();
DROP FUNCTION @extschema@.pg_lease_force_release(p_key text, p_expected_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_force_release(p_key text, p_expected_epoch bigint, p_operator text);
DROP FUNCTION @extschema@.pg_lease_guard_inherited_rows();
DROP FUNCTION @extschema@.pg_lease_guard_key(p_key text, p_fences jsonb, p_table text);
DROP FUNCTION @extschema@.pg_lease_guard_rows();
DROP FUNCTION @extschema@.pg_lease_guard_truncate();
DROP FUNCTION @extschema@.pg_lease_heartbeat(p_key text, p_owner text, p_epoch bigint, p_ttl interval);
DROP FUNCTION @extschema@.pg_lease_insert_above_floor();
DROP FUNCTION @extschema@.pg_lease_inspect(p_key text);
DROP FUNCTION @extschema@.pg_lease_prune(p_free_for interval, p_dry_run boolean);
DROP FUNCTION @extschema@.pg_lease_recheck_under_lock();
DROP FUNCTION @extschema@.pg_lease_record_transition();
DROP FUNCTION @extschema@.pg_lease_refuse(p_verdict text, p_key text, p_owner text, p_epoch bigint, p_message text);
DROP FUNCTION @extschema@.pg_lease_release(p_key text, p_owner text, p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_remember_fence(p_key text, p_owner text, p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_renew(p_key text, p_owner text, p_epoch bigint, p_ttl interval);
DROP FUNCTION @extschema@.pg_lease_request_handoff(p_key text, p_epoch bigint);
DROP FUNCTION @extschema@.pg_lease_status(p_owner text, p_expires_at timestamp with time zone, p_now timestamp with time zone);
DROP FUNCTION @extschema@.pg_lease_ttl(p_ttl interval);
DROP FUNCTION @extschema@.pg_lease_unfenced_allowed();
DROP FUNCTION @extschema@.pg_lease_verdict(p_row_owner text, p_row_epoch bigint, p_row_expires_at timestamp with time zone, p_owner text, p_epoch bigint, p_now timestamp with time zone);
DROP FUNCTION @extschema@.pg_lease_waiter_lock(p_key text);
DROP FUNCTION @extschema@.pg_lease_wake_waiters(p_key text);
