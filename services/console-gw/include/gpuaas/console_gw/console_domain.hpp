#pragma once
// console-gw's pure rules: grants (random secrets kept only as a SHA-256), where a WebSocket
// upgrade may come from (Origin), what its path names, and why a relay ends (EndReason: its text,
// its close code, whether it fails the session). No I/O.
#include <chrono>
#include <cstdint>
#include <iterator>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/console_gw/console_gw_reasons.hpp"

namespace gpuaas::console_gw {

// How long a grant may wait for its one connect.
inline constexpr int64_t kGrantTtlSeconds = 60;

// A fresh grant: URL-safe base64 (no padding) of 32 random bytes (OpenSSL RAND_bytes).
Result<std::string> NewGrant();
// The SHA-256 of a grant, as stored (64 lowercase hex digits).
std::string GrantHash(std::string_view grant);

// Whether a WebSocket upgrade or an API call with this Origin header may proceed. An empty
// `allowed` list means same-origin only: the Origin must be http(s)://<Host header>. A request
// without an Origin is refused (browsers always send one on WebSocket upgrades and POSTs).
bool OriginAllowed(std::string_view origin, std::string_view host,
                   const std::vector<std::string>& allowed);

// "/console/ws/<session_id>?grant=<grant>" -> its two parts; nullopt for anything else (a
// session id that is not a UUID, a missing or oddly formed grant).
struct WsTarget {
  std::string session_id;
  std::string grant;
};
std::optional<WsTarget> ParseWsTarget(std::string_view target);

// Why a console connection ended (or was refused): the closed set behind a session's
// `end_reason`, the connect refusals and the WebSocket's close reason. Decisions are made on the
// value; its text (a registry reason) appears only at the edges: the stored `end_reason`, the
// events, the close frame, a ConsoleFrame's close_reason.
enum class EndReason : uint8_t {
  // Orderly ends (DISCONNECTED), closed 1000.
  kClientClosed,
  kVmClosed,
  kMaxDuration,
  kGatewayStopping,
  // Policy (1008): a grant refused (the session is not changed, except wrong_scope: FAILED, and a
  // grant past its minute: EXPIRED), the session revoked, a flooding browser.
  kGrantUnknown,
  kGrantUsed,
  kGrantExpired,
  kGrantRevoked,
  kWrongScope,
  kRevoked,
  kClientFlood,
  // Failures of the relay (FAILED), closed 1011.
  kRelayLost,
  kNodeRefused,
  kNodeUnreachable,
  kAgentStopping,
  kCreditExceeded,
  kGatewayLost,
};

struct EndReasonInfo {
  EndReason value;
  Reason text;     // stored, announced and sent as this (never changes)
  int close_code;  // RFC 6455: 1000 normal, 1008 policy violation, 1011 internal error
  bool failed;     // a session that ends with it is FAILED (else DISCONNECTED, EXPIRED, REVOKED)
};

// In declaration order (a static_assert below keeps it so).
inline constexpr EndReasonInfo kEndReasons[] = {
    {EndReason::kClientClosed, reason::kClientClosed, 1000, false},
    {EndReason::kVmClosed, reason::kVmClosed, 1000, false},
    {EndReason::kMaxDuration, reason::kMaxDuration, 1000, false},
    {EndReason::kGatewayStopping, reason::kGatewayStopping, 1000, false},
    {EndReason::kGrantUnknown, reason::kGrantUnknown, 1008, false},
    {EndReason::kGrantUsed, reason::kGrantUsed, 1008, false},
    {EndReason::kGrantExpired, reason::kGrantExpired, 1008, false},
    {EndReason::kGrantRevoked, reason::kGrantRevoked, 1008, false},
    {EndReason::kWrongScope, reason::kWrongScope, 1008, true},
    {EndReason::kRevoked, reason::kRevoked, 1008, false},
    {EndReason::kClientFlood, reason::kClientFlood, 1008, true},
    {EndReason::kRelayLost, reason::kRelayLost, 1011, true},
    {EndReason::kNodeRefused, reason::kNodeRefused, 1011, true},
    {EndReason::kNodeUnreachable, reason::kNodeUnreachable, 1011, true},
    {EndReason::kAgentStopping, reason::kAgentStopping, 1011, true},
    {EndReason::kCreditExceeded, reason::kCreditExceeded, 1011, true},
    {EndReason::kGatewayLost, reason::kGatewayLost, 1011, true},
};

constexpr bool EndReasonsInOrder() {
  for (size_t i = 0; i < std::size(kEndReasons); ++i) {
    if (static_cast<size_t>(kEndReasons[i].value) != i) return false;
  }
  return std::size(kEndReasons) == static_cast<size_t>(EndReason::kGatewayLost) + 1;
}
static_assert(EndReasonsInOrder(), "kEndReasons: one entry per EndReason, in declaration order");

constexpr const EndReasonInfo& InfoOf(EndReason r) { return kEndReasons[static_cast<size_t>(r)]; }
// The reason's text: `end_reason`, the events' `failure`, the close frame's reason.
constexpr Reason TextOf(EndReason r) { return InfoOf(r).text; }
// The WebSocket close code (RFC 6455) a connection ending with it is closed with.
constexpr int CloseCodeFor(EndReason r) { return InfoOf(r).close_code; }
// Whether a session ending with it is FAILED.
constexpr bool EndsFailed(EndReason r) { return InfoOf(r).failed; }
// The value of a text read at an edge (a stored end_reason, a node's close_reason); nullopt for
// "" and text outside the set.
std::optional<EndReason> ParseEndReason(std::string_view text);

// Why an operator page session (a login) ended: the closed set behind page_sessions.end_reason
// and PageSession.end_reason; the texts are registry reasons.
enum class PageEnd : uint8_t { kLogout, kIdle, kExpired, kRevoked, kEnded };
inline constexpr Reason kPageEndTexts[] = {reason::kPageLogout, reason::kPageIdle,
                                           reason::kPageExpired, reason::kRevoked,
                                           reason::kPageEnded};
constexpr Reason TextOf(PageEnd e) { return kPageEndTexts[static_cast<size_t>(e)]; }
// Every text, in order (the column's CHECK admits these and '').
std::vector<std::string> PageEndTexts();
// Whether a live page session ends now: past its token's expiry, or idle longer than `idle`
// since its last call; nullopt while it may go on.
std::optional<PageEnd> PageSessionEnds(std::chrono::system_clock::time_point now,
                                       std::chrono::system_clock::time_point last_seen,
                                       std::chrono::system_clock::time_point expires,
                                       std::chrono::seconds idle);

// A relay's credit: a side may have at most `window` bytes sent and not yet acknowledged.
struct Credit {
  uint64_t window = 0;
  uint64_t sent = 0;   // bytes this side sent
  uint64_t acked = 0;  // bytes the other side acknowledged (written out)
  // Bytes that may be sent now.
  uint64_t Available() const { return sent - acked >= window ? 0 : window - (sent - acked); }
  // Applies an acknowledgement; false when it acknowledges more than was sent (a broken peer).
  bool Ack(uint64_t total) {
    if (total > sent) return false;
    if (total > acked) acked = total;
    return true;
  }
};

// An error as the page's API and the gateway answer it:
// {"error":{"code":"NOT_FOUND","reason":...,"message":...,"details":{...},"retryable":false}},
// and the HTTP status of its code.
std::string ErrorJson(const Error& e);
int HttpStatusFor(Code code);

// Static file paths: `path` (URL path below a mount, "" = index) resolved inside `root`; nullopt
// for anything that could leave it ("..", a NUL, a backslash, an absolute path).
std::optional<std::string> SafeJoin(const std::string& root, std::string_view path);
// Content-Type by extension (html, js/mjs, css, png, svg, json, ico; else octet-stream).
std::string ContentTypeFor(std::string_view path);

}  // namespace gpuaas::console_gw
