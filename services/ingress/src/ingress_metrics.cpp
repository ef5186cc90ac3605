#include "ingress_metrics.hpp"

#include <map>
#include <set>
#include <utility>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/types.pb.h"
#include "ingress_reasons.hpp"
#include "ingress_store.hpp"

namespace gpuaas::ingress {

IngressMetrics::IngressMetrics(prometheus::Registry& registry)
    : apply_seconds_(
          &prometheus::BuildHistogram()
               .Name("gpuaas_exposure_apply_seconds")
               .Help("Time from an exposure entering applying (in the node's document) "
                     "to the node's ack of a document that has it")
               .Register(registry)
               .Add({}, prometheus::Histogram::BucketBoundaries{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5,
                                                                5, 10, 30, 60, 300})),
      drift_(&prometheus::BuildCounter()
                  .Name("gpuaas_exposure_drift_total")
                  .Help("Exposure drift nodes reported and fixed, by kind")
                  .Register(registry)) {
  for (Reason k :
       {reason::kRuleMissing, reason::kRuleStale, reason::kRuleForeign, reason::kTableMissing}) {
    drift_->Add({{"kind", k.str()}});
  }
}

void IngressMetrics::Applied(double seconds) { apply_seconds_->Observe(std::max(0.0, seconds)); }

void IngressMetrics::Drift(std::optional<Reason> kind) {
  // The label comes from a node: only the kinds the contract names, so a confused agent cannot
  // grow the series without bound.
  drift_->Add({{"kind", kind ? kind->str() : std::string("other")}}).Increment();
}

std::shared_ptr<metrics::Sampler> StartExposureGauges(std::shared_ptr<store::Pool> pool,
                                                      prometheus::Registry& registry,
                                                      log::Logger logger,
                                                      std::chrono::milliseconds interval) {
  auto* count = &prometheus::BuildGauge()
                     .Name("gpuaas_exposures")
                     .Help("Exposures per state (all replicas; sampled from the database)")
                     .Register(registry);
  auto* endpoints = &prometheus::BuildGauge()
                         .Name("gpuaas_endpoint_pool_endpoints")
                         .Help(
                             "Endpoints of each pool: usage=total (ports or addresses it hands "
                             "out) or used (held by exposures); sampled")
                         .Register(registry);
  struct Sample {
    std::map<std::string, double> states;
    std::map<std::string, std::pair<double, double>> pools;
  };
  // Pools sampled last time: a deleted pool's series go instead of freezing at their last value.
  auto known = std::make_shared<std::set<std::string>>();
  return std::make_shared<metrics::Sampler>(
      interval, [pool = std::move(pool), count, endpoints, known, log = std::move(logger)] {
        auto r = store::WithTx(
            *pool,
            [](pqxx::work& tx) -> Result<Sample> {
              Sample s;
              for (const auto& st : enums::Texts<v1::ExposureState>()) s.states[st] = 0;
              for (const auto& c : CountExposuresByState(tx)) s.states[c.state] = c.count;
              for (const auto& p : CountPoolEndpoints(tx)) s.pools[p.pool] = {p.total, p.used};
              return s;
            },
            store::ReadSnapshot());
        if (!r.ok()) {
          log.Debug("exposure gauges not sampled", {{"error", r.error().ToString()}});
          return;
        }
        for (const auto& [state, n] : r->states) count->Add({{"state", state}}).Set(n);
        for (const auto& name : *known) {
          if (r->pools.count(name)) continue;
          for (const char* usage : {"total", "used"}) {
            endpoints->Remove(&endpoints->Add({{"pool", name}, {"usage", usage}}));
          }
        }
        known->clear();
        for (const auto& [name, v] : r->pools) {
          endpoints->Add({{"pool", name}, {"usage", "total"}}).Set(v.first);
          endpoints->Add({{"pool", name}, {"usage", "used"}}).Set(v.second);
          known->insert(name);
        }
      });
}

}  // namespace gpuaas::ingress
