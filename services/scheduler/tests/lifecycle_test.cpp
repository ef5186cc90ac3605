// The allocation lifecycle table (lifecycle.hpp), walked over every (state, event) pair and every
// context: a golden table pins each transition, and properties that must hold for any transition
// (claim phases the invariant checker accepts, terminal states, no silent state change) are
// checked for all of them, including every illegal pair getting its structured error.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/enums.hpp"
#include "lifecycle.hpp"

namespace gpuaas::scheduler::lifecycle {
namespace {

std::vector<Context> AllContexts() {
  std::vector<Context> out;
  for (int bits = 0; bits < 64; ++bits) {
    Context c;
    c.baremetal = (bits & 1) != 0;
    c.has_live_claims = (bits & 2) != 0;
    c.task_open = (bits & 4) != 0;
    c.current_attempt = (bits & 8) != 0;
    c.endpoints_pending = (bits & 16) != 0;
    c.vm_ready = (bits & 32) != 0;
    out.push_back(c);
  }
  return out;
}

std::string Describe(const Context& c) {
  return fmt::format(
      "baremetal={} live_claims={} task_open={} current_attempt={} endpoints_pending={} "
      "vm_ready={}",
      c.baremetal, c.has_live_claims, c.task_open, c.current_attempt, c.endpoints_pending,
      c.vm_ready);
}

// One line per transition: "<state> [claims <phase>|freed] [send a,b] [failure set <stage>|clear]
// [announce] [step <step>] [cancel] [late] [noop]", or "illegal".
std::string Render(const Result<Effects>& r) {
  if (!r.ok()) return r.error().reason == "illegal_transition" ? "illegal" : r.error().reason;
  const Effects& fx = *r;
  std::vector<std::string> parts = {enums::Text(fx.state)};
  if (fx.claims == Claims::kSetPhase) parts.push_back("claims " + enums::Text(fx.phase));
  if (fx.claims == Claims::kFree) parts.emplace_back("freed");
  if (!fx.send.empty()) {
    std::vector<std::string> t;
    for (auto s : fx.send) t.push_back(enums::Text(s));
    parts.push_back(fmt::format("send {}", fmt::join(t, ",")));
  }
  if (fx.failure == FailureChange::kSet) {
    parts.push_back("failure " + enums::Text(fx.failure_stage));
  }
  if (fx.failure == FailureChange::kClear) parts.emplace_back("failure clear");
  if (fx.announce) parts.emplace_back("announce");
  if (fx.step != v1::TIMELINE_STEP_UNSPECIFIED) parts.push_back("step " + enums::Text(fx.step));
  if (fx.cancel_open_tasks) parts.emplace_back("cancel");
  if (fx.late) parts.emplace_back("late");
  if (fx.noop) parts.emplace_back("noop");
  return fmt::format("{}", fmt::join(parts, " "));
}

// The whole table for a slice allocation with live claims, no task open and a result of the
// current attempt: every (state, event) pair, written out.
const std::map<std::pair<std::string, std::string>, std::string>& Golden() {
  static const std::map<std::pair<std::string, std::string>, std::string> golden = {
      {{"pending", "start"}, "illegal"},
      {{"pending", "release_requested"}, "released freed announce step claims_freed"},
      {{"pending", "force_release"},
       "released freed failure release announce step force_released cancel"},
      {{"pending", "provision_succeeded"}, "pending late"},
      {{"pending", "provision_failed"}, "pending late"},
      {{"pending", "release_succeeded"}, "pending late"},
      {{"pending", "release_failed"}, "pending late"},
      {{"pending", "cleanup_proved"}, "pending late"},
      {{"pending", "cleanup_failed"}, "pending late"},
      {{"pending", "exposures_ready"}, "pending noop"},
      {{"pending", "exposure_failed"}, "pending noop"},

      {{"reserved", "start"}, "provisioning claims provisioning send vm.provision announce"},
      {{"reserved", "release_requested"}, "released freed announce step claims_freed"},
      {{"reserved", "force_release"},
       "released freed failure release announce step force_released cancel"},
      {{"reserved", "provision_succeeded"}, "reserved late"},
      {{"reserved", "provision_failed"}, "reserved late"},
      {{"reserved", "release_succeeded"}, "reserved late"},
      {{"reserved", "release_failed"}, "reserved late"},
      {{"reserved", "cleanup_proved"}, "reserved late"},
      {{"reserved", "cleanup_failed"}, "reserved late"},
      {{"reserved", "exposures_ready"}, "reserved noop"},
      {{"reserved", "exposure_failed"}, "reserved noop"},

      {{"provisioning", "start"}, "illegal"},
      {{"provisioning", "release_requested"},
       "releasing claims releasing send vm.release announce"},
      {{"provisioning", "force_release"},
       "releasing claims releasing send vm.release failure clear announce step force_released "
       "cancel"},
      {{"provisioning", "provision_succeeded"}, "active claims active announce"},
      {{"provisioning", "provision_failed"},
       "failed claims cleanup_blocked send slot.cleanup failure provisioning announce"},
      {{"provisioning", "release_succeeded"}, "provisioning late"},
      {{"provisioning", "release_failed"}, "provisioning late"},
      {{"provisioning", "cleanup_proved"}, "provisioning late"},
      {{"provisioning", "cleanup_failed"}, "provisioning late"},
      {{"provisioning", "exposures_ready"}, "provisioning noop"},
      {{"provisioning", "exposure_failed"},
       "failed claims cleanup_blocked send slot.cleanup failure exposure announce"},

      {{"active", "start"}, "illegal"},
      {{"active", "release_requested"}, "releasing claims releasing send vm.release announce"},
      {{"active", "force_release"},
       "releasing claims releasing send vm.release failure clear announce step force_released "
       "cancel"},
      {{"active", "provision_succeeded"}, "active late"},
      {{"active", "provision_failed"}, "active late"},
      {{"active", "release_succeeded"}, "active late"},
      {{"active", "release_failed"}, "active late"},
      {{"active", "cleanup_proved"}, "active late"},
      {{"active", "cleanup_failed"}, "active late"},
      {{"active", "exposures_ready"}, "active noop"},
      {{"active", "exposure_failed"}, "active noop"},

      {{"releasing", "start"}, "illegal"},
      {{"releasing", "release_requested"},
       "releasing claims releasing send vm.release failure clear announce"},
      {{"releasing", "force_release"},
       "releasing claims releasing send vm.release failure clear announce step force_released "
       "cancel"},
      {{"releasing", "provision_succeeded"}, "releasing late"},
      {{"releasing", "provision_failed"}, "releasing late"},
      {{"releasing", "release_succeeded"}, "releasing claims cleanup send slot.cleanup"},
      {{"releasing", "release_failed"},
       "releasing claims cleanup_blocked failure release announce"},
      {{"releasing", "cleanup_proved"}, "released freed failure clear announce step claims_freed"},
      {{"releasing", "cleanup_failed"},
       "releasing claims cleanup_blocked failure cleanup announce"},
      {{"releasing", "exposures_ready"}, "releasing noop"},
      {{"releasing", "exposure_failed"}, "releasing noop"},

      {{"released", "start"}, "illegal"},
      {{"released", "release_requested"}, "released noop"},
      {{"released", "force_release"}, "released noop"},
      {{"released", "provision_succeeded"}, "released late"},
      {{"released", "provision_failed"}, "released late"},
      {{"released", "release_succeeded"}, "released late"},
      {{"released", "release_failed"}, "released late"},
      {{"released", "cleanup_proved"}, "released late"},
      {{"released", "cleanup_failed"}, "released late"},
      {{"released", "exposures_ready"}, "released noop"},
      {{"released", "exposure_failed"}, "released noop"},

      {{"failed", "start"}, "illegal"},
      {{"failed", "release_requested"}, "failed claims cleanup send slot.cleanup"},
      {{"failed", "force_release"},
       "failed claims cleanup send slot.cleanup announce step force_released cancel"},
      {{"failed", "provision_succeeded"}, "failed late"},
      {{"failed", "provision_failed"}, "failed late"},
      {{"failed", "release_succeeded"}, "failed late"},
      {{"failed", "release_failed"}, "failed late"},
      {{"failed", "cleanup_proved"}, "failed freed announce step claims_freed"},
      {{"failed", "cleanup_failed"}, "failed claims cleanup_blocked"},
      {{"failed", "exposures_ready"}, "failed noop"},
      {{"failed", "exposure_failed"}, "failed noop"},
  };
  return golden;
}

TEST(LifecycleTest, GoldenTableCoversEveryStateAndEvent) {
  const Context slice;  // live claims, no task open, current attempt
  std::set<std::pair<std::string, std::string>> seen;
  for (auto s : AllStates()) {
    for (auto e : kAllEvents) {
      const std::pair<std::string, std::string> key{enums::Text(s), std::string(EventName(e))};
      seen.insert(key);
      auto it = Golden().find(key);
      ASSERT_NE(it, Golden().end()) << "no golden row for " << key.first << " x " << key.second;
      EXPECT_EQ(Render(Next(s, e, slice)), it->second) << key.first << " x " << key.second;
    }
  }
  EXPECT_EQ(seen.size(), Golden().size()) << "the golden table names a pair that does not exist";
  EXPECT_EQ(AllStates().size(), enums::Texts<v1::AllocationState>().size())
      << "a state was added to the enum but not to the lifecycle";
}

TEST(LifecycleTest, ContextChangesOnlyWhatItShould) {
  Context bm;
  bm.baremetal = true;
  // Bare metal: handed over as placed, and released without host work.
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_RESERVED, Event::kStart, bm)),
            "active claims active announce step state");
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_ACTIVE, Event::kReleaseRequested, bm)),
            "released freed announce step claims_freed");
  Context open;
  open.task_open = true;
  // A release already on its way is not sent twice.
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_RELEASING, Event::kReleaseRequested, open)),
            "releasing noop");
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_FAILED, Event::kReleaseRequested, open)),
            "failed noop");
  Context none;
  none.has_live_claims = false;
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_FAILED, Event::kReleaseRequested, none)),
            "failed noop");
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_FAILED, Event::kForceRelease, none)), "failed noop");
  // A force-release replaces what is in flight instead of waiting for it.
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_FAILED, Event::kForceRelease, open)),
            "failed claims cleanup send slot.cleanup announce step force_released cancel");
  // Bare metal has no host task: its claim is freed at once.
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_ACTIVE, Event::kForceRelease, bm)),
            "released freed failure release announce step force_released cancel");
  Context old;
  old.current_attempt = false;
  // A result of an earlier attempt decides nothing.
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_PROVISIONING, Event::kProvisionSucceeded, old)),
            "provisioning late");
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_PROVISIONING, Event::kProvisionFailed, old)),
            "provisioning late");
  // Endpoints asked for: the VM being up is not enough to be active.
  Context exposing;
  exposing.endpoints_pending = true;
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_PROVISIONING, Event::kProvisionSucceeded, exposing)),
            "provisioning announce");
  exposing.vm_ready = true;
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_PROVISIONING, Event::kExposuresReady, exposing)),
            "provisioning noop");
  Context applied;
  applied.vm_ready = true;
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_PROVISIONING, Event::kExposuresReady, applied)),
            "active claims active announce");
  // An endpoint failing after the allocation is active does not fail the allocation.
  EXPECT_EQ(Render(Next(v1::ALLOCATION_STATE_ACTIVE, Event::kExposureFailed, applied)),
            "active noop");
}

TEST(LifecycleTest, EveryTransitionInEveryContextKeepsTheInvariants) {
  const std::set<v1::TaskType> vm_tasks = {v1::TASK_TYPE_VM_PROVISION, v1::TASK_TYPE_VM_RELEASE,
                                           v1::TASK_TYPE_SLOT_CLEANUP};
  int pairs = 0, illegal = 0;
  for (const auto& ctx : AllContexts()) {
    for (auto s : AllStates()) {
      for (auto e : kAllEvents) {
        ++pairs;
        SCOPED_TRACE(fmt::format("{} x {} ({})", enums::Text(s), EventName(e), Describe(ctx)));
        auto r = Next(s, e, ctx);
        if (!r.ok()) {
          // Illegal: a structured FAILED_PRECONDITION naming the pair; only starting something
          // that is not reserved is illegal (task results and releases can always arrive).
          ++illegal;
          EXPECT_EQ(r.error().code, Code::kFailedPrecondition);
          EXPECT_EQ(r.error().reason, "illegal_transition");
          EXPECT_EQ(r.error().details.at("state"), enums::Text(s));
          EXPECT_EQ(r.error().details.at("event"), EventName(e));
          EXPECT_FALSE(r.error().retryable);
          EXPECT_EQ(e, Event::kStart);
          EXPECT_NE(s, v1::ALLOCATION_STATE_RESERVED);
          continue;
        }
        const Effects& fx = *r;
        EXPECT_FALSE(enums::Text(fx.state).empty()) << "a real state after every event";
        // Claims move only to a phase the invariant checker accepts for the new state.
        if (fx.claims == Claims::kSetPhase) {
          EXPECT_THAT(LiveClaimPhases(fx.state), ::testing::Contains(fx.phase));
        }
        // Claims kept only where the state stays (so their phases stay valid).
        if (fx.claims == Claims::kKeep) {
          EXPECT_EQ(fx.state, s);
        }
        // Freed claims end the allocation: released, or failed with its failure kept.
        if (fx.claims == Claims::kFree) {
          EXPECT_THAT(fx.state,
                      ::testing::AnyOf(v1::ALLOCATION_STATE_RELEASED, v1::ALLOCATION_STATE_FAILED));
        }
        // A state change is always announced (a new generation and an event).
        if (fx.state != s) {
          EXPECT_TRUE(fx.announce);
        }
        // A released allocation holds nothing and nothing moves it.
        if (fx.state == v1::ALLOCATION_STATE_RELEASED && fx.state != s) {
          EXPECT_EQ(fx.claims, Claims::kFree);
        }
        if (s == v1::ALLOCATION_STATE_RELEASED) {
          EXPECT_EQ(fx.state, s);
          EXPECT_TRUE(fx.noop || fx.late);
        }
        // Late results and repeated requests change nothing.
        if (fx.late || fx.noop) {
          EXPECT_EQ(fx.state, s);
          EXPECT_EQ(fx.claims, Claims::kKeep);
          EXPECT_TRUE(fx.send.empty());
          EXPECT_FALSE(fx.announce);
          EXPECT_EQ(fx.failure, FailureChange::kKeep);
          EXPECT_FALSE(fx.late && fx.noop);
        }
        for (auto t : fx.send) EXPECT_TRUE(vm_tasks.count(t)) << enums::Text(t);
        if (fx.failure == FailureChange::kSet) {
          EXPECT_NE(fx.failure_stage, v1::LIFECYCLE_STAGE_UNSPECIFIED);
        }
        // Claims of an allocation a host may have worked on are freed only by a cleanup proof
        // (or a release with no host work), never by a force-release: the node's lease on those
        // slots goes only with the proven cleanup.
        if (e == Event::kForceRelease && fx.claims == Claims::kFree) {
          EXPECT_TRUE(ctx.baremetal || s == v1::ALLOCATION_STATE_PENDING ||
                      s == v1::ALLOCATION_STATE_RESERVED);
        }
        // Bare metal never gets host tasks.
        if (ctx.baremetal &&
            (s == v1::ALLOCATION_STATE_RESERVED || s == v1::ALLOCATION_STATE_ACTIVE)) {
          EXPECT_TRUE(fx.send.empty());
        }
      }
    }
  }
  EXPECT_EQ(pairs, 64 * 7 * 11);
  EXPECT_EQ(illegal, 64 * 6) << "start on each of the 6 states other than reserved";
}

TEST(LifecycleTest, UnspecifiedStateIsAnInvalidArgument) {
  for (auto e : kAllEvents) {
    auto r = Next(v1::ALLOCATION_STATE_UNSPECIFIED, e, Context());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.error().code, Code::kInvalidArgument);
    EXPECT_EQ(r.error().reason, "state_invalid");
  }
}

TEST(LifecycleTest, EveryStateIsReachableFromReserved) {
  std::set<v1::AllocationState> seen = {v1::ALLOCATION_STATE_RESERVED};
  std::vector<v1::AllocationState> todo = {v1::ALLOCATION_STATE_RESERVED};
  while (!todo.empty()) {
    auto s = todo.back();
    todo.pop_back();
    for (const auto& ctx : AllContexts()) {
      for (auto e : kAllEvents) {
        auto r = Next(s, e, ctx);
        if (r.ok() && seen.insert(r->state).second) todo.push_back(r->state);
      }
    }
  }
  // pending is the row before placement commits; every other state is reached by events.
  for (auto s : AllStates()) {
    if (s == v1::ALLOCATION_STATE_PENDING) continue;
    EXPECT_TRUE(seen.count(s)) << enums::Text(s);
  }
  EXPECT_FALSE(seen.count(v1::ALLOCATION_STATE_PENDING));
}

TEST(LifecycleTest, HappyPathAndFailedCleanupRetry) {
  const Context c;
  auto walk = [&](v1::AllocationState s, std::initializer_list<Event> events) {
    for (auto e : events) {
      auto r = Next(s, e, c);
      EXPECT_TRUE(r.ok()) << enums::Text(s) << " x " << EventName(e);
      if (!r.ok()) return s;
      s = r->state;
    }
    return s;
  };
  EXPECT_EQ(walk(v1::ALLOCATION_STATE_RESERVED,
                 {Event::kStart, Event::kProvisionSucceeded, Event::kReleaseRequested,
                  Event::kReleaseSucceeded, Event::kCleanupProved}),
            v1::ALLOCATION_STATE_RELEASED);
  // A failed cleanup blocks the claims; asking again retries from vm.release and can finish.
  EXPECT_EQ(walk(v1::ALLOCATION_STATE_ACTIVE,
                 {Event::kReleaseRequested, Event::kReleaseSucceeded, Event::kCleanupFailed,
                  Event::kReleaseRequested, Event::kReleaseSucceeded, Event::kCleanupProved}),
            v1::ALLOCATION_STATE_RELEASED);
}

}  // namespace
}  // namespace gpuaas::scheduler::lifecycle
