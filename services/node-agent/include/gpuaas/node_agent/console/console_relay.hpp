#pragma once
// The node's side of the audited VM console (console.proto): console-gw asks this agent on
// gpuaas.v1.node.<node_id>.console.open to open one of its domains' VNC UNIX socket, and the
// agent then relays the socket's bytes as ConsoleFrames: VM -> gw on
// gpuaas.v1.node.<node_id>.console.<session_id>.out, gw -> VM on ...<session_id>.in (core NATS).
//
// Flow control is credit-based, per ConsoleFrame: the agent never has more than the session's
// window of VM bytes sent and not yet acknowledged by the gw's `acked`; it reports its own
// `acked` (bytes written to the socket) on every frame, and in an ack-only frame once a quarter
// of the window is unacknowledged or shortly (ack_delay) after any unacknowledged write. A gap in
// the gw's seq closes the relay with relay_lost. One thread per session (poll on the socket and
// a wakeup pipe); nothing listens on TCP.
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"

namespace prometheus {
class Registry;
class Gauge;
class Counter;
}  // namespace prometheus

namespace gpuaas::v1 {
class OpenConsoleRequest;
class OpenConsoleResponse;
}  // namespace gpuaas::v1

namespace gpuaas::rpc {
class Server;
}  // namespace gpuaas::rpc

namespace gpuaas::node_agent {

// The VNC UNIX socket a domain's (live) XML names: <graphics type='vnc' socket='P'> or its
// <listen type='socket' socket='P'/>. "" when the domain has no VNC on a socket. Pure.
std::string VncSocketFromXml(const std::string& domain_xml);

// Finds the console socket of `domain` for `allocation_id`, or refuses: FAILED_PRECONDITION
// domain_not_managed (not this agent's domain for that allocation), console_unavailable (no VNC
// socket, not running).
using ConsoleLocator =
    std::function<Result<std::string>(const std::string& allocation_id, const std::string& domain)>;

// The agent's own: the ledger's domain record (local store, key domain-<allocation_id>) must
// name `domain`, and the live domain (libvirt at `libvirt_uri`, running) must serve VNC on a
// UNIX socket. `libvirt_uri` "" (the simulated runtime): a managed domain's console is the
// socket <sim_socket_dir>/<domain>.vnc when one is there (a stand-in qemu started by a test or
// scripts/up), else it has none. `store` must outlive the locator.
ConsoleLocator LedgerConsoleLocator(const LocalStore& store, std::string libvirt_uri,
                                    std::string sim_socket_dir = "");

struct ConsoleOptions {
  std::string node_id;
  // The largest credit window a session may ask for (OpenConsoleRequest.window_bytes; 0 asks
  // for this).
  int64_t max_window_bytes = 262144;
  int max_sessions = 8;                     // more: RESOURCE_EXHAUSTED too_many_sessions
  int64_t max_duration_s = 43200;           // cap (and default for 0) of max_duration_s
  std::chrono::milliseconds ack_delay{20};  // an unacknowledged write is acked within this
};

// gpuaas.v1.node.<node_id>.console.open and its subjects.
std::string ConsoleOpenSubject(const std::string& node_id);
std::string ConsoleInSubject(const std::string& node_id, const std::string& session_id);
std::string ConsoleOutSubject(const std::string& node_id, const std::string& session_id);

class ConsoleRelay;

// Serves console.open (rpc::Server, queue group node-<node_id>) and owns the live relays.
class ConsoleServer {
 public:
  // `conn` is the node's own connection (it may serve the open subject and publish .out).
  ConsoleServer(std::shared_ptr<messaging::Connection> conn, ConsoleOptions opts,
                ConsoleLocator locate, const log::Logger& log, prometheus::Registry* metrics);
  ~ConsoleServer();
  ConsoleServer(const ConsoleServer&) = delete;
  ConsoleServer& operator=(const ConsoleServer&) = delete;

  Result<void> Start();
  // Stops serving opens, closes every relay with agent_stopping and waits for them.
  void Stop();
  // The open handler (what Start() serves): validates, connects the socket, subscribes to .in
  // and starts the relay. Refusals have no side effects.
  Result<v1::OpenConsoleResponse> Open(const v1::OpenConsoleRequest& req);
  // Relays running now.
  size_t LiveSessions() const;

 private:
  friend class ConsoleRelay;
  // Called by a relay's thread when it has finished (socket closed, subscription gone).
  void Finished(const std::string& session_id);
  // Joins the threads of relays that finished.
  void Reap();

  std::shared_ptr<messaging::Connection> conn_;
  ConsoleOptions opts_;
  ConsoleLocator locate_;
  log::Logger log_;
  std::unique_ptr<rpc::Server> server_;
  std::unique_ptr<prometheus::Registry> own_metrics_;  // when the caller gave none
  prometheus::Gauge* sessions_gauge_ = nullptr;
  prometheus::Counter* bytes_to_vm_ = nullptr;
  prometheus::Counter* bytes_to_client_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
  std::map<std::string, std::shared_ptr<ConsoleRelay>> live_;
  std::vector<std::shared_ptr<ConsoleRelay>> done_;
};

}  // namespace gpuaas::node_agent
