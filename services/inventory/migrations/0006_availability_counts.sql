-- inventory.availability.list aggregated every slot of the fleet on each call (400,000 rows at
-- 50,000 nodes). Its counts are kept here instead, by triggers on node_resource_slots and nodes,
-- so a read sums a few rows per (region, pool, sku, gpu_model) whatever the fleet.
--
-- availability_node_counts: per node and (sku, gpu_model), its slots, how many are schedulable
-- and how many approved (admin state available); a node counts in its group's `nodes` while it
-- has a slot there.
CREATE TABLE availability_node_counts (
  node_id     text   NOT NULL,
  sku         text   NOT NULL,
  gpu_model   text   NOT NULL,
  slots       bigint NOT NULL,
  schedulable bigint NOT NULL,
  approved    bigint NOT NULL,
  PRIMARY KEY (node_id, sku, gpu_model)
);

-- availability_counts: the groups' sums, in 16 shards (the changing backend's pid mod 16), so
-- concurrent changes of different nodes rarely wait on one counter row; a read sums the shards.
CREATE TABLE availability_counts (
  region      text    NOT NULL,
  pool        text    NOT NULL,
  sku         text    NOT NULL,
  gpu_model   text    NOT NULL,
  shard       integer NOT NULL,
  slots       bigint  NOT NULL,
  schedulable bigint  NOT NULL,
  approved    bigint  NOT NULL,
  nodes       bigint  NOT NULL,
  PRIMARY KEY (region, pool, sku, gpu_model, shard)
);

INSERT INTO availability_node_counts (node_id, sku, gpu_model, slots, schedulable, approved)
  SELECT node_id, sku, gpu_model, count(*), count(*) FILTER (WHERE schedulable),
         count(*) FILTER (WHERE admin_state = 'available')
  FROM node_resource_slots GROUP BY 1, 2, 3;

INSERT INTO availability_counts
    (region, pool, sku, gpu_model, shard, slots, schedulable, approved, nodes)
  SELECT n.region, n.pool, c.sku, c.gpu_model, 0, sum(c.slots), sum(c.schedulable),
         sum(c.approved), count(*)
  FROM availability_node_counts c JOIN nodes n USING (node_id) GROUP BY 1, 2, 3, 4;

-- Applies the slots a statement added and removed (an update: its new and its old rows).
CREATE FUNCTION availability_count_slots(added node_resource_slots[],
                                         removed node_resource_slots[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
  nodes_changed text[];
BEGIN
  SELECT array_agg(DISTINCT node_id ORDER BY node_id) INTO nodes_changed FROM (
    SELECT node_id FROM unnest(added) UNION ALL SELECT node_id FROM unnest(removed)) x;
  IF nodes_changed IS NULL THEN
    RETURN;
  END IF;
  -- A node that moves region or pool (an UPDATE of nodes, whose trigger below moves its
  -- counts) waits for this transaction, or this statement for it: the next statement then
  -- reads the region and pool that move committed.
  PERFORM 1 FROM nodes WHERE node_id = ANY (nodes_changed) ORDER BY node_id FOR SHARE;
  WITH d AS (
    SELECT node_id, sku, gpu_model, sum(k) AS slots, sum(k * schedulable::int) AS schedulable,
           sum(k * (admin_state = 'available')::int) AS approved
    FROM (SELECT a.node_id, a.sku, a.gpu_model, a.schedulable, a.admin_state, 1 AS k
          FROM unnest(added) a
          UNION ALL
          SELECT r.node_id, r.sku, r.gpu_model, r.schedulable, r.admin_state, -1
          FROM unnest(removed) r) x
    GROUP BY 1, 2, 3
    HAVING sum(k) <> 0 OR sum(k * schedulable::int) <> 0
        OR sum(k * (admin_state = 'available')::int) <> 0),
  up AS (
    INSERT INTO availability_node_counts AS c
        (node_id, sku, gpu_model, slots, schedulable, approved)
      SELECT node_id, sku, gpu_model, slots, schedulable, approved FROM d
      ORDER BY node_id, sku, gpu_model
      ON CONFLICT (node_id, sku, gpu_model) DO UPDATE SET slots = c.slots + EXCLUDED.slots,
        schedulable = c.schedulable + EXCLUDED.schedulable,
        approved = c.approved + EXCLUDED.approved
      RETURNING c.node_id, c.sku, c.gpu_model, c.slots)
  INSERT INTO availability_counts AS g
      (region, pool, sku, gpu_model, shard, slots, schedulable, approved, nodes)
    SELECT n.region, n.pool, d.sku, d.gpu_model, pg_backend_pid() % 16, sum(d.slots),
           sum(d.schedulable), sum(d.approved),
           sum((up.slots > 0)::int - (up.slots - d.slots > 0)::int)
    FROM d JOIN up USING (node_id, sku, gpu_model) JOIN nodes n USING (node_id)
    GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (region, pool, sku, gpu_model, shard) DO UPDATE SET
      slots = g.slots + EXCLUDED.slots, schedulable = g.schedulable + EXCLUDED.schedulable,
      approved = g.approved + EXCLUDED.approved, nodes = g.nodes + EXCLUDED.nodes;
END;
$$;

-- Statement-level with transition tables: one pass per statement, however many slots it wrote.
CREATE FUNCTION availability_slots_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    PERFORM availability_count_slots(ARRAY(SELECT n::node_resource_slots FROM new_rows n), '{}');
  ELSIF TG_OP = 'DELETE' THEN
    PERFORM availability_count_slots('{}', ARRAY(SELECT o::node_resource_slots FROM old_rows o));
  ELSE
    PERFORM availability_count_slots(ARRAY(SELECT n::node_resource_slots FROM new_rows n),
                                     ARRAY(SELECT o::node_resource_slots FROM old_rows o));
  END IF;
  RETURN NULL;
END;
$$;

CREATE TRIGGER node_resource_slots_availability_insert AFTER INSERT ON node_resource_slots
  REFERENCING NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION availability_slots_changed();
CREATE TRIGGER node_resource_slots_availability_update AFTER UPDATE ON node_resource_slots
  REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION availability_slots_changed();
CREATE TRIGGER node_resource_slots_availability_delete AFTER DELETE ON node_resource_slots
  REFERENCING OLD TABLE AS old_rows
  FOR EACH STATEMENT EXECUTE FUNCTION availability_slots_changed();

-- A node that moved to another region or pool takes its counts with it.
CREATE FUNCTION availability_nodes_moved() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO availability_counts AS g
      (region, pool, sku, gpu_model, shard, slots, schedulable, approved, nodes)
    SELECT m.region, m.pool, c.sku, c.gpu_model, pg_backend_pid() % 16, sum(m.k * c.slots),
           sum(m.k * c.schedulable), sum(m.k * c.approved), sum(m.k * (c.slots > 0)::int)
    FROM (SELECT n.node_id, n.region, n.pool, 1 AS k
          FROM new_rows n JOIN old_rows o USING (node_id)
          WHERE (n.region, n.pool) IS DISTINCT FROM (o.region, o.pool)
          UNION ALL
          SELECT o.node_id, o.region, o.pool, -1
          FROM new_rows n JOIN old_rows o USING (node_id)
          WHERE (n.region, n.pool) IS DISTINCT FROM (o.region, o.pool)) m
    JOIN availability_node_counts c USING (node_id)
    GROUP BY 1, 2, 3, 4, 5
    ON CONFLICT (region, pool, sku, gpu_model, shard) DO UPDATE SET
      slots = g.slots + EXCLUDED.slots, schedulable = g.schedulable + EXCLUDED.schedulable,
      approved = g.approved + EXCLUDED.approved, nodes = g.nodes + EXCLUDED.nodes;
  RETURN NULL;
END;
$$;

CREATE TRIGGER nodes_availability_moved AFTER UPDATE ON nodes
  REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION availability_nodes_moved();
