#include "allocation_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "allocation_rows.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/allocations.hpp"
#include "lifecycle.hpp"
#include "projection_store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Timestamp Ts(double epoch) {
  return TimeUtil::MillisecondsToTimestamp(static_cast<int64_t>(epoch * 1000));
}

constexpr const char* kAllocColumns =
    "allocation_id::text, tenant, request_id, sku, shape, gpu_count, region, pool, network_mode, "
    "state, node_id, failure_stage, failure_code, failure_detail, generation, "
    "extract(epoch from created_at)::float8, extract(epoch from updated_at)::float8, attempt, "
    "image, net_domain, net_mac, net_expected_ip, net_actual_ip, net_lease_state, release_actor, "
    "release_actor_tenant, release_reason, vm_ready, app, release_actor_roles, release_token_id, "
    "billable_unit";

void AddEndpoints(pqxx::work& tx, v1::Allocation& a) {
  for (const auto& e : store::Prepared(
           tx,
           "SELECT name, protocol, port, exposure_id, public_ip, public_port, state, reason, "
           "connect FROM allocation_endpoints WHERE allocation_id = $1 ORDER BY name",
           a.allocation_id())) {
    auto* ep = a.add_endpoints();
    ep->set_name(e[0].as<std::string>());
    ep->set_protocol(enums::FromColumn<v1::TransportProtocol>(e[1].as<std::string>()));
    ep->set_port(e[2].as<int32_t>());
    ep->set_exposure_id(e[3].as<std::string>());
    ep->set_public_ip(e[4].as<std::string>());
    ep->set_public_port(e[5].as<int32_t>());
    ep->set_state(enums::FromColumn<v1::ExposureState>(e[6].as<std::string>()));
    ep->set_reason(e[7].as<std::string>());
    ep->set_connect(e[8].as<std::string>());
  }
}

void AddClaims(pqxx::work& tx, v1::Allocation& a) {
  for (const auto& c : store::Prepared(
           tx,
           "SELECT node_id, slot_key, kind, extract(epoch from claimed_at)::float8, "
           "extract(epoch from released_at)::float8, phase FROM allocation_resource_claims "
           "WHERE allocation_id = $1 ORDER BY slot_key",
           a.allocation_id())) {
    auto* pc = a.add_claims();
    pc->set_allocation_id(a.allocation_id());
    pc->set_node_id(c[0].as<std::string>());
    pc->set_slot_key(c[1].as<std::string>());
    pc->set_kind(enums::FromColumn<v1::ClaimKind>(c[2].as<std::string>()));
    *pc->mutable_claimed_at() = Ts(c[3].as<double>());
    if (!c[4].is_null()) *pc->mutable_released_at() = Ts(c[4].as<double>());
    pc->set_phase(enums::FromColumn<v1::ClaimPhase>(c[5].as<std::string>()));
    if (c[4].is_null() && pc->kind() == v1::CLAIM_KIND_SLOT) a.add_slot_keys(pc->slot_key());
  }
}

// A row of kAllocColumns, with its endpoints and claims.
v1::Allocation FromRow(pqxx::work& tx, const pqxx::row& r) {
  v1::Allocation a;
  a.set_allocation_id(r[0].as<std::string>());
  a.set_tenant(r[1].as<std::string>());
  a.set_request_id(r[2].as<std::string>());
  a.set_sku(r[3].as<std::string>());
  a.set_shape(enums::FromColumn<v1::CapacityShape>(r[4].as<std::string>()));
  a.set_gpu_count(r[5].as<int>());
  a.set_region(r[6].as<std::string>());
  a.set_pool(r[7].as<std::string>());
  a.set_network_mode(enums::FromColumn<v1::NetworkMode>(r[8].as<std::string>()));
  a.set_state(enums::FromColumn<v1::AllocationState>(r[9].as<std::string>()));
  a.set_node_id(r[10].as<std::string>());
  if (!r[12].as<std::string>().empty()) {
    a.mutable_failure()->set_stage(enums::FromColumn<v1::LifecycleStage>(r[11].as<std::string>()));
    a.mutable_failure()->set_code(r[12].as<std::string>());
    a.mutable_failure()->set_detail(r[13].as<std::string>());
  }
  a.set_generation(r[14].as<int64_t>());
  *a.mutable_created_at() = Ts(r[15].as<double>());
  *a.mutable_updated_at() = Ts(r[16].as<double>());
  a.set_attempt(r[17].as<int>());
  a.set_image(r[18].as<std::string>());
  if (!r[19].as<std::string>().empty()) {
    auto* n = a.mutable_network();
    n->set_domain_name(r[19].as<std::string>());
    n->set_mac(r[20].as<std::string>());
    n->set_expected_ip(r[21].as<std::string>());
    n->set_actual_ip(r[22].as<std::string>());
    n->set_lease_state(enums::FromColumn<v1::LeaseState>(r[23].as<std::string>()));
  }
  if (!r[24].as<std::string>().empty()) {
    auto* by = a.mutable_release_requested_by();
    by->set_subject(r[24].as<std::string>());
    by->set_tenant(r[25].as<std::string>());
    by->set_reason(r[26].as<std::string>());
    for (auto& role : store::TextArray(r[29])) by->add_roles(std::move(role));
    by->set_token_id(r[30].as<std::string>());
  }
  a.set_vm_ready(r[27].as<bool>());
  a.set_app(r[28].as<std::string>());
  a.set_billable_unit(enums::FromColumn<v1::BillableUnit>(r[31].as<std::string>()));
  AddEndpoints(tx, a);
  AddClaims(tx, a);
  return a;
}

}  // namespace

// --- allocation_rows.hpp ---------------------------------------------------------------------

Result<v1::Allocation> LoadAllocation(pqxx::work& tx, const std::string& id, bool lock,
                                      const std::string& tenant_scope) {
  if (!ids::IsUuid(id)) {
    return Error::InvalidArgument(reason::kInvalidAllocationId,
                                  "allocation ids are UUIDs: '" + id + "'",
                                  {{"allocation_id", "must be a UUID"}});
  }
  auto r = store::Prepared(tx,
                           fmt::format("SELECT {} FROM allocations WHERE allocation_id = $1{}",
                                       kAllocColumns, lock ? " FOR UPDATE" : ""),
                           id);
  if (r.empty() || (!tenant_scope.empty() && r[0][1].as<std::string>() != tenant_scope)) {
    return Error::Of(Code::kNotFound, reason::kAllocationNotFound, "no allocation " + id,
                     {{"allocation_id", id}});
  }
  return FromRow(tx, r[0]);
}

Result<void> Announce(pqxx::work& tx, const v1::Allocation& a, const std::string& source,
                      const std::string& traceparent) {
  v1::AllocationSnapshot snap;
  *snap.mutable_allocation() = a;
  auto ev = outbox::Append(
      tx, {fmt::format("gpuaas.v1.evt.scheduler.allocation.{state}",
                       fmt::arg("state", enums::Text(a.state()))),
           "", source, a.allocation_id(), a.generation(), a.allocation_id(), traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return Ok();
}

Result<void> AnnounceIfEmptied(pqxx::work& tx, const std::string& node_id,
                               const std::string& source, const std::string& traceparent) {
  if (node_id.empty()) return Ok();
  const auto generation = DrainingNodeEmptied(tx, node_id);
  if (!generation) return Ok();
  v1::NodeEmptied emptied;
  emptied.set_node_id(node_id);
  emptied.set_generation(*generation);
  auto ev = outbox::Append(tx, {"gpuaas.v1.evt.scheduler.node.emptied", "", source, node_id,
                                *generation, node_id, traceparent, &emptied});
  if (!ev.ok()) return ev.error();
  return Ok();
}

std::optional<v1::Allocation> FindByRequest(pqxx::work& tx, const std::string& tenant,
                                            const std::string& request_id) {
  // The tenant as a parameter the planner cannot see: with statistics older than the tenant's
  // allocations (a new tenant, or one busy since the last ANALYZE) it took `tenant = 'x'` for
  // one row and walked allocations_tenant, reading every allocation of the tenant per create
  // (755 of them in a benchmark, 0.18 ms per create and growing); the unique key's index is
  // the only plan that does not grow.
  auto r = store::Prepared(
      tx,
      fmt::format("SELECT {} FROM allocations WHERE tenant = (SELECT $1::text) AND request_id = $2",
                  kAllocColumns),
      tenant, request_id);
  if (r.empty()) return std::nullopt;
  return FromRow(tx, r[0]);
}

void AddTimeline(pqxx::work& tx, const std::string& allocation_id, const Step& s) {
  store::Prepared(
      tx,
      "INSERT INTO allocation_timeline (allocation_id, step, state, task_id, task_type, stage, "
      "code, detail, percent) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
      allocation_id, enums::Text(s.step), enums::Text(s.state), s.task_id, enums::Text(s.task_type),
      enums::Text(s.stage), s.code, s.detail, s.percent);
}

// --- create ------------------------------------------------------------------------------------

void LockRequestId(pqxx::work& tx, const std::string& tenant, const std::string& request_id) {
  store::Prepared(tx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                  "allocation.create\x1f" + tenant + "\x1f" + request_id);
}

bool RegionHasOnlyDisabledSlots(pqxx::work& tx, const std::string& region) {
  auto r = tx.exec_params(
      "SELECT count(*), count(*) FILTER (WHERE region_enabled) FROM projected_slots "
      "WHERE region = $1",
      region);
  return r[0][0].as<int64_t>() > 0 && r[0][1].as<int64_t>() == 0;
}

void SetLockTimeout(pqxx::work& tx, int ms) {
  tx.exec0(fmt::format("SET LOCAL lock_timeout = '{}ms'", ms));
}

void ClearLockTimeout(pqxx::work& tx) { tx.exec0("SET LOCAL lock_timeout = 0"); }

// Plain SQL savepoints: a pqxx 6 subtransaction whose statements all go through exec_params
// never sends its SAVEPOINT, so its abort undid nothing and a lock timeout failed the whole
// create.
void BeginChoice(pqxx::work& tx) { tx.exec0("SAVEPOINT choice"); }

void KeepChoice(pqxx::work& tx) { tx.exec0("RELEASE SAVEPOINT choice"); }

void AbandonChoice(pqxx::work& tx) {
  tx.exec0("ROLLBACK TO SAVEPOINT choice; RELEASE SAVEPOINT choice");
}

NodeShare ShareNode(pqxx::work& tx, const std::string& node_id, bool skip) {
  // Under the row's share lock the admin state cannot change before this transaction ends: a
  // drain projected before it is seen, one projected after it waits for it.
  auto r = store::Prepared(
      tx,
      fmt::format("SELECT admin_state = 'active' FROM projected_nodes WHERE node_id = $1 FOR "
                  "SHARE{}",
                  skip ? " SKIP LOCKED" : ""),
      node_id);
  if (r.empty()) return NodeShare::kHeld;
  return r[0][0].as<bool>() ? NodeShare::kShared : NodeShare::kNotActive;
}

int LockSchedulableSlots(pqxx::work& tx, const std::string& node_id, const std::string& slot_keys,
                         bool skip) {
  // In slot order: two waiting placers lock overlapping slots in the same order. Only slots
  // still schedulable and complete count: a proposal from an index that has not yet applied a
  // slot's change (an incomplete binding) must not place on it.
  return static_cast<int>(
      store::Prepared(
          tx,
          fmt::format("SELECT p.slot_key FROM projected_slots p WHERE p.node_id = $1 AND "
                      "p.slot_key = ANY($2::text[]) AND p.schedulable AND {} ORDER BY p.slot_key "
                      "FOR UPDATE{}",
                      kSlotCompleteSql, skip ? " SKIP LOCKED" : ""),
          node_id, slot_keys)
          .size());
}

bool SlotsClaimed(pqxx::work& tx, const std::string& node_id, const std::string& slot_keys) {
  return !store::Prepared(tx,
                          "SELECT 1 FROM allocation_resource_claims WHERE released_at IS NULL "
                          "AND node_id = $1 AND (slot_key = ANY($2::text[]) OR kind = "
                          "'node_exclusive') LIMIT 1",
                          node_id, slot_keys)
              .empty();
}

std::vector<std::string> BaremetalCandidates(pqxx::work& tx, const std::string& region,
                                             const std::string& pool, int limit) {
  // An active node in baremetal mode (its devices given back to their host drivers: node.mode)
  // with no live claim of any kind; fewer approved slots first.
  auto rows = tx.exec_params(
      "SELECT n.node_id FROM projected_nodes n WHERE n.region = $1 AND ($2 = '' OR n.pool = $2) "
      "AND n.admin_state = 'active' AND n.capacity_profile = 'baremetal' "
      "AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.released_at IS NULL "
      "AND c.node_id = n.node_id) AND NOT EXISTS (SELECT 1 FROM projected_slots s WHERE "
      "s.node_id = n.node_id AND NOT s.region_enabled) "
      "ORDER BY (SELECT count(*) FROM projected_slots s WHERE s.node_id = n.node_id), n.node_id "
      "LIMIT $3",
      region, pool, limit);
  std::vector<std::string> out;
  out.reserve(rows.size());
  for (const auto& r : rows) out.push_back(r[0].as<std::string>());
  return out;
}

bool LockNodeExclusive(pqxx::work& tx, const std::string& node_id) {
  // The admin state read under the row lock: a drain projected meanwhile is seen.
  return !tx.exec_params(
                "SELECT 1 FROM projected_nodes WHERE node_id = $1 AND admin_state = 'active' FOR "
                "UPDATE SKIP LOCKED",
                node_id)
              .empty();
}

bool NodeClaimed(pqxx::work& tx, const std::string& node_id) {
  return !tx.exec_params(
                "SELECT 1 FROM allocation_resource_claims WHERE released_at IS NULL AND node_id "
                "= $1 LIMIT 1",
                node_id)
              .empty();
}

std::vector<RegionCapacity> ReadRegionCapacity(pqxx::work& tx) {
  // A free slot: schedulable, complete, in an enabled region, no live claim on it nor on its
  // whole node (CountFree's rule). Baremetal: the GPUs (slots) of active baremetal-mode nodes in
  // an enabled region with no live claim of any kind (where baremetal can go:
  // BaremetalCandidates).
  auto r = store::Prepared(
      tx,
      std::string("WITH slots AS (SELECT p.region, p.sku, p.node_id, p.region_enabled, "
                  "(p.schedulable AND p.region_enabled AND ") +
          kSlotCompleteSql +
          " AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.released_at IS "
          "NULL AND c.node_id = p.node_id AND (c.slot_key = p.slot_key OR c.kind = "
          "'node_exclusive'))) AS free, (p.region_enabled AND EXISTS (SELECT 1 FROM "
          "projected_nodes n WHERE n.node_id = p.node_id AND n.capacity_profile = 'baremetal' AND "
          "n.admin_state = 'active') AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c "
          "WHERE c.released_at IS NULL AND c.node_id = p.node_id)) AS whole FROM projected_slots "
          "p), per_node AS (SELECT region, sku, node_id, bool_or(region_enabled) AS enabled, "
          "count(*) FILTER (WHERE free) AS n, count(*) FILTER (WHERE whole) AS w FROM slots "
          "GROUP BY 1, 2, 3) SELECT region, sku, bool_or(enabled), COALESCE(sum(n), 0)::bigint, "
          "COALESCE(max(n), 0)::bigint, COALESCE(sum(w), 0)::bigint, COALESCE(max(w), 0)::bigint "
          "FROM per_node GROUP BY 1, 2 ORDER BY 1, 2");
  std::vector<RegionCapacity> out;
  out.reserve(r.size());
  for (const auto& row : r) {
    RegionCapacity c;
    c.region = row[0].as<std::string>();
    c.sku = row[1].as<std::string>();
    c.region_enabled = row[2].as<bool>();
    c.free_gpus = row[3].as<int64_t>();
    c.max_on_one_node = row[4].as<int64_t>();
    c.free_on_clean_nodes = row[5].as<int64_t>();
    c.max_on_one_clean_node = row[6].as<int64_t>();
    out.push_back(std::move(c));
  }
  return out;
}

PlacementCache::FreeCounts CountFree(pqxx::work& tx, const std::string& region,
                                     const std::string& pool, const std::string& sku,
                                     const std::string& fabric_type, int gpus) {
  auto r = tx.exec_params(
      std::string("WITH free AS (SELECT p.*, ") + kSlotCompleteSql +
          " AS complete FROM projected_slots p WHERE p.region = $1 AND "
          "($2 = '' OR p.pool = $2) AND p.schedulable AND NOT EXISTS (SELECT 1 FROM "
          "allocation_resource_claims c WHERE c.released_at IS NULL AND c.node_id = p.node_id AND "
          "(c.slot_key = p.slot_key OR c.kind = 'node_exclusive'))), "
          "per_node AS (SELECT node_id, count(*) FILTER (WHERE complete AND sku = $3 AND ($4 = '' "
          "OR "
          "fabric_type = $4)) AS fit, count(*) FILTER (WHERE sku = $3 AND $4 <> '' AND "
          "fabric_type <> $4) AS wrong_fabric FROM free GROUP BY node_id) "
          "SELECT (SELECT count(*) FROM free), (SELECT count(*) FROM free WHERE sku = $3), "
          "(SELECT COALESCE(sum(fit), 0) FROM per_node), (SELECT COALESCE(max(fit), 0) FROM "
          "per_node), "
          "(SELECT count(*) FROM per_node WHERE fit >= $5), "
          "(SELECT count(*) FROM per_node WHERE wrong_fabric > 0), "
          "(SELECT count(*) FROM projected_slots WHERE region = $1 AND NOT schedulable), "
          "(SELECT count(*) FROM free WHERE NOT complete)",
      region, pool, sku, fabric_type, gpus);
  const auto& x = r[0];
  PlacementCache::FreeCounts c;
  c.free_in_region = x[0].as<int64_t>();
  c.free_of_sku = x[1].as<int64_t>();
  c.matching = x[2].as<int64_t>();
  c.max_on_one_node = x[3].as<int64_t>();
  c.nodes_with_enough = x[4].as<int64_t>();
  c.nodes_with_wrong_fabric = x[5].as<int64_t>();
  c.unschedulable_in_region = x[6].as<int64_t>();
  c.incomplete = x[7].as<int64_t>();
  return c;
}

void InsertAllocation(pqxx::work& tx, const NewAllocation& a) {
  store::Prepared(tx,
                  "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, "
                  "gpu_count, region, pool, network_mode, state, node_id, generation, "
                  "billable_unit) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 'reserved', $10, 1, "
                  "$11)",
                  a.id, a.tenant, a.request_id, a.sku, enums::Text(a.shape), a.gpu_count, a.region,
                  a.pool, enums::Text(a.network_mode), a.node_id, enums::Text(a.billable_unit));
}

void SetAllocationApp(pqxx::work& tx, const std::string& allocation_id, const std::string& app) {
  store::Prepared(tx, "UPDATE allocations SET app = $2 WHERE allocation_id = $1", allocation_id,
                  app);
}

void InsertEndpoint(pqxx::work& tx, const std::string& allocation_id,
                    const v1::EndpointRequest& endpoint) {
  store::Prepared(tx,
                  "INSERT INTO allocation_endpoints (allocation_id, name, protocol, port) VALUES "
                  "($1, $2, $3, $4)",
                  allocation_id, endpoint.name(), enums::Text(endpoint.protocol()),
                  endpoint.port());
}

void InsertExclusiveClaim(pqxx::work& tx, const std::string& allocation_id,
                          const std::string& node_id) {
  store::Prepared(tx,
                  "INSERT INTO allocation_resource_claims (allocation_id, node_id, kind) VALUES "
                  "($1, $2, 'node_exclusive')",
                  allocation_id, node_id);
}

void InsertSlotClaims(pqxx::work& tx, const std::string& allocation_id, const std::string& node_id,
                      const std::vector<std::string>& slot_keys) {
  store::Prepared(tx,
                  "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_key, "
                  "kind) "
                  "SELECT $1, $2, unnest($3::text[]), 'slot'",
                  allocation_id, node_id, store::TextArrayLiteral(slot_keys));
}

// --- reads -----------------------------------------------------------------------------------

AllocationPage ListAllocations(pqxx::work& tx, const std::string& tenant, const std::string& state,
                               const std::string& after, int limit) {
  auto rows = tx.exec_params(
      fmt::format("SELECT {} FROM allocations WHERE ($1 = '' OR tenant = $1) AND "
                  "($2 = '' OR state = $2) AND ($3 = '' OR allocation_id > $3::uuid) "
                  "ORDER BY allocation_id LIMIT $4",
                  kAllocColumns),
      tenant, state, after, limit + 1);
  AllocationPage page;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
    page.allocations.push_back(FromRow(tx, rows[i]));
  }
  page.more = static_cast<int>(rows.size()) > limit;
  return page;
}

// --- allocations.hpp -------------------------------------------------------------------------

std::vector<std::string> CheckInvariants(pqxx::work& tx) {
  std::vector<std::string> out;
  // The gauges' counts (allocation_state_counts, kept by a trigger) are the table's.
  for (const auto& r :
       tx.exec("SELECT COALESCE(a.state, c.state), COALESCE(a.n, 0), COALESCE(c.n, 0) FROM "
               "(SELECT state, count(*) AS n FROM allocations GROUP BY state) a FULL JOIN "
               "(SELECT state, sum(n) AS n FROM allocation_state_counts GROUP BY state) c "
               "USING (state) WHERE COALESCE(a.n, 0) <> COALESCE(c.n, 0)")) {
    out.push_back(fmt::format("{} allocations are {}, but the counts say {}", r[1].as<int64_t>(),
                              r[0].as<std::string>(), r[2].as<int64_t>()));
  }
  for (const auto& r :
       tx.exec("SELECT node_id, slot_key FROM allocation_resource_claims WHERE released_at IS NULL "
               "AND kind = 'slot' GROUP BY 1, 2 HAVING count(*) > 1")) {
    out.push_back("slot " + r[0].as<std::string>() + "/" + r[1].as<std::string>() +
                  " has two live claims");
  }
  for (const auto& r : tx.exec(
           "SELECT node_id FROM allocation_resource_claims WHERE released_at IS NULL GROUP BY 1 "
           "HAVING bool_or(kind = 'node_exclusive') AND count(*) > 1")) {
    out.push_back("node " + r[0].as<std::string>() + " has an exclusive claim and others");
  }
  // Claim phases follow the allocation's state, as the lifecycle table allows them
  // (lifecycle::LiveClaimPhases): a released or pending allocation holds nothing, a failed one
  // only slots awaiting cleanup proof.
  std::vector<std::string> allowed;
  for (auto st : lifecycle::AllStates()) {
    for (auto ph : lifecycle::LiveClaimPhases(st)) {
      allowed.push_back(fmt::format("('{}','{}')", enums::Text(st), enums::Text(ph)));
    }
  }
  for (const auto& r : tx.exec(fmt::format(
           "SELECT DISTINCT c.allocation_id::text, a.state, c.phase FROM "
           "allocation_resource_claims c JOIN allocations a USING (allocation_id) WHERE "
           "c.released_at IS NULL AND (a.state, c.phase) NOT IN ({})",
           fmt::join(allowed, ",")))) {
    out.push_back("claim of allocation " + r[0].as<std::string>() + " is " +
                  r[2].as<std::string>() + " while the allocation is " + r[1].as<std::string>());
  }
  for (const auto& r : tx.exec("SELECT allocation_id::text FROM allocation_resource_claims WHERE "
                               "(released_at IS NULL) <> (phase <> 'released')")) {
    out.push_back("claim of allocation " + r[0].as<std::string>() +
                  " has a phase that contradicts released_at");
  }
  for (const auto& r : tx.exec(fmt::format(
           "SELECT a.allocation_id::text, a.shape, a.gpu_count, count(c.*) FILTER (WHERE "
           "c.kind = 'slot'), count(c.*) FILTER (WHERE c.kind = 'node_exclusive'), "
           "count(DISTINCT c.node_id), bool_and(c.node_id = a.node_id) FROM allocations a "
           "LEFT JOIN allocation_resource_claims c ON c.allocation_id = a.allocation_id AND "
           "c.released_at IS NULL WHERE a.state IN {} OR (a.state = 'failed' AND EXISTS (SELECT 1 "
           "FROM allocation_resource_claims x WHERE x.allocation_id = a.allocation_id AND "
           "x.released_at IS NULL)) GROUP BY 1, 2, 3",
           kLiveStates))) {
    const bool bm = enums::FromColumn<v1::CapacityShape>(r[1].as<std::string>()) ==
                    v1::CAPACITY_SHAPE_BAREMETAL;
    const int gpus = r[2].as<int>(), slots = r[3].as<int>(), excl = r[4].as<int>();
    const int node_count = r[5].as<int>();
    const bool same_node = !r[6].is_null() && r[6].as<bool>();
    const bool ok = bm ? (excl == 1 && slots == 0) : (slots == gpus && excl == 0);
    if (!ok || node_count != 1 || !same_node) {
      out.push_back(fmt::format(
          "allocation {} ({} x{}) has {} slot / {} exclusive claims on {} "
          "node(s)",
          r[0].as<std::string>(), r[1].as<std::string>(), gpus, slots, excl, node_count));
    }
  }
  return out;
}

// --- gauges ------------------------------------------------------------------------------------

void FoldCountsOfGoneBackends(pqxx::work& tx) {
  tx.exec(
      "WITH gone AS (DELETE FROM allocation_state_counts WHERE shard <> 0 AND shard NOT "
      "IN (SELECT pid FROM pg_stat_activity WHERE pid IS NOT NULL) RETURNING state, n) "
      "INSERT INTO allocation_state_counts AS c (state, shard, n) SELECT state, 0, "
      "sum(n) FROM gone GROUP BY state ON CONFLICT (state, shard) DO UPDATE SET n = c.n "
      "+ EXCLUDED.n");
}

std::map<std::string, StateGauge> ReadStateGauges(pqxx::work& tx,
                                                  const std::vector<std::string>& states) {
  std::map<std::string, StateGauge> by_state;
  for (const auto& s : states) by_state[s] = {0, 0};
  for (const auto& row :
       tx.exec("SELECT state, sum(n)::float8 FROM allocation_state_counts GROUP BY state")) {
    by_state[row[0].as<std::string>()].count = row[1].as<double>();
  }
  // updated_at moves with every announced change (the saga's UPDATE of the state);
  // each state's oldest is one probe of allocations_state_updated.
  for (const auto& row :
       tx.exec_params("SELECT s, COALESCE(extract(epoch from now() - (SELECT min(a.updated_at) "
                      "FROM allocations a WHERE a.state = s)), 0)::float8 "
                      "FROM unnest($1::text[]) s",
                      store::TextArrayLiteral(states))) {
    by_state[row[0].as<std::string>()].oldest_seconds = row[1].as<double>();
  }
  return by_state;
}

}  // namespace gpuaas::scheduler
