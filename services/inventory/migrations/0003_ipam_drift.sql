-- The newest ipam drift generation applied per slot: ipam's drift events for one slot are
-- ordered by it, so a late or redelivered older event does not undo a newer one.
CREATE TABLE ipam_drift_marks (
  node_id    text NOT NULL,
  slot_key   text NOT NULL,
  generation bigint NOT NULL,
  PRIMARY KEY (node_id, slot_key)
);
