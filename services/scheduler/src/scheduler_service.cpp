#include "gpuaas/scheduler/scheduler_service.hpp"

#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "allocation_rows.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"
#include "gpuaas/scheduler/saga.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "projection_store.hpp"
#include "scheduler_metrics.hpp"
#include "scheduler_reasons.hpp"
#include "tenant_feed.hpp"

namespace gpuaas::scheduler {

namespace {
// A batch's events by entity (`keyed[i]` = event i's key and generation): for each key, the
// index of the one to apply, the newest generation and the first of equals, as applying them
// one by one would keep. In key order.
template <typename Key>
std::map<Key, size_t> NewestPerKey(const std::vector<std::pair<Key, int64_t>>& keyed) {
  std::map<Key, std::pair<int64_t, size_t>> newest;
  for (size_t i = 0; i < keyed.size(); ++i) {
    auto [it, added] = newest.try_emplace(keyed[i].first, keyed[i].second, i);
    if (!added && keyed[i].second > it->second.first) it->second = {keyed[i].second, i};
  }
  std::map<Key, size_t> out;
  for (const auto& [key, chosen] : newest) out.emplace(key, chosen.second);
  return out;
}
}  // namespace

Result<void> ApplyNodeEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events,
                             const std::string& source) {
  std::vector<v1::NodeSnapshot> snaps(events.size());
  std::vector<std::pair<std::string, int64_t>> keyed;
  for (size_t i = 0; i < events.size(); ++i) {
    v1::NodeSnapshot& snap = snaps[i];
    if (!events[i]->data().UnpackTo(&snap) || snap.node().node_id().empty()) {
      return Error::InvalidArgument(reason::kMalformedEvent,
                                    "event data is not a gpuaas.v1.NodeSnapshot");
    }
    keyed.emplace_back(snap.node().node_id(), snap.node().generation());
  }
  const auto newest = NewestPerKey(keyed);  // one row per node
  if (newest.empty()) return Ok();
  std::vector<NodeUpsert> rows;
  rows.reserve(newest.size());
  for (const auto& [id, chosen] : newest) rows.push_back({&snaps[chosen], events[chosen]});
  UpsertProjectedNodes(tx, rows);
  // A drain of a node that holds nothing (any more): drained at once.
  for (const auto& [id, chosen] : newest) {
    if (snaps[chosen].node().admin_state() != v1::NODE_ADMIN_STATE_DRAINING) continue;
    if (auto r = AnnounceIfEmptied(tx, id, source, ""); !r.ok()) return r.error();
  }
  return Ok();
}

Result<void> ApplyNodeEvent(pqxx::work& tx, const v1::Event& ev, const std::string& source) {
  return ApplyNodeEvents(tx, {&ev}, source);
}

Result<void> ApplySlotEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events) {
  std::vector<v1::SlotSnapshot> snaps(events.size());
  std::vector<std::pair<std::pair<std::string, std::string>, int64_t>> keyed;
  for (size_t i = 0; i < events.size(); ++i) {
    v1::SlotSnapshot& snap = snaps[i];
    if (!events[i]->data().UnpackTo(&snap) || snap.slot().node_id().empty() ||
        snap.slot().slot_key().empty()) {
      return Error::InvalidArgument(reason::kMalformedEvent,
                                    "event data is not a gpuaas.v1.SlotSnapshot");
    }
    keyed.emplace_back(std::make_pair(snap.slot().node_id(), snap.slot().slot_key()),
                       snap.slot().generation());
  }
  const auto newest = NewestPerKey(keyed);  // one row per slot
  if (newest.empty()) return Ok();
  std::vector<SlotUpsert> rows;
  rows.reserve(newest.size());
  for (const auto& [key, chosen] : newest) rows.push_back({&snaps[chosen], events[chosen]});
  UpsertProjectedSlots(tx, rows);
  return Ok();
}

Result<void> ApplySlotEvent(pqxx::work& tx, const v1::Event& ev) {
  return ApplySlotEvents(tx, {&ev});
}

void SchedulerConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("scheduler.catalog_file", &catalog_file,
        "SKU/profile catalog YAML (empty: the catalog built into the binary)", "");
  s.Add("scheduler.provision_deadline_s", &provision_deadline_s,
        "A vm.provision task not answered within this fails the allocation (node_unresponsive)",
        900, config::Range(1, 86400));
  s.Add("scheduler.release_deadline_s", &release_deadline_s,
        "A vm.release task not answered within this leaves the slots cleanup_blocked", 300,
        config::Range(1, 86400));
  s.Add("scheduler.cleanup_deadline_s", &cleanup_deadline_s,
        "A slot.cleanup task not answered within this leaves the slots cleanup_blocked", 1800,
        config::Range(1, 86400));
  s.Add("scheduler.sweep_interval_ms", &sweep_interval_ms,
        "How often each replica looks for node tasks past their deadline", 1000,
        config::Range(10, 60000));
  s.Add("scheduler.placement_index", &placement_index,
        "Propose placements from this replica's in-memory index, kept current through PostgreSQL "
        "notifications (false: read every create's candidates from SQL)",
        true);
  s.Add("scheduler.group_commit", &group_commit,
        "Creates that arrive together share one transaction and commit, each in a savepoint of "
        "its own (false: a transaction each); how many overlap is bounded by rpc.workers",
        true);
}

SchedulerService::SchedulerService(SchedulerConfig cfg)
    : cfg_(std::move(cfg)),
      svc_(runtime::Component{"scheduler", &Migrations()}, cfg_.common),
      stats_(std::make_shared<inbox::ProjectionStats>()) {}

namespace {
// Inventory events per fetch, each fetch applied in one transaction: a fleet's replay
// (a new replica, a rebuild) costs a commit per this many events, not per event.
constexpr int kProjectionBatch = 1024;
}  // namespace

messaging::ConsumerSpec SchedulerService::NodeConsumerSpec() const {
  messaging::ConsumerSpec spec;
  spec.stream = messaging::InventoryEventsStream().name;
  spec.durable = kNodeProjection;
  spec.filter_subject = "gpuaas.v1.evt.inventory.node.>";
  spec.batch = kProjectionBatch;
  spec.prefetch = true;
  return spec;
}

messaging::ConsumerSpec SchedulerService::SlotConsumerSpec() const {
  messaging::ConsumerSpec spec;
  spec.stream = messaging::InventoryEventsStream().name;
  spec.durable = kSlotProjection;
  spec.filter_subject = "gpuaas.v1.evt.inventory.slot.>";
  spec.batch = kProjectionBatch;
  spec.prefetch = true;
  return spec;
}

namespace {

// The catalog of scheduler.catalog_file, or the one compiled in.
Result<Catalog> LoadCatalog(const std::string& file) {
  std::string yaml = Catalog::DefaultYaml();
  if (!file.empty()) {
    std::ifstream in(file);
    if (!in) {
      return Error::InvalidArgument(reason::kCatalogUnreadable,
                                    "cannot read scheduler.catalog_file " + file);
    }
    yaml.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }
  return Catalog::Parse(yaml);
}

}  // namespace

Result<void> SchedulerService::StartProjections() {
  // A fetched batch of inventory events is applied in one transaction (slots in one
  // statement); one by one only when that fails.
  const std::string source = svc_.source();
  auto one = [source](pqxx::work& tx, const v1::Event& ev) {
    return ApplyNodeEvent(tx, ev, source);
  };
  auto batch = [source](pqxx::work& tx, const std::vector<const v1::Event*>& events) {
    return ApplyNodeEvents(tx, events, source);
  };
  auto consumer = svc_.StartConsumer(
      NodeConsumerSpec(),
      inbox::ProjectionHandler(svc_.pg(), kNodeProjection, one, svc_.log(), stats_),
      inbox::ProjectionBatchHandler(svc_.pg(), kNodeProjection, one, batch, svc_.log(), stats_));
  if (!consumer.ok()) return consumer.error();
  nodes_consumer_ = *consumer;
  auto slots = svc_.StartConsumer(
      SlotConsumerSpec(),
      inbox::ProjectionHandler(svc_.pg(), kSlotProjection, ApplySlotEvent, svc_.log(), stats_),
      inbox::ProjectionBatchHandler(svc_.pg(), kSlotProjection, ApplySlotEvent, ApplySlotEvents,
                                    svc_.log(), stats_));
  if (!slots.ok()) return slots.error();
  slots_consumer_ = *slots;
  return Ok();
}

SagaOptions SchedulerService::MakeSagaOptions() {
  SagaOptions saga;
  saga.source = svc_.source();
  saga.provision_deadline_s = cfg_.provision_deadline_s;
  saga.release_deadline_s = cfg_.release_deadline_s;
  saga.cleanup_deadline_s = cfg_.cleanup_deadline_s;
  saga.sweep_interval_ms = cfg_.sweep_interval_ms;
  saga.metrics = std::make_shared<SchedulerMetrics>(svc_.metrics());
  return saga;
}

Result<void> SchedulerService::Start() {
  auto catalog = LoadCatalog(cfg_.catalog_file);
  if (!catalog.ok()) return catalog.error();
  if (auto r = svc_.Start(); !r.ok()) return r;
  svc_.StartOutboxRelay();
  if (auto r = StartProjections(); !r.ok()) return r;
  if (auto r = StartTenantFeed(svc_); !r.ok()) return r;

  const SagaOptions saga = MakeSagaOptions();
  auto gauges = StartAllocationGauges(svc_.pg(), svc_.metrics(), svc_.log());
  svc_.OnDrain("allocation gauges", [gauges] { gauges->Stop(); });
  if (cfg_.placement_index) {
    placement_ = std::make_shared<PlacementCache>(cfg_.common.pg_dsn, svc_.log());
    placement_->SetOrderableShapes(catalog->OrderableSlices());
    if (auto r = placement_->Start(); !r.ok()) return r;
    auto capacity = StartCapacityGauges(placement_, svc_.metrics());
    svc_.OnDrain("placement index", [cache = placement_, capacity] {
      capacity->Stop();
      cache->Stop();
    });
  }
  if (cfg_.group_commit) {
    group_ = std::make_unique<store::GroupCommit>(svc_.pg(), store::GroupCommit::Options{});
  }
  // Only registers (requests are served from ServeRequests on); before StartSaga, so a bad app
  // table (checked by AppHandlers) aborts before the saga's consumers run.
  RegisterRoutes(*catalog, saga);
  if (auto r = StartSaga(svc_, saga); !r.ok()) return r;
  return svc_.ServeRequests();
}

Result<RebuildStats> SchedulerService::RebuildProjection(std::chrono::milliseconds timeout) {
  std::lock_guard lock(rebuild_mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::vector<messaging::Consumer*> consumers = {nodes_consumer_, slots_consumer_};
  for (auto* c : consumers) {
    c->Stop();
    if (auto r = c->DeleteDurable(); !r.ok()) return r.error();
  }
  auto cleared = store::WithTx(*svc_.pg(), [](pqxx::work& tx) -> Result<void> {
    EmptyProjections(tx, kNodeProjection, kSlotProjection);
    return Ok();
  });
  if (!cleared.ok()) return cleared.error();
  uint64_t before = 0;
  for (auto* c : consumers) {
    before += c->Processed();
    if (auto r = c->Start(); !r.ok()) return r.error();
  }
  for (auto* c : consumers) {
    while (true) {
      auto backlog = c->Backlog();
      if (backlog.ok() && *backlog == 0) break;
      if (std::chrono::steady_clock::now() > deadline) {
        return Error::Of(Code::kDeadlineExceeded, reason::kRebuildIncomplete,
                         "replay is still running; the projection will finish catching up", {},
                         true);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  auto counts = store::WithTx(
      *svc_.pg(), [](pqxx::work& tx) -> Result<ProjectionCounts> { return CountProjections(tx); });
  if (!counts.ok()) return counts.error();
  RebuildStats st;
  uint64_t after = 0;
  for (auto* c : consumers) after += c->Processed();
  st.events_replayed = static_cast<int64_t>(after - before);
  st.nodes = counts->nodes;
  st.slots = counts->slots;
  return st;
}

}  // namespace gpuaas::scheduler
