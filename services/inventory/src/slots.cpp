#include "slots.hpp"

#include <google/protobuf/util/message_differencer.h>
#include <google/protobuf/util/time_util.h>

#include <map>
#include <optional>
#include <set>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/inventory/slot_rules.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/topology.pb.h"
#include "host_operations.hpp"
#include "slot_store.hpp"

namespace gpuaas::inventory {

namespace {

using google::protobuf::util::TimeUtil;

constexpr const char* kSlotEvent = "gpuaas.v1.evt.inventory.slot.updated";
constexpr const char* kChangedInMaintenance = "topology changed during maintenance: approve again";

bool Complete(const v1::Slot& s) {
  return !s.gpu_pci_address().empty() && !s.nvme_by_id().empty() &&
         s.fabric_claim_mode() == v1::FABRIC_CLAIM_MODE_PER_SLOT_VF &&
         !s.fabric_vf_pci_address().empty() && !s.mac().empty() && !s.private_ip().empty();
}

bool Schedulable(const v1::Slot& s, const NodeCtx& c) {
  return s.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE &&
         s.health() == v1::SLOT_HEALTH_HEALTHY && Complete(s) && c.region_enabled &&
         c.blockers.empty() && c.admin_state == v1::NODE_ADMIN_STATE_ACTIVE &&
         c.mode == v1::CAPACITY_PROFILE_SLICE_VM;
}

// The slot with the topology drift of `report` when its kinds differ from what the slot
// records; ipam drift is kept as it is.
v1::Slot WithTopologyDrift(const v1::Slot& slot, const v1::TopologyReport& report) {
  v1::Slot next = slot;
  auto drift = DetectDrift(slot, report);
  if (drift.empty()) return next;
  std::set<std::string> had, now;
  for (const auto& x : slot.drift()) {
    if (!IsReportedDrift(x.kind())) had.insert(x.kind());
  }
  for (const auto& x : drift) now.insert(x.kind());
  if (had == now) return next;
  next.clear_drift();
  for (auto& x : drift) {
    *x.mutable_detected_at() = TimeUtil::GetCurrentTime();
    *next.add_drift() = x;
  }
  for (const auto& x : slot.drift()) {
    if (IsReportedDrift(x.kind())) *next.add_drift() = x;
  }
  next.set_health(v1::SLOT_HEALTH_DEGRADED);
  next.set_health_detail(DriftDetail(next));
  return next;
}

// Back from maintenance, an approved slot whose devices changed (a disk or GPU swapped, a VF
// gone) is no longer the slot an operator approved: it is taken out of service (disabled,
// approve again) and the report's candidate for it is what an operator approves, as on a new
// host. Slots that did not change come back as they were.
v1::Slot AfterMaintenance(const v1::Slot& slot, const v1::TopologyReport& report) {
  if (slot.admin_state() != v1::SLOT_ADMIN_STATE_AVAILABLE) return WithTopologyDrift(slot, report);
  const auto drift = DetectDrift(slot, report);
  if (drift.empty()) return slot;
  v1::Slot next = slot;
  std::string changes;
  for (const auto& x : drift) changes += (changes.empty() ? "" : "; ") + x.detail();
  next.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
  next.set_health(v1::SLOT_HEALTH_UNKNOWN);
  next.clear_health_detail();
  next.set_disabled_reason(std::string(kChangedInMaintenance) + ": " + changes);
  next.clear_drift();
  for (const auto& x : slot.drift()) {
    if (IsReportedDrift(x.kind())) *next.add_drift() = x;
  }
  return next;
}

// The slot with its ipam drift replaced by what `d` says (none once resolved), and its health
// following: degraded while any drift is left, healthy again (available slots) when none is.
// nullopt when (detection times aside) nothing changes.
std::optional<v1::Slot> WithIpamDrift(const v1::Slot& slot, const v1::IpamDrift& d) {
  v1::Slot next = slot;
  next.clear_drift();
  for (const auto& x : slot.drift()) {
    if (!IsIpamDrift(x.kind())) *next.add_drift() = x;
  }
  if (!d.has_resolved_at()) {
    auto* x = next.add_drift();
    x->set_slot_key(d.slot_key());
    x->set_kind(d.kind());
    x->set_detail(d.detail());
    *x->mutable_detected_at() = d.detected_at();
  }
  if (SameSlot(slot, next)) return std::nullopt;
  HealthFollowsDrift(next);
  return next;
}

}  // namespace

Result<NodeCtx> LoadNode(pqxx::work& tx, const std::string& node_id, RowLock lock) {
  auto placement = LoadNodePlacement(tx, node_id, lock);
  if (!placement) {
    return Error::Of(Code::kNotFound, reason::kNodeNotFound,
                     "inventory does not know node " + node_id, {{"node_id", node_id}});
  }
  NodeCtx c;
  c.node_id = node_id;
  c.region = placement->region;
  c.pool = placement->pool;
  c.region_enabled = placement->region_enabled;
  c.admin_state = placement->admin_state;
  c.mode = placement->mode;
  c.generation = placement->generation;
  c.mode_target = placement->mode_target;
  c.mode_change_version = placement->mode_change_version;
  if (auto latest = LoadLatestSnapshotBlockers(tx, node_id)) {
    c.snapshot_version = latest->version;
    c.blockers = std::move(latest->blockers);
  }
  return c;
}

Result<void> CheckNodeId(const std::string& id) {
  if (id.empty()) {
    return Error::InvalidArgument(reason::kInvalidNodeId, "node_id is required",
                                  {{"node_id", "required"}});
  }
  if (!ids::IsNodeId(id)) {
    return Error::InvalidArgument(reason::kInvalidNodeId, "node_id is not a valid node id: " + id,
                                  {{"node_id", "must be a lowercase DNS label"}});
  }
  return Ok();
}

bool SameSlot(v1::Slot a, v1::Slot b) {
  for (auto* s : {&a, &b}) {
    s->clear_generation();
    s->clear_updated_at();
    for (auto& d : *s->mutable_drift()) d.clear_detected_at();
  }
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

Result<v1::Slot> SaveSlot(pqxx::work& tx, const NodeCtx& c, v1::Slot slot,
                          const std::string& source, const std::string& traceparent,
                          const std::string& correlation) {
  const auto cur = LockSlotGeneration(tx, c.node_id, slot.slot_key());
  const int64_t gen = cur ? *cur + 1 : 1;
  slot.set_node_id(c.node_id);
  slot.set_generation(gen);
  *slot.mutable_updated_at() = TimeUtil::GetCurrentTime();
  const bool schedulable = Schedulable(slot, c);
  UpsertSlot(tx, slot, schedulable);
  v1::SlotSnapshot snap;
  *snap.mutable_slot() = slot;
  snap.set_region(c.region);
  snap.set_pool(c.pool);
  snap.set_region_enabled(c.region_enabled);
  for (const auto& b : c.blockers) snap.add_node_blockers(b);
  snap.set_schedulable(schedulable);
  snap.set_node_admin_state(c.admin_state);
  auto ev = outbox::Append(tx, {kSlotEvent, "", source, c.node_id + "/" + slot.slot_key(), gen,
                                correlation, traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return slot;
}

bool IsIpamDrift(const std::string& kind) {
  return kind == reason::kIpamLeaseMismatch || kind == reason::kIpamLeaseMissing ||
         kind == reason::kIpamLeaseUnexpected || kind == reason::kIpamVnicDrift;
}

bool IsReportedDrift(const std::string& kind) {
  return IsIpamDrift(kind) || kind == reason::kVfioBindingLost;
}

void HealthFollowsDrift(v1::Slot& s) {
  if (s.drift_size() > 0) {
    if (s.health() != v1::SLOT_HEALTH_FAILED) s.set_health(v1::SLOT_HEALTH_DEGRADED);
    s.set_health_detail(DriftDetail(s));
    return;
  }
  if (s.health() == v1::SLOT_HEALTH_DEGRADED) {
    s.set_health(s.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE ? v1::SLOT_HEALTH_HEALTHY
                                                                   : v1::SLOT_HEALTH_UNKNOWN);
  }
  s.clear_health_detail();
}

std::string DriftDetail(const v1::Slot& s) {
  std::string out;
  for (const auto& x : s.drift()) out += (out.empty() ? "" : "; ") + x.kind() + ": " + x.detail();
  return out;
}

const documents::Tables& DesiredTables() {
  static const documents::Tables t{"desired_slot_sets", "node_agent_acks", "desired slot set"};
  return t;
}

Result<int64_t> UpdateDesired(pqxx::work& tx, const std::string& node_id) {
  auto slots = LoadSlots(tx, node_id);
  if (!slots.ok()) return slots.error();
  const auto node = LoadNodePlacement(tx, node_id, RowLock::kNone);
  v1::DesiredSlotSet want;
  want.set_node_id(node_id);
  if (node) {
    want.set_mode(node->mode_target != v1::CAPACITY_PROFILE_UNSPECIFIED ? node->mode_target
                                                                        : node->mode);
    want.set_rebind_generation(node->rebind_generation);
  }
  const bool slice = want.mode() != v1::CAPACITY_PROFILE_BAREMETAL;
  std::set<std::string> devices;
  for (const auto& [key, s] : *slots) {
    const bool available = s.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE;
    // Slice-vm binds what it sells; baremetal gives back whatever a slot ever named.
    if (available || !slice) {
      for (const auto* pci : {&s.gpu_pci_address(), &s.fabric_vf_pci_address()}) {
        if (!pci->empty()) devices.insert(*pci);
      }
    }
    if (!available || !slice) continue;
    v1::Slot d = s;
    d.clear_health();
    d.clear_health_detail();
    d.clear_rejections();
    d.clear_drift();
    d.clear_disabled_reason();
    d.clear_generation();
    d.clear_updated_at();
    d.clear_approved_snapshot();
    *want.add_slots() = d;
  }
  for (const auto& d : devices) want.add_passthrough_devices(d);
  return documents::Publish(tx, DesiredTables(), node_id, want,
                            want.slots_size() == 0 && want.passthrough_devices_size() == 0 &&
                                want.mode() != v1::CAPACITY_PROFILE_BAREMETAL);
}

Result<void> ReemitNodeSlots(pqxx::work& tx, const std::string& node_id, const std::string& source,
                             const std::string& traceparent) {
  // The node's row first, then its slots: the order of every slot change (the availability
  // trigger locks the node's row too, so the other order could deadlock with them).
  auto node = LoadNode(tx, node_id, RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  auto slots = LoadSlots(tx, node_id);
  if (!slots.ok()) return slots.error();
  for (const auto& [key, s] : *slots) {
    if (auto r = SaveSlot(tx, *node, s, source, traceparent, ""); !r.ok()) return r.error();
  }
  return Ok();
}

Result<void> ApplyTopologyEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source) {
  v1::TopologyReport report;
  if (!ev.data().UnpackTo(&report)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.TopologyReport");
  }
  if (!ids::IsNodeId(report.node_id())) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "topology report without a valid node_id");
  }
  auto before = LoadNode(tx, report.node_id(), RowLock::kForUpdate);
  if (!before.ok()) return before.error();  // unknown node: not retryable, dead-lettered
  // A report that arrives after a newer one (redelivery, a slow task) is history, not news.
  if (report.has_discovered_at() &&
      HasSnapshotDiscoveredAfter(tx, report.node_id(),
                                 TimeUtil::ToString(report.discovered_at()))) {
    return Ok();
  }
  const int64_t version = before->snapshot_version + 1;
  InsertSnapshot(tx, report.node_id(), version, ev.id(), report);
  NodeCtx after = *before;  // what every slot snapshot carries, as of this report
  after.snapshot_version = version;
  after.blockers.assign(report.node_blockers().begin(), report.node_blockers().end());
  const bool blockers_changed = before->blockers != after.blockers;
  auto slots = LoadSlots(tx, report.node_id());
  if (!slots.ok()) return slots.error();
  const bool maintenance = before->admin_state == v1::NODE_ADMIN_STATE_MAINTENANCE;
  bool taken_out = false;
  for (const auto& [key, slot] : *slots) {
    const v1::Slot next =
        maintenance ? AfterMaintenance(slot, report) : WithTopologyDrift(slot, report);
    taken_out = taken_out || next.admin_state() != slot.admin_state();
    if (blockers_changed || !SameSlot(slot, next)) {
      if (auto r = SaveSlot(tx, after, next, source, "", ev.correlation_id()); !r.ok()) {
        return r.error();
      }
    }
  }
  if (!maintenance) return Ok();
  if (taken_out) {
    if (auto r = UpdateDesired(tx, report.node_id()); !r.ok()) return r.error();
  }
  // Back from maintenance: the agent's discovery after the host's return is the check.
  return ApplyMaintenanceChecks(tx, report.node_id(), after.blockers.empty(), source);
}

Result<void> ApplyTaskEvent(pqxx::work& tx, const v1::Event& ev) {
  // Progress of long tasks (gpuaas.v1.evt.node.<id>.task.progress) is the scheduler's business.
  if (ev.data().Is<v1::NodeTaskProgress>()) return Ok();
  v1::NodeTaskResult res;
  if (!ev.data().UnpackTo(&res)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.NodeTaskResult");
  }
  if (!ids::IsUuid(res.task_id())) {
    return Error::InvalidArgument(reason::kMalformedEvent, "task result without a task id");
  }
  // A result without a final status (none, queued, or one this inventory does not know) is
  // recorded as failed.
  std::string status = enums::Text(res.status());
  if (status.empty() || res.status() == v1::TASK_STATUS_QUEUED) {
    status = enums::Text(v1::TASK_STATUS_FAILED);
  }
  const std::string error =
      res.has_error() ? res.error().reason() + ": " + res.error().message() : std::string();
  if (!FinishTask(tx, res.task_id(), status, error)) {
    // A task this inventory did not queue (sent by another tool): recorded when the node is known.
    InsertFinishedTaskOfKnownNode(tx, res.task_id(), res.node_id(), enums::Text(res.type()), status,
                                  error);
  }
  return Ok();
}

Result<void> ApplyIpamDriftEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source) {
  v1::IpamDriftSnapshot snap;
  if (!ev.data().UnpackTo(&snap)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.IpamDriftSnapshot");
  }
  const auto& d = snap.drift();
  if (!ids::IsNodeId(d.node_id()) || !IsIpamDrift(d.kind())) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "ipam drift without a node id or ipam kind");
  }
  if (d.slot_key().empty()) return Ok();  // a lease no slot owns: ipam's node-level evidence
  const auto seen = LockIpamDriftMark(tx, d.node_id(), d.slot_key());
  if (seen && *seen >= d.generation()) return Ok();  // older news
  auto node = LoadNode(tx, d.node_id(), RowLock::kForUpdate);
  if (!node.ok()) return Ok();  // a node inventory does not know has no slots to mark
  SaveIpamDriftMark(tx, d.node_id(), d.slot_key(), d.generation());
  auto slots = LoadSlots(tx, d.node_id());
  if (!slots.ok()) return slots.error();
  auto it = slots->find(d.slot_key());
  if (it == slots->end()) return Ok();
  const auto next = WithIpamDrift(it->second, d);
  if (!next) return Ok();  // (detection times aside) nothing changed
  auto saved = SaveSlot(tx, *node, *next, source, "", d.allocation_id());
  if (!saved.ok()) return saved.error();
  return Ok();
}

}  // namespace gpuaas::inventory
