#pragma once
// Small helpers shared by the benchmarks: percentiles and one summary line per measure, the
// raw-consume baseline, a service's config from an environment map.
#include <nats/nats.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/config.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"

namespace gpuaas::bench {

inline double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

inline void Report(const char* name, const std::vector<double>& ms) {
  if (ms.empty()) {
    std::printf("%-22s n=0\n", name);
    return;
  }
  std::printf("%-22s n=%zu p50=%.3fms p90=%.3fms p99=%.3fms max=%.3fms\n", name, ms.size(),
              Percentile(ms, 0.5), Percentile(ms, 0.9), Percentile(ms, 0.99),
              *std::max_element(ms.begin(), ms.end()));
}

// Consume baselines: a durable pull consumer `durable` over `filter` of `stream` (every message
// from the first) read through messaging::Puller in batches of `batch` until `n` messages, as a
// service's consumer fetches; `ack`: explicit acks, each message acked and nothing else done
// (what the server's acked delivery alone costs), else no acks at all (a raw consume). Messages
// per second, 0 when the consumer could not be made. The consumer is deleted after.
inline double ConsumePerSecond(const std::shared_ptr<messaging::Connection>& conn,
                               const std::string& stream, const std::string& filter, int64_t n,
                               const std::string& durable, int batch, bool ack) {
  if (ack) {
    messaging::ConsumerSpec spec;
    spec.stream = stream;
    spec.durable = durable;
    spec.filter_subject = filter;
    if (!messaging::EnsureConsumer(*conn, spec).ok()) return 0;
  } else {
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.Durable = durable.c_str();
    cc.AckPolicy = js_AckNone;
    cc.DeliverPolicy = js_DeliverAll;
    cc.FilterSubject = filter.c_str();
    jsConsumerInfo* info = nullptr;
    jsErrCode jerr{};
    if (js_AddConsumer(&info, conn->js(), stream.c_str(), &cc, nullptr, &jerr) != NATS_OK) {
      std::fprintf(stderr, "consumer on %s failed (%d)\n", filter.c_str(), static_cast<int>(jerr));
      return 0;
    }
    jsConsumerInfo_Destroy(info);
  }
  auto puller = messaging::Puller::Open(conn, stream, durable);
  if (!puller.ok()) return 0;
  int64_t got = 0;
  const auto t = std::chrono::steady_clock::now();
  while (got < n) {
    auto f = (*puller)->Fetch(batch, 5000);
    if (f.outcome != messaging::Puller::Outcome::kMessages) break;
    got += static_cast<int64_t>(f.msgs.size());
    for (natsMsg* m : f.msgs) {
      if (ack) (void)messaging::SettleMsg(*conn, m, messaging::Settle::kAck);
      natsMsg_Destroy(m);
    }
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  puller->reset();
  (void)messaging::DeleteConsumer(*conn, stream, durable);
  return static_cast<double>(got) / s;
}

// The raw-consume baseline: no acks, batches of 1,000.
inline double RawPullPerSecond(const std::shared_ptr<messaging::Connection>& conn,
                               const std::string& stream, const std::string& filter, int64_t n) {
  return ConsumePerSecond(conn, stream, filter, n, "bench-raw", 1000, false);
}

// A service's config from an environment map, as its main() loads the process's.
template <typename Cfg>
Result<Cfg> LoadConfig(const std::map<std::string, std::string>& env) {
  Cfg cfg;
  config::Schema schema;
  cfg.Register(schema);
  if (auto r = schema.LoadFromString("", env); !r.ok()) return r.error();
  return cfg;
}

}  // namespace gpuaas::bench
