// Allocations against real NATS JetStream and PostgreSQL: the slot projection is fed with
// inventory-shaped events, several scheduler replicas share one database and queue group.
#include <gtest/gtest.h>

#include <atomic>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "allocations.hpp"
#include "catalog.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "scheduler_service.hpp"
#include "test_env.hpp"

namespace gpuaas::scheduler {
namespace {

using namespace std::chrono_literals;

TEST(CatalogTest, DefaultCatalogParsesAndValidatesOrders) {
  auto c = Catalog::Parse(Catalog::DefaultYaml());
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  auto ok = c->Validate("h200-sxm-slice", 4, "");
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->second, "private-nat");
  EXPECT_EQ(c->Validate("h100-pcie", 1, "").error().reason, "unknown_sku");
  EXPECT_EQ(c->Validate("h200-sxm-slice", 3, "").error().reason, "gpu_count_not_allowed");
  EXPECT_EQ(c->Validate("h200-sxm-slice", 1, "fabric-only").error().reason,
            "fabric_only_not_for_slices");
  EXPECT_EQ(c->Validate("h200-sxm-mig-1g", 1, "").error().reason, "shape_not_offered");
  EXPECT_TRUE(c->Validate("h200-sxm-baremetal", 8, "fabric-only").ok());
  EXPECT_EQ(c->Validate("h200-sxm-baremetal", 8, "bridged").error().reason,
            "network_mode_not_allowed");
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
  EXPECT_TRUE(d.count("skus.b.sharing_mechanism"));
  EXPECT_FALSE(Catalog::Parse("skus: {}").ok());
  EXPECT_FALSE(Catalog::Parse(": : :").ok());
}

class AllocationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dsn_ = testing::SharedPostgres().CreateDatabase("sched");
    for (int i = 0; i < 3; ++i) StartReplica();
    auto c = messaging::Connection::Connect({nats_.url(), "test", 2000, 100, false},
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
    store::PoolOptions po;
    po.dsn = dsn_;
    pool_ = std::make_shared<store::Pool>(po, log::Logger("test", "t", log::Level::kWarn));
  }
  void TearDown() override {
    for (auto& r : replicas_) r->Shutdown();
  }
  void StartReplica() {
    replicas_.push_back(std::make_unique<SchedulerService>(
        LoadConfig<SchedulerConfig>({{"GPUAAS_NATS_URL", nats_.url()},
                                     {"GPUAAS_POSTGRES_DSN", dsn_},
                                     {"GPUAAS_LOG_LEVEL", "error"}})));
    auto r = replicas_.back()->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  void Publish(const std::string& subject, const google::protobuf::Message& data,
               const std::string& entity, int64_t generation) {
    const auto ev =
        outbox::MakeEvent({subject, "", "inventory/test", entity, generation, "", "", &data});
    ASSERT_TRUE(messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id()).ok());
  }
  // A node with `slots` approved slots: 2 NUMA nodes x 2 switches.
  void AddNode(const std::string& id, int slots, const std::string& region = "us-east-1",
               bool baremetal_profile = false, bool region_enabled = true,
               const std::string& fabric = "infiniband") {
    v1::NodeSnapshot n;
    n.mutable_node()->set_node_id(id);
    n.mutable_node()->set_hostname(id);
    n.mutable_node()->set_region(region);
    n.mutable_node()->set_pool("h200");
    n.mutable_node()->set_capacity_profile(baremetal_profile ? v1::CAPACITY_PROFILE_BAREMETAL
                                                             : v1::CAPACITY_PROFILE_SLICE_VM);
    n.mutable_node()->set_generation(1);
    Publish("gpuaas.v1.evt.inventory.node.registered", n, id, 1);
    ++nodes_published_;
    for (int i = 0; i < slots; ++i) {
      v1::SlotSnapshot s;
      auto* sl = s.mutable_slot();
      sl->set_node_id(id);
      sl->set_slot_key(fmt::format("gpu-0000:{:02x}:00.0", 0x18 + i));
      sl->set_admin_state("available");
      sl->set_health("healthy");
      sl->set_sku("h200-sxm");
      sl->set_numa_node(i / 4);
      sl->set_pcie_switch(fmt::format("sw{}", i / 2));
      sl->set_fabric_type(fabric);
      sl->set_generation(1);
      s.set_region(region);
      s.set_pool("h200");
      s.set_region_enabled(region_enabled);
      s.set_schedulable(region_enabled);
      Publish("gpuaas.v1.evt.inventory.slot.updated", s, id + "/" + sl->slot_key(), 1);
      ++slots_published_;
    }
  }
  void WaitProjected() {
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          auto l = rpc::Client(conn_).Call<v1::ListProjectedSlotsResponse>(
              "gpuaas.v1.scheduler.slot.list", v1::ListProjectedSlotsRequest(), 5000ms);
          // Slices also need the node row (it is what baremetal placement locks).
          auto n = rpc::Client(conn_).Call<v1::ListProjectedNodesResponse>(
              "gpuaas.v1.scheduler.node.list", v1::ListProjectedNodesRequest(), 5000ms);
          return l.ok() && l->slots_size() == slots_published_ && n.ok() &&
                 n->nodes_size() == nodes_published_;
        },
        15s));
  }
  Result<v1::CreateAllocationResponse> Create(const std::string& request_id, int gpus,
                                              const std::string& sku = "h200-sxm-slice",
                                              const std::string& region = "us-east-1",
                                              const std::string& mode = "") {
    v1::CreateAllocationRequest r;
    r.set_tenant("acme");
    r.set_request_id(request_id);
    r.set_sku(sku);
    r.set_gpu_count(gpus);
    r.set_region(region);
    r.set_network_mode(mode);
    return rpc::Client(conn_).Call<v1::CreateAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.create", r, 10000ms);
  }
  Result<v1::ReleaseAllocationResponse> Release(const std::string& id, bool force = false) {
    v1::ReleaseAllocationRequest r;
    r.set_allocation_id(id);
    r.set_force(force);
    return rpc::Client(conn_).Call<v1::ReleaseAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.release", r, 10000ms);
  }
  std::vector<std::string> Invariants() {
    std::vector<std::string> out;
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
      out = CheckInvariants(tx);
      return Ok();
    });
    EXPECT_TRUE(r.ok());
    return out;
  }

  testing::TestNats nats_;
  std::string dsn_;
  std::vector<std::unique_ptr<SchedulerService>> replicas_;
  std::shared_ptr<messaging::Connection> conn_;
  std::shared_ptr<store::Pool> pool_;
  int slots_published_ = 0;
  int nodes_published_ = 0;
};

TEST_F(AllocationTest, SliceIsPlacedOnOneNodeAndAnnounced) {
  AddNode("gpu-01", 8);
  AddNode("gpu-02", 8);
  WaitProjected();
  auto a = Create("req-1", 4);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_TRUE(a->created());
  const auto& al = a->allocation();
  EXPECT_EQ(al.state(), "reserved");
  EXPECT_EQ(al.shape(), v1::CAPACITY_SHAPE_GPU_SLICE);
  ASSERT_EQ(al.claims_size(), 4);
  std::set<std::string> slots;
  for (const auto& c : al.claims()) {
    EXPECT_EQ(c.node_id(), al.node_id()) << "a multi-GPU slice never spans nodes";
    EXPECT_EQ(c.kind(), "slot");
    slots.insert(c.slot_key());
  }
  EXPECT_EQ(slots.size(), 4u);
  EXPECT_TRUE(testing::WaitFor([&] {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_SCHEDULER",
                                           "gpuaas.v1.evt.scheduler.allocation.reserved");
    return n.ok() && *n == 1;
  }));
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

TEST_F(AllocationTest, RetriedCreateAndRepeatedReleaseHaveNoDoubleEffect) {
  AddNode("gpu-01", 8);
  WaitProjected();
  auto a = Create("same", 2);
  ASSERT_TRUE(a.ok());
  auto again = Create("same", 2);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->allocation().allocation_id(), a->allocation().allocation_id());
  auto r1 = Release(a->allocation().allocation_id());
  ASSERT_TRUE(r1.ok()) << r1.error().ToString();
  EXPECT_EQ(r1->allocation().state(), "released");
  for (const auto& c : r1->allocation().claims()) EXPECT_TRUE(c.has_released_at());
  auto r2 = Release(a->allocation().allocation_id());
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->allocation().generation(), r1->allocation().generation());
  // The slots are free again: all 8 can be taken.
  auto full = Create("full", 8);
  ASSERT_TRUE(full.ok()) << full.error().ToString();
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(AllocationTest, InvalidRequestsGetTheirOwnErrors) {
  AddNode("gpu-01", 8);
  AddNode("gpu-off", 8, "eu-west-1", false, /*region_enabled=*/false);
  WaitProjected();
  EXPECT_EQ(Create("r1", 1, "h100-pcie").error().reason, "unknown_sku");
  EXPECT_EQ(Create("r2", 3).error().reason, "gpu_count_not_allowed");
  EXPECT_EQ(Create("r3", 1, "h200-sxm-slice", "us-east-1", "fabric-only").error().reason,
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
  AddNode("gpu-roce", 8, "us-east-1", false, true, "roce");
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

TEST_F(AllocationTest, BaremetalAndSlicesNeverShareANode) {
  AddNode("bm-01", 8, "us-east-1", /*baremetal_profile=*/true);
  AddNode("gpu-01", 8);
  WaitProjected();
  auto bm = Create("bm", 8, "h200-sxm-baremetal");
  ASSERT_TRUE(bm.ok()) << bm.error().ToString();
  EXPECT_EQ(bm->allocation().node_id(), "bm-01");
  ASSERT_EQ(bm->allocation().claims_size(), 1);
  EXPECT_EQ(bm->allocation().claims(0).kind(), "node_exclusive");
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
  EXPECT_EQ(f->allocation().state(), "released");
  EXPECT_TRUE(Create("s1-again", 1).ok());
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(AllocationTest, ConcurrentCreatorsOnThreeReplicasNeverDoubleBook) {
  for (int i = 0; i < 10; ++i) AddNode(fmt::format("gpu-{:02d}", i), 8);
  WaitProjected();
  const std::vector<int> sizes = {1, 2, 4, 1, 8, 2, 1, 4};
  std::atomic<int> placed_gpus{0}, placed{0}, exhausted{0}, other{0};
  std::vector<std::thread> threads;
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
  EXPECT_NE(v[1].find("in state released"), std::string::npos) << v[1];
}

}  // namespace
}  // namespace gpuaas::scheduler
