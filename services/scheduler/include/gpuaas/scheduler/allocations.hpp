#pragma once
// Allocations: create (validate against the catalog, place, claim), get, list, release. Placement
// takes proposals from the replica's placement index (placement_cache.hpp; candidate slots read
// from the slot projection and ranked with the pure placement engine when the index has none),
// then locks the chosen node (FOR SHARE for slices, FOR UPDATE for baremetal) and its slots
// (FOR UPDATE SKIP LOCKED), re-checks live claims, and commits allocation, claims and the
// outbox event together; a node someone else is placing on is skipped, not waited for. The SQL
// is in allocation_store.{hpp,cpp}.
//
// The create transaction also starts the lifecycle (saga.hpp): a slice leaves it in
// `provisioning` with its vm.provision task in the outbox; release goes through the saga too.
#include <pqxx/pqxx>

#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/scheduler/saga.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::rpc {
struct Context;
}  // namespace gpuaas::rpc
namespace gpuaas::store {
class GroupCommit;
class Pool;
}  // namespace gpuaas::store

namespace gpuaas::scheduler {

class PlacementCache;
enum class NoPlacementKind;  // scheduler_metrics.hpp

// The handlers of gpuaas.v1.scheduler.allocation.{create,get,list,release,force_release} and
// catalog.list (routed in scheduler_routes.cpp).
class AllocationHandlers {
 public:
  // `cache`: the replica's placement index (placement_cache.hpp), or null to read every
  // decision's candidates from SQL. `group`: creates that overlap share a transaction and its
  // commit (store::GroupCommit), or null for a transaction each. Both outlive the handlers.
  AllocationHandlers(std::shared_ptr<store::Pool> pool, Catalog catalog, SagaOptions saga,
                     PlacementCache* cache, store::GroupCommit* group);

  // Every answer counted: gpuaas_placements_total, gpuaas_no_placement_total.
  Result<v1::CreateAllocationResponse> Create(const v1::CreateAllocationRequest& req,
                                              rpc::Context& ctx);
  Result<v1::GetAllocationResponse> Get(const v1::GetAllocationRequest& req, rpc::Context& ctx);
  Result<v1::ListAllocationsResponse> List(const v1::ListAllocationsRequest& req,
                                           rpc::Context& ctx);
  Result<v1::ReleaseAllocationResponse> Release(const v1::ReleaseAllocationRequest& req,
                                                rpc::Context& ctx);
  Result<v1::ReleaseAllocationResponse> ForceRelease(const v1::ForceReleaseAllocationRequest& req,
                                                     rpc::Context& ctx);
  // The whole catalog as loaded at start.
  Result<v1::ListCatalogResponse> ListCatalog(const v1::ListCatalogRequest& req, rpc::Context& ctx);

 private:
  // `refusal`: why a failed create found no capacity (kNone when that was not why).
  Result<v1::CreateAllocationResponse> PlaceAndCommit(const v1::CreateAllocationRequest& req,
                                                      rpc::Context& ctx, NoPlacementKind* refusal);

  std::shared_ptr<store::Pool> pool_;
  Catalog catalog_;
  v1::ListCatalogResponse listed_;  // catalog_, as catalog.list answers it
  SagaOptions saga_;
  PlacementCache* cache_;
  store::GroupCommit* group_;
};

// Violations of the claim invariants (empty: consistent): a slot with two live claims, a node
// with both an exclusive and slot claims, a live claim of a released allocation (or of a failed
// one outside cleanup), a claim phase that contradicts its allocation's state, a live
// allocation whose claims do not match its shape and GPU count or span nodes. The SQL checker
// the tests run (allocation_store.cpp).
std::vector<std::string> CheckInvariants(pqxx::work& tx);

}  // namespace gpuaas::scheduler
