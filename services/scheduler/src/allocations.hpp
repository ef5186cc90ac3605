#pragma once
// Allocations: create (validate against the catalog, place, claim), get, list, release. Placement
// reads candidate slots from the slot projection, ranks nodes with the pure placement engine,
// then locks the chosen node (FOR SHARE for slices, FOR UPDATE for baremetal) and its slots
// (FOR UPDATE SKIP LOCKED), re-checks live claims, and commits allocation, claims and the
// outbox event together; a node someone else is placing on is skipped, not waited for.
//
// Today an allocation stops at `reserved`: the provisioning saga (vm.provision tasks) is not
// built yet. Releasing a reserved allocation frees its claims at once (nothing was created on
// the host); provisioning/active allocations will go through vm.release + slot.cleanup.
#include <pqxx/pqxx>

#include <string>

#include "catalog.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::scheduler {

Result<void> StartAllocations(runtime::Service& svc, const Catalog& catalog);

// Violations of the claim invariants (empty: consistent): a slot with two live claims, a node
// with both an exclusive and slot claims, a live claim of an allocation that is not live, a
// live allocation whose claims do not match its shape and GPU count or span nodes.
std::vector<std::string> CheckInvariants(pqxx::work& tx);

}  // namespace gpuaas::scheduler
