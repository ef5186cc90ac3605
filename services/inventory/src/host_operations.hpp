#pragma once
// Host operations on top of inventory's database: a node's admin state moved by the pure table
// (node_lifecycle.hpp) and everything a move implies, in the caller's transaction. A move writes
// the node with the next generation and the operator's reason, re-announces every slot of the
// node (a slot is schedulable only on an active node) and appends node.updated; the scheduler's
// projection of node.updated is what keeps new placements off the node.
#include <pqxx/pqxx>

#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/inventory/node_lifecycle.hpp"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::inventory {

// Who asks for a move, and why.
struct AdminCause {
  std::string why;
  std::string actor;        // the operator's principal, or inventory's source for reports
  std::string traceparent;  // "" for a consumer's move
  int64_t deadline_s = 0;   // a drain's deadline from now; 0 = none
  // A report about the node at this generation: the node stays when it has moved on since
  // (0 = any generation).
  int64_t seen_generation = 0;
  // What the scheduler said about its live claims (decommission asks it first); unknown counts
  // as live.
  bool has_live_claims = true;
  // node.mode: the mode asked for.
  v1::CapacityProfile target = v1::CAPACITY_PROFILE_UNSPECIFIED;
  // The agent's ack that decides an open mode change: what did not hold (empty: applied).
  std::vector<std::string> blockers;
};

struct AdminMove {
  v1::Node node;         // as stored after the move
  bool changed = false;  // false: the table said the node stays (nothing written)
};

// Locks the node's row, asks the table and writes what it says (a decommission also disables
// every slot and empties the desired slot set; a mode change opens with a desired slot set of
// the target mode and closes on the agent's ack: applied, or failed with its blockers; back in
// slice-vm every slot needs a fresh approval). NOT_FOUND node_not_found for an unknown node;
// the table's FAILED_PRECONDITION refusals as they are.
Result<AdminMove> MoveNode(pqxx::work& tx, const std::string& node_id, node_lifecycle::Event e,
                           const AdminCause& cause, const std::string& source);

// The agent's ack of `version` of the node's desired slot set, with its blockers: an open mode
// change whose version it covers is applied (no blockers) or failed; in slice-vm, the slots
// whose GPU or VF lost its vfio-pci binding are degraded (vfio_binding_lost) and cleared again
// when the agent's ack no longer names them.
Result<void> ApplyDesiredAck(pqxx::work& tx, const std::string& node_id, int64_t version,
                             const std::vector<std::string>& blockers, const std::string& source);

// The scheduler's gpuaas.v1.evt.scheduler.node.emptied: a draining node becomes drained.
Result<void> ApplyNodeEmptiedEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source);

// A node in maintenance is back when its agent's topology report has no node blocker: called by
// the topology consumer with the report's blockers, after the snapshot is stored.
Result<void> ApplyMaintenanceChecks(pqxx::work& tx, const std::string& node_id, bool passed,
                                    const std::string& source);

}  // namespace gpuaas::inventory
