// gpuaasctl ipam: reservations, leases, drift and the network document of a node; subnet rules;
// release and admin re-provision of a slot's address; rows no inventory node or slot backs.
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::ctl {

namespace {

void PrintDocument(const v1::GetNodeNetworkResponse& r) {
  const auto& d = r.document();
  if (d.version() == 0) {
    std::cout << fmt::format("node {}: no network document yet (no reservation)\n", d.node_id());
    return;
  }
  std::cout << fmt::format(
      "node {}  document v{} (latest v{})  applied v{}{}\n"
      "datapath {}  bridge {}  subnet {}  gateway {}  masquerade {}  ip_forward {}  "
      "deny_cross_slice {}\n",
      d.node_id(), d.version(), r.latest_version(), r.applied_version(),
      r.applied_version() == 0 ? " (never acked)"
                               : (r.has_acked_at() ? " at " + Time(r.acked_at()) : ""),
      Txt(d.datapath()), d.bridge(), d.subnet(), d.gateway(), d.nat().masquerade() ? "on" : "off",
      d.nat().ip_forward() ? "on" : "off", d.isolation().deny_cross_slice() ? "on" : "off");
  if (d.removed()) {
    std::cout << "removed: true (the node is in bare-metal mode or on its way there: no slice "
                 "network on the host)\n";
  }
  if (r.blockers_size() > 0) {
    std::cout << "blockers: "
              << Join(std::vector<std::string>(r.blockers().begin(), r.blockers().end())) << "\n";
  }
  std::vector<std::vector<std::string>> rows;
  for (const auto& x : d.reservations()) {
    rows.push_back({x.slot_key(), x.mac(), x.ip(), Or(x.hostname()), Or(x.allocation_id())});
  }
  PrintTable({"SLOT", "MAC", "IP", "HOSTNAME", "ALLOCATION"}, rows);
}

// ipam reservations: the MAC/IP reservations of a node.
Action AddIpamReservations(CLI::App& ipam) {
  auto node = std::make_shared<std::string>();
  auto* reservations = ipam.add_subcommand("reservations", "MAC/IP reservations of a node");
  reservations->add_option("--node", *node, "Node id")->required();
  return [reservations, node](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!reservations->parsed()) return std::nullopt;
    v1::ListReservationsRequest req;
    req.set_node_id(*node);
    auto r = client.Call<v1::ListReservationsResponse>("gpuaas.v1.ipam.reservation.list", req,
                                                       g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::vector<std::vector<std::string>> rows;
      for (const auto& x : r->reservations()) {
        rows.push_back({x.node_id(), x.slot_key(), x.mac(), x.mac_source(), x.ip(), x.subnet(),
                        x.gateway(), Or(x.allocation_id())});
      }
      PrintTable({"NODE", "SLOT", "MAC", "MAC FROM", "IP", "SUBNET", "GATEWAY", "ALLOCATION"},
                 rows);
    });
  };
}

void PrintLeases(const v1::ListLeasesResponse& r, const std::string& node) {
  if (!r.has_observed_at()) {
    std::cout << "no lease report from " << node << " yet\n";
    return;
  }
  std::cout << fmt::format(
      "report of {} for document v{}{}\n", Time(r.observed_at()), r.document_version(),
      r.blockers_size() == 0 ? ""
                             : "  blockers: " + Join(std::vector<std::string>(r.blockers().begin(),
                                                                              r.blockers().end())));
  std::vector<std::vector<std::string>> rows;
  for (const auto& l : r.leases()) {
    const auto& x = l.observation();
    rows.push_back({Or(x.slot_key()), x.mac(), Or(x.expected_ip()), Or(x.actual_ip()),
                    Txt(x.lease_state()), Or(l.allocation_id())});
  }
  PrintTable({"SLOT", "MAC", "EXPECTED IP", "ACTUAL IP", "LEASE", "ALLOCATION"}, rows);
}

// ipam leases: the latest lease observation per slot of a node.
Action AddIpamLeases(CLI::App& ipam) {
  auto node = std::make_shared<std::string>();
  auto* leases = ipam.add_subcommand("leases", "Latest lease observation per slot of a node");
  leases->add_option("--node", *node, "Node id")->required();
  return [leases, node](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!leases->parsed()) return std::nullopt;
    v1::ListLeasesRequest req;
    req.set_node_id(*node);
    auto r = client.Call<v1::ListLeasesResponse>("gpuaas.v1.ipam.lease.list", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintLeases(*r, *node); });
  };
}

// ipam drift: a node's open drift, or all of it with --all.
Action AddIpamDrift(CLI::App& ipam) {
  struct Opts {
    std::string node;
    bool all = false;
  };
  auto o = std::make_shared<Opts>();
  auto* drift = ipam.add_subcommand("drift", "IPAM drift of a node (open; --all for history)");
  drift->add_option("--node", o->node, "Node id")->required();
  drift->add_flag("--all", o->all, "Include resolved drift");
  return [drift, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!drift->parsed()) return std::nullopt;
    v1::ListDriftRequest req;
    req.set_node_id(o->node);
    req.set_include_resolved(o->all);
    auto r = client.Call<v1::ListDriftResponse>("gpuaas.v1.ipam.drift.list", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::vector<std::vector<std::string>> rows;
      for (const auto& d : r->drift()) {
        rows.push_back({std::to_string(d.drift_id()), Or(d.slot_key()), d.kind(),
                        Time(d.detected_at()), d.has_resolved_at() ? Time(d.resolved_at()) : "open",
                        d.detail()});
      }
      PrintTable({"ID", "SLOT", "KIND", "DETECTED", "RESOLVED", "DETAIL"}, rows);
    });
  };
}

// ipam network: a node's network document (a version of it) and the version its agent acked.
Action AddIpamNetwork(CLI::App& ipam) {
  struct Opts {
    std::string node;
    int64_t version = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* network =
      ipam.add_subcommand("network", "A node's network document and the version its agent acked");
  network->add_option("--node", o->node, "Node id")->required();
  network->add_option("--version", o->version, "Document version (default: latest)");
  return [network, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!network->parsed()) return std::nullopt;
    v1::GetNodeNetworkRequest req;
    req.set_node_id(o->node);
    req.set_version(o->version);
    auto r = client.Call<v1::GetNodeNetworkResponse>("gpuaas.v1.ipam.node.{node_id}.network.get",
                                                     req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintDocument(*r); });
  };
}

struct SubnetOpts {
  std::string region, pool, node, subnet, gateway, datapath, bridge;
  std::vector<std::string> host_cidrs;
};

int RunIpamSubnet(rpc::Client& client, const Globals& g, const SubnetOpts& o) {
  int rc = kExitOk;
  auto datapath = ParseFlag<v1::NetworkDatapath>(g, "datapath", o.datapath, &rc);
  if (!datapath) return rc;
  v1::SetSubnetRequest req;
  req.set_datapath(*datapath);
  req.set_bridge(o.bridge);
  req.set_region(o.region);
  req.set_pool(o.pool);
  req.set_node_id(o.node);
  req.set_subnet(o.subnet);
  req.set_gateway(o.gateway);
  for (const auto& h : o.host_cidrs) req.add_host_cidrs(h);
  auto r = client.Call<v1::SetSubnetResponse>("gpuaas.v1.ipam.subnet.set", req, g.Timeout());
  if (!r.ok()) return Fail(g, r.error());
  return Print(g, *r, [&] {
    const auto& x = r->rule();
    // What the rule applies to, from the fields its scope sets (node_id; region + pool; region).
    std::cout << fmt::format("{} rule {}: {} gateway {}  datapath {}  bridge {}{}\n", x.scope(),
                             !x.node_id().empty() ? x.node_id()
                             : !x.pool().empty()  ? x.region() + "/" + x.pool()
                                                  : x.region(),
                             x.subnet(), x.gateway(), Txt(x.datapath(), "(inherited)"),
                             Or(x.bridge(), "(default)"), r->changed() ? "" : " (unchanged)");
    if (r->document_version() > 0) {
      std::cout << "node network document v" << r->document_version() << "\n";
    }
  });
}

// ipam subnet: sets the management subnet rule of a region, a pool or a node.
Action AddIpamSubnet(CLI::App& ipam) {
  auto o = std::make_shared<SubnetOpts>();
  auto* subnet = ipam.add_subcommand(
      "subnet", "Set the management subnet of a region, a pool (--region --pool) or a node");
  subnet->add_option("--region", o->region, "Region");
  subnet->add_option("--pool", o->pool, "Pool (with --region)");
  subnet->add_option("--node", o->node, "Node id (alone)");
  subnet->add_option("--subnet", o->subnet, "CIDR, e.g. 10.100.0.0/24")->required();
  subnet->add_option("--gateway", o->gateway, "Gateway (default: the subnet's first host)");
  subnet->add_option("--host-cidr", o->host_cidrs,
                     "A network already used on the scope's hosts (repeatable)");
  OneOfEnum<v1::NetworkDatapath>(subnet->add_option(
      "--datapath", o->datapath, "Datapath of the scope's nodes (default: inherit)"));
  subnet->add_option("--bridge", o->bridge,
                     "Bridge of --datapath (default: ipam.bridge / ipam.ovs_bridge)");
  return [subnet, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!subnet->parsed()) return std::nullopt;
    return RunIpamSubnet(client, g, *o);
  };
}

// The --node/--slot/--reason of a command on one slot's address.
struct SlotOpts {
  std::string node, slot, reason;
};

std::shared_ptr<SlotOpts> AddSlotOptions(CLI::App& command) {
  auto o = std::make_shared<SlotOpts>();
  command.add_option("--node", o->node, "Node id")->required();
  command.add_option("--slot", o->slot, "Slot key")->required();
  command.add_option("--reason", o->reason, "Why");
  return o;
}

// ipam release: releases a slot's IP reservation (its MAC stays the slot's).
Action AddIpamRelease(CLI::App& ipam) {
  auto* release = ipam.add_subcommand("release", "Release a slot's IP reservation (idempotent)");
  auto o = AddSlotOptions(*release);
  return [release, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!release->parsed()) return std::nullopt;
    v1::ReleaseSlotAddressRequest req;
    req.set_node_id(o->node);
    req.set_slot_key(o->slot);
    req.set_reason(o->reason);
    auto r = client.Call<v1::ReleaseSlotAddressResponse>("gpuaas.v1.ipam.reservation.release", req,
                                                         g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      if (r->released()) {
        std::cout << fmt::format("released {} of slot {} (MAC {} stays the slot's)\n",
                                 r->reservation().ip(), o->slot, r->reservation().mac());
      } else {
        std::cout << "slot " << o->slot << " had no reservation\n";
      }
    });
  };
}

// ipam reprovision: gives a slot a new MAC (admin).
Action AddIpamReprovision(CLI::App& ipam) {
  auto* reprovision =
      ipam.add_subcommand("reprovision", "Give a slot a new MAC (admin; not while bound)");
  auto o = AddSlotOptions(*reprovision);
  return [reprovision, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!reprovision->parsed()) return std::nullopt;
    v1::ReprovisionSlotAddressRequest req;
    req.set_node_id(o->node);
    req.set_slot_key(o->slot);
    req.set_reason(o->reason);
    auto r = client.Call<v1::ReprovisionSlotAddressResponse>(
        "gpuaas.v1.ipam.reservation.reprovision", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format("slot {}: MAC {} -> {}; network document v{}\n", o->slot,
                               r->previous_mac(), Or(r->reservation().mac(), "(no reservation)"),
                               r->document_version());
    });
  };
}

struct OrphansOpts {
  std::string node, reason;
  int64_t min_age = -1;  // -1: the service's default
  bool remove = false;
};

template <typename List>
void PrintOrphans(const List& list) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& x : list) {
    rows.push_back({x.node_id(), Or(x.slot_key()), Txt(x.reason()), Or(x.mac()), Or(x.ip()),
                    Or(x.subnet()), std::to_string(x.reservations()),
                    x.has_updated_at() ? Time(x.updated_at()) : "-"});
  }
  PrintTable({"NODE", "SLOT", "REASON", "MAC", "IP", "SUBNET", "RESERVED", "CHANGED"}, rows);
}

int RunIpamOrphans(rpc::Client& client, const Globals& g, const OrphansOpts& o) {
  if (o.remove) {
    v1::RemoveOrphansRequest req;
    if (o.min_age >= 0) req.set_min_age_seconds(o.min_age);
    req.set_node_id(o.node);
    req.set_reason(o.reason);
    auto r =
        client.Call<v1::RemoveOrphansResponse>("gpuaas.v1.ipam.orphan.remove", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << r->removed_size() << " orphan(s) removed\n";
      if (r->removed_size() > 0) PrintOrphans(r->removed());
    });
  }
  v1::ListOrphansRequest req;
  if (o.min_age >= 0) req.set_min_age_seconds(o.min_age);
  auto r = client.Call<v1::ListOrphansResponse>("gpuaas.v1.ipam.orphan.list", req, g.Timeout());
  if (!r.ok()) return Fail(g, r.error());
  return Print(g, *r, [&] { PrintOrphans(r->orphans()); });
}

// ipam orphans: rows of nodes/slots inventory does not know; --remove deletes them (admin).
Action AddIpamOrphans(CLI::App& ipam) {
  auto o = std::make_shared<OrphansOpts>();
  auto* orphans = ipam.add_subcommand(
      "orphans", "Rows of nodes/slots inventory does not know (--remove deletes them: admin)");
  orphans->add_flag("--remove", o->remove, "Delete them (each announced as orphan.removed)");
  orphans->add_option("--min-age", o->min_age,
                      "Only slot orphans unchanged for this many seconds (default 600)");
  orphans->add_option("--node", o->node, "Only this node's (with --remove)");
  orphans->add_option("--reason", o->reason, "Why (with --remove)");
  return [orphans, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!orphans->parsed()) return std::nullopt;
    return RunIpamOrphans(client, g, *o);
  };
}

}  // namespace

Action AddIpamCommands(CLI::App& app) {
  auto* ipam = app.add_subcommand("ipam", "Slot network identities (MAC/IP), leases and drift");
  ipam->require_subcommand(1);
  return FirstOf<Action>({AddIpamReservations(*ipam), AddIpamLeases(*ipam), AddIpamDrift(*ipam),
                          AddIpamNetwork(*ipam), AddIpamSubnet(*ipam), AddIpamRelease(*ipam),
                          AddIpamReprovision(*ipam), AddIpamOrphans(*ipam)});
}

}  // namespace gpuaas::ctl
