#include "host_operations.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>
#include <set>
#include <string_view>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "node_store.hpp"
#include "slot_store.hpp"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

constexpr const char* kNodeUpdated = "gpuaas.v1.evt.inventory.node.updated";

// Every slot of the node disabled with `why` (decommission: for good; back in slice-vm mode: until
// an operator approves it again), and the desired slot set following.
Result<void> DisableSlots(pqxx::work& tx, const std::string& node_id, const std::string& why,
                          const AdminCause& cause, const std::string& source) {
  auto node = LoadNode(tx, node_id, RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  auto slots = LoadSlots(tx, node_id);
  if (!slots.ok()) return slots.error();
  for (auto [key, slot] : *slots) {
    slot.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
    slot.set_health(v1::SLOT_HEALTH_UNKNOWN);
    slot.set_disabled_reason(why);
    if (auto r = SaveSlot(tx, *node, slot, source, cause.traceparent, node_id); !r.ok()) {
      return r.error();
    }
  }
  auto desired = UpdateDesired(tx, node_id);
  if (!desired.ok()) return desired.error();
  return Ok();
}

// A mode change opened (the desired slot set of the target mode for the agent) or closed (the
// node in its new mode, or its old one with the agent's blockers).
Result<void> ModeEffects(pqxx::work& tx, const std::string& node_id,
                         const node_lifecycle::Effects& fx, const node_lifecycle::Context& ctx,
                         const AdminCause& cause) {
  if (fx.start_mode_change) {
    OpenModeChange(tx, node_id, ctx.target);
    auto version = UpdateDesired(tx, node_id);
    if (!version.ok()) return version.error();
    SetModeChangeVersion(tx, node_id, *version);
  }
  if (fx.mode_change_done) CloseModeChange(tx, node_id, fx.mode, cause.blockers);
  return Ok();
}

// The node's slots after a move, each written once: disabled (decommission; back in slice-vm
// mode, until approved again) or re-announced with the node's new state; the desired set follows
// a closed mode change (a failed one: back to the old mode).
Result<void> SlotEffects(pqxx::work& tx, const std::string& node_id,
                         const node_lifecycle::Effects& fx, const AdminCause& cause,
                         const std::string& source) {
  if (fx.retire) {
    return DisableSlots(tx, node_id, "node decommissioned: " + cause.why, cause, source);
  }
  if (fx.slots_need_approval) {
    return DisableSlots(tx, node_id, "mode changed to slice-vm: approve again", cause, source);
  }
  if (auto r = ReemitNodeSlots(tx, node_id, source, cause.traceparent); !r.ok()) return r;
  if (fx.mode_change_done) {
    auto version = UpdateDesired(tx, node_id);
    if (!version.ok()) return version.error();
  }
  return Ok();
}

}  // namespace

Result<AdminMove> MoveNode(pqxx::work& tx, const std::string& node_id, node_lifecycle::Event e,
                           const AdminCause& cause, const std::string& source) {
  // The node's row first: every slot change takes it in this order (slots.hpp).
  auto node = LoadNode(tx, node_id, RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  node_lifecycle::Context ctx;
  // Inventory does not know claims (the scheduler does): a drain always goes to draining, and
  // the scheduler's node.emptied takes the node on to drained, at once when it holds none.
  ctx.has_live_claims = cause.has_live_claims;
  ctx.mode = node->mode;
  ctx.mode_change_open = node->mode_target != v1::CAPACITY_PROFILE_UNSPECIFIED;
  ctx.target = ctx.mode_change_open ? node->mode_target : cause.target;
  auto next = node_lifecycle::Next(node->admin_state, e, ctx);
  if (!next.ok()) return next.error();
  AdminMove out;
  // A report about an older generation (an earlier drain's, redelivered) changes nothing.
  if (next->noop || (cause.seen_generation > 0 && node->generation > cause.seen_generation)) {
    out.node = ReadNode(tx, node_id);
    return out;
  }
  NodeAdminWrite w;
  w.state = next->state;
  w.reason = cause.why;
  w.actor = cause.actor;
  w.deadline_s = e == node_lifecycle::Event::kDrain ? cause.deadline_s : 0;
  WriteNodeAdmin(tx, node_id, w);
  out.changed = true;
  if (auto r = ModeEffects(tx, node_id, *next, ctx, cause); !r.ok()) return r.error();
  // Every slot snapshot carries the node's admin state, and its schedulability follows it.
  if (auto r = SlotEffects(tx, node_id, *next, cause, source); !r.ok()) return r.error();
  out.node = ReadNode(tx, node_id);
  v1::NodeSnapshot snap;
  *snap.mutable_node() = out.node;
  auto ev = outbox::Append(tx, {kNodeUpdated, "", source, node_id, out.node.generation(), node_id,
                                cause.traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return out;
}

namespace {

constexpr std::string_view kBindingLost = "vfio_binding_lost_";

// "0000:18:00.0" as a blocker names it ("0000_18_00_0").
std::string BlockerToken(const std::string& pci) {
  std::string out = pci;
  for (char& ch : out) {
    if (ch == ':' || ch == '.') ch = '_';
  }
  return out;
}

// The slot with vfio_binding_lost set (its GPU or VF named in `lost`) or cleared, and its health
// following; nullopt when nothing changes.
std::optional<v1::Slot> WithBindingDrift(const v1::Slot& slot, const std::set<std::string>& lost) {
  std::string named;
  for (const auto* pci : {&slot.gpu_pci_address(), &slot.fabric_vf_pci_address()}) {
    if (!pci->empty() && lost.count(BlockerToken(*pci))) {
      named += (named.empty() ? "" : ", ") + *pci;
    }
  }
  bool had = false;
  v1::Slot next = slot;
  next.clear_drift();
  for (const auto& d : slot.drift()) {
    if (d.kind() == reason::kVfioBindingLost) {
      had = true;
      if (!named.empty()) *next.add_drift() = d;  // still lost: as first detected
    } else {
      *next.add_drift() = d;
    }
  }
  if (had == !named.empty()) return std::nullopt;
  if (!named.empty()) {
    auto* d = next.add_drift();
    d->set_slot_key(slot.slot_key());
    d->set_kind(reason::kVfioBindingLost.str());
    d->set_detail(named + " not bound to vfio-pci (the agent's check)");
    *d->mutable_detected_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
  }
  HealthFollowsDrift(next);
  return next;
}

Result<void> ApplyBindingDrift(pqxx::work& tx, const NodeCtx& node,
                               const std::vector<std::string>& blockers,
                               const std::string& source) {
  std::set<std::string> lost;
  for (const auto& b : blockers) {
    if (b.rfind(kBindingLost, 0) == 0) lost.insert(b.substr(kBindingLost.size()));
  }
  auto slots = LoadSlots(tx, node.node_id);
  if (!slots.ok()) return slots.error();
  for (const auto& [key, slot] : *slots) {
    if (auto next = WithBindingDrift(slot, lost)) {
      if (auto r = SaveSlot(tx, node, *next, source, "", node.node_id); !r.ok()) return r.error();
    }
  }
  return Ok();
}

}  // namespace

Result<void> ApplyDesiredAck(pqxx::work& tx, const std::string& node_id, int64_t version,
                             const std::vector<std::string>& blockers, const std::string& source) {
  auto node = LoadNode(tx, node_id, RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  if (node->mode_target != v1::CAPACITY_PROFILE_UNSPECIFIED) {
    // Only the ack of the version that carries the change (or a later one) decides it.
    if (node->mode_change_version == 0 || version < node->mode_change_version) return Ok();
    AdminCause cause;
    cause.actor = source;
    cause.blockers = blockers;
    cause.why = blockers.empty()
                    ? "the agent verified the binding of mode " + enums::Text(node->mode_target)
                    : "the agent could not apply mode " + enums::Text(node->mode_target) + ": " +
                          fmt::format("{}", fmt::join(blockers, ", "));
    auto moved = MoveNode(
        tx, node_id,
        blockers.empty() ? node_lifecycle::Event::kModeApplied : node_lifecycle::Event::kModeFailed,
        cause, source);
    if (!moved.ok()) return moved.error();
    return Ok();
  }
  if (node->mode != v1::CAPACITY_PROFILE_SLICE_VM) return Ok();
  return ApplyBindingDrift(tx, *node, blockers, source);
}

Result<void> ApplyNodeEmptiedEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source) {
  v1::NodeEmptied emptied;
  if (!ev.data().UnpackTo(&emptied) || !ids::IsNodeId(emptied.node_id())) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.NodeEmptied with a node id");
  }
  AdminCause cause;
  cause.why = "the last live allocation on the node was released";
  cause.actor = source;
  // The scheduler reports each draining generation it sees empty; only the current one counts.
  cause.seen_generation = std::max<int64_t>(emptied.generation(), 1);
  auto moved =
      MoveNode(tx, emptied.node_id(), node_lifecycle::Event::kLastClaimReleased, cause, source);
  if (!moved.ok() && moved.error().code == Code::kNotFound) return Ok();  // not ours to know
  if (!moved.ok()) return moved.error();
  return Ok();
}

Result<void> ApplyMaintenanceChecks(pqxx::work& tx, const std::string& node_id, bool passed,
                                    const std::string& source) {
  AdminCause cause;
  cause.why = passed ? "back from maintenance: discovery and prerequisite checks passed"
                     : "discovery reported node blockers";
  cause.actor = source;
  auto moved =
      MoveNode(tx, node_id,
               passed ? node_lifecycle::Event::kChecksPassed : node_lifecycle::Event::kChecksFailed,
               cause, source);
  if (!moved.ok()) return moved.error();
  return Ok();
}

}  // namespace gpuaas::inventory
