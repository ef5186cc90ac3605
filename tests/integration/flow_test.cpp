// The first real flow: inventory registers a node (request/reply), its outbox relay publishes
// the event, and the scheduler's durable consumer projects it idempotently. Plus the faults:
// duplicates, replay, PostgreSQL and nats-server restarts, malformed events, agent isolation.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <set>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/http.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/node_agent/agent/node_agent.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

class FlowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    inv_dsn_ = testing::SharedPostgres().CreateDatabase("inv");
    sched_dsn_ = testing::SharedPostgres().CreateDatabase("sched");
    StartInventory();
    StartScheduler();
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness),
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
  }
  void TearDown() override {
    if (scheduler_) scheduler_->Shutdown();
    if (inventory_) inventory_->Shutdown();
  }
  void StartInventory() {
    inventory_ = std::make_unique<inventory::InventoryService>(
        LoadConfig<inventory::InventoryConfig>(Env(inv_dsn_, "inventory")));
    auto r = inventory_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  void StartScheduler() {
    scheduler_ = std::make_unique<scheduler::SchedulerService>(
        LoadConfig<scheduler::SchedulerConfig>(Env(sched_dsn_, "scheduler")));
    auto r = scheduler_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  // A service's (or an enrolled node's) environment: its identity and database.
  std::map<std::string, std::string> Env(const std::string& dsn, const std::string& role,
                                         const std::string& node_id = "") {
    auto env = nats_.Env(role, node_id);
    env["GPUAAS_POSTGRES_DSN"] = dsn;
    env["GPUAAS_LOG_LEVEL"] = "error";
    return env;
  }
  v1::RegisterNodeRequest Req(const std::string& id, const std::string& pool = "h200") {
    v1::RegisterNodeRequest r;
    r.set_node_id(id);
    r.set_hostname(id);
    r.set_region("us-east-1");
    r.set_pool(pool);
    r.set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
    return r;
  }
  Result<v1::RegisterNodeResponse> Register(const v1::RegisterNodeRequest& r) {
    return rpc::Client(conn_).Call<v1::RegisterNodeResponse>(
        "gpuaas.v1.inventory.node.{node_id}.register", r, 3000ms);
  }
  std::map<std::string, v1::ProjectedNode> Projection() {
    std::map<std::string, v1::ProjectedNode> out;
    v1::ListProjectedNodesRequest req;
    req.set_page_size(1000);
    auto r = rpc::Client(conn_).Call<v1::ListProjectedNodesResponse>(
        "gpuaas.v1.scheduler.node.list", req, 3000ms);
    if (r.ok()) {
      for (const auto& n : r->nodes()) out[n.node_id()] = n;
    }
    return out;
  }

  // A server's outage: `stop` it, `down` for that long, `start` it, then `after` to recover.
  struct Outage {
    std::function<void()> stop, start;
    std::chrono::milliseconds down, after;
  };
  void RegisterThroughOutage(const std::string& prefix, const Outage& outage,
                             std::chrono::seconds settle);

  testing::TestNats nats_;
  std::string inv_dsn_;
  std::string sched_dsn_;
  std::unique_ptr<inventory::InventoryService> inventory_;
  std::unique_ptr<scheduler::SchedulerService> scheduler_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(FlowTest, RegisteredNodeReachesTheSchedulerProjection) {
  ASSERT_TRUE(Register(Req("gpu-01")).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return Projection().count("gpu-01") == 1; }));
  auto p = Projection().at("gpu-01");
  EXPECT_EQ(p.generation(), 1);
  EXPECT_EQ(p.pool(), "h200");
  ASSERT_TRUE(Register(Req("gpu-01", "h200-b")).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return Projection().at("gpu-01").generation() == 2; }));
  EXPECT_EQ(Projection().at("gpu-01").pool(), "h200-b");
}

// A NUL byte would be cut off when stored ("fuzz-ok\0nul-x" became "fuzz-ok"): every served
// request is refused at decode, before any handler writes anything.
TEST_F(FlowTest, StringWithNulIsRefusedAndNothingIsStored) {
  auto req = Req("gpu-nul");
  req.set_hostname(std::string("fuzz-ok\0nul-x", 13));
  auto r = Register(req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kInvalidArgument);
  EXPECT_EQ(r.error().reason, "string_has_nul");
  EXPECT_EQ(r.error().details.count("hostname"), 1u) << r.error().ToString();
  v1::ShowNodeRequest show;
  show.set_node_id("gpu-nul");
  auto shown =
      rpc::Client(conn_).Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show, 3000ms);
  ASSERT_FALSE(shown.ok());
  EXPECT_EQ(shown.error().code, Code::kNotFound) << shown.error().ToString();
  // The same node without the NUL is stored as sent.
  req.set_hostname("fuzz-ok-nul-x");
  ASSERT_TRUE(Register(req).ok());
  shown =
      rpc::Client(conn_).Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show, 3000ms);
  ASSERT_TRUE(shown.ok()) << shown.error().ToString();
  EXPECT_EQ(shown->node().hostname(), "fuzz-ok-nul-x");
}

TEST_F(FlowTest, DuplicateAndStaleDeliveriesHaveNoEffect) {
  {
    auto r = Register(Req("gpu-01"));
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  ASSERT_TRUE(Register(Req("gpu-01", "h200-b")).ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    auto p = Projection();
    return p.count("gpu-01") && p.at("gpu-01").generation() == 2;
  }));
  const uint64_t applied = scheduler_->projection_stats().applied.load();
  // Fetch the generation-1 event as stored and deliver it again under a new message id, so
  // JetStream does not de-duplicate it: the inbox must.
  std::string first_event;
  messaging::Consumer reader(
      conn_, {"GPUAAS_EVT_INVENTORY", "test-reader", "gpuaas.v1.evt.inventory.node.registered"},
      [&](const messaging::Delivery& d) {
        first_event = d.msg.data;
        return messaging::HandlerResult::Ack();
      },
      log::Logger());
  ASSERT_TRUE(reader.Start().ok());
  ASSERT_TRUE(testing::WaitFor([&] { return !first_event.empty(); }));
  reader.Stop();
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.inventory.node.registered", first_event,
                                     fmt::format("redelivery-{}", i))
                    .ok());
  }
  ASSERT_TRUE(
      testing::WaitFor([&] { return scheduler_->projection_stats().duplicates.load() >= 3; }));
  EXPECT_EQ(scheduler_->projection_stats().applied.load(), applied);
  // A stale event with a new id (an older generation) must not roll the projection back.
  v1::Event stale;
  ASSERT_TRUE(stale.ParseFromString(first_event));
  stale.set_id("0190a6e2-7c1b-7abc-8def-0123456789ab");
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.inventory.node.registered",
                                   stale.SerializeAsString(), stale.id())
                  .ok());
  ASSERT_TRUE(testing::WaitFor(
      [&] { return scheduler_->projection_stats().applied.load() == applied + 1; }));
  EXPECT_EQ(Projection().at("gpu-01").generation(), 2);
  EXPECT_EQ(Projection().at("gpu-01").pool(), "h200-b");
}

TEST_F(FlowTest, MalformedEventIsDeadLetteredAndConsumptionContinues) {
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.inventory.node.registered",
                                   "definitely not protobuf \xff\xff", "junk-1")
                  .ok());
  ASSERT_TRUE(Register(Req("gpu-after-junk")).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return Projection().count("gpu-after-junk") == 1; }));
  ASSERT_TRUE(testing::WaitFor([&] {
    auto n = messaging::StreamSubjectCount(
        *conn_, "GPUAAS_DLQ", "gpuaas.v1.dlq.GPUAAS_EVT_INVENTORY.scheduler-inventory-nodes");
    return n.ok() && *n == 1;
  }));
}

TEST_F(FlowTest, ProjectionRebuildsFromTheStream) {
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(Register(Req(fmt::format("gpu-{:02}", i))).ok());
  ASSERT_TRUE(Register(Req("gpu-00", "h200-b")).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return Projection().size() == 5; }));
  // An empty request is refused and leaves the projection as it was.
  auto refused = rpc::Client(conn_).Call<v1::RebuildProjectionResponse>(
      "gpuaas.v1.scheduler.projection.rebuild", v1::RebuildProjectionRequest(), 10000ms);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, Code::kInvalidArgument);
  EXPECT_EQ(refused.error().reason, "confirm_required");
  EXPECT_EQ(Projection().size(), 5u);
  v1::RebuildProjectionRequest confirmed;
  confirmed.set_confirm(true);
  auto r = rpc::Client(conn_).Call<v1::RebuildProjectionResponse>(
      "gpuaas.v1.scheduler.projection.rebuild", confirmed, 10000ms);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->nodes(), 5);
  EXPECT_EQ(r->events_replayed(), 6);
  auto p = Projection();
  ASSERT_EQ(p.size(), 5u);
  EXPECT_EQ(p.at("gpu-00").generation(), 2);
  EXPECT_EQ(p.at("gpu-00").pool(), "h200-b");
  // A node registered after the rebuild still flows in.
  ASSERT_TRUE(Register(Req("gpu-late")).ok());
  EXPECT_TRUE(testing::WaitFor([&] { return Projection().count("gpu-late") == 1; }));
}

// Keeps registering nodes (each retried until inventory acknowledges it) through `outage`, then
// checks that registrations met the outage (a request in flight while the server was down: it
// was refused and retried, or it waited for the reconnect) and that every acknowledged
// registration reached the scheduler's projection.
void FlowTest::RegisterThroughOutage(const std::string& prefix, const Outage& outage,
                                     std::chrono::seconds settle) {
  using Clock = std::chrono::steady_clock;
  std::atomic<bool> stop{false};
  std::set<std::string> acked;
  std::vector<std::pair<Clock::time_point, Clock::time_point>> calls;  // each request's span
  int refused = 0;
  std::thread writer([&] {
    for (int i = 0; !stop || i < 5; ++i) {
      while (true) {
        const auto began = Clock::now();
        auto r = Register(Req(fmt::format("{}-{:03}", prefix, i)));
        calls.emplace_back(began, Clock::now());
        if (r.ok()) {
          acked.insert(r->node().node_id());
          break;
        }
        ++refused;
        EXPECT_TRUE(r.error().retryable) << r.error().ToString();
        std::this_thread::sleep_for(50ms);
      }
      std::this_thread::sleep_for(20ms);
    }
  });
  std::this_thread::sleep_for(300ms);
  outage.stop();
  const auto down_from = Clock::now();
  std::this_thread::sleep_for(outage.down);
  const auto down_until = Clock::now();
  outage.start();
  std::this_thread::sleep_for(outage.after);
  stop = true;
  writer.join();
  ASSERT_GE(acked.size(), 5u);
  // Without this the test would pass just as well if the outage fell between requests.
  const auto met = std::count_if(calls.begin(), calls.end(), [&](const auto& c) {
    return c.first < down_until && c.second > down_from;
  });
  EXPECT_GE(met, 1) << "no registration was in flight while the server was down (" << refused
                    << " refused in all)";
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto p = Projection();
        for (const auto& id : acked) {
          if (!p.count(id)) return false;
        }
        return true;
      },
      settle))
      << "acknowledged registrations missing from the projection";
}

TEST_F(FlowTest, PostgresRestartMidRunLosesNothing) {
  // While PostgreSQL is down, requests get UNAVAILABLE and are retried.
  RegisterThroughOutage("pg",
                        {[] { testing::SharedPostgres().Stop(); },
                         [] { testing::SharedPostgres().Start(); }, 700ms, 500ms},
                        20s);
}

TEST_F(FlowTest, NatsRestartMidRunLosesNothing) {
  // While NATS is down, a request fails or waits for the client's reconnect.
  RegisterThroughOutage("nats",
                        {[this] { nats_.Stop(); }, [this] { nats_.Start(); }, 500ms, 1000ms}, 30s);
}

TEST_F(FlowTest, NodeAgentRegistersItselfOrStaysIsolated) {
  auto make_agent = [&](const std::string& id, const std::string& region) {
    nats_.EnrollNode(id);
    auto env = Env("", "node-agent", id);
    env.erase("GPUAAS_POSTGRES_DSN");
    env["GPUAAS_NODE_ID"] = id;
    env["GPUAAS_NODE_REGION"] = region;
    env["GPUAAS_NODE_STATE_DIR"] = testing::MakeTempDir("gpuaas-agent");
    env["GPUAAS_NODE_REGISTER_RETRY_MS"] = "50";
    env["GPUAAS_LIBVIRT_URI"] = "test:///default";
    return std::make_unique<node_agent::NodeAgent>(LoadConfig<node_agent::NodeAgentConfig>(env));
  };
  auto good = make_agent("sim-01", "us-east-1");
  ASSERT_TRUE(good->Start().ok());
  ASSERT_TRUE(testing::WaitFor([&] { return good->Registered(); }));
  auto ready = http::Get("127.0.0.1", good->runtime().http_port(), "/readyz");
  ASSERT_TRUE(ready.ok());
  EXPECT_EQ(ready->first, 200) << ready->second;
  EXPECT_TRUE(testing::WaitFor([&] { return Projection().count("sim-01") == 1; }));

  // Inventory refuses this node (bad region): the agent isolates itself.
  auto bad = make_agent("sim-02", "Not A Region");
  ASSERT_TRUE(bad->Start().ok());
  ASSERT_TRUE(testing::WaitFor([&] { return !bad->LastError().empty(); }));
  std::this_thread::sleep_for(200ms);
  EXPECT_FALSE(bad->Registered());
  EXPECT_NE(bad->LastError().find("invalid_node_registration"), std::string::npos);
  auto not_ready = http::Get("127.0.0.1", bad->runtime().http_port(), "/readyz");
  ASSERT_TRUE(not_ready.ok());
  EXPECT_EQ(not_ready->first, 503);
  good->Shutdown();
  bad->Shutdown();
}

TEST_F(FlowTest, AgentStartedBeforeInventoryRegistersOnceItAppears) {
  inventory_->Shutdown();
  inventory_.reset();
  nats_.EnrollNode("sim-early");
  auto env = Env("", "node-agent", "sim-early");
  env.erase("GPUAAS_POSTGRES_DSN");
  env["GPUAAS_NODE_ID"] = "sim-early";
  env["GPUAAS_NODE_REGION"] = "us-east-1";
  env["GPUAAS_NODE_STATE_DIR"] = testing::MakeTempDir("gpuaas-agent");
  env["GPUAAS_NODE_REGISTER_RETRY_MS"] = "50";
  env["GPUAAS_LIBVIRT_URI"] = "test:///default";
  node_agent::NodeAgent agent(LoadConfig<node_agent::NodeAgentConfig>(env));
  ASSERT_TRUE(agent.Start().ok());
  ASSERT_TRUE(testing::WaitFor([&] { return !agent.LastError().empty(); }));
  EXPECT_NE(agent.LastError().find("no_responders"), std::string::npos) << agent.LastError();
  StartInventory();
  EXPECT_TRUE(testing::WaitFor([&] { return agent.Registered(); }));
  agent.Shutdown();
}

}  // namespace
}  // namespace gpuaas
