#include "gpuaas/scheduler/placement.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <utility>

namespace gpuaas::scheduler::placement {
namespace {

// Locality of a slot group, best first. A slot with an unknown NUMA node (-1) may sit anywhere,
// so a group made only of such slots ranks below a group inside one known NUMA node, but above a
// group that is known to span NUMA nodes.
enum Tier : int { kSameSwitch = 0, kSameNuma = 1, kUnknownNuma = 2, kAnywhere = 3 };

// Free-slot counts below this are reduced modulo a request size by table lookup: the ranking
// loop does a few dozen such reductions per node and a hardware division costs more than the
// rest of the loop.
constexpr int kModTable = 64;

struct MixEntry {
  int gpus;
  double p;
  std::array<uint8_t, kModTable> mod;  // mod[c] == c % gpus

  int Mod(int c) const { return c < kModTable ? mod[static_cast<size_t>(c)] : c % gpus; }
};
using MixVec = std::vector<MixEntry>;

// Sizes <= 0 and probabilities that are not positive and finite cannot be requested: they are
// dropped once here so that the hot loops see a short flat array instead of a std::map.
MixVec Flatten(const Mix& mix) {
  MixVec out;
  out.reserve(mix.size());
  for (const auto& [gpus, p] : mix) {
    if (gpus <= 0 || !(p > 0) || !std::isfinite(p)) {
      continue;
    }
    MixEntry e{gpus, p, {}};
    for (int c = 0; c < kModTable; ++c) {
      e.mod[static_cast<size_t>(c)] = static_cast<uint8_t>(c % gpus);
    }
    out.push_back(e);
  }
  return out;
}

// A (NUMA node, PCIe switch) group of a node's free slots: the unit the fragmentation measure
// counts against, and the unit a same-switch slot group must come from.
struct Domain {
  int numa;
  std::string_view pcie_switch;
  int group;     // index of its NUMA group
  int free;      // free slots, any fabric
  int eligible;  // free slots of the requested fabric
};

struct NumaGroup {
  int numa;
  int free;
  int eligible;
};

// Free slots of one node reduced to counts per domain and per NUMA node. Nodes have a handful of
// domains, so lookups are linear scans over small arrays that are reused from node to node.
struct NodeModel {
  std::vector<Domain> domains;
  std::vector<NumaGroup> groups;
  std::vector<int> slot_domain;  // per slot of `free`: its domain, or -1 if of another fabric
  int free = 0;
  int eligible = 0;

  void Build(const std::vector<SlotView>& slots, std::string_view fabric) {
    domains.clear();
    groups.clear();
    slot_domain.clear();
    free = static_cast<int>(slots.size());
    eligible = 0;
    for (const SlotView& slot : slots) {
      const int numa = slot.numa < 0 ? -1 : slot.numa;
      size_t d = 0;
      while (d < domains.size() &&
             (domains[d].numa != numa || domains[d].pcie_switch != slot.pcie_switch)) {
        ++d;
      }
      if (d == domains.size()) {
        size_t g = 0;
        while (g < groups.size() && groups[g].numa != numa) {
          ++g;
        }
        if (g == groups.size()) {
          groups.push_back({numa, 0, 0});
        }
        domains.push_back({numa, slot.pcie_switch, static_cast<int>(g), 0, 0});
      }
      Domain& domain = domains[d];
      NumaGroup& group = groups[static_cast<size_t>(domain.group)];
      ++domain.free;
      ++group.free;
      const bool ok = fabric.empty() || slot.fabric_type == fabric;
      if (ok) {
        ++domain.eligible;
        ++group.eligible;
        ++eligible;
      }
      slot_domain.push_back(ok ? static_cast<int>(d) : -1);
    }
  }
};

// 4 x the stranded GPUs for requests of n GPUs (see Fragmentation); integers keep it exact.
int64_t Stranded4(int64_t numa_mod, int64_t switch_mod) { return 3 * numa_mod + switch_mod; }

double FragmentationOf(const NodeModel& m, const MixVec& mix) {
  double total = 0;
  for (const MixEntry& e : mix) {
    int64_t numa_mod = 0;
    int64_t switch_mod = 0;
    for (const NumaGroup& g : m.groups) {
      numa_mod += e.Mod(g.free);
    }
    for (const Domain& d : m.domains) {
      switch_mod += e.Mod(d.free);
    }
    total += e.p * static_cast<double>(Stranded4(numa_mod, switch_mod)) / 4.0;
  }
  return total;
}

// ΔF is compared after rounding to this grid, so that sums which are equal on paper but differ
// in the last bit (different summation terms) rank as ties and fall through to the next key.
constexpr double kDeltaResolution = 1e-6;
constexpr int64_t kDeltaLimit = 100'000'000'000;  // |ΔF| <= 1e5 GPUs, far beyond any node

int64_t Quantize(double delta) {
  const double scaled = std::round(delta / kDeltaResolution);
  if (!(scaled > -static_cast<double>(kDeltaLimit))) {
    return -kDeltaLimit;
  }
  if (scaled > static_cast<double>(kDeltaLimit)) {
    return kDeltaLimit;
  }
  return static_cast<int64_t>(scaled);
}

// Above this many take vectors in one scope the search falls back to a greedy fill. Nodes of up
// to 8 slots in 4 domains have at most 3^4 = 81.
constexpr int64_t kMaxTakeVectors = 1024;

// Chooses how many slots to take from each domain of one node. With `with_keys`, ties between
// take vectors of equal tier and ΔF are broken by the picked slot keys (smallest sorted list
// first) and the slots are materialised; without it (ranking many nodes), the first best take
// vector is kept, which changes neither the tier nor ΔF, so the ranking is the same.
class Picker {
 public:
  explicit Picker(MixVec mix) : mix_(std::move(mix)) {}

  // False when the node cannot hold `gpus` slots of the fabric (`numa_local`: on one known NUMA
  // node).
  bool Pick(const std::vector<SlotView>& slots, std::string_view fabric, int gpus, bool with_keys,
            bool numa_local = false) {
    found_ = false;
    if (gpus <= 0 || static_cast<int>(slots.size()) < gpus) {
      return false;
    }
    model_.Build(slots, fabric);
    if (model_.eligible < gpus) {
      return false;
    }
    slots_ = &slots;
    with_keys_ = with_keys;
    gpus_ = gpus;
    take_.assign(model_.domains.size(), 0);
    group_take_.assign(model_.groups.size(), 0);
    if (with_keys_) {
      SortDomainSlots();
    }

    // Tier 0: one known switch of a known NUMA node.
    for (size_t d = 0; d < model_.domains.size(); ++d) {
      const Domain& domain = model_.domains[d];
      if (domain.numa < 0 || domain.pcie_switch.empty() || domain.eligible < gpus) {
        continue;
      }
      scope_.assign(1, static_cast<int>(d));
      Search(kSameSwitch);
    }
    if (found_) {
      return true;
    }
    // Tier 1: one known NUMA node; tier 2: the group of slots whose NUMA node is unknown.
    for (const Tier tier : {kSameNuma, kUnknownNuma}) {
      if (numa_local && tier == kUnknownNuma) {
        return false;  // unknown NUMA, or across NUMA nodes, is not local
      }
      for (size_t g = 0; g < model_.groups.size(); ++g) {
        const NumaGroup& group = model_.groups[g];
        if ((group.numa < 0) != (tier == kUnknownNuma) || group.eligible < gpus) {
          continue;
        }
        scope_.clear();
        for (size_t d = 0; d < model_.domains.size(); ++d) {
          if (model_.domains[d].group == static_cast<int>(g) && model_.domains[d].eligible > 0) {
            scope_.push_back(static_cast<int>(d));
          }
        }
        Search(tier);
      }
      if (found_) {
        return true;
      }
    }
    // Tier 3: anywhere on the node.
    scope_.clear();
    for (size_t d = 0; d < model_.domains.size(); ++d) {
      if (model_.domains[d].eligible > 0) {
        scope_.push_back(static_cast<int>(d));
      }
    }
    Search(kAnywhere);
    return found_;
  }

  int tier() const { return best_tier_; }
  int64_t quantized_delta() const { return best_q_; }
  int free_after() const { return model_.free - gpus_; }

  // Slot keys of the best take vector (requires with_keys), sorted.
  std::vector<std::string> Keys() const {
    std::vector<std::string> out;
    out.reserve(best_keys_.size());
    for (const std::string* key : best_keys_) {
      out.push_back(*key);
    }
    return out;
  }

 private:
  // Enumerates the take vectors over scope_ (or fills greedily when there are too many).
  void Search(Tier tier) {
    int64_t vectors = 1;
    for (const int d : scope_) {
      vectors *= std::min(model_.domains[static_cast<size_t>(d)].eligible, gpus_) + 1;
      if (vectors > kMaxTakeVectors) {
        break;
      }
    }
    if (vectors > kMaxTakeVectors) {
      Greedy(tier);
    } else {
      Enumerate(tier, 0, gpus_);
    }
  }

  void Enumerate(Tier tier, size_t pos, int left) {
    if (left == 0) {
      Consider(tier);
      return;
    }
    if (pos == scope_.size()) {
      return;
    }
    const size_t d = static_cast<size_t>(scope_[pos]);
    const int most = std::min(model_.domains[d].eligible, left);
    for (int t = most; t >= 0; --t) {
      take_[d] = t;
      Enumerate(tier, pos + 1, left - t);
    }
    take_[d] = 0;
  }

  // Takes from the domains with the fewest free slots first: using up small remainders keeps the
  // larger domains, which can still serve bigger requests locally, intact. Ties by (NUMA, switch)
  // so that the result does not depend on the order of the node's slots.
  void Greedy(Tier tier) {
    std::sort(scope_.begin(), scope_.end(), [this](int a, int b) {
      const Domain& x = model_.domains[static_cast<size_t>(a)];
      const Domain& y = model_.domains[static_cast<size_t>(b)];
      if (x.free != y.free) {
        return x.free < y.free;
      }
      if (x.numa != y.numa) {
        return x.numa < y.numa;
      }
      return x.pcie_switch < y.pcie_switch;
    });
    int left = gpus_;
    for (const int d : scope_) {
      const int t = std::min(model_.domains[static_cast<size_t>(d)].eligible, left);
      take_[static_cast<size_t>(d)] = t;
      left -= t;
    }
    if (left == 0) {
      Consider(tier);
    }
    for (const int d : scope_) {
      take_[static_cast<size_t>(d)] = 0;
    }
  }

  double DeltaOfTake() {
    std::fill(group_take_.begin(), group_take_.end(), 0);
    for (const int d : scope_) {
      const size_t i = static_cast<size_t>(d);
      group_take_[static_cast<size_t>(model_.domains[i].group)] += take_[i];
    }
    double delta = 0;
    for (const MixEntry& e : mix_) {
      int64_t numa = 0;
      for (size_t g = 0; g < model_.groups.size(); ++g) {
        if (group_take_[g] == 0) {
          continue;
        }
        const int c = model_.groups[g].free;
        numa += e.Mod(c - group_take_[g]) - e.Mod(c);
      }
      int64_t sw = 0;
      for (const int d : scope_) {
        const size_t i = static_cast<size_t>(d);
        if (take_[i] == 0) {
          continue;
        }
        const int c = model_.domains[i].free;
        sw += e.Mod(c - take_[i]) - e.Mod(c);
      }
      delta += e.p * static_cast<double>(Stranded4(numa, sw)) / 4.0;
    }
    return delta;
  }

  void Consider(Tier tier) {
    const int64_t q = Quantize(DeltaOfTake());
    if (found_) {
      if (tier > best_tier_ || (tier == best_tier_ && q > best_q_)) {
        return;
      }
      if (tier == best_tier_ && q == best_q_) {
        if (!with_keys_) {
          return;
        }
        CollectKeys(cand_keys_);
        if (!std::lexicographical_compare(
                cand_keys_.begin(), cand_keys_.end(), best_keys_.begin(), best_keys_.end(),
                [](const std::string* a, const std::string* b) { return *a < *b; })) {
          return;
        }
        Accept(tier, q);
        best_keys_.swap(cand_keys_);
        return;
      }
    }
    Accept(tier, q);
    if (with_keys_) {
      CollectKeys(best_keys_);
    }
  }

  void Accept(Tier tier, int64_t q) {
    found_ = true;
    best_tier_ = tier;
    best_q_ = q;
  }

  // The smallest keys a take vector allows: the first t slots by key of each domain.
  void CollectKeys(std::vector<const std::string*>& out) const {
    out.clear();
    for (size_t d = 0; d < take_.size(); ++d) {
      for (int i = 0; i < take_[d]; ++i) {
        out.push_back(
            &(*slots_)[static_cast<size_t>(domain_slots_[d][static_cast<size_t>(i)])].slot_key);
      }
    }
    std::sort(out.begin(), out.end(),
              [](const std::string* a, const std::string* b) { return *a < *b; });
  }

  void SortDomainSlots() {
    domain_slots_.resize(model_.domains.size());
    for (auto& list : domain_slots_) {
      list.clear();
    }
    for (size_t i = 0; i < model_.slot_domain.size(); ++i) {
      const int d = model_.slot_domain[i];
      if (d >= 0) {
        domain_slots_[static_cast<size_t>(d)].push_back(static_cast<int>(i));
      }
    }
    for (auto& list : domain_slots_) {
      std::sort(list.begin(), list.end(), [this](int a, int b) {
        return (*slots_)[static_cast<size_t>(a)].slot_key <
               (*slots_)[static_cast<size_t>(b)].slot_key;
      });
    }
  }

  MixVec mix_;
  NodeModel model_;
  const std::vector<SlotView>* slots_ = nullptr;
  bool with_keys_ = false;
  int gpus_ = 0;
  std::vector<int> scope_;
  std::vector<int> take_;
  std::vector<int> group_take_;
  std::vector<std::vector<int>> domain_slots_;
  std::vector<const std::string*> cand_keys_;

  bool found_ = false;
  int best_tier_ = kAnywhere;
  int64_t best_q_ = 0;
  std::vector<const std::string*> best_keys_;
};

bool BaremetalEligible(const NodeView& node) {
  return node.total_slots > 0 && node.claimed_slots == 0 && !node.baremetal_claimed &&
         static_cast<int>(node.free.size()) == node.total_slots;
}

// Slice ranking key, packed lexicographically into 53 bits so that Choice.score (the key as a
// double) is exact and strictly follows the order up to the node-id tie-break:
//   bits 15..52 ΔF in steps of kDeltaResolution, offset by kDeltaLimit (38 bits)
//   bit 14      1 if the node could still be sold as baremetal (keep those for baremetal)
//   bits 2..13  free slots left after the placement, capped at 4095 (12 bits)
//   bits 0..1   locality tier of the picked group
// ΔF comes before the bare-metal bit: ahead of it, the bit kept every whole node empty, small ones
// included, while slices broke whole NUMA nodes of bigger nodes that NUMA-local and whole-node
// requests need (the heterogeneous P4 trace, docs/benchmarks.md).
constexpr int kTierBits = 2;
constexpr int kFreeBits = 12;
constexpr int kDeltaBits = 38;
static_assert(2 * kDeltaLimit < (int64_t{1} << kDeltaBits));
static_assert(1 + kDeltaBits + kFreeBits + kTierBits == 53);

uint64_t SliceKey(bool clean, int64_t q, int free_after, int tier) {
  const auto delta = static_cast<uint64_t>(q + kDeltaLimit);
  const auto left = static_cast<uint64_t>(std::clamp(free_after, 0, (1 << kFreeBits) - 1));
  uint64_t key = delta;
  key = (key << 1) | (clean ? 1 : 0);
  key = (key << kFreeBits) | left;
  key = (key << kTierBits) | static_cast<uint64_t>(tier);
  return key;
}

}  // namespace

Mix DefaultMix() { return {{1, 0.4}, {2, 0.3}, {4, 0.2}, {8, 0.1}}; }

double Fragmentation(const std::vector<SlotView>& free, const Mix& mix) {
  NodeModel model;
  model.Build(free, "");
  return FragmentationOf(model, Flatten(mix));
}

std::vector<std::string> PickSlots(const NodeView& node, const Request& req) {
  return PickSlots(node, req, DefaultMix());
}

std::vector<std::string> PickSlots(const NodeView& node, const Request& req, const Mix& mix) {
  if (node.baremetal_claimed) {
    return {};
  }
  Picker picker(Flatten(mix));
  if (!picker.Pick(node.free, req.fabric_type, req.gpus, /*with_keys=*/true, req.numa_local)) {
    return {};
  }
  return picker.Keys();
}

std::vector<Choice> Rank(const std::vector<NodeView>& nodes, const Request& req, size_t limit,
                         const Mix& mix) {
  if (limit == 0 || req.gpus <= 0) {
    return {};
  }
  struct Candidate {
    uint64_t key;
    uint32_t index;
  };
  std::vector<Candidate> candidates;
  candidates.reserve(nodes.size());
  Picker picker(Flatten(mix));

  for (size_t i = 0; i < nodes.size(); ++i) {
    const NodeView& node = nodes[i];
    if (req.baremetal) {
      if (!BaremetalEligible(node) || node.total_slots < req.gpus) {
        continue;
      }
      if (!req.fabric_type.empty() &&
          !std::all_of(node.free.begin(), node.free.end(),
                       [&](const SlotView& s) { return s.fabric_type == req.fabric_type; })) {
        continue;
      }
      candidates.push_back({static_cast<uint64_t>(node.total_slots), static_cast<uint32_t>(i)});
      continue;
    }
    if (node.baremetal_claimed) {
      continue;
    }
    if (!picker.Pick(node.free, req.fabric_type, req.gpus, /*with_keys=*/false, req.numa_local)) {
      continue;
    }
    candidates.push_back({SliceKey(BaremetalEligible(node), picker.quantized_delta(),
                                   picker.free_after(), picker.tier()),
                          static_cast<uint32_t>(i)});
  }

  const auto better = [&nodes](const Candidate& a, const Candidate& b) {
    if (a.key != b.key) {
      return a.key < b.key;
    }
    const int c = nodes[a.index].node_id.compare(nodes[b.index].node_id);
    if (c != 0) {
      return c < 0;
    }
    return a.index < b.index;
  };
  const size_t n = std::min(limit, candidates.size());
  if (n == candidates.size()) {
    std::sort(candidates.begin(), candidates.end(), better);
  } else {
    std::partial_sort(candidates.begin(), candidates.begin() + static_cast<std::ptrdiff_t>(n),
                      candidates.end(), better);
  }

  std::vector<Choice> out;
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const NodeView& node = nodes[candidates[i].index];
    Choice choice;
    choice.node_id = node.node_id;
    choice.score = static_cast<double>(candidates[i].key);
    if (!req.baremetal) {
      picker.Pick(node.free, req.fabric_type, req.gpus, /*with_keys=*/true, req.numa_local);
      choice.slot_keys = picker.Keys();
    }
    out.push_back(std::move(choice));
  }
  return out;
}

Index::Index(Mix mix) : mix_(std::move(mix)) {}

std::string Index::Signature(const NodeView& node) {
  std::vector<std::string> parts;
  parts.reserve(node.free.size());
  for (const auto& s : node.free) {
    parts.push_back(std::to_string(s.numa) + '\x1f' + s.pcie_switch + '\x1f' + s.fabric_type);
  }
  std::sort(parts.begin(), parts.end());
  std::string sig = std::to_string(node.total_slots) + (BaremetalEligible(node) ? "E" : "e") +
                    (node.baremetal_claimed ? "B" : "b");
  for (const auto& p : parts) {
    sig += '\x1e';
    sig += p;
  }
  return sig;
}

std::optional<uint64_t> Index::KeyOf(const Bucket& b, const Kind& kind) const {
  auto cached = b.keys.find(kind);
  if (cached != b.keys.end()) return cached->second;
  const auto& [gpus, baremetal, fabric, numa_local] = kind;
  const NodeView& node = b.shape;
  std::optional<uint64_t> key;
  if (baremetal) {
    // `fabric` enters the lambda by init-capture: clang < 16 (so clang-tidy 14) rejects a
    // captured structured binding.
    if (BaremetalEligible(node) && node.total_slots >= gpus &&
        (fabric.empty() ||
         std::all_of(node.free.begin(), node.free.end(),
                     [&want = fabric](const SlotView& s) { return s.fabric_type == want; }))) {
      key = static_cast<uint64_t>(node.total_slots);
    }
  } else if (!node.baremetal_claimed) {
    Picker picker(Flatten(mix_));
    if (picker.Pick(node.free, fabric, gpus, /*with_keys=*/false, numa_local)) {
      key = SliceKey(BaremetalEligible(node), picker.quantized_delta(), picker.free_after(),
                     picker.tier());
    }
  }
  b.keys[kind] = key;
  return key;
}

const Index::Order& Index::OrderFor(const Kind& kind) const {
  auto it = orders_.find(kind);
  if (it != orders_.end()) return it->second;
  Order& order = orders_[kind];
  for (const auto& [sig, b] : buckets_) {
    if (auto key = KeyOf(b, kind)) order.emplace(*key, &b);
  }
  return order;
}

void Index::Upsert(NodeView node) {
  Remove(node.node_id);
  std::string sig = Signature(node);
  auto [it, fresh] = buckets_.try_emplace(sig);
  Bucket& bucket = it->second;
  if (fresh) {
    bucket.shape = node;
    for (auto& [kind, order] : orders_) {
      if (auto key = KeyOf(bucket, kind)) order.emplace(*key, &bucket);
    }
  }
  bucket.members.insert(node.node_id);
  const std::string id = node.node_id;
  nodes_[id] = Entry{std::move(node), std::move(sig)};
}

void Index::Remove(const std::string& node_id) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  auto b = buckets_.find(it->second.signature);
  if (b != buckets_.end()) {
    b->second.members.erase(node_id);
    if (b->second.members.empty()) {
      for (auto& [kind, order] : orders_) {
        if (auto key = KeyOf(b->second, kind)) order.erase({*key, &b->second});
      }
      buckets_.erase(b);
    } else if (b->second.shape.node_id == node_id) {
      // Same shape, so the keys stay; only the representative's identity changes.
      b->second.shape = nodes_.at(*b->second.members.begin()).node;
    }
  }
  nodes_.erase(it);
}

const NodeView* Index::Find(const std::string& node_id) const {
  auto it = nodes_.find(node_id);
  return it == nodes_.end() ? nullptr : &it->second.node;
}

std::vector<Choice> Index::Rank(const Request& req, size_t limit) const {
  if (limit == 0 || req.gpus <= 0) return {};
  const Order& order = OrderFor(Kind{req.gpus, req.baremetal, req.fabric_type, req.numa_local});
  Picker picker(Flatten(mix_));
  // Buckets of equal key interleave by node id (placement::Rank's tie-break): merge them.
  std::vector<Choice> out;
  for (auto i = order.begin(); i != order.end() && out.size() < limit;) {
    const uint64_t key = i->first;
    using It = std::set<std::string>::const_iterator;
    std::vector<std::pair<It, It>> runs;
    for (; i != order.end() && i->first == key; ++i) {
      runs.emplace_back(i->second->members.begin(), i->second->members.end());
    }
    while (out.size() < limit) {
      std::pair<It, It>* best = nullptr;
      for (auto& r : runs) {
        if (r.first != r.second && (!best || *r.first < *best->first)) best = &r;
      }
      if (!best) break;
      const NodeView& node = nodes_.at(*best->first).node;
      ++best->first;
      Choice choice;
      choice.node_id = node.node_id;
      choice.score = static_cast<double>(key);
      if (!req.baremetal) {
        picker.Pick(node.free, req.fabric_type, req.gpus, /*with_keys=*/true, req.numa_local);
        choice.slot_keys = picker.Keys();
      }
      out.push_back(std::move(choice));
    }
  }
  return out;
}

}  // namespace gpuaas::scheduler::placement
