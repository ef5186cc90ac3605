// The allocation saga against real NATS JetStream and PostgreSQL, with a node played at the wire
// level (a durable consumer on the node task stream that answers the way a node-agent does), so
// every edge can be forced: failures, silence, incomplete proofs, duplicate and late results.
// The same flows with real node-agents are in tests/integration/saga_flow_test.cpp.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/http.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/v1/node.pb.h"
#include "scheduler_fixture.hpp"

namespace gpuaas::scheduler {
namespace {

using google::protobuf::util::TimeUtil;

// What the played node does with each task type.
enum class Answer { kSucceed, kFail, kReject, kSilent, kIncompleteProof };

class SagaTest : public AllocationTest {
 protected:
  SagaTest() { replicas_wanted_ = 2; }
  void TearDown() override {
    if (node_) node_->Stop();
    AllocationTest::TearDown();
  }
  void StartNode() {
    messaging::ConsumerSpec spec;
    spec.stream = "GPUAAS_NODE_TASKS";
    spec.durable = "played-nodes";
    spec.filter_subject = "gpuaas.v1.node.>";
    spec.fetch_timeout_ms = 100;
    node_ = std::make_unique<messaging::Consumer>(
        conn_, spec, [this](const messaging::Delivery& d) { return OnTask(d); },
        log::Logger("test", "node", log::Level::kWarn));
    ASSERT_TRUE(node_->Start().ok());
  }
  messaging::HandlerResult OnTask(const messaging::Delivery& d) {
    v1::Event ev;
    v1::NodeTask t;
    if (!ev.ParseFromString(d.msg.data) || !ev.data().UnpackTo(&t)) {
      return messaging::HandlerResult::Reject("not a task");
    }
    Answer how;
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(t);
      msg_ids_.push_back(d.msg.Header("Nats-Msg-Id"));
      const auto& type = enums::Text(t.type());
      how = answers_.count(type) ? answers_[type] : Answer::kSucceed;
    }
    if (how == Answer::kSilent) return messaging::HandlerResult::Ack();
    v1::NodeTaskProgress p;
    p.set_task_id(t.task_id());
    p.set_node_id(t.node_id());
    p.set_type(t.type());
    p.set_stage(v1::TASK_STAGE_IMAGE);
    p.set_percent(50);
    p.set_detail("copying");
    Publish(t.node_id(), "progress", p, t.correlation_id());
    v1::NodeTaskResult r;
    r.set_task_id(t.task_id());
    r.set_node_id(t.node_id());
    r.set_type(t.type());
    if (how == Answer::kFail || how == Answer::kReject) {
      r.set_status(how == Answer::kFail ? v1::TASK_STATUS_FAILED : v1::TASK_STATUS_REJECTED);
      r.mutable_error()->set_reason(how == Answer::kFail ? "lease_timeout" : "slot_leased");
      r.mutable_error()->set_message("played failure");
      r.set_stage(v1::TASK_STAGE_READINESS);
    } else {
      r.set_status(v1::TASK_STATUS_SUCCEEDED);
      if (t.has_vm_provision()) {
        const auto& b = t.vm_provision();
        auto& out = *r.mutable_vm_provision();
        out.set_domain_name("gpuaas-" + b.allocation_id());
        out.set_mac(b.slots(0).mac());
        out.set_expected_ip(b.slots(0).private_ip());
        out.set_actual_ip(b.slots(0).private_ip());
        out.set_lease_state(v1::LEASE_STATE_BOUND);
        out.set_runtime(v1::VM_RUNTIME_SIMULATED);
      } else if (t.has_vm_release()) {
        r.mutable_vm_release()->set_stop(v1::STOP_METHOD_GRACEFUL);
      } else if (t.has_slot_cleanup()) {
        const auto& cp = t.slot_cleanup();
        auto& out = *r.mutable_slot_cleanup();
        for (const auto& s : cp.slots()) {
          auto* proof = out.add_proofs();
          proof->set_slot_key(s.slot_key());
          proof->set_nvme_by_id(s.nvme_by_id());
          proof->set_method(v1::WIPE_METHOD_SIMULATED);
          proof->set_domain_undefined(true);
          proof->set_network_state_removed(true);
          proof->set_exposure_state_removed(true);
          proof->set_signatures_remaining(how == Answer::kIncompleteProof);
        }
      }
    }
    const std::string word = r.status() == v1::TASK_STATUS_SUCCEEDED  ? "succeeded"
                             : r.status() == v1::TASK_STATUS_REJECTED ? "rejected"
                                                                      : "failed";
    last_result_[t.task_id()] = Publish(t.node_id(), "task." + word, r, t.correlation_id());
    return messaging::HandlerResult::Ack();
  }
  v1::Event Publish(const std::string& node, const std::string& suffix,
                    const google::protobuf::Message& m, const std::string& correlation) {
    const std::string subject = "gpuaas.v1.evt.node." + node + "." + suffix;
    if (suffix == "progress") {
      const std::string s = "gpuaas.v1.evt.node." + node + ".task.progress";
      auto ev = outbox::MakeEvent({s, "", "node-agent/" + node, node, 0, correlation, "", &m});
      EXPECT_TRUE(messaging::JsPublish(*conn_, s, ev.SerializeAsString(), ev.id()).ok());
      return ev;
    }
    auto ev = outbox::MakeEvent({subject, "", "node-agent/" + node, node, 0, correlation, "", &m});
    EXPECT_TRUE(messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id()).ok());
    return ev;
  }
  void SetAnswer(const std::string& type, Answer a) {
    std::lock_guard lock(mu_);
    answers_[type] = a;
  }
  std::vector<v1::NodeTask> Tasks(const std::string& type = "") {
    std::lock_guard lock(mu_);
    std::vector<v1::NodeTask> out;
    for (const auto& t : tasks_) {
      if (type.empty() || enums::Text(t.type()) == type) out.push_back(t);
    }
    return out;
  }
  v1::Allocation Get(const std::string& id) {
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    auto r = rpc::Client(conn_).Call<v1::GetAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.get", g, 5000ms);
    EXPECT_TRUE(r.ok());
    return r.ok() ? r->allocation() : v1::Allocation();
  }
  // Waits until the allocation is in `state` and no task of it is in flight.
  v1::Allocation WaitSettled(const std::string& id, const std::string& state,
                             std::chrono::milliseconds timeout = 15s) {
    v1::Allocation a;
    EXPECT_TRUE(testing::WaitFor(
        [&] {
          auto t = Timeline(id);
          a = Get(id);
          return enums::Text(a.state()) == state && t.ok() && !t->in_flight();
        },
        timeout))
        << "state " << enums::Text(a.state()) << ", wanted " << state;
    return a;
  }
  Result<v1::GetAllocationTimelineResponse> Timeline(const std::string& id,
                                                     const std::string& after = "", int page = 0) {
    v1::GetAllocationTimelineRequest r;
    r.set_allocation_id(id);
    r.set_page_token(after);
    r.set_page_size(page);
    return rpc::Client(conn_).Call<v1::GetAllocationTimelineResponse>(
        "gpuaas.v1.scheduler.allocation.timeline", r, 5000ms);
  }
  std::vector<std::string> Steps(const std::string& id) {
    std::vector<std::string> out;
    auto t = Timeline(id);
    EXPECT_TRUE(t.ok());
    if (!t.ok()) return out;
    for (const auto& e : t->entries()) {
      const auto& type = enums::Text(e.task_type());
      out.push_back(enums::Text(e.step()) + (type.empty() ? "" : " " + type));
    }
    return out;
  }
  static std::map<std::string, std::string> Phases(const v1::Allocation& a) {
    std::map<std::string, std::string> out;
    for (const auto& c : a.claims()) out[c.slot_key()] = enums::Text(c.phase());
    return out;
  }
  bool AllPhases(const v1::Allocation& a, const std::string& phase) {
    for (const auto& c : a.claims()) {
      if (enums::Text(c.phase()) != phase) return false;
    }
    return a.claims_size() > 0;
  }

  std::unique_ptr<messaging::Consumer> node_;
  std::mutex mu_;
  std::map<std::string, Answer> answers_;
  std::vector<v1::NodeTask> tasks_;
  std::vector<std::string> msg_ids_;
  std::map<std::string, v1::Event> last_result_;
};

TEST_F(SagaTest, SliceIsProvisionedReleasedAndCleanedThroughNodeTasks) {
  AddNode("gpu-01", 8);
  WaitProjected();
  StartNode();
  auto c = Create("life", 2);
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  const std::string id = c->allocation().allocation_id();
  auto a = WaitSettled(id, "active");
  EXPECT_TRUE(AllPhases(a, "active"));
  ASSERT_TRUE(a.has_network());
  EXPECT_EQ(a.network().lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(a.attempt(), 1);
  // The task carried the concrete bundle, with Nats-Msg-Id = allocation id + type + attempt.
  auto prov = Tasks("vm.provision");
  ASSERT_EQ(prov.size(), 1u);
  ASSERT_TRUE(prov[0].has_vm_provision());
  EXPECT_EQ(prov[0].type(), v1::TASK_TYPE_VM_PROVISION);
  const v1::ProvisionBundle& b = prov[0].vm_provision();
  EXPECT_EQ(b.allocation_id(), id);
  ASSERT_EQ(b.slots_size(), 2);
  for (const auto& s : b.slots()) {
    EXPECT_FALSE(s.nvme_by_id().empty());
    EXPECT_FALSE(s.mac().empty());
    EXPECT_FALSE(s.private_ip().empty());
    EXPECT_FALSE(s.fabric_vf_pci_address().empty());
  }
  EXPECT_EQ(b.shape().vcpus(), 48);
  EXPECT_EQ(b.shape().memory_mib(), 2 * 65536);
  EXPECT_EQ(b.image().name(), "tiny-guest");
  EXPECT_EQ(b.image().sha256().size(), 64u);
  EXPECT_EQ(b.cloud_init().instance_id(), id);
  EXPECT_TRUE(prov[0].has_deadline());
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(msg_ids_[0], id + ".vm.provision.1");
  }

  auto r = Release(id);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->allocation().state(), v1::ALLOCATION_STATE_RELEASING);
  a = WaitSettled(id, "released");
  for (const auto& cl : a.claims()) {
    EXPECT_TRUE(cl.has_released_at());
    EXPECT_EQ(cl.phase(), v1::CLAIM_PHASE_RELEASED);
  }
  EXPECT_FALSE(a.has_failure());
  EXPECT_EQ(Tasks("vm.release").size(), 1u);
  EXPECT_EQ(Tasks("slot.cleanup").size(), 1u);
  // Progress that two replicas happen to handle after its result is dropped as stale, so it is
  // left out of the comparison (the single-scheduler flow test checks progress).
  const std::vector<std::string> want = {"placed",
                                         "task_sent vm.provision",
                                         "task_succeeded vm.provision",
                                         "task_sent vm.release",
                                         "task_succeeded vm.release",
                                         "task_sent slot.cleanup",
                                         "task_succeeded slot.cleanup",
                                         "claims_freed slot.cleanup"};
  auto steps = Steps(id);
  const size_t all_steps = steps.size();
  steps.erase(std::remove_if(steps.begin(), steps.end(),
                             [](const std::string& x) { return x.rfind("task_progress", 0) == 0; }),
              steps.end());
  EXPECT_EQ(steps, want);
  // Pagination: two at a time from the start reaches the same entries.
  std::string token;
  size_t seen = 0;
  do {
    auto page = Timeline(id, token, 2);
    ASSERT_TRUE(page.ok());
    seen += page->entries_size();
    token = page->next_page_token();
  } while (!token.empty());
  EXPECT_EQ(seen, all_steps);
  // The slots are reusable: all 8 can be taken.
  ASSERT_TRUE(Create("all", 8).ok());
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(SagaTest, RetriedCreateAndRepeatedReleaseHaveNoDoubleEffect) {
  AddNode("gpu-01", 8);
  WaitProjected();
  SetAnswer("vm.release", Answer::kSilent);  // keeps the release in flight while we repeat it
  StartNode();
  auto a = Create("same", 2);
  ASSERT_TRUE(a.ok());
  auto again = Create("same", 2);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  const std::string id = a->allocation().allocation_id();
  EXPECT_EQ(again->allocation().allocation_id(), id);
  WaitSettled(id, "active");
  EXPECT_EQ(Tasks("vm.provision").size(), 1u);
  auto r1 = Release(id);
  ASSERT_TRUE(r1.ok()) << r1.error().ToString();
  EXPECT_EQ(r1->allocation().state(), v1::ALLOCATION_STATE_RELEASING);
  auto r2 = Release(id);
  ASSERT_TRUE(r2.ok());
  EXPECT_EQ(r2->allocation().generation(), r1->allocation().generation());
  ASSERT_TRUE(testing::WaitFor([&] { return Tasks("vm.release").size() == 1; }));
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(Tasks("vm.release").size(), 1u) << "a release in flight is not sent twice";
  // Admin force-release does not wait for the release in flight: it is cancelled and a new
  // vm.release goes out; the claims are freed by the cleanup proof that follows, not before.
  SetAnswer("vm.release", Answer::kSucceed);
  auto f = Release(id, true);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->allocation().state(), v1::ALLOCATION_STATE_RELEASING);
  for (const auto& cl : f->allocation().claims()) EXPECT_FALSE(cl.has_released_at());
  auto done = WaitSettled(id, "released");
  for (const auto& cl : done.claims()) EXPECT_TRUE(cl.has_released_at());
  EXPECT_EQ(Tasks("vm.release").size(), 2u);
  EXPECT_EQ(Tasks("slot.cleanup").size(), 1u);
  auto r3 = Release(id);
  ASSERT_TRUE(r3.ok());
  EXPECT_EQ(r3->allocation().generation(), done.generation());
  ASSERT_TRUE(Create("full", 8).ok());
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(SagaTest, FailedProvisioningBlocksSlotsUntilCleanupProof) {
  AddNode("gpu-01", 8);
  WaitProjected();
  SetAnswer("vm.provision", Answer::kFail);
  SetAnswer("slot.cleanup", Answer::kIncompleteProof);
  StartNode();
  auto c = Create("doomed", 4);
  ASSERT_TRUE(c.ok());
  const std::string id = c->allocation().allocation_id();
  auto a = WaitSettled(id, "failed");
  ASSERT_TRUE(a.has_failure());
  EXPECT_EQ(a.failure().stage(), v1::LIFECYCLE_STAGE_PROVISIONING);
  EXPECT_EQ(a.failure().code(), "lease_timeout");
  // A proof with signatures left is no proof: the slots stay cleanup_blocked, unplaceable.
  EXPECT_TRUE(AllPhases(a, "cleanup_blocked")) << ::testing::PrintToString(Phases(a));
  auto t = Timeline(id);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->entries(t->entries_size() - 1).code(), "cleanup_proof_incomplete");
  auto none = Create("eight", 8);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().reason, "no_placement");
  EXPECT_TRUE(Invariants().empty());
  // Releasing the failed allocation retries the cleanup; with a clean proof the claims go.
  SetAnswer("slot.cleanup", Answer::kSucceed);
  ASSERT_TRUE(Release(id).ok());
  a = WaitSettled(id, "failed");
  for (const auto& cl : a.claims()) EXPECT_TRUE(cl.has_released_at());
  EXPECT_EQ(Tasks("slot.cleanup").size(), 2u);
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(msg_ids_.back(), id + ".slot.cleanup.2");
  }
  EXPECT_TRUE(Create("eight-again", 8).ok());
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(SagaTest, RejectedProvisioningFailsWithTheNodesReason) {
  AddNode("gpu-01", 8);
  WaitProjected();
  SetAnswer("vm.provision", Answer::kReject);
  StartNode();
  auto c = Create("rej", 1);
  ASSERT_TRUE(c.ok());
  auto a = WaitSettled(c->allocation().allocation_id(), "failed");
  EXPECT_EQ(a.failure().code(), "slot_leased");
  for (const auto& cl : a.claims()) EXPECT_TRUE(cl.has_released_at()) << "cleanup proof freed it";
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(SagaTest, DuplicateAndLateResultsHaveNoSecondEffect) {
  AddNode("gpu-01", 8);
  WaitProjected();
  StartNode();
  auto c = Create("dup", 1);
  ASSERT_TRUE(c.ok());
  const std::string id = c->allocation().allocation_id();
  auto a = WaitSettled(id, "active");
  const int64_t gen = a.generation();
  const auto prov = Tasks("vm.provision").at(0);
  // The same result event again (a redelivery): the inbox drops it.
  const v1::Event same = last_result_.at(prov.task_id());
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.node.gpu-01.task.succeeded",
                                   same.SerializeAsString(), ids::NewUuidV7())
                  .ok());
  // A different event reporting the same task failed (a confused node): recorded, no effect.
  v1::NodeTaskResult late;
  late.set_task_id(prov.task_id());
  late.set_node_id("gpu-01");
  late.set_type(v1::TASK_TYPE_VM_PROVISION);
  late.set_status(v1::TASK_STATUS_FAILED);
  late.mutable_error()->set_reason("late");
  Publish("gpu-01", "task.failed", late, id);
  ASSERT_TRUE(testing::WaitFor([&] {
    auto steps = Steps(id);
    return std::count(steps.begin(), steps.end(), "late_result vm.provision") == 1;
  }));
  a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_ACTIVE);
  EXPECT_EQ(a.generation(), gen);
  // A result for a task id nobody sent is ignored.
  late.set_task_id(ids::NewUuidV7());
  Publish("gpu-01", "task.failed", late, id);
  // Malformed input: unknown allocation, bad page token.
  auto unknown = Timeline("0190b5a0-0000-7000-8000-000000000000");
  EXPECT_EQ(unknown.error().reason, "allocation_not_found");
  EXPECT_EQ(Timeline(id, "x1").error().reason, "invalid_page_token");
  EXPECT_EQ(Get(id).generation(), gen);
  EXPECT_TRUE(Invariants().empty());
}

class SilentNodeTest : public SagaTest {
 protected:
  SilentNodeTest() {
    extra_env_ = {{"GPUAAS_SCHEDULER_PROVISION_DEADLINE_S", "1"},
                  {"GPUAAS_SCHEDULER_RELEASE_DEADLINE_S", "1"},
                  {"GPUAAS_SCHEDULER_CLEANUP_DEADLINE_S", "1"},
                  {"GPUAAS_SCHEDULER_SWEEP_INTERVAL_MS", "100"}};
  }
};

TEST_F(SilentNodeTest, SilentNodeFailsTheAllocationAndAnAdminForceReleases) {
  AddNode("gpu-01", 8);
  WaitProjected();
  SetAnswer("vm.provision", Answer::kSilent);
  SetAnswer("slot.cleanup", Answer::kSilent);
  StartNode();
  auto c = Create("quiet", 2);
  ASSERT_TRUE(c.ok());
  const std::string id = c->allocation().allocation_id();
  auto a = WaitSettled(id, "failed");
  EXPECT_EQ(a.failure().code(), "node_unresponsive");
  EXPECT_EQ(a.failure().stage(), v1::LIFECYCLE_STAGE_PROVISIONING);
  // Its cleanup went unanswered too: the slots stay blocked (never silently reused).
  EXPECT_TRUE(AllPhases(a, "cleanup_blocked"));
  auto steps = Steps(id);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), "task_timed_out vm.provision"), 1);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), "task_timed_out slot.cleanup"), 1);
  EXPECT_TRUE(Invariants().empty());
  // An admin force-releases it while the node is still quiet: a new cleanup goes out, and the
  // slots stay blocked (never freed without proof) until the node answers.
  auto f = Release(id, true);
  ASSERT_TRUE(f.ok());
  EXPECT_EQ(f->allocation().state(), v1::ALLOCATION_STATE_FAILED);
  for (const auto& cl : f->allocation().claims()) EXPECT_FALSE(cl.has_released_at());
  EXPECT_THAT(Steps(id), ::testing::Contains("force_released"));
  a = WaitSettled(id, "failed");
  EXPECT_TRUE(AllPhases(a, "cleanup_blocked"));
  steps = Steps(id);
  EXPECT_EQ(std::count(steps.begin(), steps.end(), "task_timed_out slot.cleanup"), 2);
  EXPECT_TRUE(Invariants().empty());
  // The node answers again: one more release (what `gpuaasctl slot repair` sends) proves the
  // cleanup and frees the slots.
  SetAnswer("slot.cleanup", Answer::kSucceed);
  ASSERT_TRUE(Release(id).ok());
  a = WaitSettled(id, "failed");
  for (const auto& cl : a.claims()) EXPECT_TRUE(cl.has_released_at());
  EXPECT_TRUE(Invariants().empty());
  // The replicas counted the timeouts (one each per overdue task, whichever handled it).
  // (The counter moves right after the sweep's commit, so it is polled.)
  auto timed_out = [&] {
    double sum = 0;
    for (auto& r : replicas_) {
      auto m = http::Get("127.0.0.1", r->runtime().http_port(), "/metrics");
      if (!m.ok()) return -1.0;
      const std::string name = "\ngpuaas_scheduler_node_tasks_timed_out_total ";
      const auto at = m->second.find(name);
      if (at == std::string::npos) return -1.0;
      if (m->second.find("gpuaas_scheduler_node_tasks_open{type=\"vm.provision\"}") ==
          std::string::npos) {
        return -1.0;
      }
      sum += std::stod(m->second.substr(at + name.size()));
    }
    return sum;
  };
  EXPECT_TRUE(testing::WaitFor([&] { return timed_out() == 3; }))
      << timed_out() << " timed out; want vm.provision and slot.cleanup (twice)";

  // An active allocation whose node goes quiet on release stays releasing, blocked.
  SetAnswer("vm.provision", Answer::kSucceed);
  SetAnswer("vm.release", Answer::kSilent);
  auto b = Create("loud-then-quiet", 1);
  ASSERT_TRUE(b.ok());
  const std::string bid = b->allocation().allocation_id();
  WaitSettled(bid, "active");
  ASSERT_TRUE(Release(bid).ok());
  a = WaitSettled(bid, "releasing");
  EXPECT_EQ(a.failure().code(), "node_unresponsive");
  EXPECT_TRUE(AllPhases(a, "cleanup_blocked"));
  // The node answers again: releasing again retries from vm.release and finishes.
  SetAnswer("vm.release", Answer::kSucceed);
  SetAnswer("slot.cleanup", Answer::kSucceed);
  ASSERT_TRUE(Release(bid).ok());
  a = WaitSettled(bid, "released");
  EXPECT_FALSE(a.has_failure());
  EXPECT_EQ(Tasks("vm.release").size(), 2u);
  EXPECT_TRUE(Invariants().empty());
}

TEST_F(SagaTest, BaremetalIsActiveWhenPlacedAndFreedOnRelease) {
  AddNode("bm-01", 8, "us-east-1", /*baremetal_profile=*/true);
  WaitProjected();
  StartNode();
  auto c = Create("bm", 8, "h200-sxm-baremetal");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->allocation().state(), v1::ALLOCATION_STATE_ACTIVE);
  auto r = Release(c->allocation().allocation_id());
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->allocation().state(), v1::ALLOCATION_STATE_RELEASED);
  const std::vector<std::string> want = {"placed", "state", "claims_freed"};
  EXPECT_EQ(Steps(c->allocation().allocation_id()), want) << "baremetal sends no VM tasks";
  EXPECT_TRUE(Tasks().empty());
  EXPECT_TRUE(Invariants().empty());
}

}  // namespace
}  // namespace gpuaas::scheduler
