#pragma once
// The SQL of allocations (allocations.cpp): reading allocation rows, the create transaction's
// statements (idempotency lock, placement locks and re-checks, inserts), the refusal counts and
// the list page. Every function runs in the caller's transaction; the create path's statements
// stay prepared (store::Prepared) under the names their text gives them. Internal to the
// scheduler. The row helpers shared with the saga are declared in allocation_rows.hpp and
// defined in allocation_store.cpp as well.
#include <pqxx/pqxx>

#include <map>
#include <string>
#include <vector>

#include "gpuaas/scheduler/placement_cache.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::scheduler {

// --- create: idempotency and region --------------------------------------------------------

// Retries of one request id, on any replica, one at a time (a transaction-scoped advisory lock).
void LockRequestId(pqxx::work& tx, const std::string& tenant, const std::string& request_id);
// The region has projected slots and none of them is in an enabled region.
bool RegionHasOnlyDisabledSlots(pqxx::work& tx, const std::string& region);

// --- create: placement rounds ----------------------------------------------------------------

// From now on in `tx`, a row lock waits at most `ms` (then 55P03).
void SetLockTimeout(pqxx::work& tx, int ms);
// Back to no lock_timeout for the rest of `tx`.
void ClearLockTimeout(pqxx::work& tx);

// One placement choice in its own savepoint (named `choice`): Begin, then Keep (release the
// savepoint, keeping its locks) or Abandon (roll back to it, releasing its locks).
void BeginChoice(pqxx::work& tx);
void KeepChoice(pqxx::work& tx);
void AbandonChoice(pqxx::work& tx);

// The node's row FOR SHARE (slices share it), SKIP LOCKED when `skip`: taken, not taken (held
// by someone, or gone), or taken on a node that is not active (drained, draining, ...: it takes
// no new placement; the lock is given up with the choice's savepoint).
enum class NodeShare { kShared, kHeld, kNotActive };
NodeShare ShareNode(pqxx::work& tx, const std::string& node_id, bool skip);
// The schedulable and complete (kSlotCompleteSql) ones of `slot_keys` (a text[] literal) of the
// node, FOR UPDATE in slot order (SKIP LOCKED when `skip`); how many were locked.
int LockSchedulableSlots(pqxx::work& tx, const std::string& node_id, const std::string& slot_keys,
                         bool skip);
// A live claim on one of `slot_keys` (a text[] literal) or an exclusive one on the node.
bool SlotsClaimed(pqxx::work& tx, const std::string& node_id, const std::string& slot_keys);

// Active nodes free of live claims for a baremetal placement, best first, at most `limit`.
std::vector<std::string> BaremetalCandidates(pqxx::work& tx, const std::string& region,
                                             const std::string& pool, int limit);
// The node's row FOR UPDATE SKIP LOCKED; false when someone else holds it or it is not active.
bool LockNodeExclusive(pqxx::work& tx, const std::string& node_id);
// The node has a live claim of any kind.
bool NodeClaimed(pqxx::work& tx, const std::string& node_id);

// Why nothing could be placed, counted in SQL (the refusal's details).
// One slot SKU's capacity in one region, for catalog.list (CatalogAvailability).
struct RegionCapacity {
  std::string region;
  std::string sku;  // the slot SKU (a catalog SKU's gpu_sku)
  bool region_enabled = false;
  int64_t free_gpus = 0;        // free slots
  int64_t max_on_one_node = 0;  // the most free slots on one node
  // The GPUs (slots) of active baremetal-mode nodes no allocation holds anything of (where
  // baremetal can be placed), in all and on the largest such node.
  int64_t free_on_clean_nodes = 0;
  int64_t max_on_one_clean_node = 0;
};
// Every (region, slot SKU) the projected slots have, by region then SKU.
std::vector<RegionCapacity> ReadRegionCapacity(pqxx::work& tx);

PlacementCache::FreeCounts CountFree(pqxx::work& tx, const std::string& region,
                                     const std::string& pool, const std::string& sku,
                                     const std::string& fabric_type, int gpus);

// --- create: what the placement commits -------------------------------------------------------

struct NewAllocation {
  std::string id;
  std::string tenant;
  std::string request_id;
  std::string sku;
  v1::CapacityShape shape = v1::CAPACITY_SHAPE_UNSPECIFIED;
  int gpu_count = 0;
  std::string region;
  std::string pool;
  v1::NetworkMode network_mode = v1::NETWORK_MODE_UNSPECIFIED;
  std::string node_id;
  v1::BillableUnit billable_unit = v1::BILLABLE_UNIT_GPU_SECOND;
};
// The allocation row, `reserved`, generation 1.
void InsertAllocation(pqxx::work& tx, const NewAllocation& a);
void SetAllocationApp(pqxx::work& tx, const std::string& allocation_id, const std::string& app);
void InsertEndpoint(pqxx::work& tx, const std::string& allocation_id,
                    const v1::EndpointRequest& endpoint);
void InsertExclusiveClaim(pqxx::work& tx, const std::string& allocation_id,
                          const std::string& node_id);
void InsertSlotClaims(pqxx::work& tx, const std::string& allocation_id, const std::string& node_id,
                      const std::vector<std::string>& slot_keys);

// --- reads ---------------------------------------------------------------------------------

struct AllocationPage {
  std::vector<v1::Allocation> allocations;  // at most the limit asked
  bool more = false;                        // rows follow the last one
};
// Allocations in id order after `after` ("" = from the first), filtered by tenant and state
// ("" = any), with their claims and endpoints.
AllocationPage ListAllocations(pqxx::work& tx, const std::string& tenant, const std::string& state,
                               const std::string& after, int limit);

// --- gauges (scheduler_metrics.cpp) ------------------------------------------------------------

// Folds the counts of backends that are gone into shard 0 (migration 0009), so the rows the
// gauges sum are about one per live connection and state, whatever the fleet.
void FoldCountsOfGoneBackends(pqxx::work& tx);
struct StateGauge {
  double count = 0;           // allocations in the state
  double oldest_seconds = 0;  // time the oldest has been in it (0: none)
};
// Every state of `states` (0, 0 when it has none), and any other state with counts.
std::map<std::string, StateGauge> ReadStateGauges(pqxx::work& tx,
                                                  const std::vector<std::string>& states);

}  // namespace gpuaas::scheduler
