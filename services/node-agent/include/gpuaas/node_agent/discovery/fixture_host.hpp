#pragma once
// Builds a fake GPU host under a directory: the sysfs, /proc, /dev and tool layout discovery
// reads, with real symlinks where a real host has them (/sys/bus/pci/devices/*,
// /sys/class/{block,infiniband,net}/*, /dev/disk/by-id/*, iommu_group, driver, physfn,
// virtfn*, an absolute /var/run -> /run). Device nodes are regular files holding the first
// sectors of a disk (partition table and filesystem signatures); `ip` and `iptables` are shell
// scripts printing canned output. Unit tests use it, and `gpuaas-node-agent fixture` writes one
// so scripts can run agents against simulated hosts.
//
// Default layout (an 8-GPU HGX-style host): GPU i sits behind its own PCIe switch
// (root port 0000:BB:01.0 -> switch upstream 0000:BB+1:00.0 -> downstream ports on BB+2) with
// an IB PF (eight VFs) and a data NVMe behind the same switch; GPUs 0-3 on NUMA 0, 4-7 on
// NUMA 1; a separate OS NVMe (BOSS-style) on its own root port; an ASPEED VGA that is not a GPU.
#include <set>
#include <string>

#include "gpuaas/common/result.hpp"

namespace gpuaas::node_agent {

struct FixtureOptions {
  std::string hostname = "fixture-host";
  int gpus = 8;                     // 0..16
  std::set<int> unknown_numa_gpus;  // GPUs whose numa_node reads -1
  // Data NVMe disks; the first min(nvme, gpus) sit behind GPU i's switch, the rest on their own
  // root ports. -1 = one per GPU.
  int nvme = -1;
  bool separate_os_disk = true;       // an extra NVMe holding /boot/efi and /
  int os_disk_nvme = -1;              // instead: data NVMe j holds /boot/efi and / (needs no extra)
  bool os_on_lvm = false;             // / is an LVM volume (dm-0) on the OS disk's second partition
  int mounted_child_nvme = -1;        // data NVMe j has a GPT and p1 (ext4) mounted at "/share 1"
  int fs_nvme = -1;                   // data NVMe j carries an unmounted xfs on the whole disk
  int mounted_nvme = -1;              // data NVMe j carries an xfs on the whole disk, at /scratch
  bool shuffle_kernel_names = false;  // kernel names reversed against PCI order (a reboot)
  bool controller_path_names = false;  // add nvme<k>c<k>n1 multipath path devices
  // Fabric PFs; the first min(pfs, gpus) sit behind GPU i's switch. -1 = one per GPU.
  int fabric_pfs = -1;
  int vfs_per_pf = 8;
  bool vf_rdma_devices = true;            // VFs get /sys/class/infiniband entries of their own
  std::string link_layer = "InfiniBand";  // or "Ethernet" (RoCE)
  // Prerequisites.
  bool kvm = true;
  // /dev/kvm is group kvm (the root's /etc/group names the file's group kvm) and 0660, as on a
  // Debian host with udev; false: 0600 and kvm is another group, as where no udev ran.
  bool kvm_access = true;
  bool iommu = true;
  bool iommu_cmdline = true;
  bool vfio = true;
  bool ovmf = true;
  int hugepages_free = 0;
  bool reboot_required = false;
  // Network baseline (bridge ovsbr0 with 10.100.0.1/24).
  bool bridge = true;
  bool gateway = true;
  bool ip_forward = true;
  bool nat_rule = true;
  bool tmfifo = true;
  bool ip_tool = true;  // false: no usr/sbin/ip, addresses only in /proc/net/fib_trie
  bool iptables_tool = true;
};

// Creates `dir` (and parents) and writes the tree. Fails when `dir` exists and is not empty,
// or on a filesystem error.
Result<void> BuildFixtureHost(const std::string& dir, const FixtureOptions& opts);

}  // namespace gpuaas::node_agent
