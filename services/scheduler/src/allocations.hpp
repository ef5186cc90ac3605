#pragma once
// Allocations: create (validate against the catalog, place, claim), get, list, release. Placement
// takes proposals from the replica's placement index (placement_cache.hpp; candidate slots read
// from the slot projection and ranked with the pure placement engine when the index has none),
// then locks the chosen node (FOR SHARE for slices, FOR UPDATE for baremetal) and its slots
// (FOR UPDATE SKIP LOCKED), re-checks live claims, and commits allocation, claims and the
// outbox event together; a node someone else is placing on is skipped, not waited for.
//
// The create transaction also starts the lifecycle (saga.hpp): a slice leaves it in
// `provisioning` with its vm.provision task in the outbox; release goes through the saga too.
#include <pqxx/pqxx>

#include <string>

#include "catalog.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"
#include "saga.hpp"

namespace gpuaas::scheduler {

class PlacementCache;
}  // namespace gpuaas::scheduler
namespace gpuaas::store {
class GroupCommit;
}  // namespace gpuaas::store
namespace gpuaas::scheduler {

// `cache`: the replica's placement index (placement_cache.hpp), or null to read every decision's
// candidates from SQL. `group`: creates that overlap share a transaction and its commit
// (store::GroupCommit), or null for a transaction each.
Result<void> StartAllocations(runtime::Service& svc, const Catalog& catalog,
                              const SagaOptions& saga, PlacementCache* cache,
                              store::GroupCommit* group);

// Violations of the claim invariants (empty: consistent): a slot with two live claims, a node
// with both an exclusive and slot claims, a live claim of a released allocation (or of a failed
// one outside cleanup), a claim phase that contradicts its allocation's state, a live
// allocation whose claims do not match its shape and GPU count or span nodes.
std::vector<std::string> CheckInvariants(pqxx::work& tx);

}  // namespace gpuaas::scheduler
