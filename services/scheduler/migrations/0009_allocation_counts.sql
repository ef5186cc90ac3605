-- gpuaas_allocations{state} and gpuaas_allocation_oldest_seconds{state} are sampled every 5 s by
-- every replica. Counting them with a scan of allocations grew with the fleet and its history
-- (340,000 rows at 50,000 nodes: a stall every 5 s that showed in the create path's p99). The
-- counts are kept here instead, by a trigger on allocations, in rows of the PostgreSQL backend
-- that made the change (shard = its pid), so concurrent transactions never wait on one another's
-- counter row; the gauge sums them. Rows of backends that are gone are folded into shard 0 by
-- the sampler (scheduler_metrics.cpp). The oldest per state is read through an index.
CREATE TABLE allocation_state_counts (
  state text    NOT NULL,
  shard integer NOT NULL,
  n     bigint  NOT NULL,
  PRIMARY KEY (state, shard)
);

INSERT INTO allocation_state_counts (state, shard, n)
  SELECT state, 0, count(*) FROM allocations GROUP BY state;

-- Statement-level, with transition tables: one upsert per state a statement changed, so a bulk
-- INSERT of many allocations costs one row change, not one per allocation (row-level upserts of
-- one counter row in one transaction grew a version chain walked by each next upsert).
CREATE FUNCTION allocation_state_count() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    INSERT INTO allocation_state_counts AS c (state, shard, n)
      SELECT state, pg_backend_pid(), count(*) FROM new_rows GROUP BY state
      ON CONFLICT (state, shard) DO UPDATE SET n = c.n + EXCLUDED.n;
  ELSIF TG_OP = 'DELETE' THEN
    INSERT INTO allocation_state_counts AS c (state, shard, n)
      SELECT state, pg_backend_pid(), -count(*) FROM old_rows GROUP BY state
      ON CONFLICT (state, shard) DO UPDATE SET n = c.n + EXCLUDED.n;
  ELSE
    INSERT INTO allocation_state_counts AS c (state, shard, n)
      SELECT state, pg_backend_pid(), sum(d) FROM (
        SELECT state, 1 AS d FROM new_rows UNION ALL SELECT state, -1 FROM old_rows) x
      GROUP BY state HAVING sum(d) <> 0
      ON CONFLICT (state, shard) DO UPDATE SET n = c.n + EXCLUDED.n;
  END IF;
  RETURN NULL;
END;
$$;

CREATE TRIGGER allocations_state_count_insert AFTER INSERT ON allocations
  REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION allocation_state_count();
CREATE TRIGGER allocations_state_count_update AFTER UPDATE ON allocations
  REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
  FOR EACH STATEMENT EXECUTE FUNCTION allocation_state_count();
CREATE TRIGGER allocations_state_count_delete AFTER DELETE ON allocations
  REFERENCING OLD TABLE AS old_rows FOR EACH STATEMENT EXECUTE FUNCTION allocation_state_count();

CREATE INDEX allocations_state_updated ON allocations (state, updated_at);
