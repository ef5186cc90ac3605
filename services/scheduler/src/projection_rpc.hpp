#pragma once
// gpuaas.v1.scheduler.node.list, node.holders, slot.list and projection.rebuild: reads of the
// node and slot projections (scheduler_service.hpp applies inventory's events to them) and their
// rebuild. Routed in scheduler_routes.cpp. Internal to the scheduler.
#include <chrono>
#include <functional>
#include <memory>

#include "gpuaas/common/result.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::rpc {
struct Context;
}  // namespace gpuaas::rpc
namespace gpuaas::store {
class Pool;
}  // namespace gpuaas::store

namespace gpuaas::scheduler {

class ProjectionHandlers {
 public:
  // `rebuild`: SchedulerService::RebuildProjection.
  using Rebuild = std::function<Result<RebuildStats>(std::chrono::milliseconds timeout)>;
  ProjectionHandlers(std::shared_ptr<store::Pool> pool, Rebuild rebuild)
      : pool_(std::move(pool)), rebuild_(std::move(rebuild)) {}

  Result<v1::ListProjectedNodesResponse> ListNodes(const v1::ListProjectedNodesRequest& req,
                                                   rpc::Context& ctx);
  Result<v1::ListProjectedSlotsResponse> ListSlots(const v1::ListProjectedSlotsRequest& req,
                                                   rpc::Context& ctx);
  // Once the projection has min_generation of the node (polled until wait_ms).
  Result<v1::ListNodeHoldersResponse> NodeHolders(const v1::ListNodeHoldersRequest& req,
                                                  rpc::Context& ctx);
  Result<v1::RebuildProjectionResponse> RebuildProjection(const v1::RebuildProjectionRequest& req,
                                                          rpc::Context& ctx);

 private:
  std::shared_ptr<store::Pool> pool_;
  Rebuild rebuild_;
};

}  // namespace gpuaas::scheduler
