-- ipam's projection of inventory (durables ipam-inventory-nodes and ipam-inventory-slots, from
-- GPUAAS_EVT_INVENTORY): the nodes reserve is checked against, the nodes and slots reprovision
-- is checked against, and what orphan.list/remove judge ipam's own rows by.
CREATE TABLE inventory_nodes (
  node_id    text PRIMARY KEY,
  generation bigint NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE inventory_slots (
  node_id    text NOT NULL,
  slot_key   text NOT NULL,
  generation bigint NOT NULL,
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, slot_key)
);
