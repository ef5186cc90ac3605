#include "saga_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>

#include "allocation_rows.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

using google::protobuf::util::TimeUtil;

// --- node tasks ------------------------------------------------------------------------------

std::optional<TaskRow> FindTask(pqxx::work& tx, const std::string& task_id, bool lock) {
  auto r = store::Prepared(tx,
                           std::string("SELECT task_id::text, allocation_id::text, type, attempt, "
                                       "status FROM allocation_tasks WHERE task_id = $1") +
                               (lock ? " FOR UPDATE" : ""),
                           task_id);
  if (r.empty()) return std::nullopt;
  return TaskRow{r[0][0].as<std::string>(), r[0][1].as<std::string>(),
                 enums::FromColumn<v1::TaskType>(r[0][2].as<std::string>()), r[0][3].as<int>(),
                 ParseTaskStatus(r[0][4].as<std::string>())};
}

int NextAttempt(pqxx::work& tx, const std::string& allocation_id, v1::TaskType type) {
  return tx
      .exec_params1(
          "SELECT COALESCE(max(attempt), 0) + 1 FROM allocation_tasks WHERE allocation_id = $1 "
          "AND type = $2",
          allocation_id, enums::Text(type))[0]
      .as<int>();
}

void InsertTask(pqxx::work& tx, const std::string& task_id, const std::string& allocation_id,
                const std::string& node_id, v1::TaskType type, int attempt, int64_t deadline_s) {
  store::Prepared(
      tx,
      "INSERT INTO allocation_tasks (task_id, allocation_id, node_id, type, attempt, deadline) "
      "VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))",
      task_id, allocation_id, node_id, enums::Text(type), attempt, static_cast<double>(deadline_s));
}

void CancelOpenTasks(pqxx::work& tx, const std::string& allocation_id) {
  store::Prepared(tx,
                  "UPDATE allocation_tasks SET status = 'cancelled', finished_at = now() WHERE "
                  "allocation_id = $1 AND status = 'sent'",
                  allocation_id);
}

void FinishTask(pqxx::work& tx, const std::string& task_id, TaskStatus status,
                const std::string& error_reason, const std::string& error_detail) {
  store::Prepared(
      tx,
      "UPDATE allocation_tasks SET status = $2, finished_at = now(), error_reason = $3, "
      "error_detail = $4 WHERE task_id = $1",
      task_id, std::string(TaskStatusText(status)), error_reason, error_detail);
}

bool HasOpenTask(pqxx::work& tx, const std::string& allocation_id) {
  return !store::Prepared(
              tx,
              "SELECT 1 FROM allocation_tasks WHERE allocation_id = $1 AND status = 'sent' "
              "LIMIT 1",
              allocation_id)
              .empty();
}

std::vector<std::string> OverdueTaskIds(pqxx::work& tx, int max) {
  std::vector<std::string> ids;
  for (const auto& r : tx.exec_params(
           "SELECT task_id::text FROM allocation_tasks WHERE status = 'sent' AND deadline < "
           "now() ORDER BY deadline LIMIT $1",
           max)) {
    ids.push_back(r[0].as<std::string>());
  }
  return ids;
}

bool LockOverdueTask(pqxx::work& tx, const std::string& task_id) {
  return !store::Prepared(
              tx,
              "SELECT 1 FROM allocation_tasks WHERE task_id = $1 AND status = 'sent' AND deadline "
              "< now() FOR UPDATE",
              task_id)
              .empty();
}

void MarkTaskTimedOut(pqxx::work& tx, const std::string& task_id) {
  store::Prepared(
      tx,
      "UPDATE allocation_tasks SET status = 'timed_out', finished_at = now(), error_reason = $2 "
      "WHERE task_id = $1",
      task_id, reason::kNodeUnresponsive.str());
}

std::map<std::string, int> OpenTasksByType(pqxx::work& tx) {
  std::map<std::string, int> by_type = {
      {"vm.provision", 0}, {"vm.release", 0}, {"slot.cleanup", 0}};
  for (const auto& r :
       tx.exec("SELECT type, count(*) FROM allocation_tasks WHERE status = 'sent' GROUP BY 1")) {
    by_type[r[0].as<std::string>()] = r[1].as<int>();
  }
  return by_type;
}

// --- claims ----------------------------------------------------------------------------------

std::vector<v1::BundleSlot> BundleSlots(pqxx::work& tx, const std::string& allocation_id,
                                        std::vector<int>* vcpus, std::vector<int64_t>* mem,
                                        std::vector<int>* huge, std::string* profile) {
  std::vector<v1::BundleSlot> out;
  for (const auto& r : store::Prepared(
           tx,
           "SELECT c.slot_key, p.gpu_pci_address, p.fabric_vf_pci_address, p.fabric_type, "
           "p.nvme_by_id, p.mac, p.private_ip, p.numa, p.vcpus_per_gpu, p.memory_mib_per_gpu, "
           "p.hugepages_1g_per_gpu, p.profile_name FROM allocation_resource_claims c "
           "LEFT JOIN projected_slots p ON p.node_id = c.node_id AND p.slot_key = c.slot_key "
           "WHERE c.allocation_id = $1 AND c.released_at IS NULL AND c.kind = 'slot' "
           "ORDER BY c.slot_key",
           allocation_id)) {
    v1::BundleSlot s;
    s.set_slot_key(r[0].as<std::string>());
    s.set_gpu_pci_address(r[1].is_null() ? "" : r[1].as<std::string>());
    s.set_fabric_vf_pci_address(r[2].is_null() ? "" : r[2].as<std::string>());
    s.set_fabric_type(
        enums::FromColumn<v1::FabricType>(r[3].is_null() ? "" : r[3].as<std::string>()));
    s.set_nvme_by_id(r[4].is_null() ? "" : r[4].as<std::string>());
    s.set_mac(r[5].is_null() ? "" : r[5].as<std::string>());
    s.set_private_ip(r[6].is_null() ? "" : r[6].as<std::string>());
    if (!r[7].is_null() && r[7].as<int>() >= 0) s.set_numa_node(r[7].as<int>());
    if (vcpus) vcpus->push_back(r[8].is_null() ? 0 : r[8].as<int>());
    if (mem) mem->push_back(r[9].is_null() ? 0 : r[9].as<int64_t>());
    if (huge) huge->push_back(r[10].is_null() ? 0 : r[10].as<int>());
    if (profile && !r[11].is_null() && profile->empty()) *profile = r[11].as<std::string>();
    out.push_back(std::move(s));
  }
  return out;
}

int FreeClaims(pqxx::work& tx, const std::string& allocation_id) {
  return static_cast<int>(
      store::Prepared(
          tx,
          "UPDATE allocation_resource_claims SET released_at = clock_timestamp(), phase = "
          "'released' WHERE allocation_id = $1 AND released_at IS NULL",
          allocation_id)
          .affected_rows());
}

bool HasLiveClaims(pqxx::work& tx, const std::string& allocation_id) {
  return !store::Prepared(tx,
                          "SELECT 1 FROM allocation_resource_claims WHERE allocation_id = $1 AND "
                          "released_at IS NULL LIMIT 1",
                          allocation_id)
              .empty();
}

std::vector<std::string> LiveSlotKeys(pqxx::work& tx, const std::string& allocation_id) {
  std::vector<std::string> keys;
  for (const auto& r : store::Prepared(
           tx,
           "SELECT slot_key FROM allocation_resource_claims WHERE allocation_id = $1 AND "
           "released_at IS NULL AND kind = 'slot' ORDER BY slot_key",
           allocation_id)) {
    keys.push_back(r[0].as<std::string>());
  }
  return keys;
}

// Declared in allocation_rows.hpp.
void SetClaimPhase(pqxx::work& tx, const std::string& allocation_id, v1::ClaimPhase phase) {
  store::Prepared(tx,
                  "UPDATE allocation_resource_claims SET phase = $2 WHERE allocation_id = $1 AND "
                  "released_at IS NULL",
                  allocation_id, enums::Text(phase));
}

// --- the allocation row ----------------------------------------------------------------------

void SetAllocationState(pqxx::work& tx, const std::string& allocation_id, v1::AllocationState state,
                        bool set_failure, const std::string& stage, const std::string& code,
                        const std::string& detail) {
  store::Prepared(
      tx,
      "UPDATE allocations SET state = $2, generation = generation + 1, updated_at = "
      "clock_timestamp(), "
      "failure_stage = CASE WHEN $3 THEN $4 ELSE failure_stage END, "
      "failure_code = CASE WHEN $3 THEN $5 ELSE failure_code END, "
      "failure_detail = CASE WHEN $3 THEN $6 ELSE failure_detail END WHERE allocation_id = $1",
      allocation_id, enums::Text(state), set_failure, stage, code, detail);
}

void RecordProvisionInputs(pqxx::work& tx, const std::string& allocation_id,
                           const std::string& image, const std::string& hostname,
                           const std::vector<std::string>& ssh_keys) {
  store::Prepared(
      tx,
      "UPDATE allocations SET attempt = 1, image = $2, hostname = $3, ssh_keys = $4::text[] "
      "WHERE allocation_id = $1",
      allocation_id, image, hostname, store::TextArrayLiteral(ssh_keys));
}

void RecordObservedNetwork(pqxx::work& tx, const std::string& allocation_id,
                           const v1::ProvisionOutput& out) {
  store::Prepared(
      tx,
      "UPDATE allocations SET net_domain = $2, net_mac = $3, net_expected_ip = $4, "
      "net_actual_ip = $5, net_lease_state = $6, vm_ready = true WHERE allocation_id = $1",
      allocation_id, out.domain_name(), out.mac(), out.expected_ip(), out.actual_ip(),
      enums::Text(out.lease_state()));
}

void RecordReleaseActor(pqxx::work& tx, const std::string& allocation_id,
                        const v1::Principal& actor) {
  store::Prepared(
      tx,
      "UPDATE allocations SET release_actor = $2, release_actor_tenant = $3, release_reason = $4, "
      "release_actor_roles = $5::text[], release_token_id = $6 WHERE allocation_id = $1",
      allocation_id, actor.subject(), actor.tenant(), actor.reason(),
      store::TextArrayLiteral({actor.roles().begin(), actor.roles().end()}), actor.token_id());
}

// --- endpoints -------------------------------------------------------------------------------

bool EndpointsPending(pqxx::work& tx, const std::string& allocation_id) {
  return !store::Prepared(
              tx,
              "SELECT 1 FROM allocation_endpoints WHERE allocation_id = $1 AND state NOT IN "
              "('active', 'drift') LIMIT 1",
              allocation_id)
              .empty();
}

std::optional<std::pair<std::string, int64_t>> LockEndpointExposure(
    pqxx::work& tx, const std::string& allocation_id, const std::string& name) {
  auto row = store::Prepared(
      tx,
      "SELECT exposure_id, exposure_generation FROM allocation_endpoints WHERE allocation_id = $1 "
      "AND name = $2 FOR UPDATE",
      allocation_id, name);
  if (row.empty()) return std::nullopt;
  return std::make_pair(row[0][0].as<std::string>(), row[0][1].as<int64_t>());
}

void UpsertEndpointExposure(pqxx::work& tx, const v1::Exposure& e, int64_t generation) {
  store::Prepared(
      tx,
      "INSERT INTO allocation_endpoints (allocation_id, name, protocol, port, exposure_id, "
      "exposure_generation, public_ip, public_port, state, reason, connect) VALUES ($1, $2, $3, "
      "$4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT (allocation_id, name) DO UPDATE SET "
      "protocol = EXCLUDED.protocol, port = EXCLUDED.port, exposure_id = EXCLUDED.exposure_id, "
      "exposure_generation = EXCLUDED.exposure_generation, public_ip = EXCLUDED.public_ip, "
      "public_port = EXCLUDED.public_port, state = EXCLUDED.state, reason = EXCLUDED.reason, "
      "connect = EXCLUDED.connect",
      e.allocation_id(), e.name(),
      enums::Text(e.protocol()).empty() ? std::string("tcp") : enums::Text(e.protocol()),
      std::clamp(e.target_port(), 1, 65535), e.exposure_id(), generation, e.public_ip(),
      e.public_port(), enums::Text(e.state()), e.reason(), e.connect());
}

// --- timeline --------------------------------------------------------------------------------

int64_t AddTimelineEntries(pqxx::work& tx, const std::string& allocation_id, int64_t after,
                           int limit, v1::GetAllocationTimelineResponse& resp) {
  auto rows = tx.exec_params(
      "SELECT seq, extract(epoch from at)::float8, step, state, "
      "task_id, task_type, stage, code, detail, percent FROM "
      "allocation_timeline WHERE allocation_id = $1 AND seq > $2 "
      "ORDER BY seq LIMIT $3",
      allocation_id, after, limit + 1);
  int64_t last = after;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
    const auto& r = rows[i];
    auto* e = resp.add_entries();
    e->set_seq(r[0].as<int64_t>());
    *e->mutable_at() =
        TimeUtil::MillisecondsToTimestamp(static_cast<int64_t>(r[1].as<double>() * 1000));
    e->set_step(enums::FromColumn<v1::TimelineStep>(r[2].as<std::string>()));
    e->set_state(enums::FromColumn<v1::AllocationState>(r[3].as<std::string>()));
    e->set_task_id(r[4].as<std::string>());
    e->set_task_type(enums::FromColumn<v1::TaskType>(r[5].as<std::string>()));
    e->set_stage(enums::FromColumn<v1::TaskStage>(r[6].as<std::string>()));
    e->set_code(r[7].as<std::string>());
    e->set_detail(r[8].as<std::string>());
    e->set_percent(r[9].as<int>());
    last = e->seq();
  }
  if (static_cast<int>(rows.size()) > limit) resp.set_next_page_token(std::to_string(last));
  return last;
}

}  // namespace gpuaas::scheduler
