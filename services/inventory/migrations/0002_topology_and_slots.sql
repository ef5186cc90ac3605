-- Regions (enabled/disabled), versioned topology snapshots reported by node-agents (advisory
-- evidence + candidates), approved node_resource_slots (what the scheduler may sell), wipe
-- proofs, each node's versioned desired slot set and the version its agent applied, and the
-- typed tasks inventory sent to agents. Protobuf documents are kept as jsonb (proto field names);
-- the columns next to them are what queries and constraints need.
CREATE TABLE regions (
  name       text PRIMARY KEY,
  enabled    boolean NOT NULL DEFAULT true,
  updated_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO regions (name) SELECT DISTINCT region FROM nodes ON CONFLICT DO NOTHING;

CREATE TABLE topology_snapshots (
  node_id       text NOT NULL REFERENCES nodes (node_id),
  version       bigint NOT NULL CHECK (version > 0),
  event_id      uuid NOT NULL UNIQUE,
  report        jsonb NOT NULL,  -- gpuaas.v1.TopologyReport
  node_blockers text[] NOT NULL DEFAULT '{}',
  received_at   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, version)
);

CREATE TABLE node_resource_slots (
  node_id               text NOT NULL REFERENCES nodes (node_id),
  slot_key              text NOT NULL,
  admin_state           text NOT NULL CHECK (admin_state IN ('available', 'disabled')),
  health                text NOT NULL CHECK (health IN ('unknown', 'healthy', 'degraded', 'failed')),
  sku                   text NOT NULL DEFAULT '',
  gpu_model             text NOT NULL DEFAULT '',
  nvme_by_id            text NOT NULL DEFAULT '',
  fabric_vf_pci_address text NOT NULL DEFAULT '',
  schedulable           boolean NOT NULL DEFAULT false,
  generation            bigint NOT NULL CHECK (generation > 0),
  doc                   jsonb NOT NULL,  -- gpuaas.v1.Slot
  updated_at            timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, slot_key)
);
-- The database, not hope, keeps one disk and one fabric VF per approved slot.
CREATE UNIQUE INDEX node_resource_slots_one_vf ON node_resource_slots (node_id, fabric_vf_pci_address)
  WHERE admin_state = 'available' AND fabric_vf_pci_address <> '';
CREATE UNIQUE INDEX node_resource_slots_one_nvme ON node_resource_slots (node_id, nvme_by_id)
  WHERE admin_state = 'available' AND nvme_by_id <> '';
-- An available slot is a complete bundle.
ALTER TABLE node_resource_slots ADD CONSTRAINT available_is_complete CHECK (
  admin_state <> 'available' OR (nvme_by_id <> '' AND fabric_vf_pci_address <> ''));

CREATE TABLE wipe_proofs (
  node_id     text NOT NULL REFERENCES nodes (node_id),
  nvme_by_id  text NOT NULL,
  method      text NOT NULL,
  evidence    text NOT NULL,
  recorded_by text NOT NULL,
  recorded_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, nvme_by_id)
);

CREATE TABLE desired_slot_sets (
  node_id    text NOT NULL REFERENCES nodes (node_id),
  version    bigint NOT NULL CHECK (version > 0),
  doc        jsonb NOT NULL,  -- gpuaas.v1.DesiredSlotSet
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, version)
);

CREATE TABLE node_agent_acks (
  node_id         text PRIMARY KEY REFERENCES nodes (node_id),
  applied_version bigint NOT NULL,
  acked_at        timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE node_tasks (
  task_id     uuid PRIMARY KEY,
  node_id     text NOT NULL REFERENCES nodes (node_id),
  type        text NOT NULL,
  status      text NOT NULL CHECK (status IN ('queued', 'succeeded', 'failed', 'rejected')),
  error       text NOT NULL DEFAULT '',
  queued_at   timestamptz NOT NULL DEFAULT now(),
  finished_at timestamptz
);
CREATE INDEX node_tasks_node ON node_tasks (node_id, queued_at DESC);
