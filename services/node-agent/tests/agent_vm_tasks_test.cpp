// The agent answering the scheduler's VM lifecycle tasks over a real nats-server, on a fixture
// host, with a fake inventory that accepts the registration (label nats).
#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <limits>
#include <memory>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuaas/common/config.hpp"
#include "gpuaas/common/http.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/agent/node_agent.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

using google::protobuf::util::TimeUtil;
using namespace std::chrono_literals;

const std::string kNode = "sim-node-1";
const std::string kAlloc = "0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0b";

class NodeAgentVmTaskTest : public ::testing::Test {
 protected:
  void SetUp() override {
    // The test's stand-ins (inventory, the task sender) on the harness identity; the agent on
    // its own node identity.
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness),
                                            log::Logger("test", "t", log::Level::kError));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
    for (const auto& spec : {messaging::NodeTasksStream(), messaging::NodeEventsStream()}) {
      ASSERT_TRUE(messaging::EnsureStream(*conn_, spec).ok());
    }
    nats_.EnrollNode(kNode);
    // A fake inventory: accepts the registration (making the node's task consumer, as inventory
    // does), has no desired set.
    inventory_ =
        std::make_unique<rpc::Server>(conn_, "inventory", "gpuaas.*.inventory.>",
                                      log::Logger("inventory", "t", log::Level::kError), nullptr);
    inventory_->Handle<v1::RegisterNodeRequest, v1::RegisterNodeResponse>(
        "gpuaas.v1.inventory.node.{node_id}.register",
        [conn = conn_](const v1::RegisterNodeRequest& r,
                       rpc::Context&) -> Result<v1::RegisterNodeResponse> {
          if (auto e =
                  messaging::EnsureConsumer(*conn, messaging::NodeTaskConsumerSpec(r.node_id()));
              !e.ok()) {
            return e.error();
          }
          v1::RegisterNodeResponse resp;
          resp.mutable_node()->set_node_id(r.node_id());
          resp.mutable_node()->set_region(r.region());
          resp.mutable_node()->set_pool(r.pool());
          resp.set_created(true);
          return resp;
        });
    inventory_->Handle<v1::GetDesiredSlotsRequest, v1::GetDesiredSlotsResponse>(
        "gpuaas.v1.inventory.node.{node_id}.desired.get",
        [](const v1::GetDesiredSlotsRequest&, rpc::Context&)
            -> Result<v1::GetDesiredSlotsResponse> { return v1::GetDesiredSlotsResponse{}; });
    ASSERT_TRUE(inventory_->Start().ok());
    root_ = testing::MakeTempDir("gpuaas-host") + "/root";
    FixtureOptions fo;
    fo.gpus = 2;
    fo.hostname = kNode;
    ASSERT_TRUE(BuildFixtureHost(root_, fo).ok());
  }
  void TearDown() override {
    if (agent_) agent_->Shutdown();
    agent_.reset();
    if (inventory_) inventory_->Drain(2s);
  }
  void StartAgent(const std::string& behavior,
                  const std::map<std::string, std::string>& extra = {}) {
    std::map<std::string, std::string> env = {
        {"GPUAAS_NATS_URL", nats_.url()},
        {"GPUAAS_LOG_LEVEL", "error"},
        {"GPUAAS_NODE_ID", kNode},
        {"GPUAAS_NODE_REGION", "us-east-1"},
        {"GPUAAS_NODE_POOL", "h200"},
        {"GPUAAS_NODE_STATE_DIR", testing::MakeTempDir("gpuaas-agent")},
        {"GPUAAS_NODE_REGISTER_RETRY_MS", "50"},
        {"GPUAAS_NODE_DESIRED_POLL_MS", "1000"},
        {"GPUAAS_NODE_HOST_ROOT", root_},
        {"GPUAAS_NODE_DISCOVER_ON_START", "false"},
        {"GPUAAS_LIBVIRT_URI", ""},
        {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", behavior},
        {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "1"}};
    for (const auto& [k, v] : nats_.Env("node-agent", kNode)) env[k] = v;
    for (const auto& [k, v] : extra) env[k] = v;
    agent_ = std::make_unique<NodeAgent>(LoadConfig<NodeAgentConfig>(env));
    ASSERT_TRUE(agent_->Start().ok());
    ASSERT_TRUE(testing::WaitFor([&] { return agent_->Registered(); }));
  }
  // A task of `type` whose params oneof holds `params` (the case whose message type it is; none
  // when null), as the scheduler or inventory would send it.
  std::string Send(v1::TaskType type, const google::protobuf::Message* params,
                   const std::string& task_id = "", const messaging::Headers& headers = {}) {
    v1::NodeTask t;
    t.set_task_id(task_id.empty() ? ids::NewUuidV7() : task_id);
    t.set_node_id(kNode);
    t.set_type(type);
    t.set_correlation_id(kAlloc);
    *t.mutable_deadline() = TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(60);
    if (params) {
      const auto* oneof = v1::NodeTask::descriptor()->FindOneofByName("params");
      for (int i = 0; i < oneof->field_count(); ++i) {
        const auto* f = oneof->field(i);
        if (f->message_type() == params->GetDescriptor()) {
          t.GetReflection()->MutableMessage(&t, f)->CopyFrom(*params);
        }
      }
    }
    const std::string subject = "gpuaas.v1.node." + kNode + ".task";
    outbox::EventSpec spec;
    spec.nats_subject = subject;
    spec.source = "test/1";
    spec.entity = kNode;
    spec.data = &t;
    const auto ev = outbox::MakeEvent(spec);
    EXPECT_TRUE(
        messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id(), headers).ok());
    return t.task_id();
  }
  Result<v1::NodeTaskResult> Wait(const std::string& status, const std::string& task_id,
                                  std::chrono::milliseconds timeout = 10s) {
    Result<v1::NodeTaskResult> r = Error::NotFound("none", "no result yet");
    testing::WaitFor(
        [&] {
          auto m = messaging::StreamLastMessage(*conn_, "GPUAAS_EVT_NODE",
                                                "gpuaas.v1.evt.node." + kNode + ".task." + status);
          v1::Event ev;
          v1::NodeTaskResult res;
          if (!m.ok() || !ev.ParseFromString(m->data) || !ev.data().UnpackTo(&res)) return false;
          r = res;
          return res.task_id() == task_id;
        },
        timeout);
    if (r.ok() && r->task_id() != task_id) return Error::NotFound("none", "no result for task");
    return r;
  }
  uint64_t ProgressCount() {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_NODE",
                                           "gpuaas.v1.evt.node." + kNode + ".task.progress");
    if (!n.ok()) {
      // An unreadable count is a failure, never 0 (which "nothing published" would accept).
      ADD_FAILURE() << "progress count: " << n.error().ToString();
      return std::numeric_limits<uint64_t>::max();
    }
    return *n;
  }
  v1::ProvisionBundle Bundle() {
    v1::ProvisionBundle b;
    b.set_allocation_id(kAlloc);
    b.set_attempt(1);
    auto* s = b.add_slots();
    s->set_slot_key("gpu-0000:18:00.0");
    s->set_gpu_pci_address("0000:18:00.0");
    s->set_mac("52:54:00:12:34:56");
    s->set_private_ip("10.100.0.10");
    b.mutable_image()->set_name("ubuntu");
    b.mutable_image()->set_sha256(std::string(64, 'a'));
    b.mutable_shape()->set_vcpus(24);
    b.mutable_shape()->set_memory_mib(65536);
    return b;
  }

  testing::TestNats nats_;
  std::shared_ptr<messaging::Connection> conn_;
  std::unique_ptr<rpc::Server> inventory_;
  std::unique_ptr<NodeAgent> agent_;
  std::string root_;
};

TEST_F(NodeAgentVmTaskTest, ProvisionReleaseCleanupWithProgress) {
  StartAgent("succeed");
  const auto bundle = Bundle();
  const auto id = Send(v1::TASK_TYPE_VM_PROVISION, &bundle);
  auto r = Wait("succeeded", id);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ASSERT_TRUE(r->has_vm_provision()) << r->DebugString();
  const auto& out = r->vm_provision();
  EXPECT_EQ(out.domain_name(), "gpuaas-" + kAlloc);
  EXPECT_EQ(out.actual_ip(), "10.100.0.10");
  EXPECT_EQ(out.lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(out.runtime(), v1::VM_RUNTIME_SIMULATED);
  EXPECT_EQ(ProgressCount(), 9u);  // validate, lease, image x3, seed, define, start, readiness
  auto last = messaging::StreamLastMessage(*conn_, "GPUAAS_EVT_NODE",
                                           "gpuaas.v1.evt.node." + kNode + ".task.progress");
  ASSERT_TRUE(last.ok());
  v1::Event ev;
  v1::NodeTaskProgress p;
  ASSERT_TRUE(ev.ParseFromString(last->data) && ev.data().UnpackTo(&p));
  EXPECT_EQ(p.task_id(), id);
  EXPECT_EQ(p.type(), v1::TASK_TYPE_VM_PROVISION);
  EXPECT_EQ(p.stage(), v1::TASK_STAGE_READINESS);
  EXPECT_EQ(ev.correlation_id(), kAlloc);

  // Redelivered: the stored result again, not a second run.
  const uint64_t runs = agent_->TasksRun();
  Send(v1::TASK_TYPE_VM_PROVISION, &bundle, id);
  ASSERT_TRUE(testing::WaitFor([&] { return ProgressCount() == 9u; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(agent_->TasksRun(), runs);

  v1::ReleaseParams rel;
  rel.set_allocation_id(kAlloc);
  auto rr = Wait("succeeded", Send(v1::TASK_TYPE_VM_RELEASE, &rel));
  ASSERT_TRUE(rr.ok()) << rr.error().ToString();
  ASSERT_TRUE(rr->has_vm_release()) << rr->DebugString();
  const auto& ro = rr->vm_release();
  EXPECT_EQ(ro.stop(), v1::STOP_METHOD_GRACEFUL);

  v1::CleanupParams cl;
  cl.set_allocation_id(kAlloc);
  *cl.mutable_slots() = bundle.slots();
  auto cr = Wait("succeeded", Send(v1::TASK_TYPE_SLOT_CLEANUP, &cl));
  ASSERT_TRUE(cr.ok()) << cr.error().ToString();
  ASSERT_TRUE(cr->has_slot_cleanup()) << cr->DebugString();
  const auto& co = cr->slot_cleanup();
  ASSERT_EQ(co.proofs_size(), 1);
  EXPECT_EQ(co.proofs(0).method(), v1::WIPE_METHOD_SIMULATED);
}

// This process's stderr (where the JSON log lines go) into a file while it lives.
class StderrCapture {
 public:
  StderrCapture() : path_(testing::MakeTempDir("gpuaas-stderr") + "/stderr.log") {
    std::fflush(stderr);
    saved_ = dup(STDERR_FILENO);
    const int fd = open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    dup2(fd, STDERR_FILENO);
    close(fd);
  }
  ~StderrCapture() {
    std::fflush(stderr);
    dup2(saved_, STDERR_FILENO);
    close(saved_);
  }
  StderrCapture(const StderrCapture&) = delete;
  StderrCapture& operator=(const StderrCapture&) = delete;
  // The JSON log lines written so far whose task_id is `task_id`.
  std::vector<nlohmann::json> TaskLines(const std::string& task_id) const {
    std::fflush(stderr);
    std::ifstream in(path_);
    std::vector<nlohmann::json> out;
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_object() && j.value("task_id", "") == task_id) out.push_back(std::move(j));
    }
    return out;
  }

 private:
  std::string path_;
  int saved_ = -1;
};

// The value of the sample `name{labels}` in a Prometheus text exposition (labels in the
// serializer's order: sorted by name); -1 when absent.
double Sample(const std::string& exposition, const std::string& series) {
  std::istringstream in(exposition);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(series + " ", 0) == 0) return std::stod(line.substr(series.size() + 1));
  }
  return -1;
}

TEST_F(NodeAgentVmTaskTest, TaskLogLinesCarryTraceAndAllocationAndStagesAreTimed) {
  StderrCapture captured;
  StartAgent("succeed", {{"GPUAAS_LOG_LEVEL", "debug"}});
  const std::string traceparent = ids::NewTraceparent();
  const std::string trace_id = ids::TraceId(traceparent);
  const auto bundle = Bundle();
  const auto id =
      Send(v1::TASK_TYPE_VM_PROVISION, &bundle, "", {{messaging::kHeaderTraceparent, traceparent}});
  ASSERT_TRUE(Wait("succeeded", id).ok());

  // Every line about the task: started, one per stage, finished (written after the result).
  std::vector<nlohmann::json> lines;
  ASSERT_TRUE(testing::WaitFor([&] {
    lines = captured.TaskLines(id);
    return !lines.empty() && lines.back().value("msg", "") == "task finished";
  })) << lines.size()
      << " line(s) for the task";
  std::set<std::string> msgs;
  std::set<std::string> stages;
  for (const auto& j : lines) {
    EXPECT_EQ(j.value("trace_id", ""), trace_id) << j.dump();
    EXPECT_EQ(j.value("allocation_id", ""), kAlloc) << j.dump();
    EXPECT_EQ(j.value("node_id", ""), kNode) << j.dump();
    EXPECT_EQ(j.value("type", ""), "vm.provision") << j.dump();
    msgs.insert(j.value("msg", ""));
    if (j.value("msg", "") == "task stage done") stages.insert(j.value("stage", ""));
  }
  EXPECT_TRUE(msgs.count("task started"));
  EXPECT_EQ(stages, (std::set<std::string>{"validate", "lease", "image", "seed", "define", "start",
                                           "readiness"}));

  // The result continues the scheduler's trace.
  auto last = messaging::StreamLastMessage(*conn_, "GPUAAS_EVT_NODE",
                                           "gpuaas.v1.evt.node." + kNode + ".task.succeeded");
  ASSERT_TRUE(last.ok());
  EXPECT_EQ(ids::TraceId(last->Header(messaging::kHeaderTraceparent)), trace_id);

  // /metrics: the task and each of its stages, and the process and build families.
  auto m = http::Get("127.0.0.1", agent_->runtime().http_port(), "/metrics");
  ASSERT_TRUE(m.ok() && m->first == 200);
  const std::string& body = m->second;
  EXPECT_EQ(Sample(body,
                   "gpuaas_node_task_seconds_count{result=\"succeeded\",stage=\"total\","
                   "type=\"vm.provision\"}"),
            1)
      << body;
  for (const char* stage : {"validate", "image", "readiness"}) {
    EXPECT_EQ(Sample(body, std::string("gpuaas_node_task_seconds_count{result=\"succeeded\","
                                       "stage=\"") +
                               stage + "\",type=\"vm.provision\"}"),
              1)
        << stage;
  }
  EXPECT_GT(Sample(body, "process_resident_memory_bytes"), 0);
  EXPECT_GT(Sample(body, "process_open_fds"), 0);
  EXPECT_GT(Sample(body, "process_start_time_seconds"), 1.6e9);
  EXPECT_NE(body.find("gpuaas_build_info{commit=\""), std::string::npos);
  EXPECT_NE(body.find("service=\"node-agent\""), std::string::npos);
}

TEST_F(NodeAgentVmTaskTest, AFailedTaskIsTimedAtTheStageItFailed) {
  StartAgent("fail");  // vm.provision fails at readiness (lease_timeout)
  const auto bundle = Bundle();
  auto r = Wait("failed", Send(v1::TASK_TYPE_VM_PROVISION, &bundle));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ASSERT_EQ(r->stage(), v1::TASK_STAGE_READINESS);
  std::string body;
  ASSERT_TRUE(testing::WaitFor([&] {
    auto m = http::Get("127.0.0.1", agent_->runtime().http_port(), "/metrics");
    body = m.ok() ? m->second : "";
    return Sample(body,
                  "gpuaas_node_task_seconds_count{result=\"failed\",stage=\"total\","
                  "type=\"vm.provision\"}") == 1;
  })) << body;
  EXPECT_EQ(Sample(body,
                   "gpuaas_node_task_seconds_count{result=\"failed\",stage=\"readiness\","
                   "type=\"vm.provision\"}"),
            1);
  EXPECT_EQ(Sample(body,
                   "gpuaas_node_task_seconds_count{result=\"succeeded\",stage=\"start\","
                   "type=\"vm.provision\"}"),
            1);
}

TEST_F(NodeAgentVmTaskTest, LibvirtRuntimeAdoptsFirstThenRunsTasks) {
  StartAgent("succeed", {{"GPUAAS_VM_RUNTIME", "libvirt"},
                         {"GPUAAS_LIBVIRT_URI", "test:///default"},
                         {"GPUAAS_VM_DOMAIN_TYPE", "qemu"},
                         {"GPUAAS_VM_PASSTHROUGH", "false"},
                         {"GPUAAS_VM_LEASE_TIMEOUT_S", "1"},
                         {"GPUAAS_VM_SSH_TIMEOUT_S", "1"}});
  // Restart adoption against libvirt happens before the agent is ready.
  ASSERT_TRUE(testing::WaitFor([&] { return agent_->Adopted(); }));
  ASSERT_TRUE(testing::WaitFor([&] { return agent_->runtime().Readiness().first; }));
  // The libvirt runtime answers (here the fixture's disk is a plain file, which a real runtime
  // never writes to): a structured failure with its stage, not a simulated success.
  const auto bundle = Bundle();
  auto r = Wait("failed", Send(v1::TASK_TYPE_VM_PROVISION, &bundle));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_FALSE(r->error().reason().empty());
  EXPECT_NE(r->stage(), v1::TASK_STAGE_UNSPECIFIED) << r->DebugString();
  EXPECT_FALSE(r->has_vm_provision()) << "no output on failure";
}

TEST_F(NodeAgentVmTaskTest, VmTasksWaitWhileTheManagedSliceNetworkIsNotApplied) {
  // The agent manages the network but has no document applied (no ipam here): VM tasks are
  // redelivered later, not run against a host without its bridge and DHCP.
  StartAgent("succeed",
             {{"GPUAAS_NETWORK_APPLY", "netns"}, {"GPUAAS_NETWORK_NETNS", "gpuaas-no-such-ns"}});
  const auto bundle = Bundle();
  const std::string id = Send(v1::TASK_TYPE_VM_PROVISION, &bundle);
  for (const char* status : {"succeeded", "failed", "rejected"}) {
    EXPECT_FALSE(Wait(status, id, 1500ms).ok()) << status;
  }
}

TEST_F(NodeAgentVmTaskTest, BadParamsAndValidationErrors) {
  StartAgent("succeed");
  v1::ReleaseParams wrong;
  auto r = Wait("rejected", Send(v1::TASK_TYPE_VM_PROVISION, &wrong));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->error().reason(), "invalid_params");
  r = Wait("rejected", Send(v1::TASK_TYPE_SLOT_CLEANUP, nullptr));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->error().reason(), "invalid_params");
  // A task type this agent does not know (a newer scheduler): rejected, named by number.
  r = Wait("rejected", Send(static_cast<v1::TaskType>(99), &wrong));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->error().reason(), "unknown_task_type");
  EXPECT_EQ(r->error().code(), v1::UNIMPLEMENTED);

  auto bundle = Bundle();
  bundle.mutable_slots(0)->set_gpu_pci_address("0000:ff:00.0");
  r = Wait("rejected", Send(v1::TASK_TYPE_VM_PROVISION, &bundle));  // the node scheduler refuses it
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->error().reason(), "gpu_not_found");
  EXPECT_EQ(r->stage(), v1::TASK_STAGE_VALIDATE);
  EXPECT_FALSE(r->error().details().count("stage")) << "the stage travels as its own field";
  EXPECT_EQ(r->error().code(), v1::NOT_FOUND);
}

TEST_F(NodeAgentVmTaskTest, FailBehaviorFailsProvisionAtReadiness) {
  StartAgent("fail");
  const auto bundle = Bundle();
  auto r = Wait("failed", Send(v1::TASK_TYPE_VM_PROVISION, &bundle));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->error().reason(), "lease_timeout");
  EXPECT_EQ(r->stage(), v1::TASK_STAGE_READINESS);
  v1::ReleaseParams rel;
  rel.set_allocation_id(kAlloc);
  EXPECT_TRUE(Wait("succeeded", Send(v1::TASK_TYPE_VM_RELEASE, &rel)).ok());
}

TEST_F(NodeAgentVmTaskTest, SilentBehaviorAnswersNothing) {
  StartAgent("silent");
  const auto bundle = Bundle();
  Send(v1::TASK_TYPE_VM_PROVISION, &bundle);
  v1::ReleaseParams rel;
  rel.set_allocation_id(kAlloc);
  Send(v1::TASK_TYPE_VM_RELEASE, &rel);
  // Other tasks are still answered (the silence is only for the VM lifecycle).
  const v1::PrereqCheckParams none;
  auto r = Wait("succeeded", Send(v1::TASK_TYPE_PREREQ_CHECK, &none));
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  std::this_thread::sleep_for(300ms);
  for (const char* status : {"succeeded", "failed", "rejected", "progress"}) {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_NODE",
                                           "gpuaas.v1.evt.node." + kNode + ".task." + status);
    // A count that cannot be read proves nothing about what was published: it fails the test.
    ASSERT_TRUE(n.ok()) << status << ": " << n.error().ToString();
    EXPECT_EQ(*n, std::string(status) == "succeeded" ? 1u : 0u) << status;
  }
}

TEST(NodeAgentConfigTest, UnknownSimBehaviorIsAConfigError) {
  NodeAgentConfig cfg;
  config::Schema schema;
  cfg.Register(schema);
  auto r = schema.LoadFromString("", {{"GPUAAS_NODE_ID", kNode},
                                      {"GPUAAS_NODE_REGION", "r"},
                                      {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", "explode"},
                                      {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "-1"}});
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.error().details.count("node_agent.sim_behavior")) << r.error().ToString();
  EXPECT_TRUE(r.error().details.count("node_agent.sim_step_ms")) << r.error().ToString();
}

}  // namespace
}  // namespace gpuaas::node_agent
