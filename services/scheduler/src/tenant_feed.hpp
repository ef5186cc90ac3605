#pragma once
// The tenant event feed: each allocation event of GPUAAS_EVT_SCHEDULER again, unchanged, on its
// tenant's subject gpuaas.v1.tenant.<tenant>.evt.scheduler.allocation.<state> (stream
// GPUAAS_TENANT_FEED), so a tenant gateway follows its tenants' allocations with pull consumers
// filtered per tenant instead of polling, and never reads another tenant's events (the platform
// stream has every tenant's). The durable scheduler-tenant-feed copies them in stream order; the
// copy keeps the event's Nats-Msg-Id (its event id), so a copy made again after a crash is
// dropped by the feed stream's duplicate window.
#include <string>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/runtime.hpp"

namespace gpuaas::scheduler {

inline constexpr const char* kTenantFeedConsumer = "scheduler-tenant-feed";

// gpuaas.v1.tenant.<tenant>.evt.scheduler.allocation.<state> for an event published on
// `subject` (gpuaas.v1.evt.scheduler.allocation.<state>).
std::string TenantFeedSubject(const std::string& tenant, const std::string& subject);

// Copies one delivered allocation event to its tenant's feed subject: acked once the feed
// stream has it, retried while it cannot be published, dead-lettered when it is no allocation
// event (it never could be copied).
messaging::HandlerResult FeedOne(messaging::Connection& conn, const messaging::Delivery& d);

// Declares GPUAAS_TENANT_FEED and starts the durable scheduler-tenant-feed.
Result<void> StartTenantFeed(runtime::Service& svc);

}  // namespace gpuaas::scheduler
