// gpuaasctl against a fake scheduler on a real nats-server (label nats): the catalog, enum flags
// and columns, -o json (one document; JSON Lines under --watch), and the exit codes 1 (the
// platform's error), 3 (no service answers) and 4 (a --watch settled in another state).
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "ctl_harness.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas {
namespace {

using CtlRun = testing::CommandResult;

class CtlTest : public testing::FakeSchedulerCtlTest {
 protected:
  void FakeScheduler() override {
    server_->Handle<v1::ListCatalogRequest, v1::ListCatalogResponse>(
        "gpuaas.v1.scheduler.catalog.list",
        [](const v1::ListCatalogRequest&, rpc::Context&) -> Result<v1::ListCatalogResponse> {
          v1::ListCatalogResponse c;
          auto* s = c.add_skus();
          s->set_name("h200-sxm-slice");
          s->set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
          s->set_gpu_sku("h200-sxm");
          for (int n : {1, 2, 4, 8}) s->add_allowed_gpu_counts(n);
          s->add_network_modes(v1::NETWORK_MODE_PRIVATE_NAT);
          s->mutable_runtime_profile()->set_vcpus_per_gpu(16);
          s->mutable_runtime_profile()->set_memory_mib_per_gpu(229376);
          s->set_orderable(true);
          auto* m = c.add_skus();
          m->set_name("h200-mig");
          m->set_shape(v1::CAPACITY_SHAPE_GPU_PARTITION);
          m->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
          m->set_sharing_mechanism("mig");
          auto* i = c.add_images();
          i->set_name("ubuntu-24.04");
          i->set_url("file:///var/lib/gpuaas/images/ubuntu.qcow2");
          i->set_sha256(std::string(64, 'a'));
          i->set_is_default(true);
          return c;
        });
    server_->Handle<v1::GetAllocationRequest, v1::GetAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.get",
        [](const v1::GetAllocationRequest& req,
           rpc::Context&) -> Result<v1::GetAllocationResponse> {
          if (req.allocation_id() == "missing") {
            return Error::NotFound("allocation_not_found", "no allocation missing");
          }
          v1::GetAllocationResponse r;
          auto* a = r.mutable_allocation();
          a->set_allocation_id(req.allocation_id());
          a->set_state(v1::ALLOCATION_STATE_FAILED);
          auto* c = a->add_claims();
          c->set_kind(v1::CLAIM_KIND_SLOT);
          c->set_slot_key("gpu0");
          c->set_phase(req.allocation_id() == "freed" ? v1::CLAIM_PHASE_RELEASED
                                                      : v1::CLAIM_PHASE_CLEANUP_BLOCKED);
          if (req.allocation_id() == "freed") c->mutable_released_at()->set_seconds(1);
          return r;
        });
    server_->Handle<v1::ListAllocationsRequest, v1::ListAllocationsResponse>(
        "gpuaas.v1.scheduler.allocation.list",
        [this](const v1::ListAllocationsRequest& req,
               rpc::Context&) -> Result<v1::ListAllocationsResponse> {
          std::lock_guard lock(mu_);
          listed_state_ = req.state();
          v1::ListAllocationsResponse r;
          auto* a = r.add_allocations();
          a->set_allocation_id("a1");
          a->set_state(req.state());
          a->set_network_mode(v1::NETWORK_MODE_PRIVATE_NAT);
          auto* c = a->add_claims();
          c->set_kind(v1::CLAIM_KIND_NODE_EXCLUSIVE);
          c->set_phase(v1::CLAIM_PHASE_ACTIVE);
          return r;
        });
    server_->Handle<v1::CreateAllocationRequest, v1::CreateAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.create",
        [this](const v1::CreateAllocationRequest& req,
               rpc::Context&) -> Result<v1::CreateAllocationResponse> {
          std::lock_guard lock(mu_);
          created_mode_ = req.network_mode();
          v1::CreateAllocationResponse r;
          r.set_created(true);
          r.mutable_allocation()->set_allocation_id("good");
          r.mutable_allocation()->set_state(v1::ALLOCATION_STATE_RESERVED);
          return r;
        });
    server_->Handle<v1::ReleaseAllocationRequest, v1::ReleaseAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.release",
        [](const v1::ReleaseAllocationRequest& req,
           rpc::Context&) -> Result<v1::ReleaseAllocationResponse> {
          v1::ReleaseAllocationResponse r;
          r.mutable_allocation()->set_allocation_id(req.allocation_id());
          r.mutable_allocation()->set_state(v1::ALLOCATION_STATE_RELEASING);
          return r;
        });
    // "good" settles active, anything else failed; two entries, nothing in flight.
    server_->Handle<v1::GetAllocationTimelineRequest, v1::GetAllocationTimelineResponse>(
        "gpuaas.v1.scheduler.allocation.timeline",
        [](const v1::GetAllocationTimelineRequest& req,
           rpc::Context&) -> Result<v1::GetAllocationTimelineResponse> {
          const auto state = req.allocation_id() == "good" ? v1::ALLOCATION_STATE_ACTIVE
                                                           : v1::ALLOCATION_STATE_FAILED;
          v1::GetAllocationTimelineResponse r;
          r.set_state(state);
          r.set_last_seq("2");
          if (req.page_token().empty()) {
            auto* e = r.add_entries();
            e->set_seq(1);
            e->set_step(v1::TIMELINE_STEP_PLACED);
            e->set_state(v1::ALLOCATION_STATE_RESERVED);
            e = r.add_entries();
            e->set_seq(2);
            e->set_step(v1::TIMELINE_STEP_TASK_SUCCEEDED);
            e->set_task_type(v1::TASK_TYPE_VM_PROVISION);
            e->set_stage(v1::TASK_STAGE_READINESS);
            e->set_state(state);
          }
          return r;
        });
  }

  std::mutex mu_;
  v1::AllocationState listed_state_ = v1::ALLOCATION_STATE_UNSPECIFIED;
  v1::NetworkMode created_mode_ = v1::NETWORK_MODE_UNSPECIFIED;
};

TEST_F(CtlTest, CatalogPrintsSkusAndImages) {
  for (const auto& args : {std::vector<std::string>{"catalog"}, {"catalog", "list"}}) {
    auto r = Ctl(args);
    ASSERT_EQ(r.rc, 0) << r.err;
    for (const char* want :
         {"h200-sxm-slice", "gpu_slice", "h200-sxm ", "1,2,4,8", "private-nat (default)",
          "16 vCPU, 229376 MiB per GPU", "h200-mig", "gpu_partition", "infiniband", "no (mig)",
          "ubuntu-24.04", "aaaaaaaaaaaa ", "file:///var/lib/gpuaas/images/ubuntu.qcow2"}) {
      EXPECT_NE(r.out.find(want), std::string::npos) << want << " in:\n" << r.out;
    }
  }
  auto j = Ctl({"catalog", "-o", "json"});
  ASSERT_EQ(j.rc, 0) << j.err;
  EXPECT_NE(j.out.find("\"shape\": \"CAPACITY_SHAPE_GPU_SLICE\""), std::string::npos) << j.out;
  EXPECT_NE(j.out.find("\"NETWORK_MODE_PRIVATE_NAT\""), std::string::npos) << j.out;
}

TEST_F(CtlTest, PlatformErrorExits1WithTheStatus) {
  auto r = Ctl({"alloc", "get", "--id", "missing"});
  EXPECT_EQ(r.rc, 1);
  EXPECT_NE(r.err.find("NOT_FOUND allocation_not_found"), std::string::npos) << r.err;
  auto j = Ctl({"alloc", "get", "--id", "missing", "-o", "json"});
  EXPECT_EQ(j.rc, 1);
  EXPECT_NE(j.out.find("\"code\": \"NOT_FOUND\""), std::string::npos) << j.out;
  EXPECT_NE(j.out.find("\"reason\": \"allocation_not_found\""), std::string::npos) << j.out;
}

TEST_F(CtlTest, NoServiceAnswersExits3) {
  auto r = Ctl({"--timeout-ms", "1000", "node", "list"});  // no inventory here
  EXPECT_EQ(r.rc, 3) << r.out << r.err;
  EXPECT_NE(r.err.find("UNAVAILABLE no_responders"), std::string::npos) << r.err;
}

TEST_F(CtlTest, EnumFlagsAndColumnsUseTheirTexts) {
  auto r = Ctl({"alloc", "list", "--state", "released"});
  ASSERT_EQ(r.rc, 0) << r.err;
  {
    std::lock_guard lock(mu_);
    EXPECT_EQ(listed_state_, v1::ALLOCATION_STATE_RELEASED);
  }
  EXPECT_NE(r.out.find("released"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("node_exclusive"), std::string::npos) << r.out;

  auto c = Ctl({"alloc", "create", "--tenant", "t", "--request-id", "q", "--gpus", "1", "--region",
                "r", "--network-mode", "fabric-only"});
  ASSERT_EQ(c.rc, 0) << c.err;
  std::lock_guard lock(mu_);
  EXPECT_EQ(created_mode_, v1::NETWORK_MODE_FABRIC_ONLY);
}

TEST_F(CtlTest, WatchExitsByTheStateItSettledIn) {
  auto good = Ctl({"alloc", "timeline", "--id", "good", "--watch"});
  EXPECT_EQ(good.rc, 0) << good.out << good.err;
  EXPECT_NE(good.out.find("task_succeeded vm.provision"), std::string::npos) << good.out;
  EXPECT_NE(good.out.find("[readiness]"), std::string::npos) << good.out;
  EXPECT_NE(good.out.find("settled: active"), std::string::npos) << good.out;

  auto bad = Ctl({"alloc", "timeline", "--id", "bad", "--watch"});
  EXPECT_EQ(bad.rc, 4) << bad.out << bad.err;
  EXPECT_NE(bad.out.find("settled: failed"), std::string::npos) << bad.out;

  // create --watch asks for active; release --watch for released (or failed, every claim freed).
  EXPECT_EQ(Ctl({"alloc", "create", "--tenant", "t", "--request-id", "q", "--gpus", "1", "--region",
                 "r", "--watch"})
                .rc,
            0);
  EXPECT_EQ(Ctl({"alloc", "release", "--id", "freed", "--watch"}).rc, 0);
  EXPECT_EQ(Ctl({"alloc", "release", "--id", "blocked", "--watch"}).rc, 4);
  EXPECT_EQ(Ctl({"alloc", "release", "--id", "good", "--watch"}).rc, 4);  // active, not released
}

TEST_F(CtlTest, JsonIsOneDocumentOrJsonLinesUnderWatch) {
  auto doc = Ctl({"-o", "json", "alloc", "timeline", "--id", "good"});
  ASSERT_EQ(doc.rc, 0) << doc.err;
  EXPECT_EQ(doc.out.front(), '{');
  EXPECT_EQ(doc.out.find("\n{"), std::string::npos) << "one document:\n" << doc.out;
  EXPECT_NE(doc.out.find("\"entries\""), std::string::npos) << doc.out;
  EXPECT_NE(doc.out.find("\"state\": \"ALLOCATION_STATE_ACTIVE\""), std::string::npos) << doc.out;

  auto lines = Ctl({"alloc", "timeline", "--id", "good", "--watch", "-o", "json"});
  ASSERT_EQ(lines.rc, 0) << lines.err;
  std::istringstream in(lines.out);
  std::vector<std::string> got;
  for (std::string l; std::getline(in, l);) got.push_back(l);
  ASSERT_EQ(got.size(), 2u) << lines.out;
  EXPECT_NE(got[0].find("\"step\":\"TIMELINE_STEP_PLACED\""), std::string::npos) << got[0];
  EXPECT_NE(got[1].find("\"task_type\":\"TASK_TYPE_VM_PROVISION\""), std::string::npos) << got[1];
  for (const auto& l : got) EXPECT_TRUE(l.front() == '{' && l.back() == '}') << l;
}

}  // namespace
}  // namespace gpuaas
