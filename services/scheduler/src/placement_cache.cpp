#include "gpuaas/scheduler/placement_cache.hpp"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <utility>

#include "gpuaas/common/store.hpp"
#include "projection_store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

constexpr const char* kChannel = "gpuaas_placement";

// A Sync marker's payload (node ids never start with a control character).
constexpr char kMarker = '\x01';

class Receiver : public pqxx::notification_receiver {
 public:
  Receiver(pqxx::connection_base& c, std::set<std::string>* pending, uint64_t* marker)
      : pqxx::notification_receiver(c, kChannel), pending_(pending), marker_(marker) {}
  void operator()(const std::string& payload, int /*backend_pid*/) override {
    if (!payload.empty() && payload[0] == kMarker) {
      *marker_ = std::max<uint64_t>(*marker_, std::stoull(payload.substr(1)));
    } else {
      pending_->insert(payload);
    }
  }

 private:
  std::set<std::string>* pending_;
  uint64_t* marker_;
};

}  // namespace

PlacementCache::PlacementCache(std::string dsn, log::Logger log)
    : dsn_(std::move(dsn)), log_(std::move(log)) {}

PlacementCache::~PlacementCache() { Stop(); }

std::string PlacementCache::PartitionKey(const std::string& region, const std::string& pool,
                                         const std::string& sku) {
  return region + '\x1f' + pool + '\x1f' + sku;
}

void PlacementCache::Connect() {
  listen_ = store::Connect(dsn_);
  listen_pid_ = listen_->backendpid();
  // LISTEN first, then read everything: a commit in between is both read and notified.
  pending_.clear();
  pending_marker_ = 0;
  receiver_ = std::make_unique<Receiver>(*listen_, &pending_, &pending_marker_);
  uint64_t sent = 0;  // markers sent before the read: what they wait for is in it
  {
    std::lock_guard lock(sync_mu_);
    sent = next_marker_;
  }
  pqxx::work tx(*listen_);
  Load(tx, {});
  tx.commit();
  {
    std::lock_guard lock(synced_mu_);
    synced_ = std::max(synced_, sent);
  }
  full_loads_++;
  ready_ = true;
  log_.Info("placement cache loaded", {{"nodes", std::to_string(nodes())}});
}

void PlacementCache::Disconnect() {
  receiver_.reset();  // before its connection
  listen_.reset();
}

Result<void> PlacementCache::Start() {
  // The first load in the foreground: a scheduler that starts has its index.
  try {
    Connect();
  } catch (const std::exception& e) {
    Disconnect();
    return Error::Unavailable(reason::kPlacementCacheUnavailable,
                              std::string("placement cache: ") + e.what());
  }
  thread_ = std::thread([this] { Loop(); });
  return Ok();
}

void PlacementCache::Stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
  ready_ = false;
  synced_cv_.notify_all();
  std::lock_guard lock(sync_mu_);
  sync_conn_.reset();
}

void PlacementCache::PauseFeed(bool paused) {
  paused_ = paused;
  // Returns once the thread saw it: nothing is applied after a pause returned.
  while (paused && thread_.joinable() && !stop_ && !feed_paused_) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

size_t PlacementCache::nodes() const {
  std::lock_guard lock(mu_);
  return nodes_.size();
}

void PlacementCache::Loop() {
  auto last_ping = std::chrono::steady_clock::now();
  while (!stop_) {
    try {
      if (!listen_) Connect();
      // libpqxx reconnects a broken connection by itself (and listens again), but what was
      // notified in between is gone: a new backend means a full read.
      if (listen_->backendpid() != listen_pid_) throw std::runtime_error("connection was reset");
      feed_paused_ = paused_.load();
      if (feed_paused_) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        continue;
      }
      listen_->await_notification(0, 200000);
      const uint64_t marker = std::exchange(pending_marker_, 0);
      const bool heard = !pending_.empty() || marker > 0;
      if (!pending_.empty()) {
        std::vector<std::string> ids(pending_.begin(), pending_.end());
        pending_.clear();
        pqxx::work tx(*listen_);
        Load(tx, ids);
        tx.commit();
      }
      if (marker > 0) {
        // Everything notified before the marker came with it, and is applied now.
        std::lock_guard lock(synced_mu_);
        synced_ = std::max(synced_, marker);
        synced_cv_.notify_all();
      }
      if (heard) {
        last_ping = std::chrono::steady_clock::now();
      } else if (std::chrono::steady_clock::now() - last_ping > std::chrono::seconds(5)) {
        // A connection that died quietly shows here rather than as missing notifications.
        PingConnection(*listen_);
        last_ping = std::chrono::steady_clock::now();
      }
    } catch (const std::exception& e) {
      // Notifications may have been missed: proposals come from SQL until a full load again.
      if (ready_.exchange(false)) {
        log_.Warn(
            "placement cache lost its database connection; placing from SQL until it "
            "is back",
            {{"error", e.what()}});
      }
      synced_cv_.notify_all();  // Sync waiters give up: placement reads SQL
      Disconnect();
      for (int i = 0; i < 10 && !stop_; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
  }
  Disconnect();
}

std::unordered_map<std::string, PlacementCache::Node> PlacementCache::Parse(
    const pqxx::result& rows) {
  std::unordered_map<std::string, Node> read;
  for (const auto& r : rows) {
    auto& n = read[r[0].as<std::string>()];
    n.region = r[1].as<std::string>();
    n.pool = r[2].as<std::string>();
    Slot s;
    s.sku = r[3].as<std::string>();
    s.slot_key = r[4].as<std::string>();
    s.numa = r[5].as<int>();
    s.pcie_switch = r[6].as<std::string>();
    s.fabric_type = r[7].as<std::string>();
    s.schedulable = r[8].as<bool>();
    s.complete = r[9].as<bool>();
    s.claimed = r[10].as<bool>();
    n.baremetal_claimed = n.baremetal_claimed || r[11].as<bool>();
    n.region_enabled = n.region_enabled || r[12].as<bool>();
    n.slots.push_back(std::move(s));
  }
  return read;
}

namespace {
std::vector<std::string> Unique(std::vector<std::string> ids) {
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}
}  // namespace

void PlacementCache::Load(pqxx::transaction_base& tx, const std::vector<std::string>& node_ids) {
  if (node_ids.empty()) {
    // Everything, in pages of nodes: the memory of a page's rows is given back before the next
    // (placement reads SQL meanwhile: the cache is not ready during a full read).
    {
      std::lock_guard lock(mu_);
      nodes_.clear();
      partitions_.clear();
      pools_.clear();
      tallies_.clear();
    }
    std::string after;
    while (true) {
      // The page's last node, then its rows by primary key range.
      auto last = LastNodeOfSlotPage(tx, after);
      if (!last) break;
      const std::string upto = std::move(*last);
      auto read = Parse(ReadPlacementSlotsInRange(tx, after, upto));
      after = upto;
      node_reads_ += read.size();
      std::lock_guard lock(mu_);
      for (auto& [id, n] : read) Put(id, std::move(n));
    }
    malloc_trim(0);  // the rows' memory, freed in many small pieces, back to the system
    return;
  }
  // Each node once: a second Put of one node would move from what the first took.
  const std::vector<std::string> ids = Unique(node_ids);
  auto read = Parse(ReadPlacementSlotsOfNodes(tx, ids));
  node_reads_ += ids.size();
  std::lock_guard lock(mu_);
  for (const auto& id : ids) {
    auto it = read.find(id);
    if (it == read.end()) {
      Drop(id);
    } else {
      Put(id, std::move(it->second));
    }
  }
}

void PlacementCache::Tally(const Node& n, int sign) {
  auto& region = tallies_[n.region];
  auto& pool = region.pools[n.pool];
  pool.nodes += sign;
  std::map<std::string, std::array<int64_t, kFabrics.size()>> fit, wrong;
  for (const auto& s : n.slots) {
    if (!s.schedulable) {
      region.unschedulable += sign;
      continue;
    }
    if (s.claimed || n.baremetal_claimed) continue;
    pool.free += sign;
    if (!s.complete) pool.incomplete += sign;
    pool.skus[s.sku].free += sign;
    auto& f = fit[s.sku];
    auto& w = wrong[s.sku];
    for (size_t i = 0; i < kFabrics.size(); ++i) {
      if (!kFabrics[i].empty() && s.fabric_type != kFabrics[i]) {
        w[i]++;
      } else if (s.complete) {
        f[i]++;
      }
    }
  }
  for (const auto& [sku, f] : fit) {
    auto& agg = pool.skus[sku];
    for (size_t i = 0; i < kFabrics.size(); ++i) {
      agg.fabric[i].matching += sign * f[i];
      if (f[i] > 0) {
        auto& count = agg.fabric[i].nodes_by_fit[f[i]];
        count += sign;
        if (count == 0) agg.fabric[i].nodes_by_fit.erase(f[i]);
      }
      if (wrong[sku][i] > 0) agg.fabric[i].nodes_with_wrong += sign;
    }
  }
  if (pool.nodes == 0) region.pools.erase(n.pool);
  if (region.pools.empty() && region.unschedulable == 0) tallies_.erase(n.region);
}

void PlacementCache::TallyCapacity(const Node& n, const std::string& sku,
                                   const placement::NodeView& view, int sign) {
  auto& agg = tallies_[n.region].pools[n.pool].skus[sku];
  agg.free_complete += sign * static_cast<int64_t>(view.free.size());
  const auto shapes = shapes_.find(sku);
  agg.stranded +=
      sign * (shapes == shapes_.end() ? static_cast<int64_t>(view.free.size())
                                      : placement::StrandedGpus(view.free, shapes->second));
  if (placement::WholeNodeFree(view)) agg.whole_free_nodes += sign;
}

void PlacementCache::SetOrderableShapes(const std::vector<placement::OrderableShape>& shapes) {
  std::lock_guard lock(mu_);
  shapes_.clear();
  for (const auto& shape : shapes) shapes_[shape.gpu_sku].push_back(shape);
}

std::vector<PlacementCache::Capacity> PlacementCache::Capacities() const {
  std::lock_guard lock(mu_);
  std::vector<Capacity> out;
  for (const auto& [region_name, region] : tallies_) {
    for (const auto& [pool_name, pool] : region.pools) {
      for (const auto& [sku, t] : pool.skus) {
        out.push_back(
            {region_name, pool_name, sku, t.free_complete, t.stranded, t.whole_free_nodes});
      }
    }
  }
  return out;
}

void PlacementCache::Drop(const std::string& node_id) {
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  const Node& old = it->second;
  std::set<std::string> skus;
  for (const auto& s : old.slots) skus.insert(s.sku);
  // The capacity it added, from the views the index holds (before Tally may drop its pool).
  for (const auto& sku : skus) {
    auto p = partitions_.find(PartitionKey(old.region, old.pool, sku));
    if (p == partitions_.end()) continue;
    if (const auto* view = p->second.index.Find(node_id)) TallyCapacity(old, sku, *view, -1);
  }
  Tally(old, -1);
  for (const auto& sku : skus) {
    const std::string key = PartitionKey(old.region, old.pool, sku);
    auto p = partitions_.find(key);
    if (p == partitions_.end()) continue;
    p->second.index.Remove(node_id);
    if (old.region_enabled) p->second.enabled--;
    if (p->second.index.size() == 0) {
      partitions_.erase(p);
      auto pools = pools_.find({old.region, sku});
      if (pools != pools_.end()) {
        pools->second.erase(old.pool);
        if (pools->second.empty()) pools_.erase(pools);
      }
    }
  }
  nodes_.erase(it);
}

std::map<std::string, placement::NodeView> PlacementCache::Views(const std::string& node_id,
                                                                 const Node& node) {
  std::map<std::string, placement::NodeView> views;
  for (const auto& s : node.slots) {
    auto& v = views[s.sku];
    v.node_id = node_id;
    v.total_slots++;
    v.claimed_slots += s.claimed ? 1 : 0;
    v.baremetal_claimed = node.baremetal_claimed;
    if (s.schedulable && s.complete && !s.claimed) {
      v.free.push_back({s.slot_key, s.numa, s.pcie_switch, s.fabric_type});
    }
  }
  return views;
}

void PlacementCache::Put(const std::string& node_id, Node node) {
  Drop(node_id);
  Tally(node, +1);
  for (auto& [sku, view] : Views(node_id, node)) {
    TallyCapacity(node, sku, view, +1);
    auto& p = partitions_[PartitionKey(node.region, node.pool, sku)];
    p.index.Upsert(std::move(view));
    if (node.region_enabled) p.enabled++;
    pools_[{node.region, sku}].insert(node.pool);
  }
  nodes_[node_id] = std::move(node);
}

std::vector<placement::NodeView> ReadNodeViews(pqxx::transaction_base& tx,
                                               const std::string& region, const std::string& pool,
                                               const std::string& sku, bool* region_enabled) {
  const auto nodes = PlacementCache::Parse(ReadPlacementSlotsOfSku(tx, region, pool, sku));
  std::vector<placement::NodeView> out;
  out.reserve(nodes.size());
  *region_enabled = false;
  for (const auto& [id, n] : nodes) {
    *region_enabled = *region_enabled || n.region_enabled;
    auto views = PlacementCache::Views(id, n);
    out.push_back(std::move(views[sku]));
  }
  return out;
}

PlacementCache::Ranked PlacementCache::Rank(const std::string& region, const std::string& pool,
                                            const std::string& sku, const placement::Request& req,
                                            size_t limit) {
  Ranked out;
  std::lock_guard lock(mu_);
  std::vector<std::string> pools;
  if (!pool.empty()) {
    pools.push_back(pool);
  } else if (auto it = pools_.find({region, sku}); it != pools_.end()) {
    pools.assign(it->second.begin(), it->second.end());
  }
  for (const auto& name : pools) {
    auto p = partitions_.find(PartitionKey(region, name, sku));
    if (p == partitions_.end() || p->second.index.size() == 0) continue;
    out.any_node = true;
    out.region_enabled = out.region_enabled || p->second.enabled > 0;
    auto ranked = p->second.index.Rank(req, limit);
    out.choices.insert(out.choices.end(), std::make_move_iterator(ranked.begin()),
                       std::make_move_iterator(ranked.end()));
  }
  if (pools.size() > 1) {
    // Each pool's proposals are in Rank's order (score, then node id): merged, they are Rank's
    // order over all the pools' nodes.
    std::stable_sort(out.choices.begin(), out.choices.end(),
                     [](const placement::Choice& a, const placement::Choice& b) {
                       return a.score != b.score ? a.score < b.score : a.node_id < b.node_id;
                     });
    if (out.choices.size() > limit) out.choices.resize(limit);
  }
  return out;
}

bool PlacementCache::Sync(std::chrono::milliseconds timeout) {
  if (!ready_) return false;
  uint64_t marker = 0;
  try {
    std::lock_guard lock(sync_mu_);
    if (!sync_conn_) sync_conn_ = store::Connect(dsn_);
    marker = ++next_marker_;
    Notify(*sync_conn_, kChannel, std::string(1, kMarker) + std::to_string(marker));
  } catch (const std::exception&) {
    std::lock_guard lock(sync_mu_);
    sync_conn_.reset();
    return false;
  }
  std::unique_lock lock(synced_mu_);
  if (!synced_cv_.wait_for(lock, timeout, [&] { return synced_ >= marker || !ready_; }) ||
      synced_ < marker) {
    return false;
  }
  syncs_++;
  return true;
}

PlacementCache::FreeCounts PlacementCache::Count(const std::string& region, const std::string& pool,
                                                 const std::string& sku, const std::string& fabric,
                                                 int gpus) const {
  FreeCounts c;
  const auto f =
      static_cast<size_t>(std::find(kFabrics.begin(), kFabrics.end(), fabric) - kFabrics.begin());
  std::lock_guard lock(mu_);
  auto r = tallies_.find(region);
  if (r == tallies_.end()) return c;
  c.unschedulable_in_region = r->second.unschedulable;
  for (const auto& [name, p] : r->second.pools) {
    if (!pool.empty() && name != pool) continue;
    c.free_in_region += p.free;
    c.incomplete += p.incomplete;
    auto k = p.skus.find(sku);
    if (k == p.skus.end()) continue;
    c.free_of_sku += k->second.free;
    if (f >= kFabrics.size()) continue;  // a fabric no slot can have
    const auto& agg = k->second.fabric[f];
    c.matching += agg.matching;
    c.nodes_with_wrong_fabric += agg.nodes_with_wrong;
    if (!agg.nodes_by_fit.empty()) {
      c.max_on_one_node = std::max(c.max_on_one_node, agg.nodes_by_fit.rbegin()->first);
    }
    for (auto it = agg.nodes_by_fit.lower_bound(std::max(gpus, 1)); it != agg.nodes_by_fit.end();
         ++it) {
      c.nodes_with_enough += it->second;
    }
  }
  return c;
}

void PlacementCache::Refresh(pqxx::transaction_base& tx, const std::vector<std::string>& node_ids) {
  if (node_ids.empty()) return;
  stale_reads_ += node_ids.size();
  Load(tx, node_ids);
}

void PlacementCache::Claimed(const std::string& node_id, const std::vector<std::string>& slots) {
  std::lock_guard lock(mu_);
  auto it = nodes_.find(node_id);
  if (it == nodes_.end()) return;
  Node copy = it->second;
  for (auto& s : copy.slots) {
    if (std::find(slots.begin(), slots.end(), s.slot_key) != slots.end()) s.claimed = true;
  }
  Put(node_id, std::move(copy));
}

}  // namespace gpuaas::scheduler
