#pragma once
// The scheduler's domain metrics (docs/operations.md has the table):
//   gpuaas_placements_total{result}          create requests by outcome: placed | duplicate |
//                                            no_placement | rejected | error
//   gpuaas_no_placement_total{reason}        why nothing could be placed (NoPlacementKind)
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
//   gpuaas_free_gpus{region,pool,sku}        free GPUs the placement index can propose
//   gpuaas_stranded_gpus{region,pool,sku}    ... of them, those no orderable slice can use
//   gpuaas_free_whole_nodes{region,pool,sku} nodes whose every slot of the SKU is free
//                                            (the three from the index, when it is on)
#include <chrono>
#include <memory>
#include <string>
#include <string_view>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/process_metrics.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::scheduler {

// Why a create found no capacity: what the create path decided when it refused (no_placement,
// placement_contended or region_disabled), read by gpuaas_no_placement_total{reason}.
enum class NoPlacementKind {
  kNone,               // the create was not refused for capacity
  kRegionDisabled,     // region_disabled
  kNoFreeNode,         // baremetal: no node free of claims
  kNoFreeGpus,         // none of the SKU free
  kFabricMismatch,     // free ones only of another fabric
  kFragmented,         // enough free in the region, not together on one node
  kContended,          // a node had enough but others took them first, or placement_contended
  kNotEnoughFreeGpus,  // fewer free than asked
};
// The reason label of `k` ("" for kNone).
std::string_view NoPlacementLabel(NoPlacementKind k);

class SchedulerMetrics {
 public:
  explicit SchedulerMetrics(prometheus::Registry& registry);
  // One create request's answer; `refusal`: why it found no capacity, as the create path said.
  void CreateAnswered(const Result<v1::CreateAllocationResponse>& r, NoPlacementKind refusal);
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

class PlacementCache;
// gpuaas_free_gpus, gpuaas_stranded_gpus and gpuaas_free_whole_nodes{region,pool,sku} from the
// placement index, every `interval` (a (region, pool, SKU) the index no longer has is removed).
std::shared_ptr<metrics::Sampler> StartCapacityGauges(
    std::shared_ptr<PlacementCache> cache, prometheus::Registry& registry,
    std::chrono::milliseconds interval = std::chrono::seconds(5));

}  // namespace gpuaas::scheduler
