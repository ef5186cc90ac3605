#pragma once
// Scheduler test fixture: real NATS JetStream and PostgreSQL, a slot projection fed with
// inventory-shaped events, and several scheduler replicas sharing one database and queue group.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/allocations.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::scheduler {

using namespace std::chrono_literals;

class AllocationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dsn_ = testing::SharedPostgres().CreateDatabase("sched");
    for (int i = 0; i < replicas_wanted_; ++i) StartReplica();
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness),
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
    store::PoolOptions po;
    po.dsn = dsn_;
    pool_ = std::make_shared<store::Pool>(po, log::Logger("test", "t", log::Level::kWarn));
  }
  void TearDown() override {
    for (auto& r : replicas_) r->Shutdown();
  }
  void StartReplica() {
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn_},
                                              {"GPUAAS_LOG_LEVEL", "error"}};
    for (const auto& [k, v] : nats_.Env("scheduler")) env[k] = v;
    for (const auto& [k, v] : extra_env_) env[k] = v;
    replicas_.push_back(std::make_unique<SchedulerService>(LoadConfig<SchedulerConfig>(env)));
    auto r = replicas_.back()->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  void Publish(const std::string& subject, const google::protobuf::Message& data,
               const std::string& entity, int64_t generation) {
    const auto ev =
        outbox::MakeEvent({subject, "", "inventory/test", entity, generation, "", "", &data});
    ASSERT_TRUE(messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id()).ok());
  }
  // A node with `slots` approved slots: 2 NUMA nodes x 2 switches.
  void AddNode(const std::string& id, int slots, const std::string& region = "us-east-1",
               bool baremetal_profile = false, bool region_enabled = true,
               v1::FabricType fabric = v1::FABRIC_TYPE_INFINIBAND) {
    v1::NodeSnapshot n;
    n.mutable_node()->set_node_id(id);
    n.mutable_node()->set_hostname(id);
    n.mutable_node()->set_region(region);
    n.mutable_node()->set_pool("h200");
    n.mutable_node()->set_capacity_profile(baremetal_profile ? v1::CAPACITY_PROFILE_BAREMETAL
                                                             : v1::CAPACITY_PROFILE_SLICE_VM);
    n.mutable_node()->set_generation(1);
    Publish("gpuaas.v1.evt.inventory.node.registered", n, id, 1);
    ++nodes_published_;
    for (int i = 0; i < slots; ++i) {
      v1::SlotSnapshot s;
      auto* sl = s.mutable_slot();
      sl->set_node_id(id);
      sl->set_slot_key(fmt::format("gpu-0000:{:02x}:00.0", 0x18 + i));
      sl->set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
      sl->set_health(v1::SLOT_HEALTH_HEALTHY);
      sl->set_sku("h200-sxm");
      sl->set_numa_node(i / 4);
      sl->set_pcie_switch(fmt::format("sw{}", i / 2));
      sl->set_fabric_type(fabric);
      sl->set_gpu_pci_address(sl->slot_key().substr(4));
      sl->set_nvme_by_id(fmt::format("/dev/disk/by-id/nvme-eui.{}{:02x}", id, i));
      sl->set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
      sl->set_fabric_vf_pci_address(fmt::format("0000:{:02x}:00.1", 0x40 + i));
      sl->set_mac(fmt::format("52:54:00:aa:{:02x}:{:02x}", nodes_published_ % 256, i));
      sl->set_private_ip(fmt::format("10.100.0.{}", 10 + i));
      sl->mutable_profile()->set_name("h200_24c_64g");
      sl->mutable_profile()->set_vcpus_per_gpu(24);
      sl->mutable_profile()->set_memory_mib_per_gpu(65536);
      sl->set_generation(1);
      s.set_region(region);
      s.set_pool("h200");
      s.set_region_enabled(region_enabled);
      // As inventory says: slots are sold only on slice-vm nodes in enabled regions.
      s.set_schedulable(region_enabled && !baremetal_profile);
      Publish("gpuaas.v1.evt.inventory.slot.updated", s, id + "/" + sl->slot_key(), 1);
      ++slots_published_;
    }
  }
  // Every projected slot, page by page (what slot.list pages through).
  Result<std::vector<v1::ProjectedSlot>> ProjectedSlots(v1::ListProjectedSlotsRequest req = {}) {
    std::vector<v1::ProjectedSlot> out;
    req.set_page_size(1000);
    do {
      auto l = rpc::Client(conn_).Call<v1::ListProjectedSlotsResponse>(
          "gpuaas.v1.scheduler.slot.list", req, 5000ms);
      if (!l.ok()) return l.error();
      out.insert(out.end(), l->slots().begin(), l->slots().end());
      req.set_page_token(l->next_page_token());
    } while (!req.page_token().empty());
    return out;
  }
  void WaitProjected() {
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          auto l = ProjectedSlots();
          // Slices also need the node row (it is what baremetal placement locks).
          v1::ListProjectedNodesRequest nr;
          nr.set_page_size(1000);
          auto n = rpc::Client(conn_).Call<v1::ListProjectedNodesResponse>(
              "gpuaas.v1.scheduler.node.list", nr, 5000ms);
          return l.ok() && static_cast<int>(l->size()) == slots_published_ && n.ok() &&
                 n->nodes_size() == nodes_published_;
        },
        15s));
  }
  Result<v1::CreateAllocationResponse> Create(const std::string& request_id, int gpus,
                                              const std::string& sku = "h200-sxm-slice",
                                              const std::string& region = "us-east-1",
                                              v1::NetworkMode mode = v1::NETWORK_MODE_UNSPECIFIED) {
    v1::CreateAllocationRequest r;
    r.set_tenant("acme");
    r.set_request_id(request_id);
    r.set_sku(sku);
    r.set_gpu_count(gpus);
    r.set_region(region);
    r.set_network_mode(mode);
    return rpc::Client(conn_).Call<v1::CreateAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.create", r, 10000ms);
  }
  // `force`: the operator's force-release (its own subject; an operator token).
  Result<v1::ReleaseAllocationResponse> Release(const std::string& id, bool force = false) {
    if (force) {
      v1::ForceReleaseAllocationRequest r;
      r.set_allocation_id(id);
      r.set_reason("test force-release");
      return rpc::Client(conn_).Call<v1::ReleaseAllocationResponse>(
          "gpuaas.v1.scheduler.allocation.force_release", r, 10000ms);
    }
    v1::ReleaseAllocationRequest r;
    r.set_allocation_id(id);
    return rpc::Client(conn_).Call<v1::ReleaseAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.release", r, 10000ms);
  }
  std::vector<std::string> Invariants() {
    std::vector<std::string> out;
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
      out = CheckInvariants(tx);
      return Ok();
    });
    EXPECT_TRUE(r.ok());
    return out;
  }

  int replicas_wanted_ = 3;
  std::map<std::string, std::string> extra_env_;  // set before SetUp (constructor)
  testing::TestNats nats_;
  std::string dsn_;
  std::vector<std::unique_ptr<SchedulerService>> replicas_;
  std::shared_ptr<messaging::Connection> conn_;
  std::shared_ptr<store::Pool> pool_;
  int slots_published_ = 0;
  int nodes_published_ = 0;
};

}  // namespace gpuaas::scheduler
