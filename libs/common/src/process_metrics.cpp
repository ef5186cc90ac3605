#include "gpuaas/common/process_metrics.hpp"

#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "gpuaas/common/store.hpp"

#ifndef GPUAAS_BUILD_VERSION
#define GPUAAS_BUILD_VERSION "unknown"
#endif
#ifndef GPUAAS_BUILD_COMMIT
#define GPUAAS_BUILD_COMMIT "unknown"
#endif

namespace gpuaas::metrics {

const std::string& BuildVersion() {
  static const std::string v = GPUAAS_BUILD_VERSION;
  return v;
}

const std::string& BuildCommit() {
  static const std::string c = GPUAAS_BUILD_COMMIT;
  return c;
}

namespace {

double BootTimeSeconds() {
  std::ifstream in("/proc/stat");
  std::string key;
  double value = 0;
  while (in >> key) {
    if (key == "btime") {
      in >> value;
      return value;
    }
    in.ignore(std::numeric_limits<std::streamsize>::max(), '\n');
  }
  return 0;
}

// The families, looked up by name: the registry merges a second registration of the same family
// into the first, so these return what AddProcessMetrics registered.
prometheus::Counter& CpuCounter(prometheus::Registry& r) {
  return prometheus::BuildCounter()
      .Name("process_cpu_seconds_total")
      .Help("Total user and system CPU time spent in seconds")
      .Register(r)
      .Add({});
}

prometheus::Gauge& ProcessGauge(prometheus::Registry& r, const std::string& name) {
  static const std::map<std::string, std::string> kHelp = {
      {"process_resident_memory_bytes", "Resident memory size in bytes"},
      {"process_virtual_memory_bytes", "Virtual memory size in bytes"},
      {"process_open_fds", "Number of open file descriptors"},
      {"process_max_fds", "Maximum number of open file descriptors"},
      {"process_start_time_seconds", "Start time of the process since unix epoch in seconds"},
  };
  return prometheus::BuildGauge().Name(name).Help(kHelp.at(name)).Register(r).Add({});
}

std::mutex& RefreshMutex() {
  static std::mutex m;
  return m;
}

}  // namespace

ProcessStats ReadProcessStats() {
  ProcessStats s;
  static const double kTicks = static_cast<double>(sysconf(_SC_CLK_TCK));
  static const double kPage = static_cast<double>(sysconf(_SC_PAGESIZE));
  std::ifstream in("/proc/self/stat");
  std::string line;
  std::getline(in, line);
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
  // ')'. The fields after it start at field 3 (state).
  const auto close = line.rfind(')');
  if (close != std::string::npos) {
    std::istringstream rest(line.substr(close + 1));
    std::vector<std::string> f;
    f.reserve(48);
    for (std::string tok; rest >> tok;) f.push_back(tok);
    // Field n of proc(5) is f[n - 3].
    if (f.size() > 21) {
      s.cpu_seconds = (std::stod(f[11]) + std::stod(f[12])) / kTicks;  // utime, stime
      s.start_time_seconds = BootTimeSeconds() + std::stod(f[19]) / kTicks;
      s.virtual_bytes = std::stod(f[20]);
      s.resident_bytes = std::stod(f[21]) * kPage;
    }
  }
  std::error_code ec;
  int fds = 0;
  for (auto it = std::filesystem::directory_iterator("/proc/self/fd", ec);
       !ec && it != std::filesystem::directory_iterator(); it.increment(ec)) {
    ++fds;
  }
  s.open_fds = fds > 0 ? fds - 1 : 0;  // not counting the directory iterator's own descriptor
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) s.max_fds = static_cast<double>(lim.rlim_cur);
  return s;
}

void AddProcessMetrics(prometheus::Registry& registry, const std::string& service) {
  prometheus::BuildGauge()
      .Name("gpuaas_build_info")
      .Help("Always 1: the service and the version and commit its binary was built from")
      .Register(registry)
      .Add({{"service", service}, {"version", BuildVersion()}, {"commit", BuildCommit()}})
      .Set(1);
  RefreshProcessMetrics(registry);
}

void RefreshProcessMetrics(prometheus::Registry& registry) {
  const ProcessStats s = ReadProcessStats();
  std::lock_guard lock(RefreshMutex());
  auto& cpu = CpuCounter(registry);
  // A counter only goes up: add what was used since the last reading.
  if (s.cpu_seconds > cpu.Value()) cpu.Increment(s.cpu_seconds - cpu.Value());
  ProcessGauge(registry, "process_resident_memory_bytes").Set(s.resident_bytes);
  ProcessGauge(registry, "process_virtual_memory_bytes").Set(s.virtual_bytes);
  ProcessGauge(registry, "process_open_fds").Set(s.open_fds);
  ProcessGauge(registry, "process_max_fds").Set(s.max_fds);
  ProcessGauge(registry, "process_start_time_seconds").Set(s.start_time_seconds);
}

Sampler::Sampler(std::chrono::milliseconds interval, std::function<void()> sample)
    : interval_(interval), sample_(std::move(sample)) {
  thread_ = std::thread([this] {
    std::unique_lock lock(mu_);
    while (!stop_) {
      lock.unlock();
      sample_();
      lock.lock();
      cv_.wait_for(lock, interval_, [this] { return stop_; });
    }
  });
}

Sampler::~Sampler() { Stop(); }

void Sampler::Stop() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<Sampler> StartOutboxBacklog(std::shared_ptr<store::Pool> pool,
                                            const std::string& service,
                                            prometheus::Registry& registry, log::Logger logger,
                                            std::chrono::milliseconds interval) {
  auto* backlog = &prometheus::BuildGauge()
                       .Name("gpuaas_outbox_backlog")
                       .Help("Outbox rows not yet published to JetStream (sampled)")
                       .Register(registry)
                       .Add({{"service", service}});
  auto* oldest = &prometheus::BuildGauge()
                      .Name("gpuaas_outbox_oldest_unpublished_seconds")
                      .Help("Age of the oldest outbox row not yet published (0: none; sampled)")
                      .Register(registry)
                      .Add({{"service", service}});
  return std::make_shared<Sampler>(
      interval, [pool = std::move(pool), backlog, oldest, log = std::move(logger)] {
        // The partial index outbox_unpublished keeps this to the unpublished rows.
        auto r = store::WithTx(
            *pool,
            [](pqxx::work& tx) -> Result<std::pair<double, double>> {
              auto row = tx.exec1(
                  "SELECT count(*)::float8, COALESCE(extract(epoch from now() - min(created_at)), "
                  "0)::float8 FROM outbox WHERE published_at IS NULL");
              return std::make_pair(row[0].as<double>(), row[1].as<double>());
            },
            store::ReadSnapshot());
        if (!r.ok()) {
          log.Debug("outbox backlog not sampled", {{"error", r.error().ToString()}});
          return;
        }
        backlog->Set(r->first);
        oldest->Set(r->second);
      });
}

std::shared_ptr<Sampler> StartDatabaseRole(std::shared_ptr<store::Pool> pool,
                                           const std::string& service,
                                           prometheus::Registry& registry,
                                           std::chrono::milliseconds interval) {
  const prometheus::Labels labels{{"service", service}};
  auto* primary =
      &prometheus::BuildGauge()
           .Name("gpuaas_db_primary")
           .Help("1 while this service's database connections reach a read-write primary")
           .Register(registry)
           .Add(labels);
  auto* without = &prometheus::BuildGauge()
                       .Name("gpuaas_db_no_primary_seconds")
                       .Help("Seconds since this service last reached its primary (0: it does)")
                       .Register(registry)
                       .Add(labels);
  auto* reconnects = &prometheus::BuildCounter()
                          .Name("gpuaas_db_reconnects_total")
                          .Help("Database connections opened again after one was lost")
                          .Register(registry)
                          .Add(labels);
  auto sample = [pool = std::move(pool), primary, without, reconnects] {
    (void)pool->Ping();
    primary->Set(pool->primary() ? 1 : 0);
    without->Set(pool->SecondsWithoutPrimary());
    const double total = static_cast<double>(pool->reconnects());
    if (total > reconnects->Value()) reconnects->Increment(total - reconnects->Value());
  };
  return std::make_shared<Sampler>(interval, std::move(sample));
}

}  // namespace gpuaas::metrics
