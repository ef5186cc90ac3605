-- Every column that stores a closed set holds the text form of its protobuf enum
-- (proto/gpuaas/v1/types.proto; libs/common enums.hpp converts). enum_checks_test compares each
-- list with the enum, so a new enum value needs a migration.
ALTER TABLE node_tasks
  ADD CONSTRAINT node_tasks_type
    CHECK (type IN ('topology.discover', 'prereq.check', 'network.baseline.check',
                    'vm.provision', 'vm.release', 'slot.cleanup'));
