#include "ha_postgres.hpp"

#include <pwd.h>
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
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

// `pid` and every process below it (children of children), read from /proc before any dies.
std::vector<pid_t> ProcessTree(pid_t pid) {
  std::multimap<pid_t, pid_t> children;
  for (const auto& e : std::filesystem::directory_iterator("/proc")) {
    const std::string name = e.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "stat");
    std::string stat;
    std::getline(in, stat);
    // "pid (comm) state ppid ...": comm may hold spaces and ')', so read after the last one.
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    char state = 0;
    long ppid = 0;
    if (std::sscanf(stat.c_str() + close + 1, " %c %ld", &state, &ppid) == 2) {
      children.emplace(static_cast<pid_t>(ppid), static_cast<pid_t>(std::stol(name)));
    }
  }
  std::vector<pid_t> tree = {pid};
  for (size_t i = 0; i < tree.size(); ++i) {
    auto [from, to] = children.equal_range(tree[i]);
    for (auto it = from; it != to; ++it) tree.push_back(it->second);
  }
  return tree;
}

// The postmaster of a data directory and its children (logger, background workers), read
// while it runs: once it dies its children are someone else's. Empty when none runs (a
// postmaster.pid left by a crash may name a pid that is now another program's).
std::vector<pid_t> PostmasterTree(const std::string& data) {
  const pid_t pm = PostmasterPid(data);
  if (pm <= 0) return {};
  std::ifstream comm(fmt::format("/proc/{}/comm", pm));
  std::string name;
  if (!std::getline(comm, name) || name != "postgres") return {};
  return ProcessTree(pm);
}

// Kills such a tree at once, as a machine that is lost (killed alone, the postmaster left
// children behind as orphans), and waits for the postmaster to be gone.
void KillTree(const std::vector<pid_t>& tree) {
  for (pid_t p : tree) kill(p, SIGKILL);
  if (!tree.empty()) WaitFor([&] { return kill(tree[0], 0) != 0; }, std::chrono::seconds(10));
}

// The last lines of a log, for an error message (the directory is gone after the test).
std::string Tail(const std::string& path, size_t lines = 15) {
  std::ifstream in(path);
  std::vector<std::string> last;
  for (std::string l; std::getline(in, l);) {
    last.push_back(l);
    if (last.size() > lines) last.erase(last.begin());
  }
  std::string out;
  for (const auto& l : last) out += l + "\n";
  return out;
}

uid_t Uid(const std::string& user) {
  const passwd* pw = getpwnam(user.c_str());
  if (pw == nullptr) {
    throw std::runtime_error("no user " + user + " (scripts/install-deps adds it, as root)");
  }
  return pw->pw_uid;
}

// The partition's rules: every connection on the loopback interface is marked, when it opens,
// with the bit of each node it joins to the rest of the formation (a connection of anyone but
// root and node i to node i's port, or one of node i's to any other port); the `cut` chain
// drops a node's bit while it is cut off. Marks follow a connection's packets both ways.
std::string PartitionRules(const std::string& table, const std::vector<uint16_t>& ports,
                           const std::vector<uid_t>& uids) {
  std::string mark;
  for (size_t i = 0; i < ports.size(); ++i) {
    const unsigned bit = 1U << i;
    mark += fmt::format(
        "    oifname \"lo\" ct state new tcp dport {0} meta skuid != {{ 0, {1} }} ct mark set ct "
        "mark or {2:#x}\n"
        "    oifname \"lo\" ct state new meta skuid {1} tcp dport != {0} ct mark set ct mark or "
        "{2:#x}\n",
        ports[i], uids[i], bit);
  }
  return fmt::format(
      "table inet {} {{\n"
      "  chain tag {{\n    type filter hook output priority 0; policy accept;\n{}  }}\n"
      "  chain cut {{\n    type filter hook input priority 0; policy accept;\n  }}\n"
      "}}\n",
      table, mark);
}
}  // namespace

TestHaPostgres::TestHaPostgres(int disk_mb, bool partitionable)
    : dir_(MakeTempDir("gpuaas-ha-pg")),
      bindir_(PostgresBinDir()),
      user_(geteuid() == 0 ? "postgres" : ""),
      disk_mb_(disk_mb),
      partitionable_(partitionable),
      monitor_port_(FreePort()) {
  try {
    Start();
  } catch (...) {
    Cleanup();  // the destructor does not run for a constructor that threw
    throw;
  }
}

void TestHaPostgres::Start() {
  for (auto& p : ports_) p = FreePort();
  if (partitionable_ && user_.empty()) throw std::runtime_error("a partition needs root");
  // Group postgres (every node's user) may enter and write (a keeper keeps backups beside its
  // data directory, in backup/); each node's own directories are its user's.
  if (!user_.empty() &&
      Shell(fmt::format(
          "mkdir -p {0}/backup && chown postgres: {0} {0}/backup && chmod 770 {0} {0}/backup",
          dir_)) != 0) {
    throw std::runtime_error("chown failed");
  }
  for (int i = 0; i < kNodes && !user_.empty(); ++i) {
    // The data directory (empty: initdb or the clone fills it) and the keeper's XDG directories
    // exist up front: a missing runtime directory makes the keeper fall back to /tmp/pg_autoctl,
    // which another node's user may own.
    const std::string data = fmt::format("{}/node{}", dir_, i + 1);
    const std::string home = data + "-home";
    if (Shell(fmt::format("mkdir -p {0} {1}/config {1}/share {1}/run && chmod 700 {0} {1} && "
                          "chown -R {2}:postgres {0} {1}",
                          data, home, NodeUser(i))) != 0) {
      throw std::runtime_error("cannot make " + data);
    }
  }
  if (partitionable_) {
    static std::atomic<int> formations{0};
    nft_table_ = fmt::format("gpuaas_ha_{}_{}", getpid(), formations++);
    const std::vector<uint16_t> ports(std::begin(ports_), std::end(ports_));
    std::vector<uid_t> uids;
    uids.reserve(kNodes);
    for (int i = 0; i < kNodes; ++i) uids.push_back(Uid(NodeUser(i)));
    // In place before any connection of the formation opens, so each is marked from its first
    // packet.
    if (Shell(fmt::format("printf '%s' '{}' | nft -f -",
                          PartitionRules(nft_table_, ports, uids))) != 0) {
      throw std::runtime_error("cannot load the partition rules (nft)");
    }
  }
  for (int i = 0; disk_mb_ > 0 && i < kNodes; ++i) {
    // No blocks reserved for root: the filler takes them all.
    const std::string img = fmt::format("{}/node{}.img", dir_, i + 1);
    if (Shell(fmt::format("truncate -s {}M {} && mkfs.ext4 -q -m 0 -F {} && mkdir -p {} && "
                          "mount -o loop {} {} && chown {}:postgres {}",
                          disk_mb_, img, img, DiskDir(i), img, DiskDir(i), NodeUser(i),
                          DiskDir(i))) != 0) {
      throw std::runtime_error("cannot make node disk " + DiskDir(i));
    }
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
    throw std::runtime_error("the first node never became primary; node1.log ends:\n" +
                             Tail(dir_ + "/node1.log"));
  }
  {
    // Checkpoints keep the WAL small (the standby's clone copies the setting).
    pqxx::connection c(
        fmt::format("host=127.0.0.1 port={} user=postgres dbname=postgres", ports_[0]));
    pqxx::nontransaction tx(c);
    tx.exec("ALTER SYSTEM SET max_wal_size = '96MB'");
    // A primary cut off from its standby notices within 5 s (30 s by default), and its keeper
    // demotes it 5 s after it lost both the monitor and the standby (20 s by default): the
    // window in which an isolated old primary still takes (unacknowledged) writes.
    tx.exec("ALTER SYSTEM SET wal_sender_timeout = '5s'");
    tx.exec("SELECT pg_reload_conf()");
  }
  TuneKeeper(0);
  StartNode(1);
  if (!WaitFor([&] { return HasSecondary(); }, std::chrono::seconds(120),
               std::chrono::milliseconds(200))) {
    throw std::runtime_error("the second node never became a secondary:\n" + State() +
                             "node2.log ends:\n" + Tail(dir_ + "/node2.log"));
  }
  TuneKeeper(1);
}

void TestHaPostgres::TuneKeeper(int i) {
  const std::string pgdata = " --pgdata " + DataDir(i);
  if (NodeCtl(i, "config set timeout.network_partition_timeout 5" + pgdata) != 0 ||
      NodeCtl(i, "reload" + pgdata) != 0) {
    throw std::runtime_error(fmt::format("cannot set node{}'s network_partition_timeout", i + 1));
  }
}

std::string TestHaPostgres::NodeUser(int i) const {
  return partitionable_ ? fmt::format("gpuaas-pg{}", i + 1) : user_;
}

int TestHaPostgres::NodeCtl(int i, const std::string& args) const {
  std::string env;
  for (const auto& e : Env(fmt::format("node{}", i + 1))) env += e + " ";
  const std::string as = NodeUser(i).empty() ? "" : "runuser -u " + NodeUser(i) + " -- ";
  return Shell(fmt::format("{}env {}pg_autoctl {} >/dev/null 2>&1", as, env, args));
}

void TestHaPostgres::Partition(int i) {
  if (nft_table_.empty()) throw std::runtime_error("the formation is not partitionable");
  Shell(fmt::format("nft add rule inet {} cut ct mark and {:#x} == {:#x} drop", nft_table_, 1U << i,
                    1U << i));
}

void TestHaPostgres::Heal() {
  if (!nft_table_.empty()) Shell("nft flush chain inet " + nft_table_ + " cut");
}

TestHaPostgres::~TestHaPostgres() { Cleanup(); }

void TestHaPostgres::Cleanup() {
  for (int i = 0; i < kNodes; ++i) KillNode(i);
  const auto monitor_tree = PostmasterTree(dir_ + "/monitor");
  monitor_.Kill();
  KillTree(monitor_tree);
  for (int i = 0; disk_mb_ > 0 && i < kNodes; ++i) Shell("umount -l " + DiskDir(i));
  if (!nft_table_.empty()) Shell("nft delete table inet " + nft_table_);
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

std::string TestHaPostgres::DataDir(int i) const {
  return disk_mb_ > 0 ? DiskDir(i) + "/data" : fmt::format("{}/node{}", dir_, i + 1);
}

void TestHaPostgres::FillDisk(int i) {
  // fallocate takes nearly all at once; dd the last blocks until ENOSPC.
  Shell(fmt::format(
      "a=$(df --output=avail -B1 {0} | tail -1); fallocate -l $((a - 4194304)) {0}/filler; "
      "dd if=/dev/zero of={0}/filler.tail bs=4096 >/dev/null 2>&1; sync",
      DiskDir(i)));
}

void TestHaPostgres::FreeDisk(int i) {
  Shell(fmt::format("rm -f {0}/filler {0}/filler.tail", DiskDir(i)));
}

void TestHaPostgres::StartNode(int i) {
  const std::string name = fmt::format("node{}", i + 1);
  // Keepalives and a TCP user timeout: a keeper inside a query when its network goes away gives
  // up in seconds instead of waiting for TCP to (without them a partitioned keeper never
  // demoted its primary while the partition lasted).
  const std::string monitor = fmt::format(
      "postgres://autoctl_node@127.0.0.1:{}/pg_auto_failover?sslmode=disable&keepalives_idle=2&"
      "keepalives_interval=1&keepalives_count=2&tcp_user_timeout=4000",
      monitor_port_);
  const std::string data = DataDir(i);
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
            "--username",
            "postgres",
            "--auth",
            "trust",
            "--no-ssl",
            "--monitor",
            monitor,
            "--run"};
  }
  nodes_[i].Spawn(argv, fmt::format("{}/{}.log", dir_, name), Env(name), NodeUser(i));
}

void TestHaPostgres::KillNode(int i) {
  // The keeper leads its process group (its supervisor and, through it, postgres); the
  // postmaster and its children are also killed by pid in case they left the group.
  const auto tree = PostmasterTree(DataDir(i));
  nodes_[i].Kill();
  KillTree(tree);
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
