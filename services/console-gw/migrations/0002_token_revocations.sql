-- Token revocations: one token (jti) or a principal's tokens issued until revoked_at. The record
-- of what was revoked, by whom and why; services learn of each from its event
-- (gpuaas.v1.evt.auth.token.revoked, through the outbox). A row is in force until expires_at.
CREATE TABLE token_revocations (
  revocation_id uuid PRIMARY KEY,
  jti text NOT NULL DEFAULT '',
  subject text NOT NULL DEFAULT '',
  revoked_at timestamptz NOT NULL,
  revoked_by text NOT NULL,
  reason text NOT NULL DEFAULT '',
  expires_at timestamptz NOT NULL,
  CHECK ((jti = '') <> (subject = ''))
);
-- One revocation of a token in force; a principal's newest revocation covers its older ones.
CREATE UNIQUE INDEX token_revocations_jti ON token_revocations (jti) WHERE jti <> '';
CREATE INDEX token_revocations_subject ON token_revocations (subject, revoked_at DESC)
  WHERE subject <> '';
CREATE INDEX token_revocations_expires ON token_revocations (expires_at);
