#include "gpuaas/scheduler/placement.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace gpuaas::scheduler::placement {
namespace {

// The usual 8-GPU node: gpu0..gpu7, NUMA 0 holds gpu0-3, NUMA 1 gpu4-7, one PCIe switch per pair.
SlotView StdSlot(int i, const std::string& fabric = "infiniband") {
  return {"gpu" + std::to_string(i), i / 4, "sw" + std::to_string(i / 2), fabric};
}

// A node of the usual topology whose free slots are `free`; the others are slice-claimed.
NodeView StdNode(const std::string& id, const std::vector<int>& free,
                 const std::string& fabric = "infiniband") {
  NodeView node;
  node.node_id = id;
  node.free.reserve(free.size());
  for (const int i : free) {
    node.free.push_back(StdSlot(i, fabric));
  }
  node.total_slots = 8;
  node.claimed_slots = 8 - static_cast<int>(free.size());
  return node;
}

NodeView CleanNode(const std::string& id) { return StdNode(id, {0, 1, 2, 3, 4, 5, 6, 7}); }

std::vector<std::string> Ids(const std::vector<Choice>& choices) {
  std::vector<std::string> out;
  out.reserve(choices.size());
  for (const Choice& c : choices) {
    out.push_back(c.node_id);
  }
  return out;
}

Request Slice(int gpus, const std::string& fabric = "") { return {gpus, false, fabric}; }
// A slice whose slots must share one known NUMA node.
Request Local(int gpus, const std::string& fabric = "") { return {gpus, false, fabric, true}; }

// A fleet of usual nodes with a random part of their slots claimed, a few baremetal-claimed.
std::vector<NodeView> RandomFleet(int nodes, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<NodeView> fleet;
  for (int n = 0; n < nodes; ++n) {
    std::vector<int> free;
    const int occupancy = static_cast<int>(rng() % 9);  // claimed slots 0..8 on average 4
    for (int i = 0; i < 8; ++i) {
      if (static_cast<int>(rng() % 8) >= occupancy) {
        free.push_back(i);
      }
    }
    char id[32];
    std::snprintf(id, sizeof id, "node-%03d", n);
    NodeView node = StdNode(id, free);
    if (rng() % 20 == 0) {
      node = StdNode(id, {});
      node.claimed_slots = 0;
      node.baremetal_claimed = true;
    }
    fleet.push_back(node);
  }
  return fleet;
}

TEST(PlacementTest, SameInputInAnyOrderGivesSameRanking) {
  const std::vector<NodeView> fleet = RandomFleet(300, 7);
  std::mt19937 rng(11);
  for (const int gpus : {1, 2, 3, 4, 8}) {
    const std::vector<Choice> want = Rank(fleet, Slice(gpus), 25);
    ASSERT_FALSE(want.empty()) << gpus;
    for (int round = 0; round < 5; ++round) {
      std::vector<NodeView> shuffled = fleet;
      std::shuffle(shuffled.begin(), shuffled.end(), rng);
      for (NodeView& node : shuffled) {
        std::shuffle(node.free.begin(), node.free.end(), rng);
      }
      const std::vector<Choice> got = Rank(shuffled, Slice(gpus), 25);
      ASSERT_EQ(got.size(), want.size());
      for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].node_id, want[i].node_id) << gpus << " #" << i;
        EXPECT_EQ(got[i].slot_keys, want[i].slot_keys) << gpus << " #" << i;
        EXPECT_EQ(got[i].score, want[i].score) << gpus << " #" << i;
      }
    }
  }
}

TEST(PlacementTest, ScoreNeverDecreasesAlongTheResult) {
  const std::vector<NodeView> fleet = RandomFleet(300, 3);
  for (const Request& req : {Slice(1), Slice(2), Slice(4), Request{1, true, ""}}) {
    const std::vector<Choice> got = Rank(fleet, req, 1000);
    ASSERT_GT(got.size(), 1u);
    for (size_t i = 1; i < got.size(); ++i) {
      EXPECT_LE(got[i - 1].score, got[i].score) << i;
      if (got[i - 1].score == got[i].score) {
        EXPECT_LT(got[i - 1].node_id, got[i].node_id);
      }
    }
  }
}

TEST(PlacementTest, SmallSlicePrefersAlreadySlicedNodeOverCleanNode) {
  // "a-clean" would win a tie on node id; the sliced node must win on the score itself.
  const std::vector<Choice> got =
      Rank({CleanNode("a-clean"), StdNode("b-sliced", {1, 2, 3, 4, 5, 6, 7})}, Slice(1), 10);
  ASSERT_EQ(Ids(got), (std::vector<std::string>{"b-sliced", "a-clean"}));
  EXPECT_LT(got[0].score, got[1].score);

  // Between nodes of equal fragmentation increase and equal fit, the one that could not be sold as
  // baremetal anyway (here: a ninth slot unschedulable) goes first, whatever the ids say.
  NodeView ninth = CleanNode("b-ninth-slot-down");
  ninth.total_slots = 9;
  EXPECT_EQ(Ids(Rank({CleanNode("a-clean"), ninth}, Slice(1), 10)),
            (std::vector<std::string>{"b-ninth-slot-down", "a-clean"}));

  // A node without claims but with an unschedulable slot cannot be sold as baremetal either, so
  // it is not kept for baremetal.
  NodeView partial = StdNode("b-partial", {0, 1, 2, 3, 4, 5, 6});
  partial.claimed_slots = 0;
  EXPECT_EQ(Ids(Rank({CleanNode("a-clean"), partial}, Slice(1), 10)),
            (std::vector<std::string>{"b-partial", "a-clean"}));
}

TEST(PlacementTest, BestFitWinsWhenFragmentationIsEqual) {
  // 6 free: whole switches sw0, sw1 (NUMA 0) and sw2 (NUMA 1); 2 free: whole switch sw3. Taking a
  // whole switch pair changes the fragmentation of both by the same amount.
  const NodeView six = StdNode("a-six", {0, 1, 2, 3, 4, 5});
  const NodeView two = StdNode("b-two", {6, 7});
  const std::vector<Choice> got = Rank({six, two}, Slice(2), 10);
  ASSERT_EQ(Ids(got), (std::vector<std::string>{"b-two", "a-six"}));
  EXPECT_EQ(got[0].slot_keys, (std::vector<std::string>{"gpu6", "gpu7"}));
  // On the six-free node the pair comes from NUMA 1, keeping NUMA 0 whole for a 4-GPU request.
  EXPECT_EQ(got[1].slot_keys, (std::vector<std::string>{"gpu4", "gpu5"}));
}

TEST(PlacementTest, LowerFragmentationBeatsTighterFit) {
  // Plain best fit would take one GPU of the intact pair on "a" (1 left); taking the lone GPU of
  // "b" leaves a whole switch pair and an even count.
  const std::vector<Choice> got =
      Rank({StdNode("a-pair", {0, 1}), StdNode("b-three", {0, 1, 2})}, Slice(1), 10);
  ASSERT_EQ(Ids(got), (std::vector<std::string>{"b-three", "a-pair"}));
  EXPECT_EQ(got[0].slot_keys, (std::vector<std::string>{"gpu2"}));
}

TEST(PlacementTest, PicksSameSwitchGroupOverSplitGroup) {
  NodeView node;
  node.node_id = "n";
  node.total_slots = 8;
  // The split slots have the smaller keys, so only locality can make the switch group win.
  node.free = {{"a0", 1, "B", "roce"}, {"a1", 1, "C", "roce"}, {"a2", 1, "D", "roce"},
               {"a3", 1, "E", "roce"}, {"g4", 0, "A", "roce"}, {"g5", 0, "A", "roce"},
               {"g6", 0, "A", "roce"}, {"g7", 0, "A", "roce"}};
  EXPECT_EQ(PickSlots(node, Slice(4)), (std::vector<std::string>{"g4", "g5", "g6", "g7"}));
  const std::vector<Choice> got = Rank({node}, Slice(4), 1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].slot_keys, (std::vector<std::string>{"g4", "g5", "g6", "g7"}));
}

TEST(PlacementTest, BetterLocalityWinsWhenAllElseIsEqual) {
  // Same shape (one group of two slots), so the same fragmentation and the same fit.
  const auto pair = [](const std::string& id, int numa, const std::string& pcie_switch) {
    NodeView node;
    node.node_id = id;
    node.total_slots = 8;
    node.claimed_slots = 6;
    node.free = {{"gpu0", numa, pcie_switch, ""}, {"gpu1", numa, pcie_switch, ""}};
    return node;
  };
  const std::vector<Choice> got = Rank(
      {pair("a-unknown-numa", -1, "u"), pair("a-unknown-switch", 0, ""), pair("b-known", 0, "s")},
      Slice(2), 10);
  ASSERT_EQ(Ids(got), (std::vector<std::string>{"b-known", "a-unknown-switch", "a-unknown-numa"}));
  EXPECT_LT(got[0].score, got[1].score);
  EXPECT_LT(got[1].score, got[2].score);
}

TEST(PlacementTest, LocalityOrderIsSwitchThenNumaThenUnknownNumaThenAnywhere) {
  NodeView node;
  node.node_id = "n";
  node.total_slots = 8;
  const SlotView far0{"a0", 0, "s0", ""};  // alone on NUMA 0
  const SlotView unknown0{"b0", -1, "u", ""};
  const SlotView unknown1{"b1", -1, "u", ""};
  const SlotView numa1a{"c0", 1, "s1", ""};  // NUMA 1, two switches
  const SlotView numa1b{"c1", 1, "s2", ""};
  const SlotView switch3a{"d0", 1, "s3", ""};  // NUMA 1, one switch
  const SlotView switch3b{"d1", 1, "s3", ""};
  node.free = {far0, unknown0, unknown1, numa1a, numa1b, switch3a, switch3b};
  EXPECT_EQ(PickSlots(node, Slice(2)), (std::vector<std::string>{"d0", "d1"}));
  node.free = {far0, unknown0, unknown1, numa1a, numa1b};
  EXPECT_EQ(PickSlots(node, Slice(2)), (std::vector<std::string>{"c0", "c1"}));
  node.free = {far0, unknown0, unknown1, numa1a};
  EXPECT_EQ(PickSlots(node, Slice(2)), (std::vector<std::string>{"b0", "b1"}));
  node.free = {far0, unknown0, numa1a};
  EXPECT_EQ(PickSlots(node, Slice(2)), (std::vector<std::string>{"a0", "b0"}));
  EXPECT_EQ(PickSlots(node, Slice(3)), (std::vector<std::string>{"a0", "b0", "c0"}));
  EXPECT_TRUE(PickSlots(node, Slice(4)).empty());
}

TEST(PlacementTest, SameLocalityGroupsArePickedToLeaveLeastFragmentation) {
  // One GPU: gpu0/gpu1 form a whole pair on sw0, gpu2 is alone on sw1 (gpu3 claimed). The lone
  // GPU goes first although gpu0 has the smaller key.
  EXPECT_EQ(PickSlots(StdNode("n", {0, 1, 2}), Slice(1)), (std::vector<std::string>{"gpu2"}));
  // Three GPUs inside NUMA 0 (no switch has three): pairs on A and B, one GPU on C. Taking C's
  // GPU and a whole pair leaves the other pair whole; the smallest keys (a0 a1 b0) would not.
  NodeView node;
  node.node_id = "n";
  node.total_slots = 8;
  node.free = {{"a0", 0, "A", ""}, {"a1", 0, "A", ""}, {"b0", 0, "B", ""},
               {"b1", 0, "B", ""}, {"z0", 0, "C", ""}, {"y0", 1, "D", ""}};
  EXPECT_EQ(PickSlots(node, Slice(3)), (std::vector<std::string>{"a0", "a1", "z0"}));
  // Equal groups: the smallest keys win.
  EXPECT_EQ(PickSlots(CleanNode("n"), Slice(2)), (std::vector<std::string>{"gpu0", "gpu1"}));
}

TEST(PlacementTest, ManyDomainsFallBackToAGreedyFillOfTheSmallestDomains) {
  // 6 switches with 2 free on NUMA 0 and 6 with 1 free on NUMA 1: 14 GPUs fit in no NUMA node,
  // and there are too many ways to split them to try each. The single GPUs go first (they are
  // the fragments), then whole pairs in switch order.
  NodeView node;
  node.node_id = "big";
  node.total_slots = 18;
  std::vector<std::string> want;
  for (int s = 0; s < 6; ++s) {
    for (int i = 0; i < 2; ++i) {
      const std::string key = "a" + std::to_string(s) + std::to_string(i);
      node.free.push_back({key, 0, "s" + std::to_string(s), ""});
      if (s < 4) {
        want.push_back(key);
      }
    }
    const std::string key = "z" + std::to_string(s);
    node.free.push_back({key, 1, "t" + std::to_string(s), ""});
    want.push_back(key);
  }
  std::sort(want.begin(), want.end());
  EXPECT_EQ(PickSlots(node, Slice(14)), want);
  std::mt19937 rng(1);
  for (int round = 0; round < 5; ++round) {
    std::shuffle(node.free.begin(), node.free.end(), rng);
    EXPECT_EQ(PickSlots(node, Slice(14)), want);
  }
}

TEST(PlacementTest, FabricFilter) {
  const NodeView roce = StdNode("a-roce", {0, 1, 2, 3}, "roce");
  const NodeView ib = StdNode("b-ib", {0, 1, 2, 3}, "infiniband");
  EXPECT_EQ(Ids(Rank({roce, ib}, Slice(2, "infiniband"), 10)), (std::vector<std::string>{"b-ib"}));
  EXPECT_EQ(Ids(Rank({roce, ib}, Slice(2, "roce"), 10)), (std::vector<std::string>{"a-roce"}));
  EXPECT_EQ(Rank({roce, ib}, Slice(2), 10).size(), 2u);
  EXPECT_TRUE(Rank({roce, ib}, Slice(2, "nvlink"), 10).empty());

  // Mixed node: only the matching slots count, even when others have better locality.
  NodeView mixed = StdNode("m", {0, 1, 2, 3});
  mixed.free[0].fabric_type = "roce";
  mixed.free[1].fabric_type = "roce";
  EXPECT_EQ(PickSlots(mixed, Slice(2, "infiniband")), (std::vector<std::string>{"gpu2", "gpu3"}));
  EXPECT_TRUE(PickSlots(mixed, Slice(3, "infiniband")).empty());
  EXPECT_TRUE(PickSlots(mixed, Slice(3, "roce")).empty());
  EXPECT_EQ(PickSlots(mixed, Slice(3)).size(), 3u);

  // Baremetal needs every slot of the fabric.
  NodeView clean_mixed = CleanNode("c");
  clean_mixed.free[7].fabric_type = "roce";
  EXPECT_TRUE(Rank({clean_mixed}, Request{8, true, "infiniband"}, 10).empty());
  EXPECT_EQ(Rank({clean_mixed}, Request{8, true, ""}, 10).size(), 1u);
}

TEST(PlacementTest, BaremetalOnlyOnWholeFreeUnclaimedNodes) {
  NodeView small = StdNode("c-small", {0, 1, 2, 3});
  small.total_slots = 4;
  small.claimed_slots = 0;
  NodeView bm = CleanNode("bm");  // free rows still listed, but the node is sold whole
  bm.baremetal_claimed = true;
  NodeView unschedulable = StdNode("u", {0, 1, 2, 3, 4, 5, 6});
  unschedulable.claimed_slots = 0;  // gpu7 is unschedulable, not claimed
  NodeView empty;
  empty.node_id = "e";
  NodeView racing = CleanNode("r");  // a claim whose slot rows do not show it yet
  racing.claimed_slots = 1;
  const std::vector<NodeView> nodes{CleanNode("a-clean"),
                                    StdNode("s-sliced", {1, 2, 3, 4, 5}),
                                    bm,
                                    small,
                                    unschedulable,
                                    empty,
                                    racing};
  const std::vector<Choice> got = Rank(nodes, Request{1, true, ""}, 10);
  ASSERT_EQ(Ids(got), (std::vector<std::string>{"c-small", "a-clean"}));  // smallest first
  EXPECT_TRUE(got[0].slot_keys.empty());
  EXPECT_LT(got[0].score, got[1].score);
  EXPECT_EQ(Ids(Rank(nodes, Request{8, true, ""}, 10)), (std::vector<std::string>{"a-clean"}));
  EXPECT_TRUE(Rank(nodes, Request{9, true, ""}, 10).empty());
}

TEST(PlacementTest, SlicesNeverOnBaremetalClaimedNodes) {
  NodeView bm = CleanNode("a-bm");
  bm.baremetal_claimed = true;
  EXPECT_TRUE(PickSlots(bm, Slice(1)).empty());
  for (const int gpus : {1, 2, 4, 8}) {
    EXPECT_EQ(Ids(Rank({bm, StdNode("b", {0, 1, 2, 3, 4, 5, 6, 7})}, Slice(gpus), 10)),
              (std::vector<std::string>{"b"}))
        << gpus;
  }
  EXPECT_TRUE(Rank({bm}, Slice(1), 10).empty());
}

TEST(PlacementTest, RequestBiggerThanAnyNodeGivesNothing) {
  const std::vector<NodeView> fleet{CleanNode("a"), CleanNode("b"), StdNode("c", {0, 1, 2})};
  EXPECT_TRUE(Rank(fleet, Slice(9), 10).empty());
  EXPECT_TRUE(Rank(fleet, Request{9, true, ""}, 10).empty());
  EXPECT_TRUE(PickSlots(CleanNode("a"), Slice(9)).empty());
  EXPECT_TRUE(Rank(fleet, Slice(0), 10).empty());
  EXPECT_TRUE(Rank({}, Slice(1), 10).empty());
}

TEST(PlacementTest, MultiGpuRequestNeverSpansNodes) {
  // Per-node keys so that a slot of one node cannot pass for a slot of another.
  std::vector<NodeView> fleet = RandomFleet(200, 5);
  for (NodeView& node : fleet) {
    for (SlotView& slot : node.free) {
      slot.slot_key = node.node_id + "/" + slot.slot_key;
    }
  }
  for (const int gpus : {2, 3, 4, 5, 8}) {
    const std::vector<Choice> got = Rank(fleet, Slice(gpus), 1000);
    ASSERT_FALSE(got.empty()) << gpus;
    for (const Choice& choice : got) {
      const auto node = std::find_if(fleet.begin(), fleet.end(), [&](const NodeView& n) {
        return n.node_id == choice.node_id;
      });
      ASSERT_NE(node, fleet.end());
      ASSERT_EQ(choice.slot_keys.size(), static_cast<size_t>(gpus));
      std::set<std::string> free_keys;
      for (const SlotView& slot : node->free) {
        free_keys.insert(slot.slot_key);
      }
      const std::set<std::string> picked(choice.slot_keys.begin(), choice.slot_keys.end());
      EXPECT_EQ(picked.size(), choice.slot_keys.size()) << "duplicate slot";
      for (const std::string& key : picked) {
        EXPECT_TRUE(free_keys.count(key)) << key;
      }
      EXPECT_FALSE(node->baremetal_claimed);
    }
    // Every node that can hold the request is listed, and no other.
    size_t fitting = 0;
    for (const NodeView& node : fleet) {
      if (!node.baremetal_claimed && node.free.size() >= static_cast<size_t>(gpus)) {
        ++fitting;
      }
    }
    EXPECT_EQ(got.size(), fitting) << gpus;
  }
}

// A node of the heterogeneous P4 fleet with 4 GPUs: NUMA 0 holds g0-1, NUMA 1 g2-3, one switch per
// pair. No NUMA-local 4-GPU request and no 8-GPU request can ever use it.
NodeView SmallNode(const std::string& id, const std::string& fabric = "roce") {
  NodeView node;
  node.node_id = id;
  node.total_slots = 4;
  for (int i = 0; i < 4; ++i) {
    node.free.push_back({"g" + std::to_string(i), i / 2, "sw" + std::to_string(i / 2), fabric});
  }
  return node;
}

TEST(PlacementTest, SmallSlicesFillASmallNodeBeforeBreakingAWholeNumaNode) {
  // "a-big" has NUMA 0 in use and NUMA 1 whole: the only place left there for a NUMA-local
  // 4-GPU request. A 1- or 2-GPU slice goes to the small whole node instead, although it is
  // clean (could be sold as baremetal) and "a-big" sorts first; until 2026-11-28 the
  // bare-metal bit came first and the slice broke NUMA 1.
  for (const Request& req : {Slice(1, "roce"), Local(2, "roce"), Slice(2, "roce")}) {
    const std::vector<Choice> got =
        Rank({StdNode("a-big", {4, 5, 6, 7}, "roce"), SmallNode("b-small")}, req, 10);
    ASSERT_EQ(Ids(got), (std::vector<std::string>{"b-small", "a-big"})) << req.gpus;
    EXPECT_LT(got[0].score, got[1].score);
  }
  // A NUMA-local 4-GPU request cannot use the small node at all, and takes the whole NUMA node.
  const std::vector<Choice> four =
      Rank({StdNode("a-big", {4, 5, 6, 7}, "roce"), SmallNode("b-small")}, Local(4, "roce"), 10);
  ASSERT_EQ(Ids(four), (std::vector<std::string>{"a-big"}));
  EXPECT_EQ(four[0].slot_keys, (std::vector<std::string>{"gpu4", "gpu5", "gpu6", "gpu7"}));
}

TEST(PlacementTest, ASliceKeepsWholeNumaNodesAndWholeNodesFree) {
  // A pair lands inside the NUMA node that is already broken (gpu0-1 free on NUMA 0) rather than
  // in a whole NUMA node, on a node that is not whole, rather than on a whole node.
  const std::vector<Choice> got = Rank({CleanNode("a-whole"), StdNode("b-whole-numa", {4, 5, 6, 7}),
                                        StdNode("c-broken-numa", {0, 1, 4, 5, 6, 7})},
                                       Slice(2), 10);
  ASSERT_EQ(Ids(got), (std::vector<std::string>{"c-broken-numa", "b-whole-numa", "a-whole"}));
  EXPECT_EQ(got[0].slot_keys, (std::vector<std::string>{"gpu0", "gpu1"}));
  // Within one node, a single GPU comes from the NUMA node that is already broken.
  EXPECT_EQ(PickSlots(StdNode("n", {2, 4, 5, 6, 7}), Slice(1)), (std::vector<std::string>{"gpu2"}));
}

TEST(PlacementTest, FragmentationHandComputedCases) {
  // S(n) = 3/4 sum_numa (c mod n) + 1/4 sum_switch (c mod n)
  const auto slots = [](const std::vector<int>& idx) {
    std::vector<SlotView> out;
    out.reserve(idx.size());
    for (const int i : idx) {
      out.push_back(StdSlot(i));
    }
    return out;
  };
  EXPECT_DOUBLE_EQ(Fragmentation({}, DefaultMix()), 0.0);
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0, 1, 2, 3, 4, 5, 6, 7}), {{1, 1.0}, {2, 1.0}}), 0.0);
  // A lone GPU cannot serve a pair anywhere.
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0}), {{2, 1.0}}), 1.0);
  // Two GPUs on one NUMA node, different switches: only the switch level strands them.
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0, 2}), {{2, 1.0}}), 0.5);
  // Two GPUs on different NUMA nodes: no NUMA node can hold the pair -> 3/4 * 2 + 1/4 * 2.
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0, 4}), {{2, 1.0}}), 2.0);
  // 5 free for 4-GPU requests: NUMA 0+1, switches 2+2+1 -> 3/4 + 5/4.
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0, 1, 2, 3, 4}), {{4, 1.0}}), 2.0);
  // An idle node for 8-GPU requests: no NUMA node or switch holds 8 -> 3/4 * 8 + 8/4.
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0, 1, 2, 3, 4, 5, 6, 7}), {{8, 1.0}}), 8.0);
  // Default mix, gpu0-2 free: n=1 0; n=2 (3/4*1 + 1/4*1) = 1; n=4 and n=8 all 3.
  EXPECT_NEAR(Fragmentation(slots({0, 1, 2}), DefaultMix()), 0.3 * 1 + 0.2 * 3 + 0.1 * 3, 1e-12);
  // Sizes and probabilities that cannot occur are ignored.
  EXPECT_DOUBLE_EQ(Fragmentation(slots({0}), {{0, 1.0}, {-2, 1.0}, {2, 0.0}, {4, -1.0}}), 0.0);
  // Unknown NUMA is one group; its slots pair up there.
  EXPECT_DOUBLE_EQ(Fragmentation({{"x", -1, "", ""}, {"y", -1, "", ""}}, {{2, 1.0}}), 0.0);
  EXPECT_DOUBLE_EQ(Fragmentation({{"x", -1, "", ""}, {"y", -7, "p", ""}}, {{2, 1.0}}), 0.5);
}

TEST(PlacementTest, LimitIsHonoured) {
  const std::vector<NodeView> fleet = RandomFleet(100, 9);
  const std::vector<Choice> all = Rank(fleet, Slice(1), 100000);
  ASSERT_GT(all.size(), 20u);
  const std::vector<Choice> five = Rank(fleet, Slice(1), 5);
  ASSERT_EQ(five.size(), 5u);
  for (size_t i = 0; i < five.size(); ++i) {
    EXPECT_EQ(five[i].node_id, all[i].node_id);
    EXPECT_EQ(five[i].slot_keys, all[i].slot_keys);
  }
  EXPECT_TRUE(Rank(fleet, Slice(1), 0).empty());
  EXPECT_EQ(Rank(fleet, Request{1, true, ""}, 1).size(), 1u);
}

}  // namespace
}  // namespace gpuaas::scheduler::placement

namespace gpuaas::scheduler::placement {
namespace {

// A mixed fleet: usual nodes, unknown NUMA, RoCE, 4-slot hosts, unschedulable slots.
std::vector<NodeView> MixedFleet(int nodes, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<NodeView> fleet = RandomFleet(nodes, seed);
  for (auto& n : fleet) {
    switch (rng() % 6) {
      case 0:
        for (auto& s : n.free) s.numa = -1;
        break;
      case 1:
        for (auto& s : n.free) s.fabric_type = "roce";
        break;
      case 2:
        if (!n.free.empty()) {
          n.free.pop_back();  // one unschedulable slot: not sellable as baremetal
          n.claimed_slots = std::max(0, n.claimed_slots - 1);
        }
        break;
      case 3:
        n.total_slots = 4;
        n.claimed_slots = 0;
        n.free.resize(std::min<size_t>(n.free.size(), 4));
        n.claimed_slots = 4 - static_cast<int>(n.free.size());
        break;
      default:
        break;
    }
  }
  return fleet;
}

bool SameChoices(const std::vector<Choice>& a, const std::vector<Choice>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].node_id != b[i].node_id || a[i].slot_keys != b[i].slot_keys ||
        a[i].score != b[i].score) {
      return false;
    }
  }
  return true;
}

TEST(PlacementTest, ANumaLocalRequestTakesOneKnownNumaNodeOrNothing) {
  // 2 free on NUMA 0, 2 on NUMA 1, 2 of unknown NUMA.
  NodeView split{"split",
                 {{"a0", 0, "s0", ""},
                  {"a1", 0, "s0", ""},
                  {"b0", 1, "s2", ""},
                  {"b1", 1, "s2", ""},
                  {"u0", -1, "", ""},
                  {"u1", -1, "", ""}},
                 8,
                 2,
                 false};
  EXPECT_EQ(PickSlots(split, Slice(4)).size(), 4u) << "preferred only: spans NUMA nodes";
  EXPECT_TRUE(PickSlots(split, Local(4)).empty()) << "no NUMA node has 4";
  EXPECT_EQ(PickSlots(split, Local(2)).size(), 2u);
  for (const auto& key : PickSlots(split, Local(2))) EXPECT_NE(key[0], 'u') << key;
  NodeView four{
      "four",
      {{"c0", 1, "s2", ""}, {"c1", 1, "s2", ""}, {"c2", 1, "s3", ""}, {"c3", 1, "s3", ""}},
      8,
      4,
      false};
  const auto ranked = Rank({split, four}, Local(4), 8);
  ASSERT_EQ(ranked.size(), 1u);
  EXPECT_EQ(ranked[0].node_id, "four");
  EXPECT_EQ(Rank({split, four}, Slice(4), 8).size(), 2u);
}

TEST(PlacementIndexTest, IndexRanksExactlyLikeRankOnRandomFleets) {
  for (unsigned seed = 1; seed <= 20; ++seed) {
    auto fleet = MixedFleet(300, seed);
    Index index;
    for (const auto& n : fleet) index.Upsert(n);
    ASSERT_EQ(index.size(), fleet.size());
    EXPECT_LT(index.buckets(), fleet.size()) << "nodes of one shape share a bucket";
    for (const Request& req :
         {Slice(1), Slice(2), Slice(4), Slice(8), Slice(2, "infiniband"), Slice(4, "roce"),
          Request{8, true, ""}, Request{4, true, "infiniband"}, Slice(16), Local(2), Local(4),
          Local(4, "infiniband")}) {
      for (size_t limit : {1u, 8u, 1000u}) {
        const auto want = Rank(fleet, req, limit);
        const auto got = index.Rank(req, limit);
        ASSERT_TRUE(SameChoices(want, got))
            << "seed " << seed << " gpus " << req.gpus << " baremetal " << req.baremetal
            << " limit " << limit << ": " << ::testing::PrintToString(Ids(want)) << " vs "
            << ::testing::PrintToString(Ids(got));
      }
    }
  }
}

TEST(PlacementIndexTest, UpdatesAndRemovalsKeepTheIndexExact) {
  std::mt19937 rng(7);
  auto fleet = MixedFleet(200, 7);
  Index index;
  for (const auto& n : fleet) index.Upsert(n);
  auto replacement = MixedFleet(200, 8);
  for (int step = 0; step < 400; ++step) {
    const size_t i = rng() % fleet.size();
    if (rng() % 5 == 0) {
      index.Remove(fleet[i].node_id);
      fleet.erase(fleet.begin() + static_cast<std::ptrdiff_t>(i));
    } else {
      NodeView changed = replacement[rng() % replacement.size()];
      changed.node_id = fleet[i].node_id;  // the node's slots changed (claims, health)
      fleet[i] = changed;
      index.Upsert(changed);
    }
    if (step % 40 == 0) {
      ASSERT_EQ(index.size(), fleet.size());
      for (int g : {1, 2, 4, 8}) {
        ASSERT_TRUE(SameChoices(Rank(fleet, Slice(g), 16), index.Rank(Slice(g), 16)))
            << "step " << step << " gpus " << g;
      }
    }
  }
  index.Remove("no-such-node");
  EXPECT_EQ(index.Find("no-such-node"), nullptr);
  ASSERT_FALSE(fleet.empty());
  EXPECT_NE(index.Find(fleet[0].node_id), nullptr);
}

}  // namespace
}  // namespace gpuaas::scheduler::placement
