// The ledger's consumer: a batch of the scheduler's allocation events applied set-based. The
// policy is pure (usage_policy.hpp), so a batch runs it in memory, event by event in stream
// order, exactly as one event per transaction would, and writes what changed with one statement
// per table: the same events give the same records however they were batched.
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/usage/usage_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/usage.pb.h"
#include "usage_metrics.hpp"
#include "usage_reasons.hpp"
#include "usage_store.hpp"

namespace gpuaas::usage {

namespace {

constexpr const char* kRecordCreated = "gpuaas.v1.evt.usage.record.created";

std::string CountsAs(v1::UsageKind kind) {
  return kind == v1::USAGE_KIND_STRANDED ? "stranded" : "billable";
}

// One batch in memory: the meters it touches (locked), the snapshots kept ahead, the clock,
// and the records it made, then written in one go.
class Batch {
 public:
  Batch(pqxx::work& tx, const Context& c) : tx_(tx), c_(c), clock_(LockClock(tx)) {}

  // Reads the meters and kept snapshots of the events' allocations.
  void Load(const std::vector<Snapshot>& events);
  // One event, as ApplyAllocationEvent would apply it alone.
  void Apply(Snapshot s);
  // Writes the meters, kept snapshots, clock, records and their events.
  Result<void> Write();

 private:
  using Key = std::pair<std::string, int64_t>;  // allocation, generation
  // The records of `made`, with what each counts towards.
  void Add(std::vector<v1::UsageRecord> made);
  // The days before the horizon, closed for every open meter (the one in hand first).
  void CloseDays(const std::string& in_hand, int64_t horizon);

  pqxx::work& tx_;
  const Context& c_;
  Clock clock_;
  bool clock_moved_ = false;
  std::map<std::string, Meter> meters_;
  std::set<std::string> changed_;
  bool all_open_loaded_ = false;
  std::map<Key, Snapshot> pending_;  // kept, loaded or new
  std::set<Key> stored_pending_;     // those in the table
  std::vector<NewRecord> records_;
  std::map<std::string, std::string> counts_as_;  // of this batch's records, by id
};

void Batch::Load(const std::vector<Snapshot>& events) {
  std::vector<std::string> ids;
  ids.reserve(events.size());
  for (const auto& s : events) ids.push_back(s.allocation.allocation_id());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  meters_ = LockMeters(tx_, ids);
  for (auto& s : LoadPending(tx_, ids)) {
    Key k{s.allocation.allocation_id(), s.generation};
    stored_pending_.insert(k);
    pending_.emplace(std::move(k), std::move(s));
  }
}

void Batch::Add(std::vector<v1::UsageRecord> made) {
  for (auto& r : made) {
    std::string counts_as;
    if (r.kind() != v1::USAGE_KIND_CORRECTION) {
      counts_as = CountsAs(r.kind());
    } else if (auto it = counts_as_.find(r.corrects()); it != counts_as_.end()) {
      counts_as = it->second;  // corrects a record of this batch
    }
    counts_as_[r.record_id()] = counts_as;
    records_.push_back({std::move(r), std::move(counts_as)});
  }
}

void Batch::CloseDays(const std::string& in_hand, int64_t horizon) {
  Add(usage::CloseDays(meters_[in_hand], horizon));
  if (!all_open_loaded_) {
    // The open meters this batch has not touched are as the table has them.
    for (auto& m : LockOpenMeters(tx_)) meters_.try_emplace(m.allocation_id, std::move(m));
    all_open_loaded_ = true;
  }
  for (auto& [id, m] : meters_) {
    if (id == in_hand) continue;
    auto closed = usage::CloseDays(m, horizon);
    if (closed.empty()) continue;
    changed_.insert(id);
    Add(std::move(closed));
  }
}

void Batch::Apply(Snapshot s) {
  const std::string id = s.allocation.allocation_id();
  auto [it, fresh] = meters_.try_emplace(id);
  Meter& meter = it->second;
  if (fresh) meter.allocation_id = id;
  switch (OrderOf(meter, s)) {
    case Order::kSeen:
      return;  // a duplicate or older news
    case Order::kAhead:
      // The one between is still on its way (a redelivery overtaken by later events): this one
      // waits for it, so a stop is never taken from a later state's time.
      pending_.try_emplace(Key{id, s.generation}, std::move(s));
      return;
    case Order::kNext:
      break;
  }
  // This one, then whatever was waiting for it, in generation order.
  int64_t newest = clock_.newest_event_us;
  std::optional<Snapshot> next = std::move(s);
  while (next) {
    Add(usage::Apply(meter, *next));
    newest = std::max(newest, Micros(next->allocation.updated_at()));
    next.reset();
    if (auto p = pending_.find(Key{id, meter.generation + 1}); p != pending_.end()) {
      next = std::move(p->second);
      pending_.erase(p);
    }
  }
  changed_.insert(id);
  // The horizon moves with the scheduler database's times, in stream order.
  clock_.newest_event_us = newest;
  clock_moved_ = true;
  const int64_t horizon =
      CloseHorizon(clock_.newest_event_us, c_.cfg.close_lag_s * int64_t{1000000});
  if (horizon > clock_.closed_before_us) {
    CloseDays(id, horizon);
    clock_.closed_before_us = horizon;
  }
}

Result<void> Batch::Write() {
  std::vector<const Meter*> meters;
  for (const auto& id : changed_) meters.push_back(&meters_.at(id));
  SaveMeters(tx_, meters);
  for (const auto& k : stored_pending_) {
    if (!pending_.count(k)) DropPending(tx_, k.first, k.second);
  }
  for (const auto& [k, s] : pending_) {
    if (!stored_pending_.count(k)) KeepPending(tx_, s);
  }
  if (clock_moved_) SaveClock(tx_, clock_);
  // A replayed record exists already: it is neither written nor announced again.
  const std::set<std::string> written = InsertRecords(tx_, records_);
  std::vector<v1::UsageRecordCreated> data;
  data.reserve(written.size());
  for (const auto& n : records_) {
    if (!written.count(n.record.record_id())) continue;
    *data.emplace_back().mutable_record() = n.record;
    if (c_.metrics != nullptr) c_.metrics->Recorded(n.record);
  }
  std::vector<outbox::EventSpec> specs;
  specs.reserve(data.size());
  for (const auto& d : data) {
    const auto& r = d.record();
    specs.push_back({kRecordCreated, "", c_.source, r.record_id(), 1, r.allocation_id(), "", &d});
  }
  auto appended = outbox::AppendMany(tx_, specs);
  if (!appended.ok()) return appended.error();
  return Ok();
}

}  // namespace

Result<void> ApplyAllocationEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events,
                                   const Context& c) {
  std::vector<Snapshot> snaps;
  snaps.reserve(events.size());
  for (const v1::Event* ev : events) {
    v1::AllocationSnapshot snap;
    if (!ev->data().UnpackTo(&snap) || !ids::IsUuid(snap.allocation().allocation_id())) {
      return Error::InvalidArgument(reason::kMalformedEvent,
                                    "event data is not a gpuaas.v1.AllocationSnapshot with an id",
                                    {{"event_id", ev->id()}});
    }
    const int64_t generation =
        ev->generation() > 0 ? ev->generation() : snap.allocation().generation();
    snaps.push_back(Snapshot{ev->id(), generation, std::move(*snap.mutable_allocation())});
  }
  if (snaps.empty()) return Ok();
  Batch batch(tx, c);
  batch.Load(snaps);
  for (auto& s : snaps) batch.Apply(std::move(s));
  return batch.Write();
}

Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const Context& c) {
  return ApplyAllocationEvents(tx, {&ev}, c);
}

}  // namespace gpuaas::usage
