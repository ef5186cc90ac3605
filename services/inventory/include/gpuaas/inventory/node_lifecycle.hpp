#pragma once
// A node's admin state as one pure transition function, beside the allocation lifecycle
// (services/scheduler/src/lifecycle.hpp, the house model): (admin state, event, context) -> the
// next state and what inventory does about it. Modes are the node's capacity profile (slice-vm |
// baremetal); the admin state is
//   active -> draining -> drained -> maintenance -> active,  drained -> decommissioned (final);
// a drain of a node without live claims goes straight to drained, and undrain returns a draining
// or drained node to active. A mode change and a decommission start only from drained.
// Operator requests on a state that cannot take them are FAILED_PRECONDITION
// `illegal_transition` {state, event}; reports (the last claim released, the agent's checks,
// the agent's verified binding) that change nothing in a state are no-ops, since they arrive
// whenever they happen. node_lifecycle_test walks every (state, event, context).
#include <string_view>

#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::inventory::node_lifecycle {

enum class Event {
  kDrain,              // operator: node drain (reason, deadline)
  kUndrain,            // operator: node undrain
  kLastClaimReleased,  // the node holds no live claim any more
  kEnterMaintenance,   // operator: node maintenance (from drained)
  kChecksPassed,       // the agent (re)started: discovery and the prerequisite checks pass
  kChecksFailed,       // ... and some check fails
  kChangeMode,         // operator: node mode slice-vm|baremetal (from drained)
  kModeApplied,        // the agent verified the requested driver binding from sysfs
  kModeFailed,         // the agent could not apply or verify it
  kDecommission,       // operator: node decommission (from drained)
};
inline constexpr Event kAllEvents[] = {
    Event::kDrain,        Event::kUndrain,      Event::kLastClaimReleased, Event::kEnterMaintenance,
    Event::kChecksPassed, Event::kChecksFailed, Event::kChangeMode,        Event::kModeApplied,
    Event::kModeFailed,   Event::kDecommission};
inline constexpr v1::NodeAdminState kAllStates[] = {
    v1::NODE_ADMIN_STATE_ACTIVE, v1::NODE_ADMIN_STATE_DRAINING, v1::NODE_ADMIN_STATE_DRAINED,
    v1::NODE_ADMIN_STATE_MAINTENANCE, v1::NODE_ADMIN_STATE_DECOMMISSIONED};
std::string_view EventName(Event e);

// Facts about the node the table needs besides its admin state.
struct Context {
  bool has_live_claims = false;   // some allocation still holds a slot or the whole node
  bool mode_change_open = false;  // a mode change was started and not yet applied or failed
  v1::CapacityProfile mode = v1::CAPACITY_PROFILE_SLICE_VM;       // the node's mode now
  v1::CapacityProfile target = v1::CAPACITY_PROFILE_UNSPECIFIED;  // kChangeMode: the new mode
};

struct Effects {
  v1::NodeAdminState state = v1::NODE_ADMIN_STATE_UNSPECIFIED;  // after the event
  v1::CapacityProfile mode = v1::CAPACITY_PROFILE_UNSPECIFIED;  // after the event
  // New placements may land on the node (active only): what the slots' schedulability and the
  // scheduler's index follow.
  bool placeable = false;
  // A new node generation and a node.updated event.
  bool announce = false;
  // Nothing changes (a repeated request, or a report this state does not act on).
  bool noop = false;
  bool start_mode_change = false;  // publish the desired binding for `target` to the agent
  bool mode_change_done = false;   // the open mode change is over (applied or failed)
  // After a return to slice mode every slot needs a fresh operator approval.
  bool slots_need_approval = false;
  // Decommission: slots retired, the node's NATS key revoked, its durable deleted, its desired
  // set emptied (its history stays in the streams).
  bool retire = false;
};

// The transition, or FAILED_PRECONDITION `illegal_transition` {state, event} (a mode change or
// maintenance while a mode change is open: `mode_change_in_progress`; a decommission with live
// claims, of a drained node or of a draining one still held: `node_has_live_claims`).
Result<Effects> Next(v1::NodeAdminState state, Event event, const Context& ctx);

}  // namespace gpuaas::inventory::node_lifecycle
