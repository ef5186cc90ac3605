-- The projection's allocation state holds the text form of gpuaas.v1.AllocationState
-- (proto/gpuaas/v1/types.proto; libs/common enums.hpp converts). enum_checks_test compares the
-- list with the enum, so a new enum value needs a migration.
ALTER TABLE allocations
  ADD CONSTRAINT allocations_state
    CHECK (state IN ('pending', 'reserved', 'provisioning', 'active', 'releasing', 'released',
                     'failed'));
