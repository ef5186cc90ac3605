#pragma once
// gpuaasctl's tests: the built gpuaasctl (GPUAASCTL_BIN) run as an operator against a real
// nats-server, and a fixture serving a fake scheduler there for it to talk to.
#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "test_env.hpp"

namespace gpuaas::testing {

// gpuaasctl --nats <test server> args..., as an operator: its NATS key and a request token.
inline CommandResult RunCtl(const TestNats& nats, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {GPUAASCTL_BIN,
                                   "--nats",
                                   nats.url(),
                                   "--nats-seed-file",
                                   nats.SeedFile("operator"),
                                   "--token",
                                   nats.Token("operator")};
  argv.insert(argv.end(), args.begin(), args.end());
  return RunCommand(argv);
}

// A fake scheduler on a real nats-server: the subclass registers the operations its test needs
// on server_ in FakeScheduler(), then the server starts. Request tokens are checked with the
// test's token key, as the real scheduler does.
class FakeSchedulerCtlTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_ = log::Logger("test", "t1", log::Level::kWarn);
    conn_ = nats_.Connect(TestNats::kHarness);
    rpc::ServerOptions so;
    std::ifstream key(nats_.TokenPublicKeyFile());
    so.token_public_keys.emplace_back(std::istreambuf_iterator<char>(key),
                                      std::istreambuf_iterator<char>());
    server_ = std::make_unique<rpc::Server>(conn_, "scheduler", "gpuaas.*.scheduler.>", log_,
                                            nullptr, so);
    FakeScheduler();
    auto started = server_->Start();
    ASSERT_TRUE(started.ok()) << started.error().ToString();
  }
  // The handlers capture the subclass's members: stop serving before those are destroyed.
  void TearDown() override { server_.reset(); }

  virtual void FakeScheduler() = 0;

  CommandResult Ctl(const std::vector<std::string>& args) { return RunCtl(nats_, args); }

  TestNats nats_;
  log::Logger log_;
  std::shared_ptr<messaging::Connection> conn_;
  std::unique_ptr<rpc::Server> server_;
};

}  // namespace gpuaas::testing
