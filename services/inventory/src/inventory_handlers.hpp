#pragma once
// Inventory's request handlers, one per subject of its route table (RegisterRoutes in
// inventory_service.cpp). Each decodes and validates its request, runs the domain and store
// code in one transaction and maps the result. Node handlers are in node_handlers.cpp, host
// operations (drain, undrain, maintenance, mode, decommission) in host_handlers.cpp, slot, region
// and availability handlers in slot_handlers.cpp.
#include <cstdint>
#include <memory>
#include <string>

#include "approval.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/inventory/node_lifecycle.hpp"
#include "host_operations.hpp"

namespace gpuaas::v1 {
class AckDesiredSlotsRequest;
class AckDesiredSlotsResponse;
class ApproveSlotsRequest;
class ChangeNodeModeRequest;
class ApproveSlotsResponse;
class DisableSlotRequest;
class DrainNodeRequest;
class NodeAdminRequest;
class NodeAdminResponse;
class DisableSlotResponse;
class DiscoverNodeRequest;
class DiscoverNodeResponse;
class GetDesiredSlotsRequest;
class GetDesiredSlotsResponse;
class ListAvailabilityRequest;
class ListAvailabilityResponse;
class ListNodesRequest;
class ListNodesResponse;
class ListRegionsRequest;
class ListRegionsResponse;
class RecordWipeProofRequest;
class RecordWipeProofResponse;
class RegisterNodeRequest;
class RegisterNodeResponse;
class RepairSlotRequest;
class RepairSlotResponse;
class SetRegionRequest;
class SetRegionResponse;
class ShowNodeRequest;
class ShowNodeResponse;
}  // namespace gpuaas::v1

namespace gpuaas::inventory {

struct HandlerDeps {
  std::shared_ptr<store::Pool> pool;
  std::shared_ptr<messaging::Connection> nats;
  std::string source;                     // "inventory/<instance>"
  int64_t ipam_timeout_ms = 5000;         // MAC/IP reservation at approval
  int64_t node_task_ack_wait_ms = 30000;  // ack wait of each node's task consumer
  int64_t task_deadline_s = 300;          // typed tasks sent to node-agents
  int64_t drain_confirm_ms = 10000;       // a drain's wait for the scheduler's projection
};

class InventoryHandlers {
 public:
  explicit InventoryHandlers(HandlerDeps deps);

  // ---- nodes (node_handlers.cpp) ----
  Result<v1::RegisterNodeResponse> NodeRegister(const v1::RegisterNodeRequest& req,
                                                rpc::Context& ctx) const;
  Result<v1::ListNodesResponse> NodeList(const v1::ListNodesRequest& req, rpc::Context& ctx) const;
  Result<v1::DiscoverNodeResponse> NodeDiscover(const v1::DiscoverNodeRequest& req,
                                                rpc::Context& ctx) const;
  Result<v1::ShowNodeResponse> NodeShow(const v1::ShowNodeRequest& req, rpc::Context& ctx) const;
  Result<v1::GetDesiredSlotsResponse> DesiredGet(const v1::GetDesiredSlotsRequest& req,
                                                 rpc::Context& ctx) const;
  Result<v1::AckDesiredSlotsResponse> DesiredAck(const v1::AckDesiredSlotsRequest& req,
                                                 rpc::Context& ctx) const;

  // ---- host operations (host_handlers.cpp) ----
  Result<v1::NodeAdminResponse> NodeDrain(const v1::DrainNodeRequest& req, rpc::Context& ctx) const;
  Result<v1::NodeAdminResponse> NodeUndrain(const v1::NodeAdminRequest& req,
                                            rpc::Context& ctx) const;
  Result<v1::NodeAdminResponse> NodeMaintenance(const v1::NodeAdminRequest& req,
                                                rpc::Context& ctx) const;
  Result<v1::NodeAdminResponse> NodeDecommission(const v1::NodeAdminRequest& req,
                                                 rpc::Context& ctx) const;
  Result<v1::NodeAdminResponse> NodeMode(const v1::ChangeNodeModeRequest& req,
                                         rpc::Context& ctx) const;

  // ---- slots, wipe proofs, availability and regions (slot_handlers.cpp) ----
  Result<v1::ApproveSlotsResponse> SlotApprove(const v1::ApproveSlotsRequest& req,
                                               rpc::Context& ctx) const;
  Result<v1::RepairSlotResponse> SlotRepair(const v1::RepairSlotRequest& req,
                                            rpc::Context& ctx) const;
  Result<v1::DisableSlotResponse> SlotDisable(const v1::DisableSlotRequest& req,
                                              rpc::Context& ctx) const;
  Result<v1::RecordWipeProofResponse> WipeProofRecord(const v1::RecordWipeProofRequest& req,
                                                      rpc::Context& ctx) const;
  Result<v1::ListAvailabilityResponse> AvailabilityList(const v1::ListAvailabilityRequest& req,
                                                        rpc::Context& ctx) const;
  Result<v1::ListRegionsResponse> RegionList(const v1::ListRegionsRequest& req,
                                             rpc::Context& ctx) const;
  Result<v1::SetRegionResponse> RegionSet(const v1::SetRegionRequest& req, rpc::Context& ctx) const;

 private:
  ApprovalDeps Approval() const;
  // One admin-state move in its own transaction, logged with who and why.
  Result<v1::NodeAdminResponse> Move(const std::string& node_id, node_lifecycle::Event e,
                                     const AdminCause& cause, rpc::Context& ctx) const;
  static AdminCause Cause(const std::string& reason_text, rpc::Context& ctx);

  HandlerDeps d_;
};

}  // namespace gpuaas::inventory
