#pragma once
// ingress: will own public endpoint pools, allocation-scoped exposures and their audit.
// Today it runs the shared runtime only: config, NATS, its own database with migrations,
// /healthz, /readyz and /metrics. It serves no requests yet.
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::ingress {

const std::vector<store::Migration>& Migrations();

using IngressConfig = runtime::BasicConfig;

class IngressService : public runtime::BasicService {
 public:
  explicit IngressService(const IngressConfig& cfg)
      : runtime::BasicService("ingress", &Migrations(), cfg) {}
};

}  // namespace gpuaas::ingress
