#pragma once
// The billing policy usage-policy/1 (proto/gpuaas/v1/usage.proto states it), as pure functions:
// an allocation's meter, moved by each of its snapshots in generation order, yields the usage
// records; a day closes once the ledger's horizon is past it. No clock, no I/O: the same events
// in the same order give the same records, which is what makes a rebuilt ledger identical.
#include <cstdint>
#include <string>
#include <vector>

#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/usage.pb.h"

namespace gpuaas::usage {

inline constexpr const char* kPolicyVersion = "usage-policy/1";
inline constexpr int64_t kDayUs = int64_t{86400} * 1000000;

// One of the two intervals an allocation can have: billable (active until a release, failure
// or force-release) and stranded (its claims cleanup_blocked until freed).
struct Interval {
  int64_t since_us = 0;  // 0: not started
  int64_t until_us = 0;  // records exist for [since, until): until is the last day closed
  bool done = false;     // stopped: no more records (except corrections)
  std::string start_event_id;
  v1::UsageRecord base;  // the claim snapshot when it started (every record copies it)
};

// What the ledger keeps per allocation.
struct Meter {
  std::string allocation_id;
  int64_t generation = 0;  // the newest snapshot applied
  Interval billable;
  Interval stranded;
};

// A snapshot of the allocation as the scheduler announced it.
struct Snapshot {
  std::string event_id;
  int64_t generation = 0;
  v1::Allocation allocation;
};

// Microseconds since the epoch of a timestamp; its UTC day's 00:00; "YYYY-MM-DD".
int64_t Micros(const google::protobuf::Timestamp& t);
google::protobuf::Timestamp Stamp(int64_t us);
int64_t DayStart(int64_t us);
std::string DayText(int64_t us);

// Where a snapshot stands against the meter. The scheduler announces every generation of an
// allocation, from 1, one event each: a snapshot more than one ahead means the one between is
// still on its way (a redelivery overtaken by later events) and must be applied first, or a
// stop would be taken from a later state's time (the ledger keeps it until then).
enum class Order { kNext, kSeen, kAhead };
Order OrderOf(const Meter& m, const Snapshot& s);

// Applies one snapshot: nothing for an older or equal generation (a duplicate or a redelivery)
// or one ahead of the next (kAhead: the caller keeps it for later); otherwise the records it
// completes (billable pieces up to a stop; stranded pieces when the claims are freed; corrections
// when the stop lies before days already closed).
std::vector<v1::UsageRecord> Apply(Meter& m, const Snapshot& s);

// Closes the whole UTC days before `close_before_us` (a midnight) of the open intervals: a
// record per day, ending DAY_END. Nothing when nothing is open or no day is complete.
std::vector<v1::UsageRecord> CloseDays(Meter& m, int64_t close_before_us);

// The midnight before which days may close, given the newest event time seen and the lag
// allowed for transactions that commit out of their start-time order.
int64_t CloseHorizon(int64_t newest_event_us, int64_t close_lag_us);

// Export lines, in the stable column order (kExportColumns): the header (with the policy
// version) and one line per record. CSV follows RFC 4180; JSON lines are objects with the same
// keys in the same order.
extern const std::vector<std::string> kExportColumns;
std::string CsvHeader();
std::string CsvLine(const v1::UsageRecord& r);
std::string JsonHeader();
std::string JsonLine(const v1::UsageRecord& r);

}  // namespace gpuaas::usage
