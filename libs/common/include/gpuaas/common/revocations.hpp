#pragma once
// Token revocation, as every service applies it. An operator revokes a token (its `jti`) or a
// principal (every token of a `sub` issued until then) through console-gw
// (gpuaas.v1.console.token.revoke), which stores it and publishes a gpuaas.v1.TokenRevocation on
// gpuaas.v1.evt.auth.token.revoked (stream GPUAAS_EVT_AUTH, kept 25 h: longer than any token
// lives). Each service instance reads that stream whole when it starts and follows the subject
// live (a core subscription: contract operation followTokenRevocations, `live_copy`), so a
// revoked token is refused by every service within milliseconds: UNAUTHENTICATED token_revoked.
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/log.hpp"
#include "gpuaas/common/result.hpp"

namespace gpuaas {
namespace v1 {
class TokenRevocation;
}
namespace messaging {
class Connection;
}
}  // namespace gpuaas

namespace gpuaas::revocation {

inline constexpr const char* kSubject = "gpuaas.v1.evt.auth.token.revoked";

// The revocations in force: pure, thread-safe.
class List {
 public:
  using Clock = std::chrono::system_clock;
  // Adds one (a repeat changes nothing); forgets those past their expires_at.
  void Apply(const v1::TokenRevocation& r, Clock::time_point now = Clock::now());
  // OK, or UNAUTHENTICATED token_revoked when `p`'s token, or its principal at the token's
  // issue time, is revoked.
  Result<void> Check(const auth::Principal& p) const;
  size_t Size() const;

 private:
  void Forget(Clock::time_point now);
  mutable std::mutex mu_;
  std::unordered_map<std::string, Clock::time_point> tokens_;  // jti -> expires_at
  struct Subject {
    Clock::time_point revoked_at;
    Clock::time_point expires_at;
  };
  std::unordered_map<std::string, Subject> subjects_;
};

// Keeps a List current on one connection: subscribes to kSubject, then reads the stream
// GPUAAS_EVT_AUTH from its first message (declaring it when missing), so nothing published in
// between is missed.
class Follower {
 public:
  static Result<std::unique_ptr<Follower>> Start(std::shared_ptr<messaging::Connection> conn,
                                                 std::shared_ptr<List> list, log::Logger log);
  ~Follower();
  Follower(const Follower&) = delete;
  Follower& operator=(const Follower&) = delete;

 private:
  Follower() = default;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace gpuaas::revocation
