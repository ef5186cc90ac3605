#pragma once
// console-gw's HTTP + WebSocket listener (Boost.Beast, compiled only in console_gateway.cpp):
// the operator page and noVNC as static files, the page's JSON API (login with an operator's
// request token: a server-side page session, named by an opaque HttpOnly cookie; calls forwarded
// over NATS with the session's token), and the
// console WebSocket at /console/ws/<session>?grant=<grant>, relayed through a Bridge. What it
// needs from the service is the small Backend interface, so the listener holds no policy.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/console_gw/console_bridge.hpp"

namespace gpuaas::console_gw {

// A WebSocket connect as the gateway saw it.
struct ConnectAttempt {
  std::string session_id;  // from the path
  std::string grant;       // from the query
  std::string origin;
  std::string client_address;
};

// A session the grant unlocked (now CONNECTED).
struct Claimed {
  std::string session_id;
  std::string allocation_id;
  std::string node_id;
  std::string domain;
  int64_t max_duration_s = 0;
};

// What a connect's grant came to: the session it unlocked, or the refusal the WebSocket is
// closed with (grant_unknown, grant_used, grant_expired, grant_revoked, wrong_scope).
struct ClaimOutcome {
  std::optional<Claimed> claimed;
  EndReason refused = EndReason::kGrantUnknown;  // when !claimed
  std::string detail;                            // the refusal's, for humans
};

// A started relay, or why none: node_refused / node_unreachable.
struct OpenOutcome {
  std::shared_ptr<Bridge> bridge;
  EndReason failed = EndReason::kNodeRefused;  // when !bridge
};

struct ApiReply {
  int status = 200;
  std::string json;
};

struct Identity {
  std::string subject;  // "user:alice"
  std::vector<std::string> roles;
  int64_t expires_unix = 0;
  std::string session_id;  // the page session (how operators name it; never the cookie)
};

// A login: the cookie value naming its page session (opaque and random: the server keeps the
// token), and who logged in.
struct PageLogin {
  std::string cookie;
  Identity identity;
};

// The live page session a cookie names: the token its calls carry, and who it is.
struct PageAccess {
  std::string token;
  Identity identity;
};

class Backend {
 public:
  virtual ~Backend() = default;
  // An operator's request token becomes a page session (the token stays server-side), or
  // UNAUTHENTICATED / PERMISSION_DENIED.
  virtual Result<PageLogin> Login(const std::string& token) = 0;
  // The live page session `cookie` names, noting the call; UNAUTHENTICATED not_logged_in
  // (no cookie) or session_ended (logged out, idle, expired, revoked, ended by an operator).
  virtual Result<PageAccess> Resume(const std::string& cookie) = 0;
  // Logout: ends the page session `cookie` names (nothing when there is none).
  virtual void Logout(const std::string& cookie) = 0;
  // One page request forwarded with the operator's token (subject from the allowed list).
  virtual ApiReply Call(const std::string& token, const std::string& subject,
                        const std::string& json) = 0;
  // A connect refused before the grant was looked at (cross_origin, a path that does not parse:
  // grant_unknown): audited.
  virtual void Refused(const ConnectAttempt& a, Reason failure, const std::string& detail) = 0;
  // Uses up the grant: the session (now CONNECTED) or the refusal, audited either way; an error
  // only when the claim could not be recorded (the database), and then no console opens.
  virtual Result<ClaimOutcome> Claim(const ConnectAttempt& a) = 0;
  // Starts the relay for a claimed session (the node opens the VM's console). On failure the
  // session is FAILED (node_refused / node_unreachable) and nothing stays open.
  virtual OpenOutcome Open(const Claimed& c, Bridge::Callbacks cb) = 0;
  // The connection is live; `stop` ends it (revoked, max_duration, gateway_lost) from any
  // thread.
  virtual void Live(const std::string& session_id, std::function<void(EndReason reason)> stop) = 0;
  // It ended: DISCONNECTED (or FAILED for a relay failure, EndsFailed) with its byte counts,
  // audited.
  virtual void Finish(const std::string& session_id, EndReason reason, uint64_t bytes_to_client,
                      uint64_t bytes_from_client) = 0;
};

struct GatewayOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 0;
  std::string web_dir;                       // the operator page
  std::string novnc_dir;                     // noVNC's files, served under /novnc/
  std::vector<std::string> allowed_origins;  // empty: same origin (Host) only
  bool secure_cookies = false;               // behind TLS: the cookie gets `Secure`
  int workers = 4;                           // threads for blocking backend calls
};

class Gateway {
 public:
  Gateway(GatewayOptions opts, Backend& backend, log::Logger logger);
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;
  Result<uint16_t> Start();
  // Stops accepting, closes live consoles (gateway_stopping) and joins the threads.
  void Stop();
  size_t LiveConnections() const;

  struct Impl;  // opaque (Beast lives in console_gateway.cpp only)

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace gpuaas::console_gw
