#include "node_agent.hpp"

#include <unistd.h>

#include <array>

#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::node_agent {

void NodeAgentConfig::Register(config::Schema& s) {
  common.Register(s, false);
  s.Add("node.id", &node_id, "This host's node id (lowercase DNS label)", "", config::NonEmpty());
  s.Add("node.hostname", &hostname, "Hostname reported to inventory (empty: gethostname)", "");
  s.Add("node.region", &region, "Region the host belongs to", "", config::NonEmpty());
  s.Add("node.pool", &pool, "Pool the host belongs to", "default", config::NonEmpty());
  s.Add("node.capacity_profile", &capacity_profile, "baremetal | slice-vm", "slice-vm",
        config::OneOf({"baremetal", "slice-vm"}));
  s.Add("node.state_dir", &state_dir, "Directory of the crash-safe local store",
        "/var/lib/gpuaas-node-agent", config::NonEmpty());
  s.Add("node.register_retry_ms", &register_retry_ms,
        "Delay between registration attempts while inventory is unreachable", 1000,
        config::Range(10, 600000));
}

NodeAgent::NodeAgent(NodeAgentConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"node-agent", nullptr}, cfg_.common) {
  if (cfg_.hostname.empty()) {
    std::array<char, 256> host{};
    gethostname(host.data(), host.size() - 1);
    cfg_.hostname = host.data();
  }
}

NodeAgent::~NodeAgent() { Shutdown(); }

Result<void> NodeAgent::Start() {
  auto store = LocalStore::Open(cfg_.state_dir);
  if (!store.ok()) return store.error();
  store_.emplace(std::move(*store));
  svc_.SetReady(false);
  if (auto r = svc_.Start(); !r.ok()) return r;
  svc_.OnDrain("registration", [this] {
    stop_ = true;
    cv_.notify_all();
    if (register_thread_.joinable()) register_thread_.join();
  });
  register_thread_ = std::thread([this] { RegisterLoop(); });
  return Ok();
}

void NodeAgent::Shutdown() { svc_.Shutdown(); }

std::string NodeAgent::LastError() const {
  std::lock_guard lock(mu_);
  return last_error_;
}

void NodeAgent::RegisterLoop() {
  rpc::Client client(svc_.nats());
  v1::RegisterNodeRequest req;
  req.set_node_id(cfg_.node_id);
  req.set_hostname(cfg_.hostname);
  req.set_region(cfg_.region);
  req.set_pool(cfg_.pool);
  req.set_capacity_profile(cfg_.capacity_profile == "baremetal" ? v1::CAPACITY_PROFILE_BAREMETAL
                                                                : v1::CAPACITY_PROFILE_SLICE_VM);
  req.set_agent_version(GPUAAS_VERSION);
  const auto log = svc_.log().With({{"node_id", cfg_.node_id}});
  while (!stop_) {
    auto r = client.Call<v1::RegisterNodeResponse>(
        "gpuaas.v1.inventory.node.register", req,
        std::chrono::milliseconds(cfg_.common.nats_request_timeout_ms));
    if (r.ok()) {
      nlohmann::json reg = {{"node_id", r->node().node_id()},
                            {"generation", r->node().generation()},
                            {"region", r->node().region()},
                            {"pool", r->node().pool()}};
      if (auto w = store_->Put("registration", reg); !w.ok()) {
        log.Error("cannot persist registration", {{"error", w.error().ToString()}});
      }
      log.Info("registered with inventory", {{"generation", std::to_string(r->node().generation())},
                                             {"created", r->created() ? "true" : "false"}});
      registered_ = true;
      svc_.SetReady(true);
      return;
    }
    {
      std::lock_guard lock(mu_);
      last_error_ = r.error().ToString();
    }
    if (!r.error().retryable) {
      // Inventory refuses this node: stay isolated (not ready, serving nothing) until an
      // operator fixes the configuration.
      log.Error("inventory rejected registration; agent stays isolated",
                {{"error", r.error().ToString()}});
      return;
    }
    log.Warn("inventory unreachable, will retry", {{"error", r.error().ToString()}});
    std::unique_lock lock(mu_);
    cv_.wait_for(lock, std::chrono::milliseconds(cfg_.register_retry_ms),
                 [this] { return stop_.load(); });
  }
}

}  // namespace gpuaas::node_agent
