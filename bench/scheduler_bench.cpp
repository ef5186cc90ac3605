// P1 and P2 of the scheduler, on a real nats-server and a PostgreSQL with fsync on, against an
// in-process scheduler (NATS request/reply, real transactions), each with a baseline measured in
// the same run:
//   P1 placements_per_s=<x> pgbench_tps=<y> ratio=<x/y>
//       closed loop, --clients C creators (1/2/4/8-GPU mix, each force-releasing what it
//       created beyond 2 allocations; see `SchedulerBench::Release` for what that gives back)
//       vs pgbench TPC-B with the same client count on the same PostgreSQL.
//   P2 alloc_p99_ms=<x> nats_rtt_p99_ms=<r> fdatasync_ms=<f> ratio=<x/(r+f)>
//       one creator paced at 50% of the P1 rate vs a raw NATS request/reply round trip and one
//       8 KiB write+fdatasync on the same disk, both measured after the load (the old line).
//   P2-alongside alloc_p99_ms=<x> pgbench_insert_p99_ms=<a> nats_rtt_p99_ms=<b> ratio=<x/(a+b)>
//       the same creates vs baselines run alongside them, at their pace and client count
//       (class Alongside): a disk's commit stall lands on both sides.
//   P3 create_p99_<N>_ms=<x> create_p99_<M>_ms=<y> ratio=<x/y>
//       the P2 creator at the same pace on each fleet (through the service over NATS), largest
//       fleet over smallest: flat when the ratio is ~1.
//   index nodes=<n> full_load_ms=<t> catch_up_ms=<c> rss_mib=<r> index_heap_mib=<i>
//       the placement index of each fleet: a full read (what a restarted replica does), the
//       time for notifications of the fill to reach the running replica, this process's RSS
//       (scheduler, its index, the benchmark's clients) and the heap one index of the fleet
//       holds.
//   read list_page_p99_<N>_ms=<x> list_page_p99_<M>_ms=<y> ratio=<x/y>
//       pages (100 rows; after 20 untimed ones) of scheduler.slot.list and allocation.list from
//       anywhere in each fleet, through the service: flat when the ratio is ~1. A "p1: index
//       proposals" line says how often the index proposed slots that the SQL re-check found stale.
//   scheduler_bench [--nodes 50000,1000] [--clients 4] [--seconds 10] [--index 1|0]
//                   [--group 1|0] [--statements N]
// The first fleet of --nodes gets P1 and P2; every fleet gets the paced creator (P3).
// --index 0 runs the scheduler with scheduler.placement_index=false (every create reads SQL);
// --group 0 with scheduler.group_commit=false (a transaction per create). With group commit, a
// "p1: group commit" line says how many creates shared each commit. --statements N (with
// GPUAAS_PG_OPTIONS="shared_preload_libraries=pg_stat_statements pg_stat_statements.track=all")
// prints the N statements that took PostgreSQL the most time (executing, and planning with
// pg_stat_statements.track_planning=on) during P1, with their calls per placement: the profile
// of the create path in SQL. A "p1 cpu" line splits the machine's CPU over P1 between
// PostgreSQL, nats-server, this process and idle. BENCH_LOG_LEVEL=warn shows the scheduler's
// warnings (default: errors only).
//   scheduler_bench --p8 50000
//   P8 rebuild_events_per_s=<x> raw_consume_per_s=<y> ratio=<x/y>
//       only this: 50,000 node and 400,000 slot events published to the inventory stream; a raw
//       JetStream pull consumer reads the slot events; a scheduler started on an empty database
//       builds its projection and placement index from the stream (RunP8). A second baseline,
//       a durable consumer with explicit acks fetched as the service fetches and acking each
//       message without doing anything else, shows what the server's acked delivery alone costs.
#include <fcntl.h>
#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <prometheus/registry.h>

#include "bench_util.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/process_metrics.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "test_env.hpp"

using namespace gpuaas;
using Clock = std::chrono::steady_clock;
using bench::Percentile;
using bench::Report;

namespace {

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// The database as autovacuum keeps tables that changed gradually: with statistics (without
// them the planner takes just-filled tables for empty ones), vacuumed (else autovacuum's pass
// over 700,000 freshly inserted rows, or over what P1 churned, runs under the next
// measurements) and checkpointed (else the checkpointer writes those pages under them). After
// the fill and after P1, so that the paced creates of every fleet start from the same state.
bool Settle(const std::string& dsn) {
  try {
    pqxx::connection c(dsn);
    pqxx::nontransaction(c).exec("VACUUM ANALYZE");
    pqxx::nontransaction(c).exec("CHECKPOINT");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vacuum: %s\n", e.what());
    return false;
  }
  return true;
}

// A fleet of `nodes` x 8 slots (2 NUMA x 2 switches x 2 GPUs), ~85% occupied by 1-GPU claims.
bool Fill(store::Pool& pool, const std::string& dsn, int nodes) {
  auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
    tx.exec_params(
        "INSERT INTO projected_nodes (node_id, hostname, region, pool, capacity_profile, "
        "generation, last_event_id) SELECT 'n' || lpad(i::text, 6, '0'), 'h' || i, 'us-east-1', "
        "'h200', 'slice-vm', 1, gen_random_uuid() FROM generate_series(1, $1) i",
        nodes);
    tx.exec_params(
        "INSERT INTO projected_slots (node_id, slot_key, region, pool, sku, admin_state, health, "
        "schedulable, generation, last_event_id, fabric_type, numa, pcie_switch, "
        "gpu_pci_address, nvme_by_id, fabric_claim_mode, fabric_vf_pci_address, mac, private_ip, "
        "vcpus_per_gpu, memory_mib_per_gpu) "
        "SELECT 'n' || lpad(i::text, 6, '0'), 'gpu-' || s, 'us-east-1', 'h200', 'h200-sxm', "
        "'available', 'healthy', true, 1, gen_random_uuid(), 'infiniband', s / 4, "
        "'sw' || (s / 2), '0000:1' || s || ':00.0', '/dev/disk/by-id/nvme-eui.' || i || '-' || s, "
        "'per_slot_vf', '0000:4' || s || ':00.1', '52:54:00:00:00:0' || s, '10.100.0.' || (10 + "
        "s), "
        "24, 65536 FROM generate_series(1, $1) i, generate_series(0, 7) s",
        nodes);
    // Occupancy: a deterministic ~85% of slots hold a 1-GPU allocation.
    tx.exec(
        "CREATE TEMP TABLE occ AS SELECT node_id, slot_key, gen_random_uuid() AS id FROM "
        "projected_slots WHERE abs(hashtext(node_id || slot_key)) % 100 < 85");
    tx.exec(
        "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, gpu_count, "
        "region, network_mode, state, node_id, generation) SELECT id, 'fill', id::text, "
        "'h200-sxm-slice', 'gpu_slice', 1, 'us-east-1', 'private-nat', 'active', node_id, 1 "
        "FROM occ");
    tx.exec(
        "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_key, kind, phase) "
        "SELECT id, node_id, slot_key, 'slot', 'active' FROM occ");
    return Ok();
  });
  if (!r.ok()) {
    std::fprintf(stderr, "fill: %s\n", r.error().ToString().c_str());
    return false;
  }
  return Settle(dsn);
}

// The machine's CPU time by whom, for the "p1 cpu" line: the PostgreSQL server of the run (its
// postmaster, found by port, and every child), its nats-server (a child of this process), this
// process (the scheduler and the clients), everything else, and idle (from /proc/stat), in
// seconds.
struct CpuSample {
  double postgres = 0, nats = 0, self = 0, all = 0, idle = 0;
};

CpuSample SampleCpu(uint16_t pg_port) {
  const double tick = static_cast<double>(sysconf(_SC_CLK_TCK));
  struct Proc {
    int ppid = 0;
    double cpu = 0;
    std::string cmd;
  };
  std::map<int, Proc> procs;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream st(e.path() / "stat"), cl(e.path() / "cmdline");
    std::string stat((std::istreambuf_iterator<char>(st)), {});
    std::string cmd((std::istreambuf_iterator<char>(cl)), {});
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream in(stat.substr(close + 2));
    std::vector<std::string> f{std::istream_iterator<std::string>(in), {}};
    if (f.size() < 13) continue;
    std::replace(cmd.begin(), cmd.end(), '\0', ' ');
    procs[std::stoi(name)] = {std::stoi(f[1]), (std::stod(f[11]) + std::stod(f[12])) / tick, cmd};
  }
  int postmaster = -1;
  for (const auto& [pid, p] : procs) {
    if (p.cmd.find("postgres") != std::string::npos &&
        p.cmd.find(" -p " + std::to_string(pg_port) + " ") != std::string::npos) {
      postmaster = pid;
    }
  }
  CpuSample s;
  for (const auto& [pid, p] : procs) {
    if (pid == postmaster || p.ppid == postmaster) {
      s.postgres += p.cpu;
    } else if (p.cmd.rfind("nats-server", 0) == 0 && p.ppid == getpid()) {
      s.nats += p.cpu;
    } else if (pid == getpid()) {
      s.self += p.cpu;
    }
  }
  std::ifstream ps("/proc/stat");
  std::string cpu;
  double user = 0, nice = 0, sys = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
  ps >> cpu >> user >> nice >> sys >> idle >> iowait >> irq >> softirq >> steal;
  s.all = (user + nice + sys + idle + iowait + irq + softirq + steal) / tick;
  s.idle = (idle + iowait) / tick;
  return s;
}

void PrintCpu(const char* phase, const CpuSample& a, const CpuSample& b) {
  const double all = b.all - a.all;
  if (all <= 0) return;
  const double pg = b.postgres - a.postgres, nats = b.nats - a.nats, self = b.self - a.self,
               idle = b.idle - a.idle;
  std::printf(
      "%s cpu: postgres %.0f%%, nats-server %.0f%%, this process (scheduler and clients) %.0f%%, "
      "other %.0f%%, idle %.0f%% of %ld cores\n",
      phase, 100 * pg / all, 100 * nats / all, 100 * self / all,
      100 * std::max(0.0, all - pg - nats - self - idle) / all, 100 * idle / all,
      sysconf(_SC_NPROCESSORS_ONLN));
}

// pg_stat_statements over P1 (--statements): zeroed before, its top `n` by time after. False
// (and why, on stderr) when the server was not started with it.
bool ResetStatements(const std::string& dsn) {
  try {
    pqxx::connection c(dsn);
    pqxx::nontransaction tx(c);
    tx.exec("CREATE EXTENSION IF NOT EXISTS pg_stat_statements");
    tx.exec("SELECT pg_stat_statements_reset()");
    return true;
  } catch (const std::exception& e) {
    std::fprintf(
        stderr,
        "--statements needs GPUAAS_PG_OPTIONS=\"shared_preload_libraries=pg_stat_statements "
        "pg_stat_statements.track=all\": %s\n",
        e.what());
    return false;
  }
}

void PrintStatements(const std::string& dsn, int n, int64_t placed) {
  pqxx::connection c(dsn);
  pqxx::nontransaction tx(c);
  const double per = placed > 0 ? static_cast<double>(placed) : 1.0;
  auto total = tx.exec(
      "SELECT coalesce(sum(total_exec_time), 0), coalesce(sum(calls) FILTER (WHERE toplevel), 0), "
      "coalesce(sum(calls) FILTER (WHERE NOT toplevel), 0), coalesce(sum(total_plan_time), 0) "
      "FROM pg_stat_statements "
      "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())");
  std::printf(
      "p1 statements: %.2f ms of PostgreSQL execution and %.2f ms of planning (0 unless "
      "pg_stat_statements.track_planning), %.1f statements from clients and %.1f from triggers "
      "and functions per placement\n",
      total[0][0].as<double>() / per, total[0][3].as<double>() / per,
      total[0][1].as<double>() / per, total[0][2].as<double>() / per);
  for (const auto& r : tx.exec_params(
           "SELECT total_exec_time, calls, mean_exec_time, toplevel, total_plan_time, "
           "regexp_replace(query, '\\s+', ' ', 'g') FROM pg_stat_statements WHERE dbid = (SELECT "
           "oid FROM pg_database WHERE datname = current_database()) ORDER BY total_exec_time + "
           "total_plan_time DESC LIMIT $1",
           n)) {
    std::printf(
        "p1 statement: %7.3f ms/placement (planning %.3f) %6.2f calls/placement %6.3f ms/call %s "
        "%.100s\n",
        r[0].as<double>() / per, r[4].as<double>() / per, r[1].as<double>() / per,
        r[2].as<double>(), r[3].as<bool>() ? "client" : "nested", r[5].as<std::string>().c_str());
  }
}

double PgbenchTps(testing::TestPostgres& pg, int clients, int seconds) {
  const std::string db = "pgbench";
  const std::string bin = pg.bindir() + "/pgbench";
  const std::string conn = fmt::format("-h 127.0.0.1 -p {} -U postgres", pg.port());
  testing::Shell(fmt::format("{}/psql {} -qc 'CREATE DATABASE {}' postgres >/dev/null 2>&1",
                             pg.bindir(), conn, db));
  if (testing::Shell(fmt::format("{} -i -q -s 10 {} {} >/dev/null 2>&1", bin, conn, db)) != 0) {
    return 0;
  }
  const std::string out = "/tmp/gpuaas-pgbench.out";
  testing::Shell(fmt::format("{} -n -c {} -j {} -T {} {} {} >{} 2>&1", bin, clients, clients,
                             seconds, conn, db, out));
  FILE* f = std::fopen(out.c_str(), "r");
  if (!f) return 0;
  char line[512];
  double tps = 0;
  while (std::fgets(line, sizeof line, f)) {
    std::cmatch m;
    if (std::regex_search(line, m, std::regex("tps = ([0-9.]+)"))) tps = std::stod(m[1]);
  }
  std::fclose(f);
  return tps;
}

// P2's baselines run alongside the paced creator, at its pace with its one client, so a commit
// stall of the disk or a busy core lands on both sides: pgbench running a one-row INSERT (-R at
// the creator's rate, one client; each transaction's latency from its log, schedule lag taken
// out) and raw NATS request/replies to a trivial responder ("bench.echo") at the same pace.
class Alongside {
 public:
  Alongside(testing::TestPostgres& pg, messaging::Connection& conn, double gap_s, int count)
      : conn_(conn), gap_s_(gap_s), count_(count) {
    dir_ = testing::MakeTempDir("gpuaas-p2-alongside");
    const std::string psql =
        fmt::format("{}/psql -h 127.0.0.1 -p {} -U postgres -q", pg.bindir(), pg.port());
    testing::Shell(psql + " -c 'CREATE DATABASE p2base' postgres >/dev/null 2>&1");
    testing::Shell(psql +
                   " -c 'CREATE TABLE IF NOT EXISTS p2 (id bigserial PRIMARY KEY, v int NOT NULL, "
                   "at timestamptz NOT NULL DEFAULT now())' p2base >/dev/null");
    std::ofstream(dir_ + "/insert.sql")
        << "\\set v random(1, 1000000)\nINSERT INTO p2 (v) VALUES (:v);\n";
    const int secs = std::max(1, static_cast<int>(std::ceil(gap_s * count)));
    pgbench_ = std::thread([this, &pg, secs] {
      testing::Shell(fmt::format(
          "cd {} && {}/pgbench -n -c 1 -j 1 -R {:.3f} -T {} -f insert.sql -l --log-prefix=p2 "
          "-h 127.0.0.1 -p {} -U postgres p2base >pgbench.out 2>&1",
          dir_, pg.bindir(), 1.0 / gap_s_, secs, pg.port()));
    });
    nats_ = std::thread([this] {
      for (int i = 0; i < count_; ++i) {
        const auto start = Clock::now();
        if (conn_.Request("bench.echo", "ping", {}, std::chrono::seconds(2)).ok()) {
          rtt_ms_.push_back(Ms(Clock::now() - start));
        }
        std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(
                                                  std::chrono::duration<double>(gap_s_)));
      }
    });
  }
  ~Alongside() { Join(); }
  Alongside(const Alongside&) = delete;
  Alongside& operator=(const Alongside&) = delete;

  // Waits for both; then the insert latencies (ms) from pgbench's transaction log.
  void Join() {
    if (pgbench_.joinable()) pgbench_.join();
    if (nats_.joinable()) nats_.join();
    if (!insert_ms_.empty()) return;
    for (const auto& e : std::filesystem::directory_iterator(dir_)) {
      if (e.path().filename().string().rfind("p2.", 0) != 0) continue;
      std::ifstream in(e.path());
      // client_id transaction_no time script_no time_epoch time_us [schedule_lag]
      for (std::string line; std::getline(in, line);) {
        std::istringstream f(line);
        long long client = 0, tx = 0, time_us = 0, script = 0, epoch = 0, us = 0, lag = 0;
        if (!(f >> client >> tx >> time_us >> script >> epoch >> us)) continue;
        f >> lag;
        insert_ms_.push_back(static_cast<double>(time_us - lag) / 1000.0);
      }
    }
  }
  const std::vector<double>& insert_ms() const { return insert_ms_; }
  const std::vector<double>& rtt_ms() const { return rtt_ms_; }

 private:
  messaging::Connection& conn_;
  double gap_s_;
  int count_;
  std::string dir_;
  std::thread pgbench_, nats_;
  std::vector<double> insert_ms_, rtt_ms_;
};

// Resident set of this process, MiB (what the scheduler's process_resident_memory_bytes says).
double RssMib() { return metrics::ReadProcessStats().resident_bytes / (1024.0 * 1024.0); }

struct Fleet {
  int nodes = 0;
  double p99_ms = 0;
  double read_p99_ms = 0;
  std::vector<double> create_ms;
};

// The scheduler's gpuaas_placement_choices_total{source="index"} by outcome (placed, stale:
// the SQL re-check found the proposal claimed or unschedulable, held: locked by another create).
std::map<std::string, double> IndexChoices(scheduler::SchedulerService& svc) {
  std::map<std::string, double> out;
  for (const auto& fam : svc.runtime().metrics().Collect()) {
    if (fam.name != "gpuaas_placement_choices_total") continue;
    for (const auto& m : fam.metric) {
      std::string source, outcome;
      for (const auto& l : m.label) {
        if (l.name == "source") source = l.value;
        if (l.name == "outcome") outcome = l.value;
      }
      if (source == "index") out[outcome] += m.counter.value;
    }
  }
  return out;
}

void PrintChoices(const char* phase, const std::map<std::string, double>& before,
                  const std::map<std::string, double>& after) {
  auto d = [&](const char* k) {
    const auto a = after.find(k), b = before.find(k);
    return (a == after.end() ? 0 : a->second) - (b == before.end() ? 0 : b->second);
  };
  const double placed = d("placed"), stale = d("stale"), held = d("held");
  const double all = placed + stale + held;
  std::printf("%s: index proposals: %.0f placed, %.0f stale, %.0f held (stale %.2f%%)\n", phase,
              placed, stale, held, all > 0 ? 100.0 * stale / all : 0.0);
}

// A scheduler on `dsn` with `clients` request workers, started (null and said why on failure).
std::unique_ptr<scheduler::SchedulerService> StartScheduler(testing::TestNats& nats,
                                                            const std::string& dsn, int clients,
                                                            bool index, bool group = true) {
  auto env = nats.Env("scheduler");
  env["GPUAAS_POSTGRES_DSN"] = dsn;
  env["GPUAAS_LOG_LEVEL"] =
      std::getenv("BENCH_LOG_LEVEL") ? std::getenv("BENCH_LOG_LEVEL") : "error";
  env["GPUAAS_RPC_WORKERS"] = std::to_string(clients);
  // The create path is measured, not the per-principal limits: with them (operator writes
  // 200/s) P1's creates and releases were refused as rate_limited (until 2026-11-28).
  env["GPUAAS_RPC_RATE_LIMITS"] = "";
  env["GPUAAS_POSTGRES_POOL_SIZE"] = std::to_string(clients + 2);
  env["GPUAAS_SCHEDULER_PLACEMENT_INDEX"] = index ? "true" : "false";
  env["GPUAAS_SCHEDULER_GROUP_COMMIT"] = group ? "true" : "false";
  auto cfg = bench::LoadConfig<scheduler::SchedulerConfig>(env);
  if (!cfg.ok()) {
    std::fprintf(stderr, "scheduler config: %s\n", cfg.error().ToString().c_str());
    return nullptr;
  }
  auto svc = std::make_unique<scheduler::SchedulerService>(*cfg);
  if (auto r = svc->Start(); !r.ok()) {
    std::fprintf(stderr, "scheduler: %s\n", r.error().ToString().c_str());
    return nullptr;
  }
  return svc;
}

// P8: the scheduler's projection and placement index rebuilt from the inventory stream. `nodes`
// node events and 8 slot events each are published first; then a raw JetStream pull consumer
// reads the slot events (no ack, no processing), and a scheduler started on an empty database
// consumes the stream until its projection holds every slot and its index every node.
int RunP8(testing::TestNats& nats, testing::TestPostgres& pg,
          const std::shared_ptr<messaging::Connection>& conn, int nodes, int clients,
          const log::Logger& logger) {
  if (!messaging::EnsureStream(*conn, messaging::InventoryEventsStream()).ok()) return 1;
  jsCtx* js = conn->js();
  jsPubOptions po;
  jsPubOptions_Init(&po);
  int64_t slots = 0;
  const auto t_pub = Clock::now();
  auto publish = [&](const std::string& subject, const google::protobuf::Message& data,
                     const std::string& entity) {
    const auto ev = outbox::MakeEvent({subject, "", "inventory/bench", entity, 1, "", "", &data});
    const std::string bytes = ev.SerializeAsString();
    po.MsgId = ev.id().c_str();
    return js_PublishAsync(js, subject.c_str(), bytes.data(), static_cast<int>(bytes.size()),
                           &po) == NATS_OK;
  };
  for (int n = 0; n < nodes; ++n) {
    const std::string id = fmt::format("n{:06d}", n);
    v1::NodeSnapshot ns;
    ns.mutable_node()->set_node_id(id);
    ns.mutable_node()->set_hostname(id);
    ns.mutable_node()->set_region("us-east-1");
    ns.mutable_node()->set_pool("h200");
    ns.mutable_node()->set_capacity_profile(v1::CAPACITY_PROFILE_SLICE_VM);
    ns.mutable_node()->set_generation(1);
    if (!publish("gpuaas.v1.evt.inventory.node.registered", ns, id)) return 1;
    for (int i = 0; i < 8; ++i) {
      v1::SlotSnapshot ss;
      auto* sl = ss.mutable_slot();
      sl->set_node_id(id);
      sl->set_slot_key(fmt::format("gpu-0000:{:02x}:00.0", 0x18 + i));
      sl->set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
      sl->set_health(v1::SLOT_HEALTH_HEALTHY);
      sl->set_sku("h200-sxm");
      sl->set_numa_node(i / 4);
      sl->set_pcie_switch(fmt::format("sw{}", i / 2));
      sl->set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
      sl->set_gpu_pci_address(sl->slot_key().substr(4));
      sl->set_nvme_by_id(fmt::format("/dev/disk/by-id/nvme-eui.{}{:02x}", id, i));
      sl->set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
      sl->set_fabric_vf_pci_address(fmt::format("0000:{:02x}:00.1", 0x40 + i));
      sl->set_mac(fmt::format("52:54:00:{:02x}:{:02x}:{:02x}", n / 256 % 256, n % 256, i));
      sl->set_private_ip(fmt::format("10.100.0.{}", 10 + i));
      sl->mutable_profile()->set_name("h200_24c_64g");
      sl->mutable_profile()->set_vcpus_per_gpu(24);
      sl->mutable_profile()->set_memory_mib_per_gpu(65536);
      sl->set_generation(1);
      ss.set_region("us-east-1");
      ss.set_pool("h200");
      ss.set_region_enabled(true);
      ss.set_schedulable(true);
      if (!publish("gpuaas.v1.evt.inventory.slot.updated", ss, id + "/" + sl->slot_key())) {
        return 1;
      }
      ++slots;
    }
  }
  jsPubOptions done;
  jsPubOptions_Init(&done);
  done.MaxWait = 120000;
  if (js_PublishAsyncComplete(js, &done) != NATS_OK) return 1;
  std::printf("p8: published %d node and %lld slot events in %.1fs\n", nodes,
              static_cast<long long>(slots),
              std::chrono::duration<double>(Clock::now() - t_pub).count());

  // Raw: a pull consumer over the slot events, batches of 1,000, no acks.
  const double raw_per_s = bench::RawPullPerSecond(conn, messaging::InventoryEventsStream().name,
                                                   "gpuaas.v1.evt.inventory.slot.>", slots);
  if (raw_per_s == 0) return 1;

  // What the server alone costs a consumer like the scheduler's: a durable pull consumer with
  // explicit acks over the same slot events, fetched as the service fetches (messaging::Puller,
  // batches of 256) and each message acked, nothing else done with it.
  const double acked_per_s = bench::ConsumePerSecond(conn, messaging::InventoryEventsStream().name,
                                                     "gpuaas.v1.evt.inventory.slot.>", slots,
                                                     "p8-acked", 256, /*ack=*/true);
  if (acked_per_s == 0) return 1;

  // The scheduler on an empty database: projection and index from the stream.
  const std::string dsn = pg.CreateDatabase("p8");
  const auto t_rebuild = Clock::now();
  auto svc = StartScheduler(nats, dsn, clients, /*index=*/true);
  if (!svc) return 1;
  // Done when every event was applied (the projection's own count, so that polling costs the
  // two cores nothing) and the index holds every node; then the table is checked once.
  const auto& stats = svc->projection_stats();
  while (static_cast<int64_t>(stats.applied + stats.duplicates) < slots + nodes ||
         svc->placement_index()->nodes() < static_cast<size_t>(nodes)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (Clock::now() - t_rebuild > std::chrono::minutes(30)) {
      std::fprintf(stderr, "p8: rebuild not done after 30 min (%llu events applied)\n",
                   static_cast<unsigned long long>(stats.applied.load()));
      return 1;
    }
  }
  const double rebuild_s = std::chrono::duration<double>(Clock::now() - t_rebuild).count();
  store::Pool pool({dsn, 1, 5000}, logger);
  auto projected = store::WithTx(pool, [](pqxx::work& tx) -> Result<int64_t> {
    return tx.exec1("SELECT count(*) FROM projected_slots")[0].as<int64_t>();
  });
  if (!projected.ok() || *projected != slots) {
    std::fprintf(stderr, "p8: the projection holds %lld slots, not %lld\n",
                 static_cast<long long>(projected.ok() ? *projected : -1),
                 static_cast<long long>(slots));
    return 1;
  }
  const double rebuild_per_s = static_cast<double>(slots) / rebuild_s;
  svc->Shutdown();
  std::printf("p8: %lld slot events (and %d node events) into the projection and index in %.1fs\n",
              static_cast<long long>(slots), nodes, rebuild_s);
  std::printf("p8: acked_consume_per_s=%.1f (rebuild / acked consume = %.3f)\n", acked_per_s,
              acked_per_s > 0 ? rebuild_per_s / acked_per_s : 0.0);
  std::printf("P8 rebuild_events_per_s=%.1f raw_consume_per_s=%.1f ratio=%.3f\n", rebuild_per_s,
              raw_per_s, raw_per_s > 0 ? rebuild_per_s / raw_per_s : 0.0);
  return 0;
}

}  // namespace

namespace {

struct Args {
  std::vector<int> fleets = {50000, 1000};
  int clients = 4;
  int seconds = 10;
  bool index = true;
  bool group = true;
  int p8_nodes = 0;
  int statements = 0;
};

Args ParseArgs(int argc, char** argv) {
  Args a;
  for (int i = 1; i + 1 < argc; ++i) {
    if (!std::strcmp(argv[i], "--p8")) a.p8_nodes = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--nodes")) {
      a.fleets.clear();
      std::stringstream list(argv[i + 1]);
      for (std::string n; std::getline(list, n, ',');) a.fleets.push_back(std::atoi(n.c_str()));
    }
    if (!std::strcmp(argv[i], "--clients")) a.clients = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--seconds")) a.seconds = std::atoi(argv[i + 1]);
    if (!std::strcmp(argv[i], "--index")) a.index = std::atoi(argv[i + 1]) != 0;
    if (!std::strcmp(argv[i], "--group")) a.group = std::atoi(argv[i + 1]) != 0;
    if (!std::strcmp(argv[i], "--statements")) a.statements = std::atoi(argv[i + 1]);
  }
  return a;
}

constexpr int kSizes[] = {1, 1, 1, 1, 2, 2, 2, 4, 4, 8};  // 40/30/20/10 %

// The placement index of a filled fleet: how long the running replica took to hear of the fill
// (notifications alone), and what a restarted replica's full read costs.
struct IndexLoad {
  double catch_up_ms = 0;
  double load_ms = 0;
  double heap_mib = 0;
};

// P1 to P3 and the read path over one NATS connection: each fleet gets a fresh database and
// scheduler, P1 and P2 run on the first.
class SchedulerBench {
 public:
  SchedulerBench(const Args& args, testing::TestNats& nats, testing::TestPostgres& pg,
                 std::shared_ptr<messaging::Connection> conn, log::Logger logger)
      : a_(args),
        nats_(nats),
        pg_(pg),
        conn_(conn),
        client_(std::move(conn)),
        log_(std::move(logger)) {}

  int Run();

 private:
  Result<v1::CreateAllocationResponse> Create(const std::string& id, int gpus);
  // No node-agent answers tasks here. Releases are admin force-releases (a normal one would
  // wait for vm.release); the allocation is `provisioning` (vm.provision was sent), so its
  // claims then wait for the node's cleanup proof, which never comes: a release here does not
  // give the GPUs back. The fleets are sized for it: P1 and the paced creates of the
  // 50,000-node fleet take ~4,000 of its ~60,000 free GPUs (occupancy 85% -> ~86%); the
  // 1,000-node fleet (~1,200 free) gets only the 300 paced creates, whose 8-GPU requests are
  // refused anyway.
  Result<v1::ReleaseAllocationResponse> Release(const std::string& id);
  std::optional<IndexLoad> MeasureIndex(scheduler::SchedulerService& svc, const std::string& dsn,
                                        int nodes);
  // Closed loop, C creators; each releases what it created to hold occupancy. Placements/s.
  std::optional<double> RunP1(scheduler::SchedulerService& svc, const std::string& dsn, int nodes);
  // One creator paced at `gap`: P2 on the first fleet (with its baselines alongside), P3 on
  // each.
  void RunPaced(Fleet* fl, std::chrono::duration<double> gap, bool alongside);
  // Pages of slot.list and allocation.list from anywhere in the fleet.
  bool RunReads(Fleet* fl);
  bool PrintResults(double rate, double tps);

  const Args& a_;
  testing::TestNats& nats_;
  testing::TestPostgres& pg_;
  std::shared_ptr<messaging::Connection> conn_;
  rpc::Client client_;
  log::Logger log_;
  std::vector<Fleet> done_;
  std::vector<double> along_insert_ms_, along_rtt_ms_;
};

Result<v1::CreateAllocationResponse> SchedulerBench::Create(const std::string& id, int gpus) {
  v1::CreateAllocationRequest r;
  r.set_tenant("bench");
  r.set_request_id(id);
  r.set_sku("h200-sxm-slice");
  r.set_gpu_count(gpus);
  r.set_region("us-east-1");
  return client_.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r,
                                                    std::chrono::seconds(10));
}

Result<v1::ReleaseAllocationResponse> SchedulerBench::Release(const std::string& id) {
  v1::ForceReleaseAllocationRequest r;
  r.set_allocation_id(id);
  r.set_reason("bench");
  return client_.Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.force_release",
                                                     r, std::chrono::seconds(10));
}

std::optional<IndexLoad> SchedulerBench::MeasureIndex(scheduler::SchedulerService& svc,
                                                      const std::string& dsn, int nodes) {
  IndexLoad out;
  const auto filled = Clock::now();
  while (svc.placement_index()->nodes() < static_cast<size_t>(nodes)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (Clock::now() - filled > std::chrono::minutes(5)) {
      std::fprintf(stderr, "index did not catch up with the fill\n");
      return std::nullopt;
    }
  }
  out.catch_up_ms = Ms(Clock::now() - filled);
  const auto before = mallinfo2().uordblks;
  auto fresh = std::make_unique<scheduler::PlacementCache>(dsn, log_);
  const auto t = Clock::now();
  if (!fresh->Start().ok()) return std::nullopt;
  out.load_ms = Ms(Clock::now() - t);
  out.heap_mib = static_cast<double>(mallinfo2().uordblks - before) / (1024.0 * 1024.0);
  fresh->Stop();
  return out;
}

std::optional<double> SchedulerBench::RunP1(scheduler::SchedulerService& svc,
                                            const std::string& dsn, int nodes) {
  std::atomic<int64_t> placed{0}, rejected{0}, failed{0};
  std::mutex why_mu;
  std::map<std::string, int64_t> why;  // failed creates and releases by reason
  auto fail = [&](const Error& e) {
    failed++;
    std::lock_guard lock(why_mu);
    why[e.reason]++;
  };
  std::atomic<bool> stop{false};
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(std::max(a_.clients, 0)));
  const auto t0 = Clock::now();
  for (int c = 0; c < a_.clients; ++c) {
    threads.emplace_back([&, c] {
      std::mt19937 rng(static_cast<unsigned>(c + 1));
      std::vector<std::string> mine;
      for (int i = 0; !stop; ++i) {
        auto r = Create(fmt::format("p1-{}-{}", c, i), kSizes[rng() % 10]);
        if (r.ok()) {
          placed++;
          mine.push_back(r->allocation().allocation_id());
        } else if (r.error().reason == "no_placement") {
          rejected++;
        } else {
          fail(r.error());
        }
        if (mine.size() > 2) {  // keep occupancy steady: release an older one of ours
          const size_t k = rng() % mine.size();
          if (auto rel = Release(mine[k]); !rel.ok()) fail(rel.error());
          mine.erase(mine.begin() + static_cast<long>(k));
        }
      }
      for (const auto& id : mine) (void)Release(id);
    });
  }
  const auto choices_before = IndexChoices(svc);
  int statements = a_.statements;
  if (statements > 0 && !ResetStatements(dsn)) statements = 0;
  const CpuSample cpu_before = SampleCpu(pg_.port());
  std::this_thread::sleep_for(std::chrono::seconds(a_.seconds));
  PrintCpu("p1", cpu_before, SampleCpu(pg_.port()));
  stop = true;
  for (auto& t : threads) t.join();
  if (statements > 0) PrintStatements(dsn, statements, placed.load());
  PrintChoices("p1", choices_before, IndexChoices(svc));
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("p1: %lld placed, %lld no_placement, %lld errors in %.1fs (%d clients, %d nodes)\n",
              static_cast<long long>(placed.load()), static_cast<long long>(rejected.load()),
              static_cast<long long>(failed.load()), elapsed, a_.clients, nodes);
  for (const auto& [reason, n] : why) {
    std::printf("p1: failed: %lld %s\n", static_cast<long long>(n), reason.c_str());
  }
  if (const store::GroupCommit* g = svc.group_commit(); g != nullptr) {
    const auto gs = g->stats();
    std::printf(
        "p1: group commit: %llu creates in %llu commits (%.2f per commit, at most %llu), %llu "
        "run again alone\n",
        static_cast<unsigned long long>(gs.units), static_cast<unsigned long long>(gs.groups),
        gs.groups > 0 ? static_cast<double>(gs.units) / static_cast<double>(gs.groups) : 0.0,
        static_cast<unsigned long long>(gs.largest), static_cast<unsigned long long>(gs.alone));
  }
  if (!Settle(dsn)) return std::nullopt;
  return static_cast<double>(placed.load()) / elapsed;
}

void SchedulerBench::RunPaced(Fleet* fl, std::chrono::duration<double> gap, bool alongside) {
  std::unique_ptr<Alongside> along;
  if (alongside) along = std::make_unique<Alongside>(pg_, *conn_, gap.count(), 300);
  for (int i = 0; i < 300; ++i) {
    const auto start = Clock::now();
    auto r = Create(fmt::format("p2-{}", i), kSizes[i % 10]);
    fl->create_ms.push_back(Ms(Clock::now() - start));
    if (r.ok()) (void)Release(r->allocation().allocation_id());
    std::this_thread::sleep_until(start + std::chrono::duration_cast<Clock::duration>(gap));
  }
  if (along) {
    along->Join();
    along_insert_ms_ = along->insert_ms();
    along_rtt_ms_ = along->rtt_ms();
  }
  fl->p99_ms = Percentile(fl->create_ms, 0.99);
  Report(fmt::format("alloc_create_paced_{}", fl->nodes).c_str(), fl->create_ms);
}

bool SchedulerBench::RunReads(Fleet* fl) {
  std::vector<double> slot_ms, alloc_ms;
  std::mt19937 rng(7);
  // 20 warm-up reads (10 of each), then 200 timed ones.
  for (int i = -20; i < 200; ++i) {
    const std::string from = fmt::format("n{:06d}", rng() % static_cast<unsigned>(fl->nodes));
    const auto start = Clock::now();
    bool ok = false;
    if (i % 2 == 0) {
      v1::ListProjectedSlotsRequest req;
      req.set_page_token(from + "/gpu-0000:18:00.0");
      ok = client_
               .Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", req,
                                                     std::chrono::seconds(10))
               .ok();
      slot_ms.push_back(Ms(Clock::now() - start));
    } else {
      v1::ListAllocationsRequest req;
      req.set_tenant("bench");
      req.set_page_token(ids::NewUuidV7());
      ok = client_
               .Call<v1::ListAllocationsResponse>("gpuaas.v1.scheduler.allocation.list", req,
                                                  std::chrono::seconds(10))
               .ok();
      alloc_ms.push_back(Ms(Clock::now() - start));
    }
    if (!ok) return false;
    if (i < 0) (i % 2 == 0 ? slot_ms : alloc_ms).pop_back();
  }
  std::vector<double> read_ms = slot_ms;
  read_ms.insert(read_ms.end(), alloc_ms.begin(), alloc_ms.end());
  fl->read_p99_ms = Percentile(read_ms, 0.99);
  Report(fmt::format("slot_list_page_{}", fl->nodes).c_str(), slot_ms);
  Report(fmt::format("alloc_list_page_{}", fl->nodes).c_str(), alloc_ms);
  return true;
}

int SchedulerBench::Run() {
  // A trivial responder: the raw NATS round trip of P2's baselines.
  natsSubscription* echo = nullptr;
  natsConnection_Subscribe(
      &echo, conn_->raw(), "bench.echo",
      [](natsConnection* nc, natsSubscription*, natsMsg* m, void*) {
        natsConnection_Publish(nc, natsMsg_GetReply(m), "ok", 2);
        natsMsg_Destroy(m);
      },
      nullptr);
  double rate = 0, tps = 0;
  std::chrono::duration<double> gap(0.2);
  for (size_t f = 0; f < a_.fleets.size(); ++f) {
    const int nodes = a_.fleets[f];
    const std::string dsn = pg_.CreateDatabase("sched");
    auto svc = StartScheduler(nats_, dsn, a_.clients, a_.index, a_.group);
    if (!svc) return 1;
    store::Pool pool({dsn, 2, 5000}, log_);
    const auto fill_start = Clock::now();
    if (!Fill(pool, dsn, nodes)) return 1;
    const auto filled = Clock::now();
    IndexLoad index;
    if (a_.index) {
      auto measured = MeasureIndex(*svc, dsn, nodes);
      if (!measured) return 1;
      index = *measured;
    }
    std::printf("fill: %d nodes x 8 slots in %.1fs\n", nodes,
                std::chrono::duration<double>(filled - fill_start).count());
    if (f == 0) {
      auto p1 = RunP1(*svc, dsn, nodes);
      if (!p1) return 1;
      rate = *p1;
      // 50% load; bounded so a very slow P1 cannot stretch P2 into hours.
      gap = std::chrono::duration<double>(std::clamp(rate > 0 ? 2.0 / rate : 0.2, 0.0, 0.2));
    }
    Fleet fl;
    fl.nodes = nodes;
    RunPaced(&fl, gap, f == 0);
    if (!RunReads(&fl)) return 1;
    std::printf(
        "index nodes=%d full_load_ms=%.1f catch_up_ms=%.1f rss_mib=%.1f index_heap_mib=%.1f\n",
        nodes, index.load_ms, index.catch_up_ms, RssMib(), index.heap_mib);
    svc->Shutdown();
    svc.reset();
    // Its database goes, so its autovacuum does not run under the next measurements.
    std::cmatch m;
    if (std::regex_search(dsn.c_str(), m, std::regex("dbname=([a-z0-9_]+)"))) {
      pqxx::connection admin(pg_.AdminDsn());
      pqxx::nontransaction(admin).exec("DROP DATABASE " + m[1].str() + " WITH (FORCE)");
    }
    if (f == 0) tps = PgbenchTps(pg_, a_.clients, a_.seconds);
    done_.push_back(std::move(fl));
  }
  const bool ok = PrintResults(rate, tps);
  natsSubscription_Destroy(echo);
  return ok ? 0 : 1;
}

// Baselines after the load (raw request/reply to the trivial responder; an 8 KiB
// write+fdatasync), then the P1, P2, P2-alongside, P3 and read lines.
bool SchedulerBench::PrintResults(double rate, double tps) {
  std::vector<double> rtt_ms;
  for (int i = 0; i < 1000; ++i) {
    const auto start = Clock::now();
    if (!conn_->Request("bench.echo", "ping", {}, std::chrono::seconds(2)).ok()) return false;
    rtt_ms.push_back(Ms(Clock::now() - start));
  }
  std::vector<double> sync_ms;
  {
    const std::string path = testing::MakeTempDir("gpuaas-fsync") + "/f";
    const int fd = ::open(path.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0600);
    std::string block(8192, 'x');
    for (int i = 0; i < 300 && fd >= 0; ++i) {
      const auto start = Clock::now();
      if (::write(fd, block.data(), block.size()) < 0) break;
      ::fdatasync(fd);
      sync_ms.push_back(Ms(Clock::now() - start));
    }
    if (fd >= 0) ::close(fd);
  }
  Report("nats_request_reply", rtt_ms);
  Report("write_fdatasync_8k", sync_ms);
  std::printf("P1 placements_per_s=%.1f pgbench_tps=%.1f ratio=%.2f\n", rate, tps,
              tps > 0 ? rate / tps : 0.0);
  const double x = done_.front().p99_ms, r = Percentile(rtt_ms, 0.99),
               fs = Percentile(sync_ms, 0.5);
  std::printf("P2 alloc_p99_ms=%.3f nats_rtt_p99_ms=%.3f fdatasync_ms=%.3f ratio=%.2f\n", x, r, fs,
              x / (r + fs));
  if (!along_insert_ms_.empty() && !along_rtt_ms_.empty()) {
    Report("p2_alongside_pgbench_insert", along_insert_ms_);
    Report("p2_alongside_nats_request_reply", along_rtt_ms_);
    const double a = Percentile(along_insert_ms_, 0.99), b = Percentile(along_rtt_ms_, 0.99);
    std::printf(
        "P2-alongside alloc_p99_ms=%.3f pgbench_insert_p99_ms=%.3f nats_rtt_p99_ms=%.3f "
        "ratio=%.2f\n",
        x, a, b, x / (a + b));
  } else {
    std::printf("P2-alongside not measured (pgbench's log or the round trips are missing)\n");
  }
  if (done_.size() > 1) {
    auto by_nodes = [](const Fleet& a, const Fleet& b) { return a.nodes < b.nodes; };
    const auto big = std::max_element(done_.begin(), done_.end(), by_nodes);
    const auto small = std::min_element(done_.begin(), done_.end(), by_nodes);
    std::printf("P3 create_p99_%d_ms=%.3f create_p99_%d_ms=%.3f ratio=%.2f\n", big->nodes,
                big->p99_ms, small->nodes, small->p99_ms,
                small->p99_ms > 0 ? big->p99_ms / small->p99_ms : 0.0);
    std::printf("read list_page_p99_%d_ms=%.3f list_page_p99_%d_ms=%.3f ratio=%.2f\n", big->nodes,
                big->read_p99_ms, small->nodes, small->read_p99_ms,
                small->read_p99_ms > 0 ? big->read_p99_ms / small->read_p99_ms : 0.0);
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const Args args = ParseArgs(argc, argv);
  log::Logger logger("bench", "scheduler", log::Level::kError);
  testing::TestNats nats;
  testing::TestPostgres pg(/*fsync=*/true);
  auto conn = messaging::Connection::Connect(nats.Options(testing::TestNats::kHarness), logger);
  if (!conn.ok()) return 1;
  if (args.p8_nodes > 0) return RunP8(nats, pg, *conn, args.p8_nodes, args.clients, logger);
  SchedulerBench bench(args, nats, pg, *conn, logger);
  return bench.Run();
}
