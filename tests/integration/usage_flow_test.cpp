// The usage ledger behind the real scheduler: a slice released by its tenant and one
// force-released by an operator are each billed from the moment the scheduler made them active
// to the moment their release was asked for (the scheduler database's times: the transactions
// that wrote those steps of its timeline), with the claim snapshot of the allocation; the summary
// adds them up.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>

#include "gpuaas/usage/usage_policy.hpp"
#include "gpuaas/v1/usage.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

// When the allocation first entered `state`, as the scheduler's timeline says.
int64_t EnteredAt(testing::Platform& p, const std::string& id, v1::AllocationState state) {
  const auto timeline = p.Timeline(id);
  for (const auto& e : timeline.entries()) {
    if (e.state() == state) return usage::Micros(e.at());
  }
  return 0;
}

// The days around the allocation's last change (the records' days).
v1::ListUsageRequest PeriodAround(const v1::Allocation& a) {
  const int64_t now = usage::Micros(a.updated_at());
  v1::ListUsageRequest list;
  *list.mutable_from() = usage::Stamp(usage::DayStart(now) - usage::kDayUs);
  *list.mutable_to() = usage::Stamp(usage::DayStart(now) + 2 * usage::kDayUs);
  return list;
}

// The records of `list` once there are at least `n` (a failure, and what there was, if never).
v1::ListUsageResponse WaitRecords(testing::Platform& p, const v1::ListUsageRequest& list, int n) {
  v1::ListUsageResponse got;
  EXPECT_TRUE(testing::WaitFor([&] {
    auto l = p.Call<v1::ListUsageResponse>("gpuaas.v1.usage.record.list", list);
    if (l.ok()) got = *l;
    return l.ok() && l->records_size() >= n;
  })) << got.DebugString();
  return got;
}

TEST(UsageFlowTest, ReleasedSlicesAreBilledFromActiveToTheReleaseRequest) {
  testing::Platform p;
  p.Start();
  p.StartUsage();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  p.StartApprovedAgent("usage-node", "usage", 2);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());

  auto tenant = p.CreateSlice("usage-1", "usage", 1);
  ASSERT_TRUE(tenant.ok()) << tenant.error().ToString();
  auto forced = p.CreateSlice("usage-2", "usage", 1);
  ASSERT_TRUE(forced.ok()) << forced.error().ToString();
  for (const auto* a : {&*tenant, &*forced}) {
    p.WaitSettled(a->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
  }
  ASSERT_TRUE(p.Release(tenant->allocation_id(), "done").ok());
  ASSERT_TRUE(p.Release(forced->allocation_id(), "hung guest", true).ok());
  const auto released = p.WaitSettled(tenant->allocation_id(), v1::ALLOCATION_STATE_RELEASED);
  p.WaitSettled(forced->allocation_id(), v1::ALLOCATION_STATE_RELEASED);

  const v1::ListUsageRequest list = PeriodAround(released);
  const v1::ListUsageResponse got = WaitRecords(p, list, 2);
  ASSERT_EQ(got.records_size(), 2) << got.DebugString();
  int64_t total = 0;
  for (const auto& r : got.records()) {
    const bool is_forced = r.allocation_id() == forced->allocation_id();
    const auto& a = is_forced ? *forced : *tenant;
    SCOPED_TRACE(r.DebugString());
    EXPECT_EQ(r.kind(), v1::USAGE_KIND_BILLABLE);
    EXPECT_EQ(r.tenant(), "acme");
    EXPECT_EQ(r.sku(), "h200-sxm-slice");
    EXPECT_EQ(r.gpu_count(), 1);
    EXPECT_EQ(r.billable_unit(), "gpu_second");
    EXPECT_EQ(r.units_micro(), r.duration_us()) << "1 GPU";
    EXPECT_EQ(r.node_id(), "usage-node");
    ASSERT_EQ(r.slot_keys_size(), 1);
    EXPECT_EQ(r.slot_keys(0), a.slot_keys(0));
    // The snapshot's time is the moment its state change was written (clock_timestamp(), in
    // milliseconds); the timeline row of that step is written by the same transaction, a moment
    // before or after it.
    const int64_t active = EnteredAt(p, a.allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
    const int64_t releasing = EnteredAt(p, a.allocation_id(), v1::ALLOCATION_STATE_RELEASING);
    EXPECT_LT(std::llabs(usage::Micros(r.start()) - active), 1000000);
    EXPECT_LT(std::llabs(usage::Micros(r.end()) - releasing), 1000000);
    EXPECT_GT(r.duration_us(), 0);
    if (is_forced) {
      EXPECT_EQ(r.stop(), v1::USAGE_STOP_OPERATOR_RELEASE);
    }
    total += r.units_micro();
  }
  v1::UsageSummaryRequest sum;
  *sum.mutable_from() = list.from();
  *sum.mutable_to() = list.to();
  auto s = p.Call<v1::UsageSummaryResponse>("gpuaas.v1.usage.summary", sum);
  ASSERT_TRUE(s.ok()) << s.error().ToString();
  ASSERT_EQ(s->totals_size(), 1);
  EXPECT_EQ(s->totals(0).billable_units_micro(), total);
  EXPECT_EQ(s->totals(0).allocations(), 2);
}

// A SKU the catalog bills per node: the scheduler keeps the unit with the allocation and the
// ledger counts the allocation's seconds, not its GPUs'.
TEST(UsageFlowTest, ASkuBilledPerNodeIsBilledInNodeSeconds) {
  const std::string catalog = testing::MakeTempDir("gpuaas-catalog") + "/catalog.yaml";
  std::ofstream(catalog) << R"(skus:
  h200-sxm-slice:
    shape: gpu_slice
    gpu_sku: h200-sxm
    allowed_gpu_counts: [1, 2]
    network_modes: [private-nat]
    billable_unit: node_second
images:
  tiny-guest:
    url: file:///var/lib/gpuaas/images/tiny-guest.qcow2
    sha256: 0000000000000000000000000000000000000000000000000000000000000000
default_image: tiny-guest
)";
  testing::Platform p;
  p.Start({{"GPUAAS_SCHEDULER_CATALOG_FILE", catalog}});
  p.StartUsage();
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  p.StartApprovedAgent("node-billed", "per-node", 2);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto a = p.CreateSlice("per-node-1", "per-node", 2);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  EXPECT_EQ(a->billable_unit(), v1::BILLABLE_UNIT_NODE_SECOND);
  p.WaitSettled(a->allocation_id(), v1::ALLOCATION_STATE_ACTIVE);
  ASSERT_TRUE(p.Release(a->allocation_id(), "done").ok());
  const auto released = p.WaitSettled(a->allocation_id(), v1::ALLOCATION_STATE_RELEASED);
  const v1::ListUsageResponse got = WaitRecords(p, PeriodAround(released), 1);
  ASSERT_EQ(got.records_size(), 1) << got.DebugString();
  const auto& r = got.records(0);
  EXPECT_EQ(r.gpu_count(), 2);
  EXPECT_EQ(r.billable_unit(), "node_second");
  EXPECT_GT(r.duration_us(), 0);
  EXPECT_EQ(r.units_micro(), r.duration_us()) << "the allocation's seconds, not 2 x";
}

}  // namespace
}  // namespace gpuaas
