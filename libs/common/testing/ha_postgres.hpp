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
  // over within seconds.
  TestHaPostgres();
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
  uint16_t port(int i) const { return ports_[i]; }

 private:
  std::vector<std::string> Env(const std::string& name) const;
  std::string MonitorDsn() const;
  std::string dir_;
  std::string bindir_;
  std::string user_;
  uint16_t monitor_port_;
  uint16_t ports_[kNodes];
  Process monitor_;
  Process nodes_[kNodes];
};

}  // namespace gpuaas::testing
