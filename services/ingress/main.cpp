// gpuaas-ingress
#include "gpuaas/ingress/ingress_service.hpp"

int main(int argc, char** argv) {
  using gpuaas::ingress::IngressConfig;
  using gpuaas::ingress::IngressService;
  return gpuaas::runtime::Main<IngressService, IngressConfig>(argc, argv, "ingress");
}
