#pragma once
// ipam: owns per-node management subnets (rules per region/pool/node), fleet-unique slot MACs,
// per-slot private-IP reservations bound to allocations while they live, each node's versioned
// network document and its acks, lease observations and IPAM drift. Serves gpuaas.v1.ipam.*;
// consumes allocation events (GPUAAS_EVT_SCHEDULER) and node-agent lease reports
// (GPUAAS_EVT_NODE), and inventory's node and slot events (GPUAAS_EVT_INVENTORY) as the
// projection reserve/reprovision and orphan judgement check against; announces reservation and
// drift changes through its outbox (GPUAAS_EVT_IPAM). Pure rules live in ipam_domain.hpp.
#include <pqxx/pqxx>

#include <string>

#include "gpuaas/common/runtime.hpp"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::ipam {

struct NetworkDefaults;  // ipam_domain.hpp

const std::vector<store::Migration>& Migrations();

inline constexpr const char* kAllocationConsumer = "ipam-scheduler-allocations";
inline constexpr const char* kLeaseConsumer = "ipam-node-leases";
inline constexpr const char* kInventoryNodeConsumer = "ipam-inventory-nodes";
inline constexpr const char* kInventorySlotConsumer = "ipam-inventory-slots";

struct IpamConfig {
  runtime::CommonConfig common;
  std::string default_subnet = "10.100.0.0/24";
  std::string default_gateway;  // "" = the subnet's first host
  int64_t first_host = 10;      // slot addresses: subnet + first_host .. subnet + last_host
  int64_t last_host = 250;
  int64_t slots_per_node = 8;  // a subnet must hold at least this many slot addresses
  std::string reserved_cidrs;  // comma-separated networks no management subnet may overlap
  std::string datapath = "linux-bridge";  // a NetworkDatapath text
  std::string bridge = "gpuaasbr0";       // the Linux bridge's default name
  std::string ovs_bridge = "ovsbr0";      // the OVS bridge's default name
  bool masquerade = true;
  bool ip_forward = true;
  bool deny_cross_slice = true;
  int64_t lease_readiness_timeout_ms = 300000;
  void Register(config::Schema& schema);
  // Every problem of the values together (INVALID_ARGUMENT invalid_config, details per key).
  Result<void> Validate() const;
  // What every node network document asks for (default datapath and bridges, NAT, isolation).
  NetworkDefaults Network() const;
};

// Subject a node-agent publishes its LeaseReport on (stream GPUAAS_EVT_NODE).
std::string LeaseReportSubject(const std::string& node_id);

// Consumers' effects (public for tests). An AllocationSnapshot event binds the allocation's
// slots' reservations (provisioning, active) or unbinds them (released; failed with no live
// claims), in generation order. A LeaseReport event becomes the node's latest observations, and
// drift records are opened, changed or resolved from it.
Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const IpamConfig& cfg,
                                  const std::string& source);
Result<void> ApplyLeaseEvent(pqxx::work& tx, const v1::Event& ev, const IpamConfig& cfg,
                             const std::string& source);
// Inventory's NodeSnapshot / SlotSnapshot events: the nodes and slots inventory knows (ipam's
// projection; nothing is ever removed from it, inventory deletes neither). A node's event also
// says whether its slice network is removed (bare-metal mode or a mode change to it): a change
// writes the node's next document version.
Result<void> ApplyInventoryNodeEvent(pqxx::work& tx, const v1::Event& ev, const IpamConfig& cfg);
Result<void> ApplyInventorySlotEvent(pqxx::work& tx, const v1::Event& ev);

class IpamService {
 public:
  explicit IpamService(IpamConfig cfg);
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown() { svc_.Shutdown(); }
  runtime::Service& runtime() { return svc_; }

 private:
  IpamConfig cfg_;
  runtime::Service svc_;
};

}  // namespace gpuaas::ipam
