#pragma once
// ingress's domain metrics (docs/operations.md has the table):
//   gpuaas_exposures{state}                    exposures per state (sampled from the database)
//   gpuaas_exposure_apply_seconds              applying -> active: the document written until
//                                              the node's ack that has it
//   gpuaas_exposure_drift_total{kind}          drift nodes reported (rule_missing, rule_stale,
//                                              rule_foreign, table_missing; other)
//   gpuaas_endpoint_pool_endpoints{pool,usage} endpoints per pool: total | used (sampled)
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/process_metrics.hpp"
#include "gpuaas/common/result.hpp"

namespace gpuaas::ingress {

class IngressMetrics {
 public:
  explicit IngressMetrics(prometheus::Registry& registry);
  // An exposure became active `seconds` after it went applying.
  void Applied(double seconds);
  // A node reported drift of `kind` (reason::DriftKind of its text; nullopt: a kind the contract
  // does not name, counted as "other").
  void Drift(std::optional<Reason> kind);

 private:
  prometheus::Histogram* apply_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* drift_ = nullptr;
};

// gpuaas_exposures{state} and gpuaas_endpoint_pool_endpoints{pool,usage}, every `interval`.
std::shared_ptr<metrics::Sampler> StartExposureGauges(std::shared_ptr<store::Pool> pool,
                                                      prometheus::Registry& registry,
                                                      log::Logger logger,
                                                      std::chrono::milliseconds interval);

}  // namespace gpuaas::ingress
