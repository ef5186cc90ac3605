// P5: outbox lag (commit -> JetStream ack) against a raw JetStream synchronous publish, both
// measured in this run on the same nats-server and a PostgreSQL with fsync on.
//   outbox_bench [--events N]
// Last line: P5 outbox_lag_p99_ms=<x> raw_publish_p99_ms=<y> ratio=<x/y>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_util.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "test_env.hpp"

using namespace gpuaas;
using Clock = std::chrono::steady_clock;

using bench::Percentile;
using bench::Report;

int main(int argc, char** argv) {
  int events = 2000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--events") == 0) events = std::atoi(argv[i + 1]);
  }
  log::Logger logger("bench", "outbox", log::Level::kError);
  testing::TestNats nats;
  testing::TestPostgres pg(/*fsync=*/true);
  const std::string dsn = pg.CreateDatabase("bench");
  auto conn = messaging::Connection::Connect(nats.Options(testing::TestNats::kHarness), logger);
  if (!conn.ok()) return 1;
  if (!messaging::EnsureStream(**conn, {"BENCH", {"gpuaas.v1.evt.bench.>"}, 0, 600}).ok()) return 1;
  store::Pool pool({dsn, 2, 5000}, logger);
  if (!store::Migrate(pool, "common", store::CommonMigrations()).ok()) return 1;

  // Baseline: raw synchronous JetStream publishes of the same payload size.
  v1::NodeSnapshot data;
  data.mutable_node()->set_node_id("bench-node");
  data.mutable_node()->set_hostname("bench-node.example");
  data.mutable_node()->set_region("us-east-1");
  std::string payload(data.SerializeAsString());
  payload.resize(200, 'x');
  std::vector<double> raw;
  for (int i = 0; i < events + 100; ++i) {
    const auto t0 = Clock::now();
    auto r =
        messaging::JsPublish(**conn, "gpuaas.v1.evt.bench.raw", payload, fmt::format("raw-{}", i));
    if (!r.ok()) return 1;
    if (i >= 100) {
      raw.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
    }
  }

  // Outbox: commit an event, wait for the relay to get its JetStream ack, repeat.
  outbox::Relay relay(dsn, *conn, logger, nullptr);
  std::mutex mu;
  std::condition_variable cv;
  std::map<std::string, Clock::time_point> acked;
  relay.after_publish = [&](const std::string& id) {
    std::lock_guard lock(mu);
    acked[id] = Clock::now();
    cv.notify_all();
  };
  relay.Start();
  std::vector<double> lag;
  for (int i = 0; i < events + 100; ++i) {
    std::string id;
    auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
      auto e = outbox::Append(tx, {"gpuaas.v1.evt.bench.node.registered", "", "bench/1",
                                   "bench-node", i + 1, "", "", &data});
      if (!e.ok()) return e.error();
      id = *e;
      return Ok();
    });
    const auto committed = Clock::now();
    if (!r.ok()) return 1;
    std::unique_lock lock(mu);
    if (!cv.wait_for(lock, std::chrono::seconds(10), [&] { return acked.count(id) > 0; })) {
      std::fprintf(stderr, "event %s never acked\n", id.c_str());
      return 1;
    }
    if (i >= 100) {
      lag.push_back(std::chrono::duration<double, std::milli>(acked[id] - committed).count());
    }
  }
  relay.Stop();
  Report("raw_jetstream_publish", raw);
  Report("outbox_commit_to_ack", lag);
  const double x = Percentile(lag, 0.99);
  const double y = Percentile(raw, 0.99);
  std::printf("P5 outbox_lag_p99_ms=%.3f raw_publish_p99_ms=%.3f ratio=%.2f\n", x, y, x / y);
  return 0;
}
