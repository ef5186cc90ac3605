#include "gpuaas/inventory/slot_rules.hpp"

#include <algorithm>
#include <cctype>
#include <string_view>
#include <utility>

#include "gpuaas/common/enums.hpp"

namespace gpuaas::inventory {
namespace {

std::string Lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  return out;
}

// PCI addresses are compared case-insensitively: sysfs writes them lower-case, but a slot edited
// by hand may not be, and a case difference must not let one VF be sold twice.
bool SamePci(std::string_view a, std::string_view b) {
  return a.size() == b.size() &&
         std::equal(a.begin(), a.end(), b.begin(), [](unsigned char x, unsigned char y) {
           return std::tolower(x) == std::tolower(y);
         });
}

std::string Join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& item : items) {
    if (!out.empty()) {
      out += ", ";
    }
    out += item;
  }
  return out;
}

std::string Quoted(std::string_view s) { return "\"" + std::string(s) + "\""; }

const v1::GpuDevice* FindGpu(const v1::TopologyReport& report, std::string_view pci) {
  for (const auto& gpu : report.gpus()) {
    if (SamePci(gpu.pci_address(), pci)) {
      return &gpu;
    }
  }
  return nullptr;
}

const v1::NvmeDevice* FindNvme(const v1::TopologyReport& report, std::string_view by_id) {
  for (const auto& nvme : report.nvme()) {
    if (nvme.by_id_path() == by_id) {
      return &nvme;
    }
  }
  return nullptr;
}

// A VF counts as present when discovery saw it as a VF device, or a PF lists it among its VFs
// (a VF bound to vfio-pci has no RDMA device of its own, so only its PF names it).
bool VfPresent(const v1::TopologyReport& report, std::string_view vf) {
  for (const auto& dev : report.fabric()) {
    if (dev.is_vf() && SamePci(dev.pci_address(), vf)) {
      return true;
    }
    for (const auto& listed : dev.vf_pci_addresses()) {
      if (SamePci(listed, vf)) {
        return true;
      }
    }
  }
  return false;
}

std::vector<std::string> DiskMountpoints(const v1::NvmeDevice& nvme) {
  return {nvme.mountpoints().begin(), nvme.mountpoints().end()};
}

// "nvme0n1p1 at /share2": the parent-disk mount check alone misses these (seen in the lab).
std::vector<std::string> PartitionMountpoints(const v1::NvmeDevice& nvme) {
  std::vector<std::string> out;
  for (const auto& part : nvme.partitions()) {
    if (part.mountpoints().empty()) {
      continue;
    }
    std::vector<std::string> mounts(part.mountpoints().begin(), part.mountpoints().end());
    out.push_back(part.kernel_name() + " at " + Join(mounts));
  }
  return out;
}

// Every signature that says the disk holds someone's data: whole-disk filesystem, partition
// table, filesystems on partitions.
std::vector<std::string> Signatures(const v1::NvmeDevice& nvme) {
  std::vector<std::string> out;
  if (!nvme.fs_type().empty()) {
    out.push_back("filesystem " + nvme.fs_type());
  }
  if (!nvme.partition_table().empty()) {
    out.push_back("partition table " + nvme.partition_table());
  }
  for (const auto& part : nvme.partitions()) {
    if (!part.fs_type().empty()) {
      out.push_back(part.kernel_name() + " filesystem " + part.fs_type());
    }
  }
  return out;
}

class Rejections {
 public:
  void Add(Reason reason, std::string message) {
    v1::SlotRejection r;
    r.set_reason(reason.str());
    r.set_message(std::move(message));
    out_.push_back(std::move(r));
  }
  std::vector<v1::SlotRejection> Take() { return std::move(out_); }

 private:
  std::vector<v1::SlotRejection> out_;
};

constexpr std::string_view kNoReport = " (no topology report for this snapshot)";

void CheckGpu(const v1::CandidateSlot& c, const v1::TopologyReport* report, Rejections& out) {
  if (c.gpu_pci_address().empty()) {
    out.Add(reason::kGpuPciAddressMissing,
            "candidate " + Quoted(c.slot_key()) + " has no GPU PCI address");
    return;
  }
  if (report == nullptr) {
    out.Add(reason::kGpuNotFound,
            "GPU " + c.gpu_pci_address() + " not found" + std::string(kNoReport));
  } else if (FindGpu(*report, c.gpu_pci_address()) == nullptr) {
    out.Add(reason::kGpuNotFound, "GPU " + c.gpu_pci_address() +
                                      " is not in the topology report of node " +
                                      Quoted(report->node_id()));
  }
}

void CheckNvme(const v1::CandidateSlot& c, const ApprovalContext& ctx, Rejections& out) {
  const std::string& by_id = c.nvme_by_id();
  if (by_id.empty()) {
    out.Add(reason::kNvmeByIdMissing,
            "candidate " + Quoted(c.slot_key()) + " has no NVMe by-id path (no raw disk paired)");
    return;
  }
  const v1::NvmeDevice* nvme = ctx.report == nullptr ? nullptr : FindNvme(*ctx.report, by_id);
  if (ctx.report == nullptr) {
    out.Add(reason::kNvmeNotFound, "NVMe " + by_id + " not found" + std::string(kNoReport));
  } else if (nvme == nullptr) {
    out.Add(reason::kNvmeNotFound, "NVMe " + by_id + " is not in the topology report of node " +
                                       Quoted(ctx.report->node_id()));
  }
  if (nvme != nullptr) {
    if (nvme->os_disk()) {
      out.Add(reason::kNvmeOsDisk, "NVMe " + by_id + " (" + nvme->kernel_name() +
                                       ") holds the host OS (/, /boot or swap)");
    }
    if (!nvme->mountpoints().empty()) {
      out.Add(reason::kNvmeMounted,
              "NVMe " + by_id + " is mounted at " + Join(DiskMountpoints(*nvme)));
    }
    if (auto parts = PartitionMountpoints(*nvme); !parts.empty()) {
      out.Add(reason::kNvmeChildPartitionMounted,
              "NVMe " + by_id + " has mounted partitions: " + Join(parts));
    }
    // A recorded wipe proof accepts a stale signature (the wipe workflow saw and cleared it
    // after this snapshot), but never a mount: a mounted disk is in use right now.
    if (auto sigs = Signatures(*nvme); !sigs.empty() && ctx.wiped_nvme.count(by_id) == 0) {
      out.Add(reason::kNvmeUnexpectedFilesystem,
              "NVMe " + by_id + " carries " + Join(sigs) + " and has no recorded wipe proof");
    }
  }
  for (const auto& holder : ctx.holders) {
    if (holder.slot_key() != c.slot_key() && holder.nvme_by_id() == by_id) {
      out.Add(reason::kNvmeInUse,
              "NVMe " + by_id + " is already bound to slot " + Quoted(holder.slot_key()));
    }
  }
}

// Mode and VF are separate bindings and both are reported when both are wrong (the operator must
// fix both). An empty VF is rejected whatever the mode; it then suppresses not_found/duplicate,
// which would only restate that there is no VF.
void CheckFabric(const v1::CandidateSlot& c, const ApprovalContext& ctx, Rejections& out) {
  if (c.fabric_claim_mode() != v1::FABRIC_CLAIM_MODE_PER_SLOT_VF) {
    const std::string& text = enums::Text(c.fabric_claim_mode());
    const std::string mode = text.empty() ? "(empty)" : text;
    out.Add(reason::kFabricNotPerSlotVf,
            "fabric claim mode is " + Quoted(mode) +
                ", need \"per_slot_vf\" (a fabric device shared between slots can sell "
                "concurrent slices on one link)");
  }
  const std::string& vf = c.fabric_vf_pci_address();
  if (vf.empty()) {
    out.Add(reason::kFabricVfMissing,
            "candidate " + Quoted(c.slot_key()) + " has no fabric VF PCI address");
    return;
  }
  if (ctx.report == nullptr) {
    out.Add(reason::kFabricVfNotFound, "fabric VF " + vf + " not found" + std::string(kNoReport));
  } else if (!VfPresent(*ctx.report, vf)) {
    out.Add(reason::kFabricVfNotFound,
            "fabric VF " + vf +
                " is neither a VF device nor listed by a PF in the topology "
                "report of node " +
                Quoted(ctx.report->node_id()));
  }
  for (const auto& holder : ctx.holders) {
    if (holder.slot_key() != c.slot_key() && SamePci(holder.fabric_vf_pci_address(), vf)) {
      out.Add(reason::kFabricVfDuplicate,
              "fabric VF " + vf + " is already bound to slot " + Quoted(holder.slot_key()));
    }
  }
}

v1::DriftRecord Drift(const v1::Slot& slot, Reason kind, std::string detail) {
  v1::DriftRecord d;
  d.set_slot_key(slot.slot_key());
  d.set_kind(kind.str());
  d.set_detail(std::move(detail));
  return d;
}

}  // namespace

std::vector<v1::SlotRejection> ValidateCandidate(const v1::CandidateSlot& c,
                                                 const ApprovalContext& ctx) {
  Rejections out;
  CheckGpu(c, ctx.report, out);
  CheckNvme(c, ctx, out);
  CheckFabric(c, ctx, out);
  return out.Take();
}

std::vector<v1::DriftRecord> DetectDrift(const v1::Slot& slot, const v1::TopologyReport& report) {
  std::vector<v1::DriftRecord> out;
  // An empty GPU address or NVMe path on an approved slot cannot match evidence; it is reported
  // as missing so that such a row never looks healthy.
  if (slot.gpu_pci_address().empty() || FindGpu(report, slot.gpu_pci_address()) == nullptr) {
    out.push_back(Drift(slot, reason::kGpuMissing,
                        "GPU " + Quoted(slot.gpu_pci_address()) +
                            " is no longer in the topology report of node " +
                            Quoted(report.node_id())));
  }
  const v1::NvmeDevice* nvme =
      slot.nvme_by_id().empty() ? nullptr : FindNvme(report, slot.nvme_by_id());
  if (nvme == nullptr) {
    out.push_back(Drift(slot, reason::kNvmeMissing,
                        "NVMe " + Quoted(slot.nvme_by_id()) +
                            " is no longer in the topology report of node " +
                            Quoted(report.node_id())));
  } else {
    std::vector<std::string> mounts;
    if (!nvme->mountpoints().empty()) {
      mounts.push_back(nvme->kernel_name() + " at " + Join(DiskMountpoints(*nvme)));
    }
    for (auto& part : PartitionMountpoints(*nvme)) {
      mounts.push_back(std::move(part));
    }
    if (!mounts.empty()) {
      out.push_back(Drift(slot, reason::kNvmeMounted,
                          "NVMe " + slot.nvme_by_id() + " is now mounted: " + Join(mounts)));
    }
  }
  if (!slot.fabric_vf_pci_address().empty() && !VfPresent(report, slot.fabric_vf_pci_address())) {
    out.push_back(Drift(slot, reason::kFabricVfMissing,
                        "fabric VF " + slot.fabric_vf_pci_address() +
                            " is no longer in the topology report of node " +
                            Quoted(report.node_id())));
  }
  return out;
}

std::string SkuForDevice(const std::string& device_id) {
  std::string id = Lower(device_id);
  if (id.rfind("0x", 0) == 0) {
    id.erase(0, 2);
  }
  if (id.empty()) {
    return "unknown";
  }
  if (id == "2335") {
    return "h200-sxm";
  }
  if (id == "2330") {
    return "h100-sxm";
  }
  return "nvidia-" + id;
}

}  // namespace gpuaas::inventory
