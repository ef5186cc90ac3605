#pragma once
// Inventory: owns regions, pools, nodes, topology snapshots and approved slots (slots.hpp).
// Serves gpuaas.v1.inventory.* requests and announces every change through its outbox.
#include <string>

#include "gpuaas/common/config.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::v1 {
class RegisterNodeRequest;
}

namespace gpuaas::inventory {

struct InventoryConfig {
  runtime::CommonConfig common;
  int64_t ipam_timeout_ms = 5000;         // MAC/IP reservation at approval
  int64_t node_task_ack_wait_ms = 30000;  // ack wait of each node's task consumer
  int64_t task_deadline_s = 300;          // typed tasks sent to node-agents
  int64_t drain_confirm_ms = 10000;       // a drain waits this long for the scheduler
  void Register(config::Schema& schema);
};

// Field-level validation of a registration; every problem is in the error's details.
Result<void> ValidateRegister(const v1::RegisterNodeRequest& req);
// node ids become NATS subject tokens: lowercase DNS labels, no dots or wildcards.
bool ValidNodeId(const std::string& id);

const std::vector<store::Migration>& Migrations();

class InventoryService {
 public:
  explicit InventoryService(InventoryConfig cfg);
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown() { svc_.Shutdown(); }
  runtime::Service& runtime() { return svc_; }

 private:
  InventoryConfig cfg_;
  runtime::Service svc_;
};

}  // namespace gpuaas::inventory
