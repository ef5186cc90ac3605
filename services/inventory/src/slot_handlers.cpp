// Slot handlers (approve, repair, disable), wipe proofs, availability and regions.
#include <map>
#include <set>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "inventory_handlers.hpp"
#include "node_store.hpp"
#include "slot_store.hpp"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

Error SlotNotFound(const std::string& node_id, const std::string& slot_key) {
  return Error::NotFound(reason::kSlotNotFound, "node " + node_id + " has no slot " + slot_key);
}

Error SlotKeyRequired() {
  return Error::InvalidArgument(reason::kInvalidSlotKey, "slot_key is required",
                                {{"slot_key", "required"}});
}

Result<void> ValidateWipeProof(const v1::RecordWipeProofRequest& req) {
  std::map<std::string, std::string> problems;
  if (req.nvme_by_id().rfind("/dev/disk/by-id/", 0) != 0) {
    problems["nvme_by_id"] = "must be a /dev/disk/by-id/ path";
  }
  static const std::set<std::string> kMethods = {"blkdiscard", "nvme-format", "wipefs"};
  if (!kMethods.count(req.method())) {
    problems["method"] = "one of blkdiscard, nvme-format, wipefs";
  }
  if (req.evidence().empty()) problems["evidence"] = "required: what proves the wipe";
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidWipeProof,
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  return Ok();
}

// The slot disabled with the operator's reason, written unless it already was.
Result<v1::DisableSlotResponse> WriteDisable(pqxx::work& tx, const v1::DisableSlotRequest& req,
                                             const std::string& source,
                                             const std::string& traceparent) {
  auto node = LoadNode(tx, req.node_id(), RowLock::kForUpdate);
  if (!node.ok()) return node.error();
  auto slots = LoadSlots(tx, req.node_id());
  if (!slots.ok()) return slots.error();
  auto it = slots->find(req.slot_key());
  if (it == slots->end()) return SlotNotFound(req.node_id(), req.slot_key());
  v1::Slot s = it->second;
  s.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
  s.set_disabled_reason(req.reason().empty() ? "disabled by an operator" : req.reason());
  v1::DisableSlotResponse resp;
  if (SameSlot(s, it->second)) {
    *resp.mutable_slot() = it->second;
  } else {
    auto saved = SaveSlot(tx, *node, s, source, traceparent, "");
    if (!saved.ok()) return saved.error();
    *resp.mutable_slot() = *saved;
  }
  auto desired = UpdateDesired(tx, req.node_id());
  if (!desired.ok()) return desired.error();
  resp.set_desired_version(*desired);
  return resp;
}

// The region set to `enabled`; a change re-announces the slots of its nodes.
Result<v1::SetRegionResponse> WriteRegion(pqxx::work& tx, const v1::SetRegionRequest& req,
                                          const std::string& source, rpc::Context& ctx) {
  // A new region is created in the requested state (nodes may join it later).
  InsertRegionIfMissing(tx, req.name(), req.enabled());
  if (LockRegionEnabled(tx, req.name()) != req.enabled()) {
    SetRegionEnabled(tx, req.name(), req.enabled());
    // Every slot snapshot carries region_enabled: re-announce the region's slots.
    for (const auto& n : NodesWithSlotsInRegion(tx, req.name())) {
      if (auto r = ReemitNodeSlots(tx, n, source, ctx.traceparent); !r.ok()) return r.error();
    }
    ctx.log.Info("region changed",
                 {{"region", req.name()}, {"enabled", req.enabled() ? "true" : "false"}});
  }
  v1::SetRegionResponse resp;
  *resp.mutable_region() = LoadRegion(tx, req.name(), req.enabled());
  return resp;
}

}  // namespace

Result<v1::ApproveSlotsResponse> InventoryHandlers::SlotApprove(const v1::ApproveSlotsRequest& req,
                                                                rpc::Context& ctx) const {
  return ApproveCandidates(Approval(), req, ctx, ApprovalMode::kApprove);
}

Result<v1::RepairSlotResponse> InventoryHandlers::SlotRepair(const v1::RepairSlotRequest& req,
                                                             rpc::Context& ctx) const {
  if (req.slot_key().empty()) return SlotKeyRequired();
  // Whether its devices lost their vfio-pci binding (the agent's drift): repair has them bound
  // again (the agent clears that drift once its check is clean).
  auto binding_lost = store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<bool> {
    if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
    if (auto n = LoadNode(tx, req.node_id(), RowLock::kNone); !n.ok()) return n.error();
    auto slots = LoadSlots(tx, req.node_id());
    if (!slots.ok()) return slots.error();
    auto it = slots->find(req.slot_key());
    if (it == slots->end()) return SlotNotFound(req.node_id(), req.slot_key());
    for (const auto& d : it->second.drift()) {
      if (d.kind() == reason::kVfioBindingLost) return true;
    }
    return false;
  });
  if (!binding_lost.ok()) return binding_lost.error();
  if (*binding_lost) {
    auto rebind = store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<void> {
      if (auto n = LoadNode(tx, req.node_id(), RowLock::kForUpdate); !n.ok()) return n.error();
      BumpRebindGeneration(tx, req.node_id());
      auto v = UpdateDesired(tx, req.node_id());
      if (!v.ok()) return v.error();
      return Ok();
    });
    if (!rebind.ok()) return rebind.error();
  }
  v1::ApproveSlotsRequest a;
  a.set_node_id(req.node_id());
  a.add_slot_keys(req.slot_key());
  // Repair re-validates against the latest evidence and clears drift when it passes.
  auto r = ApproveCandidates(Approval(), a, ctx, ApprovalMode::kRepair);
  if (!r.ok()) return r.error();
  v1::RepairSlotResponse resp;
  if (r->results_size() > 0) *resp.mutable_result() = r->results(0);
  resp.set_desired_version(r->desired_version());
  return resp;
}

Result<v1::DisableSlotResponse> InventoryHandlers::SlotDisable(const v1::DisableSlotRequest& req,
                                                               rpc::Context& ctx) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  if (req.slot_key().empty()) return SlotKeyRequired();
  return store::WithTx(
      *d_.pool, [&](pqxx::work& tx) { return WriteDisable(tx, req, d_.source, ctx.traceparent); });
}

Result<v1::RecordWipeProofResponse> InventoryHandlers::WipeProofRecord(
    const v1::RecordWipeProofRequest& req, rpc::Context& ctx) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  if (auto v = ValidateWipeProof(req); !v.ok()) return v.error();
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::RecordWipeProofResponse> {
    if (auto n = LoadNode(tx, req.node_id(), RowLock::kNone); !n.ok()) return n.error();
    // Who: the request token's principal (an operator's subject is always there).
    const std::string actor = ctx.principal.subject;
    const double recorded_at =
        UpsertWipeProof(tx, req.node_id(), req.nvme_by_id(), req.method(), req.evidence(), actor);
    v1::RecordWipeProofResponse resp;
    *resp.mutable_recorded_at() = TimestampFromEpoch(recorded_at);
    ctx.log.Info("wipe proof recorded",
                 {{"node_id", req.node_id()}, {"nvme_by_id", req.nvme_by_id()}});
    return resp;
  });
}

Result<v1::ListAvailabilityResponse> InventoryHandlers::AvailabilityList(
    const v1::ListAvailabilityRequest& req, rpc::Context& /*ctx*/) const {
  return store::WithTx(*d_.pool,
                       [&](pqxx::work& tx) { return ListAvailability(tx, req.region()); });
}

Result<v1::ListRegionsResponse> InventoryHandlers::RegionList(const v1::ListRegionsRequest& /*req*/,
                                                              rpc::Context& /*ctx*/) const {
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::ListRegionsResponse> {
    v1::ListRegionsResponse resp;
    for (auto& r : ListRegions(tx)) *resp.add_regions() = std::move(r);
    return resp;
  });
}

Result<v1::SetRegionResponse> InventoryHandlers::RegionSet(const v1::SetRegionRequest& req,
                                                           rpc::Context& ctx) const {
  if (!ids::IsNodeId(req.name())) {
    return Error::InvalidArgument(reason::kInvalidRegion,
                                  "region names are lowercase DNS labels: '" + req.name() + "'",
                                  {{"name", "must be a lowercase DNS label"}});
  }
  return store::WithTx(*d_.pool,
                       [&](pqxx::work& tx) { return WriteRegion(tx, req, d_.source, ctx); });
}

}  // namespace gpuaas::inventory
