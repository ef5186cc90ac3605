// gpuaas-usage
#include "gpuaas/usage/usage_service.hpp"

int main(int argc, char** argv) {
  using gpuaas::usage::UsageConfig;
  using gpuaas::usage::UsageService;
  return gpuaas::runtime::Main<UsageService, UsageConfig>(argc, argv, "usage");
}
