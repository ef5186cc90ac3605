#pragma once
// Typed request/reply over NATS. A service subscribes once, in a queue group named after the
// service, to "gpuaas.*.<service>.>", and routes by subject to typed handlers (protobuf in,
// protobuf out). Every reply is a gpuaas.v1.Reply carrying a Status; malformed payloads,
// unknown subjects or versions, oversize payloads, expired deadlines and overload all get a
// structured error and the server keeps serving. Work runs on a bounded worker pool so a slow
// handler never blocks NATS' delivery thread; Drain() stops intake and finishes in-flight work.
#include <google/protobuf/any.pb.h>

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rate_limit.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/revocations.hpp"

namespace prometheus {
class Registry;
}

namespace gpuaas::rpc {

struct Context {
  // As served: the route's address (a client's role suffix taken off; a node-scoped address
  // keeps its `{node_id}`, bound in `node_id`).
  std::string subject;
  // The node a node-scoped subject (`….node.{node_id}.…`) names; "" for other subjects. The
  // server's permissions let a node publish only its own id there, and the request's own
  // `node_id` field must equal it (Server::Handle checks; PERMISSION_DENIED node_id_mismatch).
  std::string node_id;
  // The client role of the connection that sent it (the suffix the server let it publish:
  // access.hpp ClientSubject); "" for a platform identity (a service, a node).
  std::string client_role;
  std::string traceparent;  // this request's span (child of the caller's)
  std::string trace_id;
  std::chrono::system_clock::time_point deadline;
  messaging::Headers headers;
  log::Logger log;  // carries trace_id and subject, and the principal
  // Who sent it: the verified request token's principal, or (a platform identity calling a
  // subject the contract lets services and nodes call without a token) subject "internal".
  auth::Principal principal;
  bool HasToken() const { return !principal.token_id.empty(); }
  // The tenant a tenant principal is confined to ("" for operators, auditors and internal
  // callers, who see every tenant).
  std::string TenantScope() const {
    return principal.HasRole(auth::kRoleTenant) ? principal.tenant : std::string();
  }
  // Milliseconds left before the caller gives up (at least 1).
  int64_t RemainingMs() const;
};

struct ServerOptions {
  int workers = 4;
  size_t max_queue = 1024;                  // beyond this: RESOURCE_EXHAUSTED "overloaded"
  size_t max_payload = 256 * size_t{1024};  // bytes; beyond: INVALID_ARGUMENT payload_too_large
  int64_t default_deadline_ms = 10000;
  // PEM public keys that verify request tokens (Authorization: Bearer). Each served subject's
  // callers come from the contract (access.hpp RequestAccessFor): a subject only client roles
  // may call needs a valid token with one of their token roles; one platform identities may call
  // takes a request without a token as theirs.
  std::vector<std::string> token_public_keys;
  // The tenant issuer's keys: they verify tenant tokens only (auth::VerifyIssuedToken).
  std::vector<std::string> tenant_token_public_keys;
  // Per-principal limits of requests with a token, by token role and subject class
  // (rate_limit.hpp); empty = none. Over the limit: RESOURCE_EXHAUSTED rate_limited, retryable,
  // details retry_after_ms; counted in gpuaas_rpc_rate_limited_total{subject,role}.
  ratelimit::Limits rate_limits;
  // The token revocations in force (revocations.hpp); null = none checked. A revoked token is
  // UNAUTHENTICATED token_revoked.
  std::shared_ptr<const revocation::List> revocations;
};

// How far ahead a caller's deadline may lie: one day. A request lives seconds; a later
// deadline (a clock far off, or a bogus header) is capped here.
inline constexpr int64_t kMaxDeadlineAheadMs = int64_t{24} * 3600 * 1000;

// The deadline (Unix ms) of a request received at `now_ms` whose Gpuaas-Deadline-Ms header is
// `value`: absent ("") or not a decimal integer -> now_ms + default_ms; a deadline in the past
// stays past (it is answered deadline_exceeded), but never before the Unix epoch; one later than
// now_ms + kMaxDeadlineAheadMs -> now_ms + kMaxDeadlineAheadMs. The result converts to a
// system_clock time_point (nanoseconds) without overflow.
int64_t ParseDeadlineHeader(std::string_view value, int64_t now_ms, int64_t default_ms);

// A node-scoped subject's node (Context::node_id) against the request's own `node_id` field
// (the caller's identity, vouched for by the server, against what it asks about): the field
// empty takes the subject's node; another node is PERMISSION_DENIED node_id_mismatch. A request
// type without a string `node_id`, or a subject naming no node, passes.
Result<void> CheckSubjectNode(const Context& ctx, google::protobuf::Message& req);

// `address` with its `{node_id}` bound to `req`'s `node_id` field (a node-scoped subject is
// addressed by what the request names); an address without it is returned as it is. The field
// empty (or missing) is INVALID_ARGUMENT node_id_missing.
Result<std::string> BindSubject(const std::string& address, const google::protobuf::Message& req);

// Parses a served request and refuses what no handler should see: INVALID_ARGUMENT
// malformed_payload (not a valid message of its type) or string_has_nul (validate.hpp).
Result<void> DecodeRequest(const std::string& data, google::protobuf::Message& req);

class Server {
 public:
  using RawHandler =
      std::function<Result<void>(const std::string& data, Context& ctx, google::protobuf::Any*)>;

  // `filter` is the subscription, e.g. "gpuaas.*.inventory.>"; `service` names the queue group.
  Server(std::shared_ptr<messaging::Connection> conn, std::string service, std::string filter,
         log::Logger logger, prometheus::Registry* metrics, ServerOptions options = {});
  ~Server();

  template <typename Req, typename Resp>
  void Handle(const std::string& subject, std::function<Result<Resp>(const Req&, Context&)> fn) {
    Register(
        subject,
        [fn = std::move(fn)](const std::string& data, Context& ctx,
                             google::protobuf::Any* out) -> Result<void> {
          Req req;
          if (auto d = DecodeRequest(data, req); !d.ok()) return d.error();
          if (auto n = CheckSubjectNode(ctx, req); !n.ok()) return n.error();
          Result<Resp> r = fn(req, ctx);
          if (!r.ok()) return r.error();
          out->PackFrom(*r);
          return Ok();
        },
        Req::descriptor()->full_name(), Resp::descriptor()->full_name());
  }

  // One entry of a service's route table: `subject` is answered by the named handler `fn` of
  // `handlers` (a service's handler object, shared by every route of its table), e.g.
  //   rpc.Route("gpuaas.v1.ipam.subnet.set", h, &IpamHandlers::SetSubnet);
  // A node-scoped address (`gpuaas.v1.ipam.node.{node_id}.network.get`) answers that subject
  // for every node id, bound in Context::node_id.
  template <typename H, typename Req, typename Resp>
  void Route(const std::string& subject, std::shared_ptr<H> handlers,
             Result<Resp> (H::*fn)(const Req&, Context&)) {
    Handle<Req, Resp>(subject, [handlers = std::move(handlers), fn](const Req& req, Context& ctx) {
      return ((*handlers).*fn)(req, ctx);
    });
  }
  template <typename H, typename Req, typename Resp>
  void Route(const std::string& subject, std::shared_ptr<H> handlers,
             Result<Resp> (H::*fn)(const Req&, Context&) const) {
    Handle<Req, Resp>(subject, [handlers = std::move(handlers), fn](const Req& req, Context& ctx) {
      return ((*handlers).*fn)(req, ctx);
    });
  }

  // `request_type` and `result_type` (fully-qualified protobuf names, "" = not known) are what
  // the subject's contract entry (contract.hpp) says it takes and answers; Handle fills them in.
  // A subject is recorded as served once Start() subscribed.
  void Register(const std::string& subject, RawHandler handler, std::string request_type = "",
                std::string result_type = "");
  Result<void> Start();
  // Stops taking requests, answers what was already received, waits for in-flight work.
  void Drain(std::chrono::milliseconds timeout);
  size_t InFlight() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

class Client {
 public:
  explicit Client(std::shared_ptr<messaging::Connection> conn) : conn_(std::move(conn)) {}

  // `subject` is an operation's address; a node-scoped one (`….node.{node_id}.…`) is bound to
  // the request's `node_id` (BindSubject).
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds(5000),
                    const std::string& traceparent = "") {
    auto bound = BindSubject(subject, req);
    if (!bound.ok()) return bound.error();
    auto raw = CallRaw(*bound, req.SerializeAsString(), timeout, traceparent,
                       Resp::descriptor()->full_name(), Req::descriptor()->full_name());
    if (!raw.ok()) return raw.error();
    Resp resp;
    if (!resp.ParseFromString(*raw)) {
      return Error::Internal(gpuaas::reason::kMalformedReply,
                             "reply result does not parse as " + Resp::descriptor()->full_name());
    }
    return resp;
  }

  // Sends raw bytes; returns the serialized result of type `expected_type` or the error
  // carried in the reply's Status. `request_type` ("" = not known) is recorded with the
  // subject in the connection's contract registry.
  Result<std::string> CallRaw(const std::string& subject, const std::string& data,
                              std::chrono::milliseconds timeout, const std::string& traceparent,
                              const std::string& expected_type,
                              const std::string& request_type = "");

  // Every request of this client carries `token` (a request token: Authorization: Bearer).
  Client& WithToken(std::string token) {
    token_ = std::move(token);
    return *this;
  }

 private:
  std::shared_ptr<messaging::Connection> conn_;
  std::string token_;
};

// The page size of a paginated list request: 0 means `def`; outside 0..`max` is
// INVALID_ARGUMENT invalid_page_size.
Result<int> PageLimit(int32_t page_size, int def = 100, int max = 1000);

}  // namespace gpuaas::rpc
