-- Mode changes (node.mode): the mode an open change is taking the node to (NULL: none open),
-- the desired slot set version that carries it (the agent's ack of it, or a later one, decides
-- the change), why the last change failed, and the rebind generation slot.repair bumps for a
-- slot whose devices lost their vfio-pci binding.
ALTER TABLE nodes
  ADD COLUMN mode_target text
    CONSTRAINT nodes_mode_target CHECK (mode_target IN ('baremetal', 'slice-vm')),
  ADD COLUMN mode_change_version bigint,
  ADD COLUMN mode_blockers text[] NOT NULL DEFAULT '{}',
  ADD COLUMN rebind_generation bigint NOT NULL DEFAULT 0;
