-- The node's admin state as inventory announces it (gpuaas.v1.Node.admin_state): only an active
-- node takes new placements. Slice placement checks it under the node row's share lock, a
-- baremetal placement under its exclusive lock, and the placement index reads it with the
-- slots; a change notifies every replica through projected_nodes' trigger (0008).
ALTER TABLE projected_nodes
  ADD COLUMN admin_state text NOT NULL DEFAULT 'active'
    CONSTRAINT projected_nodes_admin_state
      CHECK (admin_state IN ('active', 'draining', 'drained', 'maintenance', 'decommissioned'));
