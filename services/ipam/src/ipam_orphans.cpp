#include "ipam_orphans.hpp"

#include <google/protobuf/util/time_util.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "ipam_store.hpp"

namespace gpuaas::ipam {

namespace {

using google::protobuf::util::TimeUtil;

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
      const bool node =
          !tx.exec_params("SELECT 1 FROM inventory_nodes WHERE node_id = $1", node_id).empty();
      const bool s = !slot || !tx.exec_params(
                                     "SELECT 1 FROM inventory_slots WHERE node_id = $1 AND "
                                     "slot_key = $2",
                                     node_id, slot_key)
                                   .empty();
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
  std::vector<v1::IpamOrphan> out;
  auto nodes = tx.exec_params(
      "WITH ids AS (SELECT node_id FROM node_subnets UNION SELECT node_id FROM mac_assignments "
      "UNION SELECT node_id FROM slot_reservations UNION SELECT node_id FROM network_documents "
      "UNION SELECT node_id FROM network_acks) "
      "SELECT i.node_id, COALESCE(ns.subnet::text, ''), "
      "(SELECT count(*) FROM slot_reservations r WHERE r.node_id = i.node_id), "
      "(extract(epoch from GREATEST(ns.created_at, (SELECT max(updated_at) FROM mac_assignments m "
      "WHERE m.node_id = i.node_id), (SELECT max(created_at) FROM network_documents d WHERE "
      "d.node_id = i.node_id))) * 1000)::int8 "
      "FROM ids i LEFT JOIN node_subnets ns ON ns.node_id = i.node_id "
      "WHERE NOT EXISTS (SELECT 1 FROM inventory_nodes n WHERE n.node_id = i.node_id) "
      "AND NOT EXISTS (SELECT 1 FROM slot_reservations r WHERE r.node_id = i.node_id AND "
      "r.allocation_id IS NOT NULL) AND ($1 = '' OR i.node_id = $1) ORDER BY 1",
      node_id);
  out.reserve(nodes.size());
  for (const auto& r : nodes) {
    v1::IpamOrphan o;
    o.set_node_id(r[0].as<std::string>());
    o.set_reason(v1::IPAM_ORPHAN_REASON_NODE_UNKNOWN);
    o.set_subnet(r[1].as<std::string>());
    o.set_reservations(r[2].as<int64_t>());
    if (!r[3].is_null()) {
      *o.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[3].as<int64_t>());
    }
    out.push_back(std::move(o));
  }
  auto slots = tx.exec_params(
      "SELECT m.node_id, m.slot_key, m.mac::text, COALESCE(host(r.ip), ''), "
      "(extract(epoch from GREATEST(m.updated_at, r.updated_at)) * 1000)::int8 "
      "FROM mac_assignments m JOIN inventory_nodes n ON n.node_id = m.node_id "
      "LEFT JOIN slot_reservations r ON r.node_id = m.node_id AND r.slot_key = m.slot_key "
      "WHERE NOT EXISTS (SELECT 1 FROM inventory_slots s WHERE s.node_id = m.node_id AND "
      "s.slot_key = m.slot_key) AND r.allocation_id IS NULL "
      "AND GREATEST(m.updated_at, r.updated_at) <= now() - make_interval(secs => $1) "
      "AND ($2 = '' OR m.node_id = $2) ORDER BY 1, 2",
      static_cast<double>(min_age_s), node_id);
  out.reserve(out.size() + slots.size());
  for (const auto& r : slots) {
    v1::IpamOrphan o;
    o.set_node_id(r[0].as<std::string>());
    o.set_slot_key(r[1].as<std::string>());
    o.set_reason(v1::IPAM_ORPHAN_REASON_SLOT_UNKNOWN);
    o.set_mac(r[2].as<std::string>());
    o.set_ip(r[3].as<std::string>());
    o.set_reservations(o.ip().empty() ? 0 : 1);
    *o.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[4].as<int64_t>());
    out.push_back(std::move(o));
  }
  return out;
}

Result<void> RemoveOrphan(pqxx::work& tx, const v1::IpamOrphan& orphan, const IpamConfig& cfg,
                          const std::string& source, const std::string& traceparent) {
  const std::string& node = orphan.node_id();
  int64_t generation = 0;
  std::string entity = node;
  if (orphan.reason() == v1::IPAM_ORPHAN_REASON_NODE_UNKNOWN) {
    // The node's next document version would have been this: its events stay ordered.
    generation = tx.exec_params(
                       "SELECT COALESCE(max(version), 0) + 1 FROM network_documents WHERE "
                       "node_id = $1",
                       node)[0][0]
                     .as<int64_t>();
    for (const char* table :
         {"lease_observations", "lease_reports", "ipam_drift", "network_acks", "network_documents",
          "slot_reservations", "mac_assignments", "node_subnets"}) {
      tx.exec_params(fmt::format("DELETE FROM {} WHERE node_id = $1", table), node);
    }
  } else {
    const std::string& slot = orphan.slot_key();
    entity = node + "/" + slot;
    // The slot's events continue its reservation's order.
    generation = tx.exec_params(
                       "SELECT GREATEST(m.generation, COALESCE((SELECT generation FROM "
                       "slot_reservations r WHERE r.node_id = $1 AND r.slot_key = $2), 0)) + 1 "
                       "FROM mac_assignments m WHERE m.node_id = $1 AND m.slot_key = $2",
                       node, slot)[0][0]
                     .as<int64_t>();
    if (auto d = ResolveDrift(tx, node, slot, "orphan removed", source); !d.ok()) return d.error();
    tx.exec_params("DELETE FROM lease_observations WHERE node_id = $1 AND subject = $2", node,
                   slot);
    tx.exec_params("DELETE FROM slot_reservations WHERE node_id = $1 AND slot_key = $2", node,
                   slot);
    tx.exec_params("DELETE FROM mac_assignments WHERE node_id = $1 AND slot_key = $2", node, slot);
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
