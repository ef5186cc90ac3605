#pragma once
// ingress's SQL: every statement the pool, exposure, ack and gauge code runs against ingress's
// tables (endpoint_pools, allocations, exposures, endpoint_leases, exposure_acks), each behind a
// function named for what it does. Every function runs in the caller's transaction; what it
// locks is said at its declaration, and the lock order is the caller's: a node's document lock
// (LockNodeDocument) before any exposure row lock, an allocation's row before its pools' rows.
#include <pqxx/pqxx>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ingress {

struct Context;

// ---- endpoint pools ----

// Pools by name with their `used` (leases) and `total`; `region` "" = every region.
std::vector<v1::EndpointPool> LoadPools(pqxx::work& tx, const std::string& region);
std::optional<v1::EndpointPool> LoadPool(pqxx::work& tx, const std::string& name);

// LOCK TABLE endpoint_pools IN SHARE ROW EXCLUSIVE MODE: a pool change's overlap checks see
// every pool, and no other change runs beside it.
void LockPoolTable(pqxx::work& tx);

// Where a pool serves and how many of its endpoints are leased; its row locked FOR UPDATE.
struct PoolPlacement {
  std::string region;
  std::string node_id;
  int64_t used = 0;
};
std::optional<PoolPlacement> LockPoolPlacement(pqxx::work& tx, const std::string& name);

// The first (by pool name, address) address another pool hands out that `want` would hand out
// too (for two port ranges: with a port in common).
struct PoolAddress {
  std::string pool;
  std::string address;
};
std::optional<PoolAddress> FindOverlappingPool(pqxx::work& tx, const v1::EndpointPool& want);

// The first (by address, port) endpoint of the pool an exposure holds that `want` would no
// longer hand out (an address it drops, a port outside its range, another kind).
struct HeldEndpoint {
  std::string address;
  int32_t port = 0;
};
std::optional<HeldEndpoint> FindEndpointDroppedBy(pqxx::work& tx, const v1::EndpointPool& want);

// Creates or replaces the pool (a replaced one's generation bumps); true when it created it.
bool UpsertPool(pqxx::work& tx, const v1::EndpointPool& want);

// The pool's row, locked FOR UPDATE (no-op when there is none).
void LockPool(pqxx::work& tx, const std::string& name);
int64_t CountLeasesOfPool(pqxx::work& tx, const std::string& name);
int64_t CountLeasesOfPools(pqxx::work& tx, const std::vector<std::string>& names);
void DeletePoolRow(pqxx::work& tx, const std::string& name);

// The pools that can serve an allocation on `node_id` in `region` (name, kind, addresses,
// ports), locked FOR UPDATE in one order: the node's port_range pools, then the region's
// public_ip pools, by name.
std::vector<v1::EndpointPool> LockPoolsServingNode(pqxx::work& tx, const std::string& region,
                                                   const std::string& node_id);

// ---- endpoint leases ----

// The public address (port 0 lease) the allocation already holds.
std::optional<PoolAddress> FindHeldPublicAddress(pqxx::work& tx, const std::string& allocation_id);
// The lowest port of port_min..port_max of `address` no lease holds.
std::optional<int32_t> FindLowestFreePort(pqxx::work& tx, const std::string& address,
                                          int32_t port_min, int32_t port_max);
// The first address of the pool (in its order) no lease holds.
std::optional<std::string> FindFirstFreeAddress(pqxx::work& tx, const v1::EndpointPool& pool);
void LeasePort(pqxx::work& tx, const std::string& pool, const std::string& address, int32_t port,
               const std::string& allocation_id, const std::string& exposure_id);
void LeaseAddress(pqxx::work& tx, const std::string& pool, const std::string& address,
                  const std::string& allocation_id);
// Frees what the exposure held: its port, or its allocation's address once no live exposure of
// the allocation uses it any more.
void FreeEndpoint(pqxx::work& tx, const v1::Exposure& e);

// ---- allocations (ingress's projection of the scheduler's) ----

// shape and state are stored as their enums' texts (enums::Text) and read back with
// enums::FromColumn: UNSPECIFIED for a text this build does not know.
struct AllocationRow {
  std::string id, tenant, node, region;
  v1::CapacityShape shape = v1::CAPACITY_SHAPE_UNSPECIFIED;
  v1::AllocationState state = v1::ALLOCATION_STATE_UNSPECIFIED;
  std::string slot_key, target_ip;
  bool vm_ready = false;
};
std::optional<AllocationRow> LoadAllocation(pqxx::work& tx, const std::string& id);
// The same, its row locked FOR UPDATE.
std::optional<AllocationRow> LockAllocation(pqxx::work& tx, const std::string& id);
std::optional<std::string> LoadAllocationTenant(pqxx::work& tx, const std::string& id);
// The generation of the last event applied, its row locked FOR UPDATE.
std::optional<int64_t> LockAllocationGeneration(pqxx::work& tx, const std::string& id);
// Writes the projection row; an empty slot_key or target_ip keeps the last known one.
void UpsertAllocation(pqxx::work& tx, const AllocationRow& a, int64_t generation);

// ---- exposures ----

// One exposure as stored, with its connect hint (nullopt: none with that id, or not a UUID).
std::optional<v1::Exposure> LoadExposure(pqxx::work& tx, const Context& c, const std::string& id);
// The same, its row locked FOR UPDATE.
std::optional<v1::Exposure> LockExposure(pqxx::work& tx, const Context& c, const std::string& id);

// exposure.list: "" matches any; state UNSPECIFIED is every state but removed. Newest first, at
// most 1000.
struct ExposureFilter {
  std::string allocation_id;
  std::string node_id;
  v1::ExposureState state = v1::EXPOSURE_STATE_UNSPECIFIED;
  std::string tenant;
};
std::vector<std::string> ListExposureIds(pqxx::work& tx, const ExposureFilter& f);

bool HasExposureNamed(pqxx::work& tx, const std::string& allocation_id, const std::string& name);
// A live exposure of the allocation with this name or this (protocol, port).
std::optional<v1::Exposure> FindLiveExposureLike(pqxx::work& tx, const Context& c,
                                                 const std::string& allocation_id,
                                                 const std::string& name,
                                                 const std::string& protocol, int32_t port);
int64_t CountLiveExposures(pqxx::work& tx, const std::string& allocation_id);

// A new exposure row: `requested` with its endpoint (pool, public_ip, public_port, detail), or
// `failed` saying why (reason, detail).
struct NewExposure {
  std::string id, allocation_id, tenant, node_id, slot_key, name, protocol;
  int32_t target_port = 0;
  std::string pool, public_ip;
  int32_t public_port = 0;
  std::string reason, detail;
};
v1::Exposure InsertRequestedExposure(pqxx::work& tx, const Context& c, const NewExposure& x);
v1::Exposure InsertFailedExposure(pqxx::work& tx, const Context& c, const NewExposure& x);

// How long the exposure has been in its state, and which state that is.
double SecondsInState(pqxx::work& tx, const std::string& id);
std::optional<v1::ExposureState> LoadExposureState(pqxx::work& tx, const std::string& id);
// Moves it to `state` with a new generation; `doc_version` < 0 keeps its document version.
v1::Exposure UpdateExposureState(pqxx::work& tx, const Context& c, const std::string& id,
                                 v1::ExposureState state, const std::string& reason,
                                 const std::string& detail, int64_t doc_version);
// The allocation's `requested` exposures become `applying` towards the VM; returns their ids.
std::vector<std::string> MarkRequestedApplying(pqxx::work& tx, const std::string& allocation_id,
                                               const std::string& target_ip,
                                               const std::string& slot_key);
// The state alone (no generation, no event): the caller announces it with UpdateExposureState.
void MarkRemoving(pqxx::work& tx, const std::string& id);

// Whose live (requested, applying, active, drift) exposures a removal takes.
struct ExposureSelection {
  enum class By { kAllocation, kExposure };
  By by;
  std::string id;
};
// The nodes they are on, in order.
std::vector<std::string> NodesOfLiveExposures(pqxx::work& tx, const ExposureSelection& s);
// Their rows locked FOR UPDATE, by exposure id.
struct LiveExposure {
  std::string id;
  v1::ExposureState state = v1::EXPOSURE_STATE_UNSPECIFIED;
  std::string node_id;
};
std::vector<LiveExposure> LockLiveExposures(pqxx::work& tx, const ExposureSelection& s);

// The node's applying, drift and removing exposures of a document version up to `version`, by
// exposure id: (id, state).
struct SettlingExposure {
  std::string id;
  v1::ExposureState state = v1::EXPOSURE_STATE_UNSPECIFIED;
};
std::vector<SettlingExposure> ListExposuresToSettle(pqxx::work& tx, const std::string& node_id,
                                                    int64_t version);

// ---- the node's exposure document ----

// One writer of a node's document at a time (the next version is latest + 1): a transaction
// advisory lock.
void LockNodeDocument(pqxx::work& tx, const std::string& node_id);
// The document the node should have now: its applying, active and drift exposures by id.
v1::NodeExposureDocument LoadNodeMappings(pqxx::work& tx, const std::string& node_id);
// Marks the node's ack as from an agent that does not touch the kernel (or not).
void RecordAckSimulated(pqxx::work& tx, const std::string& node_id, bool simulated);

// ---- gauges (StartExposureGauges reads them in one snapshot) ----

// How many exposures are in each state that has any (the state's text).
struct StateCount {
  std::string state;
  double count = 0;
};
std::vector<StateCount> CountExposuresByState(pqxx::work& tx);
// Every pool's endpoints: `total` it hands out (ports or addresses), `used` by leases.
struct PoolEndpoints {
  std::string pool;
  double total = 0;
  double used = 0;
};
std::vector<PoolEndpoints> CountPoolEndpoints(pqxx::work& tx);

}  // namespace gpuaas::ingress
