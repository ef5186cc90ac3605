#pragma once
// console-gw: will own console sessions, short-lived grants and audit; the admin HTTP+WebSocket
// console gateway. Today it runs the shared runtime only: config, NATS, its own database with
// migrations, /healthz, /readyz and /metrics. It serves no requests yet.
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::console_gw {

const std::vector<store::Migration>& Migrations();

using ConsoleGwConfig = runtime::BasicConfig;

class ConsoleGwService : public runtime::BasicService {
 public:
  explicit ConsoleGwService(const ConsoleGwConfig& cfg)
      : runtime::BasicService("console-gw", &Migrations(), cfg) {}
};

}  // namespace gpuaas::console_gw
