#pragma once
// The agent side of ingress's per-node exposure document: a DocumentFollower whose apply is
// exposure_apply.hpp's ApplyExposures (nftables DNAT from the uplink to slice management IPs),
// whose check is ReconcileExposures (drift found is repaired, then reported), and whose ack
// carries the mappings the node refused and the drift it fixed. In "simulate" mode (simulated
// fleets) the document is taken and acked as simulated without touching the kernel.
// Thread-safe: the control loop steps it, the task thread's slot cleanup waits on it.
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/agent/document_follower.hpp"
#include "gpuaas/node_agent/network/exposure_apply.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::node_agent {

struct ExposureAgentOptions {
  std::string node_id;
  std::string mode = "simulate";            // "simulate" | "netns" | "host"
  std::string uplink;                       // the node's public interface (netns/host)
  std::string sys_root = "/sys";            // where <uplink>'s sysfs entry is read (fabric check)
  NetContext ctx;                           // netns for "netns"
  std::chrono::milliseconds timeout{5000};  // each request to ingress
  std::chrono::milliseconds check_interval{5000};  // reconcile period
  // The network document the agent applied (slice IPs and subnet: the only allowed targets);
  // nullopt while none is.
  std::function<std::optional<v1::NodeNetworkDocument>()> network;
};

class ExposureAgent {
 public:
  // `nats` gives the agent's connection when a request is made (it exists once the service runs).
  ExposureAgent(std::function<std::shared_ptr<messaging::Connection>()> nats,
                ExposureAgentOptions opts, log::Logger log);
  // One round: fetch, apply a new version, reconcile every check interval, ack.
  void Step();
  // Slot cleanup: waits (stepping the follower) until neither the latest document nor the
  // kernel maps anything to `target_ips`; UNAVAILABLE exposure_still_mapped after `timeout`.
  Result<void> WaitRemoved(const std::vector<std::string>& target_ips,
                           std::chrono::milliseconds timeout);
  int64_t AppliedVersion();

 private:
  void StepLocked();
  Result<void> Apply(const v1::NodeExposureDocument& doc);
  Result<std::vector<std::string>> Check(const v1::NodeExposureDocument& doc);
  Result<void> Ack(int64_t version, const std::vector<std::string>& blockers);
  Result<ExposureSpec> SpecOf(const v1::NodeExposureDocument& doc) const;

  std::function<std::shared_ptr<messaging::Connection>()> nats_;
  ExposureAgentOptions opts_;
  log::Logger log_;
  std::mutex mu_;
  std::unique_ptr<DocumentFollower<v1::NodeExposureDocument>> follower_;
  std::vector<v1::ExposureRefusal> refused_;  // of the applied version
  std::vector<v1::ExposureDrift> drift_;      // found since the last accepted ack
  bool drift_acked_ = false;                  // the last accepted ack carried drift
};

}  // namespace gpuaas::node_agent
