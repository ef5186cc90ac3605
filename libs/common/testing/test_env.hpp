#pragma once
// Real servers for tests: a nats-server with JetStream and a PostgreSQL cluster, each started
// on a free loopback port in a temporary directory and stopped (by PID) at the end.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace gpuaas::testing {

uint16_t FreePort();
std::string MakeTempDir(const std::string& prefix);

// Polls `pred` until it holds or `timeout` passes.
bool WaitFor(const std::function<bool()>& pred,
             std::chrono::milliseconds timeout = std::chrono::seconds(10),
             std::chrono::milliseconds step = std::chrono::milliseconds(10));

// A child process; output goes to `log_path`.
class Process {
 public:
  Process() = default;
  ~Process();
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  // `run_as`: user name to switch to before exec (PostgreSQL refuses to run as root).
  void Spawn(const std::vector<std::string>& argv, const std::string& log_path,
             const std::vector<std::string>& extra_env = {}, const std::string& run_as = "");
  void Signal(int sig);
  // SIGTERM, wait, then SIGKILL.
  void Stop(std::chrono::milliseconds grace = std::chrono::seconds(10));
  bool Running();
  pid_t pid() const { return pid_; }

 private:
  pid_t pid_ = -1;
};

class TestNats {
 public:
  TestNats();
  ~TestNats();
  void Start();  // same port and store directory as before: JetStream state survives
  void Stop();
  std::string url() const;
  uint16_t port() const { return port_; }

 private:
  uint16_t port_;
  std::string dir_;
  Process proc_;
};

class TestPostgres {
 public:
  // `fsync` off by default: tests need isolation, not durability.
  explicit TestPostgres(bool fsync = false);
  ~TestPostgres();
  void Start();
  void Stop();
  // Creates a fresh database and returns its libpq connection string.
  std::string CreateDatabase(const std::string& prefix = "t");
  std::string AdminDsn() const;
  uint16_t port() const { return port_; }
  const std::string& bindir() const { return bindir_; }

 private:
  std::string Dsn(const std::string& db) const;
  uint16_t port_;
  std::string dir_;
  std::string bindir_;
  bool fsync_;
  Process proc_;
};

// One PostgreSQL cluster per test binary (started on first use); each test makes its own
// database in it.
TestPostgres& SharedPostgres();

// Finds the PostgreSQL server binaries (GPUAAS_PG_BINDIR or /usr/lib/postgresql/<v>/bin).
std::string PostgresBinDir();
// Runs a command line via /bin/sh; returns the exit status.
int Shell(const std::string& cmd);

}  // namespace gpuaas::testing
