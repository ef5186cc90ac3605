// The node admin-state table (node_lifecycle.hpp), walked over every (state, event) pair and
// every context: a golden table pins each transition for two contexts, and properties that must
// hold for any transition (only active takes placements, a state change is announced, a no-op
// changes nothing, decommissioned is final, every refusal is structured) are checked for all.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/inventory/inventory_reasons.hpp"
#include "gpuaas/inventory/node_lifecycle.hpp"

namespace gpuaas::inventory::node_lifecycle {
namespace {

std::vector<Context> AllContexts() {
  std::vector<Context> out;
  for (int bits = 0; bits < 16; ++bits) {
    Context c;
    c.has_live_claims = (bits & 1) != 0;
    c.mode_change_open = (bits & 2) != 0;
    c.mode = (bits & 4) != 0 ? v1::CAPACITY_PROFILE_BAREMETAL : v1::CAPACITY_PROFILE_SLICE_VM;
    c.target = (bits & 8) != 0 ? v1::CAPACITY_PROFILE_BAREMETAL : v1::CAPACITY_PROFILE_SLICE_VM;
    out.push_back(c);
  }
  return out;
}

// "= <state>" for a no-op; "<state>[ start_mode][ mode <m>][ done][ approve][ retire]" for a
// change; the reason for a refusal.
std::string Render(const Result<Effects>& r, const Context& ctx) {
  if (!r.ok()) return std::string(r.error().reason);
  const Effects& fx = *r;
  if (fx.noop) return "= " + enums::Text(fx.state);
  std::string out = enums::Text(fx.state);
  if (fx.start_mode_change) out += " start_mode";
  if (fx.mode != ctx.mode) out += " mode " + enums::Text(fx.mode);
  if (fx.mode_change_done) out += " done";
  if (fx.slots_need_approval) out += " approve";
  if (fx.retire) out += " retire";
  return out;
}

using Golden = std::map<v1::NodeAdminState, std::vector<std::string>>;  // by kAllEvents order

void ExpectTable(const Context& ctx, const Golden& want) {
  for (const auto& [state, row] : want) {
    ASSERT_EQ(row.size(), std::size(kAllEvents));
    for (size_t i = 0; i < row.size(); ++i) {
      const Event e = kAllEvents[i];
      EXPECT_EQ(Render(Next(state, e, ctx), ctx), row[i])
          << enums::Text(state) << " + " << EventName(e);
    }
  }
}

// The rows no context changes: maintenance returns only through its checks; decommissioned is
// final.
const std::vector<std::string> kMaintenanceRow = {"illegal_transition",
                                                  "illegal_transition",
                                                  "= maintenance",
                                                  "= maintenance",
                                                  "active",
                                                  "= maintenance",
                                                  "illegal_transition",
                                                  "= maintenance",
                                                  "= maintenance",
                                                  "illegal_transition"};
const std::vector<std::string> kDecommissionedRow = {
    "illegal_transition", "illegal_transition", "= decommissioned",   "illegal_transition",
    "= decommissioned",   "= decommissioned",   "illegal_transition", "= decommissioned",
    "= decommissioned",   "illegal_transition"};

// drain, undrain, last_claim_released, enter_maintenance, checks_passed, checks_failed,
// change_mode, mode_applied, mode_failed, decommission
TEST(NodeLifecycleTest, AnIdleSliceNodeGoldenTable) {
  Context ctx;
  ctx.mode = v1::CAPACITY_PROFILE_SLICE_VM;
  ctx.target = v1::CAPACITY_PROFILE_BAREMETAL;
  const std::string ill = "illegal_transition";
  ExpectTable(ctx,
              {
                  {v1::NODE_ADMIN_STATE_ACTIVE,
                   {"drained", "= active", "= active", ill, "= active", "= active", ill, "= active",
                    "= active", ill}},
                  {v1::NODE_ADMIN_STATE_DRAINING,
                   {"= draining", "active", "drained", ill, "= draining", "= draining", ill,
                    "= draining", "= draining", ill}},
                  {v1::NODE_ADMIN_STATE_DRAINED,
                   {"= drained", "active", "= drained", "maintenance", "= drained", "= drained",
                    "drained start_mode", "= drained", "= drained", "decommissioned retire"}},
                  {v1::NODE_ADMIN_STATE_MAINTENANCE, kMaintenanceRow},
                  {v1::NODE_ADMIN_STATE_DECOMMISSIONED, kDecommissionedRow},
              });
}

TEST(NodeLifecycleTest, ABusyNodeWithAnOpenModeChangeGoldenTable) {
  Context ctx;
  ctx.has_live_claims = true;
  ctx.mode_change_open = true;
  ctx.mode = v1::CAPACITY_PROFILE_BAREMETAL;
  ctx.target = v1::CAPACITY_PROFILE_SLICE_VM;
  const std::string ill = "illegal_transition";
  const std::string busy = "mode_change_in_progress";
  ExpectTable(
      ctx, {
               {v1::NODE_ADMIN_STATE_ACTIVE,
                {"draining", "= active", "= active", ill, "= active", "= active", ill, "= active",
                 "= active", ill}},
               {v1::NODE_ADMIN_STATE_DRAINING,
                {"= draining", busy, "drained", ill, "= draining", "= draining", ill, "= draining",
                 "= draining", "node_has_live_claims"}},
               {v1::NODE_ADMIN_STATE_DRAINED,
                {"= drained", busy, "= drained", busy, "= drained", "= drained", busy,
                 "drained mode slice-vm done approve", "drained done", "node_has_live_claims"}},
               {v1::NODE_ADMIN_STATE_MAINTENANCE, kMaintenanceRow},
               {v1::NODE_ADMIN_STATE_DECOMMISSIONED, kDecommissionedRow},
           });
}

TEST(NodeLifecycleTest, EveryPairHasAnEffectOrAStructuredRefusal) {
  const std::set<std::string> refusals = {"illegal_transition", "mode_change_in_progress",
                                          "node_has_live_claims"};
  int pairs = 0;
  for (const auto& ctx : AllContexts()) {
    for (const auto state : kAllStates) {
      for (const auto e : kAllEvents) {
        ++pairs;
        const std::string where = fmt::format("{} + {}", enums::Text(state), EventName(e));
        auto r = Next(state, e, ctx);
        if (!r.ok()) {
          EXPECT_EQ(r.error().code, Code::kFailedPrecondition) << where;
          EXPECT_TRUE(refusals.count(std::string(r.error().reason))) << where;
          EXPECT_EQ(r.error().details.at("state"), enums::Text(state)) << where;
          EXPECT_EQ(r.error().details.at("event"), EventName(e)) << where;
          continue;
        }
        // Only an active node takes new placements.
        EXPECT_EQ(r->placeable, r->state == v1::NODE_ADMIN_STATE_ACTIVE) << where;
        // A no-op changes nothing; any change is announced.
        if (r->noop) {
          EXPECT_EQ(r->state, state) << where;
          EXPECT_EQ(r->mode, ctx.mode) << where;
          EXPECT_FALSE(r->announce || r->start_mode_change || r->retire || r->mode_change_done)
              << where;
        } else {
          EXPECT_TRUE(r->announce) << where;
        }
        // Decommissioned is final.
        if (state == v1::NODE_ADMIN_STATE_DECOMMISSIONED) {
          EXPECT_EQ(r->state, state) << where;
        }
        // A node with live claims is never drained, retired or mode-changed.
        if (ctx.has_live_claims) {
          EXPECT_FALSE(r->retire) << where;
          if (state == v1::NODE_ADMIN_STATE_ACTIVE) {
            EXPECT_NE(r->state, v1::NODE_ADMIN_STATE_DRAINED) << where;
          }
        }
        // The mode changes only on the agent's verified report of an open change.
        if (r->mode != ctx.mode) {
          EXPECT_EQ(e, Event::kModeApplied) << where;
          EXPECT_TRUE(ctx.mode_change_open) << where;
        }
      }
    }
  }
  EXPECT_EQ(pairs, 16 * 5 * 10);
}

// Every state is reachable from active, and from every non-final state active is reachable
// again (an operator can always bring a node back unless it is decommissioned).
TEST(NodeLifecycleTest, EveryStateIsReachableAndActiveIsReachableAgain) {
  auto successors = [](v1::NodeAdminState s) {
    std::set<v1::NodeAdminState> out;
    for (const auto& ctx : AllContexts()) {
      for (const auto e : kAllEvents) {
        auto r = Next(s, e, ctx);
        if (r.ok()) out.insert(r->state);
      }
    }
    return out;
  };
  auto reach = [&](v1::NodeAdminState from) {
    std::set<v1::NodeAdminState> seen = {from};
    std::vector<v1::NodeAdminState> todo = {from};
    while (!todo.empty()) {
      const auto s = todo.back();
      todo.pop_back();
      for (const auto n : successors(s)) {
        if (seen.insert(n).second) todo.push_back(n);
      }
    }
    return seen;
  };
  EXPECT_EQ(reach(v1::NODE_ADMIN_STATE_ACTIVE).size(), std::size(kAllStates));
  for (const auto s : kAllStates) {
    if (s == v1::NODE_ADMIN_STATE_DECOMMISSIONED) continue;
    EXPECT_TRUE(reach(s).count(v1::NODE_ADMIN_STATE_ACTIVE)) << enums::Text(s);
  }
  EXPECT_EQ(reach(v1::NODE_ADMIN_STATE_DECOMMISSIONED).size(), 1U);
}

}  // namespace
}  // namespace gpuaas::inventory::node_lifecycle
