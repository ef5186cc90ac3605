// gpuaasctl: the operator/tenant CLI. It talks to the services over NATS only, like any other
// client. Output: human tables by default, `-o json` for scripts. Errors print the structured
// status (code, reason, message, details) and exit 1.
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/time_util.h>

#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "ctl.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

using namespace gpuaas;
using namespace gpuaas::ctl;

namespace {

std::string Profile(v1::CapacityProfile p) {
  switch (p) {
    case v1::CAPACITY_PROFILE_BAREMETAL:
      return "baremetal";
    case v1::CAPACITY_PROFILE_SLICE_VM:
      return "slice-vm";
    default:
      return "unspecified";
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"gpuaasctl: manage the GPU cloud control plane over NATS"};
  app.require_subcommand(1);
  Globals g;
  const char* env_url = std::getenv("GPUAAS_NATS_URL");
  g.nats_url = env_url ? env_url : "nats://127.0.0.1:4222";
  app.add_option("--nats", g.nats_url, "NATS URL (env GPUAAS_NATS_URL)");
  app.add_option("-o,--output", g.output, "table | json")->check(CLI::IsMember({"table", "json"}));
  app.add_option("--timeout-ms", g.timeout_ms, "Request timeout");

  auto* node = app.add_subcommand("node", "Nodes known to inventory");
  node->require_subcommand(1);
  v1::RegisterNodeRequest reg;
  std::string reg_id, reg_host, reg_region, reg_pool, reg_profile = "slice-vm";
  std::vector<std::string> reg_labels;
  auto* node_register = node->add_subcommand("register", "Register (or update) a node");
  node_register->add_option("--id", reg_id, "Node id")->required();
  node_register->add_option("--hostname", reg_host, "Hostname (default: the id)");
  node_register->add_option("--region", reg_region, "Region")->required();
  node_register->add_option("--pool", reg_pool, "Pool")->default_val("default");
  node_register->add_option("--profile", reg_profile, "baremetal | slice-vm")
      ->check(CLI::IsMember({"baremetal", "slice-vm"}));
  node_register->add_option("--label", reg_labels, "key=value (repeatable)");
  std::string list_region, list_pool;
  auto* node_list = node->add_subcommand("list", "List nodes");
  node_list->add_option("--region", list_region, "Only this region");
  node_list->add_option("--pool", list_pool, "Only this pool");

  auto* sched = app.add_subcommand("scheduler", "The scheduler's view");
  sched->require_subcommand(1);
  std::string sched_region;
  auto* sched_nodes = sched->add_subcommand("nodes", "Nodes in the scheduler's projection");
  sched_nodes->add_option("--region", sched_region, "Only this region");
  auto* sched_rebuild = sched->add_subcommand(
      "rebuild-projection", "Drop the scheduler's projection and replay inventory events");

  const Action inventory_commands = AddInventoryCommands(app, node);
  const Action alloc_commands = AddAllocCommands(app);
  const Action ipam_commands = AddIpamCommands(app);

  CLI11_PARSE(app, argc, argv);

  log::Logger quiet("gpuaasctl", "cli", log::Level::kError);
  messaging::ConnectionOptions co;
  co.url = g.nats_url;
  co.name = "gpuaasctl";
  co.retry_on_failed_connect = false;
  auto conn = messaging::Connection::Connect(co, quiet);
  if (!conn.ok()) return Fail(g, conn.error());
  rpc::Client client(*conn);
  const auto timeout = std::chrono::milliseconds(g.timeout_ms);

  if (auto rc = inventory_commands(client, g)) return *rc;
  if (auto rc = alloc_commands(client, g)) return *rc;
  if (auto rc = ipam_commands(client, g)) return *rc;

  if (node_register->parsed()) {
    reg.set_node_id(reg_id);
    reg.set_hostname(reg_host.empty() ? reg_id : reg_host);
    reg.set_region(reg_region);
    reg.set_pool(reg_pool);
    reg.set_capacity_profile(reg_profile == "baremetal" ? v1::CAPACITY_PROFILE_BAREMETAL
                                                        : v1::CAPACITY_PROFILE_SLICE_VM);
    for (const auto& l : reg_labels) {
      auto eq = l.find('=');
      if (eq == std::string::npos) {
        return Fail(g, Error::InvalidArgument("invalid_label", "labels are key=value: " + l));
      }
      (*reg.mutable_labels())[l.substr(0, eq)] = l.substr(eq + 1);
    }
    reg.set_agent_version("gpuaasctl");
    auto r =
        client.Call<v1::RegisterNodeResponse>("gpuaas.v1.inventory.node.register", reg, timeout);
    if (!r.ok()) return Fail(g, r.error());
    if (g.output == "json") {
      std::cout << ToJson(*r) << "\n";
    } else {
      std::cout << fmt::format(
          "node {} {} (generation {})\n", r->node().node_id(),
          r->created() ? "registered" : (r->changed() ? "updated" : "unchanged"),
          r->node().generation());
    }
    return 0;
  }

  if (node_list->parsed()) {
    v1::ListNodesResponse all;
    v1::ListNodesRequest req;
    req.set_region(list_region);
    req.set_pool(list_pool);
    auto r = ListAll<v1::ListNodesResponse>(
        client, "gpuaas.v1.inventory.node.list", req, timeout,
        [&](v1::ListNodesResponse& page) { all.mutable_nodes()->MergeFrom(page.nodes()); });
    if (!r.ok()) return Fail(g, r.error());
    if (g.output == "json") {
      std::cout << ToJson(all) << "\n";
      return 0;
    }
    std::vector<std::vector<std::string>> rows;
    for (const auto& n : all.nodes()) {
      rows.push_back({n.node_id(), n.hostname(), n.region(), n.pool(),
                      Profile(n.capacity_profile()), std::to_string(n.generation()),
                      Time(n.registered_at())});
    }
    PrintTable({"NODE", "HOSTNAME", "REGION", "POOL", "PROFILE", "GEN", "REGISTERED"}, rows);
    return 0;
  }

  if (sched_nodes->parsed()) {
    v1::ListProjectedNodesResponse all;
    v1::ListProjectedNodesRequest req;
    req.set_region(sched_region);
    auto r =
        ListAll<v1::ListProjectedNodesResponse>(client, "gpuaas.v1.scheduler.node.list", req,
                                                timeout, [&](v1::ListProjectedNodesResponse& page) {
                                                  all.mutable_nodes()->MergeFrom(page.nodes());
                                                });
    if (!r.ok()) return Fail(g, r.error());
    if (g.output == "json") {
      std::cout << ToJson(all) << "\n";
      return 0;
    }
    std::vector<std::vector<std::string>> rows;
    for (const auto& n : all.nodes()) {
      rows.push_back({n.node_id(), n.region(), n.pool(), Profile(n.capacity_profile()),
                      std::to_string(n.generation()), n.last_event_id()});
    }
    PrintTable({"NODE", "REGION", "POOL", "PROFILE", "GEN", "LAST EVENT"}, rows);
    return 0;
  }

  if (sched_rebuild->parsed()) {
    auto r = client.Call<v1::RebuildProjectionResponse>("gpuaas.v1.scheduler.projection.rebuild",
                                                        v1::RebuildProjectionRequest(), timeout);
    if (!r.ok()) return Fail(g, r.error());
    if (g.output == "json") {
      std::cout << ToJson(*r) << "\n";
    } else {
      std::cout << fmt::format("projection rebuilt: {} events replayed, {} nodes, {} slots\n",
                               r->events_replayed(), r->nodes(), r->slots());
    }
    return 0;
  }
  return 0;
}
