#pragma once
// The real VM runtime: slice VMs through the libvirt C API (never virsh), with the same
// interface behaviour as SimulatedRuntime (stages, reasons, the lease ledger, the
// `domain-<allocation_id>` records) and real effects.
//
// Provision: ValidateBundle against a fresh DiscoverDevices of the host root, then the kernel's
// own view of every target disk (a block device, not mounted, no mounted partition, no holder,
// exclusive open possible) BEFORE anything is written; TakeLease; the image (image_cache.hpp:
// fetched once into the node's cache by digest, qcow2 converted once to raw there, then one
// sequential pass per provision that hashes and writes it onto the boot slot's disk with O_DIRECT,
// the disk made bootable only once the digest matched); the NoCloud seed ISO (genisoimage, label
// cidata); define; start; readiness = the boot MAC's lease in the dnsmasq lease file, then an SSH
// banner. A failure after the lease leaves the lease, the domain and the disk for release/cleanup
// (the slot is dirty). Release: virDomainShutdown, wait, virDomainDestroy on timeout; undefine with
// NVRAM (retried); seed removed. Cleanup: leftover domain destroyed and undefined, the disk-safety
// checks again right before each write, wipefs -a, blkdiscard (or zeroing the whole disk when
// discard is not supported), verification that no signature remains, the caller's network hook,
// DropLease. Adopt (agent restart): this agent's domains against the ledger.
//
// Tools (qemu-img, genisoimage, wipefs, blkdiscard, blkid) run from the real
// root with RunTool-style bounded runs; the devices are read under `host_root`, so a fixture
// host works (its device nodes are regular files, or block nodes made for loop devices).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"

namespace gpuaas::node_agent {
class ImageCache;
}

struct _virConnect;  // libvirt's connection and domain; libvirt headers stay out of this header
struct _virDomain;

namespace gpuaas::node_agent {

// Bound on one readiness probe attempt (TCP connect + banner read).
using SshProbeFn =
    std::function<bool(const std::string& ip, int port, std::chrono::milliseconds timeout)>;

struct LibvirtOptions {
  std::string uri = "qemu:///system";  // "test:///default" in unit tests
  std::string host_root = "/";         // devices are discovered and resolved under it
  std::string tools_root = "/";        // where qemu-img, wipefs, ... are looked up
  std::string image_cache_dir;         // required: <dir>/<sha256>.img
  std::string seed_dir;                // required: <dir>/<allocation_id>/seed.iso
  // Everything but seed_iso, disk_paths and numa_cpuset (filled per allocation). With
  // domain.passthrough false the bundle is still validated against the host's GPUs and VFs.
  DomainXmlOptions domain;
  // Fixture hosts: a slot disk may be a regular file (the fixture's device nodes). Never on
  // a real host.
  bool allow_regular_file_disks = false;
  // The slice bridge must exist under <host_root>/sys/class/net before a domain is defined.
  bool check_bridge = true;
  // Set when the agent applies the slice network itself (network.apply): the bridge of the
  // applied document, which VMs attach to instead of domain.bridge; nullopt while none is
  // applied (provision fails with network_not_applied, retryable).
  struct AppliedBridge {
    std::string name;
    bool ovs = false;  // an Open vSwitch bridge: the vNIC gets <virtualport type='openvswitch'/>
    bool userspace = false;  // its datapath is userspace (netdev): no checksum offload
  };
  std::function<std::optional<AppliedBridge>()> applied_bridge;
  std::string lease_file = "/var/lib/gpuaas/net/dnsmasq.leases";
  std::chrono::milliseconds lease_timeout{std::chrono::minutes(5)};
  std::chrono::milliseconds ssh_timeout{std::chrono::minutes(2)};
  std::chrono::milliseconds poll_interval{std::chrono::milliseconds(250)};
  int ssh_port = 22;
  SshProbeFn ssh_probe;  // default: ProbeSshBanner
  // Used when ReleaseParams.graceful_timeout_s is 0.
  std::chrono::milliseconds shutdown_timeout{std::chrono::seconds(60)};
  int undefine_attempts = 3;
  std::chrono::milliseconds undefine_retry_delay{std::chrono::milliseconds(500)};
  std::chrono::milliseconds image_timeout{std::chrono::hours(1)};  // fetch, convert, write
  std::chrono::milliseconds wipe_timeout{std::chrono::hours(4)};   // discard or zero, per disk
  NetworkCleanupFn network_cleanup;  // unset: proofs say network_state_removed=false
  // Called once the domain runs, before readiness waits for its lease: the slice network admits
  // the new vNIC now (on Open vSwitch its port exists only from here, and the flows and policing
  // key on it) instead of at the next periodic check. A failure is progress, not fatal: the
  // check repairs it.
  std::function<Result<void>()> vnic_attached;
  // Set when the agent follows ingress's exposure documents (no exposure maps to the slots any
  // more); unset: the node has no exposure state (exposure_state_removed=true).
  NetworkCleanupFn exposure_cleanup;
  // The node's terminal relay key (private; `<path>.pub` next to it): created when missing
  // (ed25519, 0600) and its public key added to every VM's ssh_authorized_keys, so the node can
  // open the audited console's SSH PTY into the guest. "" = none.
  std::string relay_key_path;
};

// One domain of this agent as seen at adoption.
struct AdoptedDomain {
  std::string allocation_id;  // "" when the name is not gpuaas-<uuid>
  std::string domain_name;
  std::string state;         // libvirt state: running, paused, shutoff, ...; "absent" if missing
  std::string ledger_state;  // the domain record's state; "leased" (lease only); "" (unknown)
};

struct AdoptionReport {
  std::vector<AdoptedDomain> adopted;  // in libvirt and in the ledger
  std::vector<AdoptedDomain> orphans;  // gpuaas-* domain the ledger does not know (drift)
  std::vector<AdoptedDomain> missing;  // the ledger's domain record, no domain (drift)
};

class LibvirtRuntime : public VmRuntime {
 public:
  // `store` must outlive the runtime. The connection is opened on first use.
  LibvirtRuntime(LocalStore& store, LibvirtOptions opts);
  ~LibvirtRuntime() override;
  LibvirtRuntime(const LibvirtRuntime&) = delete;
  LibvirtRuntime& operator=(const LibvirtRuntime&) = delete;

  Result<v1::ProvisionOutput> Provision(const v1::ProvisionBundle& bundle,
                                        const ProgressFn& progress) override;
  Result<v1::ReleaseOutput> Release(const v1::ReleaseParams& params,
                                    const ProgressFn& progress) override;
  Result<v1::CleanupOutput> Cleanup(const v1::CleanupParams& params,
                                    const ProgressFn& progress) override;

  // Lists this agent's domains (name prefix gpuaas-) and reconciles them with the ledger.
  // Read-only: orphans are reported, not removed. Adopted() is true after a successful run.
  Result<AdoptionReport> Adopt();
  bool Adopted() const;

  const LibvirtOptions& options() const { return opts_; }

 private:
  Result<_virConnect*> Conn();
  using RecordFn = std::function<Result<void>(const std::string&, const std::string&)>;
  // A redelivered vm.provision whose own attempt already runs (the ledger recorded it started,
  // libvirt has it active): readiness is awaited again; nothing is rewritten. nullopt = no.
  std::optional<Result<v1::ProvisionOutput>> ResumeStarted(const v1::ProvisionBundle& b,
                                                           const std::vector<std::string>& plan,
                                                           const RecordFn& record,
                                                           const ProgressFn& progress);
  Result<v1::ProvisionOutput> AwaitReadiness(_virDomain* dom, const v1::ProvisionBundle& b,
                                             const std::vector<std::string>& plan,
                                             const RecordFn& record, const ProgressFn& progress);
  // Provision's steps, in order (libvirt_runtime.cpp).
  struct ProvisionTarget;
  Result<ProvisionTarget> CheckTarget(const v1::ProvisionBundle& b, const ProgressFn& progress);
  Result<void> DestroyNeverRunDomain(_virConnect* conn, const v1::ProvisionBundle& b,
                                     const ProgressFn& progress);
  Result<void> LeaseSlots(const v1::ProvisionBundle& b, const ProgressFn& progress);
  Result<v1::ProvisionBundle> SeedInput(const v1::ProvisionBundle& b);
  Result<v1::ProvisionOutput> InstallAndStart(const v1::ProvisionBundle& b,
                                              const v1::ProvisionBundle& seeded,
                                              const ProvisionTarget& t,
                                              const std::vector<std::string>& plan,
                                              const RecordFn& record, const ProgressFn& progress);
  Result<void> RunDomain(_virDomain* dom, const std::string& domain, bool paused,
                         const RecordFn& record, const ProgressFn& progress);
  LocalStore& store_;
  LibvirtOptions opts_;
  mutable std::mutex mu_;  // ledger changes and domain records
  std::mutex conn_mu_;     // the connection
  _virConnect* conn_ = nullptr;
  bool adopted_ = false;
  std::unique_ptr<ImageCache> images_;  // the node's image cache (image_cache.hpp)
};

// Building blocks, public for tests and for the agent's own checks.

// The IP dnsmasq leased to `mac` (case-insensitive), from a dnsmasq lease file
// ("<expiry> <mac> <ip> <hostname> <client-id>", expired entries ignored); nullopt when none.
std::optional<std::string> LeasedIp(const std::string& lease_file, const std::string& mac);

// PCI addresses ("0000:18:00.0") of every <hostdev type='pci'> source in a domain's XML (as
// libvirt returns it): which devices another domain already passes through.
std::vector<std::string> HostdevPciAddresses(const std::string& xml);

// TCP connect to ip:port and read until the banner starts with "SSH-"; false on refusal,
// timeout or another banner.
bool ProbeSshBanner(const std::string& ip, int port, std::chrono::milliseconds timeout);

// ProbeSshBanner from inside network namespace `netns` (/run/netns/<netns>; "" = this one): for
// an agent whose slice network lives in a namespace (network.apply=netns). False when the
// namespace cannot be entered.
SshProbeFn SshProbeInNetns(const std::string& netns);

// A slot disk as the kernel sees it right now, at `path` (a resolved host path).
struct DiskTarget {
  std::string path;
  bool block = false;    // false: a regular file (fixture hosts only)
  uint64_t size = 0;     // bytes
  bool discard = false;  // the block device advertises discard
};
// Refuses (stage `stage`, FailedPrecondition) a path that is not a block device (or a regular
// file when allowed): disk_not_block_device; mounted directly or through a partition, or used
// as swap: disk_mounted / disk_child_mounted; held by device-mapper/md: disk_held; opened
// exclusively by someone (O_EXCL open fails with EBUSY): disk_busy.
Result<DiskTarget> CheckDiskTarget(const std::string& path, bool allow_regular_file,
                                   const std::string& stage);

// The public half of the terminal relay key at `path`, creating the pair when missing
// (ssh-keygen, comment `comment`; stage "seed", reason relay_key_unavailable).
Result<std::string> EnsureRelayKey(const std::string& path, const std::string& comment,
                                   const std::string& tools_root = "/");

// The NoCloud seed's meta-data and user-data for a bundle (invalid_hostname, invalid_ssh_key,
// invalid_instance_id; stage "seed").
struct SeedFiles {
  std::string meta_data;
  std::string user_data;
};
Result<SeedFiles> MakeSeedFiles(const v1::ProvisionBundle& bundle);

}  // namespace gpuaas::node_agent
