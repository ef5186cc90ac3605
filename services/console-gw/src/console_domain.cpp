#include "gpuaas/console_gw/console_domain.hpp"

#include <openssl/rand.h>
#include <openssl/sha.h>

#include <array>

#include <nlohmann/json.hpp>

#include "gpuaas/common/ids.hpp"

namespace gpuaas::console_gw {

namespace {

std::string Base64Url(const unsigned char* data, size_t n) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  out.reserve((n * 4 + 2) / 3);
  for (size_t i = 0; i < n; i += 3) {
    const uint32_t b = (uint32_t{data[i]} << 16) | (i + 1 < n ? uint32_t{data[i + 1]} << 8 : 0) |
                       (i + 2 < n ? uint32_t{data[i + 2]} : 0);
    out += kAlphabet[(b >> 18) & 63];
    out += kAlphabet[(b >> 12) & 63];
    if (i + 1 < n) out += kAlphabet[(b >> 6) & 63];
    if (i + 2 < n) out += kAlphabet[b & 63];
  }
  return out;
}

bool IsGrantChar(char c) {
  return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
         c == '_';
}

std::string Lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

}  // namespace

Result<std::string> NewGrant() {
  std::array<unsigned char, 32> raw{};
  if (RAND_bytes(raw.data(), static_cast<int>(raw.size())) != 1) {
    return Error::Internal(reason::kRandomFailed, "no random bytes for a console grant");
  }
  return Base64Url(raw.data(), raw.size());
}

std::string GrantHash(std::string_view grant) {
  std::array<unsigned char, SHA256_DIGEST_LENGTH> md{};
  SHA256(reinterpret_cast<const unsigned char*>(grant.data()), grant.size(), md.data());
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(md.size() * 2);
  for (unsigned char b : md) {
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out;
}

bool OriginAllowed(std::string_view origin, std::string_view host,
                   const std::vector<std::string>& allowed) {
  if (origin.empty() || origin == "null") return false;
  const std::string o = Lower(origin);
  if (!allowed.empty()) {
    for (const auto& a : allowed) {
      if (Lower(a) == o) return true;
    }
    return false;
  }
  if (host.empty()) return false;
  const std::string h = Lower(host);
  return o == "http://" + h || o == "https://" + h;
}

std::optional<WsTarget> ParseWsTarget(std::string_view target) {
  constexpr std::string_view kPrefix = "/console/ws/";
  if (target.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  target.remove_prefix(kPrefix.size());
  const auto q = target.find('?');
  if (q == std::string_view::npos) return std::nullopt;
  WsTarget t;
  t.session_id = std::string(target.substr(0, q));
  if (!ids::IsUuid(t.session_id)) return std::nullopt;
  std::string_view query = target.substr(q + 1);
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view kv = query.substr(0, amp);
    if (kv.substr(0, 6) == "grant=") t.grant = std::string(kv.substr(6));
    if (amp == std::string_view::npos) break;
    query.remove_prefix(amp + 1);
  }
  if (t.grant.empty() || t.grant.size() > 128) return std::nullopt;
  for (char c : t.grant) {
    if (!IsGrantChar(c)) return std::nullopt;
  }
  return t;
}

std::vector<std::string> PageEndTexts() {
  std::vector<std::string> out;
  for (const auto& t : kPageEndTexts) out.emplace_back(t.text());
  return out;
}

std::optional<PageEnd> PageSessionEnds(std::chrono::system_clock::time_point now,
                                       std::chrono::system_clock::time_point last_seen,
                                       std::chrono::system_clock::time_point expires,
                                       std::chrono::seconds idle) {
  if (now >= expires) return PageEnd::kExpired;
  if (now - last_seen > idle) return PageEnd::kIdle;
  return std::nullopt;
}

std::optional<EndReason> ParseEndReason(std::string_view text) {
  for (const auto& e : kEndReasons) {
    if (e.text.text() == text) return e.value;
  }
  return std::nullopt;
}

std::string ErrorJson(const Error& e) {
  nlohmann::json details = nlohmann::json::object();
  for (const auto& [k, v] : e.details) details[k] = v;
  return nlohmann::json{{"error",
                         {{"code", CodeName(e.code)},
                          {"reason", e.reason},
                          {"message", e.message},
                          {"details", details},
                          {"retryable", e.retryable}}}}
      .dump();
}

int HttpStatusFor(Code code) {
  switch (code) {
    case Code::kInvalidArgument:
    case Code::kOutOfRange:
      return 400;
    case Code::kUnauthenticated:
      return 401;
    case Code::kPermissionDenied:
      return 403;
    case Code::kNotFound:
      return 404;
    case Code::kAlreadyExists:
    case Code::kAborted:
    case Code::kFailedPrecondition:
      return 409;
    case Code::kResourceExhausted:
      return 429;
    case Code::kUnimplemented:
      return 501;
    case Code::kUnavailable:
      return 503;
    case Code::kDeadlineExceeded:
      return 504;
    default:
      return 500;
  }
}

std::optional<std::string> SafeJoin(const std::string& root, std::string_view path) {
  if (path.find('\0') != std::string_view::npos || path.find('\\') != std::string_view::npos) {
    return std::nullopt;
  }
  while (!path.empty() && path.front() == '/') path.remove_prefix(1);
  std::string_view rest = path;
  while (!rest.empty()) {
    const auto slash = rest.find('/');
    const std::string_view seg = rest.substr(0, slash);
    if (seg == ".." || seg == ".") return std::nullopt;
    if (slash == std::string_view::npos) break;
    rest.remove_prefix(slash + 1);
  }
  if (path.empty()) return root + "/index.html";
  if (path.back() == '/') return std::nullopt;
  return root + "/" + std::string(path);
}

std::string ContentTypeFor(std::string_view path) {
  const auto dot = path.rfind('.');
  const std::string ext = dot == std::string_view::npos ? "" : Lower(path.substr(dot + 1));
  if (ext == "html") return "text/html; charset=utf-8";
  if (ext == "js" || ext == "mjs") return "text/javascript; charset=utf-8";
  if (ext == "css") return "text/css; charset=utf-8";
  if (ext == "json") return "application/json";
  if (ext == "png") return "image/png";
  if (ext == "svg") return "image/svg+xml";
  if (ext == "ico") return "image/x-icon";
  return "application/octet-stream";
}

}  // namespace gpuaas::console_gw
