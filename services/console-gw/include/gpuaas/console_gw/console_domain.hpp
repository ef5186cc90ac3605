#pragma once
// console-gw's pure rules: grants (random secrets kept only as a SHA-256), where a WebSocket
// upgrade may come from (Origin), what its path names, and how a relay's end is told to the
// browser (close codes). No I/O.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"

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

// WebSocket close codes (RFC 6455) for a relay's end reason: 1000 for an orderly end
// (client_closed, vm_closed, max_duration), 1008 for a policy refusal (a grant refused, revoked),
// 1011 for a failure of the relay (node_refused, node_unreachable, relay_lost, ...).
int CloseCodeFor(std::string_view end_reason);

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
