-- The scheduler's projection of inventory nodes, built from gpuaas.v1.evt.inventory.node.*
-- events. A row only moves forward: an event older than `generation` is ignored.
CREATE TABLE projected_nodes (
  node_id          text PRIMARY KEY,
  hostname         text NOT NULL,
  region           text NOT NULL,
  pool             text NOT NULL,
  capacity_profile text NOT NULL,
  generation       bigint NOT NULL,
  last_event_id    uuid NOT NULL,
  projected_at     timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX projected_nodes_region ON projected_nodes (region, node_id);
