// gpuaasctl ipam against the real ipam service (in-process, real NATS JetStream and PostgreSQL;
// labels nats pg): `ipam subnet --datapath/--bridge` stores the rule's datapath, the node's
// document then names it (`ipam network` prints "datapath ovs  bridge ovsbr0"), and a bad bridge
// is the service's INVALID_ARGUMENT invalid_bridge (exit 1) while a bad --datapath is a usage
// error (exit 2) that never reaches it.
#include <gtest/gtest.h>
#include <pqxx/pqxx>

#include <string>
#include <vector>

#include "ctl_harness.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

bool Has(const std::string& text, const std::string& want) {
  return text.find(want) != std::string::npos;
}

class IpamCtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dsn_ = testing::SharedPostgres().CreateDatabase("ipamctl");
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn_},
                                              {"GPUAAS_LOG_LEVEL", "error"}};
    for (const auto& [k, v] : nats_.Env("ipam")) env[k] = v;
    svc_ = std::make_unique<ipam::IpamService>(LoadConfig<ipam::IpamConfig>(env));
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

  // Inventory registers the node (ipam reserves only for nodes it projected), then reserves one
  // slot the way inventory does at approval.
  void ReserveOn(const std::string& node) {
    v1::NodeSnapshot snap;
    snap.mutable_node()->set_node_id(node);
    snap.mutable_node()->set_generation(1);
    const std::string subject = "gpuaas.v1.evt.inventory.node.registered";
    auto ev = outbox::MakeEvent({subject, "", "inventory/test", node, 1, node, "", &snap});
    ASSERT_TRUE(messaging::JsPublish(*conn_, subject, ev.SerializeAsString(), ev.id()).ok());
    ASSERT_TRUE(testing::WaitFor([&] {
      pqxx::connection c(dsn_);
      pqxx::nontransaction tx(c);
      return !tx.exec_params("SELECT 1 FROM inventory_nodes WHERE node_id = $1", node).empty();
    }));
    v1::ReserveSlotAddressRequest req;
    req.set_node_id(node);
    req.set_slot_key("gpu-0000:18:00.0");
    auto r = rpc::Client(conn_).Call<v1::ReserveSlotAddressResponse>(
        "gpuaas.v1.ipam.reservation.reserve", req, 10000ms);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }

  testing::TestNats nats_;
  std::string dsn_;
  std::unique_ptr<ipam::IpamService> svc_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(IpamCtlTest, SubnetDatapathAndBridgeReachTheNodesDocument) {
  ReserveOn("gpu-01");
  auto before = Ctl({"ipam", "network", "--node", "gpu-01"});
  ASSERT_EQ(before.rc, 0) << before.err;
  EXPECT_TRUE(Has(before.out, "datapath linux-bridge  bridge gpuaasbr0")) << before.out;

  auto set =
      Ctl({"ipam", "subnet", "--node", "gpu-01", "--subnet", "10.100.0.0/24", "--datapath", "ovs"});
  ASSERT_EQ(set.rc, 0) << set.err;
  EXPECT_TRUE(Has(set.out, "datapath ovs  bridge (default)")) << set.out;
  EXPECT_TRUE(Has(set.out, "node network document v2")) << set.out;
  auto after = Ctl({"ipam", "network", "--node", "gpu-01"});
  ASSERT_EQ(after.rc, 0) << after.err;
  EXPECT_TRUE(Has(after.out, "document v2")) << after.out;
  EXPECT_TRUE(Has(after.out, "datapath ovs  bridge ovsbr0")) << after.out;
  auto json = Ctl({"-o", "json", "ipam", "network", "--node", "gpu-01"});
  ASSERT_EQ(json.rc, 0) << json.err;
  EXPECT_TRUE(Has(json.out, "NETWORK_DATAPATH_OVS")) << json.out;

  auto named = Ctl({"ipam", "subnet", "--region", "us-east-1", "--subnet", "10.20.0.0/24",
                    "--datapath", "linux-bridge", "--bridge", "br-lab"});
  ASSERT_EQ(named.rc, 0) << named.err;
  EXPECT_TRUE(Has(named.out, "datapath linux-bridge  bridge br-lab")) << named.out;

  auto bad = Ctl({"ipam", "subnet", "--node", "gpu-01", "--subnet", "10.100.0.0/24", "--datapath",
                  "ovs", "--bridge", "not a bridge"});
  EXPECT_EQ(bad.rc, 1) << bad.out << bad.err;
  EXPECT_TRUE(Has(bad.err, "invalid_bridge")) << bad.err;
  auto usage = Ctl({"ipam", "subnet", "--node", "gpu-01", "--subnet", "10.100.0.0/24", "--datapath",
                    "linux_bridge"});
  EXPECT_EQ(usage.rc, 2) << usage.out << usage.err;
  EXPECT_TRUE(Has(Ctl({"ipam", "network", "--node", "gpu-01"}).out, "document v2"))
      << "refused requests changed nothing";
}

}  // namespace
}  // namespace gpuaas
