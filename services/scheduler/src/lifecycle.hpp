#pragma once
// The allocation lifecycle as one pure transition function: (state, event, context) -> the next
// state, what happens to the claims, the node tasks to send, the failure to record and the
// timeline row to write. The saga (saga.cpp) only applies these effects; the invariant checker
// (CheckInvariants) takes the claim phases a state may hold from LiveClaimPhases(), and the
// lifecycle test walks every (state, event) pair. docs/architecture.md shows the table.
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/types.pb.h"

namespace gpuaas::scheduler::lifecycle {

enum class Event {
  kStart,               // placement committed: start the host work (or hand over baremetal)
  kReleaseRequested,    // allocation.release
  kForceRelease,        // allocation.release with force (admin)
  kProvisionSucceeded,  // vm.provision succeeded (the current attempt)
  kProvisionFailed,     // vm.provision failed, was rejected or timed out
  kReleaseSucceeded,    // vm.release succeeded
  kReleaseFailed,       // vm.release failed, was rejected or timed out
  kCleanupProved,       // slot.cleanup succeeded with a clean proof for every live slot
  kCleanupFailed,       // slot.cleanup failed, timed out or its proof was incomplete
  kExposuresReady,      // ingress reports every endpoint of the allocation applied
  kExposureFailed,      // ingress could not reserve or apply an endpoint of the allocation
};
inline constexpr Event kAllEvents[] = {Event::kStart,           Event::kReleaseRequested,
                                       Event::kForceRelease,    Event::kProvisionSucceeded,
                                       Event::kProvisionFailed, Event::kReleaseSucceeded,
                                       Event::kReleaseFailed,   Event::kCleanupProved,
                                       Event::kCleanupFailed,   Event::kExposuresReady,
                                       Event::kExposureFailed};
std::string_view EventName(Event e);

// Facts about the allocation the table needs besides its state.
struct Context {
  bool baremetal = false;
  bool has_live_claims = true;
  bool task_open = false;       // a node task of the allocation awaits its result
  bool current_attempt = true;  // a provision result belongs to the allocation's attempt
  // The allocation asked for endpoints (expose/app) that ingress has not reported applied yet.
  bool endpoints_pending = false;
  // The node reported the VM up (vm.provision succeeded).
  bool vm_ready = false;
};

enum class Claims {
  kKeep,      // phases unchanged
  kSetPhase,  // every live claim to `phase`
  kFree,      // every live claim freed (released_at, phase released)
};
enum class FailureChange { kKeep, kSet, kClear };

struct Effects {
  v1::AllocationState state = v1::ALLOCATION_STATE_UNSPECIFIED;  // after the event
  // A new generation and an allocation.<state> event (also when the state stays the same, so
  // projections see a claim or failure change).
  bool announce = false;
  Claims claims = Claims::kKeep;
  v1::ClaimPhase phase = v1::CLAIM_PHASE_UNSPECIFIED;  // with kSetPhase
  FailureChange failure = FailureChange::kKeep;
  v1::LifecycleStage failure_stage = v1::LIFECYCLE_STAGE_UNSPECIFIED;  // with kSet
  std::vector<v1::TaskType> send;  // node tasks to send, in order
  bool cancel_open_tasks = false;
  // The timeline row of the event itself (UNSPECIFIED: none; task outcomes write their own
  // succeeded/failed/rejected/timed_out row, which the saga knows).
  v1::TimelineStep step = v1::TIMELINE_STEP_UNSPECIFIED;
  // A task result that decides nothing any more (late or for an old attempt): only a
  // late_result row is written.
  bool late = false;
  // Nothing to do (a repeated request): the reply is the allocation as it is.
  bool noop = false;
};

// The transition, or FAILED_PRECONDITION `illegal_transition` {state, event} for a pair the
// lifecycle does not allow (e.g. kStart on an active allocation).
Result<Effects> Next(v1::AllocationState state, Event event, const Context& ctx);

// The phases a live claim may have while the allocation is in `state` (empty: it holds none).
std::vector<v1::ClaimPhase> LiveClaimPhases(v1::AllocationState state);

// Every state a stored allocation can be in (UNSPECIFIED excluded).
std::vector<v1::AllocationState> AllStates();

}  // namespace gpuaas::scheduler::lifecycle
