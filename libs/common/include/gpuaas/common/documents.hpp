#pragma once
// Versioned per-node documents that a node-agent applies and acks (inventory's desired slot
// set, ipam's network document, ingress's exposure document): one mechanism, two tables each.
//
//   documents: (node_id text, version bigint, doc jsonb, created_at timestamptz,
//               PRIMARY KEY (node_id, version))    immutable; version 1, 2, ... per node
//   acks:      (node_id text PRIMARY KEY, applied_version bigint, blockers text[],
//               acked_at timestamptz)               the newest version the agent applied
//
// A service publishes the document it wants the node to have (a new version only when the
// content changed), serves the latest (or a given) version to the agent, and records the
// agent's acks, which only move forward. The agent side is services/node-agent's
// DocumentFollower. See libs/common/docs/documents.md.
#include <pqxx/pqxx>

#include <google/protobuf/timestamp.pb.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace gpuaas::documents {

// Table names come from code constants, never from users (they are quoted anyway).
struct Tables {
  std::string documents;
  std::string acks;
  std::string what;  // "network document", "desired slot set": used in error messages
};

// The document message must have `int64 version` and `google.protobuf.Timestamp created_at`
// fields (found by name; INTERNAL document_without_version otherwise).
//
// Writes `want` as the node's next version unless its content (version and created_at
// ignored) equals the latest's; sets want's version and created_at (those of the stored
// document when unchanged) and returns the latest version. When the node has no version yet
// and `empty` is true, writes nothing and returns 0.
Result<int64_t> Publish(pqxx::work& tx, const Tables& t, const std::string& node_id,
                        google::protobuf::Message& want, bool empty);

// The node's latest version (0: none).
int64_t Latest(pqxx::work& tx, const Tables& t, const std::string& node_id);

// Version 0 = the latest. Fills `out`; when the node has no version, leaves it as it is (the
// caller sets node_id). NOT_FOUND document_version_not_found {version, latest} for a version
// that does not exist; INTERNAL corrupt_document when the stored JSON does not parse. Returns
// the latest version.
Result<int64_t> Load(pqxx::work& tx, const Tables& t, const std::string& node_id, int64_t version,
                     google::protobuf::Message& out);

struct AckState {
  int64_t applied_version = 0;
  std::vector<std::string> blockers;
  std::optional<google::protobuf::Timestamp> acked_at;  // none: never acked
};
AckState LoadAck(pqxx::work& tx, const Tables& t, const std::string& node_id);

// The checks RecordAck makes before touching the database (handlers that validate before
// opening a transaction call it first): INVALID_ARGUMENT invalid_version below 0,
// invalid_blocker unless every blocker is snake_case of 1-64 [a-z0-9_] (each bad one in the
// details as blockers[i]).
Result<void> ValidateAck(int64_t version, const std::vector<std::string>& blockers);

struct AckResult {
  int64_t applied_version = 0;  // after this ack: the highest acked
  int64_t latest_version = 0;
  std::vector<std::string> blockers;  // those of the highest version acked
};
// ValidateAck, then INVALID_ARGUMENT unknown_version {version, latest} above the latest, then
// records the ack. Acks only move forward (a late ack of an older version changes neither the
// version nor the blockers); an ack of the same version replaces the blockers.
Result<AckResult> RecordAck(pqxx::work& tx, const Tables& t, const std::string& node_id,
                            int64_t version, const std::vector<std::string>& blockers);

}  // namespace gpuaas::documents
