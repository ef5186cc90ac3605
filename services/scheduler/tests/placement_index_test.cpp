// The scheduler replica's placement index (src/placement_cache.hpp) on real PostgreSQL and NATS:
// it proposes what placement::Rank over the database proposes, a replica whose index is late
// never double-books (the SQL re-check refuses its stale proposals, which it reads again), and
// it converges once its notifications flow again. The concurrency tests in allocation_test.cpp
// run on the index as well (it is on by default).
#include <gtest/gtest.h>

#include <map>
#include <set>

#include "gpuaas/scheduler/placement.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"
#include "scheduler_fixture.hpp"

namespace gpuaas::scheduler {
namespace {

class PlacementIndexServiceTest : public AllocationTest {
 protected:
  PlacementIndexServiceTest() { replicas_wanted_ = 1; }
  PlacementCache& Index(size_t replica = 0) { return *replicas_[replica]->placement_index(); }

  // placement::Rank over views read from the database here, independently of the cache.
  std::vector<placement::Choice> RankOverSql(const placement::Request& req) {
    std::map<std::string, placement::NodeView> nodes;
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
      for (const auto& row :
           tx.exec("SELECT p.node_id, p.slot_key, p.numa, p.pcie_switch, p.fabric_type, "
                   "p.schedulable, EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE "
                   "c.released_at IS NULL AND c.node_id = p.node_id AND c.slot_key = p.slot_key) "
                   "FROM projected_slots p WHERE p.region = 'us-east-1' AND p.sku = 'h200-sxm' "
                   "ORDER BY 1, 2")) {
        auto& n = nodes[row[0].as<std::string>()];
        n.node_id = row[0].as<std::string>();
        n.total_slots++;
        const bool claimed = row[6].as<bool>();
        n.claimed_slots += claimed ? 1 : 0;
        if (row[5].as<bool>() && !claimed) {
          n.free.push_back({row[1].as<std::string>(), row[2].as<int>(), row[3].as<std::string>(),
                            row[4].as<std::string>()});
        }
      }
      return Ok();
    });
    EXPECT_TRUE(r.ok());
    std::vector<placement::NodeView> views;
    views.reserve(nodes.size());
    for (auto& [id, n] : nodes) views.push_back(n);
    return placement::Rank(views, req, 8);
  }
  static std::vector<std::pair<std::string, std::vector<std::string>>> Picks(
      const std::vector<placement::Choice>& choices) {
    std::vector<std::pair<std::string, std::vector<std::string>>> out;
    out.reserve(choices.size());
    for (const auto& c : choices) out.emplace_back(c.node_id, c.slot_keys);
    return out;
  }
  // Whether `cache` proposes exactly what Rank over the database proposes, for every size.
  bool AgreesWithSql(PlacementCache& cache) {
    for (int gpus : {1, 2, 4, 8}) {
      placement::Request req;
      req.gpus = gpus;
      req.fabric_type = "infiniband";
      if (Picks(cache.Rank("us-east-1", "", "h200-sxm", req, 8).choices) !=
          Picks(RankOverSql(req))) {
        return false;
      }
    }
    return true;
  }
  // Claims every slot of `node` the way another replica's commit would (not through this one).
  void TakeNode(const std::string& node) {
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
      tx.exec_params(
          "CREATE TEMP TABLE take ON COMMIT DROP AS SELECT slot_key, gen_random_uuid() AS id "
          "FROM projected_slots WHERE node_id = $1",
          node);
      tx.exec_params(
          "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, gpu_count, "
          "region, network_mode, state, node_id, generation) SELECT id, 'other', id::text, "
          "'h200-sxm-slice', 'gpu_slice', 1, 'us-east-1', 'private-nat', 'active', $1, 1 "
          "FROM take",
          node);
      tx.exec_params(
          "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_key, kind, "
          "phase) SELECT id, $1, slot_key, 'slot', 'active' FROM take",
          node);
      return Ok();
    });
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
};

TEST_F(PlacementIndexServiceTest, ALateIndexNeverDoubleBooksAndConvergesWhenItsFeedResumes) {
  for (int i = 0; i < 4; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  ASSERT_TRUE(testing::WaitFor([&] { return Index().ready() && Index().nodes() == 4; }));
  ASSERT_TRUE(testing::WaitFor([&] { return AgreesWithSql(Index()); }));

  // The replica stops hearing about commits; others fill three of the four nodes meanwhile.
  Index().PauseFeed(true);
  for (int i = 0; i < 3; ++i) TakeNode(fmt::format("gpu-{:02d}", i));
  EXPECT_FALSE(AgreesWithSql(Index())) << "the paused index still sees the taken nodes free";
  const uint64_t stale_before = Index().stale_reads();
  std::set<std::string> used;
  for (int i = 0; i < 4; ++i) {
    auto a = Create(fmt::format("late-{}", i), 2);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    EXPECT_EQ(a->allocation().node_id(), "gpu-03") << "the only node with free slots";
    for (const auto& k : a->allocation().slot_keys()) EXPECT_TRUE(used.insert(k).second) << k;
  }
  EXPECT_GT(Index().stale_reads(), stale_before) << "its stale proposals were refused and re-read";
  const auto violations = Invariants();
  EXPECT_TRUE(violations.empty()) << violations.front();
  // Full now, and the refusal is decided on the database, with its counts.
  auto full = Create("late-full", 1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().reason, "no_placement");
  EXPECT_EQ(full.error().details.at("free_gpus_of_sku"), "0");

  // The feed resumes. That refusal was decided on SQL (the paused index could not sync); the
  // index, caught up, counts the same, and refuses the next one itself at once.
  Index().PauseFeed(false);
  ASSERT_TRUE(testing::WaitFor([&] { return AgreesWithSql(Index()); }));
  const auto c = Index().Count("us-east-1", "", "h200-sxm", "infiniband", 1);
  const std::map<std::string, int64_t> counted = {
      {"free_gpus_in_region", c.free_in_region},
      {"free_gpus_of_sku", c.free_of_sku},
      {"free_gpus_matching_fabric", c.matching},
      {"max_free_matching_on_one_node", c.max_on_one_node},
      {"nodes_with_enough_free_slots", c.nodes_with_enough},
      {"nodes_with_wrong_fabric", c.nodes_with_wrong_fabric},
      {"unschedulable_slots_in_region", c.unschedulable_in_region},
      {"incomplete_slots_ignored", c.incomplete}};
  for (const auto& [key, n] : counted) {
    EXPECT_EQ(full.error().details.at(key), std::to_string(n)) << key;
  }
  const uint64_t syncs = Index().syncs();
  auto again = Create("late-full-again", 1);
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().details, full.error().details);
  EXPECT_GT(Index().syncs(), syncs) << "refused by the synced index";

  // A release elsewhere reaches the index by its notification alone.
  auto freed = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    tx.exec(
        "UPDATE allocation_resource_claims SET released_at = now(), phase = 'released' WHERE "
        "node_id = 'gpu-01' AND released_at IS NULL");
    return Ok();
  });
  ASSERT_TRUE(freed.ok());
  EXPECT_TRUE(testing::WaitFor([&] { return AgreesWithSql(Index()); }))
      << "the index converges once its notifications flow again";
  placement::Request eight;
  eight.gpus = 8;
  auto ranked = Index().Rank("us-east-1", "", "h200-sxm", eight, 8);
  ASSERT_EQ(ranked.choices.size(), 1u);
  EXPECT_EQ(ranked.choices[0].node_id, "gpu-01");
}

TEST_F(PlacementIndexServiceTest, AFreshIndexIsRankOverTheDatabaseAfterCreatesAndReleases) {
  for (int i = 0; i < 6; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  ASSERT_TRUE(testing::WaitFor([&] { return Index().nodes() == 6; }));
  std::vector<std::string> live;
  const int sizes[] = {1, 2, 4, 1, 2, 8, 1, 2};
  for (int i = 0; i < 24; ++i) {
    auto a = Create(fmt::format("mix-{}", i), sizes[i % 8]);
    if (a.ok()) live.push_back(a->allocation().allocation_id());
    if (i % 3 == 2 && !live.empty()) {
      ASSERT_TRUE(Release(live.front(), /*force=*/true).ok());
      live.erase(live.begin());
    }
  }
  // The replica's index, fed by its own commits and notifications, and one read from scratch
  // (what a restarted replica builds) both propose what Rank over the database proposes.
  EXPECT_TRUE(testing::WaitFor([&] { return AgreesWithSql(Index()); }));
  PlacementCache fresh(dsn_, log::Logger("test", "t", log::Level::kWarn));
  ASSERT_TRUE(fresh.Start().ok());
  EXPECT_EQ(fresh.nodes(), 6u);
  EXPECT_TRUE(AgreesWithSql(fresh));
  // The refusal counts the live index kept up through every change equal a fresh count.
  auto fields = [](const PlacementCache::FreeCounts& c) {
    return std::vector<int64_t>{
        c.free_in_region,          c.free_of_sku,       c.matching,
        c.max_on_one_node,         c.nodes_with_enough, c.nodes_with_wrong_fabric,
        c.unschedulable_in_region, c.incomplete};
  };
  for (const char* fabric : {"", "infiniband", "roce"}) {
    for (int gpus : {1, 2, 4, 8}) {
      EXPECT_EQ(fields(Index().Count("us-east-1", "", "h200-sxm", fabric, gpus)),
                fields(fresh.Count("us-east-1", "", "h200-sxm", fabric, gpus)))
          << fabric << " x" << gpus;
    }
  }
  fresh.Stop();
}

// gpuaas_free_gpus / gpuaas_stranded_gpus / gpuaas_free_whole_nodes come from these counts.
TEST_F(PlacementIndexServiceTest, StrandedCapacityFollowsClaimsAndTheShapesTheCatalogSells) {
  AddNode("ib-0", 8);
  AddNode("ib-1", 8);
  AddNode("roce-0", 4, "us-east-1", false, true, v1::FABRIC_TYPE_ROCE);
  WaitProjected();
  ASSERT_TRUE(testing::WaitFor([&] { return Index().nodes() == 3; }));
  // A second index that sells only even InfiniBand slices, next to the replica's own (the
  // default catalog: 1, 2, 4 or 8 InfiniBand GPUs).
  PlacementCache even(dsn_, log::Logger("test", "t", log::Level::kWarn));
  even.SetOrderableShapes({{"h200-sxm", "infiniband", {2, 4, 8}}});
  ASSERT_TRUE(even.Start().ok());
  auto capacity = [](const PlacementCache& cache) {
    for (const auto& c : cache.Capacities()) {
      if (c.region == "us-east-1" && c.sku == "h200-sxm") {
        return std::vector<int64_t>{c.free, c.stranded, c.whole_free_nodes};
      }
    }
    return std::vector<int64_t>{};
  };
  // Nothing sells RoCE: its 4 are stranded under either catalog.
  EXPECT_EQ(capacity(Index()), (std::vector<int64_t>{20, 4, 3}));
  EXPECT_EQ(capacity(even), (std::vector<int64_t>{20, 4, 3}));

  auto one = Create("one", 1);
  ASSERT_TRUE(one.ok()) << one.error().ToString();
  TakeNode(one->allocation().node_id() == "ib-0" ? "ib-1" : "ib-0");
  // One IB node is taken and the other has 7 free: even slices strand one of them.
  EXPECT_TRUE(testing::WaitFor([&] {
    return capacity(Index()) == std::vector<int64_t>{11, 4, 1};
  })) << ::testing::PrintToString(capacity(Index()));
  EXPECT_TRUE(testing::WaitFor([&] {
    return capacity(even) == std::vector<int64_t>{11, 5, 1};
  })) << ::testing::PrintToString(capacity(even));

  // The index kept up through every change counts what one read from scratch counts.
  PlacementCache fresh(dsn_, log::Logger("test", "t", log::Level::kWarn));
  fresh.SetOrderableShapes({{"h200-sxm", "infiniband", {2, 4, 8}}});
  ASSERT_TRUE(fresh.Start().ok());
  EXPECT_EQ(capacity(fresh), capacity(even));
  fresh.Stop();
  even.Stop();
}

TEST_F(PlacementIndexServiceTest, ALostListeningConnectionMeansAFullReadAgain) {
  for (int i = 0; i < 2; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  ASSERT_TRUE(testing::WaitFor([&] { return Index().nodes() == 2 && AgreesWithSql(Index()); }));
  const uint64_t loads = Index().full_loads();
  // Every other connection to the scheduler's database is cut (the listening one included):
  // what is committed while it is away is never notified to it.
  auto cut = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    tx.exec(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
        "current_database() AND pid <> pg_backend_pid()");
    return Ok();
  });
  ASSERT_TRUE(cut.ok()) << cut.error().ToString();
  TakeNode("gpu-00");
  EXPECT_TRUE(
      testing::WaitFor([&] { return Index().full_loads() > loads && Index().ready(); }, 20s));
  EXPECT_TRUE(testing::WaitFor([&] { return AgreesWithSql(Index()); }));
  // The service's own pooled connections were cut too: the first answers may be the retryable
  // db_unavailable, which a client retries with the same request id.
  Result<v1::CreateAllocationResponse> a = Error::Internal("not_run", "");
  ASSERT_TRUE(testing::WaitFor([&] {
    a = Create("after-cut", 4);
    EXPECT_TRUE(a.ok() || a.error().retryable) << a.error().ToString();
    return a.ok();
  }));
  EXPECT_EQ(a->allocation().node_id(), "gpu-01");
}

// scheduler.placement_index=false: every create reads its candidates and its refusal's counts
// from SQL (the same read the index falls back to).
// What a commit's notification costs a replica: its nodes read by primary key, never a scan of
// every slot, even over a table PostgreSQL has no statistics for yet (a new replica, a rebuild
// replaying the stream), where `node_id = ANY(...)` was planned as a sequential scan.
TEST_F(PlacementIndexServiceTest, ReadingNotifiedNodesProbesTheirRowsWithoutScanningEverySlot) {
  auto filled = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    tx.exec(
        "INSERT INTO projected_slots (node_id, slot_key, region, pool, sku, admin_state, health, "
        "schedulable, generation, last_event_id, fabric_type, numa, pcie_switch, "
        "gpu_pci_address, nvme_by_id, fabric_claim_mode, fabric_vf_pci_address, mac, "
        "private_ip) "
        "SELECT 'bulk-' || lpad(i::text, 5, '0'), 'gpu-' || s, 'us-east-1', 'h200', 'h200-sxm', "
        "'available', 'healthy', true, 1, gen_random_uuid(), 'infiniband', s / 4, "
        "'sw' || (s / 2), '0000:1' || s || ':00.0', 'nvme-' || i || '-' || s, 'per_slot_vf', "
        "'0000:4' || s || ':00.1', '52:54:00:00:00:0' || s, '10.100.0.' || (10 + s) "
        "FROM generate_series(1, 5000) i, generate_series(0, 7) s");
    return Ok();
  });
  ASSERT_TRUE(filled.ok()) << filled.error().ToString();
  std::vector<std::string> ids;
  for (int i = 1; i <= 64; ++i) ids.push_back(fmt::format("bulk-{:05d}", i * 70));
  ids.push_back(ids.front());  // a node named twice (two refused proposals) keeps its slots
  auto scans = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<std::pair<int64_t, int64_t>> {
    auto stats = tx.exec1(
        "SELECT count(*) FILTER (WHERE s.staattnum IS NOT NULL) FROM pg_class c LEFT JOIN "
        "pg_statistic s ON s.starelid = c.oid WHERE c.relname = 'projected_slots'");
    EXPECT_EQ(stats[0].as<int64_t>(), 0) << "the table is to be without statistics";
    Index().Refresh(tx, ids);
    // This transaction's own scans, not yet flushed to the cumulative statistics.
    auto r = tx.exec1(
        "SELECT seq_scan, COALESCE(idx_scan, 0) FROM pg_stat_xact_user_tables "
        "WHERE relname = 'projected_slots'");
    return std::make_pair(r[0].as<int64_t>(), r[1].as<int64_t>());
  });
  ASSERT_TRUE(scans.ok()) << scans.error().ToString();
  EXPECT_EQ(scans->first, 0) << "sequential scans of projected_slots";
  EXPECT_GE(scans->second, 64) << "an index probe per node";
  // And what it read is right: each of those nodes with its 8 free slots.
  for (const auto& id : {ids[0], ids[63]}) {
    placement::Request req;
    req.gpus = 8;
    req.fabric_type = "infiniband";
    bool found = false;
    const auto ranked = Index().Rank("us-east-1", "", "h200-sxm", req, 100000);
    for (const auto& c : ranked.choices) found = found || c.node_id == id;
    const auto counts = Index().Count("us-east-1", "", "h200-sxm", "infiniband", 8);
    EXPECT_TRUE(found) << id << " among " << ranked.choices.size() << "; matching "
                       << counts.matching << " incomplete " << counts.incomplete << " enough "
                       << counts.nodes_with_enough << " free " << counts.free_of_sku;
  }
}

class SqlPlacementTest : public AllocationTest {
 protected:
  SqlPlacementTest() {
    replicas_wanted_ = 1;
    extra_env_["GPUAAS_SCHEDULER_PLACEMENT_INDEX"] = "false";
  }
};

TEST_F(SqlPlacementTest, WithoutTheIndexCreatesArePlacedAndRefusedFromSql) {
  EXPECT_EQ(replicas_[0]->placement_index(), nullptr);
  for (int i = 0; i < 2; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  std::map<std::string, int> per_node;
  for (int i = 0; i < 4; ++i) {
    auto a = Create(fmt::format("sql-{}", i), 4);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    per_node[a->allocation().node_id()] += 4;
  }
  EXPECT_EQ(per_node, (std::map<std::string, int>{{"gpu-00", 8}, {"gpu-01", 8}}));
  auto full = Create("sql-full", 1);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().reason, "no_placement");
  EXPECT_EQ(full.error().details.at("free_gpus_of_sku"), "0");
  const auto violations = Invariants();
  EXPECT_TRUE(violations.empty()) << violations.front();
}

}  // namespace
}  // namespace gpuaas::scheduler
