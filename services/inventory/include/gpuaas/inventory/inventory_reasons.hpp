#pragma once
// Every reason inventory answers or records, one constant a line (result.hpp says why): the
// Status reasons of its requests and consumers, the rejection reasons of slot approval
// (SlotRejection.reason), the drift kinds it writes on slots (DriftRecord.kind) and the reason it
// gives ipam when it releases an address. The texts are the wire contract: never change one.
// Public (under include/) because the pure slot rules (slot_rules.hpp) and their fuzz target
// name the rejection reasons. Reasons inventory passes on from libs/common (db_unavailable,
// invalid_page_size, unknown_version, ...) are in gpuaas/common/reasons.hpp.
#include "gpuaas/common/result.hpp"

namespace gpuaas::inventory::reason {

// ---- Status reasons of inventory's requests ----
inline constexpr Reason kInvalidNodeId{"invalid_node_id"};  // INVALID_ARGUMENT: not a DNS label
inline constexpr Reason kNodeNotFound{"node_not_found"};    // NOT_FOUND: unknown node
inline constexpr Reason kInvalidNodeRegistration{"invalid_node_registration"};  // INVALID_ARGUMENT
inline constexpr Reason kInvalidSlotKey{"invalid_slot_key"};  // INVALID_ARGUMENT: slot_key empty
inline constexpr Reason kSlotNotFound{"slot_not_found"};  // NOT_FOUND: the node has no such slot
inline constexpr Reason kInvalidWipeProof{"invalid_wipe_proof"};  // INVALID_ARGUMENT: bad fields
inline constexpr Reason kInvalidRegion{"invalid_region"};  // INVALID_ARGUMENT: not a DNS label
inline constexpr Reason kInvalidSnapshotVersion{"invalid_snapshot_version"};  // INVALID_ARGUMENT
inline constexpr Reason kSnapshotNotFound{"snapshot_not_found"};      // NOT_FOUND: no such version
inline constexpr Reason kNoTopologySnapshot{"no_topology_snapshot"};  // FAILED_PRECONDITION
inline constexpr Reason kCorruptSnapshot{"corrupt_snapshot"};  // INTERNAL: stored report unreadable
inline constexpr Reason kCorruptSlot{"corrupt_slot"};          // INTERNAL: stored slot unreadable
inline constexpr Reason kCorruptDesiredSet{"corrupt_desired_set"};  // INTERNAL: set unreadable
// FAILED_PRECONDITION: the node's admin state cannot take the request (node_lifecycle.hpp;
// details: state, event).
inline constexpr Reason kIllegalTransition{"illegal_transition"};
// FAILED_PRECONDITION: a mode change of the node is still open (details: state, event).
inline constexpr Reason kModeChangeInProgress{"mode_change_in_progress"};
// FAILED_PRECONDITION: a decommission of a node that still holds live claims.
inline constexpr Reason kNodeHasLiveClaims{"node_has_live_claims"};
// INVALID_ARGUMENT: a host operation without a reason, or with a bad deadline (details: fields).
inline constexpr Reason kInvalidAdminRequest{"invalid_admin_request"};
// FAILED_PRECONDITION: a registration of a decommissioned node (final).
inline constexpr Reason kNodeDecommissioned{"node_decommissioned"};
// UNAVAILABLE (retryable): the drain is recorded, but the scheduler has not confirmed it yet.
inline constexpr Reason kDrainNotConfirmed{"drain_not_confirmed"};

// ---- Consumers (dead-lettered: such an event can never succeed) ----
inline constexpr Reason kMalformedEvent{"malformed_event"};  // INVALID_ARGUMENT: bad event data

// ---- Slot rejections (SlotRejection.reason; the slot is stored disabled) ----
inline constexpr Reason kGpuPciAddressMissing{"gpu_pci_address_missing"};  // rejection: no GPU
inline constexpr Reason kGpuNotFound{"gpu_not_found"};           // rejection: GPU not in report
inline constexpr Reason kNvmeByIdMissing{"nvme_by_id_missing"};  // rejection: no NVMe by-id
inline constexpr Reason kNvmeNotFound{"nvme_not_found"};         // rejection: NVMe not in report
inline constexpr Reason kNvmeOsDisk{"nvme_os_disk"};             // rejection: NVMe holds the OS
inline constexpr Reason kNvmeMounted{"nvme_mounted"};  // rejection and drift: NVMe mounted
inline constexpr Reason kNvmeChildPartitionMounted{"nvme_child_partition_mounted"};  // rejection
inline constexpr Reason kNvmeUnexpectedFilesystem{"nvme_unexpected_filesystem"};     // rejection
inline constexpr Reason kNvmeInUse{"nvme_in_use"};  // rejection: another slot has the NVMe
inline constexpr Reason kFabricNotPerSlotVf{"fabric_not_per_slot_vf"};  // rejection: no own VF
inline constexpr Reason kFabricVfMissing{"fabric_vf_missing"};      // rejection and drift: no VF
inline constexpr Reason kFabricVfNotFound{"fabric_vf_not_found"};   // rejection: VF not in report
inline constexpr Reason kFabricVfDuplicate{"fabric_vf_duplicate"};  // rejection: VF taken
inline constexpr Reason kAddressReservationFailed{"address_reservation_failed"};  // rejection
inline constexpr Reason kNotInSnapshot{"not_in_snapshot"};  // rejection: key not a candidate

// ---- Drift kinds inventory writes on slots (DriftRecord.kind) ----
inline constexpr Reason kGpuMissing{"gpu_missing"};    // drift: the GPU left the report
inline constexpr Reason kNvmeMissing{"nvme_missing"};  // drift: the NVMe left the report
inline constexpr Reason kNodeBlocker{"node_blocker"};  // drift (node.show): one per node blocker
inline constexpr Reason kVfioBindingLost{"vfio_binding_lost"};  // drift: GPU/VF not on vfio-pci
// IPAM drift kinds, recorded as ipam reports them (ipam.proto IpamDrift.kind).
inline constexpr Reason kIpamLeaseMismatch{"ipam_lease_mismatch"};      // drift: leased IP differs
inline constexpr Reason kIpamLeaseMissing{"ipam_lease_missing"};        // drift: no lease in time
inline constexpr Reason kIpamLeaseUnexpected{"ipam_lease_unexpected"};  // drift: unreserved lease
inline constexpr Reason kIpamVnicDrift{"ipam_vnic_drift"};              // drift: agent's vNIC drift

// ---- Reasons inventory gives ipam ----
inline constexpr Reason kApprovalRejected{"approval_rejected"};  // release: slot not approved

}  // namespace gpuaas::inventory::reason
