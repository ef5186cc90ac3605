// The contracts as an outsider uses them: tests/contract/js/client.mjs, a client written only from
// asyncapi/ and proto/ with the official NATS JavaScript client and protobufjs, runs as a tenant
// gateway (the tenant-api identity and a tenant token, docs/integrating.md) against the real
// services (ipam, inventory, the scheduler and a simulated node-agent on a fixture host, on real
// NATS + PostgreSQL). It lists the catalog with its availability, opens a durable pull consumer of
// the tenant's feed (GPUAAS_TENANT_FEED), places a gpu_slice allocation, follows it on that feed
// to ACTIVE, releases it, follows it to RELEASED and deletes its durable. tests/contract/js/
// attacker.mjs, with the same libraries, tries each path the platform must refuse (anonymous
// connect, another node's subjects and documents, a tenant gateway's bare and admin subjects,
// wrong-role, revoked, expired, forged and missing tokens, a create flood) and sees each refused
// by the NATS server or the service, beside a control the same identity may do. SKIPs without
// node or without tests/contract/js/node_modules (scripts/install-deps).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using namespace std::chrono_literals;

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

// An attacker with the same client libraries (attacker.mjs), holding node A's key, the tenant
// gateway's key and a handful of tokens, tries every path the platform must refuse: each is
// refused by the NATS server (authorization or permissions violation) or by the service (its
// Reply's code and reason), and beside each a control shows the same identity may do the
// legitimate thing.
TEST_F(ContractClientTest, AnAttackersEveryRefusedPathIsRefused) {
  p_.Start();
  p_.StartIngress();
  // console-gw serves token revocation (gpuaas.v1.console.token.revoke).
  p_.StartConsole();
  // Two enrolled nodes, their slots never approved: the flood's creates find no capacity.
  p_.StartAgent("atk-a", 1, "attack");
  p_.StartAgent("atk-b", 1, "attack");

  const std::string tenant = "attack-js-" + std::to_string(::getpid());
  const std::string dir = testing::MakeTempDir("gpuaas-attack");
  auto contents = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  auto token_file = [&](const std::string& name, const std::string& content) {
    std::string path = dir + "/" + name;
    std::ofstream(path) << content;
    return path;
  };
  // Tenant tokens the services must refuse: expired two hours ago (the platform's key), and
  // signed by a key no service knows.
  auth::Principal mallory;
  mallory.subject = "tenant:" + tenant + "/mallory";
  mallory.tenant = tenant;
  mallory.roles = {auth::kRoleTenant};
  const auto now = std::chrono::system_clock::now();
  const std::string platform_key = contents(access::TokenSigningKeyPath(p_.nats.keys_dir()));
  auto expired = auth::IssueToken(platform_key, mallory, 60s, now - 2h);
  ASSERT_TRUE(expired.ok()) << expired.error().ToString();
  auto other_key = auth::NewSigningKey();
  ASSERT_TRUE(other_key.ok()) << other_key.error().ToString();
  auto forged = auth::IssueToken(other_key->private_pem, mallory, 600s, now);
  ASSERT_TRUE(forged.ok()) << forged.error().ToString();

  // A leaked tenant token, good until an operator revokes it by its jti; the scheduler refuses
  // it before the script runs (so its check does not race the revocation).
  const std::string leaked =
      p_.nats.Token(auth::kRoleTenant, tenant, "tenant:" + tenant + "/leaked");
  auto leaked_principal = auth::VerifyToken(leaked, {contents(p_.nats.TokenPublicKeyFile())});
  ASSERT_TRUE(leaked_principal.ok()) << leaked_principal.error().ToString();
  auto leaky_options = p_.nats.Options("tenant-api");
  leaky_options.token = leaked;
  auto leaky = messaging::Connection::Connect(leaky_options,
                                              log::Logger("contract-js", "t", log::Level::kError));
  ASSERT_TRUE(leaky.ok()) << leaky.error().ToString();
  auto list_leaked = [&] {
    return rpc::Client(*leaky).Call<v1::ListAllocationsResponse>(
        "gpuaas.v1.scheduler.allocation.list", v1::ListAllocationsRequest(), 5s);
  };
  auto before = list_leaked();
  ASSERT_TRUE(before.ok()) << before.error().ToString();
  v1::RevokeTokenRequest revoke;
  revoke.set_jti(leaked_principal->token_id);
  revoke.set_reason("contract-js: leaked to an attacker");
  auto revoked = p_.Call<v1::RevokeTokenResponse>("gpuaas.v1.console.token.revoke", revoke);
  ASSERT_TRUE(revoked.ok()) << revoked.error().ToString();
  ASSERT_TRUE(testing::WaitFor([&] {
    auto r = list_leaked();
    return !r.ok() && r.error().Is(reason::kTokenRevoked);
  })) << "the scheduler never refused the revoked token";

  // What the attacker holds besides: a valid tenant token for `tenant`, a valid operator token.
  const std::string tenant_token =
      p_.nats.Token(auth::kRoleTenant, tenant, "tenant:" + tenant + "/attacker");
  const std::string operator_token = p_.nats.Token(auth::kRoleOperator, "", "user:attacker");
  std::string cmd = Quote(node_) + " attacker.mjs";
  cmd += " --nats " + Quote(p_.nats.url());
  cmd += " --proto-dir " + Quote((fs::path(GPUAAS_SOURCE_DIR) / "proto").string());
  cmd += " --node-a-seed " + Quote(p_.nats.SeedFile("node-agent", "atk-a"));
  cmd += " --node-a atk-a --node-b atk-b";
  cmd += " --tenant-seed " + Quote(p_.nats.SeedFile("tenant-api"));
  cmd += " --tenant " + Quote(tenant);
  cmd += " --tenant-token-file " + Quote(token_file("tenant.token", tenant_token));
  cmd += " --operator-token-file " + Quote(token_file("operator.token", operator_token));
  cmd += " --revoked-token-file " + Quote(token_file("revoked.token", leaked));
  cmd += " --expired-token-file " + Quote(token_file("expired.token", *expired));
  cmd += " --forged-token-file " + Quote(token_file("forged.token", *forged));
  // The tenant issuer's key (the tenant gateway's), claiming the operator role.
  cmd += " --tenant-issued-operator-token-file " +
         Quote(token_file("tenant-issued.token",
                          p_.nats.TenantIssuedToken("operator", "", "user:mallory")));
  cmd += " --timeout-s 90";
  const Outcome r = RunCommand(cmd);
  std::cout << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (const std::string line : {
           "attack 1 anonymous-connect: refused (server: AUTHORIZATION_VIOLATION",
           "control 1 node-a-key-connects: ok",
           "attack 2 node-a-reads-b-desired: refused (server: PERMISSIONS_VIOLATION",
           "attack 2 node-a-reads-b-network: refused (server: PERMISSIONS_VIOLATION",
           "attack 2 node-a-acks-b-exposures: refused (server: PERMISSIONS_VIOLATION",
           "control 2 node-a-reads-own-desired: ok",
           "control 2 node-a-reads-own-network: ok",
           "attack 3 node-a-acks-exposures-for-b: refused (",
           "attack 3 node-a-reads-desired-for-b: refused (",
           "control 3 node-a-reads-own-exposures: ok",
           "attack 4 tenant-api-bare-subject: refused (server: PERMISSIONS_VIOLATION",
           "attack 4 tenant-api-admin-subject: refused (server: PERMISSIONS_VIOLATION",
           "control 4 tenant-api-lists-allocations: ok",
           "attack 5 operator-token-on-tenant-api: refused (",
           "control 5 tenant-token-on-tenant-api: ok",
           "attack 6 revoked-token: refused (",
           "attack 6 expired-token: refused (",
           "attack 6 forged-token: refused (",
           "attack 6 tenant-issued-operator-token: refused (",
           "attack 6 no-token: refused (",
           "control 6 valid-token: ok",
           "control 7 first-create-let-through: ok",
           "attack 7 create-flood: refused (",
           "attacker PASS: 15 attacks refused",
       }) {
    EXPECT_THAT(r.output, HasSubstr(line));
  }
  // The services' words for the refusals, as the script printed them.
  EXPECT_THAT(r.output, HasSubstr("PERMISSION_DENIED node_id_mismatch"));
  EXPECT_THAT(r.output, HasSubstr("PERMISSION_DENIED token_role_not_allowed_for_connection"));
  for (const std::string why : {"token_revoked", "token_expired", "token_signature",
                                "token_issuer_role", "token_missing"}) {
    EXPECT_THAT(r.output, HasSubstr("UNAUTHENTICATED " + why));
  }
  EXPECT_THAT(r.output, HasSubstr("RESOURCE_EXHAUSTED rate_limited"));
  EXPECT_THAT(r.output, ::testing::Not(HasSubstr("NOT REFUSED")));
}

}  // namespace
}  // namespace gpuaas
