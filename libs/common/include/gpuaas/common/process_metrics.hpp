#pragma once
// Metrics every service exposes besides its own: the standard process_* families (read from
// /proc/self at each scrape; prometheus-cpp has no process collector), gpuaas_build_info, and
// gpuaas_outbox_backlog / gpuaas_outbox_oldest_unpublished_seconds for a service with an outbox.
// docs/operations.md lists every metric, its labels and what it means.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "gpuaas/common/log.hpp"

// The prometheus-cpp types metrics code names, declared once (services' metrics headers include
// this header rather than prometheus-cpp's).
namespace prometheus {
class Registry;
class Counter;
class Gauge;
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace gpuaas::store {
class Pool;
}

namespace gpuaas::metrics {

// What the binary was built from (CMake at configure time: the project version and the short
// commit of the checkout, "unknown" outside a git checkout).
const std::string& BuildVersion();
const std::string& BuildCommit();

// Registers gpuaas_build_info{service,version,commit} = 1 and the process_* families in
// `registry`, with a first reading.
void AddProcessMetrics(prometheus::Registry& registry, const std::string& service);
// Reads /proc/self again into the families AddProcessMetrics registered (the /metrics handler
// calls it before serializing). Thread-safe.
void RefreshProcessMetrics(prometheus::Registry& registry);

// The process numbers, as read from /proc/self (exposed for tests).
struct ProcessStats {
  double cpu_seconds = 0;  // user + system
  double resident_bytes = 0;
  double virtual_bytes = 0;
  double open_fds = 0;
  double max_fds = 0;
  double start_time_seconds = 0;  // since the Unix epoch
};
ProcessStats ReadProcessStats();

// Runs `sample` on its own thread at once and then every `interval` until Stop() (or
// destruction). For gauges that come from a query: nothing blocks a scrape on the database.
class Sampler {
 public:
  Sampler(std::chrono::milliseconds interval, std::function<void()> sample);
  ~Sampler();
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;
  void Stop();

 private:
  std::chrono::milliseconds interval_;
  std::function<void()> sample_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

// gpuaas_outbox_backlog{service} (rows not yet published) and
// gpuaas_outbox_oldest_unpublished_seconds{service} of the outbox in `pool`'s database, every
// `interval`. Every replica reports the same numbers (one outbox per service database).
std::shared_ptr<Sampler> StartOutboxBacklog(
    std::shared_ptr<store::Pool> pool, const std::string& service, prometheus::Registry& registry,
    log::Logger logger, std::chrono::milliseconds interval = std::chrono::seconds(5));

// The database as this service sees it, every `interval` (a Pool::Ping, which the readiness
// check also runs): gpuaas_db_primary{service} (1 while a pooled connection reaches a read-write
// primary), gpuaas_db_no_primary_seconds{service} (how long it has not; 0 while it has) and
// gpuaas_db_reconnects_total{service} (connections opened again after one was lost: a restart,
// a failover).
std::shared_ptr<Sampler> StartDatabaseRole(
    std::shared_ptr<store::Pool> pool, const std::string& service, prometheus::Registry& registry,
    std::chrono::milliseconds interval = std::chrono::seconds(1));

}  // namespace gpuaas::metrics
