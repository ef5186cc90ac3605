// ipam's consumers: allocation events bind/unbind reservations; node-agent lease reports become
// observations and drift; inventory's node and slot events become the projection requests and
// orphan judgement are checked against. All run inside inbox::ProjectionHandler's transaction, so a
// redelivered event is a no-op, and both order by the entity's own clock (allocation
// generation, report observed_at) because the inbox does not order anything.
#include <google/protobuf/util/time_util.h>

#include <algorithm>

#include <fmt/format.h>

#include "gpuaas/common/allocation_event.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "ipam_store.hpp"

namespace gpuaas::ipam {

namespace {

using google::protobuf::util::TimeUtil;

// Unbinds every reservation of the allocation on `node_id` not in `keep`; resolves their drift.
Result<int> Unbind(pqxx::work& tx, const std::string& node_id, const std::string& allocation_id,
                   const std::vector<std::string>& keep, const std::string& why,
                   const std::string& source) {
  const auto keys = UnbindReservations(tx, node_id, allocation_id, keep);
  for (const auto& key : keys) {
    auto res = FindReservation(tx, node_id, key);
    if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.updated", *res,
                                     reason::kUnbound.str(), source, "");
        !a.ok()) {
      return a.error();
    }
    if (auto d = ResolveDrift(tx, node_id, key, why, source); !d.ok()) return d.error();
  }
  return static_cast<int>(keys.size());
}

}  // namespace

Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const IpamConfig& cfg,
                                  const std::string& source) {
  auto read = inbox::ReadAllocationEvent(ev);
  if (!read.ok()) return read.error();
  const auto& a = read->allocation();
  const int64_t generation = read->generation;
  auto prev = LockAllocationBinding(tx, a.allocation_id());
  if (prev && *prev >= generation) return Ok();  // older news
  std::vector<std::string> keys(a.slot_keys().begin(), a.slot_keys().end());
  std::sort(keys.begin(), keys.end());
  UpsertAllocationBinding(tx, a.allocation_id(), a.node_id(), enums::Text(a.state()), generation,
                          keys);

  const bool bind =
      a.state() == v1::ALLOCATION_STATE_PROVISIONING || a.state() == v1::ALLOCATION_STATE_ACTIVE;
  // slot_keys lists live claims only: a failed allocation without them has had its claims
  // freed (cleanup proof or force-release).
  const bool unbind = a.state() == v1::ALLOCATION_STATE_RELEASED ||
                      (a.state() == v1::ALLOCATION_STATE_FAILED && keys.empty());
  if (bind && ids::IsNodeId(a.node_id())) {
    if (!LockNode(tx, a.node_id())) return Ok();  // nothing reserved on that node
    const auto bound = BindReservations(tx, a.node_id(), keys, a.allocation_id());
    for (const auto& key : bound) {
      auto res = FindReservation(tx, a.node_id(), key);
      if (auto x = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.updated", *res,
                                       reason::kBound.str(), source, "");
          !x.ok()) {
        return x.error();
      }
    }
    // A claim the allocation no longer holds is no longer bound to it.
    auto gone = Unbind(tx, a.node_id(), a.allocation_id(), keys, "claim freed", source);
    if (!gone.ok()) return gone.error();
    if (!bound.empty() || *gone > 0) {
      if (auto d = UpdateDocument(tx, a.node_id(), cfg); !d.ok()) return d.error();
    }
    return Ok();
  }
  if (unbind) {
    for (const auto& node : ListNodesOfAllocation(tx, a.allocation_id())) {
      LockNode(tx, node);
      auto n =
          Unbind(tx, node, a.allocation_id(), {}, "allocation " + enums::Text(a.state()), source);
      if (!n.ok()) return n.error();
      if (auto d = UpdateDocument(tx, node, cfg); !d.ok()) return d.error();
    }
  }
  return Ok();
}

Result<void> ApplyInventoryNodeEvent(pqxx::work& tx, const v1::Event& ev, const IpamConfig& cfg) {
  v1::NodeSnapshot snap;
  if (!ev.data().UnpackTo(&snap)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.NodeSnapshot");
  }
  if (!ids::IsNodeId(snap.node().node_id())) {
    return Error::InvalidArgument(reason::kMalformedEvent, "node event without a valid node id");
  }
  const auto& n = snap.node();
  const int64_t generation = ev.generation() > 0 ? ev.generation() : n.generation();
  const v1::CapacityProfile mode =
      n.mode_target() != v1::CAPACITY_PROFILE_UNSPECIFIED ? n.mode_target() : n.capacity_profile();
  const bool removed = mode == v1::CAPACITY_PROFILE_BAREMETAL;
  // The node's network follows its mode: a new document version when that changed (none for a
  // node ipam never reserved on).
  if (!UpsertInventoryNode(tx, n.node_id(), generation, removed)) return Ok();
  if (auto d = UpdateDocument(tx, n.node_id(), cfg); !d.ok()) return d.error();
  return Ok();
}

Result<void> ApplyInventorySlotEvent(pqxx::work& tx, const v1::Event& ev) {
  v1::SlotSnapshot snap;
  if (!ev.data().UnpackTo(&snap)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.SlotSnapshot");
  }
  const auto& s = snap.slot();
  if (!ids::IsNodeId(s.node_id()) || s.slot_key().empty()) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "slot event without a node id or slot key");
  }
  const int64_t generation = ev.generation() > 0 ? ev.generation() : s.generation();
  UpsertInventorySlot(tx, s.node_id(), s.slot_key(), generation);
  return Ok();
}

Result<void> ApplyLeaseEvent(pqxx::work& tx, const v1::Event& ev, const IpamConfig& cfg,
                             const std::string& source) {
  v1::LeaseReport report;
  if (!ev.data().UnpackTo(&report)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.LeaseReport");
  }
  if (auto v = ValidateLeaseReport(report); !v.ok()) return v.error();
  const int64_t observed_ms = report.has_observed_at()
                                  ? TimeUtil::TimestampToMilliseconds(report.observed_at())
                                  : TimeUtil::TimestampToMilliseconds(ev.time());
  if (!LockNode(tx, report.node_id())) return Ok();  // ipam reserved nothing there
  auto prev = LoadLeaseReportTime(tx, report.node_id());
  if (prev && *prev > observed_ms) return Ok();  // older news
  std::vector<std::string> blockers(report.blockers().begin(), report.blockers().end());
  UpsertLeaseReport(tx, report.node_id(), report.document_version(), blockers, observed_ms,
                    ev.id());
  const auto slots = LoadReservedSlots(tx, report.node_id());
  const auto judged = JudgeLeases(slots, report, observed_ms, cfg.lease_readiness_timeout_ms);
  ReplaceLeaseObservations(tx, report.node_id(), judged.leases);
  for (const auto& [subject, finding] : judged.drift) {
    if (auto r = RecordDrift(tx, report.node_id(), finding, report.document_version(), source);
        !r.ok()) {
      return r.error();
    }
  }
  for (const auto& subject : ListOpenDriftSubjects(tx, report.node_id())) {
    if (judged.drift.count(subject)) continue;
    if (auto x = ResolveDrift(
            tx, report.node_id(), subject,
            fmt::format("clean lease report of document {}", report.document_version()), source);
        !x.ok()) {
      return x.error();
    }
  }
  return Ok();
}

}  // namespace gpuaas::ipam
