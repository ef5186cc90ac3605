#include "gpuaas/console_gw/console_gw_service.hpp"

#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/util/time_util.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "console_gw_routes.hpp"
#include "console_store.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::console_gw {

namespace pb = google::protobuf;
using google::protobuf::util::TimeUtil;
using json = nlohmann::json;

// ---- metrics ----

// gpuaas_console_sessions{state}                  sessions per state (sampled by the sweeper)
// gpuaas_console_connections                      live WebSocket relays of this instance
// gpuaas_console_bytes_total{direction}           relayed bytes: to_client | from_client
// gpuaas_console_connect_refused_total{failure}   refused connects (the audit's failure)
// gpuaas_console_open_seconds                     grant accepted -> the node's relay open
class ConsoleMetrics {
 public:
  explicit ConsoleMetrics(prometheus::Registry& r)
      : sessions_(&prometheus::BuildGauge()
                       .Name("gpuaas_console_sessions")
                       .Help("Console sessions per state (sampled from the database)")
                       .Register(r)),
        connections_(&prometheus::BuildGauge()
                          .Name("gpuaas_console_connections")
                          .Help("Live console WebSocket relays of this console-gw instance")
                          .Register(r)
                          .Add({})),
        bytes_(&prometheus::BuildCounter()
                    .Name("gpuaas_console_bytes_total")
                    .Help("Console bytes relayed: to_client (VM to browser), from_client")
                    .Register(r)),
        refused_(&prometheus::BuildCounter()
                      .Name("gpuaas_console_connect_refused_total")
                      .Help("Console connects refused, by failure")
                      .Register(r)),
        open_(&prometheus::BuildHistogram()
                   .Name("gpuaas_console_open_seconds")
                   .Help("From an accepted grant to the node's relay being open")
                   .Register(r)
                   .Add({}, prometheus::Histogram::BucketBoundaries{0.005, 0.01, 0.025, 0.05, 0.1,
                                                                    0.25, 0.5, 1, 2.5, 5})) {}
  void SetSessions(const std::map<std::string, int64_t>& by_state) {
    for (const auto& s : enums::TextsOf(v1::ConsoleSessionState_descriptor())) {
      auto it = by_state.find(s);
      sessions_->Add({{"state", s}}).Set(it == by_state.end() ? 0.0 : double(it->second));
    }
  }
  void SetConnections(size_t n) { connections_->Set(static_cast<double>(n)); }
  void Bytes(uint64_t to_client, uint64_t from_client) {
    bytes_->Add({{"direction", "to_client"}}).Increment(static_cast<double>(to_client));
    bytes_->Add({{"direction", "from_client"}}).Increment(static_cast<double>(from_client));
  }
  void Refused(const std::string& failure) { refused_->Add({{"failure", failure}}).Increment(); }
  void Opened(double seconds) { open_->Observe(seconds); }

 private:
  prometheus::Family<prometheus::Gauge>* sessions_;
  prometheus::Gauge* connections_;
  prometheus::Family<prometheus::Counter>* bytes_;
  prometheus::Family<prometheus::Counter>* refused_;
  prometheus::Histogram* open_;
};

namespace {

ApiReply ErrorReply(const Error& e) { return {HttpStatusFor(e.code), ErrorJson(e)}; }

std::vector<std::string> SplitComma(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');) {
    while (!item.empty() && item.front() == ' ') item.erase(0, 1);
    while (!item.empty() && item.back() == ' ') item.pop_back();
    if (!item.empty()) out.push_back(item);
  }
  return out;
}

}  // namespace

const std::vector<ApiRoute>& ApiRoutes() {
  // Exactly the operations the contract marks `via: [console-gw]` (a test checks they agree).
  static const std::vector<ApiRoute> routes = {
      {"gpuaas.v1.inventory.node.list", v1::ListNodesRequest::descriptor(),
       v1::ListNodesResponse::descriptor()},
      {"gpuaas.v1.inventory.node.discover", v1::DiscoverNodeRequest::descriptor(),
       v1::DiscoverNodeResponse::descriptor()},
      {"gpuaas.v1.inventory.node.show", v1::ShowNodeRequest::descriptor(),
       v1::ShowNodeResponse::descriptor()},
      {"gpuaas.v1.inventory.node.drain", v1::DrainNodeRequest::descriptor(),
       v1::NodeAdminResponse::descriptor()},
      {"gpuaas.v1.inventory.node.undrain", v1::NodeAdminRequest::descriptor(),
       v1::NodeAdminResponse::descriptor()},
      {"gpuaas.v1.inventory.node.maintenance", v1::NodeAdminRequest::descriptor(),
       v1::NodeAdminResponse::descriptor()},
      {"gpuaas.v1.inventory.node.decommission", v1::NodeAdminRequest::descriptor(),
       v1::NodeAdminResponse::descriptor()},
      {"gpuaas.v1.inventory.node.mode", v1::ChangeNodeModeRequest::descriptor(),
       v1::NodeAdminResponse::descriptor()},
      {"gpuaas.v1.scheduler.node.holders", v1::ListNodeHoldersRequest::descriptor(),
       v1::ListNodeHoldersResponse::descriptor()},
      {"gpuaas.v1.inventory.slot.approve", v1::ApproveSlotsRequest::descriptor(),
       v1::ApproveSlotsResponse::descriptor()},
      {"gpuaas.v1.inventory.slot.disable", v1::DisableSlotRequest::descriptor(),
       v1::DisableSlotResponse::descriptor()},
      {"gpuaas.v1.inventory.slot.repair", v1::RepairSlotRequest::descriptor(),
       v1::RepairSlotResponse::descriptor()},
      {"gpuaas.v1.inventory.node.{node_id}.desired.get", v1::GetDesiredSlotsRequest::descriptor(),
       v1::GetDesiredSlotsResponse::descriptor()},
      {"gpuaas.v1.scheduler.slot.list", v1::ListProjectedSlotsRequest::descriptor(),
       v1::ListProjectedSlotsResponse::descriptor()},
      {"gpuaas.v1.ipam.node.{node_id}.network.get", v1::GetNodeNetworkRequest::descriptor(),
       v1::GetNodeNetworkResponse::descriptor()},
      {"gpuaas.v1.ipam.drift.list", v1::ListDriftRequest::descriptor(),
       v1::ListDriftResponse::descriptor()},
      {"gpuaas.v1.scheduler.allocation.get", v1::GetAllocationRequest::descriptor(),
       v1::GetAllocationResponse::descriptor()},
      {"gpuaas.v1.scheduler.allocation.list", v1::ListAllocationsRequest::descriptor(),
       v1::ListAllocationsResponse::descriptor()},
      {"gpuaas.v1.scheduler.allocation.timeline", v1::GetAllocationTimelineRequest::descriptor(),
       v1::GetAllocationTimelineResponse::descriptor()},
      {"gpuaas.v1.ingress.exposure.list", v1::ListExposuresRequest::descriptor(),
       v1::ListExposuresResponse::descriptor()},
      {"gpuaas.v1.console.session.create", v1::CreateConsoleSessionRequest::descriptor(),
       v1::CreateConsoleSessionResponse::descriptor()},
      {"gpuaas.v1.console.session.revoke", v1::RevokeConsoleSessionRequest::descriptor(),
       v1::RevokeConsoleSessionResponse::descriptor()},
      {"gpuaas.v1.console.session.list", v1::ListConsoleSessionsRequest::descriptor(),
       v1::ListConsoleSessionsResponse::descriptor()},
  };
  return routes;
}

void ConsoleGwConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("console.http_host", &http_host,
        "Address the operator page and console WebSocket listen on (an IP literal)", "127.0.0.1",
        config::NonEmpty());
  s.Add("console.http_port", &http_port, "Port of the operator page; 0 picks a free one (logged)",
        0, config::Range(0, 65535));
  s.Add("console.web_dir", &web_dir, "Directory of the operator page's files",
        GPUAAS_CONSOLE_WEB_DIR, config::NonEmpty());
  s.Add("console.novnc_dir", &novnc_dir,
        "noVNC's files (the Debian novnc package), served under /novnc/", "/usr/share/novnc",
        config::NonEmpty());
  s.Add("console.allowed_origins", &allowed_origins,
        "Comma-separated Origins allowed to use the page's API and open consoles (e.g. "
        "https://console.example.com); empty = the page's own origin (its Host header) only",
        "");
  s.Add("console.secure_cookies", &secure_cookies,
        "Mark the login cookie Secure (when served over TLS, e.g. behind an ingress)", false);
  s.Add("console.max_session_s", &max_session_s,
        "Longest a console connection may stay open (seconds); a session asking for more gets "
        "this",
        3600, config::Range(10, 86400));
  s.Add("console.window_bytes", &window_bytes,
        "Console relay credit: bytes a side may send beyond the other side's acknowledgement",
        262144, config::Range(4096, int64_t{16} * 1024 * 1024));
  s.Add("console.open_timeout_ms", &open_timeout_ms,
        "How long the node may take to open a console relay", 5000, config::Range(100, 60000));
  s.Add("console.page_idle_s", &page_idle_s,
        "An operator page session with no call for this long ends (idle); the page asks to log "
        "in again",
        1800, config::Range(1, 86400));
  s.Add("console.sweep_ms", &sweep_ms,
        "How often grants expire, revocations and maximum lengths reach live connections", 1000,
        config::Range(50, 60000));
}

ConsoleGwService::ConsoleGwService(ConsoleGwConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"console-gw", &Migrations()}, cfg_.common) {}

ConsoleGwService::~ConsoleGwService() {
  StopSweeper();
  if (gateway_) gateway_->Stop();
  svc_.Shutdown();
}

Result<void> ConsoleGwService::Start() {
  if (auto r = svc_.Start(); !r.ok()) return r;
  svc_.StartOutboxRelay();
  metrics_ = std::make_unique<ConsoleMetrics>(svc_.metrics());
  RegisterRoutes(
      svc_.Rpc(),
      std::make_shared<SessionHandlers>(svc_.pg(), svc_.nats(), svc_.source(), cfg_.max_session_s),
      std::make_shared<TokenHandlers>(svc_.pg(), svc_.source()),
      std::make_shared<PageSessionHandlers>(svc_.pg(), svc_.source()));
  if (auto r = svc_.ServeRequests(); !r.ok()) return r;
  if (auto r = StartGateway(); !r.ok()) return r;
  svc_.OnDrain("console gateway", [this] {
    StopSweeper();
    gateway_->Stop();
  });
  sweeper_ = std::thread([this] { SweepLoop(); });
  return Ok();
}

Result<void> ConsoleGwService::StartGateway() {
  GatewayOptions go;
  go.host = cfg_.http_host;
  go.port = static_cast<uint16_t>(cfg_.http_port);
  go.web_dir = cfg_.web_dir;
  go.novnc_dir = cfg_.novnc_dir;
  go.allowed_origins = SplitComma(cfg_.allowed_origins);
  go.secure_cookies = cfg_.secure_cookies;
  go.workers = static_cast<int>(cfg_.common.rpc_workers);
  gateway_ = std::make_unique<Gateway>(go, *this, svc_.log());
  auto port = gateway_->Start();
  if (!port.ok()) return port.error();
  gateway_port_ = *port;
  svc_.log().Info("console gateway listening",
                  {{"url", fmt::format("http://{}:{}/", cfg_.http_host, gateway_port_)}});
  return Ok();
}

// ---- Backend ----

ApiReply ConsoleGwService::Call(const std::string& token, const std::string& subject,
                                const std::string& body) {
  const ApiRoute* route = nullptr;
  for (const auto& r : ApiRoutes()) {
    // A node-scoped route is called on its node's subject (…node.<node id>.network.get).
    if (access::BindAddress(r.subject, subject)) route = &r;
  }
  if (route == nullptr) {
    return ErrorReply(
        Error::NotFound(reason::kSubjectNotAllowed, "the operator page may not call " + subject));
  }
  std::unique_ptr<pb::Message> req(
      pb::MessageFactory::generated_factory()->GetPrototype(route->request)->New());
  if (auto r = protojson::FromJson(body, req.get()); !r.ok()) return ErrorReply(r.error());
  auto raw = rpc::Client(svc_.nats())
                 .WithToken(token)
                 .CallRaw(subject, req->SerializeAsString(),
                          std::chrono::milliseconds(cfg_.common.nats_request_timeout_ms), "",
                          route->result->full_name(), route->request->full_name());
  if (!raw.ok()) return ErrorReply(raw.error());
  std::unique_ptr<pb::Message> res(
      pb::MessageFactory::generated_factory()->GetPrototype(route->result)->New());
  if (!res->ParseFromString(*raw)) {
    return ErrorReply(Error::Internal(reason::kMalformedReply, "reply does not parse"));
  }
  return {200, "{\"result\":" + protojson::ToJson(*res) + "}"};
}

void ConsoleGwService::Refused(const ConnectAttempt& a, Reason failure, const std::string& detail) {
  metrics_->Refused(failure.str());
  svc_.log().Warn("console connect refused", {{"failure", failure.str()},
                                              {"session_id", a.session_id},
                                              {"origin", a.origin},
                                              {"client", a.client_address}});
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    std::optional<v1::ConsoleSession> s;
    if (ids::IsUuid(a.session_id)) s = LoadSession(tx, a.session_id, false);
    v1::ConsoleSession shown;
    if (s) {
      shown = *s;
    } else {
      shown.set_session_id(a.session_id);
    }
    return Announce(tx, svc_.source(), shown, {failure.str(), detail, a.client_address, a.origin},
                    true);
  });
  if (!r.ok()) {
    svc_.log().Error("console refusal not recorded", {{"error", r.error().ToString()}});
  }
}

namespace {

// The attempt's grant, claimed in `tx`: its session becomes connected through `gateway`, or the
// attempt is refused (a connect.refused event; a grant presented for another session or past its
// minute also ends its session).
Result<ClaimOutcome> ClaimGrant(pqxx::work& tx, const std::string& source,
                                const std::string& gateway, const ConnectAttempt& a) {
  ClaimOutcome o;
  auto refuse = [&](const v1::ConsoleSession& s, EndReason failure,
                    std::string detail) -> Result<ClaimOutcome> {
    o.refused = failure;
    o.detail = std::move(detail);
    if (auto x = Announce(tx, source, s,
                          {TextOf(failure).str(), o.detail, a.client_address, a.origin}, true);
        !x.ok()) {
      return x.error();
    }
    return o;
  };
  auto s = LoadSessionByGrant(tx, GrantHash(a.grant), true);
  if (!s) {
    v1::ConsoleSession shown;
    if (auto path = LoadSession(tx, a.session_id, false)) {
      shown = *path;
    } else {
      shown.set_session_id(a.session_id);
    }
    return refuse(shown, EndReason::kGrantUnknown, "the grant matches no console session");
  }
  if (s->session_id() != a.session_id) {
    // A grant presented for another session is burnt: whoever holds it is not following the
    // link it was issued with.
    if (s->state() == v1::CONSOLE_SESSION_STATE_CREATED) {
      *s = FailWrongScope(tx, s->session_id());
      if (auto x =
              Announce(tx, source, *s,
                       {TextOf(EndReason::kWrongScope).str(),
                        "grant presented for session " + a.session_id, a.client_address, a.origin});
          !x.ok()) {
        return x.error();
      }
    }
    return refuse(
        *s, EndReason::kWrongScope,
        fmt::format("the grant is for session {}, not {}", s->session_id(), a.session_id));
  }
  switch (s->state()) {
    case v1::CONSOLE_SESSION_STATE_CREATED:
      break;
    case v1::CONSOLE_SESSION_STATE_EXPIRED:
      return refuse(*s, EndReason::kGrantExpired, "the grant was not used within its 60 s");
    case v1::CONSOLE_SESSION_STATE_REVOKED:
      return refuse(*s, EndReason::kGrantRevoked, "the session was revoked by " + s->revoked_by());
    default:
      return refuse(*s, EndReason::kGrantUsed,
                    "the grant was already used (single use); ask for a new session");
  }
  if (GrantPastConnectBy(tx, s->session_id())) {
    *s = ExpireGrant(tx, s->session_id());
    if (auto x = Announce(tx, source, *s,
                          {TextOf(EndReason::kGrantExpired).str(), "", a.client_address, a.origin});
        !x.ok()) {
      return x.error();
    }
    return refuse(*s, EndReason::kGrantExpired, "the grant was not used within its 60 s");
  }
  *s = MarkConnected(tx, s->session_id(), gateway, a.client_address, a.origin);
  // The operator who created it is the actor of its connection (the grant stands for them).
  outbox::ActorScope scope(OperatorActor(s->created_by()));
  if (auto x = Announce(tx, source, *s, {"", "", a.client_address, a.origin}); !x.ok()) {
    return x.error();
  }
  o.claimed =
      Claimed{s->session_id(), s->allocation_id(), s->node_id(), s->domain(), s->max_duration_s()};
  return o;
}

// Whether an open's failure means no node-agent answered (no responder, a timeout, a lost
// connection) rather than the agent refusing (domain_not_managed, console_unavailable, ...).
bool NodeUnreachable(const Error& e) {
  return e.code == Code::kUnavailable || e.code == Code::kDeadlineExceeded ||
         e.Is(gpuaas::reason::kNoResponders);
}

}  // namespace

Result<ClaimOutcome> ConsoleGwService::Claim(const ConnectAttempt& a) {
  const std::string source = svc_.source();
  const std::string gateway = svc_.instance_id();
  auto r =
      store::WithTx(*svc_.pg(), [&](pqxx::work& tx) { return ClaimGrant(tx, source, gateway, a); });
  if (r.ok() && !r->claimed) {
    const std::string failure = TextOf(r->refused).str();
    metrics_->Refused(failure);
    svc_.log().Warn("console connect refused", {{"failure", failure},
                                                {"session_id", a.session_id},
                                                {"origin", a.origin},
                                                {"client", a.client_address}});
  }
  return r;
}

OpenOutcome ConsoleGwService::Open(const Claimed& c, Bridge::Callbacks cb) {
  const auto t0 = std::chrono::steady_clock::now();
  Bridge::Options bo;
  bo.node_id = c.node_id;
  bo.session_id = c.session_id;
  bo.window_bytes = static_cast<uint64_t>(cfg_.window_bytes);
  auto bridge = Bridge::Start(svc_.nats(), bo, std::move(cb));
  if (!bridge.ok()) {
    const EndReason failed =
        NodeUnreachable(bridge.error()) ? EndReason::kNodeUnreachable : EndReason::kNodeRefused;
    RecordNotOpened(c, failed, bridge.error());
    return {nullptr, failed};
  }
  v1::OpenConsoleRequest req;
  req.set_session_id(c.session_id);
  req.set_allocation_id(c.allocation_id);
  req.set_domain(c.domain);
  *req.mutable_open_by() =
      TimeUtil::MillisecondsToTimestamp(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            std::chrono::system_clock::now().time_since_epoch())
                                            .count() +
                                        cfg_.open_timeout_ms);
  req.set_window_bytes(cfg_.window_bytes);
  req.set_max_duration_s(c.max_duration_s);
  auto opened =
      rpc::Client(svc_.nats())
          .Call<v1::OpenConsoleResponse>(fmt::format("gpuaas.v1.node.{}.console.open", c.node_id),
                                         req, std::chrono::milliseconds(cfg_.open_timeout_ms));
  if (!opened.ok()) {
    (*bridge)->Close(EndReason::kNodeRefused);
    const EndReason failed =
        NodeUnreachable(opened.error()) ? EndReason::kNodeUnreachable : EndReason::kNodeRefused;
    RecordNotOpened(c, failed, opened.error());
    return {nullptr, failed};
  }
  metrics_->Opened(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  svc_.log().Info("console relay open", {{"session_id", c.session_id},
                                         {"allocation_id", c.allocation_id},
                                         {"node_id", c.node_id},
                                         {"socket", opened->socket()}});
  return {*bridge, EndReason::kNodeRefused};
}

void ConsoleGwService::RecordNotOpened(const Claimed& c, EndReason failed, const Error& why) {
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    auto s = LoadSession(tx, c.session_id, true);
    if (!s || s->state() != v1::CONSOLE_SESSION_STATE_CONNECTED) return Ok();
    *s = FailSession(tx, c.session_id, failed);
    return Announce(tx, svc_.source(), *s, {TextOf(failed).str(), why.ToString(), "", ""});
  });
  if (!r.ok()) svc_.log().Error("console failure not recorded", {{"error", r.error().ToString()}});
  svc_.log().Warn("console relay not opened", {{"session_id", c.session_id},
                                               {"node_id", c.node_id},
                                               {"failure", TextOf(failed).str()},
                                               {"error", why.ToString()}});
}

void ConsoleGwService::Live(const std::string& session_id,
                            std::function<void(EndReason reason)> stop) {
  std::lock_guard lock(live_mu_);
  live_[session_id] = std::move(stop);
  metrics_->SetConnections(live_.size());
}

void ConsoleGwService::Finish(const std::string& session_id, EndReason reason,
                              uint64_t bytes_to_client, uint64_t bytes_from_client) {
  {
    std::lock_guard lock(live_mu_);
    live_.erase(session_id);
    metrics_->SetConnections(live_.size());
  }
  metrics_->Bytes(bytes_to_client, bytes_from_client);
  const std::string text = TextOf(reason).str();
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    auto s = LoadSession(tx, session_id, true);
    if (!s) return Ok();
    if (s->state() != v1::CONSOLE_SESSION_STATE_CONNECTED) {
      // Revoked (or failed by the sweeper) meanwhile: the end is recorded already; keep the
      // byte counts.
      RecordBytes(tx, session_id, bytes_to_client, bytes_from_client);
      return Ok();
    }
    *s = EndConnection(tx, session_id, bytes_to_client, bytes_from_client, reason);
    const double secs = double(TimeUtil::TimestampToMilliseconds(s->ended_at()) -
                               TimeUtil::TimestampToMilliseconds(s->connected_at())) /
                        1000.0;
    return Announce(tx, svc_.source(), *s,
                    {EndsFailed(reason) ? text : "",
                     fmt::format("{} after {:.1f} s: {} bytes to the client, {} from it", text,
                                 secs, bytes_to_client, bytes_from_client),
                     "", ""});
  });
  if (!r.ok()) svc_.log().Error("console end not recorded", {{"error", r.error().ToString()}});
  svc_.log().Info("console relay closed",
                  {{"session_id", session_id},
                   {"reason", text},
                   {"bytes_to_client", std::to_string(bytes_to_client)},
                   {"bytes_from_client", std::to_string(bytes_from_client)}});
}

// ---- the sweeper ----

void ConsoleGwService::StopSweeper() {
  {
    std::lock_guard lock(sweep_mu_);
    stopping_ = true;
  }
  sweep_cv_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
}

void ConsoleGwService::SweepLoop() {
  std::unique_lock lock(sweep_mu_);
  while (!stopping_) {
    lock.unlock();
    try {
      Sweep();
    } catch (const std::exception& e) {
      svc_.log().Warn("console sweep failed", {{"error", e.what()}});
    }
    lock.lock();
    sweep_cv_.wait_for(lock, std::chrono::milliseconds(cfg_.sweep_ms),
                       [this] { return stopping_; });
  }
}

void ConsoleGwService::Sweep() {
  std::vector<std::string> live_ids;
  {
    std::lock_guard lock(live_mu_);
    for (const auto& [id, stop] : live_) live_ids.push_back(id);
  }
  std::vector<std::pair<std::string, EndReason>> to_stop;  // session, reason
  std::map<std::string, int64_t> by_state;
  const std::string source = svc_.source();
  const auto now = std::chrono::steady_clock::now();
  const bool count = now - counted_ >= kGaugeEvery;
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    to_stop.clear();
    by_state.clear();
    // Unused grants past their minute.
    for (const auto& s : ExpireUnusedGrants(tx)) {
      if (auto x = Announce(tx, source, s, {}); !x.ok()) return x;
    }
    // Connections a lost gateway left behind: past their maximum by two minutes, so no live
    // gateway holds them any more.
    for (const auto& s : FailLostGatewaySessions(tx)) {
      if (auto x = Announce(tx, source, s, {TextOf(EndReason::kGatewayLost).str(), "", "", ""});
          !x.ok()) {
        return x;
      }
    }
    for (const auto& live : LoadLiveSessionStates(tx, live_ids)) {
      if (live.state != v1::CONSOLE_SESSION_STATE_CONNECTED) {
        // Ended meanwhile: revoked, or failed gateway_lost by a sweeper that took this gateway
        // for gone. Closed with the reason recorded.
        to_stop.emplace_back(live.session_id, live.end_reason.value_or(EndReason::kGatewayLost));
      } else if (live.past_max_duration) {
        to_stop.emplace_back(live.session_id, EndReason::kMaxDuration);
      }
    }
    // The gauges scan every session ever made: sampled every kGaugeEvery, not every sweep.
    if (count) by_state = CountSessionsByState(tx);
    return Ok();
  });
  if (!r.ok()) {
    svc_.log().Warn("console sweep failed", {{"error", r.error().ToString()}});
    return;
  }
  if (count) {
    metrics_->SetSessions(by_state);
    counted_ = now;
  }
  for (const auto& [id, reason] : to_stop) {
    std::function<void(EndReason)> stop;
    {
      std::lock_guard lock(live_mu_);
      auto it = live_.find(id);
      if (it != live_.end()) stop = it->second;
    }
    if (stop) stop(reason);
  }
}

}  // namespace gpuaas::console_gw
