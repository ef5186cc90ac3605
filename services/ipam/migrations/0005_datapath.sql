-- The datapath of a node's slice network: the NetworkDatapath text (proto/gpuaas/v1/types.proto,
-- enum_checks_test compares the lists) and the bridge. On a subnet rule '' inherits (the less
-- specific rule, then ipam.datapath / the datapath's configured bridge). On a node's subnet row
-- it is the node's resolved datapath and bridge, chosen with its subnet; '' on rows made before
-- this migration, whose documents keep taking the configured datapath and bridge.
ALTER TABLE subnet_rules
  ADD COLUMN datapath text NOT NULL DEFAULT ''
    CONSTRAINT subnet_rules_datapath CHECK (datapath IN ('', 'linux-bridge', 'ovs')),
  ADD COLUMN bridge text NOT NULL DEFAULT '';
ALTER TABLE node_subnets
  ADD COLUMN datapath text NOT NULL DEFAULT ''
    CONSTRAINT node_subnets_datapath CHECK (datapath IN ('', 'linux-bridge', 'ovs')),
  ADD COLUMN bridge text NOT NULL DEFAULT '';
