#pragma once
// Idempotent consumption. MarkProcessed() records (consumer, event id) in the same
// transaction as the effect; a redelivered event finds its row and is skipped.
// ProjectionHandler() turns "apply this event in a transaction" into a JetStream consumer
// handler: malformed envelopes are dead-lettered, transient errors retried with backoff.
#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/store.hpp"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::inbox {

// True when this is the first time `consumer` sees `event_id` (the row is now written in
// `tx`); false for a duplicate.
bool MarkProcessed(pqxx::work& tx, const std::string& consumer, const std::string& event_id);

using ApplyFn = std::function<Result<void>(pqxx::work& tx, const v1::Event& event)>;

struct ProjectionStats {
  std::atomic<uint64_t> applied{0};
  std::atomic<uint64_t> duplicates{0};
};

// Applies several events at once (a projection's bulk path): `events` are new to the consumer
// (duplicates already filtered out), in stream order.
using BatchApplyFn =
    std::function<Result<void>(pqxx::work& tx, const std::vector<const v1::Event*>& events)>;

// The batch path of a projection: a fetched batch's events are marked processed and applied in
// one transaction with one commit - by `apply_many`, or by `apply` one event at a time when
// `apply_many` is empty. Undecodable events are rejected as ProjectionHandler rejects them. When
// anything else fails, the batch's events go to ProjectionHandler's one-by-one path, which
// retries or dead-letters exactly the event that failed.
messaging::Consumer::BatchHandler ProjectionBatchHandler(
    std::shared_ptr<store::Pool> pool, std::string consumer, ApplyFn apply, BatchApplyFn apply_many,
    log::Logger logger, std::shared_ptr<ProjectionStats> stats = nullptr);

messaging::Consumer::Handler ProjectionHandler(std::shared_ptr<store::Pool> pool,
                                               std::string consumer, ApplyFn apply,
                                               log::Logger logger,
                                               std::shared_ptr<ProjectionStats> stats = nullptr);

}  // namespace gpuaas::inbox
