#pragma once
// The SQL of the allocation lifecycle (saga.cpp): node task rows, claim phases, the allocation's
// state and what the lifecycle records on it, endpoint exposures and the timeline page. Every
// function runs in the caller's transaction (the caller holds the allocation row lock where
// the saga needs it: allocation row first, then its task rows). Internal to the scheduler.
#include <pqxx/pqxx>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpuaas/scheduler/task_status.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::scheduler {

// --- node tasks ------------------------------------------------------------------------------

struct TaskRow {
  std::string task_id;
  std::string allocation_id;
  v1::TaskType type = v1::TASK_TYPE_UNSPECIFIED;
  int attempt = 0;
  std::optional<TaskStatus> status;  // nullopt: a status this build does not know (a newer writer)
};
// The task row `task_id` (FOR UPDATE when `lock`), if any.
std::optional<TaskRow> FindTask(pqxx::work& tx, const std::string& task_id, bool lock);
// The next attempt number of the allocation's tasks of `type` (1 for the first).
int NextAttempt(pqxx::work& tx, const std::string& allocation_id, v1::TaskType type);
// A task row, `sent`, due `deadline_s` from now.
void InsertTask(pqxx::work& tx, const std::string& task_id, const std::string& allocation_id,
                const std::string& node_id, v1::TaskType type, int attempt, int64_t deadline_s);
// Every `sent` task of the allocation becomes `cancelled`.
void CancelOpenTasks(pqxx::work& tx, const std::string& allocation_id);
// A result for the task: its status (succeeded, failed, rejected) and error.
void FinishTask(pqxx::work& tx, const std::string& task_id, TaskStatus status,
                const std::string& error_reason, const std::string& error_detail);
// The allocation has a task `sent` and not answered.
bool HasOpenTask(pqxx::work& tx, const std::string& allocation_id);
// Ids of `sent` tasks past their deadline, the most overdue first, at most `max`.
std::vector<std::string> OverdueTaskIds(pqxx::work& tx, int max);
// The task row FOR UPDATE if it is still `sent` and past its deadline.
bool LockOverdueTask(pqxx::work& tx, const std::string& task_id);
// The task becomes `timed_out` (node_unresponsive).
void MarkTaskTimedOut(pqxx::work& tx, const std::string& task_id);
// `sent` tasks per type, over every replica; each of the three types present.
std::map<std::string, int> OpenTasksByType(pqxx::work& tx);

// --- claims ----------------------------------------------------------------------------------

// The live slots of an allocation as the node needs them (from the slot projection); with each
// slot's runtime profile sizes into `vcpus`, `mem`, `huge` and the first profile name into
// `profile` (each optional).
std::vector<v1::BundleSlot> BundleSlots(pqxx::work& tx, const std::string& allocation_id,
                                        std::vector<int>* vcpus, std::vector<int64_t>* mem,
                                        std::vector<int>* huge, std::string* profile);
// Frees the live claims (cleanup proof or force) and says how many.
int FreeClaims(pqxx::work& tx, const std::string& allocation_id);
bool HasLiveClaims(pqxx::work& tx, const std::string& allocation_id);
// The slot keys of the allocation's live slot claims, in order.
std::vector<std::string> LiveSlotKeys(pqxx::work& tx, const std::string& allocation_id);

// --- the allocation row ----------------------------------------------------------------------

// A new state (generation + 1); with `set_failure` the failure columns too.
void SetAllocationState(pqxx::work& tx, const std::string& allocation_id, v1::AllocationState state,
                        bool set_failure, const std::string& stage, const std::string& code,
                        const std::string& detail);
// What the first vm.provision was sent with (attempt 1).
void RecordProvisionInputs(pqxx::work& tx, const std::string& allocation_id,
                           const std::string& image, const std::string& hostname,
                           const std::vector<std::string>& ssh_keys);
// The network the node observed; the VM is up.
void RecordObservedNetwork(pqxx::work& tx, const std::string& allocation_id,
                           const v1::ProvisionOutput& out);
// Who asked for the release, and why: the request token's principal whole (subject, tenant,
// roles, token id) and the request's reason.
void RecordReleaseActor(pqxx::work& tx, const std::string& allocation_id,
                        const v1::Principal& actor);

// --- endpoints -------------------------------------------------------------------------------

// The allocation asked for endpoints that ingress has not reported applied (active, or drifted
// and repaired) yet.
bool EndpointsPending(pqxx::work& tx, const std::string& allocation_id);
// The exposure id and generation last stored for the endpoint, FOR UPDATE; none when the
// allocation has no such endpoint.
std::optional<std::pair<std::string, int64_t>> LockEndpointExposure(
    pqxx::work& tx, const std::string& allocation_id, const std::string& name);
// The endpoint as ingress reports it (inserted when the allocation did not ask for it).
void UpsertEndpointExposure(pqxx::work& tx, const v1::Exposure& e, int64_t generation);

// --- timeline --------------------------------------------------------------------------------

// Up to `limit` timeline rows of the allocation after seq `after` into `resp` (and its
// next_page_token when more follow); the seq of the last one added (`after` when none).
int64_t AddTimelineEntries(pqxx::work& tx, const std::string& allocation_id, int64_t after,
                           int limit, v1::GetAllocationTimelineResponse& resp);

}  // namespace gpuaas::scheduler
