#pragma once
// ipam: will own per-node management subnets, MAC assignments, private-IP reservations, lease
// observations and IPAM drift (issue 5). Today it runs the shared runtime only: config, NATS, its
// own database with migrations, /healthz, /readyz and /metrics. It serves no requests yet.
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::ipam {

const std::vector<store::Migration>& Migrations();

using IpamConfig = runtime::BasicConfig;

class IpamService : public runtime::BasicService {
 public:
  explicit IpamService(const IpamConfig& cfg) : runtime::BasicService("ipam", &Migrations(), cfg) {}
};

}  // namespace gpuaas::ipam
