-- A claim's claimed_at and released_at are the moments its row was written (clock_timestamp()),
-- not its transaction's start (now()). A create in a group transaction runs after others in the
-- same transaction, and may take a slot whose release committed after that transaction began:
-- stamped with now() the new claim seemed to start before the old one ended, though the partial
-- unique index never let two live claims exist. Written this way the stamps follow the order the
-- database imposed: a release commits before the placement index offers the slot again, and a
-- drain's projection waits for every create that holds the node's share lock.
ALTER TABLE allocation_resource_claims ALTER COLUMN claimed_at SET DEFAULT clock_timestamp();
