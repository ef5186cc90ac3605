#include "projection_rpc.hpp"

#include <string>

#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "projection_store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

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
