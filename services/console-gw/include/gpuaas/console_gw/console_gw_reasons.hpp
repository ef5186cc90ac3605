#pragma once
// Every reason console-gw answers or records: Status.reason of the session subjects and of the
// operator page's API, the refusals of console connects (connect.refused `failure`, the
// WebSocket's close reason), and the end reasons of console sessions (`end_reason`, the events'
// `failure`). The texts are the wire contract: never change one. End reasons are also the
// closed set `EndReason` (console_domain.hpp), whose table names these constants.
// Reasons passed on from others (the scheduler's allocation_not_found, the node-agent's
// domain_not_managed, libs/common's db_unavailable, ...) are theirs, not listed here.
#include "gpuaas/common/result.hpp"

namespace gpuaas::console_gw::reason {

// One entry a line, as a test parses them.
// clang-format off
// ---- session.create / session.revoke ----
inline constexpr Reason kReasonRequired{"reason_required"};  // INVALID_ARGUMENT: create without a reason (why the console is opened)
inline constexpr Reason kInvalidAllocationId{"invalid_allocation_id"};  // INVALID_ARGUMENT: create's allocation_id is not a UUID
inline constexpr Reason kInvalidRequest{"invalid_request"};  // INVALID_ARGUMENT: create's other fields are invalid (reason too long, negative max_duration_s); details name them
inline constexpr Reason kAllocationNotLive{"allocation_not_live"};  // FAILED_PRECONDITION: the allocation is not provisioning/active on a node: no VM to show {state}
inline constexpr Reason kNoConsole{"no_console"};  // FAILED_PRECONDITION: a bare-metal allocation has no VM console (use the node's BMC)
inline constexpr Reason kInvalidSessionId{"invalid_session_id"};  // INVALID_ARGUMENT: revoke's session_id is not a UUID
inline constexpr Reason kSessionNotFound{"session_not_found"};  // NOT_FOUND: revoke names no session
inline constexpr Reason kRandomFailed{"random_failed"};  // INTERNAL: OpenSSL gave no random bytes for a grant

// ---- token.revoke ----
inline constexpr Reason kInvalidRevocation{"invalid_revocation"};  // INVALID_ARGUMENT: not exactly one of jti (a UUID) and subject, or a reason over 256 characters; details name the fields

// ---- the operator page's HTTP API and the gateway's start ----
inline constexpr Reason kRoleNotAllowed{"role_not_allowed"};  // PERMISSION_DENIED: the login token's roles do not include operator
inline constexpr Reason kSubjectNotAllowed{"subject_not_allowed"};  // NOT_FOUND: /api/call/ of a subject not marked via: [console-gw]
inline constexpr Reason kMalformedReply{"malformed_reply"};  // INTERNAL: a forwarded call's reply does not parse as its result type
inline constexpr Reason kCrossOrigin{"cross_origin"};  // PERMISSION_DENIED: a POST or console upgrade from an Origin not allowed (audited for upgrades)
inline constexpr Reason kMalformedJson{"malformed_json"};  // INVALID_ARGUMENT: /api/login's body is not JSON
inline constexpr Reason kSessionEnded{"session_ended"};  // UNAUTHENTICATED: the page session named by the cookie ended or never existed (details end_reason: logout, idle, expired, revoked, ended)
inline constexpr Reason kInvalidPageSessionId{"invalid_page_session_id"};  // INVALID_ARGUMENT: login.end's session_id is not a UUID
inline constexpr Reason kPageSessionNotFound{"page_session_not_found"};  // NOT_FOUND: login.end names no page session
// ---- page session ends (page_sessions.end_reason: PageEnd, console_domain.hpp; and kRevoked below: its token was revoked) ----
inline constexpr Reason kPageLogout{"logout"};  // the operator logged out
inline constexpr Reason kPageIdle{"idle"};  // no page call for console.page_idle_s
inline constexpr Reason kPageExpired{"expired"};  // its token expired
inline constexpr Reason kPageEnded{"ended"};  // an operator ended it (console.login.end)
inline constexpr Reason kNotLoggedIn{"not_logged_in"};  // UNAUTHENTICATED: /api/call/ without the login cookie
inline constexpr Reason kNoSuchApi{"no_such_api"};  // NOT_FOUND: no API at that /api/ path and method
inline constexpr Reason kInvalidHost{"invalid_host"};  // INVALID_ARGUMENT: console.http_host is not an IP literal (start fails)
inline constexpr Reason kListenFailed{"listen_failed"};  // UNAVAILABLE: the console port cannot be bound (start fails)

// ---- end reasons (EndReason): refusals of a connect, closed 1008 ----
inline constexpr Reason kGrantUnknown{"grant_unknown"};  // PERMISSION_DENIED: the grant matches no session, or the upgrade's path does not parse
inline constexpr Reason kGrantUsed{"grant_used"};  // PERMISSION_DENIED: the grant was used already (single use)
inline constexpr Reason kGrantExpired{"grant_expired"};  // PERMISSION_DENIED: the grant was not used within its 60 s; also an expired session's end_reason
inline constexpr Reason kGrantRevoked{"grant_revoked"};  // PERMISSION_DENIED: the grant's session was revoked before it connected
inline constexpr Reason kWrongScope{"wrong_scope"};  // PERMISSION_DENIED: the grant was presented on another session's path (its session is failed)

// ---- end reasons (EndReason): how a session ended ----
inline constexpr Reason kClientClosed{"client_closed"};  // end_reason: disconnected, close 1000; the browser closed (or its connection broke)
inline constexpr Reason kVmClosed{"vm_closed"};  // end_reason: disconnected, close 1000; the VM's console socket closed
inline constexpr Reason kMaxDuration{"max_duration"};  // end_reason: disconnected, close 1000; the session reached its max_duration_s
inline constexpr Reason kGatewayStopping{"gateway_stopping"};  // end_reason: disconnected, close 1000; this console-gw instance is stopping
inline constexpr Reason kRevoked{"revoked"};  // end_reason: revoked, close 1008; session.revoke ended it
inline constexpr Reason kClientFlood{"client_flood"};  // end_reason: failed, close 1008; the browser sent more than 8 MiB beyond the node's credit
inline constexpr Reason kRelayLost{"relay_lost"};  // end_reason: failed, close 1011; a frame lost, reordered, malformed or beyond the credit (or an unknown close reason from the node)
inline constexpr Reason kNodeRefused{"node_refused"};  // end_reason: failed, close 1011; the node-agent refused to open the console
inline constexpr Reason kNodeUnreachable{"node_unreachable"};  // end_reason: failed, close 1011; no node-agent answered the open in time
inline constexpr Reason kAgentStopping{"agent_stopping"};  // end_reason: failed, close 1011; the node-agent is stopping
inline constexpr Reason kCreditExceeded{"credit_exceeded"};  // end_reason: failed, close 1011; the node saw console-gw exceed its credit
inline constexpr Reason kGatewayLost{"gateway_lost"};  // end_reason: failed, close 1011; connected past max_duration_s + 120 s: its gateway is gone (sweeper)
// clang-format on

}  // namespace gpuaas::console_gw::reason
