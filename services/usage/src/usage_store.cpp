#include "usage_store.hpp"

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"

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

std::map<std::string, Meter> LockMeters(pqxx::work& tx, const std::vector<std::string>& ids) {
  std::map<std::string, Meter> out;
  if (ids.empty()) return out;
  for (const auto& row : tx.exec_params(std::string("SELECT ") + kMeterColumns +
                                            " FROM meters WHERE allocation_id = ANY($1::text[]) "
                                            "ORDER BY allocation_id FOR UPDATE",
                                        store::TextArrayLiteral(ids))) {
    Meter m = ReadMeter(row);
    out.emplace(m.allocation_id, std::move(m));
  }
  return out;
}

std::vector<Meter> LockOpenMeters(pqxx::work& tx) {
  std::vector<Meter> out;
  for (const auto& row : tx.exec(std::string("SELECT ") + kMeterColumns +
                                 " FROM meters WHERE open ORDER BY allocation_id FOR UPDATE")) {
    out.push_back(ReadMeter(row));
  }
  return out;
}

void SaveMeters(pqxx::work& tx, const std::vector<const Meter*>& meters) {
  if (meters.empty()) return;
  // An interval not started has no snapshot: empty bytes.
  auto flag = [](bool b) { return std::string(b ? "t" : "f"); };
  auto base = [](const Interval& iv) { return iv.since_us == 0 ? "" : Bytes(iv.base); };
  store::ArrayColumns rows(13, {6, 11});
  for (const Meter* m : meters) {
    const Interval& bill = m->billable;
    const Interval& lost = m->stranded;
    rows.Add({m->allocation_id, std::to_string(m->generation), std::to_string(bill.since_us),
              std::to_string(bill.until_us), flag(bill.done), bill.start_event_id, base(bill),
              std::to_string(lost.since_us), std::to_string(lost.until_us), flag(lost.done),
              lost.start_event_id, base(lost), flag(Open(bill) || Open(lost))});
  }
  rows.Exec(tx,
            "INSERT INTO meters (allocation_id, generation, bill_since_us, bill_until_us, "
            "bill_done, bill_start_event, bill_base, lost_since_us, lost_until_us, lost_done, "
            "lost_start_event, lost_base, open) SELECT * FROM unnest($1::text[], $2::bigint[], "
            "$3::bigint[], $4::bigint[], $5::boolean[], $6::text[], $7::bytea[], $8::bigint[], "
            "$9::bigint[], $10::boolean[], $11::text[], $12::bytea[], $13::boolean[]) "
            "ON CONFLICT (allocation_id) DO UPDATE SET generation = EXCLUDED.generation, "
            "bill_since_us = EXCLUDED.bill_since_us, bill_until_us = EXCLUDED.bill_until_us, "
            "bill_done = EXCLUDED.bill_done, bill_start_event = EXCLUDED.bill_start_event, "
            "bill_base = EXCLUDED.bill_base, lost_since_us = EXCLUDED.lost_since_us, "
            "lost_until_us = EXCLUDED.lost_until_us, lost_done = EXCLUDED.lost_done, "
            "lost_start_event = EXCLUDED.lost_start_event, lost_base = EXCLUDED.lost_base, "
            "open = EXCLUDED.open");
}

std::vector<Snapshot> LoadPending(pqxx::work& tx, const std::vector<std::string>& ids) {
  std::vector<Snapshot> out;
  if (ids.empty()) return out;
  for (const auto& row : tx.exec_params(
           "SELECT allocation_id, generation, event_id, snapshot FROM pending_snapshots WHERE "
           "allocation_id = ANY($1::text[]) ORDER BY allocation_id, generation",
           store::TextArrayLiteral(ids))) {
    Snapshot s;
    s.generation = row[1].as<int64_t>();
    s.event_id = row[2].as<std::string>();
    const pqxx::binarystring raw(row[3]);
    s.allocation.ParseFromArray(raw.data(), static_cast<int>(raw.size()));
    out.push_back(std::move(s));
  }
  return out;
}

void KeepPending(pqxx::work& tx, const Snapshot& s) {
  const std::string bytes = Bytes(s.allocation);
  tx.exec_params(
      "INSERT INTO pending_snapshots (allocation_id, generation, event_id, snapshot) VALUES ($1, "
      "$2, $3, $4) ON CONFLICT DO NOTHING",
      s.allocation.allocation_id(), s.generation, s.event_id,
      pqxx::binarystring(bytes.data(), bytes.size()));
}

void DropPending(pqxx::work& tx, const std::string& allocation_id, int64_t generation) {
  tx.exec_params("DELETE FROM pending_snapshots WHERE allocation_id = $1 AND generation = $2",
                 allocation_id, generation);
}

std::set<std::string> InsertRecords(pqxx::work& tx, const std::vector<NewRecord>& records) {
  std::set<std::string> written;
  if (records.empty()) return written;
  store::ArrayColumns rows(10, {9});
  for (const auto& [r, counts_as] : records) {
    rows.Add({r.record_id(), r.day(), r.tenant(), r.allocation_id(), r.sku(),
              std::string(enums::Text(r.kind())), r.corrects(), counts_as,
              std::to_string(r.units_micro()), Bytes(r)});
  }
  // A correction of a record written earlier counts as that record; WITH ORDINALITY keeps the
  // order given (seq).
  const auto inserted = rows.Exec(
      tx,
      "INSERT INTO usage_records (record_id, day, tenant, allocation_id, sku, kind, corrects, "
      "counts_as, units_micro, record) SELECT id, day, tenant, alloc, sku, kind, corrects, "
      "COALESCE(NULLIF(counts_as, ''), (SELECT u.counts_as FROM usage_records u WHERE "
      "u.record_id = x.corrects), 'billable'), units, record FROM unnest($1::text[], $2::date[], "
      "$3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::bigint[], "
      "$10::bytea[]) WITH ORDINALITY AS x(id, day, tenant, alloc, sku, kind, corrects, counts_as, "
      "units, record, n) ORDER BY n ON CONFLICT (record_id) DO NOTHING RETURNING record_id");
  for (const auto& row : inserted) written.insert(row[0].as<std::string>());
  return written;
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
