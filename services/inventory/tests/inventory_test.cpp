// Inventory service in-process against real NATS JetStream and PostgreSQL.
#include <gtest/gtest.h>

#include <atomic>
#include <limits>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/http.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "test_env.hpp"

namespace gpuaas::inventory {
namespace {

using namespace std::chrono_literals;

v1::RegisterNodeRequest Req(const std::string& id, const std::string& region = "us-east-1") {
  v1::RegisterNodeRequest r;
  r.set_node_id(id);
  r.set_hostname(id + ".lab");
  r.set_region(region);
  r.set_pool("h200");
  r.set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
  (*r.mutable_labels())["rack"] = "r1";
  return r;
}

TEST(ValidateRegisterTest, EveryProblemIsReported) {
  v1::RegisterNodeRequest r;
  r.set_node_id("Bad.Id");
  r.set_region("US East");
  auto v = ValidateRegister(r);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.error().code, Code::kInvalidArgument);
  const auto& d = v.error().details;
  EXPECT_TRUE(d.count("node_id"));
  EXPECT_EQ(d.at("hostname"), "required");
  EXPECT_TRUE(d.count("region"));
  EXPECT_EQ(d.at("pool"), "required");
  EXPECT_TRUE(d.count("capacity_profile"));
  EXPECT_TRUE(ValidateRegister(Req("gpu-01")).ok());
  EXPECT_FALSE(ValidNodeId("gpu.01"));  // would split a NATS subject
  EXPECT_FALSE(ValidNodeId("gpu-*"));
  EXPECT_FALSE(ValidNodeId(std::string(64, 'a')));
}

class InventoryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    InventoryConfig cfg;
    config::Schema schema;
    cfg.Register(schema);
    std::map<std::string, std::string> env = {
        {"GPUAAS_NATS_URL", nats_.url()},
        {"GPUAAS_POSTGRES_DSN", testing::SharedPostgres().CreateDatabase("inv")},
        {"GPUAAS_LOG_LEVEL", "warn"}};
    for (const auto& [k, v] : nats_.Env("inventory")) env[k] = v;
    ASSERT_TRUE(schema.LoadFromString("", env).ok());
    svc_ = std::make_unique<InventoryService>(cfg);
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness),
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
  }
  void TearDown() override { svc_->Shutdown(); }

  Result<v1::RegisterNodeResponse> Register(const v1::RegisterNodeRequest& r) {
    return rpc::Client(conn_).Call<v1::RegisterNodeResponse>(
        "gpuaas.v1.inventory.node.{node_id}.register", r, 5000ms);
  }
  // Node events of `kind` in the stream. A failed count fails the test and matches no expected
  // number: read as 0 it would pass every "no event" check.
  uint64_t Events(const std::string& kind) {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_INVENTORY",
                                           "gpuaas.v1.evt.inventory.node." + kind);
    if (!n.ok()) {
      ADD_FAILURE() << "counting " << kind << " events: " << n.error().ToString();
      return std::numeric_limits<uint64_t>::max();
    }
    return *n;
  }

  testing::TestNats nats_;
  std::unique_ptr<InventoryService> svc_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(InventoryTest, RegisterIsIdempotentAndAnnouncesChangesOnce) {
  auto first = Register(Req("gpu-01"));
  ASSERT_TRUE(first.ok()) << first.error().ToString();
  EXPECT_TRUE(first->created());
  EXPECT_EQ(first->node().generation(), 1);
  EXPECT_EQ(first->node().labels().at("rack"), "r1");
  ASSERT_TRUE(testing::WaitFor([&] { return Events("registered") == 1; }));

  auto again = Register(Req("gpu-01"));  // a retried request: no change, no event
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_FALSE(again->changed());
  EXPECT_EQ(again->node().generation(), 1);

  auto moved = Register(Req("gpu-01", "eu-west-1"));
  ASSERT_TRUE(moved.ok());
  EXPECT_TRUE(moved->changed());
  EXPECT_EQ(moved->node().generation(), 2);
  EXPECT_EQ(moved->node().region(), "eu-west-1");
  ASSERT_TRUE(testing::WaitFor([&] { return Events("updated") == 1; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(Events("registered"), 1u);
}

TEST_F(InventoryTest, ConcurrentRegistrationsOfOneNodeCreateItOnce) {
  std::atomic<int> created{0};
  std::atomic<int> failed{0};
  std::vector<std::thread> ts;
  ts.reserve(8);
  for (int i = 0; i < 8; ++i) {
    ts.emplace_back([&] {
      auto r = Register(Req("gpu-race"));
      if (!r.ok()) {
        failed++;
      } else if (r->created()) {
        created++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(created.load(), 1);
  ASSERT_TRUE(testing::WaitFor([&] { return Events("registered") == 1; }));
}

TEST_F(InventoryTest, InvalidRegistrationIsRejectedWithFieldDetails) {
  auto bad = Req("gpu-01");
  bad.set_node_id("Not_A_Label");
  bad.set_capacity_profile(v1::CAPACITY_PROFILE_UNSPECIFIED);
  auto r = Register(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kInvalidArgument);
  EXPECT_EQ(r.error().reason, "invalid_node_registration");
  EXPECT_NE(r.error().details.at("node_id").find("DNS label"), std::string::npos);
  EXPECT_TRUE(r.error().details.count("capacity_profile"));
  // The subject names the node: a registration without one cannot be addressed at all.
  bad.set_node_id("");
  auto unaddressed = Register(bad);
  ASSERT_FALSE(unaddressed.ok());
  EXPECT_TRUE(unaddressed.error().Is(reason::kNodeIdMissing)) << unaddressed.error().ToString();
}

TEST_F(InventoryTest, ListFiltersAndPages) {
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(Register(Req(fmt::format("gpu-{:02}", i), i < 3 ? "us-east-1" : "eu-west-1")).ok());
  }
  rpc::Client client(conn_);
  v1::ListNodesRequest req;
  req.set_region("us-east-1");
  req.set_page_size(2);
  auto p1 = client.Call<v1::ListNodesResponse>("gpuaas.v1.inventory.node.list", req);
  ASSERT_TRUE(p1.ok());
  ASSERT_EQ(p1->nodes_size(), 2);
  EXPECT_EQ(p1->nodes(0).node_id(), "gpu-00");
  EXPECT_EQ(p1->next_page_token(), "gpu-01");
  req.set_page_token(p1->next_page_token());
  auto p2 = client.Call<v1::ListNodesResponse>("gpuaas.v1.inventory.node.list", req);
  ASSERT_TRUE(p2.ok());
  ASSERT_EQ(p2->nodes_size(), 1);
  EXPECT_EQ(p2->nodes(0).node_id(), "gpu-02");
  EXPECT_TRUE(p2->next_page_token().empty());
  req.set_page_size(5000);
  auto bad = client.Call<v1::ListNodesResponse>("gpuaas.v1.inventory.node.list", req);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_page_size");
}

TEST_F(InventoryTest, HealthAndMetricsEndpoints) {
  const uint16_t port = svc_->runtime().http_port();
  auto health = http::Get("127.0.0.1", port, "/healthz");
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->first, 200);
  auto ready = http::Get("127.0.0.1", port, "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->first, 200) << ready->second;
  EXPECT_NE(ready->second.find("\"postgres\":\"ok\""), std::string::npos);
  ASSERT_TRUE(Register(Req("gpu-m")).ok());
  auto metrics = http::Get("127.0.0.1", port, "/metrics");
  ASSERT_TRUE(metrics.ok());
  EXPECT_NE(metrics->second.find("gpuaas_rpc_requests_total{code=\"OK\",subject=\"gpuaas.v1."
                                 "inventory.node.{node_id}.register\"}"),
            std::string::npos)
      << metrics->second.substr(0, 2000);
  // Readiness follows PostgreSQL.
  testing::SharedPostgres().Stop();
  auto down = http::Get("127.0.0.1", port, "/readyz");
  testing::SharedPostgres().Start();
  ASSERT_TRUE(down.ok());
  EXPECT_EQ(down->first, 503);
  EXPECT_NE(down->second.find("db_unavailable"), std::string::npos) << down->second;
}

}  // namespace
}  // namespace gpuaas::inventory
