// Store, outbox and inbox against a real PostgreSQL and nats-server.
#include <gtest/gtest.h>

#include <atomic>
#include <stdexcept>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/group_commit.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

const std::vector<store::Migration> kTestMigrations = {
    {1, "0001_items.sql", "CREATE TABLE items (id text PRIMARY KEY, n int NOT NULL);"},
    {2, "0002_more.sql", "ALTER TABLE items ADD COLUMN note text;"},
};

class StoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_ = log::Logger("test", "t1", log::Level::kWarn);
    dsn_ = testing::SharedPostgres().CreateDatabase("store");
    pool_ = std::make_shared<store::Pool>(store::PoolOptions{dsn_, 8, 3000}, log_);
  }
  log::Logger log_;
  std::string dsn_;
  std::shared_ptr<store::Pool> pool_;
};

// Group commit: units that overlap share one transaction, and every caller gets its own answer.
// A unit that returns an error is undone alone; one whose statement fails is undone and run
// again alone; the others of its group commit either way.
TEST_F(StoreTest, AGroupCommitsTogetherAndOneUnitsFailureNeverFailsAnother) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  store::GroupCommit group(pool_, {});
  auto insert = [](pqxx::work& tx, const std::string& id) {
    tx.exec_params("INSERT INTO items (id, n) VALUES ($1, 1)", id);
  };
  // The first unit holds its group open until the other callers have started, so they queue
  // behind it and are committed together in the next group.
  constexpr int kCallers = 8;
  std::atomic<bool> first_running{false};
  std::atomic<int> started{0};
  std::vector<Result<std::string>> results(kCallers, Result<std::string>(std::string()));
  std::vector<std::thread> callers;
  callers.emplace_back([&] {
    results[0] = group.Run([&](pqxx::work& tx) -> Result<std::string> {
      insert(tx, "u0");
      first_running = true;
      while (started < kCallers - 1) std::this_thread::sleep_for(1ms);
      std::this_thread::sleep_for(50ms);  // let the last of them reach the queue
      return std::string("u0");
    });
  });
  ASSERT_TRUE(testing::WaitFor([&] { return first_running.load(); }));
  for (int i = 1; i < kCallers; ++i) {
    callers.emplace_back([&, i] {
      started++;
      results[static_cast<size_t>(i)] = group.Run([&, i](pqxx::work& tx) -> Result<std::string> {
        const std::string id = "u" + std::to_string(i);
        insert(tx, id);
        if (i == 3) return Error::FailedPrecondition("refused", "unit 3 says no");
        if (i == 5) insert(tx, "u5");  // a duplicate key: the statement fails
        return id;
      });
    });
  }
  for (auto& t : callers) t.join();
  for (int i = 0; i < kCallers; ++i) {
    if (i == 3 || i == 5) continue;
    ASSERT_TRUE(results[static_cast<size_t>(i)].ok()) << i;
    EXPECT_EQ(*results[static_cast<size_t>(i)], "u" + std::to_string(i));
  }
  ASSERT_FALSE(results[3].ok());
  EXPECT_EQ(results[3].error().reason, "refused");
  ASSERT_FALSE(results[5].ok()) << "run again alone, the duplicate fails there too";
  auto rows = store::WithTx(*pool_, [](pqxx::work& tx) -> Result<std::vector<std::string>> {
    std::vector<std::string> ids;
    for (const auto& r : tx.exec("SELECT id FROM items ORDER BY id")) {
      ids.emplace_back(r[0].c_str());
    }
    return ids;
  });
  ASSERT_TRUE(rows.ok());
  EXPECT_EQ(*rows, (std::vector<std::string>{"u0", "u1", "u2", "u4", "u6", "u7"}))
      << "what failed is undone; everything else committed";
  const auto st = group.stats();
  EXPECT_GE(st.largest, 2u) << "the callers that overlapped shared a commit";
  EXPECT_LT(st.groups, 6u);
  EXPECT_EQ(st.units, 6u);
  EXPECT_EQ(st.alone, 1u);
}

TEST_F(StoreTest, MigrationsApplyOnceUnderConcurrentStarts) {
  std::vector<std::thread> ts;
  std::atomic<int> applied{0};
  std::atomic<int> failed{0};
  ts.reserve(4);
  for (int i = 0; i < 4; ++i) {
    ts.emplace_back([&] {
      auto r = store::Migrate(*pool_, "svc", kTestMigrations);
      if (r.ok()) {
        applied += *r;
      } else {
        failed++;
      }
    });
  }
  for (auto& t : ts) t.join();
  EXPECT_EQ(failed.load(), 0);
  EXPECT_EQ(applied.load(), 2);
  auto again = store::Migrate(*pool_, "svc", kTestMigrations);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 0);
}

TEST_F(StoreTest, ChangedMigrationIsRefused) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  auto edited = kTestMigrations;
  edited[0].sql += " -- edited";
  auto r = store::Migrate(*pool_, "svc", edited);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "migration_changed");
}

TEST_F(StoreTest, WithTxRetriesSerializationFailures) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  ASSERT_TRUE(store::WithTx(*pool_, [](pqxx::work& tx) -> Result<void> {
                tx.exec0("INSERT INTO items VALUES ('counter', 0)");
                return Ok();
              }).ok());
  std::atomic<int> attempts{0};
  std::vector<std::thread> ts;
  ts.reserve(8);
  for (int i = 0; i < 8; ++i) {
    ts.emplace_back([&] {
      for (int j = 0; j < 10; ++j) {
        auto r = store::WithTx(
            *pool_,
            [&](pqxx::work& tx) -> Result<void> {
              attempts++;
              int n = tx.exec1("SELECT n FROM items WHERE id = 'counter'")[0].as<int>();
              tx.exec_params("UPDATE items SET n = $1 WHERE id = 'counter'", n + 1);
              return Ok();
            },
            store::TxOptions{50, true});
        EXPECT_TRUE(r.ok()) << r.error().ToString();
      }
    });
  }
  for (auto& t : ts) t.join();
  auto n = store::WithTx(*pool_, [](pqxx::work& tx) -> Result<int> {
    return tx.exec1("SELECT n FROM items WHERE id = 'counter'")[0].as<int>();
  });
  EXPECT_EQ(*n, 80);               // no lost update
  EXPECT_GT(attempts.load(), 80);  // conflicts happened and were retried
}

// store::Prepared: one server-side statement per connection and text, kept through a rolled
// back transaction and a failed savepoint, with the parameters of each call.
TEST_F(StoreTest, APreparedStatementIsPreparedOncePerConnectionAndOutlivesRollbacks) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  const std::string insert = "INSERT INTO items (id, n) VALUES ($1, $2)";
  const std::string read = "SELECT n FROM items WHERE id = $1";
  pqxx::connection c(dsn_);
  {
    pqxx::work tx(c);
    store::Prepared(tx, insert, "gone", 0);
    tx.abort();
  }
  {
    pqxx::work tx(c);
    for (int i = 1; i <= 7; ++i) store::Prepared(tx, insert, "item-" + std::to_string(i), i);
    // A failed statement in a savepoint (as a group commit's unit or a placement choice has).
    tx.exec0("SAVEPOINT dup");
    try {
      store::Prepared(tx, insert, "item-1", 99);  // a unique violation
      ADD_FAILURE() << "the duplicate was inserted";
    } catch (const pqxx::unique_violation&) {
      tx.exec0("ROLLBACK TO SAVEPOINT dup");
    }
    EXPECT_EQ(store::Prepared(tx, read, "item-6")[0][0].as<int>(), 6);
    EXPECT_TRUE(store::Prepared(tx, read, "gone").empty());
    tx.commit();
  }
  pqxx::work tx(c);
  auto prepared = tx.exec_params(
      "SELECT name, statement FROM pg_prepared_statements WHERE name IN ($1, $2) ORDER BY "
      "statement",
      store::PreparedName(insert), store::PreparedName(read));
  ASSERT_EQ(prepared.size(), 2u);
  EXPECT_EQ(prepared[0][1].as<std::string>(), insert);
  EXPECT_EQ(prepared[1][1].as<std::string>(), read);
  EXPECT_EQ(tx.exec1("SELECT count(*) FROM items")[0].as<int>(), 7);
}

TEST_F(StoreTest, ReadSnapshotSeesOneMomentAndWritesNothing) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  ASSERT_TRUE(store::WithTx(*pool_, [](pqxx::work& tx) -> Result<void> {
                tx.exec0("INSERT INTO items VALUES ('state', 1)");
                return Ok();
              }).ok());
  auto bump = [&] {
    return store::WithTx(*pool_, [](pqxx::work& tx) -> Result<void> {
      tx.exec0("UPDATE items SET n = n + 1 WHERE id = 'state'");
      return Ok();
    });
  };
  // A commit between two reads of one unit of work: READ COMMITTED sees it half-way, a
  // snapshot does not (a state and the rows that explain it stay consistent).
  auto read_twice = [&](store::TxOptions opts) {
    return store::WithTx(
        *pool_,
        [&](pqxx::work& tx) -> Result<std::pair<int, int>> {
          const int a = tx.exec1("SELECT n FROM items WHERE id = 'state'")[0].as<int>();
          EXPECT_TRUE(bump().ok());
          const int b = tx.exec1("SELECT n FROM items WHERE id = 'state'")[0].as<int>();
          return std::make_pair(a, b);
        },
        opts);
  };
  auto plain = read_twice({});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->second, plain->first + 1);
  auto snap = read_twice(store::ReadSnapshot());
  ASSERT_TRUE(snap.ok());
  EXPECT_EQ(snap->second, snap->first);
  auto write = store::WithTx(
      *pool_,
      [](pqxx::work& tx) -> Result<void> {
        tx.exec0("UPDATE items SET n = 0");
        return Ok();
      },
      store::ReadSnapshot());
  EXPECT_FALSE(write.ok());
}

// ArrayColumns: any number of rows in one statement, text cast server-side, bytes intact.
TEST_F(StoreTest, RowsTravelAsArrayColumnsInOneStatement) {
  std::string bytes;
  for (int b = 0; b < 256; ++b) bytes += static_cast<char>(b);
  store::ArrayColumns rows(4, {3});
  rows.Add({"a \"quoted\" \\ {value}", "1", "t", bytes});
  rows.Add({"", "-9000000000", "f", ""});
  rows.Add({"c,d", "3", "t", std::string("\0\0", 2)});
  EXPECT_EQ(rows.rows(), 3U);
  EXPECT_THROW(rows.Add({"only one"}), std::invalid_argument);
  auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<std::vector<std::string>> {
    std::vector<std::string> out;
    for (const auto& row :
         rows.Exec(tx,
                   "SELECT s, n + 1, NOT b, length(p), encode(p, 'hex') FROM unnest($1::text[], "
                   "$2::bigint[], $3::boolean[], $4::bytea[]) WITH ORDINALITY AS x(s, n, b, p, i) "
                   "ORDER BY i")) {
      out.push_back(fmt::format("{}|{}|{}|{}|{}", row[0].c_str(), row[1].c_str(), row[2].c_str(),
                                row[3].c_str(), std::string(row[4].c_str()).substr(0, 8)));
    }
    return out;
  });
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ASSERT_EQ(r->size(), 3U);
  EXPECT_EQ((*r)[0], "a \"quoted\" \\ {value}|2|f|256|00010203");
  EXPECT_EQ((*r)[1], "|-8999999999|t|0|");
  EXPECT_EQ((*r)[2], "c,d|4|f|2|0000");
}

TEST_F(StoreTest, UnreachableDatabaseIsUnavailableNotACrash) {
  store::Pool dead(
      store::PoolOptions{"host=127.0.0.1 port=1 user=x dbname=x connect_timeout=1", 2, 1000}, log_);
  auto r = dead.Ping();
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kUnavailable);
  EXPECT_TRUE(r.error().retryable);
}

class OutboxTest : public StoreTest {
 protected:
  void SetUp() override {
    StoreTest::SetUp();
    ASSERT_TRUE(store::Migrate(*pool_, "common", store::CommonMigrations()).ok());
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness), log_);
    ASSERT_TRUE(c.ok());
    conn_ = *c;
    ASSERT_TRUE(
        messaging::EnsureStream(*conn_, {"TEST_OUT", {"gpuaas.v1.evt.test.>"}, 0, 600}).ok());
  }
  std::string Append(int i) {
    std::string id;
    v1::NodeSnapshot data;
    data.mutable_node()->set_node_id("n" + std::to_string(i));
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
      auto e = outbox::Append(tx, {"gpuaas.v1.evt.test.node.registered", "", "test/t1",
                                   "n" + std::to_string(i), i, "", "", &data});
      if (!e.ok()) return e.error();
      id = *e;
      return Ok();
    });
    EXPECT_TRUE(r.ok());
    return id;
  }
  uint64_t StreamCount() {
    auto n =
        messaging::StreamSubjectCount(*conn_, "TEST_OUT", "gpuaas.v1.evt.test.node.registered");
    // A failed count fails the test: read as 0 it would pass every "nothing published yet".
    if (!n.ok()) {
      ADD_FAILURE() << "counting TEST_OUT: " << n.error().ToString();
      return UINT64_MAX;
    }
    return *n;
  }
  int64_t Unpublished() {
    return *store::WithTx(*pool_, [](pqxx::work& tx) -> Result<int64_t> {
      return tx.exec1("SELECT count(*) FROM outbox WHERE published_at IS NULL")[0].as<int64_t>();
    });
  }
  testing::TestNats nats_;
  std::shared_ptr<messaging::Connection> conn_;
};

TEST_F(OutboxTest, EventsCommittedWhileRelayIsDownArriveOnceInOrder) {
  std::vector<std::string> ids;
  ids.reserve(20);
  for (int i = 0; i < 20; ++i) ids.push_back(Append(i));
  EXPECT_EQ(StreamCount(), 0u);
  outbox::Relay relay(dsn_, conn_, log_, nullptr);
  relay.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return Unpublished() == 0; }));
  EXPECT_EQ(StreamCount(), 20u);
  // Stream order = outbox order, and each message carries its event id as Nats-Msg-Id.
  std::atomic<int> idx{0};
  std::atomic<bool> in_order{true};
  messaging::Consumer reader(
      conn_, {"TEST_OUT", "reader", "gpuaas.v1.evt.test.>"},
      [&](const messaging::Delivery& d) {
        v1::Event ev;
        ev.ParseFromString(d.msg.data);
        const int i = idx++;
        if (ev.id() != ids[i] || d.msg.Header("Nats-Msg-Id") != ids[i] || ev.generation() != i ||
            ev.type() != "gpuaas.v1.test.node.registered") {
          in_order = false;
        }
        return messaging::HandlerResult::Ack();
      },
      log_);
  ASSERT_TRUE(reader.Start().ok());
  ASSERT_TRUE(testing::WaitFor([&] { return idx == 20; }));
  EXPECT_TRUE(in_order.load());
  relay.Stop();
}

// AppendMany: one statement for a batch's events; they are published in the order given, each
// with its binary payload intact (quotes, backslashes, braces and NUL bytes included).
TEST_F(OutboxTest, EventsAppendedTogetherArriveInTheGivenOrderWithTheirBytes) {
  // Valid UTF-8 (a string field), with every ASCII byte; the serialized events carry the rest
  // (tags, lengths, the ids' bytes).
  std::string bytes;
  for (int b = 0; b < 128; ++b) bytes += static_cast<char>(b);
  bytes += "\"\\{},é中";
  std::vector<v1::NodeSnapshot> data(5);
  std::vector<outbox::EventSpec> specs;
  for (int i = 0; i < 5; ++i) {
    data[i].mutable_node()->set_node_id("n" + std::to_string(i));
    data[i].mutable_node()->set_hostname(bytes.substr(0, size_t{50} * (i + 1)));
    specs.push_back(
        {"gpuaas.v1.evt.test.node.registered", "", "test/t1", "n", i, "", "", &data[i]});
  }
  std::vector<std::string> ids;
  auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    auto many = outbox::AppendMany(tx, specs);
    if (!many.ok()) return many.error();
    ids = *many;
    return Ok();
  });
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  ASSERT_EQ(ids.size(), 5U);
  outbox::Relay relay(dsn_, conn_, log_, nullptr);
  relay.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return Unpublished() == 0; }));
  const auto published = testing::ReadStream(*conn_, "TEST_OUT");
  ASSERT_EQ(published.size(), 5U);
  for (size_t i = 0; i < published.size(); ++i) {
    const v1::Event& ev = published[i].event;
    EXPECT_EQ(ev.id(), ids[i]);
    EXPECT_EQ(ev.generation(), static_cast<int64_t>(i));
    v1::NodeSnapshot got;
    ASSERT_TRUE(ev.data().UnpackTo(&got));
    EXPECT_EQ(got.node().hostname(), data[i].node().hostname()) << i;
  }
  relay.Stop();
  // A subject outside the outbox's: nothing written.
  specs[2].nats_subject = "gpuaas.v1.test.other";
  auto bad = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<void> {
    auto many = outbox::AppendMany(tx, specs);
    if (!many.ok()) return many.error();
    return Ok();
  });
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "bad_event_subject");
}

TEST_F(OutboxTest, CrashBetweenPublishAndMarkStillDeliversExactlyOnce) {
  Append(1);
  {
    outbox::Relay crashing(dsn_, conn_, log_, nullptr);
    std::atomic<int> published{0};
    crashing.after_publish = [&](const std::string&) {
      published++;
      throw std::runtime_error("relay killed after publish, before mark");
    };
    crashing.Start();
    ASSERT_TRUE(testing::WaitFor([&] { return published > 0; }));
    crashing.Stop(false, 0ms);
  }
  EXPECT_EQ(Unpublished(), 1);  // the mark never happened
  EXPECT_EQ(StreamCount(), 1u);
  outbox::Relay restarted(dsn_, conn_, log_, nullptr);
  restarted.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return Unpublished() == 0; }));
  EXPECT_EQ(StreamCount(), 1u);  // re-published, de-duplicated by Nats-Msg-Id
  restarted.Stop();
}

TEST_F(OutboxTest, TwoRelaysPublishEachEventOnce) {
  outbox::Relay a(dsn_, conn_, log_, nullptr);
  outbox::Relay b(dsn_, conn_, log_, nullptr);
  a.Start();
  b.Start();
  std::vector<std::thread> writers;
  writers.reserve(4);
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&, w] {
      for (int i = 0; i < 25; ++i) Append(w * 100 + i);
    });
  }
  for (auto& t : writers) t.join();
  ASSERT_TRUE(testing::WaitFor([&] { return Unpublished() == 0; }));
  a.Stop();
  b.Stop();
  EXPECT_EQ(StreamCount(), 100u);
  EXPECT_EQ(a.Published() + b.Published(), 100u);
}

TEST_F(OutboxTest, StandbyRelayTakesOverWhenTheLeaderStops) {
  auto a = std::make_unique<outbox::Relay>(dsn_, conn_, log_, nullptr);
  auto b = std::make_unique<outbox::Relay>(dsn_, conn_, log_, nullptr);
  a->Start();
  b->Start();
  for (int i = 0; i < 10; ++i) Append(i);
  ASSERT_TRUE(testing::WaitFor([&] { return Unpublished() == 0; }));
  // Exactly one of them published; stop that one.
  ASSERT_TRUE((a->Published() == 10) != (b->Published() == 10));
  auto& leader = a->Published() == 10 ? a : b;
  auto& standby = a->Published() == 10 ? b : a;
  leader->Stop();
  leader.reset();
  for (int i = 10; i < 20; ++i) Append(i);
  ASSERT_TRUE(testing::WaitFor([&] { return Unpublished() == 0; }, 10s));
  EXPECT_EQ(standby->Published(), 10u);
  EXPECT_EQ(StreamCount(), 20u);
  standby->Stop();
}

TEST_F(OutboxTest, RelayResumesAfterPostgresRestart) {
  outbox::Relay relay(dsn_, conn_, log_, nullptr);
  relay.Start();
  Append(1);
  ASSERT_TRUE(testing::WaitFor([&] { return StreamCount() == 1; }));
  testing::SharedPostgres().Stop();
  std::this_thread::sleep_for(300ms);
  testing::SharedPostgres().Start();
  Append(2);  // the pool drops the dead connection and reconnects
  EXPECT_TRUE(testing::WaitFor([&] { return StreamCount() == 2; }, 15s));
  relay.Stop();
}

TEST_F(OutboxTest, InboxMakesRedeliveryANoOp) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  auto stats = std::make_shared<inbox::ProjectionStats>();
  auto handler = inbox::ProjectionHandler(
      pool_, "test-projection",
      [](pqxx::work& tx, const v1::Event& ev) -> Result<void> {
        tx.exec_params(
            "INSERT INTO items (id, n) VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET n = items.n + "
            "1",
            ev.subject());
        return Ok();
      },
      log_, stats);
  v1::Event ev;
  ev.set_id("0190a6e2-7c1b-7abc-8def-0123456789ab");
  ev.set_subject("node-a");
  messaging::Delivery d;
  d.msg.data = ev.SerializeAsString();
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(handler(d).disposition, messaging::Disposition::kAck);
  }
  EXPECT_EQ(stats->applied.load(), 1u);
  EXPECT_EQ(stats->duplicates.load(), 2u);
  auto n = store::WithTx(*pool_, [](pqxx::work& tx) -> Result<int> {
    return tx.exec1("SELECT n FROM items WHERE id = 'node-a'")[0].as<int>();
  });
  EXPECT_EQ(*n, 1);
  // Malformed envelopes are rejected (dead-lettered), never applied.
  messaging::Delivery junk;
  junk.msg.data = std::string("\xff\x01", 2);
  EXPECT_EQ(handler(junk).disposition, messaging::Disposition::kReject);
}

// A fetched batch in one transaction: each event applied once (a duplicate in the batch or an
// event seen before is skipped), an undecodable one rejected; when one event cannot be applied,
// the batch path applies nothing and the one-by-one path applies the others and rejects just it.
TEST_F(OutboxTest, ABatchOfEventsIsAppliedInOneTransactionAndAFailureIsolatesOneEvent) {
  ASSERT_TRUE(store::Migrate(*pool_, "svc", kTestMigrations).ok());
  auto stats = std::make_shared<inbox::ProjectionStats>();
  std::atomic<int> transactions{0};
  inbox::ApplyFn apply = [](pqxx::work& tx, const v1::Event& ev) -> Result<void> {
    if (ev.subject() == "poison") return Error::InvalidArgument("poison", "never applies");
    tx.exec_params(
        "INSERT INTO items (id, n) VALUES ($1, 1) ON CONFLICT (id) DO UPDATE SET n = items.n + 1",
        ev.subject());
    return Ok();
  };
  inbox::BatchApplyFn apply_many = [&](pqxx::work& tx,
                                       const std::vector<const v1::Event*>& events) {
    transactions++;
    for (const v1::Event* e : events) {
      if (auto r = apply(tx, *e); !r.ok()) return r;
    }
    return Result<void>(Ok());
  };
  auto batch =
      inbox::ProjectionBatchHandler(pool_, "batch-projection", apply, apply_many, log_, stats);
  auto one = inbox::ProjectionHandler(pool_, "batch-projection", apply, log_, stats);
  auto delivery = [](const std::string& id, const std::string& subject) {
    v1::Event ev;
    ev.set_id(id);
    ev.set_subject(subject);
    messaging::Delivery d;
    d.msg.data = ev.SerializeAsString();
    return d;
  };
  auto count = [&](const std::string& id) {
    auto n = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<int> {
      auto r = tx.exec_params("SELECT n FROM items WHERE id = $1", id);
      return r.empty() ? 0 : r[0][0].as<int>();
    });
    return n.ok() ? *n : -1;
  };
  messaging::Delivery junk;
  junk.msg.data = std::string("\xff\x01", 2);
  const std::vector<messaging::Delivery> first = {
      delivery("0190a6e2-7c1b-7abc-8def-000000000001", "a"),
      delivery("0190a6e2-7c1b-7abc-8def-000000000002", "b"), junk,
      delivery("0190a6e2-7c1b-7abc-8def-000000000001", "a"),  // the same event again
      delivery("0190a6e2-7c1b-7abc-8def-000000000003", "c")};
  auto out = batch(first);
  ASSERT_EQ(out.size(), first.size());
  for (size_t i : {0, 1, 3, 4}) EXPECT_EQ(out[i].disposition, messaging::Disposition::kAck) << i;
  EXPECT_EQ(out[2].disposition, messaging::Disposition::kReject);
  EXPECT_EQ(transactions.load(), 1);
  EXPECT_EQ(count("a"), 1);
  EXPECT_EQ(count("b"), 1);
  EXPECT_EQ(count("c"), 1);
  EXPECT_EQ(stats->applied.load(), 3u);
  EXPECT_EQ(stats->duplicates.load(), 1u);

  // Seen before (a redelivered batch): nothing applied again.
  out = batch({first[0], first[1]});
  EXPECT_EQ(out[0].disposition, messaging::Disposition::kAck);
  EXPECT_EQ(count("a"), 1);

  const std::vector<messaging::Delivery> poisoned = {
      delivery("0190a6e2-7c1b-7abc-8def-000000000004", "d"),
      delivery("0190a6e2-7c1b-7abc-8def-000000000005", "poison"),
      delivery("0190a6e2-7c1b-7abc-8def-000000000006", "e")};
  out = batch(poisoned);
  for (const auto& r : out) EXPECT_EQ(r.disposition, messaging::Disposition::kRetry);
  EXPECT_EQ(count("d"), 0) << "the failed batch applied nothing";
  // What the consumer does next: each one on its own.
  EXPECT_EQ(one(poisoned[0]).disposition, messaging::Disposition::kAck);
  EXPECT_EQ(one(poisoned[1]).disposition, messaging::Disposition::kReject);
  EXPECT_EQ(one(poisoned[2]).disposition, messaging::Disposition::kAck);
  EXPECT_EQ(count("d"), 1);
  EXPECT_EQ(count("e"), 1);
  EXPECT_EQ(count("poison"), 0);
}

}  // namespace
}  // namespace gpuaas
