// gpuaasctl ingress: endpoint pools (admin), exposures of allocations (expose, unexpose, list)
// and a node's exposure document with the version its agent acked (services/ingress).
#include <charconv>
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/ingress.pb.h"

namespace gpuaas::ctl {

namespace {

// A port 0..65535 written as decimal digits only.
std::optional<int32_t> ParsePort(std::string_view s) {
  int32_t v = 0;
  const auto* end = s.data() + s.size();
  auto [p, ec] = std::from_chars(s.data(), end, v);
  if (s.empty() || ec != std::errc() || p != end || v < 0 || v > 65535) return std::nullopt;
  return v;
}

// "MIN-MAX" (or a single port: MIN-MIN) into {min, max}; nullopt when malformed. The service
// judges the allowed range (1024..65535).
std::optional<std::pair<int32_t, int32_t>> ParsePorts(std::string_view s) {
  const auto dash = s.find('-');
  auto lo = ParsePort(s.substr(0, dash));
  auto hi = dash == std::string_view::npos ? lo : ParsePort(s.substr(dash + 1));
  if (!lo || !hi || *lo > *hi) return std::nullopt;
  return std::make_pair(*lo, *hi);
}

std::string Ports(const v1::EndpointPool& p) {
  if (p.port_min() == 0 && p.port_max() == 0) return "-";
  return fmt::format("{}-{}", p.port_min(), p.port_max());
}

void PrintPools(const google::protobuf::RepeatedPtrField<v1::EndpointPool>& pools) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(pools.size());
  for (const auto& p : pools) {
    rows.push_back({p.name(), Txt(p.kind()), p.region(), Or(p.node_id()),
                    Or(Join(std::vector<std::string>(p.addresses().begin(), p.addresses().end()))),
                    Ports(p), fmt::format("{}/{}", p.used(), p.total())});
  }
  PrintTable({"NAME", "KIND", "REGION", "NODE", "ADDRESSES", "PORTS", "USED/TOTAL"}, rows);
}

void PrintPool(const v1::EndpointPool& p) {
  google::protobuf::RepeatedPtrField<v1::EndpointPool> one;
  *one.Add() = p;
  PrintPools(one);
}

// "203.0.113.10:20022 -> 10.100.0.5:22/tcp"; "-" for what is not known yet.
std::string Mapping(const std::string& public_ip, int32_t public_port, const std::string& target_ip,
                    int32_t target_port, v1::TransportProtocol protocol) {
  const std::string from =
      public_ip.empty() ? std::string("-") : fmt::format("{}:{}", public_ip, public_port);
  return fmt::format("{} -> {}:{}/{}", from, Or(target_ip), target_port, Txt(protocol, "?"));
}

void PrintExposures(const google::protobuf::RepeatedPtrField<v1::Exposure>& es) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(es.size());
  for (const auto& e : es) {
    rows.push_back(
        {e.exposure_id(), e.allocation_id(), e.name(), Txt(e.state()),
         Mapping(e.public_ip(), e.public_port(), e.target_ip(), e.target_port(), e.protocol()),
         Or(e.reason())});
  }
  PrintTable({"ID", "ALLOCATION", "NAME", "STATE", "PUBLIC -> TARGET", "REASON"}, rows);
}

void PrintExposure(const v1::Exposure& e) {
  google::protobuf::RepeatedPtrField<v1::Exposure> one;
  *one.Add() = e;
  PrintExposures(one);
  if (!e.detail().empty()) std::cout << "detail: " << e.detail() << "\n";
  std::cout << "connect: " << Or(e.connect(), "(no public endpoint)") << "\n";
}

void PrintDocument(const v1::GetNodeExposuresResponse& r) {
  const auto& d = r.document();
  if (d.version() == 0) {
    std::cout << fmt::format("node {}: no exposure document yet (nothing exposed on it)\n",
                             d.node_id());
    return;
  }
  std::cout << fmt::format("node {}  document v{} (latest v{})  applied v{}{}  {} mapping(s)\n",
                           d.node_id(), d.version(), r.latest_version(), r.applied_version(),
                           r.applied_version() == 0
                               ? " (never acked)"
                               : (r.has_acked_at() ? " at " + Time(r.acked_at()) : ""),
                           d.mappings_size());
  if (r.blockers_size() > 0) {
    std::cout << "blockers: "
              << Join(std::vector<std::string>(r.blockers().begin(), r.blockers().end())) << "\n";
  }
  std::vector<std::vector<std::string>> rows;
  rows.reserve(d.mappings_size());
  for (const auto& m : d.mappings()) {
    rows.push_back(
        {m.exposure_id(), m.allocation_id(), m.slot_key(),
         Mapping(m.public_ip(), m.public_port(), m.target_ip(), m.target_port(), m.protocol())});
  }
  PrintTable({"EXPOSURE", "ALLOCATION", "SLOT", "PUBLIC -> TARGET"}, rows);
}

struct PoolSetOpts {
  std::string name, kind, region, node;
  std::vector<std::string> addresses;
  std::pair<int32_t, int32_t> ports{0, 0};
};

int RunPoolSet(rpc::Client& client, const Globals& g, const PoolSetOpts& o) {
  int rc = kExitOk;
  auto kind = ParseFlag<v1::EndpointPoolKind>(g, "kind", o.kind, &rc);
  if (!kind) return rc;
  v1::SetEndpointPoolRequest req;
  auto* p = req.mutable_pool();
  p->set_name(o.name);
  p->set_kind(*kind);
  p->set_region(o.region);
  p->set_node_id(o.node);
  for (const auto& a : o.addresses) p->add_addresses(a);
  p->set_port_min(o.ports.first);
  p->set_port_max(o.ports.second);
  auto r = client.Call<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", req, g.Timeout());
  if (!r.ok()) return Fail(g, r.error());
  return Print(g, *r, [&] {
    std::cout << fmt::format("pool {} {} (generation {})\n", r->pool().name(),
                             r->created() ? "created" : "replaced", r->pool().generation());
    PrintPool(r->pool());
  });
}

// ingress pool set: creates or replaces an endpoint pool (admin).
Action AddPoolSet(CLI::App& pool) {
  auto o = std::make_shared<PoolSetOpts>();
  auto* set = pool.add_subcommand("set", "Create or replace an endpoint pool");
  set->add_option("--name", o->name, "Pool name (a lowercase DNS label)")->required();
  OneOfEnum<v1::EndpointPoolKind>(
      set->add_option("--kind", o->kind,
                      "port_range: ports of one node's public address; public_ip: whole "
                      "addresses routed to the region's nodes")
          ->required());
  set->add_option("--region", o->region, "Region it serves")->required();
  set->add_option("--node", o->node, "The node whose uplink holds the address (port_range)");
  set->add_option("--address", o->addresses,
                  "Public IPv4 address (port_range: exactly one; public_ip: repeatable)")
      ->required()
      ->delimiter(',');
  set->add_option_function<std::string>(
         "--ports", [o](const std::string& v) { o->ports = *ParsePorts(v); },
         "Ports handed out, MIN-MAX (port_range), e.g. 20000-20999")
      ->check(CLI::Validator(
          [](const std::string& v) {
            return ParsePorts(v)
                       ? std::string()
                       : fmt::format("{}: want MIN-MAX (MIN <= MAX), e.g. 20000-20999", v);
          },
          "MIN-MAX"));
  return [set, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!set->parsed()) return std::nullopt;
    return RunPoolSet(client, g, *o);
  };
}

// ingress pool list: endpoint pools with their usage.
Action AddPoolList(CLI::App& pool) {
  auto region = std::make_shared<std::string>();
  auto* list = pool.add_subcommand("list", "Endpoint pools with their usage");
  list->add_option("--region", *region, "Only this region");
  return [list, region](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!list->parsed()) return std::nullopt;
    v1::ListEndpointPoolsRequest req;
    req.set_region(*region);
    auto r =
        client.Call<v1::ListEndpointPoolsResponse>("gpuaas.v1.ingress.pool.list", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintPools(r->pools()); });
  };
}

// ingress pool delete: deletes an endpoint pool no exposure uses.
Action AddPoolDelete(CLI::App& pool) {
  auto name = std::make_shared<std::string>();
  auto* del =
      pool.add_subcommand("delete", "Delete an endpoint pool (refused while one is in use)");
  del->add_option("--name", *name, "Pool name")->required();
  return [del, name](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!del->parsed()) return std::nullopt;
    v1::DeleteEndpointPoolRequest req;
    req.set_name(*name);
    auto r = client.Call<v1::DeleteEndpointPoolResponse>("gpuaas.v1.ingress.pool.delete", req,
                                                         g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format("pool {} deleted ({} of region {})\n", r->pool().name(),
                               Txt(r->pool().kind()), r->pool().region());
    });
  };
}

// ingress expose: one more endpoint of a live slice allocation.
Action AddExpose(CLI::App& ingress) {
  struct Opts {
    std::string alloc, name, protocol = "tcp";
    int32_t port = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* expose = ingress.add_subcommand(
      "expose", "Expose one more endpoint of a live slice allocation (idempotent per name)");
  expose->add_option("--alloc", o->alloc, "Allocation id")->required();
  expose->add_option("--name", o->name, "Endpoint name (a lowercase DNS label: ssh, jupyter)")
      ->required();
  expose->add_option("--port", o->port, "The VM's port")->required()->check(CLI::Range(1, 65535));
  OneOfEnum<v1::TransportProtocol>(expose->add_option("--protocol", o->protocol, "Protocol"))
      ->capture_default_str();
  return [expose, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!expose->parsed()) return std::nullopt;
    int rc = kExitOk;
    auto protocol = ParseFlag<v1::TransportProtocol>(g, "protocol", o->protocol, &rc);
    if (!protocol) return rc;
    v1::CreateExposureRequest req;
    req.set_allocation_id(o->alloc);
    req.set_name(o->name);
    req.set_protocol(*protocol);
    req.set_port(o->port);
    auto r = client.Call<v1::CreateExposureResponse>("gpuaas.v1.ingress.exposure.create", req,
                                                     g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      if (!r->created()) std::cout << "(it existed already)\n";
      PrintExposure(r->exposure());
    });
  };
}

// ingress unexpose: stops exposing one endpoint.
Action AddUnexpose(CLI::App& ingress) {
  auto id = std::make_shared<std::string>();
  auto* unexpose = ingress.add_subcommand("unexpose", "Stop exposing one endpoint (idempotent)");
  unexpose->add_option("--id", *id, "Exposure id")->required();
  return [unexpose, id](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!unexpose->parsed()) return std::nullopt;
    v1::DeleteExposureRequest req;
    req.set_exposure_id(*id);
    auto r = client.Call<v1::DeleteExposureResponse>("gpuaas.v1.ingress.exposure.delete", req,
                                                     g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintExposure(r->exposure()); });
  };
}

// ingress exposures: exposures of an allocation, a node and/or in a state.
Action AddExposures(CLI::App& ingress) {
  struct Opts {
    std::string alloc, node, state;
  };
  auto o = std::make_shared<Opts>();
  auto* exposures = ingress.add_subcommand("exposures", "Exposures (default: all but removed)");
  exposures->add_option("--alloc", o->alloc, "Only this allocation's");
  exposures->add_option("--node", o->node, "Only this node's");
  OneOfEnum<v1::ExposureState>(exposures->add_option("--state", o->state, "Only this state"));
  return [exposures, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!exposures->parsed()) return std::nullopt;
    int rc = kExitOk;
    auto state = ParseFlag<v1::ExposureState>(g, "state", o->state, &rc);
    if (!state) return rc;
    v1::ListExposuresRequest req;
    req.set_allocation_id(o->alloc);
    req.set_node_id(o->node);
    req.set_state(*state);
    auto r =
        client.Call<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintExposures(r->exposures()); });
  };
}

// ingress node: a node's exposure document (a version of it) and the version its agent acked.
Action AddIngressNode(CLI::App& ingress) {
  struct Opts {
    std::string node;
    int64_t version = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* node =
      ingress.add_subcommand("node", "A node's exposure document and the version its agent acked");
  node->add_option("--node", o->node, "Node id")->required();
  node->add_option("--version", o->version, "Document version (default: latest)");
  return [node, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!node->parsed()) return std::nullopt;
    v1::GetNodeExposuresRequest req;
    req.set_node_id(o->node);
    req.set_version(o->version);
    auto r = client.Call<v1::GetNodeExposuresResponse>(
        "gpuaas.v1.ingress.node.{node_id}.exposures.get", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintDocument(*r); });
  };
}

}  // namespace

Action AddIngressCommands(CLI::App& app) {
  auto* ingress =
      app.add_subcommand("ingress", "Public endpoints: pools, exposures of allocations");
  ingress->require_subcommand(1);
  auto* pool = ingress->add_subcommand("pool", "Endpoint pools (admin)");
  pool->require_subcommand(1);
  return FirstOf<Action>({AddPoolSet(*pool), AddPoolList(*pool), AddPoolDelete(*pool),
                          AddExpose(*ingress), AddUnexpose(*ingress), AddExposures(*ingress),
                          AddIngressNode(*ingress)});
}

}  // namespace gpuaas::ctl
