#pragma once
// Group commit: units of work that arrive while a transaction is being committed share the next
// transaction, and so one commit and one fsync, instead of one each. Every caller still gets its
// own answer, and only after its work is durable; one unit's failure never fails another's.
//
// The first caller to find no group running leads: it takes the queued units (up to
// max_group), runs each in a savepoint of its own in one transaction, commits, and wakes their
// callers; units that arrive meanwhile wait for the next group. No thread of its own and no
// timer: a lone caller commits at once, and groups grow only when callers overlap.
//
// What becomes of a unit:
// - it returns ok: its savepoint is released and it commits with the group;
// - it returns an error: its savepoint is rolled back (its writes undone) and its caller gets
//   the error; the rest of the group commits;
// - it throws (a deadlock, a statement error): its savepoint is rolled back, and it runs again
//   alone after the group, in a transaction of its own (store::WithTx, with its retries);
// - the group's transaction fails (a lost connection, the commit refused): every unit of it runs
//   again alone.
// A unit may therefore run more than once, and must be safe to (as for WithTx: every effect
// through the transaction; a unit whose commit may have happened must find its own earlier
// result, e.g. by a request id).
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/common/store.hpp"

namespace gpuaas::store {

class GroupCommit {
 public:
  struct Options {
    size_t max_group = 32;  // units per transaction
  };
  struct Stats {
    uint64_t groups = 0;   // transactions committed for groups
    uint64_t units = 0;    // units committed in them
    uint64_t alone = 0;    // units run again alone
    uint64_t largest = 0;  // most units in one committed group
  };
  GroupCommit(std::shared_ptr<Pool> pool, Options opts);
  GroupCommit(const GroupCommit&) = delete;
  GroupCommit& operator=(const GroupCommit&) = delete;

  // Runs fn(tx) as one unit of a group (see above) and returns its result once it is committed
  // (or its error).
  template <typename F>
  auto Run(F&& fn) -> decltype(fn(std::declval<pqxx::work&>())) {
    using R = decltype(fn(std::declval<pqxx::work&>()));
    std::optional<R> out;
    const std::function<Result<void>(pqxx::work&)> body = [&](pqxx::work& tx) -> Result<void> {
      out.emplace(fn(tx));
      if (!out->ok()) return out->error();
      return Ok();
    };
    Result<void> done = Submit(body);
    if (!done.ok()) return R(done.error());
    return std::move(*out);
  }

  Stats stats() const;

 private:
  struct Unit {
    const std::function<Result<void>(pqxx::work&)>* body = nullptr;
    Result<void> result = Ok();
    bool done = false;   // committed, or failed with `result`
    bool alone = false;  // to be run again alone, by its caller
  };
  struct Outcome {
    enum Kind { kAlone, kCommitted, kFailed } kind = kAlone;
    Error error;  // kFailed: the unit's error
  };
  Result<void> Submit(const std::function<Result<void>(pqxx::work&)>& body);
  // Runs `group` in one transaction: what became of each unit.
  std::vector<Outcome> RunGroup(const std::vector<Unit*>& group);

  std::shared_ptr<Pool> pool_;
  Options opts_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Unit*> queue_;
  bool leading_ = false;
  Stats stats_;
};

}  // namespace gpuaas::store
