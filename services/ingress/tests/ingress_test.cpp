// ingress in-process against real NATS JetStream and PostgreSQL: endpoint pools and their
// errors, exposures reserved from the scheduler's allocation events, applied through the node's
// exposure document when the VM is up, settled by the node's acks (active, refused -> failed,
// drift -> active again, removing -> removed), exposure.create/delete/list for tenants and
// operators, pool exhaustion with its counts, concurrent reservations from a small pool, and
// public_ip pools (one address per allocation).
#include <gtest/gtest.h>
#include <pqxx/pqxx>

#include <atomic>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/http.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/ingress/ingress_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "ingress_domain.hpp"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::ingress {
namespace {

using namespace std::chrono_literals;

constexpr const char* kRegion = "us-east-1";
constexpr const char* kNode = "gpu-01";
constexpr const char* kNodeAddress = "203.0.113.10";
constexpr v1::TransportProtocol kTcp = v1::TRANSPORT_PROTOCOL_TCP;
constexpr v1::TransportProtocol kUdp = v1::TRANSPORT_PROTOCOL_UDP;

// An allocation as the scheduler announces it.
struct Alloc {
  std::string id = ids::NewUuidV7();
  std::string tenant = "acme";
  std::string node = kNode;
  std::string region = kRegion;
  v1::CapacityShape shape = v1::CAPACITY_SHAPE_GPU_SLICE;
  std::vector<std::tuple<std::string, v1::TransportProtocol, int32_t>> endpoints;
  int64_t generation = 0;
  bool vm_ready = false;
  std::string ip;
  std::string slot = "gpu-0000:18:00.0";
};

v1::Principal Actor(const std::string& subject, const std::string& tenant = "",
                    const std::string& reason = "") {
  v1::Principal p;
  p.set_subject(subject);
  p.set_tenant(tenant);
  p.set_reason(reason);
  return p;
}

class IngressTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }
  void Start(const std::map<std::string, std::string>& extra) {
    if (dsn_.empty()) dsn_ = testing::SharedPostgres().CreateDatabase("ingress");
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn_},
                                              {"GPUAAS_LOG_LEVEL", "error"}};
    for (const auto& [k, v] : nats_.Env("ingress")) env[k] = v;
    for (const auto& [k, v] : extra) env[k] = v;
    svc_ = std::make_unique<IngressService>(LoadConfig<IngressConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    // rpc::Server::Start does not flush its SUB: a round trip makes sure the server has it.
    ASSERT_TRUE(svc_->runtime().nats()->Flush(2000ms).ok());
    if (!conn_) {
      conn_ = nats_.Connect(testing::TestNats::kHarness);
      operator_ = nats_.Connect("operator");
    }
  }
  void Restart(const std::map<std::string, std::string>& extra) {
    svc_->Shutdown();
    Start(extra);
  }
  void TearDown() override { svc_->Shutdown(); }

  // ---- clients ----
  rpc::Client Operator() { return rpc::Client(operator_); }
  rpc::Client Auditor() {
    std::lock_guard lock(mu_);
    if (!auditor_) auditor_ = nats_.Connect("auditor");
    return rpc::Client(auditor_);
  }
  // tenant-api acting for `tenant`'s user alice.
  rpc::Client Tenant(const std::string& tenant) {
    std::lock_guard lock(mu_);
    if (!tenant_api_) tenant_api_ = nats_.Connect("tenant-api");
    rpc::Client c(tenant_api_);
    c.WithToken(nats_.Token("tenant", tenant, fmt::format("tenant:{}/alice", tenant)));
    return c;
  }
  // The harness connection (allowed every subject) with `token`: what the service itself
  // decides for a principal, whatever nats-server's permissions.
  rpc::Client WithToken(const std::string& token) {
    rpc::Client c(conn_);
    c.WithToken(token);
    return c;
  }
  // The node's own agent identity (what acks its document).
  rpc::Client Node(const std::string& node) {
    std::lock_guard lock(mu_);
    auto& c = nodes_[node];
    if (!c) {
      nats_.EnrollNode(node);
      c = nats_.Connect("node-agent", node);
    }
    return rpc::Client(c);
  }

  // ---- pools ----
  static v1::EndpointPool PortPool(const std::string& name, int32_t min, int32_t max,
                                   const std::string& node = kNode,
                                   const std::string& address = kNodeAddress) {
    v1::EndpointPool p;
    p.set_name(name);
    p.set_kind(v1::ENDPOINT_POOL_KIND_PORT_RANGE);
    p.set_region(kRegion);
    p.set_node_id(node);
    p.add_addresses(address);
    p.set_port_min(min);
    p.set_port_max(max);
    return p;
  }
  static v1::EndpointPool IpPool(const std::string& name, const std::vector<std::string>& addrs,
                                 const std::string& region = kRegion) {
    v1::EndpointPool p;
    p.set_name(name);
    p.set_kind(v1::ENDPOINT_POOL_KIND_PUBLIC_IP);
    p.set_region(region);
    for (const auto& a : addrs) p.add_addresses(a);
    return p;
  }
  Result<v1::SetEndpointPoolResponse> SetPool(const v1::EndpointPool& p) {
    v1::SetEndpointPoolRequest req;
    *req.mutable_pool() = p;
    return Operator().Call<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", req, 10s);
  }
  Result<v1::DeleteEndpointPoolResponse> DeletePool(const std::string& name) {
    v1::DeleteEndpointPoolRequest req;
    req.set_name(name);
    return Operator().Call<v1::DeleteEndpointPoolResponse>("gpuaas.v1.ingress.pool.delete", req,
                                                           10s);
  }
  std::optional<v1::EndpointPool> Pool(const std::string& name) {
    auto r = Operator().Call<v1::ListEndpointPoolsResponse>("gpuaas.v1.ingress.pool.list",
                                                            v1::ListEndpointPoolsRequest(), 10s);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    if (!r.ok()) return std::nullopt;
    for (const auto& p : r->pools()) {
      if (p.name() == name) return p;
    }
    return std::nullopt;
  }

  // ---- allocations (what the scheduler's outbox relay publishes) ----
  // Announces `a` in `state` with the next generation, caused by `actor`; returns once
  // ingress's projection has applied it.
  void Announce(Alloc& a, v1::AllocationState state,
                const v1::Principal& actor = Actor("service:scheduler")) {
    v1::AllocationSnapshot snap;
    auto* x = snap.mutable_allocation();
    x->set_allocation_id(a.id);
    x->set_tenant(a.tenant);
    x->set_node_id(a.node);
    x->set_region(a.region);
    x->set_shape(a.shape);
    x->set_state(state);
    x->set_generation(++a.generation);
    x->set_vm_ready(a.vm_ready);
    x->mutable_network()->set_expected_ip(a.ip);
    if (!a.slot.empty()) x->add_slot_keys(a.slot);
    for (const auto& [name, proto, port] : a.endpoints) {
      auto* e = x->add_endpoints();
      e->set_name(name);
      e->set_protocol(proto);
      e->set_port(port);
    }
    const std::string subject =
        fmt::format("gpuaas.v1.evt.scheduler.allocation.{}", enums::Text(state));
    outbox::EventSpec spec;
    spec.nats_subject = subject;
    spec.source = "scheduler/test";
    spec.entity = a.id;
    spec.generation = a.generation;
    spec.correlation_id = a.id;
    spec.data = &snap;
    spec.actor = &actor;
    auto ev = outbox::MakeEvent(spec);
    auto r = messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id());
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    ASSERT_TRUE(testing::WaitFor([&] { return ProjectedGeneration(a.id) >= a.generation; }))
        << "ingress did not apply generation " << a.generation << " of " << a.id;
  }
  int64_t ProjectedGeneration(const std::string& id) {
    pqxx::connection c(dsn_);
    pqxx::nontransaction tx(c);
    auto r = tx.exec_params("SELECT generation FROM allocations WHERE allocation_id = $1", id);
    return r.empty() ? 0 : r[0][0].as<int64_t>();
  }

  // ---- exposures ----
  Result<v1::CreateExposureResponse> Create(rpc::Client c, const std::string& allocation,
                                            const std::string& name, int32_t port,
                                            v1::TransportProtocol proto = kTcp) {
    v1::CreateExposureRequest req;
    req.set_allocation_id(allocation);
    req.set_name(name);
    req.set_protocol(proto);
    req.set_port(port);
    return c.Call<v1::CreateExposureResponse>("gpuaas.v1.ingress.exposure.create", req, 10s);
  }
  Result<v1::DeleteExposureResponse> Delete(rpc::Client c, const std::string& id) {
    v1::DeleteExposureRequest req;
    req.set_exposure_id(id);
    return c.Call<v1::DeleteExposureResponse>("gpuaas.v1.ingress.exposure.delete", req, 10s);
  }
  Result<v1::ListExposuresResponse> List(rpc::Client c, const std::string& allocation = "",
                                         v1::ExposureState state = v1::EXPOSURE_STATE_UNSPECIFIED) {
    v1::ListExposuresRequest req;
    req.set_allocation_id(allocation);
    req.set_state(state);
    return c.Call<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", req, 10s);
  }
  // The allocation's exposures by name, removed ones included (a live one wins).
  std::map<std::string, v1::Exposure> ByName(const std::string& allocation) {
    std::map<std::string, v1::Exposure> out;
    for (auto state : {v1::EXPOSURE_STATE_UNSPECIFIED, v1::EXPOSURE_STATE_REMOVED}) {
      auto r = List(Operator(), allocation, state);
      EXPECT_TRUE(r.ok()) << r.error().ToString();
      if (!r.ok()) return out;
      for (const auto& e : r->exposures()) out.emplace(e.name(), e);
    }
    return out;
  }
  // Waits until every named exposure of the allocation is in `state`; returns them by name.
  std::map<std::string, v1::Exposure> WaitStates(const std::string& allocation,
                                                 const std::set<std::string>& names,
                                                 v1::ExposureState state) {
    std::map<std::string, v1::Exposure> got;
    const bool ok = testing::WaitFor([&] {
      got = ByName(allocation);
      for (const auto& n : names) {
        auto it = got.find(n);
        if (it == got.end() || it->second.state() != state) return false;
      }
      return true;
    });
    EXPECT_TRUE(ok) << "not all of the exposures are " << enums::Text(state) << ":\n"
                    << [&] {
                         std::string s;
                         for (const auto& [n, e] : got) {
                           s += fmt::format("  {} {} {}\n", n, enums::Text(e.state()), e.detail());
                         }
                         return s;
                       }();
    return got;
  }

  // ---- the node's document ----
  Result<v1::GetNodeExposuresResponse> Document(const std::string& node, int64_t version = 0) {
    v1::GetNodeExposuresRequest req;
    req.set_node_id(node);
    req.set_version(version);
    return Operator().Call<v1::GetNodeExposuresResponse>(
        "gpuaas.v1.ingress.node.{node_id}.exposures.get", req, 10s);
  }
  Result<v1::AckNodeExposuresResponse> Ack(const std::string& node, int64_t version,
                                           const std::vector<v1::ExposureRefusal>& refused = {},
                                           const std::vector<v1::ExposureDrift>& drift = {}) {
    v1::AckNodeExposuresRequest req;
    req.set_node_id(node);
    req.set_version(version);
    for (const auto& f : refused) *req.add_refused() = f;
    for (const auto& d : drift) *req.add_drift() = d;
    return Node(node).Call<v1::AckNodeExposuresResponse>(
        "gpuaas.v1.ingress.node.{node_id}.exposures.ack", req, 10s);
  }

  // ---- events on GPUAAS_EVT_INGRESS ----
  // Events about `entity` (an exposure or node id) as (subject, event), oldest first.
  std::vector<std::pair<std::string, v1::Event>> Events(const std::string& entity) {
    for (auto& e : testing::ReadStream(*conn_, "GPUAAS_EVT_INGRESS", read_seq_ + 1)) {
      read_seq_ = e.seq;
      events_.emplace_back(e.subject, std::move(e.event));
    }
    std::vector<std::pair<std::string, v1::Event>> out;
    for (const auto& e : events_) {
      if (e.second.subject() == entity) out.push_back(e);
    }
    return out;
  }
  // The event announcing that `exposure` entered `state` once the relay has published it.
  std::optional<v1::Event> WaitEvent(const std::string& entity, const std::string& subject) {
    std::optional<v1::Event> found;
    testing::WaitFor([&] {
      for (const auto& [s, ev] : Events(entity)) {
        if (s == subject) found = ev;
      }
      return found.has_value();
    });
    return found;
  }
  static std::string ExposureSubject(v1::ExposureState s) {
    return "gpuaas.v1.evt.ingress.exposure." + enums::Text(s);
  }

  std::string Metrics() {
    auto m = http::Get("127.0.0.1", svc_->runtime().http_port(), "/metrics");
    return m.ok() ? m->second : "";
  }

  testing::TestNats nats_;
  std::string dsn_;
  std::unique_ptr<IngressService> svc_;
  std::shared_ptr<messaging::Connection> conn_;  // harness: publishes allocation events
  std::shared_ptr<messaging::Connection> operator_;
  std::mutex mu_;
  std::shared_ptr<messaging::Connection> auditor_;
  std::shared_ptr<messaging::Connection> tenant_api_;
  std::map<std::string, std::shared_ptr<messaging::Connection>> nodes_;
  uint64_t read_seq_ = 0;
  std::vector<std::pair<std::string, v1::Event>> events_;
};

TEST_F(IngressTest, PoolsAreValidatedAndNeverOverlap) {
  // Every bad field is named.
  v1::EndpointPool bad;
  bad.set_name("Edge_A");
  auto r = SetPool(bad);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kInvalidArgument);
  EXPECT_EQ(r.error().reason, "invalid_pool");
  for (const char* f : {"name", "region", "kind"}) EXPECT_EQ(r.error().details.count(f), 1u) << f;
  auto ports = PortPool("edge-a", 80, 70);
  ports.add_addresses("203.0.113.11");
  ports.set_node_id("Not A Node");
  r = SetPool(ports);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "invalid_pool");
  for (const char* f : {"node_id", "addresses", "port_min", "port_max"}) {
    EXPECT_EQ(r.error().details.count(f), 1u) << f;
  }
  auto ips = IpPool("ips", {"198.51.100.1", "198.51.100.1", "198.51.100.300"});
  ips.set_node_id(kNode);
  ips.set_port_min(2000);
  r = SetPool(ips);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "invalid_pool");
  for (const char* f : {"node_id", "port_min", "addresses[1]", "addresses[2]"}) {
    EXPECT_EQ(r.error().details.count(f), 1u) << f;
  }
  // Only operators define pools: the service itself refuses a tenant's token (nats-server
  // already keeps tenant-api's connections off the subject).
  v1::SetEndpointPoolRequest as_tenant;
  *as_tenant.mutable_pool() = PortPool("edge-a", 20000, 20009);
  auto refused = WithToken(nats_.Token("tenant", "acme"))
                     .Call<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", as_tenant);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().code, Code::kPermissionDenied);
  EXPECT_EQ(refused.error().reason, "role_not_allowed");

  auto a = SetPool(PortPool("edge-a", 20000, 20009));
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_TRUE(a->created());
  EXPECT_EQ(a->pool().total(), 10);
  EXPECT_EQ(a->pool().used(), 0);
  EXPECT_EQ(a->pool().generation(), 1);
  auto again = SetPool(PortPool("edge-a", 20000, 20019));
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->pool().total(), 20);
  EXPECT_EQ(again->pool().generation(), 2);

  // The same address in a public_ip pool, or an overlapping port range of it, is refused.
  auto overlap = SetPool(IpPool("ips", {"198.51.100.1", kNodeAddress}));
  ASSERT_FALSE(overlap.ok());
  EXPECT_EQ(overlap.error().code, Code::kFailedPrecondition);
  EXPECT_EQ(overlap.error().reason, "pool_overlap");
  EXPECT_EQ(overlap.error().details.at("pool"), "edge-a");
  EXPECT_EQ(overlap.error().details.at("address"), kNodeAddress);
  overlap = SetPool(PortPool("edge-b", 20019, 20100));
  ASSERT_FALSE(overlap.ok());
  EXPECT_EQ(overlap.error().reason, "pool_overlap");
  // Another range of the same address is another set of endpoints.
  auto b = SetPool(PortPool("edge-b", 20020, 20029));
  ASSERT_TRUE(b.ok()) << b.error().ToString();
  ASSERT_TRUE(SetPool(IpPool("ips", {"198.51.100.1"})).ok());

  auto missing = DeletePool("nope");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Code::kNotFound);
  EXPECT_EQ(missing.error().reason, "pool_not_found");
  auto gone = DeletePool("edge-b");
  ASSERT_TRUE(gone.ok()) << gone.error().ToString();
  EXPECT_EQ(gone->pool().name(), "edge-b");
  EXPECT_FALSE(Pool("edge-b"));
}

TEST_F(IngressTest, PoolsInUseCannotShrinkMoveOrGo) {
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20009)).ok());
  Alloc a;
  a.endpoints = {{"ssh", kTcp, 22}};
  Announce(a, v1::ALLOCATION_STATE_RESERVED);
  auto held = WaitStates(a.id, {"ssh"}, v1::EXPOSURE_STATE_REQUESTED);
  ASSERT_EQ(held["ssh"].public_port(), 20000);
  EXPECT_EQ(Pool("edge-a")->used(), 1);

  auto shrink = SetPool(PortPool("edge-a", 20001, 20009));
  ASSERT_FALSE(shrink.ok());
  EXPECT_EQ(shrink.error().code, Code::kFailedPrecondition);
  EXPECT_EQ(shrink.error().reason, "pool_in_use");
  EXPECT_EQ(shrink.error().details.at("address"), kNodeAddress);
  EXPECT_EQ(shrink.error().details.at("port"), "20000");
  auto readdress = SetPool(PortPool("edge-a", 20000, 20009, kNode, "203.0.113.99"));
  ASSERT_FALSE(readdress.ok());
  EXPECT_EQ(readdress.error().reason, "pool_in_use");
  auto move = SetPool(PortPool("edge-a", 20000, 20009, "gpu-02"));
  ASSERT_FALSE(move.ok());
  EXPECT_EQ(move.error().reason, "pool_in_use");
  EXPECT_EQ(move.error().details.at("node_id"), kNode);
  auto del = DeletePool("edge-a");
  ASSERT_FALSE(del.ok());
  EXPECT_EQ(del.error().reason, "pool_in_use");
  EXPECT_EQ(del.error().details.at("used"), "1");
  // Growing keeps what is held.
  auto grow = SetPool(PortPool("edge-a", 20000, 20049));
  ASSERT_TRUE(grow.ok()) << grow.error().ToString();
  EXPECT_EQ(grow->pool().used(), 1);
  EXPECT_EQ(grow->pool().total(), 50);

  // Once the exposure is gone (it never reached the node) the pool may go, and so do its
  // gauges.
  Announce(a, v1::ALLOCATION_STATE_RELEASED);
  WaitStates(a.id, {"ssh"}, v1::EXPOSURE_STATE_REMOVED);
  EXPECT_EQ(Pool("edge-a")->used(), 0);
  const std::string used = R"(gpuaas_endpoint_pool_endpoints{pool="edge-a",usage="used"} 0)";
  ASSERT_TRUE(testing::WaitFor([&] { return Metrics().find(used) != std::string::npos; }, 15s))
      << Metrics();
  ASSERT_TRUE(DeletePool("edge-a").ok());
  EXPECT_TRUE(testing::WaitFor(
      [&] { return Metrics().find(R"(pool="edge-a")") == std::string::npos; }, 15s))
      << Metrics();
}

// The whole path of an allocation's endpoints: reserved when it is placed, applied through the
// node's document when its VM is up, active on the node's ack, removed on release.
TEST_F(IngressTest, AllocationEndpointsFollowTheAllocation) {
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20009)).ok());
  Alloc a;
  a.endpoints = {{"ssh", kTcp, 22}, {"jupyter", kTcp, 8888}};
  Announce(a, v1::ALLOCATION_STATE_RESERVED, Actor("tenant:acme/alice", "acme"));
  auto got = WaitStates(a.id, {"ssh", "jupyter"}, v1::EXPOSURE_STATE_REQUESTED);
  const auto ssh = got["ssh"];
  const auto jupyter = got["jupyter"];
  EXPECT_NE(ssh.public_port(), jupyter.public_port());
  for (const auto& e : {ssh, jupyter}) {
    EXPECT_EQ(e.public_ip(), kNodeAddress);
    EXPECT_GE(e.public_port(), 20000);
    EXPECT_LE(e.public_port(), 20009);
    EXPECT_EQ(e.pool(), "edge-a");
    EXPECT_EQ(e.tenant(), "acme");
    EXPECT_EQ(e.node_id(), kNode);
    EXPECT_EQ(e.target_ip(), "") << "the VM has no address yet";
  }
  EXPECT_EQ(ssh.connect(), fmt::format("ssh -p {} root@{}", ssh.public_port(), kNodeAddress));
  EXPECT_EQ(jupyter.connect(), fmt::format("{}:{}/tcp", kNodeAddress, jupyter.public_port()));
  auto doc = Document(kNode);
  ASSERT_TRUE(doc.ok()) << doc.error().ToString();
  EXPECT_EQ(doc->latest_version(), 0) << "nothing goes to the node before the VM is up";
  // Announced on the requested subject, in the name of whoever placed the allocation.
  auto requested = WaitEvent(ssh.exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_REQUESTED));
  ASSERT_TRUE(requested);
  EXPECT_EQ(requested->actor().subject(), "tenant:acme/alice");
  EXPECT_EQ(requested->correlation_id(), a.id);
  EXPECT_EQ(requested->generation(), ssh.generation());

  // The VM is up: both go into the node's next document, mapped to the VM's address.
  a.vm_ready = true;
  a.ip = "10.100.0.10";
  Announce(a, v1::ALLOCATION_STATE_PROVISIONING);
  got = WaitStates(a.id, {"ssh", "jupyter"}, v1::EXPOSURE_STATE_APPLYING);
  const int64_t v = got["ssh"].document_version();
  EXPECT_GT(v, 0);
  EXPECT_EQ(got["jupyter"].document_version(), v);
  EXPECT_EQ(got["ssh"].target_ip(), "10.100.0.10");
  EXPECT_EQ(got["ssh"].slot_key(), a.slot);
  doc = Document(kNode);
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->latest_version(), v);
  EXPECT_EQ(doc->applied_version(), 0);
  ASSERT_EQ(doc->document().mappings_size(), 2);
  std::map<std::string, v1::ExposureMapping> mappings;
  for (const auto& m : doc->document().mappings()) mappings[m.exposure_id()] = m;
  for (const auto& e : {ssh, jupyter}) {
    ASSERT_TRUE(mappings.count(e.exposure_id())) << e.name();
    const auto& m = mappings[e.exposure_id()];
    EXPECT_EQ(m.public_ip(), kNodeAddress);
    EXPECT_EQ(m.public_port(), e.public_port());
    EXPECT_EQ(m.target_ip(), "10.100.0.10");
    EXPECT_EQ(m.target_port(), e.target_port());
    EXPECT_EQ(m.protocol(), kTcp);
    EXPECT_EQ(m.allocation_id(), a.id);
    EXPECT_EQ(m.slot_key(), a.slot);
  }
  auto applying = WaitEvent(ssh.exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_APPLYING));
  ASSERT_TRUE(applying);
  EXPECT_EQ(applying->actor().subject(), "service:scheduler");

  // An ack of a version that does not exist is refused; the node's ack makes them active.
  auto ahead = Ack(kNode, v + 1);
  ASSERT_FALSE(ahead.ok());
  EXPECT_EQ(ahead.error().reason, "unknown_version");
  auto ack = Ack(kNode, v);
  ASSERT_TRUE(ack.ok()) << ack.error().ToString();
  EXPECT_EQ(ack->applied_version(), v);
  EXPECT_EQ(ack->latest_version(), v);
  got = WaitStates(a.id, {"ssh", "jupyter"}, v1::EXPOSURE_STATE_ACTIVE);
  auto active = WaitEvent(ssh.exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_ACTIVE));
  ASSERT_TRUE(active);
  EXPECT_EQ(active->actor().subject(), "node:gpu-01");
  EXPECT_EQ(active->generation(), got["ssh"].generation());
  doc = Document(kNode);
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->applied_version(), v);
  EXPECT_TRUE(doc->has_acked_at());

  // Released at the tenant's request: out of the document, removing until the node acks.
  Announce(a, v1::ALLOCATION_STATE_RELEASING, Actor("tenant:acme/bob", "acme", "done"));
  got = WaitStates(a.id, {"ssh", "jupyter"}, v1::EXPOSURE_STATE_REMOVING);
  const int64_t v2 = got["ssh"].document_version();
  EXPECT_EQ(v2, v + 1);
  doc = Document(kNode);
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->latest_version(), v2);
  EXPECT_EQ(doc->document().mappings_size(), 0);
  EXPECT_EQ(Pool("edge-a")->used(), 2) << "the ports are held until the node took the rules out";
  auto removing = WaitEvent(ssh.exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_REMOVING));
  ASSERT_TRUE(removing);
  EXPECT_EQ(removing->actor().subject(), "tenant:acme/bob");
  EXPECT_EQ(removing->actor().reason(), "done");
  ASSERT_TRUE(Ack(kNode, v2).ok());
  got = WaitStates(a.id, {"ssh", "jupyter"}, v1::EXPOSURE_STATE_REMOVED);
  EXPECT_EQ(Pool("edge-a")->used(), 0);
  auto removed = WaitEvent(ssh.exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_REMOVED));
  ASSERT_TRUE(removed);
  EXPECT_EQ(removed->actor().subject(), "node:gpu-01");
  // Every step was announced once, in order, generation by generation.
  std::vector<std::string> subjects;
  int64_t gen = 0;
  for (const auto& [s, ev] : Events(ssh.exposure_id())) {
    subjects.push_back(s.substr(s.rfind('.') + 1));
    EXPECT_GT(ev.generation(), gen);
    gen = ev.generation();
    v1::ExposureSnapshot snap;
    ASSERT_TRUE(ev.data().UnpackTo(&snap));
    EXPECT_EQ(enums::Text(snap.exposure().state()), subjects.back());
  }
  EXPECT_EQ(subjects,
            (std::vector<std::string>{"requested", "applying", "active", "removing", "removed"}));

  // The ports are free again: the next allocation gets the first one.
  Alloc b;
  b.endpoints = {{"ssh", kTcp, 22}};
  Announce(b, v1::ALLOCATION_STATE_RESERVED);
  got = WaitStates(b.id, {"ssh"}, v1::EXPOSURE_STATE_REQUESTED);
  EXPECT_EQ(got["ssh"].public_port(), 20000);

  // The apply latency and the per-state gauge are exported.
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        const auto m = Metrics();
        return m.find("gpuaas_exposure_apply_seconds_count 2") != std::string::npos &&
               m.find("gpuaas_exposures{state=\"removed\"} 2") != std::string::npos &&
               m.find("gpuaas_endpoint_pool_endpoints{pool=\"edge-a\",usage=\"total\"} 10") !=
                   std::string::npos;
      },
      15s))
      << Metrics();
}

TEST_F(IngressTest, ARefusedMappingFailsAndFreesItsPort) {
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20001)).ok());
  Alloc a;
  a.endpoints = {{"ssh", kTcp, 22}, {"dns", kUdp, 53}};
  a.vm_ready = true;
  a.ip = "10.100.0.11";
  Announce(a, v1::ALLOCATION_STATE_PROVISIONING);
  auto got = WaitStates(a.id, {"ssh", "dns"}, v1::EXPOSURE_STATE_APPLYING);
  const int64_t v = got["ssh"].document_version();
  EXPECT_EQ(got["dns"].document_version(), v) << "one event, one new document";
  EXPECT_EQ(Document(kNode)->latest_version(), v);
  EXPECT_EQ(Pool("edge-a")->used(), 2);
  EXPECT_EQ(got["dns"].connect(), fmt::format("{}:{}/udp", kNodeAddress, got["dns"].public_port()));

  v1::ExposureRefusal no;
  no.set_exposure_id(got["dns"].exposure_id());
  no.set_reason("fabric_interface");
  no.set_message("the route to 10.100.0.11 leaves through ib0");
  auto ack = Ack(kNode, v, {no});
  ASSERT_TRUE(ack.ok()) << ack.error().ToString();
  EXPECT_EQ(ack->latest_version(), v + 1) << "a document without the refused mapping";
  auto after = ByName(a.id);
  EXPECT_EQ(after["ssh"].state(), v1::EXPOSURE_STATE_ACTIVE);
  EXPECT_EQ(after["dns"].state(), v1::EXPOSURE_STATE_FAILED);
  EXPECT_EQ(after["dns"].reason(), "fabric_interface");
  EXPECT_NE(after["dns"].detail().find("ib0"), std::string::npos) << after["dns"].detail();
  auto failed = WaitEvent(got["dns"].exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_FAILED));
  ASSERT_TRUE(failed);
  EXPECT_EQ(failed->actor().subject(), "node:gpu-01");
  auto doc = Document(kNode);
  ASSERT_TRUE(doc.ok());
  ASSERT_EQ(doc->document().mappings_size(), 1);
  EXPECT_EQ(doc->document().mappings(0).exposure_id(), got["ssh"].exposure_id());

  // Its port is free: another allocation gets exactly it.
  EXPECT_EQ(Pool("edge-a")->used(), 1);
  Alloc b;
  b.vm_ready = true;
  b.ip = "10.100.0.12";
  Announce(b, v1::ALLOCATION_STATE_ACTIVE);
  auto c = Create(Operator(), b.id, "web", 8080);
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_EQ(c->exposure().public_port(), got["dns"].public_port());
  EXPECT_EQ(c->exposure().state(), v1::EXPOSURE_STATE_APPLYING) << "its VM is already up";
  const int64_t v3 = c->exposure().document_version();
  EXPECT_EQ(v3, v + 2);
  ASSERT_TRUE(Ack(kNode, v3).ok());
  WaitStates(b.id, {"web"}, v1::EXPOSURE_STATE_ACTIVE);
  // The first ack again (a retried request, overtaken by the newer one) changes nothing: the
  // node serves ssh now, whatever that old ack said.
  no.set_exposure_id(got["ssh"].exposure_id());
  auto late = Ack(kNode, v, {no});
  ASSERT_TRUE(late.ok()) << late.error().ToString();
  EXPECT_EQ(late->applied_version(), v3);
  EXPECT_EQ(late->latest_version(), v3);
  EXPECT_EQ(ByName(a.id)["ssh"].state(), v1::EXPOSURE_STATE_ACTIVE);
  EXPECT_EQ(Document(kNode)->applied_version(), v3);
  // A failed endpoint may be asked for again (here: the pool has nothing left).
  auto retry = Create(Operator(), a.id, "dns", 53, kUdp);
  ASSERT_FALSE(retry.ok());
  EXPECT_EQ(retry.error().reason, "pool_exhausted");
}

TEST_F(IngressTest, DriftIsReportedAndClearedByTheNextCleanAck) {
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20009)).ok());
  Alloc a;
  a.endpoints = {{"ssh", kTcp, 22}};
  a.vm_ready = true;
  a.ip = "10.100.0.10";
  Announce(a, v1::ALLOCATION_STATE_ACTIVE);
  auto got = WaitStates(a.id, {"ssh"}, v1::EXPOSURE_STATE_APPLYING);
  const auto id = got["ssh"].exposure_id();
  const int64_t v = got["ssh"].document_version();
  ASSERT_TRUE(Ack(kNode, v).ok());
  WaitStates(a.id, {"ssh"}, v1::EXPOSURE_STATE_ACTIVE);

  // The node found the rule gone and put it back; it also removed a rule nobody asked for.
  v1::ExposureDrift missing;
  missing.set_exposure_id(id);
  missing.set_kind("rule_missing");
  missing.set_detail("tcp dport 20000 dnat to 10.100.0.10:22");
  v1::ExposureDrift foreign;
  foreign.set_kind("rule_foreign");
  foreign.set_detail("tcp dport 2222 dnat to 10.100.0.99:22");
  ASSERT_TRUE(Ack(kNode, v, {}, {missing, foreign}).ok());
  got = WaitStates(a.id, {"ssh"}, v1::EXPOSURE_STATE_DRIFT);
  EXPECT_EQ(got["ssh"].reason(), "rule_missing");
  EXPECT_NE(got["ssh"].detail().find("dport 20000"), std::string::npos) << got["ssh"].detail();
  auto drift = WaitEvent(id, ExposureSubject(v1::EXPOSURE_STATE_DRIFT));
  ASSERT_TRUE(drift);
  EXPECT_EQ(drift->actor().subject(), "node:gpu-01");
  // The foreign rule belongs to no exposure: a node drift event says what it was.
  auto node_drift = WaitEvent(kNode, "gpuaas.v1.evt.ingress.node.drift");
  ASSERT_TRUE(node_drift);
  v1::NodeExposureDrift nd;
  ASSERT_TRUE(node_drift->data().UnpackTo(&nd));
  EXPECT_EQ(nd.node_id(), kNode);
  EXPECT_EQ(nd.document_version(), v);
  EXPECT_EQ(nd.drift().kind(), "rule_foreign");
  EXPECT_EQ(nd.drift().detail(), foreign.detail());
  // Drift of an exposure this node does not have is a node drift too, never a state change.
  v1::ExposureDrift stranger;
  stranger.set_exposure_id(ids::NewUuidV7());
  stranger.set_kind("rule_stale");
  v1::ExposureDrift odd;  // a kind the contract does not name: counted as "other"
  odd.set_kind("made_up");
  ASSERT_TRUE(Ack(kNode, v, {}, {missing, stranger, odd}).ok());
  EXPECT_TRUE(testing::WaitFor([&] { return Events(kNode).size() == 3; }));
  EXPECT_EQ(ByName(a.id)["ssh"].state(), v1::EXPOSURE_STATE_DRIFT);

  // The next ack without drift: active again.
  ASSERT_TRUE(Ack(kNode, v).ok());
  got = WaitStates(a.id, {"ssh"}, v1::EXPOSURE_STATE_ACTIVE);
  EXPECT_EQ(got["ssh"].reason(), "");
  EXPECT_TRUE(testing::WaitFor([&] {
    const auto m = Metrics();
    return m.find("gpuaas_exposure_drift_total{kind=\"rule_missing\"} 2") != std::string::npos &&
           m.find("gpuaas_exposure_drift_total{kind=\"rule_foreign\"} 1") != std::string::npos &&
           m.find("gpuaas_exposure_drift_total{kind=\"other\"} 1") != std::string::npos &&
           m.find("made_up") == std::string::npos;
  })) << Metrics();
}

TEST_F(IngressTest, ExhaustionIsStructuredWithItsCounts) {
  Restart({{"GPUAAS_INGRESS_MAX_ENDPOINTS_PER_ALLOCATION", "3"},
           {"GPUAAS_INGRESS_SSH_USER", "ubuntu"}});
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20001)).ok());
  Alloc a;
  a.endpoints = {{"ssh", kTcp, 22}, {"web", kTcp, 80}, {"api", kTcp, 8000}};
  Announce(a, v1::ALLOCATION_STATE_RESERVED);
  // The third one finds the pool exhausted: a failed exposure says so, with the counts.
  auto got = WaitStates(a.id, {"ssh", "web"}, v1::EXPOSURE_STATE_REQUESTED);
  EXPECT_EQ(got["ssh"].connect(),
            fmt::format("ssh -p {} ubuntu@{}", got["ssh"].public_port(), kNodeAddress));
  got = WaitStates(a.id, {"api"}, v1::EXPOSURE_STATE_FAILED);
  EXPECT_EQ(got["api"].reason(), "pool_exhausted");
  EXPECT_EQ(got["api"].public_ip(), "");
  EXPECT_EQ(got["api"].target_port(), 8000);
  EXPECT_NE(got["api"].detail().find("total=2"), std::string::npos) << got["api"].detail();
  EXPECT_NE(got["api"].detail().find("used=2"), std::string::npos) << got["api"].detail();
  ASSERT_TRUE(WaitEvent(got["api"].exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_FAILED)));

  // exposure.create answers RESOURCE_EXHAUSTED with the counts in the details.
  auto more = Create(Tenant("acme"), a.id, "api", 8000);
  ASSERT_FALSE(more.ok());
  EXPECT_EQ(more.error().code, Code::kResourceExhausted);
  EXPECT_EQ(more.error().reason, "pool_exhausted");
  EXPECT_TRUE(more.error().retryable);
  EXPECT_EQ(more.error().details.at("region"), kRegion);
  EXPECT_EQ(more.error().details.at("node_id"), kNode);
  EXPECT_EQ(more.error().details.at("pools"), "edge-a");
  EXPECT_EQ(more.error().details.at("total"), "2");
  EXPECT_EQ(more.error().details.at("used"), "2");
  EXPECT_EQ(more.error().details.at("requested"), "1");
  // Idempotent for what exists; a clash and the per-allocation limit are refused.
  auto same = Create(Tenant("acme"), a.id, "ssh", 22);
  ASSERT_TRUE(same.ok()) << same.error().ToString();
  EXPECT_FALSE(same->created());
  EXPECT_EQ(same->exposure().exposure_id(), got["ssh"].exposure_id());
  auto clash = Create(Tenant("acme"), a.id, "ssh", 2222);
  ASSERT_FALSE(clash.ok());
  EXPECT_EQ(clash.error().reason, "endpoint_exists");
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20009)).ok());
  ASSERT_TRUE(Create(Tenant("acme"), a.id, "api", 8000).ok());
  auto fourth = Create(Tenant("acme"), a.id, "metrics", 9100);
  ASSERT_FALSE(fourth.ok());
  EXPECT_EQ(fourth.error().reason, "too_many_endpoints");
  auto invalid = Create(Tenant("acme"), a.id, "Bad Name", 0);
  ASSERT_FALSE(invalid.ok());
  EXPECT_EQ(invalid.error().reason, "invalid_endpoint");
  EXPECT_EQ(invalid.error().details.count("name"), 1u);
  EXPECT_EQ(invalid.error().details.count("port"), 1u);

  // A node no pool serves, an allocation ingress never saw, one that is over, a bare-metal one.
  Alloc lonely;
  lonely.node = "gpu-09";
  Announce(lonely, v1::ALLOCATION_STATE_ACTIVE);
  auto no_pool = Create(Operator(), lonely.id, "ssh", 22);
  ASSERT_FALSE(no_pool.ok());
  EXPECT_EQ(no_pool.error().code, Code::kResourceExhausted);
  EXPECT_EQ(no_pool.error().reason, "no_pool");
  EXPECT_EQ(no_pool.error().details.at("node_id"), "gpu-09");
  auto unseen = Create(Operator(), ids::NewUuidV7(), "ssh", 22);
  ASSERT_FALSE(unseen.ok());
  EXPECT_EQ(unseen.error().reason, "allocation_not_found");
  Announce(lonely, v1::ALLOCATION_STATE_RELEASED);
  auto over = Create(Operator(), lonely.id, "ssh", 22);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.error().reason, "allocation_not_live");
  Alloc metal;
  metal.shape = v1::CAPACITY_SHAPE_BAREMETAL;
  metal.slot = "";
  Announce(metal, v1::ALLOCATION_STATE_ACTIVE);
  auto bare = Create(Operator(), metal.id, "ssh", 22);
  ASSERT_FALSE(bare.ok());
  EXPECT_EQ(bare.error().reason, "exposure_not_for_baremetal");
}

// Many reservations at once from a pool smaller than the demand: exactly its capacity succeeds,
// and no endpoint is ever given to two exposures.
TEST_F(IngressTest, ConcurrentReservationsNeverShareAnEndpoint) {
  constexpr int kPorts = 5;
  constexpr int kAllocations = 8;
  constexpr int kThreads = 24;  // per pool
  constexpr size_t kCalls = size_t{kThreads} * 2;
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20000 + kPorts - 1)).ok());
  ASSERT_TRUE(
      SetPool(IpPool("ips", {"198.51.100.1", "198.51.100.2", "198.51.100.3"}, "eu-1")).ok());
  std::vector<Alloc> ports(kAllocations);
  std::vector<Alloc> addrs(kAllocations);
  for (int i = 0; i < kAllocations; ++i) {
    Announce(ports[i], v1::ALLOCATION_STATE_PROVISIONING);
    addrs[i].region = "eu-1";
    addrs[i].node = fmt::format("gpu-eu-{}", i);
    Announce(addrs[i], v1::ALLOCATION_STATE_PROVISIONING);
  }
  std::atomic<int> ready{0};
  std::vector<Result<v1::CreateExposureResponse>> results(kCalls, Error::Internal("x", "unset"));
  std::vector<std::thread> threads;
  threads.reserve(kCalls);
  for (int i = 0; i < static_cast<int>(kCalls); ++i) {
    threads.emplace_back([&, i] {
      const auto& a = i < kThreads ? ports[i % kAllocations] : addrs[i % kAllocations];
      ready++;
      while (ready.load() < static_cast<int>(kCalls)) std::this_thread::yield();
      results[i] = Create(Operator(), a.id, fmt::format("ep-{}", i), 1000 + i);
    });
  }
  for (auto& t : threads) t.join();
  std::set<int32_t> taken_ports;
  std::map<std::string, std::set<std::string>> address_of;  // allocation -> its addresses
  std::map<std::string, std::string> holder;                // address -> allocation
  int port_ok = 0;
  int addr_ok = 0;
  for (int i = 0; i < static_cast<int>(kCalls); ++i) {
    const auto& r = results[i];
    if (!r.ok()) {
      EXPECT_EQ(r.error().reason, "pool_exhausted") << r.error().ToString();
      continue;
    }
    ASSERT_TRUE(r->created());
    const auto& e = r->exposure();
    if (i < kThreads) {
      ++port_ok;
      EXPECT_TRUE(taken_ports.insert(e.public_port()).second)
          << "port " << e.public_port() << " given twice";
    } else {
      ++addr_ok;
      EXPECT_EQ(e.public_port(), e.target_port());
      address_of[e.allocation_id()].insert(e.public_ip());
      auto [it, fresh] = holder.emplace(e.public_ip(), e.allocation_id());
      EXPECT_TRUE(fresh || it->second == e.allocation_id())
          << e.public_ip() << " given to two allocations";
    }
  }
  EXPECT_EQ(port_ok, kPorts);
  EXPECT_EQ(taken_ports.size(), static_cast<size_t>(kPorts));
  EXPECT_EQ(holder.size(), 3u) << "every address handed out once";
  for (const auto& [alloc, a] : address_of) EXPECT_EQ(a.size(), 1u) << alloc;
  EXPECT_GE(addr_ok, 3);
  EXPECT_EQ(Pool("edge-a")->used(), kPorts);
  EXPECT_EQ(Pool("ips")->used(), 3);
  // What the service lists agrees with what the callers were told.
  auto live = List(Operator());
  ASSERT_TRUE(live.ok());
  EXPECT_EQ(live->exposures_size(), port_ok + addr_ok);
}

TEST_F(IngressTest, TenantsSeeAndChangeOnlyTheirOwnExposures) {
  ASSERT_TRUE(SetPool(PortPool("edge-a", 20000, 20009)).ok());
  Alloc acme;
  Alloc globex;
  globex.tenant = "globex";
  Announce(acme, v1::ALLOCATION_STATE_PROVISIONING);
  Announce(globex, v1::ALLOCATION_STATE_PROVISIONING);
  auto mine = Create(Tenant("acme"), acme.id, "ssh", 22);
  ASSERT_TRUE(mine.ok()) << mine.error().ToString();
  EXPECT_TRUE(mine->created());
  EXPECT_EQ(mine->exposure().state(), v1::EXPOSURE_STATE_REQUESTED);
  auto theirs = Create(Tenant("globex"), globex.id, "ssh", 22);
  ASSERT_TRUE(theirs.ok()) << theirs.error().ToString();
  // Recorded in the name of the tenant's user who asked.
  auto ev =
      WaitEvent(mine->exposure().exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_REQUESTED));
  ASSERT_TRUE(ev);
  EXPECT_EQ(ev->actor().subject(), "tenant:acme/alice");
  EXPECT_EQ(ev->actor().tenant(), "acme");

  // globex cannot expose, see or remove acme's.
  auto sneak = Create(Tenant("globex"), acme.id, "web", 80);
  ASSERT_FALSE(sneak.ok());
  EXPECT_EQ(sneak.error().code, Code::kNotFound);
  EXPECT_EQ(sneak.error().reason, "allocation_not_found");
  auto del = Delete(Tenant("globex"), mine->exposure().exposure_id());
  ASSERT_FALSE(del.ok());
  EXPECT_EQ(del.error().code, Code::kNotFound);
  EXPECT_EQ(del.error().reason, "exposure_not_found");
  auto seen = List(Tenant("globex"));
  ASSERT_TRUE(seen.ok());
  ASSERT_EQ(seen->exposures_size(), 1);
  EXPECT_EQ(seen->exposures(0).tenant(), "globex");
  seen = List(Tenant("globex"), acme.id);
  ASSERT_TRUE(seen.ok());
  EXPECT_EQ(seen->exposures_size(), 0);
  // Operators and auditors see every tenant's.
  for (const auto& c : {Operator(), Auditor()}) {
    auto all = List(c);
    ASSERT_TRUE(all.ok()) << all.error().ToString();
    EXPECT_EQ(all->exposures_size(), 2);
  }
  // An auditor changes nothing (refused by the service, not only by nats-server).
  auto audit = Create(WithToken(nats_.Token("auditor")), acme.id, "web", 80);
  ASSERT_FALSE(audit.ok());
  EXPECT_EQ(audit.error().code, Code::kPermissionDenied);
  EXPECT_EQ(audit.error().reason, "role_not_allowed");

  // acme removes its own: it never reached the node, so it is removed at once; again is a no-op.
  auto gone = Delete(Tenant("acme"), mine->exposure().exposure_id());
  ASSERT_TRUE(gone.ok()) << gone.error().ToString();
  EXPECT_EQ(gone->exposure().state(), v1::EXPOSURE_STATE_REMOVED);
  auto again = Delete(Tenant("acme"), mine->exposure().exposure_id());
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  EXPECT_EQ(again->exposure().state(), v1::EXPOSURE_STATE_REMOVED);
  EXPECT_EQ(again->exposure().generation(), gone->exposure().generation());
  auto removed =
      WaitEvent(mine->exposure().exposure_id(), ExposureSubject(v1::EXPOSURE_STATE_REMOVED));
  ASSERT_TRUE(removed);
  EXPECT_EQ(removed->actor().subject(), "tenant:acme/alice");
  auto left = List(Tenant("acme"));
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->exposures_size(), 0) << "removed exposures are listed only when asked for";
  left = List(Tenant("acme"), "", v1::EXPOSURE_STATE_REMOVED);
  ASSERT_TRUE(left.ok());
  EXPECT_EQ(left->exposures_size(), 1);
  EXPECT_EQ(Pool("edge-a")->used(), 1);
}

// A public_ip pool gives an allocation one whole address; every endpoint keeps its own port.
TEST_F(IngressTest, PublicIpPoolsGiveAnAllocationOneAddress) {
  ASSERT_TRUE(SetPool(IpPool("ips", {"198.51.100.1", "198.51.100.2"})).ok());
  Alloc a;
  a.endpoints = {{"ssh", kTcp, 22}, {"web", kTcp, 8080}, {"dns", kUdp, 53}};
  a.vm_ready = true;
  a.ip = "10.100.0.10";
  Announce(a, v1::ALLOCATION_STATE_PROVISIONING);
  auto got = WaitStates(a.id, {"ssh", "web", "dns"}, v1::EXPOSURE_STATE_APPLYING);
  const std::string address = got["ssh"].public_ip();
  EXPECT_EQ(address, "198.51.100.1");
  for (const auto& [name, e] : got) {
    EXPECT_EQ(e.public_ip(), address) << name;
    EXPECT_EQ(e.public_port(), e.target_port()) << name;
    EXPECT_EQ(e.pool(), "ips") << name;
  }
  EXPECT_EQ(got["ssh"].connect(), "ssh -p 22 root@198.51.100.1");
  EXPECT_EQ(Pool("ips")->used(), 1) << "one address, however many endpoints";
  // A later endpoint of the same allocation uses the same address.
  auto more = Create(Operator(), a.id, "metrics", 9100);
  ASSERT_TRUE(more.ok()) << more.error().ToString();
  EXPECT_EQ(more->exposure().public_ip(), address);

  Alloc b;
  b.node = "gpu-02";
  b.endpoints = {{"ssh", kTcp, 22}};
  Announce(b, v1::ALLOCATION_STATE_RESERVED);
  EXPECT_EQ(WaitStates(b.id, {"ssh"}, v1::EXPOSURE_STATE_REQUESTED)["ssh"].public_ip(),
            "198.51.100.2");
  Alloc c;
  c.endpoints = {{"ssh", kTcp, 22}};
  Announce(c, v1::ALLOCATION_STATE_RESERVED);
  EXPECT_EQ(WaitStates(c.id, {"ssh"}, v1::EXPOSURE_STATE_FAILED)["ssh"].reason(), "pool_exhausted");
  // The held address cannot leave the pool.
  auto drop = SetPool(IpPool("ips", {"198.51.100.2"}));
  ASSERT_FALSE(drop.ok());
  EXPECT_EQ(drop.error().reason, "pool_in_use");
  EXPECT_EQ(drop.error().details.at("address"), address);

  // Deleting one endpoint keeps the address (others use it) ...
  ASSERT_TRUE(Delete(Operator(), more->exposure().exposure_id()).ok());
  const int64_t v = Document(kNode)->latest_version();
  ASSERT_TRUE(Ack(kNode, v).ok());
  got = WaitStates(a.id, {"ssh", "web", "dns"}, v1::EXPOSURE_STATE_ACTIVE);
  EXPECT_EQ(WaitStates(a.id, {"metrics"}, v1::EXPOSURE_STATE_REMOVED).size(), 4u);
  EXPECT_EQ(Pool("ips")->used(), 2);
  // ... releasing the allocation frees it once the node took the rules out.
  Announce(a, v1::ALLOCATION_STATE_RELEASING);
  WaitStates(a.id, {"ssh", "web", "dns"}, v1::EXPOSURE_STATE_REMOVING);
  EXPECT_EQ(Pool("ips")->used(), 2);
  ASSERT_TRUE(Ack(kNode, Document(kNode)->latest_version()).ok());
  WaitStates(a.id, {"ssh", "web", "dns"}, v1::EXPOSURE_STATE_REMOVED);
  EXPECT_EQ(Pool("ips")->used(), 1);
  auto retry = Create(Operator(), c.id, "ssh", 22);
  ASSERT_TRUE(retry.ok()) << retry.error().ToString();
  EXPECT_EQ(retry->exposure().public_ip(), address);
}

// Unit rules: pool capacity, endpoint validation, connect hints.
TEST(IngressDomainTest, RulesOfPoolsAndEndpoints) {
  v1::EndpointPool p;
  p.set_kind(v1::ENDPOINT_POOL_KIND_PORT_RANGE);
  p.set_port_min(20000);
  p.set_port_max(20009);
  EXPECT_EQ(PoolCapacity(p), 10);
  p.set_port_max(1);
  EXPECT_EQ(PoolCapacity(p), 0);
  p.set_kind(v1::ENDPOINT_POOL_KIND_PUBLIC_IP);
  p.add_addresses("198.51.100.1");
  p.add_addresses("198.51.100.2");
  EXPECT_EQ(PoolCapacity(p), 2);
  EXPECT_TRUE(ParseIpv4("198.51.100.1"));
  for (const char* bad : {"", "1.2.3", "1.2.3.4.5", "01.2.3.4", "256.1.1.1", "1.2.3.4/32", "a"}) {
    EXPECT_FALSE(ParseIpv4(bad)) << bad;
  }
  EXPECT_TRUE(ValidateEndpoint("ssh", kTcp, 22).ok());
  auto bad = ValidateEndpoint("-x", v1::TRANSPORT_PROTOCOL_UNSPECIFIED, 70000);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().details.size(), 3u);
  v1::Exposure e;
  e.set_protocol(kTcp);
  e.set_target_port(22);
  EXPECT_EQ(ConnectHint(e, "root"), "") << "no public endpoint yet";
  e.set_public_ip("203.0.113.10");
  e.set_public_port(20022);
  EXPECT_EQ(ConnectHint(e, "root"), "ssh -p 20022 root@203.0.113.10");
  e.set_protocol(kUdp);
  EXPECT_EQ(ConnectHint(e, "root"), "203.0.113.10:20022/udp");
  // DNS names and overlay identities have room in the contract, not yet an implementation.
  for (auto kind : {v1::ENDPOINT_POOL_KIND_DNS_NAME, v1::ENDPOINT_POOL_KIND_OVERLAY}) {
    v1::EndpointPool reserved;
    reserved.set_name("names");
    reserved.set_region("us-east-1");
    reserved.set_kind(kind);
    auto r = ValidatePool(reserved);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, Code::kFailedPrecondition);
    EXPECT_EQ(r.error().reason, "pool_kind_not_supported");
  }
}

}  // namespace
}  // namespace gpuaas::ingress
