#include "approval.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/inventory/slot_rules.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/topology.pb.h"
#include "slot_store.hpp"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

// The MAC/IP ipam reserved (or failed to) for each candidate that passed the local rules.
using Reservations = std::map<std::string, Result<v1::ReserveSlotAddressResponse>>;

Result<void> CheckApproveRequest(const v1::ApproveSlotsRequest& req) {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  if (req.snapshot_version() < 0) {
    return Error::InvalidArgument(reason::kInvalidSnapshotVersion, "snapshot_version must be >= 0",
                                  {{"snapshot_version", "must be >= 0 (0 = latest)"}});
  }
  return Ok();
}

Error NoSuchSnapshot(const v1::ApproveSlotsRequest& req) {
  if (req.snapshot_version() != 0) {
    return Error::Of(Code::kNotFound, reason::kSnapshotNotFound,
                     fmt::format("node {} has no topology snapshot version {}", req.node_id(),
                                 req.snapshot_version()),
                     {{"snapshot_version", std::to_string(req.snapshot_version())}});
  }
  return Error::FailedPrecondition(
      reason::kNoTopologySnapshot,
      "node " + req.node_id() + " has not reported its topology yet; run node discover");
}

bool Requested(const v1::ApproveSlotsRequest& req, const std::string& key) {
  return req.slot_keys().empty() ||
         std::find(req.slot_keys().begin(), req.slot_keys().end(), key) != req.slot_keys().end();
}

// The slot a candidate becomes (before addresses).
v1::Slot SlotFromCandidate(const v1::CandidateSlot& c, const v1::TopologyReport& report,
                           int64_t snapshot_version) {
  v1::Slot s;
  s.set_slot_key(c.slot_key());
  s.set_index(c.index());
  s.set_gpu_pci_address(c.gpu_pci_address());
  for (const auto& g : report.gpus()) {
    if (g.pci_address() == c.gpu_pci_address()) {
      s.set_gpu_model(g.model());
      s.set_sku(SkuForDevice(g.device_id()));
    }
  }
  if (s.sku().empty()) s.set_sku(SkuForDevice(""));
  if (c.has_numa_node()) s.set_numa_node(c.numa_node());
  s.set_pcie_switch(c.pcie_switch());
  s.set_locality_group(c.locality_group());
  s.set_nvme_by_id(c.nvme_by_id());
  s.set_fabric_claim_mode(c.fabric_claim_mode());
  s.set_fabric_vf_pci_address(c.fabric_vf_pci_address());
  s.set_fabric_type(c.fabric_type());
  *s.mutable_profile() = c.profile();
  s.set_approved_snapshot(snapshot_version);
  return s;
}

// Holders a candidate must not collide with: available slots of other keys.
std::vector<v1::Slot> Holders(const std::map<std::string, v1::Slot>& slots) {
  std::vector<v1::Slot> out;
  for (const auto& [k, s] : slots) {
    if (s.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE) out.push_back(s);
  }
  return out;
}

v1::SlotRejection Rejection(Reason why, const std::string& message) {
  v1::SlotRejection r;
  r.set_reason(why.str());
  r.set_message(message);
  return r;
}

// ---- Phase 1: what would pass the local rules now ----

struct Precheck {
  NodeCtx node;
  std::map<std::string, bool> passes;  // by slot key, the requested candidates
};

// Each requested candidate against the rules, the ones passing before it counted as holders.
std::map<std::string, bool> PassingCandidates(const v1::ApproveSlotsRequest& req,
                                              const v1::TopologyReport& report,
                                              const std::map<std::string, v1::Slot>& slots,
                                              std::set<std::string> wiped) {
  std::map<std::string, bool> passes;
  ApprovalContext actx;
  actx.report = &report;
  actx.wiped_nvme = std::move(wiped);
  auto holders = Holders(slots);
  for (const auto& c : report.candidates()) {
    if (!Requested(req, c.slot_key())) continue;
    actx.holders = holders;
    const bool ok = ValidateCandidate(c, actx).empty();
    passes[c.slot_key()] = ok;
    if (ok) holders.push_back(SlotFromCandidate(c, report, 0));
  }
  return passes;
}

Result<Precheck> PrecheckCandidates(const ApprovalDeps& d, const v1::ApproveSlotsRequest& req) {
  return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<Precheck> {
    auto node = LoadNode(tx, req.node_id(), RowLock::kNone);
    if (!node.ok()) return node.error();
    auto snap = LoadSnapshot(tx, req.node_id(), req.snapshot_version());
    if (!snap.ok()) return snap.error();
    if (!snap->has_value()) return NoSuchSnapshot(req);
    auto slots = LoadSlots(tx, req.node_id());
    if (!slots.ok()) return slots.error();
    Precheck out;
    out.node = *node;
    out.passes = PassingCandidates(req, (*snap)->report, *slots, WipedDisks(tx, req.node_id()));
    return out;
  });
}

// ---- Phase 2: addresses for the candidates that pass (ipam is idempotent per slot) ----

// Reserves MAC/IP for a slot from ipam (idempotent on ipam's side). The node's region and pool
// choose its subnet rule in ipam.
Result<v1::ReserveSlotAddressResponse> Reserve(const ApprovalDeps& d, const NodeCtx& node,
                                               const std::string& slot_key,
                                               const std::string& traceparent) {
  v1::ReserveSlotAddressRequest req;
  req.set_node_id(node.node_id);
  req.set_slot_key(slot_key);
  req.set_region(node.region);
  req.set_pool(node.pool);
  return rpc::Client(d.nats).Call<v1::ReserveSlotAddressResponse>(
      "gpuaas.v1.ipam.reservation.reserve", req, std::chrono::milliseconds(d.ipam_timeout_ms),
      traceparent);
}

Reservations ReserveAddresses(const ApprovalDeps& d, const Precheck& pre,
                              const std::string& traceparent) {
  Reservations addresses;
  for (const auto& [key, ok] : pre.passes) {
    if (ok) addresses.emplace(key, Reserve(d, pre.node, key, traceparent));
  }
  return addresses;
}

// ---- Phase 3: validate again under the node lock, write slots, events and the desired set ----

// What phase 3 decides every candidate against, in its transaction.
struct FinalCheck {
  pqxx::work& tx;
  const ApprovalDeps& deps;
  const NodeCtx& node;
  const Snapshot& snapshot;
  const Reservations& addresses;
  ApprovalMode mode;
  const std::string& traceparent;
  ApprovalContext actx;
  std::map<std::string, v1::Slot> slots;  // the node's slots, with this batch's writes
};

// A result with `not_in_snapshot` for each requested key the snapshot has no candidate for;
// returns the requested keys.
std::set<std::string> RejectKeysNotInSnapshot(const v1::ApproveSlotsRequest& req,
                                              const Snapshot& snap,
                                              v1::ApproveSlotsResponse& resp) {
  const auto& candidates = snap.report.candidates();
  std::set<std::string> seen;
  for (const auto& key : req.slot_keys()) {
    if (seen.insert(key).second &&
        std::none_of(candidates.begin(), candidates.end(),
                     [&](const v1::CandidateSlot& c) { return c.slot_key() == key; })) {
      auto* res = resp.add_results();
      res->set_slot_key(key);
      *res->add_rejections() =
          Rejection(reason::kNotInSnapshot,
                    fmt::format("snapshot {} has no candidate {}", snap.version, key));
    }
  }
  return seen;
}

// The rules again, then the address ipam reserved in phase 2 onto `slot`.
std::vector<v1::SlotRejection> FinalRejections(FinalCheck& f, const v1::CandidateSlot& c,
                                               v1::Slot& slot) {
  // The holders: available slots of other keys as they are now (including this batch).
  std::map<std::string, v1::Slot> others = f.slots;
  others.erase(c.slot_key());
  f.actx.holders = Holders(others);
  auto rejections = ValidateCandidate(c, f.actx);
  if (!rejections.empty()) return rejections;
  auto it = f.addresses.find(c.slot_key());
  if (it == f.addresses.end()) {
    rejections.push_back(Rejection(reason::kAddressReservationFailed,
                                   "the candidate changed while it was being approved; "
                                   "approve it again"));
  } else if (!it->second.ok()) {
    rejections.push_back(
        Rejection(reason::kAddressReservationFailed,
                  "ipam could not reserve a MAC/IP: " + it->second.error().ToString()));
  } else {
    slot.set_mac(it->second->reservation().mac());
    slot.set_private_ip(it->second->reservation().ip());
  }
  return rejections;
}

// The disabled_reason of a slot a failed approval disabled, after its first rejection.
std::string RejectedDisabledReason(const v1::SlotRejection& first) {
  return "approval rejected: " + first.reason();
}

// Whether a disabled slot's reason is an operator's rather than the one a failed approval wrote
// (approval writes it from the slot's own first rejection; disable keeps the rejections).
bool DisabledByOperator(const v1::Slot& s) {
  if (s.admin_state() != v1::SLOT_ADMIN_STATE_DISABLED || s.disabled_reason().empty()) {
    return false;
  }
  return s.rejections().empty() || s.disabled_reason() != RejectedDisabledReason(s.rejections(0));
}

// Incomplete or unsafe: recorded, but disabled (an operator's reason for an earlier disable
// is kept).
void MarkRejected(v1::Slot& slot, const std::vector<v1::SlotRejection>& rejections,
                  const v1::Slot* existing) {
  slot.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
  slot.set_health(v1::SLOT_HEALTH_UNKNOWN);
  slot.set_disabled_reason(RejectedDisabledReason(rejections.front()));
  for (const auto& r : rejections) *slot.add_rejections() = r;
  if (existing == nullptr) return;
  *slot.mutable_drift() = existing->drift();
  if (DisabledByOperator(*existing)) slot.set_disabled_reason(existing->disabled_reason());
}

void MarkApproved(v1::Slot& slot, const v1::Slot* existing, ApprovalMode mode) {
  slot.set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
  slot.set_health(v1::SLOT_HEALTH_HEALTHY);
  if (existing == nullptr) return;
  const bool repair = mode == ApprovalMode::kRepair;
  // Approval does not clear drift; repair re-validates the topology evidence and clears
  // its drift, but IPAM drift clears only with a clean lease report.
  for (const auto& dr : existing->drift()) {
    if (!repair || IsReportedDrift(dr.kind())) *slot.add_drift() = dr;
  }
  if (slot.drift_size() > 0) {
    slot.set_health(v1::SLOT_HEALTH_DEGRADED);
    slot.set_health_detail(repair ? DriftDetail(slot) : existing->health_detail());
  }
}

// One candidate checked, turned into its slot and written unless nothing changed.
Result<void> DecideCandidate(FinalCheck& f, const v1::CandidateSlot& c, v1::SlotApproval& res) {
  v1::Slot slot = SlotFromCandidate(c, f.snapshot.report, f.snapshot.version);
  slot.set_node_id(f.node.node_id);
  const auto rejections = FinalRejections(f, c, slot);
  res.set_slot_key(c.slot_key());
  const auto found = f.slots.find(c.slot_key());
  const v1::Slot* existing = found == f.slots.end() ? nullptr : &found->second;
  if (!rejections.empty()) {
    for (const auto& r : rejections) *res.add_rejections() = r;
    if (existing != nullptr && existing->admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE) {
      // An approved slot is never demoted by a failed re-approval; drift and disable do that.
      *res.mutable_slot() = *existing;
      return Ok();
    }
    MarkRejected(slot, rejections, existing);
  } else {
    MarkApproved(slot, existing, f.mode);
    res.set_approved(true);
  }
  if (existing != nullptr && SameSlot(*existing, slot)) {
    *res.mutable_slot() = *existing;
    return Ok();
  }
  auto saved = SaveSlot(f.tx, f.node, slot, f.deps.source, f.traceparent, "");
  if (!saved.ok()) return saved.error();
  f.slots[c.slot_key()] = *saved;
  *res.mutable_slot() = *saved;
  return Ok();
}

Result<v1::ApproveSlotsResponse> WriteApproval(pqxx::work& tx, const ApprovalDeps& d,
                                               const v1::ApproveSlotsRequest& req,
                                               const Reservations& addresses, rpc::Context& ctx,
                                               ApprovalMode mode) {
  auto node = LoadNode(tx, req.node_id(), RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  auto snap = LoadSnapshot(tx, req.node_id(), req.snapshot_version());
  if (!snap.ok()) return snap.error();
  if (!snap->has_value()) {
    return Error::FailedPrecondition(reason::kNoTopologySnapshot, "topology snapshot disappeared");
  }
  const Snapshot& snapshot = **snap;
  auto slots = LoadSlots(tx, req.node_id());
  if (!slots.ok()) return slots.error();
  FinalCheck f{tx, d, *node, snapshot, addresses, mode, ctx.traceparent, {}, std::move(*slots)};
  f.actx.report = &snapshot.report;
  f.actx.wiped_nvme = WipedDisks(tx, req.node_id());
  v1::ApproveSlotsResponse resp;
  resp.set_snapshot_version(snapshot.version);
  const auto requested = RejectKeysNotInSnapshot(req, snapshot, resp);
  for (const auto& c : snapshot.report.candidates()) {
    if (!req.slot_keys().empty() && !requested.count(c.slot_key())) continue;
    if (auto r = DecideCandidate(f, c, *resp.add_results()); !r.ok()) return r.error();
  }
  auto desired = UpdateDesired(tx, req.node_id());
  if (!desired.ok()) return desired.error();
  resp.set_desired_version(*desired);
  ctx.log.Info(mode == ApprovalMode::kRepair ? "slots repaired" : "slots approved",
               {{"node_id", req.node_id()},
                {"snapshot_version", std::to_string(snapshot.version)},
                {"desired_version", std::to_string(*desired)}});
  return resp;
}

// Gives back reservations this approval made (or found) for slots that did not end up
// approved with them, so a rejected approval leaves no orphaned MAC/IP in ipam. Best effort: a
// failure is logged and the reservation stays until the next approval of the slot.
void ReleaseUnapproved(const ApprovalDeps& d, const std::string& node_id,
                       const Reservations& reserved,
                       const Result<v1::ApproveSlotsResponse>& outcome, rpc::Context& ctx) {
  for (const auto& [key, r] : reserved) {
    if (!r.ok()) continue;
    bool kept = false;
    if (outcome.ok()) {
      for (const auto& res : outcome->results()) {
        kept = kept || (res.slot_key() == key &&
                        res.slot().admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE &&
                        res.slot().mac() == r->reservation().mac());
      }
    } else {
      // Nothing was written: only what this call created is surely nobody's.
      kept = !r->created();
    }
    if (kept) continue;
    v1::ReleaseSlotAddressRequest req;
    req.set_node_id(node_id);
    req.set_slot_key(key);
    req.set_reason(reason::kApprovalRejected.str());
    auto rel = rpc::Client(d.nats).Call<v1::ReleaseSlotAddressResponse>(
        "gpuaas.v1.ipam.reservation.release", req, std::chrono::milliseconds(d.ipam_timeout_ms),
        ctx.traceparent);
    if (!rel.ok()) {
      ctx.log.Warn("reservation of a rejected slot not released",
                   {{"node_id", node_id}, {"slot_key", key}, {"error", rel.error().ToString()}});
    } else if (rel->released()) {
      ctx.log.Info("reservation of a rejected slot released",
                   {{"node_id", node_id}, {"slot_key", key}, {"ip", rel->reservation().ip()}});
    }
  }
}

}  // namespace

Result<v1::ApproveSlotsResponse> ApproveCandidates(const ApprovalDeps& d,
                                                   const v1::ApproveSlotsRequest& req,
                                                   rpc::Context& ctx, ApprovalMode mode) {
  if (auto v = CheckApproveRequest(req); !v.ok()) return v.error();
  auto pre = PrecheckCandidates(d, req);
  if (!pre.ok()) return pre.error();
  const Reservations addresses = ReserveAddresses(d, *pre, ctx.traceparent);
  auto outcome = store::WithTx(
      *d.pool, [&](pqxx::work& tx) { return WriteApproval(tx, d, req, addresses, ctx, mode); });
  ReleaseUnapproved(d, req.node_id(), addresses, outcome, ctx);
  return outcome;
}

}  // namespace gpuaas::inventory
