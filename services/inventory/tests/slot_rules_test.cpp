#include "gpuaas/inventory/slot_rules.hpp"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace gpuaas::inventory {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::UnorderedElementsAre;

constexpr const char* kGpu = "0000:18:00.0";
constexpr const char* kOtherGpu = "0000:2a:00.0";
constexpr const char* kNvme = "/dev/disk/by-id/nvme-eui.0001";
constexpr const char* kOtherNvme = "/dev/disk/by-id/nvme-eui.0002";
constexpr const char* kPf = "0000:19:00.0";
constexpr const char* kVf = "0000:19:00.1";
constexpr const char* kOtherVf = "0000:19:00.2";
constexpr const char* kVfDevice = "0000:19:00.3";  // seen as its own RDMA device (is_vf)
constexpr const char* kSlotKey = "gpu-0000:18:00.0";
constexpr const char* kOtherSlotKey = "gpu-0000:2a:00.0";

// A node with two GPUs, two raw unmounted NVMe disks and one PF with SR-IOV VFs: everything the
// candidate below needs, so each test breaks exactly one thing.
v1::TopologyReport ValidReport() {
  v1::TopologyReport r;
  r.set_node_id("node-a");
  for (const char* pci : {kGpu, kOtherGpu}) {
    auto* gpu = r.add_gpus();
    gpu->set_pci_address(pci);
    gpu->set_vendor_id("0x10de");
    gpu->set_device_id("0x2335");
  }
  int n = 0;
  for (const char* by_id : {kNvme, kOtherNvme}) {
    auto* nvme = r.add_nvme();
    nvme->set_by_id_path(by_id);
    nvme->set_kernel_name("nvme" + std::to_string(n++) + "n1");
  }
  auto* pf = r.add_fabric();
  pf->set_name("mlx5_0");
  pf->set_pci_address(kPf);
  pf->set_sriov_totalvfs(8);
  pf->set_sriov_numvfs(2);
  pf->add_vf_pci_addresses(kVf);
  pf->add_vf_pci_addresses(kOtherVf);
  auto* vf = r.add_fabric();
  vf->set_name("mlx5_2");
  vf->set_pci_address(kVfDevice);
  vf->set_is_vf(true);
  vf->set_pf_pci_address(kPf);
  return r;
}

v1::CandidateSlot ValidCandidate() {
  v1::CandidateSlot c;
  c.set_slot_key(kSlotKey);
  c.set_gpu_pci_address(kGpu);
  c.set_nvme_by_id(kNvme);
  c.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
  c.set_fabric_vf_pci_address(kVf);
  c.set_fabric_pf_pci_address(kPf);
  return c;
}

// The node's other approved slot: it holds the other disk and VF, so it must not get in the way.
v1::Slot OtherHolder() {
  v1::Slot s;
  s.set_slot_key(kOtherSlotKey);
  s.set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
  s.set_gpu_pci_address(kOtherGpu);
  s.set_nvme_by_id(kOtherNvme);
  s.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
  s.set_fabric_vf_pci_address(kOtherVf);
  return s;
}

ApprovalContext ValidContext(const v1::TopologyReport& report) {
  ApprovalContext ctx;
  ctx.report = &report;
  ctx.holders.push_back(OtherHolder());
  return ctx;
}

v1::Slot ApprovedSlot() {
  v1::Slot s;
  s.set_node_id("node-a");
  s.set_slot_key(kSlotKey);
  s.set_admin_state(v1::SLOT_ADMIN_STATE_AVAILABLE);
  s.set_gpu_pci_address(kGpu);
  s.set_nvme_by_id(kNvme);
  s.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
  s.set_fabric_vf_pci_address(kVf);
  return s;
}

std::vector<std::string> Reasons(const std::vector<v1::SlotRejection>& rejections) {
  std::vector<std::string> out;
  out.reserve(rejections.size());
  for (const auto& r : rejections) {
    out.push_back(r.reason());
  }
  return out;
}

std::string MessageOf(const std::vector<v1::SlotRejection>& rejections, const std::string& reason) {
  for (const auto& r : rejections) {
    if (r.reason() == reason) {
      return r.message();
    }
  }
  return "<no " + reason + ">";
}

std::vector<std::string> Kinds(const std::vector<v1::DriftRecord>& drift) {
  std::vector<std::string> out;
  out.reserve(drift.size());
  for (const auto& d : drift) {
    out.push_back(d.kind());
  }
  return out;
}

v1::NvmeDevice* Nvme(v1::TopologyReport& report, const std::string& by_id) {
  for (auto& nvme : *report.mutable_nvme()) {
    if (nvme.by_id_path() == by_id) {
      return &nvme;
    }
  }
  ADD_FAILURE() << "no NVMe " << by_id << " in the test report";
  return report.add_nvme();
}

// --- ValidateCandidate -----------------------------------------------------------------------

TEST(SlotRulesTest, CompleteCandidateHasNoRejections) {
  const auto report = ValidReport();
  EXPECT_THAT(ValidateCandidate(ValidCandidate(), ValidContext(report)), IsEmpty());
}

TEST(SlotRulesTest, GpuPciAddressMissing) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.clear_gpu_pci_address();
  const auto got = ValidateCandidate(c, ValidContext(report));
  // Not also gpu_not_found: an empty address is one problem, not two.
  EXPECT_THAT(Reasons(got), ElementsAre("gpu_pci_address_missing"));
  EXPECT_THAT(MessageOf(got, "gpu_pci_address_missing"), HasSubstr(kSlotKey));
}

TEST(SlotRulesTest, GpuNotFound) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_gpu_pci_address("0000:99:00.0");
  const auto got = ValidateCandidate(c, ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("gpu_not_found"));
  EXPECT_THAT(MessageOf(got, "gpu_not_found"), HasSubstr("0000:99:00.0"));
}

TEST(SlotRulesTest, NvmeByIdMissing) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.clear_nvme_by_id();
  const auto got = ValidateCandidate(c, ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_by_id_missing"));
  EXPECT_THAT(MessageOf(got, "nvme_by_id_missing"), HasSubstr(kSlotKey));
}

TEST(SlotRulesTest, NvmeNotFound) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_nvme_by_id("/dev/disk/by-id/nvme-eui.dead");
  const auto got = ValidateCandidate(c, ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_not_found"));
  EXPECT_THAT(MessageOf(got, "nvme_not_found"), HasSubstr("nvme-eui.dead"));
}

TEST(SlotRulesTest, NvmeKernelNameIsNotIdentity) {
  // Kernel names move across reboots: a candidate naming the disk by kernel name is not found.
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_nvme_by_id("nvme0n1");
  EXPECT_THAT(Reasons(ValidateCandidate(c, ValidContext(report))), ElementsAre("nvme_not_found"));
}

TEST(SlotRulesTest, NvmeOsDisk) {
  auto report = ValidReport();
  Nvme(report, kNvme)->set_os_disk(true);
  const auto got = ValidateCandidate(ValidCandidate(), ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_os_disk"));
  EXPECT_THAT(MessageOf(got, "nvme_os_disk"), HasSubstr(kNvme));
}

TEST(SlotRulesTest, NvmeMounted) {
  auto report = ValidReport();
  Nvme(report, kNvme)->add_mountpoints("/data");
  const auto got = ValidateCandidate(ValidCandidate(), ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_mounted"));
  EXPECT_THAT(MessageOf(got, "nvme_mounted"), HasSubstr("/data"));
}

TEST(SlotRulesTest, NvmeChildPartitionMounted) {
  auto report = ValidReport();
  auto* part = Nvme(report, kNvme)->add_partitions();
  part->set_kernel_name("nvme0n1p1");
  part->add_mountpoints("/share2");
  const auto got = ValidateCandidate(ValidCandidate(), ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_child_partition_mounted"));
  EXPECT_THAT(MessageOf(got, "nvme_child_partition_mounted"), HasSubstr("nvme0n1p1"));
  EXPECT_THAT(MessageOf(got, "nvme_child_partition_mounted"), HasSubstr("/share2"));
}

TEST(SlotRulesTest, HostShareDiskIsRejectedThoughParentIsUnmounted) {
  // The lab case: the parent disk has no mountpoint, a child partition is a host share.
  auto report = ValidReport();
  auto* nvme = Nvme(report, kNvme);
  nvme->set_partition_table("gpt");
  auto* part = nvme->add_partitions();
  part->set_kernel_name("nvme0n1p1");
  part->set_fs_type("ext4");
  part->add_mountpoints("/share2");
  EXPECT_THAT(Reasons(ValidateCandidate(ValidCandidate(), ValidContext(report))),
              UnorderedElementsAre("nvme_child_partition_mounted", "nvme_unexpected_filesystem"));
}

TEST(SlotRulesTest, NvmeUnexpectedFilesystemOnDisk) {
  auto report = ValidReport();
  Nvme(report, kNvme)->set_fs_type("xfs");
  const auto got = ValidateCandidate(ValidCandidate(), ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_unexpected_filesystem"));
  EXPECT_THAT(MessageOf(got, "nvme_unexpected_filesystem"), HasSubstr("xfs"));
}

TEST(SlotRulesTest, NvmeUnexpectedPartitionTable) {
  auto report = ValidReport();
  Nvme(report, kNvme)->set_partition_table("gpt");
  const auto got = ValidateCandidate(ValidCandidate(), ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_unexpected_filesystem"));
  EXPECT_THAT(MessageOf(got, "nvme_unexpected_filesystem"), HasSubstr("gpt"));
}

TEST(SlotRulesTest, NvmeUnexpectedFilesystemOnPartition) {
  auto report = ValidReport();
  auto* part = Nvme(report, kNvme)->add_partitions();
  part->set_kernel_name("nvme0n1p1");
  part->set_fs_type("ext4");
  const auto got = ValidateCandidate(ValidCandidate(), ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_unexpected_filesystem"));
  EXPECT_THAT(MessageOf(got, "nvme_unexpected_filesystem"), HasSubstr("ext4"));
}

TEST(SlotRulesTest, WipeProofAcceptsUnexpectedFilesystem) {
  auto report = ValidReport();
  auto* nvme = Nvme(report, kNvme);
  nvme->set_fs_type("xfs");
  nvme->set_partition_table("gpt");
  nvme->add_partitions()->set_fs_type("ext4");
  auto ctx = ValidContext(report);
  ctx.wiped_nvme.insert(kNvme);
  EXPECT_THAT(ValidateCandidate(ValidCandidate(), ctx), IsEmpty());
}

TEST(SlotRulesTest, WipeProofOfAnotherDiskDoesNotCount) {
  auto report = ValidReport();
  Nvme(report, kNvme)->set_fs_type("xfs");
  auto ctx = ValidContext(report);
  ctx.wiped_nvme.insert(kOtherNvme);
  EXPECT_THAT(Reasons(ValidateCandidate(ValidCandidate(), ctx)),
              ElementsAre("nvme_unexpected_filesystem"));
}

TEST(SlotRulesTest, WipeProofDoesNotAcceptMounts) {
  auto report = ValidReport();
  auto* nvme = Nvme(report, kNvme);
  nvme->add_mountpoints("/data");
  auto* part = nvme->add_partitions();
  part->set_kernel_name("nvme0n1p1");
  part->add_mountpoints("/share2");
  auto ctx = ValidContext(report);
  ctx.wiped_nvme.insert(kNvme);
  EXPECT_THAT(Reasons(ValidateCandidate(ValidCandidate(), ctx)),
              UnorderedElementsAre("nvme_mounted", "nvme_child_partition_mounted"));
}

TEST(SlotRulesTest, NvmeInUseByAnotherSlot) {
  const auto report = ValidReport();
  auto ctx = ValidContext(report);
  auto thief = OtherHolder();
  thief.set_slot_key("gpu-0000:3b:00.0");
  thief.set_nvme_by_id(kNvme);
  thief.clear_fabric_vf_pci_address();
  ctx.holders.push_back(thief);
  const auto got = ValidateCandidate(ValidCandidate(), ctx);
  EXPECT_THAT(Reasons(got), ElementsAre("nvme_in_use"));
  EXPECT_THAT(MessageOf(got, "nvme_in_use"), HasSubstr("gpu-0000:3b:00.0"));
}

TEST(SlotRulesTest, OwnSlotHoldingSameNvmeAndVfIsNotADuplicate) {
  // Re-approving a slot: its own earlier approval holds the same disk and VF.
  const auto report = ValidReport();
  auto ctx = ValidContext(report);
  ctx.holders.push_back(ApprovedSlot());
  EXPECT_THAT(ValidateCandidate(ValidCandidate(), ctx), IsEmpty());
}

TEST(SlotRulesTest, FabricNotPerSlotVf) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_SHARED_PARENT);
  const auto got = ValidateCandidate(c, ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("fabric_not_per_slot_vf"));
  EXPECT_THAT(MessageOf(got, "fabric_not_per_slot_vf"), HasSubstr("shared_parent"));
}

TEST(SlotRulesTest, FabricVfMissing) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.clear_fabric_vf_pci_address();
  const auto got = ValidateCandidate(c, ValidContext(report));
  // Not also fabric_vf_not_found: there is no address to look up.
  EXPECT_THAT(Reasons(got), ElementsAre("fabric_vf_missing"));
  EXPECT_THAT(MessageOf(got, "fabric_vf_missing"), HasSubstr(kSlotKey));
}

TEST(SlotRulesTest, NoFabricReportsModeAndMissingVf) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_NONE);
  c.clear_fabric_vf_pci_address();
  c.clear_fabric_pf_pci_address();
  EXPECT_THAT(Reasons(ValidateCandidate(c, ValidContext(report))),
              ElementsAre("fabric_not_per_slot_vf", "fabric_vf_missing"));
}

TEST(SlotRulesTest, FabricVfNotFound) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_fabric_vf_pci_address("0000:19:07.7");
  const auto got = ValidateCandidate(c, ValidContext(report));
  EXPECT_THAT(Reasons(got), ElementsAre("fabric_vf_not_found"));
  EXPECT_THAT(MessageOf(got, "fabric_vf_not_found"), HasSubstr("0000:19:07.7"));
}

TEST(SlotRulesTest, PfAddressIsNotAVf) {
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_fabric_vf_pci_address(kPf);
  EXPECT_THAT(Reasons(ValidateCandidate(c, ValidContext(report))),
              ElementsAre("fabric_vf_not_found"));
}

TEST(SlotRulesTest, VfFoundAsItsOwnDevice) {
  // Not listed by any PF, but discovered as a VF device.
  const auto report = ValidReport();
  auto c = ValidCandidate();
  c.set_fabric_vf_pci_address(kVfDevice);
  EXPECT_THAT(ValidateCandidate(c, ValidContext(report)), IsEmpty());
}

TEST(SlotRulesTest, FabricVfDuplicate) {
  const auto report = ValidReport();
  auto ctx = ValidContext(report);
  auto thief = OtherHolder();
  thief.set_slot_key("gpu-0000:3b:00.0");
  thief.set_nvme_by_id("/dev/disk/by-id/nvme-eui.0003");
  thief.set_fabric_vf_pci_address(kVf);
  ctx.holders.push_back(thief);
  const auto got = ValidateCandidate(ValidCandidate(), ctx);
  EXPECT_THAT(Reasons(got), ElementsAre("fabric_vf_duplicate"));
  EXPECT_THAT(MessageOf(got, "fabric_vf_duplicate"), HasSubstr("gpu-0000:3b:00.0"));
  EXPECT_THAT(MessageOf(got, "fabric_vf_duplicate"), HasSubstr(kVf));
}

TEST(SlotRulesTest, FabricVfComparisonIgnoresAddressCase) {
  // sysfs writes lower case; a hand-edited slot may not, and must still block a second sale.
  auto report = ValidReport();
  report.mutable_fabric(0)->add_vf_pci_addresses("0000:19:0a.1");
  auto c = ValidCandidate();
  c.set_fabric_vf_pci_address("0000:19:0A.1");
  auto ctx = ValidContext(report);
  EXPECT_THAT(ValidateCandidate(c, ctx), IsEmpty());
  ctx.holders[0].set_fabric_vf_pci_address("0000:19:0a.1");
  EXPECT_THAT(Reasons(ValidateCandidate(c, ctx)), ElementsAre("fabric_vf_duplicate"));
}

TEST(SlotRulesTest, MultipleViolationsReportedTogether) {
  auto report = ValidReport();
  auto* nvme = Nvme(report, kNvme);
  nvme->set_os_disk(true);
  nvme->add_mountpoints("/");
  nvme->set_fs_type("ext4");
  auto c = ValidCandidate();
  c.set_gpu_pci_address("0000:99:00.0");
  c.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_SHARED_PARENT);
  c.set_fabric_vf_pci_address(kOtherVf);  // held by the other slot
  EXPECT_THAT(Reasons(ValidateCandidate(c, ValidContext(report))),
              UnorderedElementsAre("gpu_not_found", "nvme_os_disk", "nvme_mounted",
                                   "nvme_unexpected_filesystem", "fabric_not_per_slot_vf",
                                   "fabric_vf_duplicate"));
}

TEST(SlotRulesTest, EmptyCandidateReportsEveryMissingBinding) {
  const auto report = ValidReport();
  EXPECT_THAT(Reasons(ValidateCandidate(v1::CandidateSlot{}, ValidContext(report))),
              ElementsAre("gpu_pci_address_missing", "nvme_by_id_missing", "fabric_not_per_slot_vf",
                          "fabric_vf_missing"));
}

TEST(SlotRulesTest, NullReportFailsEveryEvidenceRule) {
  ApprovalContext ctx;
  ctx.holders.push_back(OtherHolder());
  const auto got = ValidateCandidate(ValidCandidate(), ctx);
  EXPECT_THAT(Reasons(got), ElementsAre("gpu_not_found", "nvme_not_found", "fabric_vf_not_found"));
  EXPECT_THAT(MessageOf(got, "gpu_not_found"), HasSubstr(kGpu));
  EXPECT_THAT(MessageOf(got, "nvme_not_found"), HasSubstr(kNvme));
  EXPECT_THAT(MessageOf(got, "fabric_vf_not_found"), HasSubstr(kVf));
}

TEST(SlotRulesTest, NullReportStillChecksHolders) {
  ApprovalContext ctx;
  auto thief = OtherHolder();
  thief.set_nvme_by_id(kNvme);
  thief.set_fabric_vf_pci_address(kVf);
  ctx.holders.push_back(thief);
  EXPECT_THAT(Reasons(ValidateCandidate(ValidCandidate(), ctx)),
              UnorderedElementsAre("gpu_not_found", "nvme_not_found", "nvme_in_use",
                                   "fabric_vf_not_found", "fabric_vf_duplicate"));
}

// --- DetectDrift -----------------------------------------------------------------------------

TEST(SlotRulesTest, NoDrift) { EXPECT_THAT(DetectDrift(ApprovedSlot(), ValidReport()), IsEmpty()); }

TEST(SlotRulesTest, DriftGpuMissing) {
  auto report = ValidReport();
  report.mutable_gpus()->DeleteSubrange(0, 1);
  const auto got = DetectDrift(ApprovedSlot(), report);
  ASSERT_THAT(Kinds(got), ElementsAre("gpu_missing"));
  EXPECT_EQ(got[0].slot_key(), kSlotKey);
  EXPECT_THAT(got[0].detail(), HasSubstr(kGpu));
  EXPECT_FALSE(got[0].has_detected_at());
}

TEST(SlotRulesTest, DriftNvmeMissing) {
  auto report = ValidReport();
  report.mutable_nvme()->DeleteSubrange(0, 1);
  const auto got = DetectDrift(ApprovedSlot(), report);
  ASSERT_THAT(Kinds(got), ElementsAre("nvme_missing"));
  EXPECT_EQ(got[0].slot_key(), kSlotKey);
  EXPECT_THAT(got[0].detail(), HasSubstr(kNvme));
}

TEST(SlotRulesTest, DriftNvmeMounted) {
  auto report = ValidReport();
  Nvme(report, kNvme)->add_mountpoints("/mnt/oops");
  const auto got = DetectDrift(ApprovedSlot(), report);
  ASSERT_THAT(Kinds(got), ElementsAre("nvme_mounted"));
  EXPECT_THAT(got[0].detail(), HasSubstr("/mnt/oops"));
}

TEST(SlotRulesTest, DriftNvmeChildPartitionMounted) {
  auto report = ValidReport();
  auto* part = Nvme(report, kNvme)->add_partitions();
  part->set_kernel_name("nvme0n1p1");
  part->add_mountpoints("/share2");
  const auto got = DetectDrift(ApprovedSlot(), report);
  ASSERT_THAT(Kinds(got), ElementsAre("nvme_mounted"));
  EXPECT_THAT(got[0].detail(), HasSubstr("nvme0n1p1"));
  EXPECT_THAT(got[0].detail(), HasSubstr("/share2"));
}

TEST(SlotRulesTest, DriftFabricVfMissing) {
  auto report = ValidReport();
  report.mutable_fabric(0)->clear_vf_pci_addresses();
  const auto got = DetectDrift(ApprovedSlot(), report);
  ASSERT_THAT(Kinds(got), ElementsAre("fabric_vf_missing"));
  EXPECT_THAT(got[0].detail(), HasSubstr(kVf));
}

TEST(SlotRulesTest, NoFabricDriftWithoutVf) {
  auto slot = ApprovedSlot();
  slot.clear_fabric_vf_pci_address();
  auto report = ValidReport();
  report.clear_fabric();
  EXPECT_THAT(DetectDrift(slot, report), IsEmpty());
}

TEST(SlotRulesTest, DriftOfEverythingAtOnce) {
  v1::TopologyReport empty;
  EXPECT_THAT(Kinds(DetectDrift(ApprovedSlot(), empty)),
              ElementsAre("gpu_missing", "nvme_missing", "fabric_vf_missing"));
}

// --- SkuForDevice ----------------------------------------------------------------------------

TEST(SlotRulesTest, SkuForKnownDevices) {
  EXPECT_EQ(SkuForDevice("0x2335"), "h200-sxm");
  EXPECT_EQ(SkuForDevice("0x2330"), "h100-sxm");
  EXPECT_EQ(SkuForDevice("2335"), "h200-sxm");
  EXPECT_EQ(SkuForDevice("0X2330"), "h100-sxm");
}

TEST(SlotRulesTest, SkuForUnknownDevices) {
  EXPECT_EQ(SkuForDevice("0x26B9"), "nvidia-26b9");
  EXPECT_EQ(SkuForDevice("20B5"), "nvidia-20b5");
  EXPECT_EQ(SkuForDevice(""), "unknown");
  EXPECT_EQ(SkuForDevice("0x"), "unknown");
  EXPECT_THAT(SkuForDevice("0x2336"), Not(HasSubstr("0x")));
}

}  // namespace
}  // namespace gpuaas::inventory
