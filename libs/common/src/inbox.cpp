#include "gpuaas/common/inbox.hpp"

#include <unordered_set>

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

namespace {
// Reject, with why, when an envelope can never be applied; Ack when it can be tried.
messaging::HandlerResult Undecodable(const messaging::Delivery& d, v1::Event* ev) {
  if (!ev->ParseFromString(d.msg.data)) {
    return messaging::HandlerResult::Reject("payload is not a gpuaas.v1.Event",
                                            messaging::kRejectUndecodable);
  }
  if (!ids::IsUuid(ev->id())) {
    return messaging::HandlerResult::Reject("event id is not a UUID: '" + ev->id() + "'",
                                            messaging::kRejectInvalid);
  }
  return messaging::HandlerResult::Ack();
}
}  // namespace

messaging::Consumer::BatchHandler ProjectionBatchHandler(std::shared_ptr<store::Pool> pool,
                                                         std::string consumer, ApplyFn apply,
                                                         BatchApplyFn apply_many,
                                                         log::Logger logger,
                                                         std::shared_ptr<ProjectionStats> stats) {
  return [pool = std::move(pool), consumer = std::move(consumer), apply = std::move(apply),
          apply_many = std::move(apply_many), logger = std::move(logger),
          stats = std::move(stats)](const std::vector<messaging::Delivery>& batch) {
    std::vector<messaging::HandlerResult> out(
        batch.size(), messaging::HandlerResult::Retry("the batch was not applied"));
    std::vector<v1::Event> events(batch.size());
    std::vector<size_t> valid;
    std::vector<std::string> ids;
    for (size_t i = 0; i < batch.size(); ++i) {
      auto why = Undecodable(batch[i], &events[i]);
      if (why.disposition != messaging::Disposition::kAck) {
        out[i] = why;
        continue;
      }
      valid.push_back(i);
      ids.push_back(events[i].id());
    }
    if (valid.empty()) return out;
    std::vector<const v1::Event*> fresh;
    auto r = store::WithTx(*pool, [&](pqxx::work& tx) -> Result<void> {
      fresh.clear();
      auto rows = tx.exec_params(
          "INSERT INTO inbox (consumer, event_id) SELECT $1, unnest($2::uuid[]) "
          "ON CONFLICT DO NOTHING RETURNING event_id::text",
          consumer, store::TextArrayLiteral(ids));
      std::unordered_set<std::string> inserted;
      for (const auto& row : rows) inserted.insert(row[0].c_str());
      // The first of two deliveries of one event in a batch is applied; the second is a
      // duplicate.
      for (size_t i : valid) {
        if (inserted.erase(events[i].id()) > 0) fresh.push_back(&events[i]);
      }
      if (apply_many) return apply_many(tx, fresh);
      for (const v1::Event* e : fresh) {
        if (auto a = apply(tx, *e); !a.ok()) return a;
      }
      return Ok();
    });
    if (!r.ok()) {
      logger.Warn("event batch not applied; applying its events one by one",
                  {{"events", std::to_string(valid.size())}, {"error", r.error().ToString()}});
      return out;
    }
    for (size_t i : valid) out[i] = messaging::HandlerResult::Ack();
    if (stats) {
      stats->applied += fresh.size();
      stats->duplicates += valid.size() - fresh.size();
    }
    return out;
  };
}

messaging::Consumer::Handler ProjectionHandler(std::shared_ptr<store::Pool> pool,
                                               std::string consumer, ApplyFn apply,
                                               log::Logger logger,
                                               std::shared_ptr<ProjectionStats> stats) {
  return [pool = std::move(pool), consumer = std::move(consumer), apply = std::move(apply),
          logger = std::move(logger),
          stats = std::move(stats)](const messaging::Delivery& d) -> messaging::HandlerResult {
    v1::Event ev;
    if (auto why = Undecodable(d, &ev); why.disposition != messaging::Disposition::kAck) {
      return why;
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
