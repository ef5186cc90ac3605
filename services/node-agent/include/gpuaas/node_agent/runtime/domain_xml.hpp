#pragma once
// The libvirt domain of one slice VM, generated from its host bundle. Pure: no I/O, so every
// shape of bundle can be checked against libvirt's schema in unit tests.
//
// What the XML always says (the runtime profile decides the rest):
// - q35, UEFI (OVMF pflash loader, secure='no' because guest NVIDIA drivers hang on MOK prompts
//   otherwise) with a per-domain NVRAM copied from a template, no TPM;
// - every slot's GPU and fabric VF as a managed VFIO PCI hostdev;
// - every slot's raw NVMe as a virtio block disk (its /dev/disk/by-id path unless the caller
//   maps it), the first one the boot disk unless a kernel is booted directly (test guests);
// - the NoCloud seed ISO as a read-only virtio disk;
// - one vNIC on the slice bridge with the boot slot's MAC (the first slot: the MAC/IP that DHCP
//   reserved and readiness waits for), on an isolated bridge port;
// - memory and vCPUs from the VmShape, pinned to the GPUs' NUMA node when it is known
//   (numatune + vcpu cpuset), 1 GiB hugepage backing when the shape asks for it;
// - a pty serial console, and VNC only on a loopback address or a UNIX socket (console-gw
//   relays it; a VNC port on 0.0.0.0 is refused);
// - name "gpuaas-<allocation_id>" and the allocation in <metadata>.
#include <map>
#include <optional>
#include <string>

#include "gpuaas/common/result.hpp"

namespace gpuaas::v1 {
class ProvisionBundle;
}  // namespace gpuaas::v1

namespace gpuaas::node_agent {

// Namespace of the <metadata> element that marks a domain as this agent's.
inline constexpr const char* kDomainMetadataNs = "https://gpuaas.dev/xmlns/libvirt/domain/v1";
inline constexpr const char* kDomainPrefix = "gpuaas-";

struct DomainXmlOptions {
  std::string domain_type = "kvm";  // "kvm", or "qemu" (TCG: hosts without KVM)
  std::string machine = "q35";
  std::string cpu_mode = "host-passthrough";  // "maximum" under TCG
  std::string emulator;                       // "" = libvirt's default for the arch
  std::string loader = "/usr/share/OVMF/OVMF_CODE_4M.fd";
  std::string nvram_template = "/usr/share/OVMF/OVMF_VARS_4M.fd";
  std::string nvram_dir = "/var/lib/libvirt/qemu/nvram";  // <dir>/<name>_VARS.fd
  std::string bridge = "ovsbr0";
  // Open vSwitch bridge: adds <virtualport type='openvswitch'/> and no <port isolated/>
  // (libvirt isolates ports on Linux bridges only; OVS isolation is flow rules).
  bool bridge_is_ovs = false;
  // OVS with the userspace datapath (datapath_type=netdev) reads a tap's frames off a socket and
  // cannot finish a checksum the guest left to the device: the vNIC then runs with
  // <driver><host csum='off'/></driver> (the guest computes its checksums itself).
  bool userspace_datapath = false;
  bool isolated_port = true;
  // Direct kernel boot (test guests): used when `kernel` is set; otherwise the first slot's
  // disk is the boot disk.
  std::string kernel;
  std::string initrd;
  std::string cmdline = "console=ttyS0 panic=-1";
  // false: no VFIO hostdevs (TCG test hosts have no devices to pass through).
  bool passthrough = true;
  std::string seed_iso;  // required: the allocation's NoCloud seed
  // slot_key -> host path of the slot's disk; slots not listed use their nvme_by_id.
  std::map<std::string, std::string> disk_paths;
  std::string vnc_listen = "127.0.0.1";  // must be loopback (127.0.0.0/8 or ::1)
  std::string vnc_socket;                // when set: VNC on this UNIX socket instead of TCP
  std::string serial_log;                // when set: the serial console is also logged here
  // With vnc_socket empty: VNC on a UNIX socket at a path libvirt chooses (<listen
  // type='socket'/>), never TCP. The libvirt runtime always sets it.
  bool vnc_auto_socket = false;
  // Host CPUs of the NUMA node the VM is pinned to ("0-47,96-143"); "" = memory pinning only.
  std::string numa_cpuset;
  std::string numa_memory_mode = "strict";
};

std::string DomainName(const std::string& allocation_id);

// The NUMA node the VM is pinned to: shape.numa_node when set, else the node every slot
// shares; nullopt when unknown, mixed or negative (no pinning).
std::optional<int> PinnedNumaNode(const v1::ProvisionBundle& bundle);

// The domain XML, or an error (stage "define") naming the field that cannot be expressed:
// invalid_allocation_id, shape_invalid, hugepages_memory_unaligned, invalid_domain_type,
// invalid_path, invalid_mac, invalid_pci_address, invalid_bridge, vnc_listen_not_loopback,
// seed_missing.
Result<std::string> GenerateDomainXml(const v1::ProvisionBundle& bundle,
                                      const DomainXmlOptions& opts);

// True for 127.0.0.0/8 and ::1.
bool IsLoopbackAddress(const std::string& addr);

// Reading back what libvirt returns (virDomainGetXMLDesc), without an XML library: the start tag
// of the element at `pos` (up to its '>'), and the value of attribute `name` in such a tag
// ('...' or "...", the five XML entities decoded; nullopt when absent).
std::string XmlStartTag(const std::string& xml, size_t pos);
std::optional<std::string> XmlAttr(const std::string& tag, const std::string& name);

}  // namespace gpuaas::node_agent
