#pragma once
// Every reason ingress answers (Status.reason) or records (Exposure.reason of a failed or drifted
// exposure): one constant a line, the text being the wire contract (README "Reasons"). Reasons
// of libs/common (db_unavailable, unknown_version, ...) are in gpuaas/common/reasons.hpp; a
// refusal reason a node gives (its own registry's) is recorded as the node said it.
#include <optional>
#include <string_view>

#include "gpuaas/common/result.hpp"

namespace gpuaas::ingress::reason {

// One entry a line, as a test parses them.
// clang-format off
// ---- Answers ----
inline constexpr Reason kInvalidPool{"invalid_pool"};  // INVALID_ARGUMENT: pool fields, each named
inline constexpr Reason kInvalidEndpoint{"invalid_endpoint"};  // INVALID_ARGUMENT: name/protocol/port
inline constexpr Reason kInvalidNodeId{"invalid_node_id"};  // INVALID_ARGUMENT: node_id not a node id
inline constexpr Reason kPoolNotFound{"pool_not_found"};  // NOT_FOUND: no pool of that name
inline constexpr Reason kAllocationNotFound{"allocation_not_found"};  // NOT_FOUND: never seen (or another tenant's)
inline constexpr Reason kExposureNotFound{"exposure_not_found"};  // NOT_FOUND: no such exposure (or another tenant's)
inline constexpr Reason kPoolKindNotSupported{"pool_kind_not_supported"};  // FAILED_PRECONDITION: dns_name/overlay pools
inline constexpr Reason kPoolOverlap{"pool_overlap"};  // FAILED_PRECONDITION: another pool hands out the address
inline constexpr Reason kPoolInUse{"pool_in_use"};  // FAILED_PRECONDITION: the change drops or moves a held endpoint
inline constexpr Reason kExposureNotForBaremetal{"exposure_not_for_baremetal"};  // FAILED_PRECONDITION: slice VMs only
inline constexpr Reason kAllocationNotLive{"allocation_not_live"};  // FAILED_PRECONDITION: not reserved/provisioning/active
inline constexpr Reason kEndpointExists{"endpoint_exists"};  // FAILED_PRECONDITION: same name or port, other endpoint
inline constexpr Reason kTooManyEndpoints{"too_many_endpoints"};  // FAILED_PRECONDITION: max_endpoints_per_allocation
inline constexpr Reason kNoPool{"no_pool"};  // RESOURCE_EXHAUSTED: no pool serves the node (not retryable)
inline constexpr Reason kPoolExhausted{"pool_exhausted"};  // RESOURCE_EXHAUSTED: every endpoint taken (retryable)

// ---- Recorded on exposures (Exposure.reason) and drift events ----
inline constexpr Reason kRefusedByNode{"refused_by_node"};  // exposure FAILED: node refused, no reason given
inline constexpr Reason kRuleMissing{"rule_missing"};  // exposure DRIFT: node re-applied a missing rule
inline constexpr Reason kRuleStale{"rule_stale"};  // exposure DRIFT: node replaced a rule that differed
inline constexpr Reason kRuleForeign{"rule_foreign"};  // node drift: node removed a rule of no mapping
inline constexpr Reason kTableMissing{"table_missing"};  // exposure DRIFT: node re-created its table
// clang-format on

// The drift kind a node reported, when it is one the contract names (ExposureDrift.kind).
inline std::optional<Reason> DriftKind(std::string_view kind) {
  for (Reason r : {kRuleMissing, kRuleStale, kRuleForeign, kTableMissing}) {
    if (r.text() == kind) return r;
  }
  return std::nullopt;
}

}  // namespace gpuaas::ingress::reason
