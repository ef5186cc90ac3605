#pragma once
// Pure slot rules of the inventory (no I/O): the approval validator that turns an advisory
// candidate into an approved slot only when it is a complete, safe bundle, drift detection of an
// approved slot against newer evidence, and the SKU a GPU is sold as. Every rejection carries a
// machine-readable reason; every rule has its own unit test (tests/slot_rules_test.cpp).
#include <set>
#include <string>
#include <vector>

#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::inventory {

// Rejection reasons (SlotRejection.reason).
namespace reason {
inline constexpr const char* kGpuPciAddressMissing = "gpu_pci_address_missing";
inline constexpr const char* kGpuNotFound = "gpu_not_found";
inline constexpr const char* kNvmeByIdMissing = "nvme_by_id_missing";
inline constexpr const char* kNvmeNotFound = "nvme_not_found";
inline constexpr const char* kNvmeOsDisk = "nvme_os_disk";
inline constexpr const char* kNvmeMounted = "nvme_mounted";
inline constexpr const char* kNvmeChildPartitionMounted = "nvme_child_partition_mounted";
inline constexpr const char* kNvmeUnexpectedFilesystem = "nvme_unexpected_filesystem";
inline constexpr const char* kNvmeInUse = "nvme_in_use";
inline constexpr const char* kFabricNotPerSlotVf = "fabric_not_per_slot_vf";
inline constexpr const char* kFabricVfMissing = "fabric_vf_missing";
inline constexpr const char* kFabricVfNotFound = "fabric_vf_not_found";
inline constexpr const char* kFabricVfDuplicate = "fabric_vf_duplicate";
inline constexpr const char* kAddressReservationFailed = "address_reservation_failed";
inline constexpr const char* kNotInSnapshot = "not_in_snapshot";
}  // namespace reason

struct ApprovalContext {
  // Evidence of the snapshot the candidate comes from.
  const v1::TopologyReport* report = nullptr;
  // The node's other approved (admin_state "available") slots, and those already approved
  // earlier in the same batch: their NVMe and fabric VF must not be taken twice.
  std::vector<v1::Slot> holders;
  // NVMe by-id paths with a recorded wipe proof (an unexpected signature is then accepted).
  std::set<std::string> wiped_nvme;
};

// All local rule violations of one candidate (empty: the bundle is complete and safe). Address
// reservation (MAC/IP from ipam) is checked by the caller after these pass.
std::vector<v1::SlotRejection> ValidateCandidate(const v1::CandidateSlot& c,
                                                 const ApprovalContext& ctx);

// Drift of an approved slot against a newer report: the GPU, its NVMe or its fabric VF vanished,
// or the NVMe became mounted (the disk or a child partition). Empty: no drift.
std::vector<v1::DriftRecord> DetectDrift(const v1::Slot& slot, const v1::TopologyReport& report);

// "0x2335" -> "h200-sxm", "0x2330" -> "h100-sxm", otherwise "nvidia-<id without 0x>".
std::string SkuForDevice(const std::string& device_id);

}  // namespace gpuaas::inventory
