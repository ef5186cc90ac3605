#include "scheduler_metrics.hpp"

#include <google/protobuf/util/time_util.h>

#include <map>
#include <set>
#include <tuple>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "allocation_store.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"

namespace gpuaas::scheduler {

std::string_view NoPlacementLabel(NoPlacementKind k) {
  switch (k) {
    case NoPlacementKind::kNone:
      return "";
    case NoPlacementKind::kRegionDisabled:
      return "region_disabled";
    case NoPlacementKind::kNoFreeNode:
      return "no_free_node";
    case NoPlacementKind::kNoFreeGpus:
      return "no_free_gpus";
    case NoPlacementKind::kFabricMismatch:
      return "fabric_mismatch";
    case NoPlacementKind::kFragmented:
      return "fragmented";
    case NoPlacementKind::kContended:
      return "contended";
    case NoPlacementKind::kNotEnoughFreeGpus:
      return "not_enough_free_gpus";
  }
  return "";
}

SchedulerMetrics::SchedulerMetrics(prometheus::Registry& registry)
    : placements_(&prometheus::BuildCounter()
                       .Name("gpuaas_placements_total")
                       .Help("Allocation create requests by outcome: placed, duplicate (a retried "
                             "request_id), no_placement, rejected (invalid or not allowed), error")
                       .Register(registry)),
      no_placement_(&prometheus::BuildCounter()
                         .Name("gpuaas_no_placement_total")
                         .Help("Create requests that found no capacity, by reason")
                         .Register(registry)),
      create_seconds_(
          &prometheus::BuildHistogram()
               .Name("gpuaas_allocation_create_seconds")
               .Help("Time from an allocation's create request to active")
               .Register(registry)
               .Add({}, prometheus::Histogram::BucketBoundaries{0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                                                                30, 60, 120, 300, 600, 900, 1800})),
      choices_(&prometheus::BuildCounter()
                    .Name("gpuaas_placement_choices_total")
                    .Help("Placement proposals tried by create requests, by source (index: the "
                          "replica's placement index, sql: read from the database) and outcome "
                          "(placed, stale: found claimed or unschedulable by the re-check, held: "
                          "locked by another placement)")
                    .Register(registry)) {
  // Present from the start, so rate() and alerts see a 0 before the first increment.
  for (const char* r : {"placed", "duplicate", "no_placement", "rejected", "error"}) {
    placements_->Add({{"result", r}});
  }
  for (const char* src : {"index", "sql"}) {
    for (const char* o : {"placed", "stale", "held"}) {
      choices_->Add({{"source", src}, {"outcome", o}});
    }
  }
}

void SchedulerMetrics::Choices(bool from_index, int placed, int stale, int held) {
  const char* src = from_index ? "index" : "sql";
  if (placed > 0) choices_->Add({{"source", src}, {"outcome", "placed"}}).Increment(placed);
  if (stale > 0) choices_->Add({{"source", src}, {"outcome", "stale"}}).Increment(stale);
  if (held > 0) choices_->Add({{"source", src}, {"outcome", "held"}}).Increment(held);
}

void SchedulerMetrics::CreateAnswered(const Result<v1::CreateAllocationResponse>& r,
                                      NoPlacementKind refusal) {
  if (r.ok()) {
    placements_->Add({{"result", r->created() ? "placed" : "duplicate"}}).Increment();
    return;
  }
  if (refusal != NoPlacementKind::kNone) {
    placements_->Add({{"result", "no_placement"}}).Increment();
    no_placement_->Add({{"reason", std::string(NoPlacementLabel(refusal))}}).Increment();
    return;
  }
  const Error& e = r.error();
  switch (e.code) {
    case Code::kInvalidArgument:
    case Code::kNotFound:
    case Code::kPermissionDenied:
    case Code::kUnauthenticated:
    case Code::kFailedPrecondition:
      placements_->Add({{"result", "rejected"}}).Increment();
      return;
    default:
      placements_->Add({{"result", "error"}}).Increment();
  }
}

void SchedulerMetrics::Activated(const v1::Allocation& a) {
  using google::protobuf::util::TimeUtil;
  if (!a.has_created_at()) return;
  const auto took = TimeUtil::GetCurrentTime() - a.created_at();
  create_seconds_->Observe(
      std::max(0.0, static_cast<double>(TimeUtil::DurationToMilliseconds(took)) / 1000.0));
}

std::shared_ptr<metrics::Sampler> StartAllocationGauges(std::shared_ptr<store::Pool> pool,
                                                        prometheus::Registry& registry,
                                                        log::Logger logger,
                                                        std::chrono::milliseconds interval) {
  auto* count = &prometheus::BuildGauge()
                     .Name("gpuaas_allocations")
                     .Help("Allocations per state (all replicas; sampled from the database)")
                     .Register(registry);
  auto* oldest = &prometheus::BuildGauge()
                      .Name("gpuaas_allocation_oldest_seconds")
                      .Help(
                          "Time the oldest allocation in each state has been in it (0: none; "
                          "sampled)")
                      .Register(registry);
  return std::make_shared<metrics::Sampler>(
      interval, [pool = std::move(pool), count, oldest, log = std::move(logger)] {
        // The counts of backends that are gone fold into shard 0 before the sums are read.
        auto folded = store::WithTx(*pool, [](pqxx::work& tx) -> Result<void> {
          FoldCountsOfGoneBackends(tx);
          return Ok();
        });
        if (!folded.ok()) {
          log.Debug("allocation counts not folded", {{"error", folded.error().ToString()}});
        }
        auto r = store::WithTx(
            *pool,
            [](pqxx::work& tx) -> Result<std::map<std::string, StateGauge>> {
              return ReadStateGauges(tx, enums::Texts<v1::AllocationState>());
            },
            store::ReadSnapshot());
        if (!r.ok()) {
          log.Debug("allocation gauges not sampled", {{"error", r.error().ToString()}});
          return;
        }
        for (const auto& [state, v] : *r) {
          count->Add({{"state", state}}).Set(v.count);
          oldest->Add({{"state", state}}).Set(v.oldest_seconds);
        }
      });
}

std::shared_ptr<metrics::Sampler> StartCapacityGauges(std::shared_ptr<PlacementCache> cache,
                                                      prometheus::Registry& registry,
                                                      std::chrono::milliseconds interval) {
  auto gauge = [&](const char* name, const char* help) {
    return &prometheus::BuildGauge().Name(name).Help(help).Register(registry);
  };
  auto* free = gauge("gpuaas_free_gpus",
                     "Free GPUs the placement index can propose: schedulable slots with every "
                     "binding and no claim (sampled from this replica's index)");
  auto* stranded = gauge("gpuaas_stranded_gpus",
                         "Free GPUs no slice the catalog offers can use (their node's free slots "
                         "fit no mix of orderable GPU counts and fabrics; sampled)");
  auto* whole = gauge("gpuaas_free_whole_nodes",
                      "Nodes whose every slot of the SKU is free: could take the largest slice "
                      "or move to bare metal (sampled)");
  using Key = std::tuple<std::string, std::string, std::string>;
  return std::make_shared<metrics::Sampler>(interval, [cache = std::move(cache), free, stranded,
                                                       whole, seen = std::set<Key>()]() mutable {
    std::set<Key> now;
    for (const auto& c : cache->Capacities()) {
      const std::map<std::string, std::string> labels = {
          {"region", c.region}, {"pool", c.pool}, {"sku", c.sku}};
      free->Add(labels).Set(static_cast<double>(c.free));
      stranded->Add(labels).Set(static_cast<double>(c.stranded));
      whole->Add(labels).Set(static_cast<double>(c.whole_free_nodes));
      now.insert({c.region, c.pool, c.sku});
    }
    for (const auto& [region, pool, sku] : seen) {
      if (now.count({region, pool, sku}) > 0) continue;
      const std::map<std::string, std::string> labels = {
          {"region", region}, {"pool", pool}, {"sku", sku}};
      for (auto* family : {free, stranded, whole}) family->Remove(&family->Add(labels));
    }
    seen = std::move(now);
  });
}

}  // namespace gpuaas::scheduler
