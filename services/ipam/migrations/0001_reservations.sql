-- Per-node management subnets (node-local private network, e.g. 10.100.0.0/24 on every host)
-- and per-slot MAC/IP reservations. MACs are unique across the whole managed L2 domain; IPs are
-- unique within a node's subnet.
CREATE TABLE node_subnets (
  node_id    text PRIMARY KEY,
  subnet     cidr NOT NULL,
  gateway    inet NOT NULL,
  created_at timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE slot_reservations (
  node_id    text NOT NULL REFERENCES node_subnets (node_id),
  slot_key   text NOT NULL,
  mac        macaddr NOT NULL UNIQUE,
  ip         inet NOT NULL,
  generation bigint NOT NULL DEFAULT 1,
  created_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (node_id, slot_key),
  UNIQUE (node_id, ip)
);
