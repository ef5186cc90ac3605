#pragma once
// SQL on inventory's topology snapshots, node_resource_slots, wipe proofs, ipam drift marks and
// availability counts. Every function runs in the caller's transaction. A slot change expects
// the caller to hold its node's row lock first (LoadNodePlacement with RowLock::kForUpdate):
// the availability triggers of migration 0006 lock the node's row too, so the other order could
// deadlock with them.
#include <pqxx/pqxx>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::v1 {
class ListAvailabilityResponse;
class Slot;
}  // namespace gpuaas::v1

namespace gpuaas::inventory {

// ---- topology_snapshots ----

struct Snapshot {
  int64_t version = 0;
  double received_at = 0;  // epoch seconds
  v1::TopologyReport report;
};
// The node's snapshot `version` (0 = the latest); nullopt when there is none.
Result<std::optional<Snapshot>> LoadSnapshot(pqxx::work& tx, const std::string& node_id,
                                             int64_t version);
// The latest snapshot's version and node blockers; nullopt when the node has none.
struct LatestSnapshotBlockers {
  int64_t version = 0;
  std::vector<std::string> blockers;
};
std::optional<LatestSnapshotBlockers> LoadLatestSnapshotBlockers(pqxx::work& tx,
                                                                 const std::string& node_id);
// Whether a stored snapshot of the node was discovered after `discovered_at` (RFC 3339).
bool HasSnapshotDiscoveredAfter(pqxx::work& tx, const std::string& node_id,
                                const std::string& discovered_at);
void InsertSnapshot(pqxx::work& tx, const std::string& node_id, int64_t version,
                    const std::string& event_id, const v1::TopologyReport& report);

// ---- node_resource_slots ----

// Every slot of the node, by slot_key.
Result<std::map<std::string, v1::Slot>> LoadSlots(pqxx::work& tx, const std::string& node_id);
bool SlotExists(pqxx::work& tx, const std::string& node_id, const std::string& slot_key);
// The slot's stored generation with its row locked FOR UPDATE; nullopt for a new slot.
std::optional<int64_t> LockSlotGeneration(pqxx::work& tx, const std::string& node_id,
                                          const std::string& slot_key);
// Inserts or overwrites the slot (node_id, generation and all as `slot` has them) together
// with the columns constraints and availability counts need.
void UpsertSlot(pqxx::work& tx, const v1::Slot& slot, bool schedulable);

// ---- wipe_proofs ----

// The by-id paths of the node's disks with a wipe proof.
std::set<std::string> WipedDisks(pqxx::work& tx, const std::string& node_id);
// Records (or replaces) the proof of the node's disk; returns when it was recorded (epoch s).
double UpsertWipeProof(pqxx::work& tx, const std::string& node_id, const std::string& nvme_by_id,
                       const std::string& method, const std::string& evidence,
                       const std::string& recorded_by);

// ---- ipam_drift_marks ----

// The newest ipam drift generation applied to the slot, its row locked FOR UPDATE.
std::optional<int64_t> LockIpamDriftMark(pqxx::work& tx, const std::string& node_id,
                                         const std::string& slot_key);
void SaveIpamDriftMark(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                       int64_t generation);

// ---- availability_counts ----

// What inventory.availability.list answers for `region` ("" = every region): the sums of the
// counts the triggers of migration 0006 keep, without reading a slot.
Result<v1::ListAvailabilityResponse> ListAvailability(pqxx::work& tx, const std::string& region);

}  // namespace gpuaas::inventory
