// gpuaasctl: node discover/show, slot approve/disable/repair, disk wipe-proof, availability,
// region list/set, scheduler slots.
#include <cctype>
#include <chrono>
#include <iostream>
#include <memory>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::ctl {

namespace {

std::string Numa(const v1::CandidateSlot& c) {
  return c.has_numa_node() ? std::to_string(c.numa_node()) : "?";
}

std::string CheckWord(v1::CheckStatus s) {
  std::string word = Txt(s, "?");
  for (char& c : word) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return word;
}

std::string Reasons(const google::protobuf::RepeatedPtrField<v1::SlotRejection>& rs) {
  std::vector<std::string> out;
  for (const auto& r : rs) out.push_back(r.reason());
  return Join(out);
}

void PrintShow(const v1::ShowNodeResponse& r) {
  const auto& n = r.node();
  std::cout << fmt::format("node {}  host {}  region {}{}  pool {}  agent {}\n", n.node_id(),
                           n.hostname(), n.region(), r.region_enabled() ? "" : " (disabled)",
                           n.pool(), n.agent_version());
  std::cout << fmt::format("admin: {}{}{}\n", Txt(n.admin_state()),
                           n.admin_reason().empty()
                               ? ""
                               : fmt::format(" ({}, by {})", n.admin_reason(), n.admin_actor()),
                           n.has_drain_deadline() ? "  deadline " + Time(n.drain_deadline()) : "");
  std::cout << fmt::format(
      "mode: {}{}{}\n", Txt(n.capacity_profile()),
      n.mode_target() == v1::CAPACITY_PROFILE_UNSPECIFIED
          ? ""
          : " (changing to " + Txt(n.mode_target()) + ")",
      n.mode_blockers_size() == 0
          ? ""
          : "  last change failed: " +
                Join({n.mode_blockers().begin(), n.mode_blockers().end()}, ", "));
  if (r.snapshot_version() == 0) {
    std::cout << "topology: none reported yet (gpuaasctl node discover --id " << n.node_id()
              << ")\n";
  } else {
    const auto& t = r.topology();
    std::cout << fmt::format(
        "topology: snapshot {} at {}  gpus {}  nvme {}  fabric {}  reboot_required {}\n",
        r.snapshot_version(), Time(r.snapshot_at()), t.gpus_size(), t.nvme_size(), t.fabric_size(),
        t.reboot_required() ? "yes" : "no");
  }
  std::vector<std::string> blockers(r.node_blockers().begin(), r.node_blockers().end());
  std::cout << "blockers: " << (blockers.empty() ? "none" : Join(blockers, ", ")) << "\n";
  std::cout << fmt::format("desired slot set: version {}, agent applied {}\n", r.desired_version(),
                           r.applied_version());
  if (r.snapshot_version() > 0) {
    std::vector<std::vector<std::string>> checks;
    for (const auto* list : {&r.topology().prereqs(), &r.topology().network_checks()}) {
      for (const auto& c : *list) {
        if (c.status() == v1::CHECK_STATUS_PASS) continue;
        checks.push_back({CheckWord(c.status()), c.name(), c.blocker() ? "yes" : "", c.detail()});
      }
    }
    if (!checks.empty()) {
      std::cout << "\nchecks not passing:\n";
      PrintTable({"STATUS", "CHECK", "BLOCKER", "DETAIL"}, checks);
    }
    std::cout << "\ncandidates (advisory):\n";
    std::vector<std::vector<std::string>> rows;
    for (const auto& c : r.topology().candidates()) {
      rows.push_back({c.slot_key(), std::to_string(c.index()), Numa(c), c.locality_group(),
                      c.nvme_by_id().empty() ? "-" : c.nvme_by_id(), Txt(c.fabric_claim_mode()),
                      c.fabric_vf_pci_address().empty() ? "-" : c.fabric_vf_pci_address()});
    }
    PrintTable({"SLOT", "IDX", "NUMA", "LOCALITY", "NVME", "FABRIC", "VF"}, rows);
  }
  std::cout << "\nslots:\n";
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : r.slots()) {
    rows.push_back({s.slot_key(), Txt(s.admin_state()), Txt(s.health()), s.sku(),
                    s.mac().empty() ? "-" : s.mac(), s.private_ip().empty() ? "-" : s.private_ip(),
                    std::to_string(s.generation()),
                    s.rejections().empty() ? s.disabled_reason() : Reasons(s.rejections())});
  }
  PrintTable({"SLOT", "ADMIN", "HEALTH", "SKU", "MAC", "IP", "GEN", "NOTE"}, rows);
  if (!r.drift().empty()) {
    std::cout << "\ndrift:\n";
    std::vector<std::vector<std::string>> d;
    for (const auto& x : r.drift()) {
      d.push_back({x.slot_key().empty() ? "(node)" : x.slot_key(), x.kind(), x.detail()});
    }
    PrintTable({"SLOT", "KIND", "DETAIL"}, d);
  }
  if (!r.recent_tasks().empty()) {
    std::cout << "\nrecent tasks:\n";
    std::vector<std::vector<std::string>> t;
    for (const auto& x : r.recent_tasks()) {
      t.push_back({x.task_id(), Txt(x.type()), Txt(x.status()), Time(x.queued_at()), x.error()});
    }
    PrintTable({"TASK", "TYPE", "STATUS", "QUEUED", "ERROR"}, t);
  }
}

void PrintApprovals(const google::protobuf::RepeatedPtrField<v1::SlotApproval>& results) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& a : results) {
    std::vector<std::string> why;
    for (const auto& r : a.rejections()) why.push_back(r.reason() + ": " + r.message());
    rows.push_back({a.slot_key(), a.approved() ? "approved" : "rejected",
                    Txt(a.slot().admin_state()), a.slot().mac().empty() ? "-" : a.slot().mac(),
                    a.slot().private_ip().empty() ? "-" : a.slot().private_ip(), Join(why, "; ")});
  }
  PrintTable({"SLOT", "RESULT", "ADMIN", "MAC", "IP", "REASONS"}, rows);
}

// The scheduler's view of one slot, or nullopt (the error already printed in *rc).
std::optional<v1::ProjectedSlot> SchedulerSlot(rpc::Client& client, const Globals& g,
                                               const std::string& node, const std::string& slot,
                                               int* rc) {
  v1::ListProjectedSlotsRequest req;
  req.set_node_id(node);
  std::optional<v1::ProjectedSlot> found;
  auto r = ListAll<v1::ListProjectedSlotsResponse>(client, "gpuaas.v1.scheduler.slot.list", req,
                                                   g.Timeout(),
                                                   [&](v1::ListProjectedSlotsResponse& page) {
                                                     for (const auto& s : page.slots()) {
                                                       if (s.slot_key() == slot) found = s;
                                                     }
                                                   });
  if (!r.ok()) {
    *rc = Fail(g, r.error());
    return std::nullopt;
  }
  if (found) return found;
  *rc = kExitOk;
  return v1::ProjectedSlot();  // not projected (yet): nothing of the scheduler's to repair
}

// slot repair, the scheduler's half: a claim left cleanup_blocked (a release or cleanup that
// failed or went unanswered, e.g. after a force-release on a node that was down) is released
// again by the operator, which sends the host's teardown once more; the slot is freed only by
// the cleanup proof, never here. Waits up to `wait_s` for the outcome. kExitOk when the slot
// holds no blocked claim any more (or never did).
int RepairClaim(rpc::Client& client, const Globals& g, const std::string& node,
                const std::string& slot, int wait_s) {
  int rc = kExitOk;
  auto s = SchedulerSlot(client, g, node, slot, &rc);
  if (!s) return rc;
  if (s->allocation_id().empty()) return kExitOk;
  const std::string id = s->allocation_id();
  const bool blocked = s->lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED;
  const bool cleaning = s->lifecycle() == v1::SLOT_LIFECYCLE_STATE_RELEASING ||
                        s->lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP;
  if (!blocked && !cleaning) {
    if (!g.Json()) {
      std::cout << fmt::format(
          "slot {} is held by allocation {} ({}); not a repair: release the allocation to free "
          "it\n",
          slot, id, Txt(s->lifecycle()));
    }
    return kExitOk;
  }
  if (blocked) {
    v1::ReleaseAllocationRequest req;
    req.set_allocation_id(id);
    req.set_reason(fmt::format("slot repair {} {}", node, slot));
    auto r = client.Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release",
                                                        req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    if (!g.Json()) {
      std::cout << fmt::format(
          "slot {} cleanup_blocked by allocation {} ({}): host teardown sent again; waiting for "
          "its cleanup proof\n",
          slot, id, Txt(r->allocation().state()));
    }
  }
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(wait_s);
  v1::GetAllocationTimelineRequest t;
  t.set_allocation_id(id);
  t.set_page_size(1);
  while (true) {
    auto r = client.Call<v1::GetAllocationTimelineResponse>(
        "gpuaas.v1.scheduler.allocation.timeline", t, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    if (!r->in_flight()) break;
    if (std::chrono::steady_clock::now() > until) {
      std::cerr << fmt::format(
          "the teardown of allocation {} is still in flight after {}s (is node {} answering?); "
          "the slot stays blocked until its cleanup proof\n",
          id, wait_s, node);
      return kExitUnreachable;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  s = SchedulerSlot(client, g, node, slot, &rc);
  if (!s) return rc;
  if (s->allocation_id() == id) {
    v1::GetAllocationRequest one;
    one.set_allocation_id(id);
    auto a = client.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", one,
                                                    g.Timeout());
    std::string why = "no failure recorded";
    if (a.ok() && a->allocation().has_failure()) {
      why = a->allocation().failure().code() + ": " + a->allocation().failure().detail();
    }
    std::cerr << fmt::format(
        "slot {} is still {} by allocation {} ({}); see gpuaasctl alloc timeline --id {}\n", slot,
        Txt(s->lifecycle()), id, why, id);
    return kExitOutcome;
  }
  if (!g.Json()) {
    std::cout << fmt::format("slot {}: cleanup proven, allocation {}'s claim freed\n", slot, id);
  }
  return kExitOk;
}

// node discover: asks the node's agent to report its topology.
Action AddNodeDiscover(CLI::App& node) {
  auto id = std::make_shared<std::string>();
  auto* discover = node.add_subcommand("discover", "Ask the node's agent to report its topology");
  discover->add_option("--id", *id, "Node id")->required();
  return [discover, id](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!discover->parsed()) return std::nullopt;
    v1::DiscoverNodeRequest req;
    req.set_node_id(*id);
    auto r = client.Call<v1::DiscoverNodeResponse>("gpuaas.v1.inventory.node.discover", req,
                                                   g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format("discovery task {} sent to {}; see `gpuaasctl node show --id {}`\n",
                               r->task_id(), *id, *id);
    });
  };
}

// node show: what inventory knows of a node.
Action AddNodeShow(CLI::App& node) {
  auto id = std::make_shared<std::string>();
  auto* show = node.add_subcommand(
      "show", "Evidence, blockers, candidates, slots, drift and tasks of a node");
  show->add_option("--id", *id, "Node id")->required();
  return [show, id](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!show->parsed()) return std::nullopt;
    v1::ShowNodeRequest req;
    req.set_node_id(*id);
    auto r = client.Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintShow(*r); });
  };
}

// slot approve: approves candidate slots of a snapshot; exit 4 when one was rejected.
Action AddSlotApprove(CLI::App& slot) {
  struct Opts {
    std::string node;
    int64_t snapshot = 0;
    std::vector<std::string> slots;
  };
  auto o = std::make_shared<Opts>();
  auto* approve = slot.add_subcommand("approve", "Approve candidate slot(s) of a snapshot");
  approve->add_option("--node", o->node, "Node id")->required();
  approve->add_option("--snapshot", o->snapshot, "Snapshot version (default: latest)");
  approve->add_option("--slot", o->slots, "Slot key (repeatable; default: every candidate)");
  return [approve, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!approve->parsed()) return std::nullopt;
    v1::ApproveSlotsRequest req;
    req.set_node_id(o->node);
    req.set_snapshot_version(o->snapshot);
    for (const auto& s : o->slots) req.add_slot_keys(s);
    auto r =
        client.Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    Print(g, *r, [&] {
      std::cout << fmt::format("snapshot {}; desired slot set version {}\n", r->snapshot_version(),
                               r->desired_version());
      PrintApprovals(r->results());
    });
    for (const auto& a : r->results()) {
      if (!a.approved()) return kExitOutcome;  // something was rejected: scripts can tell
    }
    return kExitOk;
  };
}

// slot disable: takes a slot out of sale.
Action AddSlotDisable(CLI::App& slot) {
  struct Opts {
    std::string node, slot, reason;
  };
  auto o = std::make_shared<Opts>();
  auto* disable = slot.add_subcommand("disable", "Take a slot out of sale");
  disable->add_option("--node", o->node, "Node id")->required();
  disable->add_option("--slot", o->slot, "Slot key")->required();
  disable->add_option("--reason", o->reason, "Why (shown in node show)");
  return [disable, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!disable->parsed()) return std::nullopt;
    v1::DisableSlotRequest req;
    req.set_node_id(o->node);
    req.set_slot_key(o->slot);
    req.set_reason(o->reason);
    auto r =
        client.Call<v1::DisableSlotResponse>("gpuaas.v1.inventory.slot.disable", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format("slot {} disabled ({}); desired slot set version {}\n",
                               r->slot().slot_key(), r->slot().disabled_reason(),
                               r->desired_version());
    });
  };
}

// slot repair: the scheduler's half (RepairClaim), then inventory re-validates the slot; exit 4
// when it is rejected.
Action AddSlotRepair(CLI::App& slot) {
  struct Opts {
    std::string node, slot;
    int wait_s = 120;
  };
  auto o = std::make_shared<Opts>();
  auto* repair = slot.add_subcommand(
      "repair",
      "Bring a slot back: a cleanup_blocked claim is cleaned again (the host's cleanup proof "
      "frees it), then the slot is re-validated against the latest evidence (clears drift)");
  repair->add_option("--node", o->node, "Node id")->required();
  repair->add_option("--slot", o->slot, "Slot key")->required();
  repair->add_option("--wait-s", o->wait_s, "How long to wait for the cleanup proof (default 120)");
  return [repair, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!repair->parsed()) return std::nullopt;
    if (int rc = RepairClaim(client, g, o->node, o->slot, o->wait_s); rc != kExitOk) return rc;
    v1::RepairSlotRequest req;
    req.set_node_id(o->node);
    req.set_slot_key(o->slot);
    auto r =
        client.Call<v1::RepairSlotResponse>("gpuaas.v1.inventory.slot.repair", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    Print(g, *r, [&] {
      google::protobuf::RepeatedPtrField<v1::SlotApproval> one;
      *one.Add() = r->result();
      PrintApprovals(one);
    });
    return r->result().approved() ? kExitOk : kExitOutcome;
  };
}

// disk wipe-proof: records that a slot disk was wiped.
Action AddDiskWipeProof(CLI::App& disk) {
  struct Opts {
    std::string node, nvme, method, evidence;
  };
  auto o = std::make_shared<Opts>();
  auto* wipe = disk.add_subcommand("wipe-proof", "Record that a disk was wiped");
  wipe->add_option("--node", o->node, "Node id")->required();
  wipe->add_option("--nvme", o->nvme, "/dev/disk/by-id/... path")->required();
  Suggest(wipe->add_option("--method", o->method, "blkdiscard | nvme-format | wipefs")->required(),
          {"blkdiscard", "nvme-format", "wipefs"});
  wipe->add_option("--evidence", o->evidence, "What proves it (command output, ticket)")
      ->required();
  return [wipe, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!wipe->parsed()) return std::nullopt;
    v1::RecordWipeProofRequest req;
    req.set_node_id(o->node);
    req.set_nvme_by_id(o->nvme);
    req.set_method(o->method);
    req.set_evidence(o->evidence);
    auto r = client.Call<v1::RecordWipeProofResponse>("gpuaas.v1.inventory.disk.wipe_proof.record",
                                                      req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format("wipe proof for {} on {} recorded at {}\n", o->nvme, o->node,
                               Time(r->recorded_at()));
    });
  };
}

// availability: sellable slots per region/pool/SKU.
Action AddAvailability(CLI::App& app) {
  auto region = std::make_shared<std::string>();
  auto* avail = app.add_subcommand("availability", "Sellable slots per region/pool/SKU");
  avail->add_option("--region", *region, "Only this region");
  return [avail, region](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!avail->parsed()) return std::nullopt;
    v1::ListAvailabilityRequest req;
    req.set_region(*region);
    auto r = client.Call<v1::ListAvailabilityResponse>("gpuaas.v1.inventory.availability.list", req,
                                                       g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::vector<std::vector<std::string>> rows;
      for (const auto& a : r->availability()) {
        rows.push_back({a.region(), a.pool(), a.sku(), a.gpu_model(),
                        std::to_string(a.schedulable_slots()), std::to_string(a.approved_slots()),
                        std::to_string(a.nodes())});
      }
      PrintTable({"REGION", "POOL", "SKU", "MODEL", "SCHEDULABLE", "APPROVED", "NODES"}, rows);
    });
  };
}

// region list: the regions and their pools.
Action AddRegionList(CLI::App& region) {
  auto* list = region.add_subcommand("list", "List regions and their pools");
  return [list](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!list->parsed()) return std::nullopt;
    auto r = client.Call<v1::ListRegionsResponse>("gpuaas.v1.inventory.region.list",
                                                  v1::ListRegionsRequest(), g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::vector<std::vector<std::string>> rows;
      for (const auto& x : r->regions()) {
        rows.push_back({x.name(), x.enabled() ? "enabled" : "disabled",
                        Join({x.pools().begin(), x.pools().end()})});
      }
      PrintTable({"REGION", "STATE", "POOLS"}, rows);
    });
  };
}

// region set: enables or disables a region.
Action AddRegionSet(CLI::App& region) {
  struct Opts {
    std::string name, enabled;
  };
  auto o = std::make_shared<Opts>();
  auto* set = region.add_subcommand("set", "Enable or disable a region");
  set->add_option("--name", o->name, "Region")->required();
  OneOf(set->add_option("--enabled", o->enabled, "Enable (true) or disable (false)")->required(),
        {"true", "false"});
  return [set, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!set->parsed()) return std::nullopt;
    v1::SetRegionRequest req;
    req.set_name(o->name);
    req.set_enabled(o->enabled == "true");
    auto r = client.Call<v1::SetRegionResponse>("gpuaas.v1.inventory.region.set", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format("region {} {}\n", r->region().name(),
                               r->region().enabled() ? "enabled" : "disabled");
    });
  };
}

void PrintProjectedSlots(const v1::ListProjectedSlotsResponse& all) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : all.slots()) {
    rows.push_back({s.node_id(), s.slot_key(), s.region(), s.sku(), Txt(s.admin_state()),
                    Txt(s.health()), s.schedulable() ? "yes" : "no",
                    Join({s.node_blockers().begin(), s.node_blockers().end()}), Txt(s.lifecycle()),
                    s.allocation_id().empty() ? "-" : s.allocation_id().substr(0, 8),
                    std::to_string(s.generation())});
  }
  PrintTable({"NODE", "SLOT", "REGION", "SKU", "ADMIN", "HEALTH", "SCHEDULABLE", "BLOCKERS",
              "LIFECYCLE", "ALLOC", "GEN"},
             rows);
}

// scheduler slots: every page of the slots in the scheduler's projection.
Action AddSchedulerSlots(CLI::App& sched) {
  struct Opts {
    std::string node, region;
  };
  auto o = std::make_shared<Opts>();
  auto* slots = sched.add_subcommand("slots", "Slots in the scheduler's projection");
  slots->add_option("--node", o->node, "Only this node");
  slots->add_option("--region", o->region, "Only this region");
  return [slots, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!slots->parsed()) return std::nullopt;
    v1::ListProjectedSlotsRequest req;
    req.set_node_id(o->node);
    req.set_region(o->region);
    v1::ListProjectedSlotsResponse all;
    auto r = ListAll<v1::ListProjectedSlotsResponse>(client, "gpuaas.v1.scheduler.slot.list", req,
                                                     g.Timeout(),
                                                     [&](v1::ListProjectedSlotsResponse& page) {
                                                       all.mutable_slots()->MergeFrom(page.slots());
                                                     });
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, all, [&] { PrintProjectedSlots(all); });
  };
}

// A command group that needs one of its subcommands.
CLI::App& Group(CLI::App& app, const std::string& name, const std::string& description) {
  CLI::App* group = app.add_subcommand(name, description);
  group->require_subcommand(1);
  return *group;
}

}  // namespace

Action AddInventoryCommands(CLI::App& app) {
  // "node" and "scheduler" exist (AddNodeCommands); discover/show and slots join them.
  CLI::App& node = *app.get_subcommand("node");
  CLI::App& sched = *app.get_subcommand("scheduler");
  // Added in the order --help lists them: slot, disk, availability, region.
  CLI::App& slot = Group(app, "slot", "Approved node resource slots");
  CLI::App& disk = Group(app, "disk", "Slot disks");
  Action availability = AddAvailability(app);
  CLI::App& region = Group(app, "region", "Regions");
  return FirstOf<Action>({AddNodeDiscover(node), AddNodeShow(node), AddHostCommands(node),
                          AddSlotApprove(slot), AddSlotDisable(slot), AddSlotRepair(slot),
                          AddDiskWipeProof(disk), availability, AddRegionList(region),
                          AddRegionSet(region), AddSchedulerSlots(sched)});
}

}  // namespace gpuaas::ctl
