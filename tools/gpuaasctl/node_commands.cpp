// gpuaasctl node register/list, scheduler nodes/rebuild-projection.
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ctl {

Action AddNodeCommands(CLI::App& app) {
  struct Opts {
    std::string id, host, region, pool = "default", profile = "slice-vm", list_pool;
    std::vector<std::string> labels;
  };
  auto o = std::make_shared<Opts>();

  auto* node = app.add_subcommand("node", "Nodes known to inventory");
  node->require_subcommand(1);
  auto* reg = node->add_subcommand("register", "Register (or update) a node");
  reg->add_option("--id", o->id, "Node id")->required();
  reg->add_option("--hostname", o->host, "Hostname (default: the id)");
  reg->add_option("--region", o->region, "Region")->required();
  reg->add_option("--pool", o->pool, "Pool")->capture_default_str();
  OneOfEnum<v1::CapacityProfile>(
      reg->add_option("--profile", o->profile, "Capacity profile")->capture_default_str());
  reg->add_option("--label", o->labels, "key=value (repeatable)");
  auto* list = node->add_subcommand("list", "List nodes");
  list->add_option("--region", o->region, "Only this region");
  list->add_option("--pool", o->list_pool, "Only this pool");

  auto* sched = app.add_subcommand("scheduler", "The scheduler's view");
  sched->require_subcommand(1);
  auto* sched_nodes = sched->add_subcommand("nodes", "Nodes in the scheduler's projection");
  sched_nodes->add_option("--region", o->region, "Only this region");
  auto* rebuild = sched->add_subcommand(
      "rebuild-projection", "Drop the scheduler's projection and replay inventory events");

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (reg->parsed()) {
      v1::RegisterNodeRequest req;
      req.set_node_id(o->id);
      req.set_hostname(o->host.empty() ? o->id : o->host);
      req.set_region(o->region);
      req.set_pool(o->pool);
      req.set_capacity_profile(enums::FromColumn<v1::CapacityProfile>(o->profile));
      for (const auto& l : o->labels) {
        auto eq = l.find('=');
        if (eq == std::string::npos) {
          return Usage(g,
                       Error::InvalidArgument(reason::kInvalidLabel, "labels are key=value: " + l));
        }
        (*req.mutable_labels())[l.substr(0, eq)] = l.substr(eq + 1);
      }
      req.set_agent_version("gpuaasctl");
      auto r = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.inventory.node.{node_id}.register",
                                                     req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        std::cout << fmt::format(
            "node {} {} (generation {})\n", r->node().node_id(),
            r->created() ? "registered" : (r->changed() ? "updated" : "unchanged"),
            r->node().generation());
      });
    }
    if (list->parsed()) {
      v1::ListNodesResponse all;
      v1::ListNodesRequest req;
      req.set_region(o->region);
      req.set_pool(o->list_pool);
      auto r = ListAll<v1::ListNodesResponse>(
          client, "gpuaas.v1.inventory.node.list", req, g.Timeout(),
          [&](v1::ListNodesResponse& page) { all.mutable_nodes()->MergeFrom(page.nodes()); });
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, all, [&] {
        std::vector<std::vector<std::string>> rows;
        for (const auto& n : all.nodes()) {
          rows.push_back({n.node_id(), n.hostname(), n.region(), n.pool(),
                          Txt(n.capacity_profile()), Txt(n.admin_state()),
                          std::to_string(n.generation()), Time(n.registered_at())});
        }
        PrintTable({"NODE", "HOSTNAME", "REGION", "POOL", "PROFILE", "STATE", "GEN", "REGISTERED"},
                   rows);
      });
    }
    if (sched_nodes->parsed()) {
      v1::ListProjectedNodesResponse all;
      v1::ListProjectedNodesRequest req;
      req.set_region(o->region);
      auto r = ListAll<v1::ListProjectedNodesResponse>(
          client, "gpuaas.v1.scheduler.node.list", req, g.Timeout(),
          [&](v1::ListProjectedNodesResponse& page) {
            all.mutable_nodes()->MergeFrom(page.nodes());
          });
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, all, [&] {
        std::vector<std::vector<std::string>> rows;
        for (const auto& n : all.nodes()) {
          rows.push_back({n.node_id(), n.region(), n.pool(), Txt(n.capacity_profile()),
                          Txt(n.admin_state()), std::to_string(n.generation()), n.last_event_id()});
        }
        PrintTable({"NODE", "REGION", "POOL", "PROFILE", "STATE", "GEN", "LAST EVENT"}, rows);
      });
    }
    if (rebuild->parsed()) {
      v1::RebuildProjectionRequest req;
      req.set_confirm(true);  // naming the command is the operator's confirmation
      auto r = client.Call<v1::RebuildProjectionResponse>("gpuaas.v1.scheduler.projection.rebuild",
                                                          req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        std::cout << fmt::format("projection rebuilt: {} events replayed, {} nodes, {} slots\n",
                                 r->events_replayed(), r->nodes(), r->slots());
      });
    }
    return std::nullopt;
  };
}

}  // namespace gpuaas::ctl
