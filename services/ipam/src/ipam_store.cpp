#include "ipam_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/ipam/ipam_service.hpp"

namespace gpuaas::ipam {

namespace {

using google::protobuf::util::TimeUtil;

constexpr const char* kReservationColumns =
    "r.node_id, r.slot_key, r.mac::text, host(r.ip), s.subnet::text, host(s.gateway), "
    "(extract(epoch from r.created_at) * 1000)::int8, r.generation, "
    "COALESCE(r.allocation_id, ''), COALESCE(m.source, 'derived'), "
    "(extract(epoch from r.bound_at) * 1000)::int8, (extract(epoch from r.updated_at) * "
    "1000)::int8";

constexpr const char* kReservationFrom =
    "FROM slot_reservations r JOIN node_subnets s USING (node_id) "
    "LEFT JOIN mac_assignments m USING (node_id, slot_key)";

v1::SlotReservation ReservationFromRow(const pqxx::row& r) {
  v1::SlotReservation out;
  out.set_node_id(r[0].as<std::string>());
  out.set_slot_key(r[1].as<std::string>());
  out.set_mac(r[2].as<std::string>());
  out.set_ip(r[3].as<std::string>());
  out.set_subnet(r[4].as<std::string>());
  out.set_gateway(r[5].as<std::string>());
  *out.mutable_created_at() = TimeUtil::MillisecondsToTimestamp(r[6].as<int64_t>());
  out.set_generation(r[7].as<int64_t>());
  out.set_allocation_id(r[8].as<std::string>());
  out.set_mac_source(r[9].as<std::string>());
  if (!r[10].is_null()) {
    *out.mutable_bound_at() = TimeUtil::MillisecondsToTimestamp(r[10].as<int64_t>());
  }
  *out.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[11].as<int64_t>());
  return out;
}

constexpr const char* kDriftColumns =
    "drift_id, node_id, slot_key, mac, kind, detail, expected_ip, actual_ip, allocation_id, "
    "(extract(epoch from detected_at) * 1000)::int8, (extract(epoch from resolved_at) * "
    "1000)::int8, "
    "generation, document_version";

v1::IpamDrift DriftFromRow(const pqxx::row& r) {
  v1::IpamDrift d;
  d.set_drift_id(r[0].as<int64_t>());
  d.set_node_id(r[1].as<std::string>());
  d.set_slot_key(r[2].as<std::string>());
  d.set_mac(r[3].as<std::string>());
  d.set_kind(r[4].as<std::string>());
  d.set_detail(r[5].as<std::string>());
  d.set_expected_ip(r[6].as<std::string>());
  d.set_actual_ip(r[7].as<std::string>());
  d.set_allocation_id(r[8].as<std::string>());
  *d.mutable_detected_at() = TimeUtil::MillisecondsToTimestamp(r[9].as<int64_t>());
  if (!r[10].is_null()) {
    *d.mutable_resolved_at() = TimeUtil::MillisecondsToTimestamp(r[10].as<int64_t>());
  }
  d.set_generation(r[11].as<int64_t>());
  d.set_document_version(r[12].as<int64_t>());
  return d;
}

Result<void> AnnounceDrift(pqxx::work& tx, const std::string& event, const v1::IpamDrift& d,
                           const std::string& subject, const std::string& source) {
  v1::IpamDriftSnapshot snap;
  *snap.mutable_drift() = d;
  auto ev =
      outbox::Append(tx, {event, "", source, d.node_id() + "/" + subject, d.generation(),
                          d.allocation_id().empty() ? d.node_id() : d.allocation_id(), "", &snap});
  if (!ev.ok()) return ev.error();
  return Ok();
}

}  // namespace

std::optional<NodeNet> LockNode(pqxx::work& tx, const std::string& node_id) {
  auto r = tx.exec_params(
      "SELECT subnet::text, host(gateway), region, pool, datapath, bridge FROM node_subnets "
      "WHERE node_id = $1 FOR UPDATE",
      node_id);
  if (r.empty()) return std::nullopt;
  return NodeNet{node_id,
                 r[0][0].as<std::string>(),
                 r[0][1].as<std::string>(),
                 r[0][2].as<std::string>(),
                 r[0][3].as<std::string>(),
                 {enums::FromColumn<v1::NetworkDatapath>(r[0][4].as<std::string>()),
                  r[0][5].as<std::string>()}};
}

std::optional<v1::SlotReservation> FindReservation(pqxx::work& tx, const std::string& node_id,
                                                   const std::string& slot_key) {
  auto rows = tx.exec_params(fmt::format("SELECT {} {} WHERE r.node_id = $1 AND r.slot_key = $2",
                                         kReservationColumns, kReservationFrom),
                             node_id, slot_key);
  if (rows.empty()) return std::nullopt;
  return ReservationFromRow(rows[0]);
}

std::vector<v1::SlotReservation> ListReservations(pqxx::work& tx, const std::string& node_id) {
  std::vector<v1::SlotReservation> out;
  for (const auto& r : tx.exec_params(fmt::format("SELECT {} {} WHERE ($1 = '' OR r.node_id = $1) "
                                                  "ORDER BY r.node_id, r.ip",
                                                  kReservationColumns, kReservationFrom),
                                      node_id)) {
    out.push_back(ReservationFromRow(r));
  }
  return out;
}

std::vector<ReservedSlot> LoadReservedSlots(pqxx::work& tx, const std::string& node_id) {
  std::vector<ReservedSlot> out;
  for (const auto& r : tx.exec_params(
           "SELECT slot_key, mac::text, host(ip), COALESCE(allocation_id, ''), "
           "COALESCE((extract(epoch from bound_at) * 1000)::int8, 0) FROM slot_reservations "
           "WHERE node_id = $1 ORDER BY slot_key",
           node_id)) {
    out.push_back({r[0].as<std::string>(), r[1].as<std::string>(), r[2].as<std::string>(),
                   r[3].as<std::string>(), r[4].as<int64_t>()});
  }
  return out;
}

bool ClaimMac(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
              const std::string& mac, const std::string& source, int epoch) {
  // No conflict target: a conflict on the slot's primary key or on the MAC's unique index both
  // mean "not yours"; a concurrent insert of the same MAC waits for the other transaction.
  return !tx.exec_params(
                "INSERT INTO mac_assignments (node_id, slot_key, mac, source, epoch) "
                "VALUES ($1, $2, $3::macaddr, $4, $5) ON CONFLICT DO NOTHING RETURNING 1",
                node_id, slot_key, mac, source, epoch)
              .empty();
}

Result<std::string> ClaimPoolMac(pqxx::work& tx, const std::string& node_id,
                                 const std::string& slot_key, int epoch) {
  for (int i = 0; i < 64; ++i) {
    const auto seq = tx.exec("SELECT nextval('mac_pool_seq')")[0][0].as<int64_t>();
    if (seq <= 0 || static_cast<uint64_t>(seq) >= kPoolSize) {
      return Error::Of(Code::kResourceExhausted, reason::kMacPoolExhausted,
                       "the platform MAC pool 52:54:01:00:00:01-52:54:01:ff:ff:ff is used up",
                       {{"node_id", node_id}, {"slot_key", slot_key}});
    }
    const std::string mac = FormatMac(PoolMacValue(static_cast<uint64_t>(seq)));
    if (ClaimMac(tx, node_id, slot_key, mac, "pool", epoch)) return mac;
  }
  return Error::Aborted(reason::kMacPoolContended, "64 pool MACs in a row were taken; retry");
}

Result<std::pair<std::string, std::string>> EnsureMac(pqxx::work& tx, const std::string& node_id,
                                                      const std::string& slot_key) {
  const std::string find =
      "SELECT mac::text, source FROM mac_assignments WHERE node_id = $1 AND "
      "slot_key = $2";
  auto owned = tx.exec_params(find, node_id, slot_key);
  if (!owned.empty()) {
    return std::make_pair(owned[0][0].as<std::string>(), owned[0][1].as<std::string>());
  }
  const std::string derived = DeterministicMac(node_id, slot_key, 0);
  if (ClaimMac(tx, node_id, slot_key, derived, "derived", 0)) {
    return std::make_pair(derived, std::string("derived"));
  }
  owned = tx.exec_params(find, node_id, slot_key);  // the slot itself, claimed meanwhile
  if (!owned.empty()) {
    return std::make_pair(owned[0][0].as<std::string>(), owned[0][1].as<std::string>());
  }
  // Collision: another slot (on any node) owns the derived MAC.
  auto pool = ClaimPoolMac(tx, node_id, slot_key, 0);
  if (!pool.ok()) return pool.error();
  return std::make_pair(*pool, std::string("pool"));
}

const documents::Tables& NetworkDocumentTables() {
  static const documents::Tables t{"network_documents", "network_acks", "network document"};
  return t;
}

Result<int64_t> UpdateDocument(pqxx::work& tx, const std::string& node_id, const IpamConfig& cfg) {
  auto node = LockNode(tx, node_id);
  if (!node) return int64_t{0};
  const auto slots = LoadReservedSlots(tx, node_id);
  auto want =
      BuildDocument(node_id, node->subnet, node->gateway, node->datapath, cfg.Network(), slots);
  want.set_removed(SliceNetworkRemoved(tx, node_id));
  return documents::Publish(tx, NetworkDocumentTables(), node_id, want, slots.empty());
}

Result<void> AnnounceReservation(pqxx::work& tx, const std::string& event,
                                 const v1::SlotReservation& r, const std::string& reason,
                                 const std::string& source, const std::string& traceparent) {
  v1::ReservationSnapshot snap;
  *snap.mutable_reservation() = r;
  snap.set_reason(reason);
  auto ev = outbox::Append(
      tx, {event, "", source, r.node_id() + "/" + r.slot_key(), r.generation(),
           r.allocation_id().empty() ? r.node_id() : r.allocation_id(), traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return Ok();
}

Result<void> RecordDrift(pqxx::work& tx, const std::string& node_id, const Finding& f,
                         int64_t document_version, const std::string& source) {
  auto open = tx.exec_params(
      "SELECT drift_id, kind, actual_ip, mac, allocation_id FROM ipam_drift WHERE node_id = $1 AND "
      "subject = $2 AND resolved_at IS NULL FOR UPDATE",
      node_id, f.subject);
  pqxx::result row;
  if (!open.empty()) {
    if (open[0][1].as<std::string>() == f.kind && open[0][2].as<std::string>() == f.actual_ip &&
        open[0][3].as<std::string>() == f.mac && open[0][4].as<std::string>() == f.allocation_id) {
      return Ok();  // the same drift, seen again
    }
    row = tx.exec_params(
        fmt::format("UPDATE ipam_drift SET kind = $2, detail = $3, expected_ip = $4, "
                    "actual_ip = $5, allocation_id = $6, mac = $7, slot_key = $8, "
                    "document_version = $9, generation = generation + 1 WHERE drift_id = $1 "
                    "RETURNING {}",
                    kDriftColumns),
        open[0][0].as<int64_t>(), f.kind, f.detail, f.expected_ip, f.actual_ip, f.allocation_id,
        f.mac, f.slot_key, document_version);
  } else {
    row = tx.exec_params(
        fmt::format(
            "INSERT INTO ipam_drift (node_id, subject, slot_key, mac, kind, detail, expected_ip, "
            "actual_ip, allocation_id, document_version, generation) VALUES ($1, $2, $3, $4, $5, "
            "$6, $7, $8, $9, $10, 1 + COALESCE((SELECT max(generation) FROM ipam_drift WHERE "
            "node_id = $1 AND subject = $2), 0)) RETURNING {}",
            kDriftColumns),
        node_id, f.subject, f.slot_key, f.mac, f.kind, f.detail, f.expected_ip, f.actual_ip,
        f.allocation_id, document_version);
  }
  return AnnounceDrift(tx, "gpuaas.v1.evt.ipam.drift.detected", DriftFromRow(row[0]), f.subject,
                       source);
}

Result<void> ResolveDrift(pqxx::work& tx, const std::string& node_id, const std::string& subject,
                          const std::string& why, const std::string& source) {
  auto row = tx.exec_params(
      fmt::format("UPDATE ipam_drift SET resolved_at = now(), generation = generation + 1, "
                  "detail = detail || ' (resolved: ' || $3 || ')' WHERE node_id = $1 AND "
                  "subject = $2 AND resolved_at IS NULL RETURNING {}",
                  kDriftColumns),
      node_id, subject, why);
  if (row.empty()) return Ok();
  return AnnounceDrift(tx, "gpuaas.v1.evt.ipam.drift.resolved", DriftFromRow(row[0]), subject,
                       source);
}

std::vector<v1::IpamDrift> ListDrift(pqxx::work& tx, const std::string& node_id,
                                     bool include_resolved) {
  std::vector<v1::IpamDrift> out;
  for (const auto& r : tx.exec_params(fmt::format("SELECT {} FROM ipam_drift WHERE node_id = $1 "
                                                  "AND ($2 OR resolved_at IS NULL) ORDER BY "
                                                  "drift_id",
                                                  kDriftColumns),
                                      node_id, include_resolved)) {
    out.push_back(DriftFromRow(r));
  }
  return out;
}

std::optional<RuleRow> LoadRule(pqxx::work& tx, const RuleScope& rule) {
  auto r = tx.exec_params(
      "SELECT subnet::text, host(gateway), host_cidrs, datapath, bridge FROM subnet_rules WHERE "
      "scope = $1 AND region = $2 AND pool = $3 AND node_id = $4",
      std::string(ScopeText(rule.scope)), rule.region, rule.pool, rule.node_id);
  if (r.empty()) return std::nullopt;
  return RuleRow{r[0][0].as<std::string>(),
                 r[0][1].as<std::string>(),
                 store::TextArray(r[0][2]),
                 {enums::FromColumn<v1::NetworkDatapath>(r[0][3].as<std::string>()),
                  r[0][4].as<std::string>()}};
}

void UpsertRule(pqxx::work& tx, const RuleScope& rule, const std::string& subnet,
                const std::string& gateway, const std::vector<std::string>& host_cidrs,
                const Datapath& datapath) {
  tx.exec_params(
      "INSERT INTO subnet_rules (scope, region, pool, node_id, subnet, gateway, "
      "host_cidrs, datapath, bridge) VALUES ($1, $2, $3, $4, $5::cidr, $6::inet, "
      "$7::text[], $8, $9) "
      "ON CONFLICT (scope, region, pool, node_id) DO UPDATE SET subnet = EXCLUDED.subnet, "
      "gateway = EXCLUDED.gateway, host_cidrs = EXCLUDED.host_cidrs, "
      "datapath = EXCLUDED.datapath, bridge = EXCLUDED.bridge, updated_at = now()",
      std::string(ScopeText(rule.scope)), rule.region, rule.pool, rule.node_id, subnet, gateway,
      store::TextArrayLiteral(host_cidrs), enums::Text(datapath.datapath), datapath.bridge);
}

std::vector<HostNetwork> ListNarrowerSubnets(pqxx::work& tx, const std::string& region,
                                             const std::string& pool) {
  std::vector<HostNetwork> out;
  for (const auto& n : tx.exec_params(
           "SELECT subnet::text, 'pool rule ' || region || '/' || pool FROM subnet_rules "
           "WHERE scope = $3 AND region = $1 AND $2 = '' UNION ALL "
           "SELECT subnet::text, 'node ' || node_id FROM node_subnets WHERE region = $1 AND "
           "($2 = '' OR pool = $2)",
           region, pool, std::string(ScopeText(Scope::kPool)))) {
    out.push_back({n[0].as<std::string>(), n[1].as<std::string>()});
  }
  return out;
}

std::pair<std::string, std::string> ResolveSubnet(pqxx::work& tx, const IpamConfig& cfg,
                                                  const std::string& node_id,
                                                  const std::string& region,
                                                  const std::string& pool) {
  for (const auto& scope : ApplicableRules(node_id, region, pool)) {
    if (auto r = LoadRule(tx, scope)) return {r->subnet, r->gateway};
  }
  auto subnet = ParseCidr(cfg.default_subnet);
  auto gw = ResolveGateway(*subnet, cfg.default_gateway);
  return {subnet->ToString(), FormatIpv4(*gw)};
}

Datapath ResolveNodeDatapath(pqxx::work& tx, const IpamConfig& cfg, const std::string& node_id,
                             const std::string& region, const std::string& pool) {
  std::vector<Datapath> rules;
  for (const auto& scope : ApplicableRules(node_id, region, pool)) {
    if (auto r = LoadRule(tx, scope)) rules.push_back(r->datapath);
  }
  return ResolveDatapath(rules, cfg.Network());
}

void InsertNodeSubnet(pqxx::work& tx, const std::string& node_id, const NodeRow& row) {
  tx.exec_params(
      "INSERT INTO node_subnets (node_id, subnet, gateway, region, pool, datapath, bridge) "
      "VALUES ($1, $2::cidr, $3::inet, $4, $5, $6, $7) ON CONFLICT (node_id) DO NOTHING",
      node_id, row.subnet, row.gateway, row.region, row.pool, enums::Text(row.datapath.datapath),
      row.datapath.bridge);
}

void ReplaceNodeSubnet(pqxx::work& tx, const std::string& node_id, const NodeRow& row) {
  tx.exec_params(
      "UPDATE node_subnets SET subnet = $2::cidr, gateway = $3::inet, region = $4, "
      "pool = $5, datapath = $6, bridge = $7 WHERE node_id = $1",
      node_id, row.subnet, row.gateway, row.region, row.pool, enums::Text(row.datapath.datapath),
      row.datapath.bridge);
}

void SetNodeScope(pqxx::work& tx, const std::string& node_id, const std::string& region,
                  const std::string& pool) {
  tx.exec_params("UPDATE node_subnets SET region = $2, pool = $3 WHERE node_id = $1", node_id,
                 region, pool);
}

void SetNodeSubnet(pqxx::work& tx, const std::string& node_id, const std::string& subnet,
                   const std::string& gateway) {
  tx.exec_params("UPDATE node_subnets SET subnet = $2::cidr, gateway = $3::inet WHERE node_id = $1",
                 node_id, subnet, gateway);
}

void SetNodeDatapath(pqxx::work& tx, const std::string& node_id, const Datapath& datapath) {
  tx.exec_params("UPDATE node_subnets SET datapath = $2, bridge = $3 WHERE node_id = $1", node_id,
                 enums::Text(datapath.datapath), datapath.bridge);
}

int64_t CountReservations(pqxx::work& tx, const std::string& node_id) {
  return tx.exec_params("SELECT count(*) FROM slot_reservations WHERE node_id = $1", node_id)[0][0]
      .as<int64_t>();
}

bool HasReservations(pqxx::work& tx, const std::string& node_id) {
  return !tx.exec_params(
                "SELECT 1 FROM slot_reservations WHERE node_id = $1 "
                "LIMIT 1",
                node_id)
              .empty();
}

std::vector<SlotAddress> ListReservedAddresses(pqxx::work& tx, const std::string& node_id) {
  std::vector<SlotAddress> out;
  for (const auto& r :
       tx.exec_params("SELECT slot_key, host(ip) FROM slot_reservations WHERE node_id = $1 "
                      "ORDER BY ip",
                      node_id)) {
    out.push_back({r[0].as<std::string>(), r[1].as<std::string>()});
  }
  return out;
}

std::set<uint32_t> LoadUsedIps(pqxx::work& tx, const std::string& node_id) {
  std::set<uint32_t> used;
  for (const auto& r :
       tx.exec_params("SELECT host(ip) FROM slot_reservations WHERE node_id = $1", node_id)) {
    if (auto ip = ParseIpv4(r[0].as<std::string>())) used.insert(*ip);
  }
  return used;
}

void InsertReservation(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                       const std::string& mac, const std::string& ip) {
  tx.exec_params(
      "INSERT INTO slot_reservations (node_id, slot_key, mac, ip, generation) "
      "SELECT $1, $2, $3::macaddr, $4::inet, generation + 1 FROM mac_assignments "
      "WHERE node_id = $1 AND slot_key = $2",
      node_id, slot_key, mac, ip);
}

void DeleteReservation(pqxx::work& tx, const std::string& node_id, const std::string& slot_key) {
  tx.exec_params("DELETE FROM slot_reservations WHERE node_id = $1 AND slot_key = $2", node_id,
                 slot_key);
}

void SetReservationMac(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                       const std::string& mac) {
  tx.exec_params(
      "UPDATE slot_reservations SET mac = $3::macaddr, generation = generation + 1, "
      "updated_at = now() WHERE node_id = $1 AND slot_key = $2",
      node_id, slot_key, mac);
}

std::optional<MacAssignment> LockMacAssignment(pqxx::work& tx, const std::string& node_id,
                                               const std::string& slot_key) {
  auto owned = tx.exec_params(
      "SELECT mac::text, epoch, generation FROM mac_assignments WHERE node_id = $1 "
      "AND slot_key = $2 FOR UPDATE",
      node_id, slot_key);
  if (owned.empty()) return std::nullopt;
  return MacAssignment{owned[0][0].as<std::string>(), owned[0][1].as<int>(),
                       owned[0][2].as<int64_t>()};
}

void DeleteMacAssignment(pqxx::work& tx, const std::string& node_id, const std::string& slot_key) {
  tx.exec_params("DELETE FROM mac_assignments WHERE node_id = $1 AND slot_key = $2", node_id,
                 slot_key);
}

void SetMacGeneration(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                      int64_t generation) {
  tx.exec_params("UPDATE mac_assignments SET generation = $3 WHERE node_id = $1 AND slot_key = $2",
                 node_id, slot_key, generation);
}

Result<std::string> ClaimReprovisionedMac(pqxx::work& tx, const std::string& node_id,
                                          const std::string& slot_key, int epoch,
                                          const std::string& old) {
  for (int e = epoch + 1; e <= epoch + 8; ++e) {
    const auto candidate = DeterministicMac(node_id, slot_key, e);
    if (candidate != old && ClaimMac(tx, node_id, slot_key, candidate, "derived", e)) {
      return candidate;
    }
  }
  return ClaimPoolMac(tx, node_id, slot_key, epoch + 1);
}

Result<v1::ListLeasesResponse> LoadLeases(pqxx::work& tx, const std::string& node_id) {
  v1::ListLeasesResponse resp;
  auto head = tx.exec_params(
      "SELECT document_version, blockers, (extract(epoch from observed_at) * 1000)::int8 "
      "FROM lease_reports WHERE node_id = $1",
      node_id);
  if (head.empty()) return resp;
  resp.set_document_version(head[0][0].as<int64_t>());
  for (const auto& b : store::TextArray(head[0][1])) resp.add_blockers(b);
  *resp.mutable_observed_at() = TimeUtil::MillisecondsToTimestamp(head[0][2].as<int64_t>());
  for (const auto& r : tx.exec_params(
           "SELECT doc::text FROM lease_observations WHERE node_id = $1 ORDER BY subject",
           node_id)) {
    if (auto p = protojson::FromJson(r[0].as<std::string>(), resp.add_leases()); !p.ok()) {
      return Error::Internal(reason::kCorruptLease, p.error().message);
    }
  }
  return resp;
}

std::optional<int64_t> LoadLeaseReportTime(pqxx::work& tx, const std::string& node_id) {
  auto prev = tx.exec_params(
      "SELECT (extract(epoch from observed_at) * 1000)::int8 FROM lease_reports WHERE node_id = $1",
      node_id);
  if (prev.empty()) return std::nullopt;
  return prev[0][0].as<int64_t>();
}

void UpsertLeaseReport(pqxx::work& tx, const std::string& node_id, int64_t document_version,
                       const std::vector<std::string>& blockers, int64_t observed_ms,
                       const std::string& event_id) {
  tx.exec_params(
      "INSERT INTO lease_reports (node_id, document_version, blockers, observed_at, event_id) "
      "VALUES ($1, $2, $3::text[], to_timestamp($4::float8 / 1000), $5) ON CONFLICT (node_id) DO "
      "UPDATE SET document_version = EXCLUDED.document_version, blockers = EXCLUDED.blockers, "
      "observed_at = EXCLUDED.observed_at, event_id = EXCLUDED.event_id, received_at = now()",
      node_id, document_version, store::TextArrayLiteral(blockers), observed_ms, event_id);
}

void ReplaceLeaseObservations(pqxx::work& tx, const std::string& node_id,
                              const std::map<std::string, v1::StoredLease>& leases) {
  tx.exec_params("DELETE FROM lease_observations WHERE node_id = $1", node_id);
  for (const auto& [subject, lease] : leases) {
    tx.exec_params(
        "INSERT INTO lease_observations (node_id, subject, doc) VALUES ($1, $2, $3::jsonb)",
        node_id, subject, protojson::ToJson(lease));
  }
}

std::vector<std::string> ListOpenDriftSubjects(pqxx::work& tx, const std::string& node_id) {
  std::vector<std::string> out;
  for (const auto& r : tx.exec_params(
           "SELECT subject FROM ipam_drift WHERE node_id = $1 AND resolved_at IS NULL", node_id)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

std::optional<int64_t> LockAllocationBinding(pqxx::work& tx, const std::string& allocation_id) {
  auto prev = tx.exec_params(
      "SELECT generation FROM allocation_bindings WHERE allocation_id = $1 FOR UPDATE",
      allocation_id);
  if (prev.empty()) return std::nullopt;
  return prev[0][0].as<int64_t>();
}

void UpsertAllocationBinding(pqxx::work& tx, const std::string& allocation_id,
                             const std::string& node_id, const std::string& state,
                             int64_t generation, const std::vector<std::string>& slot_keys) {
  tx.exec_params(
      "INSERT INTO allocation_bindings (allocation_id, node_id, state, generation, slot_keys) "
      "VALUES ($1, $2, $3, $4, $5::text[]) ON CONFLICT (allocation_id) DO UPDATE SET "
      "node_id = EXCLUDED.node_id, state = EXCLUDED.state, generation = EXCLUDED.generation, "
      "slot_keys = EXCLUDED.slot_keys, updated_at = now()",
      allocation_id, node_id, state, generation, store::TextArrayLiteral(slot_keys));
}

std::vector<std::string> BindReservations(pqxx::work& tx, const std::string& node_id,
                                          const std::vector<std::string>& slot_keys,
                                          const std::string& allocation_id) {
  std::vector<std::string> out;
  for (const auto& r : tx.exec_params(
           "UPDATE slot_reservations SET allocation_id = $3, bound_at = now(), "
           "generation = generation + 1, updated_at = now() WHERE node_id = $1 AND "
           "slot_key = ANY($2::text[]) AND allocation_id IS DISTINCT FROM $3 RETURNING slot_key",
           node_id, store::TextArrayLiteral(slot_keys), allocation_id)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

std::vector<std::string> UnbindReservations(pqxx::work& tx, const std::string& node_id,
                                            const std::string& allocation_id,
                                            const std::vector<std::string>& keep) {
  std::vector<std::string> out;
  for (const auto& r :
       tx.exec_params("UPDATE slot_reservations SET allocation_id = NULL, bound_at = NULL, "
                      "generation = generation + 1, updated_at = now() WHERE node_id = $1 AND "
                      "allocation_id = $2 AND NOT (slot_key = ANY($3::text[])) RETURNING slot_key",
                      node_id, allocation_id, store::TextArrayLiteral(keep))) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

std::vector<std::string> ListNodesOfAllocation(pqxx::work& tx, const std::string& allocation_id) {
  std::vector<std::string> out;
  for (const auto& r : tx.exec_params(
           "SELECT DISTINCT node_id FROM slot_reservations WHERE allocation_id = $1 ORDER BY 1",
           allocation_id)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

bool UpsertInventoryNode(pqxx::work& tx, const std::string& node_id, int64_t generation,
                         bool slice_network_removed) {
  const auto r = tx.exec_params(
      "SELECT generation, slice_network_removed FROM inventory_nodes WHERE node_id = $1 FOR UPDATE",
      node_id);
  const bool was = !r.empty() && r[0][1].as<bool>();
  // An older generation (a redelivery) moves nothing back.
  const bool newer = r.empty() || generation >= r[0][0].as<int64_t>();
  const bool now = newer ? slice_network_removed : was;
  tx.exec_params(
      "INSERT INTO inventory_nodes (node_id, generation, slice_network_removed) VALUES ($1, $2, "
      "$3) ON CONFLICT (node_id) DO UPDATE SET generation = GREATEST(inventory_nodes.generation, "
      "EXCLUDED.generation), slice_network_removed = EXCLUDED.slice_network_removed, "
      "updated_at = now()",
      node_id, generation, now);
  return now != was;
}

bool SliceNetworkRemoved(pqxx::work& tx, const std::string& node_id) {
  const auto r = tx.exec_params(
      "SELECT slice_network_removed FROM inventory_nodes WHERE node_id = $1", node_id);
  return !r.empty() && r[0][0].as<bool>();
}

void UpsertInventorySlot(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                         int64_t generation) {
  tx.exec_params(
      "INSERT INTO inventory_slots (node_id, slot_key, generation) VALUES ($1, $2, $3) "
      "ON CONFLICT (node_id, slot_key) DO UPDATE SET generation = "
      "GREATEST(inventory_slots.generation, EXCLUDED.generation), updated_at = now()",
      node_id, slot_key, generation);
}

bool InventoryHasNode(pqxx::work& tx, const std::string& node_id) {
  return !tx.exec_params("SELECT 1 FROM inventory_nodes WHERE node_id = $1", node_id).empty();
}

bool InventoryHasSlot(pqxx::work& tx, const std::string& node_id, const std::string& slot_key) {
  return !tx.exec_params(
                "SELECT 1 FROM inventory_slots WHERE node_id = $1 AND "
                "slot_key = $2",
                node_id, slot_key)
              .empty();
}

std::vector<v1::IpamOrphan> ListNodeOrphans(pqxx::work& tx, const std::string& node_id) {
  std::vector<v1::IpamOrphan> out;
  auto nodes = tx.exec_params(
      "WITH ids AS (SELECT node_id FROM node_subnets UNION SELECT node_id FROM mac_assignments "
      "UNION SELECT node_id FROM slot_reservations UNION SELECT node_id FROM network_documents "
      "UNION SELECT node_id FROM network_acks) "
      "SELECT i.node_id, COALESCE(ns.subnet::text, ''), "
      "(SELECT count(*) FROM slot_reservations r WHERE r.node_id = i.node_id), "
      "(extract(epoch from GREATEST(ns.created_at, (SELECT max(updated_at) FROM mac_assignments m "
      "WHERE m.node_id = i.node_id), (SELECT max(created_at) FROM network_documents d WHERE "
      "d.node_id = i.node_id))) * 1000)::int8 "
      "FROM ids i LEFT JOIN node_subnets ns ON ns.node_id = i.node_id "
      "WHERE NOT EXISTS (SELECT 1 FROM inventory_nodes n WHERE n.node_id = i.node_id) "
      "AND NOT EXISTS (SELECT 1 FROM slot_reservations r WHERE r.node_id = i.node_id AND "
      "r.allocation_id IS NOT NULL) AND ($1 = '' OR i.node_id = $1) ORDER BY 1",
      node_id);
  out.reserve(nodes.size());
  for (const auto& r : nodes) {
    v1::IpamOrphan o;
    o.set_node_id(r[0].as<std::string>());
    o.set_reason(v1::IPAM_ORPHAN_REASON_NODE_UNKNOWN);
    o.set_subnet(r[1].as<std::string>());
    o.set_reservations(r[2].as<int64_t>());
    if (!r[3].is_null()) {
      *o.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[3].as<int64_t>());
    }
    out.push_back(std::move(o));
  }
  return out;
}

std::vector<v1::IpamOrphan> ListSlotOrphans(pqxx::work& tx, int64_t min_age_s,
                                            const std::string& node_id) {
  std::vector<v1::IpamOrphan> out;
  auto slots = tx.exec_params(
      "SELECT m.node_id, m.slot_key, m.mac::text, COALESCE(host(r.ip), ''), "
      "(extract(epoch from GREATEST(m.updated_at, r.updated_at)) * 1000)::int8 "
      "FROM mac_assignments m JOIN inventory_nodes n ON n.node_id = m.node_id "
      "LEFT JOIN slot_reservations r ON r.node_id = m.node_id AND r.slot_key = m.slot_key "
      "WHERE NOT EXISTS (SELECT 1 FROM inventory_slots s WHERE s.node_id = m.node_id AND "
      "s.slot_key = m.slot_key) AND r.allocation_id IS NULL "
      "AND GREATEST(m.updated_at, r.updated_at) <= now() - make_interval(secs => $1) "
      "AND ($2 = '' OR m.node_id = $2) ORDER BY 1, 2",
      static_cast<double>(min_age_s), node_id);
  out.reserve(slots.size());
  for (const auto& r : slots) {
    v1::IpamOrphan o;
    o.set_node_id(r[0].as<std::string>());
    o.set_slot_key(r[1].as<std::string>());
    o.set_reason(v1::IPAM_ORPHAN_REASON_SLOT_UNKNOWN);
    o.set_mac(r[2].as<std::string>());
    o.set_ip(r[3].as<std::string>());
    o.set_reservations(o.ip().empty() ? 0 : 1);
    *o.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[4].as<int64_t>());
    out.push_back(std::move(o));
  }
  return out;
}

int64_t NextDocumentVersion(pqxx::work& tx, const std::string& node_id) {
  return tx
      .exec_params(
          "SELECT COALESCE(max(version), 0) + 1 FROM network_documents WHERE "
          "node_id = $1",
          node_id)[0][0]
      .as<int64_t>();
}

void DeleteNodeRows(pqxx::work& tx, const std::string& node_id) {
  for (const char* table :
       {"lease_observations", "lease_reports", "ipam_drift", "network_acks", "network_documents",
        "slot_reservations", "mac_assignments", "node_subnets"}) {
    tx.exec_params(fmt::format("DELETE FROM {} WHERE node_id = $1", table), node_id);
  }
}

int64_t NextSlotGeneration(pqxx::work& tx, const std::string& node_id,
                           const std::string& slot_key) {
  return tx
      .exec_params(
          "SELECT GREATEST(m.generation, COALESCE((SELECT generation FROM "
          "slot_reservations r WHERE r.node_id = $1 AND r.slot_key = $2), 0)) + 1 "
          "FROM mac_assignments m WHERE m.node_id = $1 AND m.slot_key = $2",
          node_id, slot_key)[0][0]
      .as<int64_t>();
}

void DeleteLeaseObservation(pqxx::work& tx, const std::string& node_id,
                            const std::string& subject) {
  tx.exec_params("DELETE FROM lease_observations WHERE node_id = $1 AND subject = $2", node_id,
                 subject);
}

}  // namespace gpuaas::ipam
