#include "tenant_feed.hpp"

#include <string_view>

#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::scheduler {

namespace {
constexpr std::string_view kVersionPrefix = "gpuaas.v1.";
constexpr const char* kAllocationEvents = "gpuaas.v1.evt.scheduler.allocation.>";
}  // namespace

std::string TenantFeedSubject(const std::string& tenant, const std::string& subject) {
  return std::string(kVersionPrefix) + "tenant." + tenant + "." +
         subject.substr(kVersionPrefix.size());
}

messaging::HandlerResult FeedOne(messaging::Connection& conn, const messaging::Delivery& d) {
  v1::Event ev;
  if (!ev.ParseFromString(d.msg.data)) {
    return messaging::HandlerResult::Reject("not a gpuaas.v1.Event", messaging::kRejectUndecodable);
  }
  v1::AllocationSnapshot snap;
  if (d.msg.subject.rfind(kVersionPrefix, 0) != 0 || !ev.data().UnpackTo(&snap) ||
      snap.allocation().tenant().empty() || ev.id().empty()) {
    return messaging::HandlerResult::Reject("not an allocation event with a tenant and an id",
                                            messaging::kRejectInvalid);
  }
  messaging::Headers h;
  if (auto tp = d.msg.Header(messaging::kHeaderTraceparent); !tp.empty()) {
    h[messaging::kHeaderTraceparent] = tp;
  }
  auto ack = messaging::JsPublish(
      conn, TenantFeedSubject(snap.allocation().tenant(), d.msg.subject), d.msg.data, ev.id(), h);
  if (!ack.ok()) return messaging::HandlerResult::Retry(ack.error().ToString());
  return messaging::HandlerResult::Ack();
}

Result<void> StartTenantFeed(runtime::Service& svc) {
  messaging::ConsumerSpec spec;
  spec.stream = messaging::SchedulerEventsStream().name;
  spec.durable = kTenantFeedConsumer;
  spec.filter_subject = kAllocationEvents;
  auto conn = svc.nats();
  auto started =
      svc.StartConsumer(spec, [conn](const messaging::Delivery& d) { return FeedOne(*conn, d); });
  if (!started.ok()) return started.error();
  return Ok();
}

}  // namespace gpuaas::scheduler
