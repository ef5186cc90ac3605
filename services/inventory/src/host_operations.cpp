#include "host_operations.hpp"

#include <algorithm>

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

// Decommission: every slot disabled for good and the desired slot set emptied (the agent
// stops every slice it would still run).
Result<void> RetireSlots(pqxx::work& tx, const std::string& node_id, const AdminCause& cause,
                         const std::string& source) {
  auto node = LoadNode(tx, node_id, RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  auto slots = LoadSlots(tx, node_id);
  if (!slots.ok()) return slots.error();
  for (auto [key, slot] : *slots) {
    slot.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
    slot.set_disabled_reason("node decommissioned: " + cause.why);
    if (auto r = SaveSlot(tx, *node, slot, source, cause.traceparent, node_id); !r.ok()) {
      return r.error();
    }
  }
  auto desired = UpdateDesired(tx, node_id);
  if (!desired.ok()) return desired.error();
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
  out.node = WriteNodeAdmin(tx, node_id, w);
  out.changed = true;
  // Every slot snapshot carries the node's admin state, and its schedulability follows it.
  auto done = next->retire ? RetireSlots(tx, node_id, cause, source)
                           : ReemitNodeSlots(tx, node_id, source, cause.traceparent);
  if (!done.ok()) return done.error();
  v1::NodeSnapshot snap;
  *snap.mutable_node() = out.node;
  auto ev = outbox::Append(tx, {kNodeUpdated, "", source, node_id, out.node.generation(), node_id,
                                cause.traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return out;
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
