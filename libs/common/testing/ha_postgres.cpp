#include "ha_postgres.hpp"

#include <csignal>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <pqxx/pqxx>

namespace gpuaas::testing {

namespace {
// The postmaster pid of a data directory (0: none).
pid_t PostmasterPid(const std::string& data) {
  std::ifstream in(data + "/postmaster.pid");
  long pid = 0;
  in >> pid;
  return static_cast<pid_t>(pid);
}
}  // namespace

TestHaPostgres::TestHaPostgres()
    : dir_(MakeTempDir("gpuaas-ha-pg")),
      bindir_(PostgresBinDir()),
      user_(geteuid() == 0 ? "postgres" : ""),
      monitor_port_(FreePort()) {
  for (auto& p : ports_) p = FreePort();
  if (!user_.empty() && Shell("chown postgres: " + dir_) != 0) {
    throw std::runtime_error("chown failed");
  }
  monitor_.Spawn({"pg_autoctl", "create", "monitor", "--pgdata", dir_ + "/monitor", "--pgctl",
                  bindir_ + "/pg_ctl", "--pgport", std::to_string(monitor_port_), "--hostname",
                  "127.0.0.1", "--listen", "127.0.0.1", "--auth", "trust", "--no-ssl", "--run"},
                 dir_ + "/monitor.log", Env("monitor"), user_);
  const bool up = WaitFor(
      [&] {
        try {
          pqxx::connection c(MonitorDsn());
          pqxx::nontransaction tx(c);
          return !tx.exec("SELECT 1 FROM pg_extension WHERE extname = 'pgautofailover'").empty();
        } catch (...) {
          return false;
        }
      },
      std::chrono::seconds(60), std::chrono::milliseconds(200));
  if (!up) throw std::runtime_error("pg_auto_failover monitor did not start; see " + dir_);
  {
    pqxx::connection c(MonitorDsn());
    pqxx::nontransaction tx(c);
    for (const char* s :
         {"pgautofailover.health_check_period = 1000", "pgautofailover.health_check_timeout = 1000",
          "pgautofailover.health_check_max_retries = 1",
          "pgautofailover.health_check_retry_delay = 500",
          "pgautofailover.node_considered_unhealthy_timeout = 4000",
          // How long the monitor waits for an unreachable primary to confirm its demotion
          // before promoting (30 s by default). Shorter is safe here: with its synchronous
          // standby gone the old primary cannot acknowledge a commit, so nothing it takes
          // meanwhile was promised to anyone.
          "pgautofailover.primary_demote_timeout = 5000"}) {
      tx.exec(std::string("ALTER SYSTEM SET ") + s);
    }
    tx.exec("SELECT pg_reload_conf()");
  }
  // One at a time: the first becomes the primary, the second a standby cloned from it.
  StartNode(0);
  if (!WaitFor([&] { return Primary() == 0; }, std::chrono::seconds(90),
               std::chrono::milliseconds(200))) {
    throw std::runtime_error("the first node never became primary; see " + dir_);
  }
  StartNode(1);
  if (!WaitFor([&] { return HasSecondary(); }, std::chrono::seconds(120),
               std::chrono::milliseconds(200))) {
    throw std::runtime_error("the second node never became a secondary; see " + dir_ + "\n" +
                             State());
  }
}

TestHaPostgres::~TestHaPostgres() {
  for (int i = 0; i < kNodes; ++i) KillNode(i);
  monitor_.Kill();
  const pid_t m = PostmasterPid(dir_ + "/monitor");
  if (m > 0) kill(m, SIGKILL);
  std::filesystem::remove_all(dir_);
}

std::vector<std::string> TestHaPostgres::Env(const std::string& name) const {
  // Each keeper keeps its state and configuration under its own directory.
  const std::string home = fmt::format("{}/{}-home", dir_, name);
  return {"XDG_CONFIG_HOME=" + home + "/config", "XDG_DATA_HOME=" + home + "/share",
          "XDG_RUNTIME_DIR=" + home + "/run", "HOME=" + home,
          "PG_CONFIG=" + bindir_ + "/pg_config"};
}

std::string TestHaPostgres::MonitorDsn() const {
  return fmt::format(
      "host=127.0.0.1 port={} user=postgres dbname=pg_auto_failover connect_timeout=2",
      monitor_port_);
}

void TestHaPostgres::StartNode(int i) {
  const std::string name = fmt::format("node{}", i + 1);
  const std::string monitor = fmt::format(
      "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable", monitor_port_);
  const std::string data = dir_ + "/" + name;
  // Created (registered with the monitor, initdb or cloned) the first time; run afterwards.
  std::vector<std::string> argv = {"pg_autoctl", "run", "--pgdata", data};
  if (!std::filesystem::exists(data + "/PG_VERSION")) {
    argv = {"pg_autoctl",
            "create",
            "postgres",
            "--pgdata",
            data,
            "--pgctl",
            bindir_ + "/pg_ctl",
            "--pgport",
            std::to_string(ports_[i]),
            "--hostname",
            "127.0.0.1",
            "--listen",
            "127.0.0.1",
            "--name",
            name,
            "--auth",
            "trust",
            "--no-ssl",
            "--monitor",
            monitor,
            "--run"};
  }
  nodes_[i].Spawn(argv, data + ".log", Env(name), user_);
}

void TestHaPostgres::KillNode(int i) {
  // The keeper leads its process group (its supervisor and, through it, postgres); the
  // postmaster is also killed by pid in case it left the group.
  nodes_[i].Kill();
  const std::string data = fmt::format("{}/node{}", dir_, i + 1);
  const pid_t pm = PostmasterPid(data);
  if (pm > 0 && kill(pm, SIGKILL) == 0) {
    WaitFor([&] { return kill(pm, 0) != 0; }, std::chrono::seconds(10));
  }
}

std::string TestHaPostgres::Dsn(const std::string& db) const {
  return fmt::format(
      "host=127.0.0.1,127.0.0.1 port={},{} user=postgres dbname={} connect_timeout=2 "
      "target_session_attrs=read-write",
      ports_[0], ports_[1], db);
}

std::string TestHaPostgres::CreateDatabase(const std::string& prefix) {
  return Dsn(CreateUniqueDatabase(Dsn("postgres"), prefix));
}

int TestHaPostgres::Primary() const {
  try {
    pqxx::connection c(MonitorDsn());
    pqxx::nontransaction tx(c);
    auto r = tx.exec(
        "SELECT nodeport FROM pgautofailover.node WHERE reportedstate IN ('primary', "
        "'wait_primary', 'single') AND goalstate = reportedstate");
    if (r.size() != 1) return -1;
    const auto port = r[0][0].as<int>();
    for (int i = 0; i < kNodes; ++i) {
      if (ports_[i] == port) return i;
    }
  } catch (...) {
  }
  return -1;
}

bool TestHaPostgres::HasSecondary() const {
  try {
    pqxx::connection c(MonitorDsn());
    pqxx::nontransaction tx(c);
    return !tx.exec(
                  "SELECT 1 FROM pgautofailover.node WHERE reportedstate = 'secondary' AND "
                  "goalstate = 'secondary'")
                .empty() &&
           !tx.exec(
                  "SELECT 1 FROM pgautofailover.node WHERE reportedstate = 'primary' AND "
                  "goalstate = 'primary'")
                .empty();
  } catch (...) {
    return false;
  }
}

std::string TestHaPostgres::State() const {
  try {
    pqxx::connection c(MonitorDsn());
    pqxx::nontransaction tx(c);
    std::string out;
    for (const auto& row : tx.exec("SELECT nodename, nodeport, reportedstate, goalstate, "
                                   "reportedlsn FROM pgautofailover.node ORDER BY nodeid")) {
      out += fmt::format("{} :{} reported={} assigned={} lsn={}\n", row[0].c_str(), row[1].c_str(),
                         row[2].c_str(), row[3].c_str(), row[4].c_str());
    }
    return out;
  } catch (const std::exception& e) {
    return std::string("monitor unreachable: ") + e.what() + "\n";
  }
}

}  // namespace gpuaas::testing
