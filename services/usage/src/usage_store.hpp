#pragma once
// usage's SQL: every statement the consumer and the request handlers run against the ledger's
// tables (meters, usage_records, ledger_clock), each behind a function named for what it does.
// Every function runs in the caller's transaction. Lock order: the ledger clock, then meters.
#include <pqxx/pqxx>

#include <cstdint>
#include <optional>
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

// One allocation's meter, locked FOR UPDATE; nullopt before its first event.
std::optional<Meter> LockMeter(pqxx::work& tx, const std::string& allocation_id);
// Every meter with an open interval, locked FOR UPDATE, by allocation id.
std::vector<Meter> LockOpenMeters(pqxx::work& tx);
void SaveMeter(pqxx::work& tx, const Meter& m);

// A snapshot ahead of its allocation's next generation, kept (a second copy changes nothing);
// and the one that is next now, taken out (nullopt when it has not arrived).
void KeepPending(pqxx::work& tx, const Snapshot& s);
std::optional<Snapshot> TakePending(pqxx::work& tx, const std::string& allocation_id,
                                    int64_t generation);

// Appends the record; false when its id exists already (a replayed event).
bool InsertRecord(pqxx::work& tx, const v1::UsageRecord& r);

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
