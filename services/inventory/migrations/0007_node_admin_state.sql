-- Host operations (node_lifecycle.hpp): a node's admin state, the operator's reason and who made
-- the change, and a drain's deadline. Every existing node is active.
ALTER TABLE nodes
  ADD COLUMN admin_state text NOT NULL DEFAULT 'active'
    CONSTRAINT nodes_admin_state
      CHECK (admin_state IN ('active', 'draining', 'drained', 'maintenance', 'decommissioned')),
  ADD COLUMN admin_reason text NOT NULL DEFAULT '',
  ADD COLUMN admin_actor text NOT NULL DEFAULT '',
  ADD COLUMN admin_changed_at timestamptz,
  ADD COLUMN drain_deadline timestamptz;
UPDATE nodes SET admin_changed_at = registered_at;
ALTER TABLE nodes ALTER COLUMN admin_changed_at SET DEFAULT now(),
                  ALTER COLUMN admin_changed_at SET NOT NULL;
-- What gpuaas_nodes{mode,state} and gpuaas_node_drain_overdue count.
CREATE INDEX nodes_admin_state ON nodes (admin_state) WHERE admin_state <> 'active';
