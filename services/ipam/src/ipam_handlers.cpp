#include "ipam_handlers.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/v1/ipam.pb.h"
#include "ipam_store.hpp"

namespace gpuaas::ipam {

namespace {

using google::protobuf::util::TimeUtil;

// How long a request may wait for ipam's projection of inventory to catch up: at most this, and
// never past the caller's deadline.
std::chrono::steady_clock::time_point ProjectionDeadline(const rpc::Context& ctx) {
  constexpr int64_t kMaxWaitMs = 5000;
  const int64_t ms = std::min<int64_t>(kMaxWaitMs, std::max<int64_t>(ctx.RemainingMs() - 200, 0));
  return std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
}

constexpr int64_t kDefaultOrphanMinAgeS = 600;

// The deprecated ReprovisionSlotAddressRequest.mac, read only to refuse it.
std::string DeprecatedMac(const v1::ReprovisionSlotAddressRequest& req) {
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
  return req.mac();
#pragma GCC diagnostic pop
}

// ---- reserve ----

// A node with no address handed out yet takes the rules of today (they may have changed since
// the node's row was made); one with reservations only follows the request's region and pool.
void ApplyRulesAtReserve(pqxx::work& tx, const NodeRow& wanted, NodeNet& node) {
  const NodeRow current{node.subnet, node.gateway, node.region, node.pool, node.datapath};
  switch (ChangeAtReserve(current, wanted, HasReservations(tx, node.node_id))) {
    case NodeRowChange::kApplyRules:
      ReplaceNodeSubnet(tx, node.node_id, wanted);
      node.subnet = wanted.subnet;
      node.gateway = wanted.gateway;
      node.datapath = wanted.datapath;
      break;
    case NodeRowChange::kMoveScope:
      SetNodeScope(tx, node.node_id, wanted.region, wanted.pool);
      break;
    case NodeRowChange::kNone:
      break;
  }
}

// The slot's new reservation on the locked node: the lowest free slot address and the MAC the
// slot owns, announced and in a new document version.
Result<v1::ReserveSlotAddressResponse> AssignSlotAddress(pqxx::work& tx, const IpamConfig& cfg,
                                                         const std::string& source,
                                                         const v1::ReserveSlotAddressRequest& req,
                                                         const NodeNet& node, rpc::Context& ctx) {
  const AddressPlan plan = PlanOf(node.subnet, node.gateway, cfg.first_host, cfg.last_host);
  auto ip = PickIp(plan, LoadUsedIps(tx, req.node_id()));
  if (!ip) {
    return Error::Of(Code::kResourceExhausted, reason::kSubnetExhausted,
                     "no free slot address left in the node's management subnet " + node.subnet,
                     {{"node_id", req.node_id()}, {"subnet", node.subnet}});
  }
  auto mac = EnsureMac(tx, req.node_id(), req.slot_key());
  if (!mac.ok()) return mac.error();
  InsertReservation(tx, req.node_id(), req.slot_key(), mac->first, FormatIpv4(*ip));
  v1::ReserveSlotAddressResponse resp;
  *resp.mutable_reservation() = *FindReservation(tx, req.node_id(), req.slot_key());
  resp.set_created(true);
  if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.created", resp.reservation(),
                                   reason::kReserved.str(), source, ctx.traceparent);
      !a.ok()) {
    return a.error();
  }
  if (auto d = UpdateDocument(tx, req.node_id(), cfg); !d.ok()) return d.error();
  ctx.log.Info("slot address reserved", {{"node_id", req.node_id()},
                                         {"slot_key", req.slot_key()},
                                         {"mac", mac->first},
                                         {"mac_source", mac->second},
                                         {"ip", resp.reservation().ip()}});
  return resp;
}

Result<v1::ReserveSlotAddressResponse> ReserveInTx(pqxx::work& tx, const IpamConfig& cfg,
                                                   const std::string& source,
                                                   const v1::ReserveSlotAddressRequest& req,
                                                   rpc::Context& ctx) {
  v1::ReserveSlotAddressResponse resp;
  if (auto existing = FindReservation(tx, req.node_id(), req.slot_key())) {
    *resp.mutable_reservation() = *existing;
    return resp;
  }
  const auto [subnet, gateway] = ResolveSubnet(tx, cfg, req.node_id(), req.region(), req.pool());
  const NodeRow wanted{subnet, gateway, req.region(), req.pool(),
                       ResolveNodeDatapath(tx, cfg, req.node_id(), req.region(), req.pool())};
  InsertNodeSubnet(tx, req.node_id(), wanted);
  // Every change of one node's reservations is serialised on its subnet row.
  auto node = LockNode(tx, req.node_id());
  if (auto existing = FindReservation(tx, req.node_id(), req.slot_key())) {
    *resp.mutable_reservation() = *existing;
    return resp;
  }
  ApplyRulesAtReserve(tx, wanted, *node);
  return AssignSlotAddress(tx, cfg, source, req, *node, ctx);
}

// ---- release, reprovision ----

Result<v1::ReleaseSlotAddressResponse> ReleaseInTx(pqxx::work& tx, const IpamConfig& cfg,
                                                   const std::string& source,
                                                   const v1::ReleaseSlotAddressRequest& req,
                                                   rpc::Context& ctx) {
  v1::ReleaseSlotAddressResponse resp;
  if (!LockNode(tx, req.node_id())) return resp;  // never reserved on: nothing to do
  auto r = FindReservation(tx, req.node_id(), req.slot_key());
  if (!r) {
    auto d = UpdateDocument(tx, req.node_id(), cfg);
    if (!d.ok()) return d.error();
    resp.set_document_version(*d);
    return resp;
  }
  if (!r->allocation_id().empty()) {
    return Error::Of(Code::kFailedPrecondition, reason::kReservationBound,
                     fmt::format("slot {} of {} is bound to allocation {}; release the "
                                 "allocation first",
                                 req.slot_key(), req.node_id(), r->allocation_id()),
                     {{"allocation_id", r->allocation_id()}, {"slot_key", req.slot_key()}});
  }
  DeleteReservation(tx, req.node_id(), req.slot_key());
  r->set_generation(r->generation() + 1);
  SetMacGeneration(tx, req.node_id(), req.slot_key(), r->generation());
  *r->mutable_updated_at() = TimeUtil::GetCurrentTime();
  const std::string why = req.reason().empty() ? reason::kReleased.str() : req.reason();
  if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.released", *r, why, source,
                                   ctx.traceparent);
      !a.ok()) {
    return a.error();
  }
  if (auto x = ResolveDrift(tx, req.node_id(), req.slot_key(), "reservation released", source);
      !x.ok()) {
    return x.error();
  }
  auto d = UpdateDocument(tx, req.node_id(), cfg);
  if (!d.ok()) return d.error();
  resp.set_released(true);
  *resp.mutable_reservation() = *r;
  resp.set_document_version(*d);
  ctx.log.Info(
      "slot address released",
      {{"node_id", req.node_id()}, {"slot_key", req.slot_key()}, {"ip", r->ip()}, {"reason", why}});
  return resp;
}

Result<v1::ReprovisionSlotAddressResponse> ReprovisionInTx(
    pqxx::work& tx, const IpamConfig& cfg, const std::string& source,
    const v1::ReprovisionSlotAddressRequest& req, rpc::Context& ctx) {
  LockNode(tx, req.node_id());
  const auto owned = LockMacAssignment(tx, req.node_id(), req.slot_key());
  if (!owned) {
    return Error::Of(Code::kNotFound, reason::kSlotNotFound,
                     fmt::format("slot {} of {} owns no MAC", req.slot_key(), req.node_id()),
                     {{"node_id", req.node_id()}, {"slot_key", req.slot_key()}});
  }
  auto r = FindReservation(tx, req.node_id(), req.slot_key());
  if (r && !r->allocation_id().empty()) {
    return Error::Of(Code::kFailedPrecondition, reason::kReservationBound,
                     "a slot bound to an allocation keeps its MAC; release the allocation first",
                     {{"allocation_id", r->allocation_id()}, {"slot_key", req.slot_key()}});
  }
  v1::ReprovisionSlotAddressResponse resp;
  resp.set_previous_mac(owned->mac);
  DeleteMacAssignment(tx, req.node_id(), req.slot_key());
  auto mac = ClaimReprovisionedMac(tx, req.node_id(), req.slot_key(), owned->epoch, owned->mac);
  if (!mac.ok()) return mac.error();
  // The re-inserted ownership row keeps the slot's event order.
  SetMacGeneration(tx, req.node_id(), req.slot_key(), owned->generation);
  if (r) {
    SetReservationMac(tx, req.node_id(), req.slot_key(), *mac);
    r = FindReservation(tx, req.node_id(), req.slot_key());
    *resp.mutable_reservation() = *r;
    if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.updated", *r,
                                     reason::kReprovisioned.str(), source, ctx.traceparent);
        !a.ok()) {
      return a.error();
    }
  }
  auto d = UpdateDocument(tx, req.node_id(), cfg);
  if (!d.ok()) return d.error();
  resp.set_document_version(*d);
  ctx.log.Info("slot MAC re-provisioned", {{"node_id", req.node_id()},
                                           {"slot_key", req.slot_key()},
                                           {"previous_mac", owned->mac},
                                           {"mac", *mac},
                                           {"reason", req.reason()}});
  return resp;
}

// ---- subnet.set ----

// The networks already on the hosts of this rule's scope - the platform's, this rule's and those
// of the broader rules that cover the same nodes - against the rule's subnet; then this rule's
// host networks against the management subnets of narrower rules and of nodes already in its
// scope. `node` is the node rule's node row, if ipam reserved on it.
Result<void> CheckHostNetworks(pqxx::work& tx, const IpamConfig& cfg, const SubnetRuleSpec& spec,
                               const std::optional<NodeNet>& node) {
  std::vector<HostNetwork> hosts;
  for (const auto& r : SplitCsv(cfg.reserved_cidrs)) hosts.push_back({r, "ipam.reserved_cidrs"});
  for (const auto& h : spec.host_cidrs) hosts.push_back({h, "host_cidrs"});
  const std::string& region = node ? node->region : spec.rule.region;
  const std::string& pool = node ? node->pool : spec.rule.pool;
  for (const auto& broader : BroaderRules(spec.rule.scope, region, pool)) {
    if (auto r = LoadRule(tx, broader.rule)) {
      for (const auto& h : r->host_cidrs) hosts.push_back({h, broader.where});
    }
  }
  if (auto c = CheckHostOverlap(spec.subnet, hosts); !c.ok()) return c;
  if (spec.rule.scope != Scope::kNode && !spec.own_hosts.empty()) {
    return CheckNarrowerOverlap(spec.own_hosts,
                                ListNarrowerSubnets(tx, spec.rule.region, spec.rule.pool));
  }
  return Ok();
}

// The rule as set, and whether that changed it.
v1::SetSubnetResponse RuleResponse(const SubnetRuleSpec& spec,
                                   const std::optional<RuleRow>& before) {
  const std::string subnet = spec.subnet.ToString();
  const std::string gateway = FormatIpv4(spec.gateway);
  v1::SetSubnetResponse resp;
  resp.set_changed(!before || before->subnet != subnet || before->gateway != gateway ||
                   before->host_cidrs != spec.host_cidrs || before->datapath != spec.datapath);
  auto* rule = resp.mutable_rule();
  rule->set_scope(std::string(ScopeText(spec.rule.scope)));
  rule->set_region(spec.rule.region);
  rule->set_pool(spec.rule.pool);
  rule->set_node_id(spec.rule.node_id);
  rule->set_subnet(subnet);
  rule->set_gateway(gateway);
  for (const auto& h : spec.host_cidrs) rule->add_host_cidrs(h);
  rule->set_datapath(spec.datapath.datapath);
  rule->set_bridge(spec.datapath.bridge);
  *rule->mutable_updated_at() = TimeUtil::GetCurrentTime();
  return resp;
}

// A node rule moves its node at once: the subnet, the datapath where the rule chooses one (or
// stops choosing one), and a new document version when the content changed.
Result<int64_t> MoveNodeToRule(pqxx::work& tx, const IpamConfig& cfg, const SubnetRuleSpec& spec,
                               const std::optional<RuleRow>& before, const NodeNet& node) {
  SetNodeSubnet(tx, node.node_id, spec.subnet.ToString(), FormatIpv4(spec.gateway));
  const auto chosen_before = before ? std::optional<Datapath>(before->datapath) : std::nullopt;
  if (NodeRuleMovesDatapath(chosen_before, spec.datapath)) {
    SetNodeDatapath(tx, node.node_id,
                    ResolveNodeDatapath(tx, cfg, node.node_id, node.region, node.pool));
  }
  return UpdateDocument(tx, node.node_id, cfg);
}

Result<v1::SetSubnetResponse> SetSubnetInTx(pqxx::work& tx, const IpamConfig& cfg,
                                            const SubnetRuleSpec& spec, rpc::Context& ctx) {
  std::optional<NodeNet> node;
  int64_t reserved = 0;
  if (spec.rule.scope == Scope::kNode) {
    node = LockNode(tx, spec.rule.node_id);
    reserved = CountReservations(tx, spec.rule.node_id);
  }
  const AddressPlan plan{spec.subnet, spec.gateway, cfg.first_host, cfg.last_host};
  if (auto c = CheckSubnetCapacity(plan, std::max(cfg.slots_per_node, reserved)); !c.ok()) {
    return c.error();
  }
  if (auto c = CheckHostNetworks(tx, cfg, spec, node); !c.ok()) return c.error();
  if (node) {
    if (auto c = CheckReservationsFit(plan, spec.rule.node_id,
                                      ListReservedAddresses(tx, spec.rule.node_id));
        !c.ok()) {
      return c.error();
    }
  }
  const auto before = LoadRule(tx, spec.rule);
  UpsertRule(tx, spec.rule, spec.subnet.ToString(), FormatIpv4(spec.gateway), spec.host_cidrs,
             spec.datapath);
  v1::SetSubnetResponse resp = RuleResponse(spec, before);
  if (node) {
    auto d = MoveNodeToRule(tx, cfg, spec, before, *node);
    if (!d.ok()) return d.error();
    resp.set_document_version(*d);
  }
  if (resp.changed()) {
    ctx.log.Info("subnet rule set", {{"scope", std::string(ScopeText(spec.rule.scope))},
                                     {"region", spec.rule.region},
                                     {"pool", spec.rule.pool},
                                     {"node_id", spec.rule.node_id},
                                     {"subnet", spec.subnet.ToString()},
                                     {"datapath", enums::Text(spec.datapath.datapath)},
                                     {"bridge", spec.datapath.bridge}});
  }
  return resp;
}

}  // namespace

IpamHandlers::IpamHandlers(std::shared_ptr<store::Pool> pool, IpamConfig cfg, std::string source,
                           InventoryView inv)
    : pool_(std::move(pool)), cfg_(std::move(cfg)), source_(std::move(source)), inv_(inv) {}

Result<v1::ReserveSlotAddressResponse> IpamHandlers::Reserve(
    const v1::ReserveSlotAddressRequest& req, rpc::Context& ctx) const {
  if (auto v = ValidateReserveRequest(req); !v.ok()) return v.error();
  // Only nodes inventory registered get addresses. The slot is not checked: inventory
  // reserves while it approves a candidate, before it announces the slot.
  if (auto k = RequireKnown(*pool_, inv_, req.node_id(), "", {Code::kFailedPrecondition, true},
                            ProjectionDeadline(ctx));
      !k.ok()) {
    return k.error();
  }
  return store::WithTx(*pool_,
                       [&](pqxx::work& tx) { return ReserveInTx(tx, cfg_, source_, req, ctx); });
}

Result<v1::ListReservationsResponse> IpamHandlers::ListReservations(
    const v1::ListReservationsRequest& req, rpc::Context& /*ctx*/) const {
  if (!req.node_id().empty() && !ids::IsNodeId(req.node_id())) {
    return Error::InvalidArgument(reason::kInvalidNodeId, "node_id must be a lowercase DNS label",
                                  {{"node_id", "must be a lowercase DNS label"}});
  }
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ListReservationsResponse> {
    v1::ListReservationsResponse resp;
    for (auto& r : ipam::ListReservations(tx, req.node_id())) *resp.add_reservations() = r;
    return resp;
  });
}

Result<v1::ReleaseSlotAddressResponse> IpamHandlers::Release(
    const v1::ReleaseSlotAddressRequest& req, rpc::Context& ctx) const {
  if (auto v = ValidateSlotKeys(req.node_id(), req.slot_key(), reason::kInvalidReleaseRequest);
      !v.ok()) {
    return v.error();
  }
  return store::WithTx(*pool_,
                       [&](pqxx::work& tx) { return ReleaseInTx(tx, cfg_, source_, req, ctx); });
}

Result<v1::ReprovisionSlotAddressResponse> IpamHandlers::Reprovision(
    const v1::ReprovisionSlotAddressRequest& req, rpc::Context& ctx) const {
  if (auto v = ValidateSlotKeys(req.node_id(), req.slot_key(), reason::kInvalidReprovisionRequest);
      !v.ok()) {
    return v.error();
  }
  // A MAC is derived or taken from the pool, never chosen by a caller: a chosen one could
  // be any other host's on the L2 domain.
  if (!DeprecatedMac(req).empty()) {
    return Error::InvalidArgument(
        reason::kMacNotAllowed,
        "a slot's MAC is derived or taken from ipam's pool; leave mac empty",
        {{"mac", "must be empty (deprecated)"}});
  }
  if (auto k = RequireKnown(*pool_, inv_, req.node_id(), req.slot_key(), {Code::kNotFound, false},
                            ProjectionDeadline(ctx));
      !k.ok()) {
    return k.error();
  }
  return store::WithTx(
      *pool_, [&](pqxx::work& tx) { return ReprovisionInTx(tx, cfg_, source_, req, ctx); });
}

Result<v1::ListOrphansResponse> IpamHandlers::ListOrphans(const v1::ListOrphansRequest& req,
                                                          rpc::Context& /*ctx*/) const {
  const int64_t min_age = req.has_min_age_seconds() ? req.min_age_seconds() : kDefaultOrphanMinAgeS;
  if (min_age < 0) {
    return Error::InvalidArgument(reason::kInvalidMinAge, "min_age_seconds must be >= 0",
                                  {{"min_age_seconds", "must be >= 0"}});
  }
  if (auto c = RequireCaughtUp(inv_); !c.ok()) return c.error();
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ListOrphansResponse> {
    v1::ListOrphansResponse resp;
    for (auto& o : FindOrphans(tx, min_age, "")) *resp.add_orphans() = std::move(o);
    return resp;
  });
}

Result<v1::RemoveOrphansResponse> IpamHandlers::RemoveOrphans(const v1::RemoveOrphansRequest& req,
                                                              rpc::Context& ctx) const {
  const int64_t min_age = req.has_min_age_seconds() ? req.min_age_seconds() : kDefaultOrphanMinAgeS;
  std::map<std::string, std::string> problems;
  if (min_age < 0) problems["min_age_seconds"] = "must be >= 0";
  if (!req.node_id().empty() && !ids::IsNodeId(req.node_id())) {
    problems["node_id"] = "must be a lowercase DNS label";
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidOrphanRequest, "invalid field(s)", problems);
  }
  if (auto c = RequireCaughtUp(inv_); !c.ok()) return c.error();
  // Nodes one at a time, each judged again under its lock: a reservation made or bound
  // meanwhile is not an orphan any more.
  auto candidates = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<std::set<std::string>> {
    std::set<std::string> out;
    for (const auto& o : FindOrphans(tx, min_age, req.node_id())) out.insert(o.node_id());
    return out;
  });
  if (!candidates.ok()) return candidates.error();
  v1::RemoveOrphansResponse resp;
  for (const auto& node : *candidates) {
    auto removed =
        store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<std::vector<v1::IpamOrphan>> {
          LockNode(tx, node);
          auto found = FindOrphans(tx, min_age, node);
          for (const auto& o : found) {
            if (auto r = RemoveOrphan(tx, o, cfg_, source_, ctx.traceparent); !r.ok()) {
              return r.error();
            }
          }
          return found;
        });
    if (!removed.ok()) return removed.error();
    for (auto& o : *removed) {
      ctx.log.Info("ipam orphan removed", {{"node_id", o.node_id()},
                                           {"slot_key", o.slot_key()},
                                           {"orphan_reason", enums::Text(o.reason())},
                                           {"mac", o.mac()},
                                           {"ip", o.ip()},
                                           {"reason", req.reason()}});
      *resp.add_removed() = std::move(o);
    }
  }
  return resp;
}

Result<v1::SetSubnetResponse> IpamHandlers::SetSubnet(const v1::SetSubnetRequest& req,
                                                      rpc::Context& ctx) const {
  auto spec = ParseSubnetRule(req);
  if (!spec.ok()) return spec.error();
  return store::WithTx(*pool_, [&](pqxx::work& tx) { return SetSubnetInTx(tx, cfg_, *spec, ctx); });
}

Result<v1::GetNodeNetworkResponse> IpamHandlers::GetNodeNetwork(
    const v1::GetNodeNetworkRequest& req, rpc::Context& /*ctx*/) const {
  if (auto v = CheckNodeId(req.node_id(), reason::kInvalidNodeId); !v.ok()) return v.error();
  if (req.version() < 0) {
    return Error::InvalidArgument(reason::kInvalidVersion, "version must be >= 0 (0 = latest)",
                                  {{"version", "must be >= 0"}});
  }
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::GetNodeNetworkResponse> {
    v1::GetNodeNetworkResponse resp;
    auto latest = documents::Load(tx, NetworkDocumentTables(), req.node_id(), req.version(),
                                  *resp.mutable_document());
    if (!latest.ok()) return latest.error();
    resp.set_latest_version(*latest);
    if (*latest == 0) resp.mutable_document()->set_node_id(req.node_id());
    const auto ack = documents::LoadAck(tx, NetworkDocumentTables(), req.node_id());
    if (ack.acked_at) {
      resp.set_applied_version(ack.applied_version);
      for (const auto& b : ack.blockers) resp.add_blockers(b);
      *resp.mutable_acked_at() = *ack.acked_at;
    }
    return resp;
  });
}

Result<v1::AckNodeNetworkResponse> IpamHandlers::AckNodeNetwork(
    const v1::AckNodeNetworkRequest& req, rpc::Context& ctx) const {
  if (auto v = CheckNodeId(req.node_id(), reason::kInvalidNodeId); !v.ok()) return v.error();
  const std::vector<std::string> blockers(req.blockers().begin(), req.blockers().end());
  if (auto v = documents::ValidateAck(req.version(), blockers); !v.ok()) return v.error();
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::AckNodeNetworkResponse> {
    auto r =
        documents::RecordAck(tx, NetworkDocumentTables(), req.node_id(), req.version(), blockers);
    if (!r.ok()) return r.error();
    v1::AckNodeNetworkResponse resp;
    resp.set_applied_version(r->applied_version);
    resp.set_latest_version(r->latest_version);
    for (const auto& b : r->blockers) resp.add_blockers(b);
    ctx.log.Debug("network document acked",
                  {{"node_id", req.node_id()}, {"version", std::to_string(req.version())}});
    return resp;
  });
}

Result<v1::ListLeasesResponse> IpamHandlers::ListLeases(const v1::ListLeasesRequest& req,
                                                        rpc::Context& /*ctx*/) const {
  if (auto v = CheckNodeId(req.node_id(), reason::kInvalidNodeId); !v.ok()) return v.error();
  return store::WithTx(*pool_, [&](pqxx::work& tx) { return LoadLeases(tx, req.node_id()); });
}

Result<v1::ListDriftResponse> IpamHandlers::ListDrift(const v1::ListDriftRequest& req,
                                                      rpc::Context& /*ctx*/) const {
  if (auto v = CheckNodeId(req.node_id(), reason::kInvalidNodeId); !v.ok()) return v.error();
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ListDriftResponse> {
    v1::ListDriftResponse resp;
    for (auto& d : ipam::ListDrift(tx, req.node_id(), req.include_resolved())) {
      *resp.add_drift() = d;
    }
    return resp;
  });
}

}  // namespace gpuaas::ipam
