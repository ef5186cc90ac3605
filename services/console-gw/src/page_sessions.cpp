// Operator page sessions: a login turns an operator's request token into a server-side session
// (page_sessions), named in the browser by an opaque random cookie of which only the hash is
// stored. Each page call resumes the session (ending it when idle past console.page_idle_s, its
// token expired or revoked) and forwards the session's token. Logout, or an operator with
// gpuaas.v1.console.login.end, ends it server-side: the cookie is worth nothing afterwards. Every
// start and end is an audit event (gpuaas.v1.evt.console.login.started|ended) written with it.
#include <algorithm>
#include <chrono>

#include "console_gw_routes.hpp"
#include "console_store.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/console_gw/console_domain.hpp"
#include "gpuaas/console_gw/console_gw_reasons.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/v1/console.pb.h"
#include "page_session_store.hpp"

namespace gpuaas::console_gw {

namespace {

using Clock = std::chrono::system_clock;

Identity IdentityOf(const auth::Principal& p, const std::string& session_id) {
  Identity id;
  id.subject = p.subject;
  id.roles = p.roles;
  id.expires_unix =
      std::chrono::duration_cast<std::chrono::seconds>(p.expires.time_since_epoch()).count();
  id.session_id = session_id;
  return id;
}

Error Ended(const std::string& end_reason) {
  return Error::Of(Code::kUnauthenticated, reason::kSessionEnded,
                   end_reason.empty() ? "no such page session: log in"
                                      : "this page session ended (" + end_reason + "): log in",
                   {{"end_reason", end_reason}}, false);
}

}  // namespace

Result<auth::Principal> ConsoleGwService::VerifyOperator(const std::string& token) {
  auto p = auth::VerifyToken(token, svc_.token_public_keys());
  if (!p.ok()) return p.error();
  if (auto r = svc_.revocations().Check(*p); !r.ok()) return r.error();
  if (!p->HasRole(auth::kRoleOperator)) {
    return Error::Of(
        Code::kPermissionDenied, reason::kRoleNotAllowed,
        "the operator page is for operators; this token's roles do not include operator");
  }
  return p;
}

Result<PageLogin> ConsoleGwService::Login(const std::string& token) {
  auto p = VerifyOperator(token);
  if (!p.ok()) return p.error();
  auto cookie = NewGrant();
  if (!cookie.ok()) return cookie.error();
  NewPageSession s;
  s.session_id = ids::NewUuidV7();
  s.cookie_hash = GrantHash(*cookie);
  s.principal = p->subject;
  s.roles = p->roles;
  s.token = token;
  s.token_id = p->token_id;
  s.expires = p->expires;
  const v1::Principal actor = OperatorActor(p->subject);
  auto stored = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<v1::PageSession> {
    auto session = InsertPageSession(tx, s);
    if (auto a = AnnouncePageSession(tx, svc_.source(), session, &actor); !a.ok()) {
      return a.error();
    }
    return session;
  });
  if (!stored.ok()) return stored.error();
  svc_.log().Info("page login",
                  {{"principal", p->subject}, {"page_session", stored->session_id()}});
  return PageLogin{*cookie, IdentityOf(*p, stored->session_id())};
}

Result<PageAccess> ConsoleGwService::Resume(const std::string& cookie) {
  if (cookie.empty()) {
    return Error::Of(Code::kUnauthenticated, reason::kNotLoggedIn, "log in first");
  }
  // The session, or why it ended now (committed either way).
  struct Outcome {
    std::optional<PageAccess> access;
    std::string ended;
  };
  auto out = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<Outcome> {
    auto s = LockPageSession(tx, GrantHash(cookie));
    if (!s) return Outcome{std::nullopt, ""};
    if (!s->session.end_reason().empty()) return Outcome{std::nullopt, s->session.end_reason()};
    auto ends = PageSessionEnds(Clock::now(), s->last_seen, s->expires,
                                std::chrono::seconds(cfg_.page_idle_s));
    auto p = auth::VerifyToken(s->token, svc_.token_public_keys());
    if (!ends && !p.ok()) ends = PageEnd::kExpired;
    if (!ends && !svc_.revocations().Check(*p).ok()) ends = PageEnd::kRevoked;
    if (ends) {
      // Found idle, expired or revoked: console-gw ends it (the event's actor).
      bool now = false;
      auto ended = EndPageSession(tx, s->session.session_id(), *ends, "", &now);
      if (now && ended) {
        if (auto a = AnnouncePageSession(tx, svc_.source(), *ended, nullptr); !a.ok()) {
          return a.error();
        }
      }
      return Outcome{std::nullopt, std::string(TextOf(*ends).text())};
    }
    // Written at most every 10 s (a quarter of the idle time when that is shorter).
    TouchPageSession(
        tx, s->session.session_id(),
        std::min(std::chrono::seconds(10), std::chrono::seconds(cfg_.page_idle_s / 4)));
    return Outcome{PageAccess{s->token, IdentityOf(*p, s->session.session_id())}, ""};
  });
  if (!out.ok()) return out.error();
  if (!out->access) return Ended(out->ended);
  return *out->access;
}

void ConsoleGwService::Logout(const std::string& cookie) {
  if (cookie.empty()) return;
  auto r = store::WithTx(*svc_.pg(), [&](pqxx::work& tx) -> Result<void> {
    auto s = LockPageSession(tx, GrantHash(cookie));
    if (!s || !s->session.end_reason().empty()) return Ok();
    bool now = false;
    auto ended =
        EndPageSession(tx, s->session.session_id(), PageEnd::kLogout, s->session.principal(), &now);
    if (!now || !ended) return Ok();
    const v1::Principal actor = OperatorActor(s->session.principal());
    return AnnouncePageSession(tx, svc_.source(), *ended, &actor);
  });
  if (!r.ok()) svc_.log().Error("page logout not recorded", {{"error", r.error().ToString()}});
}

PageSessionHandlers::PageSessionHandlers(std::shared_ptr<store::Pool> pool, std::string source)
    : pool_(std::move(pool)), source_(std::move(source)) {}

Result<v1::ListPageSessionsResponse> PageSessionHandlers::List(
    const v1::ListPageSessionsRequest& req, rpc::Context& /*ctx*/) const {
  auto limit = rpc::PageLimit(req.page_size());
  if (!limit.ok()) return limit.error();
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListPageSessionsResponse> {
        v1::ListPageSessionsResponse resp;
        for (auto& s : ListPageSessions(tx, req.include_ended(), *limit)) {
          *resp.add_sessions() = std::move(s);
        }
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::EndPageSessionResponse> PageSessionHandlers::End(const v1::EndPageSessionRequest& req,
                                                            rpc::Context& ctx) const {
  if (!ids::IsUuid(req.session_id())) {
    return Error::InvalidArgument(reason::kInvalidPageSessionId, "session_id is not a UUID",
                                  {{"session_id", "not a UUID"}});
  }
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::EndPageSessionResponse> {
    bool now = false;
    auto s = EndPageSession(tx, req.session_id(), PageEnd::kEnded, ctx.principal.subject, &now);
    if (!s) {
      return Error::NotFound(reason::kPageSessionNotFound, "no page session " + req.session_id());
    }
    // The operator who ended it is the event's actor (the request's principal).
    if (now) {
      if (auto a = AnnouncePageSession(tx, source_, *s, nullptr); !a.ok()) return a.error();
    }
    v1::EndPageSessionResponse resp;
    *resp.mutable_session() = std::move(*s);
    return resp;
  });
}

}  // namespace gpuaas::console_gw
