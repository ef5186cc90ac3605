#include "gpuaas/usage/usage_policy.hpp"

#include <fmt/format.h>
#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <ctime>
#include <nlohmann/json.hpp>

#include "gpuaas/common/enums.hpp"

namespace gpuaas::usage {

namespace {

using google::protobuf::util::TimeUtil;

bool Stopping(v1::AllocationState s) {
  return s == v1::ALLOCATION_STATE_RELEASING || s == v1::ALLOCATION_STATE_RELEASED ||
         s == v1::ALLOCATION_STATE_FAILED;
}

bool AnyBlocked(const v1::Allocation& a) {
  return std::any_of(a.claims().begin(), a.claims().end(), [](const v1::ResourceClaim& c) {
    return c.phase() == v1::CLAIM_PHASE_CLEANUP_BLOCKED;
  });
}

// Every claim freed (a cleanup proof, or a force-release of what never reached a host).
bool Freed(const v1::Allocation& a) {
  if (a.state() == v1::ALLOCATION_STATE_RELEASED) return true;
  return !a.claims().empty() &&
         std::all_of(a.claims().begin(), a.claims().end(), [](const v1::ResourceClaim& c) {
           return c.phase() == v1::CLAIM_PHASE_RELEASED;
         });
}

v1::UsageStop StopOf(const v1::Allocation& a) {
  const auto& roles = a.release_requested_by().roles();
  if (std::find(roles.begin(), roles.end(), "operator") != roles.end()) {
    return v1::USAGE_STOP_OPERATOR_RELEASE;
  }
  if (a.state() == v1::ALLOCATION_STATE_FAILED) return v1::USAGE_STOP_FAILED;
  return v1::USAGE_STOP_RELEASE_REQUESTED;
}

// An allocation from before SKUs named a unit bills GPU-seconds.
v1::BillableUnit UnitOf(const v1::Allocation& a) {
  return a.billable_unit() == v1::BILLABLE_UNIT_UNSPECIFIED ? v1::BILLABLE_UNIT_GPU_SECOND
                                                            : a.billable_unit();
}

// The claim snapshot every record of an interval copies.
v1::UsageRecord Base(const v1::Allocation& a, v1::UsageKind kind) {
  v1::UsageRecord r;
  r.set_policy_version(kPolicyVersion);
  r.set_kind(kind);
  r.set_tenant(a.tenant());
  r.set_allocation_id(a.allocation_id());
  r.set_sku(a.sku());
  r.set_shape(a.shape());
  r.set_gpu_count(a.gpu_count());
  r.set_region(a.region());
  r.set_pool(a.pool());
  r.set_node_id(a.node_id());
  for (const auto& k : a.slot_keys()) {
    r.add_slot_keys(k);
    if (k.rfind("gpu-", 0) == 0) r.add_gpu_pci_addresses(k.substr(4));
  }
  r.set_network_mode(a.network_mode());
  for (const auto& e : a.endpoints()) {
    if (e.public_ip().empty()) continue;
    r.add_endpoints(fmt::format("{} {}:{}", e.name(), e.public_ip(), e.public_port()));
  }
  // The SKU's unit, as the allocation carries it from its creation.
  r.set_billable_unit(enums::Text(UnitOf(a)));
  return r;
}

std::string KindToken(v1::UsageKind k) {
  return k == v1::USAGE_KIND_STRANDED ? "stranded" : "billable";
}

std::string RecordId(const std::string& alloc, v1::UsageKind k, int64_t day_us) {
  return alloc + "/" + KindToken(k) + "/" + DayText(day_us);
}

v1::UsageRecord Piece(const Interval& iv, int64_t from, int64_t to, v1::UsageStop stop,
                      const std::string& stop_event) {
  v1::UsageRecord r = iv.base;
  r.set_record_id(RecordId(r.allocation_id(), r.kind(), DayStart(from)));
  r.set_day(DayText(from));
  *r.mutable_start() = Stamp(from);
  *r.mutable_end() = Stamp(to);
  r.set_duration_us(to - from);
  const bool per_node = r.billable_unit() == enums::Text(v1::BILLABLE_UNIT_NODE_SECOND);
  r.set_units_micro((per_node ? 1 : static_cast<int64_t>(r.gpu_count())) * (to - from));
  r.set_stop(stop);
  r.add_event_ids(iv.start_event_id);
  if (!stop_event.empty()) r.add_event_ids(stop_event);
  return r;
}

// [from, to) cut at every 00:00 UTC, one record a day; the last piece ends with `last_stop`.
void Pieces(const Interval& iv, int64_t from, int64_t to, v1::UsageStop last_stop,
            const std::string& stop_event, std::vector<v1::UsageRecord>& out) {
  while (from < to) {
    const int64_t next = std::min(DayStart(from) + kDayUs, to);
    const bool last = next == to;
    out.push_back(Piece(iv, from, next, last ? last_stop : v1::USAGE_STOP_DAY_END,
                        last ? stop_event : std::string()));
    from = next;
  }
}

// The interval ends at `at`: its remaining pieces, or corrections of the days it closed past
// `at` (the stop arrived after those days were closed).
std::vector<v1::UsageRecord> Finish(Interval& iv, int64_t at, v1::UsageStop stop,
                                    const std::string& event_id) {
  std::vector<v1::UsageRecord> out;
  const int64_t end = std::max(at, iv.since_us);
  if (end >= iv.until_us) {
    Pieces(iv, iv.until_us, end, stop, event_id, out);
  } else {
    for (int64_t day = DayStart(end); day < iv.until_us; day += kDayUs) {
      const int64_t from = std::max(iv.since_us, day);
      const int64_t to = std::max(from, std::min(end, day + kDayUs));
      v1::UsageRecord r = Piece(iv, from, to, stop, event_id);
      r.set_corrects(r.record_id());
      r.set_record_id(r.record_id() + "/c1");
      r.set_kind(v1::USAGE_KIND_CORRECTION);
      out.push_back(std::move(r));
    }
  }
  iv.until_us = std::max(iv.until_us, end);
  iv.done = true;
  return out;
}

void Begin(Interval& iv, int64_t at, const Snapshot& s, v1::UsageKind kind) {
  iv.since_us = at;
  iv.until_us = at;
  iv.start_event_id = s.event_id;
  iv.base = Base(s.allocation, kind);
}

void Close(Interval& iv, int64_t before, std::vector<v1::UsageRecord>& out) {
  if (iv.since_us == 0 || iv.done || before <= iv.until_us) return;
  Pieces(iv, iv.until_us, before, v1::USAGE_STOP_DAY_END, "", out);
  iv.until_us = before;
}

std::string Decimal6(int64_t micro) {
  const char* sign = micro < 0 ? "-" : "";
  const uint64_t v = micro < 0 ? static_cast<uint64_t>(-(micro + 1)) + 1 : micro;
  return fmt::format("{}{}.{:06d}", sign, v / 1000000, v % 1000000);
}

std::string TimeText(const google::protobuf::Timestamp& t) {
  const int64_t us = Micros(t);
  const std::time_t secs = static_cast<std::time_t>(us / 1000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04d}-{:02d}-{:02d}T{:02d}:{:02d}:{:02d}.{:06d}Z", tm.tm_year + 1900,
                     tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, us % 1000000);
}

std::string Joined(const google::protobuf::RepeatedPtrField<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ";") + i;
  return out;
}

// The values of one record, in kExportColumns order.
std::vector<std::string> Values(const v1::UsageRecord& r) {
  return {r.policy_version(),
          r.record_id(),
          enums::Text(r.kind()),
          r.tenant(),
          r.allocation_id(),
          r.sku(),
          enums::Text(r.shape()),
          std::to_string(r.gpu_count()),
          r.region(),
          r.pool(),
          r.node_id(),
          Joined(r.slot_keys()),
          Joined(r.gpu_pci_addresses()),
          enums::Text(r.network_mode()),
          Joined(r.endpoints()),
          r.day(),
          TimeText(r.start()),
          TimeText(r.end()),
          Decimal6(r.duration_us()),
          r.billable_unit(),
          Decimal6(r.units_micro()),
          r.stop() == v1::USAGE_STOP_UNSPECIFIED ? "" : enums::Text(r.stop()),
          r.corrects(),
          Joined(r.event_ids())};
}

std::string CsvField(const std::string& v) {
  if (v.find_first_of(",\"\r\n") == std::string::npos) return v;
  std::string out = "\"";
  for (char c : v) out += c == '"' ? std::string("\"\"") : std::string(1, c);
  return out + "\"";
}

std::string CsvRow(const std::vector<std::string>& values) {
  std::string out;
  for (size_t i = 0; i < values.size(); ++i) out += (i ? "," : "") + CsvField(values[i]);
  return out + "\r\n";
}

}  // namespace

int64_t Micros(const google::protobuf::Timestamp& t) {
  return t.seconds() * 1000000 + t.nanos() / 1000;
}

google::protobuf::Timestamp Stamp(int64_t us) { return TimeUtil::MicrosecondsToTimestamp(us); }

int64_t DayStart(int64_t us) {
  const int64_t d = us / kDayUs;
  return (us % kDayUs < 0 ? d - 1 : d) * kDayUs;
}

std::string DayText(int64_t us) {
  const std::time_t secs = static_cast<std::time_t>(DayStart(us) / 1000000);
  std::tm tm{};
  gmtime_r(&secs, &tm);
  return fmt::format("{:04d}-{:02d}-{:02d}", tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday);
}

Order OrderOf(const Meter& m, const Snapshot& s) {
  if (s.generation <= m.generation) return Order::kSeen;
  return s.generation == m.generation + 1 ? Order::kNext : Order::kAhead;
}

std::vector<v1::UsageRecord> Apply(Meter& m, const Snapshot& s) {
  std::vector<v1::UsageRecord> out;
  if (OrderOf(m, s) != Order::kNext) return out;  // seen already, or one is missing before it
  m.generation = s.generation;
  const v1::Allocation& a = s.allocation;
  const int64_t at = Micros(a.updated_at());
  Interval& bill = m.billable;
  if (bill.since_us == 0 && !bill.done && a.state() == v1::ALLOCATION_STATE_ACTIVE) {
    Begin(bill, at, s, v1::USAGE_KIND_BILLABLE);
  } else if (bill.since_us != 0 && !bill.done && Stopping(a.state())) {
    auto done = Finish(bill, at, StopOf(a), s.event_id);
    out.insert(out.end(), done.begin(), done.end());
  }
  Interval& lost = m.stranded;
  if (lost.since_us == 0 && !lost.done && AnyBlocked(a)) {
    Begin(lost, at, s, v1::USAGE_KIND_STRANDED);
  } else if (lost.since_us != 0 && !lost.done && Freed(a)) {
    auto done = Finish(lost, at, v1::USAGE_STOP_CLAIMS_FREED, s.event_id);
    out.insert(out.end(), done.begin(), done.end());
  }
  return out;
}

std::vector<v1::UsageRecord> CloseDays(Meter& m, int64_t close_before_us) {
  std::vector<v1::UsageRecord> out;
  Close(m.billable, close_before_us, out);
  Close(m.stranded, close_before_us, out);
  return out;
}

int64_t CloseHorizon(int64_t newest_event_us, int64_t close_lag_us) {
  return DayStart(newest_event_us - close_lag_us);
}

const std::vector<std::string> kExportColumns = {"policy_version",
                                                 "record_id",
                                                 "kind",
                                                 "tenant",
                                                 "allocation_id",
                                                 "sku",
                                                 "shape",
                                                 "gpu_count",
                                                 "region",
                                                 "pool",
                                                 "node_id",
                                                 "slot_keys",
                                                 "gpu_pci_addresses",
                                                 "network_mode",
                                                 "endpoints",
                                                 "day",
                                                 "start",
                                                 "end",
                                                 "duration_s",
                                                 "billable_unit",
                                                 "units",
                                                 "stop",
                                                 "corrects",
                                                 "event_ids"};

std::string CsvHeader() { return CsvRow(kExportColumns); }

std::string CsvLine(const v1::UsageRecord& r) { return CsvRow(Values(r)); }

std::string JsonHeader() {
  nlohmann::ordered_json h;
  h["policy_version"] = kPolicyVersion;
  h["columns"] = kExportColumns;
  return h.dump() + "\n";
}

std::string JsonLine(const v1::UsageRecord& r) {
  const auto values = Values(r);
  nlohmann::ordered_json o;
  for (size_t i = 0; i < kExportColumns.size(); ++i) o[kExportColumns[i]] = values[i];
  return o.dump() + "\n";
}

}  // namespace gpuaas::usage
