-- The provisioning saga: what a node needs to build a slice (carried on slot events), claim
-- phases (slot occupancy as an admin sees it), the node tasks each allocation sent, and the
-- allocation timeline read model.
ALTER TABLE projected_slots
  ADD COLUMN nvme_by_id            text NOT NULL DEFAULT '',
  ADD COLUMN fabric_claim_mode     text NOT NULL DEFAULT '',
  ADD COLUMN fabric_vf_pci_address text NOT NULL DEFAULT '',
  ADD COLUMN mac                   text NOT NULL DEFAULT '',
  ADD COLUMN private_ip            text NOT NULL DEFAULT '',
  ADD COLUMN profile_name          text NOT NULL DEFAULT '',
  ADD COLUMN vcpus_per_gpu         integer NOT NULL DEFAULT 0,
  ADD COLUMN memory_mib_per_gpu    bigint NOT NULL DEFAULT 0,
  ADD COLUMN hugepages_1g_per_gpu  integer NOT NULL DEFAULT 0;

-- reserved -> provisioning -> active -> releasing -> cleanup -> released, and cleanup_blocked
-- after a failed provisioning/release/cleanup. released_at is set only on cleanup proof (or an
-- admin's force-release).
ALTER TABLE allocation_resource_claims
  ADD COLUMN phase text NOT NULL DEFAULT 'reserved' CHECK (phase IN ('reserved', 'provisioning',
    'active', 'releasing', 'cleanup', 'cleanup_blocked', 'released'));

ALTER TABLE allocations
  ADD COLUMN attempt         integer NOT NULL DEFAULT 0,
  ADD COLUMN image           text NOT NULL DEFAULT '',
  ADD COLUMN hostname        text NOT NULL DEFAULT '',
  ADD COLUMN ssh_keys        text[] NOT NULL DEFAULT '{}',
  ADD COLUMN net_domain      text NOT NULL DEFAULT '',
  ADD COLUMN net_mac         text NOT NULL DEFAULT '',
  ADD COLUMN net_expected_ip text NOT NULL DEFAULT '',
  ADD COLUMN net_actual_ip   text NOT NULL DEFAULT '',
  ADD COLUMN net_lease_state text NOT NULL DEFAULT '';

CREATE TABLE allocation_tasks (
  task_id       uuid PRIMARY KEY,
  allocation_id uuid NOT NULL REFERENCES allocations (allocation_id),
  node_id       text NOT NULL,
  type          text NOT NULL CHECK (type IN ('vm.provision', 'vm.release', 'slot.cleanup')),
  attempt       integer NOT NULL CHECK (attempt > 0),
  status        text NOT NULL DEFAULT 'sent' CHECK (status IN ('sent', 'succeeded', 'failed',
                  'rejected', 'timed_out', 'cancelled')),
  deadline      timestamptz NOT NULL,
  sent_at       timestamptz NOT NULL DEFAULT now(),
  finished_at   timestamptz,
  error_reason  text NOT NULL DEFAULT '',
  error_detail  text NOT NULL DEFAULT '',
  UNIQUE (allocation_id, type, attempt)
);
CREATE INDEX allocation_tasks_open ON allocation_tasks (deadline) WHERE status = 'sent';

CREATE TABLE allocation_timeline (
  seq           bigserial PRIMARY KEY,
  allocation_id uuid NOT NULL,
  at            timestamptz NOT NULL DEFAULT clock_timestamp(),
  step          text NOT NULL,
  state         text NOT NULL,
  task_id       text NOT NULL DEFAULT '',
  task_type     text NOT NULL DEFAULT '',
  stage         text NOT NULL DEFAULT '',
  code          text NOT NULL DEFAULT '',
  detail        text NOT NULL DEFAULT '',
  percent       integer NOT NULL DEFAULT 0
);
CREATE INDEX allocation_timeline_by_allocation ON allocation_timeline (allocation_id, seq);
