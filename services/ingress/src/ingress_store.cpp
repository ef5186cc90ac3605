#include "ingress_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/ingress/ingress_service.hpp"
#include "ingress_domain.hpp"

namespace gpuaas::ingress {

namespace {

using google::protobuf::util::TimeUtil;

// ---- rows to messages ----

std::vector<v1::EndpointPool> SelectPools(pqxx::work& tx, const std::string& where,
                                          const std::string& arg) {
  std::vector<v1::EndpointPool> out;
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT p.name, p.kind, p.region, p.node_id, p.addresses, p.port_min, "
                       "p.port_max, p.generation, (extract(epoch from p.updated_at) * "
                       "1000)::int8, (SELECT count(*) FROM endpoint_leases l WHERE l.pool = "
                       "p.name) FROM endpoint_pools p WHERE {} ORDER BY p.name",
                       where),
           arg)) {
    v1::EndpointPool p;
    p.set_name(r[0].as<std::string>());
    p.set_kind(enums::FromColumn<v1::EndpointPoolKind>(r[1].as<std::string>()));
    p.set_region(r[2].as<std::string>());
    p.set_node_id(r[3].as<std::string>());
    for (const auto& a : store::TextArray(r[4])) p.add_addresses(a);
    p.set_port_min(r[5].as<int32_t>());
    p.set_port_max(r[6].as<int32_t>());
    p.set_generation(r[7].as<int64_t>());
    *p.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[8].as<int64_t>());
    p.set_total(PoolCapacity(p));
    p.set_used(r[9].as<int64_t>());
    out.push_back(std::move(p));
  }
  return out;
}

constexpr const char* kCols =
    "exposure_id::text, allocation_id, tenant, node_id, slot_key, name, protocol, target_ip, "
    "target_port, pool, public_ip, public_port, state, reason, detail, document_version, "
    "generation, (extract(epoch from created_at) * 1000)::int8, "
    "(extract(epoch from updated_at) * 1000)::int8";

v1::Exposure FromRow(const pqxx::row& r, const Context& c) {
  v1::Exposure e;
  e.set_exposure_id(r[0].as<std::string>());
  e.set_allocation_id(r[1].as<std::string>());
  e.set_tenant(r[2].as<std::string>());
  e.set_node_id(r[3].as<std::string>());
  e.set_slot_key(r[4].as<std::string>());
  e.set_name(r[5].as<std::string>());
  e.set_protocol(enums::FromColumn<v1::TransportProtocol>(r[6].as<std::string>()));
  e.set_target_ip(r[7].as<std::string>());
  e.set_target_port(r[8].as<int32_t>());
  e.set_pool(r[9].as<std::string>());
  e.set_public_ip(r[10].as<std::string>());
  e.set_public_port(r[11].as<int32_t>());
  e.set_state(enums::FromColumn<v1::ExposureState>(r[12].as<std::string>()));
  e.set_reason(r[13].as<std::string>());
  e.set_detail(r[14].as<std::string>());
  e.set_document_version(r[15].as<int64_t>());
  e.set_generation(r[16].as<int64_t>());
  *e.mutable_created_at() = TimeUtil::MillisecondsToTimestamp(r[17].as<int64_t>());
  *e.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[18].as<int64_t>());
  e.set_connect(ConnectHint(e, c.cfg.ssh_user));
  return e;
}

std::optional<v1::Exposure> SelectExposure(pqxx::work& tx, const Context& c, const std::string& id,
                                           bool lock) {
  if (!ids::IsUuid(id)) return std::nullopt;
  auto r = tx.exec_params(fmt::format("SELECT {} FROM exposures WHERE exposure_id = $1::uuid{}",
                                      kCols, lock ? " FOR UPDATE" : ""),
                          id);
  if (r.empty()) return std::nullopt;
  return FromRow(r[0], c);
}

std::optional<AllocationRow> SelectAllocation(pqxx::work& tx, const std::string& id, bool lock) {
  auto r = tx.exec_params(
      fmt::format("SELECT allocation_id, tenant, node_id, region, shape, state, slot_key, "
                  "target_ip, vm_ready FROM allocations WHERE allocation_id = $1{}",
                  lock ? " FOR UPDATE" : ""),
      id);
  if (r.empty()) return std::nullopt;
  AllocationRow a;
  a.id = r[0][0].as<std::string>();
  a.tenant = r[0][1].as<std::string>();
  a.node = r[0][2].as<std::string>();
  a.region = r[0][3].as<std::string>();
  a.shape = enums::FromColumn<v1::CapacityShape>(r[0][4].as<std::string>());
  a.state = enums::FromColumn<v1::AllocationState>(r[0][5].as<std::string>());
  a.slot_key = r[0][6].as<std::string>();
  a.target_ip = r[0][7].as<std::string>();
  a.vm_ready = r[0][8].as<bool>();
  return a;
}

// The WHERE condition (on $1) of an ExposureSelection.
const char* Where(const ExposureSelection& s) {
  return s.by == ExposureSelection::By::kAllocation ? "allocation_id = $1"
                                                    : "exposure_id = $1::uuid";
}

}  // namespace

const documents::Tables& ExposureDocuments() {
  static const documents::Tables t{"exposure_documents", "exposure_acks", "exposure document"};
  return t;
}

// ---- endpoint pools ----

std::vector<v1::EndpointPool> LoadPools(pqxx::work& tx, const std::string& region) {
  return SelectPools(tx, "($1 = '' OR p.region = $1)", region);
}

std::optional<v1::EndpointPool> LoadPool(pqxx::work& tx, const std::string& name) {
  auto pools = SelectPools(tx, "p.name = $1", name);
  if (pools.empty()) return std::nullopt;
  return std::move(pools.front());
}

void LockPoolTable(pqxx::work& tx) {
  tx.exec("LOCK TABLE endpoint_pools IN SHARE ROW EXCLUSIVE MODE");
}

std::optional<PoolPlacement> LockPoolPlacement(pqxx::work& tx, const std::string& name) {
  auto r = tx.exec_params(
      "SELECT region, node_id, (SELECT count(*) FROM endpoint_leases l WHERE l.pool = p.name) "
      "FROM endpoint_pools p WHERE name = $1 FOR UPDATE",
      name);
  if (r.empty()) return std::nullopt;
  return PoolPlacement{r[0][0].as<std::string>(), r[0][1].as<std::string>(), r[0][2].as<int64_t>()};
}

std::optional<PoolAddress> FindOverlappingPool(pqxx::work& tx, const v1::EndpointPool& want) {
  std::vector<std::string> addrs(want.addresses().begin(), want.addresses().end());
  auto r = tx.exec_params(
      "SELECT name, a FROM endpoint_pools, unnest(addresses) a WHERE name <> $1 AND a = "
      "ANY($2::text[]) AND (kind = 'public_ip' OR $3 = 'public_ip' OR (port_min <= $5 AND $4 <= "
      "port_max)) ORDER BY name, a LIMIT 1",
      want.name(), store::TextArrayLiteral(addrs), enums::Text(want.kind()), want.port_min(),
      want.port_max());
  if (r.empty()) return std::nullopt;
  return PoolAddress{r[0][0].as<std::string>(), r[0][1].as<std::string>()};
}

std::optional<HeldEndpoint> FindEndpointDroppedBy(pqxx::work& tx, const v1::EndpointPool& want) {
  std::vector<std::string> addrs(want.addresses().begin(), want.addresses().end());
  auto r = tx.exec_params(
      "SELECT address, port FROM endpoint_leases WHERE pool = $1 AND (NOT (address = "
      "ANY($2::text[])) OR (port <> 0 AND (port < $3 OR port > $4)) OR (port = 0 AND $5 = "
      "'port_range') OR (port <> 0 AND $5 = 'public_ip')) ORDER BY address, port LIMIT 1",
      want.name(), store::TextArrayLiteral(addrs), want.port_min(), want.port_max(),
      enums::Text(want.kind()));
  if (r.empty()) return std::nullopt;
  return HeldEndpoint{r[0][0].as<std::string>(), r[0][1].as<int32_t>()};
}

bool UpsertPool(pqxx::work& tx, const v1::EndpointPool& want) {
  std::vector<std::string> addrs(want.addresses().begin(), want.addresses().end());
  auto r = tx.exec_params(
      "INSERT INTO endpoint_pools (name, kind, region, node_id, addresses, port_min, port_max) "
      "VALUES ($1, $2, $3, $4, $5::text[], $6, $7) ON CONFLICT (name) DO UPDATE SET kind = "
      "EXCLUDED.kind, region = EXCLUDED.region, node_id = EXCLUDED.node_id, addresses = "
      "EXCLUDED.addresses, port_min = EXCLUDED.port_min, port_max = EXCLUDED.port_max, "
      "generation = endpoint_pools.generation + 1, updated_at = now() RETURNING generation = 1",
      want.name(), enums::Text(want.kind()), want.region(), want.node_id(),
      store::TextArrayLiteral(addrs), want.port_min(), want.port_max());
  return r[0][0].as<bool>();
}

void LockPool(pqxx::work& tx, const std::string& name) {
  tx.exec_params("SELECT 1 FROM endpoint_pools WHERE name = $1 FOR UPDATE", name);
}

int64_t CountLeasesOfPool(pqxx::work& tx, const std::string& name) {
  return tx.exec_params("SELECT count(*) FROM endpoint_leases WHERE pool = $1", name)[0][0]
      .as<int64_t>();
}

int64_t CountLeasesOfPools(pqxx::work& tx, const std::vector<std::string>& names) {
  return tx
      .exec_params("SELECT count(*) FROM endpoint_leases WHERE pool = ANY($1::text[])",
                   store::TextArrayLiteral(names))[0][0]
      .as<int64_t>();
}

void DeletePoolRow(pqxx::work& tx, const std::string& name) {
  tx.exec_params("DELETE FROM endpoint_pools WHERE name = $1", name);
}

std::vector<v1::EndpointPool> LockPoolsServingNode(pqxx::work& tx, const std::string& region,
                                                   const std::string& node_id) {
  std::vector<v1::EndpointPool> pools;
  for (const auto& r : tx.exec_params(
           "SELECT p.name, p.kind, p.addresses, p.port_min, p.port_max FROM endpoint_pools p "
           "WHERE p.region = $1 AND ((p.kind = 'port_range' AND p.node_id = $2) OR p.kind = "
           "'public_ip') ORDER BY p.kind = 'port_range' DESC, p.name FOR UPDATE OF p",
           region, node_id)) {
    v1::EndpointPool p;
    p.set_name(r[0].as<std::string>());
    p.set_kind(enums::FromColumn<v1::EndpointPoolKind>(r[1].as<std::string>()));
    for (const auto& addr : store::TextArray(r[2])) p.add_addresses(addr);
    p.set_port_min(r[3].as<int32_t>());
    p.set_port_max(r[4].as<int32_t>());
    pools.push_back(std::move(p));
  }
  return pools;
}

// ---- endpoint leases ----

std::optional<PoolAddress> FindHeldPublicAddress(pqxx::work& tx, const std::string& allocation_id) {
  auto r = tx.exec_params(
      "SELECT pool, address FROM endpoint_leases WHERE allocation_id = $1 AND port = 0 LIMIT 1",
      allocation_id);
  if (r.empty()) return std::nullopt;
  return PoolAddress{r[0][0].as<std::string>(), r[0][1].as<std::string>()};
}

std::optional<int32_t> FindLowestFreePort(pqxx::work& tx, const std::string& address,
                                          int32_t port_min, int32_t port_max) {
  auto r = tx.exec_params(
      "SELECT g::int4 FROM generate_series($2::int4, $3::int4) g WHERE NOT EXISTS (SELECT 1 "
      "FROM endpoint_leases l WHERE l.address = $1 AND l.port = g) ORDER BY g LIMIT 1",
      address, port_min, port_max);
  if (r.empty()) return std::nullopt;
  return r[0][0].as<int32_t>();
}

std::optional<std::string> FindFirstFreeAddress(pqxx::work& tx, const v1::EndpointPool& pool) {
  std::vector<std::string> addrs(pool.addresses().begin(), pool.addresses().end());
  auto r = tx.exec_params(
      "SELECT t.a FROM unnest($1::text[]) WITH ORDINALITY AS t(a, i) WHERE NOT EXISTS "
      "(SELECT 1 FROM endpoint_leases l WHERE l.address = t.a) ORDER BY t.i LIMIT 1",
      store::TextArrayLiteral(addrs));
  if (r.empty()) return std::nullopt;
  return r[0][0].as<std::string>();
}

void LeasePort(pqxx::work& tx, const std::string& pool, const std::string& address, int32_t port,
               const std::string& allocation_id, const std::string& exposure_id) {
  tx.exec_params(
      "INSERT INTO endpoint_leases (pool, address, port, allocation_id, exposure_id) VALUES "
      "($1, $2, $3, $4, $5::uuid)",
      pool, address, port, allocation_id, exposure_id);
}

void LeaseAddress(pqxx::work& tx, const std::string& pool, const std::string& address,
                  const std::string& allocation_id) {
  tx.exec_params(
      "INSERT INTO endpoint_leases (pool, address, port, allocation_id) VALUES ($1, $2, 0, "
      "$3)",
      pool, address, allocation_id);
}

void FreeEndpoint(pqxx::work& tx, const v1::Exposure& e) {
  tx.exec_params("DELETE FROM endpoint_leases WHERE exposure_id = $1::uuid", e.exposure_id());
  tx.exec_params(
      "DELETE FROM endpoint_leases l WHERE l.allocation_id = $1 AND l.port = 0 AND NOT EXISTS "
      "(SELECT 1 FROM exposures x WHERE x.allocation_id = $1 AND x.public_ip = l.address AND "
      "x.state NOT IN ('removed', 'failed'))",
      e.allocation_id());
}

// ---- allocations ----

std::optional<AllocationRow> LoadAllocation(pqxx::work& tx, const std::string& id) {
  return SelectAllocation(tx, id, false);
}

std::optional<AllocationRow> LockAllocation(pqxx::work& tx, const std::string& id) {
  return SelectAllocation(tx, id, true);
}

std::optional<std::string> LoadAllocationTenant(pqxx::work& tx, const std::string& id) {
  auto r = tx.exec_params("SELECT tenant FROM allocations WHERE allocation_id = $1", id);
  if (r.empty()) return std::nullopt;
  return r[0][0].as<std::string>();
}

std::optional<int64_t> LockAllocationGeneration(pqxx::work& tx, const std::string& id) {
  auto r =
      tx.exec_params("SELECT generation FROM allocations WHERE allocation_id = $1 FOR UPDATE", id);
  if (r.empty()) return std::nullopt;
  return r[0][0].as<int64_t>();
}

void UpsertAllocation(pqxx::work& tx, const AllocationRow& a, int64_t generation) {
  // Slot keys go when the claims are freed, the address when the VM is gone: keep the last known.
  tx.exec_params(
      "INSERT INTO allocations (allocation_id, tenant, node_id, region, shape, state, slot_key, "
      "target_ip, vm_ready, generation) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10) ON "
      "CONFLICT (allocation_id) DO UPDATE SET tenant = EXCLUDED.tenant, node_id = "
      "EXCLUDED.node_id, region = EXCLUDED.region, shape = EXCLUDED.shape, state = "
      "EXCLUDED.state, slot_key = CASE WHEN EXCLUDED.slot_key = '' THEN allocations.slot_key "
      "ELSE EXCLUDED.slot_key END, target_ip = CASE WHEN EXCLUDED.target_ip = '' THEN "
      "allocations.target_ip ELSE EXCLUDED.target_ip END, vm_ready = EXCLUDED.vm_ready, "
      "generation = EXCLUDED.generation, updated_at = now()",
      a.id, a.tenant, a.node, a.region, enums::Text(a.shape), enums::Text(a.state), a.slot_key,
      a.target_ip, a.vm_ready, generation);
}

// ---- exposures ----

std::optional<v1::Exposure> LoadExposure(pqxx::work& tx, const Context& c, const std::string& id) {
  return SelectExposure(tx, c, id, false);
}

std::optional<v1::Exposure> LockExposure(pqxx::work& tx, const Context& c, const std::string& id) {
  return SelectExposure(tx, c, id, true);
}

std::vector<std::string> ListExposureIds(pqxx::work& tx, const ExposureFilter& f) {
  std::vector<std::string> out;
  for (const auto& r :
       tx.exec_params("SELECT exposure_id::text FROM exposures WHERE ($1 = '' OR allocation_id "
                      "= $1) AND ($2 = '' OR node_id = $2) AND (($3 = '' AND state <> "
                      "'removed') OR state = $3) AND ($4 = '' OR tenant = $4) ORDER BY "
                      "exposure_id DESC LIMIT 1000",
                      f.allocation_id, f.node_id, enums::Text(f.state), f.tenant)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

bool HasExposureNamed(pqxx::work& tx, const std::string& allocation_id, const std::string& name) {
  return !tx.exec_params("SELECT 1 FROM exposures WHERE allocation_id = $1 AND name = $2",
                         allocation_id, name)
              .empty();
}

std::optional<v1::Exposure> FindLiveExposureLike(pqxx::work& tx, const Context& c,
                                                 const std::string& allocation_id,
                                                 const std::string& name,
                                                 const std::string& protocol, int32_t port) {
  auto r = tx.exec_params(
      fmt::format("SELECT {} FROM exposures WHERE allocation_id = $1 AND state NOT IN "
                  "('removed', 'failed') AND (name = $2 OR (protocol = $3 AND "
                  "target_port = $4))",
                  kCols),
      allocation_id, name, protocol, port);
  if (r.empty()) return std::nullopt;
  return FromRow(r[0], c);
}

int64_t CountLiveExposures(pqxx::work& tx, const std::string& allocation_id) {
  return tx
      .exec_params(
          "SELECT count(*) FROM exposures WHERE allocation_id = $1 AND state NOT IN "
          "('removed', 'failed')",
          allocation_id)[0][0]
      .as<int64_t>();
}

v1::Exposure InsertRequestedExposure(pqxx::work& tx, const Context& c, const NewExposure& x) {
  auto r = tx.exec_params(
      fmt::format("INSERT INTO exposures (exposure_id, allocation_id, tenant, node_id, slot_key, "
                  "name, protocol, target_port, pool, public_ip, public_port, state, detail) "
                  "VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'requested', $12) "
                  "RETURNING {}",
                  kCols),
      x.id, x.allocation_id, x.tenant, x.node_id, x.slot_key, x.name, x.protocol, x.target_port,
      x.pool, x.public_ip, x.public_port, x.detail);
  return FromRow(r[0], c);
}

v1::Exposure InsertFailedExposure(pqxx::work& tx, const Context& c, const NewExposure& x) {
  auto r = tx.exec_params(
      fmt::format("INSERT INTO exposures (exposure_id, allocation_id, tenant, node_id, "
                  "slot_key, name, protocol, target_port, state, reason, detail) VALUES "
                  "($1::uuid, $2, $3, $4, $5, $6, $7, $8, 'failed', $9, $10) RETURNING {}",
                  kCols),
      x.id, x.allocation_id, x.tenant, x.node_id, x.slot_key, x.name, x.protocol, x.target_port,
      x.reason, x.detail);
  return FromRow(r[0], c);
}

double SecondsInState(pqxx::work& tx, const std::string& id) {
  return tx
      .exec_params(
          "SELECT extract(epoch from now() - updated_at)::float8 FROM exposures WHERE "
          "exposure_id = $1::uuid",
          id)[0][0]
      .as<double>();
}

std::optional<v1::ExposureState> LoadExposureState(pqxx::work& tx, const std::string& id) {
  auto r = tx.exec_params("SELECT state FROM exposures WHERE exposure_id = $1::uuid", id);
  if (r.empty()) return std::nullopt;
  return enums::FromColumn<v1::ExposureState>(r[0][0].as<std::string>());
}

v1::Exposure UpdateExposureState(pqxx::work& tx, const Context& c, const std::string& id,
                                 v1::ExposureState state, const std::string& reason,
                                 const std::string& detail, int64_t doc_version) {
  auto r = tx.exec_params(
      fmt::format("UPDATE exposures SET state = $2, reason = $3, detail = $4, document_version = "
                  "CASE WHEN $5::int8 < 0 THEN document_version ELSE $5::int8 END, generation = "
                  "generation + 1, updated_at = now() WHERE exposure_id = $1::uuid RETURNING {}",
                  kCols),
      id, enums::Text(state), reason, detail, doc_version);
  return FromRow(r[0], c);
}

std::vector<std::string> MarkRequestedApplying(pqxx::work& tx, const std::string& allocation_id,
                                               const std::string& target_ip,
                                               const std::string& slot_key) {
  std::vector<std::string> out;
  for (const auto& r : tx.exec_params(
           "UPDATE exposures SET state = 'applying', target_ip = $2, slot_key = $3 WHERE "
           "allocation_id = $1 AND state = 'requested' RETURNING exposure_id::text",
           allocation_id, target_ip, slot_key)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

void MarkRemoving(pqxx::work& tx, const std::string& id) {
  tx.exec_params("UPDATE exposures SET state = 'removing' WHERE exposure_id = $1::uuid", id);
}

std::vector<std::string> NodesOfLiveExposures(pqxx::work& tx, const ExposureSelection& s) {
  std::vector<std::string> out;
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT DISTINCT node_id FROM exposures WHERE {} AND state IN ('requested', "
                       "'applying', 'active', 'drift') ORDER BY node_id",
                       Where(s)),
           s.id)) {
    out.push_back(r[0].as<std::string>());
  }
  return out;
}

std::vector<LiveExposure> LockLiveExposures(pqxx::work& tx, const ExposureSelection& s) {
  std::vector<LiveExposure> out;
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT exposure_id::text, state, node_id FROM exposures WHERE {} AND "
                       "state IN ('requested', 'applying', 'active', 'drift') ORDER BY "
                       "exposure_id FOR UPDATE",
                       Where(s)),
           s.id)) {
    out.push_back({r[0].as<std::string>(),
                   enums::FromColumn<v1::ExposureState>(r[1].as<std::string>()),
                   r[2].as<std::string>()});
  }
  return out;
}

std::vector<SettlingExposure> ListExposuresToSettle(pqxx::work& tx, const std::string& node_id,
                                                    int64_t version) {
  std::vector<SettlingExposure> out;
  for (const auto& r : tx.exec_params(
           "SELECT exposure_id::text, state FROM exposures WHERE node_id = $1 AND state IN "
           "('applying', 'drift', 'removing') AND document_version <= $2 ORDER BY exposure_id",
           node_id, version)) {
    out.push_back(
        {r[0].as<std::string>(), enums::FromColumn<v1::ExposureState>(r[1].as<std::string>())});
  }
  return out;
}

// ---- the node's exposure document ----

void LockNodeDocument(pqxx::work& tx, const std::string& node_id) {
  tx.exec_params("SELECT pg_advisory_xact_lock(hashtextextended('ingress-doc:' || $1, 0))",
                 node_id);
}

v1::NodeExposureDocument LoadNodeMappings(pqxx::work& tx, const std::string& node_id) {
  v1::NodeExposureDocument doc;
  doc.set_node_id(node_id);
  for (const auto& r : tx.exec_params(
           "SELECT exposure_id::text, allocation_id, slot_key, protocol, public_ip, public_port, "
           "target_ip, target_port FROM exposures WHERE node_id = $1 AND state IN ('applying', "
           "'active', 'drift') ORDER BY exposure_id",
           node_id)) {
    auto* m = doc.add_mappings();
    m->set_exposure_id(r[0].as<std::string>());
    m->set_allocation_id(r[1].as<std::string>());
    m->set_slot_key(r[2].as<std::string>());
    m->set_protocol(enums::FromColumn<v1::TransportProtocol>(r[3].as<std::string>()));
    m->set_public_ip(r[4].as<std::string>());
    m->set_public_port(r[5].as<int32_t>());
    m->set_target_ip(r[6].as<std::string>());
    m->set_target_port(r[7].as<int32_t>());
  }
  return doc;
}

void RecordAckSimulated(pqxx::work& tx, const std::string& node_id, bool simulated) {
  tx.exec_params("UPDATE exposure_acks SET simulated = $2 WHERE node_id = $1", node_id, simulated);
}

// ---- gauges ----

std::vector<StateCount> CountExposuresByState(pqxx::work& tx) {
  std::vector<StateCount> out;
  for (const auto& r : tx.exec("SELECT state, count(*)::float8 FROM exposures GROUP BY state")) {
    out.push_back({r[0].as<std::string>(), r[1].as<double>()});
  }
  return out;
}

std::vector<PoolEndpoints> CountPoolEndpoints(pqxx::work& tx) {
  std::vector<PoolEndpoints> out;
  for (const auto& r :
       tx.exec("SELECT p.name, CASE WHEN p.kind = 'port_range' THEN p.port_max - "
               "p.port_min + 1 ELSE cardinality(p.addresses) END::float8, (SELECT "
               "count(*) FROM endpoint_leases l WHERE l.pool = p.name)::float8 FROM "
               "endpoint_pools p")) {
    out.push_back({r[0].as<std::string>(), r[1].as<double>(), r[2].as<double>()});
  }
  return out;
}

}  // namespace gpuaas::ingress
