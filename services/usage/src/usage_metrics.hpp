#pragma once
// usage's domain metrics (docs/operations.md has the table):
//   gpuaas_usage_gpu_seconds_total{sku,kind} GPU-seconds of the records written (gpu_count x
//                                            duration, whatever the SKU bills by; a correction
//                                            counts its own piece)
//   gpuaas_usage_records_total{kind}         records written
//   gpuaas_usage_ledger_lag_seconds          how long the ledger has been behind the scheduler's
//                                            stream (0 while its consumer has no backlog)
//   gpuaas_usage_ledger_backlog              allocation events not yet applied
#include <chrono>
#include <functional>
#include <memory>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/process_metrics.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/usage.pb.h"

namespace gpuaas::usage {

class UsageMetrics {
 public:
  explicit UsageMetrics(prometheus::Registry& registry);
  // A record was written.
  void Recorded(const v1::UsageRecord& r);

 private:
  prometheus::Family<prometheus::Counter>* gpu_seconds_ = nullptr;
  prometheus::Family<prometheus::Counter>* records_ = nullptr;
};

// gpuaas_usage_ledger_backlog and gpuaas_usage_ledger_lag_seconds from `backlog` (the
// consumer's), every `interval`.
std::shared_ptr<metrics::Sampler> StartLedgerLag(const std::function<Result<uint64_t>()>& backlog,
                                                 prometheus::Registry& registry,
                                                 const log::Logger& logger,
                                                 std::chrono::milliseconds interval);

}  // namespace gpuaas::usage
