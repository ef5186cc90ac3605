// The store across a lost connection and a failover: a commit whose outcome is unknown is not
// run again, a pool on a multi-host DSN follows a pg_auto_failover promotion, a partitioned
// primary acknowledges nothing that is then lost, and a full disk is a retryable answer (real
// servers, a real network partition and a real full file system).
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <iostream>
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
  // The connection on the standby is not kept: the next Ping connects anew (and would find a
  // primary there, were this server promoted meanwhile).
  EXPECT_FALSE(on_standby.Ping().ok());
  EXPECT_EQ(on_standby.reconnects(), 1);
  EXPECT_EQ(Count(standby_dsn, "SELECT count(*) FROM items"), 2);
}

// The primary's machine cut off from the monitor and the standby by a network partition (both
// ways), not killed, while a client on its side still reaches it: a write there waits for the
// synchronous standby and is never acknowledged; the monitor promotes the standby; the old
// primary's keeper, alone, stops it and the waiting session ends in an error; a pool on the
// multi-host DSN writes to the new primary; healed, the old primary rewinds and rejoins as the
// standby, and the unacknowledged row exists nowhere. Timings are printed for docs/operations.md.
TEST(StoreFailoverTest, APartitionedPrimaryAcknowledgesNothingThatIsThenLost) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (nftables, a user per node)";
  testing::TestHaPostgres ha(0, /*partitionable=*/true);
  const std::string dsn = ha.CreateDatabase("partition");
  {
    pqxx::connection c(dsn);
    pqxx::work tx(c);
    tx.exec0("CREATE TABLE items (id text PRIMARY KEY)");
    tx.exec0("INSERT INTO items VALUES ('before')");
    tx.commit();
  }
  const int old = ha.Primary();
  ASSERT_GE(old, 0) << ha.State();
  const std::string db = pqxx::connection(dsn).dbname();
  const auto on = [&](int node) {
    return fmt::format("host=127.0.0.1 port={} user=postgres dbname={} connect_timeout=2",
                       ha.port(node), db);
  };
  pqxx::connection client(on(old));  // a client on the old primary's side of the partition
  const auto t0 = std::chrono::steady_clock::now();
  const auto secs = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  ha.Partition(old);
  std::atomic<bool> acknowledged{false};
  std::atomic<bool> ended{false};
  double ended_s = 0;
  std::thread writer([&] {
    try {
      pqxx::work tx(client);
      tx.exec0("INSERT INTO items VALUES ('during')");
      tx.commit();
      acknowledged = true;
    } catch (const std::exception& e) {
      std::cout << "the write on the old primary ended: " << e.what() << std::endl;
    }
    ended_s = secs();
    ended = true;
  });
  ASSERT_TRUE(testing::WaitFor([&] { return ha.Primary() == 1 - old; }, 60s, 100ms)) << ha.State();
  const double promoted_s = secs();
  EXPECT_FALSE(acknowledged.load()) << "the isolated primary acknowledged a write";
  // The keeper on the far side stops its primary; the waiting session ends unacknowledged.
  ASSERT_TRUE(testing::WaitFor([&] { return ended.load(); }, 60s, 100ms));
  writer.join();
  EXPECT_FALSE(acknowledged.load());
  store::Pool pool({dsn, 2, 3000}, log::Logger("test", "t", log::Level::kError));
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        return store::WithTx(
                   pool,
                   [&](pqxx::work& tx) -> Result<void> {
                     tx.exec0("INSERT INTO items VALUES ('after') ON CONFLICT DO NOTHING");
                     return Ok();
                   })
            .ok();
      },
      30s, 200ms));
  const double writable_s = secs();
  ha.Heal();
  ASSERT_TRUE(testing::WaitFor([&] { return ha.HasSecondary(); }, 120s, 200ms)) << ha.State();
  const double rejoined_s = secs();
  std::cout << fmt::format(
                   "partition: standby promoted after {:.1f} s, the old primary's waiting write "
                   "ended after {:.1f} s, the pool wrote to the new primary after {:.1f} s; healed "
                   "then, the old primary was the standby again after {:.1f} s",
                   promoted_s, ended_s, writable_s, rejoined_s)
            << std::endl;
  EXPECT_EQ(Count(dsn, "SELECT count(*) FROM items WHERE id IN ('before', 'after')"), 2);
  EXPECT_EQ(Count(dsn, "SELECT count(*) FROM items WHERE id = 'during'"), 0);
  EXPECT_EQ(Count(on(old), "SELECT count(*) FROM items WHERE id = 'during'"), 0)
      << "the rewound old primary kept the unacknowledged row";
}

// Connections carry TCP keepalives and a 15 s user timeout unless the DSN sets its own, so a
// connection to a server gone silent (a partition) fails in seconds rather than minutes: read
// back from the connection's own socket.
TEST(StoreFailoverTest, ConnectionsGiveUpOnASilentServerWithinSeconds) {
  const std::string dsn = testing::SharedPostgres().CreateDatabase("tcp");
  auto socket_option = [](const pqxx::connection& c, int level, int name) {
    int v = -1;
    socklen_t len = sizeof v;
    EXPECT_EQ(getsockopt(c.sock(), level, name, &v, &len), 0);
    return v;
  };
  auto c = store::Connect(dsn);
  EXPECT_EQ(socket_option(*c, SOL_SOCKET, SO_KEEPALIVE), 1);
  EXPECT_EQ(socket_option(*c, IPPROTO_TCP, TCP_KEEPIDLE), 5);
  EXPECT_EQ(socket_option(*c, IPPROTO_TCP, TCP_USER_TIMEOUT), 15000);
  auto own = store::Connect(dsn + " tcp_user_timeout=3000");
  EXPECT_EQ(socket_option(*own, IPPROTO_TCP, TCP_USER_TIMEOUT), 3000);
}

// The server's disk fills up: a write that needs a new block fails with SQLSTATE 53100
// disk_full. That is UNAVAILABLE db_insufficient_resources (retryable: a consumer retries it, a
// client is told to), not an internal error given up on, and the same write succeeds once space
// is freed. The table lives in a tablespace on a 16 MiB loop-mounted ext4 (root).
TEST(StoreFailoverTest, AFullDiskIsRetryableAndTheWriteSucceedsOnceSpaceIsFreed) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root (a loop-mounted file system)";
  const std::string dir = testing::MakeTempDir("gpuaas-full-disk");
  const std::string mnt = dir + "/mnt";
  ASSERT_EQ(testing::Shell(fmt::format("chmod 755 {0} && truncate -s 16M {0}/disk.img && mkfs.ext4 "
                                       "-q -m 0 -F {0}/disk.img && mkdir {1} "
                                       "&& mount -o loop {0}/disk.img {1} && chown postgres: {1}",
                                       dir, mnt)),
            0);
  const std::string dsn = testing::SharedPostgres().CreateDatabase("fulldisk");
  const std::string space = fmt::format("full_disk_{}", getpid());
  {
    pqxx::connection c(dsn);
    pqxx::nontransaction tx(c);
    tx.exec(fmt::format("CREATE TABLESPACE {} LOCATION '{}'", space, mnt));
    tx.exec(fmt::format("CREATE TABLE items (id text, pad text) TABLESPACE {}", space));
  }
  store::Pool pool({dsn, 2, 3000}, log::Logger("test", "t", log::Level::kError));
  auto insert = [&](const std::string& id) {
    return store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
      tx.exec_params0("INSERT INTO items SELECT $1, repeat('x', 1000) FROM generate_series(1, 500)",
                      id);
      return Ok();
    });
  };
  ASSERT_TRUE(insert("before").ok());
  // Every free block taken.
  testing::Shell(fmt::format(
      "a=$(df --output=avail -B1 {0} | tail -1); fallocate -l $((a - 65536)) {0}/filler; dd "
      "if=/dev/zero of={0}/filler.tail bs=4096 >/dev/null 2>&1; sync",
      mnt));
  auto full = insert("during");
  ASSERT_FALSE(full.ok());
  EXPECT_EQ(full.error().reason, reason::kDbInsufficientResources) << full.error().ToString();
  EXPECT_TRUE(full.error().retryable);
  EXPECT_EQ(full.error().details["sqlstate"], "53100");
  testing::Shell(fmt::format("rm -f {0}/filler {0}/filler.tail", mnt));
  EXPECT_TRUE(insert("during").ok());
  EXPECT_EQ(Count(dsn, "SELECT count(*) FROM items WHERE id = 'during'"), 500);
  {
    pqxx::connection c(dsn);
    pqxx::nontransaction tx(c);
    tx.exec("DROP TABLE items");
    tx.exec("DROP TABLESPACE " + space);
  }
  testing::Shell("umount -l " + mnt + " && rm -rf " + dir);
}

}  // namespace
}  // namespace gpuaas
