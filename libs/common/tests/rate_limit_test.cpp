// The per-principal token buckets of the rpc edge (rate_limit.hpp): pure, on a given clock.
#include "gpuaas/common/rate_limit.hpp"

#include <gtest/gtest.h>

#include "gpuaas/common/reasons.hpp"

namespace gpuaas::ratelimit {
namespace {

using namespace std::chrono_literals;
using Clock = Limiter::Clock;

TEST(RateLimitTest, TheClassIsTheAddressesVerb) {
  EXPECT_EQ(SubjectClass("gpuaas.v1.scheduler.allocation.get"), kClassRead);
  EXPECT_EQ(SubjectClass("gpuaas.v1.scheduler.allocation.list"), kClassRead);
  EXPECT_EQ(SubjectClass("gpuaas.v1.inventory.node.show"), kClassRead);
  EXPECT_EQ(SubjectClass("gpuaas.v1.scheduler.allocation.timeline"), kClassRead);
  EXPECT_EQ(SubjectClass("gpuaas.v1.scheduler.allocation.create"), kClassWrite);
  EXPECT_EQ(SubjectClass("gpuaas.v1.inventory.slot.approve"), kClassWrite);
}

TEST(RateLimitTest, ParsesTheConfigurationAndNamesABadEntry) {
  auto l = ParseLimits(kDefaultLimits);
  ASSERT_TRUE(l.ok()) << l.error().ToString();
  EXPECT_DOUBLE_EQ(l->at({"tenant", "write"}).per_second, 20);
  EXPECT_DOUBLE_EQ(l->at({"tenant", "write"}).burst, 40);
  EXPECT_TRUE(ParseLimits("").ok());
  EXPECT_TRUE(ParseLimits(" tenant.read=0.5:1 ").ok());
  for (const std::string bad : {"tenant.write=20", "tenant=20:40", "tenant.delete=1:1",
                                "tenant.write=x:1", "tenant.write=0:1", "tenant.write=5:0.5",
                                "tenant.write=1:1,tenant.write=2:2", "tenant.write=1e999:1"}) {
    auto r = ParseLimits(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_TRUE(r.error().Is(reason::kInvalidRateLimits)) << bad;
  }
}

TEST(RateLimitTest, ABurstThenTheSustainedRateAndTheWaitUntilTheNext) {
  Limiter l(*ParseLimits("tenant.write=10:3"));
  const auto t0 = Clock::now();
  const std::vector<std::string> tenant = {"tenant"};
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(l.Take("tenant:a/x", tenant, kClassWrite, t0)) << i;
  auto wait = l.Take("tenant:a/x", tenant, kClassWrite, t0);
  ASSERT_TRUE(wait.has_value());
  EXPECT_EQ(*wait, 100ms);  // one token every 100 ms
  EXPECT_TRUE(l.Take("tenant:a/x", tenant, kClassWrite, t0 + 50ms).has_value());
  EXPECT_FALSE(l.Take("tenant:a/x", tenant, kClassWrite, t0 + 110ms).has_value());
  // Another principal, and another class of the same one, have their own buckets.
  EXPECT_FALSE(l.Take("tenant:b/y", tenant, kClassWrite, t0 + 110ms).has_value());
  EXPECT_FALSE(l.Take("tenant:a/x", tenant, kClassRead, t0 + 110ms).has_value());  // not listed
  // A long pause refills only up to the burst.
  const auto later = t0 + 10s;
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(l.Take("tenant:a/x", tenant, kClassWrite, later));
  EXPECT_TRUE(l.Take("tenant:a/x", tenant, kClassWrite, later).has_value());
}

TEST(RateLimitTest, SeveralRolesGetTheMostGenerousAndAnUnlistedRoleIsUnlimited) {
  Limiter l(*ParseLimits("tenant.write=1:1,operator.write=100:100"));
  EXPECT_EQ(l.LimitFor({"tenant", "operator"}, kClassWrite)->per_second, 100);
  EXPECT_FALSE(l.LimitFor({"auditor"}, kClassWrite).has_value());
  const auto t0 = Clock::now();
  for (int i = 0; i < 1000; ++i) EXPECT_FALSE(l.Take("svc", {"auditor"}, kClassWrite, t0));
}

TEST(RateLimitTest, BucketsAreBoundedAndAFullOneIsForgottenFirst) {
  Limiter l(*ParseLimits("tenant.write=1:2"), 4);
  const auto t0 = Clock::now();
  EXPECT_FALSE(l.Take("busy", {"tenant"}, kClassWrite, t0));
  EXPECT_FALSE(l.Take("busy", {"tenant"}, kClassWrite, t0));
  EXPECT_TRUE(l.Take("busy", {"tenant"}, kClassWrite, t0).has_value());
  for (int i = 0; i < 10; ++i) {
    (void)l.Take("p" + std::to_string(i), {"tenant"}, kClassWrite, t0 + 10s);
  }
  // However many principals came since, each still gets its own burst.
  EXPECT_FALSE(l.Take("fresh", {"tenant"}, kClassWrite, t0 + 10s));
}

}  // namespace
}  // namespace gpuaas::ratelimit
