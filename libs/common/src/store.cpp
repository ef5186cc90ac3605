#include "gpuaas/common/store.hpp"

#include <random>
#include <stdexcept>

#include <fmt/format.h>

#include "gpuaas/common/reasons.hpp"

namespace gpuaas::store {

Pool::Lease::~Lease() {
  // A discarded lease (null connection) still frees its slot in the pool.
  if (pool_) pool_->Release(std::move(c_));
}

namespace {
int64_t SteadyNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

void Pool::Lease::Discard() {
  c_.reset();
  if (pool_) pool_->Lost();
}

Pool::Pool(PoolOptions opts, log::Logger logger)
    : opts_(std::move(opts)), log_(std::move(logger)), last_primary_ns_(SteadyNs()) {}

void Pool::Lost() {
  std::lock_guard lock(mu_);
  lost_ += 1 + static_cast<int>(idle_.size());
  open_ -= static_cast<int>(idle_.size());
  idle_.clear();
  primary_ = false;
  cv_.notify_all();
}

double Pool::SecondsWithoutPrimary() const {
  if (primary_.load()) return 0;
  return static_cast<double>(SteadyNs() - last_primary_ns_.load()) / 1e9;
}

Result<Pool::Lease> Pool::Acquire() {
  std::unique_lock lock(mu_);
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(opts_.acquire_timeout_ms);
  while (idle_.empty() && open_ >= opts_.size) {
    if (cv_.wait_until(lock, deadline) == std::cv_status::timeout) {
      return Error::Of(Code::kResourceExhausted, reason::kDbPoolExhausted,
                       "no database connection free within the acquire timeout", {}, true);
    }
  }
  if (!idle_.empty()) {
    auto c = std::move(idle_.back());
    idle_.pop_back();
    if (c->is_open()) return Lease(this, std::move(c));
    --open_;
  }
  ++open_;
  lock.unlock();
  try {
    Lease lease(this, Connect(opts_.dsn));
    std::lock_guard relock(mu_);
    if (lost_ > 0) {
      --lost_;
      ++reconnects_;
    }
    return lease;
  } catch (const std::exception& e) {
    std::lock_guard relock(mu_);
    --open_;
    cv_.notify_one();
    return Error::Unavailable(reason::kDbUnavailable, std::string("cannot connect: ") + e.what());
  }
}

namespace {
// TCP keepalives and a user timeout, unless the DSN chose its own: a connection whose server
// went silent mid-query (a network partition, a machine gone without a reset) fails within
// about 15 s, and the pool reconnects, instead of waiting out TCP's retransmissions (~15 min).
// libpq ignores them on Unix sockets.
std::string WithTcpDefaults(const std::string& dsn) {
  if (dsn.find("keepalives") != std::string::npos ||
      dsn.find("tcp_user_timeout") != std::string::npos) {
    return dsn;
  }
  static constexpr const char* kParams[] = {"keepalives=1", "keepalives_idle=5",
                                            "keepalives_interval=2", "keepalives_count=3",
                                            "tcp_user_timeout=15000"};
  const bool uri = dsn.rfind("postgres://", 0) == 0 || dsn.rfind("postgresql://", 0) == 0;
  std::string out = dsn;
  char sep = uri ? (dsn.find('?') == std::string::npos ? '?' : '&') : ' ';
  for (const char* p : kParams) {
    if (!out.empty()) out += sep;
    out += p;
    if (uri) sep = '&';
  }
  return out;
}
}  // namespace

std::unique_ptr<pqxx::connection> Connect(const std::string& dsn) {
  auto c = std::make_unique<pqxx::connection>(WithTcpDefaults(dsn));
  c->set_variable("jit", "off");
  return c;
}

void Pool::Release(std::unique_ptr<pqxx::connection> c) {
  std::lock_guard lock(mu_);
  if (c && c->is_open()) {
    idle_.push_back(std::move(c));
  } else {
    --open_;
  }
  cv_.notify_one();
}

Result<void> Pool::Ping() {
  auto r = [&]() -> Result<void> {
    auto lease = Acquire();
    if (!lease.ok()) return lease.error();
    try {
      // With a multi-host DSN (target_session_attrs=read-write) a new connection reaches the
      // primary; one opened before a switchover may now be on a standby. It is discarded with
      // the idle ones (opened to the same server), so the next Ping connects anew and finds the
      // new primary: kept, a service that writes nothing would stay unready for good.
      pqxx::nontransaction tx(**lease);
      if (tx.exec1("SELECT pg_is_in_recovery()")[0].as<bool>()) {
        lease->Discard();
        return Error::Unavailable(reason::kDbNotPrimary, "the server is a standby in recovery");
      }
      return Ok();
    } catch (const std::exception& e) {
      bool retry = false;
      bool broken = false;
      Error err = FromException(e, &retry, &broken);
      if (broken) lease->Discard();
      return err;
    }
  }();
  if (r.ok()) {
    primary_ = true;
    last_primary_ns_ = SteadyNs();
  } else {
    if (primary_.exchange(false)) last_primary_ns_ = SteadyNs();
  }
  return r;
}

Error FromException(const std::exception& e, bool* retry_tx, bool* broken) {
  *retry_tx = false;
  *broken = false;
  if (dynamic_cast<const pqxx::serialization_failure*>(&e) ||
      dynamic_cast<const pqxx::deadlock_detected*>(&e)) {
    *retry_tx = true;
    return Error::Aborted(reason::kTxConflict, e.what());
  }
  if (dynamic_cast<const pqxx::broken_connection*>(&e) ||
      dynamic_cast<const pqxx::in_doubt_error*>(&e)) {
    *broken = true;
    return Error::Unavailable(reason::kDbUnavailable, e.what());
  }
  if (const auto* se = dynamic_cast<const pqxx::sql_error*>(&e)) {
    const std::string& state = se->sqlstate();
    // 57P01 admin_shutdown, 57P02 crash_shutdown, 57P03 cannot_connect_now, 08xxx connection.
    if (state.rfind("57P", 0) == 0 || state.rfind("08", 0) == 0) {
      *broken = true;
      return Error::Unavailable(reason::kDbUnavailable, e.what());
    }
    // 25006 read_only_sql_transaction: this connection is on a standby (a demoted primary).
    if (state == "25006") {
      *broken = true;
      return Error::Unavailable(reason::kDbNotPrimary, e.what());
    }
    // Class 53 insufficient resources (53100 disk_full, 53200 out_of_memory, 53300
    // too_many_connections): the statement failed whole, and space or memory may come back, so
    // the caller retries rather than failing for good (a consumer must not dead-letter it).
    if (state.rfind("53", 0) == 0) {
      Error err = Error::Unavailable(reason::kDbInsufficientResources, e.what());
      err.details["sqlstate"] = state;
      return err;
    }
    if (state == "40001" || state == "40P01") {
      *retry_tx = true;
      return Error::Aborted(reason::kTxConflict, e.what());
    }
    Error err = Error::Internal(reason::kDbError, e.what());
    err.details["sqlstate"] = state;
    return err;
  }
  if (dynamic_cast<const pqxx::failure*>(&e)) {
    // Any other libpq-level failure (a connection lost mid-statement, a server gone away):
    // the database, not the request, is the problem.
    *broken = true;
    return Error::Unavailable(reason::kDbUnavailable, e.what());
  }
  return Error::Internal(reason::kInternal, e.what());
}

namespace detail {
void BackoffSleep(int attempt) {
  thread_local std::mt19937 rng(std::random_device{}());
  const int base = std::min(200, 5 << std::min(attempt, 6));
  std::uniform_int_distribution<int> jitter(0, base);
  std::this_thread::sleep_for(std::chrono::milliseconds(base / 2 + jitter(rng)));
}
}  // namespace detail

namespace {
std::string Checksum(const std::string& s) {
  uint64_t h = 1469598103934665603ULL;  // FNV-1a 64
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return fmt::format("{:016x}", h);
}
}  // namespace

Result<int> Migrate(Pool& pool, const std::string& component,
                    const std::vector<Migration>& migrations) {
  auto lease = pool.Acquire();
  if (!lease.ok()) return lease.error();
  int applied = 0;
  try {
    pqxx::connection& c = **lease;
    {
      pqxx::nontransaction nt(c);
      nt.exec("SELECT pg_advisory_lock(hashtext('gpuaas_schema_migrations'))");
      nt.exec(
          "CREATE TABLE IF NOT EXISTS schema_migrations ("
          " component text NOT NULL, version int NOT NULL, name text NOT NULL,"
          " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(),"
          " PRIMARY KEY (component, version))");
    }
    for (const auto& m : migrations) {
      pqxx::work tx(c);
      auto rows = tx.exec_params(
          "SELECT checksum FROM schema_migrations WHERE component = $1 AND version = $2", component,
          m.version);
      const std::string sum = Checksum(m.sql);
      if (!rows.empty()) {
        if (rows[0][0].as<std::string>() != sum) {
          tx.abort();
          pqxx::nontransaction nt(c);
          nt.exec("SELECT pg_advisory_unlock(hashtext('gpuaas_schema_migrations'))");
          return Error::FailedPrecondition(
              reason::kMigrationChanged,
              fmt::format("{} migration {} ({}) was changed after it was applied", component,
                          m.version, m.name));
        }
        continue;
      }
      tx.exec(m.sql);
      tx.exec_params(
          "INSERT INTO schema_migrations (component, version, name, checksum) "
          "VALUES ($1, $2, $3, $4)",
          component, m.version, m.name, sum);
      tx.commit();
      ++applied;
      pool.logger().Info("migration applied", {{"component", component}, {"migration", m.name}});
    }
    pqxx::nontransaction nt(c);
    nt.exec("SELECT pg_advisory_unlock(hashtext('gpuaas_schema_migrations'))");
  } catch (const std::exception& e) {
    bool retry = false;
    bool broken = false;
    Error err = FromException(e, &retry, &broken);
    lease->Discard();  // also drops the session advisory lock
    err.message = fmt::format("{} migrations: {}", component, err.message);
    return err;
  }
  return applied;
}

const std::vector<Migration>& CommonMigrations() {
  static const std::vector<Migration> kMigrations = {
      {1, "0001_outbox_inbox.sql", R"sql(
CREATE TABLE outbox (
  seq          bigserial PRIMARY KEY,
  event_id     uuid NOT NULL UNIQUE,
  subject      text NOT NULL,
  payload      bytea NOT NULL,
  traceparent  text NOT NULL DEFAULT '',
  created_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
  published_at timestamptz
);
CREATE INDEX outbox_unpublished ON outbox (seq) WHERE published_at IS NULL;
CREATE TABLE inbox (
  consumer     text NOT NULL,
  event_id     uuid NOT NULL,
  processed_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (consumer, event_id)
);
)sql"},
      {2, "0002_outbox_msg_id.sql", R"sql(
ALTER TABLE outbox ADD COLUMN msg_id text;
)sql"},
  };
  return kMigrations;
}

std::string PreparedName(const std::string& sql) {
  return fmt::format("gpuaas_{:016x}", std::hash<std::string>{}(sql));
}

std::string TextArrayLiteral(const std::vector<std::string>& items) {
  std::string out = "{";
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ",";
    out += "\"";
    for (char ch : items[i]) {
      if (ch == '"' || ch == '\\') out += '\\';
      out += ch;
    }
    out += "\"";
  }
  return out + "}";
}

std::string ByteaArrayLiteral(const std::vector<std::string>& items) {
  static constexpr char kHex[] = "0123456789abcdef";
  size_t size = 2;
  for (const auto& item : items) size += 2 * item.size() + 6;
  std::string out;
  out.reserve(size);
  out += '{';
  for (size_t i = 0; i < items.size(); ++i) {
    if (i) out += ',';
    out += "\"\\\\x";  // "\\x: an escaped backslash, then the hex digits
    for (unsigned char ch : items[i]) {
      out += kHex[ch >> 4];
      out += kHex[ch & 15];
    }
    out += '"';
  }
  return out + "}";
}

ArrayColumns::ArrayColumns(size_t columns, const std::vector<size_t>& binary)
    : cols_(columns), binary_(columns, false) {
  for (size_t c : binary) binary_.at(c) = true;
}

void ArrayColumns::Add(std::vector<std::string> row) {
  if (row.size() != cols_.size()) {
    throw std::invalid_argument(
        fmt::format("ArrayColumns: a row of {} values for {} columns", row.size(), cols_.size()));
  }
  for (size_t c = 0; c < row.size(); ++c) cols_[c].push_back(std::move(row[c]));
  ++rows_;
}

pqxx::result ArrayColumns::Exec(pqxx::work& tx, const std::string& sql) const {
  std::vector<std::string> params;
  params.reserve(cols_.size());
  for (size_t c = 0; c < cols_.size(); ++c) {
    params.push_back(binary_[c] ? ByteaArrayLiteral(cols_[c]) : TextArrayLiteral(cols_[c]));
  }
  return tx.exec_params(sql, pqxx::prepare::make_dynamic_params(params));
}

std::vector<std::string> TextArray(const pqxx::field& field) {
  std::vector<std::string> out;
  auto parser = field.as_array();
  for (auto e = parser.get_next(); e.first != pqxx::array_parser::done; e = parser.get_next()) {
    if (e.first == pqxx::array_parser::string_value) out.push_back(e.second);
  }
  return out;
}

}  // namespace gpuaas::store
