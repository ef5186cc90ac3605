-- The usage ledger: per allocation its meter (the policy's state, usage_policy.hpp's Meter), the
-- immutable usage records, and the ledger's clock (the newest scheduler event time applied and
-- the midnight before which days are closed). Everything here is derived from
-- GPUAAS_EVT_SCHEDULER alone: dropping the database and consuming the stream again gives the
-- same rows.
CREATE TABLE meters (
  allocation_id    text PRIMARY KEY,
  generation       bigint NOT NULL,
  bill_since_us    bigint NOT NULL DEFAULT 0,
  bill_until_us    bigint NOT NULL DEFAULT 0,
  bill_done        boolean NOT NULL DEFAULT false,
  bill_start_event text NOT NULL DEFAULT '',
  bill_base        bytea NOT NULL,  -- the UsageRecord every record copies; empty until started
  lost_since_us    bigint NOT NULL DEFAULT 0,
  lost_until_us    bigint NOT NULL DEFAULT 0,
  lost_done        boolean NOT NULL DEFAULT false,
  lost_start_event text NOT NULL DEFAULT '',
  lost_base        bytea NOT NULL,
  -- An interval is open: its days are closed as the horizon passes them.
  open             boolean NOT NULL DEFAULT false
);
CREATE INDEX meters_open ON meters (allocation_id) WHERE open;

-- Append-only: never updated or deleted (a correction is a record of its own).
CREATE TABLE usage_records (
  record_id     text PRIMARY KEY,
  seq           bigserial NOT NULL UNIQUE,
  day           date NOT NULL,
  tenant        text NOT NULL,
  allocation_id text NOT NULL,
  sku           text NOT NULL,
  kind          text NOT NULL CONSTRAINT usage_records_kind
                  CHECK (kind IN ('billable', 'stranded', 'correction')),
  corrects      text NOT NULL DEFAULT '',
  -- What it counts towards: a correction counts as the record it corrects.
  counts_as     text NOT NULL CONSTRAINT usage_records_counts_as
                  CHECK (counts_as IN ('billable', 'stranded')),
  units_micro   bigint NOT NULL,
  record        bytea NOT NULL,  -- the gpuaas.v1.UsageRecord
  recorded_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX usage_records_period ON usage_records (day, tenant, allocation_id, record_id);
CREATE INDEX usage_records_corrects ON usage_records (corrects) WHERE corrects <> '';

CREATE TABLE ledger_clock (
  id               int PRIMARY KEY CHECK (id = 1),
  newest_event_us  bigint NOT NULL,
  closed_before_us bigint NOT NULL
);
INSERT INTO ledger_clock VALUES (1, 0, 0);

-- Snapshots that arrived ahead of their allocation's next generation (a redelivery overtaken by
-- later events): kept until the one between is applied, then applied in order and deleted.
CREATE TABLE pending_snapshots (
  allocation_id text NOT NULL,
  generation    bigint NOT NULL,
  event_id      text NOT NULL,
  snapshot      bytea NOT NULL,  -- the gpuaas.v1.Allocation
  received_at   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (allocation_id, generation)
);
