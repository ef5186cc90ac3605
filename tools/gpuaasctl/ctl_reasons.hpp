#pragma once
// gpuaasctl's own reasons: the errors the CLI makes itself (usage errors and its direct JetStream
// reads), printed like a service's Status. Reasons from libs/common (gpuaas/common/reasons.hpp)
// and from the services pass through unchanged. README "Reasons" lists them.
#include "gpuaas/common/result.hpp"

namespace gpuaas::ctl::reason {

// Usage errors (exit 2).
inline constexpr Reason kExposeInvalid{"expose_invalid"};   // INVALID_ARGUMENT: bad --expose
inline constexpr Reason kSinceInvalid{"since_invalid"};     // INVALID_ARGUMENT: bad --since
inline constexpr Reason kSlotIdInvalid{"slot_id_invalid"};  // INVALID_ARGUMENT: not node/slot_key
inline constexpr Reason kInvalidTtl{"invalid_ttl"};  // INVALID_ARGUMENT: --ttl not <n>s|<n>m|<n>h
inline constexpr Reason kIssuerRole{"issuer_role"};  // INVALID_ARGUMENT: a tenant token only
inline constexpr Reason kInvalidLabel{"invalid_label"};  // INVALID_ARGUMENT: label not key=value
inline constexpr Reason kConfirmRequired{"confirm_required"};  // INVALID_ARGUMENT: needs --yes
inline constexpr Reason kTokenFile{"token_file"};  // INVALID_ARGUMENT: --token-file unreadable
inline constexpr Reason kDeadlineInvalid{"deadline_invalid"};  // INVALID_ARGUMENT: bad --deadline
inline constexpr Reason kTimeInvalid{"time_invalid"};          // INVALID_ARGUMENT: bad --from/--to

// Errors of the commands that read JetStream or work locally (exit 1).
inline constexpr Reason kNoEvents{"no_events"};  // NOT_FOUND: audit found no events
inline constexpr Reason kMalformedJsReply{"malformed_js_reply"};  // INTERNAL: reply not JSON
inline constexpr Reason kStreamInfoFailed{"stream_info_failed"};  // UNAVAILABLE: stream info error
inline constexpr Reason kMessageGetFailed{"message_get_failed"};  // UNAVAILABLE: message get error
inline constexpr Reason kNatsReloadFailed{"nats_reload_failed"};  // UNAVAILABLE: cannot signal

}  // namespace gpuaas::ctl::reason
