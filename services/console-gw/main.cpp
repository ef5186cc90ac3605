// gpuaas-console-gw
#include "gpuaas/console_gw/console_gw_service.hpp"

int main(int argc, char** argv) {
  using gpuaas::console_gw::ConsoleGwConfig;
  using gpuaas::console_gw::ConsoleGwService;
  return gpuaas::runtime::Main<ConsoleGwService, ConsoleGwConfig>(argc, argv, "console-gw");
}
