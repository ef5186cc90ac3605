-- Every scheduler replica keeps a placement index in memory (src/placement_cache.hpp). A commit
-- that changes what a node can take (its projected slots or node row, a claim taken or released)
-- tells every replica which node to read again, through NOTIFY on channel gpuaas_placement with
-- the node id as payload. PostgreSQL delivers it only on commit and once per node and
-- transaction, so a bulk change costs one notification per node, never per row.
CREATE FUNCTION placement_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF TG_OP <> 'INSERT' THEN
    PERFORM pg_notify('gpuaas_placement', OLD.node_id);
  END IF;
  IF TG_OP <> 'DELETE' THEN
    PERFORM pg_notify('gpuaas_placement', NEW.node_id);
  END IF;
  RETURN NULL;
END;
$$;

CREATE TRIGGER projected_slots_placement AFTER INSERT OR UPDATE OR DELETE ON projected_slots
  FOR EACH ROW EXECUTE FUNCTION placement_notify();
CREATE TRIGGER projected_nodes_placement AFTER INSERT OR UPDATE OR DELETE ON projected_nodes
  FOR EACH ROW EXECUTE FUNCTION placement_notify();
CREATE TRIGGER claims_placement AFTER INSERT OR UPDATE OR DELETE ON allocation_resource_claims
  FOR EACH ROW EXECUTE FUNCTION placement_notify();
