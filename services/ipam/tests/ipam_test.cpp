// ipam in-process against real NATS JetStream and PostgreSQL: reservations, MAC collisions under
// concurrency, release and re-provision, subnet rules and their errors, the versioned node
// network document and its ack, allocation binding from scheduler events (with redelivery and
// stale events), lease reports becoming drift and being resolved, reserve/reprovision checked
// against ipam's projection of inventory, and orphan rows listed and removed.
#include <gtest/gtest.h>
#include <pqxx/pqxx>

#include <google/protobuf/util/time_util.h>

#include <atomic>
#include <mutex>
#include <set>
#include <thread>
#include <unordered_map>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::ipam {
namespace {

using namespace std::chrono_literals;
using google::protobuf::util::TimeUtil;

class IpamTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }
  void Start(const std::map<std::string, std::string>& extra) {
    if (dsn_.empty()) dsn_ = testing::SharedPostgres().CreateDatabase("ipam");
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn_},
                                              {"GPUAAS_LOG_LEVEL", "error"}};
    for (const auto& [k, v] : nats_.Env("ipam")) env[k] = v;
    for (auto& [k, v] : extra) env[k] = v;
    svc_ = std::make_unique<IpamService>(LoadConfig<IpamConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    // rpc::Server::Start does not flush its SUB: a round trip makes sure the server has it
    // before the first request of a test that restarted the service.
    ASSERT_TRUE(svc_->runtime().nats()->Flush(2000ms).ok());
    if (!conn_) {
      auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness),
                                              log::Logger("test", "t", log::Level::kError));
      ASSERT_TRUE(c.ok());
      conn_ = *c;
    }
  }
  void Restart(const std::map<std::string, std::string>& extra) {
    svc_->Shutdown();
    Start(extra);
  }
  void TearDown() override { svc_->Shutdown(); }

  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return rpc::Client(conn_).Call<Resp>(subject, req, 10000ms);
  }
  // Whether ipam's projection of inventory has the node (and the slot, when not "").
  bool Projected(const std::string& node, const std::string& slot = "") {
    pqxx::connection c(dsn_);
    pqxx::nontransaction tx(c);
    if (slot.empty()) {
      return !tx.exec_params("SELECT 1 FROM inventory_nodes WHERE node_id = $1", node).empty();
    }
    return !tx.exec_params("SELECT 1 FROM inventory_slots WHERE node_id = $1 AND slot_key = $2",
                           node, slot)
                .empty();
  }
  // What inventory's outbox relay publishes when it registers a node / announces a slot.
  void PublishNode(const std::string& node) {
    v1::NodeSnapshot snap;
    snap.mutable_node()->set_node_id(node);
    snap.mutable_node()->set_generation(1);
    const std::string subject = "gpuaas.v1.evt.inventory.node.registered";
    auto ev = outbox::MakeEvent({subject, "", "inventory/test", node, 1, node, "", &snap});
    Republish(subject, ev, ev.id());
  }
  void PublishSlot(const std::string& node, const std::string& slot) {
    v1::SlotSnapshot snap;
    snap.mutable_slot()->set_node_id(node);
    snap.mutable_slot()->set_slot_key(slot);
    snap.mutable_slot()->set_generation(1);
    const std::string subject = "gpuaas.v1.evt.inventory.slot.updated";
    auto ev =
        outbox::MakeEvent({subject, "", "inventory/test", node + "/" + slot, 1, node, "", &snap});
    Republish(subject, ev, ev.id());
  }
  // Inventory knows the node (and the slot), as ipam's projection says.
  void Know(const std::string& node, const std::string& slot = "") {
    if (!ids::IsNodeId(node)) return;  // requests for it are refused before the lookup
    const std::string key = node + "/" + slot;
    {
      std::lock_guard lock(known_mu_);
      if (!known_.insert(key).second) return;
    }
    if (slot.empty()) {
      PublishNode(node);
    } else {
      Know(node);
      PublishSlot(node, slot);
    }
    EXPECT_TRUE(testing::WaitFor([&] { return Projected(node, slot); })) << key;
  }
  Result<v1::ReserveSlotAddressResponse> Reserve(const std::string& node, const std::string& slot,
                                                 const std::string& region = "",
                                                 const std::string& pool = "") {
    Know(node);
    return ReserveUnchecked(node, slot, region, pool);
  }
  Result<v1::ReserveSlotAddressResponse> ReserveUnchecked(const std::string& node,
                                                          const std::string& slot,
                                                          const std::string& region = "",
                                                          const std::string& pool = "") {
    v1::ReserveSlotAddressRequest req;
    req.set_node_id(node);
    req.set_slot_key(slot);
    req.set_region(region);
    req.set_pool(pool);
    return Call<v1::ReserveSlotAddressResponse>("gpuaas.v1.ipam.reservation.reserve", req);
  }
  Result<v1::ReleaseSlotAddressResponse> Release(const std::string& node, const std::string& slot) {
    v1::ReleaseSlotAddressRequest req;
    req.set_node_id(node);
    req.set_slot_key(slot);
    req.set_reason("test");
    return Call<v1::ReleaseSlotAddressResponse>("gpuaas.v1.ipam.reservation.release", req);
  }
  Result<v1::ReprovisionSlotAddressResponse> Reprovision(const std::string& node,
                                                         const std::string& slot,
                                                         const std::string& mac = "") {
    if (!slot.empty()) Know(node, slot);
    return ReprovisionUnchecked(node, slot, mac);
  }
  Result<v1::ReprovisionSlotAddressResponse> ReprovisionUnchecked(const std::string& node,
                                                                  const std::string& slot,
                                                                  const std::string& mac = "") {
    v1::ReprovisionSlotAddressRequest req;
    req.set_node_id(node);
    req.set_slot_key(slot);
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    req.set_mac(mac);  // deprecated: set only to prove it is refused
#pragma GCC diagnostic pop
    return Call<v1::ReprovisionSlotAddressResponse>("gpuaas.v1.ipam.reservation.reprovision", req);
  }
  Result<v1::SetSubnetResponse> SetSubnet(const std::string& region, const std::string& pool,
                                          const std::string& node, const std::string& subnet,
                                          const std::vector<std::string>& hosts = {},
                                          const std::string& gateway = "",
                                          v1::NetworkDatapath datapath = {},
                                          const std::string& bridge = "") {
    v1::SetSubnetRequest req;
    req.set_region(region);
    req.set_pool(pool);
    req.set_node_id(node);
    req.set_subnet(subnet);
    req.set_gateway(gateway);
    req.set_datapath(datapath);
    req.set_bridge(bridge);
    for (const auto& h : hosts) req.add_host_cidrs(h);
    return Call<v1::SetSubnetResponse>("gpuaas.v1.ipam.subnet.set", req);
  }
  Result<v1::GetNodeNetworkResponse> Network(const std::string& node, int64_t version = 0) {
    v1::GetNodeNetworkRequest req;
    req.set_node_id(node);
    req.set_version(version);
    return Call<v1::GetNodeNetworkResponse>("gpuaas.v1.ipam.node.{node_id}.network.get", req);
  }
  Result<v1::AckNodeNetworkResponse> Ack(const std::string& node, int64_t version,
                                         const std::vector<std::string>& blockers = {}) {
    v1::AckNodeNetworkRequest req;
    req.set_node_id(node);
    req.set_version(version);
    for (const auto& b : blockers) req.add_blockers(b);
    return Call<v1::AckNodeNetworkResponse>("gpuaas.v1.ipam.node.{node_id}.network.ack", req);
  }
  std::vector<v1::SlotReservation> Reservations(const std::string& node) {
    v1::ListReservationsRequest req;
    req.set_node_id(node);
    auto r = Call<v1::ListReservationsResponse>("gpuaas.v1.ipam.reservation.list", req);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    if (!r.ok()) return {};
    return {r->reservations().begin(), r->reservations().end()};
  }
  std::optional<v1::SlotReservation> Find(const std::string& node, const std::string& slot) {
    for (auto& r : Reservations(node)) {
      if (r.slot_key() == slot) return r;
    }
    return std::nullopt;
  }
  std::vector<v1::IpamDrift> Drift(const std::string& node, bool include_resolved = false) {
    v1::ListDriftRequest req;
    req.set_node_id(node);
    req.set_include_resolved(include_resolved);
    auto r = Call<v1::ListDriftResponse>("gpuaas.v1.ipam.drift.list", req);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    if (!r.ok()) return {};
    return {r->drift().begin(), r->drift().end()};
  }
  Result<v1::ListLeasesResponse> Leases(const std::string& node) {
    v1::ListLeasesRequest req;
    req.set_node_id(node);
    return Call<v1::ListLeasesResponse>("gpuaas.v1.ipam.lease.list", req);
  }
  // A failed query fails the test: read as 0 it would let "nothing published" pass unchecked.
  uint64_t Count(const std::string& stream, const std::string& subject) {
    auto n = messaging::StreamSubjectCount(*conn_, stream, subject);
    if (!n.ok()) {
      ADD_FAILURE() << "counting " << subject << " in " << stream << ": " << n.error().ToString();
      return 0;
    }
    return *n;
  }

  // What the scheduler's outbox relay publishes; `msg_id` other than the event id makes the
  // stream hold the same event twice (a redelivery that JetStream did not de-duplicate).
  v1::Event PublishAllocation(const std::string& id, const std::string& node,
                              const std::string& state, int64_t generation,
                              const std::vector<std::string>& slots,
                              const std::string& msg_id = "") {
    v1::AllocationSnapshot snap;
    auto* a = snap.mutable_allocation();
    a->set_allocation_id(id);
    a->set_node_id(node);
    a->set_state(enums::FromColumn<v1::AllocationState>(state));
    a->set_generation(generation);
    for (const auto& s : slots) a->add_slot_keys(s);
    const std::string subject = fmt::format("gpuaas.v1.evt.scheduler.allocation.{}", state);
    auto ev = outbox::MakeEvent({subject, "", "scheduler/test", id, generation, id, "", &snap});
    Republish(subject, ev, msg_id.empty() ? ev.id() : msg_id);
    return ev;
  }
  void Republish(const std::string& subject, const v1::Event& ev, const std::string& msg_id) {
    auto r = messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), msg_id);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  // An empty lease report of `node` for document `version`, observed at `at_ms`.
  static v1::LeaseReport LeaseReportOf(const std::string& node, int64_t version, int64_t at_ms) {
    v1::LeaseReport r;
    r.set_node_id(node);
    r.set_document_version(version);
    *r.mutable_observed_at() = TimeUtil::MillisecondsToTimestamp(at_ms);
    return r;
  }
  void PublishLeases(const v1::LeaseReport& report) {
    const auto subject = LeaseReportSubject(report.node_id());
    auto ev =
        outbox::MakeEvent({subject, "", "node-agent/test", report.node_id(), 0, "", "", &report});
    Republish(subject, ev, ev.id());
  }
  bool WaitAllocation(const std::string& node, const std::string& slot, const std::string& id) {
    return testing::WaitFor([&] {
      auto r = Find(node, slot);
      return r && r->allocation_id() == id;
    });
  }

  testing::TestNats nats_;
  std::string dsn_;
  std::unique_ptr<IpamService> svc_;
  std::shared_ptr<messaging::Connection> conn_;
  std::mutex known_mu_;
  std::set<std::string> known_;  // "<node>/<slot>" already in ipam's projection
};

TEST_F(IpamTest, ReserveIsIdempotentAndAnnouncedOnce) {
  auto a = Reserve("gpu-01", "gpu-0000:18:00.0");
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_TRUE(a->created());
  EXPECT_EQ(a->reservation().ip(), "10.100.0.10");
  EXPECT_EQ(a->reservation().gateway(), "10.100.0.1");
  EXPECT_EQ(a->reservation().subnet(), "10.100.0.0/24");
  EXPECT_EQ(a->reservation().mac(), DeterministicMac("gpu-01", "gpu-0000:18:00.0", 0));
  EXPECT_EQ(a->reservation().mac_source(), "derived");
  auto again = Reserve("gpu-01", "gpu-0000:18:00.0");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->reservation().mac(), a->reservation().mac());
  EXPECT_EQ(again->reservation().ip(), a->reservation().ip());
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.reservation.created") == 1; }));
}

TEST_F(IpamTest, ConcurrentReservationsGetDistinctAddresses) {
  std::vector<std::thread> threads;
  threads.reserve(16);
  std::vector<Result<v1::ReserveSlotAddressResponse>> results(16, Error::Internal("x", "unset"));
  for (int i = 0; i < 16; ++i) {
    threads.emplace_back([&, i] {
      results[i] = Reserve(i < 8 ? "gpu-01" : "gpu-02", "slot-" + std::to_string(i % 8));
    });
  }
  for (auto& t : threads) t.join();
  std::set<std::string> macs;
  std::map<std::string, std::set<std::string>> ips;
  for (auto& r : results) {
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    macs.insert(r->reservation().mac());
    ips[r->reservation().node_id()].insert(r->reservation().ip());
  }
  EXPECT_EQ(macs.size(), 16u) << "MACs are unique across nodes";
  EXPECT_EQ(ips["gpu-01"].size(), 8u);
  EXPECT_EQ(ips["gpu-02"].size(), 8u);  // node-local subnets may reuse the same IPs
  auto doc = Network("gpu-01");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->document().reservations_size(), 8);
}

TEST_F(IpamTest, ExhaustedSubnetAndBadInputAreStructured) {
  Restart({{"GPUAAS_IPAM_FIRST_HOST", "10"},
           {"GPUAAS_IPAM_LAST_HOST", "11"},
           {"GPUAAS_IPAM_SLOTS_PER_NODE", "2"}});
  ASSERT_TRUE(Reserve("gpu-09", "a").ok());
  ASSERT_TRUE(Reserve("gpu-09", "b").ok());
  auto c = Reserve("gpu-09", "c");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, Code::kResourceExhausted);
  EXPECT_EQ(c.error().reason, "subnet_exhausted");
  auto bad = Reserve("Bad.Node", "");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Code::kInvalidArgument);
  EXPECT_TRUE(bad.error().details.count("node_id"));
  EXPECT_TRUE(bad.error().details.count("slot_key"));
  auto pool_only = Reserve("gpu-09", "d", "", "h200");
  ASSERT_FALSE(pool_only.ok());
  EXPECT_TRUE(pool_only.error().details.count("region"));
  // A config the service cannot run with is refused at start, every problem listed.
  IpamService broken(LoadConfig<IpamConfig>({{"GPUAAS_NATS_URL", nats_.url()},
                                             {"GPUAAS_NATS_SEED_FILE", nats_.SeedFile("ipam")},
                                             {"GPUAAS_POSTGRES_DSN", dsn_},
                                             {"GPUAAS_IPAM_DEFAULT_SUBNET", "10.100.0.0/29"},
                                             {"GPUAAS_IPAM_BRIDGE", "bridge-name-too-long"}}));
  auto s = broken.Start();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.error().reason, "invalid_config");
  EXPECT_TRUE(s.error().details.count("ipam.default_subnet"));
  EXPECT_TRUE(s.error().details.count("ipam.bridge"));
}

// Nodes whose slots derive the same MAC: the first keeps it, the other gets a pool MAC, also
// when both reserve at the same moment on different nodes (no internal error, no retry needed
// by the caller).
TEST_F(IpamTest, DerivedMacCollisionsAreResolvedFromThePoolEvenConcurrently) {
  std::unordered_map<uint64_t, int> seen;
  std::vector<std::pair<std::string, std::string>> pairs;  // colliding node ids, slot "slot-0"
  for (int i = 0; pairs.size() < 4; ++i) {
    auto [it, fresh] = seen.emplace(DerivedMacValue(fmt::format("n-{}", i), "slot-0", 0), i);
    if (!fresh) pairs.emplace_back(fmt::format("n-{}", it->second), fmt::format("n-{}", i));
  }
  // One after the other.
  auto first = Reserve(pairs[0].first, "slot-0");
  auto second = Reserve(pairs[0].second, "slot-0");
  ASSERT_TRUE(first.ok() && second.ok());
  EXPECT_EQ(first->reservation().mac(), DeterministicMac(pairs[0].second, "slot-0", 0))
      << "the two nodes really derive the same MAC";
  EXPECT_EQ(first->reservation().mac_source(), "derived");
  EXPECT_EQ(second->reservation().mac_source(), "pool");
  EXPECT_EQ(second->reservation().mac(), "52:54:01:00:00:01") << "the pool's first MAC";
  auto again = Reserve(pairs[0].second, "slot-0");
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->reservation().mac(), second->reservation().mac()) << "stable";
  // At the same moment, on different nodes (different subnet-row locks).
  for (size_t p = 1; p < pairs.size(); ++p) {
    std::atomic<int> ready{0};
    Result<v1::ReserveSlotAddressResponse> a = Error::Internal("x", "unset");
    Result<v1::ReserveSlotAddressResponse> b = Error::Internal("x", "unset");
    auto run = [&](const std::string& node, Result<v1::ReserveSlotAddressResponse>* out) {
      ready++;
      while (ready.load() < 2) std::this_thread::yield();
      *out = Reserve(node, "slot-0");
    };
    std::thread ta(run, pairs[p].first, &a);
    std::thread tb(run, pairs[p].second, &b);
    ta.join();
    tb.join();
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    ASSERT_TRUE(b.ok()) << b.error().ToString();
    EXPECT_NE(a->reservation().mac(), b->reservation().mac());
    std::multiset<std::string> sources = {a->reservation().mac_source(),
                                          b->reservation().mac_source()};
    EXPECT_EQ(sources, (std::multiset<std::string>{"derived", "pool"}));
  }
  std::set<std::string> macs;
  for (const auto& r : Reservations("")) EXPECT_TRUE(macs.insert(r.mac()).second) << r.mac();
  EXPECT_EQ(macs.size(), pairs.size() * 2);
}

TEST_F(IpamTest, MacIsStableAcrossReleaseAndChangesOnlyOnReprovision) {
  auto a = Reserve("gpu-01", "gpu-a");
  ASSERT_TRUE(a.ok());
  ASSERT_TRUE(Reserve("gpu-01", "gpu-b").ok());
  const auto mac = a->reservation().mac();
  auto rel = Release("gpu-01", "gpu-a");
  ASSERT_TRUE(rel.ok()) << rel.error().ToString();
  EXPECT_TRUE(rel->released());
  EXPECT_EQ(rel->reservation().ip(), "10.100.0.10");
  EXPECT_FALSE(Find("gpu-01", "gpu-a"));
  auto twice = Release("gpu-01", "gpu-a");
  ASSERT_TRUE(twice.ok()) << "idempotent";
  EXPECT_FALSE(twice->released());
  auto unknown = Release("gpu-77", "gpu-a");
  ASSERT_TRUE(unknown.ok());
  EXPECT_FALSE(unknown->released());
  auto back = Reserve("gpu-01", "gpu-a");
  ASSERT_TRUE(back.ok());
  EXPECT_TRUE(back->created());
  EXPECT_EQ(back->reservation().mac(), mac) << "a slot keeps its MAC across releases";
  EXPECT_EQ(back->reservation().generation(), rel->reservation().generation() + 1)
      << "the slot's events stay in order across a release";
  // Only an admin re-provision changes it.
  auto re = Reprovision("gpu-01", "gpu-a");
  ASSERT_TRUE(re.ok()) << re.error().ToString();
  EXPECT_EQ(re->previous_mac(), mac);
  EXPECT_NE(re->reservation().mac(), mac);
  EXPECT_EQ(re->reservation().mac(), DeterministicMac("gpu-01", "gpu-a", 1));
  EXPECT_EQ(re->reservation().ip(), back->reservation().ip()) << "the IP stays";
  auto doc = Network("gpu-01");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(re->document_version(), doc->document().version());
  bool listed = false;
  for (const auto& r : doc->document().reservations()) {
    listed = listed || (r.slot_key() == "gpu-a" && r.mac() == re->reservation().mac());
  }
  EXPECT_TRUE(listed) << "the document carries the new MAC";
  // A MAC chosen by the caller is refused, whatever it is, and changes nothing.
  for (const std::string& chosen :
       {std::string("52:54:0a:00:00:01"), std::string("52:54:00:zz:00:01"),
        Find("gpu-01", "gpu-b")->mac()}) {
    auto pinned = Reprovision("gpu-01", "gpu-a", chosen);
    ASSERT_FALSE(pinned.ok()) << chosen;
    EXPECT_EQ(pinned.error().code, Code::kInvalidArgument);
    EXPECT_EQ(pinned.error().reason, "mac_not_allowed");
  }
  EXPECT_EQ(Find("gpu-01", "gpu-a")->mac(), re->reservation().mac())
      << "a refused change changes nothing";
  auto none = Reprovision("gpu-01", "gpu-zz");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().reason, "slot_not_found");
  auto bad_release = Release("Bad", "");
  ASSERT_FALSE(bad_release.ok());
  EXPECT_EQ(bad_release.error().reason, "invalid_release_request");
  ASSERT_TRUE(testing::WaitFor([&] {
    return Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.reservation.released") == 1 &&
           Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.reservation.updated") == 1;
  }));
}

TEST_F(IpamTest, SubnetRulesApplyByScopeAndBadInputIsStructured) {
  Restart({{"GPUAAS_IPAM_RESERVED_CIDRS", "192.168.0.0/16"}});
  auto region = SetSubnet("us-east-1", "", "", "10.20.0.0/24", {"172.16.0.0/12"});
  ASSERT_TRUE(region.ok()) << region.error().ToString();
  EXPECT_EQ(region->rule().scope(), "region");
  EXPECT_EQ(region->rule().gateway(), "10.20.0.1");
  EXPECT_TRUE(region->changed());
  auto pool = SetSubnet("us-east-1", "h200", "", "10.30.0.0/24", {}, "10.30.0.254");
  ASSERT_TRUE(pool.ok()) << pool.error().ToString();
  auto node = SetSubnet("", "", "gpu-03", "10.40.0.0/25");
  ASSERT_TRUE(node.ok()) << node.error().ToString();
  EXPECT_EQ(node->document_version(), 0) << "no document before the node's first reservation";
  EXPECT_FALSE(SetSubnet("", "", "gpu-03", "10.40.0.0/25")->changed());

  auto in_region = Reserve("gpu-01", "s0", "us-east-1", "other");
  auto in_pool = Reserve("gpu-02", "s0", "us-east-1", "h200");
  auto own = Reserve("gpu-03", "s0", "us-east-1", "h200");
  auto plain = Reserve("gpu-04", "s0", "eu-west-1", "h200");
  ASSERT_TRUE(in_region.ok() && in_pool.ok() && own.ok() && plain.ok());
  EXPECT_EQ(in_region->reservation().subnet(), "10.20.0.0/24");
  EXPECT_EQ(in_region->reservation().ip(), "10.20.0.10");
  EXPECT_EQ(in_pool->reservation().subnet(), "10.30.0.0/24");
  EXPECT_EQ(in_pool->reservation().gateway(), "10.30.0.254");
  EXPECT_EQ(own->reservation().subnet(), "10.40.0.0/25");
  EXPECT_EQ(plain->reservation().subnet(), "10.100.0.0/24") << "the default";
  auto doc = Network("gpu-02");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->document().subnet(), "10.30.0.0/24");
  EXPECT_EQ(doc->document().gateway(), "10.30.0.254");

  auto expect_error = [&](const Result<v1::SetSubnetResponse>& r, Code code,
                          const std::string& reason, const std::string& detail) {
    ASSERT_FALSE(r.ok()) << reason;
    EXPECT_EQ(r.error().code, code) << r.error().ToString();
    EXPECT_EQ(r.error().reason, reason) << r.error().ToString();
    if (!detail.empty()) {
      EXPECT_TRUE(r.error().details.count(detail)) << r.error().ToString();
    }
  };
  expect_error(SetSubnet("", "", "", "10.50.0.0/24"), Code::kInvalidArgument, "invalid_scope",
               "scope");
  expect_error(SetSubnet("", "h200", "", "10.50.0.0/24"), Code::kInvalidArgument, "invalid_scope",
               "region");
  expect_error(SetSubnet("us-east-1", "", "gpu-01", "10.50.0.0/24"), Code::kInvalidArgument,
               "invalid_scope", "scope");
  expect_error(SetSubnet("", "", "gpu-05", "10.50.0/24"), Code::kInvalidArgument, "invalid_cidr",
               "subnet");
  expect_error(SetSubnet("", "", "gpu-05", "10.50.0.7/24"), Code::kInvalidArgument, "invalid_cidr",
               "subnet");
  expect_error(SetSubnet("", "", "gpu-05", "10.50.0.0/24", {"172.16.0.0/33"}),
               Code::kInvalidArgument, "invalid_cidr", "host_cidrs[0]");
  expect_error(SetSubnet("", "", "gpu-05", "10.50.0.0/24", {}, "10.51.0.1"), Code::kInvalidArgument,
               "invalid_gateway", "gateway");
  // /28 offers .10-.14 only: less than ipam.slots_per_node (8).
  expect_error(SetSubnet("", "", "gpu-05", "10.50.0.0/28"), Code::kInvalidArgument,
               "subnet_too_small", "required");
  // Overlaps within one node's scope: the platform's networks, the rule's own host networks,
  // the host networks of the region the node is in, and (the other way round) a region's new
  // host networks against the subnets of its pools and nodes.
  expect_error(SetSubnet("", "", "gpu-05", "192.168.10.0/24"), Code::kInvalidArgument,
               "subnet_overlap", "overlaps");
  expect_error(SetSubnet("", "", "gpu-05", "10.50.0.0/24", {"10.50.0.0/16"}),
               Code::kInvalidArgument, "subnet_overlap", "overlaps");
  expect_error(SetSubnet("us-east-1", "h200", "", "172.20.0.0/24"), Code::kInvalidArgument,
               "subnet_overlap", "source");
  expect_error(SetSubnet("", "", "gpu-01", "172.16.5.0/24"), Code::kInvalidArgument,
               "subnet_overlap", "source");
  expect_error(SetSubnet("us-east-1", "", "", "10.20.0.0/24", {"10.30.0.0/16"}),
               Code::kInvalidArgument, "subnet_overlap", "source");
  // Moving a node with reservations: only to a subnet its addresses still fit in.
  expect_error(SetSubnet("", "", "gpu-01", "10.60.0.0/24"), Code::kFailedPrecondition,
               "subnet_in_use", "slot_key");
  auto wider = SetSubnet("", "", "gpu-01", "10.20.0.0/23");
  ASSERT_TRUE(wider.ok()) << wider.error().ToString();
  auto moved = Network("gpu-01");
  ASSERT_TRUE(moved.ok());
  EXPECT_EQ(moved->document().subnet(), "10.20.0.0/23");
  EXPECT_EQ(moved->document().version(), 2);
  EXPECT_EQ(wider->document_version(), 2);
}

TEST_F(IpamTest, DatapathComesFromTheRulesAndANodeRuleMovesTheNodeAtOnce) {
  constexpr auto kOvs = v1::NETWORK_DATAPATH_OVS;
  constexpr auto kLinux = v1::NETWORK_DATAPATH_LINUX_BRIDGE;
  // The default: a Linux bridge named by ipam.bridge.
  ASSERT_TRUE(Reserve("gpu-01", "s0").ok());
  auto first = Network("gpu-01");
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(first->document().version(), 1);
  EXPECT_EQ(first->document().datapath(), kLinux);
  EXPECT_EQ(first->document().bridge(), "gpuaasbr0");

  // A node rule choosing OVS applies at once: a new version with OVS and ipam.ovs_bridge.
  auto ovs = SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", kOvs);
  ASSERT_TRUE(ovs.ok()) << ovs.error().ToString();
  EXPECT_TRUE(ovs->changed());
  EXPECT_EQ(ovs->rule().datapath(), kOvs);
  EXPECT_EQ(ovs->rule().bridge(), "") << "the rule inherits the bridge name";
  EXPECT_EQ(ovs->document_version(), 2);
  auto v2 = Network("gpu-01");
  ASSERT_TRUE(v2.ok());
  EXPECT_EQ(v2->document().version(), 2);
  EXPECT_EQ(v2->document().datapath(), kOvs);
  EXPECT_EQ(v2->document().bridge(), "ovsbr0");
  ASSERT_EQ(v2->document().reservations_size(), 1);
  EXPECT_EQ(v2->document().reservations(0).network_id(), "") << "never set by ipam";
  auto again = SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", kOvs);
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->changed());
  EXPECT_EQ(again->document_version(), 2) << "same datapath, no new version";
  auto named = SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", kOvs, "br-slice");
  ASSERT_TRUE(named.ok()) << named.error().ToString();
  EXPECT_TRUE(named->changed());
  EXPECT_EQ(named->document_version(), 3);
  EXPECT_EQ(Network("gpu-01")->document().bridge(), "br-slice");

  // Refused, with the reason and the field.
  auto expect_invalid = [&](const Result<v1::SetSubnetResponse>& r, const std::string& reason,
                            const std::string& field) {
    ASSERT_FALSE(r.ok()) << reason;
    EXPECT_EQ(r.error().code, Code::kInvalidArgument) << r.error().ToString();
    EXPECT_EQ(r.error().reason, reason) << r.error().ToString();
    EXPECT_TRUE(r.error().details.count(field)) << r.error().ToString();
  };
  expect_invalid(SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", kOvs, "ovs bridge!"),
                 "invalid_bridge", "bridge");
  expect_invalid(SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", kOvs, "a-name-of-16-chr"),
                 "invalid_bridge", "bridge");
  expect_invalid(SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", {}, "ovsbr0"),
                 "invalid_bridge", "bridge");
  expect_invalid(
      SetSubnet("", "", "gpu-01", "10.100.0.0/24", {}, "", static_cast<v1::NetworkDatapath>(7)),
      "datapath_invalid", "datapath");
  EXPECT_EQ(Network("gpu-01")->document().version(), 3) << "a refused rule changes nothing";

  // Region and pool rules apply at a node's first reservation; the pool's is more specific.
  auto region = SetSubnet("us-east-1", "", "", "10.20.0.0/24", {}, "", kOvs);
  ASSERT_TRUE(region.ok()) << region.error().ToString();
  EXPECT_EQ(region->document_version(), 0);
  auto pool = SetSubnet("us-east-1", "h200", "", "10.30.0.0/24", {}, "", kLinux, "br-pool");
  ASSERT_TRUE(pool.ok()) << pool.error().ToString();
  // A node rule that sets only a subnet inherits the datapath of its region.
  ASSERT_TRUE(SetSubnet("", "", "gpu-04", "10.40.0.0/24").ok());
  ASSERT_TRUE(Reserve("gpu-02", "s0", "us-east-1", "other").ok());
  ASSERT_TRUE(Reserve("gpu-03", "s0", "us-east-1", "h200").ok());
  ASSERT_TRUE(Reserve("gpu-04", "s0", "us-east-1", "other").ok());
  ASSERT_TRUE(Reserve("gpu-05", "s0", "eu-west-1").ok());
  const auto datapath_of = [&](const std::string& node) {
    auto d = Network(node);
    EXPECT_TRUE(d.ok());
    return std::make_pair(d->document().datapath(), d->document().bridge());
  };
  EXPECT_EQ(datapath_of("gpu-02"), std::make_pair(kOvs, std::string("ovsbr0")));
  EXPECT_EQ(datapath_of("gpu-03"), std::make_pair(kLinux, std::string("br-pool")));
  EXPECT_EQ(datapath_of("gpu-04"), std::make_pair(kOvs, std::string("ovsbr0")));
  EXPECT_EQ(Network("gpu-04")->document().subnet(), "10.40.0.0/24");
  EXPECT_EQ(datapath_of("gpu-05"), std::make_pair(kLinux, std::string("gpuaasbr0")));
  // A region rule changed later leaves nodes that have reservations as they are.
  ASSERT_TRUE(SetSubnet("us-east-1", "", "", "10.20.0.0/24", {}, "", kLinux).ok());
  EXPECT_EQ(datapath_of("gpu-02"), std::make_pair(kOvs, std::string("ovsbr0")));
  EXPECT_EQ(Network("gpu-02")->document().version(), 1);
  // A node rule that stops choosing moves the node back to what it inherits, at once.
  auto inherit = SetSubnet("", "", "gpu-01", "10.100.0.0/24");
  ASSERT_TRUE(inherit.ok()) << inherit.error().ToString();
  EXPECT_EQ(inherit->document_version(), 4);
  EXPECT_EQ(datapath_of("gpu-01"), std::make_pair(kLinux, std::string("gpuaasbr0")));

  // Configured for OVS: a node no rule chooses for gets OVS and ipam.ovs_bridge.
  Restart({{"GPUAAS_IPAM_DATAPATH", "ovs"}, {"GPUAAS_IPAM_OVS_BRIDGE", "br-ovs"}});
  ASSERT_TRUE(Reserve("gpu-06", "s0").ok());
  EXPECT_EQ(datapath_of("gpu-06"), std::make_pair(kOvs, std::string("br-ovs")));
  EXPECT_EQ(datapath_of("gpu-05"), std::make_pair(kLinux, std::string("gpuaasbr0")))
      << "a node keeps the datapath it got with its first reservation";
}

TEST_F(IpamTest, NetworkDocumentIsVersionedAndAppliedOnlyOnAck) {
  auto none = Network("gpu-01");
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->document().version(), 0);
  EXPECT_EQ(none->applied_version(), 0);
  ASSERT_TRUE(Reserve("gpu-01", "gpu-a").ok());
  auto v1 = Network("gpu-01");
  ASSERT_TRUE(v1.ok());
  EXPECT_EQ(v1->document().version(), 1);
  EXPECT_EQ(v1->document().bridge(), "gpuaasbr0");
  EXPECT_EQ(v1->document().datapath(), gpuaas::v1::NETWORK_DATAPATH_LINUX_BRIDGE);
  EXPECT_EQ(v1->document().subnet(), "10.100.0.0/24");
  EXPECT_EQ(v1->document().gateway(), "10.100.0.1");
  EXPECT_TRUE(v1->document().nat().masquerade());
  EXPECT_TRUE(v1->document().nat().ip_forward());
  EXPECT_TRUE(v1->document().isolation().deny_cross_slice());
  ASSERT_EQ(v1->document().reservations_size(), 1);
  EXPECT_EQ(v1->applied_version(), 0) << "never applied before the agent says so";
  ASSERT_TRUE(Reserve("gpu-01", "gpu-a").ok());
  EXPECT_EQ(Network("gpu-01")->document().version(), 1) << "no change, no new version";
  ASSERT_TRUE(Reserve("gpu-01", "gpu-b").ok());
  auto v2 = Network("gpu-01");
  EXPECT_EQ(v2->document().version(), 2);
  EXPECT_EQ(v2->document().reservations_size(), 2);
  // Versions are immutable: version 1 still has one reservation.
  auto old = Network("gpu-01", 1);
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(old->document().reservations_size(), 1);
  EXPECT_EQ(old->latest_version(), 2);

  auto ack = Ack("gpu-01", 2, {"masquerade_missing"});
  ASSERT_TRUE(ack.ok()) << ack.error().ToString();
  EXPECT_EQ(ack->applied_version(), 2);
  auto seen = Network("gpu-01");
  EXPECT_EQ(seen->applied_version(), 2);
  ASSERT_EQ(seen->blockers_size(), 1);
  EXPECT_EQ(seen->blockers(0), "masquerade_missing");
  auto late = Ack("gpu-01", 1);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->applied_version(), 2) << "acks only move forward";
  EXPECT_EQ(late->blockers_size(), 1) << "a late ack does not clear the newer blockers";
  auto clean = Ack("gpu-01", 2);
  EXPECT_EQ(clean->blockers_size(), 0);

  auto ahead = Ack("gpu-01", 9);
  ASSERT_FALSE(ahead.ok());
  EXPECT_EQ(ahead.error().reason, "unknown_version");
  auto negative = Ack("gpu-01", -1);
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.error().reason, "invalid_version");
  auto blocker = Ack("gpu-01", 2, {"Not A Blocker"});
  ASSERT_FALSE(blocker.ok());
  EXPECT_EQ(blocker.error().reason, "invalid_blocker");
  auto missing = Network("gpu-01", 7);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Code::kNotFound);
  EXPECT_EQ(missing.error().reason, "document_version_not_found");
  auto bad = Network("GPU_01");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_node_id");
}

TEST_F(IpamTest, TheSliceNetworkFollowsTheNodesModeInTheDocument) {
  ASSERT_TRUE(Reserve("gpu-01", "gpu-a").ok());
  ASSERT_EQ(Network("gpu-01")->document().version(), 1);
  EXPECT_FALSE(Network("gpu-01")->document().removed());
  // Inventory's node event at each step of a mode change (generation, mode, open target).
  auto node_event = [&](int64_t gen, v1::CapacityProfile mode, v1::CapacityProfile target) {
    v1::NodeSnapshot snap;
    snap.mutable_node()->set_node_id("gpu-01");
    snap.mutable_node()->set_generation(gen);
    snap.mutable_node()->set_capacity_profile(mode);
    snap.mutable_node()->set_mode_target(target);
    const std::string subject = "gpuaas.v1.evt.inventory.node.updated";
    auto ev =
        outbox::MakeEvent({subject, "", "inventory/test", "gpu-01", gen, "gpu-01", "", &snap});
    Republish(subject, ev, ev.id());
  };
  auto latest = [&] { return Network("gpu-01")->document(); };
  // A mode change to baremetal opens: the slice network is to come off the host.
  node_event(5, v1::CAPACITY_PROFILE_SLICE_VM, v1::CAPACITY_PROFILE_BAREMETAL);
  ASSERT_TRUE(testing::WaitFor([&] { return latest().version() == 2; }));
  EXPECT_TRUE(latest().removed());
  EXPECT_EQ(latest().reservations_size(), 1) << "the slot keeps its MAC and IP";
  // It closes (baremetal, no target): nothing new to apply.
  node_event(6, v1::CAPACITY_PROFILE_BAREMETAL, v1::CAPACITY_PROFILE_UNSPECIFIED);
  // An older event (a redelivery of slice-vm) moves nothing back.
  node_event(4, v1::CAPACITY_PROFILE_SLICE_VM, v1::CAPACITY_PROFILE_UNSPECIFIED);
  // Back to slice-vm: the network is put back. Until then the version stays 2 (both events
  // above are consumed in order before this one).
  node_event(7, v1::CAPACITY_PROFILE_BAREMETAL, v1::CAPACITY_PROFILE_SLICE_VM);
  ASSERT_TRUE(testing::WaitFor([&] { return latest().version() >= 3; }));
  EXPECT_EQ(latest().version(), 3) << "the events of generations 6 and 4 wrote no version";
  EXPECT_FALSE(latest().removed());
  auto two = Network("gpu-01", 2);
  ASSERT_TRUE(two.ok());
  EXPECT_TRUE(two->document().removed()) << "versions are immutable";
}

TEST_F(IpamTest, AllocationEventsBindReservationsIdempotentlyAndInOrder) {
  for (const char* s : {"gpu-a", "gpu-b", "gpu-c", "gpu-d"}) ASSERT_TRUE(Reserve("gpu-01", s).ok());
  const auto before = Network("gpu-01")->document().version();
  const std::string alloc = ids::NewUuidV7();
  auto ev = PublishAllocation(alloc, "gpu-01", "provisioning", 3, {"gpu-b", "gpu-a"});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-a", alloc));
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-b", alloc));
  const auto bound = *Find("gpu-01", "gpu-a");
  EXPECT_TRUE(bound.has_bound_at());
  auto doc = Network("gpu-01");
  EXPECT_EQ(doc->document().version(), before + 1);
  for (const auto& r : doc->document().reservations()) {
    if (r.slot_key() == "gpu-a") {
      EXPECT_EQ(r.allocation_id(), alloc);
      EXPECT_EQ(r.hostname(), "slice-" + alloc.substr(0, 8)) << "the VM's vNIC is its first slot";
    }
    if (r.slot_key() == "gpu-b") {
      EXPECT_EQ(r.hostname(), "");
    }
  }
  // Bound reservations are not released from under a VM.
  auto rel = Release("gpu-01", "gpu-a");
  ASSERT_FALSE(rel.ok());
  EXPECT_EQ(rel.error().code, Code::kFailedPrecondition);
  EXPECT_EQ(rel.error().reason, "reservation_bound");
  auto re = Reprovision("gpu-01", "gpu-a");
  ASSERT_FALSE(re.ok());
  EXPECT_EQ(re.error().reason, "reservation_bound");

  // The same event delivered again, then active (already bound): nothing changes. A second
  // allocation bound afterwards tells when the consumer has got past them.
  Republish("gpuaas.v1.evt.scheduler.allocation.provisioning", ev, ev.id() + "-again");
  PublishAllocation(alloc, "gpu-01", "active", 4, {"gpu-a", "gpu-b"});
  const std::string other = ids::NewUuidV7();
  PublishAllocation(other, "gpu-01", "active", 2, {"gpu-c"});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-c", other));
  EXPECT_EQ(Find("gpu-01", "gpu-a")->generation(), bound.generation());
  EXPECT_EQ(Network("gpu-01")->document().version(), before + 2);

  // Released: unbound. A stale active (older generation) arriving afterwards does not rebind.
  PublishAllocation(alloc, "gpu-01", "released", 9, {});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-a", ""));
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-b", ""));
  PublishAllocation(alloc, "gpu-01", "active", 5, {"gpu-a", "gpu-b"});
  // Failed with live claims (cleanup pending) keeps the binding; failed with none frees it.
  PublishAllocation(other, "gpu-01", "failed", 3, {"gpu-c"});
  const std::string third = ids::NewUuidV7();
  PublishAllocation(third, "gpu-01", "provisioning", 1, {"gpu-d"});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-d", third));
  EXPECT_EQ(Find("gpu-01", "gpu-a")->allocation_id(), "") << "the stale event was ignored";
  EXPECT_EQ(Find("gpu-01", "gpu-c")->allocation_id(), other);
  PublishAllocation(other, "gpu-01", "failed", 4, {});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-c", ""));
  // A malformed allocation event is dead-lettered and consumption goes on.
  v1::Event junk = outbox::MakeEvent(
      {"gpuaas.v1.evt.scheduler.allocation.active", "", "scheduler/test", "x", 1, "", "", &bound});
  Republish("gpuaas.v1.evt.scheduler.allocation.active", junk, junk.id());
  PublishAllocation(third, "gpu-01", "released", 2, {});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-d", ""));
  EXPECT_TRUE(testing::WaitFor([&] { return Count("GPUAAS_DLQ", "gpuaas.v1.dlq.>") >= 1; }));
}

v1::LeaseObservation Obs(const v1::SlotReservation& r, const std::string& actual,
                         const std::string& state) {
  v1::LeaseObservation o;
  o.set_slot_key(r.slot_key());
  o.set_mac(r.mac());
  o.set_expected_ip(r.ip());
  o.set_actual_ip(actual);
  o.set_lease_state(enums::FromColumn<v1::LeaseState>(state));
  return o;
}

TEST_F(IpamTest, AgentVnicDriftIsTheBoundSlotsDriftUntilACleanReport) {
  for (const char* s : {"gpu-a", "gpu-b"}) {
    auto r = Reserve("gpu-01", s);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  const std::string alloc = ids::NewUuidV7();
  PublishAllocation(alloc, "gpu-01", "active", 4, {"gpu-a"});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-a", alloc));
  const auto a = *Find("gpu-01", "gpu-a");
  const int64_t bound_ms = TimeUtil::TimestampToMilliseconds(a.bound_at());
  const int64_t version = Network("gpu-01")->document().version();
  auto report = [&](int64_t at_ms) {
    auto r = LeaseReportOf("gpu-01", version, at_ms);
    *r.add_observations() = Obs(a, a.ip(), "bound");
    return r;
  };
  // The agent could not put gpu-a's tap back on the bridge; gpu-b (unbound) drifts too, but
  // nothing runs there: only the bound slot is degraded.
  auto r1 = report(bound_ms + 1000);
  for (const char* slot : {"gpu-a", "gpu-b"}) {
    auto* d = r1.add_vnic_drift();
    d->set_slot_key(slot);
    d->set_kind("vnic_detached");
  }
  PublishLeases(r1);
  ASSERT_TRUE(testing::WaitFor([&] { return Drift("gpu-01").size() == 1; }));
  const auto d = Drift("gpu-01")[0];
  EXPECT_EQ(d.slot_key(), "gpu-a");
  EXPECT_EQ(d.kind(), "ipam_vnic_drift");
  EXPECT_EQ(d.allocation_id(), alloc);
  EXPECT_NE(d.detail().find("vnic_detached"), std::string::npos) << d.detail();
  // Repaired: the next report has no vNIC drift.
  PublishLeases(report(bound_ms + 2000));
  ASSERT_TRUE(testing::WaitFor([&] { return Drift("gpu-01").empty(); }));
}

TEST_F(IpamTest, LeaseReportsBecomeDriftAndAreResolved) {
  Restart({{"GPUAAS_IPAM_LEASE_READINESS_TIMEOUT_MS", "60000"}});
  for (const char* s : {"gpu-a", "gpu-b", "gpu-c"}) {
    auto r = Reserve("gpu-01", s);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  const std::string alloc = ids::NewUuidV7();
  PublishAllocation(alloc, "gpu-01", "active", 4, {"gpu-a", "gpu-b"});
  ASSERT_TRUE(WaitAllocation("gpu-01", "gpu-b", alloc));
  const auto a = *Find("gpu-01", "gpu-a");
  const auto b = *Find("gpu-01", "gpu-b");
  const auto c = *Find("gpu-01", "gpu-c");
  const int64_t bound_ms = TimeUtil::TimestampToMilliseconds(a.bound_at());
  const int64_t version = Network("gpu-01")->document().version();
  auto report = [&](int64_t at_ms) { return LeaseReportOf("gpu-01", version, at_ms); };

  // 1. gpu-a (the VM's vNIC) has its lease; gpu-b's MAC leased another IP: drift.
  auto r1 = report(bound_ms + 1000);
  *r1.add_observations() = Obs(a, a.ip(), "bound");
  *r1.add_observations() = Obs(b, "10.100.0.99", "mismatch");
  *r1.add_observations() = Obs(c, "", "missing");
  r1.add_blockers("masquerade_missing");
  PublishLeases(r1);
  ASSERT_TRUE(testing::WaitFor([&] { return Drift("gpu-01").size() == 1; }));
  auto d1 = Drift("gpu-01")[0];
  EXPECT_EQ(d1.slot_key(), "gpu-b");
  EXPECT_EQ(d1.kind(), "ipam_lease_mismatch");
  EXPECT_EQ(d1.expected_ip(), b.ip());
  EXPECT_EQ(d1.actual_ip(), "10.100.0.99");
  EXPECT_EQ(d1.allocation_id(), alloc);
  auto leases = Leases("gpu-01");
  ASSERT_TRUE(leases.ok());
  ASSERT_EQ(leases->leases_size(), 3) << "the latest observation of every slot";
  EXPECT_EQ(leases->leases(0).observation().lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(leases->leases(1).observation().lease_state(), v1::LEASE_STATE_MISMATCH);
  EXPECT_EQ(leases->leases(2).observation().lease_state(), v1::LEASE_STATE_MISSING);
  ASSERT_EQ(leases->blockers_size(), 1);
  EXPECT_EQ(leases->document_version(), version);
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.drift.detected") == 1; }));

  // 2. An older report arriving late changes nothing.
  auto stale = report(bound_ms + 500);
  *stale.add_observations() = Obs(a, "10.100.0.98", "mismatch");
  PublishLeases(stale);
  // 3. Clean (gpu-b is the second slot of the VM: no lease expected): resolved.
  auto r3 = report(bound_ms + 2000);
  *r3.add_observations() = Obs(a, a.ip(), "bound");
  *r3.add_observations() = Obs(b, "", "missing");
  PublishLeases(r3);
  ASSERT_TRUE(testing::WaitFor([&] { return Drift("gpu-01").empty(); }));
  EXPECT_EQ(Drift("gpu-01", true).size(), 1u);
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.drift.resolved") == 1; }));
  EXPECT_EQ(Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.drift.detected"), 1u)
      << "the stale report opened nothing";

  // 4. The vNIC's lease disappears: drift only once the readiness timeout has passed; a lease
  // nobody reserved is drift at once.
  auto r4 = report(bound_ms + 30000);
  *r4.add_observations() = Obs(a, "", "missing");
  v1::LeaseObservation rogue;
  rogue.set_mac("52:54:00:de:ad:01");
  rogue.set_actual_ip("10.100.0.200");
  rogue.set_lease_state(v1::LEASE_STATE_UNEXPECTED);
  *r4.add_observations() = rogue;
  PublishLeases(r4);
  ASSERT_TRUE(testing::WaitFor([&] { return Drift("gpu-01").size() == 1; }));
  EXPECT_EQ(Drift("gpu-01")[0].kind(), "ipam_lease_unexpected");
  EXPECT_EQ(Drift("gpu-01")[0].slot_key(), "");
  auto r5 = report(bound_ms + 61000);
  *r5.add_observations() = Obs(a, "", "missing");
  PublishLeases(r5);
  ASSERT_TRUE(testing::WaitFor([&] {
    auto d = Drift("gpu-01");
    return d.size() == 1 && d[0].kind() == "ipam_lease_missing" && d[0].slot_key() == "gpu-a";
  }));
  // 5. A malformed report is dead-lettered; the allocation's release resolves what is left.
  auto bad = report(bound_ms + 62000);
  *bad.add_observations() = Obs(a, "10.100.0.300", "leased");
  PublishLeases(bad);
  PublishAllocation(alloc, "gpu-01", "released", 8, {});
  ASSERT_TRUE(testing::WaitFor([&] { return Drift("gpu-01").empty(); }));
  EXPECT_TRUE(testing::WaitFor([&] { return Count("GPUAAS_DLQ", "gpuaas.v1.dlq.>") >= 1; }));
  auto all = Drift("gpu-01", true);
  ASSERT_EQ(all.size(), 3u);
  for (const auto& d : all) EXPECT_TRUE(d.has_resolved_at()) << d.kind();
  auto bad_list = Leases("");
  ASSERT_FALSE(bad_list.ok());
  EXPECT_EQ(bad_list.error().reason, "invalid_node_id");
}

// Found by a fault probe: reserve handed out an address for a node inventory never heard of,
// and reprovision set a MAC the caller chose. Both are checked against ipam's projection of
// inventory now, and a MAC is only ever derived or taken from the pool.
TEST_F(IpamTest, UnknownNodesAndSlotsGetNoAddressAndCallersChooseNoMac) {
  auto ghost = ReserveUnchecked("ghost-01", "slot-0");
  ASSERT_FALSE(ghost.ok());
  EXPECT_EQ(ghost.error().code, Code::kFailedPrecondition) << ghost.error().ToString();
  EXPECT_EQ(ghost.error().reason, "node_unknown");
  EXPECT_TRUE(Reservations("ghost-01").empty());
  auto doc = Network("ghost-01");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->latest_version(), 0) << "no subnet, no document for an unknown node";

  // Inventory registers a node and approves a slot at once: ipam's projection may be a moment
  // behind, and reserve waits for it rather than refusing.
  PublishNode("gpu-new");
  auto fresh = ReserveUnchecked("gpu-new", "slot-0");
  ASSERT_TRUE(fresh.ok()) << fresh.error().ToString();
  EXPECT_TRUE(fresh->created());

  // Reprovision: the node and the slot must be inventory's.
  auto node = ReprovisionUnchecked("ghost-01", "slot-0");
  ASSERT_FALSE(node.ok());
  EXPECT_EQ(node.error().code, Code::kNotFound);
  EXPECT_EQ(node.error().reason, "node_unknown");
  auto slot = ReprovisionUnchecked("gpu-new", "slot-0");
  ASSERT_FALSE(slot.ok());
  EXPECT_EQ(slot.error().code, Code::kNotFound);
  EXPECT_EQ(slot.error().reason, "slot_unknown");
  EXPECT_EQ(Find("gpu-new", "slot-0")->mac(), fresh->reservation().mac());
  auto chosen = Reprovision("gpu-new", "slot-0", "52:54:0a:00:00:01");
  ASSERT_FALSE(chosen.ok());
  EXPECT_EQ(chosen.error().reason, "mac_not_allowed");
  auto derived = Reprovision("gpu-new", "slot-0");
  ASSERT_TRUE(derived.ok()) << derived.error().ToString();
  EXPECT_EQ(derived->reservation().mac(), DeterministicMac("gpu-new", "slot-0", 1));
}

TEST_F(IpamTest, OrphansAreListedAndRemovedWithAnEvent) {
  // Rows of a node inventory never registered, as reserve made them before it checked.
  {
    pqxx::connection c(dsn_);
    pqxx::work tx(c);
    tx.exec0(
        "INSERT INTO node_subnets (node_id, subnet, gateway) VALUES ('ghost-01', "
        "'10.100.0.0/24', '10.100.0.1')");
    tx.exec0(
        "INSERT INTO mac_assignments (node_id, slot_key, mac, source) VALUES "
        "('ghost-01', 'slot-0', '52:54:0a:00:00:01', 'admin')");
    tx.exec0(
        "INSERT INTO slot_reservations (node_id, slot_key, mac, ip) VALUES "
        "('ghost-01', 'slot-0', '52:54:0a:00:00:01', '10.100.0.10')");
    tx.commit();
  }
  // A known node: an announced slot, a slot inventory never announced (its approval failed
  // after the reservation), and an unannounced slot bound to an allocation.
  ASSERT_TRUE(Reserve("gpu-01", "known").ok());
  Know("gpu-01", "known");
  auto stray = Reserve("gpu-01", "stray");
  ASSERT_TRUE(stray.ok());
  ASSERT_TRUE(Reserve("gpu-01", "bound").ok());
  const std::string alloc = ids::NewUuidV7();
  PublishAllocation(alloc, "gpu-01", "active", 1, {"bound"});
  ASSERT_TRUE(WaitAllocation("gpu-01", "bound", alloc));

  auto list = [&](std::optional<int64_t> min_age) {
    v1::ListOrphansRequest req;
    if (min_age) req.set_min_age_seconds(*min_age);
    auto r = Call<v1::ListOrphansResponse>("gpuaas.v1.ipam.orphan.list", req);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    std::vector<std::string> out;
    if (!r.ok()) return out;
    for (const auto& o : r->orphans()) {
      out.push_back(o.node_id() + "/" + o.slot_key() + " " + enums::Text(o.reason()));
    }
    return out;
  };
  EXPECT_EQ(list(std::nullopt), std::vector<std::string>{"ghost-01/ node_unknown"})
      << "a young slot may be one inventory is approving right now";
  EXPECT_EQ(list(0),
            (std::vector<std::string>{"ghost-01/ node_unknown", "gpu-01/stray slot_unknown"}));

  v1::RemoveOrphansRequest bad;
  bad.set_node_id("Bad.Node");
  auto refused = Call<v1::RemoveOrphansResponse>("gpuaas.v1.ipam.orphan.remove", bad);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().reason, "invalid_orphan_request");

  v1::RemoveOrphansRequest req;
  req.set_min_age_seconds(0);
  req.set_reason("probe cleanup");
  auto removed = Call<v1::RemoveOrphansResponse>("gpuaas.v1.ipam.orphan.remove", req);
  ASSERT_TRUE(removed.ok()) << removed.error().ToString();
  ASSERT_EQ(removed->removed_size(), 2);
  EXPECT_EQ(removed->removed(0).node_id(), "ghost-01");
  EXPECT_EQ(removed->removed(0).subnet(), "10.100.0.0/24");
  EXPECT_EQ(removed->removed(0).reservations(), 1);
  EXPECT_EQ(removed->removed(1).slot_key(), "stray");
  EXPECT_EQ(removed->removed(1).mac(), stray->reservation().mac());
  EXPECT_EQ(removed->removed(1).ip(), stray->reservation().ip());

  EXPECT_TRUE(list(0).empty());
  EXPECT_TRUE(Reservations("ghost-01").empty());
  EXPECT_FALSE(Find("gpu-01", "stray"));
  EXPECT_TRUE(Find("gpu-01", "known"));
  EXPECT_EQ(Find("gpu-01", "bound")->allocation_id(), alloc) << "a bound slot is never removed";
  auto doc = Network("gpu-01");
  ASSERT_TRUE(doc.ok());
  EXPECT_EQ(doc->document().reservations_size(), 2) << "the node's document lost the stray";
  {
    pqxx::connection c(dsn_);
    pqxx::nontransaction tx(c);
    EXPECT_TRUE(
        tx.exec("SELECT 1 FROM mac_assignments WHERE node_id = 'ghost-01' OR slot_key = 'stray'")
            .empty())
        << "MAC rows are gone too";
  }
  // Audited: one event per orphan, and a second run finds nothing.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return Count("GPUAAS_EVT_IPAM", "gpuaas.v1.evt.ipam.orphan.removed") == 2; }));
  auto again = Call<v1::RemoveOrphansResponse>("gpuaas.v1.ipam.orphan.remove", req);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->removed_size(), 0);
}

}  // namespace
}  // namespace gpuaas::ipam
