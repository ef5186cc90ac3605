// DocumentFollower with fake hooks: what is applied and acked, in which order, and what a
// failure of each hook leaves behind.
#include "gpuaas/node_agent/agent/document_follower.hpp"

#include <gtest/gtest.h>

namespace gpuaas::node_agent {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct FakeDoc {
  int64_t v = 0;
  std::string content;
  int64_t version() const { return v; }
};

struct Ack {
  int64_t version;
  std::vector<std::string> blockers;
  bool operator==(const Ack& o) const { return version == o.version && blockers == o.blockers; }
};

// The control plane and the host, as the hooks see them.
struct Fake {
  Result<FakeDoc> latest = FakeDoc{};
  std::vector<std::string> applied;  // content, in apply order
  std::vector<Ack> acks;             // accepted acks
  int fetches = 0;
  int checks = 0;
  int ack_calls = 0;
  bool fail_apply = false;
  bool fail_ack = false;
  std::vector<std::string> host_blockers;

  DocumentFollower<FakeDoc>::Hooks Hooks(bool with_check) {
    DocumentFollower<FakeDoc>::Hooks h;
    h.fetch = [this]() -> Result<FakeDoc> {
      ++fetches;
      return latest;
    };
    h.apply = [this](const FakeDoc& d) -> Result<void> {
      if (fail_apply) return Error::Unavailable("apply_failed", "host refused");
      applied.push_back(d.content);
      return Ok();
    };
    if (with_check) {
      h.check = [this](const FakeDoc&) -> Result<std::vector<std::string>> {
        ++checks;
        return host_blockers;
      };
    }
    h.ack = [this](int64_t version, const std::vector<std::string>& blockers) -> Result<void> {
      ++ack_calls;
      if (fail_ack) return Error::Unavailable("control_plane_down", "no responders");
      acks.push_back({version, blockers});
      return Ok();
    };
    return h;
  }
};

FakeDoc Doc(int64_t v, std::string content) { return FakeDoc{v, std::move(content)}; }

TEST(DocumentFollowerTest, NewVersionIsAppliedThenAcked) {
  Fake f;
  DocumentFollower<FakeDoc> follower(f.Hooks(false), 5s);
  const auto t0 = Clock::now();

  // Version 0: nothing desired yet, nothing applied or acked.
  auto r0 = follower.Step(t0);
  EXPECT_FALSE(r0.applied_now);
  EXPECT_TRUE(f.applied.empty());
  EXPECT_TRUE(f.acks.empty());
  EXPECT_FALSE(follower.applied().has_value());

  f.latest = Doc(1, "one");
  auto r1 = follower.Step(t0 + 1s);
  EXPECT_TRUE(r1.applied_now);
  EXPECT_TRUE(r1.acked_now);
  EXPECT_FALSE(r1.checked);  // no check hook
  EXPECT_EQ(f.applied, std::vector<std::string>{"one"});
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}}));
  ASSERT_TRUE(follower.applied().has_value());
  EXPECT_EQ(follower.applied()->content, "one");
  EXPECT_EQ(follower.applied_version(), 1);
  EXPECT_EQ(follower.acked_version(), 1);

  f.latest = Doc(2, "two");
  auto r2 = follower.Step(t0 + 2s);
  EXPECT_TRUE(r2.applied_now);
  EXPECT_EQ(f.applied, (std::vector<std::string>{"one", "two"}));
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}, {2, {}}}));
  EXPECT_EQ(follower.acked_version(), 2);
}

TEST(DocumentFollowerTest, SameVersionIsNotAppliedAgain) {
  Fake f;
  f.latest = Doc(3, "three");
  DocumentFollower<FakeDoc> follower(f.Hooks(false), 5s);
  const auto t0 = Clock::now();
  for (int i = 0; i < 4; ++i) (void)follower.Step(t0 + i * 1s);
  EXPECT_EQ(f.fetches, 4);
  EXPECT_EQ(f.applied, std::vector<std::string>{"three"});
  EXPECT_EQ(f.ack_calls, 1);
}

TEST(DocumentFollowerTest, FailedApplyIsNotAckedAndIsTriedAgain) {
  Fake f;
  f.latest = Doc(1, "one");
  DocumentFollower<FakeDoc> follower(f.Hooks(true), 5s);
  const auto t0 = Clock::now();
  ASSERT_TRUE(follower.Step(t0).acked_now);

  f.latest = Doc(2, "two");
  f.fail_apply = true;
  auto failed = follower.Step(t0 + 1s);
  ASSERT_TRUE(failed.apply_error.has_value());
  EXPECT_EQ(failed.apply_error->reason, "apply_failed");
  EXPECT_FALSE(failed.applied_now);
  EXPECT_FALSE(failed.acked_now);
  // The control plane never sees version 2 acked; the host keeps version 1.
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}}));
  EXPECT_EQ(follower.applied()->content, "one");
  EXPECT_EQ(follower.acked_version(), 1);

  f.fail_apply = false;
  auto retried = follower.Step(t0 + 2s);
  EXPECT_TRUE(retried.applied_now);
  EXPECT_EQ(f.applied, (std::vector<std::string>{"one", "two"}));
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}, {2, {}}}));
}

TEST(DocumentFollowerTest, ChangedBlockersAreAckedAgainOnTheCheckInterval) {
  Fake f;
  f.latest = Doc(1, "one");
  DocumentFollower<FakeDoc> follower(f.Hooks(true), 5s);
  const auto t0 = Clock::now();

  // Right after an apply the host is checked, and the ack carries what the check found.
  f.host_blockers = {"masquerade_missing"};
  auto r0 = follower.Step(t0);
  EXPECT_TRUE(r0.applied_now);
  EXPECT_TRUE(r0.checked);
  EXPECT_EQ(r0.blockers, std::vector<std::string>{"masquerade_missing"});
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {"masquerade_missing"}}}));

  // Within the interval: no check, no ack, even though the host changed.
  f.host_blockers.clear();
  auto r1 = follower.Step(t0 + 1s);
  EXPECT_FALSE(r1.checked);
  EXPECT_EQ(f.checks, 1);
  EXPECT_EQ(f.acks.size(), 1U);

  // On the interval: checked, and the repaired host is acked again (same version).
  auto r2 = follower.Step(t0 + 5s);
  EXPECT_TRUE(r2.checked);
  EXPECT_TRUE(r2.acked_now);
  EXPECT_FALSE(r2.applied_now);
  EXPECT_TRUE(r2.blockers.empty());
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {"masquerade_missing"}}, {1, {}}}));

  // Checked again with nothing changed: no new ack.
  auto r3 = follower.Step(t0 + 10s);
  EXPECT_TRUE(r3.checked);
  EXPECT_FALSE(r3.acked_now);
  EXPECT_EQ(f.acks.size(), 2U);
  EXPECT_EQ(f.applied, std::vector<std::string>{"one"});
}

TEST(DocumentFollowerTest, FailedAckIsRetriedNextRoundWithoutApplyingAgain) {
  Fake f;
  f.latest = Doc(1, "one");
  f.fail_ack = true;
  DocumentFollower<FakeDoc> follower(f.Hooks(true), 5s);
  const auto t0 = Clock::now();

  auto failed = follower.Step(t0);
  EXPECT_TRUE(failed.applied_now);
  ASSERT_TRUE(failed.ack_error.has_value());
  EXPECT_EQ(failed.ack_error->reason, "control_plane_down");
  EXPECT_TRUE(f.acks.empty());
  EXPECT_EQ(follower.applied_version(), 1);  // the host has it ...
  EXPECT_EQ(follower.acked_version(), 0);    // ... the control plane does not know yet

  f.fail_ack = false;
  auto retried = follower.Step(t0 + 1s);  // within the check interval
  EXPECT_FALSE(retried.applied_now);
  EXPECT_FALSE(retried.checked);
  EXPECT_TRUE(retried.acked_now);
  EXPECT_EQ(f.applied, std::vector<std::string>{"one"});
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}}));
  EXPECT_EQ(follower.acked_version(), 1);

  // A failed re-ack of changed blockers is retried too.
  f.fail_ack = true;
  f.host_blockers = {"dnsmasq_down"};
  auto blocked = follower.Step(t0 + 6s);
  EXPECT_TRUE(blocked.checked);
  EXPECT_TRUE(blocked.ack_error.has_value());
  f.fail_ack = false;
  auto reacked = follower.Step(t0 + 7s);
  EXPECT_TRUE(reacked.acked_now);
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}, {1, {"dnsmasq_down"}}}));
}

TEST(DocumentFollowerTest, FetchErrorKeepsTheAppliedDocument) {
  Fake f;
  f.latest = Doc(1, "one");
  DocumentFollower<FakeDoc> follower(f.Hooks(true), 5s);
  const auto t0 = Clock::now();
  ASSERT_TRUE(follower.Step(t0).applied_now);

  f.latest = Error::NotFound("node_not_found", "inventory does not know node");
  auto lost = follower.Step(t0 + 1s);
  ASSERT_TRUE(lost.fetch_error.has_value());
  EXPECT_EQ(lost.fetch_error->code, Code::kNotFound);  // the caller decides (isolation)
  ASSERT_TRUE(follower.applied().has_value());
  EXPECT_EQ(follower.applied()->content, "one");
  EXPECT_EQ(follower.acked_version(), 1);

  // The host is still checked and repaired while the control plane is away.
  f.host_blockers = {"bridge_missing"};
  auto checked = follower.Step(t0 + 5s);
  EXPECT_TRUE(checked.fetch_error.has_value());
  EXPECT_TRUE(checked.checked);
  EXPECT_EQ(checked.blockers, std::vector<std::string>{"bridge_missing"});
  EXPECT_EQ(f.applied, std::vector<std::string>{"one"});
}

TEST(DocumentFollowerTest, RestoredDocumentIsNotAppliedOrAckedAgain) {
  Fake f;
  f.latest = Doc(4, "four");
  DocumentFollower<FakeDoc> follower(f.Hooks(false), 5s);
  follower.Restore(Doc(4, "four"));
  EXPECT_EQ(follower.applied_version(), 4);
  EXPECT_EQ(follower.acked_version(), 4);
  const auto r = follower.Step(Clock::now());
  EXPECT_FALSE(r.applied_now);
  EXPECT_TRUE(f.applied.empty());
  EXPECT_EQ(f.ack_calls, 0);

  // A different version from the control plane (its database was rebuilt) is applied.
  f.latest = Doc(1, "one again");
  EXPECT_TRUE(follower.Step(Clock::now()).applied_now);
  EXPECT_EQ(f.acks, (std::vector<Ack>{{1, {}}}));
}

}  // namespace
}  // namespace gpuaas::node_agent
