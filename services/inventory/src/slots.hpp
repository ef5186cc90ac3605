#pragma once
// Inventory's slot domain on top of its database: topology snapshots reported by node-agents,
// drift, each node's versioned desired slot set, and the writing of slots. Every slot change
// bumps the slot's generation and announces a gpuaas.v1.SlotSnapshot through the outbox in the
// same transaction. Lock order of every slot change: the node's row first (LoadNode with
// RowLock::kForUpdate), then its slots; the availability triggers rely on it.
#include <pqxx/pqxx>

#include <cstdint>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "node_store.hpp"

namespace gpuaas::v1 {
class Event;
class Slot;
}  // namespace gpuaas::v1

namespace gpuaas::documents {
struct Tables;
}

namespace gpuaas::inventory {

inline constexpr const char* kTopologyConsumer = "inventory-node-topology";
inline constexpr const char* kTaskConsumer = "inventory-node-tasks";
inline constexpr const char* kIpamDriftConsumer = "inventory-ipam-drift";
inline constexpr const char* kNodeEmptiedConsumer = "inventory-node-emptied";

// Consumers' effects (public for tests): a TopologyReport event stored as the node's next
// snapshot version, drift and node-blocker changes applied to its slots; a NodeTaskResult event
// recorded against the task inventory sent.
Result<void> ApplyTopologyEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source);
Result<void> ApplyTaskEvent(pqxx::work& tx, const v1::Event& ev);
// An ipam drift event (gpuaas.v1.evt.ipam.drift.{detected,resolved}) on a slot: detected marks
// the slot degraded with the drift in its health_detail; resolved removes that drift (and the
// degradation when no other drift is left). Ordered by the drift's generation.
Result<void> ApplyIpamDriftEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source);

// Re-announces every slot of a node with a new generation (its region, pool, blockers or
// region state changed, which every slot snapshot carries).
Result<void> ReemitNodeSlots(pqxx::work& tx, const std::string& node_id, const std::string& source,
                             const std::string& traceparent);

// What every slot snapshot of a node carries besides the slot itself.
struct NodeCtx {
  std::string node_id;
  std::string region;
  std::string pool;
  bool region_enabled = true;
  std::vector<std::string> blockers;  // of the latest topology snapshot
  int64_t snapshot_version = 0;
  // Only an active node's slots are schedulable (a drain re-announces them all).
  v1::NodeAdminState admin_state = v1::NODE_ADMIN_STATE_ACTIVE;
  v1::CapacityProfile mode = v1::CAPACITY_PROFILE_UNSPECIFIED;  // only slice-vm sells slots
  int64_t generation = 0;                                       // the node record's
  // An open mode change (UNSPECIFIED: none) and the desired version that carries it.
  v1::CapacityProfile mode_target = v1::CAPACITY_PROFILE_UNSPECIFIED;
  int64_t mode_change_version = 0;
};
// NOT_FOUND node_not_found for a node inventory does not know.
Result<NodeCtx> LoadNode(pqxx::work& tx, const std::string& node_id, RowLock lock);

// INVALID_ARGUMENT invalid_node_id unless `id` is a node id.
Result<void> CheckNodeId(const std::string& id);

// Writes the slot with the next generation and announces its snapshot in the same transaction.
Result<v1::Slot> SaveSlot(pqxx::work& tx, const NodeCtx& c, v1::Slot slot,
                          const std::string& source, const std::string& traceparent,
                          const std::string& correlation);
// Same slot apart from bookkeeping (generation, time)?
bool SameSlot(v1::Slot a, v1::Slot b);

// Drift ipam reports (lease mismatch/missing/unexpected, vNIC drift) is kept apart from the
// topology drift inventory detects itself: each source sets and clears only its own. True for
// exactly the four ipam kinds of the registry (ipam.proto IpamDrift.kind).
bool IsIpamDrift(const std::string& kind);
// Drift only the party that reports it clears (ipam's kinds; the agent's vfio_binding_lost):
// inventory's topology drift detection and repair keep it as it is.
bool IsReportedDrift(const std::string& kind);
// "kind: detail; ..." of every drift record of the slot (its health_detail while degraded).
std::string DriftDetail(const v1::Slot& s);
// The slot's health after its drift changed: degraded with the drift as its detail while any is
// left (failed stays failed); with none, degraded turns healthy (available) or unknown.
void HealthFollowsDrift(v1::Slot& s);

// The desired slot set is a versioned per-node document (libs/common documents.hpp).
const documents::Tables& DesiredTables();
// A new desired-set version when the node's desired state differs from the latest version:
// its mode (an open change's target), in slice-vm its available slots and their GPUs and VFs to
// bind to vfio-pci, in baremetal no slots and every slot's GPU and VF to give back, and the
// rebind generation.
Result<int64_t> UpdateDesired(pqxx::work& tx, const std::string& node_id);

}  // namespace gpuaas::inventory
