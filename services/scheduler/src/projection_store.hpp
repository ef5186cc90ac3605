#pragma once
// The SQL of the node and slot projections: the batch upserts of inventory's snapshots
// (scheduler_service.cpp), the rebuild's reset and counts, the node.list and slot.list pages
// (projection_rpc.cpp), and the placement index's reads of slots with their live claims
// (placement_cache.cpp). Every function runs in the caller's transaction (or, for the index's
// ping and notification, on the caller's connection); the index's node probe stays prepared
// (store::Prepared) under the name its text gives it. Internal to the scheduler.
#include <pqxx/pqxx>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::v1 {
class Event;
class NodeSnapshot;
class SlotSnapshot;
}  // namespace gpuaas::v1

namespace gpuaas::scheduler {

// --- inventory's events -> projection rows -----------------------------------------------------

// An entity's newest snapshot in a batch, and the event that carried it.
struct NodeUpsert {
  const v1::NodeSnapshot* snapshot = nullptr;
  const v1::Event* event = nullptr;
};
struct SlotUpsert {
  const v1::SlotSnapshot* snapshot = nullptr;
  const v1::Event* event = nullptr;
};
// One statement for the batch (each column an array, unnested into rows, in the order given);
// a row replaces the stored one only when its generation is higher. `rows` is not empty.
void UpsertProjectedNodes(pqxx::work& tx, const std::vector<NodeUpsert>& rows);
void UpsertProjectedSlots(pqxx::work& tx, const std::vector<SlotUpsert>& rows);

// --- rebuild ---------------------------------------------------------------------------------

// Deletes every projected node and slot, and the inbox rows of both projection consumers.
void EmptyProjections(pqxx::work& tx, const char* node_consumer, const char* slot_consumer);
struct ProjectionCounts {
  int64_t nodes = 0;
  int64_t slots = 0;
};
ProjectionCounts CountProjections(pqxx::work& tx);

// --- node.list / slot.list pages -----------------------------------------------------------

// Up to `limit` nodes of `region` ("" = any) after node id `after`, and the next page's token
// when more follow.
v1::ListProjectedNodesResponse ReadNodePage(pqxx::work& tx, const std::string& region,
                                            const std::string& after, int limit);
// Up to `limit` slots of `node_id` and `region` ("" = any) after (after_node, after_slot), each
// with its live claim, and the next page's token ("<node_id>/<slot_key>") when more follow.
v1::ListProjectedSlotsResponse ReadSlotPage(pqxx::work& tx, const std::string& node_id,
                                            const std::string& region,
                                            const std::string& after_node,
                                            const std::string& after_slot, int limit);

// --- drains ------------------------------------------------------------------------------

// The projected node (nullopt: not projected).
std::optional<v1::ProjectedNode> ReadProjectedNode(pqxx::work& tx, const std::string& node_id);
// The allocations with a live claim on the node, oldest first.
std::vector<v1::NodeHolder> ReadNodeHolders(pqxx::work& tx, const std::string& node_id);
// Whether the node is draining and holds no live claim (its projected generation), under a
// per-node advisory lock every caller takes: of a release of its last claims and the
// projection of its drain running together, the later sees the node empty.
std::optional<int64_t> DrainingNodeEmptied(pqxx::work& tx, const std::string& node_id);

// --- the placement index's reads -------------------------------------------------------------
// Each returns one row per projected slot, with the columns PlacementCache::Parse reads:
// node_id, region, pool, sku, slot_key, numa, pcie_switch, fabric_type, schedulable, complete
// (kSlotCompleteSql), slot claimed, node exclusively claimed, region_enabled.

// The last node id of the page of up to 2000 nodes after `after` (nullopt: no node follows).
std::optional<std::string> LastNodeOfSlotPage(pqxx::transaction_base& tx, const std::string& after);
// The slots of the nodes in (after, upto], by node and slot key.
pqxx::result ReadPlacementSlotsInRange(pqxx::transaction_base& tx, const std::string& after,
                                       const std::string& upto);
// The slots of `node_ids` (unique), each node by its own primary-key probe; prepared.
pqxx::result ReadPlacementSlotsOfNodes(pqxx::transaction_base& tx,
                                       const std::vector<std::string>& node_ids);
// The slots of `sku` in `region` (and `pool`, "" = any).
pqxx::result ReadPlacementSlotsOfSku(pqxx::transaction_base& tx, const std::string& region,
                                     const std::string& pool, const std::string& sku);
// A trivial statement on `c`, outside a transaction: a connection that died shows here.
void PingConnection(pqxx::connection_base& c);
// pg_notify(channel, payload) on `c`, outside a transaction.
void Notify(pqxx::connection_base& c, const char* channel, const std::string& payload);

}  // namespace gpuaas::scheduler
