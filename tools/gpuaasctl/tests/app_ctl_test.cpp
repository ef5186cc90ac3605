// gpuaasctl app list / app check against a fake scheduler on a real nats-server (label nats): the
// table, the request each form of `app check` sends, -o json, and the exit codes (0 compatible,
// 4 not compatible, 1 the platform's error).
#include <gtest/gtest.h>

#include <mutex>
#include <string>
#include <vector>

#include "ctl_harness.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/apps.pb.h"

namespace gpuaas {
namespace {

class AppCtlTest : public testing::FakeSchedulerCtlTest {
 protected:
  static v1::AppManifest Jupyter() {
    v1::AppManifest a;
    a.set_name("jupyter");
    a.set_description("JupyterLab");
    a.set_kind(v1::APP_KIND_JUPYTER);
    a.add_shapes(v1::CAPACITY_SHAPE_GPU_SLICE);
    a.add_shapes(v1::CAPACITY_SHAPE_BAREMETAL);
    a.set_min_gpu_count(1);
    a.set_min_node_count(1);
    for (const auto& [name, port] :
         std::vector<std::pair<std::string, int>>{{"ssh", 22}, {"jupyter", 8888}}) {
      auto* e = a.add_endpoints();
      e->set_name(name);
      e->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
      e->set_port(port);
    }
    return a;
  }

  // Jupyter fits; "slurm-cluster" does not; anything else is unknown.
  void FakeScheduler() override {
    server_->Handle<v1::ListAppsRequest, v1::ListAppsResponse>(
        "gpuaas.v1.scheduler.app.list",
        [](const v1::ListAppsRequest&, rpc::Context&) -> Result<v1::ListAppsResponse> {
          v1::ListAppsResponse r;
          *r.add_apps() = Jupyter();
          auto* c = r.add_apps();
          c->set_name("slurm-cluster");
          c->set_kind(v1::APP_KIND_SLURM);
          c->add_shapes(v1::CAPACITY_SHAPE_BAREMETAL);
          c->set_min_gpu_count(1);
          c->set_max_gpu_count(8);
          c->set_multi_node(true);
          c->set_min_node_count(2);
          return r;
        });
    server_->Handle<v1::CheckAppCompatibilityRequest, v1::CheckAppCompatibilityResponse>(
        "gpuaas.v1.scheduler.app.compatibility",
        [this](const v1::CheckAppCompatibilityRequest& req,
               rpc::Context&) -> Result<v1::CheckAppCompatibilityResponse> {
          {
            std::lock_guard lock(mu_);
            last_ = req;
          }
          v1::CheckAppCompatibilityResponse r;
          r.set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
          r.set_gpu_count(2);
          r.set_node_count(1);
          if (req.app() == "jupyter") {
            *r.mutable_app() = Jupyter();
            r.set_compatible(true);
            return r;
          }
          if (req.app() == "slurm-cluster") {
            r.mutable_app()->set_name("slurm-cluster");
            auto* i = r.add_reasons();
            i->set_reason("multi_node_requires_baremetal");
            i->set_message("slurm-cluster is a multi-node cluster profile: baremetal only");
            return r;
          }
          return Error::NotFound("unknown_app", "no app named '" + req.app() + "'");
        });
  }

  v1::CheckAppCompatibilityRequest Last() {
    std::lock_guard lock(mu_);
    return last_;
  }

  std::mutex mu_;
  v1::CheckAppCompatibilityRequest last_;
};

TEST_F(AppCtlTest, ListPrintsShapesGpusNodesAndEndpoints) {
  auto r = Ctl({"app", "list"});
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const char* want :
       {"APP", "ENDPOINTS", "jupyter", "gpu_slice,baremetal", "1+", "ssh 22/tcp, jupyter 8888/tcp",
        "slurm-cluster", "1-8", "2+ (cluster)"}) {
    EXPECT_NE(r.out.find(want), std::string::npos) << want << " in:\n" << r.out;
  }
  auto j = Ctl({"app", "list", "-o", "json"});
  ASSERT_EQ(j.rc, 0) << j.err;
  EXPECT_NE(j.out.find("\"kind\": \"APP_KIND_JUPYTER\""), std::string::npos) << j.out;
  EXPECT_NE(j.out.find("\"protocol\": \"TRANSPORT_PROTOCOL_TCP\""), std::string::npos) << j.out;
}

TEST_F(AppCtlTest, CheckExitsByTheAnswer) {
  auto ok = Ctl({"app", "check", "jupyter", "--allocation", "a1"});
  EXPECT_EQ(ok.rc, 0) << ok.out << ok.err;
  EXPECT_NE(ok.out.find("jupyter on allocation a1 (gpu_slice, 2 GPU(s) per node, 1 node(s)): "
                        "compatible"),
            std::string::npos)
      << ok.out;
  EXPECT_NE(ok.out.find("endpoints: ssh 22/tcp, jupyter 8888/tcp"), std::string::npos) << ok.out;
  EXPECT_EQ(Last().allocation_id(), "a1");

  auto no = Ctl(
      {"app", "check", "slurm-cluster", "--sku", "h200-sxm-slice", "--gpus", "8", "--nodes", "4"});
  EXPECT_EQ(no.rc, 4) << no.out << no.err;
  EXPECT_NE(no.out.find("not compatible"), std::string::npos) << no.out;
  EXPECT_NE(no.out.find("multi_node_requires_baremetal"), std::string::npos) << no.out;
  auto sent = Last();
  ASSERT_TRUE(sent.has_order());
  EXPECT_EQ(sent.order().sku(), "h200-sxm-slice");
  EXPECT_EQ(sent.order().gpu_count(), 8);
  EXPECT_EQ(sent.order().node_count(), 4);
  EXPECT_EQ(sent.order().shape(), v1::CAPACITY_SHAPE_UNSPECIFIED);

  auto by_shape =
      Ctl({"app", "check", "slurm-cluster", "--shape", "baremetal", "--gpus", "8", "-o", "json"});
  EXPECT_EQ(by_shape.rc, 4) << by_shape.err;
  EXPECT_NE(by_shape.out.find("\"reason\": \"multi_node_requires_baremetal\""), std::string::npos)
      << by_shape.out;
  EXPECT_EQ(Last().order().shape(), v1::CAPACITY_SHAPE_BAREMETAL);

  auto unknown = Ctl({"app", "check", "nope", "--allocation", "a1"});
  EXPECT_EQ(unknown.rc, 1);
  EXPECT_NE(unknown.err.find("NOT_FOUND unknown_app"), std::string::npos) << unknown.err;
}

}  // namespace
}  // namespace gpuaas
