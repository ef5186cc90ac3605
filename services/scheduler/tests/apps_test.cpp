// App manifests and app compatibility. AppsTest (unit): the compiled-in manifests, every reason
// of apps::Check on every manifest, orders resolved against the catalog. AppServiceTest (real
// NATS + PostgreSQL): app.list and app.compatibility as a tenant, an operator and an auditor
// would call them, including another tenant's allocation and an unknown app.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "apps.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/v1/apps.pb.h"
#include "scheduler_fixture.hpp"
#include "test_env.hpp"

namespace gpuaas::scheduler {
namespace {

using namespace std::chrono_literals;
using apps::Reason;

constexpr auto kSlice = v1::CAPACITY_SHAPE_GPU_SLICE;
constexpr auto kBaremetal = v1::CAPACITY_SHAPE_BAREMETAL;

std::set<std::string> Reasons(const std::vector<apps::Incompatibility>& got) {
  std::set<std::string> out;
  for (const auto& i : got) out.emplace(apps::ReasonText(i.reason));
  return out;
}

std::set<std::string> Reasons(const std::string& app, const apps::Target& t) {
  const auto* a = apps::Find(app);
  EXPECT_NE(a, nullptr) << app;
  return a ? Reasons(apps::Check(*a, t)) : std::set<std::string>{"<no app>"};
}

apps::Target On(v1::CapacityShape shape, int gpus, int nodes = 1,
                std::optional<v1::AllocationState> state = std::nullopt) {
  apps::Target t;
  t.shape = shape;
  t.gpu_count = gpus;
  t.node_count = nodes;
  t.state = state;
  return t;
}

TEST(AppsTest, TheCompiledInManifestsAreValidAndDeclareTheirEndpoints) {
  EXPECT_TRUE(apps::Validate(apps::All()).empty())
      << fmt::format("{}", fmt::join(apps::Validate(apps::All()), "\n"));
  // name -> (kind, endpoints "name/protocol/port")
  const std::map<std::string, std::pair<v1::AppKind, std::set<std::string>>> want = {
      {"oci-container", {v1::APP_KIND_OCI, {"ssh/tcp/22", "http/tcp/8080"}}},
      {"jupyter", {v1::APP_KIND_JUPYTER, {"ssh/tcp/22", "jupyter/tcp/8888"}}},
      {"vllm", {v1::APP_KIND_VLLM, {"ssh/tcp/22", "openai-api/tcp/8000"}}},
      {"slurm", {v1::APP_KIND_SLURM, {"ssh/tcp/22"}}},
      {"kubernetes", {v1::APP_KIND_KUBERNETES, {"ssh/tcp/22", "kube-api/tcp/6443"}}},
      {"slurm-cluster", {v1::APP_KIND_SLURM, {"ssh/tcp/22"}}},
      {"kubernetes-cluster", {v1::APP_KIND_KUBERNETES, {"ssh/tcp/22", "kube-api/tcp/6443"}}},
  };
  ASSERT_EQ(apps::All().apps_size(), static_cast<int>(want.size()));
  for (const auto& [name, w] : want) {
    const auto* a = apps::Find(name);
    ASSERT_NE(a, nullptr) << name;
    EXPECT_EQ(a->kind(), w.first) << name;
    std::set<std::string> endpoints;
    for (const auto& e : apps::Endpoints(*a)) {
      endpoints.insert(fmt::format("{}/{}/{}", e.name(), enums::Text(e.protocol()), e.port()));
    }
    EXPECT_EQ(endpoints, w.second) << name << ": exposing it exposes exactly these";
  }
  // Sorted by name, as app.list answers.
  for (int i = 1; i < apps::All().apps_size(); ++i) {
    EXPECT_LT(apps::All().apps(i - 1).name(), apps::All().apps(i).name());
  }
  EXPECT_EQ(apps::Find("nope"), nullptr);
  auto unknown = apps::Lookup("nope");
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().code, Code::kNotFound);
  EXPECT_EQ(unknown.error().reason, "unknown_app");
  EXPECT_NE(unknown.error().details.at("offered").find("jupyter"), std::string::npos);
}

// Every manifest on every shape with one GPU on one node: OCI, Jupyter, vLLM and single-node
// Slurm/Kubernetes run on slices and baremetal; cluster profiles only on baremetal (and then
// need more than one node); no app runs on the reserved fractional shapes.
TEST(AppsTest, EveryManifestOnEveryShape) {
  const std::set<std::string> none;
  const std::set<std::string> shape = {"shape_not_supported"};
  const std::set<std::string> cluster_on_slice = {"multi_node_requires_baremetal",
                                                  "node_count_below_minimum"};
  const std::set<std::string> one_node = {"node_count_below_minimum"};
  // app -> expected reasons on slice, baremetal, partition, shared
  const std::map<std::string, std::vector<std::set<std::string>>> want = {
      {"oci-container", {none, none, shape, shape}},
      {"jupyter", {none, none, shape, shape}},
      {"vllm", {none, none, shape, shape}},
      {"slurm", {none, none, shape, shape}},
      {"kubernetes", {none, none, shape, shape}},
      {"slurm-cluster", {cluster_on_slice, one_node, cluster_on_slice, cluster_on_slice}},
      {"kubernetes-cluster", {cluster_on_slice, one_node, cluster_on_slice, cluster_on_slice}},
  };
  const std::vector<v1::CapacityShape> shapes = {
      kSlice, kBaremetal, v1::CAPACITY_SHAPE_GPU_PARTITION, v1::CAPACITY_SHAPE_GPU_SHARED};
  for (const auto& [app, per_shape] : want) {
    for (size_t i = 0; i < shapes.size(); ++i) {
      EXPECT_EQ(Reasons(app, On(shapes[i], 1)), per_shape[i])
          << app << " on " << enums::Text(shapes[i]);
    }
  }
  // A cluster profile on enough baremetal nodes fits.
  EXPECT_EQ(Reasons("slurm-cluster", On(kBaremetal, 8, 2)), none);
  EXPECT_EQ(Reasons("kubernetes-cluster", On(kBaremetal, 8, 16)), none);
}

TEST(AppsTest, EachReasonWithTheValuesThatDecidedIt) {
  const auto* vllm = apps::Find("vllm");
  ASSERT_NE(vllm, nullptr);
  auto below = apps::Check(*vllm, On(kSlice, 0));
  ASSERT_EQ(below.size(), 1u);
  EXPECT_EQ(below[0].reason, Reason::kGpuCountBelowMinimum);
  EXPECT_EQ(below[0].message, "vllm needs at least 1 GPU(s) per node, the target has 0");

  auto above = apps::Check(*vllm, On(kBaremetal, 16));
  ASSERT_EQ(above.size(), 1u);
  EXPECT_EQ(above[0].reason, Reason::kGpuCountAboveMaximum);
  EXPECT_EQ(above[0].message, "vllm uses at most 8 GPU(s) per node, the target has 16");
  EXPECT_TRUE(apps::Check(*vllm, On(kBaremetal, 8)).empty());

  auto spread = apps::Check(*apps::Find("jupyter"), On(kBaremetal, 8, 3));
  ASSERT_EQ(spread.size(), 1u);
  EXPECT_EQ(spread[0].reason, Reason::kMultiNodeNotSupported);
  EXPECT_EQ(spread[0].message, "jupyter runs on one node, the target has 3");

  auto cluster = apps::Check(*apps::Find("kubernetes-cluster"), On(kSlice, 2));
  ASSERT_EQ(cluster.size(), 2u);
  EXPECT_EQ(cluster[0].reason, Reason::kMultiNodeRequiresBaremetal);
  EXPECT_NE(cluster[0].message.find("baremetal only"), std::string::npos) << cluster[0].message;
  EXPECT_NE(cluster[0].message.find("not on gpu_slice"), std::string::npos) << cluster[0].message;
  EXPECT_EQ(cluster[1].reason, Reason::kNodeCountBelowMinimum);
  EXPECT_EQ(cluster[1].message, "kubernetes-cluster needs at least 2 nodes, the target has 1");

  auto fractional =
      apps::Check(*apps::Find("oci-container"), On(v1::CAPACITY_SHAPE_GPU_PARTITION, 1));
  ASSERT_EQ(fractional.size(), 1u);
  EXPECT_EQ(fractional[0].reason, Reason::kShapeNotSupported);
  EXPECT_EQ(fractional[0].message,
            "oci-container runs on gpu_slice, baremetal, not on gpu_partition");

  // An allocation that is going or gone runs nothing; one on its way to active is a target.
  for (auto s : {v1::ALLOCATION_STATE_RELEASING, v1::ALLOCATION_STATE_RELEASED,
                 v1::ALLOCATION_STATE_FAILED}) {
    auto gone = apps::Check(*apps::Find("slurm"), On(kSlice, 1, 1, s));
    ASSERT_EQ(gone.size(), 1u) << enums::Text(s);
    EXPECT_EQ(gone[0].reason, Reason::kAllocationNotUsable);
    EXPECT_EQ(gone[0].message,
              fmt::format("the allocation is {}: no app can start on it", enums::Text(s)));
  }
  for (auto s : {v1::ALLOCATION_STATE_PENDING, v1::ALLOCATION_STATE_RESERVED,
                 v1::ALLOCATION_STATE_PROVISIONING, v1::ALLOCATION_STATE_ACTIVE}) {
    EXPECT_TRUE(apps::Check(*apps::Find("slurm"), On(kSlice, 1, 1, s)).empty()) << enums::Text(s);
  }

  // Every reason at once, in the fixed order.
  auto all =
      apps::Check(*apps::Find("slurm-cluster"), On(kSlice, 0, 1, v1::ALLOCATION_STATE_FAILED));
  std::vector<Reason> order;
  order.reserve(all.size());
  for (const auto& i : all) order.push_back(i.reason);
  EXPECT_EQ(order,
            (std::vector<Reason>{Reason::kMultiNodeRequiresBaremetal, Reason::kGpuCountBelowMinimum,
                                 Reason::kNodeCountBelowMinimum, Reason::kAllocationNotUsable}));
  EXPECT_EQ(apps::ReasonText(Reason::kMultiNodeRequiresBaremetal), "multi_node_requires_baremetal");
}

TEST(AppsTest, ValidateReportsEveryProblemOfABadTable) {
  v1::ListAppsResponse bad;
  auto* a = bad.add_apps();
  a->set_name("Bad_Name");
  a->add_shapes(kSlice);
  a->add_shapes(kSlice);
  a->set_min_gpu_count(0);
  a->set_max_gpu_count(-1);
  a->set_min_node_count(1);
  a->set_multi_node(true);
  auto* e = a->add_endpoints();
  e->set_name("ssh");
  e->set_port(70000);
  auto* dup = a->add_endpoints();
  dup->set_name("ssh");
  dup->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
  dup->set_port(22);
  dup->set_description("SSH");
  auto* twin = bad.add_apps();
  twin->set_name("x");
  twin->set_description("d");
  twin->set_kind(v1::APP_KIND_OCI);
  twin->add_shapes(kSlice);
  twin->set_min_gpu_count(1);
  twin->set_min_node_count(2);
  *bad.add_apps() = *twin;
  const auto problems = apps::Validate(bad);
  const std::string all = fmt::format("{}", fmt::join(problems, "\n"));
  for (const char* want :
       {"Bad_Name.name: a lowercase DNS label", "Bad_Name.description: required",
        "Bad_Name.kind: one of", "Bad_Name.shapes: listed twice", "Bad_Name.min_gpu_count",
        "Bad_Name.max_gpu_count", "Bad_Name.min_node_count: at least 2",
        "Bad_Name.shapes: a multi-node app runs on baremetal only",
        "Bad_Name.endpoints.ssh: protocol", "Bad_Name.endpoints.ssh: port: 1..65535",
        "Bad_Name.endpoints.ssh: name used twice", "Bad_Name.endpoints.ssh: description",
        "x.min_node_count: 1 for a single-node app", "x.name: used by another app"}) {
    EXPECT_NE(all.find(want), std::string::npos) << want << " in:\n" << all;
  }
}

TEST(AppsTest, OrdersAreResolvedAsAllocationCreateWouldResolveThem) {
  auto catalog = Catalog::Parse(Catalog::DefaultYaml());
  ASSERT_TRUE(catalog.ok());
  v1::AppOrder o;
  o.set_sku("h200-sxm-baremetal");
  auto t = apps::FromOrder(*catalog, o);
  ASSERT_TRUE(t.ok()) << t.error().ToString();
  EXPECT_EQ(t->shape, kBaremetal);
  EXPECT_EQ(t->gpu_count, 8) << "0 = the SKU's default count";
  EXPECT_EQ(t->node_count, 1);
  EXPECT_FALSE(t->state.has_value());

  o.set_sku("h200-sxm-slice");
  o.set_gpu_count(2);
  o.set_node_count(3);
  t = apps::FromOrder(*catalog, o);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->shape, kSlice);
  EXPECT_EQ(t->gpu_count, 2);
  EXPECT_EQ(t->node_count, 3);

  auto reason = [&](const v1::AppOrder& order) {
    auto r = apps::FromOrder(*catalog, order);
    return r.ok() ? std::string("ok") : r.error().reason;
  };
  o.set_gpu_count(3);
  EXPECT_EQ(reason(o), "gpu_count_not_allowed");
  o.set_sku("h100-pcie");
  EXPECT_EQ(reason(o), "unknown_sku");
  o.set_sku("h200-sxm-mig-1g");
  o.set_gpu_count(1);
  EXPECT_EQ(reason(o), "shape_not_offered");
  o.set_sku("h200-sxm-slice");
  o.set_shape(kBaremetal);
  EXPECT_EQ(reason(o), "shape_mismatch");

  v1::AppOrder bare;  // neither a SKU nor a shape and GPU count
  auto invalid = apps::FromOrder(*catalog, bare);
  ASSERT_FALSE(invalid.ok());
  EXPECT_EQ(invalid.error().reason, "invalid_order");
  EXPECT_EQ(invalid.error().details.count("shape"), 1u);
  EXPECT_EQ(invalid.error().details.count("gpu_count"), 1u);
  bare.set_shape(kSlice);
  bare.set_gpu_count(4);
  t = apps::FromOrder(*catalog, bare);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->shape, kSlice);
  EXPECT_EQ(t->gpu_count, 4);
  bare.set_node_count(-1);
  EXPECT_EQ(reason(bare), "invalid_order");
}

// The service with one replica, real NATS and PostgreSQL.
class AppServiceTest : public AllocationTest {
 protected:
  AppServiceTest() { replicas_wanted_ = 1; }

  // A client of `role` ("tenant-api" acting for `tenant`, "operator", "auditor").
  rpc::Client As(const std::string& role, const std::string& tenant = "") {
    auto conn = nats_.Connect(role);
    conns_.push_back(conn);
    rpc::Client c(conn);
    if (role == "tenant-api") c.WithToken(nats_.Token("tenant", tenant));
    return c;
  }
  static Result<v1::CheckAppCompatibilityResponse> CheckOn(rpc::Client& c, const std::string& app,
                                                           const std::string& allocation_id) {
    v1::CheckAppCompatibilityRequest r;
    r.set_app(app);
    r.set_allocation_id(allocation_id);
    return c.Call<v1::CheckAppCompatibilityResponse>("gpuaas.v1.scheduler.app.compatibility", r,
                                                     5000ms);
  }
  static Result<v1::CheckAppCompatibilityResponse> CheckOrder(rpc::Client& c,
                                                              const std::string& app,
                                                              const std::string& sku, int gpus,
                                                              int nodes = 0) {
    v1::CheckAppCompatibilityRequest r;
    r.set_app(app);
    r.mutable_order()->set_sku(sku);
    r.mutable_order()->set_gpu_count(gpus);
    r.mutable_order()->set_node_count(nodes);
    return c.Call<v1::CheckAppCompatibilityResponse>("gpuaas.v1.scheduler.app.compatibility", r,
                                                     5000ms);
  }
  static std::vector<std::string> ReasonsOf(const v1::CheckAppCompatibilityResponse& r) {
    std::vector<std::string> out;
    out.reserve(r.reasons_size());
    for (const auto& i : r.reasons()) out.push_back(i.reason());
    return out;
  }

  std::vector<std::shared_ptr<messaging::Connection>> conns_;
};

TEST_F(AppServiceTest, EveryCallerRoleListsTheApps) {
  for (const std::string role : {"tenant-api", "operator", "auditor"}) {
    auto c = As(role, "acme");
    auto l =
        c.Call<v1::ListAppsResponse>("gpuaas.v1.scheduler.app.list", v1::ListAppsRequest(), 5000ms);
    ASSERT_TRUE(l.ok()) << role << ": " << l.error().ToString();
    std::set<std::string> names;
    for (const auto& a : l->apps()) names.insert(a.name());
    EXPECT_EQ(names, (std::set<std::string>{"oci-container", "jupyter", "vllm", "slurm",
                                            "kubernetes", "slurm-cluster", "kubernetes-cluster"}))
        << role;
  }
}

TEST_F(AppServiceTest, OrdersAreCheckedAgainstTheCatalog) {
  auto tenant = As("tenant-api", "acme");
  auto jupyter = CheckOrder(tenant, "jupyter", "h200-sxm-slice", 1);
  ASSERT_TRUE(jupyter.ok()) << jupyter.error().ToString();
  EXPECT_TRUE(jupyter->compatible());
  EXPECT_TRUE(jupyter->reasons().empty());
  EXPECT_EQ(jupyter->app().name(), "jupyter");
  EXPECT_EQ(jupyter->shape(), kSlice);

  auto cluster = CheckOrder(tenant, "slurm-cluster", "h200-sxm-slice", 8, 4);
  ASSERT_TRUE(cluster.ok()) << cluster.error().ToString();
  EXPECT_FALSE(cluster->compatible());
  EXPECT_EQ(ReasonsOf(*cluster), std::vector<std::string>{"multi_node_requires_baremetal"});
  EXPECT_NE(cluster->reasons(0).message().find("baremetal only"), std::string::npos);

  auto on_baremetal = CheckOrder(tenant, "slurm-cluster", "h200-sxm-baremetal", 0, 4);
  ASSERT_TRUE(on_baremetal.ok()) << on_baremetal.error().ToString();
  EXPECT_TRUE(on_baremetal->compatible());
  EXPECT_EQ(on_baremetal->gpu_count(), 8) << "the SKU's default GPU count";
  EXPECT_EQ(on_baremetal->node_count(), 4);

  // An order allocation.create would refuse gets the same error; an unknown app is NOT_FOUND.
  auto bad_count = CheckOrder(tenant, "jupyter", "h200-sxm-slice", 3);
  ASSERT_FALSE(bad_count.ok());
  EXPECT_EQ(bad_count.error().code, Code::kInvalidArgument);
  EXPECT_EQ(bad_count.error().reason, "gpu_count_not_allowed");
  auto unknown = CheckOrder(tenant, "tensorflow-serving", "h200-sxm-slice", 1);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().code, Code::kNotFound);
  EXPECT_EQ(unknown.error().reason, "unknown_app");

  v1::CheckAppCompatibilityRequest no_target;
  no_target.set_app("jupyter");
  auto r = tenant.Call<v1::CheckAppCompatibilityResponse>("gpuaas.v1.scheduler.app.compatibility",
                                                          no_target, 5000ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "target_required");
}

TEST_F(AppServiceTest, AnAllocationIsCheckedForItsTenantOnly) {
  AddNode("gpu-01", 8);
  WaitProjected();
  auto created = Create("apps-1", 2);  // tenant acme, a 2-GPU slice
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  const std::string id = created->allocation().allocation_id();

  auto acme = As("tenant-api", "acme");
  auto vllm = CheckOn(acme, "vllm", id);
  ASSERT_TRUE(vllm.ok()) << vllm.error().ToString();
  EXPECT_TRUE(vllm->compatible()) << vllm->DebugString();
  EXPECT_EQ(vllm->shape(), kSlice);
  EXPECT_EQ(vllm->gpu_count(), 2);
  EXPECT_EQ(vllm->node_count(), 1);
  auto k8s = CheckOn(acme, "kubernetes-cluster", id);
  ASSERT_TRUE(k8s.ok()) << k8s.error().ToString();
  EXPECT_FALSE(k8s->compatible());
  EXPECT_EQ(ReasonsOf(*k8s), (std::vector<std::string>{"multi_node_requires_baremetal",
                                                       "node_count_below_minimum"}));

  // Another tenant cannot learn it exists; the operator and the auditor see it.
  auto globex = As("tenant-api", "globex");
  auto hidden = CheckOn(globex, "vllm", id);
  ASSERT_FALSE(hidden.ok());
  EXPECT_EQ(hidden.error().code, Code::kNotFound);
  EXPECT_EQ(hidden.error().reason, "allocation_not_found");
  for (const std::string role : {"operator", "auditor"}) {
    auto c = As(role);
    auto seen = CheckOn(c, "jupyter", id);
    ASSERT_TRUE(seen.ok()) << role << ": " << seen.error().ToString();
    EXPECT_TRUE(seen->compatible()) << role;
  }
  auto unknown = CheckOn(acme, "nope", id);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().reason, "unknown_app");

  // Once it is being released no app can start on it.
  auto released = Release(id);
  ASSERT_TRUE(released.ok()) << released.error().ToString();
  auto gone = CheckOn(acme, "jupyter", id);
  ASSERT_TRUE(gone.ok()) << gone.error().ToString();
  EXPECT_FALSE(gone->compatible());
  ASSERT_EQ(ReasonsOf(*gone), std::vector<std::string>{"allocation_not_usable"});
  EXPECT_NE(gone->reasons(0).message().find(enums::Text(released->allocation().state())),
            std::string::npos)
      << gone->reasons(0).message();
}

}  // namespace
}  // namespace gpuaas::scheduler
