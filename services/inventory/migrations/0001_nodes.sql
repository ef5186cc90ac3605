-- Nodes known to inventory. `generation` bumps on every change and orders the events that
-- announce it; consumers keep the highest generation they have seen.
CREATE TABLE nodes (
  node_id          text PRIMARY KEY,
  hostname         text NOT NULL,
  region           text NOT NULL,
  pool             text NOT NULL,
  capacity_profile text NOT NULL CHECK (capacity_profile IN ('baremetal', 'slice-vm')),
  labels           jsonb NOT NULL DEFAULT '{}'::jsonb,
  agent_version    text NOT NULL DEFAULT '',
  generation       bigint NOT NULL CHECK (generation > 0),
  registered_at    timestamptz NOT NULL DEFAULT now(),
  updated_at       timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX nodes_region_pool ON nodes (region, pool, node_id);
