-- MAC ownership, subnet rules, allocation binding, node network documents and their acks, lease
-- observations and IPAM drift.

-- A slot owns its MAC independently of its IP reservation: a release frees the IP, not the MAC,
-- so the slot gets the same MAC back; only an admin re-provision changes it. The unique index is
-- what makes MACs unique across the fleet (concurrent inserts of one MAC: one wins, the other
-- finds the conflict and takes a pool MAC).
CREATE TABLE mac_assignments (
  node_id    text NOT NULL,
  slot_key   text NOT NULL,
  mac        macaddr NOT NULL,
  source     text NOT NULL CHECK (source IN ('derived', 'pool', 'admin')),
  epoch      integer NOT NULL DEFAULT 0,  -- re-provision count: input of the derived MAC
  -- Generation of the slot's last released reservation, so a reservation made again continues
  -- the slot's event order instead of starting at 1.
  generation bigint NOT NULL DEFAULT 0,
  created_at timestamptz NOT NULL DEFAULT now(),
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, slot_key)
);
CREATE UNIQUE INDEX mac_assignments_mac ON mac_assignments (mac);
INSERT INTO mac_assignments (node_id, slot_key, mac, source)
  SELECT node_id, slot_key, mac, 'derived' FROM slot_reservations;

-- The platform pool 52:54:01:00:00:01 .. 52:54:01:ff:ff:ff, handed out in sequence order.
CREATE SEQUENCE mac_pool_seq START 1;

ALTER TABLE slot_reservations
  ADD COLUMN allocation_id text,
  ADD COLUMN bound_at timestamptz,
  ADD COLUMN updated_at timestamptz NOT NULL DEFAULT now();
CREATE INDEX slot_reservations_allocation ON slot_reservations (allocation_id)
  WHERE allocation_id IS NOT NULL;

ALTER TABLE node_subnets
  ADD COLUMN region text NOT NULL DEFAULT '',
  ADD COLUMN pool text NOT NULL DEFAULT '';

-- scope: node (node_id), pool (region + pool) or region (region); '' for the unused keys.
CREATE TABLE subnet_rules (
  scope      text NOT NULL CHECK (scope IN ('node', 'pool', 'region')),
  region     text NOT NULL DEFAULT '',
  pool       text NOT NULL DEFAULT '',
  node_id    text NOT NULL DEFAULT '',
  subnet     cidr NOT NULL,
  gateway    inet NOT NULL,
  host_cidrs text[] NOT NULL DEFAULT '{}',
  updated_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (scope, region, pool, node_id)
);

-- Immutable, versioned desired network per node (protojson of gpuaas.v1.NodeNetworkDocument).
CREATE TABLE network_documents (
  node_id    text NOT NULL,
  version    bigint NOT NULL,
  doc        jsonb NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, version)
);

CREATE TABLE network_acks (
  node_id         text PRIMARY KEY,
  applied_version bigint NOT NULL,
  blockers        text[] NOT NULL DEFAULT '{}',
  acked_at        timestamptz NOT NULL DEFAULT now()
);

-- The newest allocation event applied per allocation (events are ordered by generation).
CREATE TABLE allocation_bindings (
  allocation_id text PRIMARY KEY,
  node_id       text NOT NULL,
  state         text NOT NULL,
  generation    bigint NOT NULL,
  slot_keys     text[] NOT NULL DEFAULT '{}',
  updated_at    timestamptz NOT NULL DEFAULT now()
);

-- The newest lease report per node and its observations (one per slot or unexpected MAC).
CREATE TABLE lease_reports (
  node_id          text PRIMARY KEY,
  document_version bigint NOT NULL,
  blockers         text[] NOT NULL DEFAULT '{}',
  observed_at      timestamptz NOT NULL,
  event_id         uuid NOT NULL,
  received_at      timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE lease_observations (
  node_id text NOT NULL,
  subject text NOT NULL,  -- slot key, or 'mac:<mac>' for an unexpected lease
  doc     jsonb NOT NULL, -- protojson of gpuaas.v1.StoredLease
  PRIMARY KEY (node_id, subject)
);

CREATE TABLE ipam_drift (
  drift_id         bigserial PRIMARY KEY,
  node_id          text NOT NULL,
  subject          text NOT NULL,
  slot_key         text NOT NULL,
  mac              text NOT NULL,
  kind             text NOT NULL,
  detail           text NOT NULL,
  expected_ip      text NOT NULL,
  actual_ip        text NOT NULL,
  allocation_id    text NOT NULL,
  document_version bigint NOT NULL,
  generation       bigint NOT NULL,
  detected_at      timestamptz NOT NULL DEFAULT now(),
  resolved_at      timestamptz
);
CREATE UNIQUE INDEX ipam_drift_open ON ipam_drift (node_id, subject) WHERE resolved_at IS NULL;
CREATE INDEX ipam_drift_node ON ipam_drift (node_id, drift_id);
