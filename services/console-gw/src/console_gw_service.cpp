#include "console_gw_service.hpp"

#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/util/time_util.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"
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

constexpr const char* kColumns =
    "session_id, allocation_id, node_id, domain, state, created_by, reason, "
    "(extract(epoch from created_at) * 1000)::int8, (extract(epoch from connect_by) * 1000)::int8, "
    "max_duration_s, coalesce((extract(epoch from connected_at) * 1000)::int8, 0), "
    "coalesce((extract(epoch from ended_at) * 1000)::int8, 0), bytes_to_client, "
    "bytes_from_client, end_reason, revoked_by, generation, gateway";

v1::ConsoleSession FromRow(const pqxx::row& r) {
  v1::ConsoleSession s;
  s.set_session_id(r[0].as<std::string>());
  s.set_allocation_id(r[1].as<std::string>());
  s.set_node_id(r[2].as<std::string>());
  s.set_domain(r[3].as<std::string>());
  s.set_state(enums::FromColumn<v1::ConsoleSessionState>(r[4].as<std::string>()));
  s.set_created_by(r[5].as<std::string>());
  s.set_reason(r[6].as<std::string>());
  *s.mutable_created_at() = TimeUtil::MillisecondsToTimestamp(r[7].as<int64_t>());
  *s.mutable_connect_by() = TimeUtil::MillisecondsToTimestamp(r[8].as<int64_t>());
  s.set_max_duration_s(r[9].as<int64_t>());
  if (r[10].as<int64_t>() > 0) {
    *s.mutable_connected_at() = TimeUtil::MillisecondsToTimestamp(r[10].as<int64_t>());
  }
  if (r[11].as<int64_t>() > 0) {
    *s.mutable_ended_at() = TimeUtil::MillisecondsToTimestamp(r[11].as<int64_t>());
  }
  s.set_bytes_to_client(r[12].as<int64_t>());
  s.set_bytes_from_client(r[13].as<int64_t>());
  s.set_end_reason(r[14].as<std::string>());
  s.set_revoked_by(r[15].as<std::string>());
  s.set_generation(r[16].as<int64_t>());
  s.set_gateway(r[17].as<std::string>());
  return s;
}

struct Audit {
  std::string failure;
  std::string detail;
  std::string client_address;
  std::string origin;
};

// The session's event: gpuaas.v1.evt.console.session.<state>, or connect.refused.
Result<void> Announce(pqxx::work& tx, const std::string& source, const v1::ConsoleSession& s,
                      const Audit& a, bool refused = false) {
  v1::ConsoleSessionEvent ev;
  *ev.mutable_session() = s;
  ev.set_failure(a.failure);
  ev.set_detail(a.detail);
  ev.set_client_address(a.client_address);
  ev.set_origin(a.origin);
  outbox::EventSpec spec;
  spec.nats_subject = refused ? std::string("gpuaas.v1.evt.console.connect.refused")
                              : "gpuaas.v1.evt.console.session." + enums::Text(s.state());
  spec.source = source;
  spec.entity = s.session_id();
  spec.generation = refused ? 0 : s.generation();
  spec.correlation_id = s.allocation_id();
  spec.data = &ev;
  auto r = outbox::Append(tx, spec);
  if (!r.ok()) return r.error();
  return Ok();
}

std::optional<v1::ConsoleSession> Load(pqxx::work& tx, const std::string& where,
                                       const std::string& arg, bool lock) {
  auto rows = tx.exec_params(fmt::format("SELECT {} FROM console_sessions WHERE {}{}", kColumns,
                                         where, lock ? " FOR UPDATE" : ""),
                             arg);
  if (rows.empty()) return std::nullopt;
  return FromRow(rows[0]);
}

// Moves a session to a terminal or connected state (a new generation).
// `extra` are $3, $4, ... of `set_sql`.
v1::ConsoleSession Move(pqxx::work& tx, const std::string& session_id, const std::string& state,
                        const std::string& set_sql, const std::vector<std::string>& extra = {}) {
  std::vector<std::string> p = {session_id, state};
  p.insert(p.end(), extra.begin(), extra.end());
  auto rows = tx.exec_params(
      fmt::format("UPDATE console_sessions SET state = $2, generation = generation + 1{}{} WHERE "
                  "session_id = $1 RETURNING {}",
                  set_sql.empty() ? "" : ", ", set_sql, kColumns),
      pqxx::prepare::make_dynamic_params(p));
  return FromRow(rows[0]);
}

ApiReply ErrorReply(const Error& e) { return {HttpStatusFor(e.code), ErrorJson(e)}; }

// Relay failures end a session FAILED; everything else (either side closing, the maximum
// length, this gateway stopping) DISCONNECTED.
bool IsFailure(const std::string& reason) {
  return reason == "relay_lost" || reason == "node_refused" || reason == "node_unreachable" ||
         reason == "agent_stopping" || reason == "client_flood" || reason == "credit_exceeded";
}

std::string Bearer(const rpc::Context& ctx) {
  auto it = ctx.headers.find(auth::kHeaderAuthorization);
  return it == ctx.headers.end() ? "" : auth::BearerToken(it->second);
}

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
      {"gpuaas.v1.inventory.slot.approve", v1::ApproveSlotsRequest::descriptor(),
       v1::ApproveSlotsResponse::descriptor()},
      {"gpuaas.v1.inventory.slot.disable", v1::DisableSlotRequest::descriptor(),
       v1::DisableSlotResponse::descriptor()},
      {"gpuaas.v1.inventory.slot.repair", v1::RepairSlotRequest::descriptor(),
       v1::RepairSlotResponse::descriptor()},
      {"gpuaas.v1.inventory.node.desired.get", v1::GetDesiredSlotsRequest::descriptor(),
       v1::GetDesiredSlotsResponse::descriptor()},
      {"gpuaas.v1.scheduler.slot.list", v1::ListProjectedSlotsRequest::descriptor(),
       v1::ListProjectedSlotsResponse::descriptor()},
      {"gpuaas.v1.ipam.node.network.get", v1::GetNodeNetworkRequest::descriptor(),
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
  s.Add("console.sweep_ms", &sweep_ms,
        "How often grants expire, revocations and maximum lengths reach live connections", 1000,
        config::Range(50, 60000));
}

ConsoleGwService::ConsoleGwService(ConsoleGwConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"console-gw", &Migrations()}, cfg_.common) {}

ConsoleGwService::~ConsoleGwService() {
  {
    std::lock_guard lock(sweep_mu_);
    stopping_ = true;
  }
  sweep_cv_.notify_all();
  if (sweeper_.joinable()) sweeper_.join();
  if (gateway_) gateway_->Stop();
  svc_.Shutdown();
}

Result<void> ConsoleGwService::Start() {
  if (auto r = svc_.Start(); !r.ok()) return r;
  if (auto r = messaging::EnsureStream(*svc_.nats(), messaging::ConsoleEventsStream()); !r.ok()) {
    return r;
  }
  svc_.StartOutboxRelay();
  metrics_ = std::make_unique<ConsoleMetrics>(svc_.metrics());
  auto pool = svc_.pg();
  const std::string source = svc_.source();
  auto nats = svc_.nats();
  const auto cfg = cfg_;
  auto& rpc = svc_.Rpc();

  rpc.Handle<v1::CreateConsoleSessionRequest, v1::CreateConsoleSessionResponse>(
      "gpuaas.v1.console.session.create",
      [pool, source, nats, cfg](const v1::CreateConsoleSessionRequest& req,
                                rpc::Context& ctx) -> Result<v1::CreateConsoleSessionResponse> {
        std::map<std::string, std::string> bad;
        if (!ids::IsUuid(req.allocation_id())) bad["allocation_id"] = "not a UUID";
        if (req.reason().empty()) bad["reason"] = "required: why the console is opened";
        if (req.reason().size() > 500) bad["reason"] = "at most 500 characters";
        if (req.max_duration_s() < 0) bad["max_duration_s"] = "must not be negative";
        if (!bad.empty()) {
          const std::string reason = bad.count("reason") && bad.size() == 1 ? "reason_required"
                                     : bad.count("allocation_id") ? "invalid_allocation_id"
                                                                  : "invalid_request";
          return Error::InvalidArgument(reason, "console session request is invalid", bad);
        }
        // The allocation as the scheduler has it, asked with the caller's own token.
        v1::GetAllocationRequest get;
        get.set_allocation_id(req.allocation_id());
        auto got = rpc::Client(nats)
                       .WithToken(Bearer(ctx))
                       .Call<v1::GetAllocationResponse>(
                           "gpuaas.v1.scheduler.allocation.get", get,
                           std::chrono::milliseconds(ctx.RemainingMs()), ctx.traceparent);
        if (!got.ok()) return got.error();
        const v1::Allocation& a = got->allocation();
        if (a.shape() == v1::CAPACITY_SHAPE_BAREMETAL) {
          return Error::FailedPrecondition("no_console",
                                           "a bare-metal allocation has no VM console; use the "
                                           "node's BMC");
        }
        if ((a.state() != v1::ALLOCATION_STATE_PROVISIONING &&
             a.state() != v1::ALLOCATION_STATE_ACTIVE) ||
            a.node_id().empty()) {
          Error e = Error::FailedPrecondition(
              "allocation_not_live", fmt::format("allocation {} is {}: it has no VM to show",
                                                 a.allocation_id(), enums::Text(a.state())));
          e.details = {{"state", enums::Text(a.state())}};
          return e;
        }
        auto grant = NewGrant();
        if (!grant.ok()) return grant.error();
        const int64_t max_s = req.max_duration_s() == 0
                                  ? cfg.max_session_s
                                  : std::min(req.max_duration_s(), cfg.max_session_s);
        const std::string id = ids::NewUuidV7();
        const std::string creator = ctx.principal.subject;
        return store::WithTx(
            *pool, [&](pqxx::work& tx) -> Result<v1::CreateConsoleSessionResponse> {
              auto rows = tx.exec_params(
                  fmt::format(
                      "INSERT INTO console_sessions (session_id, allocation_id, node_id, "
                      "domain, state, grant_hash, created_by, reason, connect_by, "
                      "max_duration_s) VALUES ($1, $2, $3, $4, 'created', $5, $6, $7, now() + "
                      "$8 * interval '1 second', $9) RETURNING {}",
                      kColumns),
                  id, a.allocation_id(), a.node_id(), "gpuaas-" + a.allocation_id(),
                  GrantHash(*grant), creator, req.reason(), kGrantTtlSeconds, max_s);
              v1::CreateConsoleSessionResponse resp;
              *resp.mutable_session() = FromRow(rows[0]);
              resp.set_grant(*grant);
              resp.set_ws_path(fmt::format("/console/ws/{}?grant={}", id, *grant));
              resp.set_page_path(
                  fmt::format("/static/console.html?session={}&grant={}", id, *grant));
              outbox::SetActorReason(req.reason());
              if (auto r = Announce(tx, source, resp.session(), {}); !r.ok()) return r.error();
              return resp;
            });
      });

  rpc.Handle<v1::RevokeConsoleSessionRequest, v1::RevokeConsoleSessionResponse>(
      "gpuaas.v1.console.session.revoke",
      [pool, source](const v1::RevokeConsoleSessionRequest& req,
                     rpc::Context& ctx) -> Result<v1::RevokeConsoleSessionResponse> {
        if (!ids::IsUuid(req.session_id())) {
          return Error::InvalidArgument("invalid_session_id", "session_id is not a UUID",
                                        {{"session_id", "not a UUID"}});
        }
        const std::string who = ctx.principal.subject;
        return store::WithTx(
            *pool, [&](pqxx::work& tx) -> Result<v1::RevokeConsoleSessionResponse> {
              auto s = Load(tx, "session_id = $1", req.session_id(), true);
              if (!s) return Error::NotFound("session_not_found", "no session " + req.session_id());
              v1::RevokeConsoleSessionResponse resp;
              if (s->state() != v1::CONSOLE_SESSION_STATE_CREATED &&
                  s->state() != v1::CONSOLE_SESSION_STATE_CONNECTED) {
                *resp.mutable_session() = *s;  // already over
                return resp;
              }
              *resp.mutable_session() =
                  Move(tx, req.session_id(), "revoked",
                       "ended_at = now(), end_reason = 'revoked', revoked_by = $3", {who});
              if (!req.reason().empty()) outbox::SetActorReason(req.reason());
              if (auto r = Announce(tx, source, resp.session(), {"", req.reason(), "", ""});
                  !r.ok()) {
                return r.error();
              }
              return resp;
            });
      });

  rpc.Handle<v1::ListConsoleSessionsRequest, v1::ListConsoleSessionsResponse>(
      "gpuaas.v1.console.session.list",
      [pool](const v1::ListConsoleSessionsRequest& req,
             rpc::Context&) -> Result<v1::ListConsoleSessionsResponse> {
        auto limit = rpc::PageLimit(req.page_size());
        if (!limit.ok()) return limit.error();
        return store::WithTx(
            *pool,
            [&](pqxx::work& tx) -> Result<v1::ListConsoleSessionsResponse> {
              v1::ListConsoleSessionsResponse resp;
              for (const auto& r : tx.exec_params(
                       fmt::format("SELECT {} FROM console_sessions WHERE ($1 = '' OR "
                                   "allocation_id = $1) AND ($2 = '' OR state = $2) ORDER BY "
                                   "created_at DESC, session_id DESC LIMIT $3",
                                   kColumns),
                       req.allocation_id(), enums::Text(req.state()), *limit)) {
                *resp.add_sessions() = FromRow(r);
              }
              return resp;
            },
            store::ReadSnapshot());
      });

  if (auto r = svc_.ServeRequests(); !r.ok()) return r;

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
  svc_.OnDrain("console gateway", [this] {
    {
      std::lock_guard lock(sweep_mu_);
      stopping_ = true;
    }
    sweep_cv_.notify_all();
    if (sweeper_.joinable()) sweeper_.join();
    gateway_->Stop();
  });
  sweeper_ = std::thread([this] { SweepLoop(); });
  return Ok();
}

// ---- Backend ----

Result<Identity> ConsoleGwService::Login(const std::string& token) {
  auto p = auth::VerifyToken(token, svc_.token_public_keys());
  if (!p.ok()) return p.error();
  if (!p->HasRole(auth::kRoleOperator)) {
    return Error{Code::kPermissionDenied,
                 "role_not_allowed",
                 "the operator page is for operators; this token's roles do not include operator",
                 {},
                 false};
  }
  Identity id;
  id.subject = p->subject;
  id.roles = p->roles;
  id.expires_unix =
      std::chrono::duration_cast<std::chrono::seconds>(p->expires.time_since_epoch()).count();
  return id;
}

ApiReply ConsoleGwService::Call(const std::string& token, const std::string& subject,
                                const std::string& body) {
  const ApiRoute* route = nullptr;
  for (const auto& r : ApiRoutes()) {
    if (r.subject == subject) route = &r;
  }
  if (route == nullptr) {
    return ErrorReply(
        Error::NotFound("subject_not_allowed", "the operator page may not call " + subject));
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
    return ErrorReply(Error::Internal("malformed_reply", "reply does not parse"));
  }
  return {200, "{\"result\":" + protojson::ToJson(*res) + "}"};
}

void ConsoleGwService::Refused(const ConnectAttempt& a, const std::string& failure,
                               const std::string& detail) {
  metrics_->Refused(failure);
  svc_.log().Warn("console connect refused", {{"failure", failure},
                                              {"session_id", a.session_id},
                                              {"origin", a.origin},
                                              {"client", a.client_address}});
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    std::optional<v1::ConsoleSession> s;
    if (ids::IsUuid(a.session_id)) s = Load(tx, "session_id = $1", a.session_id, false);
    v1::ConsoleSession shown;
    if (s) {
      shown = *s;
    } else {
      shown.set_session_id(a.session_id);
    }
    return Announce(tx, svc_.source(), shown, {failure, detail, a.client_address, a.origin}, true);
  });
  if (!r.ok()) {
    svc_.log().Error("console refusal not recorded", {{"error", r.error().ToString()}});
  }
}

Result<Claimed> ConsoleGwService::Claim(const ConnectAttempt& a) {
  struct Outcome {
    std::string failure;
    std::string detail;
    Claimed claimed;
  };
  const std::string source = svc_.source();
  const std::string gateway = svc_.instance_id();
  const Audit audit{"", "", a.client_address, a.origin};
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<Outcome> {
    Outcome o;
    auto refuse = [&](const v1::ConsoleSession& s, std::string failure,
                      std::string detail) -> Result<Outcome> {
      o.failure = std::move(failure);
      o.detail = std::move(detail);
      if (auto x = Announce(tx, source, s, {o.failure, o.detail, a.client_address, a.origin}, true);
          !x.ok()) {
        return x.error();
      }
      return o;
    };
    auto s = Load(tx, "grant_hash = $1", GrantHash(a.grant), true);
    if (!s) {
      v1::ConsoleSession shown;
      if (auto path = Load(tx, "session_id = $1", a.session_id, false)) {
        shown = *path;
      } else {
        shown.set_session_id(a.session_id);
      }
      return refuse(shown, "grant_unknown", "the grant matches no console session");
    }
    if (s->session_id() != a.session_id) {
      // A grant presented for another session is burnt: whoever holds it is not following the
      // link it was issued with.
      if (s->state() == v1::CONSOLE_SESSION_STATE_CREATED) {
        *s = Move(tx, s->session_id(), "failed", "ended_at = now(), end_reason = 'wrong_scope'");
        if (auto x = Announce(tx, source, *s,
                              {"wrong_scope", "grant presented for session " + a.session_id,
                               a.client_address, a.origin});
            !x.ok()) {
          return x.error();
        }
      }
      return refuse(
          *s, "wrong_scope",
          fmt::format("the grant is for session {}, not {}", s->session_id(), a.session_id));
    }
    switch (s->state()) {
      case v1::CONSOLE_SESSION_STATE_CREATED:
        break;
      case v1::CONSOLE_SESSION_STATE_EXPIRED:
        return refuse(*s, "grant_expired", "the grant was not used within its 60 s");
      case v1::CONSOLE_SESSION_STATE_REVOKED:
        return refuse(*s, "grant_revoked", "the session was revoked by " + s->revoked_by());
      default:
        return refuse(*s, "grant_used",
                      "the grant was already used (single use); ask for a new session");
    }
    const bool expired =
        tx.exec_params("SELECT connect_by < now() FROM console_sessions WHERE session_id = $1",
                       s->session_id())[0][0]
            .as<bool>();
    if (expired) {
      *s = Move(tx, s->session_id(), "expired", "ended_at = now(), end_reason = 'grant_expired'");
      if (auto x = Announce(tx, source, *s, {"grant_expired", "", a.client_address, a.origin});
          !x.ok()) {
        return x.error();
      }
      return refuse(*s, "grant_expired", "the grant was not used within its 60 s");
    }
    *s = Move(tx, s->session_id(), "connected",
              "connected_at = now(), gateway = $3, client_address = $4, origin = $5",
              {gateway, a.client_address, a.origin});
    // The operator who created it is the actor of its connection (the grant stands for them).
    v1::Principal actor;
    actor.set_subject(s->created_by());
    actor.add_roles(auth::kRoleOperator);
    outbox::ActorScope scope(actor);
    if (auto x = Announce(tx, source, *s, audit); !x.ok()) return x.error();
    o.claimed = {s->session_id(), s->allocation_id(), s->node_id(), s->domain(),
                 s->max_duration_s()};
    return o;
  });
  if (!r.ok()) return r.error();
  if (!r->failure.empty()) {
    metrics_->Refused(r->failure);
    svc_.log().Warn("console connect refused", {{"failure", r->failure},
                                                {"session_id", a.session_id},
                                                {"origin", a.origin},
                                                {"client", a.client_address}});
    return Error{Code::kPermissionDenied, r->failure, r->detail, {}, false};
  }
  return r->claimed;
}

Result<std::shared_ptr<Bridge>> ConsoleGwService::Open(const Claimed& c, Bridge::Callbacks cb) {
  const auto t0 = std::chrono::steady_clock::now();
  Bridge::Options bo;
  bo.node_id = c.node_id;
  bo.session_id = c.session_id;
  bo.window_bytes = static_cast<uint64_t>(cfg_.window_bytes);
  auto bridge = Bridge::Start(svc_.nats(), bo, std::move(cb));
  Error failure = Error::Internal("", "");
  if (bridge.ok()) {
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
    if (opened.ok()) {
      metrics_->Opened(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      svc_.log().Info("console relay open", {{"session_id", c.session_id},
                                             {"allocation_id", c.allocation_id},
                                             {"node_id", c.node_id},
                                             {"socket", opened->socket()}});
      return *bridge;
    }
    failure = opened.error();
    (*bridge)->Close("node_refused");
  } else {
    failure = bridge.error();
  }
  // No responder, a timeout or a lost connection: the node is unreachable; anything the agent
  // answered (domain_not_managed, console_unavailable, ...) is its refusal.
  const bool unreachable = failure.code == Code::kUnavailable ||
                           failure.code == Code::kDeadlineExceeded ||
                           failure.reason == "no_responders";
  const std::string reason = unreachable ? "node_unreachable" : "node_refused";
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    auto s = Load(tx, "session_id = $1", c.session_id, true);
    if (!s || s->state() != v1::CONSOLE_SESSION_STATE_CONNECTED) return Ok();
    *s = Move(tx, c.session_id, "failed", "ended_at = now(), end_reason = $3", {reason});
    return Announce(tx, svc_.source(), *s, {reason, failure.ToString(), "", ""});
  });
  if (!r.ok()) svc_.log().Error("console failure not recorded", {{"error", r.error().ToString()}});
  svc_.log().Warn("console relay not opened", {{"session_id", c.session_id},
                                               {"node_id", c.node_id},
                                               {"failure", reason},
                                               {"error", failure.ToString()}});
  return Error{Code::kUnavailable, reason, failure.ToString(), {}, false};
}

void ConsoleGwService::Live(const std::string& session_id,
                            std::function<void(const std::string& reason)> stop) {
  std::lock_guard lock(live_mu_);
  live_[session_id] = std::move(stop);
  metrics_->SetConnections(live_.size());
}

void ConsoleGwService::Finish(const std::string& session_id, const std::string& reason,
                              uint64_t bytes_to_client, uint64_t bytes_from_client) {
  {
    std::lock_guard lock(live_mu_);
    live_.erase(session_id);
    metrics_->SetConnections(live_.size());
  }
  metrics_->Bytes(bytes_to_client, bytes_from_client);
  const bool failed = IsFailure(reason);
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    auto s = Load(tx, "session_id = $1", session_id, true);
    if (!s) return Ok();
    if (s->state() != v1::CONSOLE_SESSION_STATE_CONNECTED) {
      // Revoked (or failed by the sweeper) meanwhile: the end is recorded already; keep the
      // byte counts.
      tx.exec_params(
          "UPDATE console_sessions SET bytes_to_client = $2, bytes_from_client = $3 WHERE "
          "session_id = $1",
          session_id, static_cast<int64_t>(bytes_to_client),
          static_cast<int64_t>(bytes_from_client));
      return Ok();
    }
    *s = Move(tx, session_id, failed ? "failed" : "disconnected",
              "ended_at = now(), bytes_to_client = $3::int8, bytes_from_client = $4::int8, "
              "end_reason = $5",
              {std::to_string(bytes_to_client), std::to_string(bytes_from_client), reason});
    const double secs = double(TimeUtil::TimestampToMilliseconds(s->ended_at()) -
                               TimeUtil::TimestampToMilliseconds(s->connected_at())) /
                        1000.0;
    return Announce(tx, svc_.source(), *s,
                    {failed ? reason : "",
                     fmt::format("{} after {:.1f} s: {} bytes to the client, {} from it", reason,
                                 secs, bytes_to_client, bytes_from_client),
                     "", ""});
  });
  if (!r.ok()) svc_.log().Error("console end not recorded", {{"error", r.error().ToString()}});
  svc_.log().Info("console relay closed",
                  {{"session_id", session_id},
                   {"reason", reason},
                   {"bytes_to_client", std::to_string(bytes_to_client)},
                   {"bytes_from_client", std::to_string(bytes_from_client)}});
}

// ---- the sweeper ----

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
  std::vector<std::pair<std::string, std::string>> to_stop;  // session, reason
  std::map<std::string, int64_t> by_state;
  const std::string source = svc_.source();
  const auto now = std::chrono::steady_clock::now();
  const bool count = now - counted_ >= kGaugeEvery;
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    to_stop.clear();
    by_state.clear();
    // Unused grants past their minute.
    for (const auto& row : tx.exec(fmt::format(
             "UPDATE console_sessions SET state = 'expired', generation = generation + 1, "
             "ended_at = now(), end_reason = 'grant_expired' WHERE state = 'created' AND "
             "connect_by < now() RETURNING {}",
             kColumns))) {
      if (auto x = Announce(tx, source, FromRow(row), {}); !x.ok()) return x;
    }
    // Connections a lost gateway left behind: past their maximum by two minutes, so no live
    // gateway holds them any more.
    for (const auto& row : tx.exec(fmt::format(
             "UPDATE console_sessions SET state = 'failed', generation = generation + 1, "
             "ended_at = now(), end_reason = 'gateway_lost' WHERE state = 'connected' AND "
             "connected_at + (max_duration_s + 120) * interval '1 second' < now() RETURNING {}",
             kColumns))) {
      if (auto x = Announce(tx, source, FromRow(row), {"gateway_lost", "", "", ""}); !x.ok()) {
        return x;
      }
    }
    if (!live_ids.empty()) {
      for (const auto& row : tx.exec_params(
               "SELECT session_id, state, connected_at + max_duration_s * interval '1 second' "
               "<= now() FROM console_sessions WHERE session_id = ANY($1::text[])",
               store::TextArrayLiteral(live_ids))) {
        const auto state = row[1].as<std::string>();
        if (state == "revoked") {
          to_stop.emplace_back(row[0].as<std::string>(), "revoked");
        } else if (state != "connected") {
          to_stop.emplace_back(row[0].as<std::string>(), state);
        } else if (row[2].as<bool>()) {
          to_stop.emplace_back(row[0].as<std::string>(), "max_duration");
        }
      }
    }
    // The gauges scan every session ever made: sampled every kGaugeEvery, not every sweep.
    if (count) {
      for (const auto& row :
           tx.exec("SELECT state, count(*) FROM console_sessions GROUP BY state")) {
        by_state[row[0].as<std::string>()] = row[1].as<int64_t>();
      }
    }
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
    std::function<void(const std::string&)> stop;
    {
      std::lock_guard lock(live_mu_);
      auto it = live_.find(id);
      if (it != live_.end()) stop = it->second;
    }
    if (stop) stop(reason);
  }
}

}  // namespace gpuaas::console_gw
