#pragma once
// Small helpers shared by the benchmarks: percentiles and one summary line per measure.
#include <algorithm>
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

}  // namespace gpuaas::bench
