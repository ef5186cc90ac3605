#include "allocations.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "allocation_rows.hpp"
#include "apps.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/group_commit.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/scheduler.pb.h"
#include "lifecycle.hpp"
#include "placement.hpp"
#include "placement_cache.hpp"
#include "saga.hpp"
#include "scheduler_metrics.hpp"

namespace gpuaas::scheduler {

namespace {

using google::protobuf::util::TimeUtil;

const std::regex kLabel("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$");
constexpr int kChoices = 8;
// Placement rounds per create: the first kSkipAttempts skip rows other placers hold, the rest
// wait for them up to kLockWaitMs each.
constexpr int kPlaceAttempts = 8;
constexpr int kSkipAttempts = 3;
constexpr int kLockWaitMs = 2000;
// How long a refusal waits for the placement index to catch up before asking SQL instead.
constexpr int kSyncWaitMs = 1000;
constexpr int kMaxEndpoints = 16;

google::protobuf::Timestamp Ts(double epoch) {
  return TimeUtil::MillisecondsToTimestamp(static_cast<int64_t>(epoch * 1000));
}

constexpr const char* kAllocColumns =
    "allocation_id::text, tenant, request_id, sku, shape, gpu_count, region, pool, network_mode, "
    "state, node_id, failure_stage, failure_code, failure_detail, generation, "
    "extract(epoch from created_at)::float8, extract(epoch from updated_at)::float8, attempt, "
    "image, net_domain, net_mac, net_expected_ip, net_actual_ip, net_lease_state, release_actor, "
    "release_actor_tenant, release_reason, vm_ready, app";

v1::Allocation FromRow(pqxx::work& tx, const pqxx::row& r) {
  v1::Allocation a;
  a.set_allocation_id(r[0].as<std::string>());
  a.set_tenant(r[1].as<std::string>());
  a.set_request_id(r[2].as<std::string>());
  a.set_sku(r[3].as<std::string>());
  a.set_shape(r[4].as<std::string>() == "baremetal" ? v1::CAPACITY_SHAPE_BAREMETAL
                                                    : v1::CAPACITY_SHAPE_GPU_SLICE);
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
  }
  a.set_vm_ready(r[27].as<bool>());
  a.set_app(r[28].as<std::string>());
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
  return a;
}

}  // namespace

Result<v1::Allocation> LoadAllocation(pqxx::work& tx, const std::string& id, bool lock,
                                      const std::string& tenant_scope) {
  if (!ids::IsUuid(id)) {
    return Error::InvalidArgument("invalid_allocation_id", "allocation ids are UUIDs: '" + id + "'",
                                  {{"allocation_id", "must be a UUID"}});
  }
  auto r = store::Prepared(tx,
                           fmt::format("SELECT {} FROM allocations WHERE allocation_id = $1{}",
                                       kAllocColumns, lock ? " FOR UPDATE" : ""),
                           id);
  if (r.empty() || (!tenant_scope.empty() && r[0][1].as<std::string>() != tenant_scope)) {
    return Error{Code::kNotFound,
                 "allocation_not_found",
                 "no allocation " + id,
                 {{"allocation_id", id}},
                 false};
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

namespace {

// A tenant principal asked for another tenant.
Error TenantDenied(const rpc::Context& ctx, const std::string& tenant) {
  return Error{
      Code::kPermissionDenied,
      "tenant_not_allowed",
      ctx.principal.subject + " acts for tenant " + ctx.principal.tenant + ", not " + tenant,
      {{"tenant", tenant}, {"principal_tenant", ctx.principal.tenant}},
      false};
}

Result<void> ValidateCreate(const v1::CreateAllocationRequest& req) {
  std::map<std::string, std::string> problems;
  if (!std::regex_match(req.tenant(), kLabel)) problems["tenant"] = "a lowercase DNS label";
  if (req.request_id().empty() || req.request_id().size() > 128) {
    problems["request_id"] = "required, at most 128 characters (the idempotency key)";
  }
  if (!std::regex_match(req.region(), kLabel)) problems["region"] = "a lowercase DNS label";
  if (!req.pool().empty() && !std::regex_match(req.pool(), kLabel)) {
    problems["pool"] = "empty or a lowercase DNS label";
  }
  if (req.gpu_count() < 0) problems["gpu_count"] = "must be >= 0";
  if (req.network_mode() != v1::NETWORK_MODE_UNSPECIFIED &&
      enums::Text(req.network_mode()).empty()) {
    problems["network_mode"] = "one of " + enums::JoinTexts(v1::NetworkMode_descriptor());
  }
  if (req.expose_size() > kMaxEndpoints) {
    problems["expose"] = fmt::format("at most {} endpoints", kMaxEndpoints);
  }
  std::set<std::string> names;
  std::set<std::pair<int, int32_t>> ports;
  for (int i = 0; i < req.expose_size(); ++i) {
    const auto& e = req.expose(i);
    const std::string at = fmt::format("expose[{}]", i);
    if (!std::regex_match(e.name(), kLabel)) {
      problems[at + ".name"] = "a lowercase DNS label";
    } else if (!names.insert(e.name()).second) {
      problems[at + ".name"] = "names an endpoint twice";
    }
    if (enums::Text(e.protocol()).empty()) problems[at + ".protocol"] = "tcp or udp";
    if (e.port() < 1 || e.port() > 65535) {
      problems[at + ".port"] = "1..65535";
    } else if (!ports.insert({e.protocol(), e.port()}).second) {
      problems[at + ".port"] = "exposes a port twice";
    }
  }
  if (!problems.empty()) {
    return Error::InvalidArgument("invalid_allocation_request",
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  return Ok();
}

Error RegionDisabled(const std::string& region) {
  return Error{Code::kFailedPrecondition,
               "region_disabled",
               "region " + region + " is disabled",
               {{"region", region}},
               false};
}

struct Placed {
  std::string node_id;
  std::vector<std::string> slots;
};

// Why nothing could be placed, with counts per reason (from SQL, or from a synced index).
Error NoPlacement(const v1::CreateAllocationRequest& req, const Sku& sku, int gpus,
                  const PlacementCache::FreeCounts& c) {
  std::map<std::string, std::string> d = {
      {"free_gpus_in_region", std::to_string(c.free_in_region)},
      {"free_gpus_of_sku", std::to_string(c.free_of_sku)},
      {"free_gpus_matching_fabric", std::to_string(c.matching)},
      {"max_free_matching_on_one_node", std::to_string(c.max_on_one_node)},
      {"nodes_with_enough_free_slots", std::to_string(c.nodes_with_enough)},
      {"nodes_with_wrong_fabric", std::to_string(c.nodes_with_wrong_fabric)},
      {"unschedulable_slots_in_region", std::to_string(c.unschedulable_in_region)},
      {"incomplete_slots_ignored", std::to_string(c.incomplete)},
      {"requested_gpus", std::to_string(gpus)}};
  return Error{
      Code::kResourceExhausted, "no_placement",
      fmt::format("no node in {} has {} free {} slot(s) with {} fabric together "
                  "({} free matching GPUs in the region, at most {} on one node)",
                  req.region(), gpus, sku.gpu_sku,
                  sku.fabric_type.empty() ? "any" : sku.fabric_type, c.matching, c.max_on_one_node),
      d, true};
}

PlacementCache::FreeCounts CountFree(pqxx::work& tx, const v1::CreateAllocationRequest& req,
                                     const Sku& sku, int gpus) {
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
      req.region(), req.pool(), sku.gpu_sku, sku.fabric_type, gpus);
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

// What the proposals of one create request came to (gpuaas_placement_choices_total).
struct ChoiceStats {
  bool from_index = false;
  bool refused_by_index = false;  // the synced index had nothing: the refusal's counts from it
  int placed = 0;
  int stale = 0;  // the re-check found them claimed or no longer schedulable
  int held = 0;   // locked by another placement
};

// The SQL read of the create path (every slot of the SKU in the region, with its live claims),
// ranked with placement::Rank: used when the replica's placement index has nothing to propose
// and cannot sync, or is not loaded.
Result<std::optional<std::vector<placement::Choice>>> RankFromSql(
    pqxx::work& tx, const v1::CreateAllocationRequest& req, const Sku& sku,
    const placement::Request& preq) {
  bool region_enabled = false;
  const auto views = ReadNodeViews(tx, req.region(), req.pool(), sku.gpu_sku, &region_enabled);
  if (views.empty()) return std::optional<std::vector<placement::Choice>>();
  if (!region_enabled) return RegionDisabled(req.region());
  return std::optional(placement::Rank(views, preq, kChoices));
}

// One placement attempt for a slice in `tx`: proposals from the replica's placement index (or,
// when it has none, from SQL), then lock and re-check them in order. Each choice is tried in its
// own savepoint, so a choice given up on (another transaction holds or took part of it) leaves
// no row locked behind it; a stale proposal of the index reads its node into the index again.
// `wait`: lock the choices waiting for their holders (bounded by lock_timeout) instead of
// skipping them; used once skipping kept failing.
Result<std::optional<Placed>> PlaceSlice(pqxx::work& tx, const v1::CreateAllocationRequest& req,
                                         const Sku& sku, int gpus, bool wait, bool* contended,
                                         PlacementCache* cache, ChoiceStats* stats) {
  placement::Request preq;
  preq.gpus = gpus;
  preq.fabric_type = sku.fabric_type;
  std::vector<placement::Choice> choices;
  bool from_index = false;
  if (cache != nullptr && cache->ready()) {
    auto ranked = cache->Rank(req.region(), req.pool(), sku.gpu_sku, preq, kChoices);
    // Nothing to propose: refused only by an index that has every commit made before this
    // request (a release the client saw answered included), else by SQL.
    if (ranked.any_node && ranked.region_enabled && ranked.choices.empty() &&
        cache->Sync(std::chrono::milliseconds(kSyncWaitMs))) {
      ranked = cache->Rank(req.region(), req.pool(), sku.gpu_sku, preq, kChoices);
      if (ranked.region_enabled && ranked.choices.empty()) {
        stats->refused_by_index = true;
        return std::optional<Placed>();
      }
    }
    if (ranked.region_enabled && !ranked.choices.empty()) {
      choices = std::move(ranked.choices);
      from_index = true;
    }
  }
  if (!from_index) {
    auto ranked = RankFromSql(tx, req, sku, preq);
    if (!ranked.ok()) return ranked.error();
    if (!ranked->has_value()) return std::optional<Placed>();
    choices = std::move(**ranked);
  }
  stats->from_index = stats->from_index || from_index;
  *contended = !choices.empty();  // every choice below was taken or locked by someone else
  const char* skip = wait ? "" : " SKIP LOCKED";
  std::vector<std::string> stale;
  // Each choice in a savepoint of its own: a choice given up releases the row locks it took,
  // and a wait that ran past lock_timeout (an error, which aborts the transaction) is rolled
  // back to it, so the next choice can be tried. (Plain SQL: a pqxx 6 subtransaction whose
  // statements all go through exec_params never sends its SAVEPOINT, so its abort undid
  // nothing and a lock timeout failed the whole create.)
  for (const auto& choice : choices) {
    tx.exec0("SAVEPOINT choice");
    const auto give_up = [&] {
      tx.exec0("ROLLBACK TO SAVEPOINT choice; RELEASE SAVEPOINT choice");
    };
    try {
      // Slices share the node row; a baremetal placer takes it exclusively.
      auto node = store::Prepared(
          tx, fmt::format("SELECT 1 FROM projected_nodes WHERE node_id = $1 FOR SHARE{}", skip),
          choice.node_id);
      if (node.empty()) {
        give_up();
        stats->held++;
        continue;
      }
      std::string keys = store::TextArrayLiteral(choice.slot_keys);
      // In slot order: two waiting placers lock overlapping slots in the same order.
      auto locked = store::Prepared(
          tx,
          fmt::format("SELECT slot_key FROM projected_slots WHERE node_id = $1 AND slot_key = "
                      "ANY($2::text[]) AND schedulable ORDER BY slot_key FOR UPDATE{}",
                      skip),
          choice.node_id, keys);
      // Claims committed since our read (we hold the rows now, so none can appear after this).
      auto taken = static_cast<int>(locked.size()) != gpus
                       ? pqxx::result()
                       : store::Prepared(
                             tx,
                             "SELECT 1 FROM allocation_resource_claims WHERE released_at IS NULL "
                             "AND node_id = $1 AND (slot_key = ANY($2::text[]) OR kind = "
                             "'node_exclusive') LIMIT 1",
                             choice.node_id, keys);
      if (static_cast<int>(locked.size()) != gpus || !taken.empty()) {
        give_up();  // its row locks go with it
        // Fewer rows than asked while skipping: held by someone (or gone); waiting, or claims
        // found: what the proposal was made from is out of date.
        if (!wait && static_cast<int>(locked.size()) != gpus) {
          stats->held++;
        } else {
          stats->stale++;
          stale.push_back(choice.node_id);
        }
        continue;
      }
      tx.exec0("RELEASE SAVEPOINT choice");
      stats->placed++;
      if (from_index && !stale.empty()) cache->Refresh(tx, stale);
      return std::optional<Placed>(Placed{choice.node_id, choice.slot_keys});
    } catch (const pqxx::sql_error& e) {
      // A wait that ran past lock_timeout: the next choice.
      if (e.sqlstate() != "55P03") throw;
      give_up();
      stats->held++;
    }
  }
  // The index proposed what the database no longer has: read those nodes again now, so the
  // next round does not propose them again before their notifications arrive.
  if (from_index && !stale.empty()) cache->Refresh(tx, stale);
  return std::optional<Placed>();
}

Result<std::optional<Placed>> PlaceBaremetal(pqxx::work& tx,
                                             const v1::CreateAllocationRequest& req) {
  // A node for baremetal has no live claim of any kind; prefer baremetal-profile nodes, then
  // nodes with fewer approved slots (sliceable capacity stays for slices).
  auto rows = tx.exec_params(
      "SELECT n.node_id FROM projected_nodes n WHERE n.region = $1 AND ($2 = '' OR n.pool = $2) "
      "AND NOT EXISTS (SELECT 1 FROM allocation_resource_claims c WHERE c.released_at IS NULL "
      "AND c.node_id = n.node_id) AND NOT EXISTS (SELECT 1 FROM projected_slots s WHERE "
      "s.node_id = n.node_id AND NOT s.region_enabled) "
      "ORDER BY (n.capacity_profile = 'baremetal') DESC, (SELECT count(*) FROM projected_slots s "
      "WHERE s.node_id = n.node_id), n.node_id LIMIT $3",
      req.region(), req.pool(), kChoices);
  for (const auto& r : rows) {
    const std::string node = r[0].as<std::string>();
    auto locked = tx.exec_params(
        "SELECT 1 FROM projected_nodes WHERE node_id = $1 FOR UPDATE SKIP LOCKED", node);
    if (locked.empty()) continue;
    auto taken = tx.exec_params(
        "SELECT 1 FROM allocation_resource_claims WHERE released_at IS NULL AND node_id = $1 "
        "LIMIT 1",
        node);
    if (!taken.empty()) continue;
    return std::optional<Placed>(Placed{node, {}});
  }
  return std::optional<Placed>();
}

}  // namespace

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
    const bool bm = r[1].as<std::string>() == "baremetal";
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

Result<void> StartAllocations(runtime::Service& svc, const Catalog& catalog,
                              const SagaOptions& saga, PlacementCache* cache,
                              store::GroupCommit* group) {
  if (auto r = messaging::EnsureStream(*svc.nats(), messaging::SchedulerEventsStream()); !r.ok()) {
    return r;
  }
  auto pool = svc.pg();
  auto& rpc = svc.Rpc();

  // Every answer counted: gpuaas_placements_total, gpuaas_no_placement_total.
  CountedRpc counted(rpc, saga.metrics);
  counted.Handle<v1::CreateAllocationRequest, v1::CreateAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.create",
      [pool, saga, catalog, cache, group](const v1::CreateAllocationRequest& req, rpc::Context& ctx)
          -> Result<v1::CreateAllocationResponse> {
        if (auto v = ValidateCreate(req); !v.ok()) return v.error();
        if (const std::string scope = ctx.TenantScope(); !scope.empty() && req.tenant() != scope) {
          return TenantDenied(ctx, req.tenant());
        }
        auto checked = catalog.Validate(req.sku(), req.gpu_count(), req.network_mode());
        if (!checked.ok()) return checked.error();
        const Sku& sku = *checked->first;
        const bool baremetal = sku.shape == "baremetal";
        const Image* image = nullptr;
        if (!baremetal) {
          auto img = catalog.FindImage(req.image());
          if (!img.ok()) return img.error();
          image = *img;
        } else if (!req.image().empty()) {
          return Error::InvalidArgument("image_not_for_baremetal",
                                        "baremetal nodes are handed over without a VM image",
                                        {{"image", req.image()}});
        }
        if (baremetal && req.expose_size() > 0) {
          return Error::InvalidArgument(
              "exposure_not_for_baremetal",
              "a bare-metal node has its own public addresses; ingress exposes slice VMs only",
              {{"expose", "must be empty for baremetal"}});
        }
        const int gpus = req.gpu_count() == 0 ? sku.allowed_gpu_counts.front() : req.gpu_count();
        // What to expose: the request's endpoints, then its app's (slices only: a bare-metal
        // node has its own public addresses).
        std::vector<v1::EndpointRequest> expose(req.expose().begin(), req.expose().end());
        if (!req.app().empty()) {
          auto app = apps::Lookup(req.app());
          if (!app.ok()) return app.error();
          apps::Target target;
          target.shape = baremetal ? v1::CAPACITY_SHAPE_BAREMETAL : v1::CAPACITY_SHAPE_GPU_SLICE;
          target.gpu_count = gpus;
          if (auto why = apps::Check(**app, target); !why.empty()) {
            Error e = Error::FailedPrecondition(
                "app_not_compatible",
                fmt::format("app {} cannot run on this order: {}", req.app(), why.front().message));
            for (const auto& w : why) {
              e.details[std::string(apps::ReasonText(w.reason))] = w.message;
            }
            return e;
          }
          for (const auto& ep :
               baremetal ? std::vector<v1::AppEndpoint>{} : apps::Endpoints(**app)) {
            const bool named = std::any_of(expose.begin(), expose.end(),
                                           [&](const auto& x) { return x.name() == ep.name(); });
            const bool same_port = std::any_of(expose.begin(), expose.end(), [&](const auto& x) {
              return x.protocol() == ep.protocol() && x.port() == ep.port();
            });
            if (named && same_port) continue;  // asked for explicitly as well
            if (named || same_port) {
              return Error::InvalidArgument(
                  "invalid_allocation_request",
                  fmt::format("expose and app {} both name endpoint {} or port {}", req.app(),
                              ep.name(), ep.port()),
                  {{"expose", "must not clash with the app's endpoints"}});
            }
            v1::EndpointRequest add;
            add.set_name(ep.name());
            add.set_protocol(ep.protocol());
            add.set_port(ep.port());
            expose.push_back(std::move(add));
          }
        }
        ChoiceStats stats;
        // One create's transaction; run as a unit of a group commit (each create in a savepoint,
        // one commit for the creates that overlap), or on its own.
        // The node this create claimed slots of in a run that may not have committed (a group's
        // transaction is committed after later creates ran in it): the index is told at once,
        // so those creates do not propose the same slots, and is corrected (the node read
        // again) if that run's work was undone.
        std::string provisional;
        const auto create = [&](pqxx::work& tx) -> Result<v1::CreateAllocationResponse> {
          if (cache != nullptr && !provisional.empty()) {
            cache->Refresh(tx, {provisional});  // run again: the earlier run's claim is gone
            provisional.clear();
          }
          v1::CreateAllocationResponse resp;
          // Retries of one request id, on any replica, one at a time: the later ones find the
          // first one's allocation instead of racing it to the unique (tenant, request_id) key.
          store::Prepared(tx, "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))",
                          "allocation.create\x1f" + req.tenant() + "\x1f" + req.request_id());
          if (auto existing = FindByRequest(tx, req.tenant(), req.request_id())) {
            *resp.mutable_allocation() = *existing;
            return resp;  // a retry: same answer, no second placement
          }
          if (baremetal) {  // slices learn it from the slots they scan anyway
            auto region = tx.exec_params(
                "SELECT count(*), count(*) FILTER (WHERE region_enabled) FROM projected_slots "
                "WHERE region = $1",
                req.region());
            if (region[0][0].as<int64_t>() > 0 && region[0][1].as<int64_t>() == 0) {
              return RegionDisabled(req.region());
            }
          }
          Result<std::optional<Placed>> placed = std::optional<Placed>();
          // Skipping what others hold first; when that keeps failing, waiting for them: a
          // request is not refused while capacity exists only because others held it a moment.
          bool contended = false;
          stats.refused_by_index = false;  // this run of the transaction's
          for (int attempt = 0; attempt < kPlaceAttempts; ++attempt) {
            const bool wait = attempt >= kSkipAttempts;
            if (wait && attempt == kSkipAttempts) {
              tx.exec0(fmt::format("SET LOCAL lock_timeout = '{}ms'", kLockWaitMs));
            }
            contended = false;
            placed = baremetal ? PlaceBaremetal(tx, req)
                               : PlaceSlice(tx, req, sku, gpus, wait, &contended, cache, &stats);
            if (!placed.ok() || placed->has_value() || !contended) break;
            // Others held or took our choices: read again (their commits are visible now).
            if (!wait) {
              std::this_thread::sleep_for(std::chrono::milliseconds(2 * (attempt + 1)));
            }
          }
          if (contended) tx.exec0("SET LOCAL lock_timeout = 0");
          if (!placed.ok()) return placed.error();
          if (!placed->has_value()) {
            if (baremetal) {
              return Error{Code::kResourceExhausted,
                           "no_placement",
                           "no node in " + req.region() + " is free of claims for baremetal",
                           {{"requested", "node_exclusive"}},
                           true};
            }
            if (contended) {
              // Still held by others after waiting: capacity may exist, so not no_placement.
              return Error{Code::kUnavailable,
                           "placement_contended",
                           fmt::format("every choice for {} GPU(s) in {} stayed held by other "
                                       "placements; try again",
                                       gpus, req.region()),
                           {{"requested_gpus", std::to_string(gpus)},
                            {"attempts", std::to_string(kPlaceAttempts)}},
                           true};
            }
            if (stats.refused_by_index) {
              return NoPlacement(
                  req, sku, gpus,
                  cache->Count(req.region(), req.pool(), sku.gpu_sku, sku.fabric_type, gpus));
            }
            return NoPlacement(req, sku, gpus, CountFree(tx, req, sku, gpus));
          }
          const Placed& p = **placed;
          const std::string id = ids::NewUuidV7();
          store::Prepared(
              tx,
              "INSERT INTO allocations (allocation_id, tenant, request_id, sku, shape, "
              "gpu_count, "
              "region, pool, network_mode, state, node_id, generation) VALUES ($1, $2, $3, $4, "
              "$5, $6, $7, $8, $9, 'reserved', $10, 1)",
              id, req.tenant(), req.request_id(), req.sku(), sku.shape, gpus, req.region(),
              req.pool(), enums::Text(checked->second), p.node_id);
          if (!req.app().empty()) {
            store::Prepared(tx, "UPDATE allocations SET app = $2 WHERE allocation_id = $1", id,
                            req.app());
          }
          for (const auto& e : expose) {
            store::Prepared(
                tx,
                "INSERT INTO allocation_endpoints (allocation_id, name, protocol, port) VALUES "
                "($1, $2, $3, $4)",
                id, e.name(), enums::Text(e.protocol()), e.port());
          }
          if (baremetal) {
            store::Prepared(
                tx,
                "INSERT INTO allocation_resource_claims (allocation_id, node_id, kind) VALUES "
                "($1, $2, 'node_exclusive')",
                id, p.node_id);
          } else {
            store::Prepared(
                tx,
                "INSERT INTO allocation_resource_claims (allocation_id, node_id, slot_key, "
                "kind) "
                "SELECT $1, $2, unnest($3::text[]), 'slot'",
                id, p.node_id, store::TextArrayLiteral(p.slots));
            if (cache != nullptr && group != nullptr) {
              cache->Claimed(p.node_id, p.slots);
              provisional = p.node_id;
            }
          }
          auto a = LoadAllocation(tx, id, false);
          if (!a.ok()) return a.error();
          if (auto e = Announce(tx, *a, saga.source, ctx.traceparent); !e.ok()) {
            return e.error();
          }
          AddTimeline(
              tx, id,
              {v1::TIMELINE_STEP_PLACED, v1::ALLOCATION_STATE_RESERVED, "",
               v1::TASK_TYPE_UNSPECIFIED, v1::TASK_STAGE_UNSPECIFIED, "",
               baremetal ? "node " + p.node_id + " (node_exclusive)"
                         : fmt::format("node {} slots {}", p.node_id, fmt::join(p.slots, ","))});
          a = StartLifecycle(tx, *a, req, sku, image, saga, ctx.traceparent);
          if (!a.ok()) return a.error();
          ctx.log.Info("allocation placed", {{"allocation_id", id},
                                             {"node_id", p.node_id},
                                             {"gpus", std::to_string(gpus)},
                                             {"sku", req.sku()}});
          *resp.mutable_allocation() = *a;
          resp.set_created(true);
          return resp;
        };
        auto created = group != nullptr ? group->Run(create) : store::WithTx(*pool, create);
        if (saga.metrics) {
          saga.metrics->Choices(stats.from_index, stats.placed, stats.stale, stats.held);
        }
        if (cache != nullptr && !provisional.empty() && !created.ok()) {
          // Claimed in a run that was then undone (its savepoint rolled back): read the node
          // again, as it is committed.
          (void)store::WithTx(*pool, [&](pqxx::work& tx) -> Result<void> {
            cache->Refresh(tx, {provisional});
            return Ok();
          });
        }
        // Committed: this replica's index has the claim now, not only once its notification
        // comes back (the other replicas learn it from the notification).
        if (cache != nullptr && created.ok() && created->created() && !baremetal) {
          cache->Claimed(
              created->allocation().node_id(),
              {created->allocation().slot_keys().begin(), created->allocation().slot_keys().end()});
        }
        return created;
      });

  rpc.Handle<v1::ListCatalogRequest, v1::ListCatalogResponse>(
      "gpuaas.v1.scheduler.catalog.list",
      [listed = catalog.ToProto()](const v1::ListCatalogRequest&, rpc::Context&)
          -> Result<v1::ListCatalogResponse> { return listed; });

  rpc.Handle<v1::GetAllocationRequest, v1::GetAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.get",
      [pool](const v1::GetAllocationRequest& req,
             rpc::Context& ctx) -> Result<v1::GetAllocationResponse> {
        return store::WithTx(
            *pool,
            [&](pqxx::work& tx) -> Result<v1::GetAllocationResponse> {
              auto a = LoadAllocation(tx, req.allocation_id(), false, ctx.TenantScope());
              if (!a.ok()) return a.error();
              v1::GetAllocationResponse resp;
              *resp.mutable_allocation() = *a;
              return resp;
            },
            store::ReadSnapshot());
      });

  rpc.Handle<v1::ListAllocationsRequest, v1::ListAllocationsResponse>(
      "gpuaas.v1.scheduler.allocation.list",
      [pool](const v1::ListAllocationsRequest& req,
             rpc::Context& ctx) -> Result<v1::ListAllocationsResponse> {
        // A tenant principal lists its own tenant's, whatever it asked for.
        const std::string scope = ctx.TenantScope();
        if (!scope.empty() && !req.tenant().empty() && req.tenant() != scope) {
          return TenantDenied(ctx, req.tenant());
        }
        const std::string tenant = scope.empty() ? req.tenant() : scope;
        auto page = rpc::PageLimit(req.page_size());
        if (!page.ok()) return page.error();
        if (!req.page_token().empty() && !ids::IsUuid(req.page_token())) {
          return Error::InvalidArgument("invalid_page_token", "page_token is not from a list reply",
                                        {{"page_token", "use next_page_token"}});
        }
        if (req.state() != v1::ALLOCATION_STATE_UNSPECIFIED && enums::Text(req.state()).empty()) {
          return enums::InvalidValue("state", std::to_string(req.state()),
                                     v1::AllocationState_descriptor());
        }
        const int limit = *page;
        return store::WithTx(
            *pool,
            [&](pqxx::work& tx) -> Result<v1::ListAllocationsResponse> {
              auto rows = tx.exec_params(
                  fmt::format("SELECT {} FROM allocations WHERE ($1 = '' OR tenant = $1) AND "
                              "($2 = '' OR state = $2) AND ($3 = '' OR allocation_id > $3::uuid) "
                              "ORDER BY allocation_id LIMIT $4",
                              kAllocColumns),
                  tenant, enums::Text(req.state()), req.page_token(), limit + 1);
              v1::ListAllocationsResponse resp;
              for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
                *resp.add_allocations() = FromRow(tx, rows[i]);
              }
              if (static_cast<int>(rows.size()) > limit) {
                resp.set_next_page_token(resp.allocations(limit - 1).allocation_id());
              }
              return resp;
            },
            store::ReadSnapshot());
      });

  rpc.Handle<v1::ReleaseAllocationRequest, v1::ReleaseAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.release",
      [pool, saga](const v1::ReleaseAllocationRequest& req,
                   rpc::Context& ctx) -> Result<v1::ReleaseAllocationResponse> {
        if (req.force()) {
          return Error{Code::kPermissionDenied,
                       "force_moved",
                       "force-release is gpuaas.v1.scheduler.allocation.force_release, which "
                       "only the operator role may call",
                       {{"subject", "gpuaas.v1.scheduler.allocation.force_release"}},
                       false};
        }
        outbox::SetActorReason(req.reason());
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ReleaseAllocationResponse> {
          auto after = ReleaseAllocation(tx, req.allocation_id(), false, saga, ctx.traceparent,
                                         ctx.TenantScope());
          if (!after.ok()) return after.error();
          ctx.log.Info("allocation release", {{"allocation_id", req.allocation_id()},
                                              {"state", enums::Text(after->state())},
                                              {"reason", req.reason()}});
          v1::ReleaseAllocationResponse resp;
          *resp.mutable_allocation() = *after;
          return resp;
        });
      });

  rpc.Handle<v1::ForceReleaseAllocationRequest, v1::ReleaseAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.force_release",
      [pool, saga](const v1::ForceReleaseAllocationRequest& req,
                   rpc::Context& ctx) -> Result<v1::ReleaseAllocationResponse> {
        if (req.reason().empty()) {
          return Error::InvalidArgument("reason_required",
                                        "a force-release skips the cleanup proof: say why",
                                        {{"reason", "required"}});
        }
        outbox::SetActorReason(req.reason());
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ReleaseAllocationResponse> {
          auto after = ReleaseAllocation(tx, req.allocation_id(), true, saga, ctx.traceparent);
          if (!after.ok()) return after.error();
          ctx.log.Warn("allocation force-released", {{"allocation_id", req.allocation_id()},
                                                     {"state", enums::Text(after->state())},
                                                     {"reason", req.reason()}});
          v1::ReleaseAllocationResponse resp;
          *resp.mutable_allocation() = *after;
          return resp;
        });
      });
  return Ok();
}

}  // namespace gpuaas::scheduler
