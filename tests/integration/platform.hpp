#pragma once
// The control plane in one test process for the cross-service tests: real NATS and PostgreSQL
// (one database per service), ipam, inventory and the scheduler (ingress, console-gw and usage
// on request), a client connection, and node-agents on fixture hosts. Tests add what they need on
// top.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/ingress/ingress_service.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/node_agent/agent/node_agent.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/usage/usage_service.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
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
  // console-gw (consoles, the operator page, token revocation), as deployed: its own identity
  // and database, the page from the source tree; `extra` on top of its environment.
  void StartConsole(const EnvMap& extra = {}) {
    auto env = Env(SharedPostgres().CreateDatabase("console"), "console-gw");
    for (const auto& [k, v] : extra) env[k] = v;
    console = std::make_unique<console_gw::ConsoleGwService>(
        LoadConfig<console_gw::ConsoleGwConfig>(env));
    auto r = console->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  // The usage ledger (billing records from the scheduler's allocation events).
  void StartUsage() {
    usage = std::make_unique<usage::UsageService>(
        LoadConfig<usage::UsageConfig>(Env(SharedPostgres().CreateDatabase("usage"), "usage")));
    auto r = usage->Start();
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
    if (usage) usage->Shutdown();
    if (console) console->Shutdown();
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

  // The environment of a simulated agent whose VM runtime behaves as `behavior` (succeed |
  // fail | silent), with fast steps and desired-set polls.
  static EnvMap SimulatedAgentEnv(const std::string& behavior = "succeed") {
    return {{"GPUAAS_NODE_DESIRED_POLL_MS", "100"},
            {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", behavior},
            {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "5"}};
  }

  // A simulated agent in `pool` whose VM tasks succeed, its slots approved as an operator does
  // and schedulable in the scheduler's projection.
  // `extra` overrides the agent's environment.
  void StartApprovedAgent(const std::string& id, const std::string& pool, int gpus,
                          const EnvMap& extra = {}) {
    EnvMap env = SimulatedAgentEnv();
    for (const auto& [k, v] : extra) env[k] = v;
    StartAgent(id, gpus, pool, env);
    ApproveAll(id);
    ASSERT_TRUE(WaitSchedulable(id, gpus));
  }

  // Once `node_id` has reported its topology, approves every candidate, as an operator does.
  void ApproveAll(const std::string& node_id) {
    ASSERT_TRUE(WaitFor([&] {
      v1::ShowNodeRequest r;
      r.set_node_id(node_id);
      auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
      return s.ok() && s->snapshot_version() >= 1;
    })) << node_id
        << " never reported its topology";
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(node_id);
    auto a = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    for (const auto& r : a->results()) ASSERT_TRUE(r.approved()) << r.DebugString();
  }

  // A slice of `gpus` GPUs for tenant acme in `pool` of us-east-1.
  Result<v1::Allocation> CreateSlice(const std::string& request_id, const std::string& pool,
                                     int gpus) {
    v1::CreateAllocationRequest r;
    r.set_tenant("acme");
    r.set_request_id(request_id);
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(gpus);
    r.set_region("us-east-1");
    r.set_pool(pool);
    r.add_ssh_authorized_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA test");
    auto c = Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r);
    if (!c.ok()) return c.error();
    return c->allocation();
  }

  // The tenant's release, or (`force`) the operator's force-release (its own subject).
  Result<v1::Allocation> Release(const std::string& id, const std::string& reason = "",
                                 bool force = false) {
    Result<v1::ReleaseAllocationResponse> x = Error::Internal("unreached", "");
    if (force) {
      v1::ForceReleaseAllocationRequest r;
      r.set_allocation_id(id);
      r.set_reason(reason);
      x = Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.force_release", r);
    } else {
      v1::ReleaseAllocationRequest r;
      r.set_allocation_id(id);
      r.set_reason(reason);
      x = Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", r);
    }
    if (!x.ok()) return x.error();
    return x->allocation();
  }

  v1::GetAllocationTimelineResponse Timeline(const std::string& id) {
    v1::GetAllocationTimelineRequest r;
    r.set_allocation_id(id);
    r.set_page_size(500);
    auto t = Call<v1::GetAllocationTimelineResponse>("gpuaas.v1.scheduler.allocation.timeline", r);
    EXPECT_TRUE(t.ok()) << t.error().ToString();
    return t.ok() ? *t : v1::GetAllocationTimelineResponse();
  }

  // Timeline rows as "step[ task_type]", for failure messages and counts.
  std::vector<std::string> Steps(const std::string& id) {
    std::vector<std::string> out;
    const auto timeline = Timeline(id);
    for (const auto& e : timeline.entries()) {
      const auto& type = enums::Text(e.task_type());
      out.push_back(enums::Text(e.step()) + (type.empty() ? "" : " " + type));
    }
    return out;
  }

  // How many entries of `t` are `step` of a task of `type` ("" = no task).
  static int CountSteps(const v1::GetAllocationTimelineResponse& t, v1::TimelineStep step,
                        v1::TaskType type) {
    int n = 0;
    for (const auto& e : t.entries()) n += (e.step() == step && e.task_type() == type) ? 1 : 0;
    return n;
  }

  // The allocation once it is in `state` with nothing in flight (one timeline snapshot says
  // both), as it is from there on.
  v1::Allocation WaitSettled(const std::string& id, v1::AllocationState state) {
    v1::Allocation a;
    EXPECT_TRUE(WaitFor(
        [&] {
          v1::GetAllocationTimelineRequest tr;
          tr.set_allocation_id(id);
          tr.set_page_size(1);
          auto t = Call<v1::GetAllocationTimelineResponse>(
              "gpuaas.v1.scheduler.allocation.timeline", tr);
          if (!t.ok() || t->state() != state || t->in_flight()) return false;
          v1::GetAllocationRequest g;
          g.set_allocation_id(id);
          auto r = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
          if (!r.ok()) return false;
          a = r->allocation();
          return a.state() == state;
        },
        std::chrono::seconds(20)))
        << id << " is " << enums::Text(a.state()) << ", wanted " << enums::Text(state)
        << "; timeline:\n"
        << ::testing::PrintToString(Steps(id));
    return a;
  }

  // The scheduler's projection of `node`'s slots; a failed call fails the test (an empty list
  // would pass every "each slot is ..." check).
  std::vector<v1::ProjectedSlot> Slots(const std::string& node) {
    v1::ListProjectedSlotsRequest lr;
    lr.set_node_id(node);
    auto l = Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
    EXPECT_TRUE(l.ok()) << l.error().ToString();
    if (!l.ok()) return {};
    return {l->slots().begin(), l->slots().end()};
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
  std::unique_ptr<console_gw::ConsoleGwService> console;
  std::unique_ptr<usage::UsageService> usage;
  std::vector<std::unique_ptr<node_agent::NodeAgent>> agents;
  std::shared_ptr<messaging::Connection> conn;
};

}  // namespace gpuaas::testing
