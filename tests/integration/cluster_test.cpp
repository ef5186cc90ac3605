// Replicated streams survive losing a NATS server. The control plane runs on a 3-server NATS
// cluster with every platform stream at three replicas. During a burst of allocation creates
// and releases, the server the scheduler is connected to, made leader of the scheduler's event
// stream, is SIGKILLed; later it is restarted and catches up. Checked: every acknowledged create
// ends as asked (active, or released), a retried create makes no second allocation, no allocation
// event is published twice or out of generation order, no slot is booked twice, the services keep
// serving while the server is down, and the restarted server holds the same stream sequences as the
// others.
#include <gtest/gtest.h>
#include <nats/nats.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <pqxx/pqxx>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/http.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/node_agent/agent/node_agent.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/scheduler/allocations.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

std::vector<std::string> PlatformStreams() {
  return {messaging::InventoryEventsStream().name, messaging::DeadLetterStream().name,
          messaging::NodeTasksStream().name,       messaging::NodeEventsStream().name,
          messaging::IpamEventsStream().name,      messaging::SchedulerEventsStream().name,
          messaging::IngressEventsStream().name};
}

bool PortOpen(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  const bool ok = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

int64_t MsSince(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0).count();
}

// Stream info from whichever server answers (the stream leader's view); nullopt on failure.
struct StreamView {
  int replicas = 0;
  uint64_t last_seq = 0;
  std::string leader;
  std::map<std::string, bool> followers_current;  // follower name -> current and online
};
std::optional<StreamView> ViewStream(messaging::Connection& conn, const std::string& stream) {
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  if (js_GetStreamInfo(&si, conn.js(), stream.c_str(), nullptr, &jerr) != NATS_OK) {
    return std::nullopt;
  }
  StreamView v;
  v.replicas = si->Config ? static_cast<int>(si->Config->Replicas) : 0;
  v.last_seq = si->State.LastSeq;
  if (si->Cluster) {
    v.leader = si->Cluster->Leader ? si->Cluster->Leader : "";
    for (int i = 0; i < si->Cluster->ReplicasLen; ++i) {
      const jsPeerInfo* p = si->Cluster->Replicas[i];
      v.followers_current[p->Name] = p->Current && !p->Offline;
    }
  }
  jsStreamInfo_Destroy(si);
  return v;
}

// Three (by default) nats-servers on loopback, clustered, each with JetStream and its own store
// directory, and a monitoring port. `extra_conf` is appended to every server's config file
// (e.g. an authorization include).
class NatsCluster {
 public:
  explicit NatsCluster(std::string extra_conf = "", int size = 3)
      : dir_(testing::MakeTempDir("gpuaas-nats-cluster")), extra_conf_(std::move(extra_conf)) {
    std::set<uint16_t> taken;
    auto port = [&] {
      uint16_t p = 0;
      while (p == 0 || taken.count(p)) p = testing::FreePort();
      taken.insert(p);
      return p;
    };
    for (int i = 0; i < size; ++i) {
      auto s = std::make_unique<Server>();
      s->name = fmt::format("n{}", i + 1);
      s->port = port();
      s->cluster_port = port();
      s->http_port = port();
      servers_.push_back(std::move(s));
    }
    for (auto& s : servers_) WriteConfig(*s);
    for (size_t i = 0; i < servers_.size(); ++i) Start(i);
  }
  ~NatsCluster() {
    for (auto& s : servers_) s->proc.Stop();
    std::filesystem::remove_all(dir_);
  }
  NatsCluster(const NatsCluster&) = delete;
  NatsCluster& operator=(const NatsCluster&) = delete;

  // Same config, same store directory as before: the server recovers its JetStream state and
  // catches up from its peers.
  void Start(size_t i) {
    Server& s = *servers_.at(i);
    s.proc.Spawn({"nats-server", "-c", s.conf}, s.log);
    if (!testing::WaitFor([&] { return PortOpen(s.port); }, 15s)) {
      throw std::runtime_error("nats-server " + s.name + " did not start; see " + s.log);
    }
  }
  // SIGKILL: no lame-duck mode, no leadership hand-off, nothing flushed.
  void Kill(size_t i) {
    Server& s = *servers_.at(i);
    s.proc.Signal(SIGKILL);
    s.proc.Stop(1s);  // reaps it
  }
  size_t size() const { return servers_.size(); }
  const std::string& name(size_t i) const { return servers_.at(i)->name; }
  size_t IndexOf(const std::string& server_name) const {
    for (size_t i = 0; i < servers_.size(); ++i) {
      if (servers_[i]->name == server_name) return i;
    }
    return servers_.size();
  }
  std::string url(size_t i) const {
    return fmt::format("nats://127.0.0.1:{}", servers_.at(i)->port);
  }
  // Every server's client URL, comma-separated (what nats.c takes as a server list).
  std::string urls() const {
    std::string out;
    for (size_t i = 0; i < servers_.size(); ++i) out += (i ? "," : "") + url(i);
    return out;
  }
  const std::string& log_path(size_t i) const { return servers_.at(i)->log; }
  // The last `lines` lines of server i's log (the directory goes away with the cluster).
  std::string LogTail(size_t i, size_t lines) const {
    std::ifstream in(log_path(i));
    std::vector<std::string> all;
    for (std::string l; std::getline(in, l);) all.push_back(l);
    std::string out;
    for (size_t k = all.size() > lines ? all.size() - lines : 0; k < all.size(); ++k) {
      out += all[k] + "\n";
    }
    return out;
  }
  // What the test's own connections present (seed file, inbox prefix, token) once `extra_conf`
  // turns authorization on; anonymous by default.
  void SetClientIdentity(messaging::ConnectionOptions identity) { identity_ = std::move(identity); }
  // A client of the whole cluster: nats.c picks a server and fails over to the others.
  messaging::ConnectionOptions ClientOptions(const std::string& name) const {
    messaging::ConnectionOptions o = identity_;
    o.url = urls();
    o.name = name;
    o.reconnect_wait_ms = 100;
    return o;
  }

  // GET on server i's monitoring port, parsed; nullopt when it does not answer 200 with JSON.
  std::optional<Json> Monitor(size_t i, const std::string& path) const {
    auto r = http::Get("127.0.0.1", servers_.at(i)->http_port, path);
    if (!r.ok() || r->first != 200) return std::nullopt;
    auto j = Json::parse(r->second, nullptr, false);
    if (j.is_discarded()) return std::nullopt;
    return j;
  }
  // The server holding a client connection whose name starts with `prefix` (size() if none).
  size_t ServerOf(const std::string& prefix) const {
    for (size_t i = 0; i < servers_.size(); ++i) {
      auto j = Monitor(i, "/connz?limit=4096");
      if (!j) continue;
      for (const auto& c : j->value("connections", Json::array())) {
        if (c.value("name", "").rfind(prefix, 0) == 0) return i;
      }
    }
    return servers_.size();
  }
  // The JetStream meta leader as server i sees it ("" when none or no answer).
  std::string MetaLeader(size_t i) const {
    auto j = Monitor(i, "/jsz");
    if (!j) return "";
    return j->value("/meta_cluster/leader"_json_pointer, std::string());
  }
  // Each stream's last sequence in server i's own store (not the leader's view).
  std::optional<std::map<std::string, uint64_t>> LocalLastSeqs(size_t i) const {
    auto j = Monitor(i, "/jsz?accounts=true&streams=true");
    if (!j) return std::nullopt;
    std::map<std::string, uint64_t> out;
    for (const auto& acc : j->value("account_details", Json::array())) {
      for (const auto& st : acc.value("stream_detail", Json::array())) {
        out[st.value("name", "")] = st.value("/state/last_seq"_json_pointer, uint64_t{0});
      }
    }
    return out;
  }

  // Positive readiness: JetStream has a meta leader and places (and removes) a stream with one
  // replica on every server. Returns "" when ready, otherwise the last refusal.
  std::string WaitJetStream(std::chrono::milliseconds timeout) const {
    auto c = messaging::Connection::Connect(ClientOptions("cluster-probe"),
                                            log::Logger("test", "t", log::Level::kError));
    if (!c.ok()) return c.error().ToString();
    const int replicas = static_cast<int>(servers_.size());
    std::string why = "not tried";
    const bool ready = testing::WaitFor(
        [&] {
          jsStreamConfig cfg;
          jsStreamConfig_Init(&cfg);
          const char* subjects[] = {"test.cluster.probe"};
          cfg.Name = "CLUSTER_PROBE";
          cfg.Subjects = subjects;
          cfg.SubjectsLen = 1;
          cfg.Storage = js_FileStorage;
          cfg.Replicas = replicas;
          jsStreamInfo* si = nullptr;
          jsErrCode jerr = static_cast<jsErrCode>(0);
          natsStatus s = js_AddStream(&si, (*c)->js(), &cfg, nullptr, &jerr);
          if (s == NATS_OK) {
            jsStreamInfo_Destroy(si);
            s = js_DeleteStream((*c)->js(), "CLUSTER_PROBE", nullptr, &jerr);
          }
          if (s == NATS_OK) return true;
          if (!(*c)->Connected()) {
            why = "the client never connected to " + urls();
            return false;
          }
          natsStatus ls = NATS_OK;
          const char* last = nats_GetLastError(&ls);
          why = fmt::format("{} (js error {}): {}", natsStatus_GetText(s), static_cast<int>(jerr),
                            last ? last : "");
          return false;
        },
        timeout, 100ms);
    return ready ? "" : why;
  }

 private:
  struct Server {
    std::string name;
    uint16_t port = 0;
    uint16_t cluster_port = 0;
    uint16_t http_port = 0;
    std::string conf;
    std::string log;
    testing::Process proc;
  };
  void WriteConfig(Server& s) {
    std::string routes;
    for (const auto& o : servers_) {
      if (o->name == s.name) continue;
      routes +=
          fmt::format("{}nats-route://127.0.0.1:{}", routes.empty() ? "" : ", ", o->cluster_port);
    }
    s.conf = fmt::format("{}/{}.conf", dir_, s.name);
    s.log = fmt::format("{}/{}.log", dir_, s.name);
    std::ofstream f(s.conf);
    f << fmt::format(
        "server_name: {name}\n"
        "listen: 127.0.0.1:{port}\n"
        "http: 127.0.0.1:{http}\n"
        "jetstream {{ store_dir: \"{dir}/{name}\" }}\n"
        "cluster {{\n"
        "  name: gpuaas-test\n"
        "  listen: 127.0.0.1:{cport}\n"
        "  routes: [{routes}]\n"
        "}}\n",
        fmt::arg("name", s.name), fmt::arg("port", s.port), fmt::arg("http", s.http_port),
        fmt::arg("dir", dir_), fmt::arg("cport", s.cluster_port), fmt::arg("routes", routes));
    f << extra_conf_ << "\n";
  }

  std::string dir_;
  std::string extra_conf_;
  messaging::ConnectionOptions identity_;
  std::vector<std::unique_ptr<Server>> servers_;
};

// What the burst asked for one request id, and what it got.
struct Ask {
  std::string request_id;
  bool release = false;
  std::string allocation_id;
  int create_attempts = 0;
  int release_attempts = 0;
  std::string error;  // a non-retryable error, or retries exhausted
};

class ClusterTest : public ::testing::Test {
 protected:
  static constexpr int kNodes = 3;
  static constexpr int kGpusPerNode = 8;
  static constexpr int kCreates = 20;  // every third is released right after its create
  static constexpr int kWriters = 4;

  void SetUp() override {
    t0_ = Clock::now();
    // The test's own connections: the harness identity (reads every stream).
    cluster_.SetClientIdentity(ids_.Options(cluster_.urls(), testing::TestIdentities::kHarness));
    const std::string why = cluster_.WaitJetStream(30s);
    ASSERT_EQ(why, "") << "JetStream not ready; n1's log ends:\n" << cluster_.LogTail(0, 30);
    {
      // The deploy step: every platform stream on all three servers (R3).
      auto deployer = messaging::Connection::Connect(
          ids_.Options(cluster_.urls(), testing::TestIdentities::kDeployer),
          log::Logger("test", "t", log::Level::kError));
      ASSERT_TRUE(deployer.ok()) << deployer.error().ToString();
      auto applied = messaging::ApplyStreams(**deployer, kNodes);
      ASSERT_TRUE(applied.ok()) << applied.error().ToString();
    }
    ipam_ = std::make_unique<ipam::IpamService>(LoadConfig<ipam::IpamConfig>(
        Env(testing::SharedPostgres().CreateDatabase("ipam"), "ipam")));
    ASSERT_TRUE(ipam_->Start().ok());
    inventory_ =
        std::make_unique<inventory::InventoryService>(LoadConfig<inventory::InventoryConfig>(
            Env(testing::SharedPostgres().CreateDatabase("inv"), "inventory")));
    auto inv = inventory_->Start();
    ASSERT_TRUE(inv.ok()) << inv.error().ToString();
    sched_dsn_ = testing::SharedPostgres().CreateDatabase("sched");
    scheduler_ = std::make_unique<scheduler::SchedulerService>(
        LoadConfig<scheduler::SchedulerConfig>(Env(sched_dsn_, "scheduler")));
    auto sch = scheduler_->Start();
    ASSERT_TRUE(sch.ok()) << sch.error().ToString();
    auto opts = cluster_.ClientOptions("test");
    opts.token = operator_token_;
    auto c = messaging::Connection::Connect(opts, log::Logger("test", "t", log::Level::kError));
    ASSERT_TRUE(c.ok());
    conn_ = *c;
  }
  void TearDown() override {
    const auto t = Clock::now();
    for (auto& a : agents_) a->Shutdown();
    agents_.clear();
    if (scheduler_) scheduler_->Shutdown();
    if (inventory_) inventory_->Shutdown();
    if (ipam_) ipam_->Shutdown();
    std::filesystem::remove_all(ids_dir_);
    fmt::print("[cluster] teardown {} ms\n", MsSince(t));
  }

  // The environment of every service: the whole cluster as its NATS server list (the streams
  // it uses are declared with three replicas in SetUp).
  std::map<std::string, std::string> Env(const std::string& dsn, const std::string& role,
                                         const std::string& node_id = "") const {
    auto env = ids_.Env(cluster_.urls(), role, node_id);
    env["GPUAAS_LOG_LEVEL"] = "error";
    if (!dsn.empty()) env["GPUAAS_POSTGRES_DSN"] = dsn;
    return env;
  }

  // A node-agent on a fresh fixture host (simulated VM runtime that succeeds), registered, with
  // all its slots approved and schedulable.
  void StartApprovedAgent(const std::string& id) {
    const std::string root = testing::MakeTempDir("gpuaas-host") + "/root";
    node_agent::FixtureOptions fo;
    fo.gpus = kGpusPerNode;
    fo.hostname = id;
    auto built = node_agent::BuildFixtureHost(root, fo);
    ASSERT_TRUE(built.ok()) << built.error().ToString();
    auto env = Env("", "node-agent", id);
    env["GPUAAS_NODE_ID"] = id;
    env["GPUAAS_NODE_REGION"] = "us-east-1";
    env["GPUAAS_NODE_POOL"] = "burst";
    env["GPUAAS_NODE_STATE_DIR"] = testing::MakeTempDir("gpuaas-agent");
    env["GPUAAS_NODE_REGISTER_RETRY_MS"] = "50";
    env["GPUAAS_NODE_DESIRED_POLL_MS"] = "100";
    env["GPUAAS_NODE_HOST_ROOT"] = root;
    env["GPUAAS_LIBVIRT_URI"] = "test:///default";
    env["GPUAAS_NODE_AGENT_SIM_BEHAVIOR"] = "succeed";
    env["GPUAAS_NODE_AGENT_SIM_STEP_MS"] = "5";
    agents_.push_back(
        std::make_unique<node_agent::NodeAgent>(LoadConfig<node_agent::NodeAgentConfig>(env)));
    auto* agent = agents_.back().get();
    ASSERT_TRUE(agent->Start().ok());
    ASSERT_TRUE(testing::WaitFor([&] { return agent->Registered(); }));
    std::string last;
    ASSERT_TRUE(testing::WaitFor([&] {
      v1::ShowNodeRequest r;
      r.set_node_id(id);
      auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
      last = s.ok() ? s->DebugString() : s.error().ToString();
      return s.ok() && s->snapshot_version() >= 1;
    })) << id
        << " has no topology snapshot: " << last;
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(id);
    auto a = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    for (const auto& r : a->results()) ASSERT_TRUE(r.approved()) << r.DebugString();
    ASSERT_TRUE(testing::WaitFor([&] {
      v1::ListProjectedSlotsRequest lr;
      lr.set_node_id(id);
      auto l = Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
      if (!l.ok()) return false;
      int ok = 0;
      for (const auto& s : l->slots()) ok += s.schedulable() ? 1 : 0;
      return ok == kGpusPerNode;
    }));
  }

  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req,
                    std::chrono::milliseconds timeout = 10s,
                    const std::shared_ptr<messaging::Connection>& conn = nullptr) {
    return rpc::Client(conn ? conn : conn_).Call<Resp>(subject, req, timeout);
  }

  // Calls until an answer that is not a retryable error, the way a client rides out a server
  // going away: timeouts, no responders and UNAVAILABLE are retried with the same request.
  template <typename Resp, typename Req>
  Result<Resp> CallRetrying(const std::string& subject, const Req& req, int* attempts) {
    const auto deadline = Clock::now() + 45s;
    while (true) {
      ++*attempts;
      auto r = Call<Resp>(subject, req, 3s, burst_conn_);
      if (r.ok() || !r.error().retryable || Clock::now() > deadline) return r;
      std::this_thread::sleep_for(100ms);
    }
  }

  Result<v1::Allocation> Create(const std::string& request_id, int* attempts) {
    v1::CreateAllocationRequest r;
    r.set_tenant("acme");
    r.set_request_id(request_id);
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(1);
    r.set_region("us-east-1");
    r.set_pool("burst");
    r.add_ssh_authorized_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA test");
    auto c = CallRetrying<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", r,
                                                        attempts);
    if (!c.ok()) return c.error();
    return c->allocation();
  }
  Result<v1::Allocation> Release(const std::string& id, int* attempts) {
    v1::ReleaseAllocationRequest r;
    r.set_allocation_id(id);
    auto x = CallRetrying<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release",
                                                         r, attempts);
    if (!x.ok()) return x.error();
    return x->allocation();
  }
  std::optional<v1::Allocation> Get(const std::string& id) {
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    auto r = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
    if (!r.ok()) return std::nullopt;
    return r->allocation();
  }
  // True when `id` is in `state` with no node task open.
  bool Settled(const std::string& id, const std::string& state) {
    auto a = Get(id);
    if (!a || enums::Text(a->state()) != state) return false;
    v1::GetAllocationTimelineRequest t;
    t.set_allocation_id(id);
    auto tl = Call<v1::GetAllocationTimelineResponse>("gpuaas.v1.scheduler.allocation.timeline", t);
    return tl.ok() && !tl->in_flight();
  }
  std::string StateOf(const std::string& id) {
    auto a = Get(id);
    return a ? enums::Text(a->state()) : "<unreadable>";
  }

  // Every event on GPUAAS_EVT_SCHEDULER, in stream order.
  std::vector<v1::Event> SchedulerEvents() {
    std::vector<v1::Event> out;
    const auto view = ViewStream(*conn_, messaging::SchedulerEventsStream().name);
    EXPECT_TRUE(view.has_value());
    if (!view) return out;
    for (uint64_t seq = 1; seq <= view->last_seq; ++seq) {
      natsMsg* m = nullptr;
      jsErrCode jerr = static_cast<jsErrCode>(0);
      natsStatus s = js_GetMsg(&m, conn_->js(), messaging::SchedulerEventsStream().name.c_str(),
                               seq, nullptr, &jerr);
      if (s != NATS_OK) {
        ADD_FAILURE() << "GPUAAS_EVT_SCHEDULER seq " << seq << ": " << natsStatus_GetText(s)
                      << " (js error " << static_cast<int>(jerr) << ")";
        continue;
      }
      v1::Event ev;
      EXPECT_TRUE(ev.ParseFromArray(natsMsg_GetData(m), natsMsg_GetDataLength(m))) << seq;
      natsMsg_Destroy(m);
      out.push_back(std::move(ev));
    }
    return out;
  }

  // Prints who leads JetStream's meta group and each platform stream.
  void PrintLeaders(const std::string& when) {
    std::string line = "[cluster] " + when + ": meta leader ";
    for (size_t i = 0; i < cluster_.size(); ++i) {
      if (auto l = cluster_.MetaLeader(i); !l.empty()) {
        line += l;
        break;
      }
    }
    for (const auto& st : PlatformStreams()) {
      auto v = ViewStream(*conn_, st);
      line += fmt::format(", {} {}", st, v ? v->leader : "?");
    }
    fmt::print("{}\n", line);
  }

  // The deployment's identities (every role's key, the nodes' keys, the token key), made
  // before the servers so each includes the generated authorization.
  static std::string ReadAll(const std::string& path) {
    std::ifstream in(path);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }
  static std::string IdentityDir() {
    std::string dir = testing::MakeTempDir("gpuaas-cluster-ids");
    testing::TestIdentities ids(dir);
    for (int n = 0; n < kNodes; ++n) ids.Enroll(fmt::format("gpu-{:02}", n));
    return dir;
  }
  std::string ids_dir_ = IdentityDir();
  testing::TestIdentities ids_{ids_dir_};
  // The generated authorization block, inline (nats-server includes only relative paths).
  NatsCluster cluster_{ReadAll(ids_.AuthConfigFile())};
  Clock::time_point t0_;
  std::string token_key_file_ = ids_.TokenPublicKeyFile();
  std::string operator_token_ = ids_.Token(auth::kRoleOperator, "", "user:cluster-test");
  std::string sched_dsn_;
  std::unique_ptr<ipam::IpamService> ipam_;
  std::unique_ptr<inventory::InventoryService> inventory_;
  std::unique_ptr<scheduler::SchedulerService> scheduler_;
  std::vector<std::unique_ptr<node_agent::NodeAgent>> agents_;
  std::shared_ptr<messaging::Connection> conn_;
  // The writers' connection: first on the server that is killed (it fails over to the servers
  // the cluster advertises), so requests are in flight when it goes.
  std::shared_ptr<messaging::Connection> burst_conn_;
};

TEST_F(ClusterTest, BurstSurvivesLosingTheStreamLeader) {
  const auto t_start = t0_;  // cluster and services started: SetUp
  for (int n = 0; n < kNodes; ++n) StartApprovedAgent(fmt::format("gpu-{:02}", n));
  ASSERT_FALSE(HasFatalFailure());

  // Every platform stream is really replicated: three copies, two followers besides the leader.
  for (const auto& st : PlatformStreams()) {
    auto v = ViewStream(*conn_, st);
    ASSERT_TRUE(v.has_value()) << st;
    EXPECT_EQ(v->replicas, 3) << st;
    EXPECT_FALSE(v->leader.empty()) << st;
    EXPECT_EQ(v->followers_current.size(), 2u) << st;
  }
  // The victim: the server the scheduler is connected to (its outbox relay publishes through
  // it), made leader of GPUAAS_EVT_SCHEDULER (the stream the relay writes and the test audits)
  // by asking the current leader to step down until the leadership lands there.
  const size_t victim = cluster_.ServerOf("scheduler/");
  ASSERT_LT(victim, cluster_.size()) << "the scheduler's connection is on no server";
  const std::string victim_name = cluster_.name(victim);
  const std::string sched_stream = messaging::SchedulerEventsStream().name;
  auto healthy_leader = [&] {
    auto v = ViewStream(*conn_, sched_stream);
    if (!v || v->leader.empty() || v->followers_current.size() != 2) return std::string();
    for (const auto& [name, current] : v->followers_current) {
      if (!current) return std::string();
    }
    return v->leader;
  };
  std::string leader;
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(testing::WaitFor([&] { return !(leader = healthy_leader()).empty(); }, 10s));
    if (leader == victim_name) break;
    natsMsg* reply = nullptr;
    const std::string subject = "$JS.API.STREAM.LEADER.STEPDOWN." + sched_stream;
    if (natsConnection_RequestString(&reply, conn_->raw(), subject.c_str(), "", 2000) == NATS_OK) {
      natsMsg_Destroy(reply);
    }
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          const auto now = healthy_leader();
          return !now.empty() && now != leader;
        },
        10s));
  }
  ASSERT_TRUE(testing::WaitFor([&] { return !(leader = healthy_leader()).empty(); }, 10s));
  const bool victim_leads = leader == victim_name;
  PrintLeaders("before the burst");
  std::string meta_leader;
  for (size_t i = 0; i < cluster_.size() && meta_leader.empty(); ++i) {
    meta_leader = cluster_.MetaLeader(i);
  }
  {
    auto o = cluster_.ClientOptions("test-burst");
    o.url = cluster_.url(victim);
    o.token = operator_token_;
    auto c = messaging::Connection::Connect(o, log::Logger("test", "t", log::Level::kError));
    ASSERT_TRUE(c.ok());
    burst_conn_ = *c;
  }
  const int64_t setup_ms = MsSince(t_start);

  // The burst: writers create 1-GPU slices with distinct request ids (retrying what fails
  // with the same request id) and release every third right away, while the others are still
  // being created. The stream leader is killed once a few creates are in.
  std::vector<Ask> asks(kCreates);
  for (int i = 0; i < kCreates; ++i) {
    asks[i].request_id = fmt::format("burst-{:02}", i);
    asks[i].release = i % 3 == 1;
  }
  std::atomic<int> created{0};
  const auto t_burst = Clock::now();
  std::vector<std::thread> writers;
  writers.reserve(kWriters);
  for (int w = 0; w < kWriters; ++w) {
    writers.emplace_back([&, w] {
      for (int i = w; i < kCreates; i += kWriters) {
        Ask& ask = asks[i];
        auto a = Create(ask.request_id, &ask.create_attempts);
        if (!a.ok()) {
          ask.error = "create: " + a.error().ToString();
          continue;
        }
        ask.allocation_id = a->allocation_id();
        created++;
        if (ask.release) {
          auto r = Release(ask.allocation_id, &ask.release_attempts);
          if (!r.ok()) ask.error = "release: " + r.error().ToString();
        }
        std::this_thread::sleep_for(100ms);
      }
    });
  }
  // (No ASSERT until the writers are joined.)
  EXPECT_TRUE(testing::WaitFor([&] { return created.load() >= 6; }, 30s));
  cluster_.Kill(victim);
  const int64_t kill_at_ms = MsSince(t_burst);
  const auto t_kill = Clock::now();
  for (auto& t : writers) t.join();
  const int64_t burst_ms = MsSince(t_burst);
  for (const auto& ask : asks) EXPECT_EQ(ask.error, "") << ask.request_id;
  int retried = 0;
  for (const auto& ask : asks) {
    retried += (ask.create_attempts - 1) + std::max(0, ask.release_attempts - 1);
  }

  // While the server is still down, a new create goes all the way to active.
  Ask after_kill;
  after_kill.request_id = "after-kill";
  {
    auto a = Create(after_kill.request_id, &after_kill.create_attempts);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    after_kill.allocation_id = a->allocation_id();
    // Up to the task consumer's ack wait (30 s) and more: see the settle budget below.
    EXPECT_TRUE(testing::WaitFor([&] { return Settled(after_kill.allocation_id, "active"); }, 45s))
        << "after-kill is " << StateOf(after_kill.allocation_id);
  }
  const int64_t degraded_active_ms = MsSince(t_kill);
  PrintLeaders("with " + victim_name + " down");

  // The killed server comes back with its store and catches up: each stream lists it as a
  // current follower and its own store reaches the leader's last sequence.
  const auto t_restart = Clock::now();
  cluster_.Start(victim);
  const bool rejoined = testing::WaitFor(
      [&] {
        auto local = cluster_.LocalLastSeqs(victim);
        if (!local) return false;
        for (const auto& st : PlatformStreams()) {
          auto v = ViewStream(*conn_, st);
          if (!v || !local->count(st) || local->at(st) < v->last_seq) return false;
          if (v->leader != victim_name &&
              !(v->followers_current.count(victim_name) && v->followers_current.at(victim_name))) {
            return false;
          }
        }
        return true;
      },
      45s, 100ms);
  EXPECT_TRUE(rejoined) << victim_name << " did not catch up; its log ends:\n"
                        << cluster_.LogTail(victim, 30);
  const int64_t rejoin_ms = MsSince(t_restart);

  Ask after_restart;
  after_restart.request_id = "after-restart";
  {
    auto a = Create(after_restart.request_id, &after_restart.create_attempts);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    after_restart.allocation_id = a->allocation_id();
  }
  asks.push_back(after_kill);
  asks.push_back(after_restart);

  // Every acknowledged create ends as asked. One budget for all: a node task whose nak was
  // lost with the consumer's leader comes back only after the task consumer's ack wait (30 s).
  const auto settle_by = t_kill + 60s;
  for (const auto& ask : asks) {
    if (ask.allocation_id.empty()) continue;
    const std::string want = ask.release ? "released" : "active";
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(settle_by - Clock::now());
    EXPECT_TRUE(testing::WaitFor([&] { return Settled(ask.allocation_id, want); },
                                 std::max(left, std::chrono::milliseconds(1000)), 50ms))
        << ask.request_id << " (" << ask.allocation_id << ") is " << StateOf(ask.allocation_id)
        << ", wanted " << want;
  }
  const int64_t settled_ms = MsSince(t_burst);

  // One allocation per request id, however often it was retried; claims consistent; no slot
  // held live by two allocations.
  {
    pqxx::connection db(sched_dsn_);
    pqxx::work tx(db);
    std::map<std::string, std::string> by_request;
    for (const auto& row : tx.exec("SELECT request_id, allocation_id::text FROM allocations")) {
      EXPECT_TRUE(by_request.emplace(row[0].as<std::string>(), row[1].as<std::string>()).second)
          << "two allocations for request " << row[0].as<std::string>();
    }
    EXPECT_EQ(by_request.size(), asks.size());
    for (const auto& ask : asks) {
      EXPECT_EQ(by_request[ask.request_id], ask.allocation_id) << ask.request_id;
    }
    for (const auto& v : scheduler::CheckInvariants(tx)) ADD_FAILURE() << "invariant: " << v;
    auto doubled = tx.exec(
        "SELECT node_id, slot_key FROM allocation_resource_claims WHERE released_at IS NULL "
        "GROUP BY node_id, slot_key HAVING count(DISTINCT allocation_id) > 1");
    EXPECT_EQ(doubled.size(), 0u) << "slots claimed live by two allocations";
    for (const auto& ask : asks) {
      auto live =
          tx.exec_params1(
                "SELECT count(*) FROM allocation_resource_claims WHERE allocation_id = $1 AND "
                "released_at IS NULL",
                ask.allocation_id)[0]
              .as<int>();
      EXPECT_EQ(live, ask.release ? 0 : 1) << ask.request_id;
    }
  }

  // The event log: each allocation's events carry strictly increasing generations (no state
  // change announced twice, none out of order), no event id appears twice, and the newest one
  // is the allocation's final state and generation (none lost). The relay may still be
  // publishing the last ones.
  std::map<std::string, v1::Allocation> finals;
  for (const auto& ask : asks) {
    auto a = Get(ask.allocation_id);
    ASSERT_TRUE(a.has_value()) << ask.request_id;
    finals[ask.allocation_id] = *a;
  }
  std::vector<v1::Event> events;
  const bool announced = testing::WaitFor(
      [&] {
        events = SchedulerEvents();
        std::map<std::string, int64_t> newest;
        for (const auto& ev : events) {
          newest[ev.subject()] = std::max(newest[ev.subject()], ev.generation());
        }
        for (const auto& [id, a] : finals) {
          if (newest[id] != a.generation()) return false;
        }
        return true;
      },
      20s, 200ms);
  EXPECT_TRUE(announced) << "some final allocation state never reached GPUAAS_EVT_SCHEDULER";
  std::set<std::string> event_ids;
  std::map<std::string, std::vector<const v1::Event*>> per_allocation;
  for (const auto& ev : events) {
    EXPECT_TRUE(event_ids.insert(ev.id()).second) << "event " << ev.id() << " published twice";
    per_allocation[ev.subject()].push_back(&ev);
  }
  for (const auto& [id, a] : finals) {
    const auto& evs = per_allocation[id];
    ASSERT_FALSE(evs.empty()) << id;
    for (size_t k = 1; k < evs.size(); ++k) {
      EXPECT_LT(evs[k - 1]->generation(), evs[k]->generation())
          << id << ": generation " << evs[k]->generation() << " after " << evs[k - 1]->generation();
    }
    v1::AllocationSnapshot last;
    ASSERT_TRUE(evs.back()->data().UnpackTo(&last)) << id;
    EXPECT_EQ(last.allocation().state(), a.state()) << id;
    EXPECT_EQ(evs.back()->generation(), a.generation()) << id;
  }

  // All three servers hold the same last sequence of every platform stream in their own store
  // (node-agents keep reporting leases, so compare a quiet moment).
  std::map<std::string, uint64_t> seqs;
  const bool same = testing::WaitFor(
      [&] {
        std::vector<std::map<std::string, uint64_t>> views;
        for (size_t i = 0; i < cluster_.size(); ++i) {
          auto v = cluster_.LocalLastSeqs(i);
          if (!v) return false;
          views.push_back(*v);
        }
        for (const auto& st : PlatformStreams()) {
          for (const auto& v : views) {
            if (!v.count(st) || v.at(st) != views[0].at(st)) return false;
          }
        }
        seqs = views[0];
        return true;
      },
      20s, 100ms);
  EXPECT_TRUE(same) << "the servers' stores differ in some stream's last sequence";

  fmt::print(
      "[cluster] killed {} (the scheduler's server; {}leader of GPUAAS_EVT_SCHEDULER; {}meta "
      "leader) {} ms into the burst; setup {} ms, "
      "burst {} ms ({} retried requests), create after kill active {} ms after the kill, rejoin "
      "{} ms, all settled {} ms after the burst began; {} scheduler events, last seqs:",
      victim_name, victim_leads ? "" : "not ", meta_leader == victim_name ? "" : "not ", kill_at_ms,
      setup_ms, burst_ms, retried, degraded_active_ms, rejoin_ms, settled_ms, events.size());
  for (const auto& [st, seq] : seqs) fmt::print(" {}={}", st, seq);
  fmt::print("\n");
}

}  // namespace
}  // namespace gpuaas
