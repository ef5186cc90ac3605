#pragma once
// Approval of topology candidates into slots (gpuaas.v1.inventory.slot.approve and .repair).
#include <cstdint>
#include <memory>
#include <string>

#include "gpuaas/common/result.hpp"

namespace gpuaas::v1 {
class ApproveSlotsRequest;
class ApproveSlotsResponse;
}  // namespace gpuaas::v1

namespace gpuaas::store {
class Pool;
}
namespace gpuaas::messaging {
class Connection;
}
namespace gpuaas::rpc {
struct Context;
}

namespace gpuaas::inventory {

struct ApprovalDeps {
  std::shared_ptr<store::Pool> pool;
  std::shared_ptr<messaging::Connection> nats;  // ipam's reservation calls
  std::string source;                           // "inventory/<instance>"
  int64_t ipam_timeout_ms = 5000;
};

// kRepair re-validates against the latest evidence and clears the slot's topology drift when
// every rule passes; kApprove keeps drift.
enum class ApprovalMode { kApprove, kRepair };

// Approval of a list of candidates of one snapshot, in three phases: the local rules in a
// first transaction; MAC/IP reservations from ipam for the candidates that pass (outside any
// transaction); the rules again, authoritatively, under the node's row lock together with the
// writes of slots, events and the desired set. Reservations not kept by the outcome are given
// back to ipam afterwards.
Result<v1::ApproveSlotsResponse> ApproveCandidates(const ApprovalDeps& d,
                                                   const v1::ApproveSlotsRequest& req,
                                                   rpc::Context& ctx, ApprovalMode mode);

}  // namespace gpuaas::inventory
