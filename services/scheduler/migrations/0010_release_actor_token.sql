-- The rest of the release requester's principal: its token's roles and id, so every later
-- snapshot carries release_requested_by whole, as the releasing event announced it.
ALTER TABLE allocations
  ADD COLUMN release_actor_roles text[] NOT NULL DEFAULT '{}',
  ADD COLUMN release_token_id text NOT NULL DEFAULT '';
