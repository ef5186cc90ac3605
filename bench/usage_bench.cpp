// P9: the usage ledger.
//   usage_bench [--allocations 20000] [--export-records 1000000]
//   P9 rebuild_events_per_s=<x> raw_consume_per_s=<y> ratio=<x/y>
//   P9 export_rows_per_s=<x> raw_read_rows_per_s=<y> ratio=<x/y> rss_mib=<m>
// Rebuild: `allocations` allocations' scheduler events (active, then releasing: 2 events each)
// are published to GPUAAS_EVT_SCHEDULER; a raw JetStream pull consumer reads them (no ack, no
// processing: the baseline), then a usage ledger started on an empty database consumes the
// stream until it wrote every record. Export: `export-records` records (distinct allocations,
// 100 tenants, 30 UTC days) are written straight into a ledger's table, then exported whole
// through gpuaas.v1.usage.record.export (CSV, pages of 10,000) against a plain read of the same
// rows in the same order from PostgreSQL (the baseline, after it); rss_mib is the process's peak
// resident set at the end of the export (the ledger runs in this process).
#include <fmt/format.h>
#include <pqxx/pqxx>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "bench_util.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/usage/usage_policy.hpp"
#include "gpuaas/usage/usage_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/usage.pb.h"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int64_t kDay0 = int64_t{1795737600} * 1000000;  // 2026-11-27T00:00:00Z
// The export's records lie 100 days later: the ledger started for the export also applies the
// rebuild's events from the stream (an empty ledger reads it from the start), all on kDay0.
constexpr int64_t kExportDay0 = kDay0 + 100 * usage::kDayUs;

double Seconds(Clock::time_point since) {
  return std::chrono::duration<double>(Clock::now() - since).count();
}

std::unique_ptr<usage::UsageService> StartLedger(testing::TestNats& nats, const std::string& dsn) {
  auto env = nats.Env("usage");
  env["GPUAAS_POSTGRES_DSN"] = dsn;
  env["GPUAAS_LOG_LEVEL"] = "error";
  auto cfg = bench::LoadConfig<usage::UsageConfig>(env);
  if (!cfg.ok()) {
    std::fprintf(stderr, "usage config: %s\n", cfg.error().ToString().c_str());
    return nullptr;
  }
  auto svc = std::make_unique<usage::UsageService>(*cfg);
  if (auto r = svc->Start(); !r.ok()) {
    std::fprintf(stderr, "usage: %s\n", r.error().ToString().c_str());
    return nullptr;
  }
  return svc;
}

int64_t CountRecords(const std::string& dsn) {
  pqxx::connection c(dsn);
  pqxx::nontransaction tx(c);
  return tx.exec1("SELECT count(*) FROM usage_records")[0].as<int64_t>();
}

// Publishes each allocation's active and releasing snapshots; returns the events published.
int64_t PublishAllocations(messaging::Connection& conn, int allocations) {
  jsCtx* js = conn.js();
  jsPubOptions po;
  jsPubOptions_Init(&po);
  int64_t n = 0;
  for (int i = 0; i < allocations; ++i) {
    v1::AllocationSnapshot snap;
    auto* a = snap.mutable_allocation();
    a->set_allocation_id(fmt::format("0193a6f0-0000-7000-8000-{:012d}", i));
    a->set_tenant(fmt::format("t{:03d}", i % 100));
    a->set_sku("h200-sxm-slice");
    a->set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
    a->set_gpu_count(1 + i % 8);
    a->set_region("us-east-1");
    a->set_node_id(fmt::format("n{:05d}", i % 5000));
    a->add_slot_keys("gpu-0000:18:00.0");
    const int64_t start = kDay0 + int64_t{i} * 1000000;
    for (auto [state, at] : {std::pair{v1::ALLOCATION_STATE_ACTIVE, start},
                             std::pair{v1::ALLOCATION_STATE_RELEASING, start + 3600000000}}) {
      a->set_state(state);
      a->set_generation(a->generation() + 1);
      *a->mutable_updated_at() = usage::Stamp(at);
      const std::string subject = "gpuaas.v1.evt.scheduler.allocation." + enums::Text(state);
      const auto ev = outbox::MakeEvent(
          {subject, "", "scheduler/bench", a->allocation_id(), a->generation(), "", "", &snap});
      const std::string bytes = ev.SerializeAsString();
      po.MsgId = ev.id().c_str();
      if (js_PublishAsync(js, subject.c_str(), bytes.data(), static_cast<int>(bytes.size()), &po) !=
          NATS_OK) {
        return -1;
      }
      ++n;
    }
  }
  jsPubOptions done;
  jsPubOptions_Init(&done);
  done.MaxWait = 120000;
  return js_PublishAsyncComplete(js, &done) == NATS_OK ? n : -1;
}

int RunRebuild(testing::TestNats& nats, testing::TestPostgres& pg,
               const std::shared_ptr<messaging::Connection>& conn, int allocations) {
  const int64_t events = PublishAllocations(*conn, allocations);
  if (events < 0) return 1;
  const double raw_per_s = bench::RawPullPerSecond(conn, messaging::SchedulerEventsStream().name,
                                                   "gpuaas.v1.evt.scheduler.allocation.>", events);
  if (raw_per_s == 0) return 1;
  const std::string dsn = pg.CreateDatabase("p9");
  const auto t = Clock::now();
  auto svc = StartLedger(nats, dsn);
  if (!svc) return 1;
  while (CountRecords(dsn) < allocations) {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (Seconds(t) > 1800) return 1;
  }
  const double rebuild_per_s = static_cast<double>(events) / Seconds(t);
  svc->Shutdown();
  std::printf("p9: %lld events of %d allocations into the ledger in %.1fs\n",
              static_cast<long long>(events), allocations, Seconds(t));
  std::printf("P9 rebuild_events_per_s=%.1f raw_consume_per_s=%.1f ratio=%.3f\n", rebuild_per_s,
              raw_per_s, raw_per_s > 0 ? rebuild_per_s / raw_per_s : 0.0);
  return 0;
}

// `n` records written straight into the ledger's table (COPY).
bool FillRecords(const std::string& dsn, int n) {
  pqxx::connection c(dsn);
  pqxx::work tx(c);
  pqxx::stream_to out(tx, "usage_records",
                      std::vector<std::string>{"record_id", "day", "tenant", "allocation_id", "sku",
                                               "kind", "counts_as", "units_micro", "record"});
  for (int i = 0; i < n; ++i) {
    v1::UsageRecord r;
    r.set_policy_version(usage::kPolicyVersion);
    r.set_kind(v1::USAGE_KIND_BILLABLE);
    r.set_allocation_id(fmt::format("0193a6f0-0000-7000-9000-{:012d}", i));
    r.set_tenant(fmt::format("t{:03d}", i % 100));
    const int64_t day = kExportDay0 + int64_t{i % 30} * usage::kDayUs;
    r.set_day(usage::DayText(day));
    r.set_record_id(r.allocation_id() + "/billable/" + r.day());
    r.set_sku("h200-sxm-slice");
    r.set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
    r.set_gpu_count(1 + i % 8);
    r.set_region("us-east-1");
    r.set_node_id(fmt::format("n{:05d}", i % 5000));
    r.add_slot_keys("gpu-0000:18:00.0");
    r.add_gpu_pci_addresses("0000:18:00.0");
    *r.mutable_start() = usage::Stamp(day + 3600000000);
    *r.mutable_end() = usage::Stamp(day + 7200000000);
    r.set_duration_us(3600000000);
    r.set_billable_unit("gpu_second");
    r.set_units_micro(r.gpu_count() * r.duration_us());
    r.set_stop(v1::USAGE_STOP_RELEASE_REQUESTED);
    r.add_event_ids("ev-a");
    r.add_event_ids("ev-b");
    std::string hex = "\\x";
    for (unsigned char ch : r.SerializeAsString()) hex += fmt::format("{:02x}", ch);
    out << std::make_tuple(r.record_id(), r.day(), r.tenant(), r.allocation_id(), r.sku(),
                           std::string("billable"), std::string("billable"),
                           std::to_string(r.units_micro()), hex);
  }
  out.complete();
  tx.commit();
  return true;
}

double PeakRssMib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

int RunExport(testing::TestNats& nats, testing::TestPostgres& pg,
              const std::shared_ptr<messaging::Connection>& conn, int records) {
  const std::string dsn = pg.CreateDatabase("p9x");
  auto svc = StartLedger(nats, dsn);
  if (!svc) return 1;
  const auto t_fill = Clock::now();
  if (!FillRecords(dsn, records)) return 1;
  std::printf("p9: %d records written in %.1fs\n", records, Seconds(t_fill));
  rpc::Client client(conn);
  v1::ExportUsageRequest req;
  *req.mutable_from() = usage::Stamp(kExportDay0);
  *req.mutable_to() = usage::Stamp(kExportDay0 + 30 * usage::kDayUs);
  req.set_page_size(10000);
  const auto t = Clock::now();
  int64_t rows = 0;
  size_t bytes = 0;
  do {
    auto page = client.Call<v1::ExportUsageResponse>("gpuaas.v1.usage.record.export", req,
                                                     std::chrono::seconds(60));
    if (!page.ok()) {
      std::fprintf(stderr, "export: %s\n", page.error().ToString().c_str());
      return 1;
    }
    if (req.page_token().empty() &&
        page->content().find("\nusage-policy/1,0193a6f0-0000-7000-9000-") == std::string::npos) {
      std::fprintf(stderr, "export: the first page is not the records written\n");
      return 1;
    }
    rows += page->records();
    bytes += page->content().size();
    req.set_page_token(page->next_page_token());
  } while (!req.page_token().empty());
  const double export_per_s = static_cast<double>(rows) / Seconds(t);
  const double rss_mib = PeakRssMib();  // before the baseline reads anything
  svc->Shutdown();
  // Baseline: the same rows in the same order, read from PostgreSQL in pages of the same size
  // (a cursor; no formatting, no transport), after the export.
  double raw_per_s = 0;
  {
    pqxx::connection c(dsn);
    pqxx::work tx(c);
    const auto t0 = Clock::now();
    tx.exec("DECLARE raw NO SCROLL CURSOR FOR SELECT record FROM usage_records WHERE day >= '" +
            usage::DayText(kExportDay0) + "' ORDER BY day, tenant, allocation_id, record_id");
    int64_t n = 0;
    size_t raw_bytes = 0;
    for (;;) {
      const auto page = tx.exec("FETCH 10000 FROM raw");
      if (page.empty()) break;
      for (const auto& row : page) raw_bytes += row[0].size();
      n += static_cast<int64_t>(page.size());
    }
    raw_per_s = static_cast<double>(n) / Seconds(t0);
    if (raw_bytes == 0 || n != records) {
      std::fprintf(stderr, "baseline: read %lld rows (%zu bytes), not %d\n",
                   static_cast<long long>(n), raw_bytes, records);
      return 1;
    }
  }
  if (rows != records) {
    std::fprintf(stderr, "export: %lld rows, not %d\n", static_cast<long long>(rows), records);
    return 1;
  }
  std::printf("p9: exported %lld records (%.1f MiB of CSV) in %.1fs\n",
              static_cast<long long>(rows), static_cast<double>(bytes) / 1048576.0, Seconds(t));
  std::printf("P9 export_rows_per_s=%.1f raw_read_rows_per_s=%.1f ratio=%.3f rss_mib=%.0f\n",
              export_per_s, raw_per_s, raw_per_s > 0 ? export_per_s / raw_per_s : 0.0, rss_mib);
  return 0;
}

}  // namespace
}  // namespace gpuaas

int main(int argc, char** argv) {
  using namespace gpuaas;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  int allocations = 20000, export_records = 1000000;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--allocations")) allocations = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--export-records")) export_records = std::atoi(argv[i + 1]);
  }
  log::Logger logger("bench", "usage", log::Level::kError);
  testing::TestNats nats;
  testing::TestPostgres pg(/*fsync=*/true);
  auto conn = messaging::Connection::Connect(nats.Options(testing::TestNats::kHarness), logger);
  if (!conn.ok()) return 1;
  if (allocations > 0 && RunRebuild(nats, pg, *conn, allocations) != 0) return 1;
  if (export_records > 0 && RunExport(nats, pg, *conn, export_records) != 0) return 1;
  return 0;
}
