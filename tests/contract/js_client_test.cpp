// The contracts as an outsider uses them: tests/contract/js/client.mjs, a client written only from
// asyncapi/ and proto/ with the official NATS JavaScript client and protobufjs, runs as a tenant
// gateway (the tenant-api identity and a tenant token, docs/integrating.md) against the real
// services (ipam, inventory, the scheduler and a simulated node-agent on a fixture host, on real
// NATS + PostgreSQL). It lists the catalog with its availability, opens a durable pull consumer of
// the tenant's feed (GPUAAS_TENANT_FEED), places a gpu_slice allocation, follows it on that feed
// to ACTIVE, releases it, follows it to RELEASED and deletes its durable. SKIPs without node or
// without tests/contract/js/node_modules (scripts/install-deps).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

const fs::path kClientDir = fs::path(GPUAAS_SOURCE_DIR) / "tests" / "contract" / "js";

// The first executable `name` on PATH ("" if none).
std::string FindOnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "");
  std::string dir;
  while (std::getline(ss, dir, ':')) {
    if (dir.empty()) continue;
    const fs::path p = fs::path(dir) / name;
    if (::access(p.c_str(), X_OK) == 0) return p.string();
  }
  return "";
}

std::string Quote(const std::string& s) {
  std::string out = "'";
  for (char ch : s) out += ch == '\'' ? std::string("'\\''") : std::string(1, ch);
  return out + "'";
}

struct Outcome {
  int exit_code = -1;
  std::string output;
};

// Runs `command` through the shell in the client's directory; stdout and stderr together.
Outcome RunCommand(const std::string& command) {
  Outcome r;
  const std::string full = "cd " + Quote(kClientDir.string()) + " && " + command + " 2>&1";
  FILE* pipe = ::popen(full.c_str(), "r");
  if (pipe == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  if (status != -1 && WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

class ContractClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    node_ = FindOnPath("node");
    if (node_.empty()) GTEST_SKIP() << "node is not on PATH";
    for (const char* pkg : {"nats", "protobufjs"}) {
      if (!fs::exists(kClientDir / "node_modules" / pkg / "package.json")) {
        GTEST_SKIP() << (kClientDir / "node_modules").string() << " lacks " << pkg
                     << " (run scripts/install-deps)";
      }
    }
  }

  std::string node_;
  testing::Platform p_;
};

// The client's protobuf handling alone (no servers): the contracts load from proto/ and the
// messages it relies on round-trip with enums as names and oneofs as their case.
TEST_F(ContractClientTest, ProtosLoadAndRoundTrip) {
  const Outcome r = RunCommand(Quote(node_) + " selftest.mjs");
  std::cout << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr(" passed, 0 failed"));
}

TEST_F(ContractClientTest, IndependentClientPlacesFollowsAndReleasesASlice) {
  p_.Start();
  p_.StartApprovedAgent("js-node-1", "contract", 4);

  const std::string tenant = "contract-js-" + std::to_string(::getpid());
  std::string cmd = Quote(node_) + " client.mjs";
  cmd += " --nats " + Quote(p_.nats.url());
  // A tenant gateway and nothing more: the tenant-api identity (its nkey, its inbox, requests on
  // <subject>.tenant-api) with a tenant token for `tenant`; what it reads of JetStream is the
  // tenant feed only, through its own durable.
  const std::string token_file = testing::MakeTempDir("gpuaas-js") + "/token";
  std::ofstream(token_file) << p_.nats.Token("tenant", tenant, "tenant:" + tenant + "/js");
  cmd += " --seed-file " + Quote(p_.nats.SeedFile("tenant-api"));
  cmd += " --inbox-prefix _INBOX.tenant-api --client-role tenant-api";
  cmd += " --token-file " + Quote(token_file);
  cmd += " --region us-east-1 --pool contract --timeout-s 60";
  cmd += " --tenant " + Quote(tenant);
  cmd += " --proto-dir " + Quote((fs::path(GPUAAS_SOURCE_DIR) / "proto").string());
  const Outcome r = RunCommand(cmd);
  std::cout << r.output;
  const std::string feed = "gpuaas.v1.tenant." + tenant + ".evt.scheduler.allocation.";
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("step 0 setup: connected to "));
  EXPECT_THAT(r.output, HasSubstr("as client role tenant-api (inbox _INBOX.tenant-api)"));
  EXPECT_THAT(r.output, HasSubstr("step 1 catalog: "));
  EXPECT_THAT(r.output, HasSubstr("step 1 availability: "));
  EXPECT_THAT(r.output, HasSubstr("us-east-1:enabled"));
  EXPECT_THAT(r.output, HasSubstr("step 2 feed: stream GPUAAS_TENANT_FEED subjects=["));
  EXPECT_THAT(r.output, HasSubstr("filter=" + feed + "* deliver_policy=new ack_policy=explicit"));
  EXPECT_THAT(r.output, HasSubstr("step 2 create: "));
  EXPECT_THAT(r.output, HasSubstr("tenant=" + tenant + " "));
  EXPECT_THAT(r.output, HasSubstr("shape=CAPACITY_SHAPE_GPU_SLICE"));
  EXPECT_THAT(r.output, HasSubstr("step 3 event: "));
  EXPECT_THAT(r.output, HasSubstr("ALLOCATION_STATE_ACTIVE on " + feed + "active"));
  EXPECT_THAT(r.output, HasSubstr("ALLOCATION_STATE_PROVISIONING -> ALLOCATION_STATE_ACTIVE"));
  EXPECT_THAT(r.output, HasSubstr("step 4 release: "));
  EXPECT_THAT(r.output, HasSubstr("ALLOCATION_STATE_RELEASED on " + feed + "released"));
  EXPECT_THAT(r.output, HasSubstr("step 4 lifecycle: "));
  EXPECT_THAT(r.output, HasSubstr("-> ALLOCATION_STATE_RELEASED release_requested_by=tenant:" +
                                  tenant + "/js tenant=" + tenant + " roles=tenant"));
  EXPECT_THAT(r.output, HasSubstr("step 5 PASS"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("nats: the server refused")));

  // The platform agrees: the client's one allocation is released.
  v1::ListAllocationsRequest lr;
  lr.set_tenant(tenant);
  auto l = p_.Call<v1::ListAllocationsResponse>("gpuaas.v1.scheduler.allocation.list", lr);
  ASSERT_TRUE(l.ok()) << l.error().ToString();
  ASSERT_EQ(l->allocations_size(), 1);
  EXPECT_EQ(l->allocations(0).state(), v1::ALLOCATION_STATE_RELEASED)
      << l->allocations(0).DebugString();
}

}  // namespace
}  // namespace gpuaas
