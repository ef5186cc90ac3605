#include "gpuaas/common/group_commit.hpp"

#include <algorithm>
#include <utility>
#include <vector>

namespace gpuaas::store {

GroupCommit::GroupCommit(std::shared_ptr<Pool> pool, Options opts)
    : pool_(std::move(pool)), opts_(opts) {
  opts_.max_group = std::max<size_t>(opts_.max_group, 1);
}

GroupCommit::Stats GroupCommit::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

Result<void> GroupCommit::Submit(const std::function<Result<void>(pqxx::work&)>& body) {
  Unit unit;
  unit.body = &body;
  std::unique_lock lock(mu_);
  queue_.push_back(&unit);
  for (;;) {
    if (unit.done) return unit.result;
    if (unit.alone) {
      stats_.alone++;
      lock.unlock();
      return WithTx(*pool_, [&](pqxx::work& tx) { return body(tx); });
    }
    if (leading_) {
      cv_.wait(lock);
      continue;
    }
    // Nobody is committing: this caller leads the units queued so far (its own among them,
    // unless more than a group's worth came before it).
    leading_ = true;
    std::vector<Unit*> group;
    while (!queue_.empty() && group.size() < opts_.max_group) {
      group.push_back(queue_.front());
      queue_.pop_front();
    }
    lock.unlock();
    std::vector<Outcome> outcomes = RunGroup(group);
    lock.lock();
    size_t committed = 0;
    for (size_t i = 0; i < group.size(); ++i) {
      Unit* u = group[i];
      switch (outcomes[i].kind) {
        case Outcome::kCommitted:
          u->done = true;
          ++committed;
          break;
        case Outcome::kFailed:
          u->done = true;
          u->result = outcomes[i].error;
          break;
        case Outcome::kAlone:
          u->alone = true;
          break;
      }
    }
    if (committed > 0) {
      stats_.groups++;
      stats_.units += committed;
      stats_.largest = std::max<uint64_t>(stats_.largest, committed);
    }
    leading_ = false;
    cv_.notify_all();
  }
}

std::vector<GroupCommit::Outcome> GroupCommit::RunGroup(const std::vector<Unit*>& group) {
  // Until the commit succeeds, every unit is one to run again alone.
  std::vector<Outcome> out(group.size());
  auto lease = pool_->Acquire();
  if (!lease.ok()) return out;
  std::vector<Outcome> ran(group.size());
  try {
    pqxx::work tx(**lease);
    for (size_t i = 0; i < group.size(); ++i) {
      tx.exec0("SAVEPOINT group_unit");
      Result<void> r = Ok();
      bool threw = false;
      try {
        r = (*group[i]->body)(tx);
      } catch (const pqxx::broken_connection&) {
        throw;  // the group's connection is gone: all of it runs again alone
      } catch (const std::exception&) {
        threw = true;  // a statement failed (a deadlock, a lock timeout): undone, run alone
      }
      if (threw || !r.ok()) {
        tx.exec0("ROLLBACK TO SAVEPOINT group_unit");
        if (!threw) ran[i] = Outcome{Outcome::kFailed, r.error()};
        continue;
      }
      tx.exec0("RELEASE SAVEPOINT group_unit");
      ran[i].kind = Outcome::kCommitted;
    }
    tx.commit();
  } catch (const pqxx::in_doubt_error& e) {
    // Lost during COMMIT: the group may have committed, so no unit runs again here; each
    // caller retries with its own idempotency key (WithTx does the same).
    lease->Discard();
    for (auto& o : out) {
      o = Outcome{Outcome::kFailed, Error::Unavailable(reason::kDbCommitInDoubt, e.what())};
    }
    return out;
  } catch (const std::exception& e) {
    bool retry = false;
    bool broken = false;
    (void)FromException(e, &retry, &broken);
    if (broken) lease->Discard();
    // Not committed: a failure decided inside the group may depend on units that are now
    // undone, so every unit runs again alone.
    return out;
  }
  return ran;
}

}  // namespace gpuaas::store
