#pragma once
// ipam's view of inventory (its projection of inventory's node and slot events) and what it is
// used for: reserve and reprovision refuse nodes and slots inventory does not know, and
// orphan.list/remove find and delete ipam rows no inventory node or slot backs (rows made before
// these checks existed, or a slot whose approval failed after its MAC was assigned).
#include <pqxx/pqxx>

#include <chrono>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::messaging {
class Consumer;
}

namespace gpuaas::ipam {

struct IpamConfig;

// The durables that feed the projection (their backlog says whether it has caught up).
struct InventoryView {
  messaging::Consumer* nodes = nullptr;
  messaging::Consumer* slots = nullptr;
};

// How a lookup that finds nothing is answered.
struct Unknown {
  Code code = Code::kNotFound;
  bool retryable = false;
};

// Ok when the projection knows the node (and the slot, when `slot_key` is not ""). A miss is
// definitive once the feeding durable has no backlog (measured before the lookup, so everything
// acked by then is committed): `unknown.code` node_unknown / slot_unknown. While it has one,
// the lookup is repeated until `deadline` (inventory reserves moments after it registered the
// node), then UNAVAILABLE inventory_projection_lagging (retryable).
Result<void> RequireKnown(store::Pool& pool, const InventoryView& inv, const std::string& node_id,
                          const std::string& slot_key, Unknown unknown,
                          std::chrono::steady_clock::time_point deadline);

// UNAVAILABLE inventory_projection_lagging unless both durables have no backlog.
Result<void> RequireCaughtUp(const InventoryView& inv);

// Node orphans (rows of a node inventory does not know, none bound to an allocation), then slot
// orphans (a known node's slot inventory never announced, unbound, unchanged for at least
// `min_age_s`), ordered by node and slot; only `node_id`'s when it is not "". Subnet rules are
// configuration (a node rule may precede the node's registration) and are never orphans.
std::vector<v1::IpamOrphan> FindOrphans(pqxx::work& tx, int64_t min_age_s,
                                        const std::string& node_id);

// Deletes the orphan's rows (the caller found it in this transaction, holding the node's lock)
// and appends gpuaas.v1.evt.ipam.orphan.removed; a slot orphan's node gets a new document version.
Result<void> RemoveOrphan(pqxx::work& tx, const v1::IpamOrphan& orphan, const IpamConfig& cfg,
                          const std::string& source, const std::string& traceparent);

}  // namespace gpuaas::ipam
