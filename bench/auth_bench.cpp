// P7: what identity costs a request. On one authenticated nats-server (TestNats: generated
// authorization, per-role keys), a sequential request/reply round trip of
//   raw     a bare nats.c responder on a core subject (the baseline),
//   rpc     the rpc::Server on a subject only platform identities call (no token),
//   token   the rpc::Server on a client subject with the same request token every time (verified
//           once, then cached until it expires),
//   new     a new token every request (each one's first ES256 verification),
// reported as p50/p99 and the ratio of each to the raw round trip measured in the same run.
// P7b: what a permission change costs. nats-server 2.9 changes a user's permissions only by
// reloading the whole authorization config: with 0, 200 and 1,000 enrolled nodes (their users
// and subjects in the config), the time from rewriting the config and signalling a reload to a
// newly enrolled node's first accepted connection (TestNats::EnrollNode), 5 times each; the
// cost a per-session permission (a console relay's subjects) would add to every console open.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "test_env.hpp"

using namespace gpuaas;
using Clock = std::chrono::steady_clock;

namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

void Echo(natsConnection* nc, natsSubscription*, natsMsg* m, void*) {
  natsConnection_Publish(nc, natsMsg_GetReply(m), natsMsg_GetData(m), natsMsg_GetDataLength(m));
  natsMsg_Destroy(m);
}

// P7b (see the header): a reload with `enrolled` nodes in the config, against the raw round
// trip's p50 `base_ms`.
void MeasureReloads(testing::TestNats& nats, double base_ms) {
  int enrolled = 0;
  int probe = 0;
  for (const int target : {0, 200, 1000}) {
    for (; enrolled < target; ++enrolled) {
      (void)access::EnrollNode(nats.keys_dir(), "bulk-" + std::to_string(enrolled));
    }
    std::vector<double> ms;
    for (int i = 0; i < 5; ++i) {
      const auto t = Clock::now();
      nats.EnrollNode("probe-" + std::to_string(probe++));  // rewrite, reload, first connect
      ms.push_back(Ms(Clock::now() - t));
    }
    bench::Report(("permission change, " + std::to_string(target) + " nodes").c_str(), ms);
    std::printf("ratio p50 reload/raw-round-trip %.0f\n", bench::Percentile(ms, 0.5) / base_ms);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int n = argc > 1 ? std::atoi(argv[1]) : 3000;
  testing::TestNats nats;
  log::Logger logger("bench", "auth", log::Level::kError);
  auto server = nats.Connect(testing::TestNats::kHarness);
  auto client = nats.Connect(testing::TestNats::kHarness);

  // raw: a core responder.
  natsSubscription* raw = nullptr;
  natsConnection_Subscribe(&raw, server->raw(), "bench.raw", Echo, nullptr);
  (void)server->Flush(std::chrono::seconds(2));

  // rpc: the service runtime's server, with the platform's token key.
  rpc::ServerOptions so;
  {
    std::ifstream key(nats.TokenPublicKeyFile());
    so.token_public_keys.emplace_back(std::istreambuf_iterator<char>(key),
                                      std::istreambuf_iterator<char>());
  }
  rpc::Server rpc_server(server, "scheduler", "gpuaas.*.scheduler.>", logger, nullptr, so);
  rpc_server.Handle<v1::ListCatalogRequest, v1::ListCatalogResponse>(
      "gpuaas.v1.scheduler.catalog.list",
      [](const v1::ListCatalogRequest&, rpc::Context&) -> Result<v1::ListCatalogResponse> {
        return v1::ListCatalogResponse{};
      });
  rpc::Server inv_server(server, "inventory", "gpuaas.*.inventory.>", logger, nullptr, so);
  inv_server.Handle<v1::GetDesiredSlotsRequest, v1::GetDesiredSlotsResponse>(
      "gpuaas.v1.inventory.node.{node_id}.desired.ack",  // callers: node-agent only (no token)
      [](const v1::GetDesiredSlotsRequest&, rpc::Context&) -> Result<v1::GetDesiredSlotsResponse> {
        return v1::GetDesiredSlotsResponse{};
      });
  if (!rpc_server.Start().ok() || !inv_server.Start().ok()) return 1;

  auto run = [&](const char* name, const std::function<bool()>& once) {
    for (int i = 0; i < 200; ++i) once();  // warm up
    std::vector<double> ms;
    ms.reserve(n);
    for (int i = 0; i < n; ++i) {
      const auto t = Clock::now();
      if (!once()) {
        std::fprintf(stderr, "%s failed\n", name);
        return std::vector<double>{};
      }
      ms.push_back(Ms(Clock::now() - t));
    }
    bench::Report(name, ms);
    return ms;
  };
  auto base = run("raw", [&] {
    natsMsg* reply = nullptr;
    const bool ok =
        natsConnection_RequestString(&reply, client->raw(), "bench.raw", "x", 2000) == NATS_OK;
    if (reply) natsMsg_Destroy(reply);
    return ok;
  });
  rpc::Client plain(client);
  plain.WithToken("");
  v1::GetDesiredSlotsRequest desired;
  desired.set_node_id("bench-node");  // binds the address's {node_id}
  auto internal = run("rpc (no token)", [&] {
    return plain
        .Call<v1::GetDesiredSlotsResponse>("gpuaas.v1.inventory.node.{node_id}.desired.ack",
                                           desired)
        .ok();
  });
  rpc::Client tokened(client);
  tokened.WithToken(nats.Token("operator"));
  auto token = run("rpc + ES256 token", [&] {
    return tokened
        .Call<v1::ListCatalogResponse>("gpuaas.v1.scheduler.catalog.list", v1::ListCatalogRequest())
        .ok();
  });
  // A new token every request: the first verification of a token (not cached yet).
  std::vector<std::string> fresh;
  fresh.reserve(static_cast<size_t>(n) + 200);
  for (int i = 0; i < n + 200; ++i) {
    fresh.push_back(nats.Token("operator", "", "user:u" + std::to_string(i)));
  }
  size_t next = 0;
  auto first = run("rpc + new token", [&] {
    rpc::Client once(client);
    once.WithToken(fresh[next++ % fresh.size()]);
    return once
        .Call<v1::ListCatalogResponse>("gpuaas.v1.scheduler.catalog.list", v1::ListCatalogRequest())
        .ok();
  });
  const double b = bench::Percentile(base, 0.5);
  if (b <= 0 || internal.empty() || token.empty()) return 1;
  std::printf("ratio p50 rpc/raw %.2f  token/raw %.2f  new-token/raw %.2f\n",
              bench::Percentile(internal, 0.5) / b, bench::Percentile(token, 0.5) / b,
              first.empty() ? 0.0 : bench::Percentile(first, 0.5) / b);
  natsSubscription_Destroy(raw);
  rpc_server.Drain(std::chrono::seconds(1));
  inv_server.Drain(std::chrono::seconds(1));
  MeasureReloads(nats, b);
  return 0;
}
