// Host operations through the real services: an operator drains a node holding a live slice
// while creates run against its pool (none lands on it once the drain is answered, the slice
// runs on), the node is drained when its last allocation is released and back in service on
// undrain; maintenance of a drained node ends when its agent's checks pass; a decommissioned
// node is retired for good; bad requests get a structured error and change nothing.
#include <gtest/gtest.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/host/host.hpp"
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
  // An approved agent with 2 GPUs on a fixture host the test can reach into (markers, driver
  // links); returns the host and the node's slots.
  node_agent::HostRoot StartOwnHostAgent(const std::string& node, const std::string& pool,
                                         std::vector<v1::Slot>* slots) {
    const std::string root = testing::MakeTempDir("gpuaas-host") + "/root";
    node_agent::FixtureOptions fo;
    fo.gpus = 2;
    fo.hostname = node;
    EXPECT_TRUE(node_agent::BuildFixtureHost(root, fo).ok());
    p_.StartApprovedAgent(node, pool, 2, {{"GPUAAS_NODE_HOST_ROOT", root}});
    v1::ShowNodeRequest show;
    show.set_node_id(node);
    // Schedulable comes before the agent applies the approval's desired set, and applying it
    // binds the devices: a test that changes the host waits until the agent has acked it.
    v1::ShowNodeResponse shown;
    EXPECT_TRUE(testing::WaitFor(
        [&] {
          auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show);
          if (!s.ok()) return false;
          shown = *s;
          return shown.desired_version() > 0 && shown.applied_version() == shown.desired_version();
        },
        20s))
        << node << " never applied its desired slot set";
    slots->assign(shown.slots().begin(), shown.slots().end());
    return node_agent::HostRoot(root);
  }
  // The node's admin state as the scheduler's projection has it (inventory's answer to an
  // undrain or a maintenance end comes a moment before the projection applies its event).
  v1::ProjectedNode Projected(const std::string& node) {
    v1::ListNodeHoldersRequest r;
    r.set_node_id(node);
    auto h = Call<v1::ListNodeHoldersResponse>("gpuaas.v1.scheduler.node.holders", r);
    return h.ok() ? h->node() : v1::ProjectedNode();
  }
  // Once the scheduler sees `node` active with `slots` schedulable slots, a slice of `gpus`
  // lands on it.
  void ExpectSliceLands(const std::string& node, const std::string& pool, int slots,
                        const std::string& request_id, int gpus = 1) {
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          return Projected(node).admin_state() == v1::NODE_ADMIN_STATE_ACTIVE &&
                 SchedulableSlots(node) == slots;
        },
        20s))
        << node << " is " << v1::NodeAdminState_Name(Projected(node).admin_state())
        << " in the scheduler's projection with " << SchedulableSlots(node)
        << " schedulable slots, wanted active with " << slots;
    auto placed = p_.CreateSlice(request_id, pool, gpus);
    ASSERT_TRUE(placed.ok()) << placed.error().ToString();
    EXPECT_EQ(placed->node_id(), node);
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
  clients.reserve(4);
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
  ExpectSliceLands(node, "drain", 4, "after-undrain");
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
  ExpectSliceLands(node, "maint", 2, "after-maintenance", 2);
}

TEST_F(HostOpsFlowTest, ADiskSwappedDuringMaintenanceMakesItsSlotACandidateAgain) {
  const std::string node = "maint-swap";
  std::vector<v1::Slot> slots;
  const node_agent::HostRoot host = StartOwnHostAgent(node, "swap", &slots);
  ASSERT_EQ(slots.size(), 2U);
  ASSERT_TRUE(Drain(node).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  ASSERT_TRUE(Admin("gpuaas.v1.inventory.node.maintenance", node, "replace a disk").ok());
  // The first slot's disk is replaced: the new one has another stable name (its EUI).
  const v1::Slot swapped = slots[0];
  const std::string& old_id = swapped.nvme_by_id();
  const std::string new_id = old_id.substr(0, old_id.size() - 2) + "ff";
  ASSERT_NE(old_id, new_id);
  const auto target = std::filesystem::read_symlink(host.Real(old_id));
  std::filesystem::remove(host.Real(old_id));
  std::filesystem::create_symlink(target, host.Real(new_id));

  v1::DiscoverNodeRequest d;
  d.set_node_id(node);
  ASSERT_TRUE(Call<v1::DiscoverNodeResponse>("gpuaas.v1.inventory.node.discover", d).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_ACTIVE));
  v1::ShowNodeRequest show;
  show.set_node_id(node);
  auto shown = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show);
  ASSERT_TRUE(shown.ok());
  for (const auto& s : shown->slots()) {
    if (s.slot_key() == swapped.slot_key()) {
      // Not the slot an operator approved: out of service, no drift to repair.
      EXPECT_EQ(s.admin_state(), v1::SLOT_ADMIN_STATE_DISABLED);
      EXPECT_EQ(s.disabled_reason().rfind("topology changed during maintenance: approve again", 0),
                0u)
          << s.disabled_reason();
      EXPECT_NE(s.disabled_reason().find(old_id), std::string::npos) << s.disabled_reason();
      EXPECT_EQ(s.drift_size(), 0);
    } else {
      EXPECT_EQ(s.admin_state(), v1::SLOT_ADMIN_STATE_AVAILABLE) << "an unchanged slot is back";
      EXPECT_EQ(s.health(), v1::SLOT_HEALTH_HEALTHY);
    }
  }
  // The report offers it again with the new disk; until approved, only the other slot sells.
  bool offered = false;
  for (const auto& c : shown->topology().candidates()) {
    offered = offered || (c.slot_key() == swapped.slot_key() && c.nvme_by_id() == new_id);
  }
  EXPECT_TRUE(offered) << shown->topology().DebugString();
  ASSERT_TRUE(testing::WaitFor([&] { return SchedulableSlots(node) == 1; }, 20s));
  p_.ApproveAll(node);
  ExpectSliceLands(node, "swap", 2, "after-swap", 2);
  auto after = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show);
  ASSERT_TRUE(after.ok());
  for (const auto& s : after->slots()) {
    if (s.slot_key() == swapped.slot_key()) {
      EXPECT_EQ(s.nvme_by_id(), new_id);
    }
  }
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

// A baremetal allocation of 8 GPUs for tenant acme in `pool`.
Result<v1::Allocation> CreateBaremetal(testing::Platform& p, const std::string& request_id,
                                       const std::string& pool) {
  v1::CreateAllocationRequest r;
  r.set_tenant("acme");
  r.set_request_id(request_id);
  r.set_sku("h200-sxm-baremetal");
  r.set_gpu_count(8);
  r.set_region("us-east-1");
  r.set_pool(pool);
  r.set_network_mode(v1::NETWORK_MODE_FABRIC_ONLY);
  auto c = p.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r);
  if (!c.ok()) return c.error();
  return c->allocation();
}

TEST_F(HostOpsFlowTest, AModeChangeTakesADrainedNodeToBaremetalAndBack) {
  const std::string node = "mode-a";
  p_.StartApprovedAgent(node, "mode", 8);
  auto mode = [&](v1::CapacityProfile m) {
    v1::ChangeNodeModeRequest r;
    r.set_node_id(node);
    r.set_mode(m);
    r.set_reason("rebalance");
    return Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", r);
  };
  auto early = mode(v1::CAPACITY_PROFILE_BAREMETAL);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.error().reason, "illegal_transition");
  // Slice-vm: no baremetal lands on it.
  auto refused = CreateBaremetal(p_, "bm-on-slice", "mode");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().reason, "no_placement");

  ASSERT_TRUE(Drain(node).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  auto started = mode(v1::CAPACITY_PROFILE_BAREMETAL);
  ASSERT_TRUE(started.ok()) << started.error().ToString();
  EXPECT_TRUE(started->changed());
  EXPECT_EQ(started->node().mode_target(), v1::CAPACITY_PROFILE_BAREMETAL);
  EXPECT_EQ(started->node().capacity_profile(), v1::CAPACITY_PROFILE_SLICE_VM);
  // The agent verified its devices on their host drivers: the node is in baremetal mode.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        const auto n = Node(node);
        return n.capacity_profile() == v1::CAPACITY_PROFILE_BAREMETAL &&
               n.mode_target() == v1::CAPACITY_PROFILE_UNSPECIFIED;
      },
      20s))
      << Node(node).DebugString();
  EXPECT_TRUE(Node(node).mode_blockers().empty());
  ASSERT_TRUE(Admin("gpuaas.v1.inventory.node.undrain", node).ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    const v1::ProjectedNode n = Projected(node);
    return n.admin_state() == v1::NODE_ADMIN_STATE_ACTIVE &&
           n.capacity_profile() == v1::CAPACITY_PROFILE_BAREMETAL;
  }));
  EXPECT_EQ(SchedulableSlots(node), 0) << "slots are not sold in baremetal mode";
  auto bm = CreateBaremetal(p_, "bm", "mode");
  ASSERT_TRUE(bm.ok()) << bm.error().ToString();
  EXPECT_EQ(bm->node_id(), node);
  auto slice = p_.CreateSlice("slice-on-bm", "mode", 1);
  ASSERT_FALSE(slice.ok());
  EXPECT_EQ(slice.error().reason, "no_placement");
  ASSERT_TRUE(p_.Release(bm->allocation_id()).ok());
  p_.WaitSettled(bm->allocation_id(), v1::ALLOCATION_STATE_RELEASED);

  // Back to slice-vm: its slots are candidates until an operator approves them again.
  ASSERT_TRUE(Drain(node).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  ASSERT_TRUE(mode(v1::CAPACITY_PROFILE_SLICE_VM).ok());
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Node(node).capacity_profile() == v1::CAPACITY_PROFILE_SLICE_VM; }, 20s));
  ASSERT_TRUE(Admin("gpuaas.v1.inventory.node.undrain", node).ok());
  v1::ShowNodeRequest show;
  show.set_node_id(node);
  auto shown = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show);
  ASSERT_TRUE(shown.ok());
  for (const auto& s : shown->slots()) {
    EXPECT_EQ(s.admin_state(), v1::SLOT_ADMIN_STATE_DISABLED) << s.slot_key();
    EXPECT_EQ(s.disabled_reason(), "mode changed to slice-vm: approve again");
  }
  auto unapproved = p_.CreateSlice("before-approval", "mode", 1);
  ASSERT_FALSE(unapproved.ok());
  EXPECT_EQ(unapproved.error().reason, "no_placement");
  p_.ApproveAll(node);
  ExpectSliceLands(node, "mode", 8, "after-approval");
}

TEST_F(HostOpsFlowTest, AModeChangeTheHostCannotApplyFailsWithTheAgentsReasons) {
  // A fixture host whose first GPU stays bound to vfio-pci (in use): baremetal cannot have it.
  const std::string node = "mode-stuck";
  std::vector<v1::Slot> slots;
  const node_agent::HostRoot host = StartOwnHostAgent(node, "stuck", &slots);
  ASSERT_FALSE(slots.empty());
  const std::string gpu = slots[0].gpu_pci_address();
  std::ofstream(host.Real(*host.Resolve("/sys/bus/pci/devices/" + gpu) + "/fixture_stays_bound"))
      << "1\n";

  ASSERT_TRUE(Drain(node).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  v1::ChangeNodeModeRequest r;
  r.set_node_id(node);
  r.set_mode(v1::CAPACITY_PROFILE_BAREMETAL);
  r.set_reason("rebalance");
  ASSERT_TRUE(Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", r).ok());
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Node(node).mode_target() == v1::CAPACITY_PROFILE_UNSPECIFIED; }, 20s));
  const auto n = Node(node);
  EXPECT_EQ(n.capacity_profile(), v1::CAPACITY_PROFILE_SLICE_VM) << "nothing unverified is done";
  std::string token = gpu;
  for (char& ch : token) {
    if (ch == ':' || ch == '.') ch = '_';
  }
  const std::set<std::string> blockers(n.mode_blockers().begin(), n.mode_blockers().end());
  EXPECT_TRUE(blockers.count("reboot_required_" + token)) << n.DebugString();
  EXPECT_TRUE(blockers.count("vfio_still_bound_" + token)) << n.DebugString();
  EXPECT_EQ(n.admin_state(), v1::NODE_ADMIN_STATE_DRAINED);
}

TEST_F(HostOpsFlowTest, NothingElseStartsWhileAModeChangeIsOpen) {
  // An agent that reads its desired set once a minute: the change stays open.
  const std::string node = "mode-open";
  p_.StartApprovedAgent(node, "open", 1, {{"GPUAAS_NODE_DESIRED_POLL_MS", "60000"}});
  ASSERT_TRUE(Drain(node).ok());
  ASSERT_TRUE(WaitAdminState(node, v1::NODE_ADMIN_STATE_DRAINED));
  v1::ChangeNodeModeRequest r;
  r.set_node_id(node);
  r.set_mode(v1::CAPACITY_PROFILE_BAREMETAL);
  r.set_reason("rebalance");
  ASSERT_TRUE(Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", r).ok());
  const int64_t generation = Node(node).generation();
  r.set_mode(v1::CAPACITY_PROFILE_SLICE_VM);
  auto second = Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", r);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.error().reason, "mode_change_in_progress");
  for (const char* subject :
       {"gpuaas.v1.inventory.node.undrain", "gpuaas.v1.inventory.node.maintenance",
        "gpuaas.v1.inventory.node.decommission"}) {
    auto refused = Admin(subject, node);
    ASSERT_FALSE(refused.ok()) << subject;
    EXPECT_EQ(refused.error().reason, "mode_change_in_progress") << subject;
  }
  v1::ChangeNodeModeRequest bad;
  bad.set_node_id(node);
  bad.set_reason("no mode");
  auto no_mode = Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", bad);
  ASSERT_FALSE(no_mode.ok());
  EXPECT_EQ(no_mode.error().reason, "invalid_admin_request");
  const auto n = Node(node);
  EXPECT_EQ(n.generation(), generation) << "nothing changed";
  EXPECT_EQ(n.mode_target(), v1::CAPACITY_PROFILE_BAREMETAL);
  EXPECT_EQ(n.capacity_profile(), v1::CAPACITY_PROFILE_SLICE_VM);
}

TEST_F(HostOpsFlowTest, AGpuThatLeavesVfioDegradesItsSlotUntilRepairBindsItAgain) {
  const std::string node = "bind-a";
  std::vector<v1::Slot> slots;
  const node_agent::HostRoot host = StartOwnHostAgent(node, "bind", &slots);
  ASSERT_EQ(slots.size(), 2U);
  const v1::Slot lost = slots[0];
  // Something on the host (a driver load, a hand edit) takes the GPU from vfio-pci.
  const std::string dev = *host.Resolve("/sys/bus/pci/devices/" + lost.gpu_pci_address());
  std::filesystem::remove(host.Real(dev + "/driver"));
  std::filesystem::create_directories(host.Real("/sys/bus/pci/drivers/nvidia"));
  std::filesystem::create_symlink(host.Real("/sys/bus/pci/drivers/nvidia"),
                                  host.Real(dev + "/driver"));

  v1::ShowNodeRequest show;
  show.set_node_id(node);
  auto slot = [&](const std::string& key) {
    auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show);
    for (const auto& x : s.ok() ? s->slots() : decltype(s->slots()){}) {
      if (x.slot_key() == key) return x;
    }
    return v1::Slot();
  };
  auto has_binding_drift = [](const v1::Slot& x) {
    for (const auto& d : x.drift()) {
      if (d.kind() == "vfio_binding_lost") return true;
    }
    return false;
  };
  ASSERT_TRUE(testing::WaitFor([&] { return has_binding_drift(slot(lost.slot_key())); }, 20s));
  EXPECT_EQ(slot(lost.slot_key()).health(), v1::SLOT_HEALTH_DEGRADED);
  EXPECT_FALSE(has_binding_drift(slot(slots[1].slot_key()))) << "only that slot";
  ASSERT_TRUE(testing::WaitFor([&] { return SchedulableSlots(node) == 1; }, 20s));

  // Repair: the agent binds it again, and its clean check clears the drift.
  v1::RepairSlotRequest repair;
  repair.set_node_id(node);
  repair.set_slot_key(lost.slot_key());
  ASSERT_TRUE(Call<v1::RepairSlotResponse>("gpuaas.v1.inventory.slot.repair", repair).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return !has_binding_drift(slot(lost.slot_key())); }, 20s));
  EXPECT_EQ(host.LinkBasename(dev + "/driver").value_or(""), "vfio-pci");
  EXPECT_EQ(slot(lost.slot_key()).health(), v1::SLOT_HEALTH_HEALTHY);
  EXPECT_TRUE(testing::WaitFor([&] { return SchedulableSlots(node) == 2; }, 20s));
}

}  // namespace
}  // namespace gpuaas
