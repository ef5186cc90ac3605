#include "gpuaas/common/rpc.hpp"

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/validate.hpp"
#include "gpuaas/v1/status.pb.h"

namespace gpuaas::rpc {

namespace {
constexpr const char* kNodeParam = "{node_id}";

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int64_t ParseDeadlineHeader(std::string_view value, int64_t now_ms, int64_t default_ms) {
  const int64_t latest = now_ms + kMaxDeadlineAheadMs;
  const int64_t fallback =
      std::clamp<int64_t>(now_ms + std::max<int64_t>(0, default_ms), 0, latest);
  int64_t ms = 0;
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(value.data(), end, ms);
  if (value.empty() || ptr != end) return fallback;  // absent or malformed: as if absent
  if (ec == std::errc::result_out_of_range) return value.front() == '-' ? 0 : latest;
  if (ec != std::errc()) return fallback;
  return std::clamp<int64_t>(ms, 0, latest);
}

int64_t Context::RemainingMs() const {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                  deadline - std::chrono::system_clock::now())
                  .count();
  return std::max<int64_t>(1, left);
}

struct Server::Impl {
  std::shared_ptr<messaging::Connection> conn;
  std::string service;
  std::string filter;
  log::Logger log;
  ServerOptions opts;
  std::map<std::string, RawHandler> handlers;
  // The node-scoped routes (an address with `{node_id}`).
  std::vector<std::string> node_routes;
  // subject -> (request type, result type), for the contract registry.
  std::map<std::string, std::pair<std::string, std::string>> types;
  natsSubscription* sub = nullptr;

  std::mutex mu;
  std::condition_variable cv;
  std::condition_variable idle_cv;
  std::deque<natsMsg*> queue;
  size_t in_flight = 0;
  bool stopping = false;
  std::vector<std::thread> workers;

  std::unique_ptr<ratelimit::Limiter> limiter;
  prometheus::Family<prometheus::Counter>* rate_limited = nullptr;
  prometheus::Family<prometheus::Counter>* requests = nullptr;
  prometheus::Family<prometheus::Histogram>* duration = nullptr;

  // The route that serves `subject`, and the node id a node-scoped route binds: an exact route
  // first, then the node-scoped ones (access::BindAddress).
  struct Route {
    std::string address;
    std::string node_id;
  };
  std::optional<Route> Match(const std::string& subject) const {
    if (handlers.count(subject) > 0) return Route{subject, ""};
    for (const auto& address : node_routes) {
      auto bound = access::BindAddress(address, subject);
      if (bound) return Route{address, (*bound)["node_id"]};
    }
    return std::nullopt;
  }

  void RecordServed(const std::string& subject) {
    const auto& [request_type, result_type] = types[subject];
    conn->contract().Record({contract::Role::kServe, subject, request_type, result_type,
                             "rpc server " + service + " on " + filter, 0});
  }

  void Reply(const messaging::Message& m, const Context& ctx, const v1::Reply& reply) {
    if (m.reply.empty()) return;
    messaging::Headers h{{messaging::kHeaderTraceparent, ctx.traceparent}};
    auto r = conn->Reply(m.reply, reply.SerializeAsString(), h);
    if (!r.ok()) ctx.log.Warn("reply publish failed", {{"error", r.error().ToString()}});
  }

  void Process(natsMsg* raw) {
    const auto started = std::chrono::steady_clock::now();
    messaging::Message m = messaging::FromNats(raw);
    natsMsg_Destroy(raw);
    Context ctx;
    // A client's request arrives as <subject>.<client role> (access.hpp ClientSubject).
    const auto served =
        access::ResolveServed(access::EmbeddedContract(), m.subject,
                              [&](const std::string& s) { return Match(s).has_value(); });
    const auto route = served ? Match(served->subject) : std::nullopt;
    ctx.subject = route ? route->address : m.subject;
    if (route) ctx.node_id = route->node_id;
    if (served) ctx.client_role = served->client_role;
    ctx.headers = m.headers;
    ctx.traceparent = ids::ChildTraceparent(m.Header(messaging::kHeaderTraceparent));
    ctx.trace_id = ids::TraceId(ctx.traceparent);
    const int64_t deadline_ms = ParseDeadlineHeader(m.Header(messaging::kHeaderDeadline), NowMs(),
                                                    opts.default_deadline_ms);
    ctx.deadline = std::chrono::system_clock::time_point(std::chrono::milliseconds(deadline_ms));
    ctx.log = log.With({{"trace_id", ctx.trace_id}, {"subject", ctx.subject}});
    if (!ctx.node_id.empty()) ctx.log = ctx.log.With({{"node_id", ctx.node_id}});

    v1::Reply reply;
    Result<void> result = Dispatch(m, ctx, reply.mutable_result());
    auto* st = reply.mutable_status();
    if (result.ok()) {
      st->set_code(v1::OK);
    } else {
      reply.clear_result();
      const Error& e = result.error();
      st->set_code(static_cast<v1::Code>(static_cast<int>(e.code)));
      st->set_reason(e.reason);
      st->set_message(e.message);
      st->set_retryable(e.retryable);
      for (const auto& [k, v] : e.details) (*st->mutable_details())[k] = v;
      const auto lvl = e.code == Code::kInternal ? log::Level::kError : log::Level::kInfo;
      ctx.log.Log(lvl, "request failed", {{"error", e.ToString()}});
    }
    // Metrics are recorded before the reply goes out so that a caller who has its answer
    // also sees it counted.
    const std::string code = CodeName(static_cast<Code>(st->code()));
    const std::string label = route ? route->address : "unknown";
    if (requests) requests->Add({{"subject", label}, {"code", code}}).Increment();
    if (duration) {
      duration
          ->Add({{"subject", label}},
                prometheus::Histogram::BucketBoundaries{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                        0.05, 0.1, 0.25, 1, 5})
          .Observe(
              std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count());
    }
    Reply(m, ctx, reply);
  }

  Result<void> Dispatch(const messaging::Message& m, Context& ctx, google::protobuf::Any* out) {
    if (m.data.size() > opts.max_payload) {
      return Error::InvalidArgument(
          reason::kPayloadTooLarge,
          fmt::format("request is {} bytes; the limit is {}", m.data.size(), opts.max_payload),
          {{"size", std::to_string(m.data.size())}, {"limit", std::to_string(opts.max_payload)}});
    }
    auto tokens = access::SubjectTokens(m.subject);
    if (tokens.size() < 3 || tokens[0] != "gpuaas") {
      return Error::InvalidArgument(reason::kUnknownSubject, "not a gpuaas subject: " + m.subject);
    }
    if (tokens[1] != "v1") {
      return Error::InvalidArgument(
          reason::kUnsupportedVersion,
          fmt::format("subject version '{}' is not served; this service speaks v1", tokens[1]),
          {{"version", tokens[1]}, {"supported", "v1"}});
    }
    auto it = handlers.find(ctx.subject);
    if (it == handlers.end()) {
      return Error::Of(Code::kUnimplemented, reason::kUnknownSubject,
                       "no handler for " + m.subject + " in " + service, {}, false);
    }
    if (auto a = Authenticate(m, ctx); !a.ok()) return a;
    if (auto l = Limit(ctx); !l.ok()) return l;
    if (std::chrono::system_clock::now() >= ctx.deadline) {
      return Error::Of(Code::kDeadlineExceeded, reason::kDeadlineExceeded,
                       "the caller's deadline passed before the request was handled", {}, false);
    }
    // Events the handler appends name this principal (outbox::ActorScope); a platform caller's
    // requests leave them to the service's own identity.
    std::optional<outbox::ActorScope> scope;
    if (ctx.HasToken()) {
      v1::Principal actor;
      actor.set_subject(ctx.principal.subject);
      actor.set_tenant(ctx.principal.tenant);
      for (const auto& r : ctx.principal.roles) actor.add_roles(r);
      actor.set_token_id(ctx.principal.token_id);
      scope.emplace(std::move(actor));
    }
    try {
      return it->second(m.data, ctx, out);
    } catch (const std::exception& e) {
      return Error::Internal(reason::kHandlerException, e.what());
    }
  }

  // The contract's access of a served subject, worked out once per subject (only subjects with
  // a handler get here).
  std::mutex access_mu;
  std::map<std::string, access::RequestAccess> access_cache;
  access::RequestAccess AccessOf(const std::string& subject) {
    std::lock_guard lock(access_mu);
    auto it = access_cache.find(subject);
    if (it == access_cache.end()) {
      it = access_cache
               .emplace(subject, access::RequestAccessFor(access::EmbeddedContract(), subject))
               .first;
    }
    return it->second;
  }

  // Verified tokens, until they expire: a client sends the same token with many requests, and
  // an ES256 verification (libjwt, PEM parse included) costs about 1.2 ms. Bounded: when full it
  // starts over. Only tokens that verified are kept, so a forged one is checked every time.
  std::mutex token_mu;
  std::unordered_map<std::string, auth::Principal> token_cache;
  static constexpr size_t kTokenCacheMax = 4096;
  // A revoked token is refused every time, cached or not.
  Result<auth::Principal> Verified(const std::string& token) {
    auto p = VerifiedOnce(token);
    if (p.ok() && opts.revocations) {
      if (auto r = opts.revocations->Check(*p); !r.ok()) return r.error();
    }
    return p;
  }
  Result<auth::Principal> VerifiedOnce(const std::string& token) {
    const auto now = std::chrono::system_clock::now();
    {
      std::lock_guard lock(token_mu);
      auto it = token_cache.find(token);
      if (it != token_cache.end()) {
        if (it->second.expires > now) return it->second;
        token_cache.erase(it);
      }
    }
    auto p =
        auth::VerifyIssuedToken(token, opts.token_public_keys, opts.tenant_token_public_keys, now);
    if (!p.ok()) return p.error();
    std::lock_guard lock(token_mu);
    if (token_cache.size() >= kTokenCacheMax) token_cache.clear();
    token_cache.emplace(token, *p);
    return p;
  }

  // Who may call is the contract's (x-gpuaas-access callers); the transport already limited the
  // subjects this connection may publish, this names the principal and checks its roles.
  Result<void> Authenticate(const messaging::Message& m, Context& ctx) {
    const access::RequestAccess a = AccessOf(ctx.subject);
    const std::string bearer = auth::BearerToken(m.Header(auth::kHeaderAuthorization));
    if (!ctx.client_role.empty()) return AuthenticateClient(m, a, bearer, ctx);
    if (!a.declared || a.token_roles.empty()) {
      // Only platform identities may publish this subject (the server enforces it; a subject
      // no operation declares nobody may): a token adds nothing, the service's own identity
      // records what it does.
      ctx.principal.subject = "internal";
      return Ok();
    }
    if (bearer.empty()) {
      if (!m.Header(auth::kHeaderAuthorization).empty()) {
        return Error::Of(Code::kUnauthenticated, reason::kTokenMalformed,
                         "the Authorization header is not 'Bearer <token>'", {}, false);
      }
      if (a.internal) {
        ctx.principal.subject = "internal";
        return Ok();
      }
      return Error::Of(Code::kUnauthenticated, reason::kTokenMissing,
                       m.subject + " needs a request token (Authorization: Bearer)", {}, false);
    }
    auto p = Verified(bearer);
    if (!p.ok()) return p.error();
    return CheckRoles(*p, a, ctx);
  }

  // A request a client connection sent (<subject>.<client role>): it always needs a token, and
  // every role of that token must be one the connection's role may present (roles.yaml
  // token_roles): a tenant gateway cannot act with an operator's or auditor's token.
  Result<void> AuthenticateClient(const messaging::Message& m, const access::RequestAccess& a,
                                  const std::string& bearer, Context& ctx) {
    if (bearer.empty()) {
      return Error::Of(Code::kUnauthenticated,
                       m.Header(auth::kHeaderAuthorization).empty() ? reason::kTokenMissing
                                                                    : reason::kTokenMalformed,
                       ctx.subject + " needs a request token (Authorization: Bearer)", {}, false);
    }
    auto p = Verified(bearer);
    if (!p.ok()) return p.error();
    const auto& role = access::EmbeddedContract().roles.at(ctx.client_role);
    for (const auto& r : p->roles) {
      if (std::find(role.token_roles.begin(), role.token_roles.end(), r) ==
          role.token_roles.end()) {
        return Error::Of(
            Code::kPermissionDenied, reason::kTokenRoleNotAllowedForConnection,
            fmt::format("a {} connection may not present a token with role {} ({})",
                        ctx.client_role, r, p->subject),
            {{"connection_role", ctx.client_role}, {"token_role", r}, {"principal", p->subject}},
            false);
      }
    }
    return CheckRoles(*p, a, ctx);
  }

  // The principal's token bucket for this subject's class (rate_limit.hpp); platform callers
  // (no token) are not limited.
  Result<void> Limit(const Context& ctx) {
    if (!limiter || !ctx.HasToken()) return Ok();
    const std::string klass = ratelimit::SubjectClass(ctx.subject);
    const auto wait = limiter->Take(ctx.principal.subject, ctx.principal.roles, klass,
                                    std::chrono::steady_clock::now());
    if (!wait) return Ok();
    const std::string role = ctx.principal.roles.empty() ? "" : ctx.principal.roles.front();
    if (rate_limited) rate_limited->Add({{"subject", ctx.subject}, {"role", role}}).Increment();
    return Error::Of(Code::kResourceExhausted, reason::kRateLimited,
                     fmt::format("{} sends {} requests faster than its limit; retry in {} ms",
                                 ctx.principal.subject, klass, wait->count()),
                     {{"retry_after_ms", std::to_string(wait->count())}, {"class", klass}}, true);
  }

  // One of the verified token's roles may call the subject.
  Result<void> CheckRoles(const auth::Principal& p, const access::RequestAccess& a, Context& ctx) {
    ctx.principal = p;
    ctx.log = ctx.log.With({{"principal", p.subject}});
    bool allowed = false;
    for (const auto& r : p.roles) {
      if (std::find(a.token_roles.begin(), a.token_roles.end(), r) != a.token_roles.end()) {
        allowed = true;
      }
    }
    if (!allowed) {
      std::string roles;
      for (const auto& r : p.roles) roles += (roles.empty() ? "" : ",") + r;
      return Error::Of(Code::kPermissionDenied, reason::kRoleNotAllowed,
                       fmt::format("{} ({}) may not call {}", p.subject, roles, ctx.subject),
                       {{"principal", p.subject}, {"roles", roles}}, false);
    }
    return Ok();
  }

  void Worker() {
    while (true) {
      natsMsg* m = nullptr;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stopping || !queue.empty(); });
        if (queue.empty()) return;  // stopping and nothing left
        m = queue.front();
        queue.pop_front();
        ++in_flight;
      }
      Process(m);
      {
        std::lock_guard lock(mu);
        --in_flight;
        if (in_flight == 0 && queue.empty()) idle_cv.notify_all();
      }
    }
  }

  static void OnMsg(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* self = static_cast<Impl*>(closure);
    {
      std::lock_guard lock(self->mu);
      if (!self->stopping && self->queue.size() < self->opts.max_queue) {
        self->queue.push_back(msg);
        self->cv.notify_one();
        return;
      }
    }
    // Overloaded (or stopping): answer now rather than letting the caller time out.
    messaging::Message m = messaging::FromNats(msg);
    natsMsg_Destroy(msg);
    v1::Reply reply;
    reply.mutable_status()->set_code(v1::RESOURCE_EXHAUSTED);
    reply.mutable_status()->set_reason("overloaded");
    reply.mutable_status()->set_message("server queue is full or draining; retry");
    reply.mutable_status()->set_retryable(true);
    if (!m.reply.empty()) (void)self->conn->Reply(m.reply, reply.SerializeAsString());
  }
};

Server::Server(std::shared_ptr<messaging::Connection> conn, std::string service, std::string filter,
               log::Logger logger, prometheus::Registry* metrics, ServerOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->conn = std::move(conn);
  impl_->service = std::move(service);
  impl_->filter = std::move(filter);
  impl_->log = std::move(logger);
  impl_->opts = std::move(options);
  if (!impl_->opts.rate_limits.empty()) {
    impl_->limiter = std::make_unique<ratelimit::Limiter>(impl_->opts.rate_limits);
  }
  if (metrics) {
    impl_->rate_limited = &prometheus::BuildCounter()
                               .Name("gpuaas_rpc_rate_limited_total")
                               .Help(
                                   "Requests refused for their principal's rate limit, by "
                                   "subject and the principal's first role")
                               .Register(*metrics);
    impl_->requests = &prometheus::BuildCounter()
                           .Name("gpuaas_rpc_requests_total")
                           .Help("Requests answered, by subject and status code")
                           .Register(*metrics);
    impl_->duration = &prometheus::BuildHistogram()
                           .Name("gpuaas_rpc_duration_seconds")
                           .Help("Time from dequeue to reply, by subject")
                           .Register(*metrics);
  }
}

Server::~Server() { Drain(std::chrono::milliseconds(2000)); }

void Server::Register(const std::string& subject, RawHandler handler, std::string request_type,
                      std::string result_type) {
  impl_->handlers[subject] = std::move(handler);
  if (subject.find(kNodeParam) != std::string::npos) {
    impl_->node_routes.push_back(subject);
  }
  impl_->types[subject] = {std::move(request_type), std::move(result_type)};
  if (impl_->sub) impl_->RecordServed(subject);
}

Result<void> Server::Start() {
  for (int i = 0; i < impl_->opts.workers; ++i) {
    impl_->workers.emplace_back([this] { impl_->Worker(); });
  }
  natsStatus s =
      natsConnection_QueueSubscribe(&impl_->sub, impl_->conn->raw(), impl_->filter.c_str(),
                                    impl_->service.c_str(), &Impl::OnMsg, impl_.get());
  if (s != NATS_OK) return messaging::NatsError(s, "subscribe " + impl_->filter);
  natsSubscription_SetPendingLimits(impl_->sub, -1, -1);
  for (const auto& [subject, handler] : impl_->handlers) impl_->RecordServed(subject);
  // The server has the subscription once the flush returns: a request sent right after Start()
  // (a restarted service, a test) finds a responder instead of no_responders.
  // A refused subscription is reported only asynchronously: check, and fail the start.
  if (auto f = impl_->conn->CheckPermitted(impl_->filter, std::chrono::seconds(5)); !f.ok()) {
    if (f.error().code == Code::kPermissionDenied) return f.error();
    impl_->log.Warn("rpc subscription not confirmed by the server yet",
                    {{"error", f.error().ToString()}});
  }
  impl_->log.Info("rpc server started", {{"filter", impl_->filter},
                                         {"handlers", std::to_string(impl_->handlers.size())}});
  return Ok();
}

void Server::Drain(std::chrono::milliseconds timeout) {
  if (!impl_) return;
  if (impl_->sub) {
    // Stop interest; messages already delivered to us are still queued and answered.
    natsSubscription_Drain(impl_->sub);
    natsSubscription_WaitForDrainCompletion(impl_->sub, timeout.count());
    natsSubscription_Destroy(impl_->sub);
    impl_->sub = nullptr;
  }
  {
    std::unique_lock lock(impl_->mu);
    impl_->idle_cv.wait_for(lock, timeout,
                            [&] { return impl_->queue.empty() && impl_->in_flight == 0; });
    impl_->stopping = true;
  }
  impl_->cv.notify_all();
  for (auto& t : impl_->workers) {
    if (t.joinable()) t.join();
  }
  impl_->workers.clear();
}

Result<void> DecodeRequest(const std::string& data, google::protobuf::Message& req) {
  if (!req.ParseFromString(data)) {
    return Error::InvalidArgument(
        reason::kMalformedPayload,
        "request body is not a valid " + req.GetDescriptor()->full_name() + " message");
  }
  // Protobuf strings may hold NUL, but PostgreSQL text and C strings end at it: what would be
  // stored is not what was sent. Refused at the edge, for every served request.
  return validate::RefuseNulStrings(req);
}

namespace {
// The request's string field `node_id`, if its type has one.
const google::protobuf::FieldDescriptor* NodeIdField(const google::protobuf::Message& m) {
  const auto* f = m.GetDescriptor()->FindFieldByName("node_id");
  if (f == nullptr || f->is_repeated() ||
      f->cpp_type() != google::protobuf::FieldDescriptor::CPPTYPE_STRING) {
    return nullptr;
  }
  return f;
}
}  // namespace

Result<void> CheckSubjectNode(const Context& ctx, google::protobuf::Message& req) {
  if (ctx.node_id.empty()) return Ok();
  const auto* f = NodeIdField(req);
  if (f == nullptr) return Ok();
  const auto* refl = req.GetReflection();
  const std::string asked = refl->GetString(req, f);
  if (asked.empty()) {
    refl->SetString(&req, f, ctx.node_id);
    return Ok();
  }
  if (asked != ctx.node_id) {
    return Error::Of(
        Code::kPermissionDenied, reason::kNodeIdMismatch,
        fmt::format("the request names node {} on node {}'s subject", asked, ctx.node_id),
        {{"subject_node_id", ctx.node_id}, {"node_id", asked}}, false);
  }
  return Ok();
}

Result<std::string> BindSubject(const std::string& address, const google::protobuf::Message& req) {
  const auto at = address.find(kNodeParam);
  if (at == std::string::npos) return address;
  const auto* f = NodeIdField(req);
  const std::string node = f != nullptr ? req.GetReflection()->GetString(req, f) : "";
  if (node.empty()) {
    return Error::InvalidArgument(reason::kNodeIdMissing,
                                  address + " is node-scoped: the request needs its node_id",
                                  {{"node_id", "required"}});
  }
  if (node.find_first_of(".*> \t\r\n") != std::string::npos) {
    return Error::InvalidArgument(reason::kNodeIdInvalid,
                                  "node id '" + node + "' cannot be a subject token",
                                  {{"node_id", "not a node id"}});
  }
  std::string bound = address;
  bound.replace(at, std::string(kNodeParam).size(), node);
  return bound;
}

size_t Server::InFlight() const {
  std::lock_guard lock(impl_->mu);
  return impl_->in_flight + impl_->queue.size();
}

Result<std::string> Client::CallRaw(const std::string& subject, const std::string& data,
                                    std::chrono::milliseconds timeout,
                                    const std::string& traceparent,
                                    const std::string& expected_type,
                                    const std::string& request_type) {
  // The types only; Connection::Request records (and counts) the request itself.
  conn_->contract().Record(
      {contract::Role::kRequest, subject, request_type, expected_type, "rpc client", 0});
  messaging::Headers h{
      {messaging::kHeaderTraceparent,
       traceparent.empty() ? ids::NewTraceparent() : ids::ChildTraceparent(traceparent)},
      {messaging::kHeaderDeadline, std::to_string(NowMs() + timeout.count())}};
  if (!token_.empty()) h[auth::kHeaderAuthorization] = "Bearer " + token_;
  auto resp = conn_->Request(subject, data, h, timeout);
  if (!resp.ok()) return resp.error();
  v1::Reply reply;
  if (!reply.ParseFromString(resp->data)) {
    return Error::Internal(reason::kMalformedReply,
                           "reply to " + subject + " is not a gpuaas.v1.Reply");
  }
  const auto& st = reply.status();
  if (st.code() != v1::OK) {
    Error e{static_cast<Code>(static_cast<int>(st.code())),
            st.reason(),
            st.message(),
            {},
            st.retryable()};
    for (const auto& [k, v] : st.details()) e.details[k] = v;
    return e;
  }
  const std::string& url = reply.result().type_url();
  if (url.size() < expected_type.size() ||
      url.compare(url.size() - expected_type.size(), expected_type.size(), expected_type) != 0) {
    return Error::Internal(reason::kUnexpectedReplyType,
                           "expected " + expected_type + ", got " + url);
  }
  return reply.result().value();
}

Result<int> PageLimit(int32_t page_size, int def, int max) {
  if (page_size < 0 || page_size > max) {
    return Error::InvalidArgument(reason::kInvalidPageSize,
                                  fmt::format("page_size must be 0..{}", max),
                                  {{"page_size", fmt::format("must be 0..{}", max)}});
  }
  return page_size == 0 ? def : page_size;
}

}  // namespace gpuaas::rpc
