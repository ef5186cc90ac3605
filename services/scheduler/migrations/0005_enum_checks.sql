-- Every column that stores a closed set holds the text form of its protobuf enum
-- (proto/gpuaas/v1/types.proto; libs/common enums.hpp converts). '' where the value is optional.
-- enum_checks_test compares each list here with the enum, so a new enum value needs a migration.
ALTER TABLE projected_nodes
  ADD CONSTRAINT projected_nodes_capacity_profile
    CHECK (capacity_profile IN ('baremetal', 'slice-vm'));

ALTER TABLE projected_slots
  ADD CONSTRAINT projected_slots_admin_state CHECK (admin_state IN ('available', 'disabled')),
  ADD CONSTRAINT projected_slots_health
    CHECK (health IN ('unknown', 'healthy', 'degraded', 'failed')),
  ADD CONSTRAINT projected_slots_fabric_type CHECK (fabric_type IN ('', 'infiniband', 'roce')),
  ADD CONSTRAINT projected_slots_fabric_claim_mode
    CHECK (fabric_claim_mode IN ('', 'per_slot_vf', 'shared_parent', 'none'));

ALTER TABLE allocations
  ADD CONSTRAINT allocations_network_mode
    CHECK (network_mode IN ('private-nat', 'public-nat', 'fabric-only', 'tailscale-overlay')),
  ADD CONSTRAINT allocations_failure_stage
    CHECK (failure_stage IN ('', 'placement', 'provisioning', 'release', 'cleanup')),
  ADD CONSTRAINT allocations_net_lease_state
    CHECK (net_lease_state IN ('', 'bound', 'missing', 'mismatch', 'unexpected'));

ALTER TABLE allocation_timeline
  ADD CONSTRAINT allocation_timeline_step
    CHECK (step IN ('placed', 'task_sent', 'task_progress', 'task_succeeded', 'task_failed',
                    'task_rejected', 'task_timed_out', 'late_result', 'state', 'claims_freed',
                    'force_released')),
  ADD CONSTRAINT allocation_timeline_state
    CHECK (state IN ('pending', 'reserved', 'provisioning', 'active', 'releasing', 'released',
                     'failed')),
  ADD CONSTRAINT allocation_timeline_task_type
    CHECK (task_type IN ('', 'vm.provision', 'vm.release', 'slot.cleanup')),
  ADD CONSTRAINT allocation_timeline_stage
    CHECK (stage IN ('', 'validate', 'lease', 'image', 'seed', 'define', 'start', 'readiness',
                     'adopt', 'stop', 'cleanup', 'undefine', 'wipe', 'verify', 'network'));
