// Host discovery to sellable slots, through the real services: a node-agent on a fixture host
// registers, reports its topology, inventory shows the candidates, an operator approves them
// (ipam reserves MAC/IP), the scheduler's projection has the slots, and the agent stores and
// acks the node's desired slot set. Plus typed tasks (duplicates, unknown types, deadlines) and
// agent isolation when inventory does not know the node.
#include <gtest/gtest.h>

#include <thread>

#include <fmt/format.h>
#include <google/protobuf/util/time_util.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;
using google::protobuf::util::TimeUtil;

class NodeFlowTest : public ::testing::Test {
 protected:
  void SetUp() override { p_.Start(); }
  // An agent on a fixture host with `gpus` GPUs.
  void StartAgent(const std::string& id, int gpus, int64_t register_retry_ms = 50) {
    agent_ = p_.StartAgent(id, gpus, "h200",
                           {{"GPUAAS_NODE_REGISTER_RETRY_MS", std::to_string(register_retry_ms)}});
  }
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }
  Result<v1::ShowNodeResponse> Show(const std::string& id) {
    v1::ShowNodeRequest r;
    r.set_node_id(id);
    return Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
  }
  // Sends a typed task to a node's task subject, the way inventory's outbox does.
  std::string SendTask(const std::string& node, v1::TaskType type,
                       const google::protobuf::Timestamp& deadline,
                       const std::string& task_id = "") {
    v1::NodeTask t;
    t.set_task_id(task_id.empty() ? ids::NewUuidV7() : task_id);
    t.set_node_id(node);
    t.set_type(type);
    // The checks take no parameters: their (empty) params case is still set.
    if (type == v1::TASK_TYPE_PREREQ_CHECK) t.mutable_prereq_check();
    if (type == v1::TASK_TYPE_NETWORK_BASELINE_CHECK) t.mutable_network_baseline_check();
    *t.mutable_deadline() = deadline;
    const std::string subject = "gpuaas.v1.node." + node + ".task";
    const auto ev = outbox::MakeEvent({subject, "", "test/1", node, 0, t.task_id(), "", &t});
    EXPECT_TRUE(messaging::JsPublish(*p_.conn, subject, ev.SerializeAsString(), ev.id()).ok());
    return t.task_id();
  }
  // The newest task result the agent published with `status`.
  Result<v1::NodeTaskResult> LastResult(const std::string& node, const std::string& status) {
    auto m = messaging::StreamLastMessage(*p_.conn, "GPUAAS_EVT_NODE",
                                          "gpuaas.v1.evt.node." + node + ".task." + status);
    if (!m.ok()) return m.error();
    v1::Event ev;
    v1::NodeTaskResult r;
    if (!ev.ParseFromString(m->data) || !ev.data().UnpackTo(&r)) {
      return Error::Internal("bad_result", "not a task result");
    }
    return r;
  }
  Result<v1::NodeTaskResult> WaitResult(const std::string& node, const std::string& status,
                                        const std::string& task_id) {
    Result<v1::NodeTaskResult> r = Error::NotFound("none", "no result yet");
    testing::WaitFor(
        [&] {
          r = LastResult(node, status);
          return r.ok() && r->task_id() == task_id;
        },
        10s);
    return r;
  }
  google::protobuf::Timestamp InAMinute() {
    return TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(60);
  }

  testing::Platform p_;
  node_agent::NodeAgent* agent_ = nullptr;
};

TEST_F(NodeFlowTest, DiscoveredCandidatesBecomeSchedulableSlotsOnceApproved) {
  StartAgent("sim-host-01", 4);
  // The agent reports its topology once registered; the candidates show in `node show`.
  ASSERT_TRUE(testing::WaitFor([&] {
    auto s = Show("sim-host-01");
    return s.ok() && s->snapshot_version() >= 1;
  }));
  auto show = Show("sim-host-01");
  ASSERT_TRUE(show.ok());
  ASSERT_EQ(show->topology().gpus_size(), 4);
  ASSERT_EQ(show->topology().candidates_size(), 4);
  EXPECT_TRUE(show->node_blockers().empty());
  for (const auto& c : show->topology().candidates()) {
    EXPECT_EQ(c.fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_PER_SLOT_VF) << c.slot_key();
    EXPECT_FALSE(c.nvme_by_id().empty()) << c.slot_key();
  }
  EXPECT_EQ(show->slots_size(), 0);

  v1::ApproveSlotsRequest approve;
  approve.set_node_id("sim-host-01");
  auto a = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  for (const auto& r : a->results()) EXPECT_TRUE(r.approved()) << r.DebugString();

  // The scheduler's projection has every slot, schedulable.
  v1::ListProjectedSlotsRequest lr;
  lr.set_node_id("sim-host-01");
  ASSERT_TRUE(testing::WaitFor([&] {
    auto l = Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
    if (!l.ok() || l->slots_size() != 4) return false;
    for (const auto& s : l->slots()) {
      if (!s.schedulable()) return false;
    }
    return true;
  }));

  // The agent stored the desired slot set and acked its version.
  ASSERT_TRUE(testing::WaitFor([&] { return agent_->AppliedDesiredVersion() == 1; }));
  ASSERT_TRUE(testing::WaitFor([&] {
    auto s = Show("sim-host-01");
    return s.ok() && s->applied_version() == 1 && s->desired_version() == 1;
  }));

  // An operator-triggered discovery runs as a typed task and produces snapshot 2.
  v1::DiscoverNodeRequest d;
  d.set_node_id("sim-host-01");
  auto task = Call<v1::DiscoverNodeResponse>("gpuaas.v1.inventory.node.discover", d);
  ASSERT_TRUE(task.ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    auto s = Show("sim-host-01");
    return s.ok() && s->snapshot_version() == 2 && !s->recent_tasks().empty() &&
           s->recent_tasks(0).status() == v1::TASK_STATUS_SUCCEEDED;
  }));

  // A rebuilt scheduler projection has the same slots.
  v1::RebuildProjectionRequest rebuild;
  rebuild.set_confirm(true);
  auto rebuilt =
      Call<v1::RebuildProjectionResponse>("gpuaas.v1.scheduler.projection.rebuild", rebuild);
  ASSERT_TRUE(rebuilt.ok()) << rebuilt.error().ToString();
  EXPECT_EQ(rebuilt->slots(), 4);
  EXPECT_EQ(rebuilt->nodes(), 1);
}

TEST_F(NodeFlowTest, TasksRunOnceAndBadTasksGetStructuredResults) {
  StartAgent("sim-host-02", 2);
  const std::string id = SendTask("sim-host-02", v1::TASK_TYPE_PREREQ_CHECK, InAMinute());
  auto ok = WaitResult("sim-host-02", "succeeded", id);
  ASSERT_TRUE(ok.ok()) << ok.error().ToString();
  ASSERT_TRUE(ok->has_prereq_check()) << ok->DebugString();
  v1::ChecksOutput out = ok->prereq_check();
  EXPECT_FALSE(out.checks().empty());
  const uint64_t ran = agent_->TasksRun();

  // Delivered again (a new JetStream message with the same task id): answered, not re-run.
  SendTask("sim-host-02", v1::TASK_TYPE_PREREQ_CHECK, InAMinute(), id);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(agent_->TasksRun(), ran);
  auto count = messaging::StreamSubjectCount(*p_.conn, "GPUAAS_EVT_NODE",
                                             "gpuaas.v1.evt.node.sim-host-02.task.succeeded");
  ASSERT_TRUE(count.ok());
  EXPECT_EQ(*count, 1u) << "the re-published result carries the same Nats-Msg-Id";

  const std::string net =
      SendTask("sim-host-02", v1::TASK_TYPE_NETWORK_BASELINE_CHECK, InAMinute());
  auto nr = WaitResult("sim-host-02", "succeeded", net);
  ASSERT_TRUE(nr.ok());
  ASSERT_TRUE(nr->has_network_baseline_check()) << nr->DebugString();
  out = nr->network_baseline_check();
  EXPECT_TRUE(out.network().nat_masquerade());
  EXPECT_TRUE(out.network().ip_forward());

  const std::string unknown = SendTask("sim-host-02", static_cast<v1::TaskType>(77), InAMinute());
  auto ur = WaitResult("sim-host-02", "rejected", unknown);
  ASSERT_TRUE(ur.ok());
  EXPECT_EQ(ur->error().reason(), "unknown_task_type");

  const std::string late = SendTask("sim-host-02", v1::TASK_TYPE_PREREQ_CHECK,
                                    TimeUtil::GetCurrentTime() - TimeUtil::SecondsToDuration(1));
  auto lr = WaitResult("sim-host-02", "failed", late);
  ASSERT_TRUE(lr.ok());
  EXPECT_EQ(lr->error().reason(), "deadline_exceeded");
  EXPECT_EQ(agent_->TasksRun(), ran + 1) << "only the network check ran";
}

TEST_F(NodeFlowTest, AgentUnknownToInventoryIsolatesItselfUntilRegisteredAgain) {
  StartAgent("sim-host-03", 1, 1500);
  ASSERT_FALSE(agent_->Isolated());
  // Inventory loses the node (a new, empty database): desired.get answers NotFound.
  p_.inventory->Shutdown();
  p_.StartInventory(testing::SharedPostgres().CreateDatabase("inv2"));
  ASSERT_TRUE(testing::WaitFor([&] { return agent_->Isolated(); }, 5s));
  EXPECT_FALSE(agent_->Registered());
  // While isolated, tasks are refused.
  const std::string id = SendTask("sim-host-03", v1::TASK_TYPE_PREREQ_CHECK, InAMinute());
  auto r = WaitResult("sim-host-03", "rejected", id);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->error().reason(), "agent_isolated");
  // Then it registers again with the new inventory and takes tasks.
  ASSERT_TRUE(testing::WaitFor([&] { return agent_->Registered() && !agent_->Isolated(); }, 10s));
  ASSERT_TRUE(testing::WaitFor([&] { return Show("sim-host-03").ok(); }));
  const std::string again = SendTask("sim-host-03", v1::TASK_TYPE_PREREQ_CHECK, InAMinute());
  EXPECT_TRUE(WaitResult("sim-host-03", "succeeded", again).ok());
}

}  // namespace
}  // namespace gpuaas
