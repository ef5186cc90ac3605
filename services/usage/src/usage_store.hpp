#pragma once
// usage's SQL: every statement the consumer and the request handlers run against the ledger's
// tables (meters, usage_records, ledger_clock), each behind a function named for what it does.
// Every function runs in the caller's transaction. Lock order: the ledger clock, then meters.
#include <pqxx/pqxx>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gpuaas/usage/usage_policy.hpp"
#include "gpuaas/v1/usage.pb.h"

namespace gpuaas::usage {

// The ledger's clock: the newest scheduler event time applied, and the midnight before which
// every open interval's days are closed. Locked FOR UPDATE (every consumer transaction takes
// it first: the clock moves in stream order).
struct Clock {
  int64_t newest_event_us = 0;
  int64_t closed_before_us = 0;
};
Clock LockClock(pqxx::work& tx);
void SaveClock(pqxx::work& tx, const Clock& c);
// Read without a lock.
Clock ReadClock(pqxx::work& tx);
// Nothing applied yet: no meter, the clock at zero.
bool LedgerEmpty(pqxx::work& tx);

// The meters of these allocations (those that have one), locked FOR UPDATE, by allocation id.
std::map<std::string, Meter> LockMeters(pqxx::work& tx, const std::vector<std::string>& ids);
// Every meter with an open interval, locked FOR UPDATE, by allocation id.
std::vector<Meter> LockOpenMeters(pqxx::work& tx);
// Inserts or updates the meters, in one statement.
void SaveMeters(pqxx::work& tx, const std::vector<const Meter*>& meters);

// Snapshots kept ahead of their allocation's next generation: those of these allocations; one
// kept (a second copy changes nothing); one applied, dropped.
std::vector<Snapshot> LoadPending(pqxx::work& tx, const std::vector<std::string>& ids);
void KeepPending(pqxx::work& tx, const Snapshot& s);
void DropPending(pqxx::work& tx, const std::string& allocation_id, int64_t generation);

// A record and what it counts towards ("billable" or "stranded"; "" for a correction whose
// corrected record was written earlier: that record's).
struct NewRecord {
  v1::UsageRecord record;
  std::string counts_as;
};
// Appends the records in one statement; returns the ids it wrote (a replayed record exists
// already and is not written again).
std::set<std::string> InsertRecords(pqxx::work& tx, const std::vector<NewRecord>& records);

// A period of whole UTC days [from_day_us, to_day_us), optionally one tenant's.
struct Period {
  int64_t from_day_us = 0;
  int64_t to_day_us = 0;
  std::string tenant;  // "" = every tenant
};
// Where a page starts: after this key (day, tenant, allocation, record id); empty = the first.
struct PageKey {
  std::string day;
  std::string tenant;
  std::string allocation_id;
  std::string record_id;
  bool empty() const { return record_id.empty(); }
};
// Up to `limit` records of the period after `after`, ordered by day, tenant, allocation, id.
std::vector<v1::UsageRecord> ListRecords(pqxx::work& tx, const Period& p, const PageKey& after,
                                         int limit);

// Totals per tenant and SKU: billable and stranded micro-units, a corrected record replaced by
// its correction; distinct allocations.
std::vector<v1::UsageTotal> Summarize(pqxx::work& tx, const Period& p);

}  // namespace gpuaas::usage
