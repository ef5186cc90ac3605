#pragma once
// The node-agent process: runs on every GPU host. Today: registers its node with inventory
// (retrying until inventory answers) and keeps its identity in the crash-safe local store.
// /readyz stays false until inventory has accepted the registration; an agent that
// inventory rejects stays isolated (not ready) rather than serving anything.
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "gpuaas/common/runtime.hpp"
#include "local_store.hpp"

namespace gpuaas::node_agent {

struct NodeAgentConfig {
  runtime::CommonConfig common;
  std::string node_id;
  std::string hostname;
  std::string region;
  std::string pool;
  std::string capacity_profile;
  std::string state_dir;
  int64_t register_retry_ms = 1000;
  void Register(config::Schema& schema);
};

class NodeAgent {
 public:
  explicit NodeAgent(NodeAgentConfig cfg);
  ~NodeAgent();
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown();
  runtime::Service& runtime() { return svc_; }
  bool Registered() const { return registered_.load(); }
  // Last registration outcome that was not a success (empty when none).
  std::string LastError() const;

 private:
  void RegisterLoop();
  NodeAgentConfig cfg_;
  runtime::Service svc_;
  std::optional<LocalStore> store_;
  std::thread register_thread_;
  std::atomic<bool> registered_{false};
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string last_error_;
};

}  // namespace gpuaas::node_agent
