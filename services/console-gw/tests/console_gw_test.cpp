// console-gw in-process against real NATS JetStream and PostgreSQL, with a WebSocket client
// (Beast) as the browser, a fake scheduler (allocation.get, token-checked) and a fake node
// agent that serves console.open and echoes the relay with the ConsoleFrame credit rules. The
// real agent's relay to a VM's VNC socket is tested in services/node-agent and, end to end with
// a browser, in tests/integration.
#include <gtest/gtest.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>
#include <pqxx/pqxx>

#include <atomic>
#include <fstream>
#include <iterator>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <nats/nats.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/console_gw/console_domain.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::console_gw {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace websocket = beast::websocket;
using tcp = asio::ip::tcp;
using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr const char* kNode = "gpu-01";

// ---- pure rules ----

TEST(ConsoleDomainTest, GrantsAreRandomUrlSafeAndStoredAsTheirHash) {
  auto a = NewGrant();
  auto b = NewGrant();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->size(), 43U);  // 32 bytes, base64url without padding
  EXPECT_NE(*a, *b);
  EXPECT_EQ(
      a->find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"),
      std::string::npos);
  EXPECT_EQ(GrantHash(*a).size(), 64U);
  EXPECT_EQ(GrantHash(*a), GrantHash(*a));
  EXPECT_NE(GrantHash(*a), GrantHash(*b));
  EXPECT_EQ(GrantHash("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(ConsoleDomainTest, OnlyTheSameOriginOrAConfiguredOneMayConnect) {
  EXPECT_TRUE(OriginAllowed("http://127.0.0.1:8080", "127.0.0.1:8080", {}));
  EXPECT_TRUE(OriginAllowed("https://Console.Example.com", "console.example.com", {}));
  EXPECT_FALSE(OriginAllowed("http://evil.example", "127.0.0.1:8080", {}));
  EXPECT_FALSE(OriginAllowed("http://127.0.0.1:8081", "127.0.0.1:8080", {}));
  EXPECT_FALSE(OriginAllowed("", "127.0.0.1:8080", {}));
  EXPECT_FALSE(OriginAllowed("null", "127.0.0.1:8080", {}));
  EXPECT_TRUE(OriginAllowed("https://ops.example", "10.0.0.1", {"https://ops.example"}));
  // A configured list replaces the same-origin rule.
  EXPECT_FALSE(OriginAllowed("http://10.0.0.1", "10.0.0.1", {"https://ops.example"}));
}

TEST(ConsoleDomainTest, TheWebSocketPathNamesASessionAndAGrant) {
  const std::string id = ids::NewUuidV7();
  auto t = ParseWsTarget("/console/ws/" + id + "?grant=abc-_09");
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->session_id, id);
  EXPECT_EQ(t->grant, "abc-_09");
  EXPECT_FALSE(ParseWsTarget("/console/ws/" + id).has_value());
  EXPECT_FALSE(ParseWsTarget("/console/ws/not-a-uuid?grant=x").has_value());
  EXPECT_FALSE(ParseWsTarget("/console/ws/" + id + "?grant=a%20b").has_value());
  EXPECT_FALSE(ParseWsTarget("/other/" + id + "?grant=x").has_value());
}

TEST(ConsoleDomainTest, CloseCodesSayWhoseFaultTheEndWas) {
  auto code = [](std::string_view text) {
    auto r = ParseEndReason(text);
    EXPECT_TRUE(r.has_value()) << text;
    return r ? CloseCodeFor(*r) : 0;
  };
  EXPECT_EQ(code("client_closed"), 1000);
  EXPECT_EQ(code("vm_closed"), 1000);
  EXPECT_EQ(code("max_duration"), 1000);
  EXPECT_EQ(code("gateway_stopping"), 1000);
  EXPECT_EQ(code("revoked"), 1008);
  EXPECT_EQ(code("grant_used"), 1008);
  EXPECT_EQ(code("grant_unknown"), 1008);
  EXPECT_EQ(code("wrong_scope"), 1008);
  EXPECT_EQ(code("client_flood"), 1008);
  EXPECT_EQ(code("relay_lost"), 1011);
  EXPECT_EQ(code("node_unreachable"), 1011);
  EXPECT_EQ(code("credit_exceeded"), 1011);
}

TEST(ConsoleDomainTest, EndReasonsAreOneClosedSet) {
  std::set<std::string> failed;
  for (const auto& e : kEndReasons) {
    // Each text names exactly its value (so the texts are distinct).
    EXPECT_EQ(ParseEndReason(e.text.text()), e.value) << e.text.str();
    if (e.failed) failed.insert(e.text.str());
  }
  // Relay failures (and a burnt grant, a lost gateway) end a session FAILED; the rest do not.
  EXPECT_EQ(failed, (std::set<std::string>{"agent_stopping", "client_flood", "credit_exceeded",
                                           "gateway_lost", "node_refused", "node_unreachable",
                                           "relay_lost", "wrong_scope"}));
  EXPECT_FALSE(EndsFailed(EndReason::kClientClosed));
  EXPECT_FALSE(EndsFailed(EndReason::kRevoked));
  EXPECT_FALSE(ParseEndReason("").has_value());
  EXPECT_FALSE(ParseEndReason("failed").has_value());  // a state, not a reason
}

TEST(ConsoleDomainTest, StaticFilesStayInsideTheirDirectory) {
  EXPECT_EQ(SafeJoin("/w", "app.js"), "/w/app.js");
  EXPECT_EQ(SafeJoin("/w", "core/rfb.js"), "/w/core/rfb.js");
  EXPECT_EQ(SafeJoin("/w", ""), "/w/index.html");
  EXPECT_FALSE(SafeJoin("/w", "../etc/passwd").has_value());
  EXPECT_FALSE(SafeJoin("/w", "a/../../b").has_value());
  EXPECT_FALSE(SafeJoin("/w", "a\\b").has_value());
  EXPECT_EQ(ContentTypeFor("x/rfb.js"), "text/javascript; charset=utf-8");
}

TEST(ConsoleDomainTest, CreditNeverLetsASideRunAheadOfTheWindow) {
  Credit c;
  c.window = 100;
  EXPECT_EQ(c.Available(), 100U);
  c.sent = 100;
  EXPECT_EQ(c.Available(), 0U);
  EXPECT_TRUE(c.Ack(40));
  EXPECT_EQ(c.Available(), 40U);
  EXPECT_TRUE(c.Ack(10));  // an older acknowledgement changes nothing
  EXPECT_EQ(c.Available(), 40U);
  EXPECT_FALSE(c.Ack(101));  // more than was ever sent: a broken peer
}

TEST(ConsoleDomainTest, ThePageCallsExactlyTheOperationsTheContractLetsItForward) {
  std::set<std::string> via;
  for (const auto& op : access::EmbeddedContract().operations) {
    for (const auto& g : op.via) {
      if (g == "console-gw") via.insert(op.address);
    }
  }
  std::set<std::string> routes;
  for (const auto& r : ApiRoutes()) routes.insert(r.subject);
  EXPECT_EQ(routes, via);
}

// ---- the service ----

// A fake node agent: serves console.open for kNode and echoes what the browser sends, keeping to
// the credit the gateway grants; or, with `burst`, first sends that many bytes of its own.
class FakeNode {
 public:
  FakeNode(std::shared_ptr<messaging::Connection> conn, const log::Logger& log)
      : conn_(std::move(conn)),
        server_(conn_, "fake-node", fmt::format("gpuaas.v1.node.{}.console.open", kNode), log,
                nullptr) {
    server_.Handle<v1::OpenConsoleRequest, v1::OpenConsoleResponse>(
        fmt::format("gpuaas.v1.node.{}.console.open", kNode),
        [this](const v1::OpenConsoleRequest& req,
               rpc::Context&) -> Result<v1::OpenConsoleResponse> {
          if (refuse_) {
            return Error::FailedPrecondition("domain_not_managed", "not a domain of this node");
          }
          std::lock_guard lock(mu_);
          last_open_ = req;
          window_ = static_cast<uint64_t>(req.window_bytes());
          session_ = req.session_id();
          const std::string in =
              fmt::format("gpuaas.v1.node.{}.console.{}.in", kNode, req.session_id());
          natsSubscription* sub = nullptr;
          natsConnection_Subscribe(&sub, conn_->raw(), in.c_str(), &FakeNode::OnMsg, this);
          subs_.push_back(sub);
          v1::OpenConsoleResponse resp;
          resp.set_session_id(req.session_id());
          resp.set_socket("/run/fake/vnc.sock");
          // The VM speaks first (RFB: the server's version), like qemu.
          SendLocked("RFB 003.008\n", false, "");
          for (uint64_t left = burst_; left > 0;) {
            // Waits for credit the way the real agent does; here the frames are small.
            const uint64_t n = std::min<uint64_t>(left, uint64_t{16} * 1024);
            if (sent_ - acked_ + n > window_) {
              pending_burst_ = left;
              break;
            }
            SendLocked(std::string(n, 'x'), false, "");
            left -= n;
          }
          return resp;
        });
    EXPECT_TRUE(server_.Start().ok());
  }
  ~FakeNode() {
    server_.Drain(1s);
    for (auto* s : subs_) {
      natsSubscription_Unsubscribe(s);
      natsSubscription_Destroy(s);
    }
  }
  void Close(const std::string& reason) {
    std::lock_guard lock(mu_);
    SendLocked("", true, reason);
  }
  std::string received() {
    std::lock_guard lock(mu_);
    return received_;
  }
  bool closed_by_gateway() {
    std::lock_guard lock(mu_);
    return gw_closed_;
  }
  std::string gw_close_reason() {
    std::lock_guard lock(mu_);
    return gw_close_reason_;
  }
  uint64_t max_unacked() {
    std::lock_guard lock(mu_);
    return max_unacked_;
  }
  uint64_t sent() {
    std::lock_guard lock(mu_);
    return sent_;
  }
  v1::OpenConsoleRequest last_open() {
    std::lock_guard lock(mu_);
    return last_open_;
  }
  std::atomic<bool> refuse_{false};
  uint64_t burst_ = 0;

 private:
  static void OnMsg(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* self = static_cast<FakeNode*>(closure);
    v1::ConsoleFrame f;
    f.ParseFromArray(natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
    std::lock_guard lock(self->mu_);
    EXPECT_EQ(f.seq(), self->expect_seq_) << "the gateway's frames arrive in sequence";
    self->expect_seq_ = f.seq() + 1;
    if (f.acked() > self->acked_) self->acked_ = f.acked();
    if (f.close()) {
      self->gw_closed_ = true;
      self->gw_close_reason_ = f.close_reason();
      return;
    }
    self->received_ += f.data();
    self->written_ += f.data().size();
    // The rest of the burst, as credit returns.
    while (self->pending_burst_ > 0) {
      const uint64_t n = std::min<uint64_t>(self->pending_burst_, uint64_t{16} * 1024);
      if (self->sent_ - self->acked_ + n > self->window_) break;
      self->SendLocked(std::string(n, 'x'), false, "");
      self->pending_burst_ -= n;
    }
    // Echo (the browser's keys come back as the "screen").
    if (!f.data().empty()) self->SendLocked(f.data(), false, "");
  }
  void SendLocked(const std::string& data, bool close, const std::string& reason) {
    v1::ConsoleFrame f;
    f.set_seq(next_seq_++);
    f.set_data(data);
    f.set_acked(written_);
    f.set_close(close);
    f.set_close_reason(reason);
    sent_ += data.size();
    max_unacked_ = std::max(max_unacked_, sent_ - acked_);
    (void)conn_->Publish(fmt::format("gpuaas.v1.node.{}.console.{}.out", kNode, session_),
                         f.SerializeAsString());
  }

  std::shared_ptr<messaging::Connection> conn_;
  rpc::Server server_;
  std::mutex mu_;
  std::vector<natsSubscription*> subs_;
  v1::OpenConsoleRequest last_open_;
  std::string session_;
  uint64_t window_ = 0;
  uint64_t next_seq_ = 1;
  uint64_t expect_seq_ = 1;
  uint64_t sent_ = 0;
  uint64_t acked_ = 0;
  uint64_t written_ = 0;
  uint64_t max_unacked_ = 0;
  uint64_t pending_burst_ = 0;
  std::string received_;
  bool gw_closed_ = false;
  std::string gw_close_reason_;
};

// The browser's side: a Beast WebSocket client.
struct WsResult {
  bool upgraded = false;
  int http_status = 0;
  std::string received;
  int close_code = 0;
  std::string close_reason;
};

class ConsoleGwTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_ = log::Logger("test", "t", log::Level::kWarn);
    conn_ = nats_.Connect(testing::TestNats::kHarness);
    dsn_ = testing::SharedPostgres().CreateDatabase("console");
    std::map<std::string, std::string> env = {{"GPUAAS_NATS_URL", nats_.url()},
                                              {"GPUAAS_POSTGRES_DSN", dsn_},
                                              {"GPUAAS_LOG_LEVEL", "error"},
                                              {"GPUAAS_CONSOLE_SWEEP_MS", "100"},
                                              {"GPUAAS_CONSOLE_PAGE_IDLE_S", "2"}};
    for (const auto& [k, v] : nats_.Env("console-gw")) env[k] = v;
    svc_ = std::make_unique<ConsoleGwService>(LoadConfig<ConsoleGwConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    port_ = svc_->gateway_port();
    origin_ = fmt::format("http://127.0.0.1:{}", port_);
    // The fake scheduler: allocation.get for the allocations the test made, token checked.
    rpc::ServerOptions so;
    std::ifstream key(nats_.TokenPublicKeyFile());
    so.token_public_keys.emplace_back(std::istreambuf_iterator<char>(key),
                                      std::istreambuf_iterator<char>());
    scheduler_ = std::make_unique<rpc::Server>(conn_, "scheduler", "gpuaas.*.scheduler.>", log_,
                                               nullptr, so);
    scheduler_->Handle<v1::GetAllocationRequest, v1::GetAllocationResponse>(
        "gpuaas.v1.scheduler.allocation.get",
        [this](const v1::GetAllocationRequest& req,
               rpc::Context&) -> Result<v1::GetAllocationResponse> {
          std::lock_guard lock(mu_);
          auto it = allocations_.find(req.allocation_id());
          if (it == allocations_.end()) {
            return Error::NotFound("allocation_not_found", "no " + req.allocation_id());
          }
          v1::GetAllocationResponse resp;
          *resp.mutable_allocation() = it->second;
          return resp;
        });
    ASSERT_TRUE(scheduler_->Start().ok());
    node_ = std::make_unique<FakeNode>(conn_, log_);
  }
  void TearDown() override {
    svc_.reset();
    node_.reset();
    scheduler_.reset();
  }

  std::string Allocation(v1::AllocationState state = v1::ALLOCATION_STATE_ACTIVE,
                         v1::CapacityShape shape = v1::CAPACITY_SHAPE_GPU_SLICE) {
    v1::Allocation a;
    a.set_allocation_id(ids::NewUuidV7());
    a.set_tenant("acme");
    a.set_node_id(kNode);
    a.set_state(state);
    a.set_shape(shape);
    std::lock_guard lock(mu_);
    allocations_[a.allocation_id()] = a;
    return a.allocation_id();
  }

  Result<v1::CreateConsoleSessionResponse> Create(const std::string& allocation,
                                                  const std::string& reason = "debug boot",
                                                  const std::string& role = "operator") {
    v1::CreateConsoleSessionRequest req;
    req.set_allocation_id(allocation);
    req.set_reason(reason);
    rpc::Client c(conn_);
    c.WithToken(role == "tenant" ? nats_.Token("tenant", "acme", "tenant:acme/bob")
                                 : nats_.Token(role, "", "user:alice"));
    return c.Call<v1::CreateConsoleSessionResponse>("gpuaas.v1.console.session.create", req);
  }

  // Connects like a browser (Origin header), sends `send`, reads until `want` bytes came or the
  // server closes; closes itself after that when `close` is set.
  WsResult Connect(const std::string& path, const std::string& origin, const std::string& send,
                   size_t want, bool close = true) {
    WsResult out;
    asio::io_context io;
    tcp::resolver resolver(io);
    websocket::stream<beast::tcp_stream> ws(io);
    beast::get_lowest_layer(ws).connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port_));
    // A stalled relay fails the test in seconds, not at ctest's timeout.
    ws.set_option(websocket::stream_base::timeout{10s, 30s, false});
    ws.set_option(websocket::stream_base::decorator(
        [&](websocket::request_type& req) { req.set(bhttp::field::origin, origin); }));
    websocket::response_type res;
    beast::error_code ec;
    ws.handshake(res, fmt::format("127.0.0.1:{}", port_), path, ec);
    out.http_status = static_cast<int>(res.result_int());
    if (ec) return out;
    out.upgraded = true;
    ws.binary(true);
    if (!send.empty()) ws.write(asio::buffer(send), ec);
    beast::flat_buffer buf;
    while (out.received.size() < want || want == 0) {
      ws.read(buf, ec);
      if (ec) break;
      out.received += beast::buffers_to_string(buf.data());
      buf.consume(buf.size());
      if (want == 0) break;
    }
    if (ec == websocket::error::closed) {
      out.close_code = ws.reason().code;
      out.close_reason = std::string(ws.reason().reason.c_str());
      return out;
    }
    if (close) {
      ws.close(websocket::close_code::normal, ec);
      // Read until the server's close frame (the close handshake).
      while (!ec) ws.read(buf, ec);
    }
    return out;
  }

  // The status of a WebSocket upgrade request sent by hand (Beast's client does not report the
  // status of a declined upgrade).
  int RawUpgrade(const std::string& path, const std::string& origin) {
    asio::io_context io;
    beast::tcp_stream s(io);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port_));
    bhttp::request<bhttp::string_body> req(bhttp::verb::get, path, 11);
    req.set(bhttp::field::host, fmt::format("127.0.0.1:{}", port_));
    req.set(bhttp::field::origin, origin);
    req.set(bhttp::field::connection, "Upgrade");
    req.set(bhttp::field::upgrade, "websocket");
    req.set(bhttp::field::sec_websocket_key, "dGhlIHNhbXBsZSBub25jZQ==");
    req.set(bhttp::field::sec_websocket_version, "13");
    bhttp::write(s, req);
    beast::flat_buffer buf;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(s, buf, res);
    return static_cast<int>(res.result_int());
  }

  // An HTTP request to the gateway: {status, body, set-cookie}.
  std::tuple<int, std::string, std::string> Http(bhttp::verb verb, const std::string& target,
                                                 const std::string& body, const std::string& cookie,
                                                 const std::string& origin) {
    asio::io_context io;
    beast::tcp_stream s(io);
    s.connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port_));
    bhttp::request<bhttp::string_body> req(verb, target, 11);
    req.set(bhttp::field::host, fmt::format("127.0.0.1:{}", port_));
    if (!origin.empty()) req.set(bhttp::field::origin, origin);
    if (!cookie.empty()) req.set(bhttp::field::cookie, cookie);
    req.set(bhttp::field::content_type, "application/json");
    req.body() = body;
    req.prepare_payload();
    bhttp::write(s, req);
    beast::flat_buffer buf;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(s, buf, res);
    return {res.result_int(), res.body(), std::string(res[bhttp::field::set_cookie])};
  }

  v1::ConsoleSession Session(const std::string& id) {
    v1::ListConsoleSessionsRequest req;
    rpc::Client c(conn_);
    c.WithToken(nats_.Token("operator"));
    auto r = c.Call<v1::ListConsoleSessionsResponse>("gpuaas.v1.console.session.list", req);
    EXPECT_TRUE(r.ok());
    for (const auto& s : r->sessions()) {
      if (s.session_id() == id) return s;
    }
    return {};
  }

  // Events on GPUAAS_EVT_CONSOLE about `session`: (subject, data).
  std::vector<std::pair<std::string, v1::ConsoleSessionEvent>> Events(const std::string& session) {
    std::vector<std::pair<std::string, v1::ConsoleSessionEvent>> out;
    for (const auto& e : testing::ReadStream(*conn_, "GPUAAS_EVT_CONSOLE")) {
      v1::ConsoleSessionEvent data;
      if (e.event.subject() == session && e.event.data().UnpackTo(&data)) {
        out.emplace_back(e.subject, data);
      }
    }
    return out;
  }
  bool HasEvent(const std::string& session, const std::string& subject,
                const std::string& failure = "") {
    return testing::WaitFor([&] {
      for (const auto& [s, d] : Events(session)) {
        if (s == subject && (failure.empty() || d.failure() == failure)) return true;
      }
      return false;
    });
  }

  testing::TestNats nats_;
  log::Logger log_;
  std::shared_ptr<messaging::Connection> conn_;
  std::string dsn_;
  std::unique_ptr<ConsoleGwService> svc_;
  std::unique_ptr<rpc::Server> scheduler_;
  std::unique_ptr<FakeNode> node_;
  std::mutex mu_;
  std::map<std::string, v1::Allocation> allocations_;
  uint16_t port_ = 0;
  std::string origin_;
};

TEST_F(ConsoleGwTest, AnOperatorsGrantOpensTheVmsConsoleOnceAndEveryStepIsAudited) {
  const auto alloc = Allocation();
  auto created = Create(alloc);
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  const auto& s = created->session();
  EXPECT_EQ(s.state(), v1::CONSOLE_SESSION_STATE_CREATED);
  EXPECT_EQ(s.node_id(), kNode);
  EXPECT_EQ(s.domain(), "gpuaas-" + alloc);
  EXPECT_EQ(s.created_by(), "user:alice");
  EXPECT_EQ(created->ws_path(),
            fmt::format("/console/ws/{}?grant={}", s.session_id(), created->grant()));
  // The grant is not stored: only its hash.
  {
    pqxx::connection db(dsn_);
    pqxx::work tx(db);
    auto row = tx.exec_params1("SELECT grant_hash FROM console_sessions WHERE session_id = $1",
                               s.session_id());
    EXPECT_EQ(row[0].as<std::string>(), GrantHash(created->grant()));
  }
  // The browser connects: the VM's banner, then its own keys echoed through the relay.
  auto ws = Connect(created->ws_path(), origin_, "hello vm", 12 + 8);
  ASSERT_TRUE(ws.upgraded) << ws.http_status;
  EXPECT_EQ(ws.received, "RFB 003.008\nhello vm");
  EXPECT_EQ(node_->received(), "hello vm");
  EXPECT_EQ(node_->last_open().domain(), "gpuaas-" + alloc);
  EXPECT_EQ(node_->last_open().allocation_id(), alloc);
  // The browser closed: the node is told and the session is DISCONNECTED with its bytes.
  EXPECT_TRUE(testing::WaitFor([&] { return node_->closed_by_gateway(); }));
  EXPECT_EQ(node_->gw_close_reason(), "client_closed");
  ASSERT_TRUE(testing::WaitFor(
      [&] { return Session(s.session_id()).state() == v1::CONSOLE_SESSION_STATE_DISCONNECTED; }));
  auto done = Session(s.session_id());
  EXPECT_EQ(done.bytes_to_client(), 20);
  EXPECT_EQ(done.bytes_from_client(), 8);
  EXPECT_EQ(done.end_reason(), "client_closed");
  EXPECT_TRUE(HasEvent(s.session_id(), "gpuaas.v1.evt.console.session.created"));
  EXPECT_TRUE(HasEvent(s.session_id(), "gpuaas.v1.evt.console.session.connected"));
  EXPECT_TRUE(HasEvent(s.session_id(), "gpuaas.v1.evt.console.session.disconnected"));
  // Replayed: refused with 1008 grant_used, audited.
  auto again = Connect(created->ws_path(), origin_, "", 1);
  ASSERT_TRUE(again.upgraded);
  EXPECT_EQ(again.close_code, 1008);
  EXPECT_EQ(again.close_reason, "grant_used");
  EXPECT_TRUE(HasEvent(s.session_id(), "gpuaas.v1.evt.console.connect.refused", "grant_used"));
}

TEST_F(ConsoleGwTest, CrossOriginWrongScopeUnknownAndExpiredGrantsAreRefusedAndAudited) {
  const auto alloc = Allocation();
  auto a = Create(alloc);
  auto b = Create(alloc);
  ASSERT_TRUE(a.ok() && b.ok());
  // Another site's page: the upgrade itself is refused (403), nothing reaches the node.
  auto cross = Connect(a->ws_path(), "http://evil.example", "", 1);
  EXPECT_FALSE(cross.upgraded);
  EXPECT_EQ(RawUpgrade(a->ws_path(), "http://evil.example"), 403);
  EXPECT_TRUE(
      HasEvent(a->session().session_id(), "gpuaas.v1.evt.console.connect.refused", "cross_origin"));
  EXPECT_EQ(Session(a->session().session_id()).state(), v1::CONSOLE_SESSION_STATE_CREATED);
  // A's grant on B's path: refused, and A's grant is burnt.
  auto scope =
      Connect(fmt::format("/console/ws/{}?grant={}", b->session().session_id(), a->grant()),
              origin_, "", 1);
  ASSERT_TRUE(scope.upgraded);
  EXPECT_EQ(scope.close_code, 1008);
  EXPECT_EQ(scope.close_reason, "wrong_scope");
  EXPECT_EQ(Session(a->session().session_id()).state(), v1::CONSOLE_SESSION_STATE_FAILED);
  EXPECT_TRUE(
      HasEvent(a->session().session_id(), "gpuaas.v1.evt.console.session.failed", "wrong_scope"));
  // A made-up grant.
  auto unknown =
      Connect(fmt::format("/console/ws/{}?grant=AAAA", b->session().session_id()), origin_, "", 1);
  EXPECT_EQ(unknown.close_code, 1008);
  EXPECT_EQ(unknown.close_reason, "grant_unknown");
  // B's minute passes (moved back in the database rather than waited for): the sweeper
  // expires it, and its grant is refused.
  {
    pqxx::connection db(dsn_);
    pqxx::work tx(db);
    tx.exec_params(
        "UPDATE console_sessions SET connect_by = now() - interval '1 second', created_at = "
        "now() - interval '61 seconds' WHERE session_id = $1",
        b->session().session_id());
    tx.commit();
  }
  ASSERT_TRUE(testing::WaitFor([&] {
    return Session(b->session().session_id()).state() == v1::CONSOLE_SESSION_STATE_EXPIRED;
  }));
  EXPECT_TRUE(HasEvent(b->session().session_id(), "gpuaas.v1.evt.console.session.expired"));
  auto expired = Connect(b->ws_path(), origin_, "", 1);
  EXPECT_EQ(expired.close_code, 1008);
  EXPECT_EQ(expired.close_reason, "grant_expired");
  EXPECT_TRUE(HasEvent(b->session().session_id(), "gpuaas.v1.evt.console.connect.refused",
                       "grant_expired"));
  EXPECT_TRUE(node_->received().empty()) << "no refused connect reached the node";
}

TEST_F(ConsoleGwTest, OnlyOperatorsOpenConsolesOfLiveSlicesWithAReason) {
  const auto alloc = Allocation();
  auto tenant = Create(alloc, "mine", "tenant");
  ASSERT_FALSE(tenant.ok());
  EXPECT_EQ(tenant.error().code, Code::kPermissionDenied);
  auto auditor = Create(alloc, "look", "auditor");
  ASSERT_FALSE(auditor.ok());
  EXPECT_EQ(auditor.error().code, Code::kPermissionDenied);
  auto no_reason = Create(alloc, "");
  ASSERT_FALSE(no_reason.ok());
  EXPECT_EQ(no_reason.error().reason, "reason_required");
  auto missing = Create(ids::NewUuidV7());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().reason, "allocation_not_found");
  auto released = Create(Allocation(v1::ALLOCATION_STATE_RELEASED));
  ASSERT_FALSE(released.ok());
  EXPECT_EQ(released.error().reason, "allocation_not_live");
  auto baremetal = Create(Allocation(v1::ALLOCATION_STATE_ACTIVE, v1::CAPACITY_SHAPE_BAREMETAL));
  ASSERT_FALSE(baremetal.ok());
  EXPECT_EQ(baremetal.error().reason, "no_console");
}

TEST_F(ConsoleGwTest, RevokingALiveSessionClosesItWithPolicyViolation) {
  auto created = Create(Allocation());
  ASSERT_TRUE(created.ok());
  WsResult ws;
  std::thread browser([&] { ws = Connect(created->ws_path(), origin_, "", 1u << 30, false); });
  ASSERT_TRUE(testing::WaitFor([&] {
    return Session(created->session().session_id()).state() == v1::CONSOLE_SESSION_STATE_CONNECTED;
  }));
  v1::RevokeConsoleSessionRequest req;
  req.set_session_id(created->session().session_id());
  req.set_reason("incident over");
  rpc::Client c(conn_);
  c.WithToken(nats_.Token("operator", "", "user:bob"));
  auto r = c.Call<v1::RevokeConsoleSessionResponse>("gpuaas.v1.console.session.revoke", req);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->session().state(), v1::CONSOLE_SESSION_STATE_REVOKED);
  EXPECT_EQ(r->session().revoked_by(), "user:bob");
  browser.join();
  EXPECT_EQ(ws.close_code, 1008);
  EXPECT_EQ(ws.close_reason, "revoked");
  EXPECT_TRUE(testing::WaitFor([&] { return node_->closed_by_gateway(); }));
  EXPECT_EQ(node_->gw_close_reason(), "revoked");
  EXPECT_TRUE(HasEvent(created->session().session_id(), "gpuaas.v1.evt.console.session.revoked"));
}

TEST_F(ConsoleGwTest, TheRelayKeepsToTheCreditAndDeliversEveryByteInOrder) {
  node_->burst_ = uint64_t{3} * 1024 * 1024;  // twelve windows of 256 KiB
  auto created = Create(Allocation());
  ASSERT_TRUE(created.ok());
  auto ws = Connect(created->ws_path(), origin_, "", 12 + node_->burst_);
  ASSERT_TRUE(ws.upgraded);
  ASSERT_EQ(ws.received.size(), 12 + node_->burst_);
  EXPECT_EQ(ws.received.substr(0, 12), "RFB 003.008\n");
  EXPECT_EQ(ws.received.find_first_not_of('x', 12), std::string::npos);
  EXPECT_LE(node_->max_unacked(), 256U * 1024) << "the node never ran ahead of its credit";
  EXPECT_EQ(node_->last_open().window_bytes(), 256 * 1024);
}

TEST_F(ConsoleGwTest, ANodeThatRefusesOrIsGoneFailsTheSessionWith1011) {
  node_->refuse_ = true;
  auto created = Create(Allocation());
  ASSERT_TRUE(created.ok());
  auto ws = Connect(created->ws_path(), origin_, "", 1);
  EXPECT_EQ(ws.close_code, 1011);
  EXPECT_EQ(ws.close_reason, "node_refused");
  EXPECT_EQ(Session(created->session().session_id()).state(), v1::CONSOLE_SESSION_STATE_FAILED);
  node_.reset();  // no agent answers at all
  auto again = Create(Allocation());
  ASSERT_TRUE(again.ok());
  auto gone = Connect(again->ws_path(), origin_, "", 1);
  EXPECT_EQ(gone.close_code, 1011);
  EXPECT_EQ(gone.close_reason, "node_unreachable");
  EXPECT_TRUE(HasEvent(again->session().session_id(), "gpuaas.v1.evt.console.session.failed",
                       "node_unreachable"));
}

TEST_F(ConsoleGwTest, ThePagesApiNeedsAnOperatorLoginAndTheSameOrigin) {
  // Static page and noVNC paths; nothing outside them.
  auto [st, body, ck] = Http(bhttp::verb::get, "/static/../console_gw_test.cpp", "", "", "");
  EXPECT_EQ(st, 404);
  // Login: an operator token becomes an HttpOnly cookie.
  const std::string token = nats_.Token("operator", "", "user:alice");
  auto [ls, lbody, cookie] =
      Http(bhttp::verb::post, "/api/login", json{{"token", token}}.dump(), "", origin_);
  ASSERT_EQ(ls, 200) << lbody;
  EXPECT_EQ(json::parse(lbody)["principal"], "user:alice");
  EXPECT_NE(cookie.find("HttpOnly"), std::string::npos);
  EXPECT_NE(cookie.find("SameSite=Strict"), std::string::npos);
  const std::string jar = cookie.substr(0, cookie.find(';'));
  // The cookie names a server-side session; it is not the token.
  EXPECT_EQ(jar.rfind("gpuaas_session=", 0), 0U) << jar;
  EXPECT_EQ(cookie.find(token), std::string::npos);
  EXPECT_GE(jar.size(), std::string("gpuaas_session=").size() + 40);
  // A tenant's token is not a login.
  auto [ts, tbody, tck] =
      Http(bhttp::verb::post, "/api/login",
           json{{"token", nats_.Token("tenant", "acme", "tenant:acme/x")}}.dump(), "", origin_);
  EXPECT_EQ(ts, 401) << tbody;
  // A call with the cookie goes out with the operator's token.
  const auto alloc = Allocation();
  auto [cs, cbody, cck] =
      Http(bhttp::verb::post, "/api/call/gpuaas.v1.console.session.create",
           json{{"allocation_id", alloc}, {"reason", "from the page"}}.dump(), jar, origin_);
  ASSERT_EQ(cs, 200) << cbody;
  auto created = json::parse(cbody)["result"];
  EXPECT_EQ(created["session"]["created_by"], "user:alice");
  EXPECT_EQ(created["session"]["state"], "CONSOLE_SESSION_STATE_CREATED");
  // Errors keep their code and reason.
  auto [es, ebody, eck] = Http(bhttp::verb::post, "/api/call/gpuaas.v1.console.session.create",
                               json{{"allocation_id", alloc}}.dump(), jar, origin_);
  EXPECT_EQ(es, 400);
  EXPECT_EQ(json::parse(ebody)["error"]["reason"], "reason_required");
  // Another origin, no login, or a subject the page may not call: refused.
  auto [xs, xbody, xck] = Http(bhttp::verb::post, "/api/call/gpuaas.v1.console.session.list", "{}",
                               jar, "http://evil.example");
  EXPECT_EQ(xs, 403);
  auto [ns, nbody, nck] =
      Http(bhttp::verb::post, "/api/call/gpuaas.v1.console.session.list", "{}", "", origin_);
  EXPECT_EQ(ns, 401);
  auto [us, ubody, uck] =
      Http(bhttp::verb::post, "/api/call/gpuaas.v1.scheduler.allocation.force_release", "{}", jar,
           origin_);
  EXPECT_EQ(us, 404);
  EXPECT_EQ(json::parse(ubody)["error"]["reason"], "subject_not_allowed");
}

// The page's login is a server-side session: logout ends it (the same cookie is refused
// afterwards), so do idleness (console.page_idle_s, 2 s here), an operator ending it
// (console.login.end) and revoking its token; an operator lists them, and each start and end is
// an audit event naming who caused it. A cross-origin logout is refused like every other
// cross-origin POST, and leaves the session alive.
TEST_F(ConsoleGwTest, APageSessionIsServerSideAndEndsAtLogoutIdleByAnOperatorOrRevocation) {
  const std::string token = nats_.Token("operator", "", "user:alice");
  auto login = [&](const std::string& t) {
    auto [st, body, cookie] =
        Http(bhttp::verb::post, "/api/login", json{{"token", t}}.dump(), "", origin_);
    EXPECT_EQ(st, 200) << body;
    return std::make_pair(cookie.substr(0, cookie.find(';')),
                          json::parse(body).value("session_id", ""));
  };
  // A page call with `jar`: its HTTP status and the error's end_reason ("" when none).
  auto call = [&](const std::string& jar) {
    auto [st, body, ck] =
        Http(bhttp::verb::post, "/api/call/gpuaas.v1.console.session.list", "{}", jar, origin_);
    std::string ended;
    if (st == 401) ended = json::parse(body)["error"]["details"].value("end_reason", "?");
    return std::make_pair(st, ended);
  };
  rpc::Client admin(conn_);
  admin.WithToken(nats_.Token("operator", "", "user:root"));

  // Logout ends it server-side: a copy of the cookie kept elsewhere is refused afterwards.
  auto [jar1, id1] = login(token);
  EXPECT_EQ(call(jar1).first, 200);
  auto [xs, xbody, xck] = Http(bhttp::verb::post, "/api/logout", "{}", jar1, "http://evil.example");
  EXPECT_EQ(xs, 403);  // CSRF: another origin may not log the operator out either
  EXPECT_EQ(call(jar1).first, 200);
  auto [os, obody, ock] = Http(bhttp::verb::post, "/api/logout", "{}", jar1, origin_);
  EXPECT_EQ(os, 200);
  EXPECT_NE(ock.find("Max-Age=0"), std::string::npos);
  EXPECT_EQ(call(jar1), std::make_pair(401, std::string("logout")));

  // An operator lists the live sessions and ends one.
  auto [jar2, id2] = login(token);
  auto live = admin.Call<v1::ListPageSessionsResponse>("gpuaas.v1.console.login.list",
                                                       v1::ListPageSessionsRequest());
  ASSERT_TRUE(live.ok()) << live.error().ToString();
  ASSERT_EQ(live->sessions_size(), 1);
  EXPECT_EQ(live->sessions(0).session_id(), id2);
  EXPECT_EQ(live->sessions(0).principal(), "user:alice");
  v1::EndPageSessionRequest end;
  end.set_session_id(id2);
  auto ended = admin.Call<v1::EndPageSessionResponse>("gpuaas.v1.console.login.end", end);
  ASSERT_TRUE(ended.ok()) << ended.error().ToString();
  EXPECT_EQ(ended->session().end_reason(), "ended");
  EXPECT_EQ(ended->session().ended_by(), "user:root");
  EXPECT_EQ(call(jar2), std::make_pair(401, std::string("ended")));
  end.set_session_id(ids::NewUuidV7());
  auto missing = admin.Call<v1::EndPageSessionResponse>("gpuaas.v1.console.login.end", end);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().reason, "page_session_not_found");

  // Idle past console.page_idle_s: the next call is refused (the idle time is the condition).
  auto [jar3, id3] = login(token);
  EXPECT_EQ(call(jar3).first, 200);
  std::this_thread::sleep_for(2500ms);
  EXPECT_EQ(call(jar3), std::make_pair(401, std::string("idle")));

  // Its token revoked: the session ends at its next call.
  const auto login4 = login(token);  // no structured binding: the lambda below captures it
  const std::string jar4 = login4.first;
  const std::string id4 = login4.second;
  EXPECT_EQ(call(jar4).first, 200);
  v1::RevokeTokenRequest revoke;
  revoke.set_subject("user:alice");
  ASSERT_TRUE(admin.Call<v1::RevokeTokenResponse>("gpuaas.v1.console.token.revoke", revoke).ok());
  // (A call racing the revocation may be refused by the service it reaches first; the session
  // itself ends at the next call.)
  ASSERT_TRUE(testing::WaitFor([&] { return call(jar4).second == "revoked"; }));
  auto all = admin.Call<v1::ListPageSessionsResponse>("gpuaas.v1.console.login.list", [] {
    v1::ListPageSessionsRequest r;
    r.set_include_ended(true);
    return r;
  }());
  ASSERT_TRUE(all.ok());
  std::map<std::string, std::string> reasons;
  for (const auto& s : all->sessions()) reasons[s.session_id()] = s.end_reason();
  EXPECT_EQ(reasons[id1], "logout");
  EXPECT_EQ(reasons[id2], "ended");
  EXPECT_EQ(reasons[id3], "idle");
  EXPECT_EQ(reasons[id4], "revoked");
  // Every login and its end is on the console audit trail, once, naming who caused it: the
  // operator (login, logout), the operator who ended it, or console-gw (idle, revoked).
  struct Seen {
    int started = 0;
    int ended = 0;
    std::string end_reason, started_by, ended_by_actor;
  };
  std::map<std::string, Seen> seen;
  ASSERT_TRUE(testing::WaitFor([&] {
    seen.clear();
    for (const auto& e : testing::ReadStream(*conn_, "GPUAAS_EVT_CONSOLE")) {
      v1::PageSession data;
      if (e.subject.rfind("gpuaas.v1.evt.console.login.", 0) != 0) continue;
      EXPECT_TRUE(e.event.data().UnpackTo(&data)) << e.subject;
      Seen& x = seen[data.session_id()];
      if (e.subject == "gpuaas.v1.evt.console.login.started") {
        ++x.started;
        x.started_by = e.event.actor().subject();
      } else {
        EXPECT_EQ(e.subject, "gpuaas.v1.evt.console.login.ended");
        ++x.ended;
        x.end_reason = data.end_reason();
        x.ended_by_actor = e.event.actor().subject();
      }
    }
    return seen.size() == 4 && seen[id4].ended == 1;
  })) << seen.size();
  const std::map<std::string, std::pair<std::string, std::string>> want = {
      {id1, {"logout", "user:alice"}},
      {id2, {"ended", "user:root"}},
      {id3, {"idle", "service:console-gw"}},
      {id4, {"revoked", "service:console-gw"}}};
  for (const auto& [id, w] : want) {
    EXPECT_EQ(seen[id].started, 1) << id;
    EXPECT_EQ(seen[id].started_by, "user:alice") << id;
    EXPECT_EQ(seen[id].ended, 1) << id;
    EXPECT_EQ(seen[id].end_reason, w.first) << id;
    EXPECT_EQ(seen[id].ended_by_actor, w.second) << id;
  }
  // And that principal cannot log in again with the revoked token.
  auto [rs, rbody, rck] =
      Http(bhttp::verb::post, "/api/login", json{{"token", token}}.dump(), "", origin_);
  EXPECT_EQ(rs, 401);
  EXPECT_EQ(json::parse(rbody)["error"]["reason"], "token_revoked");
}

}  // namespace
}  // namespace gpuaas::console_gw
