#include "gpuaas/scheduler/scheduler_service.hpp"

#include <fstream>
#include <iterator>
#include <map>
#include <thread>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"
#include "gpuaas/scheduler/saga.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "scheduler_metrics.hpp"
#include "scheduler_reasons.hpp"

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

Result<void> ApplyNodeEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events) {
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
  constexpr size_t kColumns = 7;
  std::vector<std::vector<std::string>> cols(kColumns);
  for (const auto& [id, chosen] : newest) {
    const auto& n = snaps[chosen].node();
    const std::string row[kColumns] = {n.node_id(),
                                       n.hostname(),
                                       n.region(),
                                       n.pool(),
                                       enums::Text(n.capacity_profile()),
                                       std::to_string(n.generation()),
                                       events[chosen]->id()};
    for (size_t c = 0; c < kColumns; ++c) cols[c].push_back(row[c]);
  }
  tx.exec_params(
      "INSERT INTO projected_nodes (node_id, hostname, region, pool, capacity_profile, "
      "generation, last_event_id) SELECT * FROM unnest($1::text[], $2::text[], $3::text[], "
      "$4::text[], $5::text[], $6::bigint[], $7::uuid[]) "
      "ON CONFLICT (node_id) DO UPDATE SET hostname = EXCLUDED.hostname, "
      "region = EXCLUDED.region, pool = EXCLUDED.pool, "
      "capacity_profile = EXCLUDED.capacity_profile, generation = EXCLUDED.generation, "
      "last_event_id = EXCLUDED.last_event_id, projected_at = now() "
      "WHERE projected_nodes.generation < EXCLUDED.generation",
      store::TextArrayLiteral(cols[0]), store::TextArrayLiteral(cols[1]),
      store::TextArrayLiteral(cols[2]), store::TextArrayLiteral(cols[3]),
      store::TextArrayLiteral(cols[4]), store::TextArrayLiteral(cols[5]),
      store::TextArrayLiteral(cols[6]));
  return Ok();
}

Result<void> ApplyNodeEvent(pqxx::work& tx, const v1::Event& ev) {
  return ApplyNodeEvents(tx, {&ev});
}

Result<void> ApplySlotEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events) {
  constexpr size_t kColumns = 26;
  std::vector<std::vector<std::string>> cols(kColumns);
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
  for (const auto& [key, chosen] : newest) {
    const v1::SlotSnapshot& snap = snaps[chosen];
    const auto& s = snap.slot();
    const std::string row[kColumns] = {
        s.node_id(),
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
        events[chosen]->id(),
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
    for (size_t c = 0; c < kColumns; ++c) cols[c].push_back(row[c]);
  }
  if (newest.empty()) return Ok();
  // One statement for the batch: each column an array, unnested into rows. node_blockers
  // travels as an array of array literals.
  tx.exec_params(
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
      "WHERE projected_slots.generation < EXCLUDED.generation",
      store::TextArrayLiteral(cols[0]), store::TextArrayLiteral(cols[1]),
      store::TextArrayLiteral(cols[2]), store::TextArrayLiteral(cols[3]),
      store::TextArrayLiteral(cols[4]), store::TextArrayLiteral(cols[5]),
      store::TextArrayLiteral(cols[6]), store::TextArrayLiteral(cols[7]),
      store::TextArrayLiteral(cols[8]), store::TextArrayLiteral(cols[9]),
      store::TextArrayLiteral(cols[10]), store::TextArrayLiteral(cols[11]),
      store::TextArrayLiteral(cols[12]), store::TextArrayLiteral(cols[13]),
      store::TextArrayLiteral(cols[14]), store::TextArrayLiteral(cols[15]),
      store::TextArrayLiteral(cols[16]), store::TextArrayLiteral(cols[17]),
      store::TextArrayLiteral(cols[18]), store::TextArrayLiteral(cols[19]),
      store::TextArrayLiteral(cols[20]), store::TextArrayLiteral(cols[21]),
      store::TextArrayLiteral(cols[22]), store::TextArrayLiteral(cols[23]),
      store::TextArrayLiteral(cols[24]), store::TextArrayLiteral(cols[25]));
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
  auto consumer = svc_.StartConsumer(
      NodeConsumerSpec(),
      inbox::ProjectionHandler(svc_.pg(), kNodeProjection, ApplyNodeEvent, svc_.log(), stats_),
      inbox::ProjectionBatchHandler(svc_.pg(), kNodeProjection, ApplyNodeEvent, ApplyNodeEvents,
                                    svc_.log(), stats_));
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
  auto nats = svc_.nats();
  // Declared by every party that uses them, so start order does not matter.
  for (const auto& spec : {messaging::InventoryEventsStream(), messaging::DeadLetterStream()}) {
    if (auto r = messaging::EnsureStream(*nats, spec); !r.ok()) return r;
  }
  svc_.StartOutboxRelay();
  if (auto r = StartProjections(); !r.ok()) return r;

  const SagaOptions saga = MakeSagaOptions();
  auto gauges = StartAllocationGauges(svc_.pg(), svc_.metrics(), svc_.log());
  svc_.OnDrain("allocation gauges", [gauges] { gauges->Stop(); });
  if (cfg_.placement_index) {
    placement_ = std::make_shared<PlacementCache>(cfg_.common.pg_dsn, svc_.log());
    if (auto r = placement_->Start(); !r.ok()) return r;
    svc_.OnDrain("placement index", [cache = placement_] { cache->Stop(); });
  }
  if (cfg_.group_commit) {
    group_ = std::make_unique<store::GroupCommit>(svc_.pg(), store::GroupCommit::Options{});
  }
  if (auto r = messaging::EnsureStream(*nats, messaging::SchedulerEventsStream()); !r.ok()) {
    return r;
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
    tx.exec0("DELETE FROM projected_nodes");
    tx.exec0("DELETE FROM projected_slots");
    tx.exec_params("DELETE FROM inbox WHERE consumer = $1 OR consumer = $2", kNodeProjection,
                   kSlotProjection);
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
  auto counts =
      store::WithTx(*svc_.pg(), [](pqxx::work& tx) -> Result<std::pair<int64_t, int64_t>> {
        auto r = tx.exec1(
            "SELECT (SELECT count(*) FROM projected_nodes), (SELECT count(*) FROM "
            "projected_slots)");
        return std::make_pair(r[0].as<int64_t>(), r[1].as<int64_t>());
      });
  if (!counts.ok()) return counts.error();
  RebuildStats st;
  uint64_t after = 0;
  for (auto* c : consumers) after += c->Processed();
  st.events_replayed = static_cast<int64_t>(after - before);
  st.nodes = counts->first;
  st.slots = counts->second;
  return st;
}

}  // namespace gpuaas::scheduler
