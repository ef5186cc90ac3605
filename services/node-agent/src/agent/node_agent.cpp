#include "gpuaas/node_agent/agent/node_agent.hpp"

#include <unistd.h>

#include <array>
#include <set>

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/console/console_relay.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/host/pci_binding.hpp"
#include "gpuaas/node_agent/network/lease_report.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "gpuaas/node_agent/runtime/libvirt_runtime.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/topology.pb.h"
#include "network/net_host.hpp"
#include "network/ovs.hpp"

namespace gpuaas::node_agent {

namespace {
// MAAS's operating-mode tags (gpuaas-profile-slice-vm, gpuaas-profile-baremetal) are the
// profile's text behind this prefix.
constexpr const char* kMaasTagPrefix = "gpuaas-profile-";
}  // namespace

void NodeAgentConfig::Register(config::Schema& s) {
  common.Register(s, false);
  s.Add("node.id", &node_id, "This host's node id (lowercase DNS label)", "",
        [](const std::string& v) -> std::string {
          // It becomes a NATS subject token and a durable consumer name: refuse it at start
          // rather than being isolated by inventory later (an FQDN node name is a common slip).
          if (v.empty()) return "required";
          return ids::IsNodeId(v) ? "" : "must be a lowercase DNS label (a-z, 0-9, '-', max 63)";
        });
  s.Add("node.hostname", &hostname, "Hostname reported to inventory (empty: gethostname)", "");
  s.Add("node.region", &region, "Region the host belongs to", "", config::NonEmpty());
  s.Add("node.pool", &pool, "Pool the host belongs to", "default", config::NonEmpty());
  // MAAS's operating-mode tags name the same intent: deploy userdata may pass the tag as it is.
  std::vector<std::string> profiles = enums::Texts<v1::CapacityProfile>();
  for (const auto& t : enums::Texts<v1::CapacityProfile>()) profiles.push_back(kMaasTagPrefix + t);
  s.Add("node.capacity_profile", &capacity_profile,
        "baremetal | slice-vm (or MAAS's tag gpuaas-profile-baremetal | gpuaas-profile-slice-vm): "
        "the mode the host registers in",
        "slice-vm", config::OneOf(profiles));
  s.Add("node.state_dir", &state_dir, "Directory of the crash-safe local store",
        "/var/lib/gpuaas-node-agent", config::NonEmpty());
  s.Add("node.register_retry_ms", &register_retry_ms,
        "Delay between registration attempts while inventory is unreachable", 1000,
        config::Range(10, 600000));
  s.Add("node.desired_poll_ms", &desired_poll_ms,
        "How often the agent asks inventory for the node's desired slot set", 5000,
        config::Range(10, 600000));
  s.Add("node.host_root", &host_root,
        "Root of every host read (\"/\" on a host; a fixture tree in simulations)", "/",
        config::NonEmpty());
  s.Add("node.discover_on_start", &discover_on_start, "Report the host topology once registered",
        true);
  s.Add("network.mode", &network_mode, "Slice network mode checked on this host", "private-nat",
        config::OneOf({"private-nat", "fabric-only"}));
  s.Add("network.bridge", &bridge, "Bridge of the slices' management network", "ovsbr0",
        config::NonEmpty());
  s.Add("network.gateway_cidr", &gateway_cidr, "Gateway address expected on the bridge",
        "10.100.0.1/24", config::NonEmpty());
  s.Add("libvirt.uri", &libvirt_uri, "libvirt connection URI (\"\" skips the libvirt check)",
        "qemu:///system");
  s.Add("node_agent.sim_behavior", &sim_behavior,
        "Simulated VM runtime: succeed | fail (vm.provision fails at readiness with "
        "lease_timeout) | silent (vm.* and slot.cleanup tasks are acked, never answered)",
        "succeed", config::OneOf({"succeed", "fail", "silent"}));
  s.Add("vm.runtime", &vm_runtime,
        "VM runtime: simulated (fixture hosts; nothing created or wiped) | libvirt (libvirt.uri)",
        "simulated", config::OneOf({"simulated", "libvirt"}));
  s.Add("vm.domain_type", &vm_domain_type, "libvirt domain type: kvm | qemu (TCG)", "kvm",
        config::OneOf({"kvm", "qemu"}));
  s.Add("vm.passthrough", &vm_passthrough, "Pass GPUs and fabric VFs through (VFIO hostdevs)",
        true);
  s.Add("vm.image_cache_dir", &vm_image_cache_dir, "Image cache (\"\" = <node.state_dir>/images)",
        "");
  s.Add("vm.seed_dir", &vm_seed_dir, "NoCloud seed ISOs (\"\" = <node.state_dir>/seeds)", "");
  s.Add("vm.nvram_dir", &vm_nvram_dir, "Per-domain UEFI NVRAM files", "/var/lib/libvirt/qemu/nvram",
        config::NonEmpty());
  s.Add("vm.kernel", &vm_kernel, "Direct kernel boot (test guests); \"\" = boot the slot disk", "");
  s.Add("vm.initrd", &vm_initrd, "initrd for direct kernel boot", "");
  s.Add("vm.lease_timeout_s", &vm_lease_timeout_s,
        "Readiness: the VM's DHCP lease must appear within this", 300, config::Range(1, 3600));
  s.Add("vm.ssh_timeout_s", &vm_ssh_timeout_s,
        "Readiness: then an SSH banner on port 22 within this", 120, config::Range(1, 3600));
  s.Add("vm.terminal_key", &vm_terminal_key,
        "The node's terminal relay key, created when missing; its public key goes into every "
        "VM's ssh_authorized_keys (\"\" = <node.state_dir>/terminal/id_ed25519)",
        "");
  s.Add("vm.profile_name", &vm_profile_name, "Runtime profile name of this host's slots",
        "h200_24c_64g", config::NonEmpty());
  s.Add("vm.vcpus_per_gpu", &vm_vcpus_per_gpu, "Runtime profile: vCPUs per GPU of a slice VM", 24,
        config::Range(1, 1024));
  s.Add("vm.memory_mib_per_gpu", &vm_memory_mib_per_gpu,
        "Runtime profile: memory (MiB) per GPU of a slice VM", 65536, config::Range(64, 16777216));
  s.Add("vm.hugepages_1g_per_gpu", &vm_hugepages_1g_per_gpu,
        "Runtime profile: 1 GiB hugepages backing per GPU (0 = none)", 0, config::Range(0, 16384));
  s.Add("network.apply", &net_apply,
        "Manage slice networking from ipam's node network document: off | netns (inside "
        "network.netns) | host",
        "off", config::OneOf({"off", "netns", "host"}));
  s.Add("exposure.apply", &exposure_apply,
        "Follow ingress's exposure document: off | simulate (acked as simulated, no kernel "
        "rules) | netns (nftables inside network.netns) | host",
        "off", config::OneOf({"off", "simulate", "netns", "host"}));
  s.Add("exposure.uplink", &exposure_uplink,
        "The node's public interface exposures are DNATed from (exposure.apply netns/host)", "");
  s.Add("exposure.sys_root", &exposure_sys_root,
        "Where the uplink's sysfs entry is read (fabric check); \"\" = <node.host_root>/sys", "");
  s.Add("exposure.cleanup_wait_ms", &exposure_cleanup_wait_ms,
        "slot.cleanup waits this long for ingress to take the slots' exposures off the node",
        120000, config::Range(0, 3600000));
  s.Add("network.netns", &net_netns, "Network namespace the network is applied in (apply=netns)",
        "");
  s.Add("network.state_dir", &net_state_dir,
        "dnsmasq config, hosts and lease files of the slice network (\"\" = <node.state_dir>/net)",
        "");
  s.Add("network.ovs_rundir", &net_ovs_rundir,
        "Open vSwitch run directory (ovsdb-server's db.sock, ovs-vswitchd's <bridge>.mgmt); "
        "\"\" = the system's",
        "");
  s.Add("network.ovs_datapath_type", &net_ovs_datapath_type,
        "datapath_type of an OVS bridge the agent creates: \"\" (kernel) | netdev (userspace); "
        "an adopted bridge keeps its own",
        "", config::OneOf({"", "system", "netdev"}));
  s.Add("network.host_dnsmasq_dir", &net_host_dnsmasq_dir,
        "The host dnsmasq's config directory, where stale gpuaas-*.conf reservation files of "
        "earlier manual runs are moved aside (\"\" = do not look)",
        "/etc/dnsmasq.d");
  s.Add("vm.vnic_ingress_kbps", &vm_vnic_ingress_kbps,
        "Runtime profile: OVS ingress policing rate of each slice vNIC, kbit/s (0 = none)", 0,
        config::Range(0, 1000000000));
  s.Add("vm.vnic_ingress_burst_kb", &vm_vnic_ingress_burst_kb,
        "Runtime profile: OVS ingress policing burst of each slice vNIC, kbit (0 = OVS default)", 0,
        config::Range(0, 1000000000));
  s.Add("network.report_ms", &net_report_ms,
        "How often the applied network is checked (and repaired) and leases are reported", 5000,
        config::Range(50, 600000));
  s.Add("console.enabled", &console_enabled,
        "Serve console-gw's console.open and relay domains' VNC UNIX sockets", true);
  s.Add("console.window_bytes", &console_window_bytes,
        "The largest credit window (bytes in flight per direction) a console session may ask for",
        262144, config::Range(1024, 16777216));
  s.Add("console.max_sessions", &console_max_sessions,
        "Console relays this node runs at once (more: too_many_sessions)", 8,
        config::Range(1, 1024));
  s.Add("console.max_duration_s", &console_max_duration_s,
        "The longest a console relay stays open (caps the session's max_duration_s)", 43200,
        config::Range(1, 604800));
  s.Add("console.sim_socket_dir", &console_sim_socket_dir,
        "Simulated VM runtime only: a managed domain's console is <dir>/<domain>.vnc when that "
        "UNIX socket exists (a stand-in qemu -vnc unix:...; scripts/up and tests); \"\" = none",
        "");
  s.Add("node_agent.sim_step_ms", &sim_step_ms, "Simulated VM runtime: sleep per lifecycle stage",
        20, config::Range(0, 60000));
}

namespace {
// ipam's document as the applier's spec (defined with the network follower below).
NetworkSpec SpecFrom(const v1::NodeNetworkDocument& doc, const NodeAgentConfig& cfg);

// A node receives replies only on its own prefix (the server allows it nothing else).
runtime::CommonConfig NodeCommon(runtime::CommonConfig c, const std::string& node_id) {
  if (c.nats_inbox_prefix.empty()) c.nats_inbox_prefix = access::InboxPrefix("node-agent", node_id);
  return c;
}
}  // namespace

NodeAgent::NodeAgent(NodeAgentConfig cfg)
    : cfg_(std::move(cfg)),
      svc_(runtime::Component{"node-agent", nullptr}, NodeCommon(cfg_.common, cfg_.node_id)) {
  if (cfg_.hostname.empty()) {
    std::array<char, 256> host{};
    gethostname(host.data(), host.size() - 1);
    cfg_.hostname = host.data();
  }
  RegisterTasks();
  task_seconds_ = &prometheus::BuildHistogram()
                       .Name("gpuaas_node_task_seconds")
                       .Help(
                           "Node task durations by type and stage (stage \"total\": the whole "
                           "task) and result (succeeded | failed | rejected)")
                       .Register(svc_.metrics());
}

NodeAgent::~NodeAgent() { Shutdown(); }

namespace {

using google::protobuf::util::TimeUtil;

}  // namespace

Result<void> NodeAgent::Start() {
  if (auto valid = ValidateApplyModes(); !valid.ok()) return valid;
  auto store = LocalStore::Open(cfg_.state_dir);
  if (!store.ok()) return store.error();
  store_.emplace(std::move(*store));
  MakeVmRuntime();
  MakeFollowers();
  svc_.SetReady(false);
  // The node's identity reaches only its own tasks, events and inbox; the streams and its task
  // consumer are the control plane's (inventory creates the consumer when the node registers).
  if (auto r = svc_.Start(); !r.ok()) return r;
  if (cfg_.console_enabled) {
    if (auto r = StartConsole(); !r.ok()) return r;
  }
  StartControlLoop();
  return Ok();
}

Result<void> NodeAgent::ValidateApplyModes() const {
  if (cfg_.net_apply == "netns" && cfg_.net_netns.empty()) {
    return Error::InvalidArgument(reason::kInvalidConfig, "network.apply=netns needs network.netns",
                                  {{"network.netns", "required when network.apply is netns"}});
  }
  if ((cfg_.exposure_apply == "netns" || cfg_.exposure_apply == "host") &&
      (cfg_.exposure_uplink.empty() || cfg_.net_apply == "off" ||
       (cfg_.exposure_apply == "netns" && cfg_.net_apply != "netns"))) {
    return Error::InvalidArgument(
        reason::kInvalidConfig,
        "exposure.apply=" + cfg_.exposure_apply + " needs exposure.uplink and network.apply " +
            (cfg_.exposure_apply == "netns" ? "netns" : "on") +
            " (the slice addresses come from the applied network document)",
        {{"exposure.uplink", "required"}, {"network.apply", "must apply the network"}});
  }
  return Ok();
}

NetworkCleanupFn NodeAgent::NetworkCleanup() {
  // With the slice network managed here, a slot's cleanup releases its DHCP lease too, so the
  // next tenant starts clean (the reservation belongs to the approved slot and stays).
  if (cfg_.net_apply == "off") return {};
  return [this](const v1::CleanupParams& p) -> Result<void> {
    const std::string why = CleanNetworkState(p);
    if (why.empty()) return Ok();
    return Error::Unavailable(reason::kNetworkCleanupFailed, why);
  };
}

NetworkCleanupFn NodeAgent::ExposureCleanup() {
  // With exposures followed, a slot's cleanup waits until ingress has taken the slot's
  // exposures off the node (document and kernel): the proof's exposure_state_removed.
  if (cfg_.exposure_apply == "off") return {};
  return [this](const v1::CleanupParams& p) -> Result<void> {
    std::vector<std::string> ips;
    for (const auto& s : p.slots()) {
      if (!s.private_ip().empty()) ips.push_back(s.private_ip());
    }
    return exposures_->WaitRemoved(ips, std::chrono::milliseconds(cfg_.exposure_cleanup_wait_ms));
  };
}

void NodeAgent::MakeVmRuntime() {
  NetworkCleanupFn network_cleanup = NetworkCleanup();
  NetworkCleanupFn exposure_cleanup = ExposureCleanup();
  if (cfg_.vm_runtime == "libvirt") {
    auto rt = std::make_unique<LibvirtRuntime>(
        *store_, MakeLibvirtOptions(std::move(network_cleanup), std::move(exposure_cleanup)));
    libvirt_ = rt.get();
    vm_runtime_ = std::move(rt);
    adopted_ = false;
  } else {
    vm_runtime_ = std::make_unique<SimulatedRuntime>(
        *store_, SimOptions{cfg_.host_root, cfg_.sim_behavior, cfg_.sim_step_ms, network_cleanup,
                            exposure_cleanup});
  }
}

LibvirtOptions NodeAgent::MakeLibvirtOptions(NetworkCleanupFn network_cleanup,
                                             NetworkCleanupFn exposure_cleanup) {
  LibvirtOptions lo;
  lo.uri = cfg_.libvirt_uri;
  lo.host_root = cfg_.host_root;
  lo.image_cache_dir =
      cfg_.vm_image_cache_dir.empty() ? cfg_.state_dir + "/images" : cfg_.vm_image_cache_dir;
  lo.seed_dir = cfg_.vm_seed_dir.empty() ? cfg_.state_dir + "/seeds" : cfg_.vm_seed_dir;
  lo.domain.domain_type = cfg_.vm_domain_type;
  if (cfg_.vm_domain_type == "qemu") lo.domain.cpu_mode = "maximum";
  lo.domain.passthrough = cfg_.vm_passthrough;
  lo.domain.nvram_dir = cfg_.vm_nvram_dir;
  lo.domain.bridge = cfg_.bridge;
  lo.domain.kernel = cfg_.vm_kernel;
  lo.domain.initrd = cfg_.vm_initrd;
  lo.lease_file = (cfg_.net_state_dir.empty() ? cfg_.state_dir + "/net" : cfg_.net_state_dir) +
                  "/dnsmasq.leases";
  lo.lease_timeout = std::chrono::seconds(cfg_.vm_lease_timeout_s);
  lo.ssh_timeout = std::chrono::seconds(cfg_.vm_ssh_timeout_s);
  lo.relay_key_path =
      cfg_.vm_terminal_key.empty() ? cfg_.state_dir + "/terminal/id_ed25519" : cfg_.vm_terminal_key;
  // The slice network (and so the VM's SSH port) lives where the agent applies it.
  lo.ssh_probe = SshProbeInNetns(cfg_.net_apply == "netns" ? cfg_.net_netns : "");
  if (cfg_.net_apply != "off") {
    lo.applied_bridge = [this]() -> std::optional<LibvirtOptions::AppliedBridge> {
      std::lock_guard lock(net_mu_);
      const auto* net = SliceNetwork();
      if (net == nullptr) return std::nullopt;
      const bool ovs = net->datapath() == v1::NETWORK_DATAPATH_OVS;
      LibvirtOptions::AppliedBridge applied{net->bridge(), ovs, false};
      if (ovs) {
        // The bridge's own datapath (an adopted one keeps its own), else the configured one.
        const NetContext ctx = NetCtx();
        const NetHost host(ctx);
        auto bridge = Ovs(host, ctx.ovs_rundir).Bridge(applied.name);
        applied.userspace = bridge.ok() && bridge->exists ? bridge->datapath_type == "netdev"
                                                          : cfg_.net_ovs_datapath_type == "netdev";
      }
      return applied;
    };
    lo.network_cleanup = std::move(network_cleanup);
    lo.vnic_attached = [this]() -> Result<void> {
      std::lock_guard lock(net_mu_);
      const auto* net = SliceNetwork();
      if (net == nullptr) return Ok();
      auto applied = ApplyNetwork(SpecFrom(*net, cfg_), NetCtx());
      if (!applied.ok()) return applied.error();
      return Ok();
    };
  }
  lo.exposure_cleanup = std::move(exposure_cleanup);
  return lo;
}

Result<void> NodeAgent::StartConsole() {
  ConsoleOptions co;
  co.node_id = cfg_.node_id;
  co.max_window_bytes = cfg_.console_window_bytes;
  co.max_sessions = static_cast<int>(cfg_.console_max_sessions);
  co.max_duration_s = cfg_.console_max_duration_s;
  // Only a libvirt runtime has consoles; the ledger says which domains are this agent's.
  console_ = std::make_unique<ConsoleServer>(
      svc_.nats(), co,
      LedgerConsoleLocator(*store_, cfg_.vm_runtime == "libvirt" ? cfg_.libvirt_uri : "",
                           cfg_.vm_runtime == "libvirt" ? "" : cfg_.console_sim_socket_dir),
      svc_.log(), &svc_.metrics());
  if (auto r = console_->Start(); !r.ok()) return r;
  // Relays end with agent_stopping while the connection can still say so.
  svc_.OnDrain("console relays", [this] { console_->Stop(); });
  return Ok();
}

void NodeAgent::StartControlLoop() {
  svc_.OnDrain("control loop", [this] {
    stop_ = true;
    cv_.notify_all();
    if (register_thread_.joinable()) register_thread_.join();
  });
  register_thread_ = std::thread([this] { ControlLoop(); });
}

void NodeAgent::Shutdown() { svc_.Shutdown(); }

std::string NodeAgent::LastError() const {
  std::lock_guard lock(mu_);
  return last_error_;
}

void NodeAgent::Isolate(const std::string& why) {
  if (!isolated_.exchange(true)) {
    svc_.log().Warn("agent isolated: refusing tasks", {{"node_id", cfg_.node_id}, {"why", why}});
  }
  registered_ = false;
  discovered_ = false;  // the next registration reports the topology again
  svc_.SetReady(false);
  std::lock_guard lock(mu_);
  last_error_ = why;
}

void NodeAgent::ControlLoop() {
  while (!stop_) {
    int64_t wait_ms = cfg_.desired_poll_ms;
    if (!registered_) {
      if (TryRegister()) {
        OnRegistered();
      } else if (rejected_) {
        return;  // isolated until an operator fixes the configuration and restarts the agent
      } else {
        wait_ms = cfg_.register_retry_ms;
      }
    }
    if (!adopted_) TryAdopt();
    if (registered_) {
      PollDesired();
      if (cfg_.net_apply != "off" && !isolated_) ReconcileNetwork();
      if (exposures_ && !isolated_) exposures_->Step();
    }
    std::unique_lock lock(mu_);
    if (registered_ && (cfg_.net_apply != "off" || exposures_)) {
      wait_ms = std::min(wait_ms, cfg_.net_report_ms);
    }
    cv_.wait_for(lock, std::chrono::milliseconds(registered_ ? wait_ms : cfg_.register_retry_ms),
                 [this] { return stop_.load(); });
  }
}

bool NodeAgent::TryRegister() {
  rpc::Client client(svc_.nats());
  v1::RegisterNodeRequest req;
  req.set_node_id(cfg_.node_id);
  req.set_hostname(cfg_.hostname);
  req.set_region(cfg_.region);
  req.set_pool(cfg_.pool);
  std::string profile = cfg_.capacity_profile;
  if (profile.rfind(kMaasTagPrefix, 0) == 0) profile.erase(0, std::string(kMaasTagPrefix).size());
  req.set_capacity_profile(enums::FromColumn<v1::CapacityProfile>(profile));
  req.set_agent_version(GPUAAS_VERSION);
  const auto log = svc_.log().With({{"node_id", cfg_.node_id}});
  auto r = client.Call<v1::RegisterNodeResponse>(
      "gpuaas.v1.inventory.node.{node_id}.register", req,
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
    return true;
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
    rejected_ = true;
    return false;
  }
  log.Warn("inventory unreachable, will retry", {{"error", r.error().ToString()}});
  return false;
}

void NodeAgent::OnRegistered() {
  isolated_ = false;
  {
    std::lock_guard lock(mu_);
    last_error_.clear();
  }
  if (!tasks_) {
    // Made by inventory at registration (its ack wait included); the agent binds to it.
    messaging::ConsumerSpec spec = messaging::NodeTaskConsumerSpec(cfg_.node_id);
    spec.bind_only = true;
    auto c =
        svc_.StartConsumer(spec, [this](const messaging::Delivery& d) { return HandleTask(d); });
    if (!c.ok()) {
      svc_.log().Error("cannot start the task consumer", {{"error", c.error().ToString()}});
    } else {
      tasks_ = *c;
    }
  }
  if (cfg_.discover_on_start && !discovered_) {
    if (auto r = PublishTopology("", svc_.log().With({{"node_id", cfg_.node_id}})); r.ok()) {
      discovered_ = true;
    } else {
      svc_.log().Warn("topology not reported; will retry after the next registration",
                      {{"error", r.error().ToString()}});
    }
  }
  svc_.SetReady(adopted_.load());
  registered_ = true;
}

v1::Event NodeAgent::NodeEvent(const std::string& subject, const std::string& correlation_id,
                               const google::protobuf::Message& data) const {
  outbox::EventSpec spec;  // by name: EventSpec grows fields
  spec.nats_subject = subject;
  spec.source = svc_.source();
  spec.entity = cfg_.node_id;
  spec.correlation_id = correlation_id;
  spec.data = &data;
  v1::Principal actor;  // the node's own identity (its key is the node's)
  actor.set_subject("node:" + cfg_.node_id);
  spec.actor = &actor;
  return outbox::MakeEvent(spec);
}

DiscoveryOptions NodeAgent::Options() const {
  DiscoveryOptions opts;
  opts.root = cfg_.host_root;
  opts.node_id = cfg_.node_id;
  opts.hostname = cfg_.hostname;
  opts.agent_version = GPUAAS_VERSION;
  opts.network_mode = cfg_.network_mode;
  opts.bridge = cfg_.bridge;
  opts.gateway_cidr = cfg_.gateway_cidr;
  if (!cfg_.net_ovs_rundir.empty()) opts.ovs_db = "unix:" + cfg_.net_ovs_rundir + "/db.sock";
  opts.libvirt_uri = cfg_.libvirt_uri;
  opts.profile.set_name(cfg_.vm_profile_name);
  opts.profile.set_vcpus_per_gpu(static_cast<int32_t>(cfg_.vm_vcpus_per_gpu));
  opts.profile.set_memory_mib_per_gpu(cfg_.vm_memory_mib_per_gpu);
  opts.profile.set_hugepages_1g_per_gpu(static_cast<int32_t>(cfg_.vm_hugepages_1g_per_gpu));
  return opts;
}

Result<void> NodeAgent::PublishTopology(const std::string& correlation_id, const log::Logger& log) {
  auto report = Discover(Options());
  if (!report.ok()) return report.error();
  const std::string subject =
      fmt::format("gpuaas.v1.evt.node.{node_id}.topology", fmt::arg("node_id", cfg_.node_id));
  const v1::Event ev = NodeEvent(subject, correlation_id, *report);
  auto ack = messaging::JsPublish(*svc_.nats(), subject, ev.SerializeAsString(), ev.id());
  if (!ack.ok()) return ack.error();
  log.Info("topology reported", {{"gpus", std::to_string(report->gpus_size())},
                                 {"candidates", std::to_string(report->candidates_size())},
                                 {"blockers", std::to_string(report->node_blockers_size())}});
  return Ok();
}

void NodeAgent::PollDesired() {
  const auto round = desired_->Step(std::chrono::steady_clock::now());
  if (round.fetch_error) {
    if (round.fetch_error->code == Code::kNotFound) {
      // Inventory does not know this node (it was removed or its database was reset): refuse
      // tasks until it is registered again.
      Isolate("inventory does not know this node: " + round.fetch_error->ToString());
      return;
    }
    // Transient: the last desired set we applied stays.
    svc_.log().Debug("desired set not fetched", {{"error", round.fetch_error->ToString()}});
  }
  if (round.apply_error) {
    svc_.log().Error("cannot persist desired set", {{"error", round.apply_error->ToString()}});
  }
  if (round.ack_error) {
    svc_.log().Warn("desired set stored but not acked; will ack again",
                    {{"version", std::to_string(desired_->applied_version())},
                     {"error", round.ack_error->ToString()}});
  }
  if (round.acked_now) {
    applied_version_ = desired_->acked_version();
    svc_.log().Info("desired slot set applied",
                    {{"version", std::to_string(desired_->acked_version())},
                     {"slots", std::to_string(desired_->applied()->slots_size())}});
  }
}

struct NodeAgent::TaskScope {
  using Clock = std::chrono::steady_clock;
  log::Logger log;
  std::string type;         // the task type's text ("unknown" for a type without one)
  std::string traceparent;  // a child of the task's: on the events published about it
  Clock::time_point started = Clock::now();
  // The stage clock: a stage runs from the end of the one before (or the task's start) to its
  // own last progress report; runtimes report a stage when it has done its work.
  std::string stage;
  Clock::time_point boundary = started;
  Clock::time_point last_report = started;
};

namespace {

using TaskScopeClock = std::chrono::steady_clock;

// The allocation a task is about, from its payload ("" for a host task such as discovery).
const std::string& TaskAllocationId(const v1::NodeTask& t) {
  static const std::string kNone;
  switch (t.params_case()) {
    case v1::NodeTask::kVmProvision:
      return t.vm_provision().allocation_id();
    case v1::NodeTask::kVmRelease:
      return t.vm_release().allocation_id();
    case v1::NodeTask::kSlotCleanup:
      return t.slot_cleanup().allocation_id();
    default:
      return kNone;
  }
}

double Seconds(TaskScopeClock::duration d) { return std::chrono::duration<double>(d).count(); }

const prometheus::Histogram::BucketBoundaries& TaskBuckets() {
  static const prometheus::Histogram::BucketBoundaries kBuckets = {
      0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800};
  return kBuckets;
}

void ObserveStage(prometheus::Family<prometheus::Histogram>& family, const std::string& type,
                  const std::string& stage, const std::string& result, double seconds,
                  const log::Logger& log) {
  family.Add({{"type", type}, {"stage", stage}, {"result", result}}, TaskBuckets())
      .Observe(seconds);
  log.Debug("task stage done",
            {{"stage", stage}, {"result", result}, {"seconds", fmt::format("{:.3f}", seconds)}});
}

}  // namespace

void NodeAgent::PublishProgress(const v1::NodeTask& task, TaskScope& scope,
                                const std::string& stage, const std::string& detail, int percent,
                                const ByteProgress* bytes) {
  const auto now = TaskScopeClock::now();
  if (stage != scope.stage) {
    if (!scope.stage.empty()) {
      ObserveStage(*task_seconds_, scope.type, scope.stage, "succeeded",
                   Seconds(scope.last_report - scope.boundary), scope.log);
      scope.boundary = scope.last_report;
    }
    scope.stage = stage;
  }
  scope.last_report = now;
  v1::NodeTaskProgress p;
  p.set_task_id(task.task_id());
  p.set_node_id(cfg_.node_id);
  p.set_type(task.type());
  p.set_stage(enums::FromColumn<v1::TaskStage>(stage));
  p.set_detail(detail);
  p.set_percent(percent);
  if (bytes != nullptr) {
    auto* b = p.mutable_bytes();
    b->set_phase(bytes->phase);
    b->set_done(bytes->done);
    b->set_total(bytes->total);
    b->set_bytes_per_second(bytes->bytes_per_second);
  }
  const std::string subject =
      fmt::format("gpuaas.v1.evt.node.{node_id}.task.progress", fmt::arg("node_id", cfg_.node_id));
  // Progress is advisory: a fresh event id each time, nothing stored, a lost one is only logged.
  const v1::Event ev = NodeEvent(subject, task.correlation_id(), p);
  messaging::Headers h;
  if (!scope.traceparent.empty()) h[messaging::kHeaderTraceparent] = scope.traceparent;
  if (auto ack = messaging::JsPublish(*svc_.nats(), subject, ev.SerializeAsString(), ev.id(), h);
      !ack.ok()) {
    scope.log.Warn("task progress not published",
                   {{"stage", stage}, {"error", ack.error().ToString()}});
  }
}

namespace {

// A VM runtime's answer as the task's result: its output in the result's oneof, or the failure
// with its typed stage. The node scheduler refusing a bundle (host validation, or another
// allocation's lease) is a rejection: nothing on the host was touched; later stages fail.
template <typename Out>
void RecordVmOutcome(const v1::NodeTask& task, Result<Out> r, Out* out, v1::NodeTaskResult& res) {
  if (r.ok()) {
    *out = std::move(*r);
    res.set_status(v1::TASK_STATUS_SUCCEEDED);
    return;
  }
  res.clear_output();  // a failed task has no output
  const Error& e = r.error();
  auto details = e.details;
  v1::TaskStage stage = v1::TASK_STAGE_UNSPECIFIED;
  if (auto it = details.find("stage"); it != details.end()) {
    stage = enums::FromColumn<v1::TaskStage>(it->second);
    details.erase(it);  // it travels as the typed `stage` field
  }
  const bool refused = task.type() == v1::TASK_TYPE_VM_PROVISION &&
                       (stage == v1::TASK_STAGE_VALIDATE || stage == v1::TASK_STAGE_LEASE);
  res.set_status(refused ? v1::TASK_STATUS_REJECTED : v1::TASK_STATUS_FAILED);
  res.set_stage(stage);
  auto* err = res.mutable_error();
  err->set_code(static_cast<v1::Code>(static_cast<int>(e.code)));
  err->set_reason(e.reason);
  err->set_message(e.message);
  err->set_retryable(e.retryable);
  for (const auto& [k, v] : details) (*err->mutable_details())[k] = v;
}

}  // namespace

void NodeAgent::RegisterTasks() {
  using T = v1::NodeTask;
  auto progress = [this](const T& t, TaskScope& scope) -> ProgressFn {
    return [this, &t, &scope](const std::string& stage, const std::string& detail, int percent,
                              const ByteProgress* bytes) {
      PublishProgress(t, scope, stage, detail, percent, bytes);
    };
  };
  tasks_by_type_ = {
      {v1::TASK_TYPE_TOPOLOGY_DISCOVER,
       {T::kTopologyDiscover, false,
        [this](const T& t, TaskScope& s, v1::NodeTaskResult& r) { return RunDiscover(t, s, r); }}},
      {v1::TASK_TYPE_PREREQ_CHECK,
       {T::kPrereqCheck, false,
        [this](const T&, TaskScope&, v1::NodeTaskResult& r) {
          return RunChecks(*r.mutable_prereq_check(), true, r);
        }}},
      {v1::TASK_TYPE_NETWORK_BASELINE_CHECK,
       {T::kNetworkBaselineCheck, false,
        [this](const T&, TaskScope&, v1::NodeTaskResult& r) {
          return RunChecks(*r.mutable_network_baseline_check(), false, r);
        }}},
      {v1::TASK_TYPE_VM_PROVISION,
       {T::kVmProvision, true,
        [this, progress](const T& t, TaskScope& s, v1::NodeTaskResult& r) {
          RecordVmOutcome(t, vm_runtime_->Provision(t.vm_provision(), progress(t, s)),
                          r.mutable_vm_provision(), r);
          return TaskRun{};
        }}},
      {v1::TASK_TYPE_VM_RELEASE,
       {T::kVmRelease, true,
        [this, progress](const T& t, TaskScope& s, v1::NodeTaskResult& r) {
          RecordVmOutcome(t, vm_runtime_->Release(t.vm_release(), progress(t, s)),
                          r.mutable_vm_release(), r);
          return TaskRun{};
        }}},
      {v1::TASK_TYPE_SLOT_CLEANUP,
       {T::kSlotCleanup, true,
        [this, progress](const T& t, TaskScope& s, v1::NodeTaskResult& r) {
          RecordVmOutcome(t, vm_runtime_->Cleanup(t.slot_cleanup(), progress(t, s)),
                          r.mutable_slot_cleanup(), r);
          return TaskRun{};
        }}},
  };
}

namespace {

void FailDiscovery(const std::string& message, v1::NodeTaskResult& res) {
  res.set_status(v1::TASK_STATUS_FAILED);
  res.mutable_error()->set_code(v1::INTERNAL);
  res.mutable_error()->set_reason(reason::kDiscoveryFailed.str());
  res.mutable_error()->set_message(message);
}

}  // namespace

NodeAgent::TaskRun NodeAgent::RunDiscover(const v1::NodeTask& task, TaskScope& scope,
                                          v1::NodeTaskResult& res) {
  if (auto r = PublishTopology(task.correlation_id(), scope.log); !r.ok()) {
    if (r.error().retryable) return {r.error().ToString()};
    FailDiscovery(r.error().ToString(), res);
  } else {
    res.set_status(v1::TASK_STATUS_SUCCEEDED);
  }
  return {};
}

NodeAgent::TaskRun NodeAgent::RunChecks(v1::ChecksOutput& out, bool prereq,
                                        v1::NodeTaskResult& res) {
  auto report = Discover(Options());
  if (!report.ok()) {
    res.clear_output();
    FailDiscovery(report.error().ToString(), res);
    return {};
  }
  *out.mutable_checks() = prereq ? report->prereqs() : report->network_checks();
  if (!prereq) *out.mutable_network() = report->network();
  *out.mutable_node_blockers() = report->node_blockers();
  res.set_status(v1::TASK_STATUS_SUCCEEDED);
  return {};
}

NetContext NodeAgent::NetCtx() const {
  NetContext ctx;
  ctx.netns = cfg_.net_apply == "netns" ? cfg_.net_netns : "";
  ctx.ovs_rundir = cfg_.net_ovs_rundir;
  ctx.ovs_datapath_type = cfg_.net_ovs_datapath_type;
  ctx.host_dnsmasq_dir = cfg_.net_host_dnsmasq_dir;
  return ctx;
}

namespace {

std::string NetStateDir(const NodeAgentConfig& cfg) {
  return cfg.net_state_dir.empty() ? cfg.state_dir + "/net" : cfg.net_state_dir;
}

// ipam's document as the applier's spec (the vNIC QoS is the host's runtime profile's).
NetworkSpec SpecFrom(const v1::NodeNetworkDocument& doc, const NodeAgentConfig& cfg) {
  NetworkSpec spec;
  spec.datapath =
      doc.datapath() == v1::NETWORK_DATAPATH_OVS ? Datapath::kOvs : Datapath::kLinuxBridge;
  spec.vnic_ingress_kbps = cfg.vm_vnic_ingress_kbps;
  spec.vnic_ingress_burst_kb = cfg.vm_vnic_ingress_burst_kb;
  spec.bridge = doc.bridge();
  spec.subnet_cidr = doc.subnet();
  const auto slash = doc.subnet().find('/');
  spec.gateway_cidr =
      doc.gateway() + (slash == std::string::npos ? "" : doc.subnet().substr(slash));
  for (const auto& r : doc.reservations()) {
    spec.reservations.push_back({r.mac(), r.ip(), r.hostname(), r.slot_key()});
  }
  spec.masquerade = doc.nat().masquerade();
  spec.ip_forward = doc.nat().ip_forward();
  spec.isolate_ports = doc.isolation().deny_cross_slice();
  spec.state_dir = NetStateDir(cfg);
  spec.version = doc.version();
  return spec;
}

// The seed's VLAN/project networks have room in the document but no datapath here yet: a
// document that uses them is refused rather than applied as if they were not there.
Result<void> RefuseProjectNetworks(const v1::NodeNetworkDocument& doc) {
  for (const auto& r : doc.reservations()) {
    if (!r.network_id().empty() || !r.network_policy_id().empty() ||
        !r.project_network_id().empty()) {
      return Error::InvalidArgument(reason::kProjectNetworksUnsupported,
                                    "reservation " + r.slot_key() +
                                        " names a project network; this agent applies only "
                                        "the node's management network",
                                    {{"slot_key", r.slot_key()}});
    }
  }
  return Ok();
}

// A `removed` document (the node in bare-metal mode): the slice network comes off the host.
Result<void> RemoveSliceNetwork(const v1::NodeNetworkDocument& doc, const NodeAgentConfig& cfg,
                                const NetContext& ctx, const log::Logger& log) {
  auto down = TeardownNetwork(SpecFrom(doc, cfg), ctx);
  if (!down.ok()) {
    log.Error("slice network not removed",
              {{"version", std::to_string(doc.version())}, {"error", down.error().ToString()}});
    return down.error();
  }
  log.Info("slice network removed: the node is in bare-metal mode",
           {{"version", std::to_string(doc.version())}, {"bridge", doc.bridge()}});
  return Ok();
}

// What is left of a removed slice network is removed again; what still is left after that is
// the ack's blocker slice_network_present.
Result<std::vector<std::string>> CheckSliceNetworkGone(const v1::NodeNetworkDocument& doc,
                                                       const NodeAgentConfig& cfg,
                                                       const NetContext& ctx,
                                                       const log::Logger& log) {
  const NetworkSpec spec = SpecFrom(doc, cfg);
  auto left = CheckTeardown(spec, ctx);
  if (left.ok() && !left->empty()) {
    log.Warn("slice network still present on a bare-metal node; removing it again",
             {{"left", fmt::format("{}", fmt::join(*left, ","))}});
    (void)TeardownNetwork(spec, ctx);
    left = CheckTeardown(spec, ctx);
  }
  if (!left.ok()) {
    log.Warn("slice network removal not checked", {{"error", left.error().ToString()}});
    return std::vector<std::string>{reason::kNetworkCheckFailed.str()};
  }
  if (left->empty()) return std::vector<std::string>();
  return std::vector<std::string>{reason::kSliceNetworkPresent.str()};
}

}  // namespace

const v1::NodeNetworkDocument* NodeAgent::SliceNetwork() const {
  const auto& applied = net_->applied();
  if (!applied || applied->removed()) return nullptr;
  return &*applied;
}

std::string NodeAgent::CleanNetworkState(const v1::CleanupParams& params) {
  std::lock_guard lock(net_mu_);
  // No network applied yet, or removed (bare-metal mode): no DHCP state on this host.
  const auto* net = SliceNetwork();
  if (net == nullptr) return "";
  const NetContext ctx = NetCtx();
  const NetworkSpec spec = SpecFrom(*net, cfg_);
  std::vector<std::string> problems;
  for (const auto& slot : params.slots()) {
    if (slot.mac().empty()) continue;
    RemovalReport report;
    if (auto r = RemoveReservation(spec, slot.mac(), ctx, &report); !r.ok()) {
      problems.push_back(slot.slot_key() + ": " + r.error().ToString());
    }
  }
  // RemoveReservation also dropped the hosts entries: put back what the document reserves.
  if (auto r = ApplyNetwork(spec, ctx); !r.ok()) {
    problems.push_back("re-apply: " + r.error().ToString());
  }
  return problems.empty() ? "" : fmt::format("{}", fmt::join(problems, "; "));
}

void NodeAgent::TryAdopt() {
  if (!libvirt_) {
    adopted_ = true;
    return;
  }
  auto r = libvirt_->Adopt();
  const auto log = svc_.log().With({{"node_id", cfg_.node_id}});
  if (!r.ok()) {
    log.Warn("restart adoption failed; will retry (not ready meanwhile)",
             {{"error", r.error().ToString()}});
    return;
  }
  for (const auto& d : r->orphans) {
    log.Warn("orphan domain: defined in libvirt, unknown to the ledger (drift; not removed)",
             {{"domain", d.domain_name}, {"state", d.state}});
  }
  for (const auto& d : r->missing) {
    log.Warn("missing domain: in the ledger, not in libvirt (drift)",
             {{"domain", d.domain_name}, {"allocation_id", d.allocation_id}});
  }
  // Drift stays visible after the log lines scroll away: orphans and missing domains are
  // gauges until the next adoption (an operator resolves them; nothing is removed here).
  auto& family = prometheus::BuildGauge()
                     .Name("gpuaas_node_agent_adopted_domains")
                     .Help(
                         "Domains found at the last restart adoption: adopted (in libvirt and "
                         "the ledger), orphan (libvirt only: drift), missing (ledger only: drift)")
                     .Register(svc_.metrics());
  family.Add({{"result", "adopted"}}).Set(static_cast<double>(r->adopted.size()));
  family.Add({{"result", "orphan"}}).Set(static_cast<double>(r->orphans.size()));
  family.Add({{"result", "missing"}}).Set(static_cast<double>(r->missing.size()));
  log.Info("restart adoption done", {{"adopted", std::to_string(r->adopted.size())},
                                     {"orphans", std::to_string(r->orphans.size())},
                                     {"missing", std::to_string(r->missing.size())}});
  adopted_ = true;
  if (registered_) svc_.SetReady(true);
}

void NodeAgent::BindPassthrough(const v1::DesiredSlotSet& want) {
  bind_blockers_.clear();
  if (want.mode() == v1::CAPACITY_PROFILE_UNSPECIFIED) return;  // a set from before modes
  const HostRoot host(cfg_.host_root);
  auto kernel = KernelFor(host);
  const auto r =
      ApplyBinding(host, *kernel, want.mode(),
                   {want.passthrough_devices().begin(), want.passthrough_devices().end()});
  for (const auto& e : r.errors) {
    svc_.log().Warn("binding write refused", {{"error", e.ToString()}});
  }
  // Only what the writes themselves report; the links are read again by the check.
  for (const auto& b : r.blockers) {
    if (b.rfind(reason::kBindFailed.str(), 0) == 0 ||
        b.rfind(reason::kRebootRequired.str(), 0) == 0) {
      bind_blockers_.push_back(b);
    }
  }
  if (r.changed || !r.blockers.empty()) {
    svc_.log().Info("passthrough devices bound",
                    {{"mode", enums::Text(want.mode())},
                     {"devices", std::to_string(want.passthrough_devices_size())},
                     {"blockers", fmt::format("{}", fmt::join(r.blockers, ","))}});
  }
}

void NodeAgent::MakeFollowers() {
  const auto timeout = std::chrono::milliseconds(cfg_.common.nats_request_timeout_ms);
  // "Apply" for the desired set: bind the passthrough devices as its mode wants (slice-vm:
  // vfio-pci, kept across reboots; baremetal: their host drivers), then persist the set the VM
  // runtime will follow. Check only reads the bindings: what is wrong goes to inventory in the
  // ack (a lost binding is repaired by the next version, slot.repair's rebind generation).
  DocumentFollower<v1::DesiredSlotSet>::Hooks desired;
  desired.fetch = [this, timeout]() -> Result<v1::DesiredSlotSet> {
    v1::GetDesiredSlotsRequest req;
    req.set_node_id(cfg_.node_id);
    auto r = rpc::Client(svc_.nats())
                 .Call<v1::GetDesiredSlotsResponse>(
                     "gpuaas.v1.inventory.node.{node_id}.desired.get", req, timeout);
    if (!r.ok()) return r.error();
    return r->desired();
  };
  desired.apply = [this](const v1::DesiredSlotSet& want) -> Result<void> {
    BindPassthrough(want);
    nlohmann::json doc = {{"version", want.version()},
                          {"set", nlohmann::json::parse(protojson::ToJson(want))}};
    return store_->Put("desired", doc);
  };
  desired.check = [this](const v1::DesiredSlotSet& doc) -> Result<std::vector<std::string>> {
    if (doc.mode() == v1::CAPACITY_PROFILE_UNSPECIFIED) return std::vector<std::string>();
    std::set<std::string> out(bind_blockers_.begin(), bind_blockers_.end());
    for (auto& b :
         CheckBinding(HostRoot(cfg_.host_root), doc.mode(),
                      {doc.passthrough_devices().begin(), doc.passthrough_devices().end()})) {
      out.insert(std::move(b));
    }
    return std::vector<std::string>(out.begin(), out.end());
  };
  desired.ack = [this, timeout](int64_t version,
                                const std::vector<std::string>& blockers) -> Result<void> {
    v1::AckDesiredSlotsRequest ack;
    ack.set_node_id(cfg_.node_id);
    ack.set_version(version);
    for (const auto& b : blockers) ack.add_blockers(b);
    auto a = rpc::Client(svc_.nats())
                 .Call<v1::AckDesiredSlotsResponse>(
                     "gpuaas.v1.inventory.node.{node_id}.desired.ack", ack, timeout);
    if (!a.ok()) return a.error();
    return Ok();
  };
  desired_ = std::make_unique<DocumentFollower<v1::DesiredSlotSet>>(
      std::move(desired), std::chrono::milliseconds(cfg_.desired_poll_ms));
  if (auto v = store_->Get("desired"); v.ok() && v->has_value()) {
    v1::DesiredSlotSet kept;
    if (const auto set = (**v).find("set"); set != (**v).end()) {
      (void)protojson::FromJson(set->dump(), &kept);
    }
    kept.set_version((**v).value("version", int64_t{0}));
    applied_version_ = kept.version();
    desired_->Restore(std::move(kept));
  }

  const NetContext ctx = NetCtx();
  const NodeAgentConfig& cfg = cfg_;
  const auto log = svc_.log().With({{"node_id", cfg_.node_id}});
  DocumentFollower<v1::NodeNetworkDocument>::Hooks net;
  net.fetch = [this, timeout]() -> Result<v1::NodeNetworkDocument> {
    v1::GetNodeNetworkRequest get;
    get.set_node_id(cfg_.node_id);
    auto doc = rpc::Client(svc_.nats())
                   .Call<v1::GetNodeNetworkResponse>("gpuaas.v1.ipam.node.{node_id}.network.get",
                                                     get, timeout);
    if (!doc.ok()) return doc.error();
    return doc->document();
  };
  net.apply = [ctx, cfg, log](const v1::NodeNetworkDocument& doc) -> Result<void> {
    if (doc.removed()) return RemoveSliceNetwork(doc, cfg, ctx, log);
    if (auto refused = RefuseProjectNetworks(doc); !refused.ok()) return refused.error();
    const NetworkSpec spec = SpecFrom(doc, cfg);
    auto applied = ApplyNetwork(spec, ctx);
    if (!applied.ok()) {
      log.Error("network document not applied",
                {{"version", std::to_string(spec.version)}, {"error", applied.error().ToString()}});
      return applied.error();
    }
    log.Info("network document applied",
             {{"version", std::to_string(spec.version)},
              {"changes", fmt::format("{}", fmt::join(applied->Changes(), ","))}});
    return Ok();
  };
  // Check what is really there; repair what is missing (the runbook's silent MASQUERADE loss).
  // The node's blockers go with the ack; the slots' vNIC drift with the next lease report
  // (net_slot_drift_, under net_mu_ like every step of the follower).
  net.check = [this, ctx, cfg,
               log](const v1::NodeNetworkDocument& doc) -> Result<std::vector<std::string>> {
    const NetworkSpec spec = SpecFrom(doc, cfg);
    std::vector<std::string> blockers;
    net_slot_drift_.clear();
    if (doc.removed()) return CheckSliceNetworkGone(doc, cfg, ctx, log);
    if (auto check = CheckNetwork(spec, ctx); !check.ok()) {
      blockers.push_back(reason::kNetworkCheckFailed.str());
      log.Warn("network check failed", {{"error", check.error().ToString()}});
    } else if (!check->ok()) {
      std::vector<std::string> drift;
      for (const auto& d : check->slot_drift) {
        drift.push_back(SlotDriftKindText(d.kind).str() + ":" + d.slot_key);
      }
      log.Warn("network drifted from the applied document; repairing",
               {{"blockers", fmt::format("{}", fmt::join(check->blockers, ","))},
                {"slot_drift", fmt::format("{}", fmt::join(drift, ","))}});
      if (auto repaired = ApplyNetwork(spec, ctx); !repaired.ok()) {
        log.Error("network repair failed", {{"error", repaired.error().ToString()}});
      }
      auto again = CheckNetwork(spec, ctx);
      const NetCheck& left = again.ok() ? *again : *check;
      blockers = left.blockers;
      net_slot_drift_ = left.slot_drift;
    }
    return blockers;
  };
  net.ack = [this, timeout](int64_t version,
                            const std::vector<std::string>& blockers) -> Result<void> {
    v1::AckNodeNetworkRequest ack;
    ack.set_node_id(cfg_.node_id);
    ack.set_version(version);
    for (const auto& b : blockers) ack.add_blockers(b);
    auto acked = rpc::Client(svc_.nats())
                     .Call<v1::AckNodeNetworkResponse>("gpuaas.v1.ipam.node.{node_id}.network.ack",
                                                       ack, timeout);
    if (!acked.ok()) return acked.error();
    return Ok();
  };
  {
    std::lock_guard lock(net_mu_);
    net_ = std::make_unique<DocumentFollower<v1::NodeNetworkDocument>>(
        std::move(net), std::chrono::milliseconds(cfg_.net_report_ms));
  }
  MakeExposureAgent();
}

void NodeAgent::MakeExposureAgent() {
  if (cfg_.exposure_apply == "off") return;
  const auto timeout = std::chrono::milliseconds(cfg_.common.nats_request_timeout_ms);
  const NetContext ctx = NetCtx();
  const auto log = svc_.log().With({{"node_id", cfg_.node_id}});
  ExposureAgentOptions eo;
  eo.node_id = cfg_.node_id;
  eo.mode = cfg_.exposure_apply;
  eo.uplink = cfg_.exposure_uplink;
  eo.sys_root = cfg_.exposure_sys_root.empty() ? HostRoot(cfg_.host_root).Real("/sys")
                                               : cfg_.exposure_sys_root;
  eo.ctx = ctx;
  eo.timeout = timeout;
  eo.check_interval = std::chrono::milliseconds(cfg_.net_report_ms);
  eo.network = [this]() -> std::optional<v1::NodeNetworkDocument> {
    std::lock_guard lock(net_mu_);
    const auto* slice = net_ ? SliceNetwork() : nullptr;
    if (slice == nullptr) return std::nullopt;
    return *slice;
  };
  exposures_ = std::make_unique<ExposureAgent>([this] { return svc_.nats(); }, std::move(eo),
                                               log.With({{"document", "exposures"}}));
}

void NodeAgent::ReconcileNetwork() {
  std::lock_guard net_lock(net_mu_);  // the task thread's cleanup uses the applied document too
  const auto log = svc_.log().With({{"node_id", cfg_.node_id}});
  const auto now = std::chrono::steady_clock::now();
  const auto round = net_->Step(now);
  if (round.fetch_error) {
    // ipam unreachable (or does not know the node yet): the network stays as applied.
    log.Debug("network document not fetched", {{"error", round.fetch_error->ToString()}});
  }
  if (round.ack_error) {
    log.Warn("network ack failed; will ack again", {{"error", round.ack_error->ToString()}});
  }
  net_version_ = net_->acked_version();
  // Leases are reported after each check whose blockers ipam has (none without a dnsmasq).
  if (SliceNetwork() == nullptr || !round.checked || round.ack_error) return;
  const NetworkSpec spec = SpecFrom(*net_->applied(), cfg_);
  const bool applied_now = round.applied_now;
  const std::vector<std::string>& blockers = round.blockers;
  // Leases as dnsmasq has them, judged against the applied document.
  v1::LeaseReport report;
  report.set_node_id(cfg_.node_id);
  report.set_document_version(spec.version);
  for (const auto& b : blockers) report.add_blockers(b);
  for (const auto& d : net_slot_drift_) {
    auto* v = report.add_vnic_drift();
    v->set_slot_key(d.slot_key);
    v->set_kind(SlotDriftKindText(d.kind).str());
  }
  int skipped_leases = 0;
  auto leases = ObserveLeases(spec, &skipped_leases);
  if (!leases.ok()) {
    log.Warn("leases not readable", {{"error", leases.error().ToString()}});
    return;
  }
  if (skipped_leases > 0) {
    log.Debug("lease lines skipped: not a unicast MAC with an IPv4 address",
              {{"skipped", std::to_string(skipped_leases)}});
  }
  AddLeaseObservations(*leases, report);
  const std::string content = report.SerializeAsString();
  *report.mutable_observed_at() = TimeUtil::GetCurrentTime();
  // Unchanged: nothing new to say, except a heartbeat every 12 intervals (ipam ages "missing").
  if (content == net_last_report_ && !applied_now &&
      now - net_published_at_ < 12 * std::chrono::milliseconds(cfg_.net_report_ms)) {
    return;
  }
  const std::string subject =
      fmt::format("gpuaas.v1.evt.node.{node_id}.leases", fmt::arg("node_id", cfg_.node_id));
  const v1::Event ev = NodeEvent(subject, "", report);
  if (auto r = messaging::JsPublish(*svc_.nats(), subject, ev.SerializeAsString(), ev.id());
      !r.ok()) {
    log.Warn("lease report not published", {{"error", r.error().ToString()}});
    return;
  }
  net_last_report_ = content;
  net_published_at_ = now;
}

void NodeAgent::ObserveTask(TaskScope& scope, const v1::NodeTaskResult& res,
                            std::chrono::steady_clock::time_point finished) {
  const std::string& status = enums::Text(res.status());
  // The stage a failure names ends at the failure; the stage reported last before it completed.
  std::string failed =
      res.status() != v1::TASK_STATUS_SUCCEEDED && res.stage() != v1::TASK_STAGE_UNSPECIFIED
          ? enums::Text(res.stage())
          : "";
  if (!scope.stage.empty()) {
    if (scope.stage == failed) {
      ObserveStage(*task_seconds_, scope.type, scope.stage, status,
                   Seconds(finished - scope.boundary), scope.log);
      failed.clear();
    } else {
      ObserveStage(*task_seconds_, scope.type, scope.stage, "succeeded",
                   Seconds(scope.last_report - scope.boundary), scope.log);
      scope.boundary = scope.last_report;
    }
  }
  if (!failed.empty()) {
    ObserveStage(*task_seconds_, scope.type, failed, status, Seconds(finished - scope.boundary),
                 scope.log);
  }
  task_seconds_->Add({{"type", scope.type}, {"stage", "total"}, {"result", status}}, TaskBuckets())
      .Observe(Seconds(finished - scope.started));
}

messaging::HandlerResult NodeAgent::HandleTask(const messaging::Delivery& d) {
  v1::Event ev;
  v1::NodeTask task;
  if (!ev.ParseFromString(d.msg.data) || !ev.data().UnpackTo(&task)) {
    return messaging::HandlerResult::Reject("not a gpuaas.v1.Event carrying a gpuaas.v1.NodeTask",
                                            messaging::kRejectUndecodable);
  }
  if (!ids::IsUuid(task.task_id())) {
    return messaging::HandlerResult::Reject("task id is not a UUID: '" + task.task_id() + "'",
                                            messaging::kRejectInvalid);
  }
  // Every line about the task names it, its allocation and its trace (the scheduler's request).
  const std::string traceparent = d.msg.Header(messaging::kHeaderTraceparent);
  TaskScope scope;
  scope.type = enums::Text(task.type()).empty() ? "unknown" : enums::Text(task.type());
  scope.traceparent = traceparent.empty() ? "" : ids::ChildTraceparent(traceparent);
  scope.log = svc_.log().With({{"task_id", task.task_id()},
                               {"type", scope.type},
                               {"allocation_id", TaskAllocationId(task)},
                               {"correlation_id", task.correlation_id()},
                               {"trace_id", ids::TraceId(traceparent)},
                               {"node_id", cfg_.node_id}});
  const log::Logger& log = scope.log;
  auto entry_it = tasks_by_type_.find(task.type());
  const TaskEntry* entry = entry_it == tasks_by_type_.end() ? nullptr : &entry_it->second;
  const bool vm_task = entry && entry->vm_task;
  const std::string key = "task-" + task.task_id();
  // A task delivered again: its stored result goes out again with the same message id.
  if (auto stored = store_->Get(key); stored.ok() && stored->has_value()) {
    const auto& rec = **stored;
    v1::Event stored_ev;
    if (auto p = protojson::FromJson(rec.at("event").dump(), &stored_ev); !p.ok()) {
      return messaging::HandlerResult::Reject("stored task result unreadable: " +
                                              p.error().message);
    }
    auto ack = messaging::JsPublish(*svc_.nats(), rec.at("subject").get<std::string>(),
                                    stored_ev.SerializeAsString(), stored_ev.id());
    if (!ack.ok()) return messaging::HandlerResult::Retry(ack.error().ToString());
    log.Info("duplicate task: result re-published, not re-run");
    return messaging::HandlerResult::Ack();
  }
  // A task past its deadline is answered (failed, below) rather than kept waiting.
  const bool expired = task.has_deadline() && TimeUtil::GetCurrentTime() > task.deadline();
  if (vm_task && !adopted_ && !expired) {
    // After a restart the runtime first reconciles its domains with the ledger.
    return messaging::HandlerResult::Retry("restart adoption not finished");
  }
  if (vm_task && cfg_.net_apply != "off") {
    // Right after a (re)start the network document is not applied yet: a VM would get no
    // bridge and a cleanup could not release its DHCP lease. The first reconcile follows
    // registration within moments.
    std::lock_guard lock(net_mu_);
    if (!net_->applied() && !expired) {
      return messaging::HandlerResult::Retry("slice network not applied yet");
    }
  }
  if (vm_task && cfg_.sim_behavior == "silent") {
    // An unresponsive node for tests: taken off the queue, never answered, nothing stored (a
    // redelivery is just as silent).
    log.Warn("node_agent.sim_behavior=silent: VM task acked and left unanswered");
    return messaging::HandlerResult::Ack();
  }
  v1::NodeTaskResult res;
  res.set_task_id(task.task_id());
  res.set_node_id(cfg_.node_id);
  res.set_type(task.type());
  *res.mutable_started_at() = TimeUtil::GetCurrentTime();
  auto fail = [&](v1::TaskStatus st, Reason reason, const std::string& message) {
    res.set_status(st);
    res.mutable_error()->set_code(st == v1::TASK_STATUS_REJECTED ? v1::FAILED_PRECONDITION
                                                                 : v1::INTERNAL);
    res.mutable_error()->set_reason(reason.str());
    res.mutable_error()->set_message(message);
  };
  if (task.node_id() != cfg_.node_id) {
    fail(v1::TASK_STATUS_REJECTED, reason::kWrongNode,
         "task for " + task.node_id() + " delivered to " + cfg_.node_id);
  } else if (isolated_) {
    fail(v1::TASK_STATUS_REJECTED, reason::kAgentIsolated,
         "this agent is not registered with inventory and refuses tasks");
  } else if (task.has_deadline() && TimeUtil::GetCurrentTime() > task.deadline()) {
    fail(v1::TASK_STATUS_FAILED, reason::kTaskDeadlineExceeded,
         "the task arrived after its deadline " + TimeUtil::ToString(task.deadline()));
    res.mutable_error()->set_code(v1::DEADLINE_EXCEEDED);
  } else if (!entry) {
    fail(v1::TASK_STATUS_REJECTED, reason::kUnknownTaskType,
         "this agent does not run tasks of type " + std::to_string(static_cast<int>(task.type())) +
             " (" + (enums::Text(task.type()).empty() ? "unknown" : enums::Text(task.type())) +
             ")");
    res.mutable_error()->set_code(v1::UNIMPLEMENTED);
  } else if (task.params_case() != entry->params) {
    fail(v1::TASK_STATUS_REJECTED, reason::kInvalidParams,
         enums::Text(task.type()) + " needs its own params case (field " +
             std::to_string(static_cast<int>(entry->params)) + "), got case " +
             std::to_string(static_cast<int>(task.params_case())));
    res.mutable_error()->set_code(v1::INVALID_ARGUMENT);
  } else {
    tasks_run_++;
    log.Info("task started", {{"deliveries", std::to_string(d.num_delivered)}});
    auto run = entry->run(task, scope, res);
    if (!run.retry.empty()) return messaging::HandlerResult::Retry(run.retry);
  }
  *res.mutable_finished_at() = TimeUtil::GetCurrentTime();
  const auto finished = TaskScopeClock::now();
  // Every handler answers succeeded, failed or rejected; its text is the subject's last token.
  const std::string& status = enums::Text(res.status());
  const std::string subject =
      fmt::format("gpuaas.v1.evt.node.{node_id}.task.{status}", fmt::arg("node_id", cfg_.node_id),
                  fmt::arg("status", status));
  const v1::Event out = NodeEvent(subject, task.correlation_id(), res);
  // Stored before it is published: a crash in between re-publishes the same event id.
  nlohmann::json rec = {{"subject", subject},
                        {"status", status},
                        {"event", nlohmann::json::parse(protojson::ToJson(out))}};
  if (auto w = store_->Put(key, rec); !w.ok()) {
    return messaging::HandlerResult::Retry("cannot persist task result: " + w.error().ToString());
  }
  messaging::Headers h;
  if (!scope.traceparent.empty()) h[messaging::kHeaderTraceparent] = scope.traceparent;
  auto ack = messaging::JsPublish(*svc_.nats(), subject, out.SerializeAsString(), out.id(), h);
  if (!ack.ok()) return messaging::HandlerResult::Retry(ack.error().ToString());
  ObserveTask(scope, res, finished);
  log.Info("task finished",
           {{"status", status},
            {"reason", res.has_error() ? res.error().reason() : ""},
            {"seconds", fmt::format("{:.3f}", Seconds(finished - scope.started))}});
  return messaging::HandlerResult::Ack();
}

}  // namespace gpuaas::node_agent
