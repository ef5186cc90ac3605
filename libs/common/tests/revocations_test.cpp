// The revocations every service holds (revocations.hpp): pure, on a given clock.
#include "gpuaas/common/revocations.hpp"

#include <google/protobuf/util/time_util.h>
#include <gtest/gtest.h>

#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::revocation {
namespace {

using namespace std::chrono_literals;
using google::protobuf::util::TimeUtil;
using Clock = List::Clock;

google::protobuf::Timestamp Ts(Clock::time_point t) {
  return TimeUtil::MillisecondsToTimestamp(
      std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count());
}

v1::TokenRevocation Revoke(const std::string& jti, const std::string& sub, Clock::time_point at,
                           std::chrono::seconds life = 24h) {
  v1::TokenRevocation r;
  r.set_jti(jti);
  r.set_subject(sub);
  *r.mutable_revoked_at() = Ts(at);
  *r.mutable_expires_at() = Ts(at + life);
  return r;
}

auth::Principal Token(const std::string& jti, const std::string& sub, Clock::time_point iat) {
  auth::Principal p;
  p.token_id = jti;
  p.subject = sub;
  p.issued = iat;
  return p;
}

TEST(RevocationListTest, ATokenIsRevokedByItsJtiAndNoOtherIs) {
  List l;
  const auto now = Clock::now();
  l.Apply(Revoke("t-1", "", now), now);
  auto r = l.Check(Token("t-1", "user:a", now - 1min));
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kUnauthenticated);
  EXPECT_TRUE(r.error().Is(reason::kTokenRevoked));
  EXPECT_EQ(r.error().details.at("jti"), "t-1");
  EXPECT_TRUE(l.Check(Token("t-2", "user:a", now - 1min)).ok());
}

TEST(RevocationListTest, APrincipalsTokensIssuedUntilTheRevocationAreRevoked) {
  List l;
  // Whole seconds, as a token's iat is.
  const auto now = std::chrono::time_point_cast<std::chrono::seconds>(Clock::now());
  l.Apply(Revoke("", "user:a", now), now);
  EXPECT_FALSE(l.Check(Token("t-1", "user:a", now - 1h)).ok());
  EXPECT_FALSE(l.Check(Token("t-2", "user:a", now)).ok());
  EXPECT_TRUE(l.Check(Token("t-3", "user:a", now + 1s)).ok());
  EXPECT_TRUE(l.Check(Token("t-4", "user:b", now - 1h)).ok());
  // A later revocation of the same principal moves the line; an earlier one does not.
  l.Apply(Revoke("", "user:a", now + 10s), now);
  EXPECT_FALSE(l.Check(Token("t-3", "user:a", now + 1s)).ok());
  l.Apply(Revoke("", "user:a", now - 1h), now);
  EXPECT_FALSE(l.Check(Token("t-3", "user:a", now + 1s)).ok());
}

TEST(RevocationListTest, WhatNoTokenCanOutliveIsForgotten) {
  List l;
  const auto now = Clock::now();
  l.Apply(Revoke("old", "", now - 25h, 24h), now);  // expired already: never held
  EXPECT_EQ(l.Size(), 0U);
  l.Apply(Revoke("t-1", "", now, 1h), now);
  l.Apply(Revoke("", "user:a", now, 1h), now);
  EXPECT_EQ(l.Size(), 2U);
  l.Apply(Revoke("t-2", "", now + 2h, 1h), now + 2h);  // applying forgets the expired
  EXPECT_EQ(l.Size(), 1U);
  EXPECT_TRUE(l.Check(Token("t-1", "user:x", now)).ok());
}

}  // namespace
}  // namespace gpuaas::revocation
