#include "ipam_orphans.hpp"

#include <chrono>
#include <thread>
#include <utility>

#include <fmt/format.h>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "ipam_store.hpp"

namespace gpuaas::ipam {

namespace {

constexpr auto kPoll = std::chrono::milliseconds(25);
constexpr auto kSettle = std::chrono::milliseconds(250);

Error Lagging(const std::string& what) {
  return Error::Unavailable(
      reason::kInventoryProjectionLagging,
      "ipam's projection of inventory has not caught up with the " + what + " events yet; retry");
}

bool CaughtUp(messaging::Consumer* c) {
  if (c == nullptr) return false;
  auto backlog = c->Backlog();
  return backlog.ok() && *backlog == 0;
}

}  // namespace

Result<void> RequireKnown(store::Pool& pool, const InventoryView& inv, const std::string& node_id,
                          const std::string& slot_key, Unknown unknown,
                          std::chrono::steady_clock::time_point deadline) {
  const bool slot = !slot_key.empty();
  // The server's pending count can trail a message published a moment ago (the consumer counts
  // it asynchronously): "unknown" only after the projection has looked caught up for a while.
  bool looked_caught_up = false;
  auto caught_up_since = std::chrono::steady_clock::now();
  for (;;) {
    const auto now = std::chrono::steady_clock::now();
    if (CaughtUp(inv.nodes) && (!slot || CaughtUp(inv.slots))) {
      if (!looked_caught_up) caught_up_since = now;
      looked_caught_up = true;
    } else {
      looked_caught_up = false;
    }
    const bool caught_up = looked_caught_up && now - caught_up_since >= kSettle;
    auto found = store::WithTx(pool, [&](pqxx::work& tx) -> Result<std::pair<bool, bool>> {
      const bool node = InventoryHasNode(tx, node_id);
      const bool s = !slot || InventoryHasSlot(tx, node_id, slot_key);
      return std::make_pair(node, s);
    });
    if (!found.ok()) return found.error();
    if (found->first && found->second) return Ok();
    if (caught_up) {
      if (!found->first) {
        return Error::Of(unknown.code, reason::kNodeUnknown,
                         "inventory does not know node " + node_id + "; register it first",
                         {{"node_id", node_id}}, unknown.retryable);
      }
      return Error::Of(unknown.code, reason::kSlotUnknown,
                       fmt::format("inventory does not know slot {} of node {}", slot_key, node_id),
                       {{"node_id", node_id}, {"slot_key", slot_key}}, unknown.retryable);
    }
    if (std::chrono::steady_clock::now() + kPoll >= deadline) {
      return Lagging(slot ? "node and slot" : "node");
    }
    std::this_thread::sleep_for(kPoll);
  }
}

Result<void> RequireCaughtUp(const InventoryView& inv) {
  if (!CaughtUp(inv.nodes) || !CaughtUp(inv.slots)) return Lagging("node and slot");
  return Ok();
}

std::vector<v1::IpamOrphan> FindOrphans(pqxx::work& tx, int64_t min_age_s,
                                        const std::string& node_id) {
  auto out = ListNodeOrphans(tx, node_id);
  auto slots = ListSlotOrphans(tx, min_age_s, node_id);
  out.reserve(out.size() + slots.size());
  for (auto& o : slots) out.push_back(std::move(o));
  return out;
}

Result<void> RemoveOrphan(pqxx::work& tx, const v1::IpamOrphan& orphan, const IpamConfig& cfg,
                          const std::string& source, const std::string& traceparent) {
  const std::string& node = orphan.node_id();
  int64_t generation = 0;
  std::string entity = node;
  if (orphan.reason() == v1::IPAM_ORPHAN_REASON_NODE_UNKNOWN) {
    // The node's next document version would have been this: its events stay ordered.
    generation = NextDocumentVersion(tx, node);
    DeleteNodeRows(tx, node);
  } else {
    const std::string& slot = orphan.slot_key();
    entity = node + "/" + slot;
    // The slot's events continue its reservation's order.
    generation = NextSlotGeneration(tx, node, slot);
    if (auto d = ResolveDrift(tx, node, slot, "orphan removed", source); !d.ok()) return d.error();
    DeleteLeaseObservation(tx, node, slot);
    DeleteReservation(tx, node, slot);
    DeleteMacAssignment(tx, node, slot);
    if (auto d = UpdateDocument(tx, node, cfg); !d.ok()) return d.error();
  }
  v1::IpamOrphanSnapshot snap;
  *snap.mutable_orphan() = orphan;
  auto ev = outbox::Append(tx, {"gpuaas.v1.evt.ipam.orphan.removed", "", source, entity, generation,
                                node, traceparent, &snap});
  if (!ev.ok()) return ev.error();
  return Ok();
}

}  // namespace gpuaas::ipam
