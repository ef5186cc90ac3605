// gpuaas-ipam
#include "gpuaas/ipam/ipam_service.hpp"

int main(int argc, char** argv) {
  using gpuaas::ipam::IpamConfig;
  using gpuaas::ipam::IpamService;
  return gpuaas::runtime::Main<IpamService, IpamConfig>(argc, argv, "ipam");
}
