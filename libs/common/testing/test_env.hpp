#pragma once
// Real servers for tests: a nats-server with JetStream and a PostgreSQL cluster, each started
// on a free loopback port in a temporary directory and stopped (by PID) at the end.
#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/v1/event.pb.h"

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
  // SIGKILL to its whole process group (a PostgreSQL postmaster and its backends), reaped.
  void Kill();
  bool Running();
  pid_t pid() const { return pid_; }
  // The wait status of the last exit Running() or Stop() reaped (-1: none yet).
  int last_status() const { return last_status_; }

 private:
  pid_t pid_ = -1;
  int last_status_ = -1;
};

// The identities of a test deployment, as `gpuaasctl auth init` makes them: a keys directory
// with every role's nkey and the token signing key, the nats-server authorization block
// generated from the contract (access.hpp) for them, connection options and service
// environments per role, enrolled nodes and request tokens. The role "harness" (tests only,
// never in the contract) may publish and subscribe to everything, and every service answers on
// its inbox (_INBOX.harness): the test's own eyes on streams and its stand-ins for parties it
// does not start.
class TestIdentities {
 public:
  static constexpr const char* kHarness = "harness";
  // The deploy identity (roles.yaml kind deploy): declares the streams.
  static constexpr const char* kDeployer = "deployer";
  // Keys under `dir`/keys; the authorization block in `dir`/auth.conf.
  explicit TestIdentities(const std::string& dir);
  // Connection options of `role` (a node: role "node-agent" and its id, enrolled first) for the
  // server(s) at `url`: operator and harness connections send an operator token with every
  // request, auditor ones an auditor token (tenant-api: none; add one per request).
  messaging::ConnectionOptions Options(const std::string& url, const std::string& role,
                                       const std::string& node_id = "") const;
  // The environment a service (or node-agent) process of `role` needs: URL, seed file, inbox
  // prefix, token public key.
  std::map<std::string, std::string> Env(const std::string& url, const std::string& role,
                                         const std::string& node_id = "") const;
  // Issues node `node_id` a key (once; true when new) and rewrites auth.conf; the caller reloads
  // the server(s).
  bool Enroll(const std::string& node_id);
  // Removes the node's key and rewrites auth.conf.
  void Revoke(const std::string& node_id);
  // A request token signed with the platform's token key (auth.hpp): `role` operator | tenant |
  // auditor, `tenant` for tenant tokens.
  std::string Token(const std::string& role, const std::string& tenant = "",
                    const std::string& subject = "",
                    std::chrono::seconds ttl = std::chrono::seconds(600)) const;
  // The same signed with the tenant issuer's key (auth::VerifyIssuedToken): services accept it
  // only with the tenant role, whatever `role` says.
  std::string TenantIssuedToken(const std::string& role, const std::string& tenant,
                                const std::string& subject) const;
  std::string SeedFile(const std::string& role, const std::string& node_id = "") const;
  std::string TokenPublicKeyFile() const;
  const std::string& keys_dir() const { return keys_; }
  // The file to `include` in a nats-server config.
  std::string AuthConfigFile() const { return dir_ + "/auth.conf"; }
  void WriteAuthConfig() const;

 private:
  std::string dir_;
  std::string keys_;
};

// A nats-server with JetStream and authorization on, as scripts/up runs it: the users and their
// permissions are generated from the contract for the test's identities (TestIdentities), so
// anonymous connections are refused and each service, node and client role gets only what the
// contract gives it. Tests connect as a role (Options/Connect/Env), enroll nodes (EnrollNode)
// and sign request tokens (Token). Its first start declares the platform streams as the deploy
// identity does (messaging::ApplyStreams).
class TestNats {
 public:
  TestNats();
  ~TestNats();
  void Start();  // same port and store directory as before: JetStream state survives
  void Stop();
  void Kill();  // kill -9 (the chaos campaign); Start() brings it back with its state
  bool Running() { return proc_.Running(); }
  std::string url() const;
  uint16_t port() const { return port_; }

  static constexpr const char* kHarness = TestIdentities::kHarness;
  static constexpr const char* kDeployer = TestIdentities::kDeployer;
  messaging::ConnectionOptions Options(const std::string& role,
                                       const std::string& node_id = "") const {
    return ids_.Options(url(), role, node_id);
  }
  // Connected as `role` (see Options).
  std::shared_ptr<messaging::Connection> Connect(const std::string& role,
                                                 const std::string& node_id = "") const;
  std::map<std::string, std::string> Env(const std::string& role,
                                         const std::string& node_id = "") const {
    return ids_.Env(url(), role, node_id);
  }
  // Issues a key for node `node_id` (once), reloads the server and waits until the node can
  // connect. Returns its seed file.
  std::string EnrollNode(const std::string& node_id);
  // Removes the node's key and reloads; waits until the server refuses it.
  void RevokeNode(const std::string& node_id);
  std::string Token(const std::string& role, const std::string& tenant = "",
                    const std::string& subject = "",
                    std::chrono::seconds ttl = std::chrono::seconds(600)) const {
    return ids_.Token(role, tenant, subject, ttl);
  }
  std::string TenantIssuedToken(const std::string& role, const std::string& tenant,
                                const std::string& subject) const {
    return ids_.TenantIssuedToken(role, tenant, subject);
  }
  const std::string& keys_dir() const { return ids_.keys_dir(); }
  std::string SeedFile(const std::string& role, const std::string& node_id = "") const {
    return ids_.SeedFile(role, node_id);
  }
  std::string TokenPublicKeyFile() const { return ids_.TokenPublicKeyFile(); }
  const TestIdentities& identities() const { return ids_; }
  // Rewrites the authorization config from the keys directory and reloads the server.
  void Reload();

 private:
  uint16_t port_;
  std::string dir_;
  TestIdentities ids_;
  Process proc_;
};

class TestPostgres {
 public:
  // `fsync` off by default: tests need isolation, not durability.
  explicit TestPostgres(bool fsync = false);
  ~TestPostgres();
  void Start();
  void Stop();
  void Kill();  // kill -9 of the postmaster and its backends; Start() recovers
  bool Running() { return proc_.Running(); }
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

// Creates a database named `prefix`_<pid>_<n> (unique in this process) through `admin_dsn` and
// returns its name.
std::string CreateUniqueDatabase(const std::string& admin_dsn, const std::string& prefix);

// One PostgreSQL cluster per test binary (started on first use); each test makes its own
// database in it.
TestPostgres& SharedPostgres();

// One message of a stream as a test reads it back (JetStream direct reads by sequence).
struct StreamEvent {
  uint64_t seq = 0;
  std::string subject;  // the NATS subject it was published on
  v1::Event event;      // empty when the payload is not an Event
};
// Every message of `stream` from sequence `from` to its last, in order (gaps skipped): what a
// test checks the outbox relays published, e.g. the audit trail.
std::vector<StreamEvent> ReadStream(messaging::Connection& conn, const std::string& stream,
                                    uint64_t from = 1);

// Finds the PostgreSQL server binaries (GPUAAS_PG_BINDIR or /usr/lib/postgresql/<v>/bin).
std::string PostgresBinDir();
// Runs a command line via /bin/sh; returns the exit status.
int Shell(const std::string& cmd);

// What a command printed and how it exited (rc -1: it did not run or was killed by a signal).
struct CommandResult {
  int rc = -1;
  std::string out;
  std::string err;
};
// Runs `argv` (each word passed as is, no shell expansion) and collects stdout and stderr.
CommandResult RunCommand(const std::vector<std::string>& argv);

}  // namespace gpuaas::testing
