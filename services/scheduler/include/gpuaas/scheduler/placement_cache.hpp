#pragma once
// The scheduler replica's in-memory view of what every node can take, for placement decisions
// whose cost does not grow with the fleet. It holds one placement::Index per (region, pool,
// SKU), built from the slot projection and the live claims at start, and kept current through
// PostgreSQL notifications (migrations/0008_placement_notify.sql): every commit that changes a
// node's slots or claims, on any replica, names the node on channel gpuaas_placement and each
// replica reads that node again. LISTEN is in place before the first full read, so no commit
// falls between them; a lost listening connection means a full read again once it is back.
//
// The index only proposes. The create transaction locks the proposed slots and re-checks their
// claims in SQL, exactly as before, so a stale proposal (a commit whose notification has not
// arrived yet) can never double-book: it is counted as stale, the node is read again, and the
// next proposal is tried. While the cache is not loaded, placement reads SQL as before.
#include <pqxx/pqxx>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/scheduler/placement.hpp"
#include "gpuaas/scheduler/stranded.hpp"

namespace gpuaas::scheduler {

// A projected slot `p` whose bindings are complete (GPU PCI address, NVMe by-id, MAC, private IP,
// a per-slot fabric VF): one that is not is ignored even when inventory says available.
inline constexpr const char* kSlotCompleteSql =
    "(p.gpu_pci_address <> '' AND p.nvme_by_id <> '' AND p.mac <> '' AND p.private_ip <> '' AND "
    "p.fabric_claim_mode = 'per_slot_vf' AND p.fabric_vf_pci_address <> '')";

// The placement views of the nodes with slots of `sku` in `region` (and `pool`, "" = any), read
// in `tx` exactly as the index builds them; `region_enabled`: one of them is in an enabled
// region. The create path's SQL read when the index has nothing to propose or is not loaded.
std::vector<placement::NodeView> ReadNodeViews(pqxx::transaction_base& tx,
                                               const std::string& region, const std::string& pool,
                                               const std::string& sku, bool* region_enabled);

class PlacementCache {
 public:
  PlacementCache(std::string dsn, log::Logger log);
  ~PlacementCache();
  PlacementCache(const PlacementCache&) = delete;
  PlacementCache& operator=(const PlacementCache&) = delete;

  // Listens and reads every node, then keeps listening on its own thread. Fails when that
  // first read fails (the database is not there).
  Result<void> Start();
  void Stop();
  // Whether proposals come from the cache (loaded, and its listening connection up).
  bool ready() const { return ready_; }

  struct Ranked {
    bool any_node = false;        // some node has slots of the SKU in the region (and pool)
    bool region_enabled = false;  // one of them is in an enabled region
    std::vector<placement::Choice> choices;
  };
  // Up to `limit` proposals, best first: exactly placement::Rank over the nodes with slots of
  // `sku` in `region` (and `pool`, "" = any pool) as the cache knows them.
  Ranked Rank(const std::string& region, const std::string& pool, const std::string& sku,
              const placement::Request& req, size_t limit);
  // Returns once every commit made before the call is in the index (a marker notified through
  // the database comes back after them, as PostgreSQL delivers in commit order), or false after
  // `timeout` (a paused or lost feed). A refusal is decided only on an index synced this way.
  bool Sync(std::chrono::milliseconds timeout);

  // What the create path reports when nothing could be placed (the no_placement details).
  struct FreeCounts {
    int64_t free_in_region = 0;           // schedulable, unclaimed slots of any SKU
    int64_t free_of_sku = 0;              // ... of the SKU
    int64_t matching = 0;                 // ... complete and of the fabric
    int64_t max_on_one_node = 0;          // most matching on one node
    int64_t nodes_with_enough = 0;        // nodes with at least the GPUs asked, matching
    int64_t nodes_with_wrong_fabric = 0;  // nodes with free ones of the SKU in another fabric
    int64_t unschedulable_in_region = 0;  // any pool
    int64_t incomplete = 0;               // free but with an incomplete binding
  };
  FreeCounts Count(const std::string& region, const std::string& pool, const std::string& sku,
                   const std::string& fabric, int gpus) const;

  // The slices tenants can order (from the catalog), for the stranded capacity; set before
  // Start, never after. Without it every free GPU counts as stranded.
  void SetOrderableShapes(const std::vector<placement::OrderableShape>& shapes);
  // Free capacity per (region, pool, SKU) as the index holds it, for gpuaas_free_gpus,
  // gpuaas_stranded_gpus and gpuaas_free_whole_nodes: free = schedulable, complete slots
  // without a claim; stranded = those no orderable slice can use (placement::StrandedGpus);
  // whole nodes = nodes whose every slot of the SKU is free (placement::WholeNodeFree).
  struct Capacity {
    std::string region;
    std::string pool;
    std::string sku;
    int64_t free = 0;
    int64_t stranded = 0;
    int64_t whole_free_nodes = 0;
  };
  std::vector<Capacity> Capacities() const;

  // Reads these nodes again in `tx` (a proposal the SQL re-check refused).
  void Refresh(pqxx::transaction_base& tx, const std::vector<std::string>& node_ids);
  // This replica's own commit claimed `slots` of `node_id` (applied now rather than when its
  // notification comes back).
  void Claimed(const std::string& node_id, const std::vector<std::string>& slots);

  // For tests and benchmarks.
  uint64_t full_loads() const { return full_loads_; }
  uint64_t node_reads() const { return node_reads_; }
  uint64_t stale_reads() const { return stale_reads_; }  // nodes read again by Refresh
  uint64_t syncs() const { return syncs_; }              // Sync calls that caught up
  size_t nodes() const;
  // Stops applying notifications (they queue on the listening connection) until resumed: a
  // replica whose feed is late. Pausing returns once nothing more is applied.
  void PauseFeed(bool paused);

 private:
  struct Slot {
    std::string slot_key;
    std::string sku;
    int numa = -1;
    std::string pcie_switch;
    std::string fabric_type;
    bool schedulable = false;
    bool complete = false;  // every binding a slice needs is known
    bool claimed = false;
  };
  struct Node {
    std::string region;
    std::string pool;
    bool region_enabled = false;
    bool baremetal_claimed = false;
    std::vector<Slot> slots;
  };
  struct Partition {
    placement::Index index;
    size_t enabled = 0;  // members in an enabled region
  };
  // What Count reports, kept as nodes come and go (Tally), so a refusal costs no scan of the
  // fleet. Per fabric a request can ask for: any (""), infiniband, roce (the projection's check
  // constraint allows no other).
  static constexpr std::array<std::string_view, 3> kFabrics = {"", "infiniband", "roce"};
  struct FabricTally {
    int64_t matching = 0;                     // free complete slots of the fabric
    int64_t nodes_with_wrong = 0;             // nodes with free slots of another fabric
    std::map<int64_t, int64_t> nodes_by_fit;  // matching free slots on a node -> nodes (> 0)
  };
  struct SkuTally {
    int64_t free = 0;              // unclaimed schedulable slots, complete or not
    int64_t free_complete = 0;     // ... with every binding (what placement may propose)
    int64_t stranded = 0;          // ... that no orderable slice can use
    int64_t whole_free_nodes = 0;  // nodes whose every slot of the SKU is free
    std::array<FabricTally, kFabrics.size()> fabric;
  };
  struct PoolTally {
    int64_t nodes = 0;
    int64_t free = 0;  // any SKU
    int64_t incomplete = 0;
    std::map<std::string, SkuTally> skus;
  };
  struct RegionTally {
    int64_t unschedulable = 0;  // any pool
    std::map<std::string, PoolTally> pools;
  };
  void Tally(const Node& n, int sign);  // mu_ held
  // Adds (sign +1) or takes back (-1) what `view`, the node's slots of `sku`, holds of the free,
  // stranded and whole-node counts (mu_ held; after Tally(n, +1), before Tally(n, -1)).
  void TallyCapacity(const Node& n, const std::string& sku, const placement::NodeView& view,
                     int sign);
  static std::string PartitionKey(const std::string& region, const std::string& pool,
                                  const std::string& sku);
  static std::unordered_map<std::string, Node> Parse(const pqxx::result& rows);
  // The node's view per SKU of its slots, as placement::Rank takes it.
  static std::map<std::string, placement::NodeView> Views(const std::string& node_id,
                                                          const Node& node);
  friend std::vector<placement::NodeView> ReadNodeViews(pqxx::transaction_base&, const std::string&,
                                                        const std::string&, const std::string&,
                                                        bool*);
  // Reads `node_ids` (empty: every node) and replaces what the cache holds for them.
  void Load(pqxx::transaction_base& tx, const std::vector<std::string>& node_ids);
  void Put(const std::string& node_id, Node node);  // mu_ held
  void Drop(const std::string& node_id);            // mu_ held
  void Connect();  // LISTEN and a full read; throws when the database is not there
  void Disconnect();
  void Loop();

  std::string dsn_;
  log::Logger log_;
  mutable std::mutex mu_;
  std::unordered_map<std::string, Node> nodes_;
  std::unordered_map<std::string, Partition> partitions_;
  // (region, sku) -> pools with a partition, for requests of any pool.
  std::map<std::pair<std::string, std::string>, std::set<std::string>> pools_;
  std::unordered_map<std::string, RegionTally> tallies_;
  std::map<std::string, std::vector<placement::OrderableShape>> shapes_;  // by slot SKU
  std::atomic<bool> ready_{false};
  std::atomic<bool> stop_{false};
  std::atomic<bool> paused_{false};
  std::atomic<bool> feed_paused_{false};  // the thread saw paused_
  std::atomic<uint64_t> full_loads_{0};
  std::atomic<uint64_t> node_reads_{0};
  std::atomic<uint64_t> stale_reads_{0};
  std::atomic<uint64_t> syncs_{0};
  // The listening connection, its receiver and the node ids it collected: the thread's own.
  std::unique_ptr<pqxx::connection> listen_;
  int listen_pid_ = 0;  // its backend when the cache was read through it
  std::unique_ptr<pqxx::notification_receiver> receiver_;
  std::set<std::string> pending_;
  uint64_t pending_marker_ = 0;  // the highest Sync marker seen, applied with pending_
  // Sync: markers sent (own connection) and the highest one whose batch is applied.
  std::mutex sync_mu_;
  std::unique_ptr<pqxx::connection> sync_conn_;
  uint64_t next_marker_ = 0;
  std::mutex synced_mu_;
  std::condition_variable synced_cv_;
  uint64_t synced_ = 0;
  std::thread thread_;
};

}  // namespace gpuaas::scheduler
