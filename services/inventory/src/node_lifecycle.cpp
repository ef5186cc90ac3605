#include "gpuaas/inventory/node_lifecycle.hpp"

#include <string>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"

namespace gpuaas::inventory::node_lifecycle {

namespace {

using v1::NodeAdminState;
constexpr NodeAdminState kActive = v1::NODE_ADMIN_STATE_ACTIVE;
constexpr NodeAdminState kDraining = v1::NODE_ADMIN_STATE_DRAINING;
constexpr NodeAdminState kDrained = v1::NODE_ADMIN_STATE_DRAINED;
constexpr NodeAdminState kMaintenance = v1::NODE_ADMIN_STATE_MAINTENANCE;
constexpr NodeAdminState kDecommissioned = v1::NODE_ADMIN_STATE_DECOMMISSIONED;

// The node stays as it is (a repeated request, a report this state does not act on).
Effects Stay(NodeAdminState s, const Context& ctx) {
  Effects fx;
  fx.state = s;
  fx.mode = ctx.mode;
  fx.placeable = s == kActive;
  fx.noop = true;
  return fx;
}

// The node moves to `s` (or changes in place): a new generation and its event.
Effects Go(NodeAdminState s, const Context& ctx) {
  Effects fx = Stay(s, ctx);
  fx.noop = false;
  fx.announce = true;
  return fx;
}

Error Refuse(Reason why, NodeAdminState s, Event e, const std::string& message) {
  Error err = Error::FailedPrecondition(why, message);
  err.details["state"] = enums::Text(s);
  err.details["event"] = std::string(EventName(e));
  return err;
}

Error Illegal(NodeAdminState s, Event e) {
  return Refuse(reason::kIllegalTransition, s, e,
                "a " + enums::Text(s) + " node cannot take " + std::string(EventName(e)));
}

Error InProgress(NodeAdminState s, Event e) {
  return Refuse(reason::kModeChangeInProgress, s, e,
                "a mode change of this node is still open: wait for the agent's report");
}

// What the agent and the scheduler report: they arrive whenever they happen, so a state that
// does not act on one takes it as a no-op rather than an error.
bool IsReport(Event e) {
  return e == Event::kLastClaimReleased || e == Event::kChecksPassed || e == Event::kChecksFailed ||
         e == Event::kModeApplied || e == Event::kModeFailed;
}

Result<Effects> Drain(NodeAdminState s, const Context& ctx) {
  if (s == kActive) return Go(ctx.has_live_claims ? kDraining : kDrained, ctx);
  if (s == kDraining || s == kDrained) return Stay(s, ctx);
  return Illegal(s, Event::kDrain);  // maintenance: it returns through its checks
}

Result<Effects> Undrain(NodeAdminState s, const Context& ctx) {
  if (s == kActive) return Stay(s, ctx);
  if (s != kDraining && s != kDrained) return Illegal(s, Event::kUndrain);
  if (ctx.mode_change_open) return InProgress(s, Event::kUndrain);
  return Go(kActive, ctx);
}

Result<Effects> EnterMaintenance(NodeAdminState s, const Context& ctx) {
  if (s == kMaintenance) return Stay(s, ctx);
  if (s != kDrained) return Illegal(s, Event::kEnterMaintenance);
  if (ctx.mode_change_open) return InProgress(s, Event::kEnterMaintenance);
  return Go(kMaintenance, ctx);
}

Result<Effects> ChangeMode(NodeAdminState s, const Context& ctx) {
  if (s != kDrained) return Illegal(s, Event::kChangeMode);
  if (ctx.mode_change_open) return InProgress(s, Event::kChangeMode);
  if (ctx.target == ctx.mode) return Stay(s, ctx);
  Effects fx = Go(s, ctx);
  fx.start_mode_change = true;
  return fx;
}

Result<Effects> ModeOutcome(NodeAdminState s, Event e, const Context& ctx) {
  // Late or repeated (a mode change is open only on a drained node).
  if (!ctx.mode_change_open || s != kDrained) return Stay(s, ctx);
  Effects fx = Go(s, ctx);
  fx.mode_change_done = true;
  if (e == Event::kModeApplied) {
    fx.mode = ctx.target;
    fx.slots_need_approval = ctx.target == v1::CAPACITY_PROFILE_SLICE_VM;
  }
  return fx;
}

Result<Effects> Decommission(NodeAdminState s, const Context& ctx) {
  // A draining node still held says so: what stands in the way is its allocations.
  if (s != kDrained && !(s == kDraining && ctx.has_live_claims)) {
    return Illegal(s, Event::kDecommission);
  }
  if (ctx.has_live_claims) {
    return Refuse(reason::kNodeHasLiveClaims, s, Event::kDecommission,
                  "the node still holds live claims: release them first");
  }
  if (ctx.mode_change_open) return InProgress(s, Event::kDecommission);
  Effects fx = Go(kDecommissioned, ctx);
  fx.retire = true;
  return fx;
}

}  // namespace

std::string_view EventName(Event e) {
  switch (e) {
    case Event::kDrain:
      return "drain";
    case Event::kUndrain:
      return "undrain";
    case Event::kLastClaimReleased:
      return "last_claim_released";
    case Event::kEnterMaintenance:
      return "enter_maintenance";
    case Event::kChecksPassed:
      return "checks_passed";
    case Event::kChecksFailed:
      return "checks_failed";
    case Event::kChangeMode:
      return "change_mode";
    case Event::kModeApplied:
      return "mode_applied";
    case Event::kModeFailed:
      return "mode_failed";
    case Event::kDecommission:
      return "decommission";
  }
  return "unknown";
}

Result<Effects> Next(v1::NodeAdminState state, Event event, const Context& ctx) {
  if (state == kDecommissioned) {
    // Final: reports change nothing, requests are refused.
    if (IsReport(event)) return Stay(state, ctx);
    return Illegal(state, event);
  }
  switch (event) {
    case Event::kDrain:
      return Drain(state, ctx);
    case Event::kUndrain:
      return Undrain(state, ctx);
    case Event::kLastClaimReleased:
      return state == kDraining ? Go(kDrained, ctx) : Stay(state, ctx);
    case Event::kEnterMaintenance:
      return EnterMaintenance(state, ctx);
    // Back from maintenance only when the checks pass; elsewhere the checks already gate each
    // slot's approval.
    case Event::kChecksPassed:
      return state == kMaintenance ? Go(kActive, ctx) : Stay(state, ctx);
    case Event::kChecksFailed:
      return Stay(state, ctx);
    case Event::kChangeMode:
      return ChangeMode(state, ctx);
    case Event::kModeApplied:
    case Event::kModeFailed:
      return ModeOutcome(state, event, ctx);
    case Event::kDecommission:
      return Decommission(state, ctx);
  }
  return Illegal(state, event);
}

}  // namespace gpuaas::inventory::node_lifecycle
