#include "projection_rpc.hpp"

#include <algorithm>
#include <string>
#include <thread>

#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "projection_store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {
constexpr int32_t kMaxHoldersWaitMs = 10000;
constexpr int kHoldersPollMs = 10;
}  // namespace

Result<v1::ListProjectedNodesResponse> ProjectionHandlers::ListNodes(
    const v1::ListProjectedNodesRequest& req, rpc::Context& /*ctx*/) {
  auto page = rpc::PageLimit(req.page_size());
  if (!page.ok()) return page.error();
  const int limit = *page;
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ListProjectedNodesResponse> {
    return ReadNodePage(tx, req.region(), req.page_token(), limit);
  });
}

Result<v1::ListProjectedSlotsResponse> ProjectionHandlers::ListSlots(
    const v1::ListProjectedSlotsRequest& req, rpc::Context& /*ctx*/) {
  auto page = rpc::PageLimit(req.page_size());
  if (!page.ok()) return page.error();
  const int limit = *page;
  // The token is the last row's "<node_id>/<slot_key>" (slot keys hold no '/'): a page
  // is one range scan of the primary key, whatever the fleet's size.
  std::string after_node, after_slot;
  if (!req.page_token().empty()) {
    const size_t slash = req.page_token().rfind('/');
    if (slash == std::string::npos || slash == 0 || slash + 1 == req.page_token().size()) {
      return Error::InvalidArgument(reason::kInvalidPageToken,
                                    "page_token is not from a list reply",
                                    {{"page_token", "use next_page_token"}});
    }
    after_node = req.page_token().substr(0, slash);
    after_slot = req.page_token().substr(slash + 1);
  }
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ListProjectedSlotsResponse> {
    return ReadSlotPage(tx, req.node_id(), req.region(), after_node, after_slot, limit);
  });
}

Result<v1::ListNodeHoldersResponse> ProjectionHandlers::NodeHolders(
    const v1::ListNodeHoldersRequest& req, rpc::Context& ctx) {
  if (req.node_id().empty() || req.wait_ms() < 0 || req.wait_ms() > kMaxHoldersWaitMs) {
    return Error::InvalidArgument(
        reason::kInvalidNodeHoldersRequest, "node_id is required and wait_ms must be 0..10000",
        {{"node_id", req.node_id()}, {"wait_ms", std::to_string(req.wait_ms())}});
  }
  const auto deadline =
      std::chrono::steady_clock::now() +
      std::chrono::milliseconds(std::min<int64_t>(req.wait_ms(), ctx.RemainingMs()));
  for (;;) {
    auto read = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ListNodeHoldersResponse> {
      auto node = ReadProjectedNode(tx, req.node_id());
      v1::ListNodeHoldersResponse resp;
      if (!node || node->generation() < req.min_generation()) return resp;  // not yet
      *resp.mutable_node() = *node;
      for (auto& h : ReadNodeHolders(tx, req.node_id())) *resp.add_holders() = std::move(h);
      return resp;
    });
    if (!read.ok()) return read.error();
    if (read->has_node()) return read;
    if (std::chrono::steady_clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(kHoldersPollMs));
  }
  if (req.min_generation() <= 0) {
    return Error::NotFound(reason::kNodeNotProjected,
                           "the scheduler's projection has no node " + req.node_id());
  }
  return Error::Of(
      Code::kUnavailable, reason::kProjectionBehind,
      "the scheduler's projection of " + req.node_id() + " has not reached generation " +
          std::to_string(req.min_generation()) + " yet",
      {{"node_id", req.node_id()}, {"min_generation", std::to_string(req.min_generation())}}, true);
}

Result<v1::RebuildProjectionResponse> ProjectionHandlers::RebuildProjection(
    const v1::RebuildProjectionRequest& req, rpc::Context& ctx) {
  // The rebuild empties the projection first: never on an empty or accidental request.
  if (!req.confirm()) {
    return Error::InvalidArgument(reason::kConfirmRequired,
                                  "projection.rebuild empties the node and slot projections "
                                  "before replaying; send confirm = true",
                                  {{"confirm", "must be true"}});
  }
  auto r = rebuild_(std::chrono::milliseconds(ctx.RemainingMs()));
  if (!r.ok()) return r.error();
  v1::RebuildProjectionResponse resp;
  resp.set_events_replayed(r->events_replayed);
  resp.set_nodes(r->nodes);
  resp.set_slots(r->slots);
  ctx.log.Info("projection rebuilt", {{"events", std::to_string(r->events_replayed)},
                                      {"nodes", std::to_string(r->nodes)},
                                      {"slots", std::to_string(r->slots)}});
  return resp;
}

}  // namespace gpuaas::scheduler
