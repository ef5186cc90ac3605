-- The endpoints an allocation asked for (CreateAllocationRequest.expose, or its app's) and what
-- ingress reported for each (a projection of gpuaas.v1.evt.ingress.exposure.* events), and
-- whether the node reported the VM up.
ALTER TABLE allocations ADD COLUMN vm_ready boolean NOT NULL DEFAULT false;
ALTER TABLE allocations ADD COLUMN app text NOT NULL DEFAULT '';

CREATE TABLE allocation_endpoints (
  allocation_id       uuid NOT NULL REFERENCES allocations (allocation_id),
  name                text NOT NULL,
  protocol            text NOT NULL CHECK (protocol IN ('tcp', 'udp')),
  port                integer NOT NULL CHECK (port BETWEEN 1 AND 65535),
  exposure_id         text NOT NULL DEFAULT '',
  exposure_generation bigint NOT NULL DEFAULT 0,
  public_ip           text NOT NULL DEFAULT '',
  public_port         integer NOT NULL DEFAULT 0,
  state               text NOT NULL DEFAULT '' CHECK (state IN ('', 'requested', 'applying',
                        'active', 'removing', 'removed', 'failed', 'drift')),
  reason              text NOT NULL DEFAULT '',
  connect             text NOT NULL DEFAULT '',
  PRIMARY KEY (allocation_id, name)
);

-- An allocation can now fail at the exposure stage.
ALTER TABLE allocations DROP CONSTRAINT allocations_failure_stage;
ALTER TABLE allocations ADD CONSTRAINT allocations_failure_stage
  CHECK (failure_stage IN ('', 'placement', 'provisioning', 'release', 'cleanup', 'exposure'));
