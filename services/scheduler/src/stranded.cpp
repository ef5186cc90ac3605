#include "gpuaas/scheduler/stranded.hpp"

#include <algorithm>
#include <map>

namespace gpuaas::scheduler::placement {
namespace {

// The largest sum of `counts` (each usable any number of times) that is at most `n`.
int Packable(const std::set<int>& counts, int n) {
  if (n <= 0 || counts.empty()) return 0;
  std::vector<bool> reach(static_cast<size_t>(n) + 1, false);
  reach[0] = true;
  for (int x = 1; x <= n; ++x) {
    for (int c : counts) {
      if (c > 0 && c <= x && reach[static_cast<size_t>(x - c)]) {
        reach[static_cast<size_t>(x)] = true;
        break;
      }
    }
  }
  for (int x = n; x > 0; --x) {
    if (reach[static_cast<size_t>(x)]) return x;
  }
  return 0;
}

}  // namespace

int StrandedGpus(const std::vector<SlotView>& free, const std::vector<OrderableShape>& shapes) {
  const int total = static_cast<int>(free.size());
  std::map<std::string, int> by_fabric;
  for (const auto& s : free) by_fabric[s.fabric_type]++;
  std::set<int> any_fabric;
  std::map<std::string, std::set<int>> per_fabric;
  for (const auto& shape : shapes) {
    auto& into = shape.fabric_type.empty() ? any_fabric : per_fabric[shape.fabric_type];
    into.insert(shape.gpu_counts.begin(), shape.gpu_counts.end());
  }
  // Each fabric filled on its own: by its own shapes and by those of any fabric.
  int per_fabric_used = 0;
  for (const auto& [fabric, n] : by_fabric) {
    std::set<int> counts = any_fabric;
    if (auto own = per_fabric.find(fabric); own != per_fabric.end()) {
      counts.insert(own->second.begin(), own->second.end());
    }
    per_fabric_used += Packable(counts, n);
  }
  const int used = std::max(per_fabric_used, Packable(any_fabric, total));
  return total - used;
}

bool WholeNodeFree(const NodeView& node) {
  return node.total_slots > 0 && !node.baremetal_claimed && node.claimed_slots == 0 &&
         static_cast<int>(node.free.size()) == node.total_slots;
}

}  // namespace gpuaas::scheduler::placement
