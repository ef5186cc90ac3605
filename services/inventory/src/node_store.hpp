#pragma once
// SQL on inventory's nodes, regions and node_tasks. Every function runs in the caller's
// transaction; the caller decides what is locked when (see slots.hpp for the lock order).
#include <pqxx/pqxx>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/v1/inventory.pb.h"

namespace google::protobuf {
class Timestamp;
}

namespace gpuaas::v1 {
class Region;
class RegisterNodeRequest;
class TaskRecord;
}  // namespace gpuaas::v1

namespace gpuaas::inventory {

// An `extract(epoch from ...)::float8` column as a Timestamp (millisecond precision).
google::protobuf::Timestamp TimestampFromEpoch(double epoch_s);

// ---- nodes ----

// The registration as a new node at generation 1; nullopt when the node exists.
std::optional<v1::Node> InsertNode(pqxx::work& tx, const v1::RegisterNodeRequest& req);
// The registration over an existing node, with the next generation, only when a field differs;
// nullopt when nothing changed. capacity_profile is not among the fields: it is the node's mode,
// set by its first registration and changed only by node.mode.
std::optional<v1::Node> UpdateNodeIfChanged(pqxx::work& tx, const v1::RegisterNodeRequest& req);
// The node with labels and timestamps (throws when it does not exist).
v1::Node ReadNode(pqxx::work& tx, const std::string& node_id);
// What node.show returns about the node: neither labels nor timestamps (throws when missing).
v1::Node ReadNodeSummary(pqxx::work& tx, const std::string& node_id);
// Up to `max_rows` nodes after `after_node_id` in node_id order; "" filters match every node.
std::vector<v1::Node> ListNodesAfter(pqxx::work& tx, const std::string& region,
                                     const std::string& pool, const std::string& after_node_id,
                                     int max_rows);

enum class RowLock { kNone, kForUpdate };

// Where a node is: its region, pool and whether the region is enabled (an unknown region
// counts as enabled); its admin state and mode.
struct NodePlacement {
  std::string region;
  std::string pool;
  bool region_enabled = true;
  v1::NodeAdminState admin_state = v1::NODE_ADMIN_STATE_ACTIVE;
  v1::CapacityProfile mode = v1::CAPACITY_PROFILE_UNSPECIFIED;
  int64_t generation = 0;
  // An open mode change: its target (UNSPECIFIED: none) and the desired version carrying it.
  v1::CapacityProfile mode_target = v1::CAPACITY_PROFILE_UNSPECIFIED;
  int64_t mode_change_version = 0;
  int64_t rebind_generation = 0;
};
// nullopt for an unknown node. kForUpdate locks the node's row (not the region's).
std::optional<NodePlacement> LoadNodePlacement(pqxx::work& tx, const std::string& node_id,
                                               RowLock lock);
// A node's new admin state, with the next generation; returns the node as stored.
struct NodeAdminWrite {
  v1::NodeAdminState state = v1::NODE_ADMIN_STATE_ACTIVE;
  std::string reason;
  std::string actor;
  int64_t deadline_s = 0;  // > 0: a drain's deadline from now (else: kept while drained)
};
v1::Node WriteNodeAdmin(pqxx::work& tx, const std::string& node_id, const NodeAdminWrite& w);

// A mode change opened (target set, earlier blockers cleared), its desired version recorded,
// and closed: the node in `mode` (its old one when the change failed) with the agent's blockers.
void OpenModeChange(pqxx::work& tx, const std::string& node_id, v1::CapacityProfile target);
void SetModeChangeVersion(pqxx::work& tx, const std::string& node_id, int64_t version);
void CloseModeChange(pqxx::work& tx, const std::string& node_id, v1::CapacityProfile mode,
                     const std::vector<std::string>& blockers);
// The node's rebind generation, bumped (slot.repair of a slot whose binding was lost).
int64_t BumpRebindGeneration(pqxx::work& tx, const std::string& node_id);

// Nodes per (mode, admin state), with those draining past their deadline.
struct NodeCount {
  std::string mode;
  std::string state;
  int64_t nodes = 0;
  int64_t overdue = 0;
};
std::vector<NodeCount> CountNodesByAdminState(pqxx::work& tx);

// The nodes of `region` that have at least one slot, in node_id order.
std::vector<std::string> NodesWithSlotsInRegion(pqxx::work& tx, const std::string& region);

// ---- regions ----

// Creates the region (enabled) unless it exists.
void EnsureRegion(pqxx::work& tx, const std::string& name);
// Creates the region in state `enabled` unless it exists.
void InsertRegionIfMissing(pqxx::work& tx, const std::string& name, bool enabled);
// Whether the (existing) region is enabled, its row locked FOR UPDATE.
bool LockRegionEnabled(pqxx::work& tx, const std::string& name);
void SetRegionEnabled(pqxx::work& tx, const std::string& name, bool enabled);
// The region with the pools of its nodes.
v1::Region LoadRegion(pqxx::work& tx, const std::string& name, bool enabled);
// Every region, by name, with the pools of its nodes.
std::vector<v1::Region> ListRegions(pqxx::work& tx);

// ---- node_tasks ----

void InsertQueuedTask(pqxx::work& tx, const std::string& task_id, const std::string& node_id,
                      const std::string& type);
// Records a result on the task; false when inventory has no such task.
bool FinishTask(pqxx::work& tx, const std::string& task_id, const std::string& status,
                const std::string& error);
// Records the result of a task inventory did not queue, when the node is known.
void InsertFinishedTaskOfKnownNode(pqxx::work& tx, const std::string& task_id,
                                   const std::string& node_id, const std::string& type,
                                   const std::string& status, const std::string& error);
// The node's last 10 tasks, newest first.
std::vector<v1::TaskRecord> RecentTasks(pqxx::work& tx, const std::string& node_id);

}  // namespace gpuaas::inventory
