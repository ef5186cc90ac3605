-- Who asked for an allocation's release and why (the request token's principal, the request's
-- reason): every later snapshot, the released one included, carries it (audit).
ALTER TABLE allocations
  ADD COLUMN release_actor text NOT NULL DEFAULT '',
  ADD COLUMN release_actor_tenant text NOT NULL DEFAULT '',
  ADD COLUMN release_reason text NOT NULL DEFAULT '';
