#include "gpuaas/ipam/ipam_service.hpp"

#include <memory>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/v1/ipam.pb.h"
#include "ipam_handlers.hpp"
#include "ipam_orphans.hpp"

namespace gpuaas::ipam {

namespace {

// The route table: every request subject ipam serves, each answered by one named handler.
void RegisterRoutes(rpc::Server& rpc, const std::shared_ptr<IpamHandlers>& h) {
  rpc.Route("gpuaas.v1.ipam.reservation.reserve", h, &IpamHandlers::Reserve);
  rpc.Route("gpuaas.v1.ipam.reservation.list", h, &IpamHandlers::ListReservations);
  rpc.Route("gpuaas.v1.ipam.reservation.release", h, &IpamHandlers::Release);
  rpc.Route("gpuaas.v1.ipam.reservation.reprovision", h, &IpamHandlers::Reprovision);
  rpc.Route("gpuaas.v1.ipam.orphan.list", h, &IpamHandlers::ListOrphans);
  rpc.Route("gpuaas.v1.ipam.orphan.remove", h, &IpamHandlers::RemoveOrphans);
  rpc.Route("gpuaas.v1.ipam.subnet.set", h, &IpamHandlers::SetSubnet);
  rpc.Route("gpuaas.v1.ipam.node.{node_id}.network.get", h, &IpamHandlers::GetNodeNetwork);
  rpc.Route("gpuaas.v1.ipam.node.{node_id}.network.ack", h, &IpamHandlers::AckNodeNetwork);
  rpc.Route("gpuaas.v1.ipam.lease.list", h, &IpamHandlers::ListLeases);
  rpc.Route("gpuaas.v1.ipam.drift.list", h, &IpamHandlers::ListDrift);
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
    return Error::InvalidArgument(reason::kInvalidConfig,
                                  fmt::format("{} ipam config problem(s)", problems.size()),
                                  problems);
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
  svc_.StartOutboxRelay();
  const std::string source = svc_.source();
  const IpamConfig cfg = cfg_;
  auto& rpc = svc_.Rpc();

  // The projection of inventory first: the handlers check against it.
  InventoryView inv;
  auto nodes = svc_.StartProjection(
      messaging::InventoryEventsStream().name, kInventoryNodeConsumer,
      "gpuaas.v1.evt.inventory.node.>",
      [cfg](pqxx::work& tx, const v1::Event& ev) { return ApplyInventoryNodeEvent(tx, ev, cfg); });
  if (!nodes.ok()) return nodes.error();
  inv.nodes = *nodes;
  auto slots = svc_.StartProjection(
      messaging::InventoryEventsStream().name, kInventorySlotConsumer,
      "gpuaas.v1.evt.inventory.slot.>",
      [](pqxx::work& tx, const v1::Event& ev) { return ApplyInventorySlotEvent(tx, ev); });
  if (!slots.ok()) return slots.error();
  inv.slots = *slots;

  RegisterRoutes(rpc, std::make_shared<IpamHandlers>(svc_.pg(), cfg, source, inv));

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
