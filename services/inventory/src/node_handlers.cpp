// Node handlers: registration, listing, discovery, show, and the desired slot set an agent
// reads and acks.
#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "host_operations.hpp"
#include "inventory_handlers.hpp"
#include "node_store.hpp"
#include "slot_store.hpp"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

using google::protobuf::util::TimeUtil;

// The registration written in `tx`: a new node, a changed one (next generation, its slots
// re-announced since slot snapshots carry region and pool), or the same again (a no-op).
Result<v1::RegisterNodeResponse> WriteRegistration(pqxx::work& tx,
                                                   const v1::RegisterNodeRequest& req,
                                                   const std::string& source, rpc::Context& ctx) {
  v1::RegisterNodeResponse resp;
  std::string subject;
  if (auto inserted = InsertNode(tx, req)) {
    *resp.mutable_node() = *inserted;
    resp.set_created(true);
    resp.set_changed(true);
    subject = "gpuaas.v1.evt.inventory.node.registered";
  } else {
    // Same registration again: a no-op. Changed fields: a new generation and event.
    auto updated = UpdateNodeIfChanged(tx, req);
    if (!updated) {
      *resp.mutable_node() = ReadNode(tx, req.node_id());
      return resp;
    }
    *resp.mutable_node() = *updated;
    resp.set_changed(true);
    subject = "gpuaas.v1.evt.inventory.node.updated";
  }
  EnsureRegion(tx, req.region());
  if (!resp.created()) {
    // Slot snapshots carry region and pool: re-announce them with the node's change.
    if (auto r = ReemitNodeSlots(tx, req.node_id(), source, ctx.traceparent); !r.ok()) {
      return r.error();
    }
  }
  v1::NodeSnapshot snap;
  *snap.mutable_node() = resp.node();
  auto ev = outbox::Append(tx, {subject, "", source, req.node_id(), resp.node().generation(),
                                req.node_id(), ctx.traceparent, &snap});
  if (!ev.ok()) return ev.error();
  ctx.log.Info(resp.created() ? "node registered" : "node updated",
               {{"node_id", req.node_id()},
                {"generation", std::to_string(resp.node().generation())},
                {"event_id", *ev}});
  return resp;
}

// Everything node.show returns besides the node itself and its region state.
Result<void> FillNodeEvidence(pqxx::work& tx, const NodeCtx& node, v1::ShowNodeResponse& resp) {
  auto snap = LoadSnapshot(tx, node.node_id, 0);
  if (!snap.ok()) return snap.error();
  if (snap->has_value()) {
    resp.set_snapshot_version((*snap)->version);
    *resp.mutable_snapshot_at() = TimestampFromEpoch((*snap)->received_at);
    *resp.mutable_topology() = (*snap)->report;
  }
  auto slots = LoadSlots(tx, node.node_id);
  if (!slots.ok()) return slots.error();
  for (const auto& [k, s] : *slots) {
    *resp.add_slots() = s;
    for (const auto& dr : s.drift()) *resp.add_drift() = dr;
  }
  for (const auto& b : node.blockers) {
    resp.add_node_blockers(b);
    auto* dr = resp.add_drift();
    dr->set_kind(reason::kNodeBlocker.str());
    dr->set_detail(b);
  }
  resp.set_desired_version(documents::Latest(tx, DesiredTables(), node.node_id));
  resp.set_applied_version(documents::LoadAck(tx, DesiredTables(), node.node_id).applied_version);
  for (auto& t : RecentTasks(tx, node.node_id)) *resp.add_recent_tasks() = std::move(t);
  return Ok();
}

}  // namespace

InventoryHandlers::InventoryHandlers(HandlerDeps deps) : d_(std::move(deps)) {}

ApprovalDeps InventoryHandlers::Approval() const {
  return ApprovalDeps{d_.pool, d_.nats, d_.source, d_.ipam_timeout_ms};
}

Result<v1::RegisterNodeResponse> InventoryHandlers::NodeRegister(const v1::RegisterNodeRequest& req,
                                                                 rpc::Context& ctx) const {
  if (auto v = ValidateRegister(req); !v.ok()) return v.error();
  // A decommissioned node stays retired: no registration and no task consumer again.
  auto retired = store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<bool> {
    auto n = LoadNodePlacement(tx, req.node_id(), RowLock::kNone);
    return n && n->admin_state == v1::NODE_ADMIN_STATE_DECOMMISSIONED;
  });
  if (!retired.ok()) return retired.error();
  if (*retired) {
    return Error::FailedPrecondition(reason::kNodeDecommissioned,
                                     "node " + req.node_id() + " is decommissioned");
  }
  // The node's task consumer: the node's own identity may only bind to it, so inventory
  // makes it (idempotent; an agent retries registration until this succeeds).
  if (auto c = messaging::EnsureConsumer(
          *d_.nats, messaging::NodeTaskConsumerSpec(req.node_id(), d_.node_task_ack_wait_ms));
      !c.ok()) {
    return c.error();
  }
  return store::WithTx(*d_.pool,
                       [&](pqxx::work& tx) { return WriteRegistration(tx, req, d_.source, ctx); });
}

Result<v1::ListNodesResponse> InventoryHandlers::NodeList(const v1::ListNodesRequest& req,
                                                          rpc::Context& /*ctx*/) const {
  auto page = rpc::PageLimit(req.page_size());
  if (!page.ok()) return page.error();
  const int limit = *page;
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::ListNodesResponse> {
    // One more than the page: whether there is a next page.
    const auto nodes = ListNodesAfter(tx, req.region(), req.pool(), req.page_token(), limit + 1);
    v1::ListNodesResponse resp;
    for (size_t i = 0; i < nodes.size() && static_cast<int>(i) < limit; ++i) {
      *resp.add_nodes() = nodes[i];
    }
    if (static_cast<int>(nodes.size()) > limit) {
      resp.set_next_page_token(resp.nodes(limit - 1).node_id());
    }
    return resp;
  });
}

Result<v1::DiscoverNodeResponse> InventoryHandlers::NodeDiscover(const v1::DiscoverNodeRequest& req,
                                                                 rpc::Context& ctx) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::DiscoverNodeResponse> {
    if (auto n = LoadNode(tx, req.node_id(), RowLock::kNone); !n.ok()) return n.error();
    v1::NodeTask task;
    task.set_task_id(ids::NewUuidV7());
    task.set_node_id(req.node_id());
    task.set_type(v1::TASK_TYPE_TOPOLOGY_DISCOVER);
    task.mutable_topology_discover();
    *task.mutable_deadline() =
        TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(d_.task_deadline_s);
    task.set_correlation_id(task.task_id());
    task.set_requested_by(d_.source);
    InsertQueuedTask(tx, task.task_id(), req.node_id(), enums::Text(task.type()));
    auto ev = outbox::Append(
        tx, {fmt::format("gpuaas.v1.node.{node_id}.task", fmt::arg("node_id", req.node_id())), "",
             d_.source, req.node_id(), 0, task.task_id(), ctx.traceparent, &task});
    if (!ev.ok()) return ev.error();
    v1::DiscoverNodeResponse resp;
    resp.set_task_id(task.task_id());
    ctx.log.Info("discovery requested", {{"node_id", req.node_id()}, {"task_id", task.task_id()}});
    return resp;
  });
}

Result<v1::ShowNodeResponse> InventoryHandlers::NodeShow(const v1::ShowNodeRequest& req,
                                                         rpc::Context& /*ctx*/) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::ShowNodeResponse> {
    auto node = LoadNode(tx, req.node_id(), RowLock::kNone);
    if (!node.ok()) return node.error();
    v1::ShowNodeResponse resp;
    *resp.mutable_node() = ReadNodeSummary(tx, req.node_id());
    resp.set_region_enabled(node->region_enabled);
    if (auto r = FillNodeEvidence(tx, *node, resp); !r.ok()) return r.error();
    return resp;
  });
}

Result<v1::GetDesiredSlotsResponse> InventoryHandlers::DesiredGet(
    const v1::GetDesiredSlotsRequest& req, rpc::Context& /*ctx*/) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::GetDesiredSlotsResponse> {
    if (auto n = LoadNode(tx, req.node_id(), RowLock::kNone); !n.ok()) return n.error();
    v1::GetDesiredSlotsResponse resp;
    auto latest = documents::Load(tx, DesiredTables(), req.node_id(), 0, *resp.mutable_desired());
    if (!latest.ok()) {
      if (latest.error().Is(gpuaas::reason::kCorruptDocument)) {
        latest.error().reason = reason::kCorruptDesiredSet.str();
      }
      return latest.error();
    }
    if (*latest == 0) resp.mutable_desired()->set_node_id(req.node_id());
    return resp;
  });
}

Result<v1::AckDesiredSlotsResponse> InventoryHandlers::DesiredAck(
    const v1::AckDesiredSlotsRequest& req, rpc::Context& ctx) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  const std::vector<std::string> blockers(req.blockers().begin(), req.blockers().end());
  if (auto v = documents::ValidateAck(req.version(), blockers); !v.ok()) return v.error();
  return store::WithTx(*d_.pool, [&](pqxx::work& tx) -> Result<v1::AckDesiredSlotsResponse> {
    if (auto n = LoadNode(tx, req.node_id(), RowLock::kNone); !n.ok()) return n.error();
    auto r = documents::RecordAck(tx, DesiredTables(), req.node_id(), req.version(), blockers);
    if (!r.ok()) return r.error();
    // What the agent found on the host decides an open mode change, or marks binding drift.
    if (auto a = ApplyDesiredAck(tx, req.node_id(), r->applied_version, r->blockers, d_.source);
        !a.ok()) {
      return a.error();
    }
    v1::AckDesiredSlotsResponse resp;
    resp.set_applied_version(r->applied_version);
    ctx.log.Debug("desired set acked",
                  {{"node_id", req.node_id()}, {"version", std::to_string(req.version())}});
    return resp;
  });
}

}  // namespace gpuaas::inventory
