// gpuaasctl status: the platform's health in a few lines, for a newcomer and for scripts. It asks
// the services what they already answer (inventory node.list and node.show per node, scheduler
// slot.list and allocation.list, ipam drift.list per node) and reads GPUAAS_DLQ when the role
// may, then prints nodes by state, slots free/held/blocked/degraded, allocations by state, open
// IPAM drift and dead letters, and for everything that needs an operator: why, and the command
// that shows more. Exit 0 when nothing needs attention, 4 (kExitOutcome) when something does.
#include <google/protobuf/util/time_util.h>
#include <algorithm>
#include <functional>

#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ctl.hpp"
#include "gpuaas/common/dlq.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ctl {

// The action of `status`: it reads GPUAAS_DLQ over the connection besides its requests.
using StatusAction =
    std::function<std::optional<int>(messaging::Connection&, rpc::Client&, const Globals&)>;
StatusAction AddStatusCommand(CLI::App& app);

namespace {

using json = nlohmann::ordered_json;

// At most this many dead letters are read (the count shows "100+" beyond).
constexpr size_t kDeadLetterLimit = 100;

// Something an operator should look at: what it is, its state, why, and where to look closer.
struct Attention {
  std::string what;  // node | slot | allocation | ipam_drift | dead_letters | service
  std::string id;
  std::string state;
  std::string reason;
  std::string command;
};

struct Summary {
  // Whether inventory's node list, the scheduler's slot list and allocation list answered.
  bool nodes_known = true, slots_known = true, allocations_known = true;
  int nodes_total = 0;
  std::map<std::string, int> nodes;  // state -> count
  int slots_total = 0;
  std::map<std::string, int> slots;  // free | held | blocked | degraded -> count
  int allocations_total = 0;
  std::map<std::string, int> allocations;  // state text -> count
  int drift_open = 0;
  std::optional<size_t> dead_letters;  // nullopt: not read (see dead_letters_note)
  std::string dead_letters_note;
  std::vector<Attention> attention;
  std::set<std::string> slots_listed;  // node/slot_key of the slots in `attention`
  std::vector<std::string> notes;      // worth knowing, nothing to fix
  bool Healthy() const { return attention.empty(); }
};

std::string Describe(const Error& e) {
  return fmt::format("{} {}: {}", CodeName(e.code), e.reason, e.message);
}

// A list a service did not answer: the summary cannot vouch for that part.
void Unanswered(Summary& s, const std::string& service, const std::string& subject, const Error& e,
                const std::string& command) {
  s.attention.push_back({"service", service, "unanswered", subject + ": " + Describe(e), command});
}

// Every node inventory knows, each as node.show sees it (blockers, snapshot, slots, versions).
std::vector<v1::ShowNodeResponse> ShowNodes(rpc::Client& client, const Globals& g, Summary& s) {
  v1::ListNodesResponse all;
  auto r = ListAll<v1::ListNodesResponse>(
      client, "gpuaas.v1.inventory.node.list", v1::ListNodesRequest{}, g.Timeout(),
      [&](v1::ListNodesResponse& page) { all.mutable_nodes()->MergeFrom(page.nodes()); });
  if (!r.ok()) {
    Unanswered(s, "inventory", "node.list", r.error(), "gpuaasctl node list");
    s.nodes_known = false;
    return {};
  }
  std::vector<v1::ShowNodeResponse> out;
  for (const auto& n : all.nodes()) {
    v1::ShowNodeRequest req;
    req.set_node_id(n.node_id());
    auto show =
        client.Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", req, g.Timeout());
    if (!show.ok()) {
      Unanswered(s, "inventory", "node.show " + n.node_id(), show.error(),
                 "gpuaasctl node show --id " + n.node_id());
      continue;
    }
    out.push_back(std::move(*show));
  }
  return out;
}

// ready | blocked (node blockers) | waiting for its agent (no topology yet) | syncing (its agent
// has not acked the latest desired slot set yet) | its admin state when an operator took it out
// of service (draining, drained, maintenance, decommissioned; a drain past its deadline needs
// attention).
void AddNodes(const std::vector<v1::ShowNodeResponse>& shown, Summary& s) {
  for (const auto& n : shown) {
    const std::string& id = n.node().node_id();
    std::string state = "ready";
    const auto admin = n.node().admin_state();
    if (admin != v1::NODE_ADMIN_STATE_ACTIVE && admin != v1::NODE_ADMIN_STATE_UNSPECIFIED) {
      // Taken out of service by an operator: its admin state is its state.
      state = Txt(admin);
      const bool overdue =
          admin == v1::NODE_ADMIN_STATE_DRAINING && n.node().has_drain_deadline() &&
          google::protobuf::util::TimeUtil::GetCurrentTime() > n.node().drain_deadline();
      if (overdue) {
        s.attention.push_back(
            {"node", id, "drain overdue",
             "still held past its drain deadline (" + n.node().admin_reason() + ")",
             "gpuaasctl node holders --id " + id});
      } else {
        s.notes.push_back(fmt::format("node {}: {} ({}, by {})", id, state, n.node().admin_reason(),
                                      n.node().admin_actor()));
      }
    } else if (!n.node_blockers().empty()) {
      state = "blocked";
      s.attention.push_back(
          {"node", id, state,
           "node blockers: " +
               Join(std::vector<std::string>(n.node_blockers().begin(), n.node_blockers().end()),
                    ", "),
           "gpuaasctl node show --id " + id});
    } else if (n.snapshot_version() == 0) {
      state = "waiting for its agent";
      s.notes.push_back(fmt::format("node {}: no agent has reported its topology yet", id));
    } else if (n.applied_version() < n.desired_version()) {
      state = "syncing";
    }
    if (!n.region_enabled()) {
      s.notes.push_back(fmt::format("node {}: region {} is disabled (gpuaasctl region list)", id,
                                    n.node().region()));
    }
    ++s.nodes[state];
    ++s.nodes_total;
  }
}

// Open IPAM drift per node: one attention item per record that no degraded slot already shows.
// Returns the slots (node/slot_key) with open drift.
std::set<std::string> AddDrift(rpc::Client& client, const Globals& g,
                               const std::vector<v1::ShowNodeResponse>& shown, Summary& s,
                               std::vector<v1::IpamDrift>& records) {
  std::set<std::string> slots;
  for (const auto& n : shown) {
    v1::ListDriftRequest req;
    req.set_node_id(n.node().node_id());
    auto r = client.Call<v1::ListDriftResponse>("gpuaas.v1.ipam.drift.list", req, g.Timeout());
    if (!r.ok()) {
      Unanswered(s, "ipam", "drift.list " + req.node_id(), r.error(),
                 "gpuaasctl ipam drift --node " + req.node_id());
      continue;
    }
    for (const auto& d : r->drift()) {
      if (d.has_resolved_at()) continue;
      ++s.drift_open;
      if (!d.slot_key().empty()) slots.insert(d.node_id() + "/" + d.slot_key());
      records.push_back(d);
    }
  }
  return slots;
}

// Why a slot nobody holds is not schedulable, and whether that needs an operator (an approval
// rejection, or no stated reason) or is a decision someone made (disabled, region off).
std::pair<std::string, bool> WhyBlocked(const v1::ProjectedSlot& p, const v1::Slot* inv,
                                        bool region_enabled) {
  std::vector<std::string> why;
  bool attention = false;
  if (p.admin_state() != v1::SLOT_ADMIN_STATE_AVAILABLE) {
    const std::string said = inv != nullptr ? inv->disabled_reason() : "";
    why.push_back("disabled: " + Or(said, "no reason given"));
    attention = inv != nullptr && !inv->rejections().empty();
  }
  for (const auto& b : p.node_blockers()) why.push_back("node blocker " + b);
  if (!region_enabled) why.push_back("region " + p.region() + " disabled");
  if (why.empty()) {
    why.emplace_back("not schedulable, for no stated reason");
    attention = true;
  }
  return {Join(why, "; "), attention};
}

// One slot of the scheduler's projection: free, held, blocked or degraded, with the reason and
// command for anything not healthy. `inv` is inventory's record of it (nullptr when unknown).
void AddSlot(const v1::ProjectedSlot& p, const v1::Slot* inv, bool region_enabled,
             const std::set<std::string>& drifting, Summary& s) {
  const std::string id = p.node_id() + "/" + p.slot_key();
  const std::string repair =
      fmt::format("gpuaasctl slot repair --node {} --slot {}", p.node_id(), p.slot_key());
  std::string state;
  if (p.lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED) {
    state = "blocked";
    s.attention.push_back(
        {"slot", id, "cleanup_blocked",
         fmt::format("allocation {}'s host teardown failed or went unanswered", p.allocation_id()),
         repair});
  } else if (p.health() == v1::SLOT_HEALTH_DEGRADED || p.health() == v1::SLOT_HEALTH_FAILED) {
    state = "degraded";
    const std::string detail = inv != nullptr ? inv->health_detail() : "";
    // ipam's drift clears itself once the lease is right again; repair does not clear it.
    const bool ipam = drifting.count(id) > 0;
    s.attention.push_back({"slot", id, Txt(p.health()), Or(detail, "no detail"),
                           ipam ? "gpuaasctl ipam drift --node " + p.node_id() : repair});
  } else if (!p.allocation_id().empty()) {
    state = "held";
  } else if (p.schedulable()) {
    state = "free";
  } else {
    state = "blocked";
    auto [why, attention] = WhyBlocked(p, inv, region_enabled);
    if (attention) {
      s.attention.push_back(
          {"slot", id, "blocked", why, "gpuaasctl node show --id " + p.node_id()});
    } else {
      s.notes.push_back(fmt::format("slot {}: {}", id, why));
    }
  }
  if (!s.attention.empty() && s.attention.back().id == id) s.slots_listed.insert(id);
  ++s.slots[state];
  ++s.slots_total;
}

void AddSlots(rpc::Client& client, const Globals& g, const std::vector<v1::ShowNodeResponse>& shown,
              const std::set<std::string>& drifting, Summary& s) {
  v1::ListProjectedSlotsResponse all;
  auto r = ListAll<v1::ListProjectedSlotsResponse>(
      client, "gpuaas.v1.scheduler.slot.list", v1::ListProjectedSlotsRequest{}, g.Timeout(),
      [&](v1::ListProjectedSlotsResponse& page) { all.mutable_slots()->MergeFrom(page.slots()); });
  if (!r.ok()) {
    Unanswered(s, "scheduler", "slot.list", r.error(), "gpuaasctl scheduler slots");
    s.slots_known = false;
    return;
  }
  std::map<std::string, const v1::Slot*> inv;
  std::set<std::string> region_off;  // nodes whose region is disabled
  for (const auto& n : shown) {
    for (const auto& slot : n.slots()) inv[slot.node_id() + "/" + slot.slot_key()] = &slot;
    if (!n.region_enabled()) region_off.insert(n.node().node_id());
  }
  for (const auto& p : all.slots()) {
    auto it = inv.find(p.node_id() + "/" + p.slot_key());
    AddSlot(p, it == inv.end() ? nullptr : it->second, region_off.count(p.node_id()) == 0, drifting,
            s);
  }
}

// IPAM drift no degraded slot shows (an unexpected lease, or drift inventory has not shown yet).
void AddDriftAttention(const std::vector<v1::IpamDrift>& records, Summary& s) {
  for (const auto& d : records) {
    const std::string id = d.node_id() + "/" + Or(d.slot_key(), d.mac());
    if (s.slots_listed.count(id) > 0) continue;
    s.attention.push_back(
        {"ipam_drift", id, d.kind(), d.detail(), "gpuaasctl ipam drift --node " + d.node_id()});
  }
}

// Allocations by state; a failed one still holding claims, or a release that failed, needs an
// operator.
void AddAllocations(rpc::Client& client, const Globals& g, Summary& s) {
  v1::ListAllocationsResponse all;
  auto r = ListAll<v1::ListAllocationsResponse>(
      client, "gpuaas.v1.scheduler.allocation.list", v1::ListAllocationsRequest{}, g.Timeout(),
      [&](v1::ListAllocationsResponse& page) {
        all.mutable_allocations()->MergeFrom(page.allocations());
      });
  if (!r.ok()) {
    Unanswered(s, "scheduler", "allocation.list", r.error(), "gpuaasctl alloc list");
    s.allocations_known = false;
    return;
  }
  for (const auto& a : all.allocations()) {
    ++s.allocations[Txt(a.state())];
    ++s.allocations_total;
    bool holds = false;
    for (const auto& c : a.claims()) holds = holds || !c.has_released_at();
    const bool stuck = (a.state() == v1::ALLOCATION_STATE_FAILED && holds) ||
                       (a.state() == v1::ALLOCATION_STATE_RELEASING && a.has_failure());
    if (!stuck) continue;
    s.attention.push_back(
        {"allocation", a.allocation_id(), Txt(a.state()),
         fmt::format("{}: {}{}", Or(a.failure().code(), "no failure recorded"),
                     a.failure().detail(), holds ? " (still holds its claims)" : ""),
         "gpuaasctl alloc timeline --id " + a.allocation_id()});
  }
}

// Dead letters (GPUAAS_DLQ): a role that may not read streams gets a note, not an alarm.
void AddDeadLetters(messaging::Connection& conn, Summary& s) {
  auto entries = dlq::ListNewest(conn, "", "", kDeadLetterLimit);
  if (!entries.ok()) {
    if (entries.error().code == Code::kPermissionDenied) {
      s.dead_letters_note = "not readable by this role (operator or auditor may)";
      return;
    }
    s.dead_letters_note = "unreadable";
    s.attention.push_back(
        {"service", "GPUAAS_DLQ", "unreadable", Describe(entries.error()), "gpuaasctl dlq list"});
    return;
  }
  s.dead_letters = entries->size();
  if (entries->empty()) return;
  v1::DeadLetter newest;
  std::string what = "not a gpuaas.v1.DeadLetter";
  if (newest.ParseFromString(entries->front().data)) {
    what = fmt::format("{}/{} {}: {}", newest.stream(), newest.consumer(), Or(newest.kind()),
                       newest.reason());
  }
  s.attention.push_back(
      {"dead_letters", "GPUAAS_DLQ",
       fmt::format("{}{}", entries->size(), entries->size() >= kDeadLetterLimit ? "+" : ""),
       "newest: " + what, "gpuaasctl dlq list"});
}

// "4 ready, 1 waiting for its agent" in `order`, then any other key.
std::string Counts(const std::map<std::string, int>& counts,
                   const std::vector<std::string>& order) {
  std::vector<std::string> parts;
  for (const auto& k : order) {
    auto it = counts.find(k);
    parts.push_back(fmt::format("{} {}", it == counts.end() ? 0 : it->second, k));
  }
  for (const auto& [k, n] : counts) {
    if (std::find(order.begin(), order.end(), k) == order.end()) {
      parts.push_back(fmt::format("{} {}", n, k));
    }
  }
  return parts.empty() ? "none" : Join(parts, ", ");
}

// "<total>: <counts>", or why the count is unknown.
std::string Line(bool known, int total, const std::map<std::string, int>& counts,
                 const std::vector<std::string>& order) {
  if (!known) return "unknown (not answered, below)";
  return fmt::format("{}: {}", total, Counts(counts, order));
}

const std::vector<std::string>& SlotStates() {
  static const std::vector<std::string> kStates = {"free", "held", "blocked", "degraded"};
  return kStates;
}

std::string DeadLetterLine(const Summary& s) {
  if (!s.dead_letters) return s.dead_letters_note;
  return fmt::format("{}{}", *s.dead_letters, *s.dead_letters >= kDeadLetterLimit ? "+" : "");
}

void PrintText(const Summary& s) {
  std::cout << fmt::format("nodes         {}\n",
                           Line(s.nodes_known, s.nodes_total, s.nodes, {"ready"}));
  std::cout << fmt::format("slots         {}\n",
                           Line(s.slots_known, s.slots_total, s.slots, SlotStates()));
  std::cout << fmt::format("allocations   {}\n",
                           Line(s.allocations_known, s.allocations_total, s.allocations, {}));
  std::cout << fmt::format("ipam drift    {} open\n", s.drift_open);
  std::cout << fmt::format("dead letters  {}\n", DeadLetterLine(s));
  for (const auto& n : s.notes) std::cout << "note: " << n << "\n";
  if (s.Healthy()) {
    std::cout << "healthy: nothing needs attention\n";
    return;
  }
  std::cout << fmt::format("needs attention ({}):\n", s.attention.size());
  for (const auto& a : s.attention) {
    std::cout << fmt::format("  {} {}  {}: {}\n    look closer: {}\n", a.what, a.id, a.state,
                             a.reason, a.command);
  }
}

json ToJsonDoc(const Summary& s) {
  json j;
  j["healthy"] = s.Healthy();
  j["nodes"] = {{"answered", s.nodes_known}, {"total", s.nodes_total}, {"by_state", s.nodes}};
  json slots = {{"answered", s.slots_known}, {"total", s.slots_total}};
  for (const auto& k : SlotStates()) slots[k] = s.slots.count(k) > 0 ? s.slots.at(k) : 0;
  j["slots"] = slots;
  j["allocations"] = {{"answered", s.allocations_known},
                      {"total", s.allocations_total},
                      {"by_state", s.allocations}};
  j["ipam_drift"] = {{"open", s.drift_open}};
  if (s.dead_letters) {
    j["dead_letters"] = {{"count", *s.dead_letters}, {"more", *s.dead_letters >= kDeadLetterLimit}};
  } else {
    j["dead_letters"] = {{"note", s.dead_letters_note}};
  }
  j["notes"] = s.notes;
  j["attention"] = json::array();
  for (const auto& a : s.attention) {
    j["attention"].push_back({{"what", a.what},
                              {"id", a.id},
                              {"state", a.state},
                              {"reason", a.reason},
                              {"command", a.command}});
  }
  return j;
}

int RunStatus(messaging::Connection& conn, rpc::Client& client, const Globals& g) {
  Summary s;
  const auto shown = ShowNodes(client, g, s);
  AddNodes(shown, s);
  std::vector<v1::IpamDrift> drift;
  const auto drifting = AddDrift(client, g, shown, s, drift);
  AddSlots(client, g, shown, drifting, s);
  AddDriftAttention(drift, s);
  AddAllocations(client, g, s);
  AddDeadLetters(conn, s);
  if (g.Json()) {
    std::cout << ToJsonDoc(s).dump(2) << "\n" << std::flush;
  } else {
    PrintText(s);
  }
  return s.Healthy() ? kExitOk : kExitOutcome;
}

}  // namespace

StatusAction AddStatusCommand(CLI::App& app) {
  auto* status = app.add_subcommand(
      "status",
      "The platform's health: nodes, slots, allocations, IPAM drift and dead letters; exit 0 "
      "when nothing needs attention, 4 when something does (each with the command to look "
      "closer)");
  return [status](messaging::Connection& conn, rpc::Client& client,
                  const Globals& g) -> std::optional<int> {
    if (!status->parsed()) return std::nullopt;
    return RunStatus(conn, client, g);
  };
}

}  // namespace gpuaas::ctl
