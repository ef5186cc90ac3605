// gpuaasctl node drain/undrain/maintenance/mode/decommission/holders: host operations (inventory)
// and the allocations holding a node (the scheduler).
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ctl {

namespace {

void PrintAdmin(const v1::NodeAdminResponse& r, const std::string& verb) {
  const auto& n = r.node();
  std::cout << fmt::format("node {} {}: {} (generation {})\n", n.node_id(),
                           r.changed() ? verb : "unchanged", Txt(n.admin_state()), n.generation());
  if (n.has_drain_deadline()) std::cout << "deadline: " << Time(n.drain_deadline()) << "\n";
  if (r.holding_allocations_size() > 0) {
    std::cout << fmt::format(
        "held by {} allocation(s): {}; see gpuaasctl node holders --id {}\n",
        r.holding_allocations_size(),
        Join({r.holding_allocations().begin(), r.holding_allocations().end()}, ", "), n.node_id());
  }
}

void PrintHolders(const v1::ListNodeHoldersResponse& r) {
  std::cout << fmt::format("node {}: {} in the scheduler's projection (generation {})\n",
                           r.node().node_id(), Txt(r.node().admin_state()), r.node().generation());
  std::vector<std::vector<std::string>> rows;
  for (const auto& h : r.holders()) {
    rows.push_back({h.allocation_id(), h.tenant(), Txt(h.state()), Txt(h.shape()),
                    h.slot_keys_size() == 0
                        ? "(whole node)"
                        : Join({h.slot_keys().begin(), h.slot_keys().end()}, ","),
                    Time(h.created_at())});
  }
  if (rows.empty()) {
    std::cout << "no allocation holds it\n";
    return;
  }
  PrintTable({"ALLOCATION", "TENANT", "STATE", "SHAPE", "SLOTS", "CREATED"}, rows);
  std::cout << "force-release one (audited): gpuaasctl alloc release --id <allocation> --force "
               "--reason ...\n";
}

}  // namespace

Action AddHostCommands(CLI::App& node) {
  struct Opts {
    std::string id, reason, deadline, mode;
  };
  auto o = std::make_shared<Opts>();
  auto* drain = node.add_subcommand(
      "drain", "Take a node out of placement; its allocations run on until released");
  auto* undrain = node.add_subcommand("undrain", "Return a draining or drained node to service");
  auto* maint = node.add_subcommand(
      "maintenance", "Put a drained node into maintenance (back when its agent's checks pass)");
  auto* retire = node.add_subcommand(
      "decommission", "Retire a drained node for good (then revoke its key: node revoke)");
  auto* mode = node.add_subcommand(
      "mode", "Change a drained node's mode: slice-vm | baremetal (the agent rebinds its devices)");
  OneOfEnum<v1::CapacityProfile>(mode->add_option("--mode", o->mode, "The new mode")->required());
  for (auto* c : {drain, undrain, maint, retire, mode}) {
    c->add_option("--id", o->id, "Node id")->required();
    c->add_option("--reason", o->reason, "Why (kept with the node and its event)")->required();
  }
  drain->add_option("--deadline", o->deadline,
                    "When its allocations should be gone: 90s, 30m, 24h, 7d (default: none)");
  auto* holders = node.add_subcommand("holders", "The allocations holding a node (scheduler)");
  holders->add_option("--id", o->id, "Node id")->required();

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (drain->parsed()) {
      v1::DrainNodeRequest req;
      req.set_node_id(o->id);
      req.set_reason(o->reason);
      if (!o->deadline.empty()) {
        auto s = ParseSeconds(o->deadline);
        if (!s) {
          return Usage(
              g, Error::InvalidArgument(reason::kDeadlineInvalid,
                                        "--deadline: a number with s, m, h or d: " + o->deadline));
        }
        req.set_deadline_s(*s);
      }
      auto r =
          client.Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.drain", req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintAdmin(*r, "drain accepted"); });
    }
    struct Simple {
      CLI::App* cmd;
      const char* subject;
      const char* verb;
    };
    for (const Simple& op :
         {Simple{undrain, "gpuaas.v1.inventory.node.undrain", "undrained"},
          Simple{maint, "gpuaas.v1.inventory.node.maintenance", "in maintenance"},
          Simple{retire, "gpuaas.v1.inventory.node.decommission", "decommissioned"}}) {
      if (!op.cmd->parsed()) continue;
      v1::NodeAdminRequest req;
      req.set_node_id(o->id);
      req.set_reason(o->reason);
      auto r = client.Call<v1::NodeAdminResponse>(op.subject, req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        PrintAdmin(*r, op.verb);
        if (op.cmd == retire) {
          std::cout << fmt::format(
              "now remove its NATS key: gpuaasctl node revoke {} --keys DIR --nats-config FILE "
              "--reload-pid-file PIDFILE\n",
              o->id);
        }
      });
    }
    if (mode->parsed()) {
      v1::ChangeNodeModeRequest req;
      req.set_node_id(o->id);
      req.set_mode(enums::FromColumn<v1::CapacityProfile>(o->mode));
      req.set_reason(o->reason);
      auto r =
          client.Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        PrintAdmin(*r, "mode change started");
        if (r->node().mode_target() != v1::CAPACITY_PROFILE_UNSPECIFIED) {
          std::cout << fmt::format(
              "to {}: the agent rebinds the node's devices; see gpuaasctl node show --id {}\n",
              Txt(r->node().mode_target()), o->id);
        }
      });
    }
    if (holders->parsed()) {
      v1::ListNodeHoldersRequest req;
      req.set_node_id(o->id);
      auto r = client.Call<v1::ListNodeHoldersResponse>("gpuaas.v1.scheduler.node.holders", req,
                                                        g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintHolders(*r); });
    }
    return std::nullopt;
  };
}

}  // namespace gpuaas::ctl
