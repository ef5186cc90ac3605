-- Operator page sessions (logins). The browser's cookie is an opaque random value; only its
-- SHA-256 is stored. The operator's request token is kept here, server-side, and forwarded with
-- the page's calls: the cookie is never the token. A session ends at logout, when idle past
-- console.page_idle_s, when its token expires or is revoked, or when an operator ends it.
CREATE TABLE page_sessions (
  session_id uuid PRIMARY KEY,
  cookie_hash text NOT NULL UNIQUE,
  principal text NOT NULL,
  roles text NOT NULL,
  token text NOT NULL,
  token_id text NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now(),
  last_seen_at timestamptz NOT NULL DEFAULT now(),
  expires_at timestamptz NOT NULL,
  ended_at timestamptz,
  end_reason text NOT NULL DEFAULT ''
    CHECK (end_reason IN ('', 'logout', 'idle', 'expired', 'revoked', 'ended')),
  ended_by text NOT NULL DEFAULT '',
  CHECK ((ended_at IS NULL) = (end_reason = ''))
);
CREATE INDEX page_sessions_live ON page_sessions (created_at DESC) WHERE ended_at IS NULL;
