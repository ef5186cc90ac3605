#include "ipam_service.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/ipam.pb.h"
#include "ipam_domain.hpp"
#include "ipam_orphans.hpp"
#include "ipam_store.hpp"

namespace gpuaas::ipam {

namespace {

using google::protobuf::util::TimeUtil;

std::vector<std::string> SplitCsv(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

Result<void> CheckNodeId(const std::string& id, const std::string& reason) {
  if (id.empty()) {
    return Error::InvalidArgument(reason, "node_id is required", {{"node_id", "required"}});
  }
  if (!ids::IsNodeId(id)) {
    return Error::InvalidArgument(reason, "node_id must be a lowercase DNS label: '" + id + "'",
                                  {{"node_id", "must be a lowercase DNS label"}});
  }
  return Ok();
}

Result<void> ValidateKeys(const std::string& node_id, const std::string& slot_key,
                          const std::string& reason) {
  std::map<std::string, std::string> problems;
  if (!ids::IsNodeId(node_id)) problems["node_id"] = "must be a lowercase DNS label";
  if (slot_key.empty() || slot_key.size() > 128) problems["slot_key"] = "required, at most 128";
  if (!problems.empty()) return Error::InvalidArgument(reason, "invalid field(s)", problems);
  return Ok();
}

Error SubnetOverlap(const Cidr& subnet, const std::string& other, const std::string& where) {
  return Error::InvalidArgument(
      "subnet_overlap",
      fmt::format("management subnet {} overlaps {} ({}) within one node's scope",
                  subnet.ToString(), other, where),
      {{"subnet", subnet.ToString()}, {"overlaps", other}, {"source", where}});
}

struct RuleRow {
  std::string subnet;
  std::string gateway;
  std::vector<std::string> host_cidrs;
  Datapath datapath;  // UNSPECIFIED / "": inherit
};

std::vector<std::string> TextArray(const pqxx::field& f) {
  std::vector<std::string> out;
  auto parser = f.as_array();
  for (auto e = parser.get_next(); e.first != pqxx::array_parser::done; e = parser.get_next()) {
    if (e.first == pqxx::array_parser::string_value) out.push_back(e.second);
  }
  return out;
}

std::optional<RuleRow> LoadRule(pqxx::work& tx, const std::string& scope, const std::string& region,
                                const std::string& pool, const std::string& node_id) {
  auto r = tx.exec_params(
      "SELECT subnet::text, host(gateway), host_cidrs, datapath, bridge FROM subnet_rules WHERE "
      "scope = $1 AND region = $2 AND pool = $3 AND node_id = $4",
      scope, region, pool, node_id);
  if (r.empty()) return std::nullopt;
  return RuleRow{r[0][0].as<std::string>(),
                 r[0][1].as<std::string>(),
                 TextArray(r[0][2]),
                 {enums::FromColumn<v1::NetworkDatapath>(r[0][3].as<std::string>()),
                  r[0][4].as<std::string>()}};
}

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

// The subnet a node gets: node rule, then pool rule, then region rule, then the default.
std::pair<std::string, std::string> ResolveSubnet(pqxx::work& tx, const IpamConfig& cfg,
                                                  const std::string& node_id,
                                                  const std::string& region,
                                                  const std::string& pool) {
  if (auto r = LoadRule(tx, "node", "", "", node_id)) return {r->subnet, r->gateway};
  if (!region.empty() && !pool.empty()) {
    if (auto r = LoadRule(tx, "pool", region, pool, "")) return {r->subnet, r->gateway};
  }
  if (!region.empty()) {
    if (auto r = LoadRule(tx, "region", region, "", "")) return {r->subnet, r->gateway};
  }
  auto subnet = ParseCidr(cfg.default_subnet);
  auto gw = ResolveGateway(*subnet, cfg.default_gateway);
  return {subnet->ToString(), FormatIpv4(*gw)};
}

// The datapath a node gets: the most specific of its node, pool and region rules that sets one,
// else the configured one. Chosen independently of the subnet: a node rule that only moves the
// subnet keeps the region's datapath.
Datapath ResolveNodeDatapath(pqxx::work& tx, const IpamConfig& cfg, const std::string& node_id,
                             const std::string& region, const std::string& pool) {
  std::vector<Datapath> rules;
  if (auto r = LoadRule(tx, "node", "", "", node_id)) rules.push_back(r->datapath);
  if (!region.empty() && !pool.empty()) {
    if (auto r = LoadRule(tx, "pool", region, pool, "")) rules.push_back(r->datapath);
  }
  if (!region.empty()) {
    if (auto r = LoadRule(tx, "region", region, "", "")) rules.push_back(r->datapath);
  }
  return ResolveDatapath(rules, cfg.Network());
}

// A subnet rule's datapath and bridge: UNSPECIFIED or a declared value (INVALID_ARGUMENT
// datapath_invalid); a bridge only with a datapath, and a valid interface name (invalid_bridge).
Result<Datapath> ValidateRuleDatapath(const v1::SetSubnetRequest& req) {
  if (req.datapath() != v1::NETWORK_DATAPATH_UNSPECIFIED && enums::Text(req.datapath()).empty()) {
    return enums::InvalidValue("datapath", std::to_string(static_cast<int>(req.datapath())),
                               v1::NetworkDatapath_descriptor());
  }
  if (!req.bridge().empty() && !ValidBridgeName(req.bridge())) {
    return Error::InvalidArgument("invalid_bridge",
                                  "bridge must be 1-15 of [A-Za-z0-9_.-]: '" + req.bridge() + "'",
                                  {{"bridge", "1-15 of [A-Za-z0-9_.-]"}});
  }
  // A bridge name means something only for a datapath: inheriting the datapath but not the
  // bridge could pair an OVS bridge name with a Linux bridge.
  if (!req.bridge().empty() && req.datapath() == v1::NETWORK_DATAPATH_UNSPECIFIED) {
    return Error::InvalidArgument("invalid_bridge", "a bridge is set only with its datapath",
                                  {{"bridge", "requires datapath"}});
  }
  return Datapath{req.datapath(), req.bridge()};
}

AddressPlan PlanOf(const IpamConfig& cfg, const std::string& subnet, const std::string& gateway) {
  AddressPlan p;
  auto c = ParseCidr(subnet, "subnet", 0, 32);
  if (c.ok()) p.subnet = *c;
  p.gateway = ParseIpv4(gateway).value_or(0);
  p.first_host = cfg.first_host;
  p.last_host = cfg.last_host;
  return p;
}

}  // namespace

void IpamConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("ipam.default_subnet", &default_subnet,
        "Management subnet of a node no subnet rule covers (node-local, NAT egress)",
        "10.100.0.0/24", config::NonEmpty());
  s.Add("ipam.default_gateway", &default_gateway,
        "Gateway (bridge address) of the default subnet; empty = its first host", "");
  s.Add("ipam.first_host", &first_host, "First host offset handed to slots (gateway is .1)", 10,
        config::Range(2, 65000));
  s.Add("ipam.last_host", &last_host, "Last host offset handed to slots", 250,
        config::Range(2, 65000));
  s.Add("ipam.slots_per_node", &slots_per_node,
        "Slot addresses every management subnet must offer (subnet_too_small below it)", 8,
        config::Range(1, 4096));
  s.Add("ipam.reserved_cidrs", &reserved_cidrs,
        "Comma-separated networks present on every host (uplink, control plane); no management "
        "subnet may overlap them",
        "");
  s.Add("ipam.datapath", &datapath,
        "Datapath of a node no subnet rule chooses one for: linux-bridge or ovs (Open vSwitch)",
        "linux-bridge", config::OneOf(enums::Texts<v1::NetworkDatapath>()));
  s.Add("ipam.bridge", &bridge,
        "Bridge of the management network for the linux-bridge datapath (unless a rule names one)",
        "gpuaasbr0", config::NonEmpty());
  s.Add("ipam.ovs_bridge", &ovs_bridge,
        "Bridge of the management network for the ovs datapath (unless a rule names one)", "ovsbr0",
        config::NonEmpty());
  s.Add("ipam.masquerade", &masquerade, "Documents ask for MASQUERADE of the subnet (private-nat)",
        true);
  s.Add("ipam.ip_forward", &ip_forward, "Documents ask for net.ipv4.ip_forward=1", true);
  s.Add("ipam.deny_cross_slice", &deny_cross_slice,
        "Documents ask for isolation between slice VMs on the bridge", true);
  s.Add("ipam.lease_readiness_timeout_ms", &lease_readiness_timeout_ms,
        "How long after binding a slot may have no DHCP lease before it is drift", 300000,
        config::Range(0, 86400000));
}

NetworkDefaults IpamConfig::Network() const {
  return {enums::FromColumn<v1::NetworkDatapath>(datapath),
          bridge,
          ovs_bridge,
          masquerade,
          ip_forward,
          deny_cross_slice};
}

Result<void> IpamConfig::Validate() const {
  std::map<std::string, std::string> problems;
  if (first_host > last_host) problems["ipam.first_host"] = "must be <= ipam.last_host";
  auto subnet = ParseCidr(default_subnet, "ipam.default_subnet");
  if (!subnet.ok()) {
    problems["ipam.default_subnet"] = subnet.error().details.begin()->second;
  } else {
    auto gw = ResolveGateway(*subnet, default_gateway);
    if (!gw.ok()) {
      problems["ipam.default_gateway"] = gw.error().details.begin()->second;
    } else if (first_host <= last_host) {
      const int64_t cap = SlotCapacity({*subnet, *gw, first_host, last_host});
      if (cap < slots_per_node) {
        problems["ipam.default_subnet"] =
            fmt::format("offers {} slot addresses, ipam.slots_per_node is {}", cap, slots_per_node);
      }
    }
  }
  const auto reserved = SplitCsv(reserved_cidrs);
  for (const auto& r : reserved) {
    auto c = ParseCidr(r, "ipam.reserved_cidrs", 1, 32);
    if (!c.ok()) {
      problems["ipam.reserved_cidrs"] = c.error().details.begin()->second;
    } else if (subnet.ok() && Overlaps(*c, *subnet)) {
      problems["ipam.default_subnet"] = "overlaps " + r + " of ipam.reserved_cidrs";
    }
  }
  if (!ValidBridgeName(bridge)) problems["ipam.bridge"] = "1-15 of [A-Za-z0-9_.-]";
  if (!ValidBridgeName(ovs_bridge)) problems["ipam.ovs_bridge"] = "1-15 of [A-Za-z0-9_.-]";
  if (!enums::Parse<v1::NetworkDatapath>(datapath)) {
    problems["ipam.datapath"] = "one of " + enums::JoinTexts(v1::NetworkDatapath_descriptor());
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(
        "invalid_config", fmt::format("{} ipam config problem(s)", problems.size()), problems);
  }
  return Ok();
}

std::string LeaseReportSubject(const std::string& node_id) {
  return fmt::format("gpuaas.v1.evt.node.{node_id}.leases", fmt::arg("node_id", node_id));
}

IpamService::IpamService(IpamConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"ipam", &Migrations()}, cfg_.common) {}

Result<void> IpamService::Start() {
  if (auto v = cfg_.Validate(); !v.ok()) return v;
  if (auto r = svc_.Start(); !r.ok()) return r;
  for (const auto& spec : {messaging::IpamEventsStream(), messaging::DeadLetterStream(),
                           messaging::SchedulerEventsStream(), messaging::NodeEventsStream(),
                           messaging::InventoryEventsStream()}) {
    if (auto r = messaging::EnsureStream(*svc_.nats(), spec); !r.ok()) return r;
  }
  svc_.StartOutboxRelay();
  auto pool = svc_.pg();
  const std::string source = svc_.source();
  const IpamConfig cfg = cfg_;
  auto& rpc = svc_.Rpc();

  // The projection of inventory first: the handlers below check against it.
  InventoryView inv;
  auto nodes = svc_.StartProjection(
      messaging::InventoryEventsStream().name, kInventoryNodeConsumer,
      "gpuaas.v1.evt.inventory.node.>",
      [](pqxx::work& tx, const v1::Event& ev) { return ApplyInventoryNodeEvent(tx, ev); });
  if (!nodes.ok()) return nodes.error();
  inv.nodes = *nodes;
  auto slots = svc_.StartProjection(
      messaging::InventoryEventsStream().name, kInventorySlotConsumer,
      "gpuaas.v1.evt.inventory.slot.>",
      [](pqxx::work& tx, const v1::Event& ev) { return ApplyInventorySlotEvent(tx, ev); });
  if (!slots.ok()) return slots.error();
  inv.slots = *slots;

  rpc.Handle<v1::ReserveSlotAddressRequest, v1::ReserveSlotAddressResponse>(
      "gpuaas.v1.ipam.reservation.reserve",
      [pool, source, cfg, inv](const v1::ReserveSlotAddressRequest& req,
                               rpc::Context& ctx) -> Result<v1::ReserveSlotAddressResponse> {
        if (auto v = ValidateKeys(req.node_id(), req.slot_key(), "invalid_reservation_request");
            !v.ok()) {
          return v.error();
        }
        std::map<std::string, std::string> problems;
        if (!req.region().empty() && !ids::IsNodeId(req.region())) {
          problems["region"] = "must be a lowercase DNS label";
        }
        if (req.pool().size() > 63) problems["pool"] = "at most 63 characters";
        if (!req.pool().empty() && req.region().empty()) problems["region"] = "required with pool";
        if (!problems.empty()) {
          return Error::InvalidArgument("invalid_reservation_request", "invalid field(s)",
                                        problems);
        }
        // Only nodes inventory registered get addresses. The slot is not checked: inventory
        // reserves while it approves a candidate, before it announces the slot.
        if (auto k = RequireKnown(*pool, inv, req.node_id(), "", {Code::kFailedPrecondition, true},
                                  ProjectionDeadline(ctx));
            !k.ok()) {
          return k.error();
        }
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ReserveSlotAddressResponse> {
          v1::ReserveSlotAddressResponse resp;
          if (auto existing = FindReservation(tx, req.node_id(), req.slot_key())) {
            *resp.mutable_reservation() = *existing;
            return resp;
          }
          const auto [subnet, gateway] =
              ResolveSubnet(tx, cfg, req.node_id(), req.region(), req.pool());
          const Datapath path =
              ResolveNodeDatapath(tx, cfg, req.node_id(), req.region(), req.pool());
          tx.exec_params(
              "INSERT INTO node_subnets (node_id, subnet, gateway, region, pool, datapath, bridge) "
              "VALUES ($1, $2::cidr, $3::inet, $4, $5, $6, $7) ON CONFLICT (node_id) DO NOTHING",
              req.node_id(), subnet, gateway, req.region(), req.pool(), enums::Text(path.datapath),
              path.bridge);
          // Every change of one node's reservations is serialised on its subnet row.
          auto node = LockNode(tx, req.node_id());
          if (auto existing = FindReservation(tx, req.node_id(), req.slot_key())) {
            *resp.mutable_reservation() = *existing;
            return resp;
          }
          const bool empty = tx.exec_params(
                                   "SELECT 1 FROM slot_reservations WHERE node_id = $1 "
                                   "LIMIT 1",
                                   req.node_id())
                                 .empty();
          const bool moved =
              !req.region().empty() && (node->region != req.region() || node->pool != req.pool());
          if (empty && (node->subnet != subnet || node->gateway != gateway || moved ||
                        node->datapath != path)) {
            // No address handed out yet: the rules of today apply (they may have changed since
            // the node's row was made).
            tx.exec_params(
                "UPDATE node_subnets SET subnet = $2::cidr, gateway = $3::inet, region = $4, "
                "pool = $5, datapath = $6, bridge = $7 WHERE node_id = $1",
                req.node_id(), subnet, gateway, req.region(), req.pool(),
                enums::Text(path.datapath), path.bridge);
            node->subnet = subnet;
            node->gateway = gateway;
            node->datapath = path;
          } else if (moved) {
            tx.exec_params("UPDATE node_subnets SET region = $2, pool = $3 WHERE node_id = $1",
                           req.node_id(), req.region(), req.pool());
          }
          const AddressPlan plan = PlanOf(cfg, node->subnet, node->gateway);
          std::set<uint32_t> used;
          for (const auto& r : tx.exec_params(
                   "SELECT host(ip) FROM slot_reservations WHERE node_id = $1", req.node_id())) {
            if (auto ip = ParseIpv4(r[0].as<std::string>())) used.insert(*ip);
          }
          auto ip = PickIp(plan, used);
          if (!ip) {
            return Error{
                Code::kResourceExhausted,
                "subnet_exhausted",
                "no free slot address left in the node's management subnet " + node->subnet,
                {{"node_id", req.node_id()}, {"subnet", node->subnet}},
                false};
          }
          auto mac = EnsureMac(tx, req.node_id(), req.slot_key());
          if (!mac.ok()) return mac.error();
          tx.exec_params(
              "INSERT INTO slot_reservations (node_id, slot_key, mac, ip, generation) "
              "SELECT $1, $2, $3::macaddr, $4::inet, generation + 1 FROM mac_assignments "
              "WHERE node_id = $1 AND slot_key = $2",
              req.node_id(), req.slot_key(), mac->first, FormatIpv4(*ip));
          *resp.mutable_reservation() = *FindReservation(tx, req.node_id(), req.slot_key());
          resp.set_created(true);
          if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.created",
                                           resp.reservation(), "reserved", source, ctx.traceparent);
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
        });
      });

  rpc.Handle<v1::ListReservationsRequest, v1::ListReservationsResponse>(
      "gpuaas.v1.ipam.reservation.list",
      [pool](const v1::ListReservationsRequest& req,
             rpc::Context&) -> Result<v1::ListReservationsResponse> {
        if (!req.node_id().empty() && !ids::IsNodeId(req.node_id())) {
          return Error::InvalidArgument("invalid_node_id", "node_id must be a lowercase DNS label",
                                        {{"node_id", "must be a lowercase DNS label"}});
        }
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ListReservationsResponse> {
          v1::ListReservationsResponse resp;
          for (auto& r : ListReservations(tx, req.node_id())) *resp.add_reservations() = r;
          return resp;
        });
      });

  rpc.Handle<v1::ReleaseSlotAddressRequest, v1::ReleaseSlotAddressResponse>(
      "gpuaas.v1.ipam.reservation.release",
      [pool, source, cfg](const v1::ReleaseSlotAddressRequest& req,
                          rpc::Context& ctx) -> Result<v1::ReleaseSlotAddressResponse> {
        if (auto v = ValidateKeys(req.node_id(), req.slot_key(), "invalid_release_request");
            !v.ok()) {
          return v.error();
        }
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ReleaseSlotAddressResponse> {
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
            return Error{Code::kFailedPrecondition,
                         "reservation_bound",
                         fmt::format("slot {} of {} is bound to allocation {}; release the "
                                     "allocation first",
                                     req.slot_key(), req.node_id(), r->allocation_id()),
                         {{"allocation_id", r->allocation_id()}, {"slot_key", req.slot_key()}},
                         false};
          }
          tx.exec_params("DELETE FROM slot_reservations WHERE node_id = $1 AND slot_key = $2",
                         req.node_id(), req.slot_key());
          r->set_generation(r->generation() + 1);
          tx.exec_params(
              "UPDATE mac_assignments SET generation = $3 WHERE node_id = $1 AND slot_key = $2",
              req.node_id(), req.slot_key(), r->generation());
          *r->mutable_updated_at() = TimeUtil::GetCurrentTime();
          const std::string why = req.reason().empty() ? "released" : req.reason();
          if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.released", *r, why,
                                           source, ctx.traceparent);
              !a.ok()) {
            return a.error();
          }
          if (auto x =
                  ResolveDrift(tx, req.node_id(), req.slot_key(), "reservation released", source);
              !x.ok()) {
            return x.error();
          }
          auto d = UpdateDocument(tx, req.node_id(), cfg);
          if (!d.ok()) return d.error();
          resp.set_released(true);
          *resp.mutable_reservation() = *r;
          resp.set_document_version(*d);
          ctx.log.Info("slot address released", {{"node_id", req.node_id()},
                                                 {"slot_key", req.slot_key()},
                                                 {"ip", r->ip()},
                                                 {"reason", why}});
          return resp;
        });
      });

  rpc.Handle<v1::ReprovisionSlotAddressRequest, v1::ReprovisionSlotAddressResponse>(
      "gpuaas.v1.ipam.reservation.reprovision",
      [pool, source, cfg, inv](const v1::ReprovisionSlotAddressRequest& req,
                               rpc::Context& ctx) -> Result<v1::ReprovisionSlotAddressResponse> {
        if (auto v = ValidateKeys(req.node_id(), req.slot_key(), "invalid_reprovision_request");
            !v.ok()) {
          return v.error();
        }
        // A MAC is derived or taken from the pool, never chosen by a caller: a chosen one could
        // be any other host's on the L2 domain.
        if (!DeprecatedMac(req).empty()) {
          return Error::InvalidArgument(
              "mac_not_allowed",
              "a slot's MAC is derived or taken from ipam's pool; leave mac empty",
              {{"mac", "must be empty (deprecated)"}});
        }
        if (auto k = RequireKnown(*pool, inv, req.node_id(), req.slot_key(),
                                  {Code::kNotFound, false}, ProjectionDeadline(ctx));
            !k.ok()) {
          return k.error();
        }
        return store::WithTx(
            *pool, [&](pqxx::work& tx) -> Result<v1::ReprovisionSlotAddressResponse> {
              LockNode(tx, req.node_id());
              auto owned = tx.exec_params(
                  "SELECT mac::text, epoch, generation FROM mac_assignments WHERE node_id = $1 "
                  "AND slot_key = $2 FOR UPDATE",
                  req.node_id(), req.slot_key());
              if (owned.empty()) {
                return Error{
                    Code::kNotFound,
                    "slot_not_found",
                    fmt::format("slot {} of {} owns no MAC", req.slot_key(), req.node_id()),
                    {{"node_id", req.node_id()}, {"slot_key", req.slot_key()}},
                    false};
              }
              const std::string old = owned[0][0].as<std::string>();
              const int epoch = owned[0][1].as<int>();
              const int64_t released_generation = owned[0][2].as<int64_t>();
              auto r = FindReservation(tx, req.node_id(), req.slot_key());
              if (r && !r->allocation_id().empty()) {
                return Error{
                    Code::kFailedPrecondition,
                    "reservation_bound",
                    "a slot bound to an allocation keeps its MAC; release the allocation first",
                    {{"allocation_id", r->allocation_id()}, {"slot_key", req.slot_key()}},
                    false};
              }
              v1::ReprovisionSlotAddressResponse resp;
              resp.set_previous_mac(old);
              tx.exec_params("DELETE FROM mac_assignments WHERE node_id = $1 AND slot_key = $2",
                             req.node_id(), req.slot_key());
              std::string mac;
              for (int e = epoch + 1; e <= epoch + 8 && mac.empty(); ++e) {
                const auto candidate = DeterministicMac(req.node_id(), req.slot_key(), e);
                if (candidate != old &&
                    ClaimMac(tx, req.node_id(), req.slot_key(), candidate, "derived", e)) {
                  mac = candidate;
                }
              }
              if (mac.empty()) {
                auto p = ClaimPoolMac(tx, req.node_id(), req.slot_key(), epoch + 1);
                if (!p.ok()) return p.error();
                mac = *p;
              }
              // The re-inserted ownership row keeps the slot's event order.
              tx.exec_params(
                  "UPDATE mac_assignments SET generation = $3 WHERE node_id = $1 AND slot_key = $2",
                  req.node_id(), req.slot_key(), released_generation);
              if (r) {
                tx.exec_params(
                    "UPDATE slot_reservations SET mac = $3::macaddr, generation = generation + 1, "
                    "updated_at = now() WHERE node_id = $1 AND slot_key = $2",
                    req.node_id(), req.slot_key(), mac);
                r = FindReservation(tx, req.node_id(), req.slot_key());
                *resp.mutable_reservation() = *r;
                if (auto a = AnnounceReservation(tx, "gpuaas.v1.evt.ipam.reservation.updated", *r,
                                                 "reprovisioned", source, ctx.traceparent);
                    !a.ok()) {
                  return a.error();
                }
              }
              auto d = UpdateDocument(tx, req.node_id(), cfg);
              if (!d.ok()) return d.error();
              resp.set_document_version(*d);
              ctx.log.Info("slot MAC re-provisioned", {{"node_id", req.node_id()},
                                                       {"slot_key", req.slot_key()},
                                                       {"previous_mac", old},
                                                       {"mac", mac},
                                                       {"reason", req.reason()}});
              return resp;
            });
      });

  rpc.Handle<v1::ListOrphansRequest, v1::ListOrphansResponse>(
      "gpuaas.v1.ipam.orphan.list",
      [pool, inv](const v1::ListOrphansRequest& req,
                  rpc::Context&) -> Result<v1::ListOrphansResponse> {
        const int64_t min_age =
            req.has_min_age_seconds() ? req.min_age_seconds() : kDefaultOrphanMinAgeS;
        if (min_age < 0) {
          return Error::InvalidArgument("invalid_min_age", "min_age_seconds must be >= 0",
                                        {{"min_age_seconds", "must be >= 0"}});
        }
        if (auto c = RequireCaughtUp(inv); !c.ok()) return c.error();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ListOrphansResponse> {
          v1::ListOrphansResponse resp;
          for (auto& o : FindOrphans(tx, min_age, "")) *resp.add_orphans() = std::move(o);
          return resp;
        });
      });

  rpc.Handle<v1::RemoveOrphansRequest, v1::RemoveOrphansResponse>(
      "gpuaas.v1.ipam.orphan.remove",
      [pool, source, cfg, inv](const v1::RemoveOrphansRequest& req,
                               rpc::Context& ctx) -> Result<v1::RemoveOrphansResponse> {
        const int64_t min_age =
            req.has_min_age_seconds() ? req.min_age_seconds() : kDefaultOrphanMinAgeS;
        std::map<std::string, std::string> problems;
        if (min_age < 0) problems["min_age_seconds"] = "must be >= 0";
        if (!req.node_id().empty() && !ids::IsNodeId(req.node_id())) {
          problems["node_id"] = "must be a lowercase DNS label";
        }
        if (!problems.empty()) {
          return Error::InvalidArgument("invalid_orphan_request", "invalid field(s)", problems);
        }
        if (auto c = RequireCaughtUp(inv); !c.ok()) return c.error();
        // Nodes one at a time, each judged again under its lock: a reservation made or bound
        // meanwhile is not an orphan any more.
        auto candidates =
            store::WithTx(*pool, [&](pqxx::work& tx) -> Result<std::set<std::string>> {
              std::set<std::string> out;
              for (const auto& o : FindOrphans(tx, min_age, req.node_id())) out.insert(o.node_id());
              return out;
            });
        if (!candidates.ok()) return candidates.error();
        v1::RemoveOrphansResponse resp;
        for (const auto& node : *candidates) {
          auto removed =
              store::WithTx(*pool, [&](pqxx::work& tx) -> Result<std::vector<v1::IpamOrphan>> {
                LockNode(tx, node);
                auto found = FindOrphans(tx, min_age, node);
                for (const auto& o : found) {
                  if (auto r = RemoveOrphan(tx, o, cfg, source, ctx.traceparent); !r.ok()) {
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
      });

  rpc.Handle<v1::SetSubnetRequest, v1::SetSubnetResponse>(
      "gpuaas.v1.ipam.subnet.set",
      [pool, cfg](const v1::SetSubnetRequest& req,
                  rpc::Context& ctx) -> Result<v1::SetSubnetResponse> {
        std::string scope;
        if (!req.node_id().empty()) {
          if (!req.region().empty() || !req.pool().empty()) {
            return Error::InvalidArgument("invalid_scope",
                                          "a node rule names only node_id (not region or pool)",
                                          {{"scope", "node_id alone, region+pool, or region"}});
          }
          if (auto v = CheckNodeId(req.node_id(), "invalid_scope"); !v.ok()) return v.error();
          scope = "node";
        } else if (!req.pool().empty()) {
          if (req.region().empty()) {
            return Error::InvalidArgument("invalid_scope", "a pool rule needs its region",
                                          {{"region", "required with pool"}});
          }
          scope = "pool";
        } else if (!req.region().empty()) {
          scope = "region";
        } else {
          return Error::InvalidArgument("invalid_scope", "name a region, a region+pool or a node",
                                        {{"scope", "node_id alone, region+pool, or region"}});
        }
        if (!req.region().empty() && !ids::IsNodeId(req.region())) {
          return Error::InvalidArgument("invalid_scope", "region must be a lowercase DNS label",
                                        {{"region", "must be a lowercase DNS label"}});
        }
        if (req.pool().size() > 63) {
          return Error::InvalidArgument("invalid_scope", "pool is at most 63 characters",
                                        {{"pool", "at most 63 characters"}});
        }
        auto subnet = ParseCidr(req.subnet(), "subnet");
        if (!subnet.ok()) return subnet.error();
        auto gw = ResolveGateway(*subnet, req.gateway());
        if (!gw.ok()) return gw.error();
        auto rule_path = ValidateRuleDatapath(req);
        if (!rule_path.ok()) return rule_path.error();
        std::vector<Cidr> own_hosts;
        for (int i = 0; i < req.host_cidrs_size(); ++i) {
          auto h = ParseCidr(req.host_cidrs(i), fmt::format("host_cidrs[{}]", i), 1, 32);
          if (!h.ok()) return h.error();
          own_hosts.push_back(*h);
        }
        const AddressPlan plan{*subnet, *gw, cfg.first_host, cfg.last_host};
        const int64_t capacity = SlotCapacity(plan);
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::SetSubnetResponse> {
          std::optional<NodeNet> node;
          int64_t reserved = 0;
          if (scope == "node") {
            node = LockNode(tx, req.node_id());
            reserved = tx.exec_params("SELECT count(*) FROM slot_reservations WHERE node_id = $1",
                                      req.node_id())[0][0]
                           .as<int64_t>();
          }
          const int64_t required = std::max(cfg.slots_per_node, reserved);
          if (capacity < required) {
            return Error::InvalidArgument(
                "subnet_too_small",
                fmt::format("{} offers {} slot addresses (offsets {}..{}, less network, gateway "
                            "and broadcast); a node needs {}",
                            subnet->ToString(), capacity, cfg.first_host, cfg.last_host, required),
                {{"subnet", subnet->ToString()},
                 {"capacity", std::to_string(capacity)},
                 {"required", std::to_string(required)}});
          }
          // The networks already on the hosts of this scope: the platform's, this rule's and
          // those of the broader rules that cover the same nodes.
          std::vector<std::pair<std::string, std::string>> hosts;  // cidr, where
          for (const auto& r : SplitCsv(cfg.reserved_cidrs)) {
            hosts.emplace_back(r, "ipam.reserved_cidrs");
          }
          for (const auto& h : req.host_cidrs()) hosts.emplace_back(h, "host_cidrs");
          std::string region = req.region(), pl = req.pool();
          if (node) {
            region = node->region;
            pl = node->pool;
          }
          if (scope != "region" && !region.empty()) {
            if (auto r = LoadRule(tx, "region", region, "", "")) {
              for (const auto& h : r->host_cidrs) hosts.emplace_back(h, "region " + region);
            }
          }
          if (scope == "node" && !region.empty() && !pl.empty()) {
            if (auto r = LoadRule(tx, "pool", region, pl, "")) {
              const std::string where = fmt::format("pool {}/{}", region, pl);
              for (const auto& h : r->host_cidrs) hosts.emplace_back(h, where);
            }
          }
          for (const auto& [cidr, where] : hosts) {
            auto c = ParseCidr(cidr, "host_cidrs", 0, 32);
            if (c.ok() && Overlaps(*subnet, *c)) return SubnetOverlap(*subnet, cidr, where);
          }
          // This rule's host networks against the management subnets of narrower rules and of
          // nodes already in its scope.
          if (scope != "node" && !own_hosts.empty()) {
            auto narrower = tx.exec_params(
                "SELECT subnet::text, 'pool rule ' || region || '/' || pool FROM subnet_rules "
                "WHERE scope = 'pool' AND region = $1 AND $2 = '' UNION ALL "
                "SELECT subnet::text, 'node ' || node_id FROM node_subnets WHERE region = $1 AND "
                "($2 = '' OR pool = $2)",
                req.region(), req.pool());
            for (const auto& n : narrower) {
              auto c = ParseCidr(n[0].as<std::string>(), "subnet", 0, 32);
              for (size_t i = 0; i < own_hosts.size(); ++i) {
                if (c.ok() && Overlaps(*c, own_hosts[i])) {
                  return SubnetOverlap(
                      *c, own_hosts[i].ToString(),
                      "host_cidrs of this rule; subnet of " + n[1].as<std::string>());
                }
              }
            }
          }
          if (node) {
            for (const auto& r : tx.exec_params(
                     "SELECT slot_key, host(ip) FROM slot_reservations WHERE node_id = $1 "
                     "ORDER BY ip",
                     req.node_id())) {
              auto ip = ParseIpv4(r[1].as<std::string>());
              if (!ip || !IsSlotAddress(plan, *ip)) {
                return Error{
                    Code::kFailedPrecondition,
                    "subnet_in_use",
                    fmt::format("slot {} holds {}, which is not a slot address of {}; "
                                "release its reservation first",
                                r[0].as<std::string>(), r[1].as<std::string>(), subnet->ToString()),
                    {{"node_id", req.node_id()},
                     {"slot_key", r[0].as<std::string>()},
                     {"ip", r[1].as<std::string>()}},
                    false};
              }
            }
          }
          const auto before = LoadRule(tx, scope, req.region(), req.pool(), req.node_id());
          std::vector<std::string> host_list(req.host_cidrs().begin(), req.host_cidrs().end());
          tx.exec_params(
              "INSERT INTO subnet_rules (scope, region, pool, node_id, subnet, gateway, "
              "host_cidrs, datapath, bridge) VALUES ($1, $2, $3, $4, $5::cidr, $6::inet, "
              "$7::text[], $8, $9) "
              "ON CONFLICT (scope, region, pool, node_id) DO UPDATE SET subnet = EXCLUDED.subnet, "
              "gateway = EXCLUDED.gateway, host_cidrs = EXCLUDED.host_cidrs, "
              "datapath = EXCLUDED.datapath, bridge = EXCLUDED.bridge, updated_at = now()",
              scope, req.region(), req.pool(), req.node_id(), subnet->ToString(), FormatIpv4(*gw),
              store::TextArrayLiteral(host_list), enums::Text(rule_path->datapath),
              rule_path->bridge);
          v1::SetSubnetResponse resp;
          resp.set_changed(!before || before->subnet != subnet->ToString() ||
                           before->gateway != FormatIpv4(*gw) || before->host_cidrs != host_list ||
                           before->datapath != *rule_path);
          auto* rule = resp.mutable_rule();
          rule->set_scope(scope);
          rule->set_region(req.region());
          rule->set_pool(req.pool());
          rule->set_node_id(req.node_id());
          rule->set_subnet(subnet->ToString());
          rule->set_gateway(FormatIpv4(*gw));
          for (const auto& h : host_list) rule->add_host_cidrs(h);
          rule->set_datapath(rule_path->datapath);
          rule->set_bridge(rule_path->bridge);
          *rule->mutable_updated_at() = TimeUtil::GetCurrentTime();
          if (node) {
            tx.exec_params(
                "UPDATE node_subnets SET subnet = $2::cidr, gateway = $3::inet WHERE node_id = $1",
                req.node_id(), subnet->ToString(), FormatIpv4(*gw));
            // A node rule that chooses a datapath, or stops choosing one, moves the node at once;
            // one that never chose keeps the datapath the node got with its first reservation.
            const bool chose =
                before && before->datapath.datapath != v1::NETWORK_DATAPATH_UNSPECIFIED;
            if (rule_path->datapath != v1::NETWORK_DATAPATH_UNSPECIFIED || chose) {
              const Datapath path =
                  ResolveNodeDatapath(tx, cfg, req.node_id(), node->region, node->pool);
              tx.exec_params(
                  "UPDATE node_subnets SET datapath = $2, bridge = $3 WHERE node_id = $1",
                  req.node_id(), enums::Text(path.datapath), path.bridge);
            }
            auto d = UpdateDocument(tx, req.node_id(), cfg);
            if (!d.ok()) return d.error();
            resp.set_document_version(*d);
          }
          if (resp.changed()) {
            ctx.log.Info("subnet rule set", {{"scope", scope},
                                             {"region", req.region()},
                                             {"pool", req.pool()},
                                             {"node_id", req.node_id()},
                                             {"subnet", subnet->ToString()},
                                             {"datapath", enums::Text(rule_path->datapath)},
                                             {"bridge", rule_path->bridge}});
          }
          return resp;
        });
      });

  rpc.Handle<v1::GetNodeNetworkRequest, v1::GetNodeNetworkResponse>(
      "gpuaas.v1.ipam.node.network.get",
      [pool](const v1::GetNodeNetworkRequest& req,
             rpc::Context&) -> Result<v1::GetNodeNetworkResponse> {
        if (auto v = CheckNodeId(req.node_id(), "invalid_node_id"); !v.ok()) return v.error();
        if (req.version() < 0) {
          return Error::InvalidArgument("invalid_version", "version must be >= 0 (0 = latest)",
                                        {{"version", "must be >= 0"}});
        }
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::GetNodeNetworkResponse> {
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
      });

  rpc.Handle<v1::AckNodeNetworkRequest, v1::AckNodeNetworkResponse>(
      "gpuaas.v1.ipam.node.network.ack",
      [pool](const v1::AckNodeNetworkRequest& req,
             rpc::Context& ctx) -> Result<v1::AckNodeNetworkResponse> {
        if (auto v = CheckNodeId(req.node_id(), "invalid_node_id"); !v.ok()) return v.error();
        const std::vector<std::string> blockers(req.blockers().begin(), req.blockers().end());
        if (auto v = documents::ValidateAck(req.version(), blockers); !v.ok()) return v.error();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::AckNodeNetworkResponse> {
          auto r = documents::RecordAck(tx, NetworkDocumentTables(), req.node_id(), req.version(),
                                        blockers);
          if (!r.ok()) return r.error();
          v1::AckNodeNetworkResponse resp;
          resp.set_applied_version(r->applied_version);
          resp.set_latest_version(r->latest_version);
          for (const auto& b : r->blockers) resp.add_blockers(b);
          ctx.log.Debug("network document acked",
                        {{"node_id", req.node_id()}, {"version", std::to_string(req.version())}});
          return resp;
        });
      });

  rpc.Handle<v1::ListLeasesRequest, v1::ListLeasesResponse>(
      "gpuaas.v1.ipam.lease.list",
      [pool](const v1::ListLeasesRequest& req, rpc::Context&) -> Result<v1::ListLeasesResponse> {
        if (auto v = CheckNodeId(req.node_id(), "invalid_node_id"); !v.ok()) return v.error();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ListLeasesResponse> {
          v1::ListLeasesResponse resp;
          auto head = tx.exec_params(
              "SELECT document_version, blockers, (extract(epoch from observed_at) * 1000)::int8 "
              "FROM lease_reports WHERE node_id = $1",
              req.node_id());
          if (head.empty()) return resp;
          resp.set_document_version(head[0][0].as<int64_t>());
          for (const auto& b : TextArray(head[0][1])) resp.add_blockers(b);
          *resp.mutable_observed_at() = TimeUtil::MillisecondsToTimestamp(head[0][2].as<int64_t>());
          for (const auto& r : tx.exec_params(
                   "SELECT doc::text FROM lease_observations WHERE node_id = $1 ORDER BY subject",
                   req.node_id())) {
            if (auto p = protojson::FromJson(r[0].as<std::string>(), resp.add_leases()); !p.ok()) {
              return Error::Internal("corrupt_lease", p.error().message);
            }
          }
          return resp;
        });
      });

  rpc.Handle<v1::ListDriftRequest, v1::ListDriftResponse>(
      "gpuaas.v1.ipam.drift.list",
      [pool](const v1::ListDriftRequest& req, rpc::Context&) -> Result<v1::ListDriftResponse> {
        if (auto v = CheckNodeId(req.node_id(), "invalid_node_id"); !v.ok()) return v.error();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ListDriftResponse> {
          v1::ListDriftResponse resp;
          for (auto& d : ListDrift(tx, req.node_id(), req.include_resolved())) {
            *resp.add_drift() = d;
          }
          return resp;
        });
      });

  auto c1 = svc_.StartProjection(messaging::SchedulerEventsStream().name, kAllocationConsumer,
                                 "gpuaas.v1.evt.scheduler.allocation.>",
                                 [cfg, source](pqxx::work& tx, const v1::Event& ev) {
                                   return ApplyAllocationEvent(tx, ev, cfg, source);
                                 });
  if (!c1.ok()) return c1.error();
  auto c2 = svc_.StartProjection(messaging::NodeEventsStream().name, kLeaseConsumer,
                                 "gpuaas.v1.evt.node.*.leases",
                                 [cfg, source](pqxx::work& tx, const v1::Event& ev) {
                                   return ApplyLeaseEvent(tx, ev, cfg, source);
                                 });
  if (!c2.ok()) return c2.error();
  return svc_.ServeRequests();
}

}  // namespace gpuaas::ipam
