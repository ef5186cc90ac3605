#pragma once
// Scheduler: owns the SKU catalog, allocations and claims (later issues), and a projection of
// inventory built from its events. Serves gpuaas.v1.scheduler.* requests.
#include <memory>
#include <mutex>
#include <string>

#include "gpuaas/common/config.hpp"
#include "gpuaas/common/group_commit.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::scheduler {

inline constexpr const char* kNodeProjection = "scheduler-inventory-nodes";
inline constexpr const char* kSlotProjection = "scheduler-inventory-slots";

struct SchedulerConfig {
  runtime::CommonConfig common;
  std::string catalog_file;  // "" = the catalog compiled in (config/catalog.yaml)
  int64_t provision_deadline_s = 900;
  int64_t release_deadline_s = 300;
  int64_t cleanup_deadline_s = 1800;
  int64_t sweep_interval_ms = 1000;
  bool placement_index = true;
  bool group_commit = true;
  void Register(config::Schema& schema);
};

const std::vector<store::Migration>& Migrations();

// Applies one inventory node event to the projection in `tx` (generation-guarded); a draining
// node without live claims is announced as emptied (gpuaas.v1.evt.scheduler.node.emptied, with
// `source` as the event's source).
Result<void> ApplyNodeEvent(pqxx::work& tx, const v1::Event& ev,
                            const std::string& source = "scheduler");
// Several node events in one statement (the projection's batch path; each node's newest
// generation); a malformed one fails them all (the one-by-one path then rejects just it).
Result<void> ApplyNodeEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events,
                             const std::string& source = "scheduler");
// Applies one inventory slot snapshot event to the slot projection (generation-guarded).
Result<void> ApplySlotEvent(pqxx::work& tx, const v1::Event& ev);
// Several slot events in one statement (the projection's batch path); a malformed one fails
// them all (the one-by-one path then rejects just it).
Result<void> ApplySlotEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events);

struct RebuildStats {
  int64_t events_replayed = 0;
  int64_t nodes = 0;
  int64_t slots = 0;
};

class Catalog;
class PlacementCache;
struct SagaOptions;

class SchedulerService {
 public:
  explicit SchedulerService(SchedulerConfig cfg);
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown() { svc_.Shutdown(); }
  runtime::Service& runtime() { return svc_; }
  const inbox::ProjectionStats& projection_stats() const { return *stats_; }
  // The replica's placement index (null with scheduler.placement_index off).
  PlacementCache* placement_index() const { return placement_.get(); }
  // Group commit of creates (null with scheduler.group_commit off).
  store::GroupCommit* group_commit() const { return group_.get(); }

  // Drops the node and slot projections and replays the inventory stream from its first
  // message; returns once the replay caught up (or the deadline passed).
  Result<RebuildStats> RebuildProjection(std::chrono::milliseconds timeout);

 private:
  messaging::ConsumerSpec NodeConsumerSpec() const;
  messaging::ConsumerSpec SlotConsumerSpec() const;
  // The node and slot projection consumers.
  Result<void> StartProjections();
  SagaOptions MakeSagaOptions();
  // The route table (scheduler_routes.cpp): every request subject the service serves.
  void RegisterRoutes(const Catalog& catalog, const SagaOptions& saga);
  SchedulerConfig cfg_;
  runtime::Service svc_;
  std::shared_ptr<inbox::ProjectionStats> stats_;
  messaging::Consumer* nodes_consumer_ = nullptr;
  messaging::Consumer* slots_consumer_ = nullptr;
  std::mutex rebuild_mu_;
  std::shared_ptr<PlacementCache> placement_;
  std::unique_ptr<store::GroupCommit> group_;
};

}  // namespace gpuaas::scheduler
