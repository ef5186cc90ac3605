#pragma once
// ipam's database helpers shared by its request handlers and consumers. Every function runs in
// the caller's transaction; functions that change a node's reservations expect the caller to
// hold the node's subnet row lock (LockNode), which serialises all changes of one node across
// workers and replicas.
#include <pqxx/pqxx>

#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/ipam.pb.h"
#include "ipam_domain.hpp"

namespace gpuaas::ipam {

struct IpamConfig;

struct NodeNet {
  std::string node_id;
  std::string subnet;
  std::string gateway;
  std::string region;
  std::string pool;
  // Resolved at the node's first reservation, or by a node rule; unresolved (UNSPECIFIED) on
  // rows older than datapaths, whose documents take the configured one.
  Datapath datapath;
};

// The node's subnet row, locked FOR UPDATE; nullopt when ipam has never reserved on the node.
std::optional<NodeNet> LockNode(pqxx::work& tx, const std::string& node_id);

std::optional<v1::SlotReservation> FindReservation(pqxx::work& tx, const std::string& node_id,
                                                   const std::string& slot_key);
std::vector<v1::SlotReservation> ListReservations(pqxx::work& tx, const std::string& node_id);
std::vector<ReservedSlot> LoadReservedSlots(pqxx::work& tx, const std::string& node_id);

// The MAC the slot owns, assigning one when it owns none: its derived MAC unless another slot
// owns that (then the next pool MAC). Concurrent claims of one MAC are settled by the unique
// index: the loser sees the conflict and moves on. Returns {mac, source}.
Result<std::pair<std::string, std::string>> EnsureMac(pqxx::work& tx, const std::string& node_id,
                                                      const std::string& slot_key);
// Tries to make `mac` the slot's (INSERT ... ON CONFLICT DO NOTHING); false when it is owned.
bool ClaimMac(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
              const std::string& mac, const std::string& source, int epoch);
// The next free pool MAC, claimed for the slot.
Result<std::string> ClaimPoolMac(pqxx::work& tx, const std::string& node_id,
                                 const std::string& slot_key, int epoch);

// The node network document and its acks: a versioned per-node document (libs/common
// documents.hpp).
const documents::Tables& NetworkDocumentTables();

// A new document version when the node's network differs from its latest version; returns
// the latest version (0 when the node has neither documents nor reservations).
Result<int64_t> UpdateDocument(pqxx::work& tx, const std::string& node_id, const IpamConfig& cfg);

// gpuaas.v1.evt.ipam.reservation.<event> with the reservation as it is now.
Result<void> AnnounceReservation(pqxx::work& tx, const std::string& event,
                                 const v1::SlotReservation& r, const std::string& reason,
                                 const std::string& source, const std::string& traceparent);

// Opens (or changes the kind/evidence of) the drift of a finding's subject.
Result<void> RecordDrift(pqxx::work& tx, const std::string& node_id, const Finding& f,
                         int64_t document_version, const std::string& source);
// Resolves the open drift of `subject` on the node, if any.
Result<void> ResolveDrift(pqxx::work& tx, const std::string& node_id, const std::string& subject,
                          const std::string& why, const std::string& source);
std::vector<v1::IpamDrift> ListDrift(pqxx::work& tx, const std::string& node_id,
                                     bool include_resolved);

}  // namespace gpuaas::ipam
