#pragma once
// Inventory's sampled gauges of host operations: gpuaas_nodes{mode,state} (nodes per capacity
// profile and admin state, every pair present, 0 when none) and gpuaas_node_drain_overdue
// (draining nodes past their deadline), read from the database every `interval`, so a scrape
// never waits on it. Every replica reports the same numbers.
#include <chrono>
#include <memory>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/process_metrics.hpp"

namespace prometheus {
class Registry;
}
namespace gpuaas::store {
class Pool;
}

namespace gpuaas::inventory {

std::shared_ptr<metrics::Sampler> StartNodeGauges(
    std::shared_ptr<store::Pool> pool, prometheus::Registry& registry, log::Logger logger,
    std::chrono::milliseconds interval = std::chrono::seconds(15));

}  // namespace gpuaas::inventory
