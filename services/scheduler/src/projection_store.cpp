#include "projection_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <array>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::scheduler {

namespace {

// One row per projected slot with its live claims: what placement needs of it.
const std::string kSlotsQuery =
    std::string(
        "SELECT p.node_id, p.region, p.pool, p.sku, p.slot_key, p.numa, p.pcie_switch, "
        "p.fabric_type, (p.schedulable AND NOT EXISTS (SELECT 1 FROM projected_nodes n WHERE "
        "n.node_id = p.node_id AND n.admin_state <> 'active')), ") +
    kSlotCompleteSql +
    ", EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.released_at IS NULL AND "
    "c.kind = 'slot' AND c.node_id = p.node_id AND c.slot_key = p.slot_key), "
    "EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.released_at IS NULL AND "
    "c.kind = 'node_exclusive' AND c.node_id = p.node_id), p.region_enabled "
    "FROM projected_slots p";

constexpr size_t kNodeColumns = 8;
constexpr size_t kSlotColumns = 26;

// The columns of UpsertProjectedSlots' statement for one slot, in its order.
std::vector<std::string> SlotColumns(const SlotUpsert& u) {
  const v1::SlotSnapshot& snap = *u.snapshot;
  const auto& s = snap.slot();
  return {s.node_id(),
          s.slot_key(),
          snap.region(),
          snap.pool(),
          s.sku(),
          enums::Text(s.admin_state()),
          enums::Text(s.health()),
          snap.schedulable() ? "true" : "false",
          store::TextArrayLiteral({snap.node_blockers().begin(), snap.node_blockers().end()}),
          s.gpu_pci_address(),
          s.locality_group(),
          std::to_string(s.generation()),
          u.event->id(),
          enums::Text(s.fabric_type()),
          std::to_string(s.has_numa_node() ? s.numa_node() : -1),
          s.pcie_switch(),
          snap.region_enabled() ? "true" : "false",
          s.nvme_by_id(),
          enums::Text(s.fabric_claim_mode()),
          s.fabric_vf_pci_address(),
          s.mac(),
          s.private_ip(),
          s.profile().name(),
          std::to_string(s.profile().vcpus_per_gpu()),
          std::to_string(s.profile().memory_mib_per_gpu()),
          std::to_string(s.profile().hugepages_1g_per_gpu())};
}

// A node event from an inventory before host operations carries no admin state: active.
std::string AdminStateText(v1::NodeAdminState s) {
  return s == v1::NODE_ADMIN_STATE_UNSPECIFIED ? std::string("active") : enums::Text(s);
}

}  // namespace

// --- inventory's events -> projection rows -----------------------------------------------------

void UpsertProjectedNodes(pqxx::work& tx, const std::vector<NodeUpsert>& rows) {
  store::ArrayColumns cols(kNodeColumns);
  for (const auto& u : rows) {
    const auto& n = u.snapshot->node();
    cols.Add({n.node_id(), n.hostname(), n.region(), n.pool(), enums::Text(n.capacity_profile()),
              std::to_string(n.generation()), u.event->id(), AdminStateText(n.admin_state())});
  }
  cols.Exec(tx,
            "INSERT INTO projected_nodes (node_id, hostname, region, pool, capacity_profile, "
            "generation, last_event_id, admin_state) SELECT * FROM unnest($1::text[], $2::text[], "
            "$3::text[], $4::text[], $5::text[], $6::bigint[], $7::uuid[], $8::text[]) "
            "ON CONFLICT (node_id) DO UPDATE SET hostname = EXCLUDED.hostname, "
            "region = EXCLUDED.region, pool = EXCLUDED.pool, "
            "capacity_profile = EXCLUDED.capacity_profile, generation = EXCLUDED.generation, "
            "last_event_id = EXCLUDED.last_event_id, admin_state = EXCLUDED.admin_state, "
            "projected_at = now() WHERE projected_nodes.generation < EXCLUDED.generation");
}

void UpsertProjectedSlots(pqxx::work& tx, const std::vector<SlotUpsert>& rows) {
  store::ArrayColumns cols(kSlotColumns);
  for (const auto& u : rows) cols.Add(SlotColumns(u));
  // One statement for the batch: each column an array, unnested into rows. node_blockers
  // travels as an array of array literals.
  cols.Exec(
      tx,
      "INSERT INTO projected_slots (node_id, slot_key, region, pool, sku, admin_state, health, "
      "schedulable, node_blockers, gpu_pci_address, locality_group, generation, last_event_id, "
      "fabric_type, numa, pcie_switch, region_enabled, nvme_by_id, fabric_claim_mode, "
      "fabric_vf_pci_address, mac, private_ip, profile_name, vcpus_per_gpu, memory_mib_per_gpu, "
      "hugepages_1g_per_gpu) "
      "SELECT n, k, r, p, sku, a, h, sch, nb::text[], g, lg, gen, ev, ft, numa, ps, re, nv, fcm, "
      "vf, mac, ip, pn, vc, mem, hp FROM unnest($1::text[], $2::text[], $3::text[], "
      "$4::text[], $5::text[], $6::text[], $7::text[], $8::boolean[], $9::text[], $10::text[], "
      "$11::text[], $12::bigint[], $13::uuid[], $14::text[], $15::integer[], $16::text[], "
      "$17::boolean[], $18::text[], $19::text[], $20::text[], $21::text[], $22::text[], "
      "$23::text[], $24::integer[], $25::bigint[], $26::integer[]) "
      "AS t(n, k, r, p, sku, a, h, sch, nb, g, lg, gen, ev, ft, numa, ps, re, nv, fcm, vf, mac, "
      "ip, pn, vc, mem, hp) "
      "ON CONFLICT (node_id, slot_key) DO UPDATE SET region = EXCLUDED.region, "
      "pool = EXCLUDED.pool, sku = EXCLUDED.sku, admin_state = EXCLUDED.admin_state, "
      "health = EXCLUDED.health, schedulable = EXCLUDED.schedulable, "
      "node_blockers = EXCLUDED.node_blockers, gpu_pci_address = EXCLUDED.gpu_pci_address, "
      "locality_group = EXCLUDED.locality_group, generation = EXCLUDED.generation, "
      "last_event_id = EXCLUDED.last_event_id, fabric_type = EXCLUDED.fabric_type, "
      "numa = EXCLUDED.numa, pcie_switch = EXCLUDED.pcie_switch, "
      "region_enabled = EXCLUDED.region_enabled, nvme_by_id = EXCLUDED.nvme_by_id, "
      "fabric_claim_mode = EXCLUDED.fabric_claim_mode, "
      "fabric_vf_pci_address = EXCLUDED.fabric_vf_pci_address, mac = EXCLUDED.mac, "
      "private_ip = EXCLUDED.private_ip, profile_name = EXCLUDED.profile_name, "
      "vcpus_per_gpu = EXCLUDED.vcpus_per_gpu, memory_mib_per_gpu = EXCLUDED.memory_mib_per_gpu, "
      "hugepages_1g_per_gpu = EXCLUDED.hugepages_1g_per_gpu, projected_at = now() "
      "WHERE projected_slots.generation < EXCLUDED.generation");
}

// --- rebuild ---------------------------------------------------------------------------------

void EmptyProjections(pqxx::work& tx, const char* node_consumer, const char* slot_consumer) {
  tx.exec0("DELETE FROM projected_nodes");
  tx.exec0("DELETE FROM projected_slots");
  tx.exec_params("DELETE FROM inbox WHERE consumer = $1 OR consumer = $2", node_consumer,
                 slot_consumer);
}

ProjectionCounts CountProjections(pqxx::work& tx) {
  auto r = tx.exec1(
      "SELECT (SELECT count(*) FROM projected_nodes), (SELECT count(*) FROM "
      "projected_slots)");
  return {r[0].as<int64_t>(), r[1].as<int64_t>()};
}

// --- node.list / slot.list pages -----------------------------------------------------------

namespace {

constexpr const char* kProjectedNodeColumns =
    "node_id, hostname, region, pool, capacity_profile, generation, last_event_id::text, "
    "extract(epoch from projected_at)::float8, admin_state";

void ProjectedNodeFromRow(const pqxx::row& r, v1::ProjectedNode* n) {
  n->set_node_id(r[0].as<std::string>());
  n->set_hostname(r[1].as<std::string>());
  n->set_region(r[2].as<std::string>());
  n->set_pool(r[3].as<std::string>());
  n->set_capacity_profile(enums::FromColumn<v1::CapacityProfile>(r[4].as<std::string>()));
  n->set_generation(r[5].as<int64_t>());
  n->set_last_event_id(r[6].as<std::string>());
  *n->mutable_projected_at() = google::protobuf::util::TimeUtil::MillisecondsToTimestamp(
      static_cast<int64_t>(r[7].as<double>() * 1000));
  n->set_admin_state(enums::FromColumn<v1::NodeAdminState>(r[8].as<std::string>()));
}

}  // namespace

std::optional<v1::ProjectedNode> ReadProjectedNode(pqxx::work& tx, const std::string& node_id) {
  auto rows = tx.exec_params(
      std::string("SELECT ") + kProjectedNodeColumns + " FROM projected_nodes WHERE node_id = $1",
      node_id);
  if (rows.empty()) return std::nullopt;
  v1::ProjectedNode n;
  ProjectedNodeFromRow(rows[0], &n);
  return n;
}

std::vector<v1::NodeHolder> ReadNodeHolders(pqxx::work& tx, const std::string& node_id) {
  std::vector<v1::NodeHolder> out;
  for (const auto& r : tx.exec_params(
           "SELECT a.allocation_id::text, a.tenant, a.state, a.shape, "
           "COALESCE(array_agg(c.slot_key ORDER BY c.slot_key) FILTER (WHERE c.kind = 'slot'), "
           "'{}'), extract(epoch from a.created_at)::float8 "
           "FROM allocation_resource_claims c JOIN allocations a USING (allocation_id) "
           "WHERE c.node_id = $1 AND c.released_at IS NULL GROUP BY a.allocation_id "
           "ORDER BY a.created_at, a.allocation_id",
           node_id)) {
    v1::NodeHolder h;
    h.set_allocation_id(r[0].as<std::string>());
    h.set_tenant(r[1].as<std::string>());
    h.set_state(enums::FromColumn<v1::AllocationState>(r[2].as<std::string>()));
    h.set_shape(enums::FromColumn<v1::CapacityShape>(r[3].as<std::string>()));
    for (auto& key : store::TextArray(r[4])) h.add_slot_keys(std::move(key));
    *h.mutable_created_at() = google::protobuf::util::TimeUtil::MillisecondsToTimestamp(
        static_cast<int64_t>(r[5].as<double>() * 1000));
    out.push_back(std::move(h));
  }
  return out;
}

std::optional<int64_t> DrainingNodeEmptied(pqxx::work& tx, const std::string& node_id) {
  // One at a time per node, across the releases of its last claims and the projection of its
  // drain: each sees what the one before it committed, so the last one to finish sees the node
  // empty (READ COMMITTED: the next statement's snapshot is taken after the lock).
  tx.exec_params("SELECT pg_advisory_xact_lock(hashtextextended('node-claims/' || $1, 0))",
                 node_id);
  auto r = tx.exec_params(
      "SELECT n.generation FROM projected_nodes n WHERE n.node_id = $1 AND n.admin_state = "
      "'draining' AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE "
      "c.released_at IS NULL AND c.node_id = n.node_id)",
      node_id);
  if (r.empty()) return std::nullopt;
  return r[0][0].as<int64_t>();
}

v1::ListProjectedNodesResponse ReadNodePage(pqxx::work& tx, const std::string& region,
                                            const std::string& after, int limit) {
  auto rows = tx.exec_params(
      std::string("SELECT ") + kProjectedNodeColumns +
          " FROM projected_nodes WHERE ($1 = '' OR region = $1) AND node_id > $2 ORDER BY "
          "node_id LIMIT $3",
      region, after, limit + 1);
  v1::ListProjectedNodesResponse resp;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
    ProjectedNodeFromRow(rows[i], resp.add_nodes());
  }
  if (static_cast<int>(rows.size()) > limit) {
    resp.set_next_page_token(resp.nodes(limit - 1).node_id());
  }
  return resp;
}

namespace {

// One row of ReadSlotPage's query.
void SlotFromRow(const pqxx::row& r, v1::ProjectedSlot* p) {
  p->set_node_id(r[0].as<std::string>());
  p->set_slot_key(r[1].as<std::string>());
  p->set_region(r[2].as<std::string>());
  p->set_pool(r[3].as<std::string>());
  p->set_sku(r[4].as<std::string>());
  p->set_admin_state(enums::FromColumn<v1::SlotAdminState>(r[5].as<std::string>()));
  p->set_health(enums::FromColumn<v1::SlotHealth>(r[6].as<std::string>()));
  p->set_schedulable(r[7].as<bool>());
  const auto b = r[8].as<std::string>();
  for (size_t start = 0; start < b.size();) {
    const size_t comma = std::min(b.find(',', start), b.size());
    p->add_node_blockers(b.substr(start, comma - start));
    start = comma + 1;
  }
  p->set_generation(r[9].as<int64_t>());
  p->set_gpu_pci_address(r[10].as<std::string>());
  p->set_locality_group(r[11].as<std::string>());
  // A claim's phase is the slot's lifecycle; a free slot shows its admin state.
  const auto phase = r[12].as<std::string>();
  p->set_lifecycle(
      enums::FromColumn<v1::SlotLifecycleState>(phase.empty() ? r[5].as<std::string>() : phase));
  p->set_allocation_id(r[13].as<std::string>());
}

}  // namespace

v1::ListProjectedSlotsResponse ReadSlotPage(pqxx::work& tx, const std::string& node_id,
                                            const std::string& region,
                                            const std::string& after_node,
                                            const std::string& after_slot, int limit) {
  // The page first (a primary-key range), then each of its slots' live claim by one
  // probe (LIMIT 1 keeps the planner from turning the probes into a scan of every
  // claim, whatever it estimates for the page).
  auto rows = tx.exec_params(
      "SELECT p.node_id, p.slot_key, p.region, p.pool, p.sku, p.admin_state, p.health, "
      "p.schedulable, array_to_string(p.node_blockers, ','), p.generation, "
      "p.gpu_pci_address, p.locality_group, COALESCE(c.phase, ''), "
      "COALESCE(c.allocation_id::text, '') FROM (SELECT * FROM projected_slots p "
      "WHERE ($1 = '' OR p.node_id = $1) AND ($2 = '' OR p.region = $2) "
      "AND (p.node_id, p.slot_key) > ($3, $4) ORDER BY p.node_id, p.slot_key LIMIT $5) p "
      "LEFT JOIN LATERAL (SELECT phase, allocation_id FROM allocation_resource_claims c "
      "WHERE c.released_at IS NULL AND c.kind = 'slot' AND c.node_id = p.node_id AND "
      "c.slot_key = p.slot_key LIMIT 1) c ON true ORDER BY p.node_id, p.slot_key",
      node_id, region, after_node, after_slot, limit + 1);
  v1::ListProjectedSlotsResponse resp;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
    SlotFromRow(rows[i], resp.add_slots());
  }
  if (static_cast<int>(rows.size()) > limit) {
    const auto& last = resp.slots(limit - 1);
    resp.set_next_page_token(last.node_id() + "/" + last.slot_key());
  }
  return resp;
}

// --- the placement index's reads -------------------------------------------------------------

std::optional<std::string> LastNodeOfSlotPage(pqxx::transaction_base& tx,
                                              const std::string& after) {
  auto last = tx.exec_params(
      "SELECT max(node_id) FROM (SELECT DISTINCT node_id FROM projected_slots WHERE node_id > "
      "$1 ORDER BY node_id LIMIT 2000) page",
      after);
  if (last.empty() || last[0][0].is_null()) return std::nullopt;
  return last[0][0].as<std::string>();
}

pqxx::result ReadPlacementSlotsInRange(pqxx::transaction_base& tx, const std::string& after,
                                       const std::string& upto) {
  return tx.exec_params(kSlotsQuery +
                            " WHERE p.node_id > $1 AND p.node_id <= $2 ORDER BY "
                            "p.node_id, p.slot_key",
                        after, upto);
}

pqxx::result ReadPlacementSlotsOfNodes(pqxx::transaction_base& tx,
                                       const std::vector<std::string>& node_ids) {
  // Each node by its own primary-key probe: `node_id = ANY(...)` over a young table without
  // statistics (a new replica, a rebuild) was planned as a parallel sequential scan of every
  // slot per notification. OFFSET 0 keeps the per-node subquery from being flattened into a
  // join the planner could again answer with a scan.
  return store::Prepared(tx,
                         "SELECT s.* FROM unnest($1::text[]) AS wanted(id) CROSS JOIN LATERAL (" +
                             kSlotsQuery + " WHERE p.node_id = wanted.id OFFSET 0) s ORDER BY 1, 5",
                         store::TextArrayLiteral(node_ids));
}

pqxx::result ReadPlacementSlotsOfSku(pqxx::transaction_base& tx, const std::string& region,
                                     const std::string& pool, const std::string& sku) {
  return tx.exec_params(
      kSlotsQuery + " WHERE p.region = $1 AND ($2 = '' OR p.pool = $2) AND p.sku = $3", region,
      pool, sku);
}

void PingConnection(pqxx::connection_base& c) { pqxx::nontransaction(c).exec("SELECT 1"); }

void Notify(pqxx::connection_base& c, const char* channel, const std::string& payload) {
  pqxx::nontransaction(c).exec_params("SELECT pg_notify($1, $2)", channel, payload);
}

}  // namespace gpuaas::scheduler
