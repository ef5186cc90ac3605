#pragma once
// PostgreSQL (libpqxx 6.4) adapter: a small connection pool, versioned migrations applied at
// start under an advisory lock, and WithTx(), which runs a unit of work in one transaction and
// retries serialization failures and deadlocks. libpqxx exceptions become Error values here:
// a lost connection is UNAVAILABLE (retryable), everything else INTERNAL.
#include <pqxx/pqxx>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/result.hpp"

namespace gpuaas::store {

struct Migration {
  int version;
  std::string name;
  std::string sql;
};

// outbox and inbox tables, shared by every service database.
const std::vector<Migration>& CommonMigrations();

struct PoolOptions {
  std::string dsn;
  int size = 4;
  int64_t acquire_timeout_ms = 5000;
};

class Pool {
 public:
  class Lease {
   public:
    Lease(Pool* pool, std::unique_ptr<pqxx::connection> c) : pool_(pool), c_(std::move(c)) {}
    Lease(Lease&& o) noexcept : pool_(std::exchange(o.pool_, nullptr)), c_(std::move(o.c_)) {}
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    ~Lease();
    pqxx::connection& operator*() { return *c_; }
    pqxx::connection* operator->() { return c_.get(); }
    // The connection is broken: do not return it to the pool. The idle ones go too: they were
    // opened to the same server, which after a failover is gone or a standby.
    void Discard();

   private:
    Pool* pool_ = nullptr;
    std::unique_ptr<pqxx::connection> c_;
  };

  Pool(PoolOptions opts, log::Logger logger);
  Result<Lease> Acquire();
  // Whether a pooled connection reaches the primary: UNAVAILABLE db_unavailable when none
  // connects, db_not_primary when the server is a standby (in recovery). Records the role.
  Result<void> Ping();
  const std::string& dsn() const { return opts_.dsn; }
  const log::Logger& logger() const { return log_; }

  // What the last Ping saw (false before the first): the primary, read-write.
  bool primary() const { return primary_.load(); }
  // Seconds since a Ping last reached the primary (since the pool's creation if none did); 0
  // while the last Ping did.
  double SecondsWithoutPrimary() const;
  // Connections opened again after a connection was lost (a restart, a failover).
  int64_t reconnects() const { return reconnects_.load(); }

 private:
  friend class Lease;
  void Release(std::unique_ptr<pqxx::connection> c);
  void Lost();
  PoolOptions opts_;
  log::Logger log_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<pqxx::connection>> idle_;
  int open_ = 0;
  int lost_ = 0;  // connections lost and not opened again yet
  std::atomic<bool> primary_{false};
  std::atomic<int64_t> last_primary_ns_;  // steady clock
  std::atomic<int64_t> reconnects_{0};
};

// Classifies an exception thrown by libpqxx (or anything else) as an Error.
// `retry_tx` is set for serialization failures and deadlocks.
Error FromException(const std::exception& e, bool* retry_tx, bool* broken);

struct TxOptions {
  int max_attempts = 6;
  bool serializable = false;
  // Reads that must agree with each other (a state and the rows that explain it): REPEATABLE
  // READ READ ONLY, so every statement sees one snapshot instead of each its own.
  bool snapshot = false;
};
inline TxOptions ReadSnapshot() {
  TxOptions o;
  o.snapshot = true;
  return o;
}

namespace detail {
void BackoffSleep(int attempt);
}

// Runs fn(tx) in a transaction and commits when it returns ok; an error value rolls back.
// fn must be safe to run again (it is, if all its effects go through tx): a conflict, or a
// connection lost before COMMIT, runs it again. A connection lost during COMMIT is not retried
// (UNAVAILABLE db_commit_in_doubt): see docs/operations.md, "PostgreSQL high availability".
template <typename F>
auto WithTx(Pool& pool, F&& fn, TxOptions opts = {}) -> decltype(fn(std::declval<pqxx::work&>())) {
  using R = decltype(fn(std::declval<pqxx::work&>()));
  Error last = Error::Unavailable(gpuaas::reason::kDbUnavailable, "no attempt made");
  for (int attempt = 1; attempt <= opts.max_attempts; ++attempt) {
    auto lease = pool.Acquire();
    if (!lease.ok()) return R(lease.error());
    try {
      pqxx::work tx(**lease);
      if (opts.serializable) tx.exec0("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE");
      if (opts.snapshot) tx.exec0("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY");
      R r = fn(tx);
      if (r.ok()) tx.commit();
      return r;
    } catch (const pqxx::in_doubt_error& e) {
      // The connection broke during COMMIT (a failover, a crash): it may have committed. fn is
      // not run again here; the caller's retry with the same idempotency key resolves it.
      lease->Discard();
      return R(Error::Unavailable(gpuaas::reason::kDbCommitInDoubt, e.what()));
    } catch (const std::exception& e) {
      bool retry = false;
      bool broken = false;
      last = FromException(e, &retry, &broken);
      if (broken) lease->Discard();
      if (!retry && !broken) return R(last);
      if (broken && attempt >= 2) return R(last);
      detail::BackoffSleep(attempt);
    }
  }
  return R(last);
}

// Applies `migrations` of `component` (e.g. "inventory") that are not yet applied, in version
// order, each in its own transaction, under a session advisory lock so concurrent replicas
// starting together apply each migration once. An applied migration whose text changed is an
// error (edit by adding a new one).
Result<int> Migrate(Pool& pool, const std::string& component,
                    const std::vector<Migration>& migrations);

// A new connection with the session settings every service's connections have (the pool's,
// and those a component holds of its own): jit off. Every statement here is a short OLTP one,
// and the planner's cost estimates over young tables without statistics (a new replica, a
// projection's rebuild) passed jit_above_cost: a 400,000-event replay spent 38% of the machine
// compiling expressions with LLVM (docs/benchmarks.md, P8). Throws what pqxx throws.
std::unique_ptr<pqxx::connection> Connect(const std::string& dsn);

// The name under which Prepared() registers `sql` with a connection (derived from the text).
std::string PreparedName(const std::string& sql);

// Runs `sql` as a prepared statement of tx's connection: defined there on its first use (libpqxx
// sends it to the server with that call), then parsed and planned once per connection, not on
// every call. Planning was as costly as executing for the create path's statements (P1 in
// docs/benchmarks.md). Only for statements whose best plan does not depend on the values passed
// (lookups and updates by key, inserts, probes driven by an unnest): after five calls PostgreSQL
// may keep one generic plan for every later call on that connection.
template <typename... Args>
pqxx::result Prepared(pqxx::transaction_base& tx, const std::string& sql, Args&&... args) {
  const std::string name = PreparedName(sql);
  tx.conn().prepare(name, sql);  // a no-op when this connection has it already
  return tx.exec_prepared(name, std::forward<Args>(args)...);
}

// A PostgreSQL text[] literal ({"a","b\"c"}) to pass as a parameter cast with ::text[].
std::string TextArrayLiteral(const std::vector<std::string>& items);
// A PostgreSQL bytea[] literal of binary strings (hex form), to pass cast with ::bytea[].
std::string ByteaArrayLiteral(const std::vector<std::string>& items);

// Rows written (or matched) with one statement, column by column: column i travels as array
// parameter $<i+1>, which the statement unnests (`unnest($1::text[], $2::bigint[], ...)`), so
// any number of rows is one round trip. Values are text (the statement casts the array:
// ::bigint[], ::boolean[] with "t"/"f", ::uuid[], ::date[]), except the columns named binary,
// whose values are raw bytes (passed as ::bytea[]).
class ArrayColumns {
 public:
  explicit ArrayColumns(size_t columns, const std::vector<size_t>& binary = {});
  // One row: a value per column, in order.
  void Add(std::vector<std::string> row);
  size_t rows() const { return rows_; }
  // Runs `sql` with the columns as its parameters $1..$n.
  pqxx::result Exec(pqxx::work& tx, const std::string& sql) const;

 private:
  std::vector<std::vector<std::string>> cols_;
  std::vector<bool> binary_;
  size_t rows_ = 0;
};
// The non-NULL strings of a text[] column, in order.
std::vector<std::string> TextArray(const pqxx::field& field);

}  // namespace gpuaas::store
