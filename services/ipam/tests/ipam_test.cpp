// ipam in-process against real NATS JetStream and PostgreSQL.
#include <gtest/gtest.h>

#include <set>
#include <thread>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/ipam.pb.h"
#include "ipam_service.hpp"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::ipam {
namespace {

using namespace std::chrono_literals;

TEST(DeterministicMacTest, QemuLocalPrefixStableAndSpread) {
  const auto a = DeterministicMac("gpu-01", "gpu-0000:18:00.0", 0);
  EXPECT_EQ(a.rfind("52:54:00:", 0), 0u) << a;
  EXPECT_EQ(a.size(), 17u);
  EXPECT_EQ(a, DeterministicMac("gpu-01", "gpu-0000:18:00.0", 0));
  EXPECT_NE(a, DeterministicMac("gpu-02", "gpu-0000:18:00.0", 0));
  EXPECT_NE(a, DeterministicMac("gpu-01", "gpu-0000:18:00.0", 1));
}

class IpamTest : public ::testing::Test {
 protected:
  void SetUp() override { Start({}); }
  void Start(std::map<std::string, std::string> extra) {
    if (dsn_.empty()) dsn_ = testing::SharedPostgres().CreateDatabase("ipam");
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn_},
                                              {"GPUAAS_LOG_LEVEL", "warn"}};
    for (auto& [k, v] : extra) env[k] = v;
    svc_ = std::make_unique<IpamService>(LoadConfig<IpamConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    auto c = messaging::Connection::Connect({nats_.url(), "test", 2000, 100, false},
                                            log::Logger("test", "t", log::Level::kWarn));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
  }
  void TearDown() override { svc_->Shutdown(); }
  Result<v1::ReserveSlotAddressResponse> Reserve(const std::string& node, const std::string& slot) {
    v1::ReserveSlotAddressRequest req;
    req.set_node_id(node);
    req.set_slot_key(slot);
    return rpc::Client(conn_).Call<v1::ReserveSlotAddressResponse>(
        "gpuaas.v1.ipam.reservation.reserve", req, 5000ms);
  }

  testing::TestNats nats_;
  std::string dsn_;
  std::unique_ptr<IpamService> svc_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(IpamTest, ReserveIsIdempotentAndAnnouncedOnce) {
  auto a = Reserve("gpu-01", "gpu-0000:18:00.0");
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_TRUE(a->created());
  EXPECT_EQ(a->reservation().ip(), "10.100.0.10");
  EXPECT_EQ(a->reservation().gateway(), "10.100.0.1");
  EXPECT_EQ(a->reservation().subnet(), "10.100.0.0/24");
  auto again = Reserve("gpu-01", "gpu-0000:18:00.0");
  ASSERT_TRUE(again.ok());
  EXPECT_FALSE(again->created());
  EXPECT_EQ(again->reservation().mac(), a->reservation().mac());
  EXPECT_EQ(again->reservation().ip(), a->reservation().ip());
  ASSERT_TRUE(testing::WaitFor([&] {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_EVT_IPAM",
                                           "gpuaas.v1.evt.ipam.reservation.created");
    return n.ok() && *n == 1;
  }));
}

TEST_F(IpamTest, ConcurrentReservationsGetDistinctAddresses) {
  std::vector<std::thread> threads;
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
}

TEST_F(IpamTest, ExhaustedSubnetAndBadInputAreStructured) {
  svc_->Shutdown();
  Start({{"GPUAAS_IPAM_FIRST_HOST", "10"}, {"GPUAAS_IPAM_LAST_HOST", "11"}});
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
}

}  // namespace
}  // namespace gpuaas::ipam
