#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "gpuaas/node_agent/agent/local_store.hpp"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

TEST(LocalStoreTest, PutGetSurvivesReopen) {
  auto dir = testing::MakeTempDir("gpuaas-store");
  {
    auto s = LocalStore::Open(dir);
    ASSERT_TRUE(s.ok());
    ASSERT_TRUE(s->Put("registration", {{"generation", 3}}).ok());
    ASSERT_TRUE(s->Put("lease.slot-1", {{"allocation", "a1"}}).ok());
  }
  auto s = LocalStore::Open(dir);
  ASSERT_TRUE(s.ok());
  auto v = s->Get("registration");
  ASSERT_TRUE(v.ok() && v->has_value());
  EXPECT_EQ((**v)["generation"], 3);
  EXPECT_EQ(s->Keys(), (std::vector<std::string>{"lease.slot-1", "registration"}));
  ASSERT_TRUE(s->Erase("lease.slot-1").ok());
  EXPECT_FALSE(s->Get("lease.slot-1")->has_value());
  std::filesystem::remove_all(dir);
}

TEST(LocalStoreTest, TornWriteLeavesOldValue) {
  auto dir = testing::MakeTempDir("gpuaas-store");
  auto s = LocalStore::Open(dir);
  ASSERT_TRUE(s->Put("k", {{"v", 1}}).ok());
  // A crash mid-write leaves only a partial temporary file beside the real one.
  std::ofstream(dir + "/k.json.tmp") << "{\"v\": 2";
  auto reopened = LocalStore::Open(dir);
  EXPECT_EQ((**reopened->Get("k"))["v"], 1);
  EXPECT_FALSE(std::filesystem::exists(dir + "/k.json.tmp"));
  std::filesystem::remove_all(dir);
}

TEST(LocalStoreTest, CorruptFileAndBadKeysAreErrorsNotCrashes) {
  auto dir = testing::MakeTempDir("gpuaas-store");
  auto s = LocalStore::Open(dir);
  std::ofstream(dir + "/bad.json") << "not json";
  auto v = s->Get("bad");
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.error().code, Code::kDataLoss);
  auto w = s->Put("../escape", {});
  ASSERT_FALSE(w.ok());
  EXPECT_EQ(w.error().reason, "invalid_key");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace gpuaas::node_agent
