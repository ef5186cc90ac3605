// Host operation handlers: drain, undrain, maintenance, mode change and decommission of a node
// (operators only). Each
// validates, moves the node by the admin-state table in one transaction (host_operations.hpp)
// and answers with the node as stored; a drain answers only once the scheduler has it.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <map>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "host_operations.hpp"
#include "inventory_handlers.hpp"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

constexpr size_t kMaxReason = 500;
constexpr int64_t kMaxDeadlineS = 30LL * 24 * 3600;

Result<void> CheckAdminRequest(const std::string& node_id, const std::string& reason_text,
                               int64_t deadline_s) {
  if (auto v = CheckNodeId(node_id); !v.ok()) return v.error();
  std::map<std::string, std::string> problems;
  if (reason_text.empty()) problems["reason"] = "required: why (kept with the node and its event)";
  if (reason_text.size() > kMaxReason) problems["reason"] = "at most 500 characters";
  if (deadline_s < 0 || deadline_s > kMaxDeadlineS) {
    problems["deadline_s"] = "0 (none) .. 2592000 (30 days)";
  }
  if (problems.empty()) return Ok();
  return Error::InvalidArgument(reason::kInvalidAdminRequest,
                                fmt::format("{} invalid field(s)", problems.size()), problems);
}

v1::NodeAdminResponse Reply(const AdminMove& m) {
  v1::NodeAdminResponse resp;
  *resp.mutable_node() = m.node;
  resp.set_changed(m.changed);
  return resp;
}

}  // namespace

Result<v1::NodeAdminResponse> InventoryHandlers::Move(const std::string& node_id,
                                                      node_lifecycle::Event e,
                                                      const AdminCause& cause,
                                                      rpc::Context& ctx) const {
  auto moved = store::WithTx(
      *d_.pool, [&](pqxx::work& tx) { return MoveNode(tx, node_id, e, cause, d_.source); });
  if (!moved.ok()) return moved.error();
  ctx.log.Info(moved->changed ? "node admin state changed" : "node admin state unchanged",
               {{"node_id", node_id},
                {"event", std::string(node_lifecycle::EventName(e))},
                {"admin_state", v1::NodeAdminState_Name(moved->node.admin_state())},
                {"generation", std::to_string(moved->node.generation())},
                {"actor", cause.actor},
                {"reason", cause.why}});
  return Reply(*moved);
}

AdminCause InventoryHandlers::Cause(const std::string& reason_text, rpc::Context& ctx) {
  AdminCause cause;
  cause.why = reason_text;
  cause.actor = ctx.principal.subject;
  cause.traceparent = ctx.traceparent;
  return cause;
}

Result<v1::NodeAdminResponse> InventoryHandlers::NodeDrain(const v1::DrainNodeRequest& req,
                                                           rpc::Context& ctx) const {
  if (auto v = CheckAdminRequest(req.node_id(), req.reason(), req.deadline_s()); !v.ok()) {
    return v.error();
  }
  AdminCause cause = Cause(req.reason(), ctx);
  cause.deadline_s = req.deadline_s();
  auto resp = Move(req.node_id(), node_lifecycle::Event::kDrain, cause, ctx);
  if (!resp.ok()) return resp.error();
  // Answered only once the scheduler's projection has this generation of the node: from then
  // on its placements (every replica, index or SQL) lock the node's row and find it not active.
  v1::ListNodeHoldersRequest holders;
  holders.set_node_id(req.node_id());
  holders.set_min_generation(resp->node().generation());
  const int64_t wait_ms = std::min<int64_t>(d_.drain_confirm_ms, ctx.RemainingMs());
  holders.set_wait_ms(static_cast<int32_t>(wait_ms));
  auto seen = rpc::Client(d_.nats).Call<v1::ListNodeHoldersResponse>(
      "gpuaas.v1.scheduler.node.holders", holders, std::chrono::milliseconds(wait_ms + 1000),
      ctx.traceparent);
  if (!seen.ok()) {
    return Error::Of(
        Code::kUnavailable, reason::kDrainNotConfirmed,
        "the drain of " + req.node_id() + " is recorded, but the scheduler has not confirmed it " +
            "yet (" + seen.error().reason + "): ask again; until then placements may still land",
        {{"node_id", req.node_id()}, {"generation", std::to_string(resp->node().generation())}},
        true);
  }
  for (const auto& h : seen->holders()) resp->add_holding_allocations(h.allocation_id());
  return resp;
}

Result<v1::NodeAdminResponse> InventoryHandlers::NodeUndrain(const v1::NodeAdminRequest& req,
                                                             rpc::Context& ctx) const {
  if (auto v = CheckAdminRequest(req.node_id(), req.reason(), 0); !v.ok()) return v.error();
  return Move(req.node_id(), node_lifecycle::Event::kUndrain, Cause(req.reason(), ctx), ctx);
}

Result<v1::NodeAdminResponse> InventoryHandlers::NodeDecommission(const v1::NodeAdminRequest& req,
                                                                  rpc::Context& ctx) const {
  if (auto v = CheckAdminRequest(req.node_id(), req.reason(), 0); !v.ok()) return v.error();
  // Claims are the scheduler's; a drained node takes no new one, so its answer holds.
  v1::ListNodeHoldersRequest ask;
  ask.set_node_id(req.node_id());
  auto held = rpc::Client(d_.nats).Call<v1::ListNodeHoldersResponse>(
      "gpuaas.v1.scheduler.node.holders", ask, std::chrono::milliseconds(ctx.RemainingMs()),
      ctx.traceparent);
  // NOT_FOUND: the scheduler never projected the node, so nothing holds it.
  if (!held.ok() && held.error().code != Code::kNotFound) return held.error();
  AdminCause cause = Cause(req.reason(), ctx);
  std::vector<std::string> holders;
  if (held.ok()) {
    for (const auto& h : held->holders()) holders.push_back(h.allocation_id());
  }
  cause.has_live_claims = !holders.empty();
  auto resp = Move(req.node_id(), node_lifecycle::Event::kDecommission, cause, ctx);
  if (!resp.ok()) {
    Error err = resp.error();
    if (err.Is(reason::kNodeHasLiveClaims)) {
      err.details["allocations"] = fmt::format("{}", fmt::join(holders, ","));
    }
    return err;
  }
  if (resp->changed()) {
    // Its task consumer goes with it (its key is revoked with gpuaasctl node revoke).
    if (auto r =
            messaging::DeleteConsumer(*d_.nats, messaging::NodeTasksStream().name,
                                      messaging::NodeTaskConsumerSpec(req.node_id(), 0).durable);
        !r.ok()) {
      ctx.log.Warn("task consumer of a decommissioned node not deleted",
                   {{"node_id", req.node_id()}, {"error", r.error().ToString()}});
    }
  }
  return resp;
}

Result<v1::NodeAdminResponse> InventoryHandlers::NodeMode(const v1::ChangeNodeModeRequest& req,
                                                          rpc::Context& ctx) const {
  if (auto v = CheckAdminRequest(req.node_id(), req.reason(), 0); !v.ok()) return v.error();
  if (req.mode() != v1::CAPACITY_PROFILE_SLICE_VM && req.mode() != v1::CAPACITY_PROFILE_BAREMETAL) {
    return Error::InvalidArgument(reason::kInvalidAdminRequest,
                                  "mode must be slice-vm or baremetal",
                                  {{"mode", "slice-vm | baremetal"}});
  }
  AdminCause cause = Cause(req.reason(), ctx);
  cause.target = req.mode();
  return Move(req.node_id(), node_lifecycle::Event::kChangeMode, cause, ctx);
}

Result<v1::NodeAdminResponse> InventoryHandlers::NodeMaintenance(const v1::NodeAdminRequest& req,
                                                                 rpc::Context& ctx) const {
  if (auto v = CheckAdminRequest(req.node_id(), req.reason(), 0); !v.ok()) return v.error();
  return Move(req.node_id(), node_lifecycle::Event::kEnterMaintenance, Cause(req.reason(), ctx),
              ctx);
}

}  // namespace gpuaas::inventory
