// Host discovery on fixture trees built like real sysfs (symlinks, -1 NUMA nodes, moved kernel
// names, OS disk among NVMe, mounted child partitions, shared fabric devices), the parity
// output format, and one run against this machine's real root.
#include <sys/stat.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "discovery.hpp"
#include "fixture_host.hpp"
#include "host.hpp"
#include "parity.hpp"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;

std::string Fixture(const FixtureOptions& o) {
  const std::string root = testing::MakeTempDir("gpuaas-fixture") + "/root";
  auto r = BuildFixtureHost(root, o);
  EXPECT_TRUE(r.ok()) << r.error().ToString();
  return root;
}

v1::TopologyReport DiscoverFixture(const FixtureOptions& o,
                                   const std::string& node_id = "gpu-fx-01") {
  DiscoveryOptions d;
  d.root = Fixture(o);
  d.node_id = node_id;
  d.libvirt_uri = "test:///default";
  auto r = Discover(d);
  EXPECT_TRUE(r.ok()) << r.error().ToString();
  return r.ok() ? *r : v1::TopologyReport();
}

const v1::Check* FindCheck(const google::protobuf::RepeatedPtrField<v1::Check>& checks,
                           const std::string& name) {
  for (const auto& c : checks) {
    if (c.name() == name) return &c;
  }
  return nullptr;
}

bool HasBlocker(const v1::TopologyReport& r, const std::string& b) {
  return std::find(r.node_blockers().begin(), r.node_blockers().end(), b) !=
         r.node_blockers().end();
}

TEST(DiscoveryTest, EightGpuHostGivesEightCompleteCandidatesGroupedByLocality) {
  const auto r = DiscoverFixture(FixtureOptions{});
  ASSERT_EQ(r.gpus_size(), 8) << "the ASPEED VGA is not a GPU";
  ASSERT_EQ(r.candidates_size(), 8);
  std::set<std::string> disks, vfs;
  int prev_numa = -1;
  for (int i = 0; i < r.candidates_size(); ++i) {
    const auto& c = r.candidates(i);
    EXPECT_EQ(c.index(), i);
    EXPECT_EQ(c.slot_key(), "gpu-" + c.gpu_pci_address());
    EXPECT_EQ(c.fabric_claim_mode(), "per_slot_vf") << c.slot_key();
    EXPECT_FALSE(c.fabric_vf_pci_address().empty());
    EXPECT_FALSE(c.nvme_by_id().empty());
    EXPECT_EQ(c.nvme_by_id().rfind("/dev/disk/by-id/nvme-eui.", 0), 0u) << c.nvme_by_id();
    ASSERT_TRUE(c.has_numa_node());
    EXPECT_GE(c.numa_node(), prev_numa) << "sorted by NUMA node";
    prev_numa = c.numa_node();
    EXPECT_EQ(c.suggested_mac(), SuggestedMac("gpu-fx-01", i));
    EXPECT_EQ(c.profile().vcpus_per_gpu(), 24);
    EXPECT_EQ(c.profile().memory_mib_per_gpu(), 65536);
    disks.insert(c.nvme_by_id());
    vfs.insert(c.fabric_vf_pci_address());
  }
  EXPECT_EQ(disks.size(), 8u) << "each slot its own disk";
  EXPECT_EQ(vfs.size(), 8u) << "each slot its own VF";
  // The GPU's switch is recorded and the disk paired with it sits behind the same switch.
  for (const auto& g : r.gpus()) {
    EXPECT_FALSE(g.pcie_switch().empty());
    EXPECT_FALSE(g.iommu_group().empty());
    EXPECT_EQ(g.driver(), "vfio-pci");
    EXPECT_GE(g.pcie_path_size(), 3);
  }
  EXPECT_TRUE(r.node_blockers().empty());
  EXPECT_EQ(r.fabric(0).fabric_type(), "infiniband");
}

TEST(DiscoveryTest, PciEntriesAreSymlinksAndAreFollowed) {
  const std::string root = Fixture(FixtureOptions{});
  const std::string entry = root + "/sys/bus/pci/devices";
  int links = 0;
  for (const auto& e : fs::directory_iterator(entry)) links += fs::is_symlink(e.symlink_status());
  EXPECT_GT(links, 8) << "the fixture must look like sysfs";
  HostRoot host(root);
  auto gpus = DiscoverGpus(host);
  ASSERT_EQ(gpus.size(), 8u);
  auto resolved = host.Resolve("/sys/bus/pci/devices/" + gpus[0].pci_address());
  ASSERT_TRUE(resolved.has_value());
  EXPECT_EQ(resolved->rfind("/sys/devices/pci", 0), 0u) << *resolved;
}

TEST(DiscoveryTest, UnknownNumaNodeStaysUnknownAndSortsLast) {
  FixtureOptions o;
  o.unknown_numa_gpus = {0};
  const auto r = DiscoverFixture(o);
  int unknown = 0;
  for (const auto& g : r.gpus()) unknown += !g.has_numa_node();
  EXPECT_EQ(unknown, 1) << "numa_node=-1 is unknown, never node 0";
  ASSERT_EQ(r.candidates_size(), 8);
  EXPECT_FALSE(r.candidates(7).has_numa_node()) << "unknown locality sorts last";
  EXPECT_NE(r.candidates(7).locality_group().find("numa?"), std::string::npos);
  for (int i = 0; i < 7; ++i) EXPECT_TRUE(r.candidates(i).has_numa_node());
}

TEST(DiscoveryTest, OsDiskAmongNvmeIsNeverACandidate) {
  FixtureOptions o;
  o.separate_os_disk = false;
  o.os_disk_nvme = 2;
  const auto r = DiscoverFixture(o);
  std::string os_disk;
  for (const auto& n : r.nvme()) {
    if (n.os_disk()) os_disk = n.by_id_path();
  }
  ASSERT_FALSE(os_disk.empty());
  int without_disk = 0;
  for (const auto& c : r.candidates()) {
    EXPECT_NE(c.nvme_by_id(), os_disk) << c.slot_key();
    without_disk += c.nvme_by_id().empty();
  }
  EXPECT_EQ(without_disk, 1) << "8 GPUs, 7 eligible disks";
}

TEST(DiscoveryTest, OsDiskOnLvmIsRecognised) {
  FixtureOptions o;
  o.os_on_lvm = true;
  const auto r = DiscoverFixture(o);
  int os = 0;
  for (const auto& n : r.nvme()) os += n.os_disk();
  EXPECT_EQ(os, 1);
  for (const auto& c : r.candidates()) EXPECT_FALSE(c.nvme_by_id().empty());
}

TEST(DiscoveryTest, MountedChildPartitionExcludesTheDiskAndIsReported) {
  FixtureOptions o;
  o.mounted_child_nvme = 3;
  const auto r = DiscoverFixture(o);
  const v1::NvmeDevice* busy = nullptr;
  for (const auto& n : r.nvme()) {
    if (n.os_disk()) continue;
    for (const auto& p : n.partitions()) {
      if (!p.mountpoints().empty()) busy = &n;
    }
  }
  ASSERT_NE(busy, nullptr);
  EXPECT_TRUE(busy->mountpoints().empty()) << "the disk itself is not mounted";
  EXPECT_EQ(busy->partition_table(), "gpt");
  EXPECT_EQ(busy->partitions(0).mountpoints(0), "/share 1") << "octal escapes decoded";
  for (const auto& c : r.candidates()) EXPECT_NE(c.nvme_by_id(), busy->by_id_path());
}

TEST(DiscoveryTest, FilesystemSignatureIsReportedOnAnUnmountedDisk) {
  FixtureOptions o;
  o.fs_nvme = 1;
  const auto r = DiscoverFixture(o);
  int xfs = 0;
  for (const auto& n : r.nvme()) xfs += n.fs_type() == "xfs";
  EXPECT_EQ(xfs, 1);
}

TEST(DiscoveryTest, KernelNamesThatMovedDoNotMoveTheStableIdentity) {
  FixtureOptions o;
  const auto before = DiscoverFixture(o);
  o.shuffle_kernel_names = true;
  const auto after = DiscoverFixture(o);
  ASSERT_EQ(before.candidates_size(), after.candidates_size());
  int moved = 0;
  for (int i = 0; i < before.candidates_size(); ++i) {
    EXPECT_EQ(before.candidates(i).nvme_by_id(), after.candidates(i).nvme_by_id())
        << "the by-id path follows the disk";
    moved += before.candidates(i).nvme_kernel_name() != after.candidates(i).nvme_kernel_name();
  }
  EXPECT_GE(moved, 6) << "the kernel names (advisory) moved; the pairing did not";
}

TEST(DiscoveryTest, ControllerPathNamesAreIgnored) {
  FixtureOptions o;
  o.controller_path_names = true;
  const auto r = DiscoverFixture(o);
  EXPECT_EQ(r.nvme_size(), 9) << "8 data disks + the OS disk, no nvmeXcYnZ";
  for (const auto& n : r.nvme()) {
    EXPECT_FALSE(std::regex_match(n.kernel_name(), std::regex("nvme\\d+c\\d+n\\d+")))
        << n.kernel_name();
  }
}

TEST(DiscoveryTest, SlotsSharingOneFabricDeviceGetSharedParentNotAVf) {
  FixtureOptions o;
  o.gpus = 2;
  o.fabric_pfs = 1;
  o.vfs_per_pf = 1;  // two GPUs, one PF with a single VF
  const auto r = DiscoverFixture(o);
  ASSERT_EQ(r.candidates_size(), 2);
  std::multiset<std::string> modes;
  for (const auto& c : r.candidates()) modes.insert(c.fabric_claim_mode());
  EXPECT_EQ(modes.count("per_slot_vf"), 1u);
  EXPECT_EQ(modes.count("shared_parent"), 1u);
  for (const auto& c : r.candidates()) {
    if (c.fabric_claim_mode() == "shared_parent") {
      EXPECT_TRUE(c.fabric_vf_pci_address().empty());
      EXPECT_FALSE(c.fabric_pf_pci_address().empty());
      EXPECT_FALSE(c.notes().empty());
    }
  }
}

TEST(DiscoveryTest, RoceLinkLayerIsReportedAsRoce) {
  FixtureOptions o;
  o.gpus = 1;
  o.link_layer = "Ethernet";
  const auto r = DiscoverFixture(o);
  ASSERT_GT(r.fabric_size(), 0);
  EXPECT_EQ(r.fabric(0).fabric_type(), "roce");
}

TEST(DiscoveryTest, MissingNatOrForwardingIsAHardBlocker) {
  FixtureOptions o;
  o.gpus = 1;
  o.nat_rule = false;
  o.ip_forward = false;
  const auto r = DiscoverFixture(o);
  EXPECT_FALSE(r.network().nat_masquerade());
  EXPECT_FALSE(r.network().ip_forward());
  const auto* nat = FindCheck(r.network_checks(), "nat_masquerade");
  ASSERT_NE(nat, nullptr);
  EXPECT_EQ(nat->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_TRUE(nat->blocker());
  EXPECT_FALSE(nat->remediation().empty());
  EXPECT_TRUE(HasBlocker(r, "nat_masquerade_missing"));
  EXPECT_TRUE(HasBlocker(r, "ip_forward_disabled"));
}

TEST(DiscoveryTest, MissingBridgeAndPrerequisitesAreReported) {
  FixtureOptions o;
  o.gpus = 1;
  o.bridge = false;
  o.kvm = false;
  o.vfio = false;
  o.reboot_required = true;
  const auto r = DiscoverFixture(o);
  EXPECT_TRUE(HasBlocker(r, "bridge_missing"));
  EXPECT_EQ(FindCheck(r.prereqs(), "kvm")->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_EQ(FindCheck(r.prereqs(), "vfio_modules")->status(), v1::CHECK_STATUS_FAIL);
  EXPECT_TRUE(r.reboot_required());
  EXPECT_EQ(FindCheck(r.prereqs(), "libvirt")->status(), v1::CHECK_STATUS_PASS);
}

TEST(DiscoveryTest, HealthyFixturePassesEveryBlockingCheck) {
  const auto r = DiscoverFixture(FixtureOptions{});
  for (const auto* list : {&r.prereqs(), &r.network_checks()}) {
    for (const auto& c : *list) {
      EXPECT_NE(c.status(), v1::CHECK_STATUS_FAIL) << c.name() << ": " << c.detail();
    }
  }
  EXPECT_TRUE(r.network().bridge_present());
  EXPECT_TRUE(r.network().gateway_present());
  EXPECT_EQ(r.network().slice_subnet(), "10.100.0.0/24");
  EXPECT_FALSE(r.network().default_route_interface().empty());
}

TEST(DiscoveryTest, SuggestedMacIsStableAndDistinct) {
  EXPECT_EQ(SuggestedMac("gpu-01", 0), SuggestedMac("gpu-01", 0));
  EXPECT_NE(SuggestedMac("gpu-01", 0), SuggestedMac("gpu-01", 1));
  EXPECT_NE(SuggestedMac("gpu-01", 0), SuggestedMac("gpu-02", 0));
  EXPECT_TRUE(std::regex_match(SuggestedMac("gpu-01", 3),
                               std::regex("52:54:00:[0-9a-f]{2}:[0-9a-f]{2}:[0-9a-f]{2}")));
}

TEST(HostRootTest, SymlinkLoopsAndEscapesStayInsideTheRoot) {
  const std::string root = testing::MakeTempDir("gpuaas-host");
  fs::create_directories(root + "/a");
  fs::create_symlink("/a/loop2", root + "/a/loop1");
  fs::create_symlink("/a/loop1", root + "/a/loop2");
  fs::create_symlink("../../../../etc", root + "/a/up");
  HostRoot host(root);
  EXPECT_FALSE(host.Resolve("/a/loop1").has_value()) << "a loop is an error, not a hang";
  auto up = host.Resolve("/a/up");
  ASSERT_TRUE(up.has_value());
  EXPECT_EQ(*up, "/etc") << "'..' above the root stays at the root";
  EXPECT_FALSE(host.ReadFile("/a/loop1").has_value());
  EXPECT_TRUE(host.ListDir("/does/not/exist").empty());
}

TEST(ParityTest, LinesFollowTheFormatWithEscaping) {
  std::vector<v1::Check> checks(3);
  checks[0].set_name("kvm");
  checks[0].set_status(v1::CHECK_STATUS_PASS);
  checks[0].set_detail("/dev/kvm present");
  checks[1].set_name("tmfifo");
  checks[1].set_status(v1::CHECK_STATUS_WARN);
  checks[1].set_detail("no\taddress\nhere \\ there");
  checks[2].set_name("nat_masquerade");
  checks[2].set_status(v1::CHECK_STATUS_FAIL);
  checks[2].set_detail("missing");
  checks[2].set_remediation("iptables -t nat -A POSTROUTING");
  EXPECT_EQ(
      FormatParity(checks),
      "GPUAAS_SLICE_PARITY status=PASS check=kvm detail=/dev/kvm\\ present\n"
      "GPUAAS_SLICE_PARITY status=WARN check=tmfifo detail=no\\taddress\\nhere\\ \\\\\\ there\n"
      "GPUAAS_SLICE_PARITY status=FAIL check=nat_masquerade detail=missing "
      "remediation=iptables\\ -t\\ nat\\ -A\\ POSTROUTING\n"
      "GPUAAS_SLICE_PARITY summary checks=3 failures=1 warnings=1\n");
  EXPECT_EQ(ParityExitCode(checks), 1);
  checks.pop_back();
  EXPECT_EQ(ParityExitCode(checks), 0);
}

TEST(DiscoveryTest, RealRootOfThisMachineDoesNotCrashAndParityParses) {
  DiscoveryOptions d;  // "/" of the machine running the tests
  d.node_id = "this-machine";
  d.libvirt_uri = "test:///default";
  auto r = Discover(d);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->root(), "/");
  EXPECT_FALSE(r->prereqs().empty());
  EXPECT_FALSE(r->network_checks().empty());
  EXPECT_EQ(r->candidates_size(), r->gpus_size()) << "one candidate per GPU found";
  for (const auto& n : r->nvme()) {
    if (n.os_disk()) {
      for (const auto& c : r->candidates()) EXPECT_NE(c.nvme_by_id(), n.by_id_path());
    }
  }
  std::vector<v1::Check> checks(r->prereqs().begin(), r->prereqs().end());
  checks.insert(checks.end(), r->network_checks().begin(), r->network_checks().end());
  std::istringstream lines(FormatParity(checks));
  const std::regex line(
      "GPUAAS_SLICE_PARITY (status=(PASS|WARN|FAIL) check=[a-z0-9_]+ detail=(\\\\.|[^ \\\\])*( "
      "remediation=(\\\\.|[^ \\\\])+)?|summary checks=\\d+ failures=\\d+ warnings=\\d+)");
  std::string l;
  int n = 0;
  while (std::getline(lines, l)) {
    EXPECT_TRUE(std::regex_match(l, line)) << l;
    ++n;
  }
  EXPECT_EQ(n, static_cast<int>(checks.size()) + 1);
}

}  // namespace
}  // namespace gpuaas::node_agent
