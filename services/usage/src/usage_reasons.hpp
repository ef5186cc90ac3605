#pragma once
// Every reason usage answers (Status.reason): one constant a line, the text being the wire
// contract (README "Reasons"). Reasons of libs/common (db_unavailable, ...) are in
// gpuaas/common/reasons.hpp.
#include "gpuaas/common/result.hpp"

namespace gpuaas::usage::reason {

// One entry a line, as a test parses them.
// clang-format off
inline constexpr Reason kInvalidPeriod{"invalid_period"};  // INVALID_ARGUMENT: from/to missing, from >= to, or over 366 days
inline constexpr Reason kInvalidPageToken{"invalid_page_token"};  // INVALID_ARGUMENT: a page token this ledger did not give
inline constexpr Reason kInvalidPageSize{"invalid_page_size"};  // INVALID_ARGUMENT: page_size out of range
inline constexpr Reason kInvalidFormat{"invalid_format"};  // INVALID_ARGUMENT: an export format the enum does not have
inline constexpr Reason kTenantMismatch{"tenant_mismatch"};  // PERMISSION_DENIED: a tenant asked for another tenant's usage
inline constexpr Reason kMalformedEvent{"malformed_event"};  // dead-lettered: an allocation event without a snapshot or id
// clang-format on

}  // namespace gpuaas::usage::reason
