-- Whether inventory has the node in bare-metal mode or on its way there (the target of its open
-- mode change, else its mode), as the node's latest event says: the node's network document then
-- has `removed` set, and its agent takes the slice network off the host.
ALTER TABLE inventory_nodes
  ADD COLUMN slice_network_removed boolean NOT NULL DEFAULT false;
