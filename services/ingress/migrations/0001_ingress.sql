-- Endpoint pools, the endpoints exposures hold, exposures, the projection of allocations they
-- follow, each node's versioned exposure document (libs/common documents.hpp) and its acks.

CREATE TABLE endpoint_pools (
  name       text PRIMARY KEY,
  kind       text NOT NULL CHECK (kind IN ('port_range', 'public_ip')),
  region     text NOT NULL,
  node_id    text NOT NULL DEFAULT '',
  addresses  text[] NOT NULL,
  port_min   integer NOT NULL DEFAULT 0,
  port_max   integer NOT NULL DEFAULT 0,
  generation bigint NOT NULL DEFAULT 1,
  updated_at timestamptz NOT NULL DEFAULT now()
);

-- What ingress knows of each allocation (from GPUAAS_EVT_SCHEDULER, ordered by generation).
CREATE TABLE allocations (
  allocation_id text PRIMARY KEY,
  tenant        text NOT NULL,
  node_id       text NOT NULL DEFAULT '',
  region        text NOT NULL DEFAULT '',
  shape         text NOT NULL DEFAULT '',
  state         text NOT NULL,
  slot_key      text NOT NULL DEFAULT '',
  target_ip     text NOT NULL DEFAULT '',
  vm_ready      boolean NOT NULL DEFAULT false,
  generation    bigint NOT NULL,
  updated_at    timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE exposures (
  exposure_id      uuid PRIMARY KEY,
  allocation_id    text NOT NULL,
  tenant           text NOT NULL,
  node_id          text NOT NULL,
  slot_key         text NOT NULL DEFAULT '',
  name             text NOT NULL,
  protocol         text NOT NULL CHECK (protocol IN ('tcp', 'udp')),
  target_ip        text NOT NULL DEFAULT '',
  target_port      integer NOT NULL,
  pool             text NOT NULL DEFAULT '',
  public_ip        text NOT NULL DEFAULT '',
  public_port      integer NOT NULL DEFAULT 0,
  state            text NOT NULL CHECK (state IN ('requested', 'applying', 'active', 'removing',
                                                  'removed', 'failed', 'drift')),
  reason           text NOT NULL DEFAULT '',
  detail           text NOT NULL DEFAULT '',
  document_version bigint NOT NULL DEFAULT 0,
  generation       bigint NOT NULL DEFAULT 1,
  created_at       timestamptz NOT NULL DEFAULT now(),
  updated_at       timestamptz NOT NULL DEFAULT now()
);
-- One live exposure per (allocation, name); a removed or failed one may be asked for again.
CREATE UNIQUE INDEX exposures_live_name ON exposures (allocation_id, name)
  WHERE state NOT IN ('removed', 'failed');
CREATE INDEX exposures_node ON exposures (node_id, state);
CREATE INDEX exposures_allocation ON exposures (allocation_id);

-- The endpoints exposures hold: an address (PUBLIC_IP pools: port 0, one per allocation) or an
-- address and port (PORT_RANGE). The primary key is what makes an endpoint impossible to give to
-- two allocations; a row goes only when the node acked a document without its mapping (or the
-- exposure failed before it reached a node).
CREATE TABLE endpoint_leases (
  pool          text NOT NULL REFERENCES endpoint_pools (name),
  address       text NOT NULL,
  port          integer NOT NULL,
  allocation_id text NOT NULL,
  exposure_id   uuid,
  leased_at     timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (address, port)
);
CREATE INDEX endpoint_leases_pool ON endpoint_leases (pool);
CREATE INDEX endpoint_leases_allocation ON endpoint_leases (allocation_id);

CREATE TABLE exposure_documents (
  node_id    text NOT NULL,
  version    bigint NOT NULL CHECK (version > 0),
  doc        jsonb NOT NULL,  -- gpuaas.v1.NodeExposureDocument
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, version)
);

CREATE TABLE exposure_acks (
  node_id         text PRIMARY KEY,
  applied_version bigint NOT NULL,
  blockers        text[] NOT NULL DEFAULT '{}',
  simulated       boolean NOT NULL DEFAULT false,
  acked_at        timestamptz NOT NULL DEFAULT now()
);
