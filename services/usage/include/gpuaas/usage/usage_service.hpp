#pragma once
// usage: the usage ledger. Owns, per allocation, its meter and its immutable usage records
// (billing policy usage-policy/1, usage_policy.hpp), derived from the scheduler's allocation
// events alone (GPUAAS_EVT_SCHEDULER, durable usage-scheduler-allocations) and rebuilt from them
// when its database is dropped. Serves gpuaas.v1.usage.* (list, export, summary); announces
// every record through its outbox (GPUAAS_EVT_USAGE), the stream a billing system reads.
#include <pqxx/pqxx>

#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/runtime.hpp"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::usage {

const std::vector<store::Migration>& Migrations();

inline constexpr const char* kAllocationConsumer = "usage-scheduler-allocations";
// Events per fetch (and per transaction) of that consumer.
inline constexpr int kAllocationBatch = 1024;

struct UsageConfig {
  runtime::CommonConfig common;
  // How far past a midnight the newest event must be before that day closes (scheduler
  // transactions may commit out of their start-time order by up to this much).
  int64_t close_lag_s = 60;
  void Register(config::Schema& schema);
  Result<void> Validate() const;
};

class UsageMetrics;

// What the consumer shares.
struct Context {
  UsageConfig cfg;
  std::string source;               // "<service>/<instance>" of the events
  UsageMetrics* metrics = nullptr;  // may be null (tests)
};

// AllocationSnapshot events, in stream order (public for tests): each allocation's meter moves,
// days the ledger's horizon passed are closed for every open meter, and each new record is
// written and appended to the outbox. Set-based (usage_ledger.cpp): one statement per table for
// the whole batch, and the same records however the events were batched. A malformed event:
// INVALID_ARGUMENT malformed_event (the one-by-one path dead-letters it).
Result<void> ApplyAllocationEvents(pqxx::work& tx, const std::vector<const v1::Event*>& events,
                                   const Context& c);
// One event: ApplyAllocationEvents of it alone.
Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const Context& c);

class UsageService {
 public:
  explicit UsageService(UsageConfig cfg);
  ~UsageService();
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown() { svc_.Shutdown(); }
  runtime::Service& runtime() { return svc_; }

 private:
  UsageConfig cfg_;
  runtime::Service svc_;
  std::unique_ptr<UsageMetrics> metrics_;
  std::shared_ptr<void> lag_;
};

}  // namespace gpuaas::usage
