// gpuaas-inventory: regions, pools, nodes, topology and approved slots.
#include "gpuaas/inventory/inventory_service.hpp"

int main(int argc, char** argv) {
  using gpuaas::inventory::InventoryConfig;
  using gpuaas::inventory::InventoryService;
  return gpuaas::runtime::Main<InventoryService, InventoryConfig>(argc, argv, "inventory");
}
