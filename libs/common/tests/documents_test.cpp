// documents:: (versioned per-node documents and their acks) against a real PostgreSQL.
#include "gpuaas/common/documents.hpp"

#include <gtest/gtest.h>

#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "test_env.hpp"

namespace gpuaas {
namespace {

const documents::Tables kTables{"widget_documents", "widget_acks", "widget document"};

const std::vector<store::Migration> kMigrations = {
    {1, "0001_documents.sql",
     "CREATE TABLE widget_documents (node_id text NOT NULL, version bigint NOT NULL, "
     "doc jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(), "
     "PRIMARY KEY (node_id, version));"
     "CREATE TABLE widget_acks (node_id text PRIMARY KEY, applied_version bigint NOT NULL, "
     "blockers text[] NOT NULL DEFAULT '{}', acked_at timestamptz NOT NULL DEFAULT now());"},
};

v1::NodeNetworkDocument Doc(const std::string& bridge) {
  v1::NodeNetworkDocument d;
  d.set_node_id("node-a");
  d.set_bridge(bridge);
  d.set_subnet("10.100.0.0/24");
  return d;
}

class DocumentsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    pool_ = std::make_shared<store::Pool>(
        store::PoolOptions{testing::SharedPostgres().CreateDatabase("docs"), 2, 3000},
        log::Logger("test", "t1", log::Level::kWarn));
    ASSERT_TRUE(store::Migrate(*pool_, "docs", kMigrations).ok());
  }

  Result<int64_t> Publish(v1::NodeNetworkDocument& want, bool empty = false,
                          const std::string& node = "node-a") {
    return store::WithTx(
        *pool_, [&](pqxx::work& tx) { return documents::Publish(tx, kTables, node, want, empty); });
  }
  Result<int64_t> Load(int64_t version, v1::NodeNetworkDocument& out) {
    return store::WithTx(*pool_, [&](pqxx::work& tx) {
      return documents::Load(tx, kTables, "node-a", version, out);
    });
  }
  Result<documents::AckResult> Ack(int64_t version, const std::vector<std::string>& blockers) {
    return store::WithTx(*pool_, [&](pqxx::work& tx) {
      return documents::RecordAck(tx, kTables, "node-a", version, blockers);
    });
  }
  documents::AckState Acked() {
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<documents::AckState> {
      return documents::LoadAck(tx, kTables, "node-a");
    });
    EXPECT_TRUE(r.ok());
    return r.ok() ? *r : documents::AckState{};
  }
  int64_t Rows() {
    auto r = store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<int64_t> {
      return tx.exec("SELECT count(*) FROM widget_documents")[0][0].as<int64_t>();
    });
    return r.ok() ? *r : -1;
  }

  std::shared_ptr<store::Pool> pool_;
};

TEST_F(DocumentsTest, SameContentTwiceIsOneVersion) {
  auto first = Doc("br0");
  auto v1 = Publish(first);
  ASSERT_TRUE(v1.ok()) << v1.error().ToString();
  EXPECT_EQ(*v1, 1);
  EXPECT_EQ(first.version(), 1);
  EXPECT_TRUE(first.has_created_at());

  auto again = Doc("br0");
  auto v2 = Publish(again);
  ASSERT_TRUE(v2.ok()) << v2.error().ToString();
  EXPECT_EQ(*v2, 1);
  // The unchanged document is the stored one, created_at included.
  EXPECT_EQ(again.version(), 1);
  EXPECT_EQ(again.created_at().seconds(), first.created_at().seconds());
  EXPECT_EQ(again.created_at().nanos(), first.created_at().nanos());
  EXPECT_EQ(Rows(), 1);
}

TEST_F(DocumentsTest, ChangedContentIsTheNextVersion) {
  auto a = Doc("br0");
  ASSERT_TRUE(Publish(a).ok());
  auto b = Doc("br1");
  auto v = Publish(b);
  ASSERT_TRUE(v.ok()) << v.error().ToString();
  EXPECT_EQ(*v, 2);
  EXPECT_EQ(b.version(), 2);
  // Back to the first content: a third version, not a return to version 1.
  auto c = Doc("br0");
  EXPECT_EQ(*Publish(c), 3);
  // Another node's versions are its own.
  auto other = Doc("br0");
  EXPECT_EQ(*Publish(other, false, "node-b"), 1);
  EXPECT_EQ(Rows(), 4);
}

TEST_F(DocumentsTest, EmptyFirstDocumentIsNotWritten) {
  auto empty = Doc("");
  auto v = Publish(empty, true);
  ASSERT_TRUE(v.ok()) << v.error().ToString();
  EXPECT_EQ(*v, 0);
  EXPECT_EQ(Rows(), 0);
  // Once the node has a version, an empty document is a version like any other.
  auto full = Doc("br0");
  ASSERT_EQ(*Publish(full), 1);
  auto emptied = Doc("");
  EXPECT_EQ(*Publish(emptied, true), 2);
}

TEST_F(DocumentsTest, MessageWithoutVersionFieldsIsInternal) {
  v1::NodeTask task;  // no version / created_at
  auto r = store::WithTx(*pool_, [&](pqxx::work& tx) {
    return documents::Publish(tx, kTables, "node-a", task, false);
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kInternal);
  EXPECT_EQ(r.error().reason, "document_without_version");
  EXPECT_EQ(Rows(), 0);
}

TEST_F(DocumentsTest, LoadLatestSpecificAndMissing) {
  v1::NodeNetworkDocument none;
  auto before = Load(0, none);
  ASSERT_TRUE(before.ok()) << before.error().ToString();
  EXPECT_EQ(*before, 0);
  EXPECT_EQ(none.version(), 0);
  EXPECT_TRUE(none.bridge().empty());

  auto a = Doc("br0");
  ASSERT_TRUE(Publish(a).ok());
  auto b = Doc("br1");
  ASSERT_TRUE(Publish(b).ok());

  v1::NodeNetworkDocument latest;
  auto l = Load(0, latest);
  ASSERT_TRUE(l.ok()) << l.error().ToString();
  EXPECT_EQ(*l, 2);
  EXPECT_EQ(latest.version(), 2);
  EXPECT_EQ(latest.bridge(), "br1");

  v1::NodeNetworkDocument first;
  auto f = Load(1, first);
  ASSERT_TRUE(f.ok()) << f.error().ToString();
  EXPECT_EQ(*f, 2);
  EXPECT_EQ(first.version(), 1);
  EXPECT_EQ(first.bridge(), "br0");

  v1::NodeNetworkDocument missing;
  auto m = Load(3, missing);
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.error().code, Code::kNotFound);
  EXPECT_EQ(m.error().reason, "document_version_not_found");
  EXPECT_EQ(m.error().details.at("version"), "3");
  EXPECT_EQ(m.error().details.at("latest"), "2");
  EXPECT_NE(m.error().message.find("widget document"), std::string::npos);
}

TEST_F(DocumentsTest, AcksOnlyMoveForward) {
  EXPECT_EQ(Acked().applied_version, 0);
  EXPECT_FALSE(Acked().acked_at.has_value());
  auto a = Doc("br0");
  ASSERT_TRUE(Publish(a).ok());
  auto b = Doc("br1");
  ASSERT_TRUE(Publish(b).ok());

  auto two = Ack(2, {"masquerade_missing"});
  ASSERT_TRUE(two.ok()) << two.error().ToString();
  EXPECT_EQ(two->applied_version, 2);
  EXPECT_EQ(two->latest_version, 2);
  EXPECT_EQ(two->blockers, std::vector<std::string>{"masquerade_missing"});

  // A late ack of version 1 changes neither the version nor the blockers.
  auto late = Ack(1, {});
  ASSERT_TRUE(late.ok()) << late.error().ToString();
  EXPECT_EQ(late->applied_version, 2);
  EXPECT_EQ(late->blockers, std::vector<std::string>{"masquerade_missing"});

  // The same version again, repaired: its blockers replace the old ones.
  auto repaired = Ack(2, {});
  ASSERT_TRUE(repaired.ok()) << repaired.error().ToString();
  EXPECT_EQ(repaired->applied_version, 2);
  EXPECT_TRUE(repaired->blockers.empty());

  const auto state = Acked();
  EXPECT_EQ(state.applied_version, 2);
  EXPECT_TRUE(state.blockers.empty());
  EXPECT_TRUE(state.acked_at.has_value());
}

TEST_F(DocumentsTest, AckValidation) {
  auto a = Doc("br0");
  ASSERT_TRUE(Publish(a).ok());

  auto negative = Ack(-1, {});
  ASSERT_FALSE(negative.ok());
  EXPECT_EQ(negative.error().code, Code::kInvalidArgument);
  EXPECT_EQ(negative.error().reason, "invalid_version");

  auto bad = Ack(1, {"ok_one", "Not-Snake", "", std::string(65, 'a')});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, Code::kInvalidArgument);
  EXPECT_EQ(bad.error().reason, "invalid_blocker");
  EXPECT_EQ(bad.error().details.count("blockers[0]"), 0U);
  EXPECT_EQ(bad.error().details.count("blockers[1]"), 1U);
  EXPECT_EQ(bad.error().details.count("blockers[2]"), 1U);
  EXPECT_EQ(bad.error().details.count("blockers[3]"), 1U);

  auto ahead = Ack(2, {});
  ASSERT_FALSE(ahead.ok());
  EXPECT_EQ(ahead.error().code, Code::kInvalidArgument);
  EXPECT_EQ(ahead.error().reason, "unknown_version");
  EXPECT_EQ(ahead.error().details.at("version"), "2");
  EXPECT_EQ(ahead.error().details.at("latest"), "1");

  // Nothing refused was recorded.
  EXPECT_EQ(Acked().applied_version, 0);
  EXPECT_FALSE(Acked().acked_at.has_value());
}

}  // namespace
}  // namespace gpuaas
