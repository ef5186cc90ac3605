// An operator's force-release through the real services and a node-agent on a fixture host: the
// host is torn down (vm.release, then slot.cleanup with its proof) without waiting for the
// tenant, the node's lease on the slots goes with the proven cleanup, and the next allocation
// placed on those slots becomes active. When the node does not answer, the slots stay
// cleanup_blocked (never freed without proof) until the node is back and one more release —
// what `gpuaasctl slot repair` sends — proves the cleanup.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

constexpr const char* kPool = "fr";

class ForceReleaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_.Start({{"GPUAAS_SCHEDULER_RELEASE_DEADLINE_S", "2"},
              {"GPUAAS_SCHEDULER_CLEANUP_DEADLINE_S", "2"},
              {"GPUAAS_SCHEDULER_SWEEP_INTERVAL_MS", "100"}});
  }
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }
  Result<v1::Allocation> Create(const std::string& request_id, int gpus) {
    v1::CreateAllocationRequest r;
    r.set_tenant("acme");
    r.set_request_id(request_id);
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(gpus);
    r.set_region("us-east-1");
    r.set_pool(kPool);
    r.add_ssh_authorized_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA test");
    auto c = Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r);
    if (!c.ok()) return c.error();
    return c->allocation();
  }
  Result<v1::Allocation> ForceRelease(const std::string& id) {
    v1::ForceReleaseAllocationRequest r;
    r.set_allocation_id(id);
    r.set_reason("tenant unreachable, host reclaimed");
    auto x = Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.force_release", r);
    if (!x.ok()) return x.error();
    return x->allocation();
  }
  v1::GetAllocationTimelineResponse Timeline(const std::string& id) {
    v1::GetAllocationTimelineRequest r;
    r.set_allocation_id(id);
    r.set_page_size(500);
    auto t = Call<v1::GetAllocationTimelineResponse>("gpuaas.v1.scheduler.allocation.timeline", r);
    EXPECT_TRUE(t.ok());
    return t.ok() ? *t : v1::GetAllocationTimelineResponse();
  }
  // Timeline rows as "step[ task_type]", for failure messages and counts.
  std::vector<std::string> Steps(const std::string& id) {
    std::vector<std::string> out;
    const auto t = Timeline(id);
    out.reserve(t.entries_size());
    for (const auto& e : t.entries()) {
      const auto& type = enums::Text(e.task_type());
      out.push_back(enums::Text(e.step()) + (type.empty() ? "" : " " + type));
    }
    return out;
  }
  v1::Allocation WaitSettled(const std::string& id, const std::string& state) {
    v1::Allocation a;
    EXPECT_TRUE(testing::WaitFor(
        [&] {
          v1::GetAllocationTimelineRequest tr;
          tr.set_allocation_id(id);
          tr.set_page_size(1);
          auto t = Call<v1::GetAllocationTimelineResponse>(
              "gpuaas.v1.scheduler.allocation.timeline", tr);
          // Settled: in `state` with nothing in flight (one snapshot), then the allocation as
          // it is from there on.
          if (!t.ok() || enums::Text(t->state()) != state || t->in_flight()) return false;
          v1::GetAllocationRequest g;
          g.set_allocation_id(id);
          auto r = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
          if (!r.ok()) return false;
          a = r->allocation();
          return enums::Text(a.state()) == state;
        },
        20s))
        << id << " is " << enums::Text(a.state()) << ", wanted " << state << "; timeline:\n"
        << ::testing::PrintToString(Steps(id));
    return a;
  }
  std::vector<v1::ProjectedSlot> Slots(const std::string& node) {
    v1::ListProjectedSlotsRequest lr;
    lr.set_node_id(node);
    auto l = Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
    if (!l.ok()) return {};
    return {l->slots().begin(), l->slots().end()};
  }
  // Every slot of `node` free and schedulable, as placement sees it.
  bool AllFree(const std::string& node, int n) {
    int free = 0;
    for (const auto& s : Slots(node)) {
      free += s.schedulable() && s.allocation_id().empty() &&
                      s.lifecycle() == v1::SLOT_LIFECYCLE_STATE_AVAILABLE
                  ? 1
                  : 0;
    }
    return free == n;
  }
  static std::set<std::string> Keys(const v1::Allocation& a) {
    return {a.slot_keys().begin(), a.slot_keys().end()};
  }

  testing::Platform p_;
};

TEST_F(ForceReleaseTest, ForceReleasedSlotsAreCleanedAndTakeTheNextAllocation) {
  p_.StartApprovedAgent("fr-node", kPool, 2);
  auto first = Create("fr-1", 2);
  ASSERT_TRUE(first.ok()) << first.error().ToString();
  const std::string id = first->allocation_id();
  WaitSettled(id, "active");

  auto forced = ForceRelease(id);
  ASSERT_TRUE(forced.ok()) << forced.error().ToString();
  // The host may still run the VM: the claims stay until the cleanup proves the slots clean.
  EXPECT_EQ(forced->state(), v1::ALLOCATION_STATE_RELEASING);
  for (const auto& c : forced->claims()) EXPECT_FALSE(c.has_released_at());

  auto done = WaitSettled(id, "released");
  for (const auto& c : done.claims()) EXPECT_TRUE(c.has_released_at());
  EXPECT_EQ(done.release_requested_by().reason(), "tenant unreachable, host reclaimed");
  auto steps = Steps(id);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), "force_released"), 1)
      << ::testing::PrintToString(steps);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), "task_succeeded vm.release"), 1)
      << ::testing::PrintToString(steps);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), "task_succeeded slot.cleanup"), 1)
      << ::testing::PrintToString(steps);
  ASSERT_TRUE(testing::WaitFor([&] { return AllFree("fr-node", 2); }))
      << "the force-released slots are schedulable and free again";

  // The same two slots (the node has no others) take the next allocation, which the node's lease
  // ledger accepts.
  auto next = Create("fr-2", 2);
  ASSERT_TRUE(next.ok()) << next.error().ToString();
  EXPECT_EQ(next->node_id(), "fr-node");
  EXPECT_EQ(Keys(*next), Keys(*first));
  auto active = WaitSettled(next->allocation_id(), "active");
  EXPECT_FALSE(active.has_failure()) << active.failure().DebugString();
}

TEST_F(ForceReleaseTest, QuietNodeKeepsTheSlotsBlockedUntilItAnswersAndTheCleanupIsProven) {
  // The agent's host and state outlive its first process, as on a real node that restarts.
  const std::string root = testing::MakeTempDir("gpuaas-host") + "/root";
  node_agent::FixtureOptions fo;
  fo.gpus = 2;
  fo.hostname = "fr-quiet";
  ASSERT_TRUE(node_agent::BuildFixtureHost(root, fo).ok());
  const testing::Platform::EnvMap same_host = {
      {"GPUAAS_NODE_HOST_ROOT", root},
      {"GPUAAS_NODE_STATE_DIR", testing::MakeTempDir("gpuaas-agent")},
      {"GPUAAS_NODE_DESIRED_POLL_MS", "100"},
      {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", "succeed"},
      {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "5"}};
  auto* agent = p_.StartAgent("fr-quiet", 2, kPool, same_host);
  ASSERT_TRUE(testing::WaitFor([&] {
    v1::ShowNodeRequest r;
    r.set_node_id("fr-quiet");
    auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
    return s.ok() && s->snapshot_version() >= 1;
  }));
  v1::ApproveSlotsRequest approve;
  approve.set_node_id("fr-quiet");
  ASSERT_TRUE(Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve).ok());
  ASSERT_TRUE(testing::WaitFor([&] { return AllFree("fr-quiet", 2); }));

  auto first = Create("quiet-1", 2);
  ASSERT_TRUE(first.ok()) << first.error().ToString();
  const std::string id = first->allocation_id();
  WaitSettled(id, "active");

  // The node goes away; the operator force-releases anyway.
  agent->Shutdown();
  ASSERT_TRUE(ForceRelease(id).ok());
  auto blocked = WaitSettled(id, "releasing");
  EXPECT_EQ(blocked.failure().code(), "node_unresponsive");
  for (const auto& c : blocked.claims()) {
    EXPECT_FALSE(c.has_released_at());
    EXPECT_EQ(c.phase(), v1::CLAIM_PHASE_CLEANUP_BLOCKED);
  }
  for (const auto& s : Slots("fr-quiet")) {
    EXPECT_EQ(s.lifecycle(), v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED) << s.slot_key();
    EXPECT_EQ(s.allocation_id(), id);
  }
  auto refused = Create("quiet-2", 2);
  ASSERT_FALSE(refused.ok()) << "blocked slots are never placed on";
  EXPECT_EQ(refused.error().reason, "no_placement");

  // The node is back (same host, same lease ledger). One release — what `gpuaasctl slot repair`
  // sends for a cleanup_blocked slot — tears it down with proof, and the slots take new work.
  p_.StartAgent("fr-quiet", 2, kPool, same_host);
  v1::ReleaseAllocationRequest repair;
  repair.set_allocation_id(id);
  repair.set_reason("slot repair fr-quiet");
  auto r = Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", repair);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  auto done = WaitSettled(id, "released");
  for (const auto& c : done.claims()) EXPECT_TRUE(c.has_released_at());
  ASSERT_TRUE(testing::WaitFor([&] { return AllFree("fr-quiet", 2); }));
  auto next = Create("quiet-3", 2);
  ASSERT_TRUE(next.ok()) << next.error().ToString();
  EXPECT_EQ(Keys(*next), Keys(*first));
  WaitSettled(next->allocation_id(), "active");
}

}  // namespace
}  // namespace gpuaas
