// Stranded capacity: the free GPUs no orderable slice can use, per node.
#include "gpuaas/scheduler/stranded.hpp"

#include <gtest/gtest.h>

namespace gpuaas::scheduler::placement {
namespace {

std::vector<SlotView> Free(int n, const std::string& fabric) {
  std::vector<SlotView> out;
  out.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) out.push_back({fabric + std::to_string(i), 0, "", fabric});
  return out;
}
std::vector<SlotView> Join(std::vector<SlotView> a, const std::vector<SlotView>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}
const OrderableShape kIbAll{"h200-sxm", "infiniband", {1, 2, 4, 8}};
const OrderableShape kIbEven{"h200-sxm", "infiniband", {2, 4, 8}};

TEST(StrandedTest, NothingIsStrandedWhenSingleGpusCanBeOrdered) {
  for (int n = 0; n <= 8; ++n) {
    EXPECT_EQ(StrandedGpus(Free(n, "infiniband"), {kIbAll}), 0) << n;
  }
}

TEST(StrandedTest, WhatEvenCountsCannotFillIsStranded) {
  EXPECT_EQ(StrandedGpus(Free(1, "infiniband"), {kIbEven}), 1);
  EXPECT_EQ(StrandedGpus(Free(3, "infiniband"), {kIbEven}), 1);
  EXPECT_EQ(StrandedGpus(Free(6, "infiniband"), {kIbEven}), 0);
  EXPECT_EQ(StrandedGpus(Free(7, "infiniband"), {kIbEven}), 1);
  // Only 8-GPU slices: 7 free GPUs are all stranded.
  EXPECT_EQ(StrandedGpus(Free(7, "infiniband"), {{"h200-sxm", "infiniband", {8}}}), 7);
  // 3-GPU and 5-GPU slices fill 8 (3 + 5) but not 7 (3 + 3, one left).
  const OrderableShape odd{"h200-sxm", "infiniband", {3, 5}};
  EXPECT_EQ(StrandedGpus(Free(8, "infiniband"), {odd}), 0);
  EXPECT_EQ(StrandedGpus(Free(7, "infiniband"), {odd}), 1);
}

TEST(StrandedTest, SlotsOfAFabricNothingIsSoldWithAreAllStranded) {
  const auto mixed = Join(Free(4, "infiniband"), Free(3, "roce"));
  EXPECT_EQ(StrandedGpus(mixed, {kIbAll}), 3);
  EXPECT_EQ(StrandedGpus(mixed, {}), 7) << "a catalog without slices sells none of them";
  // A RoCE shape too: each fabric is filled by its own shapes.
  EXPECT_EQ(StrandedGpus(mixed, {kIbAll, {"h200-sxm", "roce", {2}}}), 1);
}

TEST(StrandedTest, ShapesOfAnyFabricMayFillEverySlot) {
  const auto mixed = Join(Free(4, "infiniband"), Free(3, "roce"));
  EXPECT_EQ(StrandedGpus(mixed, {{"h200-sxm", "", {1}}}), 0);
  // Any-fabric 7s beat per-fabric 4s here; per-fabric 4s beat any-fabric 8s.
  EXPECT_EQ(StrandedGpus(mixed, {kIbEven, {"h200-sxm", "", {7}}}), 0);
  EXPECT_EQ(StrandedGpus(mixed, {kIbEven, {"h200-sxm", "", {8}}}), 3);
  // Within one fabric the two mix: IB's 4 by IB 4s, RoCE's 3 by an any-fabric 3.
  EXPECT_EQ(StrandedGpus(mixed, {kIbEven, {"h200-sxm", "", {3}}}), 0);
}

TEST(StrandedTest, AWholeNodeIsFreeOnlyWithNoClaimAndEverySlotSchedulable) {
  NodeView n;
  n.node_id = "n";
  n.total_slots = 8;
  n.free = Free(8, "infiniband");
  EXPECT_TRUE(WholeNodeFree(n));
  n.free.pop_back();
  EXPECT_FALSE(WholeNodeFree(n)) << "one slot unschedulable";
  n.free = Free(8, "infiniband");
  n.claimed_slots = 1;
  EXPECT_FALSE(WholeNodeFree(n));
  n.claimed_slots = 0;
  n.baremetal_claimed = true;
  EXPECT_FALSE(WholeNodeFree(n));
  EXPECT_FALSE(WholeNodeFree(NodeView{})) << "a node without slots is not a free node";
}

}  // namespace
}  // namespace gpuaas::scheduler::placement
