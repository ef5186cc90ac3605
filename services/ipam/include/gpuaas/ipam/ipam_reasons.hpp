#pragma once
// Every reason ipam answers (Status.reason) or records (drift kinds, reservation event reasons):
// the wire texts, one constant each. Errors are made from these and decisions compare with them;
// libs/common's own reasons (documents, rpc, store) are in gpuaas/common/reasons.hpp.
#include "gpuaas/common/result.hpp"

namespace gpuaas::ipam::reason {

// One entry a line, as a test parses them.
// clang-format off
// ---- Request fields ----
inline constexpr Reason kInvalidReservationRequest{"invalid_reservation_request"};  // INVALID_ARGUMENT: bad reserve node_id/slot_key/region/pool
inline constexpr Reason kInvalidReleaseRequest{"invalid_release_request"};  // INVALID_ARGUMENT: bad release node_id/slot_key
inline constexpr Reason kInvalidReprovisionRequest{"invalid_reprovision_request"};  // INVALID_ARGUMENT: bad reprovision node_id/slot_key
inline constexpr Reason kInvalidNodeId{"invalid_node_id"};  // INVALID_ARGUMENT: node_id missing or not a lowercase DNS label
inline constexpr Reason kInvalidMinAge{"invalid_min_age"};  // INVALID_ARGUMENT: orphan.list min_age_seconds below 0
inline constexpr Reason kInvalidOrphanRequest{"invalid_orphan_request"};  // INVALID_ARGUMENT: orphan.remove min_age_seconds or node_id bad
inline constexpr Reason kInvalidVersion{"invalid_version"};  // INVALID_ARGUMENT: node.network.get version below 0
inline constexpr Reason kMacNotAllowed{"mac_not_allowed"};  // INVALID_ARGUMENT: reprovision named a MAC (the deprecated field)
inline constexpr Reason kInvalidConfig{"invalid_config"};  // INVALID_ARGUMENT: ipam config values wrong at start (exit 1)

// ---- Subnet rules ----
inline constexpr Reason kInvalidScope{"invalid_scope"};  // INVALID_ARGUMENT: subnet.set names no node, region+pool or region
inline constexpr Reason kInvalidCidr{"invalid_cidr"};  // INVALID_ARGUMENT: a subnet or host network is not a valid IPv4 CIDR
inline constexpr Reason kInvalidGateway{"invalid_gateway"};  // INVALID_ARGUMENT: gateway not a host address of the subnet
inline constexpr Reason kInvalidBridge{"invalid_bridge"};  // INVALID_ARGUMENT: bridge name bad, or given without a datapath
inline constexpr Reason kDatapathInvalid{"datapath_invalid"};  // INVALID_ARGUMENT: datapath not a NetworkDatapath (made by enums::InvalidValue)
inline constexpr Reason kSubnetTooSmall{"subnet_too_small"};  // INVALID_ARGUMENT: fewer slot addresses than ipam.slots_per_node
inline constexpr Reason kSubnetOverlap{"subnet_overlap"};  // INVALID_ARGUMENT: management subnet overlaps a host network in scope
inline constexpr Reason kSubnetInUse{"subnet_in_use"};  // FAILED_PRECONDITION: a reservation's IP is outside the node's new subnet

// ---- Reservations and MACs ----
inline constexpr Reason kSubnetExhausted{"subnet_exhausted"};  // RESOURCE_EXHAUSTED: no free slot address left on the node
inline constexpr Reason kMacPoolExhausted{"mac_pool_exhausted"};  // RESOURCE_EXHAUSTED: platform MAC pool 52:54:01 used up
inline constexpr Reason kMacPoolContended{"mac_pool_contended"};  // ABORTED: 64 pool MACs in a row were taken; retry
inline constexpr Reason kReservationBound{"reservation_bound"};  // FAILED_PRECONDITION: release/reprovision of a slot bound to an allocation
inline constexpr Reason kSlotNotFound{"slot_not_found"};  // NOT_FOUND: reprovision of a known slot that owns no MAC

// ---- Projection of inventory ----
inline constexpr Reason kNodeUnknown{"node_unknown"};  // FAILED_PRECONDITION (reserve) / NOT_FOUND (reprovision): inventory does not know the node
inline constexpr Reason kSlotUnknown{"slot_unknown"};  // NOT_FOUND: reprovision of a slot inventory does not know
inline constexpr Reason kInventoryProjectionLagging{"inventory_projection_lagging"};  // UNAVAILABLE: projection of inventory not caught up; retry

// ---- Consumers and stored rows ----
inline constexpr Reason kMalformedEvent{"malformed_event"};  // INVALID_ARGUMENT: consumed inventory/lease event of the wrong type or without ids
inline constexpr Reason kMalformedLeaseReport{"malformed_lease_report"};  // INVALID_ARGUMENT: lease report fields invalid (dead-lettered)
inline constexpr Reason kCorruptLease{"corrupt_lease"};  // INTERNAL: a stored lease observation is unreadable

// ---- Drift kinds (ipam_drift.kind, IpamDrift.kind) ----
inline constexpr Reason kIpamLeaseMismatch{"ipam_lease_mismatch"};  // drift: a bound slot's lease has another IP or MAC
inline constexpr Reason kIpamLeaseMissing{"ipam_lease_missing"};  // drift: primary slot without a lease past the readiness timeout
inline constexpr Reason kIpamLeaseUnexpected{"ipam_lease_unexpected"};  // drift: an unreserved MAC holds a lease
inline constexpr Reason kIpamVnicDrift{"ipam_vnic_drift"};  // drift: the agent reports a bound slot's vNIC drifted

// ---- Reservation event reasons (ReservationSnapshot.reason) ----
inline constexpr Reason kReserved{"reserved"};  // event: reservation.created
inline constexpr Reason kBound{"bound"};  // event: reservation.updated, bound to an allocation
inline constexpr Reason kUnbound{"unbound"};  // event: reservation.updated, unbound from its allocation
inline constexpr Reason kReprovisioned{"reprovisioned"};  // event: reservation.updated, MAC re-provisioned
inline constexpr Reason kReleased{"released"};  // event: reservation.released when the request gives no reason
// clang-format on

}  // namespace gpuaas::ipam::reason
