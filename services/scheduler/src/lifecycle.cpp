#include "lifecycle.hpp"

#include "gpuaas/common/enums.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler::lifecycle {

namespace {

using S = v1::AllocationState;

Effects Stay(S s) {
  Effects fx;
  fx.state = s;
  return fx;
}

Effects Noop(S s) {
  Effects fx = Stay(s);
  fx.noop = true;
  return fx;
}

Effects Late(S s) {
  Effects fx = Stay(s);
  fx.late = true;
  return fx;
}

Effects To(S s, v1::ClaimPhase phase) {
  Effects fx = Stay(s);
  fx.announce = true;
  fx.claims = Claims::kSetPhase;
  fx.phase = phase;
  return fx;
}

Effects Failing(Effects fx, v1::LifecycleStage stage) {
  fx.failure = FailureChange::kSet;
  fx.failure_stage = stage;
  return fx;
}

Effects Sending(Effects fx, v1::TaskType t) {
  fx.send.push_back(t);
  return fx;
}

Effects Freed(S s, v1::TimelineStep step) {
  Effects fx = Stay(s);
  fx.announce = true;
  fx.claims = Claims::kFree;
  fx.step = step;
  return fx;
}

Error Illegal(S s, Event e) {
  return Error::Of(
      Code::kFailedPrecondition, reason::kIllegalTransition,
      "an allocation in state " + enums::Text(s) + " cannot take " + std::string(EventName(e)),
      {{"state", enums::Text(s)}, {"event", std::string(EventName(e))}});
}

}  // namespace

std::string_view EventName(Event e) {
  switch (e) {
    case Event::kStart:
      return "start";
    case Event::kReleaseRequested:
      return "release_requested";
    case Event::kForceRelease:
      return "force_release";
    case Event::kProvisionSucceeded:
      return "provision_succeeded";
    case Event::kProvisionFailed:
      return "provision_failed";
    case Event::kReleaseSucceeded:
      return "release_succeeded";
    case Event::kReleaseFailed:
      return "release_failed";
    case Event::kCleanupProved:
      return "cleanup_proved";
    case Event::kCleanupFailed:
      return "cleanup_failed";
    case Event::kExposuresReady:
      return "exposures_ready";
    case Event::kExposureFailed:
      return "exposure_failed";
  }
  return "unknown";
}

std::vector<v1::AllocationState> AllStates() {
  return {v1::ALLOCATION_STATE_PENDING,      v1::ALLOCATION_STATE_RESERVED,
          v1::ALLOCATION_STATE_PROVISIONING, v1::ALLOCATION_STATE_ACTIVE,
          v1::ALLOCATION_STATE_RELEASING,    v1::ALLOCATION_STATE_RELEASED,
          v1::ALLOCATION_STATE_FAILED};
}

std::vector<v1::ClaimPhase> LiveClaimPhases(v1::AllocationState state) {
  switch (state) {
    case v1::ALLOCATION_STATE_RESERVED:
      return {v1::CLAIM_PHASE_RESERVED};
    case v1::ALLOCATION_STATE_PROVISIONING:
      return {v1::CLAIM_PHASE_PROVISIONING};
    case v1::ALLOCATION_STATE_ACTIVE:
      return {v1::CLAIM_PHASE_ACTIVE};
    case v1::ALLOCATION_STATE_RELEASING:
      return {v1::CLAIM_PHASE_RELEASING, v1::CLAIM_PHASE_CLEANUP, v1::CLAIM_PHASE_CLEANUP_BLOCKED};
    case v1::ALLOCATION_STATE_FAILED:
      return {v1::CLAIM_PHASE_CLEANUP, v1::CLAIM_PHASE_CLEANUP_BLOCKED};
    default:
      return {};
  }
}

Result<Effects> Next(v1::AllocationState s, Event e, const Context& c) {
  if (enums::Text(s).empty()) {
    return Error::InvalidArgument(reason::kStateInvalid, "no allocation is in state UNSPECIFIED");
  }
  const bool provisioning = s == v1::ALLOCATION_STATE_PROVISIONING;
  const bool releasing = s == v1::ALLOCATION_STATE_RELEASING;
  const bool failed = s == v1::ALLOCATION_STATE_FAILED;
  const bool released = s == v1::ALLOCATION_STATE_RELEASED;
  switch (e) {
    case Event::kStart: {
      if (s != v1::ALLOCATION_STATE_RESERVED) return Illegal(s, e);
      if (c.baremetal) {
        // Bare-metal imaging is outside this product slice: the node is handed over as placed.
        Effects fx = To(v1::ALLOCATION_STATE_ACTIVE, v1::CLAIM_PHASE_ACTIVE);
        fx.step = v1::TIMELINE_STEP_STATE;
        return fx;
      }
      return Sending(To(v1::ALLOCATION_STATE_PROVISIONING, v1::CLAIM_PHASE_PROVISIONING),
                     v1::TASK_TYPE_VM_PROVISION);
    }
    case Event::kReleaseRequested: {
      if (released) return Noop(s);
      if (failed) {
        // Claims still blocked after a failed cleanup: releasing again retries the cleanup.
        if (!c.has_live_claims || c.task_open) return Noop(s);
        Effects fx = Stay(s);
        fx.claims = Claims::kSetPhase;
        fx.phase = v1::CLAIM_PHASE_CLEANUP;
        return Sending(fx, v1::TASK_TYPE_SLOT_CLEANUP);
      }
      if (s == v1::ALLOCATION_STATE_PENDING || s == v1::ALLOCATION_STATE_RESERVED || c.baremetal) {
        // Nothing was created on a host for it: its claims are free now.
        return Freed(v1::ALLOCATION_STATE_RELEASED, v1::TIMELINE_STEP_CLAIMS_FREED);
      }
      if (releasing) {
        if (c.task_open) return Noop(s);  // on its way
        // The last release or cleanup failed: start again from vm.release (idempotent on the
        // node), with the failure cleared.
        Effects fx = To(s, v1::CLAIM_PHASE_RELEASING);
        fx.failure = FailureChange::kClear;
        return Sending(fx, v1::TASK_TYPE_VM_RELEASE);
      }
      // provisioning or active
      return Sending(To(v1::ALLOCATION_STATE_RELEASING, v1::CLAIM_PHASE_RELEASING),
                     v1::TASK_TYPE_VM_RELEASE);
    }
    case Event::kForceRelease: {
      if (released || (failed && !c.has_live_claims)) return Noop(s);
      if (s == v1::ALLOCATION_STATE_PENDING || s == v1::ALLOCATION_STATE_RESERVED || c.baremetal) {
        // Nothing was created on a host for it: its claims are free now.
        Effects fx = Freed(v1::ALLOCATION_STATE_RELEASED, v1::TIMELINE_STEP_FORCE_RELEASED);
        fx.cancel_open_tasks = true;
        return Failing(fx, v1::LIFECYCLE_STAGE_RELEASE);
      }
      // The host may still run a VM and hold its slots' lease: the claims are freed only by a
      // cleanup proof, like a release's, or the next allocation placed there would meet the
      // lease. Whatever was in flight is cancelled (its result arrives late) and the teardown
      // starts again from the step the host needs.
      if (failed) {
        Effects fx = To(s, v1::CLAIM_PHASE_CLEANUP);
        fx.cancel_open_tasks = true;
        fx.step = v1::TIMELINE_STEP_FORCE_RELEASED;
        return Sending(fx, v1::TASK_TYPE_SLOT_CLEANUP);
      }
      // provisioning, active or releasing
      Effects fx = To(v1::ALLOCATION_STATE_RELEASING, v1::CLAIM_PHASE_RELEASING);
      fx.cancel_open_tasks = true;
      fx.step = v1::TIMELINE_STEP_FORCE_RELEASED;
      fx.failure = FailureChange::kClear;
      return Sending(fx, v1::TASK_TYPE_VM_RELEASE);
    }
    case Event::kProvisionSucceeded: {
      if (!provisioning || !c.current_attempt) return Late(s);
      if (!c.endpoints_pending) return To(v1::ALLOCATION_STATE_ACTIVE, v1::CLAIM_PHASE_ACTIVE);
      // The VM is up; its endpoints are not applied yet: never active with a half-applied
      // mapping. Announced so ingress sees vm_ready and applies them.
      Effects fx = Stay(s);
      fx.announce = true;
      return fx;
    }
    case Event::kExposuresReady:
      if (provisioning && c.vm_ready && !c.endpoints_pending) {
        return To(v1::ALLOCATION_STATE_ACTIVE, v1::CLAIM_PHASE_ACTIVE);
      }
      return Noop(s);
    case Event::kExposureFailed:
      // Before it is active the allocation fails with it (its slots are cleaned like after a
      // failed provisioning); later an endpoint's failure is the endpoint's own state.
      if (!provisioning) return Noop(s);
      return Sending(Failing(To(v1::ALLOCATION_STATE_FAILED, v1::CLAIM_PHASE_CLEANUP_BLOCKED),
                             v1::LIFECYCLE_STAGE_EXPOSURE),
                     v1::TASK_TYPE_SLOT_CLEANUP);
    case Event::kProvisionFailed:
      if (!provisioning || !c.current_attempt) return Late(s);
      return Sending(Failing(To(v1::ALLOCATION_STATE_FAILED, v1::CLAIM_PHASE_CLEANUP_BLOCKED),
                             v1::LIFECYCLE_STAGE_PROVISIONING),
                     v1::TASK_TYPE_SLOT_CLEANUP);
    case Event::kReleaseSucceeded: {
      if (!releasing) return Late(s);
      Effects fx = Stay(s);
      fx.claims = Claims::kSetPhase;
      fx.phase = v1::CLAIM_PHASE_CLEANUP;
      return Sending(fx, v1::TASK_TYPE_SLOT_CLEANUP);
    }
    case Event::kReleaseFailed:
      if (!releasing) return Late(s);
      return Failing(To(s, v1::CLAIM_PHASE_CLEANUP_BLOCKED), v1::LIFECYCLE_STAGE_RELEASE);
    case Event::kCleanupProved: {
      if (releasing) {
        Effects fx = Freed(v1::ALLOCATION_STATE_RELEASED, v1::TIMELINE_STEP_CLAIMS_FREED);
        fx.failure = FailureChange::kClear;
        return fx;
      }
      // A failed allocation keeps its failure; a new generation lets projections see the claims
      // go.
      if (failed) return Freed(s, v1::TIMELINE_STEP_CLAIMS_FREED);
      return Late(s);
    }
    case Event::kCleanupFailed: {
      if (releasing) {
        return Failing(To(s, v1::CLAIM_PHASE_CLEANUP_BLOCKED), v1::LIFECYCLE_STAGE_CLEANUP);
      }
      if (failed) {
        Effects fx = Stay(s);
        fx.claims = Claims::kSetPhase;
        fx.phase = v1::CLAIM_PHASE_CLEANUP_BLOCKED;
        return fx;
      }
      return Late(s);
    }
  }
  return Illegal(s, e);
}

}  // namespace gpuaas::scheduler::lifecycle
