#pragma once
// Every reason the scheduler answers (Status.reason of its request subjects), records (an
// allocation's failure code, a timeline row's code) or names in a refusal (an app's
// incompatibility reasons): one constant a line, the text being the wire contract (README
// "Reasons"). Reasons of libs/common (db_unavailable, page_size_invalid, ...) are in
// gpuaas/common/reasons.hpp; a reason a node or ingress gives (a task's error, an exposure's
// reason) is recorded as they said it.
#include "gpuaas/common/result.hpp"

namespace gpuaas::scheduler::reason {

// One entry a line, as a test parses them.
// clang-format off
// ---- allocation.create / get / list / release / force_release ----
inline constexpr Reason kInvalidAllocationRequest{"invalid_allocation_request"};  // INVALID_ARGUMENT: every bad field in the details
inline constexpr Reason kTenantNotAllowed{"tenant_not_allowed"};  // PERMISSION_DENIED: a tenant principal asked for another tenant
inline constexpr Reason kRegionDisabled{"region_disabled"};  // FAILED_PRECONDITION: the region's slots are all in a disabled region
inline constexpr Reason kImageNotForBaremetal{"image_not_for_baremetal"};  // INVALID_ARGUMENT: baremetal boots no VM image
inline constexpr Reason kExposureNotForBaremetal{"exposure_not_for_baremetal"};  // INVALID_ARGUMENT: `expose` is for slices
inline constexpr Reason kNoPlacement{"no_placement"};  // RESOURCE_EXHAUSTED: nothing fits, counts in the details (retryable)
inline constexpr Reason kPlacementContended{"placement_contended"};  // UNAVAILABLE: every choice stayed held by others (retryable)
inline constexpr Reason kInvalidAllocationId{"invalid_allocation_id"};  // INVALID_ARGUMENT: allocation ids are UUIDs
inline constexpr Reason kAllocationNotFound{"allocation_not_found"};  // NOT_FOUND: none (or another tenant's)
inline constexpr Reason kInvalidPageToken{"invalid_page_token"};  // INVALID_ARGUMENT: page_token not from a list reply
inline constexpr Reason kStateInvalid{"state_invalid"};  // INVALID_ARGUMENT: an allocation state the enum lacks
inline constexpr Reason kNetworkModeInvalid{"network_mode_invalid"};  // INVALID_ARGUMENT: a network mode the enum lacks
inline constexpr Reason kForceMoved{"force_moved"};  // PERMISSION_DENIED: force is allocation.force_release (operator)
inline constexpr Reason kReasonRequired{"reason_required"};  // INVALID_ARGUMENT: a force-release must say why
inline constexpr Reason kIllegalTransition{"illegal_transition"};  // FAILED_PRECONDITION: the state cannot take the event
// ---- catalog ----
inline constexpr Reason kInvalidCatalog{"invalid_catalog"};  // INVALID_ARGUMENT: catalog YAML problems, each in the details
inline constexpr Reason kCatalogUnreadable{"catalog_unreadable"};  // INVALID_ARGUMENT: scheduler.catalog_file cannot be read
inline constexpr Reason kUnknownSku{"unknown_sku"};  // INVALID_ARGUMENT: no SKU of that name (details: offered)
inline constexpr Reason kUnknownImage{"unknown_image"};  // INVALID_ARGUMENT: no image of that name (details: offered)
inline constexpr Reason kShapeNotOffered{"shape_not_offered"};  // INVALID_ARGUMENT: gpu_partition/gpu_shared are not sold
inline constexpr Reason kGpuCountNotAllowed{"gpu_count_not_allowed"};  // INVALID_ARGUMENT: not a count the SKU allows
inline constexpr Reason kFabricOnlyNotForSlices{"fabric_only_not_for_slices"};  // INVALID_ARGUMENT: slices need private-nat
inline constexpr Reason kNetworkModeNotAllowed{"network_mode_not_allowed"};  // INVALID_ARGUMENT: not a mode the SKU offers
// ---- apps ----
inline constexpr Reason kUnknownApp{"unknown_app"};  // NOT_FOUND: no app of that name (details: offered)
inline constexpr Reason kAppNotCompatible{"app_not_compatible"};  // FAILED_PRECONDITION: every reason in the details
inline constexpr Reason kInvalidOrder{"invalid_order"};  // INVALID_ARGUMENT: bad order fields, each named
inline constexpr Reason kShapeMismatch{"shape_mismatch"};  // INVALID_ARGUMENT: the order's shape is not its SKU's
inline constexpr Reason kAppRequired{"app_required"};  // INVALID_ARGUMENT: app.compatibility names no app
inline constexpr Reason kTargetRequired{"target_required"};  // INVALID_ARGUMENT: neither allocation_id nor order
// ---- app incompatibilities (AppIncompatibility.reason, app_not_compatible's detail keys) ----
inline constexpr Reason kMultiNodeRequiresBaremetal{"multi_node_requires_baremetal"};  // a cluster profile on a slice
inline constexpr Reason kShapeNotSupported{"shape_not_supported"};  // the app does not list the target's shape
inline constexpr Reason kGpuCountBelowMinimum{"gpu_count_below_minimum"};  // fewer GPUs per node than the app needs
inline constexpr Reason kGpuCountAboveMaximum{"gpu_count_above_maximum"};  // more GPUs per node than the app uses
inline constexpr Reason kNodeCountBelowMinimum{"node_count_below_minimum"};  // a cluster profile on too few nodes
inline constexpr Reason kMultiNodeNotSupported{"multi_node_not_supported"};  // a single-node app on several nodes
inline constexpr Reason kAllocationNotUsable{"allocation_not_usable"};  // the allocation is releasing/released/failed
// ---- projections ----
inline constexpr Reason kConfirmRequired{"confirm_required"};  // INVALID_ARGUMENT: projection.rebuild needs confirm = true
inline constexpr Reason kRebuildIncomplete{"rebuild_incomplete"};  // DEADLINE_EXCEEDED: the replay goes on (retryable)
inline constexpr Reason kMalformedEvent{"malformed_event"};  // INVALID_ARGUMENT: event data not the expected message (dead-lettered)
inline constexpr Reason kPlacementCacheUnavailable{"placement_cache_unavailable"};  // UNAVAILABLE: the index's first load failed (start)
// ---- node.holders ----
inline constexpr Reason kInvalidNodeHoldersRequest{"invalid_node_holders_request"};  // INVALID_ARGUMENT: node_id empty, wait_ms outside 0..10000
inline constexpr Reason kNodeNotProjected{"node_not_projected"};  // NOT_FOUND: the projection does not have the node
inline constexpr Reason kProjectionBehind{"projection_behind"};  // UNAVAILABLE: the node's min_generation not projected within wait_ms (retryable)
// ---- saga ----
inline constexpr Reason kUnexpectedTask{"unexpected_task"};  // INTERNAL: the lifecycle table names a task the saga cannot send
inline constexpr Reason kTaskTypeInvalid{"task_type_invalid"};  // INVALID_ARGUMENT: a result for a task type the scheduler never sends
// ---- failure and timeline codes (Allocation.failure.code, TimelineEntry.code) ----
inline constexpr Reason kForceReleased{"force_released"};  // an operator force-released the allocation
inline constexpr Reason kNodeUnresponsive{"node_unresponsive"};  // a node task passed its deadline unanswered
inline constexpr Reason kCleanupProofIncomplete{"cleanup_proof_incomplete"};  // a cleanup result without a clean proof per slot
inline constexpr Reason kTaskFailed{"task_failed"};  // a task failed and its node gave no reason
inline constexpr Reason kTaskRejected{"task_rejected"};  // a task was rejected and its node gave no reason
inline constexpr Reason kTaskTimedOut{"task_timed_out"};  // a task timed out with no reason recorded
inline constexpr Reason kExposureFailed{"exposure_failed"};  // ingress failed an endpoint and gave no reason
// clang-format on

}  // namespace gpuaas::scheduler::reason
