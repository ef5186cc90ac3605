#include "projection_rpc.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <string>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

// A page of the node projection: up to `limit` nodes of `region` ("" = any) after node id
// `after`, and the next page's token when more follow.
v1::ListProjectedNodesResponse ReadNodePage(pqxx::work& tx, const std::string& region,
                                            const std::string& after, int limit) {
  auto rows = tx.exec_params(
      "SELECT node_id, hostname, region, pool, capacity_profile, generation, "
      "last_event_id::text, extract(epoch from projected_at)::float8 FROM projected_nodes "
      "WHERE ($1 = '' OR region = $1) AND node_id > $2 ORDER BY node_id LIMIT $3",
      region, after, limit + 1);
  v1::ListProjectedNodesResponse resp;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
    const auto& r = rows[i];
    auto* n = resp.add_nodes();
    n->set_node_id(r[0].as<std::string>());
    n->set_hostname(r[1].as<std::string>());
    n->set_region(r[2].as<std::string>());
    n->set_pool(r[3].as<std::string>());
    n->set_capacity_profile(enums::FromColumn<v1::CapacityProfile>(r[4].as<std::string>()));
    n->set_generation(r[5].as<int64_t>());
    n->set_last_event_id(r[6].as<std::string>());
    *n->mutable_projected_at() = google::protobuf::util::TimeUtil::MillisecondsToTimestamp(
        static_cast<int64_t>(r[7].as<double>() * 1000));
  }
  if (static_cast<int>(rows.size()) > limit) {
    resp.set_next_page_token(resp.nodes(limit - 1).node_id());
  }
  return resp;
}

// One row of ReadSlotPage's query.
void SlotFromRow(const pqxx::row& r, v1::ProjectedSlot* p) {
  p->set_node_id(r[0].as<std::string>());
  p->set_slot_key(r[1].as<std::string>());
  p->set_region(r[2].as<std::string>());
  p->set_pool(r[3].as<std::string>());
  p->set_sku(r[4].as<std::string>());
  p->set_admin_state(enums::FromColumn<v1::SlotAdminState>(r[5].as<std::string>()));
  p->set_health(enums::FromColumn<v1::SlotHealth>(r[6].as<std::string>()));
  p->set_schedulable(r[7].as<bool>());
  const auto b = r[8].as<std::string>();
  for (size_t start = 0; start < b.size();) {
    const size_t comma = std::min(b.find(',', start), b.size());
    p->add_node_blockers(b.substr(start, comma - start));
    start = comma + 1;
  }
  p->set_generation(r[9].as<int64_t>());
  p->set_gpu_pci_address(r[10].as<std::string>());
  p->set_locality_group(r[11].as<std::string>());
  // A claim's phase is the slot's lifecycle; a free slot shows its admin state.
  const auto phase = r[12].as<std::string>();
  p->set_lifecycle(
      enums::FromColumn<v1::SlotLifecycleState>(phase.empty() ? r[5].as<std::string>() : phase));
  p->set_allocation_id(r[13].as<std::string>());
}

// A page of the slot projection after (after_node, after_slot), with each slot's live claim.
v1::ListProjectedSlotsResponse ReadSlotPage(pqxx::work& tx,
                                            const v1::ListProjectedSlotsRequest& req,
                                            const std::string& after_node,
                                            const std::string& after_slot, int limit) {
  // The page first (a primary-key range), then each of its slots' live claim by one
  // probe (LIMIT 1 keeps the planner from turning the probes into a scan of every
  // claim, whatever it estimates for the page).
  auto rows = tx.exec_params(
      "SELECT p.node_id, p.slot_key, p.region, p.pool, p.sku, p.admin_state, p.health, "
      "p.schedulable, array_to_string(p.node_blockers, ','), p.generation, "
      "p.gpu_pci_address, p.locality_group, COALESCE(c.phase, ''), "
      "COALESCE(c.allocation_id::text, '') FROM (SELECT * FROM projected_slots p "
      "WHERE ($1 = '' OR p.node_id = $1) AND ($2 = '' OR p.region = $2) "
      "AND (p.node_id, p.slot_key) > ($3, $4) ORDER BY p.node_id, p.slot_key LIMIT $5) p "
      "LEFT JOIN LATERAL (SELECT phase, allocation_id FROM allocation_resource_claims c "
      "WHERE c.released_at IS NULL AND c.kind = 'slot' AND c.node_id = p.node_id AND "
      "c.slot_key = p.slot_key LIMIT 1) c ON true ORDER BY p.node_id, p.slot_key",
      req.node_id(), req.region(), after_node, after_slot, limit + 1);
  v1::ListProjectedSlotsResponse resp;
  for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
    SlotFromRow(rows[i], resp.add_slots());
  }
  if (static_cast<int>(rows.size()) > limit) {
    const auto& last = resp.slots(limit - 1);
    resp.set_next_page_token(last.node_id() + "/" + last.slot_key());
  }
  return resp;
}

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
    return ReadSlotPage(tx, req, after_node, after_slot, limit);
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
