#pragma once
// console-gw's request API: the route table (every subject it serves over NATS) and the session
// handlers behind it. The HTTP side (the operator page and the console WebSocket) is
// console_gateway.hpp.
#include <cstdint>
#include <memory>
#include <string>

#include "gpuaas/common/result.hpp"

namespace gpuaas {
namespace messaging {
class Connection;
}
namespace store {
class Pool;
}
namespace rpc {
class Server;
struct Context;
}  // namespace rpc
namespace v1 {
class CreateConsoleSessionRequest;
class CreateConsoleSessionResponse;
class RevokeConsoleSessionRequest;
class RevokeConsoleSessionResponse;
class ListConsoleSessionsRequest;
class ListConsoleSessionsResponse;
class RevokeTokenRequest;
class RevokeTokenResponse;
class ListTokenRevocationsRequest;
class ListTokenRevocationsResponse;
class ListPageSessionsRequest;
class ListPageSessionsResponse;
class EndPageSessionRequest;
class EndPageSessionResponse;
}  // namespace v1
}  // namespace gpuaas

namespace gpuaas::console_gw {

// gpuaas.v1.console.session.{create,revoke,list}: operators' console sessions.
class SessionHandlers {
 public:
  // `source`: the events' source; `max_session_s`: console.max_session_s.
  SessionHandlers(std::shared_ptr<store::Pool> pool, std::shared_ptr<messaging::Connection> nats,
                  std::string source, int64_t max_session_s);

  // A new session and its single-use grant for a live VM allocation the caller may see.
  Result<v1::CreateConsoleSessionResponse> Create(const v1::CreateConsoleSessionRequest& req,
                                                  rpc::Context& ctx) const;
  // A created or connected session becomes revoked; an ended one is answered unchanged.
  Result<v1::RevokeConsoleSessionResponse> Revoke(const v1::RevokeConsoleSessionRequest& req,
                                                  rpc::Context& ctx) const;
  Result<v1::ListConsoleSessionsResponse> List(const v1::ListConsoleSessionsRequest& req,
                                               rpc::Context& ctx) const;

 private:
  std::shared_ptr<store::Pool> pool_;
  std::shared_ptr<messaging::Connection> nats_;
  std::string source_;
  int64_t max_session_s_;
};

// gpuaas.v1.console.token.{revoke,revocation.list}: the platform's record of revoked request
// tokens (token_handlers.cpp; revocations.hpp says how services apply them).
class TokenHandlers {
 public:
  TokenHandlers(std::shared_ptr<store::Pool> pool, std::string source);

  // Revokes a token (jti: a repeat answers the first, created false) or a principal's tokens
  // issued until now (subject: always a new revocation).
  Result<v1::RevokeTokenResponse> Revoke(const v1::RevokeTokenRequest& req,
                                         rpc::Context& ctx) const;
  Result<v1::ListTokenRevocationsResponse> List(const v1::ListTokenRevocationsRequest& req,
                                                rpc::Context& ctx) const;

 private:
  std::shared_ptr<store::Pool> pool_;
  std::string source_;
};

// gpuaas.v1.console.login.{list,end}: operator page sessions (page_sessions.cpp).
class PageSessionHandlers {
 public:
  PageSessionHandlers(std::shared_ptr<store::Pool> pool, std::string source);
  Result<v1::ListPageSessionsResponse> List(const v1::ListPageSessionsRequest& req,
                                            rpc::Context& ctx) const;
  // Ends a live page session now (ended, by the caller); an ended one is answered unchanged.
  Result<v1::EndPageSessionResponse> End(const v1::EndPageSessionRequest& req,
                                         rpc::Context& ctx) const;

 private:
  std::shared_ptr<store::Pool> pool_;
  std::string source_;  // the events' source
};

// The route table: every request subject console-gw serves, each to its handler.
void RegisterRoutes(rpc::Server& rpc, const std::shared_ptr<SessionHandlers>& sessions,
                    const std::shared_ptr<TokenHandlers>& tokens,
                    const std::shared_ptr<PageSessionHandlers>& logins);

}  // namespace gpuaas::console_gw
