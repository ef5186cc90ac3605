#pragma once
// The node-agent process: runs on every GPU host. It registers its node with inventory
// (retrying until inventory answers), reports its discovered topology, runs typed tasks from its
// durable JetStream consumer, and follows the node's versioned desired slot set (stored in the
// crash-safe local store, then acked). /readyz stays false until inventory has accepted the
// registration. An agent that inventory rejects, or that inventory answers NotFound for, is
// isolated: not ready, and every task is rejected with `agent_isolated` until it is registered
// again. A task delivered twice runs once: its result is kept in the local store and
// re-published with the same Nats-Msg-Id.
//
// Tasks: topology.discover, prereq.check, network.baseline.check (inventory's), and the
// scheduler's VM lifecycle: vm.provision (ProvisionBundle -> ProvisionOutput), vm.release
// (ReleaseParams -> ReleaseOutput), slot.cleanup (CleanupParams -> CleanupOutput), run by a
// VmRuntime (today SimulatedRuntime) that publishes NodeTaskProgress events while it works.
// `node_agent.sim_behavior` makes the simulated node fail provisioning or fall silent, so the
// scheduler's timeouts and compensation can be tested.
#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/runtime.hpp"
#include "gpuaas/node_agent/agent/document_follower.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/network/exposure_agent.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/node.pb.h"

namespace google::protobuf {
class Message;
}  // namespace google::protobuf

namespace prometheus {
class Histogram;
template <typename T>
class Family;
}  // namespace prometheus

namespace gpuaas::v1 {
class Event;
class NodeTask;
class NodeTaskResult;
class CleanupParams;
class DesiredSlotSet;
class NodeNetworkDocument;
}  // namespace gpuaas::v1

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
  int64_t desired_poll_ms = 5000;
  std::string host_root = "/";
  std::string network_mode = "private-nat";
  std::string bridge = "ovsbr0";
  std::string gateway_cidr = "10.100.0.1/24";
  std::string libvirt_uri = "qemu:///system";
  bool discover_on_start = true;
  // Simulated VM runtime: "succeed" | "fail" | "silent"; sleep per lifecycle stage.
  std::string sim_behavior = "succeed";
  int64_t sim_step_ms = 20;
  // Slice networking from ipam's node network document: "off" (this agent does not manage the
  // network: simulations, or hosts configured by other means), "netns" (inside `net_netns`:
  // tests and e2e), "host" (the agent's own network namespace: real GPU hosts).
  // VM runtime: "simulated" (fixture hosts: nothing is created or wiped) | "libvirt" (real
  // hosts and e2e, through libvirt.uri).
  std::string vm_runtime = "simulated";
  std::string vm_domain_type = "kvm";  // "qemu" where hardware KVM does not work (TCG)
  bool vm_passthrough = true;          // VFIO hostdevs for GPUs and VFs
  std::string vm_image_cache_dir;      // "" = <state_dir>/images
  std::string vm_seed_dir;             // "" = <state_dir>/seeds
  std::string vm_nvram_dir = "/var/lib/libvirt/qemu/nvram";
  std::string vm_kernel;  // direct kernel boot (test guests); "" = boot the slot disk
  std::string vm_initrd;
  int64_t vm_lease_timeout_s = 300;
  int64_t vm_ssh_timeout_s = 120;
  std::string vm_terminal_key;  // "" = <state_dir>/terminal/id_ed25519
  // The runtime profile this host's slots are offered with (discovery reports it per candidate).
  std::string vm_profile_name = "h200_24c_64g";
  int64_t vm_vcpus_per_gpu = 24;
  int64_t vm_memory_mib_per_gpu = 65536;
  int64_t vm_hugepages_1g_per_gpu = 0;
  // A task not acked within this is delivered again (the agent keeps a task it is still running
  // alive; after a crash the task comes back within this).
  std::string net_apply = "off";
  // Ingress's exposure document: off (not followed) | simulate (taken and acked as simulated,
  // no kernel rules: simulated fleets) | netns (nftables in net_netns) | host.
  std::string exposure_apply = "off";
  std::string exposure_uplink;    // the node's public interface (netns/host)
  std::string exposure_sys_root;  // where <uplink>'s sysfs entry is read; "" = <host_root>/sys
  int64_t exposure_cleanup_wait_ms = 120000;
  std::string net_netns;
  std::string net_state_dir;  // "" = <state_dir>/net
  std::string net_ovs_rundir;
  std::string net_ovs_datapath_type;
  std::string net_host_dnsmasq_dir = "/etc/dnsmasq.d";
  int64_t vm_vnic_ingress_kbps = 0;
  int64_t vm_vnic_ingress_burst_kb = 0;
  int64_t net_report_ms = 5000;
  // The VM console relay (console_relay.hpp): console-gw's opens on
  // gpuaas.v1.node.<node_id>.console.open.
  bool console_enabled = true;
  int64_t console_window_bytes = 262144;  // the largest credit window an open may ask for
  int64_t console_max_sessions = 8;
  int64_t console_max_duration_s = 43200;  // cap (and default) of an open's max_duration_s
  std::string console_sim_socket_dir;      // simulated runtime: <dir>/<domain>.vnc stand-ins
  void Register(config::Schema& schema);
};

class VmRuntime;
class LibvirtRuntime;
struct LibvirtOptions;
class ConsoleServer;

class NodeAgent {
 public:
  explicit NodeAgent(NodeAgentConfig cfg);
  ~NodeAgent();
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown();
  runtime::Service& runtime() { return svc_; }
  bool Registered() const { return registered_.load(); }
  bool Isolated() const { return isolated_.load(); }
  // Desired slot-set version stored and acked (0: none yet).
  int64_t AppliedDesiredVersion() const { return applied_version_.load(); }
  // Tasks executed (not counting re-published duplicates).
  uint64_t TasksRun() const { return tasks_run_.load(); }
  // Last registration outcome that was not a success (empty when none).
  std::string LastError() const;
  // False while a libvirt runtime has not yet reconciled its domains with the ledger (restart
  // adoption); VM tasks wait (redelivered) and /readyz stays false until then.
  bool Adopted() const { return adopted_.load(); }
  // Network document version applied and acked (0: none, or network.apply is off).
  int64_t AppliedNetworkVersion() const { return net_version_.load(); }

 private:
  // The network.apply / exposure.apply combination: refused at start (invalid_config).
  Result<void> ValidateApplyModes() const;
  // The VM runtime of vm.runtime, given the cleanup hooks of what this agent applies; a libvirt
  // runtime leaves the agent not adopted until it has reconciled its domains.
  void MakeVmRuntime();
  // slot.cleanup's hooks: unset while network.apply / exposure.apply is off.
  NetworkCleanupFn NetworkCleanup();
  NetworkCleanupFn ExposureCleanup();
  LibvirtOptions MakeLibvirtOptions(NetworkCleanupFn network_cleanup,
                                    NetworkCleanupFn exposure_cleanup);
  // The console relay (console.enabled), stopped when the service drains.
  Result<void> StartConsole();
  // The registration / reconcile thread, joined when the service drains.
  void StartControlLoop();
  void ControlLoop();
  // One registration attempt: true when accepted. A non-retryable refusal sets rejected_.
  bool TryRegister();
  void OnRegistered();
  // The followers of the node's documents (DocumentFollower): their hooks are the control
  // plane's RPCs and the changes to this host. The desired set kept in the local store is
  // restored as applied and acked.
  void MakeFollowers();
  // The follower of ingress's exposure document (exposure.apply != off), on the slice network
  // the network follower applied.
  void MakeExposureAgent();
  // The desired set's passthrough devices bound as its mode wants (host/pci_binding.hpp); what
  // the writes refused is kept in bind_blockers_ for the set's checks.
  void BindPassthrough(const v1::DesiredSlotSet& want);
  // One round of the desired slot set: stored in the local store, then acked. Inventory not
  // knowing the node isolates the agent.
  void PollDesired();
  // One round of ipam's network document: applied (then acked), and on every report interval
  // the applied network checked and repaired (acked again when the blockers change); then the
  // observed leases are published.
  void ReconcileNetwork();
  // Libvirt runtime: reconciles this agent's domains with the local ledger once (retried).
  void TryAdopt();
  // slot.cleanup with the network applied: releases each slot MAC's DHCP lease and restores the
  // document's reservations. "" when clean, else what failed.
  std::string CleanNetworkState(const v1::CleanupParams& params);
  Result<void> PublishTopology(const std::string& correlation_id, const log::Logger& log);
  DiscoveryOptions Options() const;
  NetContext NetCtx() const;
  // An event about this node (entity = node id), with a new event id.
  v1::Event NodeEvent(const std::string& subject, const std::string& correlation_id,
                      const google::protobuf::Message& data) const;
  messaging::HandlerResult HandleTask(const messaging::Delivery& d);
  // What running a task's handler asks of the consumer: answer (the result in `res`), or
  // redeliver later without answering (a transient failure of the agent itself).
  struct TaskRun {
    std::string retry;  // non-empty: redeliver, with this reason
  };
  // One entry per task type: the params case it needs, whether it is a VM task (it then waits
  // for restart adoption and the network document), and its handler. HandleTask dispatches
  // through this table only; a type without an entry is rejected (unknown_task_type).
  // One task being run: its logger (task_id, type, allocation_id, trace_id, node_id on every
  // line) and the clock of its stages (gpuaas_node_task_seconds), defined in node_agent.cpp.
  struct TaskScope;
  struct TaskEntry {
    v1::NodeTask::ParamsCase params = v1::NodeTask::PARAMS_NOT_SET;
    bool vm_task = false;
    std::function<TaskRun(const v1::NodeTask&, TaskScope&, v1::NodeTaskResult&)> run;
  };
  void RegisterTasks();
  // topology.discover: a new topology report event (the result carries no output).
  TaskRun RunDiscover(const v1::NodeTask& task, TaskScope& scope, v1::NodeTaskResult& res);
  // prereq.check / network.baseline.check: the checks into `out` (a case of res.output).
  TaskRun RunChecks(v1::ChecksOutput& out, bool prereq, v1::NodeTaskResult& res);
  // Publishes a progress event and starts or extends `stage` on the task's stage clock.
  void PublishProgress(const v1::NodeTask& task, TaskScope& scope, const std::string& stage,
                       const std::string& detail, int percent, const ByteProgress* bytes = nullptr);
  // A finished task into gpuaas_node_task_seconds: its last stage (or the one its failure
  // names) and the whole task (stage "total").
  void ObserveTask(TaskScope& scope, const v1::NodeTaskResult& res,
                   std::chrono::steady_clock::time_point finished);
  void Isolate(const std::string& why);
  NodeAgentConfig cfg_;
  runtime::Service svc_;
  std::map<v1::TaskType, TaskEntry> tasks_by_type_;
  prometheus::Family<prometheus::Histogram>* task_seconds_ = nullptr;
  std::optional<LocalStore> store_;
  std::unique_ptr<VmRuntime> vm_runtime_;
  std::thread register_thread_;
  std::atomic<bool> registered_{false};
  std::atomic<bool> isolated_{true};
  std::atomic<bool> rejected_{false};
  std::atomic<int64_t> applied_version_{0};
  std::unique_ptr<DocumentFollower<v1::DesiredSlotSet>> desired_;
  // bind_failed / reboot_required of the last apply (the control thread alone touches it).
  std::vector<std::string> bind_blockers_;
  std::atomic<uint64_t> tasks_run_{0};
  std::atomic<int64_t> net_version_{0};
  std::vector<SlotDrift> net_slot_drift_;  // of the last network check; under net_mu_
  std::atomic<bool> adopted_{true};
  LibvirtRuntime* libvirt_ = nullptr;  // set when vm_runtime is libvirt (owned above)
  // The network document's follower (its applied document), the last report and its time
  // (under net_mu_: the control loop and the task thread's cleanup both use them).
  std::mutex net_mu_;
  std::unique_ptr<DocumentFollower<v1::NodeNetworkDocument>> net_;
  // The applied document while it asks for a slice network; nullptr before one is applied and
  // while it is `removed` (bare-metal mode). Under net_mu_.
  const v1::NodeNetworkDocument* SliceNetwork() const;
  // Ingress's exposure document (exposure.apply != off); thread-safe on its own.
  std::unique_ptr<ExposureAgent> exposures_;
  // The console relay (console.enabled); stopped before the connection drains.
  std::unique_ptr<ConsoleServer> console_;
  std::string net_last_report_;
  std::chrono::steady_clock::time_point net_published_at_{};
  messaging::Consumer* tasks_ = nullptr;
  bool discovered_ = false;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string last_error_;
};

}  // namespace gpuaas::node_agent
