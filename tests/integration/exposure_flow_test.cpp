// Public ingress through the whole platform: inventory, ipam, the scheduler and ingress on real
// NATS + PostgreSQL, and a node-agent following ingress's exposure document. A slice created
// with an endpoint to expose gets a public endpoint reserved from the node's pool, stays
// provisioning after its VM is up until the node acked the document with the mapping, and only
// then is active with the endpoint in its read model; release takes the mapping off the node
// before the cleanup proof and the pool's port is free again. A pool that runs out fails the
// allocation at the exposure stage and its slots are cleaned, never leaked.
//
// The agent here runs exposure.apply=simulate (no kernel rules): the nftables side is covered
// in network namespaces by node_agent_net_test (ExposureNetnsTest) and, with a real VM and SSH
// through the public port, by the slice e2e.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <set>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

constexpr const char* kNode = "exp-node";
constexpr const char* kPublic = "203.0.113.10";

class ExposureFlowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    p_.Start();
    p_.StartIngress();
    p_.StartApprovedAgent(
        kNode, "h200", 4,
        {{"GPUAAS_EXPOSURE_APPLY", "simulate"}, {"GPUAAS_NETWORK_REPORT_MS", "100"}});
  }
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }
  void SetPool(int port_min, int port_max) {
    v1::SetEndpointPoolRequest r;
    auto* pool = r.mutable_pool();
    pool->set_name("exp-node-ports");
    pool->set_kind(v1::ENDPOINT_POOL_KIND_PORT_RANGE);
    pool->set_region("us-east-1");
    pool->set_node_id(kNode);
    pool->add_addresses(kPublic);
    pool->set_port_min(port_min);
    pool->set_port_max(port_max);
    auto s = Call<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", r);
    ASSERT_TRUE(s.ok()) << s.error().ToString();
  }
  v1::EndpointPool Pool() {
    v1::ListEndpointPoolsRequest r;
    auto l = Call<v1::ListEndpointPoolsResponse>("gpuaas.v1.ingress.pool.list", r);
    EXPECT_TRUE(l.ok());
    return l.ok() && l->pools_size() == 1 ? l->pools(0) : v1::EndpointPool();
  }
  Result<v1::Allocation> Create(const std::string& request_id, int gpus,
                                const std::vector<std::pair<std::string, int>>& expose,
                                const std::string& app = "") {
    v1::CreateAllocationRequest r;
    r.set_app(app);
    r.set_tenant("acme");
    r.set_request_id(request_id);
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(gpus);
    r.set_region("us-east-1");
    for (const auto& [name, port] : expose) {
      auto* e = r.add_expose();
      e->set_name(name);
      e->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
      e->set_port(port);
    }
    auto c = Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r);
    if (!c.ok()) return c.error();
    return c->allocation();
  }
  v1::Allocation Get(const std::string& id) {
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    auto r = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
    return r.ok() ? r->allocation() : v1::Allocation();
  }
  v1::Allocation WaitState(const std::string& id, v1::AllocationState want, bool claims_freed) {
    v1::Allocation a;
    EXPECT_TRUE(testing::WaitFor(
        [&] {
          a = Get(id);
          if (a.state() != want) return false;
          if (!claims_freed) return true;
          for (const auto& c : a.claims()) {
            if (!c.has_released_at()) return false;
          }
          return true;
        },
        30s))
        << id << " is " << enums::Text(a.state()) << ", wanted " << enums::Text(want);
    return a;
  }
  std::vector<v1::Exposure> Exposures(const std::string& allocation_id, v1::ExposureState s) {
    v1::ListExposuresRequest r;
    r.set_allocation_id(allocation_id);
    r.set_state(s);
    auto l = Call<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", r);
    if (!l.ok()) return {};
    return {l->exposures().begin(), l->exposures().end()};
  }
  std::vector<v1::TimelineEntry> Timeline(const std::string& id) {
    v1::GetAllocationTimelineRequest r;
    r.set_allocation_id(id);
    auto t = Call<v1::GetAllocationTimelineResponse>("gpuaas.v1.scheduler.allocation.timeline", r);
    EXPECT_TRUE(t.ok()) << t.error().ToString();
    if (!t.ok()) return {};
    return {t->entries().begin(), t->entries().end()};
  }
  static std::string Describe(const std::vector<v1::TimelineEntry>& timeline) {
    std::vector<std::string> lines;
    lines.reserve(timeline.size());
    for (const auto& e : timeline) {
      lines.push_back(fmt::format("{} {} {} {}", enums::Text(e.step()), enums::Text(e.state()),
                                  enums::Text(e.task_type()), e.detail()));
    }
    return fmt::format("{}", fmt::join(lines, "\n"));
  }

  testing::Platform p_;
};

TEST_F(ExposureFlowTest, ASliceIsActiveOnlyWithItsEndpointsAndReleaseFreesThem) {
  SetPool(20000, 20009);
  auto created = Create("exp-1", 2, {{"ssh", 22}, {"jupyter", 8888}});
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  const std::string id = created->allocation_id();
  ASSERT_EQ(created->endpoints_size(), 2);

  auto a = WaitState(id, v1::ALLOCATION_STATE_ACTIVE, false);
  EXPECT_TRUE(a.vm_ready());
  ASSERT_EQ(a.endpoints_size(), 2);
  std::set<int> ports;
  for (const auto& e : a.endpoints()) {
    SCOPED_TRACE(e.name());
    EXPECT_EQ(e.state(), v1::EXPOSURE_STATE_ACTIVE);
    EXPECT_EQ(e.public_ip(), kPublic);
    EXPECT_GE(e.public_port(), 20000);
    EXPECT_LE(e.public_port(), 20009);
    ports.insert(e.public_port());
    if (e.name() == "ssh") {
      EXPECT_EQ(e.connect(), fmt::format("ssh -p {} root@{}", e.public_port(), kPublic));
    } else {
      EXPECT_EQ(e.connect(), fmt::format("{}:{}/tcp", kPublic, e.public_port()));
    }
  }
  EXPECT_EQ(ports.size(), 2U) << "each endpoint has its own public port";

  // The VM was up before the allocation was active: the timeline has the vm.provision success,
  // then the row saying every endpoint was applied, then nothing else made it active.
  // Read from the entries' typed fields (step, state, task type), not their text.
  const auto timeline = Timeline(id);
  int provisioned = -1, applied = -1;
  for (int i = 0; i < static_cast<int>(timeline.size()); ++i) {
    const auto& e = timeline[i];
    if (e.step() == v1::TIMELINE_STEP_TASK_SUCCEEDED &&
        e.task_type() == v1::TASK_TYPE_VM_PROVISION) {
      provisioned = i;
    }
    if (e.step() == v1::TIMELINE_STEP_STATE && e.state() == v1::ALLOCATION_STATE_ACTIVE) {
      applied = i;
    }
  }
  EXPECT_GE(provisioned, 0) << Describe(timeline);
  EXPECT_GT(applied, provisioned) << Describe(timeline);

  // The node's document maps both ports to the VM's management IP, and the node acked it.
  v1::GetNodeExposuresRequest g;
  g.set_node_id(kNode);
  auto doc =
      Call<v1::GetNodeExposuresResponse>("gpuaas.v1.ingress.node.{node_id}.exposures.get", g);
  ASSERT_TRUE(doc.ok()) << doc.error().ToString();
  EXPECT_EQ(doc->applied_version(), doc->latest_version());
  ASSERT_EQ(doc->document().mappings_size(), 2);
  for (const auto& m : doc->document().mappings()) {
    EXPECT_EQ(m.target_ip(), a.network().expected_ip());
    EXPECT_EQ(m.allocation_id(), id);
  }
  EXPECT_EQ(Pool().used(), 2);

  v1::ReleaseAllocationRequest rel;
  rel.set_allocation_id(id);
  ASSERT_TRUE(
      Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel).ok());
  WaitState(id, v1::ALLOCATION_STATE_RELEASED, true);
  // Nothing of it is left: both exposures removed (acked off the node), the pool empty, the
  // node's latest document without a mapping.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return Exposures(id, v1::EXPOSURE_STATE_REMOVED).size() == 2 && Pool().used() == 0; }));
  doc = Call<v1::GetNodeExposuresResponse>("gpuaas.v1.ingress.node.{node_id}.exposures.get", g);
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->document().mappings_size(), 0);
  EXPECT_EQ(doc->applied_version(), doc->latest_version());
}

TEST_F(ExposureFlowTest, AnExhaustedPoolFailsTheAllocationAndItsSlotsAreCleaned) {
  SetPool(20000, 20000);  // one port
  auto first = Create("exp-a", 1, {{"ssh", 22}});
  ASSERT_TRUE(first.ok()) << first.error().ToString();
  WaitState(first->allocation_id(), v1::ALLOCATION_STATE_ACTIVE, false);

  // A second endpoint for the active one: answered at once, with the counts.
  v1::CreateExposureRequest more;
  more.set_allocation_id(first->allocation_id());
  more.set_name("web");
  more.set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
  more.set_port(8080);
  auto refused = Call<v1::CreateExposureResponse>("gpuaas.v1.ingress.exposure.create", more);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, Code::kResourceExhausted);
  EXPECT_EQ(refused.error().reason, "pool_exhausted");
  EXPECT_EQ(refused.error().details["total"], "1");
  EXPECT_EQ(refused.error().details["used"], "1");

  // A new slice asking for an endpoint fails at the exposure stage; its slots are cleaned and
  // freed by the cleanup proof like after a failed provisioning, and the first slice keeps its
  // endpoint.
  auto second = Create("exp-b", 1, {{"ssh", 22}});
  ASSERT_TRUE(second.ok()) << second.error().ToString();
  auto b = WaitState(second->allocation_id(), v1::ALLOCATION_STATE_FAILED, true);
  EXPECT_EQ(b.failure().stage(), v1::LIFECYCLE_STAGE_EXPOSURE);
  EXPECT_EQ(b.failure().code(), "pool_exhausted");
  EXPECT_NE(b.failure().detail().find("total=1"), std::string::npos) << b.failure().detail();
  ASSERT_EQ(b.endpoints_size(), 1);
  EXPECT_EQ(b.endpoints(0).state(), v1::EXPOSURE_STATE_FAILED);
  EXPECT_EQ(Exposures(first->allocation_id(), v1::EXPOSURE_STATE_ACTIVE).size(), 1U);
  EXPECT_EQ(Pool().used(), 1);
}

TEST_F(ExposureFlowTest, AnAppExposesExactlyItsDeclaredEndpointsAndClustersNeedBaremetal) {
  SetPool(20000, 20009);
  // Jupyter on a slice: its two declared endpoints (SSH and the notebook), nothing else.
  auto jupyter = Create("exp-app", 1, {}, "jupyter");
  ASSERT_TRUE(jupyter.ok()) << jupyter.error().ToString();
  EXPECT_EQ(jupyter->app(), "jupyter");
  auto a = WaitState(jupyter->allocation_id(), v1::ALLOCATION_STATE_ACTIVE, false);
  std::set<std::pair<std::string, int>> got;
  for (const auto& e : a.endpoints()) {
    EXPECT_EQ(e.state(), v1::EXPOSURE_STATE_ACTIVE) << e.name();
    got.insert({e.name(), e.port()});
  }
  EXPECT_EQ(got, (std::set<std::pair<std::string, int>>{{"ssh", 22}, {"jupyter", 8888}}));

  // A multi-node cluster profile is baremetal-only: refused before anything is placed.
  auto cluster = Create("exp-cluster", 1, {}, "slurm-cluster");
  ASSERT_FALSE(cluster.ok());
  EXPECT_EQ(cluster.error().code, Code::kFailedPrecondition);
  EXPECT_EQ(cluster.error().reason, "app_not_compatible");
  EXPECT_EQ(cluster.error().details.count("multi_node_requires_baremetal"), 1U)
      << cluster.error().ToString();
  // An app's endpoint asked for again under another name is a clash, not a second exposure.
  auto clash = Create("exp-clash", 1, {{"notebook", 8888}}, "jupyter");
  ASSERT_FALSE(clash.ok());
  EXPECT_EQ(clash.error().code, Code::kInvalidArgument);
  EXPECT_EQ(Pool().used(), 2) << "only jupyter's two endpoints hold ports";
}

}  // namespace
}  // namespace gpuaas
