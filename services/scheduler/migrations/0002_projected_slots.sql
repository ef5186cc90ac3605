-- The scheduler's projection of approved slots, built from gpuaas.v1.evt.inventory.slot.*
-- events (gpuaas.v1.SlotSnapshot). Applied by generation: an older or equal event is ignored,
-- so redelivery and replay never move a slot backwards.
CREATE TABLE projected_slots (
  node_id         text NOT NULL,
  slot_key        text NOT NULL,
  region          text NOT NULL,
  pool            text NOT NULL,
  sku             text NOT NULL,
  admin_state     text NOT NULL,
  health          text NOT NULL,
  schedulable     boolean NOT NULL,
  node_blockers   text[] NOT NULL DEFAULT '{}',
  gpu_pci_address text NOT NULL DEFAULT '',
  locality_group  text NOT NULL DEFAULT '',
  generation      bigint NOT NULL,
  last_event_id   uuid NOT NULL,
  projected_at    timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, slot_key)
);
CREATE INDEX projected_slots_schedulable ON projected_slots (region, sku, node_id)
  WHERE schedulable;
