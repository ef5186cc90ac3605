// Host operations through the real services: an operator drains a node holding a live slice
// while creates run against its pool (none lands on it once the drain is answered, the slice
// runs on), the node is drained when its last allocation is released and back in service on
// undrain; maintenance of a drained node ends when its agent's checks pass; a decommissioned
// node is retired for good; bad requests get a structured error and change nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

class HostOpsFlowTest : public ::testing::Test {
 protected:
  // The load's 1,000 creates come from one principal: no rate limit.
  void SetUp() override { p_.Start({{"GPUAAS_RPC_RATE_LIMITS", ""}}); }

  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }
  Result<v1::NodeAdminResponse> Drain(const std::string& node, int64_t deadline_s = 0) {
    v1::DrainNodeRequest r;
    r.set_node_id(node);
    r.set_reason("kernel update");
    r.set_deadline_s(deadline_s);
    return Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.drain", r);
  }
  Result<v1::NodeAdminResponse> Admin(const std::string& subject, const std::string& node,
                                      const std::string& why = "operator test") {
    v1::NodeAdminRequest r;
    r.set_node_id(node);
    r.set_reason(why);
    return Call<v1::NodeAdminResponse>(subject, r);
  }
  v1::Node Node(const std::string& id) {
    v1::ShowNodeRequest r;
    r.set_node_id(id);
    auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
    EXPECT_TRUE(s.ok()) << s.error().ToString();
    return s.ok() ? s->node() : v1::Node();
  }
  bool WaitAdminState(const std::string& id, v1::NodeAdminState want) {
    return testing::WaitFor([&] { return Node(id).admin_state() == want; }, 20s);
  }
  v1::ListNodeHoldersResponse Holders(const std::string& node) {
    v1::ListNodeHoldersRequest r;
    r.set_node_id(node);
    auto h = Call<v1::ListNodeHoldersResponse>("gpuaas.v1.scheduler.node.holders", r);
    EXPECT_TRUE(h.ok()) << h.error().ToString();
    return h.ok() ? *h : v1::ListNodeHoldersResponse();
  }
  int SchedulableSlots(const std::string& node) {
    int n = 0;
    for (const auto& s : p_.Slots(node)) n += s.schedulable() ? 1 : 0;
    return n;
  }

  testing::Platform p_;
};

// One create of the load: when it was sent and where it landed ("" = refused).
struct Attempt {
  Clock::time_point sent;
  std::string node;
  std::string allocation_id;
  std::string refusal;
};

TEST_F(HostOpsFlowTest, DrainKeepsNewPlacementsOffTheNodeWhileItsSliceRunsOn) {
  const std::string node = "drain-a";
  p_.StartApprovedAgent(node, "drain", 4);
  auto live = p_.CreateSlice("live", "drain", 1);
  ASSERT_TRUE(live.ok()) << live.error().ToString();
  ASSERT_EQ(live->node_id(), node);
  p_.WaitSettled(live->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);

  // 1,000 creates of one GPU against the pool from 4 clients, the drain in the middle of them.
  // The node is the pool's only one: every create wants it.
  constexpr int kCreates = 1000;
  std::atomic<int> next{0};
  std::mutex mu;
  std::vector<Attempt> attempts;
  auto client = [&] {
    for (int i = next++; i < kCreates; i = next++) {
      Attempt a;
      a.sent = Clock::now();
      auto c = p_.CreateSlice(fmt::format("load-{}", i), "drain", 1);
      if (c.ok()) {
        a.node = c->node_id();
        a.allocation_id = c->allocation_id();
      } else {
        a.refusal = c.error().reason;
      }
      std::lock_guard lock(mu);
      attempts.push_back(std::move(a));
    }
  };
  std::vector<std::thread> clients;
  for (int t = 0; t < 4; ++t) clients.emplace_back(client);
  ASSERT_TRUE(testing::WaitFor([&] { return next.load() >= 20; }, 30s));
  const auto asked = Clock::now();
  auto drained = Drain(node, 3600);
  const auto acked = Clock::now();
  std::cerr << "drain answered in "
            << std::chrono::duration_cast<std::chrono::milliseconds>(acked - asked).count()
            << " ms after " << next.load() << " creates\n";
  for (auto& t : clients) t.join();
  ASSERT_TRUE(drained.ok()) << drained.error().ToString();
  EXPECT_TRUE(drained->changed());
  EXPECT_EQ(drained->node().admin_state(), v1::NODE_ADMIN_STATE_DRAINING);
  EXPECT_TRUE(drained->node().has_drain_deadline());
  ASSERT_EQ(attempts.size(), static_cast<size_t>(kCreates));

  int after_ack = 0, landed_after_ack = 0;
  std::vector<std::string> holding = {live->allocation_id()};
  for (const auto& a : attempts) {
    if (a.sent >= acked) {
      after_ack++;
      if (!a.node.empty()) landed_after_ack++;
      EXPECT_TRUE(a.node.empty() || a.node != node) << a.allocation_id;
      EXPECT_EQ(a.refusal, "no_placement");
    } else if (!a.node.empty()) {
      holding.push_back(a.allocation_id);
    }
  }
  EXPECT_GT(after_ack, 0);
  EXPECT_EQ(landed_after_ack, 0);
  // From the claims: exactly what landed before the drain holds the node.
  std::set<std::string> held;
  const auto holders = Holders(node);
  for (const auto& h : holders.holders()) held.insert(h.allocation_id());
  EXPECT_EQ(held, std::set<std::string>(holding.begin(), holding.end()));
  EXPECT_EQ(holders.node().admin_state(), v1::NODE_ADMIN_STATE_DRAINING);
  std::set<std::string> reported(drained->holding_allocations().begin(),
                                 drained->holding_allocations().end());
  EXPECT_TRUE(reported.count(live->allocation_id()));
  EXPECT_EQ(SchedulableSlots(node), 0);

  // The slice runs on; the node stays draining until the last holder is released.
  auto still = p_.WaitSettled(live->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
  EXPECT_EQ(still.state(), v1::ALLOCATION_STATE_ACTIVE);
  EXPECT_EQ(Node(node).admin_state(), v1::NODE_ADMIN_STATE_DRAINING);
  for (const auto& id : holding) {
    ASSERT_TRUE(p_.Release(id).ok()) << id;
    p_.WaitSettled(id, v1::ALLOCATION_STATE_RELEASED);
  }
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  const auto n = Node(node);
  EXPECT_EQ(n.admin_actor().rfind("inventory/", 0), 0u) << n.admin_actor();
  EXPECT_TRUE(Holders(node).holders().empty());
  auto refused = p_.CreateSlice("while-drained", "drain", 1);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().reason, "no_placement");

  // Back in service: slices land on it again.
  auto back = Admin("gpuaas.v1.inventory.node.undrain", node, "kernel updated");
  ASSERT_TRUE(back.ok()) << back.error().ToString();
  EXPECT_EQ(back->node().admin_state(), v1::NODE_ADMIN_STATE_ACTIVE);
  EXPECT_EQ(back->node().admin_reason(), "kernel updated");
  ASSERT_TRUE(testing::WaitFor([&] { return SchedulableSlots(node) == 4; }, 20s));
  auto again = p_.CreateSlice("after-undrain", "drain", 1);
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  EXPECT_EQ(again->node_id(), node);
}

TEST_F(HostOpsFlowTest, MaintenanceEndsWhenTheAgentsChecksPass) {
  const std::string node = "maint-a";
  p_.StartApprovedAgent(node, "maint", 2);
  // Nothing holds it: drained as soon as the scheduler has the drain.
  auto drained = Drain(node);
  ASSERT_TRUE(drained.ok()) << drained.error().ToString();
  EXPECT_TRUE(drained->holding_allocations().empty());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  auto maint = Admin("gpuaas.v1.inventory.node.maintenance", node, "firmware update");
  ASSERT_TRUE(maint.ok()) << maint.error().ToString();
  EXPECT_EQ(maint->node().admin_state(), v1::NODE_ADMIN_STATE_MAINTENANCE);
  EXPECT_EQ(SchedulableSlots(node), 0);
  // Undrain is not how a node leaves maintenance.
  auto undrain = Admin("gpuaas.v1.inventory.node.undrain", node);
  ASSERT_FALSE(undrain.ok());
  EXPECT_EQ(undrain.error().reason, "illegal_transition");
  EXPECT_EQ(undrain.error().details.at("state"), "maintenance");

  // The host is back: its agent's discovery passes its checks, and the node is active again.
  v1::DiscoverNodeRequest d;
  d.set_node_id(node);
  ASSERT_TRUE(Call<v1::DiscoverNodeResponse>("gpuaas.v1.inventory.node.discover", d).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_ACTIVE));
  EXPECT_EQ(Node(node).admin_actor().rfind("inventory/", 0), 0u);
  ASSERT_TRUE(testing::WaitFor([&] { return SchedulableSlots(node) == 2; }, 20s));
  auto placed = p_.CreateSlice("after-maintenance", "maint", 2);
  ASSERT_TRUE(placed.ok()) << placed.error().ToString();
  EXPECT_EQ(placed->node_id(), node);
}

TEST_F(HostOpsFlowTest, BadHostOperationsGetStructuredErrorsAndChangeNothing) {
  const std::string node = "bad-a";
  p_.StartApprovedAgent(node, "bad", 1);
  const int64_t generation = Node(node).generation();

  auto unknown = Drain("no-such-node");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().code, Code::kNotFound);
  EXPECT_EQ(unknown.error().reason, "node_not_found");

  v1::DrainNodeRequest no_reason;
  no_reason.set_node_id(node);
  no_reason.set_deadline_s(-1);
  auto bad = Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.drain", no_reason);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_admin_request");
  EXPECT_TRUE(bad.error().details.count("reason"));
  EXPECT_TRUE(bad.error().details.count("deadline_s"));

  auto maint = Admin("gpuaas.v1.inventory.node.maintenance", node);
  ASSERT_FALSE(maint.ok());
  EXPECT_EQ(maint.error().code, Code::kFailedPrecondition);
  EXPECT_EQ(maint.error().reason, "illegal_transition");
  EXPECT_EQ(maint.error().details.at("state"), "active");

  auto undrain = Admin("gpuaas.v1.inventory.node.undrain", node);
  ASSERT_TRUE(undrain.ok()) << undrain.error().ToString();
  EXPECT_FALSE(undrain->changed());

  const auto after = Node(node);
  EXPECT_EQ(after.generation(), generation);
  EXPECT_EQ(after.admin_state(), v1::NODE_ADMIN_STATE_ACTIVE);
  EXPECT_EQ(SchedulableSlots(node), 1);

  // A drain asked twice is one drain.
  ASSERT_TRUE(Drain(node).ok());
  auto twice = Drain(node);
  ASSERT_TRUE(twice.ok()) << twice.error().ToString();
  EXPECT_FALSE(twice->changed());
}

TEST_F(HostOpsFlowTest, ADecommissionedNodeIsRetiredForGood) {
  const std::string node = "retire-a";
  p_.StartApprovedAgent(node, "retire", 2);
  auto live = p_.CreateSlice("retire-live", "retire", 1);
  ASSERT_TRUE(live.ok()) << live.error().ToString();

  // Only a drained node, and only once nothing holds it.
  auto active = Admin("gpuaas.v1.inventory.node.decommission", node);
  ASSERT_FALSE(active.ok());
  EXPECT_EQ(active.error().reason, "illegal_transition");
  ASSERT_TRUE(Drain(node).ok());
  auto held = Admin("gpuaas.v1.inventory.node.decommission", node);
  ASSERT_FALSE(held.ok());
  EXPECT_EQ(held.error().code, Code::kFailedPrecondition);
  EXPECT_EQ(held.error().reason, "node_has_live_claims");
  EXPECT_EQ(held.error().details.at("allocations"), live->allocation_id());
  EXPECT_EQ(Node(node).admin_state(), v1::NODE_ADMIN_STATE_DRAINING);

  p_.WaitSettled(live->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
  ASSERT_TRUE(p_.Release(live->allocation_id()).ok());
  p_.WaitSettled(live->allocation_id(), v1::ALLOCATION_STATE_RELEASED);
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  auto retired = Admin("gpuaas.v1.inventory.node.decommission", node, "chassis replaced");
  ASSERT_TRUE(retired.ok()) << retired.error().ToString();
  EXPECT_EQ(retired->node().admin_state(), v1::NODE_ADMIN_STATE_DECOMMISSIONED);

  // Its slots are disabled with the reason, its desired set is empty, its task consumer gone.
  v1::ShowNodeRequest show;
  show.set_node_id(node);
  auto shown = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show);
  ASSERT_TRUE(shown.ok()) << shown.error().ToString();
  ASSERT_EQ(shown->slots_size(), 2);
  for (const auto& slot : shown->slots()) {
    EXPECT_EQ(slot.admin_state(), v1::SLOT_ADMIN_STATE_DISABLED);
    EXPECT_EQ(slot.disabled_reason(), "node decommissioned: chassis replaced");
  }
  v1::GetDesiredSlotsRequest want;
  want.set_node_id(node);
  auto desired =
      Call<v1::GetDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.get", want);
  ASSERT_TRUE(desired.ok()) << desired.error().ToString();
  EXPECT_EQ(desired->desired().slots_size(), 0);
  EXPECT_FALSE(
      messaging::ConsumerBacklog(*p_.conn, messaging::NodeTasksStream().name, "node-" + node).ok());

  // Final: no operation and no registration brings it back.
  auto undrain = Admin("gpuaas.v1.inventory.node.undrain", node);
  ASSERT_FALSE(undrain.ok());
  EXPECT_EQ(undrain.error().reason, "illegal_transition");
  v1::RegisterNodeRequest again;
  again.set_node_id(node);
  again.set_hostname(node);
  again.set_region("us-east-1");
  again.set_pool("retire");
  again.set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
  auto reg = Call<v1::RegisterNodeResponse>("gpuaas.v1.inventory.node.{node_id}.register", again);
  ASSERT_FALSE(reg.ok());
  EXPECT_EQ(reg.error().reason, "node_decommissioned");
  EXPECT_EQ(SchedulableSlots(node), 0);
}

}  // namespace
}  // namespace gpuaas
