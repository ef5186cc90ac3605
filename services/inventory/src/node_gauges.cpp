#include "node_gauges.hpp"

#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "node_store.hpp"

namespace gpuaas::inventory {

std::shared_ptr<metrics::Sampler> StartNodeGauges(std::shared_ptr<store::Pool> pool,
                                                  prometheus::Registry& registry,
                                                  log::Logger logger,
                                                  std::chrono::milliseconds interval) {
  auto* nodes = &prometheus::BuildGauge()
                     .Name("gpuaas_nodes")
                     .Help("Nodes per mode (capacity profile) and admin state (sampled)")
                     .Register(registry);
  auto* overdue = &prometheus::BuildGauge()
                       .Name("gpuaas_node_drain_overdue")
                       .Help("Draining nodes past their drain deadline (sampled)")
                       .Register(registry)
                       .Add({});
  return std::make_shared<metrics::Sampler>(interval, [pool = std::move(pool), nodes, overdue,
                                                       log = std::move(logger)] {
    auto r = store::WithTx(
        *pool,
        [](pqxx::work& tx) -> Result<std::vector<NodeCount>> { return CountNodesByAdminState(tx); },
        store::ReadSnapshot());
    if (!r.ok()) {
      log.Debug("node gauges not sampled", {{"error", r.error().ToString()}});
      return;
    }
    for (const auto& mode : enums::Texts<v1::CapacityProfile>()) {
      for (const auto& state : enums::Texts<v1::NodeAdminState>()) {
        nodes->Add({{"mode", mode}, {"state", state}}).Set(0);
      }
    }
    int64_t late = 0;
    for (const auto& c : *r) {
      nodes->Add({{"mode", c.mode}, {"state", c.state}}).Set(static_cast<double>(c.nodes));
      late += c.overdue;
    }
    overdue->Set(static_cast<double>(late));
  });
}

}  // namespace gpuaas::inventory
