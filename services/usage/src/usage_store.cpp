#include "usage_store.hpp"

#include "gpuaas/common/enums.hpp"

namespace gpuaas::usage {

namespace {

std::string Bytes(const google::protobuf::Message& m) { return m.SerializeAsString(); }

v1::UsageRecord ParseRecord(const pqxx::field& f) {
  v1::UsageRecord r;
  const pqxx::binarystring raw(f);
  r.ParseFromArray(raw.data(), static_cast<int>(raw.size()));
  return r;
}

void ReadInterval(const pqxx::row& row, int at, Interval& iv) {
  iv.since_us = row[at].as<int64_t>();
  iv.until_us = row[at + 1].as<int64_t>();
  iv.done = row[at + 2].as<bool>();
  iv.start_event_id = row[at + 3].as<std::string>();
  if (iv.since_us != 0) iv.base = ParseRecord(row[at + 4]);
}

constexpr const char* kMeterColumns =
    "allocation_id, generation, bill_since_us, bill_until_us, bill_done, bill_start_event, "
    "bill_base, lost_since_us, lost_until_us, lost_done, lost_start_event, lost_base";

Meter ReadMeter(const pqxx::row& row) {
  Meter m;
  m.allocation_id = row[0].as<std::string>();
  m.generation = row[1].as<int64_t>();
  ReadInterval(row, 2, m.billable);
  ReadInterval(row, 7, m.stranded);
  return m;
}

bool Open(const Interval& iv) { return iv.since_us != 0 && !iv.done; }

}  // namespace

Clock LockClock(pqxx::work& tx) {
  const auto r =
      tx.exec("SELECT newest_event_us, closed_before_us FROM ledger_clock WHERE id = 1 FOR UPDATE");
  return {r[0][0].as<int64_t>(), r[0][1].as<int64_t>()};
}

Clock ReadClock(pqxx::work& tx) {
  const auto r = tx.exec("SELECT newest_event_us, closed_before_us FROM ledger_clock WHERE id = 1");
  return {r[0][0].as<int64_t>(), r[0][1].as<int64_t>()};
}

bool LedgerEmpty(pqxx::work& tx) {
  return tx
      .exec(
          "SELECT NOT EXISTS (SELECT 1 FROM meters) AND (SELECT newest_event_us = 0 FROM "
          "ledger_clock WHERE id = 1)")[0][0]
      .as<bool>();
}

void SaveClock(pqxx::work& tx, const Clock& c) {
  tx.exec_params("UPDATE ledger_clock SET newest_event_us = $1, closed_before_us = $2 WHERE id = 1",
                 c.newest_event_us, c.closed_before_us);
}

std::optional<Meter> LockMeter(pqxx::work& tx, const std::string& allocation_id) {
  const auto r = tx.exec_params(
      std::string("SELECT ") + kMeterColumns + " FROM meters WHERE allocation_id = $1 FOR UPDATE",
      allocation_id);
  if (r.empty()) return std::nullopt;
  return ReadMeter(r[0]);
}

std::vector<Meter> LockOpenMeters(pqxx::work& tx) {
  std::vector<Meter> out;
  for (const auto& row : tx.exec(std::string("SELECT ") + kMeterColumns +
                                 " FROM meters WHERE open ORDER BY allocation_id FOR UPDATE")) {
    out.push_back(ReadMeter(row));
  }
  return out;
}

void SaveMeter(pqxx::work& tx, const Meter& m) {
  // An interval not started has no snapshot: empty bytes.
  const std::string bill = m.billable.since_us == 0 ? "" : Bytes(m.billable.base);
  const std::string lost = m.stranded.since_us == 0 ? "" : Bytes(m.stranded.base);
  const pqxx::binarystring bill_base(bill.data(), bill.size());
  const pqxx::binarystring lost_base(lost.data(), lost.size());
  tx.exec_params(
      "INSERT INTO meters (allocation_id, generation, bill_since_us, bill_until_us, bill_done, "
      "bill_start_event, bill_base, lost_since_us, lost_until_us, lost_done, lost_start_event, "
      "lost_base, open) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13) "
      "ON CONFLICT (allocation_id) DO UPDATE SET generation = EXCLUDED.generation, "
      "bill_since_us = EXCLUDED.bill_since_us, bill_until_us = EXCLUDED.bill_until_us, "
      "bill_done = EXCLUDED.bill_done, bill_start_event = EXCLUDED.bill_start_event, "
      "bill_base = EXCLUDED.bill_base, lost_since_us = EXCLUDED.lost_since_us, "
      "lost_until_us = EXCLUDED.lost_until_us, lost_done = EXCLUDED.lost_done, "
      "lost_start_event = EXCLUDED.lost_start_event, lost_base = EXCLUDED.lost_base, "
      "open = EXCLUDED.open",
      m.allocation_id, m.generation, m.billable.since_us, m.billable.until_us, m.billable.done,
      m.billable.start_event_id, bill_base, m.stranded.since_us, m.stranded.until_us,
      m.stranded.done, m.stranded.start_event_id, lost_base, Open(m.billable) || Open(m.stranded));
}

void KeepPending(pqxx::work& tx, const Snapshot& s) {
  const std::string bytes = Bytes(s.allocation);
  tx.exec_params(
      "INSERT INTO pending_snapshots (allocation_id, generation, event_id, snapshot) VALUES ($1, "
      "$2, $3, $4) ON CONFLICT DO NOTHING",
      s.allocation.allocation_id(), s.generation, s.event_id,
      pqxx::binarystring(bytes.data(), bytes.size()));
}

std::optional<Snapshot> TakePending(pqxx::work& tx, const std::string& allocation_id,
                                    int64_t generation) {
  const auto r = tx.exec_params(
      "DELETE FROM pending_snapshots WHERE allocation_id = $1 AND generation = $2 "
      "RETURNING event_id, snapshot",
      allocation_id, generation);
  if (r.empty()) return std::nullopt;
  Snapshot s;
  s.event_id = r[0][0].as<std::string>();
  s.generation = generation;
  const pqxx::binarystring raw(r[0][1]);
  s.allocation.ParseFromArray(raw.data(), static_cast<int>(raw.size()));
  return s;
}

bool InsertRecord(pqxx::work& tx, const v1::UsageRecord& r) {
  // A correction counts as the record it corrects (written before it, by this ledger).
  const std::string bytes = Bytes(r);
  const auto r2 = tx.exec_params(
      "INSERT INTO usage_records (record_id, day, tenant, allocation_id, sku, kind, corrects, "
      "counts_as, units_micro, record) VALUES ($1, $2::date, $3, $4, $5, $6, $7, "
      "COALESCE((SELECT counts_as FROM usage_records WHERE record_id = $7), $8), $9, $10) "
      "ON CONFLICT (record_id) DO NOTHING",
      r.record_id(), r.day(), r.tenant(), r.allocation_id(), r.sku(), enums::Text(r.kind()),
      r.corrects(), r.kind() == v1::USAGE_KIND_STRANDED ? "stranded" : "billable", r.units_micro(),
      pqxx::binarystring(bytes.data(), bytes.size()));
  return r2.affected_rows() == 1;
}

std::vector<v1::UsageRecord> ListRecords(pqxx::work& tx, const Period& p, const PageKey& after,
                                         int limit) {
  std::vector<v1::UsageRecord> out;
  const auto rows = tx.exec_params(
      "SELECT record FROM usage_records WHERE day >= $1::date AND day < "
      "$2::date AND ($3 = '' OR tenant = $3) AND ($4 = '' OR (day, tenant, allocation_id, "
      "record_id) > ($5::date, $6, $7, $4)) ORDER BY day, tenant, allocation_id, record_id "
      "LIMIT $8",
      DayText(p.from_day_us), DayText(p.to_day_us), p.tenant, after.record_id,
      after.day.empty() ? DayText(p.from_day_us) : after.day, after.tenant, after.allocation_id,
      limit);
  for (const auto& row : rows) out.push_back(ParseRecord(row[0]));
  return out;
}

std::vector<v1::UsageTotal> Summarize(pqxx::work& tx, const Period& p) {
  std::vector<v1::UsageTotal> out;
  const auto rows = tx.exec_params(
      "SELECT tenant, sku, "
      "COALESCE(SUM(units_micro) FILTER (WHERE counts_as = 'billable' AND NOT corrected), 0), "
      "COALESCE(SUM(units_micro) FILTER (WHERE counts_as = 'stranded' AND NOT corrected), 0), "
      "COUNT(DISTINCT allocation_id) FROM (SELECT r.*, EXISTS (SELECT 1 FROM usage_records c "
      "WHERE c.corrects = r.record_id) AS corrected FROM usage_records r WHERE r.day >= $1::date "
      "AND r.day < $2::date AND ($3 = '' OR r.tenant = $3)) x GROUP BY tenant, sku "
      "ORDER BY tenant, sku",
      DayText(p.from_day_us), DayText(p.to_day_us), p.tenant);
  for (const auto& row : rows) {
    v1::UsageTotal t;
    t.set_tenant(row[0].as<std::string>());
    t.set_sku(row[1].as<std::string>());
    t.set_billable_units_micro(row[2].as<int64_t>());
    t.set_stranded_units_micro(row[3].as<int64_t>());
    t.set_allocations(row[4].as<int>());
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace gpuaas::usage
