-- Every column that stores a closed set holds the text form of its protobuf enum
-- (proto/gpuaas/v1/types.proto; libs/common enums.hpp converts). enum_checks_test compares each
-- list with the enum, so a new enum value needs a migration.
ALTER TABLE allocation_bindings
  ADD CONSTRAINT allocation_bindings_state
    CHECK (state IN ('pending', 'reserved', 'provisioning', 'active', 'releasing', 'released',
                     'failed'));
