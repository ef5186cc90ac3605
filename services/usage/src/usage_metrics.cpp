#include "usage_metrics.hpp"

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "gpuaas/common/enums.hpp"

namespace gpuaas::usage {

UsageMetrics::UsageMetrics(prometheus::Registry& registry)
    : gpu_seconds_(&prometheus::BuildCounter()
                        .Name("gpuaas_usage_gpu_seconds_total")
                        .Help("GPU-seconds of the usage records written, by SKU and kind "
                              "(billable, stranded, correction)")
                        .Register(registry)),
      records_(&prometheus::BuildCounter()
                    .Name("gpuaas_usage_records_total")
                    .Help("Usage records written, by kind")
                    .Register(registry)) {
  for (auto k : {v1::USAGE_KIND_BILLABLE, v1::USAGE_KIND_STRANDED, v1::USAGE_KIND_CORRECTION}) {
    records_->Add({{"kind", enums::Text(k)}});
  }
}

void UsageMetrics::Recorded(const v1::UsageRecord& r) {
  const std::string kind = enums::Text(r.kind());
  records_->Add({{"kind", kind}}).Increment();
  gpu_seconds_->Add({{"sku", r.sku()}, {"kind", kind}})
      .Increment(static_cast<double>(r.gpu_count()) * static_cast<double>(r.duration_us()) / 1e6);
}

std::shared_ptr<metrics::Sampler> StartLedgerLag(const std::function<Result<uint64_t>()>& backlog,
                                                 prometheus::Registry& registry,
                                                 const log::Logger& logger,
                                                 std::chrono::milliseconds interval) {
  auto* pending = &prometheus::BuildGauge()
                       .Name("gpuaas_usage_ledger_backlog")
                       .Help("Allocation events the usage ledger has not applied yet")
                       .Register(registry)
                       .Add({});
  auto* lag = &prometheus::BuildGauge()
                   .Name("gpuaas_usage_ledger_lag_seconds")
                   .Help(
                       "How long the usage ledger has been behind the scheduler's stream "
                       "(0 while its consumer has no backlog)")
                   .Register(registry)
                   .Add({});
  auto caught_up =
      std::make_shared<std::chrono::steady_clock::time_point>(std::chrono::steady_clock::now());
  return std::make_shared<metrics::Sampler>(interval, [=]() {
    auto n = backlog();
    if (!n.ok()) {
      logger.Debug("usage ledger backlog not read", {{"error", n.error().ToString()}});
      return;
    }
    const auto now = std::chrono::steady_clock::now();
    if (*n == 0) *caught_up = now;
    pending->Set(static_cast<double>(*n));
    lag->Set(std::chrono::duration<double>(now - *caught_up).count());
  });
}

}  // namespace gpuaas::usage
