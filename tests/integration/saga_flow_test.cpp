// The allocation lifecycle through the real services: inventory, ipam and the scheduler on real
// NATS + PostgreSQL, and three node-agents on fixture hosts running the simulated VM runtime —
// one that succeeds, one whose provisioning fails (no DHCP lease), one that never answers.
// Slots are discovered and approved the way an operator does it; allocations are placed by
// pool, provisioned, released and cleaned through typed node tasks.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

class SagaFlowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_.Start({{"GPUAAS_SCHEDULER_PROVISION_DEADLINE_S", "3"},
              {"GPUAAS_SCHEDULER_CLEANUP_DEADLINE_S", "3"},
              {"GPUAAS_SCHEDULER_SWEEP_INTERVAL_MS", "100"}});
  }
  // A simulated agent in pool `pool` whose VM runtime behaves as `behavior`; its slots approved.
  void StartApprovedAgent(const std::string& id, const std::string& pool,
                          const std::string& behavior) {
    p_.StartApprovedAgent(id, pool, 4, testing::Platform::SimulatedAgentEnv(behavior));
  }
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }
  static int Count(const v1::GetAllocationTimelineResponse& t, v1::TimelineStep step,
                   v1::TaskType type) {
    return testing::Platform::CountSteps(t, step, type);
  }

  testing::Platform p_;
};

TEST_F(SagaFlowTest, SimulatedAgentsSucceedFailAndStaySilent) {
  StartApprovedAgent("sim-ok", "ok", "succeed");
  StartApprovedAgent("sim-fail", "broken", "fail");
  StartApprovedAgent("sim-quiet", "quiet", "silent");
  for (const char* n : {"sim-ok", "sim-fail", "sim-quiet"}) {
    ASSERT_TRUE(p_.WaitSchedulable(n, 4)) << n;
  }

  // All three at once: each node runs its own tasks.
  auto ok = p_.CreateSlice("ok-1", "ok", 2);
  auto bad = p_.CreateSlice("bad-1", "broken", 4);
  auto quiet = p_.CreateSlice("quiet-1", "quiet", 1);
  ASSERT_TRUE(ok.ok() && bad.ok() && quiet.ok());
  EXPECT_EQ(ok->state(), v1::ALLOCATION_STATE_PROVISIONING);

  // Success: active with the network identity the node observed, which is the reservation.
  auto a = p_.WaitSettled(ok->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
  ASSERT_TRUE(a.has_network());
  EXPECT_EQ(a.network().lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(a.network().actual_ip(), a.network().expected_ip());
  EXPECT_EQ(a.network().domain_name(), "gpuaas-" + a.allocation_id());
  auto t = p_.Timeline(a.allocation_id());
  EXPECT_GE(Count(t, v1::TIMELINE_STEP_TASK_PROGRESS, v1::TASK_TYPE_VM_PROVISION), 5)
      << "validate, lease, image, ...";
  EXPECT_EQ(Count(t, v1::TIMELINE_STEP_TASK_SUCCEEDED, v1::TASK_TYPE_VM_PROVISION), 1);
  for (const auto& s : p_.Slots("sim-ok")) {
    const bool mine = std::count(a.slot_keys().begin(), a.slot_keys().end(), s.slot_key()) > 0;
    EXPECT_EQ(s.lifecycle(),
              mine ? v1::SLOT_LIFECYCLE_STATE_ACTIVE : v1::SLOT_LIFECYCLE_STATE_AVAILABLE)
        << s.slot_key();
  }
  // Release: vm.release, then slot.cleanup with a proof per slot; then the slots are free.
  auto r = p_.Release(a.allocation_id());
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  a = p_.WaitSettled(a.allocation_id(), v1::ALLOCATION_STATE_RELEASED);
  for (const auto& c : a.claims()) EXPECT_TRUE(c.has_released_at());
  t = p_.Timeline(a.allocation_id());
  EXPECT_EQ(Count(t, v1::TIMELINE_STEP_TASK_SUCCEEDED, v1::TASK_TYPE_VM_RELEASE), 1);
  EXPECT_EQ(Count(t, v1::TIMELINE_STEP_TASK_SUCCEEDED, v1::TASK_TYPE_SLOT_CLEANUP), 1);
  EXPECT_EQ(Count(t, v1::TIMELINE_STEP_CLAIMS_FREED, v1::TASK_TYPE_SLOT_CLEANUP), 1);
  for (const auto& s : p_.Slots("sim-ok")) {
    EXPECT_EQ(s.lifecycle(), v1::SLOT_LIFECYCLE_STATE_AVAILABLE) << s.slot_key();
  }

  // Failure: failed with the node's stage and code; cleanup ran and proved the slots clean.
  auto f = p_.WaitSettled(bad->allocation_id(), v1::ALLOCATION_STATE_FAILED);
  ASSERT_TRUE(f.has_failure());
  EXPECT_EQ(f.failure().stage(), v1::LIFECYCLE_STAGE_PROVISIONING);
  EXPECT_EQ(f.failure().code(), "lease_timeout");
  // The cleanup follows the failure (it may be sent a moment after the failure is recorded, when
  // nothing is in flight): wait for the proof to free every claim.
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        v1::GetAllocationRequest g;
        g.set_allocation_id(f.allocation_id());
        auto now = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
        if (!now.ok()) return false;
        f = now->allocation();
        for (const auto& c : f.claims()) {
          if (!c.has_released_at()) return false;
        }
        return true;
      },
      20s))
      << f.DebugString() << p_.Timeline(f.allocation_id()).DebugString();
  auto ft = p_.Timeline(f.allocation_id());
  bool saw_stage = false;
  for (const auto& e : ft.entries()) {
    if (e.step() == v1::TIMELINE_STEP_TASK_FAILED && e.stage() == v1::TASK_STAGE_READINESS) {
      saw_stage = true;
    }
  }
  EXPECT_TRUE(saw_stage) << "the node's failing stage is on the timeline";
  EXPECT_EQ(Count(ft, v1::TIMELINE_STEP_TASK_SUCCEEDED, v1::TASK_TYPE_SLOT_CLEANUP), 1);
  // The slots are reusable: a new 4-GPU allocation fits on that node again (and fails again).
  auto again = p_.CreateSlice("bad-2", "broken", 4);
  ASSERT_TRUE(again.ok()) << again.error().ToString();

  // Silence: node_unresponsive after the deadline; its cleanup is unanswered, so the slot stays
  // cleanup_blocked and unplaceable — a force-release too only sends the cleanup again: the slot
  // is freed by a proof, never without one.
  auto q = p_.WaitSettled(quiet->allocation_id(), v1::ALLOCATION_STATE_FAILED);
  EXPECT_EQ(q.failure().code(), "node_unresponsive");
  for (const auto& c : q.claims()) EXPECT_EQ(c.phase(), v1::CLAIM_PHASE_CLEANUP_BLOCKED);
  int blocked = 0;
  for (const auto& s : p_.Slots("sim-quiet")) {
    blocked += s.lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED ? 1 : 0;
  }
  EXPECT_EQ(blocked, 1);
  auto forced = p_.Release(q.allocation_id(), "test force-release", true);
  ASSERT_TRUE(forced.ok());
  for (const auto& c : forced->claims()) EXPECT_FALSE(c.has_released_at());
  // The allocation stays failed throughout, so wait for the positive signal: the second cleanup
  // timed out (right after the force-release its task may not be in flight yet).
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        return Count(p_.Timeline(q.allocation_id()), v1::TIMELINE_STEP_TASK_TIMED_OUT,
                     v1::TASK_TYPE_SLOT_CLEANUP) == 2;
      },
      20s));
  q = p_.WaitSettled(quiet->allocation_id(), v1::ALLOCATION_STATE_FAILED);
  for (const auto& c : q.claims()) EXPECT_EQ(c.phase(), v1::CLAIM_PHASE_CLEANUP_BLOCKED);
  EXPECT_EQ(Count(p_.Timeline(q.allocation_id()), v1::TIMELINE_STEP_TASK_TIMED_OUT,
                  v1::TASK_TYPE_SLOT_CLEANUP),
            2);

  // Inventory saw the VM tasks' outcomes too (node show, recent tasks).
  v1::ShowNodeRequest sr;
  sr.set_node_id("sim-ok");
  auto show = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", sr);
  ASSERT_TRUE(show.ok());
  int vm_tasks = 0;
  for (const auto& rt : show->recent_tasks()) {
    vm_tasks += enums::Text(rt.type()).rfind("vm.", 0) == 0 ? 1 : 0;
  }
  EXPECT_GE(vm_tasks, 2);
}

}  // namespace
}  // namespace gpuaas
