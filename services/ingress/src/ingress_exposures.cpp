// Exposures: reservation against the pools, the node's exposure document, the agent's acks and
// the allocation events that drive them. Every function runs in the caller's transaction; every
// state change is announced through the outbox in that transaction. The SQL is in
// ingress_store.cpp.
#include <algorithm>
#include <map>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/allocation_event.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/ingress/ingress_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "ingress_domain.hpp"
#include "ingress_metrics.hpp"
#include "ingress_reasons.hpp"
#include "ingress_store.hpp"

namespace gpuaas::ingress {

namespace {

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
  const double in_state_s = SecondsInState(tx, id);
  const auto prev = LoadExposureState(tx, id);
  auto e = UpdateExposureState(tx, c, id, state, reason, detail, doc_version);
  if (c.metrics != nullptr && prev == v1::EXPOSURE_STATE_APPLYING &&
      state == v1::EXPOSURE_STATE_ACTIVE) {
    c.metrics->Applied(in_state_s);
  }
  if (auto a = Announce(tx, c, e); !a.ok()) return a.error();
  return e;
}

// An allocation that may hold exposures.
bool Live(v1::AllocationState s) {
  return s == v1::ALLOCATION_STATE_RESERVED || s == v1::ALLOCATION_STATE_PROVISIONING ||
         s == v1::ALLOCATION_STATE_ACTIVE;
}

// Its VM is up with an address: its exposures can go to the node.
bool VmUp(const AllocationRow& a) {
  return a.vm_ready && !a.target_ip.empty() && a.state != v1::ALLOCATION_STATE_RESERVED;
}

// Writes the node's next document when its mappings changed; returns the latest version.
Result<int64_t> UpdateNodeDocument(pqxx::work& tx, const std::string& node_id) {
  LockNodeDocument(tx, node_id);
  auto doc = LoadNodeMappings(tx, node_id);
  const bool empty = doc.mappings_size() == 0;
  return documents::Publish(tx, ExposureDocuments(), node_id, doc, empty);
}

// Exposures whose document version the node has acked reach their next state: applying and
// repaired drift -> active, removing -> removed (the endpoint is free again).
Result<void> Settle(pqxx::work& tx, const Context& c, const std::string& node_id,
                    const std::set<std::string>& drifted_now, bool simulated) {
  auto ack = documents::LoadAck(tx, ExposureDocuments(), node_id);
  if (ack.applied_version == 0) return Ok();
  for (const auto& [id, state] : ListExposuresToSettle(tx, node_id, ack.applied_version)) {
    if (state == v1::EXPOSURE_STATE_REMOVING) {
      auto e =
          Set(tx, c, id, v1::EXPOSURE_STATE_REMOVED, "",
              fmt::format("node {} acked document {} without it", node_id, ack.applied_version));
      if (!e.ok()) return e.error();
      FreeEndpoint(tx, *e);
      continue;
    }
    if (state == v1::EXPOSURE_STATE_DRIFT && drifted_now.count(id)) continue;
    const std::string detail =
        simulated ? fmt::format("node {} took document {} (simulated: no kernel rule)", node_id,
                                ack.applied_version)
        : state == v1::EXPOSURE_STATE_DRIFT
            ? fmt::format("node {} reports the rule in place again (document {})", node_id,
                          ack.applied_version)
            : fmt::format("node {} applied document {}", node_id, ack.applied_version);
    if (auto e = Set(tx, c, id, v1::EXPOSURE_STATE_ACTIVE, "", detail); !e.ok()) return e.error();
  }
  return Ok();
}

// The exposures of an allocation that wait for its VM get its address and go to the node.
Result<void> StartApply(pqxx::work& tx, const Context& c, const AllocationRow& a) {
  // The node's document lock before any exposure row lock, as ApplyAck takes them: the other
  // order deadlocks against a concurrent ack.
  LockNodeDocument(tx, a.node);
  const auto ids = MarkRequestedApplying(tx, a.id, a.target_ip, a.slot_key);
  if (ids.empty()) return Ok();
  auto v = UpdateNodeDocument(tx, a.node);
  if (!v.ok()) return v.error();
  for (const auto& id : ids) {
    auto e = Set(tx, c, id, v1::EXPOSURE_STATE_APPLYING, "",
                 fmt::format("in exposure document {} of node {}", *v, a.node), *v);
    if (!e.ok()) return e.error();
  }
  return Settle(tx, c, a.node, {}, false);
}

// Takes exposures off their node: REMOVED at once when they never reached it, else REMOVING
// until the node acks a document without them.
Result<std::vector<v1::Exposure>> StartRemove(pqxx::work& tx, const Context& c,
                                              const ExposureSelection& which,
                                              const std::string& why) {
  std::vector<v1::Exposure> out;
  std::set<std::string> nodes;
  std::vector<std::pair<std::string, std::string>> going;  // (id, node)
  // Node document locks first (see StartApply), in one order.
  for (const auto& node : NodesOfLiveExposures(tx, which)) LockNodeDocument(tx, node);
  for (const auto& x : LockLiveExposures(tx, which)) {
    if (x.state == v1::EXPOSURE_STATE_REQUESTED) {
      auto e = Set(tx, c, x.id, v1::EXPOSURE_STATE_REMOVED, "", why + " (never on the node)");
      if (!e.ok()) return e.error();
      FreeEndpoint(tx, *e);
      out.push_back(*e);
      continue;
    }
    MarkRemoving(tx, x.id);
    nodes.insert(x.node_id);
    going.emplace_back(x.id, x.node_id);
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

// ---- reservation ----

// The allocation, its row locked (requests for one allocation are serialised), when it may
// take an exposure.
Result<AllocationRow> LockExposableAllocation(pqxx::work& tx, const std::string& allocation_id) {
  auto a = LockAllocation(tx, allocation_id);
  if (!a) {
    return Error::NotFound(reason::kAllocationNotFound,
                           "ingress has not seen allocation " + allocation_id);
  }
  if (a->shape == v1::CAPACITY_SHAPE_BAREMETAL) {
    return Error::FailedPrecondition(reason::kExposureNotForBaremetal,
                                     "a bare-metal node has its own public addresses; ingress "
                                     "exposes slice VMs only");
  }
  if (!Live(a->state)) {
    return Error::FailedPrecondition(
        reason::kAllocationNotLive,
        fmt::format("allocation {} is {}", a->id, enums::Text(a->state)));
  }
  return *a;
}

// A live exposure of the allocation asking for the same endpoint: itself when it is the same
// ask (name and (protocol, port)), else FAILED_PRECONDITION endpoint_exists; nullopt when none.
Result<std::optional<v1::Exposure>> FindSameEndpoint(pqxx::work& tx, const Context& c,
                                                     const AllocationRow& a,
                                                     const std::string& name,
                                                     v1::TransportProtocol protocol, int32_t port) {
  auto e = FindLiveExposureLike(tx, c, a.id, name, enums::Text(protocol), port);
  if (!e) return std::optional<v1::Exposure>();
  if (e->name() == name && e->protocol() == protocol && e->target_port() == port) {
    return std::optional<v1::Exposure>(*e);
  }
  Error err = Error::FailedPrecondition(
      reason::kEndpointExists,
      fmt::format("allocation {} already exposes {} ({}/{})", a.id, e->name(), e->target_port(),
                  enums::Text(e->protocol())));
  err.details = {{"exposure_id", e->exposure_id()}, {"name", e->name()}};
  return err;
}

Result<void> CheckEndpointCount(pqxx::work& tx, const Context& c, const AllocationRow& a) {
  const auto live = CountLiveExposures(tx, a.id);
  if (live >= c.cfg.max_endpoints_per_allocation) {
    return Error::FailedPrecondition(
        reason::kTooManyEndpoints,
        fmt::format("allocation {} already exposes {} endpoints (at most {})", a.id, live,
                    c.cfg.max_endpoints_per_allocation));
  }
  return Ok();
}

// The counts are read after the pool rows are locked: a count in the locking statement itself
// can predate a reservation that committed while it waited for the lock.
Error Exhausted(pqxx::work& tx, const AllocationRow& a,
                const std::vector<v1::EndpointPool>& pools) {
  int64_t total = 0;
  std::vector<std::string> names;
  names.reserve(pools.size());
  for (const auto& p : pools) {
    total += PoolCapacity(p);
    names.push_back(p.name());
  }
  const auto used = CountLeasesOfPools(tx, names);
  return Error::Of(Code::kResourceExhausted, reason::kPoolExhausted,
                   fmt::format("every endpoint of the pools serving node {} in region {} is taken "
                               "({} of {} used)",
                               a.node, a.region, used, total),
                   {{"region", a.region},
                    {"node_id", a.node},
                    {"pools", fmt::format("{}", fmt::join(names, ","))},
                    {"total", std::to_string(total)},
                    {"used", std::to_string(used)},
                    {"requested", "1"}},
                   /*retryable=*/true);
}

// A public endpoint leased for a new exposure.
struct Leased {
  std::string exposure_id;
  std::string pool;
  std::string address;
  int32_t public_port = 0;
};

// Leases an endpoint of one pool for (target) `port`: its lowest free port (port_range), or its
// first free address (public_ip, public port = target port); nullopt when it has none.
std::optional<Leased> LeaseFromPool(pqxx::work& tx, const v1::EndpointPool& p,
                                    const AllocationRow& a, int32_t port, const std::string& id) {
  if (p.kind() == v1::ENDPOINT_POOL_KIND_PORT_RANGE) {
    auto free = FindLowestFreePort(tx, p.addresses(0), p.port_min(), p.port_max());
    if (!free) return std::nullopt;
    Leased l{id, p.name(), p.addresses(0), *free};
    LeasePort(tx, l.pool, l.address, l.public_port, a.id, id);
    return l;
  }
  auto free = FindFirstFreeAddress(tx, p);
  if (!free) return std::nullopt;
  Leased l{id, p.name(), *free, port};
  LeaseAddress(tx, l.pool, l.address, a.id);
  return l;
}

// The pools that serve the node, locked: reservations from one pool are serialised. An
// allocation that already holds a public address keeps using it; otherwise the first pool
// with a free endpoint leases one.
Result<Leased> LeaseEndpoint(pqxx::work& tx, const AllocationRow& a, int32_t port) {
  const auto pools = LockPoolsServingNode(tx, a.region, a.node);
  if (pools.empty()) {
    return Error::Of(Code::kResourceExhausted, reason::kNoPool,
                     fmt::format("no endpoint pool serves node {} in region {} (gpuaasctl "
                                 "ingress pool set)",
                                 a.node, a.region),
                     {{"region", a.region}, {"node_id", a.node}}, /*retryable=*/false);
  }
  auto held = FindHeldPublicAddress(tx, a.id);
  const std::string id = ids::NewUuidV7();
  if (held) return Leased{id, held->pool, held->address, port};
  for (const auto& p : pools) {
    if (auto l = LeaseFromPool(tx, p, a, port, id)) return *l;
  }
  return Exhausted(tx, a, pools);
}

// ---- allocation events ----

// Writes the event's allocation into the projection and returns the row as it is now; nullopt
// when the projection has seen a newer generation (older news).
std::optional<AllocationRow> ProjectAllocation(pqxx::work& tx, const v1::Allocation& a,
                                               int64_t generation) {
  const auto seen = LockAllocationGeneration(tx, a.allocation_id());
  if (seen && *seen >= generation) return std::nullopt;
  std::vector<std::string> keys(a.slot_keys().begin(), a.slot_keys().end());
  std::sort(keys.begin(), keys.end());
  AllocationRow row;
  row.id = a.allocation_id();
  row.tenant = a.tenant();
  row.node = a.node_id();
  row.region = a.region();
  row.shape = a.shape();
  row.state = a.state();
  row.slot_key = keys.empty() ? std::string() : keys.front();
  row.target_ip = a.network().expected_ip();
  row.vm_ready = a.vm_ready();
  UpsertAllocation(tx, row, generation);
  return LoadAllocation(tx, a.allocation_id());
}

// Nothing of an endpoint the allocation asked for exists: a failed exposure says why (the
// scheduler fails the allocation).
Result<void> RecordUnreservable(pqxx::work& tx, const Context& c, const v1::Allocation& a,
                                const AllocationRow& row, const v1::AllocationEndpoint& want,
                                const Error& err) {
  std::vector<std::string> facts;
  facts.reserve(err.details.size());
  for (const auto& [k, v] : err.details) facts.push_back(fmt::format("{}={}", k, v));
  NewExposure x;
  x.id = ids::NewUuidV7();
  x.allocation_id = a.allocation_id();
  x.tenant = a.tenant();
  x.node_id = a.node_id();
  x.slot_key = row.slot_key;
  x.name = want.name();
  x.protocol =
      enums::Text(want.protocol()).empty() ? std::string("tcp") : enums::Text(want.protocol());
  x.target_port = std::clamp(want.port(), 0, 65535);
  x.reason = err.reason;
  x.detail = fmt::format("{} {{{}}}", err.message, fmt::join(facts, ", "));
  return Announce(tx, c, InsertFailedExposure(tx, c, x));
}

// Reserves each endpoint the allocation asked for at create, then applies them together (one
// new document version) when its VM is up.
Result<void> ReserveAskedEndpoints(pqxx::work& tx, const Context& c, const v1::Allocation& a,
                                   const AllocationRow& row) {
  for (const auto& want : a.endpoints()) {
    // Asked for at create: reserved once. A failed one is asked for again with exposure.create.
    if (HasExposureNamed(tx, a.allocation_id(), want.name())) continue;
    auto r = Reserve(tx, c, a.allocation_id(), want.name(), want.protocol(), want.port(), false);
    if (r.ok()) continue;
    if (auto f = RecordUnreservable(tx, c, a, row, want, r.error()); !f.ok()) return f;
  }
  if (VmUp(row)) {
    if (auto s = StartApply(tx, c, row); !s.ok()) return s.error();
  }
  return Ok();
}

// ---- acks ----

// The node's refused mappings (of its applying, active or drift exposures) fail and free their
// endpoints; true when any did.
Result<bool> FailRefused(pqxx::work& tx, const Context& c, const v1::AckNodeExposuresRequest& req) {
  bool refused_any = false;
  for (const auto& f : req.refused()) {
    auto e = LockExposure(tx, c, f.exposure_id());
    if (!e || e->node_id() != req.node_id()) continue;
    if (e->state() != v1::EXPOSURE_STATE_APPLYING && e->state() != v1::EXPOSURE_STATE_ACTIVE &&
        e->state() != v1::EXPOSURE_STATE_DRIFT) {
      continue;
    }
    auto failed = Set(tx, c, e->exposure_id(), v1::EXPOSURE_STATE_FAILED,
                      f.reason().empty() ? reason::kRefusedByNode.str() : f.reason(),
                      fmt::format("node {} refused it: {}", req.node_id(), f.message()));
    if (!failed.ok()) return failed.error();
    FreeEndpoint(tx, *failed);
    refused_any = true;
  }
  return refused_any;
}

// Drift of no live exposure of the node (a foreign rule, an exposure it no longer has).
Result<void> AnnounceNodeDrift(pqxx::work& tx, const Context& c,
                               const v1::AckNodeExposuresRequest& req, const v1::ExposureDrift& d) {
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
  return Ok();
}

// Drift the node found and fixed: a live exposure of it goes `drift`, anything else is node
// drift. Returns the exposures that drifted.
Result<std::set<std::string>> MarkDrifted(pqxx::work& tx, const Context& c,
                                          const v1::AckNodeExposuresRequest& req) {
  std::set<std::string> drifted;
  for (const auto& d : req.drift()) {
    if (c.metrics != nullptr) c.metrics->Drift(reason::DriftKind(d.kind()));
    std::optional<v1::Exposure> e;
    if (!d.exposure_id().empty()) e = LockExposure(tx, c, d.exposure_id());
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
    if (auto x = AnnounceNodeDrift(tx, c, req, d); !x.ok()) return x.error();
  }
  return drifted;
}

}  // namespace

Result<Reserved> Reserve(pqxx::work& tx, const Context& c, const std::string& allocation_id,
                         const std::string& name, v1::TransportProtocol protocol, int32_t port,
                         bool apply) {
  if (auto v = ValidateEndpoint(name, protocol, port); !v.ok()) return v.error();
  auto a = LockExposableAllocation(tx, allocation_id);
  if (!a.ok()) return a.error();
  auto same = FindSameEndpoint(tx, c, *a, name, protocol, port);
  if (!same.ok()) return same.error();
  if (*same) return Reserved{**same, false};
  if (auto n = CheckEndpointCount(tx, c, *a); !n.ok()) return n.error();
  auto leased = LeaseEndpoint(tx, *a, port);
  if (!leased.ok()) return leased.error();
  NewExposure x;
  x.id = leased->exposure_id;
  x.allocation_id = a->id;
  x.tenant = a->tenant;
  x.node_id = a->node;
  x.slot_key = a->slot_key;
  x.name = name;
  x.protocol = enums::Text(protocol);
  x.target_port = port;
  x.pool = leased->pool;
  x.public_ip = leased->address;
  x.public_port = leased->public_port;
  x.detail = fmt::format("reserved from pool {}", leased->pool);
  auto e = InsertRequestedExposure(tx, c, x);
  if (auto ann = Announce(tx, c, e); !ann.ok()) return ann.error();
  if (apply && VmUp(*a)) {
    if (auto s = StartApply(tx, c, *a); !s.ok()) return s.error();
    if (auto again = LoadExposure(tx, c, x.id)) e = *again;
  }
  return Reserved{e, true};
}

Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const Context& c) {
  auto read = inbox::ReadAllocationEvent(ev);
  if (!read.ok()) return read.error();
  const auto& a = read->allocation();
  // What this event makes ingress do was asked for by whoever caused it (the allocation's
  // creator, its releaser): the exposure events name them.
  std::optional<outbox::ActorScope> actor;
  if (!ev.actor().subject().empty()) actor.emplace(ev.actor());
  auto row = ProjectAllocation(tx, a, read->generation);
  if (!row) return Ok();  // older news
  if (Live(row->state) && row->shape == v1::CAPACITY_SHAPE_GPU_SLICE) {
    return ReserveAskedEndpoints(tx, c, a, *row);
  }
  if (!Live(row->state)) {
    auto r = StartRemove(tx, c, {ExposureSelection::By::kAllocation, a.allocation_id()},
                         "allocation " + enums::Text(row->state));
    if (!r.ok()) return r.error();
  }
  return Ok();
}

std::optional<v1::Exposure> FindExposure(pqxx::work& tx, const Context& c, const std::string& id) {
  return LoadExposure(tx, c, id);
}

Result<v1::Exposure> Remove(pqxx::work& tx, const Context& c, const std::string& exposure_id,
                            const std::string& tenant_scope) {
  // Not locked here: StartRemove locks the node's document first, then the row.
  auto e = LoadExposure(tx, c, exposure_id);
  if (!e || (!tenant_scope.empty() && e->tenant() != tenant_scope)) {
    return Error::NotFound(reason::kExposureNotFound, "no exposure " + exposure_id);
  }
  auto r = StartRemove(tx, c, {ExposureSelection::By::kExposure, exposure_id}, "deleted");
  if (!r.ok()) return r.error();
  if (auto now = LoadExposure(tx, c, exposure_id)) return *now;
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
  RecordAckSimulated(tx, req.node_id(), req.simulated());
  auto refused_any = FailRefused(tx, c, req);
  if (!refused_any.ok()) return refused_any.error();
  auto drifted = MarkDrifted(tx, c, req);
  if (!drifted.ok()) return drifted.error();
  if (*refused_any) {
    if (auto v = UpdateNodeDocument(tx, req.node_id()); !v.ok()) return v.error();
  }
  if (auto s = Settle(tx, c, req.node_id(), *drifted, req.simulated()); !s.ok()) return s.error();
  resp.set_latest_version(documents::Latest(tx, ExposureDocuments(), req.node_id()));
  return resp;
}

}  // namespace gpuaas::ingress
