#pragma once
// Inventory: owns regions, pools, nodes (and later topology snapshots and approved slots).
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
  void Register(config::Schema& schema) { common.Register(schema, true); }
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
