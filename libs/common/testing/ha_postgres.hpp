#pragma once
// A highly available PostgreSQL on loopback ports for tests and the chaos campaign: a
// pg_auto_failover formation (Debian postgresql-15-auto-failover) of a monitor and two data
// nodes, a primary and a synchronous standby, each run by its own `pg_autoctl` keeper process
// (as the user postgres when the test runs as root). The failover logic is the engine's; this
// class only starts, kills and asks.
#include <chrono>
#include <string>

#include "test_env.hpp"

namespace gpuaas::testing {

class TestHaPostgres {
 public:
  static constexpr int kNodes = 2;

  // Starts the monitor, then the nodes, and waits until the formation has a primary and a
  // secondary. The monitor's health checks are tightened (1 s period, a node unhealthy after
  // 4 s, 5 s for an unreachable primary to confirm its demotion) so a lost primary is failed
  // over within seconds. `disk_mb` > 0 (root only): each node's data directory lives on a
  // loop-mounted ext4 of its own of that size (FillDisk), and the nodes keep max_wal_size at
  // 96 MB so the WAL alone does not fill it. `partitionable` (root, the users gpuaas-pg1 and
  // gpuaas-pg2 that scripts/install-deps adds): node i runs as OS user gpuaas-pg<i+1>, so
  // nftables can tell its connections apart on the loopback interface (Partition).
  explicit TestHaPostgres(int disk_mb = 0, bool partitionable = false);
  ~TestHaPostgres();
  TestHaPostgres(const TestHaPostgres&) = delete;
  TestHaPostgres& operator=(const TestHaPostgres&) = delete;

  // Creates a database (on the primary; replication copies it) and returns the multi-host DSN
  // a service uses: both nodes, target_session_attrs=read-write.
  std::string CreateDatabase(const std::string& prefix);
  std::string Dsn(const std::string& db) const;
  // The node (0 or 1) the monitor has as primary (reported and assigned), -1 when none.
  int Primary() const;
  // Whether the formation has a secondary again (the standby caught up: commits wait for it).
  bool HasSecondary() const;
  // The monitor's view, `pg_autoctl show state` style, one node per line (for logs).
  std::string State() const;
  // kill -9 of node i's keeper and its PostgreSQL: the loss of that machine.
  void KillNode(int i);
  // Node i's keeper again: it rejoins the formation (as a standby after a failover).
  void StartNode(int i);
  bool NodeRunning(int i) { return nodes_[i].Running(); }
  // Node i's disk (with disk_mb) filled to the last block by a file root writes: writes that
  // need a new block fail with SQLSTATE 53100 (and a WAL write that cannot be made stops the
  // server); the keeper keeps running. FreeDisk removes the file.
  void FillDisk(int i);
  void FreeDisk(int i);
  uint16_t port(int i) const { return ports_[i]; }
  // (partitionable) Node i cut off from the monitor and the other node, both ways: every packet
  // of a connection between them is dropped (marked by nftables when it opened). Connections of
  // root (the test, the services) still reach it: clients on the old primary's side. Heal()
  // lets everything through again.
  void Partition(int i);
  void Heal();

 private:
  std::vector<std::string> Env(const std::string& name) const;
  std::string DataDir(int i) const;
  std::string DiskDir(int i) const { return dir_ + "/node" + std::to_string(i + 1) + "-disk"; }
  std::string MonitorDsn() const;
  // The OS user node i runs as.
  std::string NodeUser(int i) const;
  // `pg_autoctl <args>` as node i's user with its environment (a keeper's configuration).
  int NodeCtl(int i, const std::string& args) const;
  // The formation up (the constructor's work); Cleanup() undoes whatever of it was done.
  void Start();
  void Cleanup();
  // Node i's keeper demotes its primary 5 s after losing both the monitor and the standby.
  void TuneKeeper(int i);
  std::string dir_;
  std::string bindir_;
  std::string user_;
  int disk_mb_;
  bool partitionable_;
  std::string nft_table_;
  uint16_t monitor_port_;
  uint16_t ports_[kNodes];
  Process monitor_;
  Process nodes_[kNodes];
};

}  // namespace gpuaas::testing
