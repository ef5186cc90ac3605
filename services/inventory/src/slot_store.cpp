#include "slot_store.hpp"

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::inventory {

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
    return Error::Internal(reason::kCorruptSnapshot, r.error().message);
  }
  s.received_at = rows[0][2].as<double>();
  return std::optional<Snapshot>(std::move(s));
}

std::optional<LatestSnapshotBlockers> LoadLatestSnapshotBlockers(pqxx::work& tx,
                                                                 const std::string& node_id) {
  auto snap = tx.exec_params(
      "SELECT version, array_to_string(node_blockers, ',') FROM topology_snapshots "
      "WHERE node_id = $1 ORDER BY version DESC LIMIT 1",
      node_id);
  if (snap.empty()) return std::nullopt;
  LatestSnapshotBlockers out;
  out.version = snap[0][0].as<int64_t>();
  const auto joined = snap[0][1].as<std::string>();
  size_t start = 0;
  while (start < joined.size()) {
    const size_t comma = joined.find(',', start);
    const size_t end = comma == std::string::npos ? joined.size() : comma;
    if (end > start) out.blockers.push_back(joined.substr(start, end - start));
    start = end + 1;
  }
  return out;
}

bool HasSnapshotDiscoveredAfter(pqxx::work& tx, const std::string& node_id,
                                const std::string& discovered_at) {
  auto newer = tx.exec_params(
      "SELECT 1 FROM topology_snapshots WHERE node_id = $1 AND report ? 'discovered_at' AND "
      "(report->>'discovered_at')::timestamptz > $2::timestamptz LIMIT 1",
      node_id, discovered_at);
  return !newer.empty();
}

void InsertSnapshot(pqxx::work& tx, const std::string& node_id, int64_t version,
                    const std::string& event_id, const v1::TopologyReport& report) {
  tx.exec_params(
      "INSERT INTO topology_snapshots (node_id, version, event_id, report, node_blockers) "
      "VALUES ($1, $2, $3, $4::jsonb, $5::text[])",
      node_id, version, event_id, protojson::ToJson(report),
      store::TextArrayLiteral({report.node_blockers().begin(), report.node_blockers().end()}));
}

Result<std::map<std::string, v1::Slot>> LoadSlots(pqxx::work& tx, const std::string& node_id) {
  std::map<std::string, v1::Slot> out;
  for (const auto& r : tx.exec_params("SELECT slot_key, doc::text FROM node_resource_slots WHERE "
                                      "node_id = $1 ORDER BY slot_key",
                                      node_id)) {
    v1::Slot s;
    if (auto p = protojson::FromJson(r[1].as<std::string>(), &s); !p.ok()) {
      return Error::Internal(reason::kCorruptSlot, p.error().message);
    }
    out[r[0].as<std::string>()] = std::move(s);
  }
  return out;
}

bool SlotExists(pqxx::work& tx, const std::string& node_id, const std::string& slot_key) {
  auto r = tx.exec_params("SELECT 1 FROM node_resource_slots WHERE node_id = $1 AND slot_key = $2",
                          node_id, slot_key);
  return !r.empty();
}

std::optional<int64_t> LockSlotGeneration(pqxx::work& tx, const std::string& node_id,
                                          const std::string& slot_key) {
  auto cur = tx.exec_params(
      "SELECT generation FROM node_resource_slots WHERE node_id = $1 AND slot_key = $2 FOR UPDATE",
      node_id, slot_key);
  if (cur.empty()) return std::nullopt;
  return cur[0][0].as<int64_t>();
}

void UpsertSlot(pqxx::work& tx, const v1::Slot& slot, bool schedulable) {
  tx.exec_params(
      "INSERT INTO node_resource_slots (node_id, slot_key, admin_state, health, sku, gpu_model, "
      "nvme_by_id, fabric_vf_pci_address, schedulable, generation, doc, updated_at) "
      "VALUES ($1,$2,$3,$4,$5,$6,$7,$8,$9,$10,$11::jsonb, now()) "
      "ON CONFLICT (node_id, slot_key) DO UPDATE SET admin_state = EXCLUDED.admin_state, "
      "health = EXCLUDED.health, sku = EXCLUDED.sku, gpu_model = EXCLUDED.gpu_model, "
      "nvme_by_id = EXCLUDED.nvme_by_id, fabric_vf_pci_address = EXCLUDED.fabric_vf_pci_address, "
      "schedulable = EXCLUDED.schedulable, generation = EXCLUDED.generation, doc = EXCLUDED.doc, "
      "updated_at = now()",
      slot.node_id(), slot.slot_key(), enums::Text(slot.admin_state()), enums::Text(slot.health()),
      slot.sku(), slot.gpu_model(), slot.nvme_by_id(), slot.fabric_vf_pci_address(), schedulable,
      slot.generation(), protojson::ToJson(slot));
}

std::set<std::string> WipedDisks(pqxx::work& tx, const std::string& node_id) {
  std::set<std::string> out;
  for (const auto& r :
       tx.exec_params("SELECT nvme_by_id FROM wipe_proofs WHERE node_id = $1", node_id)) {
    out.insert(r[0].as<std::string>());
  }
  return out;
}

double UpsertWipeProof(pqxx::work& tx, const std::string& node_id, const std::string& nvme_by_id,
                       const std::string& method, const std::string& evidence,
                       const std::string& recorded_by) {
  auto r = tx.exec_params(
      "INSERT INTO wipe_proofs (node_id, nvme_by_id, method, evidence, recorded_by) "
      "VALUES ($1, $2, $3, $4, $5) ON CONFLICT (node_id, nvme_by_id) DO UPDATE SET "
      "method = EXCLUDED.method, evidence = EXCLUDED.evidence, "
      "recorded_by = EXCLUDED.recorded_by, recorded_at = now() "
      "RETURNING extract(epoch from recorded_at)::float8",
      node_id, nvme_by_id, method, evidence, recorded_by);
  return r[0][0].as<double>();
}

std::optional<int64_t> LockIpamDriftMark(pqxx::work& tx, const std::string& node_id,
                                         const std::string& slot_key) {
  auto seen = tx.exec_params(
      "SELECT generation FROM ipam_drift_marks WHERE node_id = $1 AND slot_key = $2 FOR UPDATE",
      node_id, slot_key);
  if (seen.empty()) return std::nullopt;
  return seen[0][0].as<int64_t>();
}

void SaveIpamDriftMark(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                       int64_t generation) {
  tx.exec_params(
      "INSERT INTO ipam_drift_marks (node_id, slot_key, generation) VALUES ($1, $2, $3) "
      "ON CONFLICT (node_id, slot_key) DO UPDATE SET generation = EXCLUDED.generation",
      node_id, slot_key, generation);
}

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

}  // namespace gpuaas::inventory
