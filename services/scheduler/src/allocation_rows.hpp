#pragma once
// Reading and announcing allocation rows, shared by the request handlers (allocations.cpp) and
// the saga (saga.cpp). Internal to the scheduler.
#include <pqxx/pqxx>

#include <string>

#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::scheduler {

// States in which an allocation holds its claims by right.
inline constexpr const char* kLiveStates = "('reserved','provisioning','active','releasing')";

// A claim's phase, every live claim of the allocation.
void SetClaimPhase(pqxx::work& tx, const std::string& allocation_id, v1::ClaimPhase phase);

// The allocation `id` with its claims; FOR UPDATE when `lock`. invalid_allocation_id for a
// non-UUID, allocation_not_found when there is none — or when `tenant_scope` (a tenant
// principal's tenant, rpc::Context::TenantScope) is set and it is another tenant's: a tenant
// never learns another tenant's allocation exists.
Result<v1::Allocation> LoadAllocation(pqxx::work& tx, const std::string& id, bool lock,
                                      const std::string& tenant_scope = "");
// The allocation row matching (tenant, request_id), if any: one probe of that unique key however
// many allocations the tenant has and whatever the table statistics say.
std::optional<v1::Allocation> FindByRequest(pqxx::work& tx, const std::string& tenant,
                                            const std::string& request_id);
// Appends gpuaas.v1.evt.scheduler.allocation.<state> with the allocation to the outbox.
Result<void> Announce(pqxx::work& tx, const v1::Allocation& a, const std::string& source,
                      const std::string& traceparent);
// Appends gpuaas.v1.evt.scheduler.node.emptied when the node is draining and holds no live claim
// (projection_store.hpp DrainingNodeEmptied): after its claims were freed, or its drain projected.
Result<void> AnnounceIfEmptied(pqxx::work& tx, const std::string& node_id,
                               const std::string& source, const std::string& traceparent);

// One timeline row, in `tx` (the caller holds the allocation row lock, so an allocation's seq
// order is its commit order).
struct Step {
  v1::TimelineStep step = v1::TIMELINE_STEP_UNSPECIFIED;
  v1::AllocationState state = v1::ALLOCATION_STATE_UNSPECIFIED;
  std::string task_id;
  v1::TaskType task_type = v1::TASK_TYPE_UNSPECIFIED;
  v1::TaskStage stage = v1::TASK_STAGE_UNSPECIFIED;
  std::string code;
  std::string detail;
  int percent = 0;
};
void AddTimeline(pqxx::work& tx, const std::string& allocation_id, const Step& s);

}  // namespace gpuaas::scheduler
