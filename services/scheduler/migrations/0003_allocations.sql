-- Allocations and their resource claims. Claims, not allocations.node_id, are the source of
-- placement correctness: the partial unique indexes make a second live claim on a slot, or a
-- second live node_exclusive claim on a node, impossible whatever the code does.
ALTER TABLE projected_slots
  ADD COLUMN fabric_type    text NOT NULL DEFAULT '',
  ADD COLUMN numa           integer NOT NULL DEFAULT -1,
  ADD COLUMN pcie_switch    text NOT NULL DEFAULT '',
  ADD COLUMN region_enabled boolean NOT NULL DEFAULT true;

CREATE TABLE allocations (
  allocation_id  uuid PRIMARY KEY,
  tenant         text NOT NULL,
  request_id     text NOT NULL,
  sku            text NOT NULL,
  shape          text NOT NULL CHECK (shape IN ('baremetal', 'gpu_slice')),
  gpu_count      integer NOT NULL,
  region         text NOT NULL,
  pool           text NOT NULL DEFAULT '',
  network_mode   text NOT NULL,
  state          text NOT NULL CHECK (state IN ('pending', 'reserved', 'provisioning', 'active',
                                                'releasing', 'released', 'failed')),
  node_id        text NOT NULL DEFAULT '',
  failure_stage  text NOT NULL DEFAULT '',
  failure_code   text NOT NULL DEFAULT '',
  failure_detail text NOT NULL DEFAULT '',
  generation     bigint NOT NULL CHECK (generation > 0),
  created_at     timestamptz NOT NULL DEFAULT now(),
  updated_at     timestamptz NOT NULL DEFAULT now(),
  UNIQUE (tenant, request_id)
);
CREATE INDEX allocations_tenant ON allocations (tenant, allocation_id);
CREATE INDEX allocations_state ON allocations (state, allocation_id);

CREATE TABLE allocation_resource_claims (
  allocation_id uuid NOT NULL REFERENCES allocations (allocation_id),
  node_id       text NOT NULL,
  slot_key      text NOT NULL DEFAULT '',
  kind          text NOT NULL CHECK (kind IN ('node_exclusive', 'slot')),
  claimed_at    timestamptz NOT NULL DEFAULT now(),
  released_at   timestamptz,
  CHECK ((kind = 'slot') = (slot_key <> ''))
);
CREATE UNIQUE INDEX claims_one_live_per_slot ON allocation_resource_claims (node_id, slot_key)
  WHERE released_at IS NULL AND kind = 'slot';
CREATE UNIQUE INDEX claims_one_live_exclusive_per_node ON allocation_resource_claims (node_id)
  WHERE released_at IS NULL AND kind = 'node_exclusive';
CREATE INDEX claims_live_by_node ON allocation_resource_claims (node_id) WHERE released_at IS NULL;
CREATE INDEX claims_by_allocation ON allocation_resource_claims (allocation_id);
