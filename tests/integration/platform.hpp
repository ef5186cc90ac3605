#pragma once
// The control plane in one test process for the cross-service tests: real NATS and PostgreSQL
// (one database per service), ipam, inventory and the scheduler (ingress on request), a client
// connection, and node-agents on fixture hosts. Tests add what they need on top.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fixture_host.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "ingress_service.hpp"
#include "inventory_service.hpp"
#include "ipam_service.hpp"
#include "load_config.hpp"
#include "node_agent.hpp"
#include "scheduler_service.hpp"
#include "test_env.hpp"

namespace gpuaas::testing {

class Platform {
 public:
  using EnvMap = std::map<std::string, std::string>;

  ~Platform() { Stop(); }

  // Starts ipam, inventory (on `inventory_dsn`, or a new database) and the scheduler (with
  // `scheduler_env` on top of the common environment), then connects a client.
  void Start(const EnvMap& scheduler_env = {}, const std::string& inventory_dsn = "") {
    ipam = std::make_unique<ipam::IpamService>(
        LoadConfig<ipam::IpamConfig>(Env(SharedPostgres().CreateDatabase("ipam"), "ipam")));
    ASSERT_TRUE(ipam->Start().ok());
    StartInventory(inventory_dsn.empty() ? SharedPostgres().CreateDatabase("inv") : inventory_dsn);
    auto env = Env(SharedPostgres().CreateDatabase("sched"), "scheduler");
    for (const auto& [k, v] : scheduler_env) env[k] = v;
    scheduler =
        std::make_unique<scheduler::SchedulerService>(LoadConfig<scheduler::SchedulerConfig>(env));
    ASSERT_TRUE(scheduler->Start().ok());
    auto c = messaging::Connection::Connect(nats.Options(testing::TestNats::kHarness),
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn = *c;
  }
  // Ingress (public endpoints), for the tests that expose something.
  void StartIngress() {
    ingress = std::make_unique<ingress::IngressService>(LoadConfig<ingress::IngressConfig>(
        Env(SharedPostgres().CreateDatabase("ingress"), "ingress")));
    auto r = ingress->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  void StartInventory(const std::string& dsn) {
    auto env = Env(dsn, "inventory");
    for (const auto& [k, v] : inventory_env) env[k] = v;
    inventory =
        std::make_unique<inventory::InventoryService>(LoadConfig<inventory::InventoryConfig>(env));
    auto r = inventory->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  void Stop() {
    for (auto& a : agents) a->Shutdown();
    agents.clear();
    if (ingress) ingress->Shutdown();
    if (scheduler) scheduler->Shutdown();
    if (inventory) inventory->Shutdown();
    if (ipam) ipam->Shutdown();
  }

  // The environment of a service of the test: its identity (`role`, a node's id), its database
  // (`dsn` "" = none).
  EnvMap Env(const std::string& dsn, const std::string& role,
             const std::string& node_id = "") const {
    EnvMap env = nats.Env(role, node_id);
    env["GPUAAS_LOG_LEVEL"] = "error";
    if (!dsn.empty()) env["GPUAAS_POSTGRES_DSN"] = dsn;
    return env;
  }

  // A node-agent on a fresh fixture host with `gpus` GPUs, started and registered; `extra`
  // overrides its environment. Returns it (owned by the platform).
  node_agent::NodeAgent* StartAgent(const std::string& id, int gpus, const std::string& pool,
                                    const EnvMap& extra = {}) {
    const std::string root = MakeTempDir("gpuaas-host") + "/root";
    node_agent::FixtureOptions fo;
    fo.gpus = gpus;
    fo.hostname = id;
    auto built = node_agent::BuildFixtureHost(root, fo);
    EXPECT_TRUE(built.ok()) << built.error().ToString();
    nats.EnrollNode(id);
    auto env = Env("", "node-agent", id);
    env["GPUAAS_NODE_ID"] = id;
    env["GPUAAS_NODE_REGION"] = "us-east-1";
    env["GPUAAS_NODE_POOL"] = pool;
    env["GPUAAS_NODE_STATE_DIR"] = MakeTempDir("gpuaas-agent");
    env["GPUAAS_NODE_REGISTER_RETRY_MS"] = "50";
    env["GPUAAS_NODE_DESIRED_POLL_MS"] = "50";
    env["GPUAAS_NODE_HOST_ROOT"] = root;
    env["GPUAAS_LIBVIRT_URI"] = "test:///default";
    for (const auto& [k, v] : extra) env[k] = v;
    agents.push_back(
        std::make_unique<node_agent::NodeAgent>(LoadConfig<node_agent::NodeAgentConfig>(env)));
    auto* agent = agents.back().get();
    auto started = agent->Start();
    EXPECT_TRUE(started.ok()) << id << ": " << started.error().ToString();
    EXPECT_TRUE(WaitFor([&] { return agent->Registered(); })) << id << ": " << agent->LastError();
    return agent;
  }

  // A simulated agent in `pool` whose VM tasks succeed, its slots approved as an operator does
  // and schedulable in the scheduler's projection.
  // `extra` overrides the agent's environment.
  void StartApprovedAgent(const std::string& id, const std::string& pool, int gpus,
                          const EnvMap& extra = {}) {
    EnvMap env = {{"GPUAAS_NODE_DESIRED_POLL_MS", "100"},
                  {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", "succeed"},
                  {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "5"}};
    for (const auto& [k, v] : extra) env[k] = v;
    StartAgent(id, gpus, pool, env);
    ASSERT_TRUE(WaitFor([&] {
      v1::ShowNodeRequest r;
      r.set_node_id(id);
      auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
      return s.ok() && s->snapshot_version() >= 1;
    }));
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(id);
    auto a = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    for (const auto& r : a->results()) ASSERT_TRUE(r.approved()) << r.DebugString();
    ASSERT_TRUE(WaitSchedulable(id, gpus));
  }

  // Whether the scheduler's projection comes to show exactly `n` schedulable slots of
  // `node_id` (approval reaches it through inventory's events, a moment after the approve
  // call answered).
  bool WaitSchedulable(const std::string& node_id, int n) {
    return WaitFor([&] {
      v1::ListProjectedSlotsRequest lr;
      lr.set_node_id(node_id);
      auto l = Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
      int ok = 0;
      if (l.ok()) {
        for (const auto& s : l->slots()) ok += s.schedulable() ? 1 : 0;
      }
      return ok == n;
    });
  }

  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return rpc::Client(conn).Call<Resp>(subject, req, std::chrono::seconds(10));
  }

  TestNats nats;
  EnvMap inventory_env;  // on top of inventory's environment (set before Start)
  std::unique_ptr<ipam::IpamService> ipam;
  std::unique_ptr<inventory::InventoryService> inventory;
  std::unique_ptr<scheduler::SchedulerService> scheduler;
  std::unique_ptr<ingress::IngressService> ingress;
  std::vector<std::unique_ptr<node_agent::NodeAgent>> agents;
  std::shared_ptr<messaging::Connection> conn;
};

}  // namespace gpuaas::testing
