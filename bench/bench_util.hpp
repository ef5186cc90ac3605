#pragma once
// Small helpers shared by the benchmarks: percentiles and one summary line per measure.
#include <nats/nats.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

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

// The raw-consume baseline: an ephemeral pull consumer over `filter` (every message from the
// first, no acks, batches of 1,000) reads `n` messages; messages per second, 0 when it could not
// subscribe.
inline double RawPullPerSecond(jsCtx* js, const char* filter, int64_t n) {
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Config.AckPolicy = js_AckNone;
  so.Config.DeliverPolicy = js_DeliverAll;
  natsSubscription* sub = nullptr;
  jsErrCode jerr{};
  if (js_PullSubscribe(&sub, js, filter, nullptr, nullptr, &so, &jerr) != NATS_OK) {
    std::fprintf(stderr, "pull subscribe to %s failed (%d)\n", filter, static_cast<int>(jerr));
    return 0;
  }
  int64_t got = 0;
  const auto t = std::chrono::steady_clock::now();
  while (got < n) {
    natsMsgList list{};
    if (natsSubscription_Fetch(&list, sub, 1000, 5000, &jerr) != NATS_OK) break;
    got += list.Count;
    natsMsgList_Destroy(&list);
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  natsSubscription_Unsubscribe(sub);
  natsSubscription_Destroy(sub);
  return static_cast<double>(got) / s;
}

}  // namespace gpuaas::bench
