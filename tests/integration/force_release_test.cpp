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
    return p_.CreateSlice(request_id, kPool, gpus);
  }
  Result<v1::Allocation> ForceRelease(const std::string& id) {
    return p_.Release(id, "tenant unreachable, host reclaimed", true);
  }
  // Every slot of `node` free and schedulable, as placement sees it.
  bool AllFree(const std::string& node, int n) {
    int free = 0;
    for (const auto& s : p_.Slots(node)) {
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
  p_.WaitSettled(id, v1::ALLOCATION_STATE_ACTIVE);

  auto forced = ForceRelease(id);
  ASSERT_TRUE(forced.ok()) << forced.error().ToString();
  // The host may still run the VM: the claims stay until the cleanup proves the slots clean.
  EXPECT_EQ(forced->state(), v1::ALLOCATION_STATE_RELEASING);
  for (const auto& c : forced->claims()) EXPECT_FALSE(c.has_released_at());

  auto done = p_.WaitSettled(id, v1::ALLOCATION_STATE_RELEASED);
  for (const auto& c : done.claims()) EXPECT_TRUE(c.has_released_at());
  EXPECT_EQ(done.release_requested_by().reason(), "tenant unreachable, host reclaimed");
  auto steps = p_.Steps(id);
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
  auto active = p_.WaitSettled(next->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
  EXPECT_FALSE(active.has_failure()) << active.failure().DebugString();
}

TEST_F(ForceReleaseTest, QuietNodeKeepsTheSlotsBlockedUntilItAnswersAndTheCleanupIsProven) {
  // The agent's host and state outlive its first process, as on a real node that restarts.
  const std::string root = testing::MakeTempDir("gpuaas-host") + "/root";
  node_agent::FixtureOptions fo;
  fo.gpus = 2;
  fo.hostname = "fr-quiet";
  ASSERT_TRUE(node_agent::BuildFixtureHost(root, fo).ok());
  testing::Platform::EnvMap same_host = testing::Platform::SimulatedAgentEnv();
  same_host["GPUAAS_NODE_HOST_ROOT"] = root;
  same_host["GPUAAS_NODE_STATE_DIR"] = testing::MakeTempDir("gpuaas-agent");
  auto* agent = p_.StartAgent("fr-quiet", 2, kPool, same_host);
  p_.ApproveAll("fr-quiet");
  ASSERT_TRUE(testing::WaitFor([&] { return AllFree("fr-quiet", 2); }));

  auto first = Create("quiet-1", 2);
  ASSERT_TRUE(first.ok()) << first.error().ToString();
  const std::string id = first->allocation_id();
  p_.WaitSettled(id, v1::ALLOCATION_STATE_ACTIVE);

  // The node goes away; the operator force-releases anyway.
  agent->Shutdown();
  ASSERT_TRUE(ForceRelease(id).ok());
  auto blocked = p_.WaitSettled(id, v1::ALLOCATION_STATE_RELEASING);
  EXPECT_EQ(blocked.failure().code(), "node_unresponsive");
  for (const auto& c : blocked.claims()) {
    EXPECT_FALSE(c.has_released_at());
    EXPECT_EQ(c.phase(), v1::CLAIM_PHASE_CLEANUP_BLOCKED);
  }
  for (const auto& s : p_.Slots("fr-quiet")) {
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
  auto done = p_.WaitSettled(id, v1::ALLOCATION_STATE_RELEASED);
  for (const auto& c : done.claims()) EXPECT_TRUE(c.has_released_at());
  ASSERT_TRUE(testing::WaitFor([&] { return AllFree("fr-quiet", 2); }));
  auto next = Create("quiet-3", 2);
  ASSERT_TRUE(next.ok()) << next.error().ToString();
  EXPECT_EQ(Keys(*next), Keys(*first));
  p_.WaitSettled(next->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
}

}  // namespace
}  // namespace gpuaas
