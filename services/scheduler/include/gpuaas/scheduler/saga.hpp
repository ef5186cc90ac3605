#pragma once
// The allocation lifecycle (saga). Every step commits together with the allocation state, the
// claim phases, the outbox rows (events and node tasks) and a timeline row:
//
//   create (slice)   reserved -> provisioning, vm.provision sent (Nats-Msg-Id
//                    "<allocation>.vm.provision.<attempt>") with the concrete host bundle
//   provision ok     -> active (claims active), the observed network identity stored
//   provision failed -> failed {provisioning, code, detail}; claims cleanup_blocked;
//   / rejected /       slot.cleanup sent
//   deadline passed    (deadline: code node_unresponsive)
//   release          active/provisioning -> releasing (claims releasing), vm.release sent
//   release ok       claims cleanup, slot.cleanup sent
//   cleanup ok       claims freed only if the output holds a complete proof for every slot;
//                    releasing -> released (a failed allocation stays failed)
//   release/cleanup  claims cleanup_blocked, failure recorded; releasing again retries
//   failed           (a new attempt); an admin may force-release
//   force-release    (operator) cancels what is in flight and tears the host down now:
//                    provisioning/active/releasing -> releasing, vm.release sent; failed with
//                    live claims: slot.cleanup sent. The claims are still freed only by the
//                    cleanup proof (the node's lease goes with it), so the next placement on
//                    those slots succeeds; pending/reserved (no host task yet) -> released.
//
// Baremetal allocations have no host task in this product slice (bare-metal imaging is out of
// scope): they become active when placed and their claim is freed on release.
#include <pqxx/pqxx>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::scheduler {

class SchedulerMetrics;

inline constexpr const char* kTaskConsumer = "scheduler-node-tasks";

struct SagaOptions {
  std::string source;  // "scheduler/<instance>"
  int64_t provision_deadline_s = 900;
  int64_t release_deadline_s = 300;
  int64_t cleanup_deadline_s = 1800;
  int64_t sweep_interval_ms = 1000;
  std::shared_ptr<SchedulerMetrics> metrics;  // null: nothing observed (scheduler_metrics.hpp)
};

// In the create transaction, right after the allocation row and its claims were inserted as
// `reserved`: a slice gets its bundle and vm.provision (-> provisioning); baremetal goes active.
Result<v1::Allocation> StartLifecycle(pqxx::work& tx, const v1::Allocation& reserved,
                                      const v1::CreateAllocationRequest& req, const Sku& sku,
                                      const Image* image, const SagaOptions& opts,
                                      const std::string& traceparent);

// The release request (see the header comment); `force` is the operator's force-release.
Result<v1::Allocation> ReleaseAllocation(pqxx::work& tx, const std::string& allocation_id,
                                         bool force, const SagaOptions& opts,
                                         const std::string& traceparent,
                                         const std::string& tenant_scope = "");

// Consumer of gpuaas.v1.evt.node.*.task.>: results and progress of the tasks this scheduler
// sent (others are ignored). Redelivery is filtered by the inbox; a result for a task that is no
// longer open (timed out, superseded) only adds a late_result timeline row.
Result<void> ApplyNodeTaskEvent(pqxx::work& tx, const v1::Event& ev, const SagaOptions& opts);

inline constexpr const char* kExposureConsumer = "scheduler-ingress-exposures";

// Consumer of gpuaas.v1.evt.ingress.exposure.>: the allocation's endpoints (public address,
// port, state) in generation order; a provisioning slice whose VM is up becomes active when its
// last endpoint is, and fails (stage exposure, slot.cleanup sent) when one fails before that.
Result<void> ApplyExposureEvent(pqxx::work& tx, const v1::Event& ev, const SagaOptions& opts);

// Fails every open task whose deadline has passed (at most `max`), each in its own transaction;
// returns how many it handled. Safe with several replicas (the allocation row lock serializes).
Result<int> SweepOverdueTasks(store::Pool& pool, const SagaOptions& opts, int max = 64);

// Declares the saga's streams, starts the task and exposure consumers and the deadline sweeper
// thread (stopped when the service drains).
Result<void> StartSaga(runtime::Service& svc, const SagaOptions& opts);

// The handler of gpuaas.v1.scheduler.allocation.timeline (routed in scheduler_routes.cpp).
class SagaHandlers {
 public:
  explicit SagaHandlers(std::shared_ptr<store::Pool> pool) : pool_(std::move(pool)) {}
  // Timeline rows after `page_token` (a seq), oldest first, with the allocation's state and
  // whether a node task is in flight, all of one moment.
  Result<v1::GetAllocationTimelineResponse> Timeline(const v1::GetAllocationTimelineRequest& req,
                                                     rpc::Context& ctx);

 private:
  std::shared_ptr<store::Pool> pool_;
};

}  // namespace gpuaas::scheduler
