// Discovery, prerequisite, network-baseline and parity tests. Hosts are fixture trees written by
// BuildFixtureHost (real symlinks, like sysfs), plus one run against this machine's real "/".
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>

#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/discovery/parity.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;

// A fixture tree that removes itself.
class TempHost {
 public:
  explicit TempHost(const FixtureOptions& o = {}) : dir_(testing::MakeTempDir("gpuaas-host")) {
    auto r = BuildFixtureHost(dir_, o);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
  }
  ~TempHost() {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  TempHost(const TempHost&) = delete;
  TempHost& operator=(const TempHost&) = delete;
  const std::string& dir() const { return dir_; }
  DiscoveryOptions Options() const {
    DiscoveryOptions d;
    d.root = dir_;
    d.node_id = "node-a";
    d.libvirt_uri = "test:///default";  // libvirt's in-process test driver
    return d;
  }
  v1::TopologyReport Discover() const { return Discover(Options()); }
  static v1::TopologyReport Discover(const DiscoveryOptions& d) {
    auto r = node_agent::Discover(d);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
    return r.ok() ? *r : v1::TopologyReport{};
  }

 private:
  std::string dir_;
};

std::string Hex2(unsigned v) {
  char b[8];
  std::snprintf(b, sizeof(b), "%02x", v);
  return b;
}
// Addresses of the default fixture layout for GPU i (< 8).
unsigned Base(int i) { return 0x15u + static_cast<unsigned>(i) * 0x15u; }
std::string GpuAddr(int i) { return "0000:" + Hex2(Base(i) + 3) + ":00.0"; }
std::string SwitchAddr(int i) { return "0000:" + Hex2(Base(i) + 1) + ":00.0"; }
std::string PfAddr(int i) { return "0000:" + Hex2(Base(i) + 4) + ":00.0"; }
std::string NvmeAddr(int i) { return "0000:" + Hex2(Base(i) + 5) + ":00.0"; }

const v1::Check* FindCheck(const google::protobuf::RepeatedPtrField<v1::Check>& checks,
                           const std::string& name) {
  for (const auto& c : checks) {
    if (c.name() == name) return &c;
  }
  return nullptr;
}

const v1::NvmeDevice* FindNvme(const v1::TopologyReport& r, const std::string& kname) {
  for (const auto& d : r.nvme()) {
    if (d.kernel_name() == kname) return &d;
  }
  return nullptr;
}

const v1::CandidateSlot* SlotFor(const v1::TopologyReport& r, const std::string& gpu) {
  for (const auto& s : r.candidates()) {
    if (s.gpu_pci_address() == gpu) return &s;
  }
  return nullptr;
}

bool HasNote(const v1::CandidateSlot& s, const std::string& needle) {
  for (const auto& n : s.notes()) {
    if (n.find(needle) != std::string::npos) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------

TEST(HostTest, ResolvesLinksInsideTheRoot) {
  auto dir = testing::MakeTempDir("gpuaas-root");
  fs::create_directories(dir + "/run/x");
  fs::create_directories(dir + "/sys/devices/pci0000:15/0000:15:01.0");
  fs::create_directories(dir + "/sys/bus/pci/devices");
  std::ofstream(dir + "/run/x/file") << "hello\n";
  std::ofstream(dir + "/sys/devices/pci0000:15/0000:15:01.0/vendor") << "0x8086\n";
  fs::create_directory_symlink("/run", dir + "/var-run");  // absolute: re-rooted
  fs::create_symlink("../../../devices/pci0000:15/0000:15:01.0",
                     dir + "/sys/bus/pci/devices/0000:15:01.0");
  fs::create_symlink("../../../../../../../../etc", dir + "/run/escape");  // clamps at the root
  HostRoot h(dir + "/");
  EXPECT_EQ(h.root(), dir);
  EXPECT_EQ(*h.Resolve("/var-run/x/file"), "/run/x/file");
  EXPECT_EQ(*h.ReadLine("/var-run/x/file"), "hello");
  EXPECT_EQ(*h.Resolve("/sys/bus/pci/devices/0000:15:01.0"),
            "/sys/devices/pci0000:15/0000:15:01.0");
  EXPECT_EQ(*h.ReadLine("/sys/bus/pci/devices/0000:15:01.0/vendor"), "0x8086");
  EXPECT_TRUE(h.IsSymlink("/sys/bus/pci/devices/0000:15:01.0"));
  EXPECT_FALSE(h.IsSymlink("/sys/bus/pci/devices/0000:15:01.0/vendor"));
  EXPECT_EQ(*h.LinkBasename("/sys/bus/pci/devices/0000:15:01.0"), "0000:15:01.0");
  EXPECT_EQ(*h.Resolve("/run/escape/passwd"), "/etc/passwd");
  EXPECT_FALSE(h.ReadFile("/run/escape/passwd").has_value());  // not the real /etc/passwd
  EXPECT_EQ(*h.Resolve("/missing/../run/./x"), "/run/x");
  EXPECT_FALSE(h.ReadFile("/run/x").has_value());  // a directory
  EXPECT_EQ(h.ListDir("/var-run"), (std::vector<std::string>{"escape", "x"}));
  EXPECT_TRUE(h.ListDir("/nope").empty());
  fs::remove_all(dir);
}

TEST(HostTest, SymlinkLoopIsNotFollowedForever) {
  auto dir = testing::MakeTempDir("gpuaas-root");
  fs::create_symlink("b", dir + "/a");
  fs::create_symlink("a", dir + "/b");
  fs::create_symlink("self/x", dir + "/self");
  HostRoot h(dir);
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(h.Resolve("/a/file").has_value());
  EXPECT_FALSE(h.Resolve("/self").has_value());
  EXPECT_FALSE(h.ReadFile("/a").has_value());
  EXPECT_FALSE(h.Exists("/b"));
  EXPECT_TRUE(h.IsSymlink("/a"));
  EXPECT_FALSE(h.LinkBasename("/a").has_value());
  EXPECT_TRUE(h.ListDir("/a").empty());
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  fs::remove_all(dir);
}

TEST(HostTest, RunToolCapturesExitCodeAndOutput) {
  auto r = RunTool({"/bin/sh", "-c", "echo out; echo err >&2; exit 3"});
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->exit_code, 3);
  EXPECT_FALSE(r->timed_out);
  EXPECT_EQ(r->out, "out\n");
  EXPECT_EQ(r->err, "err\n");
  auto env = RunTool({"/bin/sh", "-c", "echo $LC_ALL"});
  ASSERT_TRUE(env.ok());
  EXPECT_EQ(env->out, "C\n");
  auto big = RunTool({"/bin/sh", "-c", "head -c 3000000 /dev/zero"});
  ASSERT_TRUE(big.ok());
  EXPECT_EQ(big->exit_code, 0);
  EXPECT_EQ(big->out.size(), 1u << 20);
  EXPECT_FALSE(RunTool({"/nonexistent/tool"}).ok());
  EXPECT_FALSE(RunTool({"relative/tool"}).ok());
}

TEST(HostTest, RunToolTimeoutKillsTheProcessGroup) {
  auto t0 = std::chrono::steady_clock::now();
  // The background sleep keeps stdout open: only a group kill ends it.
  auto r = RunTool({"/bin/sh", "-c", "sleep 30 & sleep 30"}, std::chrono::milliseconds(200));
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE(r->timed_out);
  EXPECT_EQ(r->exit_code, -1);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

TEST(HostTest, Helpers) {
  EXPECT_TRUE(LooksLikePciAddress("0000:18:00.0"));
  EXPECT_TRUE(LooksLikePciAddress("10000:e1:00.7"));
  EXPECT_FALSE(LooksLikePciAddress("pci0000:15"));
  EXPECT_FALSE(LooksLikePciAddress("0000:18:00.8"));
  EXPECT_FALSE(LooksLikePciAddress("nvme0"));
  EXPECT_EQ(Trim("  a b \n"), "a b");
  EXPECT_EQ(SplitWs(" a\tb  c\n"), (std::vector<std::string>{"a", "b", "c"}));
  EXPECT_EQ(Basename("/sys/kernel/iommu_groups/12/"), "12");
  EXPECT_EQ(ParseInt("-1"), -1);
  EXPECT_EQ(HostRoot("/").root(), "/");
  EXPECT_EQ(HostRoot("relative/dir/").root(), fs::current_path().string() + "/relative/dir");
  EXPECT_FALSE(ParseInt("x1").has_value());
}

// ---------------------------------------------------------------------------------------------

TEST(DiscoveryTest, FollowsSymlinkedPciEntries) {
  TempHost host;
  HostRoot h(host.dir());
  ASSERT_TRUE(h.IsSymlink("/sys/bus/pci/devices/" + GpuAddr(0)));
  auto rep = host.Discover();
  ASSERT_EQ(rep.gpus_size(), 8);  // the ASPEED VGA (0x1a03) is not counted
  const auto& g = rep.gpus(0);
  EXPECT_EQ(g.pci_address(), "0000:18:00.0");
  EXPECT_EQ(g.vendor_id(), "0x10de");
  EXPECT_EQ(g.device_id(), "0x2335");
  EXPECT_EQ(g.class_code(), "0x030200");
  EXPECT_EQ(g.model(), "H200 SXM 141GB");
  ASSERT_TRUE(g.has_numa_node());
  EXPECT_EQ(g.numa_node(), 0);
  EXPECT_EQ(g.driver(), "vfio-pci");
  EXPECT_FALSE(g.iommu_group().empty());
  EXPECT_EQ(g.local_cpulist(), "0-47,96-143");
  EXPECT_EQ(std::vector<std::string>(g.pcie_path().begin(), g.pcie_path().end()),
            (std::vector<std::string>{"0000:15:01.0", "0000:16:00.0", "0000:17:00.0"}));
  EXPECT_EQ(g.pcie_root_port(), "0000:15:01.0");
  EXPECT_EQ(g.pcie_switch(), "0000:16:00.0");
  EXPECT_EQ(rep.gpus(7).numa_node(), 1);
  EXPECT_EQ(rep.node_id(), "node-a");
  EXPECT_EQ(rep.hostname(), "fixture-host");
  EXPECT_EQ(rep.root(), host.dir());
}

TEST(DiscoveryTest, UnknownNumaStaysUnsetAndSortsLast) {
  FixtureOptions o;
  o.unknown_numa_gpus = {0};
  TempHost host(o);
  auto rep = host.Discover();
  ASSERT_EQ(rep.gpus_size(), 8);
  EXPECT_FALSE(rep.gpus(0).has_numa_node());
  ASSERT_EQ(rep.candidates_size(), 8);
  const auto& last = rep.candidates(7);
  EXPECT_EQ(last.gpu_pci_address(), GpuAddr(0));
  EXPECT_FALSE(last.has_numa_node());
  EXPECT_EQ(last.locality_group(), "numa?/0000:16:00.0");
  EXPECT_TRUE(HasNote(last, "NUMA node unknown"));
  // Its switch still pairs it with the NVMe and PF behind the same switch.
  EXPECT_TRUE(last.nvme_by_id().find("4a100000") != std::string::npos) << last.nvme_by_id();
  EXPECT_EQ(last.fabric_pf_pci_address(), PfAddr(0));
  EXPECT_EQ(rep.candidates(0).gpu_pci_address(), GpuAddr(1));
  EXPECT_EQ(rep.candidates(0).numa_node(), 0);
}

TEST(DiscoveryTest, EightGpuHostGivesCompleteCandidatesByLocality) {
  TempHost host;
  auto rep = host.Discover();
  EXPECT_EQ(rep.gpus_size(), 8);
  EXPECT_EQ(rep.nvme_size(), 9);            // 8 data + the OS disk
  EXPECT_EQ(rep.fabric_size(), 8 + 8 * 8);  // PFs + VFs
  ASSERT_EQ(rep.candidates_size(), 8);
  std::set<std::string> disks, vfs, macs, ips;
  std::map<std::string, std::string> nvme_pci;  // by-id -> controller PCI address
  for (const auto& d : rep.nvme()) nvme_pci[d.by_id_path()] = d.pci_address();
  for (int i = 0; i < 8; ++i) {
    const auto& s = rep.candidates(i);
    const auto& gpu = GpuAddr(i);  // sorted: numa0 (GPUs 0-3) first, then by switch
    EXPECT_EQ(s.index(), i);
    EXPECT_EQ(s.gpu_pci_address(), gpu);
    EXPECT_EQ(s.slot_key(), "gpu-" + gpu);
    EXPECT_EQ(s.locality_group(), "numa" + std::to_string(i < 4 ? 0 : 1) + "/" + SwitchAddr(i));
    EXPECT_TRUE(StartsWith(s.nvme_by_id(), "/dev/disk/by-id/nvme-eui.")) << s.nvme_by_id();
    EXPECT_EQ(nvme_pci[s.nvme_by_id()], NvmeAddr(i));  // the disk behind the GPU's switch
    EXPECT_EQ(s.fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
    EXPECT_EQ(s.fabric_pf_pci_address(), PfAddr(i));
    EXPECT_EQ(s.fabric_type(), v1::FABRIC_TYPE_INFINIBAND);
    EXPECT_EQ(s.suggested_mac(), SuggestedMac("node-a", i));
    EXPECT_EQ(s.suggested_ip(), "10.100.0." + std::to_string(10 + i));
    EXPECT_EQ(s.profile().name(), "h200_24c_64g");
    EXPECT_EQ(s.profile().vcpus_per_gpu(), 24);
    EXPECT_EQ(s.profile().memory_mib_per_gpu(), 65536);
    EXPECT_TRUE(s.notes().empty()) << s.notes(0);
    disks.insert(s.nvme_by_id());
    vfs.insert(s.fabric_vf_pci_address());
    macs.insert(s.suggested_mac());
    ips.insert(s.suggested_ip());
  }
  EXPECT_EQ(disks.size(), 8u);
  EXPECT_EQ(vfs.size(), 8u);
  EXPECT_EQ(macs.size(), 8u);
  EXPECT_EQ(ips.size(), 8u);
  EXPECT_TRUE(rep.node_blockers().empty());
  EXPECT_FALSE(rep.reboot_required());
  for (const auto* list : {&rep.prereqs(), &rep.network_checks()}) {
    for (const auto& c : *list) {
      EXPECT_EQ(c.status(), v1::CHECK_STATUS_PASS) << c.name() << ": " << c.detail();
    }
  }
}

TEST(DiscoveryTest, NvmeEvidence) {
  TempHost host;
  auto rep = host.Discover();
  const auto* os = FindNvme(rep, "nvme8n1");
  ASSERT_NE(os, nullptr);
  EXPECT_TRUE(os->os_disk());
  EXPECT_EQ(os->partition_table(), "gpt");
  ASSERT_EQ(os->partitions_size(), 2);
  EXPECT_EQ(os->partitions(0).fs_type(), "vfat");
  EXPECT_EQ(os->partitions(0).mountpoints(0), "/boot/efi");
  EXPECT_EQ(os->partitions(1).fs_type(), "ext4");
  EXPECT_EQ(os->partitions(1).mountpoints(0), "/");
  const auto* d = FindNvme(rep, "nvme0n1");
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(d->by_id_path(), "/dev/disk/by-id/nvme-eui.000000000000000100a075244a100000");
  EXPECT_EQ(d->pci_address(), NvmeAddr(0));
  EXPECT_EQ(d->numa_node(), 0);
  EXPECT_EQ(d->size_bytes(), 7501476528ull * 512);
  EXPECT_EQ(d->model(), "Dell Ent NVMe PM1733a RI 3.84TB");
  EXPECT_EQ(d->serial(), "S6CRNA0W0100");
  EXPECT_FALSE(d->os_disk());
  EXPECT_EQ(d->fs_type(), "");
  EXPECT_EQ(d->partition_table(), "");
}

TEST(DiscoveryTest, OsDiskAmongNvmeIsNeverACandidate) {
  for (bool lvm : {false, true}) {
    FixtureOptions o;
    o.gpus = 2;
    o.separate_os_disk = false;
    o.os_disk_nvme = 1;  // the disk behind GPU 1's switch
    o.os_on_lvm = lvm;
    TempHost host(o);
    auto rep = host.Discover();
    const auto* os = FindNvme(rep, "nvme1n1");
    ASSERT_NE(os, nullptr);
    EXPECT_TRUE(os->os_disk()) << "lvm=" << lvm;
    if (lvm) {  // "/" is dm-0 on nvme1n1p2
      EXPECT_EQ(os->partitions(1).fs_type(), "LVM2_member");
      ASSERT_EQ(os->partitions(1).mountpoints_size(), 1);
      EXPECT_EQ(os->partitions(1).mountpoints(0), "/");
    }
    for (const auto& s : rep.candidates()) EXPECT_NE(s.nvme_by_id(), os->by_id_path());
    const auto* s1 = SlotFor(rep, GpuAddr(1));
    ASSERT_NE(s1, nullptr);
    EXPECT_EQ(s1->nvme_by_id(), "");
    EXPECT_TRUE(HasNote(*s1, "no eligible NVMe"));
    EXPECT_FALSE(SlotFor(rep, GpuAddr(0))->nvme_by_id().empty());
  }
}

TEST(DiscoveryTest, MountedChildPartitionIsExcludedAndReported) {
  FixtureOptions o;
  o.gpus = 2;
  o.mounted_child_nvme = 0;
  o.fs_nvme = 1;
  TempHost host(o);
  auto rep = host.Discover();
  const auto* d = FindNvme(rep, "nvme0n1");
  ASSERT_NE(d, nullptr);
  EXPECT_FALSE(d->os_disk());
  EXPECT_TRUE(d->mountpoints().empty());  // the parent itself is not mounted
  EXPECT_EQ(d->partition_table(), "gpt");
  ASSERT_EQ(d->partitions_size(), 1);
  EXPECT_EQ(d->partitions(0).kernel_name(), "nvme0n1p1");
  EXPECT_EQ(d->partitions(0).fs_type(), "ext4");
  ASSERT_EQ(d->partitions(0).mountpoints_size(), 1);
  EXPECT_EQ(d->partitions(0).mountpoints(0), "/share 1");  // \040 decoded
  for (const auto& s : rep.candidates()) EXPECT_NE(s.nvme_by_id(), d->by_id_path());
  // The unmounted disk with an xfs signature is paired, with a note asking for a wipe.
  const auto* x = FindNvme(rep, "nvme1n1");
  ASSERT_NE(x, nullptr);
  EXPECT_EQ(x->fs_type(), "xfs");
  const auto* s1 = SlotFor(rep, GpuAddr(1));
  EXPECT_EQ(s1->nvme_by_id(), x->by_id_path());
  EXPECT_TRUE(HasNote(*s1, "xfs"));
  EXPECT_EQ(SlotFor(rep, GpuAddr(0))->nvme_by_id(), "");
}

TEST(DiscoveryTest, KernelNamesThatMovedFollowTheByIdLink) {
  FixtureOptions o;
  o.shuffle_kernel_names = true;
  TempHost host(o);
  HostRoot h(host.dir());
  auto rep = host.Discover();
  ASSERT_EQ(rep.candidates_size(), 8);
  for (int i = 0; i < 8; ++i) {
    const auto& s = rep.candidates(i);
    char eui[16];
    std::snprintf(eui, sizeof(eui), "%08x", 0x4a100000 + i);
    EXPECT_EQ(s.nvme_by_id(),
              std::string("/dev/disk/by-id/nvme-eui.000000000000000100a07524") + eui);
    // Reversed names: GPU i's disk is nvme(8-i)n1 now, and the kernel name follows the link.
    EXPECT_EQ(s.nvme_kernel_name(), "nvme" + std::to_string(8 - i) + "n1");
    EXPECT_EQ(*h.Resolve(s.nvme_by_id()), "/dev/" + s.nvme_kernel_name());
  }
  const auto* os = FindNvme(rep, "nvme0n1");  // the OS disk moved to nvme0n1
  ASSERT_NE(os, nullptr);
  EXPECT_TRUE(os->os_disk());
}

TEST(DiscoveryTest, FewerVfsThanGpusGivesSharedParent) {
  FixtureOptions o;
  o.gpus = 2;
  o.fabric_pfs = 1;  // behind GPU 0's switch
  o.vfs_per_pf = 1;
  TempHost host(o);
  auto rep = host.Discover();
  const auto* s0 = SlotFor(rep, GpuAddr(0));
  const auto* s1 = SlotFor(rep, GpuAddr(1));
  ASSERT_TRUE(s0 && s1);
  EXPECT_EQ(s0->fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
  EXPECT_EQ(s0->fabric_vf_pci_address(), "0000:19:00.1");
  EXPECT_EQ(s0->fabric_pf_pci_address(), PfAddr(0));
  EXPECT_EQ(s1->fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_SHARED_PARENT);
  EXPECT_EQ(s1->fabric_vf_pci_address(), "");
  EXPECT_EQ(s1->fabric_pf_pci_address(), PfAddr(0));
  EXPECT_TRUE(HasNote(*s1, "no free fabric VF"));
  const auto* sriov = FindCheck(rep.prereqs(), "sriov");
  ASSERT_NE(sriov, nullptr);
  EXPECT_EQ(sriov->status(), v1::CHECK_STATUS_FAIL);

  // No VFs at all: every slot shares the PF; no fabric at all: "none".
  o.vfs_per_pf = 0;
  TempHost no_vfs(o);
  auto nv = no_vfs.Discover();
  ASSERT_EQ(nv.candidates_size(), 2);
  for (const auto& s : nv.candidates()) {
    EXPECT_EQ(s.fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_SHARED_PARENT);
  }
  o.fabric_pfs = 0;
  TempHost no_fabric(o);
  auto nf = no_fabric.Discover();
  for (const auto& s : nf.candidates()) {
    EXPECT_EQ(s.fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_NONE);
  }
  EXPECT_EQ(FindCheck(nf.prereqs(), "sriov")->status(), v1::CHECK_STATUS_WARN);
}

TEST(DiscoveryTest, VfsWithoutRdmaDeviceAreStillListed) {
  FixtureOptions o;
  o.gpus = 2;
  o.vfs_per_pf = 2;
  o.vf_rdma_devices = false;
  o.link_layer = "Ethernet";
  TempHost host(o);
  auto rep = host.Discover();
  ASSERT_EQ(rep.fabric_size(), 6);
  int vfs = 0;
  for (const auto& f : rep.fabric()) {
    EXPECT_EQ(f.fabric_type(), v1::FABRIC_TYPE_ROCE);
    if (!f.is_vf()) {
      EXPECT_EQ(f.sriov_numvfs(), 2);
      EXPECT_EQ(f.sriov_totalvfs(), 8);
      EXPECT_EQ(f.vf_pci_addresses_size(), 2);
      ASSERT_EQ(f.ports_size(), 1);
      EXPECT_EQ(f.ports(0).state(), "ACTIVE");
      EXPECT_EQ(f.ports(0).link_layer(), "Ethernet");
      continue;
    }
    ++vfs;
    EXPECT_EQ(f.name(), "");
    EXPECT_FALSE(f.pf_pci_address().empty());
    EXPECT_TRUE(f.has_numa_node());
  }
  EXPECT_EQ(vfs, 4);
  for (const auto& s : rep.candidates()) {
    EXPECT_EQ(s.fabric_claim_mode(), v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
    EXPECT_EQ(s.fabric_type(), v1::FABRIC_TYPE_ROCE);
  }
}

TEST(DiscoveryTest, ControllerPathNamesAreIgnored) {
  FixtureOptions o;
  o.gpus = 2;
  o.controller_path_names = true;
  TempHost host(o);
  HostRoot h(host.dir());
  ASSERT_TRUE(h.Exists("/sys/class/block/nvme0c0n1"));
  auto rep = host.Discover();
  EXPECT_EQ(rep.nvme_size(), 3);
  for (const auto& d : rep.nvme()) EXPECT_EQ(d.kernel_name().find('c'), std::string::npos);
}

TEST(DiscoveryTest, PrereqChecksOnFixture) {
  FixtureOptions o;
  o.gpus = 2;
  o.kvm = false;
  o.iommu_cmdline = false;
  o.vfio = false;
  o.ovmf = false;
  o.hugepages_free = 3;
  o.reboot_required = true;
  TempHost host(o);
  auto opts = host.Options();
  opts.profile.set_hugepages_1g_per_gpu(2);  // needs 4
  auto rep = TempHost::Discover(opts);
  auto status = [&](const std::string& n) {
    const auto* c = FindCheck(rep.prereqs(), n);
    EXPECT_NE(c, nullptr) << n;
    return c ? c->status() : v1::CHECK_STATUS_UNSPECIFIED;
  };
  EXPECT_EQ(status("gpus"), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(status("kvm"), v1::CHECK_STATUS_FAIL);
  EXPECT_EQ(FindCheck(rep.prereqs(), "kvm_access"), nullptr);  // nothing to open
  EXPECT_EQ(status("iommu_groups"), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(status("iommu_cmdline"), v1::CHECK_STATUS_WARN);  // groups exist anyway
  EXPECT_EQ(status("vfio_modules"), v1::CHECK_STATUS_FAIL);
  EXPECT_EQ(status("sriov"), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(status("libvirt"), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(status("ovmf"), v1::CHECK_STATUS_FAIL);
  EXPECT_EQ(status("hugepages"), v1::CHECK_STATUS_FAIL);
  EXPECT_EQ(status("reboot_required"), v1::CHECK_STATUS_WARN);
  EXPECT_TRUE(rep.reboot_required());
  EXPECT_NE(FindCheck(rep.prereqs(), "reboot_required")->detail().find("linux-image"),
            std::string::npos);
  for (const auto& c : rep.prereqs()) {
    if (c.status() != v1::CHECK_STATUS_PASS) {
      EXPECT_FALSE(c.remediation().empty()) << c.name();
    }
  }
  EXPECT_EQ(std::vector<std::string>(rep.node_blockers().begin(), rep.node_blockers().end()),
            (std::vector<std::string>{"kvm_missing", "vfio_modules_missing", "ovmf_missing",
                                      "hugepages_insufficient"}));

  // No IOMMU at all; libvirt skipped; no GPUs.
  FixtureOptions bare;
  bare.gpus = 0;
  bare.iommu = false;
  TempHost bare_host(bare);
  auto bopts = bare_host.Options();
  bopts.libvirt_uri = "";
  auto brep = TempHost::Discover(bopts);
  EXPECT_EQ(FindCheck(brep.prereqs(), "gpus")->status(), v1::CHECK_STATUS_WARN);
  EXPECT_EQ(FindCheck(brep.prereqs(), "iommu_groups")->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_EQ(FindCheck(brep.prereqs(), "libvirt")->status(), v1::CHECK_STATUS_WARN);
  EXPECT_TRUE(brep.candidates().empty());
}

TEST(DiscoveryTest, KvmAccessPassesWhenQemusGroupCanOpenIt) {
  FixtureOptions o;
  o.gpus = 1;
  TempHost host(o);
  auto st = HostRoot(host.dir()).Stat("/dev/kvm");
  ASSERT_TRUE(st.has_value());
  EXPECT_EQ(st->mode, 0660u);
  EXPECT_TRUE(st->regular);
  EXPECT_FALSE(st->char_device);
  auto rep = host.Discover();
  const auto* c = FindCheck(rep.prereqs(), "kvm_access");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status(), v1::CHECK_STATUS_PASS) << c->detail();
  EXPECT_NE(c->detail().find(":kvm 0660"), std::string::npos) << c->detail();
  if (::geteuid() == 0) {
    EXPECT_EQ(c->detail(), "/dev/kvm root:kvm 0660");
  }
  EXPECT_TRUE(c->remediation().empty());
}

TEST(DiscoveryTest, KvmAccessWarnsWhenOnlyItsOwnerCanOpenIt) {
  FixtureOptions o;
  o.gpus = 1;
  o.kvm_access = false;
  TempHost host(o);
  auto rep = host.Discover();
  const auto* c = FindCheck(rep.prereqs(), "kvm_access");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status(), v1::CHECK_STATUS_WARN);
  EXPECT_NE(c->detail().find(" 0600: libvirt's qemu (group kvm) cannot open it, and libvirt "
                             "re-probes qemu on every call (about 90 s per define)"),
            std::string::npos)
      << c->detail();
  if (::geteuid() == 0) {
    EXPECT_EQ(c->detail().rfind("/dev/kvm is root:root 0600:", 0), 0u) << c->detail();
  }
  EXPECT_EQ(c->remediation(),
            "run scripts/host-bootstrap (or: chgrp kvm /dev/kvm && chmod 0660 /dev/kvm, and a "
            "udev rule)");
  // Slow, not broken: advisory only, never a blocker, and parity still exits 0.
  EXPECT_FALSE(c->blocker());
  EXPECT_EQ(FindCheck(rep.prereqs(), "kvm")->status(), v1::CHECK_STATUS_PASS);
  EXPECT_TRUE(rep.node_blockers().empty());
  std::vector<v1::Check> checks(rep.prereqs().begin(), rep.prereqs().end());
  EXPECT_NE(FormatParity(checks).find("GPUAAS_SLICE_PARITY status=WARN check=kvm_access detail="),
            std::string::npos);
  EXPECT_EQ(ParityExitCode(checks), 0);

  // Anyone may read and write it (systemd's own default, 0666): qemu can open it.
  ASSERT_EQ(::chmod((host.dir() + "/dev/kvm").c_str(), 0666), 0);
  EXPECT_EQ(FindCheck(host.Discover().prereqs(), "kvm_access")->status(), v1::CHECK_STATUS_PASS);
}

TEST(DiscoveryTest, KvmAccessFollowsQemuConf) {
  FixtureOptions o;
  o.gpus = 1;
  TempHost host(o);
  auto write_conf = [&](const std::string& text) {
    fs::create_directories(host.dir() + "/etc/libvirt");
    std::ofstream(host.dir() + "/etc/libvirt/qemu.conf") << text;
  };
  auto access = [&] { return *FindCheck(host.Discover().prereqs(), "kvm_access"); };
  // Commented lines are libvirt's documentation, not settings; a later line wins.
  write_conf(
      "#group = \"libvirt-qemu\"\ngroup_x = \"nobody\"\ngroup = \"nobody\"\n"
      "group = \"kvm\"\n");
  EXPECT_EQ(access().status(), v1::CHECK_STATUS_PASS) << access().detail();
  // A group the root does not know: qemu cannot be in it.
  write_conf("group = \"libvirt-qemu\"\n");
  auto c = access();
  EXPECT_EQ(c.status(), v1::CHECK_STATUS_WARN);
  EXPECT_NE(c.detail().find("(group libvirt-qemu) cannot open it"), std::string::npos);
  EXPECT_NE(c.detail().find("group libvirt-qemu is not in /etc/group"), std::string::npos);
  EXPECT_NE(c.remediation().find("chgrp libvirt-qemu /dev/kvm"), std::string::npos);
  // qemu running as root opens anything.
  write_conf("group = \"libvirt-qemu\"\nuser = \"+0\"\n");
  EXPECT_EQ(access().status(), v1::CHECK_STATUS_PASS) << access().detail();
}

TEST(DiscoveryTest, LibvirtUnreachableFails) {
  FixtureOptions f;
  f.gpus = 1;
  TempHost host(f);
  auto opts = host.Options();
  opts.libvirt_uri = "qemu+unix:///system?socket=" + host.dir() + "/no-such-socket";
  auto rep = TempHost::Discover(opts);
  const auto* c = FindCheck(rep.prereqs(), "libvirt");
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_TRUE(c->blocker());
}

TEST(DiscoveryTest, NetworkBaselineOnHealthyFixture) {
  TempHost host;
  auto b = ReadNetworkBaseline(HostRoot(host.dir()), host.Options());
  EXPECT_EQ(b.mode(), v1::NETWORK_MODE_PRIVATE_NAT);
  EXPECT_EQ(b.bridge(), "ovsbr0");
  EXPECT_TRUE(b.bridge_present());
  EXPECT_EQ(b.gateway_cidr(), "10.100.0.1/24");
  EXPECT_TRUE(b.gateway_present());
  EXPECT_TRUE(b.ip_forward());
  EXPECT_EQ(b.slice_subnet(), "10.100.0.0/24");
  EXPECT_TRUE(b.nat_masquerade());
  EXPECT_EQ(b.default_route_interface(), "eno8303");
  EXPECT_EQ(b.tmfifo_address(), "192.168.100.1/30");
  for (const auto& c : NetworkChecks(b)) EXPECT_EQ(c.status(), v1::CHECK_STATUS_PASS) << c.name();

  // Without an ip tool the addresses come from /proc/net/fib_trie + /proc/net/route.
  FixtureOptions o;
  o.gpus = 0;
  o.ip_tool = false;
  TempHost proc_only(o);
  auto p = ReadNetworkBaseline(HostRoot(proc_only.dir()), proc_only.Options());
  EXPECT_TRUE(p.gateway_present());
  EXPECT_EQ(p.tmfifo_address(), "192.168.100.1/30");

  // A gateway CIDR the bridge does not carry.
  auto other = host.Options();
  other.gateway_cidr = "10.200.0.1/24";
  auto probe = ProbeNetwork(HostRoot(host.dir()), other);
  EXPECT_FALSE(probe.baseline.gateway_present());
  EXPECT_FALSE(probe.baseline.nat_masquerade());
  auto checks = NetworkChecks(probe.baseline, probe.notes);
  EXPECT_NE(checks[1].detail().find("ovsbr0 has 10.100.0.1/24"), std::string::npos)
      << checks[1].detail();
}

TEST(DiscoveryTest, MissingNatForwardingOrBridgeAreBlockers) {
  FixtureOptions o;
  o.gpus = 1;
  o.nat_rule = false;
  o.ip_forward = false;
  o.tmfifo = false;
  TempHost host(o);
  auto rep = host.Discover();
  EXPECT_FALSE(rep.network().nat_masquerade());
  EXPECT_FALSE(rep.network().ip_forward());
  const auto* nat = FindCheck(rep.network_checks(), "nat_masquerade");
  ASSERT_NE(nat, nullptr);
  EXPECT_EQ(nat->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_TRUE(nat->blocker());
  EXPECT_NE(nat->remediation().find("-s 10.100.0.0/24"), std::string::npos);
  EXPECT_EQ(FindCheck(rep.network_checks(), "tmfifo")->status(), v1::CHECK_STATUS_WARN);
  EXPECT_FALSE(FindCheck(rep.network_checks(), "tmfifo")->blocker());
  EXPECT_EQ(std::vector<std::string>(rep.node_blockers().begin(), rep.node_blockers().end()),
            (std::vector<std::string>{"ip_forward_disabled", "nat_masquerade_missing"}));

  FixtureOptions nb;
  nb.gpus = 1;
  nb.bridge = false;
  nb.iptables_tool = false;
  TempHost no_bridge(nb);
  auto r2 = no_bridge.Discover();
  EXPECT_EQ(
      std::vector<std::string>(r2.node_blockers().begin(), r2.node_blockers().end()),
      (std::vector<std::string>{"bridge_missing", "gateway_missing", "nat_masquerade_missing"}));
  EXPECT_NE(FindCheck(r2.network_checks(), "nat_masquerade")->detail().find("iptables not found"),
            std::string::npos);

  // Outside private-nat the same host has no network blockers, only warnings.
  auto routed = no_bridge.Options();
  routed.network_mode = "private-routed";
  auto r3 = TempHost::Discover(routed);
  EXPECT_TRUE(r3.node_blockers().empty());
  EXPECT_EQ(FindCheck(r3.network_checks(), "bridge")->status(), v1::CHECK_STATUS_WARN);
}

// ---------------------------------------------------------------------------------------------
// Open vSwitch evidence.

TEST(DiscoveryTest, WithoutOvsTheOvsFieldsStayEmpty) {
  // The fixture has ovsbr0's device but no ovs-vsctl: OVS cannot be asked, so no OVS evidence.
  TempHost host;
  auto rep = host.Discover();
  const auto& b = rep.network();
  EXPECT_TRUE(b.bridge_present());
  EXPECT_EQ(b.bridge_kind(), "other");
  EXPECT_EQ(b.ovs_datapath_type(), "");
  EXPECT_EQ(b.ovs_ports_size(), 0);
  EXPECT_FALSE(b.ovs_hw_offload());
  EXPECT_EQ(b.ovs_version(), "");
  EXPECT_EQ(FindCheck(rep.network_checks(), "ovs_offload"), nullptr);
  EXPECT_EQ(rep.network_checks_size(), 6);
  const auto* bridge = FindCheck(rep.network_checks(), "bridge");
  ASSERT_NE(bridge, nullptr);
  EXPECT_EQ(bridge->status(), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(bridge->detail(), "ovsbr0 present (other) (ovs-vsctl not found)");

  // A Linux bridge says so in sysfs.
  fs::create_directories(host.dir() + "/sys/devices/virtual/net/ovsbr0/bridge");
  EXPECT_EQ(host.Discover().network().bridge_kind(), "linux-bridge");

  FixtureOptions o;
  o.gpus = 0;
  o.bridge = false;
  TempHost none(o);
  auto r2 = none.Discover();
  EXPECT_FALSE(r2.network().bridge_present());
  EXPECT_EQ(r2.network().bridge_kind(), "");
  EXPECT_EQ(FindCheck(r2.network_checks(), "ovs_offload"), nullptr);
  EXPECT_NE(FindCheck(r2.network_checks(), "bridge")->remediation().find("ovs-vsctl --may-exist"),
            std::string::npos);
}

TEST(DiscoveryTest, ParseOvsInterfacesReadsOvsJsonTables) {
  auto ports = ParseOvsInterfaces(
      R"({"data":[["vnet8",["set",[]],"internal",["map",[]],0,0],)"
      R"(["vnet7",5,"",["map",[["attached-mac","52:54:00:aa:bb:cc"],["gpuaas-slot","gpu-0000:18:00.0"],["iface-id","x"]]],10000,1000],)"
      R"(["bond0a",["set",[-1]],"",["map",[]],["set",[]],0]],)"
      R"("headings":["name","ofport","type","external_ids","ingress_policing_rate","ingress_policing_burst"]})");
  ASSERT_TRUE(ports.ok()) << ports.error().ToString();
  ASSERT_EQ(ports->size(), 3u);
  EXPECT_EQ((*ports)[0].name(), "vnet8");
  EXPECT_EQ((*ports)[0].ofport(), 0);
  EXPECT_EQ((*ports)[0].type(), "internal");
  const auto& p = (*ports)[1];
  EXPECT_EQ(p.ofport(), 5);
  EXPECT_EQ(p.attached_mac(), "52:54:00:aa:bb:cc");
  EXPECT_EQ(p.slot(), "gpu-0000:18:00.0");
  EXPECT_EQ(p.ingress_policing_rate_kbps(), 10000);
  EXPECT_EQ(p.ingress_policing_burst_kb(), 1000);
  EXPECT_EQ(p.type(), "");
  EXPECT_EQ((*ports)[2].ofport(), -1);
  EXPECT_EQ((*ports)[2].ingress_policing_rate_kbps(), 0);

  // Columns in another order, and fewer of them.
  auto few = ParseOvsInterfaces(R"({"headings":["type","name"],"data":[["dpdk","p0"]]})");
  ASSERT_TRUE(few.ok());
  ASSERT_EQ(few->size(), 1u);
  EXPECT_EQ((*few)[0].name(), "p0");
  EXPECT_EQ((*few)[0].type(), "dpdk");
  // A short row is read as far as it goes.
  auto short_row = ParseOvsInterfaces(R"({"headings":["name","type"],"data":[["p1"]]})");
  ASSERT_TRUE(short_row.ok());
  EXPECT_EQ((*short_row)[0].type(), "");

  for (const char* bad : {"", "not json", "[]", R"({"headings":["type"],"data":[]})",
                          R"({"headings":["name"],"data":7})"}) {
    auto r = ParseOvsInterfaces(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().reason, "ovs_table_invalid");
  }
}

// A private ovsdb-server (no ovs-vswitchd, no kernel module: the database alone answers every
// query discovery makes), its state in a temporary directory, stopped by its PID at the end.
class PrivateOvsdb {
 public:
  PrivateOvsdb() : dir_(testing::MakeTempDir("gpuaas-ovs")) {}
  ~PrivateOvsdb() {
    server_.Stop(std::chrono::seconds(5));
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  PrivateOvsdb(const PrivateOvsdb&) = delete;
  PrivateOvsdb& operator=(const PrivateOvsdb&) = delete;

  // Fails the test (never skips) when Open vSwitch is missing: scripts/install-deps installs it.
  void Start() {
    for (const char* tool : {kTool, kServer, kVsctl, kSchema}) {
      ASSERT_TRUE(fs::exists(tool))
          << tool << " missing: install openvswitch-switch (scripts/install-deps)";
    }
    Must({kTool, "create", dir_ + "/conf.db", kSchema});
    server_.Spawn({kServer, dir_ + "/conf.db", "--remote=punix:" + db_path(),
                   "--unixctl=" + dir_ + "/ovsdb-server.ctl", "--no-chdir",
                   "--pidfile=" + dir_ + "/ovsdb-server.pid"},
                  dir_ + "/ovsdb-server.log");
    ASSERT_TRUE(testing::WaitFor([&] { return fs::exists(db_path()); }))
        << "ovsdb-server did not open " << db_path();
    Vsctl({"--no-wait", "init"});
  }
  std::string db() const { return "unix:" + db_path(); }
  // ovs-vsctl against this database, --no-wait since no ovs-vswitchd will ever apply anything.
  void Vsctl(std::vector<std::string> args) {
    args.insert(args.begin(), {kVsctl, "--db=" + db(), "--timeout=5"});
    Must(args);
  }

 private:
  static constexpr const char* kTool = "/usr/bin/ovsdb-tool";
  static constexpr const char* kServer = "/usr/sbin/ovsdb-server";
  static constexpr const char* kVsctl = "/usr/bin/ovs-vsctl";
  static constexpr const char* kSchema = "/usr/share/openvswitch/vswitch.ovsschema";
  std::string db_path() const { return dir_ + "/db.sock"; }
  static void Must(const std::vector<std::string>& argv) {
    auto r = RunTool(argv, std::chrono::seconds(10));
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    ASSERT_EQ(r->exit_code, 0) << argv[0] << " " << argv[1] << ": " << r->err;
  }
  std::string dir_;
  testing::Process server_;
};

// The fixture gets an ovs-vsctl that is this machine's, so discovery finds it inside the root.
void AddOvsVsctl(const TempHost& host) {
  const std::string bin = host.dir() + "/usr/bin";
  fs::create_directories(bin);
  std::ofstream(bin + "/ovs-vsctl") << "#!/bin/sh\nexec /usr/bin/ovs-vsctl \"$@\"\n";
  fs::permissions(bin + "/ovs-vsctl", fs::perms::owner_all | fs::perms::group_read |
                                          fs::perms::group_exec | fs::perms::others_read |
                                          fs::perms::others_exec);
}

TEST(DiscoveryTest, OvsBridgeFromRealOvsdbServer) {
  PrivateOvsdb ovs;
  ASSERT_NO_FATAL_FAILURE(ovs.Start());
  ovs.Vsctl(
      {"--no-wait", "add-br", "ovsbr0", "--", "set", "bridge", "ovsbr0", "datapath_type=netdev"});
  ovs.Vsctl({"--no-wait", "add-port", "ovsbr0", "vnet7", "--", "set", "interface", "vnet7",
             "external_ids:attached-mac=52:54:00:aa:bb:cc",
             "external_ids:gpuaas-slot=gpu-0000:18:00.0", "ingress_policing_rate=10000",
             "ingress_policing_burst=1000"});
  ovs.Vsctl({"--no-wait", "add-port", "ovsbr0", "uplink0"});
  // A port on another bridge is not ovsbr0's.
  ovs.Vsctl({"--no-wait", "add-br", "other0", "--", "add-port", "other0", "vnet9"});

  FixtureOptions o;
  o.gpus = 0;
  TempHost host(o);
  AddOvsVsctl(host);
  auto opts = host.Options();
  opts.ovs_db = ovs.db();

  auto rep = TempHost::Discover(opts);
  const auto& b = rep.network();
  EXPECT_TRUE(b.bridge_present());
  EXPECT_EQ(b.bridge_kind(), "ovs");
  EXPECT_EQ(b.ovs_datapath_type(), "netdev");
  EXPECT_FALSE(b.ovs_hw_offload());
  EXPECT_TRUE(std::regex_match(b.ovs_version(), std::regex(R"(\d+\.\d+\.\d+.*)")))
      << b.ovs_version();
  ASSERT_EQ(b.ovs_ports_size(), 2);
  EXPECT_EQ(b.ovs_ports(0).name(), "uplink0");
  EXPECT_EQ(b.ovs_ports(0).attached_mac(), "");
  const auto& vnet = b.ovs_ports(1);
  EXPECT_EQ(vnet.name(), "vnet7");
  EXPECT_EQ(vnet.attached_mac(), "52:54:00:aa:bb:cc");
  EXPECT_EQ(vnet.slot(), "gpu-0000:18:00.0");
  EXPECT_EQ(vnet.ingress_policing_rate_kbps(), 10000);
  EXPECT_EQ(vnet.ingress_policing_burst_kb(), 1000);
  EXPECT_EQ(vnet.ofport(), 0);  // no ovs-vswitchd assigned one
  EXPECT_EQ(vnet.type(), "");
  const auto* bridge = FindCheck(rep.network_checks(), "bridge");
  ASSERT_NE(bridge, nullptr);
  EXPECT_EQ(bridge->status(), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(bridge->detail(), "ovsbr0 present (ovs, datapath netdev, 2 ports)");
  const auto* off = FindCheck(rep.network_checks(), "ovs_offload");
  ASSERT_NE(off, nullptr);
  EXPECT_EQ(off->status(), v1::CHECK_STATUS_WARN);
  EXPECT_EQ(off->detail(), "hw-offload off");
  EXPECT_FALSE(off->blocker());
  EXPECT_EQ(rep.network_checks_size(), 7);
  EXPECT_TRUE(rep.node_blockers().empty());
  // The parity checker prints it like any other check, and a WARN does not fail it.
  std::vector<v1::Check> checks(rep.network_checks().begin(), rep.network_checks().end());
  EXPECT_NE(FormatParity(checks).find("status=WARN check=ovs_offload detail=hw-offload\\ off"),
            std::string::npos)
      << FormatParity(checks);
  EXPECT_EQ(ParityExitCode(checks), 0);

  ovs.Vsctl({"--no-wait", "set", "Open_vSwitch", ".", "other_config:hw-offload=true"});
  auto on = TempHost::Discover(opts);
  EXPECT_TRUE(on.network().ovs_hw_offload());
  EXPECT_EQ(FindCheck(on.network_checks(), "ovs_offload")->status(), v1::CHECK_STATUS_PASS);
  EXPECT_EQ(FindCheck(on.network_checks(), "ovs_offload")->detail(), "hw-offload on");

  // The kernel datapath: OVS leaves datapath_type empty.
  ovs.Vsctl({"--no-wait", "set", "bridge", "ovsbr0", "datapath_type=\"\""});
  EXPECT_EQ(TempHost::Discover(opts).network().ovs_datapath_type(), "system");

  // In OVS's database but without a network device (ovs-vswitchd down): OVS, yet missing.
  FixtureOptions nd;
  nd.gpus = 0;
  nd.bridge = false;
  TempHost no_device(nd);
  AddOvsVsctl(no_device);
  auto nd_opts = no_device.Options();
  nd_opts.ovs_db = ovs.db();
  auto r2 = TempHost::Discover(nd_opts);
  EXPECT_FALSE(r2.network().bridge_present());
  EXPECT_EQ(r2.network().bridge_kind(), "ovs");
  const auto* missing = FindCheck(r2.network_checks(), "bridge");
  EXPECT_EQ(missing->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_TRUE(missing->blocker());
  EXPECT_NE(missing->remediation().find("openvswitch-switch"), std::string::npos);

  // A bridge OVS does not have: no OVS evidence, the device decides.
  auto other = opts;
  other.bridge = "nope0";
  auto r3 = ProbeNetwork(HostRoot(host.dir()), other);
  EXPECT_EQ(r3.baseline.bridge_kind(), "");
  EXPECT_EQ(r3.baseline.ovs_ports_size(), 0);
  EXPECT_EQ(r3.notes.count("bridge"), 0u);

  // An unreachable database is a note, promptly, never an error.
  auto gone = opts;
  gone.ovs_db = "unix:" + host.dir() + "/no-such.sock";
  auto t0 = std::chrono::steady_clock::now();
  auto r4 = TempHost::Discover(gone);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(r4.network().bridge_kind(), "other");
  EXPECT_EQ(FindCheck(r4.network_checks(), "ovs_offload"), nullptr);
  const auto* note = FindCheck(r4.network_checks(), "bridge");
  EXPECT_NE(note->detail().find("br-exists ovsbr0 failed"), std::string::npos) << note->detail();
}

TEST(DiscoveryTest, SymlinkLoopsDoNotHang) {
  FixtureOptions o;
  o.gpus = 2;
  TempHost host(o);
  const std::string& d = host.dir();
  fs::create_symlink("0000:ff:00.0", d + "/sys/bus/pci/devices/0000:ff:00.0");
  fs::create_symlink("nvme99n1", d + "/sys/class/block/nvme99n1");
  fs::create_symlink("mlx5_99", d + "/sys/class/infiniband/mlx5_99");
  fs::create_symlink("nvme-eui.loop", d + "/dev/disk/by-id/nvme-eui.loop");
  auto t0 = std::chrono::steady_clock::now();
  auto rep = host.Discover();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  EXPECT_EQ(rep.gpus_size(), 2);
  EXPECT_EQ(rep.candidates_size(), 2);
}

TEST(DiscoveryTest, MissingRootIsAnError) {
  DiscoveryOptions o;
  o.root = "/nonexistent/gpuaas-root";
  auto r = Discover(o);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "host_root_missing");
  // An empty directory is a host with nothing on it, not an error.
  auto dir = testing::MakeTempDir("gpuaas-empty");
  o.root = dir;
  o.libvirt_uri = "";
  auto e = Discover(o);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->gpus_size(), 0);
  EXPECT_FALSE(e->prereqs().empty());
  fs::remove_all(dir);
}

TEST(DiscoveryTest, RealRootDoesNotCrash) {
  // This machine: whatever it has, discovery must complete and agree with a direct count.
  int nvidia = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/sys/bus/pci/devices", ec)) {
    std::ifstream v(e.path() / "vendor"), c(e.path() / "class");
    std::string vendor, cls;
    v >> vendor;
    c >> cls;
    if (vendor == "0x10de" && (StartsWith(cls, "0x0300") || StartsWith(cls, "0x0302"))) ++nvidia;
  }
  DiscoveryOptions o;
  o.node_id = "real-host";
  auto r = Discover(o);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->gpus_size(), nvidia);
  EXPECT_EQ(r->candidates_size(), nvidia);
  EXPECT_EQ(r->root(), "/");
  EXPECT_FALSE(r->prereqs().empty());
  // ovs_offload only where this machine's ovsbr0 is an OVS bridge.
  EXPECT_EQ(r->network_checks_size(), r->network().bridge_kind() == "ovs" ? 7 : 6);
  std::vector<v1::Check> checks(r->prereqs().begin(), r->prereqs().end());
  checks.insert(checks.end(), r->network_checks().begin(), r->network_checks().end());
  const std::regex line(
      R"(GPUAAS_SLICE_PARITY status=(PASS|WARN|FAIL) check=[a-z_0-9]+ detail=(\\.|[^\\\s])*( remediation=(\\.|[^\\\s])+)?)");
  const std::regex summary(R"(GPUAAS_SLICE_PARITY summary checks=\d+ failures=\d+ warnings=\d+)");
  auto lines = SplitLines(FormatParity(checks));
  ASSERT_EQ(lines.size(), checks.size() + 1);
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    EXPECT_TRUE(std::regex_match(lines[i], line)) << lines[i];
  }
  EXPECT_TRUE(std::regex_match(lines.back(), summary)) << lines.back();
}

// ---------------------------------------------------------------------------------------------

TEST(DiscoveryTest, SuggestedMacIsStableAndDistinct) {
  EXPECT_EQ(SuggestedMac("node-a", 0), "52:54:00:bf:39:4c");  // FNV-1a 64 of "node-a/0"
  EXPECT_EQ(SuggestedMac("node-a", 1), "52:54:00:bf:3a:ff");
  EXPECT_EQ(SuggestedMac("node-b", 0), "52:54:00:96:1b:61");
  EXPECT_EQ(SuggestedMac("node-a", 0), SuggestedMac("node-a", 0));
  std::set<std::string> macs;
  for (int n = 0; n < 50; ++n) {
    for (int i = 0; i < 8; ++i) macs.insert(SuggestedMac("node-" + std::to_string(n), i));
  }
  EXPECT_GT(macs.size(), 395u);  // 24 bits: a rare collision is possible, not a pattern
}

TEST(DiscoveryTest, SignatureDetection) {
  std::string h(8192, '\0');
  EXPECT_EQ(DetectFsType(h), "");
  EXPECT_EQ(DetectPartitionTable(h), "");
  std::string gpt = h;
  gpt[510] = static_cast<char>(0x55);
  gpt[511] = static_cast<char>(0xAA);
  gpt[450] = static_cast<char>(0xEE);
  gpt.replace(512, 8, "EFI PART");
  EXPECT_EQ(DetectPartitionTable(gpt), "gpt");
  std::string dos = h;
  dos[510] = static_cast<char>(0x55);
  dos[511] = static_cast<char>(0xAA);
  EXPECT_EQ(DetectPartitionTable(dos), "");  // boot signature but no partition entries
  dos[446 + 16 + 4] = static_cast<char>(0x83);
  EXPECT_EQ(DetectPartitionTable(dos), "dos");
  std::string ext = h;
  ext[1080] = static_cast<char>(0x53);
  ext[1081] = static_cast<char>(0xEF);
  EXPECT_EQ(DetectFsType(ext), "ext2");
  ext[1024 + 0x60] = 0x40;
  EXPECT_EQ(DetectFsType(ext), "ext4");
  std::string xfs = h;
  xfs.replace(0, 4, "XFSB");
  EXPECT_EQ(DetectFsType(xfs), "xfs");
  std::string lvm = h;
  lvm.replace(512, 8, "LABELONE");
  EXPECT_EQ(DetectFsType(lvm), "LVM2_member");
  std::string swap = h;
  swap.replace(4086, 10, "SWAPSPACE2");
  EXPECT_EQ(DetectFsType(swap), "swap");
  EXPECT_EQ(DetectFsType("short"), "");
  EXPECT_EQ(DetectPartitionTable("short"), "");
}

TEST(DiscoveryTest, CidrParsing) {
  auto c = ParseCidr("10.100.0.1/24");
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(FormatIpv4(c->Network()), "10.100.0.0");
  EXPECT_EQ(c->prefix, 24);
  EXPECT_FALSE(ParseCidr("10.100.0.1").has_value());
  EXPECT_FALSE(ParseCidr("10.100.0/24").has_value());
  EXPECT_FALSE(ParseCidr("10.100.0.256/24").has_value());
  EXPECT_FALSE(ParseCidr("10.100.0.1/33").has_value());
  EXPECT_FALSE(ParseCidr("10.100.0.1.5/24").has_value());
}

// ---------------------------------------------------------------------------------------------

v1::Check C(const std::string& name, v1::CheckStatus st, const std::string& detail,
            const std::string& rem = "") {
  v1::Check c;
  c.set_name(name);
  c.set_status(st);
  c.set_detail(detail);
  c.set_remediation(rem);
  return c;
}

TEST(ParityTest, FormatsExactLinesWithEscaping) {
  std::vector<v1::Check> checks = {
      C("node_agent", v1::CHECK_STATUS_PASS, "active/running"),
      C("ipoib_netplan", v1::CHECK_STATUS_FAIL, "command exited with 1",
        "render /etc/netplan/60-ipoib.yaml from site/profile bootstrap"),
      C("odd", v1::CHECK_STATUS_WARN, "a\\b c\nd\te", "x y"),
  };
  EXPECT_EQ(
      FormatParity(checks),
      "GPUAAS_SLICE_PARITY status=PASS check=node_agent detail=active/running\n"
      "GPUAAS_SLICE_PARITY status=FAIL check=ipoib_netplan detail=command\\ exited\\ with\\ 1"
      " remediation=render\\ /etc/netplan/60-ipoib.yaml\\ from\\ site/profile\\ bootstrap\n"
      "GPUAAS_SLICE_PARITY status=WARN check=odd detail=a\\\\b\\ c\\nd\\te remediation=x\\ y\n"
      "GPUAAS_SLICE_PARITY summary checks=3 failures=1 warnings=1\n");
  EXPECT_EQ(ParityExitCode(checks), 1);
  checks.erase(checks.begin() + 1);
  EXPECT_EQ(ParityExitCode(checks), 0);
  EXPECT_EQ(FormatParity({}), "GPUAAS_SLICE_PARITY summary checks=0 failures=0 warnings=0\n");
  EXPECT_EQ(ParityExitCode({}), 0);
}

TEST(ParityTest, FixtureHostPassesAndBrokenNatFails) {
  TempHost good;
  auto rep = good.Discover();
  std::vector<v1::Check> checks(rep.prereqs().begin(), rep.prereqs().end());
  checks.insert(checks.end(), rep.network_checks().begin(), rep.network_checks().end());
  auto out = FormatParity(checks);
  EXPECT_NE(out.find("summary checks=17 failures=0 warnings=0"), std::string::npos) << out;
  EXPECT_EQ(ParityExitCode(checks), 0);

  FixtureOptions o;
  o.gpus = 1;
  o.nat_rule = false;
  TempHost bad(o);
  auto brep = bad.Discover();
  std::vector<v1::Check> bchecks(brep.network_checks().begin(), brep.network_checks().end());
  EXPECT_NE(FormatParity(bchecks).find(
                "GPUAAS_SLICE_PARITY status=FAIL check=nat_masquerade detail=no\\ MASQUERADE\\ "
                "rule\\ for\\ 10.100.0.0/24\\ in\\ nat\\ POSTROUTING remediation=iptables\\ -t\\ "
                "nat\\ -A\\ POSTROUTING"),
            std::string::npos);
  EXPECT_EQ(ParityExitCode(bchecks), 1);
}

}  // namespace
}  // namespace gpuaas::node_agent
