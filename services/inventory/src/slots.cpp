#include "slots.hpp"

#include <google/protobuf/util/message_differencer.h>
#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include <fmt/format.h>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/topology.pb.h"
#include "slot_rules.hpp"

namespace gpuaas::inventory {

namespace {

using google::protobuf::util::TimeUtil;

constexpr const char* kSlotEvent = "gpuaas.v1.evt.inventory.slot.updated";

google::protobuf::Timestamp TsFromEpoch(double epoch) {
  return TimeUtil::MillisecondsToTimestamp(static_cast<int64_t>(epoch * 1000));
}

// What every slot snapshot of a node carries besides the slot itself.
struct NodeCtx {
  std::string node_id;
  std::string region;
  std::string pool;
  bool region_enabled = true;
  std::vector<std::string> blockers;  // of the latest topology snapshot
  int64_t snapshot_version = 0;
};

Result<NodeCtx> LoadNode(pqxx::work& tx, const std::string& node_id, bool lock) {
  auto rows = tx.exec_params(std::string("SELECT n.region, n.pool, COALESCE(r.enabled, true) "
                                         "FROM nodes n LEFT JOIN regions r ON r.name = n.region "
                                         "WHERE n.node_id = $1") +
                                 (lock ? " FOR UPDATE OF n" : ""),
                             node_id);
  if (rows.empty()) {
    return Error{Code::kNotFound,
                 "node_not_found",
                 "inventory does not know node " + node_id,
                 {{"node_id", node_id}},
                 false};
  }
  NodeCtx c;
  c.node_id = node_id;
  c.region = rows[0][0].as<std::string>();
  c.pool = rows[0][1].as<std::string>();
  c.region_enabled = rows[0][2].as<bool>();
  auto snap = tx.exec_params(
      "SELECT version, array_to_string(node_blockers, ',') FROM topology_snapshots "
      "WHERE node_id = $1 ORDER BY version DESC LIMIT 1",
      node_id);
  if (!snap.empty()) {
    c.snapshot_version = snap[0][0].as<int64_t>();
    const auto joined = snap[0][1].as<std::string>();
    size_t start = 0;
    while (start < joined.size()) {
      const size_t comma = joined.find(',', start);
      const size_t end = comma == std::string::npos ? joined.size() : comma;
      if (end > start) c.blockers.push_back(joined.substr(start, end - start));
      start = end + 1;
    }
  }
  return c;
}

struct Snapshot {
  int64_t version = 0;
  double received_at = 0;
  v1::TopologyReport report;
};

Result<std::optional<Snapshot>> LoadSnapshot(pqxx::work& tx, const std::string& node_id,
                                             int64_t version) {
  auto rows = tx.exec_params(
      "SELECT version, report::text, extract(epoch from received_at)::float8 "
      "FROM topology_snapshots WHERE node_id = $1 AND ($2 = 0 OR version = $2) "
      "ORDER BY version DESC LIMIT 1",
      node_id, version);
  if (rows.empty()) return std::optional<Snapshot>();
  Snapshot s;
  s.version = rows[0][0].as<int64_t>();
  if (auto r = protojson::FromJson(rows[0][1].as<std::string>(), &s.report); !r.ok()) {
    return Error::Internal("corrupt_snapshot", r.error().message);
  }
  s.received_at = rows[0][2].as<double>();
  return std::optional<Snapshot>(std::move(s));
}

Result<std::map<std::string, v1::Slot>> LoadSlots(pqxx::work& tx, const std::string& node_id) {
  std::map<std::string, v1::Slot> out;
  for (const auto& r : tx.exec_params("SELECT slot_key, doc::text FROM node_resource_slots WHERE "
                                      "node_id = $1 ORDER BY slot_key",
                                      node_id)) {
    v1::Slot s;
    if (auto p = protojson::FromJson(r[1].as<std::string>(), &s); !p.ok()) {
      return Error::Internal("corrupt_slot", p.error().message);
    }
    out[r[0].as<std::string>()] = std::move(s);
  }
  return out;
}

bool Complete(const v1::Slot& s) {
  return !s.gpu_pci_address().empty() && !s.nvme_by_id().empty() &&
         s.fabric_claim_mode() == v1::FABRIC_CLAIM_MODE_PER_SLOT_VF &&
         !s.fabric_vf_pci_address().empty() && !s.mac().empty() && !s.private_ip().empty();
}

bool Schedulable(const v1::Slot& s, const NodeCtx& c) {
  return s.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE &&
         s.health() == v1::SLOT_HEALTH_HEALTHY && Complete(s) && c.region_enabled &&
         c.blockers.empty();
}

// Same slot apart from bookkeeping (generation, time)?
bool SameSlot(v1::Slot a, v1::Slot b) {
  for (auto* s : {&a, &b}) {
    s->clear_generation();
    s->clear_updated_at();
    for (auto& d : *s->mutable_drift()) d.clear_detected_at();
  }
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

// Writes the slot with the next generation and announces its snapshot in the same transaction.
Result<v1::Slot> SaveSlot(pqxx::work& tx, const NodeCtx& c, v1::Slot slot,
                          const std::string& source, const std::string& traceparent,
                          const std::string& correlation) {
  auto cur = tx.exec_params(
      "SELECT generation FROM node_resource_slots WHERE node_id = $1 AND slot_key = $2 FOR UPDATE",
      c.node_id, slot.slot_key());
  const int64_t gen = cur.empty() ? 1 : cur[0][0].as<int64_t>() + 1;
  slot.set_node_id(c.node_id);
  slot.set_generation(gen);
  *slot.mutable_updated_at() = TimeUtil::GetCurrentTime();
  const bool schedulable = Schedulable(slot, c);
  tx.exec_params(
      "INSERT INTO node_resource_slots (node_id, slot_key, admin_state, health, sku, gpu_model, "
      "nvme_by_id, fabric_vf_pci_address, schedulable, generation, doc, updated_at) "
      "VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11::jsonb, now()) "
      "ON CONFLICT (node_id, slot_key) DO UPDATE SET admin_state = EXCLUDED.admin_state, "
      "health = EXCLUDED.health, sku = EXCLUDED.sku, gpu_model = EXCLUDED.gpu_model, "
      "nvme_by_id = EXCLUDED.nvme_by_id, fabric_vf_pci_address = EXCLUDED.fabric_vf_pci_address, "
      "schedulable = EXCLUDED.schedulable, generation = EXCLUDED.generation, doc = EXCLUDED.doc, "
      "updated_at = now()",
      c.node_id, slot.slot_key(), enums::Text(slot.admin_state()), enums::Text(slot.health()),
      slot.sku(), slot.gpu_model(), slot.nvme_by_id(), slot.fabric_vf_pci_address(), schedulable,
      gen, protojson::ToJson(slot));
  v1::SlotSnapshot snap;
  *snap.mutable_slot() = slot;
  snap.set_region(c.region);
  snap.set_pool(c.pool);
  snap.set_region_enabled(c.region_enabled);
  for (const auto& b : c.blockers) snap.add_node_blockers(b);
  snap.set_schedulable(schedulable);
  auto ev = outbox::Append(tx, {kSlotEvent, "", source, c.node_id + "/" + slot.slot_key(), gen,
                                correlation, traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return slot;
}

// The desired slot set is a versioned per-node document (libs/common documents.hpp).
const documents::Tables& DesiredTables() {
  static const documents::Tables t{"desired_slot_sets", "node_agent_acks", "desired slot set"};
  return t;
}

// A new desired-set version when the node's available slots differ from the latest version.
Result<int64_t> UpdateDesired(pqxx::work& tx, const std::string& node_id) {
  auto slots = LoadSlots(tx, node_id);
  if (!slots.ok()) return slots.error();
  v1::DesiredSlotSet want;
  want.set_node_id(node_id);
  for (const auto& [key, s] : *slots) {
    if (s.admin_state() != v1::SLOT_ADMIN_STATE_AVAILABLE) continue;
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
  return documents::Publish(tx, DesiredTables(), node_id, want, want.slots_size() == 0);
}

Result<void> CheckNodeId(const std::string& id) {
  if (id.empty()) {
    return Error::InvalidArgument("invalid_node_id", "node_id is required",
                                  {{"node_id", "required"}});
  }
  if (!ids::IsNodeId(id)) {
    return Error::InvalidArgument("invalid_node_id", "node_id is not a valid node id: " + id,
                                  {{"node_id", "must be a lowercase DNS label"}});
  }
  return Ok();
}

std::set<std::string> WipedDisks(pqxx::work& tx, const std::string& node_id) {
  std::set<std::string> out;
  for (const auto& r :
       tx.exec_params("SELECT nvme_by_id FROM wipe_proofs WHERE node_id = $1", node_id)) {
    out.insert(r[0].as<std::string>());
  }
  return out;
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

struct Deps {
  std::shared_ptr<store::Pool> pool;
  std::shared_ptr<messaging::Connection> nats;
  SlotDeps cfg;
};

// Reserves MAC/IP for a slot from ipam (idempotent on ipam's side). The node's region and pool
// choose its subnet rule in ipam.
Result<v1::ReserveSlotAddressResponse> Reserve(const Deps& d, const NodeCtx& node,
                                               const std::string& slot_key,
                                               const std::string& traceparent) {
  v1::ReserveSlotAddressRequest req;
  req.set_node_id(node.node_id);
  req.set_slot_key(slot_key);
  req.set_region(node.region);
  req.set_pool(node.pool);
  return rpc::Client(d.nats).Call<v1::ReserveSlotAddressResponse>(
      "gpuaas.v1.ipam.reservation.reserve", req, std::chrono::milliseconds(d.cfg.ipam_timeout_ms),
      traceparent);
}

// Gives back reservations this approval made (or found) for slots that did not end up
// approved with them, so a rejected approval leaves no orphaned MAC/IP in ipam. Best effort: a
// failure is logged and the reservation stays until the next approval of the slot.
void ReleaseUnapproved(
    const Deps& d, const std::string& node_id,
    const std::map<std::string, Result<v1::ReserveSlotAddressResponse>>& reserved,
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
    req.set_reason("approval_rejected");
    auto rel = rpc::Client(d.nats).Call<v1::ReleaseSlotAddressResponse>(
        "gpuaas.v1.ipam.reservation.release", req, std::chrono::milliseconds(d.cfg.ipam_timeout_ms),
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

// Drift ipam reports (lease mismatch/missing/unexpected) is kept apart from the topology drift
// inventory detects itself: each source sets and clears only its own.
bool IsIpamDrift(const std::string& kind) { return kind.rfind("ipam_", 0) == 0; }

// "kind: detail; ..." of every drift record of the slot (its health_detail while degraded).
std::string DriftDetail(const v1::Slot& s) {
  std::string out;
  for (const auto& x : s.drift()) out += (out.empty() ? "" : "; ") + x.kind() + ": " + x.detail();
  return out;
}

v1::SlotRejection Rejection(const std::string& reason, const std::string& message) {
  v1::SlotRejection r;
  r.set_reason(reason);
  r.set_message(message);
  return r;
}

// Approval of a list of candidates of one snapshot. Validation runs before the address
// reservations (outside any transaction) and again, authoritatively, under the node's row
// lock together with the writes.
Result<v1::ApproveSlotsResponse> Approve(const Deps& d, const v1::ApproveSlotsRequest& req,
                                         rpc::Context& ctx, bool repair) {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  if (req.snapshot_version() < 0) {
    return Error::InvalidArgument("invalid_snapshot_version", "snapshot_version must be >= 0",
                                  {{"snapshot_version", "must be >= 0 (0 = latest)"}});
  }
  // Phase 1: what would pass the local rules now.
  std::map<std::string, bool> passes;
  NodeCtx where;
  auto pre = store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<void> {
    auto node = LoadNode(tx, req.node_id(), false);
    if (!node.ok()) return node.error();
    where = *node;
    auto snap = LoadSnapshot(tx, req.node_id(), req.snapshot_version());
    if (!snap.ok()) return snap.error();
    if (!snap->has_value()) {
      if (req.snapshot_version() != 0) {
        return Error{Code::kNotFound,
                     "snapshot_not_found",
                     fmt::format("node {} has no topology snapshot version {}", req.node_id(),
                                 req.snapshot_version()),
                     {{"snapshot_version", std::to_string(req.snapshot_version())}},
                     false};
      }
      return Error::FailedPrecondition(
          "no_topology_snapshot",
          "node " + req.node_id() + " has not reported its topology yet; run node discover");
    }
    auto slots = LoadSlots(tx, req.node_id());
    if (!slots.ok()) return slots.error();
    ApprovalContext actx;
    actx.report = &(*snap)->report;
    actx.wiped_nvme = WipedDisks(tx, req.node_id());
    auto holders = Holders(*slots);
    for (const auto& c : (*snap)->report.candidates()) {
      if (!req.slot_keys().empty() && std::find(req.slot_keys().begin(), req.slot_keys().end(),
                                                c.slot_key()) == req.slot_keys().end()) {
        continue;
      }
      actx.holders = holders;
      const bool ok = ValidateCandidate(c, actx).empty();
      passes[c.slot_key()] = ok;
      if (ok) holders.push_back(SlotFromCandidate(c, (*snap)->report, 0));
    }
    return Ok();
  });
  if (!pre.ok()) return pre.error();

  // Phase 2: addresses for the candidates that pass (ipam is idempotent per slot).
  std::map<std::string, Result<v1::ReserveSlotAddressResponse>> addresses;
  for (const auto& [key, ok] : passes) {
    if (ok) addresses.emplace(key, Reserve(d, where, key, ctx.traceparent));
  }

  // Phase 3: validate again under the node lock, write slots, events and the desired set.
  auto outcome = store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::ApproveSlotsResponse> {
    auto node = LoadNode(tx, req.node_id(), true);
    if (!node.ok()) return node.error();
    auto snap = LoadSnapshot(tx, req.node_id(), req.snapshot_version());
    if (!snap.ok()) return snap.error();
    if (!snap->has_value()) {
      return Error::FailedPrecondition("no_topology_snapshot", "topology snapshot disappeared");
    }
    const auto& report = (*snap)->report;
    auto slots = LoadSlots(tx, req.node_id());
    if (!slots.ok()) return slots.error();
    ApprovalContext actx;
    actx.report = &report;
    actx.wiped_nvme = WipedDisks(tx, req.node_id());
    v1::ApproveSlotsResponse resp;
    resp.set_snapshot_version((*snap)->version);
    std::set<std::string> seen;
    for (const auto& key : req.slot_keys()) {
      if (seen.insert(key).second &&
          std::none_of(report.candidates().begin(), report.candidates().end(),
                       [&](const v1::CandidateSlot& c) { return c.slot_key() == key; })) {
        auto* res = resp.add_results();
        res->set_slot_key(key);
        *res->add_rejections() =
            Rejection(reason::kNotInSnapshot,
                      fmt::format("snapshot {} has no candidate {}", (*snap)->version, key));
      }
    }
    for (const auto& c : report.candidates()) {
      if (!req.slot_keys().empty() && !seen.count(c.slot_key())) continue;
      // The holders: available slots of other keys as they are now (including this batch).
      std::map<std::string, v1::Slot> others = *slots;
      others.erase(c.slot_key());
      actx.holders = Holders(others);
      auto rejections = ValidateCandidate(c, actx);
      v1::Slot slot = SlotFromCandidate(c, report, (*snap)->version);
      slot.set_node_id(req.node_id());
      if (rejections.empty()) {
        auto it = addresses.find(c.slot_key());
        if (it == addresses.end()) {
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
      }
      auto* res = resp.add_results();
      res->set_slot_key(c.slot_key());
      const auto existing = slots->find(c.slot_key());
      if (!rejections.empty()) {
        for (const auto& r : rejections) *res->add_rejections() = r;
        if (existing != slots->end() &&
            existing->second.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE) {
          // An approved slot is never demoted by a failed re-approval; drift and disable do that.
          *res->mutable_slot() = existing->second;
          continue;
        }
        // Incomplete or unsafe: recorded, but disabled.
        slot.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
        slot.set_health(v1::SLOT_HEALTH_UNKNOWN);
        slot.set_disabled_reason("approval rejected: " + rejections.front().reason());
        for (const auto& r : rejections) *slot.add_rejections() = r;
        if (existing != slots->end()) {
          *slot.mutable_drift() = existing->second.drift();
          if (existing->second.admin_state() == v1::SLOT_ADMIN_STATE_DISABLED &&
              !existing->second.disabled_reason().empty() &&
              existing->second.disabled_reason().rfind("approval rejected", 0) != 0) {
            slot.set_disabled_reason(existing->second.disabled_reason());
          }
        }
      } else {
        slot.set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
        slot.set_health(v1::SLOT_HEALTH_HEALTHY);
        res->set_approved(true);
        if (existing != slots->end()) {
          // Approval does not clear drift; repair re-validates the topology evidence and clears
          // its drift, but IPAM drift clears only with a clean lease report.
          for (const auto& dr : existing->second.drift()) {
            if (!repair || IsIpamDrift(dr.kind())) *slot.add_drift() = dr;
          }
          if (slot.drift_size() > 0) {
            slot.set_health(v1::SLOT_HEALTH_DEGRADED);
            slot.set_health_detail(repair ? DriftDetail(slot) : existing->second.health_detail());
          }
        }
      }
      if (existing != slots->end() && SameSlot(existing->second, slot)) {
        *res->mutable_slot() = existing->second;
        continue;
      }
      auto saved = SaveSlot(tx, *node, slot, d.cfg.source, ctx.traceparent, "");
      if (!saved.ok()) return saved.error();
      (*slots)[c.slot_key()] = *saved;
      *res->mutable_slot() = *saved;
    }
    auto desired = UpdateDesired(tx, req.node_id());
    if (!desired.ok()) return desired.error();
    resp.set_desired_version(*desired);
    ctx.log.Info(repair ? "slots repaired" : "slots approved",
                 {{"node_id", req.node_id()},
                  {"snapshot_version", std::to_string((*snap)->version)},
                  {"desired_version", std::to_string(*desired)}});
    return resp;
  });
  ReleaseUnapproved(d, req.node_id(), addresses, outcome, ctx);
  return outcome;
}

Result<std::vector<std::string>> NodesInRegion(pqxx::work& tx, const std::string& region) {
  std::vector<std::string> out;
  for (const auto& r :
       tx.exec_params("SELECT DISTINCT n.node_id FROM nodes n JOIN node_resource_slots s "
                      "USING (node_id) WHERE n.region = $1 ORDER BY 1",
                      region)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

v1::Region RegionFromRow(pqxx::work& tx, const std::string& name, bool enabled) {
  v1::Region r;
  r.set_name(name);
  r.set_enabled(enabled);
  for (const auto& p :
       tx.exec_params("SELECT DISTINCT pool FROM nodes WHERE region = $1 ORDER BY 1", name)) {
    r.add_pools(p[0].as<std::string>());
  }
  return r;
}

}  // namespace

Result<v1::ListAvailabilityResponse> ListAvailability(pqxx::work& tx, const std::string& region) {
  v1::ListAvailabilityResponse resp;
  for (const auto& r : tx.exec_params(
           "SELECT region, pool, sku, gpu_model, sum(schedulable), sum(approved), sum(nodes) "
           "FROM availability_counts WHERE ($1 = '' OR region = $1) GROUP BY 1, 2, 3, 4 "
           "HAVING sum(slots) > 0 ORDER BY 1, 2, 3, 4",
           region)) {
    auto* a = resp.add_availability();
    a->set_region(r[0].as<std::string>());
    a->set_pool(r[1].as<std::string>());
    a->set_sku(r[2].as<std::string>());
    a->set_gpu_model(r[3].as<std::string>());
    a->set_schedulable_slots(r[4].as<int32_t>());
    a->set_approved_slots(r[5].as<int32_t>());
    a->set_nodes(r[6].as<int32_t>());
  }
  return resp;
}

Result<void> ReemitNodeSlots(pqxx::work& tx, const std::string& node_id, const std::string& source,
                             const std::string& traceparent) {
  // The node's row first, then its slots: the order of every slot change (the availability
  // trigger locks the node's row too, so the other order could deadlock with them).
  auto node = LoadNode(tx, node_id, true);
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
    return Error::InvalidArgument("malformed_event",
                                  "event data is not a gpuaas.v1.TopologyReport");
  }
  if (!ids::IsNodeId(report.node_id())) {
    return Error::InvalidArgument("malformed_event", "topology report without a valid node_id");
  }
  auto before = LoadNode(tx, report.node_id(), true);
  if (!before.ok()) return before.error();  // unknown node: not retryable, dead-lettered
  if (report.has_discovered_at()) {
    // A report that arrives after a newer one (redelivery, a slow task) is history, not news.
    auto newer = tx.exec_params(
        "SELECT 1 FROM topology_snapshots WHERE node_id = $1 AND report ? 'discovered_at' AND "
        "(report->>'discovered_at')::timestamptz > $2::timestamptz LIMIT 1",
        report.node_id(), TimeUtil::ToString(report.discovered_at()));
    if (!newer.empty()) return Ok();
  }
  const int64_t version = before->snapshot_version + 1;
  tx.exec_params(
      "INSERT INTO topology_snapshots (node_id, version, event_id, report, node_blockers) "
      "VALUES ($1, $2, $3, $4::jsonb, $5::text[])",
      report.node_id(), version, ev.id(), protojson::ToJson(report),
      store::TextArrayLiteral({report.node_blockers().begin(), report.node_blockers().end()}));
  NodeCtx after = *before;  // what every slot snapshot carries, as of this report
  after.snapshot_version = version;
  after.blockers.assign(report.node_blockers().begin(), report.node_blockers().end());
  const bool blockers_changed = before->blockers != after.blockers;
  auto slots = LoadSlots(tx, report.node_id());
  if (!slots.ok()) return slots.error();
  for (const auto& [key, slot] : *slots) {
    v1::Slot next = slot;
    auto drift = DetectDrift(slot, report);
    if (!drift.empty()) {
      std::set<std::string> had, now;
      for (const auto& x : slot.drift()) {
        if (!IsIpamDrift(x.kind())) had.insert(x.kind());
      }
      for (const auto& x : drift) now.insert(x.kind());
      if (had != now) {
        next.clear_drift();
        for (auto& x : drift) {
          *x.mutable_detected_at() = TimeUtil::GetCurrentTime();
          *next.add_drift() = x;
        }
        for (const auto& x : slot.drift()) {
          if (IsIpamDrift(x.kind())) *next.add_drift() = x;
        }
        next.set_health(v1::SLOT_HEALTH_DEGRADED);
        next.set_health_detail(DriftDetail(next));
      }
    }
    if (blockers_changed || !SameSlot(slot, next)) {
      if (auto r = SaveSlot(tx, after, next, source, "", ev.correlation_id()); !r.ok()) {
        return r.error();
      }
    }
  }
  return Ok();
}

Result<void> ApplyTaskEvent(pqxx::work& tx, const v1::Event& ev) {
  // Progress of long tasks (gpuaas.v1.evt.node.<id>.task.progress) is the scheduler's business.
  if (ev.data().Is<v1::NodeTaskProgress>()) return Ok();
  v1::NodeTaskResult res;
  if (!ev.data().UnpackTo(&res)) {
    return Error::InvalidArgument("malformed_event",
                                  "event data is not a gpuaas.v1.NodeTaskResult");
  }
  if (!ids::IsUuid(res.task_id())) {
    return Error::InvalidArgument("malformed_event", "task result without a task id");
  }
  // A result without a final status (none, queued, or one this inventory does not know) is
  // recorded as failed.
  std::string status = enums::Text(res.status());
  if (status.empty() || res.status() == v1::TASK_STATUS_QUEUED) {
    status = enums::Text(v1::TASK_STATUS_FAILED);
  }
  const std::string error =
      res.has_error() ? res.error().reason() + ": " + res.error().message() : std::string();
  auto updated = tx.exec_params(
      "UPDATE node_tasks SET status = $2, error = $3, finished_at = now() WHERE task_id = $1",
      res.task_id(), status, error);
  if (updated.affected_rows() == 0) {
    // A task this inventory did not queue (sent by another tool): recorded when the node is known.
    tx.exec_params(
        "INSERT INTO node_tasks (task_id, node_id, type, status, error, finished_at) "
        "SELECT $1, node_id, $3, $4, $5, now() FROM nodes WHERE node_id = $2 "
        "ON CONFLICT DO NOTHING",
        res.task_id(), res.node_id(), enums::Text(res.type()), status, error);
  }
  return Ok();
}

Result<void> ApplyIpamDriftEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source) {
  v1::IpamDriftSnapshot snap;
  if (!ev.data().UnpackTo(&snap)) {
    return Error::InvalidArgument("malformed_event",
                                  "event data is not a gpuaas.v1.IpamDriftSnapshot");
  }
  const auto& d = snap.drift();
  if (!ids::IsNodeId(d.node_id()) || !IsIpamDrift(d.kind())) {
    return Error::InvalidArgument("malformed_event", "ipam drift without a node id or ipam kind");
  }
  if (d.slot_key().empty()) return Ok();  // a lease no slot owns: ipam's node-level evidence
  auto seen = tx.exec_params(
      "SELECT generation FROM ipam_drift_marks WHERE node_id = $1 AND slot_key = $2 FOR UPDATE",
      d.node_id(), d.slot_key());
  if (!seen.empty() && seen[0][0].as<int64_t>() >= d.generation()) return Ok();  // older news
  auto node = LoadNode(tx, d.node_id(), true);
  if (!node.ok()) return Ok();  // a node inventory does not know has no slots to mark
  tx.exec_params(
      "INSERT INTO ipam_drift_marks (node_id, slot_key, generation) VALUES ($1, $2, $3) "
      "ON CONFLICT (node_id, slot_key) DO UPDATE SET generation = EXCLUDED.generation",
      d.node_id(), d.slot_key(), d.generation());
  auto slots = LoadSlots(tx, d.node_id());
  if (!slots.ok()) return slots.error();
  auto it = slots->find(d.slot_key());
  if (it == slots->end()) return Ok();
  const v1::Slot& slot = it->second;
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
  if (SameSlot(slot, next)) return Ok();  // (detection times aside) nothing changed
  if (next.drift_size() > 0) {
    if (next.health() != v1::SLOT_HEALTH_FAILED) next.set_health(v1::SLOT_HEALTH_DEGRADED);
    next.set_health_detail(DriftDetail(next));
  } else {
    if (next.health() == v1::SLOT_HEALTH_DEGRADED) {
      next.set_health(next.admin_state() == v1::SLOT_ADMIN_STATE_AVAILABLE
                          ? v1::SLOT_HEALTH_HEALTHY
                          : v1::SLOT_HEALTH_UNKNOWN);
    }
    next.clear_health_detail();
  }
  auto saved = SaveSlot(tx, *node, next, source, "", d.allocation_id());
  if (!saved.ok()) return saved.error();
  return Ok();
}

Result<void> StartSlotDomain(runtime::Service& svc, const SlotDeps& cfg) {
  auto nats = svc.nats();
  for (const auto& spec : {messaging::NodeTasksStream(), messaging::NodeEventsStream(),
                           messaging::IpamEventsStream()}) {
    if (auto r = messaging::EnsureStream(*nats, spec); !r.ok()) return r;
  }
  Deps d{svc.pg(), nats, cfg};
  auto& rpc = svc.Rpc();

  rpc.Handle<v1::DiscoverNodeRequest, v1::DiscoverNodeResponse>(
      "gpuaas.v1.inventory.node.discover",
      [d](const v1::DiscoverNodeRequest& req,
          rpc::Context& ctx) -> Result<v1::DiscoverNodeResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::DiscoverNodeResponse> {
          if (auto n = LoadNode(tx, req.node_id(), false); !n.ok()) return n.error();
          v1::NodeTask task;
          task.set_task_id(ids::NewUuidV7());
          task.set_node_id(req.node_id());
          task.set_type(v1::TASK_TYPE_TOPOLOGY_DISCOVER);
          task.mutable_topology_discover();
          *task.mutable_deadline() =
              TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(d.cfg.task_deadline_s);
          task.set_correlation_id(task.task_id());
          task.set_requested_by(d.cfg.source);
          tx.exec_params(
              "INSERT INTO node_tasks (task_id, node_id, type, status) "
              "VALUES ($1, $2, $3, 'queued')",
              task.task_id(), req.node_id(), enums::Text(task.type()));
          auto ev = outbox::Append(
              tx, {fmt::format("gpuaas.v1.node.{node_id}.task", fmt::arg("node_id", req.node_id())),
                   "", d.cfg.source, req.node_id(), 0, task.task_id(), ctx.traceparent, &task});
          if (!ev.ok()) return ev.error();
          v1::DiscoverNodeResponse resp;
          resp.set_task_id(task.task_id());
          ctx.log.Info("discovery requested",
                       {{"node_id", req.node_id()}, {"task_id", task.task_id()}});
          return resp;
        });
      });

  rpc.Handle<v1::ShowNodeRequest, v1::ShowNodeResponse>(
      "gpuaas.v1.inventory.node.show",
      [d](const v1::ShowNodeRequest& req, rpc::Context&) -> Result<v1::ShowNodeResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::ShowNodeResponse> {
          auto node = LoadNode(tx, req.node_id(), false);
          if (!node.ok()) return node.error();
          v1::ShowNodeResponse resp;
          auto n = tx.exec_params(
              "SELECT node_id, hostname, region, pool, capacity_profile, agent_version, "
              "generation, labels::text FROM nodes WHERE node_id = $1",
              req.node_id());
          auto* pn = resp.mutable_node();
          pn->set_node_id(n[0][0].as<std::string>());
          pn->set_hostname(n[0][1].as<std::string>());
          pn->set_region(n[0][2].as<std::string>());
          pn->set_pool(n[0][3].as<std::string>());
          pn->set_capacity_profile(
              enums::FromColumn<v1::CapacityProfile>(n[0][4].as<std::string>()));
          pn->set_agent_version(n[0][5].as<std::string>());
          pn->set_generation(n[0][6].as<int64_t>());
          resp.set_region_enabled(node->region_enabled);
          auto snap = LoadSnapshot(tx, req.node_id(), 0);
          if (!snap.ok()) return snap.error();
          if (snap->has_value()) {
            resp.set_snapshot_version((*snap)->version);
            *resp.mutable_snapshot_at() = TsFromEpoch((*snap)->received_at);
            *resp.mutable_topology() = (*snap)->report;
          }
          auto slots = LoadSlots(tx, req.node_id());
          if (!slots.ok()) return slots.error();
          for (const auto& [k, s] : *slots) {
            *resp.add_slots() = s;
            for (const auto& dr : s.drift()) *resp.add_drift() = dr;
          }
          for (const auto& b : node->blockers) {
            resp.add_node_blockers(b);
            auto* dr = resp.add_drift();
            dr->set_kind("node_blocker");
            dr->set_detail(b);
          }
          resp.set_desired_version(documents::Latest(tx, DesiredTables(), req.node_id()));
          resp.set_applied_version(
              documents::LoadAck(tx, DesiredTables(), req.node_id()).applied_version);
          for (const auto& r :
               tx.exec_params("SELECT task_id::text, type, status, error, "
                              "extract(epoch from queued_at)::float8, "
                              "extract(epoch from finished_at)::float8 FROM node_tasks "
                              "WHERE node_id = $1 ORDER BY queued_at DESC LIMIT 10",
                              req.node_id())) {
            auto* t = resp.add_recent_tasks();
            t->set_task_id(r[0].as<std::string>());
            t->set_type(enums::FromColumn<v1::TaskType>(r[1].as<std::string>()));
            t->set_status(enums::FromColumn<v1::TaskStatus>(r[2].as<std::string>()));
            t->set_error(r[3].as<std::string>());
            *t->mutable_queued_at() = TsFromEpoch(r[4].as<double>());
            if (!r[5].is_null()) *t->mutable_finished_at() = TsFromEpoch(r[5].as<double>());
          }
          return resp;
        });
      });

  rpc.Handle<v1::ApproveSlotsRequest, v1::ApproveSlotsResponse>(
      "gpuaas.v1.inventory.slot.approve",
      [d](const v1::ApproveSlotsRequest& req, rpc::Context& ctx) {
        return Approve(d, req, ctx, false);
      });

  rpc.Handle<v1::RepairSlotRequest, v1::RepairSlotResponse>(
      "gpuaas.v1.inventory.slot.repair",
      [d](const v1::RepairSlotRequest& req, rpc::Context& ctx) -> Result<v1::RepairSlotResponse> {
        if (req.slot_key().empty()) {
          return Error::InvalidArgument("invalid_slot_key", "slot_key is required",
                                        {{"slot_key", "required"}});
        }
        auto exists = store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<void> {
          if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
          if (auto n = LoadNode(tx, req.node_id(), false); !n.ok()) return n.error();
          auto r = tx.exec_params(
              "SELECT 1 FROM node_resource_slots WHERE node_id = $1 AND slot_key = $2",
              req.node_id(), req.slot_key());
          if (r.empty()) {
            return Error::NotFound("slot_not_found",
                                   "node " + req.node_id() + " has no slot " + req.slot_key());
          }
          return Ok();
        });
        if (!exists.ok()) return exists.error();
        v1::ApproveSlotsRequest a;
        a.set_node_id(req.node_id());
        a.add_slot_keys(req.slot_key());
        // Repair re-validates against the latest evidence and clears drift when it passes.
        auto r = Approve(d, a, ctx, true);
        if (!r.ok()) return r.error();
        v1::RepairSlotResponse resp;
        if (r->results_size() > 0) *resp.mutable_result() = r->results(0);
        resp.set_desired_version(r->desired_version());
        return resp;
      });

  rpc.Handle<v1::DisableSlotRequest, v1::DisableSlotResponse>(
      "gpuaas.v1.inventory.slot.disable",
      [d](const v1::DisableSlotRequest& req, rpc::Context& ctx) -> Result<v1::DisableSlotResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        if (req.slot_key().empty()) {
          return Error::InvalidArgument("invalid_slot_key", "slot_key is required",
                                        {{"slot_key", "required"}});
        }
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::DisableSlotResponse> {
          auto node = LoadNode(tx, req.node_id(), true);
          if (!node.ok()) return node.error();
          auto slots = LoadSlots(tx, req.node_id());
          if (!slots.ok()) return slots.error();
          auto it = slots->find(req.slot_key());
          if (it == slots->end()) {
            return Error::NotFound("slot_not_found",
                                   "node " + req.node_id() + " has no slot " + req.slot_key());
          }
          v1::Slot s = it->second;
          s.set_admin_state(v1::SLOT_ADMIN_STATE_DISABLED);
          s.set_disabled_reason(req.reason().empty() ? "disabled by an operator" : req.reason());
          v1::DisableSlotResponse resp;
          if (SameSlot(s, it->second)) {
            *resp.mutable_slot() = it->second;
          } else {
            auto saved = SaveSlot(tx, *node, s, d.cfg.source, ctx.traceparent, "");
            if (!saved.ok()) return saved.error();
            *resp.mutable_slot() = *saved;
          }
          auto desired = UpdateDesired(tx, req.node_id());
          if (!desired.ok()) return desired.error();
          resp.set_desired_version(*desired);
          return resp;
        });
      });

  rpc.Handle<v1::RecordWipeProofRequest, v1::RecordWipeProofResponse>(
      "gpuaas.v1.inventory.disk.wipe_proof.record",
      [d](const v1::RecordWipeProofRequest& req,
          rpc::Context& ctx) -> Result<v1::RecordWipeProofResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
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
          return Error::InvalidArgument(
              "invalid_wipe_proof", fmt::format("{} invalid field(s)", problems.size()), problems);
        }
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::RecordWipeProofResponse> {
          if (auto n = LoadNode(tx, req.node_id(), false); !n.ok()) return n.error();
          // Who: the request token's principal (an operator's subject is always there).
          const std::string actor = ctx.principal.subject;
          auto r = tx.exec_params(
              "INSERT INTO wipe_proofs (node_id, nvme_by_id, method, evidence, recorded_by) "
              "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (node_id, nvme_by_id) DO UPDATE SET "
              "method = EXCLUDED.method, evidence = EXCLUDED.evidence, "
              "recorded_by = EXCLUDED.recorded_by, recorded_at = now() "
              "RETURNING extract(epoch from recorded_at)::float8",
              req.node_id(), req.nvme_by_id(), req.method(), req.evidence(), actor);
          v1::RecordWipeProofResponse resp;
          *resp.mutable_recorded_at() = TsFromEpoch(r[0][0].as<double>());
          ctx.log.Info("wipe proof recorded",
                       {{"node_id", req.node_id()}, {"nvme_by_id", req.nvme_by_id()}});
          return resp;
        });
      });

  rpc.Handle<v1::ListAvailabilityRequest, v1::ListAvailabilityResponse>(
      "gpuaas.v1.inventory.availability.list",
      [d](const v1::ListAvailabilityRequest& req,
          rpc::Context&) -> Result<v1::ListAvailabilityResponse> {
        return store::WithTx(*d.pool,
                             [&](pqxx::work& tx) { return ListAvailability(tx, req.region()); });
      });

  rpc.Handle<v1::ListRegionsRequest, v1::ListRegionsResponse>(
      "gpuaas.v1.inventory.region.list",
      [d](const v1::ListRegionsRequest&, rpc::Context&) -> Result<v1::ListRegionsResponse> {
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::ListRegionsResponse> {
          v1::ListRegionsResponse resp;
          for (const auto& r : tx.exec("SELECT name, enabled FROM regions ORDER BY name")) {
            *resp.add_regions() = RegionFromRow(tx, r[0].as<std::string>(), r[1].as<bool>());
          }
          return resp;
        });
      });

  rpc.Handle<v1::SetRegionRequest, v1::SetRegionResponse>(
      "gpuaas.v1.inventory.region.set",
      [d](const v1::SetRegionRequest& req, rpc::Context& ctx) -> Result<v1::SetRegionResponse> {
        if (!ids::IsNodeId(req.name())) {
          return Error::InvalidArgument(
              "invalid_region", "region names are lowercase DNS labels: '" + req.name() + "'",
              {{"name", "must be a lowercase DNS label"}});
        }
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::SetRegionResponse> {
          // A new region is created in the requested state (nodes may join it later).
          tx.exec_params(
              "INSERT INTO regions (name, enabled) VALUES ($1, $2) ON CONFLICT DO NOTHING",
              req.name(), req.enabled());
          auto cur =
              tx.exec_params("SELECT enabled FROM regions WHERE name = $1 FOR UPDATE", req.name());
          if (cur[0][0].as<bool>() != req.enabled()) {
            tx.exec_params("UPDATE regions SET enabled = $2, updated_at = now() WHERE name = $1",
                           req.name(), req.enabled());
            // Every slot snapshot carries region_enabled: re-announce the region's slots.
            auto nodes = NodesInRegion(tx, req.name());
            if (!nodes.ok()) return nodes.error();
            for (const auto& n : *nodes) {
              if (auto r = ReemitNodeSlots(tx, n, d.cfg.source, ctx.traceparent); !r.ok()) {
                return r.error();
              }
            }
            ctx.log.Info("region changed",
                         {{"region", req.name()}, {"enabled", req.enabled() ? "true" : "false"}});
          }
          v1::SetRegionResponse resp;
          *resp.mutable_region() = RegionFromRow(tx, req.name(), req.enabled());
          return resp;
        });
      });

  rpc.Handle<v1::GetDesiredSlotsRequest, v1::GetDesiredSlotsResponse>(
      "gpuaas.v1.inventory.node.desired.get",
      [d](const v1::GetDesiredSlotsRequest& req,
          rpc::Context&) -> Result<v1::GetDesiredSlotsResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::GetDesiredSlotsResponse> {
          if (auto n = LoadNode(tx, req.node_id(), false); !n.ok()) return n.error();
          v1::GetDesiredSlotsResponse resp;
          auto latest =
              documents::Load(tx, DesiredTables(), req.node_id(), 0, *resp.mutable_desired());
          if (!latest.ok()) {
            if (latest.error().reason == "corrupt_document") {
              latest.error().reason = "corrupt_desired_set";
            }
            return latest.error();
          }
          if (*latest == 0) resp.mutable_desired()->set_node_id(req.node_id());
          return resp;
        });
      });

  rpc.Handle<v1::AckDesiredSlotsRequest, v1::AckDesiredSlotsResponse>(
      "gpuaas.v1.inventory.node.desired.ack",
      [d](const v1::AckDesiredSlotsRequest& req,
          rpc::Context& ctx) -> Result<v1::AckDesiredSlotsResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        // The desired set's ack carries no blockers.
        if (auto v = documents::ValidateAck(req.version(), {}); !v.ok()) return v.error();
        return store::WithTx(*d.pool, [&](pqxx::work& tx) -> Result<v1::AckDesiredSlotsResponse> {
          if (auto n = LoadNode(tx, req.node_id(), false); !n.ok()) return n.error();
          auto r = documents::RecordAck(tx, DesiredTables(), req.node_id(), req.version(), {});
          if (!r.ok()) return r.error();
          v1::AckDesiredSlotsResponse resp;
          resp.set_applied_version(r->applied_version);
          ctx.log.Debug("desired set acked",
                        {{"node_id", req.node_id()}, {"version", std::to_string(req.version())}});
          return resp;
        });
      });

  // Consumers of what node-agents report.
  auto source = cfg.source;
  const std::string node_events = messaging::NodeEventsStream().name;
  auto c1 = svc.StartProjection(
      node_events, kTopologyConsumer, "gpuaas.v1.evt.node.*.topology",
      [source](pqxx::work& tx, const v1::Event& ev) { return ApplyTopologyEvent(tx, ev, source); });
  if (!c1.ok()) return c1.error();
  auto c2 = svc.StartProjection(node_events, kTaskConsumer, "gpuaas.v1.evt.node.*.task.>",
                                ApplyTaskEvent);
  if (!c2.ok()) return c2.error();
  // IPAM drift (lease mismatch/missing/unexpected) degrades the affected slot until resolved.
  auto c3 = svc.StartProjection(messaging::IpamEventsStream().name, kIpamDriftConsumer,
                                "gpuaas.v1.evt.ipam.drift.>",
                                [source](pqxx::work& tx, const v1::Event& ev) {
                                  return ApplyIpamDriftEvent(tx, ev, source);
                                });
  if (!c3.ok()) return c3.error();
  return Ok();
}

}  // namespace gpuaas::inventory
