#include <gtest/gtest.h>

#include <set>

#include "gpuaas/common/ids.hpp"

namespace gpuaas::ids {
namespace {

TEST(IdsTest, UuidV7FormatVersionAndOrder) {
  std::set<std::string> seen;
  std::string prev;
  for (int i = 0; i < 2000; ++i) {
    auto id = NewUuidV7();
    ASSERT_TRUE(IsUuid(id)) << id;
    EXPECT_EQ(id[14], '7');                                          // version
    EXPECT_NE(std::string("89ab").find(id[19]), std::string::npos);  // variant
    EXPECT_TRUE(seen.insert(id).second);
    // The 48-bit millisecond prefix never goes backwards.
    if (!prev.empty()) {
      EXPECT_LE(prev.substr(0, 13), id.substr(0, 13));
    }
    prev = id;
  }
  EXPECT_FALSE(IsUuid("not-a-uuid"));
  EXPECT_FALSE(IsUuid("0190a6e2-7c1b-7abc-8def-0123456789aZ"));
}

TEST(IdsTest, TraceparentRoundTrip) {
  auto tp = NewTraceparent();
  ASSERT_EQ(tp.size(), 55u);
  auto trace = TraceId(tp);
  ASSERT_EQ(trace.size(), 32u);
  auto child = ChildTraceparent(tp);
  EXPECT_EQ(TraceId(child), trace);
  EXPECT_NE(child, tp);
  EXPECT_EQ(TraceId("garbage"), "");
  EXPECT_EQ(TraceId("00-00000000000000000000000000000000-0000000000000001-01"), "");
  EXPECT_NE(TraceId(ChildTraceparent("garbage")), "");  // malformed parent: new trace
}

}  // namespace
}  // namespace gpuaas::ids
