-- node_agent_acks takes the shape every versioned per-node document's ack table has
-- (libs/common documents.hpp): the blockers the agent reported with its newest ack. The desired
-- set's ack carries none today, so every row keeps '{}'.
ALTER TABLE node_agent_acks ADD COLUMN blockers text[] NOT NULL DEFAULT '{}';
