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

}  // namespace

Action AddIpamCommands(CLI::App& app) {
  struct Opts {
    std::string node, slot, reason, region, pool, subnet, gateway, datapath, bridge;
    std::vector<std::string> host_cidrs;
    int64_t version = 0;
    int64_t min_age = -1;  // -1: the service's default
    bool all = false;
    bool remove = false;
  };
  auto o = std::make_shared<Opts>();

  auto* ipam = app.add_subcommand("ipam", "Slot network identities (MAC/IP), leases and drift");
  ipam->require_subcommand(1);
  auto* reservations = ipam->add_subcommand("reservations", "MAC/IP reservations of a node");
  reservations->add_option("--node", o->node, "Node id")->required();
  auto* leases = ipam->add_subcommand("leases", "Latest lease observation per slot of a node");
  leases->add_option("--node", o->node, "Node id")->required();
  auto* drift = ipam->add_subcommand("drift", "IPAM drift of a node (open; --all for history)");
  drift->add_option("--node", o->node, "Node id")->required();
  drift->add_flag("--all", o->all, "Include resolved drift");
  auto* network =
      ipam->add_subcommand("network", "A node's network document and the version its agent acked");
  network->add_option("--node", o->node, "Node id")->required();
  network->add_option("--version", o->version, "Document version (default: latest)");
  auto* subnet = ipam->add_subcommand(
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
  auto* release = ipam->add_subcommand("release", "Release a slot's IP reservation (idempotent)");
  release->add_option("--node", o->node, "Node id")->required();
  release->add_option("--slot", o->slot, "Slot key")->required();
  release->add_option("--reason", o->reason, "Why");
  auto* reprovision =
      ipam->add_subcommand("reprovision", "Give a slot a new MAC (admin; not while bound)");
  reprovision->add_option("--node", o->node, "Node id")->required();
  reprovision->add_option("--slot", o->slot, "Slot key")->required();
  reprovision->add_option("--reason", o->reason, "Why");
  auto* orphans = ipam->add_subcommand(
      "orphans", "Rows of nodes/slots inventory does not know (--remove deletes them: admin)");
  orphans->add_flag("--remove", o->remove, "Delete them (each announced as orphan.removed)");
  orphans->add_option("--min-age", o->min_age,
                      "Only slot orphans unchanged for this many seconds (default 600)");
  orphans->add_option("--node", o->node, "Only this node's (with --remove)");
  orphans->add_option("--reason", o->reason, "Why (with --remove)");

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    const auto timeout = g.Timeout();
    if (reservations->parsed()) {
      v1::ListReservationsRequest req;
      req.set_node_id(o->node);
      auto r = client.Call<v1::ListReservationsResponse>("gpuaas.v1.ipam.reservation.list", req,
                                                         timeout);
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
    }
    if (leases->parsed()) {
      v1::ListLeasesRequest req;
      req.set_node_id(o->node);
      auto r = client.Call<v1::ListLeasesResponse>("gpuaas.v1.ipam.lease.list", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        if (!r->has_observed_at()) {
          std::cout << "no lease report from " << o->node << " yet\n";
          return;
        }
        std::cout << fmt::format(
            "report of {} for document v{}{}\n", Time(r->observed_at()), r->document_version(),
            r->blockers_size() == 0
                ? ""
                : "  blockers: " +
                      Join(std::vector<std::string>(r->blockers().begin(), r->blockers().end())));
        std::vector<std::vector<std::string>> rows;
        for (const auto& l : r->leases()) {
          const auto& x = l.observation();
          rows.push_back({Or(x.slot_key()), x.mac(), Or(x.expected_ip()), Or(x.actual_ip()),
                          Txt(x.lease_state()), Or(l.allocation_id())});
        }
        PrintTable({"SLOT", "MAC", "EXPECTED IP", "ACTUAL IP", "LEASE", "ALLOCATION"}, rows);
      });
    }
    if (drift->parsed()) {
      v1::ListDriftRequest req;
      req.set_node_id(o->node);
      req.set_include_resolved(o->all);
      auto r = client.Call<v1::ListDriftResponse>("gpuaas.v1.ipam.drift.list", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        std::vector<std::vector<std::string>> rows;
        for (const auto& d : r->drift()) {
          rows.push_back({std::to_string(d.drift_id()), Or(d.slot_key()), d.kind(),
                          Time(d.detected_at()),
                          d.has_resolved_at() ? Time(d.resolved_at()) : "open", d.detail()});
        }
        PrintTable({"ID", "SLOT", "KIND", "DETECTED", "RESOLVED", "DETAIL"}, rows);
      });
    }
    if (network->parsed()) {
      v1::GetNodeNetworkRequest req;
      req.set_node_id(o->node);
      req.set_version(o->version);
      auto r =
          client.Call<v1::GetNodeNetworkResponse>("gpuaas.v1.ipam.node.network.get", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintDocument(*r); });
    }
    if (subnet->parsed()) {
      int rc = kExitOk;
      auto datapath = ParseFlag<v1::NetworkDatapath>(g, "datapath", o->datapath, &rc);
      if (!datapath) return rc;
      v1::SetSubnetRequest req;
      req.set_datapath(*datapath);
      req.set_bridge(o->bridge);
      req.set_region(o->region);
      req.set_pool(o->pool);
      req.set_node_id(o->node);
      req.set_subnet(o->subnet);
      req.set_gateway(o->gateway);
      for (const auto& h : o->host_cidrs) req.add_host_cidrs(h);
      auto r = client.Call<v1::SetSubnetResponse>("gpuaas.v1.ipam.subnet.set", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        const auto& x = r->rule();
        std::cout << fmt::format("{} rule {}: {} gateway {}  datapath {}  bridge {}{}\n", x.scope(),
                                 x.scope() == "node"   ? x.node_id()
                                 : x.scope() == "pool" ? x.region() + "/" + x.pool()
                                                       : x.region(),
                                 x.subnet(), x.gateway(), Txt(x.datapath(), "(inherited)"),
                                 Or(x.bridge(), "(default)"), r->changed() ? "" : " (unchanged)");
        if (r->document_version() > 0) {
          std::cout << "node network document v" << r->document_version() << "\n";
        }
      });
    }
    if (release->parsed()) {
      v1::ReleaseSlotAddressRequest req;
      req.set_node_id(o->node);
      req.set_slot_key(o->slot);
      req.set_reason(o->reason);
      auto r = client.Call<v1::ReleaseSlotAddressResponse>("gpuaas.v1.ipam.reservation.release",
                                                           req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        if (r->released()) {
          std::cout << fmt::format("released {} of slot {} (MAC {} stays the slot's)\n",
                                   r->reservation().ip(), o->slot, r->reservation().mac());
        } else {
          std::cout << "slot " << o->slot << " had no reservation\n";
        }
      });
    }
    if (reprovision->parsed()) {
      v1::ReprovisionSlotAddressRequest req;
      req.set_node_id(o->node);
      req.set_slot_key(o->slot);
      req.set_reason(o->reason);
      auto r = client.Call<v1::ReprovisionSlotAddressResponse>(
          "gpuaas.v1.ipam.reservation.reprovision", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        std::cout << fmt::format("slot {}: MAC {} -> {}; network document v{}\n", o->slot,
                                 r->previous_mac(), Or(r->reservation().mac(), "(no reservation)"),
                                 r->document_version());
      });
    }
    if (orphans->parsed()) {
      const auto rows_of = [](const auto& list) {
        std::vector<std::vector<std::string>> rows;
        for (const auto& x : list) {
          rows.push_back({x.node_id(), Or(x.slot_key()), Txt(x.reason()), Or(x.mac()), Or(x.ip()),
                          Or(x.subnet()), std::to_string(x.reservations()),
                          x.has_updated_at() ? Time(x.updated_at()) : "-"});
        }
        return rows;
      };
      const std::vector<std::string> header = {"NODE", "SLOT",   "REASON",   "MAC",
                                               "IP",   "SUBNET", "RESERVED", "CHANGED"};
      if (o->remove) {
        v1::RemoveOrphansRequest req;
        if (o->min_age >= 0) req.set_min_age_seconds(o->min_age);
        req.set_node_id(o->node);
        req.set_reason(o->reason);
        auto r =
            client.Call<v1::RemoveOrphansResponse>("gpuaas.v1.ipam.orphan.remove", req, timeout);
        if (!r.ok()) return Fail(g, r.error());
        return Print(g, *r, [&] {
          std::cout << r->removed_size() << " orphan(s) removed\n";
          if (r->removed_size() > 0) PrintTable(header, rows_of(r->removed()));
        });
      }
      v1::ListOrphansRequest req;
      if (o->min_age >= 0) req.set_min_age_seconds(o->min_age);
      auto r = client.Call<v1::ListOrphansResponse>("gpuaas.v1.ipam.orphan.list", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintTable(header, rows_of(r->orphans())); });
    }
    return std::nullopt;
  };
}

}  // namespace gpuaas::ctl
