// Allocations against real NATS JetStream and PostgreSQL: the slot projection is fed with
// inventory-shaped events, several scheduler replicas share one database and queue group.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <set>
#include <thread>
#include <tuple>

#include <fmt/format.h>
#include <prometheus/registry.h>

#include "allocation_rows.hpp"
#include "allocation_store.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/group_commit.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/allocations.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "lifecycle.hpp"
#include "load_config.hpp"
#include "saga_store.hpp"
#include "scheduler_fixture.hpp"
#include "scheduler_metrics.hpp"
#include "test_env.hpp"

namespace gpuaas::scheduler {
namespace {

using namespace std::chrono_literals;

TEST(CatalogTest, DefaultCatalogParsesAndValidatesOrders) {
  auto c = Catalog::Parse(Catalog::DefaultYaml());
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  constexpr auto kDefault = v1::NETWORK_MODE_UNSPECIFIED;
  auto ok = c->Validate("h200-sxm-slice", 4, kDefault);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->second, v1::NETWORK_MODE_PRIVATE_NAT);
  EXPECT_EQ(c->Validate("h100-pcie", 1, kDefault).error().reason, "unknown_sku");
  EXPECT_EQ(c->Validate("h200-sxm-slice", 3, kDefault).error().reason, "gpu_count_not_allowed");
  EXPECT_EQ(c->Validate("h200-sxm-slice", 1, v1::NETWORK_MODE_FABRIC_ONLY).error().reason,
            "fabric_only_not_for_slices");
  EXPECT_EQ(c->Validate("h200-sxm-mig-1g", 1, kDefault).error().reason, "shape_not_offered");
  EXPECT_TRUE(c->Validate("h200-sxm-baremetal", 8, v1::NETWORK_MODE_FABRIC_ONLY).ok());
  EXPECT_EQ(c->Validate("h200-sxm-baremetal", 8, v1::NETWORK_MODE_TAILSCALE_OVERLAY).error().reason,
            "network_mode_not_allowed");
  // A number the enum does not declare (a newer client) is refused, not defaulted.
  EXPECT_EQ(c->Validate("h200-sxm-slice", 1, static_cast<v1::NetworkMode>(99)).error().reason,
            "network_mode_invalid");
}

// A SKU bills by its billable_unit; GPU-seconds unless it says otherwise.
TEST(CatalogTest, ASkuNamesTheUnitItsUsageIsBilledBy) {
  auto c = Catalog::Parse(R"(
skus:
  per-gpu:
    shape: gpu_slice
    gpu_sku: h200-sxm
    allowed_gpu_counts: [1]
    network_modes: [private-nat]
  per-node:
    shape: baremetal
    gpu_sku: h200-sxm
    allowed_gpu_counts: [8]
    network_modes: [private-nat]
    billable_unit: node_second
)");
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->Find("per-gpu")->billable_unit, v1::BILLABLE_UNIT_GPU_SECOND);
  EXPECT_EQ(c->Find("per-node")->billable_unit, v1::BILLABLE_UNIT_NODE_SECOND);
  const auto listed = c->ToProto();
  ASSERT_EQ(listed.skus_size(), 2);
  EXPECT_EQ(listed.skus(1).name(), "per-node");
  EXPECT_EQ(listed.skus(1).billable_unit(), v1::BILLABLE_UNIT_NODE_SECOND);
}

TEST(CatalogTest, EveryProblemOfABadCatalogIsReported) {
  auto c = Catalog::Parse(R"(
skus:
  a:
    shape: gpu_slice
    gpu_sku: h200-sxm
    allowed_gpu_counts: [0, 2]
    network_modes: [fabric-only]
    colour: blue
    billable_unit: gpu_minute
  b:
    shape: gpu_shared
    gpu_sku: h200-sxm
    allowed_gpu_counts: [1]
    network_modes: [private-nat]
)");
  ASSERT_FALSE(c.ok());
  const auto& d = c.error().details;
  EXPECT_TRUE(d.count("skus.a.allowed_gpu_counts"));
  EXPECT_TRUE(d.count("skus.a.network_modes"));
  EXPECT_TRUE(d.count("skus.a.colour"));
  EXPECT_TRUE(d.count("skus.a.billable_unit"));
  EXPECT_TRUE(d.count("skus.b.sharing_mechanism"));
  EXPECT_FALSE(Catalog::Parse("skus: {}").ok());
  EXPECT_FALSE(Catalog::Parse(": : :").ok());
}

// fuzz_config (catalog_parse_throws): yaml-cpp's exceptions escaped Parse for these shapes.
TEST(CatalogTest, WrongYamlShapesAreProblemsNotExceptions) {
  const std::string sku =
      "    shape: gpu_slice\n    gpu_sku: h200-sxm\n    allowed_gpu_counts: [1]\n"
      "    network_modes: [private-nat]\n";
  const std::string image =
      "images:\n  ubuntu:\n    url: https://example.test/u.img\n    sha256: " +
      std::string(64, 'a') + "\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"just-a-scalar", "<root>"},
      {"[1, 2]", "<root>"},
      {"skus:\n  {a: 1}:\n" + sku, "skus"},
      {"skus:\n  [x]:\n" + sku, "skus"},
      {"skus:\n  a:\n" + sku + image + "default_image: {x: 1}\n", "default_image"},
      {"skus:\n  a:\n" + sku + image + "default_image: [ubuntu]\n", "default_image"},
      {"skus:\n  a:\n" + sku + "images: [ubuntu]\n", "images"},
      {"skus:\n  a:\n" + sku + "images:\n  {n: 1}: {url: u}\n", "images"},
      {"skus:\n  a:\n" + sku + "images:\n  u:\n    url: {x: 1}\n", "images.u.url"},
      {"skus:\n  a:\n" + sku + "images:\n  u:\n    {k: 1}: 2\n", "images.u"},
  };
  for (const auto& [yaml, key] : cases) {
    Result<Catalog> c = Error::Internal("not_parsed", "");
    ASSERT_NO_THROW(c = Catalog::Parse(yaml)) << yaml;
    ASSERT_FALSE(c.ok()) << yaml;
    EXPECT_EQ(c.error().code, Code::kInvalidArgument) << yaml;
    EXPECT_EQ(c.error().reason, "invalid_catalog") << yaml;
    EXPECT_TRUE(c.error().details.count(key)) << yaml << " -> " << c.error().ToString();
  }
  // The well-formed version of the same catalog parses.
  auto ok = Catalog::Parse("skus:\n  a:\n" + sku + image + "default_image: ubuntu\n");
  ASSERT_TRUE(ok.ok()) << ok.error().ToString();
  EXPECT_NE(ok->Find("a"), nullptr);
}

TEST_F(AllocationTest, SliceIsPlacedOnOneNodeAndAnnounced) {
  AddNode("gpu-01", 8);
  AddNode("gpu-02", 8);
  WaitProjected();
  auto a = Create("req-1", 4);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_TRUE(a->created());
  const auto& al = a->allocation();
  EXPECT_EQ(al.state(), v1::ALLOCATION_STATE_PROVISIONING)
      << "placed, and vm.provision is on its way";
  EXPECT_EQ(al.shape(), v1::CAPACITY_SHAPE_GPU_SLICE);
  EXPECT_EQ(al.billable_unit(), v1::BILLABLE_UNIT_GPU_SECOND) << "the catalog's, kept with it";
  ASSERT_EQ(al.claims_size(), 4);
  std::set<std::string> slots;
  for (const auto& c : al.claims()) {
    EXPECT_EQ(c.node_id(), al.node_id()) << "a multi-GPU slice never spans nodes";
    EXPECT_EQ(c.kind(), v1::CLAIM_KIND_SLOT);
    slots.insert(c.slot_key());
  }
  EXPECT_EQ(slots.size(), 4u);
  for (const char* state : {"reserved", "provisioning"}) {
    EXPECT_TRUE(testing::WaitFor([&] {
      auto n =
          messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_SCHEDULER",
                                        std::string("gpuaas.v1.evt.scheduler.allocation.") + state);
      return n.ok() && *n == 1;
    })) << state;
  }
  // A second 4-GPU slice goes to the already sliced node (clean nodes stay for baremetal).
  auto b = Create("req-2", 4);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->allocation().node_id(), al.node_id());

  v1::GetAllocationRequest g;
  g.set_allocation_id(al.allocation_id());
  auto got = rpc::Client(conn_).Call<v1::GetAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.get", g, 5000ms);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(got->allocation().slot_keys_size(), 4);
  EXPECT_EQ(got->allocation().billable_unit(), v1::BILLABLE_UNIT_GPU_SECOND) << "read back";
  v1::ListAllocationsRequest l;
  l.set_tenant("acme");
  l.set_page_size(1);
  auto page = rpc::Client(conn_).Call<v1::ListAllocationsResponse>(
      "gpuaas.v1.scheduler.allocation.list", l, 5000ms);
  ASSERT_TRUE(page.ok());
  EXPECT_EQ(page->allocations_size(), 1);
  EXPECT_FALSE(page->next_page_token().empty());
  EXPECT_TRUE(Invariants().empty());
}

// catalog.list says where each SKU can be ordered: per region, the free GPUs and the largest
// allocation that fits now, for slices (free slots of slice-vm nodes) and baremetal (baremetal
// nodes nothing holds).
TEST_F(AllocationTest, TheCatalogSaysWhereEachSkuCanBeOrdered) {
  AddNode("gpu-01", 8);
  AddNode("gpu-02", 8);
  AddNode("bm-01", 8, "us-east-1", /*baremetal_profile=*/true);
  AddNode("eu-01", 4, "eu-west-1", false, /*region_enabled=*/false);
  WaitProjected();
  auto availability = [&](const std::string& sku) {
    std::map<std::string, std::tuple<bool, int, int>> out;
    auto c = rpc::Client(conn_).Call<v1::ListCatalogResponse>("gpuaas.v1.scheduler.catalog.list",
                                                              v1::ListCatalogRequest{}, 5000ms);
    EXPECT_TRUE(c.ok()) << c.error().ToString();
    if (!c.ok()) return out;
    for (const auto& s : c->skus()) {
      if (s.name() != sku) continue;
      for (const auto& a : s.availability()) {
        out[a.region()] = {a.region_enabled(), a.free_gpus(), a.max_gpus_per_allocation()};
      }
    }
    return out;
  };
  using T = std::tuple<bool, int, int>;
  auto slice = availability("h200-sxm-slice");
  EXPECT_EQ(slice["us-east-1"], T(true, 16, 8));
  EXPECT_EQ(slice["eu-west-1"], T(false, 0, 0)) << "a disabled region offers nothing";
  EXPECT_EQ(availability("h200-sxm-baremetal")["us-east-1"], T(true, 8, 8))
      << "baremetal only on the baremetal node";

  auto a = Create("req-cat", 4);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  slice = availability("h200-sxm-slice");
  EXPECT_EQ(slice["us-east-1"], T(true, 12, 8)) << "4 taken on one node, the other still whole";
  EXPECT_EQ(availability("h200-sxm-baremetal")["us-east-1"], T(true, 8, 8))
      << "slices never take the baremetal node";
  auto b = Create("req-cat-2", 8, "h200-sxm-baremetal");
  ASSERT_TRUE(b.ok()) << b.error().ToString();
  EXPECT_EQ(b->allocation().node_id(), "bm-01");
  EXPECT_EQ(availability("h200-sxm-slice")["us-east-1"], T(true, 12, 8));
  EXPECT_EQ(availability("h200-sxm-baremetal")["us-east-1"], T(true, 0, 0));
}

// slot.list pages by (node_id, slot_key): every slot exactly once, in order, across pages and
// filters, with a claimed slot showing its allocation; a bad page size or token is refused.
TEST_F(AllocationTest, SlotListPagesThroughEverySlotOnceInOrder) {
  AddNode("page-a", 8);
  AddNode("page-b", 8);
  AddNode("page-c", 8, "eu-west-1");
  WaitProjected();
  auto a = Create("paged", 2);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  auto all = [&](v1::ListProjectedSlotsRequest req, int page_size, int* pages) {
    std::vector<std::string> keys;
    req.set_page_size(page_size);
    *pages = 0;
    do {
      auto l = rpc::Client(conn_).Call<v1::ListProjectedSlotsResponse>(
          "gpuaas.v1.scheduler.slot.list", req, 5000ms);
      EXPECT_TRUE(l.ok()) << l.error().ToString();
      if (!l.ok()) break;
      EXPECT_LE(l->slots_size(), page_size);
      for (const auto& s : l->slots()) {
        keys.push_back(s.node_id() + "/" + s.slot_key());
        if (!s.allocation_id().empty()) {
          EXPECT_EQ(s.allocation_id(), a->allocation().allocation_id());
        }
      }
      ++*pages;
      req.set_page_token(l->next_page_token());
    } while (!req.page_token().empty());
    return keys;
  };
  int pages = 0;
  const auto keys = all({}, 5, &pages);
  EXPECT_EQ(keys.size(), 24u);
  EXPECT_EQ(pages, 5) << "24 slots in pages of 5";
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
  EXPECT_EQ(std::set<std::string>(keys.begin(), keys.end()).size(), keys.size()) << "no repeats";
  EXPECT_EQ(all({}, 24, &pages).size(), 24u);
  EXPECT_EQ(pages, 1) << "a page that holds the rest is the last one";
  v1::ListProjectedSlotsRequest region;
  region.set_region("us-east-1");
  EXPECT_EQ(all(region, 3, &pages).size(), 16u);
  v1::ListProjectedSlotsRequest node;
  node.set_node_id("page-b");
  const auto b = all(node, 7, &pages);
  ASSERT_EQ(b.size(), 8u);
  EXPECT_EQ(pages, 2);
  EXPECT_EQ(b.front().rfind("page-b/", 0), 0u);
  auto claimed = ProjectedSlots();
  ASSERT_TRUE(claimed.ok());
  EXPECT_EQ(std::count_if(claimed->begin(), claimed->end(),
                          [](const v1::ProjectedSlot& s) { return !s.allocation_id().empty(); }),
            2);

  v1::ListProjectedSlotsRequest bad;
  bad.set_page_size(1001);
  auto big = rpc::Client(conn_).Call<v1::ListProjectedSlotsResponse>(
      "gpuaas.v1.scheduler.slot.list", bad, 5000ms);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.error().reason, "invalid_page_size");
  bad.set_page_size(0);
  bad.set_page_token("no-slash");
  auto token = rpc::Client(conn_).Call<v1::ListProjectedSlotsResponse>(
      "gpuaas.v1.scheduler.slot.list", bad, 5000ms);
  ASSERT_FALSE(token.ok());
  EXPECT_EQ(token.error().code, Code::kInvalidArgument);
  EXPECT_EQ(token.error().reason, "invalid_page_token");
}

// The projection's batch path: several events for one slot in a batch leave the newest
// generation (out of order as they may come), and an older event afterwards changes nothing.
TEST_F(AllocationTest, ABatchOfSlotEventsKeepsEachSlotsNewestGeneration) {
  auto event = [](const std::string& slot, int64_t generation, v1::SlotAdminState admin) {
    v1::SlotSnapshot s;
    s.mutable_slot()->set_node_id("batch-n");
    s.mutable_slot()->set_slot_key(slot);
    s.mutable_slot()->set_sku("h200-sxm");
    s.mutable_slot()->set_admin_state(admin);
    s.mutable_slot()->set_health(v1::SLOT_HEALTH_HEALTHY);
    s.mutable_slot()->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
    s.mutable_slot()->set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
    s.mutable_slot()->set_generation(generation);
    s.add_node_blockers("nvme \"odd\", {quoted}");
    s.set_region("us-east-1");
    return outbox::MakeEvent({"gpuaas.v1.evt.inventory.slot.updated", "", "inventory/test",
                              "batch-n/" + slot, generation, "", "", &s});
  };
  const auto g2 = event("s0", 2, v1::SLOT_ADMIN_STATE_AVAILABLE);
  const auto g5 = event("s0", 5, v1::SLOT_ADMIN_STATE_DISABLED);
  const auto g3 = event("s0", 3, v1::SLOT_ADMIN_STATE_AVAILABLE);
  const auto other = event("s1", 1, v1::SLOT_ADMIN_STATE_AVAILABLE);
  auto read = [&](const std::string& slot) {
    return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<std::vector<std::string>> {
      auto r = tx.exec_params(
          "SELECT generation::text, admin_state, last_event_id::text, node_blockers[1] "
          "FROM projected_slots WHERE node_id = 'batch-n' AND slot_key = $1",
          slot);
      if (r.empty()) return std::vector<std::string>{};
      return std::vector<std::string>{r[0][0].c_str(), r[0][1].c_str(), r[0][2].c_str(),
                                      r[0][3].c_str()};
    });
  };
  auto applied = store::WithTx(*pool_, [&](pqxx::work& tx) {
    return ApplySlotEvents(tx, {&g2, &g5, &g3, &other});
  });
  ASSERT_TRUE(applied.ok()) << applied.error().ToString();
  auto s0 = read("s0");
  ASSERT_TRUE(s0.ok());
  ASSERT_EQ(s0->size(), 4u);
  EXPECT_EQ((*s0)[0], "5");
  EXPECT_EQ((*s0)[1], "disabled");
  EXPECT_EQ((*s0)[2], g5.id());
  EXPECT_EQ((*s0)[3], "nvme \"odd\", {quoted}");
  auto s1 = read("s1");
  ASSERT_TRUE(s1.ok());
  EXPECT_EQ(s1->size(), 4u);
  const auto g4 = event("s0", 4, v1::SLOT_ADMIN_STATE_AVAILABLE);
  ASSERT_TRUE(store::WithTx(*pool_, [&](pqxx::work& tx) { return ApplySlotEvent(tx, g4); }).ok());
  s0 = read("s0");
  ASSERT_TRUE(s0.ok());
  EXPECT_EQ((*s0)[0], "5") << "an older generation changes nothing";
}

// The node projection's batch path, likewise: the newest generation per node whatever the
// order in the batch, and a malformed event fails the batch (one by one rejects just it).
TEST_F(AllocationTest, ABatchOfNodeEventsKeepsEachNodesNewestGeneration) {
  auto event = [](const std::string& node, int64_t generation, const std::string& hostname) {
    v1::NodeSnapshot n;
    n.mutable_node()->set_node_id(node);
    n.mutable_node()->set_hostname(hostname);
    n.mutable_node()->set_region("us-east-1");
    n.mutable_node()->set_pool("h200");
    n.mutable_node()->set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
    n.mutable_node()->set_generation(generation);
    return outbox::MakeEvent({"gpuaas.v1.evt.inventory.node.registered", "", "inventory/test", node,
                              generation, "", "", &n});
  };
  const auto a2 = event("batch-a", 2, "a-two");
  const auto a7 = event("batch-a", 7, "a-seven");
  const auto a5 = event("batch-a", 5, "a-five");
  const auto b1 = event("batch-b", 1, "b-one");
  auto applied = store::WithTx(*pool_, [&](pqxx::work& tx) {
    return ApplyNodeEvents(tx, {&a2, &a7, &a5, &b1});
  });
  ASSERT_TRUE(applied.ok()) << applied.error().ToString();
  auto read = [&](const std::string& node) {
    return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<std::string> {
      auto r = tx.exec_params(
          "SELECT hostname || '/' || generation || '/' || last_event_id FROM projected_nodes "
          "WHERE node_id = $1",
          node);
      return r.empty() ? std::string() : r[0][0].as<std::string>();
    });
  };
  EXPECT_EQ(*read("batch-a"), "a-seven/7/" + a7.id());
  EXPECT_EQ(*read("batch-b"), "b-one/1/" + b1.id());
  auto older = store::WithTx(*pool_, [&](pqxx::work& tx) { return ApplyNodeEvent(tx, a5); });
  ASSERT_TRUE(older.ok());
  EXPECT_EQ(*read("batch-a"), "a-seven/7/" + a7.id()) << "an older generation changes nothing";
  v1::Event bad = b1;
  bad.mutable_data()->set_type_url("type.googleapis.com/gpuaas.v1.SlotSnapshot");
  auto refused = store::WithTx(*pool_, [&](pqxx::work& tx) {
    return ApplyNodeEvents(tx, {&a2, &bad});
  });
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().reason, "malformed_event");
}

// gpuaas_allocations{state} comes from counts a trigger keeps per backend (no scan of every
// allocation every 5 s): they equal the table's after creates and state changes, and a gone
// backend's counts are folded into shard 0 without changing the sums.
TEST_F(AllocationTest, AllocationGaugesCountFromTheTriggersCountsThroughGoneBackends) {
  AddNode("count-a", 8);
  WaitProjected();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(Create(fmt::format("count-{}", i), 1).ok());
  // A state change by a connection that then goes away.
  int gone_pid = 0;
  {
    pqxx::connection c(dsn_);
    gone_pid = c.backendpid();
    pqxx::work tx(c);
    tx.exec(
        "WITH a AS (UPDATE allocations SET state = 'failed' WHERE request_id = 'count-0' "
        "RETURNING allocation_id) UPDATE allocation_resource_claims SET released_at = now(), "
        "phase = 'released' "
        "WHERE allocation_id IN (SELECT allocation_id FROM a)");
    tx.commit();
  }
  EXPECT_TRUE(Invariants().empty()) << ::testing::PrintToString(Invariants());
  prometheus::Registry registry;
  auto sampler = StartAllocationGauges(pool_, registry, log::Logger("test", "t", log::Level::kWarn),
                                       std::chrono::milliseconds(50));
  auto gauge = [&](const std::string& state) {
    for (const auto& fam : registry.Collect()) {
      if (fam.name != "gpuaas_allocations") continue;
      for (const auto& m : fam.metric) {
        for (const auto& l : m.label) {
          if (l.name == "state" && l.value == state) return m.gauge.value;
        }
      }
    }
    return -1.0;
  };
  auto rows_of = [&](int pid) {
    auto n = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<int64_t> {
      return tx
          .exec_params1("SELECT count(*) FROM allocation_state_counts WHERE shard = $1", pid)[0]
          .as<int64_t>();
    });
    return n.ok() ? *n : -1;
  };
  EXPECT_TRUE(testing::WaitFor([&] { return rows_of(gone_pid) == 0 && gauge("failed") == 1; }))
      << "rows of the gone backend: " << rows_of(gone_pid) << ", failed: " << gauge("failed");
  EXPECT_EQ(gauge("provisioning"), 2);
  EXPECT_EQ(gauge("active"), 0) << "every state is present";
  sampler->Stop();
  EXPECT_TRUE(Invariants().empty()) << ::testing::PrintToString(Invariants());
}

// A retried create finds its allocation by one probe of the (tenant, request_id) key, also
// when the statistics predate the tenant's allocations (they said no such tenant: the planner
// then walked every allocation of the tenant).
TEST_F(AllocationTest, ARetryFindsItsAllocationWithoutReadingTheTenantsOthers) {
  pqxx::connection c(dsn_);
  {
    pqxx::work tx(c);
    const auto fill = [&](const std::string& tenant, int n) {
      tx.exec_params(
          "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, gpu_count, "
          "region, network_mode, state, generation) SELECT gen_random_uuid(), $1, 'r-' || i, "
          "'h200-sxm-slice', 'gpu_slice', 1, 'us-east-1', 'private-nat', 'released', 1 FROM "
          "generate_series(1, $2) i",
          tenant, n);
    };
    fill("old-tenant", 500);
    tx.exec("ANALYZE allocations");
    fill("new-tenant", 500);
    tx.commit();
  }
  pqxx::connection fresh(dsn_);  // its statistics show this transaction's reads alone
  pqxx::work tx(fresh);
  auto found = FindByRequest(tx, "new-tenant", "r-250");
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->request_id(), "r-250");
  EXPECT_FALSE(FindByRequest(tx, "new-tenant", "r-9999").has_value());
  auto fetched = tx.exec(
      "SELECT coalesce(idx_tup_fetch, 0) + coalesce(seq_tup_read, 0) FROM "
      "pg_stat_xact_user_tables WHERE relname = 'allocations'");
  ASSERT_EQ(fetched.size(), 1u);
  EXPECT_LE(fetched[0][0].as<int64_t>(), 1) << "allocations read to find one";
}

// Every node held by someone else: after the skipping rounds the create waits for a node's row,
// and a wait that runs past lock_timeout gives way to the next choice in the same transaction;
// once the holder lets go, the create is placed.
TEST_F(AllocationTest, AChoiceWhoseLockWaitTimesOutGivesWayToTheNext) {
  AddNode("wait-a", 8);
  AddNode("wait-b", 8);
  WaitProjected();
  pqxx::connection holder(dsn_);
  pqxx::work held(holder);
  held.exec("SELECT 1 FROM projected_nodes WHERE node_id IN ('wait-a', 'wait-b') FOR UPDATE");
  Result<v1::CreateAllocationResponse> created = Error::Internal("unset", "unset");
  std::thread create([&] { created = Create("wait-1", 1); });
  pqxx::connection watch(dsn_);
  // The create's backend waiting for a row lock, and since when.
  const auto waiting_since = [&]() -> std::string {
    pqxx::nontransaction q(watch);
    auto r = q.exec(
        "SELECT query_start::text FROM pg_stat_activity WHERE datname = current_database() AND "
        "wait_event_type = 'Lock' AND query LIKE '%projected_nodes%'");
    return r.empty() ? "" : r[0][0].as<std::string>();
  };
  std::string first;
  ASSERT_TRUE(testing::WaitFor([&] { return !(first = waiting_since()).empty(); }, 10s));
  // The first wait ran out: the create waits again, in a later statement (the next choice).
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        const std::string now = waiting_since();
        return !now.empty() && now != first;
      },
      10s));
  held.abort();
  create.join();
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  EXPECT_EQ(created->allocation().slot_keys_size(), 1);
  // In the transaction it started in: not failed and run again (a group commit runs a unit
  // whose statement failed again alone).
  const store::GroupCommit* group = replicas_.front()->group_commit();
  ASSERT_NE(group, nullptr);
  EXPECT_EQ(group->stats().alone, 0u) << "the create failed once and was run again";
  EXPECT_TRUE(Invariants().empty()) << ::testing::PrintToString(Invariants());
}

TEST_F(AllocationTest, InvalidRequestsGetTheirOwnErrors) {
  AddNode("gpu-01", 8);
  AddNode("gpu-off", 8, "eu-west-1", false, /*region_enabled=*/false);
  WaitProjected();
  EXPECT_EQ(Create("r1", 1, "h100-pcie").error().reason, "unknown_sku");
  EXPECT_EQ(Create("r2", 3).error().reason, "gpu_count_not_allowed");
  EXPECT_EQ(
      Create("r3", 1, "h200-sxm-slice", "us-east-1", v1::NETWORK_MODE_FABRIC_ONLY).error().reason,
      "fabric_only_not_for_slices");
  EXPECT_EQ(Create("r4", 1, "h200-sxm-mig-1g").error().reason, "shape_not_offered");
  auto off = Create("r5", 1, "h200-sxm-slice", "eu-west-1");
  EXPECT_EQ(off.error().reason, "region_disabled");
  EXPECT_EQ(off.error().code, Code::kFailedPrecondition);
  auto bad = Create("", 1, "h200-sxm-slice", "US EAST");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_allocation_request");
  EXPECT_TRUE(bad.error().details.count("request_id"));
  EXPECT_TRUE(bad.error().details.count("region"));
  v1::GetAllocationRequest g;
  g.set_allocation_id("0190b5a0-0000-7000-8000-000000000000");
  auto unknown = rpc::Client(conn_).Call<v1::GetAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.get", g, 5000ms);
  EXPECT_EQ(unknown.error().reason, "allocation_not_found");
  EXPECT_EQ(Release("not-a-uuid").error().reason, "invalid_allocation_id");
}

TEST_F(AllocationTest, NoPlacementSaysWhyWithCounts) {
  // Three nodes with 3 free GPUs each: 9 free in aggregate, no node with 4.
  for (int i = 0; i < 3; ++i) AddNode(fmt::format("gpu-0{}", i), 3);
  AddNode("gpu-roce", 8, "us-east-1", false, true, v1::FABRIC_TYPE_ROCE);
  WaitProjected();
  auto r = Create("big", 4);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kResourceExhausted);
  EXPECT_EQ(r.error().reason, "no_placement");
  const auto& d = r.error().details;
  EXPECT_EQ(d.at("free_gpus_matching_fabric"), "9");
  EXPECT_EQ(d.at("max_free_matching_on_one_node"), "3");
  EXPECT_EQ(d.at("nodes_with_enough_free_slots"), "0");
  EXPECT_EQ(d.at("nodes_with_wrong_fabric"), "1");
  EXPECT_EQ(d.at("free_gpus_in_region"), "17");
}

TEST_F(AllocationTest, IncompleteSlotsAreIgnoredEvenWhenMarkedAvailable) {
  AddNode("gpu-01", 2);
  WaitProjected();
  // A later snapshot of one slot loses its MAC/IP binding but still says available.
  v1::SlotSnapshot s;
  auto* sl = s.mutable_slot();
  sl->set_node_id("gpu-01");
  sl->set_slot_key("gpu-0000:19:00.0");
  sl->set_gpu_pci_address("0000:19:00.0");
  sl->set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
  sl->set_health(v1::SLOT_HEALTH_HEALTHY);
  sl->set_sku("h200-sxm");
  sl->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
  sl->set_nvme_by_id("/dev/disk/by-id/nvme-eui.x");
  sl->set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
  sl->set_fabric_vf_pci_address("0000:41:00.1");
  sl->set_generation(2);
  s.set_region("us-east-1");
  s.set_pool("h200");
  s.set_region_enabled(true);
  s.set_schedulable(true);
  Publish("gpuaas.v1.evt.inventory.slot.updated", s, "gpu-01/" + sl->slot_key(), 2);
  ASSERT_TRUE(testing::WaitFor([&] {
    v1::ListProjectedSlotsRequest req;
    req.set_node_id("gpu-01");
    auto l = rpc::Client(conn_).Call<v1::ListProjectedSlotsResponse>(
        "gpuaas.v1.scheduler.slot.list", req, 5000ms);
    if (!l.ok()) return false;
    for (const auto& x : l->slots()) {
      if (x.slot_key() == sl->slot_key()) return x.generation() == 2;
    }
    return false;
  }));
  auto r = Create("two", 2);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().details.at("incomplete_slots_ignored"), "1");
  EXPECT_EQ(r.error().details.at("max_free_matching_on_one_node"), "1");
  auto one = Create("one", 1);
  ASSERT_TRUE(one.ok());
  EXPECT_EQ(one->allocation().slot_keys(0), "gpu-0000:18:00.0");
}

TEST_F(AllocationTest, BaremetalAndSlicesNeverShareANode) {
  AddNode("bm-01", 8, "us-east-1", /*baremetal_profile=*/true);
  AddNode("gpu-01", 8);
  WaitProjected();
  auto bm = Create("bm", 8, "h200-sxm-baremetal");
  ASSERT_TRUE(bm.ok()) << bm.error().ToString();
  EXPECT_EQ(bm->allocation().node_id(), "bm-01");
  ASSERT_EQ(bm->allocation().claims_size(), 1);
  EXPECT_EQ(bm->allocation().claims(0).kind(), v1::CLAIM_KIND_NODE_EXCLUSIVE);
  // Slices fill gpu-01 only; once full, nothing lands on the baremetal node.
  auto s = Create("s8", 8);
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->allocation().node_id(), "gpu-01");
  auto none = Create("s1", 1);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().reason, "no_placement");
  // A sliced node never goes to baremetal either.
  auto bm2 = Create("bm2", 8, "h200-sxm-baremetal");
  ASSERT_FALSE(bm2.ok());
  EXPECT_EQ(bm2.error().reason, "no_placement");
  // Force-release (admin) frees the node.
  auto f = Release(bm->allocation().allocation_id(), true);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->allocation().state(), v1::ALLOCATION_STATE_RELEASED);
  // Freed for baremetal again; slices are sold only on slice-vm nodes.
  EXPECT_EQ(Create("s1-again", 1).error().reason, "no_placement");
  EXPECT_TRUE(Create("bm-again", 8, "h200-sxm-baremetal").ok());
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(AllocationTest, ConcurrentCreatorsOnThreeReplicasNeverDoubleBook) {
  for (int i = 0; i < 10; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  const std::vector<int> sizes = {1, 2, 4, 1, 8, 2, 1, 4};
  std::atomic<int> placed_gpus{0}, placed{0}, exhausted{0}, other{0};
  std::vector<std::thread> threads;
  threads.reserve(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 8; ++i) {
        const int gpus = sizes[(t + i) % sizes.size()];
        auto r = Create(fmt::format("c-{}-{}", t, i), gpus);
        if (r.ok()) {
          placed++;
          placed_gpus += gpus;
        } else if (r.error().reason == "no_placement") {
          exhausted++;
        } else {
          other++;
          ADD_FAILURE() << r.error().ToString();
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_LE(placed_gpus.load(), 80);
  EXPECT_GE(placed_gpus.load(), 60) << "placement should not give up while capacity is free";
  const auto violations = Invariants();
  EXPECT_TRUE(violations.empty()) << violations.front();
  int claimed = 0;
  auto c = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    claimed =
        tx.exec1("SELECT count(*) FROM allocation_resource_claims WHERE released_at IS NULL")[0]
            .as<int>();
    return Ok();
  });
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(claimed, placed_gpus.load());
}

// A claim's stamps are the moments its rows were written, not its transaction's start. A create
// late in a group transaction may take a slot whose release committed after that transaction
// began; stamped with now() the new claim seemed to start before the old one ended (the long
// chaos run's double_booked=2), though the unique index never let both be live.
TEST_F(AllocationTest, AClaimTakenAfterAReleaseStartsAfterTheReleasedOneEnds) {
  AddNode("stamp-a", 1);
  AddNode("stamp-b", 1);
  WaitProjected();
  auto first = Create("stamp-first", 1);
  auto second = Create("stamp-second", 1);
  ASSERT_TRUE(first.ok() && second.ok());
  pqxx::connection late(dsn_);
  pqxx::work group(late);  // begun before the release
  group.exec("SELECT 1");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  std::string node;
  std::string slot;
  ASSERT_TRUE(store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
                auto r = tx.exec_params1(
                    "SELECT node_id, slot_key FROM allocation_resource_claims WHERE "
                    "allocation_id = $1::uuid",
                    first->allocation().allocation_id());
                node = r[0].as<std::string>();
                slot = r[1].as<std::string>();
                EXPECT_EQ(FreeClaims(tx, first->allocation().allocation_id()), 1);
                return Ok();
              }).ok());
  InsertSlotClaims(group, second->allocation().allocation_id(), node, {slot});
  group.commit();
  pqxx::connection db(dsn_);
  pqxx::nontransaction check(db);
  const auto overlap = check.exec_params1(
      "SELECT count(*) FROM allocation_resource_claims a JOIN allocation_resource_claims b ON "
      "a.node_id = b.node_id AND a.slot_key = b.slot_key AND a.allocation_id <> b.allocation_id "
      "WHERE a.node_id = $1 AND a.slot_key = $2 AND a.claimed_at < coalesce(b.released_at, "
      "'infinity') AND b.claimed_at < coalesce(a.released_at, 'infinity')",
      node, slot)[0];
  EXPECT_EQ(overlap.as<int>(), 0);
}

// A state change is stamped when it is written, not when its transaction began: the usage
// ledger bills from `updated_at`, and a transaction that waited (a batch under 200 ms of added
// latency, a lost packet's retransmissions) billed seconds the tenant never had (the long chaos
// run's usage_diff=5).
TEST_F(AllocationTest, AStateChangeIsStampedWhenItIsWrittenNotWhenItsTransactionBegan) {
  AddNode("stamp-state", 1);
  WaitProjected();
  auto a = Create("stamp-state-1", 1);
  ASSERT_TRUE(a.ok());
  pqxx::connection c(dsn_);
  pqxx::work tx(c);
  tx.exec("SELECT 1");
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  SetAllocationState(tx, a->allocation().allocation_id(), v1::ALLOCATION_STATE_FAILED, false, "",
                     "", "");
  const auto waited = tx.exec_params1(
      "SELECT extract(epoch from updated_at - now()) FROM allocations WHERE allocation_id = $1",
      a->allocation().allocation_id())[0];
  EXPECT_GE(waited.as<double>(), 0.19);
}

// Group commit (scheduler.group_commit, on by default): creates that arrive together share a
// transaction and its commit; one that fails inside it (no capacity in its region) is undone on
// its own and answered with its error, while the rest of its group commits.
class GroupCommitTest : public AllocationTest {
 protected:
  GroupCommitTest() {
    replicas_wanted_ = 1;
    extra_env_["GPUAAS_RPC_WORKERS"] = "12";
  }
};

TEST_F(GroupCommitTest, AGroupInWhichOneCreateFailsStillCommitsTheOthers) {
  for (int i = 0; i < 4; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  constexpr int kCreators = 12;
  std::vector<Result<v1::CreateAllocationResponse>> results(
      kCreators, Result<v1::CreateAllocationResponse>(Error::Internal("unset", "")));
  std::atomic<int> ready{0};
  std::vector<std::thread> threads;
  threads.reserve(kCreators);
  for (int i = 0; i < kCreators; ++i) {
    threads.emplace_back([&, i] {
      ready++;
      while (ready < kCreators) std::this_thread::yield();
      // Creator 5 asks for a region with no nodes; 10 and 11 send one request id twice.
      const std::string id = i == 11 ? "gc-10" : fmt::format("gc-{}", i);
      results[static_cast<size_t>(i)] =
          Create(id, 2, "h200-sxm-slice", i == 5 ? "eu-west-9" : "us-east-1");
    });
  }
  for (auto& t : threads) t.join();
  std::set<std::string> allocations;
  for (int i = 0; i < kCreators; ++i) {
    const auto& r = results[static_cast<size_t>(i)];
    if (i == 5) {
      ASSERT_FALSE(r.ok());
      EXPECT_EQ(r.error().reason, "no_placement") << r.error().ToString();
      continue;
    }
    ASSERT_TRUE(r.ok()) << i << ": " << r.error().ToString();
    allocations.insert(r->allocation().allocation_id());
  }
  EXPECT_EQ(allocations.size(), 10u) << "one allocation for the request id sent twice";
  EXPECT_EQ(results[10]->allocation().allocation_id(), results[11]->allocation().allocation_id());
  const auto violations = Invariants();
  EXPECT_TRUE(violations.empty()) << violations.front();
  int live = 0;
  ASSERT_TRUE(
      store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
        live = tx.exec1("SELECT count(*) FROM allocations WHERE state <> 'released'")[0].as<int>();
        return Ok();
      }).ok());
  EXPECT_EQ(live, 10);
  const auto stats = replicas_[0]->group_commit()->stats();
  EXPECT_EQ(stats.units, 11u) << "every create answered ok committed through a group";
  EXPECT_GE(stats.largest, 2u) << "creates that overlapped shared a commit";
  EXPECT_LT(stats.groups, 11u);
}

TEST_F(AllocationTest, RetriesOfOneRequestIdAtOnceAllGetTheOneAllocation) {
  for (int i = 0; i < 4; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  for (int round = 0; round < 5; ++round) {
    const std::string request_id = fmt::format("same-{}", round);
    std::vector<Result<v1::CreateAllocationResponse>> got(
        12, Error::Internal("not_run", "the thread did not run"));
    std::vector<std::thread> threads;
    threads.reserve(got.size());
    for (size_t t = 0; t < got.size(); ++t) {
      threads.emplace_back([&, t] { got[t] = Create(request_id, 1); });
    }
    for (auto& th : threads) th.join();
    std::set<std::string> ids;
    int created = 0;
    for (const auto& r : got) {
      ASSERT_TRUE(r.ok()) << r.error().ToString();
      ids.insert(r->allocation().allocation_id());
      created += r->created() ? 1 : 0;
    }
    EXPECT_EQ(ids.size(), 1u) << "every retry of a request id gets the same allocation";
    EXPECT_EQ(created, 1);
  }
  const auto violations = Invariants();
  EXPECT_TRUE(violations.empty()) << violations.front();
}

TEST_F(AllocationTest, ContendedCreatesAreNotRefusedWhileCapacityExists) {
  // 4 nodes x 8 free slots and 16 two-GPU requests at once: exactly enough, whatever the order.
  for (int i = 0; i < 4; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  std::vector<Result<v1::CreateAllocationResponse>> got(
      16, Error::Internal("not_run", "the thread did not run"));
  std::vector<std::thread> threads;
  threads.reserve(got.size());
  for (size_t t = 0; t < got.size(); ++t) {
    threads.emplace_back([&, t] { got[t] = Create(fmt::format("pair-{}", t), 2); });
  }
  for (auto& th : threads) th.join();
  for (const auto& r : got) {
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  const auto violations = Invariants();
  EXPECT_TRUE(violations.empty()) << violations.front();
  // Full now: the next one is refused, and its counts say why.
  auto full = Create("one-more", 2);
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().reason, "no_placement");
  EXPECT_EQ(full.error().details.at("max_free_matching_on_one_node"), "0");
}

TEST_F(AllocationTest, InvariantCheckerFindsWhatItLooksFor) {
  AddNode("gpu-01", 8);
  WaitProjected();
  auto a = Create("a", 2);
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Invariants().empty());
  // Corrupt the tables the way a bug would (bypassing the service): a released allocation that
  // keeps a live claim, and an exclusive claim next to slot claims.
  auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    tx.exec_params("UPDATE allocations SET state = 'released' WHERE allocation_id = $1",
                   a->allocation().allocation_id());
    tx.exec_params(
        "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, gpu_count, "
        "region, network_mode, state, node_id, generation) VALUES "
        "('0190b5a0-0000-7000-8000-0000000000ff', 'acme', 'bm', 'h200-sxm-baremetal', "
        "'baremetal', 8, 'us-east-1', 'private-nat', 'reserved', 'gpu-01', 1)");
    tx.exec(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, kind) VALUES "
        "('0190b5a0-0000-7000-8000-0000000000ff', 'gpu-01', 'node_exclusive')");
    return Ok();
  });
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  const auto v = Invariants();
  ASSERT_EQ(v.size(), 2u) << ::testing::PrintToString(v);
  EXPECT_NE(v[0].find("exclusive claim and others"), std::string::npos) << v[0];
  EXPECT_NE(v[1].find("while the allocation is released"), std::string::npos) << v[1];
}

// The invariant checker and the lifecycle table agree on which claim phases each allocation state
// may hold: every (state, phase) pair is written to the tables and checked.
TEST_F(AllocationTest, InvariantCheckerAcceptsExactlyTheLifecycleTablesClaimPhases) {
  struct Case {
    std::string id;
    v1::AllocationState state;
    v1::ClaimPhase phase;
  };
  std::vector<Case> cases;
  int n = 0;
  for (auto st : lifecycle::AllStates()) {
    for (const auto& text : enums::Texts<v1::ClaimPhase>()) {
      const auto ph = *enums::Parse<v1::ClaimPhase>(text);
      if (ph == v1::CLAIM_PHASE_RELEASED) continue;  // not a live claim
      cases.push_back({ids::NewUuidV7(), st, ph});
      auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
        tx.exec_params(
            "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, gpu_count, "
            "region, network_mode, state, node_id, generation) VALUES ($1, 'acme', $3, "
            "'h200-sxm-slice', 'gpu_slice', 1, 'us-east-1', 'private-nat', $2, 'gpu-x', 1)",
            cases.back().id, enums::Text(st), "r-" + cases.back().id);
        tx.exec_params(
            "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_key, kind, "
            "phase) VALUES ($1, 'gpu-x', $2, 'slot', $3)",
            cases.back().id, fmt::format("gpu-{}", n++), enums::Text(ph));
        return Ok();
      });
      ASSERT_TRUE(r.ok()) << r.error().ToString();
    }
  }
  const auto v = Invariants();
  int flagged = 0;
  for (const auto& c : cases) {
    const auto live = lifecycle::LiveClaimPhases(c.state);
    const bool allowed = std::count(live.begin(), live.end(), c.phase) > 0;
    int found = 0;
    for (const auto& line : v) {
      if (line.find(c.id) != std::string::npos) ++found;
    }
    EXPECT_EQ(found, allowed ? 0 : 1)
        << enums::Text(c.state) << " with a claim " << enums::Text(c.phase) << ": "
        << ::testing::PrintToString(v);
    flagged += found;
  }
  EXPECT_EQ(static_cast<size_t>(flagged), v.size()) << "only the pairs the table forbids";
  EXPECT_GT(flagged, 0);
}

}  // namespace
}  // namespace gpuaas::scheduler
