// gpuaas-chaos: the chaos campaign. Runs the whole platform as real processes (nats-server,
// PostgreSQL with fsync on, every service, simulated node-agents on fixture hosts), churns
// allocations through it while `kill -9` hits every part at random (a service, which is also its
// outbox relay, a node-agent, nats-server, PostgreSQL; outages of 1 s up to --max-outage-s),
// then lets it settle and checks what a user would:
//   double_booked  no two claims ever overlapped on a slot (the claims' whole history)
//   lost           every committed event (each service's outbox) is in its stream, every task
//                  result a node published and every exposure event was applied by the
//                  scheduler, every allocation event by ingress, every acknowledged create exists
//   stuck          every allocation ended active or terminal, and all of them terminal after
//                  the final release, within the deadlines
//   duplicated     no event id twice in a stream; per entity, generations in stream order
//   dead_lettered_retryable  nothing in GPUAAS_DLQ (the campaign sends only valid traffic)
//   projection     the scheduler's projection equals a rebuild by replay
//   crashed        no process died on its own by a signal
//   placed_on_draining  no claim was made on a node between its drain's answer and its undrain
//                  (an operator drains and undrains one node after another during the churn;
//                  a node that drained empty in time goes to baremetal mode and back, its
//                  slots approved again, while the agent and inventory are killed like the rest)
//   node_state_diff  at the end every node is active and in slice-vm mode with no mode change
//                  open, in inventory and in the scheduler's projection; host_op_errors:
//                  drains, undrains or mode changes never answered or never closed
//   usage_diff     the usage ledger (killed like every service) bills each allocation the
//                  GPU-seconds of its active interval in the scheduler's timeline (active to
//                  the release request or failure), within one event's timing (--usage-slack-ms
//                  per boundary); none billed twice, none missing, none never active billed
// and the exposures (ingress: a share of the slices are created with endpoints, each node has a
// port_range pool, the agents ack exposure documents as `simulate`), checked once with the
// allocations kept at the end of the churn settled and again after the final release:
//   endpoint_not_active  an active allocation's endpoint (scheduler read model) is not active
//                        (or drift) in ingress with the same public ip:port
//   exposure_leaked      an exposure of a released allocation (or a failed one whose claims
//                        are freed) is still live (requested, applying, active, drift, removing)
//   pool_used_diff       a pool's `used` differs from its live exposures' endpoints
//   endpoint_shared      two live exposures hold one public ip:port
// With --ha, PostgreSQL is a pg_auto_failover formation (testing::TestHaPostgres) and its fault
// is a failover: the primary's node killed -9, the standby promoted by the engine, the old one
// back as the standby; every service reaches the new primary through its multi-host DSN.
//   failovers, failover_promote_max_s, failover_ready_max_s  counted and measured (kill to the
//                  monitor's new primary; kill to every service's /readyz 200 again)
//   failover_stalls  a failover never promoted, services never ready, or the old primary never
//                  back as the standby; failover_ready_max_s above --max-ready-s fails the run
// With --ha --disk-full each node's data (its WAL included) lives on a 1 GiB loop-mounted ext4,
// and one PostgreSQL fault in three fills the primary's disk for the outage instead of a kill:
// writes fail with SQLSTATE 53100 (retryable db_insufficient_resources), or the server stops if
// its WAL cannot be written and the engine fails over; after the disk is freed the formation
// must have a primary and a standby again (disk_full counts them; stalls are failover_stalls).
// `--ha --faults failover` injects only failovers (ctest chaos.failover in scripts/test).
// With --net-faults every service runs in its own network namespace (net_faults.hpp) and a third
// fault stream cuts one service off PostgreSQL or nats-server (every packet dropped, both ways),
// adds 200 ms to what it sends, or loses 5 % of its packets, for 5 s to --max-net-fault-s, while
// the other streams go on; `net` counts them in the R1 line.
//   net_stalls     a service not ready (/readyz 200) within 180 s of its network's heal;
//                  net_recover_max_s is the longest heal-to-ready seen (a failover's readiness
//                  wait leaves out a service under a network fault until it is ready again)
// and prints `R1 faults=... placements=... double_booked=0 lost=0 stuck=0
// dead_lettered_retryable=0 ...`, exiting 1 when any check fails. scripts/chaos runs it.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <google/protobuf/util/time_util.h>
#include <CLI/CLI.hpp>
#include <pqxx/pqxx>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "ha_postgres.hpp"
#include "net_faults.hpp"
#include "test_env.hpp"

namespace gpuaas::chaos {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::Process;
using testing::WaitFor;

struct Options {
  std::string bin_dir;
  int duration_s = 60;
  int nodes = 3;
  int workers = 4;
  int fault_gap_ms = 2000;
  int max_outage_s = 10;
  // How far a usage record's boundary may be from the scheduler's timeline row of that step
  // (the state change's clock_timestamp() against the row's, in milliseconds as announced).
  int64_t usage_slack_ms = 2000;
  int max_pg_outage_s = 15;
  int min_faults = 0;
  // PostgreSQL as a pg_auto_failover formation (monitor, primary, synchronous standby) instead
  // of one server: its fault is a failover (the primary's machine killed, the standby promoted
  // by the engine, the old primary back later as the new standby).
  bool ha = false;
  // "all": every kind of fault; "failover" (with --ha): only failovers, nothing else killed.
  std::string faults = "all";
  // With --ha: the longest a failover may leave a service not ready (kill to /readyz 200).
  int max_ready_s = 30;
  // With --ha: each node's data on a small loop-mounted disk, and one PostgreSQL fault in three
  // the primary's disk filled up instead of a kill (DiskFull).
  bool disk_full = false;
  // Services in network namespaces, and network faults among the faults (net_faults.hpp).
  bool net_faults = false;
  int max_net_fault_s = 20;
  int expose_percent = 50;
  int pool_ports = 64;
  uint64_t seed = 0;
  std::string out_dir;
};

void Say(const std::string& s) {
  const auto t = std::time(nullptr);
  char buf[16];
  std::strftime(buf, sizeof buf, "%H:%M:%S", std::localtime(&t));
  std::cout << "[" << buf << "] " << s << std::endl;
}

// One supervised process of the platform.
struct Member {
  std::string name;
  std::vector<std::string> argv;
  std::vector<std::string> env;
  std::string log;
  int http_port = 0;
  std::string http_host = "127.0.0.1";  // its namespace's address with --net-faults
  ServiceNet* net = nullptr;            // with --net-faults (services only)
  // Under a network fault, from its injection until it was seen ready again after the heal: a
  // failover's readiness wait leaves it out (its own recovery is measured by NetFaults).
  std::atomic<bool> net_faulted{false};
  std::unique_ptr<Process> proc = std::make_unique<Process>();
  bool down = false;  // taken down on purpose (not to be restarted by the supervisor)
};

std::vector<std::string> EnvList(const std::map<std::string, std::string>& m) {
  std::vector<std::string> out;
  out.reserve(m.size());
  for (const auto& [k, v] : m) out.push_back(fmt::format("{}={}", k, v));
  return out;
}

bool HttpOk(const Member& m, const std::string& path) {
  return testing::Shell(fmt::format("curl -fsS -m 2 http://{}:{}{} >/dev/null 2>&1", m.http_host,
                                    m.http_port, path)) == 0;
}

class Campaign {
 public:
  explicit Campaign(Options o) : o_(std::move(o)), rng_(o_.seed) {}

  int Run();

 private:
  void StartPlatform();
  void Spawn(Member& m);
  // A uniform draw in [lo, hi] from the campaign's seeded generator (every stream draws here).
  int Pick(int lo, int hi) {
    std::lock_guard lock(rng_mu_);
    return std::uniform_int_distribution<int>(lo, hi)(rng_);
  }
  void Supervise();
  void Faults(bool servers);
  // kill -9 of the primary's node (keeper and postgres), then waits for the engine to promote
  // the standby and every service to be ready; after `outage` s the old primary's node comes
  // back and rejoins as the standby (waited for: the next failover needs one).
  void Failover(int outage);
  // The primary's disk filled for `outage` s, then freed; then waits for a primary and a
  // standby (a server that stopped on a WAL write it could not make has been failed over).
  void DiskFull(int outage);
  // The third stream (--net-faults): a network fault on one service at a time.
  void NetFaults();
  void Churn(int worker);
  // The operator's stream: drain a node (insisting until answered), keep it drained a while,
  // undrain it; the next node; until the churn ends.
  void HostOps();
  // A drained node to baremetal mode and back, its slots approved again (counted in
  // mode_changes_, failures in host_op_errors_).
  void RoundTripMode(const std::string& node);
  // Asks for `mode` (insisting) and waits until the change closed in it.
  bool ChangeMode(const std::string& node, v1::CapacityProfile mode);
  std::optional<v1::Node> InventoryNode(const std::string& node);
  void SettleKept();
  void Settle();
  void Check();
  // placed_on_draining and node_state_diff (see the header).
  std::pair<int, int> CheckHostOps();
  // usage_diff (see the header): allocations whose billed GPU-seconds differ from their active
  // interval in the scheduler's timeline; waits for the ledger to catch up.
  int CheckUsage();
  // The exposure checks (see the header); `phase` names the moment in the lines they print.
  void CheckExposures(const std::string& phase);
  // An active allocation's endpoints (its read model) against ingress's exposures of it;
  // returns the endpoints that are not active there.
  int CheckEndpoints(const v1::Allocation& a, const std::string& phase);
  // Every exposure ingress has in `states` (nullopt when ingress did not answer).
  std::optional<std::vector<v1::Exposure>> Exposures(const std::vector<v1::ExposureState>& states);
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req,
                    std::chrono::milliseconds timeout = 10s) {
    return rpc::Client(conn_).Call<Resp>(subject, req, timeout);
  }
  // Retries a request while the platform answers with a retryable error (or not at all).
  template <typename Resp, typename Req>
  Result<Resp> Insist(const std::string& subject, const Req& req,
                      std::chrono::seconds patience = 180s) {
    const auto until = Clock::now() + patience;
    while (true) {
      auto r = Call<Resp>(subject, req, 5s);
      if (r.ok() || !r.error().retryable || r.error().reason == "no_placement" ||
          Clock::now() > until) {
        return r;
      }
      std::this_thread::sleep_for(200ms);
    }
  }
  // Every slot of the scheduler's projection, page by page (each page insisted on).
  Result<std::vector<v1::ProjectedSlot>> ProjectedSlots(std::chrono::seconds patience) {
    std::vector<v1::ProjectedSlot> out;
    v1::ListProjectedSlotsRequest req;
    req.set_page_size(1000);
    do {
      auto l =
          Insist<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", req, patience);
      if (!l.ok()) return l.error();
      out.insert(out.end(), l->slots().begin(), l->slots().end());
      req.set_page_token(l->next_page_token());
    } while (!req.page_token().empty());
    return out;
  }
  std::vector<std::string> StreamEvents(const std::string& stream, std::vector<v1::Event>* events);
  std::string Dsn(const std::string& service) const { return dsn_.at(service); }

  Options o_;
  std::mt19937_64 rng_;
  std::mutex rng_mu_;
  std::unique_ptr<testing::TestNats> nats_;
  std::unique_ptr<testing::TestPostgres> pg_;
  std::unique_ptr<testing::TestHaPostgres> ha_;  // instead of pg_ with --ha
  std::map<std::string, std::string> dsn_;
  std::vector<std::unique_ptr<ServiceNet>> nets_;  // outlives the members inside them
  std::vector<std::unique_ptr<Member>> members_;
  std::mutex members_mu_;
  std::shared_ptr<messaging::Connection> conn_;
  std::atomic<bool> churning_{true};
  std::atomic<bool> faulting_{true};
  std::atomic<int> faults_{0};
  std::atomic<int> pg_faults_{0};
  int failovers_ = 0;         // Failover() only
  int disk_fulls_ = 0;        // DiskFull() only
  double promote_max_s_ = 0;  // kill to the monitor's new primary, the longest seen
  double ready_max_s_ = 0;    // kill to every service ready again, the longest seen
  int failover_stalls_ = 0;   // a failover that never promoted, or services never ready
  std::atomic<int> nats_faults_{0};
  std::atomic<int> net_faults_{0};
  double net_recover_max_s_ = 0;  // heal to /readyz 200 again, the longest seen (NetFaults only)
  int net_stalls_ = 0;            // a service not ready within 180 s of its network's heal
  std::atomic<int> crashed_{0};
  std::atomic<int> start_failures_{0};
  std::atomic<int> placements_{0};
  std::atomic<int> no_placement_{0};
  std::atomic<int> create_errors_{0};
  std::atomic<int> exposed_{0};            // placements created with endpoints
  std::atomic<int> endpoints_checked_{0};  // endpoints of active allocations checked in ingress
  std::atomic<int> endpoint_not_active_{0};
  int exposure_leaked_ = 0;
  int pool_used_diff_ = 0;
  int endpoint_shared_ = 0;
  int live_exposures_kept_ = 0;  // live exposures when the kept allocations had settled
  // A node's drained window: from its drain's answer to its undrain's request (Unix seconds).
  struct DrainWindow {
    std::string node;
    double from = 0;
    double to = 0;
  };
  std::vector<DrainWindow> drains_;  // written by HostOps only, read after it joined
  std::atomic<int> host_op_errors_{0};
  int mode_changes_ = 0;  // completed (applied) mode changes; HostOps only
  std::mutex allocs_mu_;
  std::set<std::string> acknowledged_;  // allocation ids a create answered with
  std::map<std::string, int> failed_by_reason_;
  int failures_ = 0;
  int usage_records_ = 0;           // billable records the ledger wrote
  int64_t usage_max_slack_us_ = 0;  // the largest per-allocation difference seen, in GPU-us
  std::string report_;
};

void Campaign::Spawn(Member& m) {
  m.proc = std::make_unique<Process>();
  m.proc->Spawn(m.argv, m.log, m.env);
}

void Campaign::StartPlatform() {
  nats_ = std::make_unique<testing::TestNats>();
  if (o_.ha) {
    ha_ = std::make_unique<testing::TestHaPostgres>(o_.disk_full ? 1024 : 0);
    Say("postgres: pg_auto_failover formation up\n" + ha_->State());
  } else {
    pg_ = std::make_unique<testing::TestPostgres>(/*fsync=*/true);
  }
  const std::string svc_bin = o_.bin_dir + "/services";
  const std::vector<std::string> services = {"inventory", "scheduler",  "ipam",
                                             "ingress",   "console-gw", "usage"};
  for (const auto& s : services) {
    const std::string db = s == "console-gw" ? "console_gw" : s;
    dsn_[s] = o_.ha ? ha_->CreateDatabase(db) : pg_->CreateDatabase(db);
    auto env = nats_->Env(s);
    env["GPUAAS_POSTGRES_DSN"] = dsn_[s];
    auto m = std::make_unique<Member>();
    m->name = s;
    m->http_port = testing::FreePort();
    env["GPUAAS_HTTP_PORT"] = std::to_string(m->http_port);
    env["GPUAAS_SERVICE_INSTANCE_ID"] = s + "-1";
    env["GPUAAS_LOG_LEVEL"] = "info";
    if (s == "scheduler") env["GPUAAS_SCHEDULER_SWEEP_INTERVAL_MS"] = "1000";
    m->argv = {fmt::format("{}/{}/gpuaas-{}", svc_bin, s, s)};
    if (o_.net_faults) {
      // Inside its own namespace: the servers at the far end of its veth.
      nets_.push_back(std::make_unique<ServiceNet>(static_cast<int>(nets_.size()),
                                                   o_.bin_dir + "/tests/gpuaas-net-delay",
                                                   o_.out_dir + "/" + s + ".net-delay.log"));
      m->net = nets_.back().get();
      for (const char* k : {"GPUAAS_POSTGRES_DSN", "GPUAAS_NATS_URL"}) {
        env[k] = Rehost(env[k], m->net->host_ip());
      }
      m->argv = m->net->Wrap(m->argv);
      m->http_host = m->net->ns_ip();
    }
    m->env = EnvList(env);
    m->log = o_.out_dir + "/" + s + ".log";
    members_.push_back(std::move(m));
  }
  for (int i = 1; i <= o_.nodes; ++i) {
    const std::string id = fmt::format("chaos-node-{:02d}", i);
    const std::string root = o_.out_dir + "/hosts/" + id;
    node_agent::FixtureOptions fo;
    fo.gpus = 8;
    fo.hostname = id;
    auto built = node_agent::BuildFixtureHost(root, fo);
    if (!built.ok()) throw std::runtime_error(built.error().ToString());
    nats_->EnrollNode(id);
    auto env = nats_->Env("node-agent", id);
    env["GPUAAS_NODE_ID"] = id;
    env["GPUAAS_NODE_REGION"] = "us-east-1";
    env["GPUAAS_NODE_POOL"] = "h200";
    env["GPUAAS_NODE_STATE_DIR"] = o_.out_dir + "/agents/" + id;
    env["GPUAAS_NODE_REGISTER_RETRY_MS"] = "200";
    env["GPUAAS_NODE_DESIRED_POLL_MS"] = "500";
    env["GPUAAS_NODE_HOST_ROOT"] = root;
    env["GPUAAS_LIBVIRT_URI"] = "test:///default";
    env["GPUAAS_NODE_AGENT_SIM_BEHAVIOR"] = "succeed";
    env["GPUAAS_NODE_AGENT_SIM_STEP_MS"] = "20";
    // Exposure documents followed and acked without kernel rules; checked (and the document
    // fetched) every 250 ms, so an exposed slice is not held back by the agent's poll.
    env["GPUAAS_EXPOSURE_APPLY"] = "simulate";
    env["GPUAAS_NETWORK_REPORT_MS"] = "250";
    env["GPUAAS_LOG_LEVEL"] = "info";
    auto m = std::make_unique<Member>();
    m->name = id;
    m->http_port = testing::FreePort();
    env["GPUAAS_HTTP_PORT"] = std::to_string(m->http_port);
    m->env = EnvList(env);
    m->argv = {svc_bin + "/node-agent/gpuaas-node-agent"};
    m->log = o_.out_dir + "/" + id + ".log";
    members_.push_back(std::move(m));
  }
  for (auto& m : members_) Spawn(*m);
  for (auto& m : members_) {
    if (!WaitFor([&] { return HttpOk(*m, "/readyz"); }, 120s, 100ms)) {
      throw std::runtime_error(m->name + " not ready; see " + m->log);
    }
  }
  auto c = messaging::Connection::Connect(nats_->Options(testing::TestNats::kHarness),
                                          log::Logger("chaos", "c", log::Level::kError));
  if (!c.ok()) throw std::runtime_error(c.error().ToString());
  conn_ = *c;
  // The campaign's own operator token outlives the longest run (the default test token lasts
  // 10 minutes).
  conn_->SetRequestToken(nats_->Token("operator", "", "chaos", std::chrono::hours(12)));
  // Every node's slots approved, as an operator does, and schedulable.
  for (int i = 1; i <= o_.nodes; ++i) {
    const std::string id = fmt::format("chaos-node-{:02d}", i);
    if (!WaitFor(
            [&] {
              v1::ShowNodeRequest r;
              r.set_node_id(id);
              auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
              return s.ok() && s->snapshot_version() >= 1;
            },
            60s, 100ms)) {
      throw std::runtime_error(id + " reported no topology");
    }
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(id);
    auto a = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    if (!a.ok()) throw std::runtime_error("approve " + id + ": " + a.error().ToString());
    // Its public ports: a node holds at most 8 slices of at most 2 endpoints, so the default 64
    // ports never run out (an exposure holds its port until the node acked its removal, and the
    // slot's cleanup waits for that).
    v1::SetEndpointPoolRequest pr;
    auto* pool = pr.mutable_pool();
    pool->set_name(id + "-ports");
    pool->set_kind(v1::ENDPOINT_POOL_KIND_PORT_RANGE);
    pool->set_region("us-east-1");
    pool->set_node_id(id);
    pool->add_addresses(fmt::format("198.51.100.{}", i));
    pool->set_port_min(20000);
    pool->set_port_max(20000 + o_.pool_ports - 1);
    auto ps = Insist<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", pr, 60s);
    if (!ps.ok()) throw std::runtime_error("pool.set " + id + ": " + ps.error().ToString());
  }
  if (!WaitFor(
          [&] {
            auto l = ProjectedSlots(10s);
            int ok = 0;
            if (l.ok()) {
              for (const auto& s : *l) ok += s.schedulable() ? 1 : 0;
            }
            return ok == 8 * o_.nodes;
          },
          60s, 100ms)) {
    throw std::runtime_error("the scheduler never saw every slot schedulable");
  }
  Say(fmt::format(
      "platform up: {} services, {} node-agents, {} schedulable slots, {} public ports each", 5,
      o_.nodes, 8 * o_.nodes, o_.pool_ports));
}

// Restarts whatever died without being taken down on purpose; a death by a signal we did not
// send is a crash.
void Campaign::Supervise() {
  while (faulting_ || churning_) {
    {
      std::lock_guard lock(members_mu_);
      for (auto& m : members_) {
        if (m->down || m->proc->Running()) continue;
        const int st = m->proc->last_status();
        if (st >= 0 && WIFSIGNALED(st)) {
          crashed_++;
          Say(fmt::format("CRASH {} died by signal {}; see {}", m->name, WTERMSIG(st), m->log));
        } else {
          // A service started while the database was down exits after its start timeout; an
          // orchestrator restarts it, and so do we.
          start_failures_++;
          Say(fmt::format("{} exited (status {}); restarting", m->name,
                          st >= 0 && WIFEXITED(st) ? WEXITSTATUS(st) : -1));
        }
        Spawn(*m);
      }
    }
    std::this_thread::sleep_for(200ms);
  }
}

// Two fault streams run at once: `servers` takes PostgreSQL (2 of 3) or nats-server down, the
// other kills the services and node-agents; so a service may be killed during a database outage.
void Campaign::Faults(bool servers) {
  std::vector<Member*> bag;
  const bool only_failovers = o_.faults == "failover";
  if (only_failovers && !servers) return;
  while (churning_ || faults_ < o_.min_faults) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(o_.fault_gap_ms / 2 + Pick(0, o_.fault_gap_ms)));
    // One draw decides: PostgreSQL (2 in 3, or always with --faults failover) or nats-server.
    const bool database = only_failovers || Pick(0, 2) < 2;
    if (servers && database && o_.ha) {
      if (o_.disk_full && Pick(0, 2) == 0) {
        DiskFull(Pick(1, o_.max_pg_outage_s));
      } else {
        Failover(Pick(1, o_.max_pg_outage_s));
      }
    } else if (servers && database) {
      // PostgreSQL: outages from 1 s to the longest asked for (a failover, a restart).
      const int outage = Pick(1, o_.max_pg_outage_s);
      Say(fmt::format("fault {}: kill -9 postgres, {} s outage", faults_ + 1, outage));
      pg_->Kill();
      faults_++;
      pg_faults_++;
      std::this_thread::sleep_for(std::chrono::seconds(outage));
      pg_->Start();
    } else if (servers) {
      const int outage = Pick(1, o_.max_outage_s);
      Say(fmt::format("fault {}: kill -9 nats-server, {} s outage", faults_ + 1, outage));
      nats_->Kill();
      faults_++;
      nats_faults_++;
      std::this_thread::sleep_for(std::chrono::seconds(outage));
      nats_->Start();
    } else {
      // Every service and node-agent in turn, in a shuffled order, so even a short run kills
      // each of them.
      if (bag.empty()) {
        for (auto& mm : members_) bag.push_back(mm.get());
        std::lock_guard lock(rng_mu_);
        std::shuffle(bag.begin(), bag.end(), rng_);
      }
      Member* m = bag.back();
      bag.pop_back();
      const int outage = Pick(1, o_.max_outage_s);
      Say(fmt::format("fault {}: kill -9 {}, {} s outage", faults_ + 1, m->name, outage));
      {
        std::lock_guard lock(members_mu_);
        m->down = true;
        m->proc->Kill();
      }
      faults_++;
      std::this_thread::sleep_for(std::chrono::seconds(outage));
      std::lock_guard lock(members_mu_);
      Spawn(*m);
      m->down = false;
    }
  }
}

void Campaign::DiskFull(int outage) {
  const int primary = ha_->Primary();
  if (primary < 0) {
    Say("disk fault skipped: the formation has no settled primary\n" + ha_->State());
    return;
  }
  Say(fmt::format("fault {}: the primary's disk full (node{}) for {} s", faults_ + 1, primary + 1,
                  outage));
  ha_->FillDisk(primary);
  faults_++;
  pg_faults_++;
  disk_fulls_++;
  std::this_thread::sleep_for(std::chrono::seconds(outage));
  ha_->FreeDisk(primary);
  // A keeper whose PostgreSQL could not start again may have given up and exited.
  for (int i = 0; i < testing::TestHaPostgres::kNodes; ++i) {
    if (!ha_->NodeRunning(i)) ha_->StartNode(i);
  }
  if (!WaitFor([&] { return ha_->HasSecondary(); }, 180s, 200ms)) {
    failover_stalls_++;
    Say("DISK FAULT STALLED: no primary and standby again after the disk was freed\n" +
        ha_->State());
    return;
  }
  Say(fmt::format("disk freed; primary node{}\n{}", ha_->Primary() + 1, ha_->State()));
}

void Campaign::Failover(int outage) {
  const int old = ha_->Primary();
  if (old < 0) {
    Say("failover skipped: the formation has no settled primary\n" + ha_->State());
    return;
  }
  const auto t0 = Clock::now();
  Say(
      fmt::format("fault {}: kill -9 the primary's machine (node{}: keeper and postgres), {} s "
                  "until it is back",
                  faults_ + 1, old + 1, outage));
  ha_->KillNode(old);
  faults_++;
  pg_faults_++;
  failovers_++;
  const auto secs = [&] { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  if (!WaitFor([&] { return ha_->Primary() == 1 - old; }, 120s, 100ms)) {
    failover_stalls_++;
    Say("FAILOVER STALLED: the standby was never promoted\n" + ha_->State());
  } else {
    const double promoted = secs();
    promote_max_s_ = std::max(promote_max_s_, promoted);
    // Ready again: every service answers /readyz 200 (each reaches the new primary).
    const bool ready = WaitFor(
        [&] {
          std::lock_guard lock(members_mu_);
          for (auto& m : members_) {
            if (m->name.rfind("chaos-node", 0) == 0 || m->net_faulted) continue;
            if (m->down || !HttpOk(*m, "/readyz")) return false;
          }
          return true;
        },
        120s, 100ms);
    if (!ready) failover_stalls_++;
    ready_max_s_ = std::max(ready_max_s_, secs());
    Say(fmt::format("failover: node{} promoted after {:.1f} s, every service ready after {:.1f} s",
                    2 - old, promoted, secs()));
  }
  std::this_thread::sleep_for(std::chrono::seconds(outage));
  ha_->StartNode(old);
  if (!WaitFor([&] { return ha_->HasSecondary(); }, 180s, 200ms)) {
    failover_stalls_++;
    Say("FAILOVER STALLED: the old primary never rejoined as the standby\n" + ha_->State());
  }
}

void Campaign::NetFaults() {
  std::vector<Member*> services;
  for (auto& m : members_) {
    if (m->net != nullptr) services.push_back(m.get());
  }
  std::vector<int> pg_ports;
  if (o_.ha) {
    for (int i = 0; i < testing::TestHaPostgres::kNodes; ++i) pg_ports.push_back(ha_->port(i));
  } else {
    pg_ports.push_back(pg_->port());
  }
  const std::vector<int> nats_ports = {nats_->port()};
  while (churning_) {
    std::this_thread::sleep_for(
        std::chrono::milliseconds(o_.fault_gap_ms / 2 + Pick(0, o_.fault_gap_ms)));
    if (!churning_) break;
    Member* m = services[static_cast<size_t>(Pick(0, static_cast<int>(services.size()) - 1))];
    const auto kind = static_cast<NetFault>(Pick(0, 3));
    const int secs = Pick(5, std::max(5, o_.max_net_fault_s));
    Say(fmt::format("fault {}: {}, {} for {} s", faults_ + 1, m->name, NetFaultName(kind), secs));
    m->net_faulted = true;
    m->net->Inject(kind, kind == NetFault::kPartitionNats ? nats_ports : pg_ports);
    faults_++;
    net_faults_++;
    std::this_thread::sleep_for(std::chrono::seconds(secs));
    m->net->Heal();
    const auto healed = Clock::now();
    // Ready again (a kill of it meanwhile is waited out too).
    const bool ready = WaitFor([&] { return !m->down && HttpOk(*m, "/readyz"); }, 180s, 200ms);
    const double took = std::chrono::duration<double>(Clock::now() - healed).count();
    m->net_faulted = false;
    if (!ready) {
      net_stalls_++;
      Say(fmt::format("NET STALL {}: not ready 180 s after its network healed; see {}", m->name,
                      m->log));
    } else {
      net_recover_max_s_ = std::max(net_recover_max_s_, took);
      Say(fmt::format("{}: network healed, ready again after {:.1f} s", m->name, took));
    }
  }
}

double UnixNow() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

void Campaign::HostOps() {
  for (int i = 0; churning_; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(Pick(1000, 4000)));
    if (!churning_) break;
    const std::string node = fmt::format("chaos-node-{:02d}", i % o_.nodes + 1);
    v1::DrainNodeRequest drain;
    drain.set_node_id(node);
    drain.set_reason("chaos");
    auto d = Insist<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.drain", drain, 120s);
    DrainWindow w{node, UnixNow(), 0};
    if (!d.ok()) {
      host_op_errors_++;
      Say(fmt::format("HOST OP drain of {} not answered: {}", node, d.error().ToString()));
    } else {
      Say(fmt::format("host op: {} draining, held by {}", node, d->holding_allocations_size()));
    }
    const auto until = Clock::now() + std::chrono::milliseconds(Pick(2000, 6000));
    while (churning_ && Clock::now() < until) std::this_thread::sleep_for(100ms);
    if (d.ok() && churning_) RoundTripMode(node);
    w.to = UnixNow();
    v1::NodeAdminRequest undrain;
    undrain.set_node_id(node);
    undrain.set_reason("chaos done");
    auto u = Insist<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.undrain", undrain, 120s);
    if (!u.ok()) {
      host_op_errors_++;
      Say(fmt::format("HOST OP undrain of {} not answered: {}", node, u.error().ToString()));
    }
    if (d.ok()) drains_.push_back(w);
  }
}

std::optional<v1::Node> Campaign::InventoryNode(const std::string& node) {
  v1::ShowNodeRequest show;
  show.set_node_id(node);
  auto s = Insist<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show, 60s);
  if (!s.ok()) return std::nullopt;
  return s->node();
}

bool Campaign::ChangeMode(const std::string& node, v1::CapacityProfile mode) {
  v1::ChangeNodeModeRequest r;
  r.set_node_id(node);
  r.set_mode(mode);
  r.set_reason("chaos");
  auto asked = Insist<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", r, 120s);
  // Asked again after an answer that was lost: the change is already open.
  if (!asked.ok() && asked.error().reason != "mode_change_in_progress") {
    Say(fmt::format("HOST OP mode {} of {} not answered: {}", enums::Text(mode), node,
                    asked.error().ToString()));
    return false;
  }
  // Closed once the agent (killed or not) acked the desired set that carries it.
  std::optional<v1::Node> n;
  WaitFor(
      [&] {
        n = InventoryNode(node);
        return n && n->mode_target() == v1::CAPACITY_PROFILE_UNSPECIFIED;
      },
      180s, 200ms);
  if (!n || n->mode_target() != v1::CAPACITY_PROFILE_UNSPECIFIED || n->capacity_profile() != mode) {
    Say(fmt::format("HOST OP mode {} of {} did not close: {}", enums::Text(mode), node,
                    n ? n->ShortDebugString() : "no answer"));
    return false;
  }
  return true;
}

void Campaign::RoundTripMode(const std::string& node) {
  // Only a drained node changes mode: one its slices have left within the drain's window.
  auto n = InventoryNode(node);
  if (!n || n->admin_state() != v1::NODE_ADMIN_STATE_DRAINED) return;
  if (!ChangeMode(node, v1::CAPACITY_PROFILE_BAREMETAL) ||
      !ChangeMode(node, v1::CAPACITY_PROFILE_SLICE_VM)) {
    host_op_errors_++;
    return;
  }
  mode_changes_ += 2;
  // Back in slice-vm its slots need an operator's approval again.
  v1::ApproveSlotsRequest approve;
  approve.set_node_id(node);
  auto a = Insist<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve, 120s);
  if (!a.ok()) {
    host_op_errors_++;
    Say(fmt::format("HOST OP approval of {} after its mode changes: {}", node,
                    a.error().ToString()));
    return;
  }
  Say(fmt::format("host op: {} went to baremetal and back, slots approved", node));
}

void Campaign::Churn(int worker) {
  std::mt19937_64 rng(o_.seed * 7919 + static_cast<uint64_t>(worker));
  const int sizes[] = {1, 2, 4, 8};
  for (int i = 0; churning_; ++i) {
    v1::CreateAllocationRequest r;
    r.set_tenant(fmt::format("tenant-{}", worker));
    r.set_request_id(fmt::format("chaos-{}-{}-{}", o_.seed, worker, i));
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(sizes[std::uniform_int_distribution<int>(0, 3)(rng)]);
    r.set_region("us-east-1");
    r.set_pool("h200");
    r.add_ssh_authorized_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA chaos");
    // A share of the slices expose their SSH (a third of those a second endpoint too): ingress
    // reserves the public ports at placement and the slice is active only once the node acked
    // them.
    const bool expose = std::uniform_int_distribution<int>(0, 99)(rng) < o_.expose_percent;
    if (expose) {
      auto* e = r.add_expose();
      e->set_name("ssh");
      e->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
      e->set_port(22);
      if (std::uniform_int_distribution<int>(0, 2)(rng) == 0) {
        auto* j = r.add_expose();
        j->set_name("jupyter");
        j->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
        j->set_port(8888);
      }
    }
    // The same request id until it is answered: a create is idempotent by (tenant, request id).
    auto c = Insist<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r);
    if (!c.ok()) {
      if (c.error().reason == "no_placement" || c.error().code == Code::kResourceExhausted) {
        no_placement_++;
        std::this_thread::sleep_for(300ms);
      } else {
        // A create refused for good is a finding; the campaign stops churning (one line, not
        // one per attempt).
        if (create_errors_++ < 5) Say("create failed: " + c.error().ToString());
        if (c.error().code == Code::kUnauthenticated || c.error().code == Code::kPermissionDenied) {
          churning_ = false;
        }
      }
      continue;
    }
    const std::string id = c->allocation().allocation_id();
    {
      std::lock_guard lock(allocs_mu_);
      acknowledged_.insert(id);
    }
    placements_++;
    if (expose) exposed_++;
    // Held for a moment once active (or until it failed), then released.
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    const auto until = Clock::now() + 120s;
    while (churning_ && Clock::now() < until) {
      auto now = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g, 5s);
      if (now.ok()) {
        const auto state = now->allocation().state();
        if (state == v1::ALLOCATION_STATE_ACTIVE && now->allocation().endpoints_size() > 0) {
          // Active with endpoints: each one is active in ingress right now, under faults.
          endpoint_not_active_ += CheckEndpoints(now->allocation(), "churn");
        }
        if (state == v1::ALLOCATION_STATE_ACTIVE || state == v1::ALLOCATION_STATE_FAILED ||
            state == v1::ALLOCATION_STATE_RELEASED) {
          break;
        }
      }
      std::this_thread::sleep_for(200ms);
    }
    // A slice with endpoints in hand when the churn ends is kept, so the exposure checks see
    // live exposures (SettleKept); Settle releases it.
    if (expose && !churning_) continue;
    std::this_thread::sleep_for(
        std::chrono::milliseconds(std::uniform_int_distribution<int>(0, 1500)(rng)));
    v1::ReleaseAllocationRequest rel;
    rel.set_allocation_id(id);
    auto x = Insist<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel);
    if (!x.ok() && x.error().code != Code::kFailedPrecondition) {
      Say("release " + id + " failed: " + x.error().ToString());
    }
  }
}

// Reads every message of `stream` (as the harness); returns their subjects and fills `events`.
std::vector<std::string> Campaign::StreamEvents(const std::string& stream,
                                                std::vector<v1::Event>* events) {
  std::vector<std::string> subjects;
  auto last = messaging::StreamLastSequence(*conn_, stream);
  if (!last.ok()) throw std::runtime_error(last.error().ToString());
  for (uint64_t seq = 1; seq <= *last; ++seq) {
    natsMsg* m = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus s = js_GetMsg(&m, conn_->js(), stream.c_str(), seq, nullptr, &jerr);
    if (s != NATS_OK) continue;  // deleted (a discarded dead letter)
    v1::Event ev;
    const int len = natsMsg_GetDataLength(m);
    if (!ev.ParseFromArray(natsMsg_GetData(m), len)) ev.Clear();
    events->push_back(ev);  // aligned with `subjects`
    subjects.emplace_back(natsMsg_GetSubject(m));
    natsMsg_Destroy(m);
  }
  return subjects;
}

int Campaign::CheckEndpoints(const v1::Allocation& a, const std::string& phase) {
  v1::ListExposuresRequest lr;
  lr.set_allocation_id(a.allocation_id());
  auto l = Insist<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", lr, 60s);
  if (!l.ok()) {
    Say(fmt::format("ENDPOINT ({}) {}: ingress did not list its exposures: {}", phase,
                    a.allocation_id(), l.error().ToString()));
    return a.endpoints_size();
  }
  int bad = 0;
  for (const auto& ep : a.endpoints()) {
    endpoints_checked_++;
    const v1::Exposure* found = nullptr;
    for (const auto& e : l->exposures()) {
      if (e.exposure_id() == ep.exposure_id()) found = &e;
    }
    const bool live_state = found && (found->state() == v1::EXPOSURE_STATE_ACTIVE ||
                                      found->state() == v1::EXPOSURE_STATE_DRIFT);
    if (ep.state() != v1::EXPOSURE_STATE_ACTIVE && ep.state() != v1::EXPOSURE_STATE_DRIFT) {
      bad++;
      Say(fmt::format("ENDPOINT NOT ACTIVE ({}) {} {}: the scheduler has it {}", phase,
                      a.allocation_id(), ep.name(), enums::Text(ep.state())));
    } else if (!live_state || found->public_port() <= 0 || found->public_ip().empty() ||
               found->public_ip() != ep.public_ip() || found->public_port() != ep.public_port()) {
      bad++;
      Say(fmt::format("ENDPOINT NOT ACTIVE ({}) {} {}: scheduler {} {}:{}, ingress {}", phase,
                      a.allocation_id(), ep.name(), ep.exposure_id(), ep.public_ip(),
                      ep.public_port(),
                      found ? fmt::format("{} {}:{}", enums::Text(found->state()),
                                          found->public_ip(), found->public_port())
                            : std::string("has no such exposure")));
    }
  }
  return bad;
}

std::optional<std::vector<v1::Exposure>> Campaign::Exposures(
    const std::vector<v1::ExposureState>& states) {
  std::vector<v1::Exposure> out;
  for (const auto st : states) {
    v1::ListExposuresRequest lr;
    lr.set_state(st);
    auto l = Insist<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", lr, 60s);
    if (!l.ok()) return std::nullopt;
    // The list holds at most 1000; a settled platform has far fewer live exposures.
    if (l->exposures_size() >= 1000) Say("WARNING: exposure list truncated at 1000");
    out.insert(out.end(), l->exposures().begin(), l->exposures().end());
  }
  return out;
}

const std::vector<v1::ExposureState> kLiveExposure = {
    v1::EXPOSURE_STATE_REQUESTED, v1::EXPOSURE_STATE_APPLYING, v1::EXPOSURE_STATE_ACTIVE,
    v1::EXPOSURE_STATE_DRIFT, v1::EXPOSURE_STATE_REMOVING};
const std::vector<v1::ExposureState> kMovingExposure = {
    v1::EXPOSURE_STATE_REQUESTED, v1::EXPOSURE_STATE_APPLYING, v1::EXPOSURE_STATE_REMOVING};

void Campaign::CheckExposures(const std::string& phase) {
  // The scheduler's allocations: state, and whether any claim is still held.
  struct Alloc {
    std::string state;
    bool claims_held = false;
  };
  std::map<std::string, Alloc> allocs;
  {
    pqxx::connection db(Dsn("scheduler"));
    pqxx::nontransaction tx(db);
    for (const auto& row :
         tx.exec("SELECT a.allocation_id::text, a.state, EXISTS (SELECT 1 FROM "
                 "allocation_resource_claims c WHERE c.allocation_id = a.allocation_id AND "
                 "c.released_at IS NULL) FROM allocations a")) {
      allocs[row[0].as<std::string>()] = {row[1].as<std::string>(), row[2].as<bool>()};
    }
  }
  // (a) every active allocation's endpoints active in ingress.
  int active_exposed = 0;
  for (const auto& [id, a] : allocs) {
    if (a.state != "active") continue;
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    auto got = Insist<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g, 60s);
    if (!got.ok()) {
      endpoint_not_active_++;
      Say(fmt::format("ENDPOINT ({}) {}: allocation.get failed: {}", phase, id,
                      got.error().ToString()));
      continue;
    }
    if (got->allocation().endpoints_size() == 0) continue;
    active_exposed++;
    endpoint_not_active_ += CheckEndpoints(got->allocation(), phase);
  }
  // (c) needs the pools and the exposures at one moment: read the pools around the exposures
  // and take a round where they did not move.
  std::vector<v1::Exposure> live;
  std::map<std::string, int64_t> used;
  for (int round = 0;; ++round) {
    auto pools = [&] {
      std::map<std::string, int64_t> out;
      v1::ListEndpointPoolsRequest pr;
      auto l = Insist<v1::ListEndpointPoolsResponse>("gpuaas.v1.ingress.pool.list", pr, 60s);
      if (!l.ok()) throw std::runtime_error("pool.list: " + l.error().ToString());
      for (const auto& p : l->pools()) out[p.name()] = p.used();
      return out;
    };
    const auto before = pools();
    auto ex = Exposures(kLiveExposure);
    if (!ex) throw std::runtime_error("ingress did not list its exposures");
    used = pools();
    live = std::move(*ex);
    if (used == before || round == 4) break;
    std::this_thread::sleep_for(1s);
  }
  // (b) no live exposure of an allocation that is gone.
  for (const auto& e : live) {
    auto it = allocs.find(e.allocation_id());
    const bool gone = it == allocs.end() || it->second.state == "released" ||
                      (it->second.state == "failed" && !it->second.claims_held);
    if (gone) {
      exposure_leaked_++;
      Say(fmt::format("EXPOSURE LEAKED ({}) {} {} {} {}:{} of allocation {} ({})", phase,
                      e.exposure_id(), e.name(), enums::Text(e.state()), e.public_ip(),
                      e.public_port(), e.allocation_id(),
                      it == allocs.end() ? "unknown to the scheduler" : it->second.state));
    }
  }
  // (c) each pool's used = its live exposures (port_range: one port each).
  std::map<std::string, int64_t> held;
  for (const auto& e : live) held[e.pool()]++;
  for (const auto& [pool, n] : used) {
    const int64_t h = held.count(pool) ? held[pool] : 0;
    if (n != h) {
      pool_used_diff_ += static_cast<int>(std::abs(n - h));
      Say(fmt::format("POOL USED ({}) {}: used={} but {} live exposures hold it", phase, pool, n,
                      h));
    }
  }
  for (const auto& [pool, n] : held) {
    if (!used.count(pool)) {
      pool_used_diff_ += static_cast<int>(n);
      Say(fmt::format("POOL USED ({}) {}: {} live exposures of a pool that is not listed", phase,
                      pool, n));
    }
  }
  // (d) no public ip:port held twice.
  std::map<std::string, std::vector<std::string>> by_endpoint;
  for (const auto& e : live) {
    by_endpoint[fmt::format("{}:{}", e.public_ip(), e.public_port())].push_back(e.exposure_id());
  }
  for (const auto& [endpoint, ids] : by_endpoint) {
    if (ids.size() > 1) {
      endpoint_shared_ += static_cast<int>(ids.size()) - 1;
      Say(fmt::format("ENDPOINT SHARED ({}) {} by {} exposures", phase, endpoint, ids.size()));
    }
  }
  if (phase == "kept") live_exposures_kept_ = static_cast<int>(live.size());
  Say(fmt::format("exposures ({}): {} active allocations with endpoints, {} live exposures", phase,
                  active_exposed, live.size()));
}

// After the churn, with the slices the workers kept: wait until every allocation is active or
// terminal (a failed one with its claims freed) and no exposure is on its way
// (requested/applying/removing), then check the exposures with live ones in place.
void Campaign::SettleKept() {
  // One more 1-GPU slice with SSH per worker, created after the faults, so the check always has
  // live exposures (the workers keep only a slice with endpoints they happened to hold).
  for (int w = 0; w < o_.workers; ++w) {
    v1::CreateAllocationRequest r;
    r.set_tenant(fmt::format("tenant-{}", w));
    r.set_request_id(fmt::format("chaos-{}-{}-kept", o_.seed, w));
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(1);
    r.set_region("us-east-1");
    r.set_pool("h200");
    auto* e = r.add_expose();
    e->set_name("ssh");
    e->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
    e->set_port(22);
    // The churn's last slices may still be releasing: no_placement is retried for a while.
    const auto until = Clock::now() + 60s;
    auto c = Insist<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r, 60s);
    while (!c.ok() && c.error().code == Code::kResourceExhausted && Clock::now() < until) {
      std::this_thread::sleep_for(500ms);
      c = Insist<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r, 60s);
    }
    if (!c.ok()) {
      if (c.error().code != Code::kResourceExhausted) create_errors_++;
      Say("kept slice not created: " + c.error().ToString());
      continue;
    }
    std::lock_guard lock(allocs_mu_);
    acknowledged_.insert(c->allocation().allocation_id());
    placements_++;
    exposed_++;
  }
  Say("settling: the kept slices active, everything else terminal");
  pqxx::connection db(Dsn("scheduler"));
  const bool settled = WaitFor(
      [&] {
        pqxx::nontransaction tx(db);
        if (tx.exec1("SELECT count(*) FROM allocations a WHERE a.state NOT IN ('active', "
                     "'released', 'failed') OR (a.state = 'failed' AND EXISTS (SELECT 1 FROM "
                     "allocation_resource_claims c WHERE c.allocation_id = a.allocation_id AND "
                     "c.released_at IS NULL))")[0]
                .as<int>() > 0) {
          return false;
        }
        v1::ListExposuresRequest lr;
        for (const auto st : kMovingExposure) {
          lr.set_state(st);
          auto l = Call<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", lr, 5s);
          if (!l.ok() || l->exposures_size() > 0) return false;
        }
        return true;
      },
      180s, 500ms);
  if (!settled) Say("not settled after 180 s; checking as it is");
  CheckExposures("kept");
}

// After the churn: every allocation released, and everything quiet.
void Campaign::Settle() {
  Say("settling: releasing what is left");
  pqxx::connection db(Dsn("scheduler"));
  auto open = [&] {
    pqxx::nontransaction tx(db);
    std::vector<std::string> ids;
    for (const auto& row : tx.exec("SELECT allocation_id::text FROM allocations WHERE state NOT IN "
                                   "('released', 'failed')")) {
      ids.push_back(row[0].as<std::string>());
    }
    return ids;
  };
  const auto deadline = Clock::now() + 300s;
  while (Clock::now() < deadline) {
    auto ids = open();
    if (ids.empty()) break;
    for (const auto& id : ids) {
      v1::ReleaseAllocationRequest rel;
      rel.set_allocation_id(id);
      (void)Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel, 5s);
    }
    std::this_thread::sleep_for(2s);
  }
  // Quiet: every outbox published, every consumer caught up.
  WaitFor(
      [&] {
        for (const auto& s : {"inventory", "scheduler", "ipam", "ingress", "usage"}) {
          pqxx::connection c(Dsn(s));
          pqxx::nontransaction tx(c);
          if (tx.exec1("SELECT count(*) FROM outbox WHERE published_at IS NULL")[0].as<int>() > 0) {
            return false;
          }
        }
        return true;
      },
      120s, 500ms);
  // ... and every event consumer has acked everything in its stream. An event held unacked by
  // a service killed mid-batch comes back only after the consumer's ack wait (30 s), after the
  // events behind it were applied by the restarted service: checking before then would call it
  // lost.
  std::string behind;
  const bool caught_up = WaitFor(
      [&] {
        behind.clear();
        for (const auto& spec :
             {messaging::InventoryEventsStream(), messaging::NodeEventsStream(),
              messaging::IpamEventsStream(), messaging::SchedulerEventsStream(),
              messaging::IngressEventsStream(), messaging::ConsoleEventsStream()}) {
          auto names = messaging::ConsumerNames(*conn_, spec.name);
          if (!names.ok()) {
            behind = names.error().ToString();
            return false;
          }
          for (const auto& durable : *names) {
            auto n = messaging::ConsumerBacklog(*conn_, spec.name, durable);
            if (!n.ok() || *n > 0) {
              behind = fmt::format("{}/{}: {}", spec.name, durable,
                                   n.ok() ? std::to_string(*n) : n.error().ToString());
              return false;
            }
          }
        }
        return true;
      },
      120s, 500ms);
  if (!caught_up) Say("consumers still behind after 120 s: " + behind);
  // Every exposure off its node (the released slices' cleanup proofs waited for it).
  WaitFor(
      [&] {
        auto l = Exposures(kLiveExposure);
        return l && l->empty();
      },
      60s, 500ms);
  std::this_thread::sleep_for(3s);
}

std::pair<int, int> Campaign::CheckHostOps() {
  int placed = 0;
  int diff = 0;
  pqxx::connection db(Dsn("scheduler"));
  pqxx::nontransaction tx(db);
  // A claim written (claimed_at is clock_timestamp()) after the drain was answered, before the
  // undrain: the drain's projection waited for every create that held the node's share lock.
  for (const auto& w : drains_) {
    for (const auto& row : tx.exec_params(
             "SELECT allocation_id::text FROM allocation_resource_claims WHERE node_id = $1 AND "
             "extract(epoch from claimed_at) > $2 AND extract(epoch from claimed_at) < $3",
             w.node, w.from, w.to)) {
      placed++;
      Say(fmt::format("PLACED ON DRAINING {}: {}", w.node, row[0].c_str()));
    }
  }
  for (int i = 1; i <= o_.nodes; ++i) {
    const std::string node = fmt::format("chaos-node-{:02d}", i);
    v1::ShowNodeRequest show;
    show.set_node_id(node);
    auto inv = Insist<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", show, 60s);
    v1::ListNodeHoldersRequest ask;
    ask.set_node_id(node);
    auto sched = Insist<v1::ListNodeHoldersResponse>("gpuaas.v1.scheduler.node.holders", ask, 60s);
    const bool ok = inv.ok() && sched.ok() &&
                    inv->node().admin_state() == v1::NODE_ADMIN_STATE_ACTIVE &&
                    sched->node().admin_state() == v1::NODE_ADMIN_STATE_ACTIVE &&
                    inv->node().capacity_profile() == v1::CAPACITY_PROFILE_SLICE_VM &&
                    inv->node().mode_target() == v1::CAPACITY_PROFILE_UNSPECIFIED &&
                    sched->node().capacity_profile() == v1::CAPACITY_PROFILE_SLICE_VM;
    if (!ok) {
      diff++;
      Say(fmt::format("NODE STATE {}: inventory {} / scheduler {}", node,
                      inv.ok() ? v1::NodeAdminState_Name(inv->node().admin_state()) : "?",
                      sched.ok() ? v1::NodeAdminState_Name(sched->node().admin_state()) : "?"));
    }
  }
  return {placed, diff};
}

int Campaign::CheckUsage() {
  // Expected: per allocation, GPUs x (first timeline row in state active .. first row after it
  // in releasing, released or failed), from the scheduler's own database.
  std::map<std::string, std::pair<int64_t, int64_t>> want;  // id -> {expected GPU-us, gpus}
  {
    pqxx::connection db(Dsn("scheduler"));
    pqxx::nontransaction tx(db);
    for (const auto& row : tx.exec(
             "SELECT a.allocation_id::text, a.gpu_count, "
             "(extract(epoch from s.stop_at - s.active_at) * 1000000)::bigint FROM allocations a "
             "JOIN LATERAL (SELECT min(at) FILTER (WHERE state = 'active') AS active_at, "
             "min(at) FILTER (WHERE state IN ('releasing', 'released', 'failed') AND at > "
             "(SELECT min(at) FROM allocation_timeline x WHERE x.allocation_id = a.allocation_id "
             "AND x.state = 'active')) AS stop_at FROM allocation_timeline t WHERE "
             "t.allocation_id = a.allocation_id) s ON true WHERE s.active_at IS NOT NULL")) {
      const int64_t gpus = row[1].as<int64_t>();
      want[row[0].as<std::string>()] = {gpus * (row[2].is_null() ? 0 : row[2].as<int64_t>()), gpus};
    }
  }
  const int64_t slack_us = o_.usage_slack_ms * 1000;
  int diff = 0;
  std::vector<std::string> lines;
  // The ledger may still be applying the last events: judge again until it agrees or 60 s.
  WaitFor(
      [&] {
        std::map<std::string, int64_t> got;
        pqxx::connection db(Dsn("usage"));
        pqxx::nontransaction tx(db);
        usage_records_ = 0;
        for (const auto& row : tx.exec(
                 "SELECT allocation_id, COALESCE(SUM(units_micro) FILTER (WHERE NOT EXISTS "
                 "(SELECT 1 FROM usage_records c WHERE c.corrects = r.record_id)), 0), count(*) "
                 "FROM usage_records r WHERE counts_as = 'billable' GROUP BY allocation_id")) {
          got[row[0].as<std::string>()] = row[1].as<int64_t>();
          usage_records_ += row[2].as<int>();
        }
        diff = 0;
        usage_max_slack_us_ = 0;
        lines.clear();
        for (const auto& [id, w] : want) {
          const auto it = got.find(id);
          const int64_t billed = it == got.end() ? -1 : it->second;
          const int64_t off = billed < 0 ? w.first : std::abs(billed - w.first);
          usage_max_slack_us_ = std::max(usage_max_slack_us_, off / std::max<int64_t>(w.second, 1));
          if (billed < 0 || off > 2 * slack_us * w.second) {
            diff++;
            lines.push_back(
                fmt::format("USAGE {}: billed {} GPU-us, timeline {}", id, billed, w.first));
          }
        }
        for (const auto& [id, billed] : got) {
          if (!want.count(id)) {
            diff++;
            lines.push_back(fmt::format("USAGE {}: billed {} GPU-us, never active", id, billed));
          }
        }
        return diff == 0;
      },
      60s, 2s);
  for (const auto& l : lines) Say(l);
  return diff;
}

void Campaign::Check() {
  CheckExposures("final");
  int double_booked = 0;
  int lost = 0;
  int stuck = 0;
  int duplicated = 0;
  int republished = 0;
  int out_of_order = 0;
  int projection_diff = 0;
  // --- double booking: no two claims on a slot ever overlapped in time ---
  {
    pqxx::connection db(Dsn("scheduler"));
    pqxx::nontransaction tx(db);
    auto r = tx.exec(
        "SELECT a.node_id, a.slot_key, a.allocation_id::text, b.allocation_id::text "
        "FROM allocation_resource_claims a JOIN allocation_resource_claims b "
        "ON a.node_id = b.node_id AND a.slot_key = b.slot_key AND a.kind = 'slot' AND "
        "b.kind = 'slot' AND a.allocation_id < b.allocation_id "
        "AND a.claimed_at < coalesce(b.released_at, 'infinity') "
        "AND b.claimed_at < coalesce(a.released_at, 'infinity')");
    for (const auto& row : r) {
      double_booked++;
      Say(fmt::format("DOUBLE BOOKED {}/{}: {} and {}", row[0].c_str(), row[1].c_str(),
                      row[2].c_str(), row[3].c_str()));
    }
    // --- stuck: everything terminal after the final release ---
    for (const auto& row :
         tx.exec("SELECT allocation_id::text, state FROM allocations WHERE state NOT IN "
                 "('released', 'failed')")) {
      stuck++;
      Say(fmt::format("STUCK {} in {}", row[0].c_str(), row[1].c_str()));
    }
    for (const auto& row :
         tx.exec("SELECT failure_code, count(*) FROM allocations WHERE state = 'failed' "
                 "GROUP BY 1")) {
      failed_by_reason_[row[0].as<std::string>()] = row[1].as<int>();
    }
    // Acknowledged creates exist.
    std::lock_guard lock(allocs_mu_);
    for (const auto& id : acknowledged_) {
      if (tx.exec_params("SELECT 1 FROM allocations WHERE allocation_id = $1::uuid", id).empty()) {
        lost++;
        Say("LOST acknowledged allocation " + id);
      }
    }
  }
  // --- exactly once, in order, nothing lost between outbox and stream ---
  // The outboxes first, then the streams: a row published by the time of this snapshot must be
  // in the stream read after it (the platform keeps publishing: ipam follows lease reports).
  struct OutboxRow {
    std::string service, id, subject;
    bool published = false;
    bool old = false;  // unpublished for more than a minute
  };
  std::vector<OutboxRow> outbox_rows;
  for (const std::string service : {"inventory", "scheduler", "ipam", "ingress", "usage"}) {
    pqxx::connection db(Dsn(service));
    pqxx::nontransaction tx(db);
    for (const auto& row : tx.exec("SELECT event_id::text, subject, published_at IS NOT NULL, "
                                   "created_at < now() - interval '60 seconds' "
                                   "FROM outbox ORDER BY seq")) {
      outbox_rows.push_back({service, row[0].as<std::string>(), row[1].as<std::string>(),
                             row[2].as<bool>(), row[3].as<bool>()});
    }
  }
  std::vector<v1::Event> node_events;
  const auto node_subjects = StreamEvents("GPUAAS_EVT_NODE", &node_events);
  std::set<std::string> in_streams;  // every event id the streams hold
  std::vector<v1::Event> ingress_events;
  std::vector<v1::Event> scheduler_events;
  const auto ingress_subjects = StreamEvents("GPUAAS_EVT_INGRESS", &ingress_events);
  const auto scheduler_subjects = StreamEvents("GPUAAS_EVT_SCHEDULER", &scheduler_events);
  for (const std::string stream :
       {"GPUAAS_EVT_INVENTORY", "GPUAAS_EVT_SCHEDULER", "GPUAAS_EVT_IPAM", "GPUAAS_EVT_INGRESS",
        "GPUAAS_NODE_TASKS", "GPUAAS_EVT_NODE", "GPUAAS_EVT_USAGE"}) {
    std::vector<v1::Event> events;
    if (stream == "GPUAAS_EVT_NODE") {
      events = node_events;
    } else if (stream == "GPUAAS_EVT_INGRESS") {
      events = ingress_events;
    } else if (stream == "GPUAAS_EVT_SCHEDULER") {
      events = scheduler_events;
    } else {
      StreamEvents(stream, &events);
    }
    std::map<std::string, int> seen;
    std::map<std::string, int64_t> generation;
    for (const auto& ev : events) {
      in_streams.insert(ev.id());
      if (++seen[ev.id()] == 2) {
        // The same event id stored twice: a publisher re-sent it after the stream's 600 s
        // duplicate window (a node-agent re-publishes a stored task result whenever the task is
        // delivered again, e.g. after nats-server lost a durable's acks in a kill -9).
        // Consumers apply it once (inbox by event id), so this is counted, not failed; a
        // service's outbox is checked for exactly once below.
        republished++;
        if (stream != "GPUAAS_EVT_NODE") {
          duplicated++;
          Say(fmt::format("DUPLICATE event {} ({}) in {}", ev.id(), ev.type(), stream));
        }
      }
      if (ev.generation() > 0) {
        auto& g = generation[ev.subject()];
        if (ev.generation() <= g && seen[ev.id()] == 1) {
          out_of_order++;
          Say(fmt::format("OUT OF ORDER {} {} {}: generation {} after {}", stream, ev.type(),
                          ev.subject(), ev.generation(), g));
        }
        g = std::max(g, ev.generation());
      }
    }
  }
  for (const auto& r : outbox_rows) {
    if ((r.published && !in_streams.count(r.id)) || (!r.published && r.old)) {
      lost++;
      Say(fmt::format("LOST {} event {} ({}){}", r.service, r.id, r.subject,
                      r.published ? " published but not in its stream" : ", never published"));
    }
  }
  // Every task result a node published was applied by the scheduler (its inbox has it).
  {
    pqxx::connection db(Dsn("scheduler"));
    pqxx::nontransaction tx(db);
    std::set<std::string> applied;
    for (const auto& row : tx.exec("SELECT event_id::text FROM inbox")) {
      applied.insert(row[0].as<std::string>());
    }
    for (size_t i = 0; i < node_events.size(); ++i) {
      const auto& ev = node_events[i];
      if (ev.type().find(".task.") == std::string::npos &&
          node_subjects[i].find(".task.") == std::string::npos) {
        continue;
      }
      if (node_subjects[i].find(".task.progress") != std::string::npos) continue;
      if (!applied.count(ev.id())) {
        lost++;
        Say(fmt::format("LOST task result {} on {} (never applied by the scheduler)", ev.id(),
                        node_subjects[i]));
      }
    }
  }
  // Every exposure event was applied by the scheduler, every allocation event by ingress.
  auto applied_by = [&](const std::string& service, const std::string& consumer,
                        const std::vector<v1::Event>& events,
                        const std::vector<std::string>& subjects, const std::string& prefix) {
    pqxx::connection db(Dsn(service));
    pqxx::nontransaction tx(db);
    std::set<std::string> applied;
    for (const auto& row :
         tx.exec_params("SELECT event_id::text FROM inbox WHERE consumer = $1", consumer)) {
      applied.insert(row[0].as<std::string>());
    }
    for (size_t i = 0; i < events.size(); ++i) {
      if (subjects[i].rfind(prefix, 0) != 0 || applied.count(events[i].id())) continue;
      lost++;
      Say(fmt::format("LOST {} on {} (never applied by {})", events[i].id(), subjects[i],
                      consumer));
    }
  };
  applied_by("scheduler", "scheduler-ingress-exposures", ingress_events, ingress_subjects,
             "gpuaas.v1.evt.ingress.exposure.");
  applied_by("ingress", "ingress-scheduler-allocations", scheduler_events, scheduler_subjects,
             "gpuaas.v1.evt.scheduler.allocation.");
  // --- dead letters ---
  std::vector<v1::Event> unused;
  int dead = 0;
  int dead_retryable = 0;
  {
    auto last = messaging::StreamLastSequence(*conn_, "GPUAAS_DLQ");
    for (uint64_t seq = 1; last.ok() && seq <= *last; ++seq) {
      natsMsg* m = nullptr;
      jsErrCode jerr = static_cast<jsErrCode>(0);
      if (js_GetMsg(&m, conn_->js(), "GPUAAS_DLQ", seq, nullptr, &jerr) != NATS_OK) continue;
      v1::DeadLetter dl;
      dl.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m));
      natsMsg_Destroy(m);
      dead++;
      // The campaign sends only valid traffic: any dead letter is a message that should have
      // been retried.
      dead_retryable++;
      Say(fmt::format("DEAD LETTER {}/{} {}: {} ({})", dl.stream(), dl.consumer(), dl.subject(),
                      dl.reason(), dl.kind()));
    }
  }
  // --- projection equals a rebuild by replay ---
  {
    auto snapshot = [&] {
      std::map<std::string, std::string> out;
      auto l = ProjectedSlots(60s);
      if (!l.ok()) throw std::runtime_error("slot list: " + l.error().ToString());
      for (const auto& s : *l) {
        out[s.node_id() + "/" + s.slot_key()] = s.ShortDebugString();
      }
      return out;
    };
    const auto before = snapshot();
    v1::RebuildProjectionRequest rr;
    // The rebuild asks for confirmation where the contract has the field.
    if (const auto* f = rr.GetDescriptor()->FindFieldByName("confirm");
        f && f->type() == google::protobuf::FieldDescriptor::TYPE_BOOL) {
      rr.GetReflection()->SetBool(&rr, f, true);
    }
    auto rb =
        Call<v1::RebuildProjectionResponse>("gpuaas.v1.scheduler.projection.rebuild", rr, 120s);
    if (!rb.ok()) {
      projection_diff++;
      Say("REBUILD failed: " + rb.error().ToString());
    } else {
      const auto after = snapshot();
      for (const auto& [k, v] : before) {
        auto it = after.find(k);
        if (it == after.end() || it->second != v) {
          projection_diff++;
          Say(fmt::format("PROJECTION {}: live {} / rebuilt {}", k, v,
                          it == after.end() ? "missing" : it->second));
        }
      }
      if (after.size() != before.size()) projection_diff++;
    }
  }
  const auto [placed_on_draining, node_state_diff] = CheckHostOps();
  const int usage_diff = CheckUsage();
  std::string failed;
  for (const auto& [reason, n] : failed_by_reason_) failed += fmt::format(" {}:{}", reason, n);
  report_ = fmt::format(
      "R1 faults={} (postgres={} nats={} net={}) placements={} no_placement={} failed=[{} ] "
      "double_booked={} lost={} stuck={} duplicated={} republished={} out_of_order={} "
      "dead_lettered_retryable={} dead_lettered={} projection_diff={} crashed={} "
      "restarts_after_start_failure={} exposed={} endpoints_checked={} live_exposures_kept={} "
      "endpoint_not_active={} exposure_leaked={} pool_used_diff={} endpoint_shared={} "
      "drains={} mode_changes={} placed_on_draining={} node_state_diff={} host_op_errors={} "
      "usage_records={} usage_diff={} usage_max_slack_ms={} failovers={} disk_full={} "
      "failover_promote_max_s={:.1f} failover_ready_max_s={:.1f} failover_stalls={} "
      "net_recover_max_s={:.1f} net_stalls={}",
      faults_.load(), pg_faults_.load(), nats_faults_.load(), net_faults_.load(),
      placements_.load(), no_placement_.load(), failed, double_booked, lost, stuck, duplicated,
      republished, out_of_order, dead_retryable, dead, projection_diff, crashed_.load(),
      start_failures_.load(), exposed_.load(), endpoints_checked_.load(), live_exposures_kept_,
      endpoint_not_active_.load(), exposure_leaked_, pool_used_diff_, endpoint_shared_,
      drains_.size(), mode_changes_, placed_on_draining, node_state_diff, host_op_errors_.load(),
      usage_records_, usage_diff, usage_max_slack_us_ / 1000, failovers_, disk_fulls_,
      promote_max_s_, ready_max_s_, failover_stalls_, net_recover_max_s_, net_stalls_);
  failures_ = double_booked + lost + stuck + duplicated + out_of_order + dead_retryable +
              projection_diff + crashed_.load() + create_errors_.load() +
              endpoint_not_active_.load() + exposure_leaked_ + pool_used_diff_ + endpoint_shared_ +
              placed_on_draining + node_state_diff + host_op_errors_.load() + usage_diff +
              failover_stalls_ + net_stalls_;
  if (o_.net_faults && net_faults_ == 0) {
    failures_++;
    Say("no network fault happened");
  }
  if (o_.ha && failovers_ == 0) {
    failures_++;
    Say("no failover happened");
  }
  if (o_.ha && ready_max_s_ > o_.max_ready_s) {
    failures_++;
    Say(fmt::format("a failover left a service not ready for {:.1f} s (at most {} s)", ready_max_s_,
                    o_.max_ready_s));
  }
  if (usage_records_ == 0) {
    failures_++;
    Say("the usage ledger wrote no record");
  }
  if (drains_.empty()) {
    failures_++;
    Say("no drain was answered during the churn");
  }
  // The exposure checks must have seen exposures (with --expose-percent above 0).
  if (o_.expose_percent > 0 && endpoints_checked_ == 0) {
    failures_++;
    Say("no endpoint of an active allocation was checked");
  }
  if (placements_ == 0) failures_++;
  if (faults_ < o_.min_faults) failures_++;
}

int Campaign::Run() {
  std::filesystem::create_directories(o_.out_dir);
  Say(fmt::format("chaos: {} s of churn, {} node-agents, {} workers, seed {}, logs in {}",
                  o_.duration_s, o_.nodes, o_.workers, o_.seed, o_.out_dir));
  StartPlatform();
  std::thread supervisor([&] { Supervise(); });
  std::thread server_faults([&] { Faults(true); });
  std::thread process_faults([&] { Faults(false); });
  std::thread net_faults([&] {
    if (o_.net_faults) NetFaults();
  });
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(o_.workers));
  for (int w = 0; w < o_.workers; ++w) workers.emplace_back([this, w] { Churn(w); });
  std::thread host_ops([&] { HostOps(); });
  std::this_thread::sleep_for(std::chrono::seconds(o_.duration_s));
  Say("churn over; waiting for the last fault to end");
  churning_ = false;
  server_faults.join();
  process_faults.join();
  net_faults.join();
  faulting_ = false;
  for (auto& w : workers) w.join();
  host_ops.join();
  SettleKept();
  Settle();
  Check();
  supervisor.join();
  {
    // Stopped gracefully; a service that does not stop within its drain timeout is a finding.
    std::lock_guard lock(members_mu_);
    for (auto& m : members_) m->proc->Stop(15s);
  }
  std::cout << report_ << std::endl;
  if (create_errors_ > 0) Say(fmt::format("{} creates failed for good", create_errors_.load()));
  Say(failures_ == 0 ? "PASS" : "FAIL");
  return failures_ == 0 ? 0 : 1;
}

}  // namespace
}  // namespace gpuaas::chaos

int main(int argc, char** argv) {
  gpuaas::chaos::Options o;
  CLI::App app{"gpuaas-chaos: the chaos campaign (see scripts/chaos)"};
  app.add_option("--bin-dir", o.bin_dir, "Build directory with services/*/gpuaas-*")->required();
  app.add_option("--duration-s", o.duration_s, "Seconds of churn under faults")
      ->capture_default_str();
  app.add_option("--nodes", o.nodes, "Simulated node-agents (8 GPUs each)")->capture_default_str();
  app.add_option("--workers", o.workers, "Concurrent tenants creating and releasing")
      ->capture_default_str();
  app.add_option("--fault-gap-ms", o.fault_gap_ms, "Mean pause between faults")
      ->capture_default_str();
  app.add_option("--max-outage-s", o.max_outage_s, "Longest outage of a process or nats-server")
      ->capture_default_str();
  app.add_option("--max-pg-outage-s", o.max_pg_outage_s, "Longest PostgreSQL outage")
      ->capture_default_str();
  app.add_option("--usage-slack-ms", o.usage_slack_ms,
                 "Allowed distance of a usage boundary from the timeline's row of that step");
  app.add_option("--min-faults", o.min_faults, "Keep injecting faults until this many")
      ->capture_default_str();
  app.add_option("--expose-percent", o.expose_percent,
                 "Share of the slices created with endpoints to expose (ssh, sometimes jupyter)")
      ->capture_default_str();
  app.add_option("--pool-ports", o.pool_ports, "Public ports of each node's port_range pool")
      ->capture_default_str();
  app.add_flag("--ha", o.ha, "PostgreSQL as a pg_auto_failover formation; its fault is a failover");
  app.add_flag("--disk-full", o.disk_full,
               "With --ha: data on small loop disks; 1 PostgreSQL fault in 3 fills the primary's");
  app.add_option("--faults", o.faults, "all, or failover (with --ha: only failovers)")
      ->check(CLI::IsMember({"all", "failover"}))
      ->capture_default_str();
  app.add_option("--max-ready-s", o.max_ready_s,
                 "With --ha: longest a failover may leave a service not ready")
      ->capture_default_str();
  app.add_flag("--net-faults", o.net_faults,
               "Services in network namespaces; partitions, latency and loss among the faults");
  app.add_option("--max-net-fault-s", o.max_net_fault_s, "Longest network fault (at least 5 s)")
      ->capture_default_str();
  app.add_option("--seed", o.seed, "Random seed (0 = time)");
  app.add_option("--out", o.out_dir, "Directory for logs and hosts (default: a temporary one)");
  CLI11_PARSE(app, argc, argv);
  if (o.disk_full && !o.ha) {
    std::cerr << "--disk-full needs --ha\n";
    return 2;
  }
  if (o.seed == 0) o.seed = static_cast<uint64_t>(std::time(nullptr));
  if (o.out_dir.empty()) o.out_dir = gpuaas::testing::MakeTempDir("gpuaas-chaos");
  signal(SIGPIPE, SIG_IGN);
  try {
    return gpuaas::chaos::Campaign(o).Run();
  } catch (const std::exception& e) {
    std::cerr << "chaos: " << e.what() << std::endl;
    return 2;
  }
}
