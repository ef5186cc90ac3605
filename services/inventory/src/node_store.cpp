#include "node_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::inventory {

namespace {

google::protobuf::Timestamp Ts(const pqxx::field& f) {
  google::protobuf::Timestamp t;
  t.set_seconds(static_cast<int64_t>(f.as<double>()));
  t.set_nanos(static_cast<int32_t>((f.as<double>() - static_cast<double>(t.seconds())) * 1e9));
  return t;
}

constexpr const char* kNodeColumns =
    "node_id, hostname, region, pool, capacity_profile, labels::text, agent_version, generation, "
    "extract(epoch from registered_at)::float8, extract(epoch from updated_at)::float8, "
    "admin_state, admin_reason, admin_actor, extract(epoch from admin_changed_at)::float8, "
    "extract(epoch from drain_deadline)::float8, COALESCE(mode_target, ''), mode_blockers";

v1::Node NodeFromRow(const pqxx::row& r) {
  v1::Node n;
  n.set_node_id(r[0].as<std::string>());
  n.set_hostname(r[1].as<std::string>());
  n.set_region(r[2].as<std::string>());
  n.set_pool(r[3].as<std::string>());
  n.set_capacity_profile(enums::FromColumn<v1::CapacityProfile>(r[4].as<std::string>()));
  const auto labels = nlohmann::json::parse(r[5].as<std::string>());
  for (const auto& [k, v] : labels.items()) {
    (*n.mutable_labels())[k] = v.get<std::string>();
  }
  n.set_agent_version(r[6].as<std::string>());
  n.set_generation(r[7].as<int64_t>());
  *n.mutable_registered_at() = Ts(r[8]);
  *n.mutable_updated_at() = Ts(r[9]);
  n.set_admin_state(enums::FromColumn<v1::NodeAdminState>(r[10].as<std::string>()));
  n.set_admin_reason(r[11].as<std::string>());
  n.set_admin_actor(r[12].as<std::string>());
  *n.mutable_admin_changed_at() = Ts(r[13]);
  if (!r[14].is_null()) *n.mutable_drain_deadline() = Ts(r[14]);
  n.set_mode_target(enums::FromColumn<v1::CapacityProfile>(r[15].as<std::string>()));
  for (auto& b : store::TextArray(r[16])) n.add_mode_blockers(std::move(b));
  return n;
}

std::string LabelsJson(const v1::RegisterNodeRequest& req) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : req.labels()) j[k] = v;
  return j.dump();
}

}  // namespace

google::protobuf::Timestamp TimestampFromEpoch(double epoch_s) {
  return google::protobuf::util::TimeUtil::MillisecondsToTimestamp(
      static_cast<int64_t>(epoch_s * 1000));
}

std::optional<v1::Node> InsertNode(pqxx::work& tx, const v1::RegisterNodeRequest& req) {
  auto rows = tx.exec_params(
      fmt::format("INSERT INTO nodes (node_id, hostname, region, pool, capacity_profile, "
                  "labels, agent_version, generation) VALUES ($1,$2,$3,$4,$5,$6::jsonb,$7,1) "
                  "ON CONFLICT (node_id) DO NOTHING RETURNING {}",
                  kNodeColumns),
      req.node_id(), req.hostname(), req.region(), req.pool(), enums::Text(req.capacity_profile()),
      LabelsJson(req), req.agent_version());
  if (rows.empty()) return std::nullopt;
  return NodeFromRow(rows[0]);
}

std::optional<v1::Node> UpdateNodeIfChanged(pqxx::work& tx, const v1::RegisterNodeRequest& req) {
  auto rows =
      tx.exec_params(fmt::format("UPDATE nodes SET hostname=$2, region=$3, pool=$4, "
                                 "labels=$5::jsonb, agent_version=$6, "
                                 "generation=generation+1, updated_at=now() WHERE node_id=$1 AND "
                                 "(hostname, region, pool, labels, agent_version) "
                                 "IS DISTINCT FROM ($2, $3, $4, $5::jsonb, $6) RETURNING {}",
                                 kNodeColumns),
                     req.node_id(), req.hostname(), req.region(), req.pool(), LabelsJson(req),
                     req.agent_version());
  if (rows.empty()) return std::nullopt;
  return NodeFromRow(rows[0]);
}

v1::Node ReadNode(pqxx::work& tx, const std::string& node_id) {
  auto rows =
      tx.exec_params(fmt::format("SELECT {} FROM nodes WHERE node_id=$1", kNodeColumns), node_id);
  return NodeFromRow(rows.at(0));
}

v1::Node ReadNodeSummary(pqxx::work& tx, const std::string& node_id) {
  auto n = tx.exec_params(
      "SELECT node_id, hostname, region, pool, capacity_profile, agent_version, "
      "generation, labels::text, admin_state, admin_reason, admin_actor, "
      "extract(epoch from drain_deadline)::float8, COALESCE(mode_target, ''), mode_blockers "
      "FROM nodes WHERE node_id = $1",
      node_id);
  v1::Node out;
  out.set_node_id(n[0][0].as<std::string>());
  out.set_hostname(n[0][1].as<std::string>());
  out.set_region(n[0][2].as<std::string>());
  out.set_pool(n[0][3].as<std::string>());
  out.set_capacity_profile(enums::FromColumn<v1::CapacityProfile>(n[0][4].as<std::string>()));
  out.set_agent_version(n[0][5].as<std::string>());
  out.set_generation(n[0][6].as<int64_t>());
  out.set_admin_state(enums::FromColumn<v1::NodeAdminState>(n[0][8].as<std::string>()));
  out.set_admin_reason(n[0][9].as<std::string>());
  out.set_admin_actor(n[0][10].as<std::string>());
  if (!n[0][11].is_null()) *out.mutable_drain_deadline() = Ts(n[0][11]);
  out.set_mode_target(enums::FromColumn<v1::CapacityProfile>(n[0][12].as<std::string>()));
  for (auto& b : store::TextArray(n[0][13])) out.add_mode_blockers(std::move(b));
  return out;
}

std::vector<v1::Node> ListNodesAfter(pqxx::work& tx, const std::string& region,
                                     const std::string& pool, const std::string& after_node_id,
                                     int max_rows) {
  std::vector<v1::Node> out;
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT {} FROM nodes WHERE ($1 = '' OR region = $1) AND "
                       "($2 = '' OR pool = $2) AND node_id > $3 ORDER BY node_id LIMIT $4",
                       kNodeColumns),
           region, pool, after_node_id, max_rows)) {
    out.push_back(NodeFromRow(r));
  }
  return out;
}

std::optional<NodePlacement> LoadNodePlacement(pqxx::work& tx, const std::string& node_id,
                                               RowLock lock) {
  auto rows = tx.exec_params(std::string("SELECT n.region, n.pool, COALESCE(r.enabled, true), "
                                         "n.admin_state, n.capacity_profile, n.generation, "
                                         "COALESCE(n.mode_target, ''), "
                                         "COALESCE(n.mode_change_version, 0), "
                                         "n.rebind_generation "
                                         "FROM nodes n LEFT JOIN regions r ON r.name = n.region "
                                         "WHERE n.node_id = $1") +
                                 (lock == RowLock::kForUpdate ? " FOR UPDATE OF n" : ""),
                             node_id);
  if (rows.empty()) return std::nullopt;
  NodePlacement p;
  p.region = rows[0][0].as<std::string>();
  p.pool = rows[0][1].as<std::string>();
  p.region_enabled = rows[0][2].as<bool>();
  p.admin_state = enums::FromColumn<v1::NodeAdminState>(rows[0][3].as<std::string>());
  p.mode = enums::FromColumn<v1::CapacityProfile>(rows[0][4].as<std::string>());
  p.generation = rows[0][5].as<int64_t>();
  p.mode_target = enums::FromColumn<v1::CapacityProfile>(rows[0][6].as<std::string>());
  p.mode_change_version = rows[0][7].as<int64_t>();
  p.rebind_generation = rows[0][8].as<int64_t>();
  return p;
}

v1::Node WriteNodeAdmin(pqxx::work& tx, const std::string& node_id, const NodeAdminWrite& w) {
  // A drain sets its deadline (NULL: none); any later state keeps it only while drained.
  auto rows = tx.exec_params(
      fmt::format("UPDATE nodes SET admin_state = $2, admin_reason = $3, admin_actor = $4, "
                  "admin_changed_at = now(), drain_deadline = CASE WHEN $5 THEN "
                  "now() + make_interval(secs => $6::bigint) WHEN $2 = 'drained' THEN "
                  "drain_deadline END, generation = generation + 1, updated_at = now() "
                  "WHERE node_id = $1 RETURNING {}",
                  kNodeColumns),
      node_id, enums::Text(w.state), w.reason, w.actor, w.deadline_s > 0, w.deadline_s);
  return NodeFromRow(rows.at(0));
}

void OpenModeChange(pqxx::work& tx, const std::string& node_id, v1::CapacityProfile target) {
  tx.exec_params(
      "UPDATE nodes SET mode_target = $2, mode_blockers = '{}', mode_change_version = NULL "
      "WHERE node_id = $1",
      node_id, enums::Text(target));
}

void SetModeChangeVersion(pqxx::work& tx, const std::string& node_id, int64_t version) {
  tx.exec_params("UPDATE nodes SET mode_change_version = $2 WHERE node_id = $1", node_id, version);
}

void CloseModeChange(pqxx::work& tx, const std::string& node_id, v1::CapacityProfile mode,
                     const std::vector<std::string>& blockers) {
  tx.exec_params(
      "UPDATE nodes SET capacity_profile = $2, mode_target = NULL, mode_change_version = NULL, "
      "mode_blockers = $3::text[] WHERE node_id = $1",
      node_id, enums::Text(mode), store::TextArrayLiteral(blockers));
}

int64_t BumpRebindGeneration(pqxx::work& tx, const std::string& node_id) {
  return tx
      .exec_params(
          "UPDATE nodes SET rebind_generation = rebind_generation + 1 WHERE node_id = $1 "
          "RETURNING rebind_generation",
          node_id)
      .at(0)[0]
      .as<int64_t>();
}

std::vector<NodeCount> CountNodesByAdminState(pqxx::work& tx) {
  std::vector<NodeCount> out;
  for (const auto& r : tx.exec(
           "SELECT capacity_profile, admin_state, count(*), count(*) FILTER (WHERE admin_state = "
           "'draining' AND drain_deadline < now()) FROM nodes GROUP BY 1, 2 ORDER BY 1, 2")) {
    out.push_back(
        {r[0].as<std::string>(), r[1].as<std::string>(), r[2].as<int64_t>(), r[3].as<int64_t>()});
  }
  return out;
}

std::vector<std::string> NodesWithSlotsInRegion(pqxx::work& tx, const std::string& region) {
  std::vector<std::string> out;
  for (const auto& r :
       tx.exec_params("SELECT DISTINCT n.node_id FROM nodes n JOIN node_resource_slots s "
                      "USING (node_id) WHERE n.region = $1 ORDER BY 1",
                      region)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

void EnsureRegion(pqxx::work& tx, const std::string& name) {
  tx.exec_params("INSERT INTO regions (name) VALUES ($1) ON CONFLICT DO NOTHING", name);
}

void InsertRegionIfMissing(pqxx::work& tx, const std::string& name, bool enabled) {
  tx.exec_params("INSERT INTO regions (name, enabled) VALUES ($1, $2) ON CONFLICT DO NOTHING", name,
                 enabled);
}

bool LockRegionEnabled(pqxx::work& tx, const std::string& name) {
  auto cur = tx.exec_params("SELECT enabled FROM regions WHERE name = $1 FOR UPDATE", name);
  return cur[0][0].as<bool>();
}

void SetRegionEnabled(pqxx::work& tx, const std::string& name, bool enabled) {
  tx.exec_params("UPDATE regions SET enabled = $2, updated_at = now() WHERE name = $1", name,
                 enabled);
}

v1::Region LoadRegion(pqxx::work& tx, const std::string& name, bool enabled) {
  v1::Region r;
  r.set_name(name);
  r.set_enabled(enabled);
  for (const auto& p :
       tx.exec_params("SELECT DISTINCT pool FROM nodes WHERE region = $1 ORDER BY 1", name)) {
    r.add_pools(p[0].as<std::string>());
  }
  return r;
}

std::vector<v1::Region> ListRegions(pqxx::work& tx) {
  std::vector<v1::Region> out;
  for (const auto& r : tx.exec("SELECT name, enabled FROM regions ORDER BY name")) {
    out.push_back(LoadRegion(tx, r[0].as<std::string>(), r[1].as<bool>()));
  }
  return out;
}

void InsertQueuedTask(pqxx::work& tx, const std::string& task_id, const std::string& node_id,
                      const std::string& type) {
  tx.exec_params(
      "INSERT INTO node_tasks (task_id, node_id, type, status) "
      "VALUES ($1, $2, $3, 'queued')",
      task_id, node_id, type);
}

bool FinishTask(pqxx::work& tx, const std::string& task_id, const std::string& status,
                const std::string& error) {
  auto updated = tx.exec_params(
      "UPDATE node_tasks SET status = $2, error = $3, finished_at = now() WHERE task_id = $1",
      task_id, status, error);
  return updated.affected_rows() != 0;
}

void InsertFinishedTaskOfKnownNode(pqxx::work& tx, const std::string& task_id,
                                   const std::string& node_id, const std::string& type,
                                   const std::string& status, const std::string& error) {
  tx.exec_params(
      "INSERT INTO node_tasks (task_id, node_id, type, status, error, finished_at) "
      "SELECT $1, node_id, $3, $4, $5, now() FROM nodes WHERE node_id = $2 "
      "ON CONFLICT DO NOTHING",
      task_id, node_id, type, status, error);
}

std::vector<v1::TaskRecord> RecentTasks(pqxx::work& tx, const std::string& node_id) {
  std::vector<v1::TaskRecord> out;
  for (const auto& r : tx.exec_params("SELECT task_id::text, type, status, error, "
                                      "extract(epoch from queued_at)::float8, "
                                      "extract(epoch from finished_at)::float8 FROM node_tasks "
                                      "WHERE node_id = $1 ORDER BY queued_at DESC LIMIT 10",
                                      node_id)) {
    v1::TaskRecord t;
    t.set_task_id(r[0].as<std::string>());
    t.set_type(enums::FromColumn<v1::TaskType>(r[1].as<std::string>()));
    t.set_status(enums::FromColumn<v1::TaskStatus>(r[2].as<std::string>()));
    t.set_error(r[3].as<std::string>());
    *t.mutable_queued_at() = TimestampFromEpoch(r[4].as<double>());
    if (!r[5].is_null()) *t.mutable_finished_at() = TimestampFromEpoch(r[5].as<double>());
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace gpuaas::inventory
