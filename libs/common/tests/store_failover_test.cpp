// The store across a lost connection and a failover: a commit whose outcome is unknown is not
// run again, and a pool on a multi-host DSN follows a pg_auto_failover promotion (real servers).
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/store.hpp"
#include "ha_postgres.hpp"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

int64_t Count(const std::string& dsn, const std::string& sql) {
  pqxx::connection c(dsn);
  pqxx::nontransaction tx(c);
  return tx.exec1(sql)[0].as<int64_t>();
}

// The connection breaks while COMMIT runs (a deferred trigger holds the commit; another
// session terminates the backend meanwhile): WithTx answers UNAVAILABLE db_commit_in_doubt and
// does not run the unit a second time, since it cannot know whether the first one committed.
TEST(StoreFailoverTest, ACommitWhoseOutcomeIsUnknownIsInDoubtAndNotRunAgain) {
  const std::string dsn = testing::SharedPostgres().CreateDatabase("indoubt");
  {
    pqxx::connection c(dsn);
    pqxx::work tx(c);
    tx.exec(R"sql(
CREATE TABLE items (id text PRIMARY KEY);
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS
  $$ BEGIN PERFORM pg_sleep(5); RETURN NULL; END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON items DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW EXECUTE FUNCTION slow_commit();
)sql");
    tx.commit();
  }
  store::Pool pool({dsn, 2, 3000}, log::Logger("test", "t", log::Level::kError));
  std::atomic<int> runs{0};
  std::atomic<int> backend{0};
  std::thread killer([&] {
    // Once the unit ran and COMMIT is under way (the trigger sleeping), end that backend.
    ASSERT_TRUE(testing::WaitFor([&] { return backend.load() != 0; }, 10s));
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          return Count(dsn, "SELECT count(*) FROM pg_stat_activity WHERE pid = " +
                                std::to_string(backend.load()) +
                                " AND query LIKE 'COMMIT%' AND wait_event = 'PgSleep'") == 1;
        },
        10s));
    Count(dsn, "SELECT count(*) FROM (SELECT pg_terminate_backend(" +
                   std::to_string(backend.load()) + ")) t");
  });
  auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
    runs++;
    backend = tx.exec1("SELECT pg_backend_pid()")[0].as<int>();
    tx.exec0("INSERT INTO items VALUES ('a')");
    return Ok();
  });
  killer.join();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, reason::kDbCommitInDoubt) << r.error().ToString();
  EXPECT_TRUE(r.error().retryable);
  EXPECT_EQ(runs.load(), 1);
  // The pool is usable again: a new connection replaces the lost one.
  EXPECT_TRUE(pool.Ping().ok());
  EXPECT_EQ(pool.reconnects(), 1);
}

// A pool on the formation's multi-host DSN: the primary's machine is killed, Ping says there is
// no primary (what /readyz answers), the engine promotes the standby, and the pool writes to it
// with the row committed before the kill there (synchronous replication); connected to the old
// primary once it is back as a standby, Ping answers db_not_primary.
TEST(StoreFailoverTest, APoolFollowsAFailoverAndNeverLosesACommittedRow) {
  testing::TestHaPostgres ha;
  const std::string dsn = ha.CreateDatabase("failover");
  store::Pool pool({dsn, 4, 3000}, log::Logger("test", "t", log::Level::kError));
  auto insert = [&](const std::string& id) {
    return store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
      tx.exec0("CREATE TABLE IF NOT EXISTS items (id text PRIMARY KEY)");
      tx.exec_params0("INSERT INTO items VALUES ($1)", id);
      return Ok();
    });
  };
  ASSERT_TRUE(insert("before").ok());
  ASSERT_TRUE(pool.Ping().ok());
  EXPECT_TRUE(pool.primary());
  EXPECT_EQ(pool.SecondsWithoutPrimary(), 0);

  const int old = ha.Primary();
  ASSERT_GE(old, 0);
  ha.KillNode(old);
  auto down = pool.Ping();
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.error().reason, reason::kDbUnavailable) << down.error().ToString();
  EXPECT_FALSE(pool.primary());

  ASSERT_TRUE(testing::WaitFor([&] { return ha.Primary() == 1 - old; }, 60s, 100ms)) << ha.State();
  ASSERT_TRUE(testing::WaitFor([&] { return pool.Ping().ok(); }, 30s, 100ms));
  EXPECT_TRUE(pool.primary());
  EXPECT_GE(pool.reconnects(), 1);
  ASSERT_TRUE(insert("after").ok());
  EXPECT_EQ(Count(dsn, "SELECT count(*) FROM items WHERE id IN ('before', 'after')"), 2);

  // The old primary rejoins as the standby; a pool that reaches only it is not ready.
  ha.StartNode(old);
  ASSERT_TRUE(testing::WaitFor([&] { return ha.HasSecondary(); }, 120s, 200ms)) << ha.State();
  const std::string standby_dsn =
      fmt::format("host=127.0.0.1 port={} user=postgres dbname={} connect_timeout=2", ha.port(old),
                  pqxx::connection(dsn).dbname());
  store::Pool on_standby({standby_dsn, 1, 3000}, log::Logger("test", "t", log::Level::kError));
  auto standby = on_standby.Ping();
  ASSERT_FALSE(standby.ok());
  EXPECT_EQ(standby.error().reason, reason::kDbNotPrimary) << standby.error().ToString();
  EXPECT_FALSE(on_standby.primary());
  EXPECT_EQ(Count(standby_dsn, "SELECT count(*) FROM items"), 2);
}

}  // namespace
}  // namespace gpuaas
