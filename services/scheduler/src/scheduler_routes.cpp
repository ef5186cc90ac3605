// The scheduler's route table: every request subject it serves (queue group `scheduler`,
// subscription gpuaas.*.scheduler.>) and the named handler that answers it. The handlers live
// beside their domain: allocations.cpp, apps_rpc.cpp, saga.cpp, projection_rpc.cpp.
#include <memory>

#include "apps.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/scheduler/allocations.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/scheduler/saga.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "projection_rpc.hpp"

namespace gpuaas::scheduler {

void SchedulerService::RegisterRoutes(const Catalog& catalog, const SagaOptions& saga) {
  auto pool = svc_.pg();
  auto projections = std::make_shared<ProjectionHandlers>(
      pool, [this](std::chrono::milliseconds timeout) { return RebuildProjection(timeout); });
  auto allocations =
      std::make_shared<AllocationHandlers>(pool, catalog, saga, placement_.get(), group_.get());
  auto apps = std::make_shared<AppHandlers>(pool, catalog);
  auto lifecycle = std::make_shared<SagaHandlers>(pool);

  rpc::Server& rpc = svc_.Rpc();
  // Projections of inventory.
  rpc.Route("gpuaas.v1.scheduler.node.list", projections, &ProjectionHandlers::ListNodes);
  rpc.Route("gpuaas.v1.scheduler.node.holders", projections, &ProjectionHandlers::NodeHolders);
  rpc.Route("gpuaas.v1.scheduler.slot.list", projections, &ProjectionHandlers::ListSlots);
  rpc.Route("gpuaas.v1.scheduler.projection.rebuild", projections,
            &ProjectionHandlers::RebuildProjection);
  // Catalog and allocations.
  rpc.Route("gpuaas.v1.scheduler.catalog.list", allocations, &AllocationHandlers::ListCatalog);
  rpc.Route("gpuaas.v1.scheduler.allocation.create", allocations, &AllocationHandlers::Create);
  rpc.Route("gpuaas.v1.scheduler.allocation.get", allocations, &AllocationHandlers::Get);
  rpc.Route("gpuaas.v1.scheduler.allocation.list", allocations, &AllocationHandlers::List);
  rpc.Route("gpuaas.v1.scheduler.allocation.release", allocations, &AllocationHandlers::Release);
  rpc.Route("gpuaas.v1.scheduler.allocation.force_release", allocations,
            &AllocationHandlers::ForceRelease);
  rpc.Route("gpuaas.v1.scheduler.allocation.timeline", lifecycle, &SagaHandlers::Timeline);
  // Apps.
  rpc.Route("gpuaas.v1.scheduler.app.list", apps, &AppHandlers::List);
  rpc.Route("gpuaas.v1.scheduler.app.compatibility", apps, &AppHandlers::Compatibility);
}

}  // namespace gpuaas::scheduler
