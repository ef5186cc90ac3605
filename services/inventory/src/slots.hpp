#pragma once
// Inventory's slot domain on top of its database: topology snapshots reported by node-agents,
// approval of candidates into node_resource_slots (validator + MAC/IP from ipam), disable and
// repair, drift, regions, availability, wipe proofs, each node's versioned desired slot set and
// the typed tasks inventory sends to agents. Every slot change bumps the slot's generation and
// announces a gpuaas.v1.SlotSnapshot through the outbox in the same transaction.
#include <pqxx/pqxx>

#include <string>

#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::v1 {
class Event;
class ListAvailabilityResponse;
}  // namespace gpuaas::v1

namespace gpuaas::inventory {

inline constexpr const char* kTopologyConsumer = "inventory-node-topology";
inline constexpr const char* kTaskConsumer = "inventory-node-tasks";
inline constexpr const char* kIpamDriftConsumer = "inventory-ipam-drift";

struct SlotDeps {
  std::string source;  // "inventory/<instance>"
  int64_t ipam_timeout_ms = 5000;
  int64_t task_deadline_s = 300;
};

// Registers the slot, region, availability, wipe-proof, discover/show and desired-set handlers
// and starts the consumers of node-agent topology reports and task results.
Result<void> StartSlotDomain(runtime::Service& svc, const SlotDeps& deps);

// Consumers' effects (public for tests): a TopologyReport event stored as the node's next
// snapshot version, drift and node-blocker changes applied to its slots; a NodeTaskResult event
// recorded against the task inventory sent.
Result<void> ApplyTopologyEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source);
Result<void> ApplyTaskEvent(pqxx::work& tx, const v1::Event& ev);
// An ipam drift event (gpuaas.v1.evt.ipam.drift.{detected,resolved}) on a slot: detected marks
// the slot degraded with the drift in its health_detail; resolved removes that drift (and the
// degradation when no other drift is left). Ordered by the drift's generation.
Result<void> ApplyIpamDriftEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source);

// What inventory.availability.list answers for `region` ("" = every region): the sums of the
// counts the triggers of migration 0006 keep, without reading a slot.
Result<v1::ListAvailabilityResponse> ListAvailability(pqxx::work& tx, const std::string& region);

// Re-announces every slot of a node with a new generation (its region, pool, blockers or
// region state changed, which every slot snapshot carries).
Result<void> ReemitNodeSlots(pqxx::work& tx, const std::string& node_id, const std::string& source,
                             const std::string& traceparent);

}  // namespace gpuaas::inventory
