// Exposures: reservation against the pools, the node's exposure document, the agent's acks and
// the allocation events that drive them. Every function runs in the caller's transaction; every
// state change is announced through the outbox in that transaction.
#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/allocation_event.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "ingress_domain.hpp"
#include "ingress_metrics.hpp"
#include "ingress_service.hpp"

namespace gpuaas::ingress {

namespace {

using google::protobuf::util::TimeUtil;

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

std::optional<v1::Exposure> Find(pqxx::work& tx, const Context& c, const std::string& id,
                                 bool lock) {
  if (!ids::IsUuid(id)) return std::nullopt;
  auto r = tx.exec_params(fmt::format("SELECT {} FROM exposures WHERE exposure_id = $1::uuid{}",
                                      kCols, lock ? " FOR UPDATE" : ""),
                          id);
  if (r.empty()) return std::nullopt;
  return FromRow(r[0], c);
}

Result<void> Announce(pqxx::work& tx, const Context& c, const v1::Exposure& e) {
  v1::ExposureSnapshot snap;
  *snap.mutable_exposure() = e;
  outbox::EventSpec spec;
  spec.nats_subject = "gpuaas.v1.evt.ingress.exposure." + enums::Text(e.state());
  spec.source = c.source;
  spec.entity = e.exposure_id();
  spec.generation = e.generation();
  spec.correlation_id = e.allocation_id();
  spec.data = &snap;
  auto r = outbox::Append(tx, spec);
  if (!r.ok()) return r.error();
  return Ok();
}

// Moves one exposure to `state` (a new generation, announced). `doc_version` < 0 keeps it.
Result<v1::Exposure> Set(pqxx::work& tx, const Context& c, const std::string& id,
                         v1::ExposureState state, const std::string& reason,
                         const std::string& detail, int64_t doc_version = -1) {
  const double in_state_s =
      tx.exec_params(
            "SELECT extract(epoch from now() - updated_at)::float8 FROM exposures WHERE "
            "exposure_id = $1::uuid",
            id)[0][0]
          .as<double>();
  const auto prev = tx.exec_params("SELECT state FROM exposures WHERE exposure_id = $1::uuid", id);
  auto r = tx.exec_params(
      fmt::format("UPDATE exposures SET state = $2, reason = $3, detail = $4, document_version = "
                  "CASE WHEN $5::int8 < 0 THEN document_version ELSE $5::int8 END, generation = "
                  "generation + 1, updated_at = now() WHERE exposure_id = $1::uuid RETURNING {}",
                  kCols),
      id, enums::Text(state), reason, detail, doc_version);
  auto e = FromRow(r[0], c);
  if (c.metrics != nullptr && !prev.empty() && prev[0][0].as<std::string>() == "applying" &&
      state == v1::EXPOSURE_STATE_ACTIVE) {
    c.metrics->Applied(in_state_s);
  }
  if (auto a = Announce(tx, c, e); !a.ok()) return a.error();
  return e;
}

struct AllocRow {
  std::string id, tenant, node, region, shape, state, slot_key, target_ip;
  bool vm_ready = false;
};

std::optional<AllocRow> LoadAlloc(pqxx::work& tx, const std::string& id, bool lock) {
  auto r = tx.exec_params(
      fmt::format("SELECT allocation_id, tenant, node_id, region, shape, state, slot_key, "
                  "target_ip, vm_ready FROM allocations WHERE allocation_id = $1{}",
                  lock ? " FOR UPDATE" : ""),
      id);
  if (r.empty()) return std::nullopt;
  AllocRow a;
  a.id = r[0][0].as<std::string>();
  a.tenant = r[0][1].as<std::string>();
  a.node = r[0][2].as<std::string>();
  a.region = r[0][3].as<std::string>();
  a.shape = r[0][4].as<std::string>();
  a.state = r[0][5].as<std::string>();
  a.slot_key = r[0][6].as<std::string>();
  a.target_ip = r[0][7].as<std::string>();
  a.vm_ready = r[0][8].as<bool>();
  return a;
}

bool Live(const std::string& allocation_state) {
  return allocation_state == "reserved" || allocation_state == "provisioning" ||
         allocation_state == "active";
}

// Frees what the exposure held: its port, or its allocation's address once no live exposure of
// the allocation uses it any more.
void FreeEndpoint(pqxx::work& tx, const v1::Exposure& e) {
  tx.exec_params("DELETE FROM endpoint_leases WHERE exposure_id = $1::uuid", e.exposure_id());
  tx.exec_params(
      "DELETE FROM endpoint_leases l WHERE l.allocation_id = $1 AND l.port = 0 AND NOT EXISTS "
      "(SELECT 1 FROM exposures x WHERE x.allocation_id = $1 AND x.public_ip = l.address AND "
      "x.state NOT IN ('removed', 'failed'))",
      e.allocation_id());
}

// One writer of a node's document at a time (the next version is latest + 1).
void LockNodeDocument(pqxx::work& tx, const std::string& node_id) {
  tx.exec_params("SELECT pg_advisory_xact_lock(hashtextextended('ingress-doc:' || $1, 0))",
                 node_id);
}

// Writes the node's next document when its mappings changed; returns the latest version.
Result<int64_t> UpdateNodeDocument(pqxx::work& tx, const std::string& node_id) {
  LockNodeDocument(tx, node_id);
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
  const bool empty = doc.mappings_size() == 0;
  return documents::Publish(tx, ExposureDocuments(), node_id, doc, empty);
}

// Exposures whose document version the node has acked reach their next state: applying and
// repaired drift -> active, removing -> removed (the endpoint is free again).
Result<void> Settle(pqxx::work& tx, const Context& c, const std::string& node_id,
                    const std::set<std::string>& drifted_now, bool simulated) {
  auto ack = documents::LoadAck(tx, ExposureDocuments(), node_id);
  if (ack.applied_version == 0) return Ok();
  for (const auto& r : tx.exec_params(
           "SELECT exposure_id::text, state FROM exposures WHERE node_id = $1 AND state IN "
           "('applying', 'drift', 'removing') AND document_version <= $2 ORDER BY exposure_id",
           node_id, ack.applied_version)) {
    const auto id = r[0].as<std::string>();
    const auto state = r[1].as<std::string>();
    if (state == "removing") {
      auto e =
          Set(tx, c, id, v1::EXPOSURE_STATE_REMOVED, "",
              fmt::format("node {} acked document {} without it", node_id, ack.applied_version));
      if (!e.ok()) return e.error();
      FreeEndpoint(tx, *e);
      continue;
    }
    if (state == "drift" && drifted_now.count(id)) continue;
    const std::string detail =
        simulated ? fmt::format("node {} took document {} (simulated: no kernel rule)", node_id,
                                ack.applied_version)
        : state == "drift"
            ? fmt::format("node {} reports the rule in place again (document {})", node_id,
                          ack.applied_version)
            : fmt::format("node {} applied document {}", node_id, ack.applied_version);
    if (auto e = Set(tx, c, id, v1::EXPOSURE_STATE_ACTIVE, "", detail); !e.ok()) return e.error();
  }
  return Ok();
}

// The exposures of an allocation that wait for its VM get its address and go to the node.
Result<void> StartApply(pqxx::work& tx, const Context& c, const AllocRow& a) {
  // The node's document lock before any exposure row lock, as ApplyAck takes them: the other
  // order deadlocks against a concurrent ack.
  LockNodeDocument(tx, a.node);
  auto ids = tx.exec_params(
      "UPDATE exposures SET state = 'applying', target_ip = $2, slot_key = $3 WHERE "
      "allocation_id = $1 AND state = 'requested' RETURNING exposure_id::text",
      a.id, a.target_ip, a.slot_key);
  if (ids.empty()) return Ok();
  auto v = UpdateNodeDocument(tx, a.node);
  if (!v.ok()) return v.error();
  for (const auto& r : ids) {
    auto e = Set(tx, c, r[0].as<std::string>(), v1::EXPOSURE_STATE_APPLYING, "",
                 fmt::format("in exposure document {} of node {}", *v, a.node), *v);
    if (!e.ok()) return e.error();
  }
  return Settle(tx, c, a.node, {}, false);
}

// Takes exposures off their node: REMOVED at once when they never reached it, else REMOVING
// until the node acks a document without them.
Result<std::vector<v1::Exposure>> StartRemove(pqxx::work& tx, const Context& c,
                                              const std::string& where, const std::string& arg,
                                              const std::string& why) {
  std::vector<v1::Exposure> out;
  std::set<std::string> nodes;
  std::vector<std::pair<std::string, std::string>> going;  // (id, node)
  // Node document locks first (see StartApply), in one order.
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT DISTINCT node_id FROM exposures WHERE {} AND state IN ('requested', "
                       "'applying', 'active', 'drift') ORDER BY node_id",
                       where),
           arg)) {
    LockNodeDocument(tx, r[0].as<std::string>());
  }
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT exposure_id::text, state, node_id FROM exposures WHERE {} AND "
                       "state IN ('requested', 'applying', 'active', 'drift') ORDER BY "
                       "exposure_id FOR UPDATE",
                       where),
           arg)) {
    const auto id = r[0].as<std::string>();
    if (r[1].as<std::string>() == "requested") {
      auto e = Set(tx, c, id, v1::EXPOSURE_STATE_REMOVED, "", why + " (never on the node)");
      if (!e.ok()) return e.error();
      FreeEndpoint(tx, *e);
      out.push_back(*e);
      continue;
    }
    tx.exec_params("UPDATE exposures SET state = 'removing' WHERE exposure_id = $1::uuid", id);
    nodes.insert(r[2].as<std::string>());
    going.emplace_back(id, r[2].as<std::string>());
  }
  std::map<std::string, int64_t> versions;
  for (const auto& n : nodes) {
    auto v = UpdateNodeDocument(tx, n);
    if (!v.ok()) return v.error();
    versions[n] = *v;
  }
  for (const auto& [id, node] : going) {
    auto e =
        Set(tx, c, id, v1::EXPOSURE_STATE_REMOVING, "",
            fmt::format("{}: out of exposure document {} of node {}", why, versions[node], node),
            versions[node]);
    if (!e.ok()) return e.error();
    out.push_back(*e);
  }
  for (const auto& n : nodes) {
    if (auto s = Settle(tx, c, n, {}, false); !s.ok()) return s.error();
  }
  return out;
}

// The counts are read after the pool rows are locked: a count in the locking statement itself
// can predate a reservation that committed while it waited for the lock.
Error Exhausted(pqxx::work& tx, const AllocRow& a, const std::vector<v1::EndpointPool>& pools) {
  int64_t total = 0;
  std::vector<std::string> names;
  names.reserve(pools.size());
  for (const auto& p : pools) {
    total += PoolCapacity(p);
    names.push_back(p.name());
  }
  const auto used =
      tx.exec_params("SELECT count(*) FROM endpoint_leases WHERE pool = ANY($1::text[])",
                     store::TextArrayLiteral(names))[0][0]
          .as<int64_t>();
  return Error{Code::kResourceExhausted,
               "pool_exhausted",
               fmt::format("every endpoint of the pools serving node {} in region {} is taken "
                           "({} of {} used)",
                           a.node, a.region, used, total),
               {{"region", a.region},
                {"node_id", a.node},
                {"pools", fmt::format("{}", fmt::join(names, ","))},
                {"total", std::to_string(total)},
                {"used", std::to_string(used)},
                {"requested", "1"}},
               true};
}

}  // namespace

const documents::Tables& ExposureDocuments() {
  static const documents::Tables t{"exposure_documents", "exposure_acks", "exposure document"};
  return t;
}

Result<Reserved> Reserve(pqxx::work& tx, const Context& c, const std::string& allocation_id,
                         const std::string& name, v1::TransportProtocol protocol, int32_t port,
                         bool apply) {
  if (auto v = ValidateEndpoint(name, protocol, port); !v.ok()) return v.error();
  auto a = LoadAlloc(tx, allocation_id, true);
  if (!a) {
    return Error::NotFound("allocation_not_found",
                           "ingress has not seen allocation " + allocation_id);
  }
  if (a->shape == "baremetal") {
    return Error::FailedPrecondition("exposure_not_for_baremetal",
                                     "a bare-metal node has its own public addresses; ingress "
                                     "exposes slice VMs only");
  }
  if (!Live(a->state)) {
    return Error::FailedPrecondition("allocation_not_live",
                                     fmt::format("allocation {} is {}", a->id, a->state));
  }
  const std::string proto = enums::Text(protocol);
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT {} FROM exposures WHERE allocation_id = $1 AND state NOT IN "
                       "('removed', 'failed') AND (name = $2 OR (protocol = $3 AND "
                       "target_port = $4))",
                       kCols),
           a->id, name, proto, port)) {
    auto e = FromRow(r, c);
    if (e.name() == name && e.protocol() == protocol && e.target_port() == port) {
      return Reserved{e, false};
    }
    Error err = Error::FailedPrecondition(
        "endpoint_exists", fmt::format("allocation {} already exposes {} ({}/{})", a->id, e.name(),
                                       e.target_port(), enums::Text(e.protocol())));
    err.details = {{"exposure_id", e.exposure_id()}, {"name", e.name()}};
    return err;
  }
  const auto live =
      tx.exec_params(
            "SELECT count(*) FROM exposures WHERE allocation_id = $1 AND state NOT IN "
            "('removed', 'failed')",
            a->id)[0][0]
          .as<int64_t>();
  if (live >= c.cfg.max_endpoints_per_allocation) {
    return Error::FailedPrecondition(
        "too_many_endpoints", fmt::format("allocation {} already exposes {} endpoints (at most {})",
                                          a->id, live, c.cfg.max_endpoints_per_allocation));
  }
  // The pools that can serve the node, locked: reservations from one pool are serialised.
  std::vector<v1::EndpointPool> pools;
  for (const auto& r : tx.exec_params(
           "SELECT p.name, p.kind, p.addresses, p.port_min, p.port_max FROM endpoint_pools p "
           "WHERE p.region = $1 AND ((p.kind = 'port_range' AND p.node_id = $2) OR p.kind = "
           "'public_ip') ORDER BY p.kind = 'port_range' DESC, p.name FOR UPDATE OF p",
           a->region, a->node)) {
    v1::EndpointPool p;
    p.set_name(r[0].as<std::string>());
    p.set_kind(enums::FromColumn<v1::EndpointPoolKind>(r[1].as<std::string>()));
    for (const auto& addr : store::TextArray(r[2])) p.add_addresses(addr);
    p.set_port_min(r[3].as<int32_t>());
    p.set_port_max(r[4].as<int32_t>());
    pools.push_back(std::move(p));
  }
  if (pools.empty()) {
    Error err{Code::kResourceExhausted,
              "no_pool",
              fmt::format("no endpoint pool serves node {} in region {} (gpuaasctl ingress pool "
                          "set)",
                          a->node, a->region),
              {{"region", a->region}, {"node_id", a->node}},
              false};
    return err;
  }
  std::string pool;
  std::string address;
  int32_t public_port = 0;
  // An allocation that already holds a public address keeps using it.
  auto held = tx.exec_params(
      "SELECT pool, address FROM endpoint_leases WHERE allocation_id = $1 AND port = 0 LIMIT 1",
      a->id);
  const std::string id = ids::NewUuidV7();
  if (!held.empty()) {
    pool = held[0][0].as<std::string>();
    address = held[0][1].as<std::string>();
    public_port = port;
  }
  for (const auto& p : pools) {
    if (!address.empty()) break;
    if (p.kind() == v1::ENDPOINT_POOL_KIND_PORT_RANGE) {
      auto free = tx.exec_params(
          "SELECT g::int4 FROM generate_series($2::int4, $3::int4) g WHERE NOT EXISTS (SELECT 1 "
          "FROM endpoint_leases l WHERE l.address = $1 AND l.port = g) ORDER BY g LIMIT 1",
          p.addresses(0), p.port_min(), p.port_max());
      if (free.empty()) continue;
      pool = p.name();
      address = p.addresses(0);
      public_port = free[0][0].as<int32_t>();
      tx.exec_params(
          "INSERT INTO endpoint_leases (pool, address, port, allocation_id, exposure_id) VALUES "
          "($1, $2, $3, $4, $5::uuid)",
          pool, address, public_port, a->id, id);
    } else {
      std::vector<std::string> addrs(p.addresses().begin(), p.addresses().end());
      auto free = tx.exec_params(
          "SELECT t.a FROM unnest($1::text[]) WITH ORDINALITY AS t(a, i) WHERE NOT EXISTS "
          "(SELECT 1 FROM endpoint_leases l WHERE l.address = t.a) ORDER BY t.i LIMIT 1",
          store::TextArrayLiteral(addrs));
      if (free.empty()) continue;
      pool = p.name();
      address = free[0][0].as<std::string>();
      public_port = port;
      tx.exec_params(
          "INSERT INTO endpoint_leases (pool, address, port, allocation_id) VALUES ($1, $2, 0, "
          "$3)",
          pool, address, a->id);
    }
  }
  if (address.empty()) return Exhausted(tx, *a, pools);
  auto r = tx.exec_params(
      fmt::format("INSERT INTO exposures (exposure_id, allocation_id, tenant, node_id, slot_key, "
                  "name, protocol, target_port, pool, public_ip, public_port, state, detail) "
                  "VALUES ($1::uuid, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, 'requested', $12) "
                  "RETURNING {}",
                  kCols),
      id, a->id, a->tenant, a->node, a->slot_key, name, proto, port, pool, address, public_port,
      fmt::format("reserved from pool {}", pool));
  auto e = FromRow(r[0], c);
  if (auto x = Announce(tx, c, e); !x.ok()) return x.error();
  if (apply && a->vm_ready && !a->target_ip.empty() && a->state != "reserved") {
    if (auto s = StartApply(tx, c, *a); !s.ok()) return s.error();
    if (auto again = Find(tx, c, id, false)) e = *again;
  }
  return Reserved{e, true};
}

Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const Context& c) {
  auto read = inbox::ReadAllocationEvent(ev);
  if (!read.ok()) return read.error();
  const auto& a = read->allocation();
  const int64_t generation = read->generation;
  // What this event makes ingress do was asked for by whoever caused it (the allocation's
  // creator, its releaser): the exposure events name them.
  std::optional<outbox::ActorScope> actor;
  if (!ev.actor().subject().empty()) actor.emplace(ev.actor());
  auto prev = tx.exec_params(
      "SELECT generation FROM allocations WHERE allocation_id = $1 FOR UPDATE", a.allocation_id());
  if (!prev.empty() && prev[0][0].as<int64_t>() >= generation) return Ok();  // older news
  std::vector<std::string> keys(a.slot_keys().begin(), a.slot_keys().end());
  std::sort(keys.begin(), keys.end());
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
      a.allocation_id(), a.tenant(), a.node_id(), a.region(), enums::Text(a.shape()),
      enums::Text(a.state()), keys.empty() ? std::string() : keys.front(),
      a.network().expected_ip(), a.vm_ready(), generation);
  auto row = LoadAlloc(tx, a.allocation_id(), false);
  if (Live(row->state) && row->shape == "gpu_slice") {
    for (const auto& want : a.endpoints()) {
      // Asked for at create: reserved once. A failed one is asked for again with exposure.create.
      if (!tx.exec_params("SELECT 1 FROM exposures WHERE allocation_id = $1 AND name = $2",
                          a.allocation_id(), want.name())
               .empty()) {
        continue;
      }
      auto r = Reserve(tx, c, a.allocation_id(), want.name(), want.protocol(), want.port(), false);
      if (r.ok()) continue;
      // Nothing of it exists: a failed exposure says why (the scheduler fails the allocation).
      const auto& err = r.error();
      std::vector<std::string> facts;
      facts.reserve(err.details.size());
      for (const auto& [k, v] : err.details) facts.push_back(fmt::format("{}={}", k, v));
      auto ins = tx.exec_params(
          fmt::format("INSERT INTO exposures (exposure_id, allocation_id, tenant, node_id, "
                      "slot_key, name, protocol, target_port, state, reason, detail) VALUES "
                      "($1::uuid, $2, $3, $4, $5, $6, $7, $8, 'failed', $9, $10) RETURNING {}",
                      kCols),
          ids::NewUuidV7(), a.allocation_id(), a.tenant(), a.node_id(), row->slot_key, want.name(),
          enums::Text(want.protocol()).empty() ? std::string("tcp") : enums::Text(want.protocol()),
          std::clamp(want.port(), 0, 65535), err.reason,
          fmt::format("{} {{{}}}", err.message, fmt::join(facts, ", ")));
      if (auto x = Announce(tx, c, FromRow(ins[0], c)); !x.ok()) return x.error();
    }
    if (row->vm_ready && !row->target_ip.empty() && row->state != "reserved") {
      if (auto s = StartApply(tx, c, *row); !s.ok()) return s.error();
    }
    return Ok();
  }
  if (!Live(row->state)) {
    auto r =
        StartRemove(tx, c, "allocation_id = $1", a.allocation_id(), "allocation " + row->state);
    if (!r.ok()) return r.error();
  }
  return Ok();
}

std::optional<v1::Exposure> FindExposure(pqxx::work& tx, const Context& c, const std::string& id) {
  return Find(tx, c, id, false);
}

Result<v1::Exposure> Remove(pqxx::work& tx, const Context& c, const std::string& exposure_id,
                            const std::string& tenant_scope) {
  // Not locked here: StartRemove locks the node's document first, then the row.
  auto e = Find(tx, c, exposure_id, false);
  if (!e || (!tenant_scope.empty() && e->tenant() != tenant_scope)) {
    return Error::NotFound("exposure_not_found", "no exposure " + exposure_id);
  }
  auto r = StartRemove(tx, c, "exposure_id = $1::uuid", exposure_id, "deleted");
  if (!r.ok()) return r.error();
  if (auto now = Find(tx, c, exposure_id, false)) return *now;
  return *e;
}

Result<v1::AckNodeExposuresResponse> ApplyAck(pqxx::work& tx, const Context& c,
                                              const v1::AckNodeExposuresRequest& req) {
  std::vector<std::string> blockers(req.blockers().begin(), req.blockers().end());
  // What the ack settles, the node reported.
  v1::Principal node;
  node.set_subject("node:" + req.node_id());
  outbox::ActorScope actor(node);
  LockNodeDocument(tx, req.node_id());
  auto acked =
      documents::RecordAck(tx, ExposureDocuments(), req.node_id(), req.version(), blockers);
  if (!acked.ok()) return acked.error();
  v1::AckNodeExposuresResponse resp;
  resp.set_applied_version(acked->applied_version);
  resp.set_latest_version(acked->latest_version);
  // A late ack (a retried request for a version a newer ack overtook) changes nothing: the newer
  // ack already said what the node has; its refusals would fail exposures the node now serves.
  if (req.version() < acked->applied_version) return resp;
  tx.exec_params("UPDATE exposure_acks SET simulated = $2 WHERE node_id = $1", req.node_id(),
                 req.simulated());
  bool refused_any = false;
  for (const auto& f : req.refused()) {
    auto e = Find(tx, c, f.exposure_id(), true);
    if (!e || e->node_id() != req.node_id()) continue;
    if (e->state() != v1::EXPOSURE_STATE_APPLYING && e->state() != v1::EXPOSURE_STATE_ACTIVE &&
        e->state() != v1::EXPOSURE_STATE_DRIFT) {
      continue;
    }
    auto failed = Set(tx, c, e->exposure_id(), v1::EXPOSURE_STATE_FAILED,
                      f.reason().empty() ? std::string("refused_by_node") : f.reason(),
                      fmt::format("node {} refused it: {}", req.node_id(), f.message()));
    if (!failed.ok()) return failed.error();
    FreeEndpoint(tx, *failed);
    refused_any = true;
  }
  std::set<std::string> drifted;
  for (const auto& d : req.drift()) {
    if (c.metrics != nullptr) c.metrics->Drift(d.kind());
    std::optional<v1::Exposure> e;
    if (!d.exposure_id().empty()) e = Find(tx, c, d.exposure_id(), true);
    const bool live =
        e && e->node_id() == req.node_id() &&
        (e->state() == v1::EXPOSURE_STATE_ACTIVE || e->state() == v1::EXPOSURE_STATE_APPLYING ||
         e->state() == v1::EXPOSURE_STATE_DRIFT);
    if (live) {
      drifted.insert(e->exposure_id());
      auto x = Set(tx, c, e->exposure_id(), v1::EXPOSURE_STATE_DRIFT, d.kind(),
                   fmt::format("node {} found and fixed: {}", req.node_id(), d.detail()));
      if (!x.ok()) return x.error();
      continue;
    }
    v1::NodeExposureDrift nd;
    nd.set_node_id(req.node_id());
    nd.set_document_version(req.version());
    *nd.mutable_drift() = d;
    outbox::EventSpec spec;
    spec.nats_subject = "gpuaas.v1.evt.ingress.node.drift";
    spec.source = c.source;
    spec.entity = req.node_id();
    spec.data = &nd;
    if (auto x = outbox::Append(tx, spec); !x.ok()) return x.error();
  }
  if (refused_any) {
    if (auto v = UpdateNodeDocument(tx, req.node_id()); !v.ok()) return v.error();
  }
  if (auto s = Settle(tx, c, req.node_id(), drifted, req.simulated()); !s.ok()) return s.error();
  resp.set_latest_version(documents::Latest(tx, ExposureDocuments(), req.node_id()));
  return resp;
}

}  // namespace gpuaas::ingress
