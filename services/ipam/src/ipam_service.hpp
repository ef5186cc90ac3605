#pragma once
// ipam: owns per-node management subnets and per-slot MAC/private-IP reservations.
// Serves gpuaas.v1.ipam.reservation.{reserve,list}; announces new reservations through its
// outbox (gpuaas.v1.evt.ipam.reservation.created). Lease observation, allocation binding and
// IPAM drift arrive with the networking issue.
#include <string>

#include "gpuaas/common/runtime.hpp"

namespace gpuaas::ipam {

const std::vector<store::Migration>& Migrations();

struct IpamConfig {
  runtime::CommonConfig common;
  std::string default_subnet = "10.100.0.0/24";
  int64_t first_host = 10;  // slot addresses: subnet + first_host .. subnet + last_host
  int64_t last_host = 250;
  void Register(config::Schema& schema);
};

// 52:54:00 (QEMU local) + 3 bytes of FNV-1a-64("<node_id>/<slot_key>#<attempt>").
std::string DeterministicMac(const std::string& node_id, const std::string& slot_key, int attempt);

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
