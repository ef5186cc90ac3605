// gpuaasctl ingress against the real ingress service (in-process, real NATS JetStream and
// PostgreSQL; labels nats pg): pool set/list/delete round trips and their errors; expose,
// exposures, the node's exposure document and unexpose for an allocation ingress learnt from a
// scheduler event. And `alloc create --expose/--app`, `alloc get` and `alloc create --watch`
// against a fake scheduler whose slice waits for its endpoints after its VM is up.
#include <gtest/gtest.h>

#include <atomic>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "ctl_harness.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/ingress/ingress_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

bool Has(const std::string& text, const std::string& want) {
  return text.find(want) != std::string::npos;
}

class IngressCtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto dsn = testing::SharedPostgres().CreateDatabase("ingressctl");
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn},
                                              {"GPUAAS_LOG_LEVEL", "error"}};
    for (const auto& [k, v] : nats_.Env("ingress")) env[k] = v;
    svc_ = std::make_unique<ingress::IngressService>(LoadConfig<ingress::IngressConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    ASSERT_TRUE(svc_->runtime().nats()->Flush(2000ms).ok());
    conn_ = nats_.Connect(testing::TestNats::kHarness);
  }
  void TearDown() override {
    if (svc_) svc_->Shutdown();
  }

  testing::CommandResult Ctl(const std::vector<std::string>& args) {
    return testing::RunCtl(nats_, args);
  }

  // What the scheduler's outbox relay publishes about a slice allocation on node gpu-01.
  void PublishAllocation(const std::string& id, int64_t generation, bool vm_up) {
    v1::AllocationSnapshot snap;
    auto* a = snap.mutable_allocation();
    a->set_allocation_id(id);
    a->set_tenant("acme");
    a->set_node_id("gpu-01");
    a->set_region("us-east-1");
    a->set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
    a->set_state(v1::ALLOCATION_STATE_PROVISIONING);
    a->set_generation(generation);
    a->add_slot_keys("gpu-0000:18:00.0");
    a->set_vm_ready(vm_up);
    if (vm_up) a->mutable_network()->set_expected_ip("10.100.0.5");
    const std::string subject = "gpuaas.v1.evt.scheduler.allocation.provisioning";
    auto ev = outbox::MakeEvent({subject, "", "scheduler/test", id, generation, id, "", &snap});
    auto r = messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id());
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }

  testing::TestNats nats_;
  std::unique_ptr<ingress::IngressService> svc_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(IngressCtlTest, PoolSetListDeleteRoundTrip) {
  auto set =
      Ctl({"ingress", "pool", "set", "--name", "edge", "--kind", "port_range", "--region",
           "us-east-1", "--node", "gpu-01", "--address", "203.0.113.10", "--ports", "20000-20009"});
  ASSERT_EQ(set.rc, 0) << set.out << set.err;
  for (const char* want :
       {"pool edge created", "port_range", "gpu-01", "203.0.113.10", "20000-20009", "0/10"}) {
    EXPECT_TRUE(Has(set.out, want)) << want << " in:\n" << set.out;
  }
  // The same name again replaces it.
  auto again =
      Ctl({"ingress", "pool", "set", "--name", "edge", "--kind", "port_range", "--region",
           "us-east-1", "--node", "gpu-01", "--address", "203.0.113.10", "--ports", "20000-20019"});
  ASSERT_EQ(again.rc, 0) << again.err;
  EXPECT_TRUE(Has(again.out, "pool edge replaced")) << again.out;
  // --address repeats and takes comma-separated lists.
  auto ips =
      Ctl({"ingress", "pool", "set", "--name", "ips", "--kind", "public_ip", "--region",
           "us-east-1", "--address", "198.51.100.1,198.51.100.2", "--address", "198.51.100.3"});
  ASSERT_EQ(ips.rc, 0) << ips.err;
  EXPECT_TRUE(Has(ips.out, "198.51.100.1,198.51.100.2,198.51.100.3")) << ips.out;

  auto list = Ctl({"ingress", "pool", "list", "--region", "us-east-1"});
  ASSERT_EQ(list.rc, 0) << list.err;
  for (const char* want :
       {"NAME", "USED/TOTAL", "edge", "20000-20019", "0/20", "ips", "public_ip", "0/3"}) {
    EXPECT_TRUE(Has(list.out, want)) << want << " in:\n" << list.out;
  }
  auto json = Ctl({"ingress", "pool", "list", "-o", "json"});
  ASSERT_EQ(json.rc, 0) << json.err;
  EXPECT_TRUE(Has(json.out, "\"kind\": \"ENDPOINT_POOL_KIND_PORT_RANGE\"")) << json.out;
  EXPECT_TRUE(Has(json.out, "\"total\": \"20\"")) << json.out;
  auto other = Ctl({"ingress", "pool", "list", "--region", "eu-west-1"});
  ASSERT_EQ(other.rc, 0) << other.err;
  EXPECT_FALSE(Has(other.out, "edge")) << other.out;

  // The service's rules: ports below 1024 are refused (exit 1 with the status).
  auto bad =
      Ctl({"ingress", "pool", "set", "--name", "low", "--kind", "port_range", "--region",
           "us-east-1", "--node", "gpu-02", "--address", "203.0.113.11", "--ports", "80-90"});
  EXPECT_EQ(bad.rc, 1) << bad.out << bad.err;
  EXPECT_TRUE(Has(bad.err, "INVALID_ARGUMENT invalid_pool")) << bad.err;

  auto del = Ctl({"ingress", "pool", "delete", "--name", "ips"});
  ASSERT_EQ(del.rc, 0) << del.err;
  EXPECT_TRUE(Has(del.out, "pool ips deleted")) << del.out;
  EXPECT_FALSE(Has(Ctl({"ingress", "pool", "list"}).out, "ips"));
  auto gone = Ctl({"ingress", "pool", "delete", "--name", "ips"});
  EXPECT_EQ(gone.rc, 1);
  EXPECT_TRUE(Has(gone.err, "NOT_FOUND pool_not_found")) << gone.err;
}

TEST_F(IngressCtlTest, ExposeListNodeDocumentUnexpose) {
  ASSERT_EQ(
      Ctl({"ingress", "pool", "set", "--name", "edge", "--kind", "port_range", "--region",
           "us-east-1", "--node", "gpu-01", "--address", "203.0.113.10", "--ports", "20000-20009"})
          .rc,
      0);
  auto unknown =
      Ctl({"ingress", "expose", "--alloc", ids::NewUuidV7(), "--name", "ssh", "--port", "22"});
  EXPECT_EQ(unknown.rc, 1);
  EXPECT_TRUE(Has(unknown.err, "NOT_FOUND allocation_not_found")) << unknown.err;

  const std::string id = ids::NewUuidV7();
  PublishAllocation(id, 1, false);
  // Ingress learns the allocation from the event: expose works once it has.
  testing::CommandResult expose;
  ASSERT_TRUE(testing::WaitFor([&] {
    expose = Ctl({"ingress", "expose", "--alloc", id, "--name", "ssh", "--port", "22"});
    return expose.rc == 0;
  })) << expose.err;
  EXPECT_TRUE(Has(expose.out, "requested")) << expose.out;
  EXPECT_TRUE(Has(expose.out, "connect: ssh -p 200")) << expose.out;
  EXPECT_TRUE(Has(expose.out, " root@203.0.113.10\n")) << expose.out;
  EXPECT_FALSE(Has(expose.out, "existed already")) << expose.out;
  auto twice = Ctl({"ingress", "expose", "--alloc", id, "--name", "ssh", "--port", "22"});
  ASSERT_EQ(twice.rc, 0) << twice.err;
  EXPECT_TRUE(Has(twice.out, "(it existed already)")) << twice.out;
  auto json =
      Ctl({"ingress", "expose", "--alloc", id, "--name", "ssh", "--port", "22", "-o", "json"});
  ASSERT_EQ(json.rc, 0) << json.err;
  const auto at = json.out.find("\"exposure_id\": \"");
  ASSERT_NE(at, std::string::npos) << json.out;
  const std::string exposure = json.out.substr(at + 16, 36);
  EXPECT_TRUE(Has(Ctl({"ingress", "pool", "list"}).out, "1/10"));

  // Its VM comes up: the mapping goes into gpu-01's exposure document (no agent acks here).
  PublishAllocation(id, 2, true);
  testing::CommandResult node;
  ASSERT_TRUE(testing::WaitFor([&] {
    node = Ctl({"ingress", "node", "--node", "gpu-01"});
    return node.rc == 0 && Has(node.out, "10.100.0.5:22/tcp");
  })) << node.out
      << node.err;
  for (const auto& want :
       std::vector<std::string>{"document v1 (latest v1)", "applied v0 (never acked)",
                                "1 mapping(s)", exposure, "gpu-0000:18:00.0", "203.0.113.10:200"}) {
    EXPECT_TRUE(Has(node.out, want)) << want << " in:\n" << node.out;
  }
  auto list = Ctl({"ingress", "exposures", "--alloc", id, "--state", "applying"});
  ASSERT_EQ(list.rc, 0) << list.err;
  for (const auto& want : std::vector<std::string>{"PUBLIC -> TARGET", exposure, "ssh", "applying",
                                                   "-> 10.100.0.5:22/tcp"}) {
    EXPECT_TRUE(Has(list.out, want)) << want << " in:\n" << list.out;
  }
  EXPECT_FALSE(Has(Ctl({"ingress", "exposures", "--state", "active"}).out, exposure));

  auto unexpose = Ctl({"ingress", "unexpose", "--id", exposure});
  ASSERT_EQ(unexpose.rc, 0) << unexpose.err;
  EXPECT_TRUE(Has(unexpose.out, "removing")) << unexpose.out;
  auto after = Ctl({"ingress", "node", "--node", "gpu-01", "-o", "json"});
  ASSERT_EQ(after.rc, 0) << after.err;
  EXPECT_TRUE(Has(after.out, "\"version\": \"2\"")) << after.out;
  EXPECT_FALSE(Has(after.out, "\"mappings\"")) << after.out;
  auto v1doc = Ctl({"ingress", "node", "--node", "gpu-01", "--version", "1"});
  ASSERT_EQ(v1doc.rc, 0) << v1doc.err;
  EXPECT_TRUE(Has(v1doc.out, "document v1 (latest v2)")) << v1doc.out;
  auto missing = Ctl({"ingress", "unexpose", "--id", ids::NewUuidV7()});
  EXPECT_EQ(missing.rc, 1);
  EXPECT_TRUE(Has(missing.err, "NOT_FOUND exposure_not_found")) << missing.err;
}

// A fake scheduler: allocation "slow" (ssh) stays provisioning with its VM up and nothing in
// flight until its endpoint was reported applying a few times, then is active; "broken" fails
// because its endpoint failed.
class AllocEndpointsCtlTest : public testing::FakeSchedulerCtlTest {
 protected:
  void FakeScheduler() override {
    server_->Handle<v1::CreateAllocationRequest, v1::CreateAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.create",
        [this](const v1::CreateAllocationRequest& req,
               rpc::Context&) -> Result<v1::CreateAllocationResponse> {
          {
            std::lock_guard lock(mu_);
            created_ = req;
          }
          v1::CreateAllocationResponse r;
          r.set_created(true);
          *r.mutable_allocation() = Allocation(req.request_id());
          r.mutable_allocation()->set_state(v1::ALLOCATION_STATE_RESERVED);
          return r;
        });
    server_->Handle<v1::GetAllocationRequest, v1::GetAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.get",
        [this](const v1::GetAllocationRequest& req,
               rpc::Context&) -> Result<v1::GetAllocationResponse> {
          ++gets_;
          v1::GetAllocationResponse r;
          *r.mutable_allocation() = Allocation(req.allocation_id());
          return r;
        });
    server_->Handle<v1::GetAllocationTimelineRequest, v1::GetAllocationTimelineResponse>(
        "gpuaas.v1.scheduler.allocation.timeline",
        [this](const v1::GetAllocationTimelineRequest& req,
               rpc::Context&) -> Result<v1::GetAllocationTimelineResponse> {
          const auto a = Allocation(req.allocation_id());
          v1::GetAllocationTimelineResponse r;
          r.set_state(a.state());
          r.set_last_seq(req.page_token().empty() ? "2" : req.page_token());
          if (req.page_token().empty()) {
            auto* e = r.add_entries();
            e->set_seq(1);
            e->set_step(v1::TIMELINE_STEP_PLACED);
            e->set_state(v1::ALLOCATION_STATE_RESERVED);
            e = r.add_entries();
            e->set_seq(2);
            e->set_step(v1::TIMELINE_STEP_TASK_SUCCEEDED);
            e->set_task_type(v1::TASK_TYPE_VM_PROVISION);
            e->set_state(v1::ALLOCATION_STATE_PROVISIONING);
          } else if (req.page_token() == "2" && a.state() != v1::ALLOCATION_STATE_PROVISIONING) {
            auto* e = r.add_entries();
            e->set_seq(3);
            e->set_step(a.state() == v1::ALLOCATION_STATE_ACTIVE ? v1::TIMELINE_STEP_STATE
                                                                 : v1::TIMELINE_STEP_TASK_FAILED);
            e->set_state(a.state());
            e->set_detail("endpoints settled");
            r.set_last_seq("3");
          }
          return r;
        });
  }

  // The allocation as the scheduler's read model has it now.
  v1::Allocation Allocation(const std::string& id) {
    v1::Allocation a;
    a.set_allocation_id(id);
    a.set_app("jupyter");
    a.set_vm_ready(true);
    const bool settled = gets_ >= 3;
    a.set_state(!settled       ? v1::ALLOCATION_STATE_PROVISIONING
                : id == "slow" ? v1::ALLOCATION_STATE_ACTIVE
                               : v1::ALLOCATION_STATE_FAILED);
    auto* e = a.add_endpoints();
    e->set_name("ssh");
    e->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
    e->set_port(22);
    e->set_public_ip("203.0.113.10");
    e->set_public_port(20022);
    e->set_connect("ssh -p 20022 root@203.0.113.10");
    e->set_state(!settled       ? v1::EXPOSURE_STATE_APPLYING
                 : id == "slow" ? v1::EXPOSURE_STATE_ACTIVE
                                : v1::EXPOSURE_STATE_FAILED);
    if (settled && id != "slow") e->set_reason("target_not_slice");
    return a;
  }

  std::atomic<int> gets_{0};
  std::mutex mu_;
  v1::CreateAllocationRequest created_;
};

TEST_F(AllocEndpointsCtlTest, CreateSendsExposeAndApp) {
  auto r =
      Ctl({"alloc", "create", "--tenant", "acme", "--request-id", "q", "--gpus", "1", "--region",
           "r", "--expose", "ssh:22", "--expose", "dns:53/udp", "--app", "jupyter"});
  ASSERT_EQ(r.rc, 0) << r.err;
  std::lock_guard lock(mu_);
  ASSERT_EQ(created_.expose_size(), 2);
  EXPECT_EQ(created_.expose(0).name(), "ssh");
  EXPECT_EQ(created_.expose(0).port(), 22);
  EXPECT_EQ(created_.expose(0).protocol(), v1::TRANSPORT_PROTOCOL_TCP);
  EXPECT_EQ(created_.expose(1).name(), "dns");
  EXPECT_EQ(created_.expose(1).port(), 53);
  EXPECT_EQ(created_.expose(1).protocol(), v1::TRANSPORT_PROTOCOL_UDP);
  EXPECT_EQ(created_.app(), "jupyter");
}

TEST_F(AllocEndpointsCtlTest, WatchWaitsForTheEndpointsAndPrintsThem) {
  auto r = Ctl({"alloc", "create", "--tenant", "acme", "--request-id", "slow", "--gpus", "1",
                "--region", "r", "--expose", "ssh:22", "--watch"});
  EXPECT_EQ(r.rc, 0) << r.out << r.err;
  for (const char* want : {"waiting for endpoints: ssh applying", "settled: active",
                           "endpoints:", "22/tcp", "ssh -p 20022 root@203.0.113.10"}) {
    EXPECT_TRUE(Has(r.out, want)) << want << " in:\n" << r.out;
  }
  EXPECT_LT(r.out.find("settled: active"), r.out.find("ssh -p 20022")) << r.out;

  auto get = Ctl({"alloc", "get", "--id", "slow"});
  ASSERT_EQ(get.rc, 0) << get.err;
  for (const char* want :
       {"app: jupyter", "ENDPOINT", "CONNECT", "ssh", "active", "ssh -p 20022 root@203.0.113.10"}) {
    EXPECT_TRUE(Has(get.out, want)) << want << " in:\n" << get.out;
  }
}

TEST_F(AllocEndpointsCtlTest, WatchOfAFailedEndpointExits4WithItsReason) {
  auto r = Ctl({"alloc", "create", "--tenant", "acme", "--request-id", "broken", "--gpus", "1",
                "--region", "r", "--expose", "ssh:22", "--watch"});
  EXPECT_EQ(r.rc, 4) << r.out << r.err;
  EXPECT_TRUE(Has(r.out, "settled: failed")) << r.out;
  EXPECT_TRUE(Has(r.out, "target_not_slice")) << r.out;
}

TEST_F(AllocEndpointsCtlTest, WatchJsonLinesEndWithTheAllocation) {
  auto r = Ctl({"alloc", "create", "--tenant", "acme", "--request-id", "slow", "--gpus", "1",
                "--region", "r", "--expose", "ssh:22", "--watch", "-o", "json"});
  ASSERT_EQ(r.rc, 0) << r.out << r.err;
  std::istringstream in(r.out);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  ASSERT_GE(lines.size(), 3u) << r.out;
  for (const auto& l : lines) EXPECT_TRUE(l.front() == '{' && l.back() == '}') << l;
  EXPECT_TRUE(Has(lines.back(), "\"connect\":\"ssh -p 20022 root@203.0.113.10\"")) << r.out;
  EXPECT_TRUE(Has(lines.back(), "\"state\":\"ALLOCATION_STATE_ACTIVE\"")) << r.out;
}

}  // namespace
}  // namespace gpuaas
