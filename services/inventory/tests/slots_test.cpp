// Inventory's slot domain in-process against real NATS JetStream and PostgreSQL, with a real
// ipam service answering the MAC/IP reservations asked at approval.
#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

#include <set>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/inventory/slot_rules.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/topology.pb.h"
#include "load_config.hpp"
#include "slot_store.hpp"
#include "test_env.hpp"

namespace gpuaas::inventory {
namespace {

using namespace std::chrono_literals;

// A two-GPU host: each GPU with its own raw NVMe and its own IB VF.
v1::TopologyReport Report(const std::string& node) {
  v1::TopologyReport r;
  r.set_node_id(node);
  r.set_hostname(node + ".lab");
  r.set_root("/fixture");
  auto* pf = r.add_fabric();
  pf->set_name("mlx5_0");
  pf->set_pci_address("0000:1a:00.0");
  pf->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
  pf->set_sriov_totalvfs(8);
  pf->set_sriov_numvfs(2);
  for (int i = 0; i < 2; ++i) {
    const std::string gpu = fmt::format("0000:{:02x}:00.0", 0x18 + i * 0x20);
    const std::string vf = fmt::format("0000:1a:00.{}", i + 1);
    const std::string disk = fmt::format("/dev/disk/by-id/nvme-eui.00000000000000{:02d}", i);
    auto* g = r.add_gpus();
    g->set_pci_address(gpu);
    g->set_vendor_id("0x10de");
    g->set_device_id("0x2335");
    g->set_model("H200 SXM 141GB");
    g->set_numa_node(i);
    auto* n = r.add_nvme();
    n->set_by_id_path(disk);
    n->set_kernel_name(fmt::format("nvme{}n1", i));
    n->set_size_bytes(3840755982336);
    pf->add_vf_pci_addresses(vf);
    auto* v = r.add_fabric();
    v->set_pci_address(vf);
    v->set_is_vf(true);
    v->set_pf_pci_address("0000:1a:00.0");
    v->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
    auto* c = r.add_candidates();
    c->set_slot_key("gpu-" + gpu);
    c->set_index(i);
    c->set_gpu_pci_address(gpu);
    c->set_numa_node(i);
    c->set_locality_group(fmt::format("numa{}/0000:15:01.0", i));
    c->set_nvme_by_id(disk);
    c->set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
    c->set_fabric_vf_pci_address(vf);
    c->set_fabric_pf_pci_address("0000:1a:00.0");
    c->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
    c->mutable_profile()->set_name("h200_24c_64g");
    c->mutable_profile()->set_vcpus_per_gpu(24);
    c->mutable_profile()->set_memory_mib_per_gpu(65536);
  }
  return r;
}

class SlotsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_LOG_LEVEL", "warn"}};
    env["GPUAAS_POSTGRES_DSN"] = testing::SharedPostgres().CreateDatabase("ipam");
    for (const auto& [k, v] : nats_.Env("ipam")) env[k] = v;
    ipam_ = std::make_unique<ipam::IpamService>(LoadConfig<ipam::IpamConfig>(env));
    auto ri = ipam_->Start();
    ASSERT_TRUE(ri.ok()) << ri.error().ToString();
    inv_dsn_ = testing::SharedPostgres().CreateDatabase("inv");
    env["GPUAAS_POSTGRES_DSN"] = inv_dsn_;
    for (const auto& [k, v] : nats_.Env("inventory")) env[k] = v;
    svc_ = std::make_unique<InventoryService>(LoadConfig<InventoryConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness),
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
  }
  void TearDown() override {
    if (svc_) svc_->Shutdown();
    if (ipam_) ipam_->Shutdown();
  }

  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return rpc::Client(conn_).Call<Resp>(subject, req, 10000ms);
  }
  void RegisterNode(const std::string& id, const std::string& region = "us-east-1") {
    v1::RegisterNodeRequest r;
    r.set_node_id(id);
    r.set_hostname(id + ".lab");
    r.set_region(region);
    r.set_pool("h200");
    r.set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
    auto res = Call<v1::RegisterNodeResponse>("gpuaas.v1.inventory.node.{node_id}.register", r);
    ASSERT_TRUE(res.ok()) << res.error().ToString();
  }
  // What a node-agent does after discovery: a TopologyReport event on its topology subject.
  void Report(const v1::TopologyReport& report) {
    const auto ev = outbox::MakeEvent({"gpuaas.v1.evt.node." + report.node_id() + ".topology", "",
                                       "node-agent/test", report.node_id(), 0, "", "", &report});
    ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.node." + report.node_id() + ".topology",
                                     ev.SerializeAsString(), ev.id())
                    .ok());
  }
  Result<v1::ShowNodeResponse> Show(const std::string& id) {
    v1::ShowNodeRequest r;
    r.set_node_id(id);
    return Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
  }
  // Waits until the node has snapshot `version`.
  void WaitSnapshot(const std::string& id, int64_t version) {
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          auto s = Show(id);
          return s.ok() && s->snapshot_version() >= version;
        },
        10s))
        << "snapshot " << version << " of " << id << " never arrived";
  }
  Result<v1::ApproveSlotsResponse> Approve(const std::string& id,
                                           const std::vector<std::string>& keys = {}) {
    v1::ApproveSlotsRequest r;
    r.set_node_id(id);
    for (const auto& k : keys) r.add_slot_keys(k);
    return Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", r);
  }
  // The newest slot snapshot event inventory published (each test has its own NATS server).
  Result<v1::SlotSnapshot> LastSlotEvent() {
    auto m = messaging::StreamLastMessage(*conn_, "GPUAAS_EVT_INVENTORY",
                                          "gpuaas.v1.evt.inventory.slot.updated");
    if (!m.ok()) return m.error();
    v1::Event ev;
    v1::SlotSnapshot snap;
    if (!ev.ParseFromString(m->data) || !ev.data().UnpackTo(&snap)) {
      return Error::Internal("bad_event", "not a slot snapshot");
    }
    return snap;
  }

  std::vector<v1::SlotReservation> Reservations(const std::string& node) {
    v1::ListReservationsRequest r;
    r.set_node_id(node);
    auto res = Call<v1::ListReservationsResponse>("gpuaas.v1.ipam.reservation.list", r);
    EXPECT_TRUE(res.ok());
    if (!res.ok()) return {};
    return {res->reservations().begin(), res->reservations().end()};
  }
  void Publish(const std::string& subject, const google::protobuf::Message& data,
               const std::string& entity, int64_t generation) {
    const auto ev = outbox::MakeEvent({subject, "", "test", entity, generation, "", "", &data});
    ASSERT_TRUE(messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id()).ok());
  }

  testing::TestNats nats_;
  std::string inv_dsn_;
  std::unique_ptr<ipam::IpamService> ipam_;
  std::unique_ptr<InventoryService> svc_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(SlotsTest, ReportedCandidatesAreApprovedWithAddressesAndAnnounced) {
  RegisterNode("gpu-01");
  Report(gpuaas::inventory::Report("gpu-01"));
  WaitSnapshot("gpu-01", 1);
  auto show = Show("gpu-01");
  ASSERT_TRUE(show.ok());
  ASSERT_EQ(show->topology().candidates_size(), 2);
  EXPECT_EQ(show->slots_size(), 0) << "candidates are advisory until approved";

  auto a = Approve("gpu-01");
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  ASSERT_EQ(a->results_size(), 2);
  std::set<std::string> macs, ips;
  for (const auto& r : a->results()) {
    EXPECT_TRUE(r.approved()) << r.slot_key() << ": " << r.DebugString();
    EXPECT_EQ(r.slot().admin_state(), v1::SLOT_ADMIN_STATE_AVAILABLE);
    EXPECT_EQ(r.slot().health(), v1::SLOT_HEALTH_HEALTHY);
    EXPECT_EQ(r.slot().sku(), "h200-sxm");
    EXPECT_EQ(r.slot().mac().rfind("52:54:00:", 0), 0u) << r.slot().mac();
    EXPECT_EQ(r.slot().private_ip().rfind("10.100.0.", 0), 0u) << r.slot().private_ip();
    macs.insert(r.slot().mac());
    ips.insert(r.slot().private_ip());
  }
  EXPECT_EQ(macs.size(), 2u);
  EXPECT_EQ(ips.size(), 2u);
  EXPECT_EQ(a->desired_version(), 1);

  // Announced with generation and schedulable, and counted in availability (no PCI details).
  Result<v1::SlotSnapshot> ev = Error::NotFound("none", "none");
  ASSERT_TRUE(testing::WaitFor([&] {
    ev = LastSlotEvent();
    return ev.ok();
  }));
  EXPECT_TRUE(ev->schedulable());
  EXPECT_EQ(ev->region(), "us-east-1");
  EXPECT_GE(ev->slot().generation(), 1);
  auto av = Call<v1::ListAvailabilityResponse>("gpuaas.v1.inventory.availability.list",
                                               v1::ListAvailabilityRequest());
  ASSERT_TRUE(av.ok());
  ASSERT_EQ(av->availability_size(), 1);
  EXPECT_EQ(av->availability(0).schedulable_slots(), 2);
  EXPECT_EQ(av->availability(0).sku(), "h200-sxm");

  // Approving again changes nothing: same addresses, no new generation, same desired version.
  auto again = Approve("gpu-01");
  ASSERT_TRUE(again.ok());
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(again->results(i).slot().generation(), a->results(i).slot().generation());
    EXPECT_EQ(again->results(i).slot().mac(), a->results(i).slot().mac());
  }
  EXPECT_EQ(again->desired_version(), 1);
}

TEST_F(SlotsTest, UnsafeCandidatesStayDisabledWithTheirReasons) {
  RegisterNode("gpu-02");
  auto rep = gpuaas::inventory::Report("gpu-02");
  rep.mutable_nvme(0)->add_mountpoints("/data");  // slot 0: mounted disk
  rep.mutable_candidates(1)->set_fabric_claim_mode(
      v1::FABRIC_CLAIM_MODE_SHARED_PARENT);  // slot 1: no own VF
  rep.mutable_candidates(1)->clear_fabric_vf_pci_address();
  Report(rep);
  WaitSnapshot("gpu-02", 1);
  auto a = Approve("gpu-02");
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  ASSERT_EQ(a->results_size(), 2);
  EXPECT_FALSE(a->results(0).approved());
  EXPECT_EQ(a->results(0).rejections(0).reason(), "nvme_mounted");
  EXPECT_FALSE(a->results(1).approved());
  std::set<std::string> reasons;
  for (const auto& r : a->results(1).rejections()) reasons.insert(r.reason());
  EXPECT_TRUE(reasons.count("fabric_not_per_slot_vf"));
  auto show = Show("gpu-02");
  ASSERT_TRUE(show.ok());
  ASSERT_EQ(show->slots_size(), 2);
  for (const auto& s : show->slots()) {
    EXPECT_EQ(s.admin_state(), v1::SLOT_ADMIN_STATE_DISABLED) << s.slot_key();
    EXPECT_FALSE(s.rejections().empty());
  }
  EXPECT_EQ(show->desired_version(), 0) << "nothing approved, nothing desired";
  ASSERT_TRUE(testing::WaitFor([&] { return LastSlotEvent().ok(); }));
  EXPECT_FALSE(LastSlotEvent()->schedulable());

  // Unknown key, unknown node, no snapshot: each its own structured error.
  auto unknown_key = Approve("gpu-02", {"gpu-0000:ff:00.0"});
  ASSERT_TRUE(unknown_key.ok());
  EXPECT_EQ(unknown_key->results(0).rejections(0).reason(), "not_in_snapshot");
  auto unknown_node = Approve("gpu-99");
  ASSERT_FALSE(unknown_node.ok());
  EXPECT_EQ(unknown_node.error().reason, "node_not_found");
  RegisterNode("gpu-03");
  auto no_snap = Approve("gpu-03");
  ASSERT_FALSE(no_snap.ok());
  EXPECT_EQ(no_snap.error().reason, "no_topology_snapshot");
  auto bad = Approve("GPU 03");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_node_id");
}

TEST_F(SlotsTest, WipeProofAcceptsAFormerFilesystem) {
  RegisterNode("gpu-04");
  auto rep = gpuaas::inventory::Report("gpu-04");
  rep.mutable_nvme(0)->set_fs_type("ext4");
  Report(rep);
  WaitSnapshot("gpu-04", 1);
  const std::string key = rep.candidates(0).slot_key();
  auto a = Approve("gpu-04", {key});
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->results(0).rejections(0).reason(), "nvme_unexpected_filesystem");

  v1::RecordWipeProofRequest bad;
  bad.set_node_id("gpu-04");
  bad.set_nvme_by_id("nvme0n1");
  auto bad_r = Call<v1::RecordWipeProofResponse>("gpuaas.v1.inventory.disk.wipe_proof.record", bad);
  ASSERT_FALSE(bad_r.ok());
  EXPECT_EQ(bad_r.error().reason, "invalid_wipe_proof");
  EXPECT_EQ(bad_r.error().details.size(), 3u) << "path, method and evidence are all wrong";

  v1::RecordWipeProofRequest w;
  w.set_node_id("gpu-04");
  w.set_nvme_by_id(rep.nvme(0).by_id_path());
  w.set_method("blkdiscard");
  w.set_evidence("blkdiscard -f; wipefs shows no signature");
  ASSERT_TRUE(
      Call<v1::RecordWipeProofResponse>("gpuaas.v1.inventory.disk.wipe_proof.record", w).ok());
  auto b = Approve("gpu-04", {key});
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(b->results(0).approved()) << b->DebugString();
}

TEST_F(SlotsTest, DriftDegradesOnlyTheAffectedSlotUntilRepaired) {
  RegisterNode("gpu-05");
  auto rep = gpuaas::inventory::Report("gpu-05");
  Report(rep);
  WaitSnapshot("gpu-05", 1);
  ASSERT_TRUE(Approve("gpu-05").ok());

  // The second disk got mounted behind our back.
  auto drifted = rep;
  drifted.mutable_nvme(1)->add_mountpoints("/mnt/scratch");
  Report(drifted);
  WaitSnapshot("gpu-05", 2);
  auto show = Show("gpu-05");
  ASSERT_TRUE(show.ok());
  ASSERT_EQ(show->slots_size(), 2);
  const auto& s0 =
      show->slots(0).slot_key() == rep.candidates(0).slot_key() ? show->slots(0) : show->slots(1);
  const auto& s1 = &s0 == &show->slots(0) ? show->slots(1) : show->slots(0);
  EXPECT_EQ(s0.health(), v1::SLOT_HEALTH_HEALTHY);
  EXPECT_EQ(s1.health(), v1::SLOT_HEALTH_DEGRADED);
  ASSERT_EQ(s1.drift_size(), 1);
  EXPECT_EQ(s1.drift(0).kind(), "nvme_mounted");
  auto av = Call<v1::ListAvailabilityResponse>("gpuaas.v1.inventory.availability.list",
                                               v1::ListAvailabilityRequest());
  ASSERT_TRUE(av.ok());
  EXPECT_EQ(av->availability(0).schedulable_slots(), 1);

  // Repair while the disk is still mounted: rejected, still degraded.
  v1::RepairSlotRequest rr;
  rr.set_node_id("gpu-05");
  rr.set_slot_key(s1.slot_key());
  auto r1 = Call<v1::RepairSlotResponse>("gpuaas.v1.inventory.slot.repair", rr);
  ASSERT_TRUE(r1.ok()) << r1.error().ToString();
  EXPECT_FALSE(r1->result().approved());
  EXPECT_EQ(r1->result().rejections(0).reason(), "nvme_mounted");

  // Unmounted again and reported: repair clears the drift.
  Report(rep);
  WaitSnapshot("gpu-05", 3);
  auto r2 = Call<v1::RepairSlotResponse>("gpuaas.v1.inventory.slot.repair", rr);
  ASSERT_TRUE(r2.ok());
  EXPECT_TRUE(r2->result().approved());
  EXPECT_EQ(r2->result().slot().health(), v1::SLOT_HEALTH_HEALTHY);
  EXPECT_EQ(r2->result().slot().drift_size(), 0);

  rr.set_slot_key("gpu-0000:ee:00.0");
  auto r3 = Call<v1::RepairSlotResponse>("gpuaas.v1.inventory.slot.repair", rr);
  ASSERT_FALSE(r3.ok());
  EXPECT_EQ(r3.error().reason, "slot_not_found");
}

TEST_F(SlotsTest, NodeBlockersAndDisabledRegionsMakeSlotsUnschedulable) {
  RegisterNode("gpu-06", "eu-west-1");
  auto rep = gpuaas::inventory::Report("gpu-06");
  Report(rep);
  WaitSnapshot("gpu-06", 1);
  ASSERT_TRUE(Approve("gpu-06").ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    auto e = LastSlotEvent();
    return e.ok() && e->schedulable();
  }));

  // Missing NAT on the host: every slot is re-announced unschedulable, with the blocker.
  auto blocked = rep;
  blocked.add_node_blockers("nat_masquerade_missing");
  Report(blocked);
  ASSERT_TRUE(testing::WaitFor([&] {
    auto e = LastSlotEvent();
    return e.ok() && !e->schedulable() && e->node_blockers_size() == 1;
  }));
  auto show = Show("gpu-06");
  ASSERT_TRUE(show.ok());
  ASSERT_EQ(show->node_blockers_size(), 1);
  EXPECT_EQ(show->node_blockers(0), "nat_masquerade_missing");
  EXPECT_EQ(show->slots(0).health(), v1::SLOT_HEALTH_HEALTHY)
      << "node-wide evidence is not slot drift";

  Report(rep);  // fixed
  ASSERT_TRUE(testing::WaitFor([&] {
    auto e = LastSlotEvent();
    return e.ok() && e->schedulable();
  }));

  v1::SetRegionRequest off;
  off.set_name("eu-west-1");
  off.set_enabled(false);
  auto r = Call<v1::SetRegionResponse>("gpuaas.v1.inventory.region.set", off);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_FALSE(r->region().enabled());
  ASSERT_EQ(r->region().pools_size(), 1);
  ASSERT_TRUE(testing::WaitFor([&] {
    auto e = LastSlotEvent();
    return e.ok() && !e->region_enabled();
  }));
  auto after = LastSlotEvent();
  ASSERT_TRUE(after.ok());
  EXPECT_FALSE(after->schedulable());
  auto regions =
      Call<v1::ListRegionsResponse>("gpuaas.v1.inventory.region.list", v1::ListRegionsRequest());
  ASSERT_TRUE(regions.ok());
  ASSERT_EQ(regions->regions_size(), 1);
  EXPECT_EQ(regions->regions(0).name(), "eu-west-1");
  off.set_name("ap-south-1");  // unknown: created, in the requested state
  auto created = Call<v1::SetRegionResponse>("gpuaas.v1.inventory.region.set", off);
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  EXPECT_FALSE(created->region().enabled());
  off.set_name("Not A Region");
  auto bad = Call<v1::SetRegionResponse>("gpuaas.v1.inventory.region.set", off);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_region");
}

TEST_F(SlotsTest, DesiredSetIsVersionedAndAcked) {
  v1::GetDesiredSlotsRequest g;
  g.set_node_id("gpu-07");
  auto unknown =
      Call<v1::GetDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.get", g);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().code, Code::kNotFound);
  EXPECT_EQ(unknown.error().reason, "node_not_found");

  RegisterNode("gpu-07");
  auto rep = gpuaas::inventory::Report("gpu-07");
  Report(rep);
  WaitSnapshot("gpu-07", 1);
  auto empty =
      Call<v1::GetDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.get", g);
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->desired().version(), 0);

  ASSERT_TRUE(Approve("gpu-07").ok());
  auto v1s = Call<v1::GetDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.get", g);
  ASSERT_TRUE(v1s.ok());
  EXPECT_EQ(v1s->desired().version(), 1);
  EXPECT_EQ(v1s->desired().slots_size(), 2);

  v1::DisableSlotRequest dis;
  dis.set_node_id("gpu-07");
  dis.set_slot_key(rep.candidates(0).slot_key());
  dis.set_reason("fan failure");
  auto d = Call<v1::DisableSlotResponse>("gpuaas.v1.inventory.slot.disable", dis);
  ASSERT_TRUE(d.ok()) << d.error().ToString();
  EXPECT_EQ(d->slot().admin_state(), v1::SLOT_ADMIN_STATE_DISABLED);
  EXPECT_EQ(d->slot().disabled_reason(), "fan failure");
  EXPECT_EQ(d->desired_version(), 2);
  auto v2s = Call<v1::GetDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.get", g);
  ASSERT_TRUE(v2s.ok());
  EXPECT_EQ(v2s->desired().slots_size(), 1);

  v1::AckDesiredSlotsRequest ack;
  ack.set_node_id("gpu-07");
  ack.set_version(3);
  auto too_new =
      Call<v1::AckDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.ack", ack);
  ASSERT_FALSE(too_new.ok());
  EXPECT_EQ(too_new.error().reason, "unknown_version");
  ack.set_version(2);
  auto ok =
      Call<v1::AckDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.ack", ack);
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(ok->applied_version(), 2);
  ack.set_version(1);  // a late ack of an older version does not move backwards
  auto late =
      Call<v1::AckDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.ack", ack);
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->applied_version(), 2);
  auto show = Show("gpu-07");
  ASSERT_TRUE(show.ok());
  EXPECT_EQ(show->desired_version(), 2);
  EXPECT_EQ(show->applied_version(), 2);
}

TEST_F(SlotsTest, DiscoverSendsATypedTaskAndRecordsItsResult) {
  RegisterNode("gpu-08");
  v1::DiscoverNodeRequest req;
  req.set_node_id("gpu-08");
  auto r = Call<v1::DiscoverNodeResponse>("gpuaas.v1.inventory.node.discover", req);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  // The task is on the node's task subject (through the outbox).
  Result<messaging::Message> m = Error::NotFound("x", "x");
  ASSERT_TRUE(testing::WaitFor([&] {
    m = messaging::StreamLastMessage(*conn_, "GPUAAS_NODE_TASKS", "gpuaas.v1.node.gpu-08.task");
    return m.ok();
  }));
  v1::Event ev;
  v1::NodeTask task;
  ASSERT_TRUE(ev.ParseFromString(m->data));
  ASSERT_TRUE(ev.data().UnpackTo(&task));
  EXPECT_EQ(task.task_id(), r->task_id());
  EXPECT_EQ(task.type(), v1::TASK_TYPE_TOPOLOGY_DISCOVER);
  EXPECT_TRUE(task.has_deadline());

  v1::NodeTaskResult res;
  res.set_task_id(task.task_id());
  res.set_node_id("gpu-08");
  res.set_type(task.type());
  res.set_status(v1::TASK_STATUS_SUCCEEDED);
  const auto out = outbox::MakeEvent({"gpuaas.v1.evt.node.gpu-08.task.succeeded", "",
                                      "node-agent/test", "gpu-08", 0, "", "", &res});
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.node.gpu-08.task.succeeded",
                                   out.SerializeAsString(), out.id())
                  .ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    auto s = Show("gpu-08");
    return s.ok() && s->recent_tasks_size() == 1 &&
           s->recent_tasks(0).status() == v1::TASK_STATUS_SUCCEEDED;
  }));

  req.set_node_id("gpu-77");
  auto unknown = Call<v1::DiscoverNodeResponse>("gpuaas.v1.inventory.node.discover", req);
  ASSERT_FALSE(unknown.ok());
  EXPECT_EQ(unknown.error().reason, "node_not_found");
}

TEST_F(SlotsTest, ConcurrentApprovalsNeverGiveOneVfToTwoSlots) {
  RegisterNode("gpu-09");
  auto rep = gpuaas::inventory::Report("gpu-09");
  // Both candidates point at the same VF: only one may get it.
  rep.mutable_candidates(1)->set_fabric_vf_pci_address(rep.candidates(0).fabric_vf_pci_address());
  Report(rep);
  WaitSnapshot("gpu-09", 1);
  std::vector<std::thread> threads;
  threads.reserve(6);
  std::atomic<int> approved{0};
  for (int i = 0; i < 6; ++i) {
    threads.emplace_back([&, i] {
      auto a = Approve("gpu-09", {rep.candidates(i % 2).slot_key()});
      if (a.ok() && a->results(0).approved()) approved++;
    });
  }
  for (auto& t : threads) t.join();
  auto show = Show("gpu-09");
  ASSERT_TRUE(show.ok());
  int available = 0;
  for (const auto& s : show->slots()) {
    available += s.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE;
  }
  EXPECT_EQ(available, 1);
  EXPECT_GE(approved.load(), 1);
}

TEST_F(SlotsTest, AnOlderReportArrivingLateDoesNotBecomeTheLatestSnapshot) {
  RegisterNode("gpu-10");
  auto newer = gpuaas::inventory::Report("gpu-10");
  *newer.mutable_discovered_at() = google::protobuf::util::TimeUtil::SecondsToTimestamp(2000000000);
  Report(newer);
  WaitSnapshot("gpu-10", 1);
  auto older = newer;
  *older.mutable_discovered_at() = google::protobuf::util::TimeUtil::SecondsToTimestamp(1900000000);
  older.add_node_blockers("nat_masquerade_missing");
  Report(older);
  auto again = newer;
  *again.mutable_discovered_at() = google::protobuf::util::TimeUtil::SecondsToTimestamp(2000000100);
  Report(again);
  WaitSnapshot("gpu-10", 2);
  auto show = Show("gpu-10");
  ASSERT_TRUE(show.ok());
  EXPECT_EQ(show->snapshot_version(), 2) << "the late, older report was not stored";
  EXPECT_TRUE(show->node_blockers().empty());
}

}  // namespace
}  // namespace gpuaas::inventory

namespace gpuaas::inventory {
namespace {

// The approval reserved an address (phase 2) and then rejected the slot (phase 3 saw newer
// evidence): the reservation goes back to ipam instead of staying orphaned.
TEST_F(SlotsTest, ARejectedApprovalReleasesTheAddressItReserved) {
  RegisterNode("gpu-01");
  Report(gpuaas::inventory::Report("gpu-01"));
  WaitSnapshot("gpu-01", 1);
  const std::string key = "gpu-0000:18:00.0";
  // Hold the node row that phase 3 locks, so the evidence can change between the phases.
  pqxx::connection c(inv_dsn_);
  pqxx::work hold(c);
  hold.exec_params("SELECT 1 FROM nodes WHERE node_id = $1 FOR UPDATE", "gpu-01");
  Result<v1::ApproveSlotsResponse> res = Error::Internal("x", "unset");
  std::thread approve([&] { res = Approve("gpu-01", {key}); });
  ASSERT_TRUE(testing::WaitFor([&] { return Reservations("gpu-01").size() == 1; }));
  hold.exec_params(
      "UPDATE topology_snapshots SET report = jsonb_set(report, '{nvme,0,mountpoints}', "
      "'[\"/mnt/scratch\"]') WHERE node_id = $1",
      "gpu-01");
  hold.commit();
  approve.join();
  ASSERT_TRUE(res.ok()) << res.error().ToString();
  ASSERT_EQ(res->results_size(), 1);
  EXPECT_FALSE(res->results(0).approved());
  EXPECT_EQ(res->results(0).rejections(0).reason(), reason::kNvmeMounted);
  EXPECT_EQ(res->results(0).slot().admin_state(), v1::SLOT_ADMIN_STATE_DISABLED);
  EXPECT_TRUE(Reservations("gpu-01").empty()) << "the reservation was released";
  ASSERT_TRUE(testing::WaitFor([&] {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_IPAM",
                                           "gpuaas.v1.evt.ipam.reservation.released");
    return n.ok() && *n == 1;
  }));
  // Approving the other slot still works and keeps its address.
  auto ok = Approve("gpu-01", {"gpu-0000:38:00.0"});
  ASSERT_TRUE(ok.ok());
  EXPECT_TRUE(ok->results(0).approved());
  EXPECT_EQ(Reservations("gpu-01").size(), 1u);
}

// ipam sees a bound slot's lease go wrong (its drift event) and later clean again: inventory
// degrades exactly that slot with the reason, then restores it.
TEST_F(SlotsTest, IpamDriftDegradesTheSlotUntilAReportIsClean) {
  RegisterNode("gpu-01");
  Report(gpuaas::inventory::Report("gpu-01"));
  WaitSnapshot("gpu-01", 1);
  ASSERT_TRUE(Approve("gpu-01").ok());
  const auto res = Reservations("gpu-01");
  ASSERT_EQ(res.size(), 2u);
  const std::string alloc = ids::NewUuidV7();
  v1::AllocationSnapshot a;
  a.mutable_allocation()->set_allocation_id(alloc);
  a.mutable_allocation()->set_node_id("gpu-01");
  a.mutable_allocation()->set_state(v1::ALLOCATION_STATE_ACTIVE);
  a.mutable_allocation()->add_slot_keys(res[0].slot_key());
  Publish("gpuaas.v1.evt.scheduler.allocation.active", a, alloc, 3);
  v1::LeaseReport lr;
  lr.set_node_id("gpu-01");
  auto* o = lr.add_observations();
  o->set_slot_key(res[0].slot_key());
  o->set_mac(res[0].mac());
  o->set_expected_ip(res[0].ip());
  o->set_actual_ip("10.100.0.77");
  o->set_lease_state(v1::LEASE_STATE_MISMATCH);
  // Published once the binding is in: ipam judges leases of bound slots only.
  ASSERT_TRUE(testing::WaitFor([&] { return !Reservations("gpu-01")[0].allocation_id().empty(); }));
  *lr.mutable_observed_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
  Publish("gpuaas.v1.evt.node.gpu-01.leases", lr, "gpu-01", 0);
  auto slot_of = [&](const std::string& key) {
    v1::Slot out;
    auto show = Show("gpu-01");
    if (show.ok()) {
      for (const auto& s : show->slots()) {
        if (s.slot_key() == key) out = s;
      }
    }
    return out;
  };
  ASSERT_TRUE(testing::WaitFor(
      [&] { return slot_of(res[0].slot_key()).health() == v1::SLOT_HEALTH_DEGRADED; }));
  const auto degraded = slot_of(res[0].slot_key());
  ASSERT_EQ(degraded.drift_size(), 1);
  EXPECT_EQ(degraded.drift(0).kind(), "ipam_lease_mismatch");
  EXPECT_NE(degraded.health_detail().find("ipam_lease_mismatch"), std::string::npos);
  EXPECT_NE(degraded.health_detail().find("10.100.0.77"), std::string::npos);
  EXPECT_EQ(slot_of(res[1].slot_key()).health(), v1::SLOT_HEALTH_HEALTHY)
      << "only the affected slot";
  // The degraded slot's event (relayed from the outbox after the commit Show already sees).
  EXPECT_TRUE(testing::WaitFor([&] {
    auto snap = LastSlotEvent();
    return snap.ok() && snap->slot().slot_key() == res[0].slot_key() &&
           snap->slot().health() == v1::SLOT_HEALTH_DEGRADED && !snap->schedulable();
  }));
  // A topology report without topology drift leaves the IPAM drift alone.
  Report(gpuaas::inventory::Report("gpu-01"));
  WaitSnapshot("gpu-01", 2);
  EXPECT_EQ(slot_of(res[0].slot_key()).drift_size(), 1);
  // Repair re-validates the topology; IPAM drift clears only with a clean lease report.
  v1::RepairSlotRequest rep;
  rep.set_node_id("gpu-01");
  rep.set_slot_key(res[0].slot_key());
  ASSERT_TRUE(Call<v1::RepairSlotResponse>("gpuaas.v1.inventory.slot.repair", rep).ok());
  EXPECT_EQ(slot_of(res[0].slot_key()).health(), v1::SLOT_HEALTH_DEGRADED);
  o->set_actual_ip(res[0].ip());
  o->set_lease_state(v1::LEASE_STATE_BOUND);
  *lr.mutable_observed_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
  Publish("gpuaas.v1.evt.node.gpu-01.leases", lr, "gpu-01", 0);
  ASSERT_TRUE(testing::WaitFor(
      [&] { return slot_of(res[0].slot_key()).health() == v1::SLOT_HEALTH_HEALTHY; }));
  EXPECT_EQ(slot_of(res[0].slot_key()).drift_size(), 0);
  EXPECT_EQ(slot_of(res[0].slot_key()).health_detail(), "");
}

// inventory.availability.list answers from counts the triggers keep (migration 0006): after
// approvals, disables, concurrent changes and nodes moving region and pool they equal what an
// aggregation of every slot says, and the read touches no slot and no node.
TEST_F(SlotsTest, AvailabilityCountsFollowEveryChangeWithoutReadingTheSlots) {
  const std::vector<std::pair<std::string, std::string>> nodes = {{"av-a1", "us-east-1"},
                                                                  {"av-a2", "us-east-1"},
                                                                  {"av-a3", "us-east-1"},
                                                                  {"av-b1", "eu-west-1"},
                                                                  {"av-b2", "eu-west-1"}};
  for (const auto& [id, region] : nodes) {
    RegisterNode(id, region);
    Report(gpuaas::inventory::Report(id));
  }
  for (const auto& [id, region] : nodes) WaitSnapshot(id, 1);
  pqxx::connection c(inv_dsn_);
  // The aggregation the service used to run on every call.
  // The aggregation the service used to run on every call, one line per group.
  const auto aggregated = [&](const std::string& region) {
    pqxx::work tx(c);
    std::vector<std::string> rows;
    for (const auto& r : tx.exec_params(
             "SELECT concat_ws(' ', n.region, n.pool, s.sku, s.gpu_model, "
             "count(*) FILTER (WHERE s.schedulable), "
             "count(*) FILTER (WHERE s.admin_state = 'available'), count(DISTINCT n.node_id)) "
             "FROM node_resource_slots s JOIN nodes n USING (node_id) WHERE ($1 = '' OR "
             "n.region = $1) GROUP BY n.region, n.pool, s.sku, s.gpu_model "
             "ORDER BY n.region, n.pool, s.sku, s.gpu_model",
             region)) {
      rows.push_back(r[0].as<std::string>());
    }
    return rows;
  };
  // What the service answers, in the same form.
  const auto listed = [&](const std::string& region) {
    v1::ListAvailabilityRequest r;
    r.set_region(region);
    auto l = Call<v1::ListAvailabilityResponse>("gpuaas.v1.inventory.availability.list", r);
    EXPECT_TRUE(l.ok()) << l.error().ToString();
    std::vector<std::string> rows;
    if (!l.ok()) return rows;
    for (const auto& a : l->availability()) {
      rows.push_back(fmt::format("{} {} {} {} {} {} {}", a.region(), a.pool(), a.sku(),
                                 a.gpu_model(), a.schedulable_slots(), a.approved_slots(),
                                 a.nodes()));
    }
    return rows;
  };
  const auto same = [&](const std::string& step) {
    for (const char* region : {"", "us-east-1", "eu-west-1"}) {
      EXPECT_EQ(listed(region), aggregated(region)) << step << ", region '" << region << "'";
    }
  };
  same("nothing approved");

  // Approvals, on several nodes at once; one node gets only one of its slots.
  {
    std::vector<std::thread> ts;
    ts.reserve(nodes.size());
    for (const auto& [id, region] : nodes) {
      ts.emplace_back([&, id = id] {
        auto a = id == "av-a2" ? Approve(id, {"gpu-0000:18:00.0"}) : Approve(id);
        EXPECT_TRUE(a.ok()) << id << ": " << a.error().ToString();
      });
    }
    for (auto& t : ts) t.join();
  }
  same("approved");
  auto all = Call<v1::ListAvailabilityResponse>("gpuaas.v1.inventory.availability.list",
                                                v1::ListAvailabilityRequest());
  ASSERT_TRUE(all.ok());
  ASSERT_EQ(all->availability_size(), 2) << all->DebugString();
  EXPECT_EQ(all->availability(0).region(), "eu-west-1");
  EXPECT_EQ(all->availability(0).schedulable_slots(), 4);
  EXPECT_EQ(all->availability(0).nodes(), 2);
  EXPECT_EQ(all->availability(1).approved_slots(), 5);
  EXPECT_EQ(all->availability(1).nodes(), 3);

  // A disable, while two nodes move: one to another region, one to another pool.
  {
    std::thread dis([&] {
      v1::DisableSlotRequest d;
      d.set_node_id("av-a1");
      d.set_slot_key("gpu-0000:38:00.0");
      auto r = Call<v1::DisableSlotResponse>("gpuaas.v1.inventory.slot.disable", d);
      EXPECT_TRUE(r.ok()) << r.error().ToString();
    });
    std::thread move([&] { RegisterNode("av-a3", "eu-west-1"); });
    std::thread pool([&] {
      v1::RegisterNodeRequest r;
      r.set_node_id("av-b2");
      r.set_hostname("av-b2.lab");
      r.set_region("eu-west-1");
      r.set_pool("h200-reserved");
      r.set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
      auto res = Call<v1::RegisterNodeResponse>("gpuaas.v1.inventory.node.{node_id}.register", r);
      EXPECT_TRUE(res.ok()) << res.error().ToString();
    });
    dis.join();
    move.join();
    pool.join();
  }
  same("disabled and moved");
  all = Call<v1::ListAvailabilityResponse>("gpuaas.v1.inventory.availability.list",
                                           v1::ListAvailabilityRequest());
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(all->availability_size(), 3) << all->DebugString();

  // The read sums counters: no slot and no node is read, however many there are (a connection
  // of its own: the statistics of its earlier transactions would show here until flushed).
  pqxx::connection fresh(inv_dsn_);
  pqxx::work tx(fresh);
  auto l = ListAvailability(tx, "");
  ASSERT_TRUE(l.ok()) << l.error().ToString();
  EXPECT_EQ(l->availability_size(), 3);
  // Both tables must be listed: an empty answer would pass the "nothing was read" check.
  const auto stats = tx.exec(
      "SELECT relname, coalesce(seq_scan, 0) + coalesce(idx_scan, 0) FROM "
      "pg_stat_xact_user_tables WHERE relname IN ('node_resource_slots', 'nodes')");
  EXPECT_EQ(stats.size(), 2u) << "pg_stat_xact_user_tables did not list both tables";
  for (const auto& r : stats) {
    EXPECT_EQ(r[1].as<int64_t>(), 0) << r[0].as<std::string>() << " was read";
  }
}

}  // namespace
}  // namespace gpuaas::inventory
