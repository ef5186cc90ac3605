#include "console_gw_routes.hpp"

#include <algorithm>
#include <map>

#include <fmt/format.h>

#include "console_store.hpp"
#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/console_gw/console_domain.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::console_gw {

void RegisterRoutes(rpc::Server& rpc, const std::shared_ptr<SessionHandlers>& sessions,
                    const std::shared_ptr<TokenHandlers>& tokens,
                    const std::shared_ptr<PageSessionHandlers>& logins) {
  rpc.Route("gpuaas.v1.console.session.create", sessions, &SessionHandlers::Create);
  rpc.Route("gpuaas.v1.console.session.revoke", sessions, &SessionHandlers::Revoke);
  rpc.Route("gpuaas.v1.console.session.list", sessions, &SessionHandlers::List);
  rpc.Route("gpuaas.v1.console.token.revoke", tokens, &TokenHandlers::Revoke);
  rpc.Route("gpuaas.v1.console.token.revocation.list", tokens, &TokenHandlers::List);
  rpc.Route("gpuaas.v1.console.login.list", logins, &PageSessionHandlers::List);
  rpc.Route("gpuaas.v1.console.login.end", logins, &PageSessionHandlers::End);
}

namespace {

std::string Bearer(const rpc::Context& ctx) {
  auto it = ctx.headers.find(auth::kHeaderAuthorization);
  return it == ctx.headers.end() ? "" : auth::BearerToken(it->second);
}

// INVALID_ARGUMENT for a create request no session can be made of.
Result<void> CheckCreateRequest(const v1::CreateConsoleSessionRequest& req) {
  std::map<std::string, std::string> bad;
  if (!ids::IsUuid(req.allocation_id())) bad["allocation_id"] = "not a UUID";
  if (req.reason().empty()) bad["reason"] = "required: why the console is opened";
  if (req.reason().size() > 500) bad["reason"] = "at most 500 characters";
  if (req.max_duration_s() < 0) bad["max_duration_s"] = "must not be negative";
  if (bad.empty()) return Ok();
  const Reason why = bad.count("reason") && bad.size() == 1 ? reason::kReasonRequired
                     : bad.count("allocation_id")           ? reason::kInvalidAllocationId
                                                            : reason::kInvalidRequest;
  return Error::InvalidArgument(why, "console session request is invalid", bad);
}

// FAILED_PRECONDITION unless the allocation is a VM placed on a node.
Result<void> CheckHasConsole(const v1::Allocation& a) {
  if (a.shape() == v1::CAPACITY_SHAPE_BAREMETAL) {
    return Error::FailedPrecondition(reason::kNoConsole,
                                     "a bare-metal allocation has no VM console; use the "
                                     "node's BMC");
  }
  if ((a.state() != v1::ALLOCATION_STATE_PROVISIONING &&
       a.state() != v1::ALLOCATION_STATE_ACTIVE) ||
      a.node_id().empty()) {
    Error e = Error::FailedPrecondition(reason::kAllocationNotLive,
                                        fmt::format("allocation {} is {}: it has no VM to show",
                                                    a.allocation_id(), enums::Text(a.state())));
    e.details = {{"state", enums::Text(a.state())}};
    return e;
  }
  return Ok();
}

}  // namespace

SessionHandlers::SessionHandlers(std::shared_ptr<store::Pool> pool,
                                 std::shared_ptr<messaging::Connection> nats, std::string source,
                                 int64_t max_session_s)
    : pool_(std::move(pool)),
      nats_(std::move(nats)),
      source_(std::move(source)),
      max_session_s_(max_session_s) {}

Result<v1::CreateConsoleSessionResponse> SessionHandlers::Create(
    const v1::CreateConsoleSessionRequest& req, rpc::Context& ctx) const {
  if (auto v = CheckCreateRequest(req); !v.ok()) return v.error();
  // The allocation as the scheduler has it, asked with the caller's own token.
  v1::GetAllocationRequest get;
  get.set_allocation_id(req.allocation_id());
  auto got = rpc::Client(nats_)
                 .WithToken(Bearer(ctx))
                 .Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", get,
                                                  std::chrono::milliseconds(ctx.RemainingMs()),
                                                  ctx.traceparent);
  if (!got.ok()) return got.error();
  const v1::Allocation& a = got->allocation();
  if (auto v = CheckHasConsole(a); !v.ok()) return v.error();
  auto grant = NewGrant();
  if (!grant.ok()) return grant.error();
  NewSession row;
  row.max_duration_s =
      req.max_duration_s() == 0 ? max_session_s_ : std::min(req.max_duration_s(), max_session_s_);
  row.session_id = ids::NewUuidV7();
  row.allocation_id = a.allocation_id();
  row.node_id = a.node_id();
  row.domain = "gpuaas-" + a.allocation_id();
  row.grant_hash = GrantHash(*grant);
  row.created_by = ctx.principal.subject;
  row.reason = req.reason();
  row.grant_ttl_s = kGrantTtlSeconds;
  const std::string& id = row.session_id;
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::CreateConsoleSessionResponse> {
    v1::CreateConsoleSessionResponse resp;
    *resp.mutable_session() = InsertSession(tx, row);
    resp.set_grant(*grant);
    resp.set_ws_path(fmt::format("/console/ws/{}?grant={}", id, *grant));
    resp.set_page_path(fmt::format("/static/console.html?session={}&grant={}", id, *grant));
    outbox::SetActorReason(req.reason());
    if (auto r = Announce(tx, source_, resp.session(), {}); !r.ok()) return r.error();
    return resp;
  });
}

Result<v1::RevokeConsoleSessionResponse> SessionHandlers::Revoke(
    const v1::RevokeConsoleSessionRequest& req, rpc::Context& ctx) const {
  if (!ids::IsUuid(req.session_id())) {
    return Error::InvalidArgument(reason::kInvalidSessionId, "session_id is not a UUID",
                                  {{"session_id", "not a UUID"}});
  }
  const std::string who = ctx.principal.subject;
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::RevokeConsoleSessionResponse> {
    auto s = LoadSession(tx, req.session_id(), true);
    if (!s) return Error::NotFound(reason::kSessionNotFound, "no session " + req.session_id());
    v1::RevokeConsoleSessionResponse resp;
    if (s->state() != v1::CONSOLE_SESSION_STATE_CREATED &&
        s->state() != v1::CONSOLE_SESSION_STATE_CONNECTED) {
      *resp.mutable_session() = *s;  // already over
      return resp;
    }
    *resp.mutable_session() = RevokeSession(tx, req.session_id(), who);
    if (!req.reason().empty()) outbox::SetActorReason(req.reason());
    if (auto r = Announce(tx, source_, resp.session(), {"", req.reason(), "", ""}); !r.ok()) {
      return r.error();
    }
    return resp;
  });
}

Result<v1::ListConsoleSessionsResponse> SessionHandlers::List(
    const v1::ListConsoleSessionsRequest& req, rpc::Context& /*ctx*/) const {
  auto limit = rpc::PageLimit(req.page_size());
  if (!limit.ok()) return limit.error();
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListConsoleSessionsResponse> {
        v1::ListConsoleSessionsResponse resp;
        for (auto& s : ListSessions(tx, req.allocation_id(), enums::Text(req.state()), *limit)) {
          *resp.add_sessions() = std::move(s);
        }
        return resp;
      },
      store::ReadSnapshot());
}

}  // namespace gpuaas::console_gw
