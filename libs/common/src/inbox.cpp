#include "gpuaas/common/inbox.hpp"

#include "gpuaas/common/ids.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::inbox {

bool MarkProcessed(pqxx::work& tx, const std::string& consumer, const std::string& event_id) {
  auto r = tx.exec_params(
      "INSERT INTO inbox (consumer, event_id) VALUES ($1, $2) ON CONFLICT DO NOTHING", consumer,
      event_id);
  return r.affected_rows() == 1;
}

namespace {
// Codes that say "not now" rather than "never": the event is kept and retried.
bool RetryableCode(Code c) {
  return c == Code::kUnavailable || c == Code::kAborted || c == Code::kDeadlineExceeded ||
         c == Code::kResourceExhausted || c == Code::kCancelled;
}
}  // namespace

messaging::Consumer::Handler ProjectionHandler(std::shared_ptr<store::Pool> pool,
                                               std::string consumer, ApplyFn apply,
                                               log::Logger logger,
                                               std::shared_ptr<ProjectionStats> stats) {
  return [pool = std::move(pool), consumer = std::move(consumer), apply = std::move(apply),
          logger = std::move(logger),
          stats = std::move(stats)](const messaging::Delivery& d) -> messaging::HandlerResult {
    v1::Event ev;
    if (!ev.ParseFromString(d.msg.data)) {
      return messaging::HandlerResult::Reject("payload is not a gpuaas.v1.Event",
                                              messaging::kRejectUndecodable);
    }
    if (!ids::IsUuid(ev.id())) {
      return messaging::HandlerResult::Reject("event id is not a UUID: '" + ev.id() + "'",
                                              messaging::kRejectInvalid);
    }
    bool duplicate = false;
    auto r = store::WithTx(*pool, [&](pqxx::work& tx) -> Result<void> {
      if (!MarkProcessed(tx, consumer, ev.id())) {
        duplicate = true;
        return Ok();
      }
      duplicate = false;
      return apply(tx, ev);
    });
    if (!r.ok()) {
      const Error& e = r.error();
      logger.Warn("event not applied",
                  {{"event_id", ev.id()},
                   {"type", ev.type()},
                   {"error", e.ToString()},
                   {"trace_id", ids::TraceId(d.msg.Header(messaging::kHeaderTraceparent))}});
      if (e.retryable || RetryableCode(e.code)) {
        return messaging::HandlerResult::Retry(e.ToString());
      }
      return messaging::HandlerResult::Reject(e.ToString(), e.code == Code::kInvalidArgument
                                                                ? messaging::kRejectInvalid
                                                                : messaging::kRejectPermanent);
    }
    if (stats) (duplicate ? stats->duplicates : stats->applied)++;
    if (duplicate) {
      logger.Debug("duplicate event skipped", {{"event_id", ev.id()}, {"type", ev.type()}});
    }
    return messaging::HandlerResult::Ack();
  };
}

}  // namespace gpuaas::inbox
