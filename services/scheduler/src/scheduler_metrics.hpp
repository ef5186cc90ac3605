#pragma once
// The scheduler's domain metrics (docs/operations.md has the table):
//   gpuaas_placements_total{result}          create requests by outcome: placed | duplicate |
//                                            no_placement | rejected | error
//   gpuaas_no_placement_total{reason}        why nothing could be placed (NoPlacementReason)
//   gpuaas_allocation_create_seconds         request -> active: observed when an allocation
//                                            becomes active, from its created_at
//   gpuaas_allocations{state}                allocations per state (sampled from the database)
//   gpuaas_allocation_oldest_seconds{state}  time the oldest allocation has spent in its state
//                                            (sampled; 0 when none): what "stuck" alerts use
//   gpuaas_placement_choices_total{source,outcome}
//                                            proposals the create path tried: source = index |
//                                            sql, outcome = placed | stale (the re-check found
//                                            them claimed or unschedulable) | held (locked by
//                                            another placement)
#include <chrono>
#include <memory>
#include <string>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/process_metrics.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace prometheus {
class Registry;
class Counter;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace gpuaas::store {
class Pool;
}

namespace gpuaas::scheduler {

// The reason label of a no_placement (or region_disabled) error, from its details:
// region_disabled, no_free_node (baremetal), no_free_gpus (none of the SKU free),
// fabric_mismatch (free ones of another fabric), fragmented (enough free in the region, not
// together on one node), contended (a node had enough, others took them first),
// not_enough_free_gpus (fewer free than asked). "" when `e` is not a placement failure.
std::string NoPlacementReason(const Error& e);

class SchedulerMetrics {
 public:
  explicit SchedulerMetrics(prometheus::Registry& registry);
  // One create request's answer.
  void CreateAnswered(const Result<v1::CreateAllocationResponse>& r);
  // `a` just became active (in the committing transaction).
  void Activated(const v1::Allocation& a);
  // Proposals of one create request: how many were tried with each outcome.
  void Choices(bool from_index, int placed, int stale, int held);

 private:
  prometheus::Family<prometheus::Counter>* placements_ = nullptr;
  prometheus::Family<prometheus::Counter>* no_placement_ = nullptr;
  prometheus::Histogram* create_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* choices_ = nullptr;
};

// gpuaas_allocations{state} and gpuaas_allocation_oldest_seconds{state}, every `interval`
// (every state is present, 0 when it has none).
std::shared_ptr<metrics::Sampler> StartAllocationGauges(
    std::shared_ptr<store::Pool> pool, prometheus::Registry& registry, log::Logger logger,
    std::chrono::milliseconds interval = std::chrono::seconds(5));

}  // namespace gpuaas::scheduler
