#pragma once
// Host topology discovery: what a GPU host has (GPUs, NVMe disks, IB/RoCE devices), whether it
// can run slice VMs (prerequisite checks), whether its slice network is in place (network
// baseline), and one advisory candidate slot per GPU. Everything is read through a HostRoot, so
// the same code runs on a real host ("/") and on fixture trees. Nothing here is schedulable:
// inventory approves slots from the candidates.
//
// Discovery never throws and never fails on odd hosts: a missing directory means "none found",
// an unreadable file means "unknown". Only an unusable root is an error.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::node_agent {

// The default one-GPU slice shape (24 vCPU, 64 GiB per GPU, no hugepages).
v1::RuntimeProfile DefaultRuntimeProfile();

struct DiscoveryOptions {
  std::string root = "/";
  std::string node_id;   // "" = the hostname
  std::string hostname;  // "" = read from the root (/proc/sys/kernel/hostname, /etc/hostname)
  std::string agent_version;
  std::string network_mode = "private-nat";
  std::string bridge = "ovsbr0";
  std::string gateway_cidr = "10.100.0.1/24";  // slice subnet derived from it (10.100.0.0/24)
  std::string libvirt_uri = "qemu:///system";  // "" = skip the libvirt check (WARN)
  // Open vSwitch database ovs-vsctl reads ("unix:/run/x/db.sock", passed as --db=); "" = its
  // default socket.
  std::string ovs_db;
  v1::RuntimeProfile profile = DefaultRuntimeProfile();
};

// Everything below, filled into one report. Errors only when the root itself is unusable.
Result<v1::TopologyReport> Discover(const DiscoveryOptions& opts);

// NVIDIA display/3D controllers under /sys/bus/pci/devices, sorted by PCI address.
std::vector<v1::GpuDevice> DiscoverGpus(const HostRoot& host);
// Whole NVMe namespaces (no partitions, no nvmeXcYnZ path devices), sorted by stable id.
std::vector<v1::NvmeDevice> DiscoverNvme(const HostRoot& host);
// /sys/class/infiniband devices plus every VF a PF lists (a VF without an RDMA device of its
// own appears with name ""), sorted by PCI address.
std::vector<v1::FabricDevice> DiscoverFabric(const HostRoot& host);

// gpus, kvm, kvm_access (only when /dev/kvm exists), iommu_groups, iommu_cmdline, vfio_modules,
// sriov, libvirt, ovmf, hugepages, reboot_required. `reboot_required` (may be null) is set when
// /var/run/reboot-required exists.
std::vector<v1::Check> PrereqChecks(const HostRoot& host, const DiscoveryOptions& opts,
                                    const std::vector<v1::GpuDevice>& gpus, bool* reboot_required);

// The baseline plus why a probe could not tell (tool missing, tool failed), keyed by check name.
struct NetworkProbe {
  v1::NetworkBaseline baseline;
  std::map<std::string, std::string> notes;
};
// When the root has ovs-vsctl it is asked, read-only with a short timeout, whether the bridge is
// OVS and, if so, for its datapath type, interfaces and hw-offload setting (opts.ovs_db picks
// the database). Its failures are notes, never errors.
NetworkProbe ProbeNetwork(const HostRoot& host, const DiscoveryOptions& opts);
v1::NetworkBaseline ReadNetworkBaseline(const HostRoot& host, const DiscoveryOptions& opts);
// bridge, gateway, ip_forward, nat_masquerade, default_route, tmfifo, and ovs_offload when the
// bridge is OVS. In private-nat mode a missing bridge, gateway, forwarding or NAT rule is a FAIL
// with blocker=true; in other modes they are WARNs. ovs_offload is evidence: PASS or WARN only.
std::vector<v1::Check> NetworkChecks(const v1::NetworkBaseline& baseline,
                                     const std::map<std::string, std::string>& notes = {});

// `ovs-vsctl --format=json list Interface` (any columns, `name` required) as one entry per row;
// an error when it is not such a table. Pure.
Result<std::vector<v1::OvsPortInfo>> ParseOvsInterfaces(const std::string& json);

// The node blocker a failed blocker check stands for ("nat_masquerade" ->
// reason::kNatMasqueradeMissing); reason::kCheckFailed for a check name discovery never makes.
Reason BlockerName(const std::string& check_name);

// One candidate per GPU, grouped by locality, each paired with its own NVMe and fabric VF
// where the host has them. `nvme_switch` maps an NVMe controller's PCI address to its PCIe
// switch (NvmeDevice has no such field). Pure: no I/O.
std::vector<v1::CandidateSlot> BuildCandidates(
    const std::vector<v1::GpuDevice>& gpus, const std::vector<v1::NvmeDevice>& nvme,
    const std::vector<v1::FabricDevice>& fabric, const DiscoveryOptions& opts,
    const std::map<std::string, std::string>& nvme_switch = {});

// "52:54:00:xx:xx:xx": the low 3 bytes of FNV-1a 64 over node_id + '/' + index.
std::string SuggestedMac(const std::string& node_id, int index);

// Filesystem and partition-table signatures in a device's first bytes (at least 8 KiB for
// swap): "ext4"/"ext3"/"ext2", "xfs", "LVM2_member", "swap", "vfat", or ""; "gpt", "dos" or "".
std::string DetectFsType(const std::string& head);
std::string DetectPartitionTable(const std::string& head);

// "10.100.0.1/24" -> network address (host order) and prefix; nullopt when malformed.
struct Ipv4Cidr {
  uint32_t addr = 0;
  int prefix = 0;
  uint32_t Network() const { return prefix == 0 ? 0 : addr & (~0u << (32 - prefix)); }
};
std::optional<Ipv4Cidr> ParseCidr(const std::string& s);
std::string FormatIpv4(uint32_t addr);

}  // namespace gpuaas::node_agent
