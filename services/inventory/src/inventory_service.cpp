#include "gpuaas/inventory/inventory_service.hpp"

#include <map>
#include <memory>
#include <regex>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "host_operations.hpp"
#include "inventory_handlers.hpp"
#include "node_gauges.hpp"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

const std::regex kLabel("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$");
const std::regex kHostname("^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$");

// Every request subject inventory serves, each with its handler.
void RegisterRoutes(rpc::Server& rpc, const std::shared_ptr<InventoryHandlers>& h) {
  rpc.Route("gpuaas.v1.inventory.node.{node_id}.register", h, &InventoryHandlers::NodeRegister);
  rpc.Route("gpuaas.v1.inventory.node.list", h, &InventoryHandlers::NodeList);
  rpc.Route("gpuaas.v1.inventory.node.discover", h, &InventoryHandlers::NodeDiscover);
  rpc.Route("gpuaas.v1.inventory.node.show", h, &InventoryHandlers::NodeShow);
  rpc.Route("gpuaas.v1.inventory.node.drain", h, &InventoryHandlers::NodeDrain);
  rpc.Route("gpuaas.v1.inventory.node.undrain", h, &InventoryHandlers::NodeUndrain);
  rpc.Route("gpuaas.v1.inventory.node.maintenance", h, &InventoryHandlers::NodeMaintenance);
  rpc.Route("gpuaas.v1.inventory.node.mode", h, &InventoryHandlers::NodeMode);
  rpc.Route("gpuaas.v1.inventory.node.decommission", h, &InventoryHandlers::NodeDecommission);
  rpc.Route("gpuaas.v1.inventory.slot.approve", h, &InventoryHandlers::SlotApprove);
  rpc.Route("gpuaas.v1.inventory.slot.repair", h, &InventoryHandlers::SlotRepair);
  rpc.Route("gpuaas.v1.inventory.slot.disable", h, &InventoryHandlers::SlotDisable);
  rpc.Route("gpuaas.v1.inventory.disk.wipe_proof.record", h, &InventoryHandlers::WipeProofRecord);
  rpc.Route("gpuaas.v1.inventory.availability.list", h, &InventoryHandlers::AvailabilityList);
  rpc.Route("gpuaas.v1.inventory.region.list", h, &InventoryHandlers::RegionList);
  rpc.Route("gpuaas.v1.inventory.region.set", h, &InventoryHandlers::RegionSet);
  rpc.Route("gpuaas.v1.inventory.node.{node_id}.desired.get", h, &InventoryHandlers::DesiredGet);
  rpc.Route("gpuaas.v1.inventory.node.{node_id}.desired.ack", h, &InventoryHandlers::DesiredAck);
}

// The consumers of what node-agents and ipam report.
Result<void> StartConsumers(runtime::Service& svc, const std::string& source) {
  const std::string node_events = messaging::NodeEventsStream().name;
  auto topology = svc.StartProjection(
      node_events, kTopologyConsumer, "gpuaas.v1.evt.node.*.topology",
      [source](pqxx::work& tx, const v1::Event& ev) { return ApplyTopologyEvent(tx, ev, source); });
  if (!topology.ok()) return topology.error();
  auto tasks = svc.StartProjection(node_events, kTaskConsumer, "gpuaas.v1.evt.node.*.task.>",
                                   ApplyTaskEvent);
  if (!tasks.ok()) return tasks.error();
  // IPAM drift (lease mismatch/missing/unexpected) degrades the affected slot until resolved.
  auto drift = svc.StartProjection(messaging::IpamEventsStream().name, kIpamDriftConsumer,
                                   "gpuaas.v1.evt.ipam.drift.>",
                                   [source](pqxx::work& tx, const v1::Event& ev) {
                                     return ApplyIpamDriftEvent(tx, ev, source);
                                   });
  if (!drift.ok()) return drift.error();
  // The scheduler's word that a draining node holds no live claim any more.
  auto emptied = svc.StartProjection(messaging::SchedulerEventsStream().name, kNodeEmptiedConsumer,
                                     "gpuaas.v1.evt.scheduler.node.emptied",
                                     [source](pqxx::work& tx, const v1::Event& ev) {
                                       return ApplyNodeEmptiedEvent(tx, ev, source);
                                     });
  if (!emptied.ok()) return emptied.error();
  return Ok();
}

}  // namespace

bool ValidNodeId(const std::string& id) { return ids::IsNodeId(id); }

Result<void> ValidateRegister(const v1::RegisterNodeRequest& req) {
  std::map<std::string, std::string> problems;
  if (req.node_id().empty()) {
    problems["node_id"] = "required";
  } else if (!ValidNodeId(req.node_id())) {
    problems["node_id"] = "must be a lowercase DNS label (a-z, 0-9, '-', at most 63)";
  }
  if (req.hostname().empty()) {
    problems["hostname"] = "required";
  } else if (!std::regex_match(req.hostname(), kHostname)) {
    problems["hostname"] = "not a valid hostname";
  }
  for (const auto& [field, value] : {std::pair{"region", req.region()}, {"pool", req.pool()}}) {
    if (value.empty()) {
      problems[field] = "required";
    } else if (!std::regex_match(value, kLabel)) {
      problems[field] = "must be a lowercase DNS label";
    }
  }
  if (req.capacity_profile() == v1::CAPACITY_PROFILE_UNSPECIFIED) {
    problems["capacity_profile"] = "required: baremetal or slice-vm";
  } else if (!v1::CapacityProfile_IsValid(req.capacity_profile())) {
    problems["capacity_profile"] = "unknown value";
  }
  if (req.labels_size() > 64) problems["labels"] = "at most 64 labels";
  for (const auto& [k, v] : req.labels()) {
    if (k.empty() || k.size() > 63 || v.size() > 253) {
      problems["labels"] = "keys 1-63 characters, values at most 253";
    }
  }
  if (req.agent_version().size() > 64) problems["agent_version"] = "at most 64 characters";
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidNodeRegistration,
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  return Ok();
}

void InventoryConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("inventory.ipam_timeout_ms", &ipam_timeout_ms,
        "Timeout of the MAC/IP reservation asked from ipam when a slot is approved", 5000,
        config::Range(1, 600000));
  s.Add("inventory.node_task_ack_wait_ms", &node_task_ack_wait_ms,
        "Ack wait of each node's task consumer, made when the node registers: a task not acked "
        "within this is redelivered (a running task is kept alive by its agent; after an agent "
        "crash it comes back within this)",
        30000, config::Range(1000, 3600000));
  s.Add("inventory.task_deadline_s", &task_deadline_s,
        "Deadline of typed tasks sent to node-agents (a task received later fails)", 300,
        config::Range(1, 86400));
  s.Add("inventory.drain_confirm_ms", &drain_confirm_ms,
        "How long a node drain waits for the scheduler's projection to have it before answering "
        "UNAVAILABLE drain_not_confirmed (the drain stays recorded; asking again waits again)",
        10000, config::Range(100, 60000));
}

InventoryService::InventoryService(InventoryConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"inventory", &Migrations()}, cfg_.common) {}

Result<void> InventoryService::Start() {
  if (auto r = svc_.Start(); !r.ok()) return r;
  auto nats = svc_.nats();
  svc_.StartOutboxRelay();
  HandlerDeps deps;
  deps.pool = svc_.pg();
  deps.nats = nats;
  deps.source = svc_.source();
  deps.ipam_timeout_ms = cfg_.ipam_timeout_ms;
  deps.node_task_ack_wait_ms = cfg_.node_task_ack_wait_ms;
  deps.task_deadline_s = cfg_.task_deadline_s;
  deps.drain_confirm_ms = cfg_.drain_confirm_ms;
  RegisterRoutes(svc_.Rpc(), std::make_shared<InventoryHandlers>(std::move(deps)));
  if (auto r = StartConsumers(svc_, svc_.source()); !r.ok()) return r;
  auto gauges = StartNodeGauges(svc_.pg(), svc_.metrics(), svc_.log());
  svc_.OnDrain("node gauges", [gauges] { gauges->Stop(); });
  return svc_.ServeRequests();
}

}  // namespace gpuaas::inventory
