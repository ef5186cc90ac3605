#include "test_env.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>
#include <nats/nats.h>
#include <pqxx/pqxx>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/auth.hpp"

namespace gpuaas::testing {

uint16_t FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return 0;  // no port could be had
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

std::string MakeTempDir(const std::string& prefix) {
  std::string tmpl = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  std::vector<char> buf(tmpl.begin(), tmpl.end());
  buf.push_back('\0');
  if (!mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
  return buf.data();
}

bool WaitFor(const std::function<bool()>& pred, std::chrono::milliseconds timeout,
             std::chrono::milliseconds step) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(step);
  }
  return pred();
}

int Shell(const std::string& cmd) {
  int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

Process::~Process() { Stop(std::chrono::seconds(5)); }

void Process::Spawn(const std::vector<std::string>& argv, const std::string& log_path,
                    const std::vector<std::string>& extra_env, const std::string& run_as) {
  uid_t uid = 0;
  gid_t gid = 0;
  if (!run_as.empty()) {
    passwd* pw = getpwnam(run_as.c_str());
    if (!pw) throw std::runtime_error("no such user " + run_as);
    uid = pw->pw_uid;
    gid = pw->pw_gid;
  }
  pid_ = fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    int fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    if (fd >= 0) {
      dup2(fd, 1);
      dup2(fd, 2);
      close(fd);
    }
    // Unblock signals the test runner may have blocked, so SIGTERM works on the child.
    sigset_t set;
    sigemptyset(&set);
    sigprocmask(SIG_SETMASK, &set, nullptr);
    setpgid(0, 0);
    for (const auto& e : extra_env) putenv(const_cast<char*>(e.c_str()));
    if (!run_as.empty() && geteuid() == 0) {
      if (setgid(gid) != 0 || setuid(uid) != 0) _exit(126);
    }
    std::vector<char*> args;
    args.reserve(argv.size() + 1);
    for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
    args.push_back(nullptr);
    execvp(args[0], args.data());
    _exit(127);
  }
}

bool Process::Running() {
  if (pid_ <= 0) return false;
  int status = 0;
  pid_t r = waitpid(pid_, &status, WNOHANG);
  if (r == pid_) {
    pid_ = -1;
    last_status_ = status;
    return false;
  }
  return true;
}

void Process::Kill() {
  if (pid_ <= 0) return;
  kill(-pid_, SIGKILL);
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  last_status_ = status;
  pid_ = -1;
}

void Process::Signal(int sig) {
  if (pid_ > 0) kill(pid_, sig);
}

void Process::Stop(std::chrono::milliseconds grace) {
  if (pid_ <= 0) return;
  kill(pid_, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + grace;
  while (std::chrono::steady_clock::now() < deadline) {
    int status = 0;
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      last_status_ = status;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid_, SIGKILL);
  int status = 0;
  waitpid(pid_, &status, 0);
  pid_ = -1;
}

namespace {
bool PortOpen(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}
}  // namespace

TestIdentities::TestIdentities(const std::string& dir) : dir_(dir), keys_(dir + "/keys") {
  const auto& contract = access::EmbeddedContract();
  if (auto r = access::InitKeys(contract, keys_); !r.ok()) {
    throw std::runtime_error("test keys: " + r.error().ToString());
  }
  auto harness = auth::NewUserNKey();
  if (!harness.ok()) throw std::runtime_error("harness key: " + harness.error().ToString());
  (void)auth::WriteSecretFile(access::SeedPath(keys_, kHarness), harness->seed + "\n");
  std::ofstream(keys_ + "/harness.pub.test") << harness->public_key << "\n";
  WriteAuthConfig();
}

void TestIdentities::WriteAuthConfig() const {
  const auto& contract = access::EmbeddedContract();
  auto users = access::UsersFromKeys(contract, keys_);
  if (!users.ok()) throw std::runtime_error("test users: " + users.error().ToString());
  std::ifstream in(keys_ + "/harness.pub.test");
  std::string harness;
  in >> harness;
  auto conf = access::RenderAuthorization(
      contract, *users,
      fmt::format("    # harness (tests only)\n    {{ nkey: \"{}\", permissions: {{ publish: "
                  "{{ allow: [\">\"] }}, subscribe: {{ allow: [\">\"] }} }} }}\n",
                  harness),
      {access::InboxPrefix(kHarness)});
  if (!conf.ok()) throw std::runtime_error("auth config: " + conf.error().ToString());
  std::ofstream(dir_ + "/auth.conf.tmp") << *conf;
  std::filesystem::rename(dir_ + "/auth.conf.tmp", AuthConfigFile());
}

std::string TestIdentities::SeedFile(const std::string& role, const std::string& node_id) const {
  return node_id.empty() ? access::SeedPath(keys_, role) : keys_ + "/nodes/" + node_id + ".seed";
}

std::string TestIdentities::TokenPublicKeyFile() const { return access::TokenPublicKeyPath(keys_); }

messaging::ConnectionOptions TestIdentities::Options(const std::string& url,
                                                     const std::string& role,
                                                     const std::string& node_id) const {
  messaging::ConnectionOptions o;
  o.url = url;
  o.name = "test-" + role + (node_id.empty() ? "" : "-" + node_id);
  o.connect_timeout_ms = 2000;
  o.reconnect_wait_ms = 100;
  o.seed_file = SeedFile(role, node_id);
  o.inbox_prefix = access::InboxPrefix(role, node_id);
  o.client_role = access::ClientRoleOf(access::EmbeddedContract(), role);
  // A client role's requests carry a token of its kind (the harness: an operator's).
  if (role == kHarness || role == "operator") o.token = Token(auth::kRoleOperator);
  if (role == "auditor") o.token = Token(auth::kRoleAuditor);
  return o;
}

std::map<std::string, std::string> TestIdentities::Env(const std::string& url,
                                                       const std::string& role,
                                                       const std::string& node_id) const {
  return {{"GPUAAS_NATS_URL", url},
          {"GPUAAS_NATS_SEED_FILE", SeedFile(role, node_id)},
          {"GPUAAS_NATS_INBOX_PREFIX", access::InboxPrefix(role, node_id)},
          {"GPUAAS_AUTH_TOKEN_PUBLIC_KEYS", TokenPublicKeyFile()},
          {"GPUAAS_AUTH_TENANT_TOKEN_PUBLIC_KEYS", access::TenantTokenPublicKeyPath(keys_)}};
}

bool TestIdentities::Enroll(const std::string& node_id) {
  const std::string seed_file = SeedFile("node-agent", node_id);
  if (std::filesystem::exists(seed_file)) return false;
  auto seed = access::EnrollNode(keys_, node_id);
  if (!seed.ok()) throw std::runtime_error("enroll " + node_id + ": " + seed.error().ToString());
  if (auto r = auth::WriteSecretFile(seed_file, *seed + "\n"); !r.ok()) {
    throw std::runtime_error("node seed: " + r.error().ToString());
  }
  WriteAuthConfig();
  return true;
}

void TestIdentities::Revoke(const std::string& node_id) {
  if (auto r = access::RevokeNode(keys_, node_id); !r.ok()) {
    throw std::runtime_error("revoke " + node_id + ": " + r.error().ToString());
  }
  std::filesystem::remove(SeedFile("node-agent", node_id));
  WriteAuthConfig();
}

namespace {
std::string SignedToken(const std::string& key_file, const std::string& role,
                        const std::string& tenant, const std::string& subject,
                        std::chrono::seconds ttl) {
  std::ifstream in(key_file);
  std::stringstream pem;
  pem << in.rdbuf();
  auth::Principal p;
  p.subject = subject.empty()
                  ? (tenant.empty() ? "user:test-" + role : "tenant:" + tenant + "/test-user")
                  : subject;
  p.tenant = tenant;
  p.roles = {role};
  auto t = auth::IssueToken(pem.str(), p, ttl);
  if (!t.ok()) throw std::runtime_error("token: " + t.error().ToString());
  return *t;
}
}  // namespace

std::string TestIdentities::Token(const std::string& role, const std::string& tenant,
                                  const std::string& subject, std::chrono::seconds ttl) const {
  return SignedToken(access::TokenSigningKeyPath(keys_), role, tenant, subject, ttl);
}

std::string TestIdentities::TenantIssuedToken(const std::string& role, const std::string& tenant,
                                              const std::string& subject) const {
  return SignedToken(access::TenantTokenSigningKeyPath(keys_), role, tenant, subject,
                     std::chrono::seconds(600));
}

TestNats::TestNats() : port_(FreePort()), dir_(MakeTempDir("gpuaas-nats")), ids_(dir_) {
  std::ofstream(dir_ + "/nats.conf") << fmt::format(
      "listen: 127.0.0.1:{}\njetstream {{ store_dir: \"{}/js\" }}\ninclude ./auth.conf\n", port_,
      dir_);
  Start();
  // What a deployment does before any service starts: the deploy identity declares the platform
  // streams (gpuaasctl streams apply); services only look them up.
  if (auto r = messaging::ApplyStreams(*Connect(kDeployer)); !r.ok()) {
    throw std::runtime_error("streams apply: " + r.error().ToString());
  }
}

void TestNats::Reload() {
  ids_.WriteAuthConfig();
  proc_.Signal(SIGHUP);
}

std::shared_ptr<messaging::Connection> TestNats::Connect(const std::string& role,
                                                         const std::string& node_id) const {
  auto c = messaging::Connection::Connect(Options(role, node_id),
                                          log::Logger("test-" + role, "t", log::Level::kWarn));
  if (!c.ok()) throw std::runtime_error("connect as " + role + ": " + c.error().ToString());
  return *c;
}

namespace {
// Whether `o` can connect now (a positive answer from the server, not a timeout).
bool CanConnect(messaging::ConnectionOptions o) {
  o.retry_on_failed_connect = false;
  auto c = messaging::Connection::Connect(o, log::Logger("probe", "t", log::Level::kError));
  return c.ok() && (*c)->Flush(std::chrono::seconds(2)).ok();
}
}  // namespace

std::string TestNats::EnrollNode(const std::string& node_id) {
  if (ids_.Enroll(node_id)) {
    proc_.Signal(SIGHUP);
    if (!WaitFor([&] { return CanConnect(Options("node-agent", node_id)); },
                 std::chrono::seconds(10), std::chrono::milliseconds(20))) {
      throw std::runtime_error("enrolled node " + node_id + " cannot connect after reload");
    }
  }
  return SeedFile("node-agent", node_id);
}

void TestNats::RevokeNode(const std::string& node_id) {
  auto opts = Options("node-agent", node_id);
  ids_.Revoke(node_id);
  proc_.Signal(SIGHUP);
  if (!WaitFor([&] { return !CanConnect(opts); }, std::chrono::seconds(10),
               std::chrono::milliseconds(20))) {
    throw std::runtime_error("revoked node " + node_id + " can still connect");
  }
}

TestNats::~TestNats() {
  Stop();
  std::filesystem::remove_all(dir_);
}

void TestNats::Start() {
  std::vector<std::string> argv = {"nats-server", "-c", dir_ + "/nats.conf"};
  // GPUAAS_NATS_PROFILE_PORT=<port>: the server serves Go's pprof on 127.0.0.1:<port>
  // (/debug/pprof/profile), for benchmarks whose bound is the server.
  if (const char* prof = std::getenv("GPUAAS_NATS_PROFILE_PORT"); prof && *prof) {
    argv.insert(argv.end(), {"--profile", prof});
  }
  proc_.Spawn(argv, dir_ + "/nats.log");
  // 0 http port disables monitoring; wait for the client port.
  if (!WaitFor([&] { return PortOpen(port_); }, std::chrono::seconds(10))) {
    throw std::runtime_error("nats-server did not start; see " + dir_ + "/nats.log");
  }
}

void TestNats::Stop() { proc_.Stop(); }

void TestNats::Kill() { proc_.Kill(); }

std::string TestNats::url() const { return fmt::format("nats://127.0.0.1:{}", port_); }

std::string PostgresBinDir() {
  if (const char* d = std::getenv("GPUAAS_PG_BINDIR")) return d;
  std::string best;
  for (const auto& e : std::filesystem::directory_iterator("/usr/lib/postgresql")) {
    auto bin = e.path() / "bin";
    if (std::filesystem::exists(bin / "postgres") && bin.string() > best) best = bin.string();
  }
  if (best.empty()) throw std::runtime_error("PostgreSQL server binaries not found");
  return best;
}

TestPostgres::TestPostgres(bool fsync)
    : port_(FreePort()), dir_(MakeTempDir("gpuaas-pg")), bindir_(PostgresBinDir()), fsync_(fsync) {
  const bool root = geteuid() == 0;
  if (root && Shell("chown postgres: " + dir_) != 0) throw std::runtime_error("chown failed");
  const std::string as = root ? "runuser -u postgres -- " : "";
  const std::string cmd = fmt::format(
      "{}{}/initdb -D {}/data -U postgres --auth=trust -E UTF8 --no-sync "
      "--no-instructions > {}/initdb.log 2>&1",
      as, bindir_, dir_, dir_);
  if (Shell(cmd) != 0) throw std::runtime_error("initdb failed; see " + dir_ + "/initdb.log");
  Start();
}

TestPostgres::~TestPostgres() {
  Stop();
  std::filesystem::remove_all(dir_);
}

void TestPostgres::Start() {
  std::vector<std::string> argv = {bindir_ + "/postgres",
                                   "-D",
                                   dir_ + "/data",
                                   "-p",
                                   std::to_string(port_),
                                   "-k",
                                   dir_,
                                   "-c",
                                   "listen_addresses=127.0.0.1",
                                   "-c",
                                   "max_connections=200"};
  if (!fsync_) {
    for (const char* o : {"fsync=off", "synchronous_commit=off", "full_page_writes=off"}) {
      argv.push_back("-c");
      argv.push_back(o);
    }
  }
  // GPUAAS_PG_OPTIONS="name=value ...": more server settings, for profiling (e.g.
  // shared_preload_libraries=pg_stat_statements, which scheduler_bench --statements reads).
  if (const char* extra = std::getenv("GPUAAS_PG_OPTIONS"); extra && *extra) {
    std::istringstream in(extra);
    for (std::string o; in >> o;) {
      argv.push_back("-c");
      argv.push_back(o);
    }
  }
  // Right after a kill -9, a backend of the old postmaster may not have exited yet: the new one
  // refuses to start ("pre-existing shared memory block is still in use") and exits. It is
  // started again until it stays up, within 30 s.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  bool up = false;
  while (!up && std::chrono::steady_clock::now() < deadline) {
    proc_.Spawn(argv, dir_ + "/postgres.log", {}, geteuid() == 0 ? "postgres" : "");
    bool exited = false;
    WaitFor(
        [&] {
          if (!proc_.Running()) return exited = true;
          try {
            pqxx::connection c(Dsn("postgres"));
            return up = true;
          } catch (...) {
            return false;
          }
        },
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                              std::chrono::steady_clock::now()),
        std::chrono::milliseconds(50));
    if (exited) std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  if (!up) throw std::runtime_error("postgres did not start; see " + dir_ + "/postgres.log");
}

void TestPostgres::Stop() {
  // SIGINT = fast shutdown: active sessions are disconnected, as in a real restart.
  if (proc_.Running()) {
    proc_.Signal(SIGINT);
    WaitFor([&] { return !proc_.Running(); }, std::chrono::seconds(20));
  }
  proc_.Stop();
}

void TestPostgres::Kill() {
  // The postmaster leads its process group: its backends go with it, or the restart would find
  // their shared memory still in use.
  proc_.Kill();
}

std::string TestPostgres::Dsn(const std::string& db) const {
  return fmt::format("host=127.0.0.1 port={} user=postgres dbname={} connect_timeout=3", port_, db);
}

std::string TestPostgres::AdminDsn() const { return Dsn("postgres"); }

std::string CreateUniqueDatabase(const std::string& admin_dsn, const std::string& prefix) {
  static std::atomic<int> counter{0};
  std::string name = fmt::format("{}_{}_{}", prefix, getpid(), counter++);
  pqxx::connection c(admin_dsn);
  pqxx::nontransaction tx(c);
  tx.exec("CREATE DATABASE " + tx.quote_name(name));
  return name;
}

std::string TestPostgres::CreateDatabase(const std::string& prefix) {
  return Dsn(CreateUniqueDatabase(Dsn("postgres"), prefix));
}

std::vector<StreamEvent> ReadStream(messaging::Connection& conn, const std::string& stream,
                                    uint64_t from) {
  std::vector<StreamEvent> out;
  auto last = messaging::StreamLastSequence(conn, stream);
  for (uint64_t seq = from; last.ok() && seq <= *last; ++seq) {
    natsMsg* m = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    if (js_GetMsg(&m, conn.js(), stream.c_str(), seq, nullptr, &jerr) != NATS_OK) continue;
    StreamEvent e;
    e.seq = seq;
    e.subject = natsMsg_GetSubject(m);
    if (!e.event.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m))) e.event.Clear();
    natsMsg_Destroy(m);
    out.push_back(std::move(e));
  }
  return out;
}

TestPostgres& SharedPostgres() {
  static auto* pg = new TestPostgres();  // stopped by the atexit below
  static bool registered = [] {
    std::atexit([] { delete pg; });
    return true;
  }();
  (void)registered;
  return *pg;
}

CommandResult RunCommand(const std::vector<std::string>& argv) {
  auto quote = [](const std::string& w) {
    std::string q = "'";
    for (char c : w) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
    return q + "'";
  };
  const std::string err_path = MakeTempDir("gpuaas-cmd") + "/stderr";
  std::string cmd;
  for (const auto& w : argv) cmd += (cmd.empty() ? "" : " ") + quote(w);
  cmd += " 2>" + quote(err_path);
  CommandResult r;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  size_t n = 0;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.out.append(buf, n);
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(err_path);
  std::stringstream ss;
  ss << in.rdbuf();
  r.err = ss.str();
  std::filesystem::remove_all(std::filesystem::path(err_path).parent_path());
  return r;
}

}  // namespace gpuaas::testing
