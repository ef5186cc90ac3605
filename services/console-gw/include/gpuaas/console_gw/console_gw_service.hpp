#pragma once
// console-gw: audited admin consoles. Owns console sessions and their single-use grants (stored
// as SHA-256 only), serves gpuaas.v1.console.session.{create,revoke,list} (operators), and runs
// the HTTP + WebSocket gateway (console_gateway.hpp): the operator page, its JSON API forwarded
// over NATS with the operator's own token, and the console relay to the VM's node
// (console_bridge.hpp). Every session step is an outbox event on GPUAAS_EVT_CONSOLE. Pure rules
// live in console_domain.hpp.
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gpuaas/common/runtime.hpp"
#include "gpuaas/console_gw/console_gateway.hpp"

namespace google::protobuf {
class Descriptor;
}

namespace gpuaas::console_gw {

const std::vector<store::Migration>& Migrations();

struct ConsoleGwConfig {
  runtime::CommonConfig common;
  std::string http_host = "127.0.0.1";
  int64_t http_port = 0;
  std::string web_dir;
  std::string novnc_dir = "/usr/share/novnc";
  std::string allowed_origins;  // comma-separated; "" = same origin only
  bool secure_cookies = false;
  int64_t max_session_s = 3600;
  int64_t window_bytes = int64_t{256} * 1024;
  int64_t open_timeout_ms = 5000;
  int64_t sweep_ms = 1000;
  int64_t page_idle_s = 1800;  // a page session with no call for this long ends (idle)
  void Register(config::Schema& schema);
};

class ConsoleMetrics;

// The page's API: the subjects it may call, with their request and result types.
struct ApiRoute {
  std::string subject;
  const google::protobuf::Descriptor* request;
  const google::protobuf::Descriptor* result;
};
const std::vector<ApiRoute>& ApiRoutes();

class ConsoleGwService : public Backend {
 public:
  explicit ConsoleGwService(ConsoleGwConfig cfg);
  ~ConsoleGwService() override;
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown() { svc_.Shutdown(); }
  runtime::Service& runtime() { return svc_; }
  // The gateway's port (after Start).
  uint16_t gateway_port() const { return gateway_port_; }

  // Backend (the gateway's calls).
  Result<PageLogin> Login(const std::string& token) override;
  Result<PageAccess> Resume(const std::string& cookie) override;
  void Logout(const std::string& cookie) override;
  ApiReply Call(const std::string& token, const std::string& subject,
                const std::string& json) override;
  void Refused(const ConnectAttempt& a, Reason failure, const std::string& detail) override;
  Result<ClaimOutcome> Claim(const ConnectAttempt& a) override;
  OpenOutcome Open(const Claimed& c, Bridge::Callbacks cb) override;
  void Live(const std::string& session_id, std::function<void(EndReason reason)> stop) override;
  void Finish(const std::string& session_id, EndReason reason, uint64_t bytes_to_client,
              uint64_t bytes_from_client) override;

  // One sweep (the loop runs it every console.sweep_ms): expires unused grants, stops live
  // connections that were revoked or reached their maximum, fails connections a lost gateway
  // left behind, refreshes the gauges.
  void Sweep();

 private:
  // An operator's token, verified, not revoked, with the operator role (page_sessions.cpp).
  Result<auth::Principal> VerifyOperator(const std::string& token);
  // The operator page and console WebSocket listener (console.http_host:http_port).
  Result<void> StartGateway();
  // A claimed session whose relay did not open: FAILED with `failed`, audited.
  void RecordNotOpened(const Claimed& c, EndReason failed, const Error& why);
  void SweepLoop();
  // Stops the sweeper and waits for its thread (idempotent).
  void StopSweeper();

  ConsoleGwConfig cfg_;
  runtime::Service svc_;
  std::unique_ptr<ConsoleMetrics> metrics_;
  std::unique_ptr<Gateway> gateway_;
  uint16_t gateway_port_ = 0;
  std::mutex live_mu_;
  std::map<std::string, std::function<void(EndReason)>> live_;
  std::chrono::steady_clock::time_point counted_{};  // sessions by state last sampled
  static constexpr std::chrono::seconds kGaugeEvery{15};
  std::thread sweeper_;
  std::mutex sweep_mu_;
  std::condition_variable sweep_cv_;
  bool stopping_ = false;
};

}  // namespace gpuaas::console_gw
