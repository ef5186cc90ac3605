-- Console sessions: one row per grant. The grant itself is never stored, only its SHA-256
-- (`grant_hash`), so a database dump cannot open a console.
CREATE TABLE console_sessions (
  session_id        text PRIMARY KEY,
  allocation_id     text NOT NULL,
  node_id           text NOT NULL,
  domain            text NOT NULL,
  state             text NOT NULL CHECK (state IN ('created', 'connected', 'disconnected',
                                                   'failed', 'expired', 'revoked')),
  grant_hash        text NOT NULL UNIQUE,
  created_by        text NOT NULL,
  reason            text NOT NULL,
  created_at        timestamptz NOT NULL DEFAULT now(),
  connect_by        timestamptz NOT NULL,
  max_duration_s    bigint NOT NULL,
  connected_at      timestamptz,
  ended_at          timestamptz,
  bytes_to_client   bigint NOT NULL DEFAULT 0,
  bytes_from_client bigint NOT NULL DEFAULT 0,
  end_reason        text NOT NULL DEFAULT '',
  revoked_by        text NOT NULL DEFAULT '',
  gateway           text NOT NULL DEFAULT '',
  client_address    text NOT NULL DEFAULT '',
  origin            text NOT NULL DEFAULT '',
  generation        bigint NOT NULL DEFAULT 1
);
CREATE INDEX console_sessions_allocation ON console_sessions (allocation_id, created_at DESC);
-- The sweeper's scans: grants to expire, connections past their maximum.
CREATE INDEX console_sessions_live ON console_sessions (state) WHERE state IN ('created', 'connected');
