// The billing policy usage-policy/1 as pure functions: which snapshots start and stop billing,
// stranded time, cuts at midnight UTC, days closed by the horizon, corrections, duplicates, and
// the export's exact lines.
#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

#include "gpuaas/usage/usage_policy.hpp"

namespace gpuaas::usage {
namespace {

using google::protobuf::util::TimeUtil;

// 2026-11-27T00:00:00Z
constexpr int64_t kDay0 = int64_t{1795737600} * 1000000;
constexpr int64_t kSec = 1000000;
constexpr int64_t kHour = 3600 * kSec;

// The allocation's story, one snapshot at a time (generation counts up).
class Story {
 public:
  explicit Story(std::string id, int gpus = 2) {
    a_.set_allocation_id(std::move(id));
    a_.set_tenant("acme");
    a_.set_sku("h200-sxm-slice");
    a_.set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
    a_.set_gpu_count(gpus);
    a_.set_region("us-east-1");
    a_.set_pool("default");
    a_.set_node_id("gpu-01");
    a_.set_network_mode(v1::NETWORK_MODE_PRIVATE_NAT);
    a_.add_slot_keys("gpu-0000:18:00.0");
    a_.add_slot_keys("gpu-0000:2a:00.0");
  }
  // The next snapshot at `at`; claims in `phase` (UNSPECIFIED: none).
  std::vector<v1::UsageRecord> To(v1::AllocationState state, int64_t at,
                                  v1::ClaimPhase phase = v1::CLAIM_PHASE_UNSPECIFIED,
                                  const std::string& releaser_role = "") {
    a_.set_state(state);
    a_.set_generation(++gen_);
    *a_.mutable_updated_at() = Stamp(at);
    a_.clear_claims();
    if (phase != v1::CLAIM_PHASE_UNSPECIFIED) {
      for (const auto& k : a_.slot_keys()) {
        auto* c = a_.add_claims();
        c->set_slot_key(k);
        c->set_phase(phase);
      }
    }
    if (!releaser_role.empty()) {
      a_.mutable_release_requested_by()->set_subject("someone");
      a_.mutable_release_requested_by()->add_roles(releaser_role);
    }
    return Apply(m_, Snapshot{"ev-" + std::to_string(gen_), gen_, a_});
  }
  Meter& meter() { return m_; }
  const v1::Allocation& allocation() const { return a_; }
  void BillBy(v1::BillableUnit unit) { a_.set_billable_unit(unit); }

 private:
  v1::Allocation a_;
  Meter m_;
  int64_t gen_ = 0;
};

TEST(UsagePolicyTest, ActiveUntilTheReleaseRequestIsBilledInGpuSeconds) {
  Story s("a1");
  const int64_t t = kDay0 + 10 * kHour;
  EXPECT_TRUE(s.To(v1::ALLOCATION_STATE_RESERVED, t, v1::CLAIM_PHASE_RESERVED).empty());
  EXPECT_TRUE(s.To(v1::ALLOCATION_STATE_PROVISIONING, t + kSec).empty());
  EXPECT_TRUE(s.To(v1::ALLOCATION_STATE_ACTIVE, t + 10 * kSec, v1::CLAIM_PHASE_ACTIVE).empty());
  auto out =
      s.To(v1::ALLOCATION_STATE_RELEASING, t + 100 * kSec, v1::CLAIM_PHASE_RELEASING, "tenant");
  ASSERT_EQ(out.size(), 1U);
  const auto& r = out[0];
  EXPECT_EQ(r.record_id(), "a1/billable/2026-11-27");
  EXPECT_EQ(r.kind(), v1::USAGE_KIND_BILLABLE);
  EXPECT_EQ(r.duration_us(), 90 * kSec);
  EXPECT_EQ(r.units_micro(), 180 * kSec) << "2 GPUs x 90 s";
  EXPECT_EQ(r.stop(), v1::USAGE_STOP_RELEASE_REQUESTED);
  EXPECT_EQ(r.policy_version(), "usage-policy/1");
  EXPECT_EQ(r.billable_unit(), "gpu_second");
  ASSERT_EQ(r.gpu_pci_addresses_size(), 2);
  EXPECT_EQ(r.gpu_pci_addresses(0), "0000:18:00.0");
  ASSERT_EQ(r.event_ids_size(), 2);
  EXPECT_EQ(r.event_ids(0), "ev-3");
  EXPECT_EQ(r.event_ids(1), "ev-4");
  // The rest of the release bills nothing more.
  EXPECT_TRUE(
      s.To(v1::ALLOCATION_STATE_RELEASED, t + 110 * kSec, v1::CLAIM_PHASE_RELEASED).empty());
}

// A SKU billed per node (the catalog's node_second, carried by the allocation): the whole
// allocation's seconds, whatever its GPU count.
TEST(UsagePolicyTest, ASkuBilledPerNodeCountsTheAllocationsSecondsNotItsGpus) {
  Story s("a8", 8);
  s.BillBy(v1::BILLABLE_UNIT_NODE_SECOND);
  const int64_t t = kDay0 + 10 * kHour;
  EXPECT_TRUE(s.To(v1::ALLOCATION_STATE_ACTIVE, t, v1::CLAIM_PHASE_ACTIVE).empty());
  auto out =
      s.To(v1::ALLOCATION_STATE_RELEASING, t + 90 * kSec, v1::CLAIM_PHASE_RELEASING, "tenant");
  ASSERT_EQ(out.size(), 1U);
  EXPECT_EQ(out[0].billable_unit(), "node_second");
  EXPECT_EQ(out[0].gpu_count(), 8);
  EXPECT_EQ(out[0].units_micro(), 90 * kSec) << "one node x 90 s";
  EXPECT_NE(CsvLine(out[0]).find(",node_second,90.000000,"), std::string::npos) << CsvLine(out[0]);
}

TEST(UsagePolicyTest, NeverActiveIsNeverBilledAndBlockedClaimsAreStrandedNotBilled) {
  Story failed("a2", 1);
  const int64_t t = kDay0 + 3600 * kSec;
  EXPECT_TRUE(failed.To(v1::ALLOCATION_STATE_PROVISIONING, t).empty());
  EXPECT_TRUE(failed.To(v1::ALLOCATION_STATE_FAILED, t + 5 * kSec, v1::CLAIM_PHASE_CLEANUP_BLOCKED)
                  .empty());
  auto freed = failed.To(v1::ALLOCATION_STATE_FAILED, t + 3605 * kSec, v1::CLAIM_PHASE_RELEASED);
  ASSERT_EQ(freed.size(), 1U);
  EXPECT_EQ(freed[0].kind(), v1::USAGE_KIND_STRANDED);
  EXPECT_EQ(freed[0].record_id(), "a2/stranded/2026-11-27");
  EXPECT_EQ(freed[0].duration_us(), 3600 * kSec);
  EXPECT_EQ(freed[0].stop(), v1::USAGE_STOP_CLAIMS_FREED);

  Story early("a3");
  EXPECT_TRUE(early.To(v1::ALLOCATION_STATE_RESERVED, t).empty());
  EXPECT_TRUE(early.To(v1::ALLOCATION_STATE_RELEASING, t + kSec, {}, "tenant").empty());
  EXPECT_TRUE(early.To(v1::ALLOCATION_STATE_RELEASED, t + 2 * kSec).empty());
}

TEST(UsagePolicyTest, AForceReleaseAndAnHourCleanupBlockedAreRecordedApart) {
  Story s("a4");
  const int64_t t = kDay0 + 3600 * kSec;
  s.To(v1::ALLOCATION_STATE_ACTIVE, t, v1::CLAIM_PHASE_ACTIVE);
  auto stop =
      s.To(v1::ALLOCATION_STATE_RELEASING, t + 60 * kSec, v1::CLAIM_PHASE_RELEASING, "operator");
  ASSERT_EQ(stop.size(), 1U);
  EXPECT_EQ(stop[0].stop(), v1::USAGE_STOP_OPERATOR_RELEASE);
  EXPECT_EQ(stop[0].duration_us(), 60 * kSec);
  EXPECT_TRUE(
      s.To(v1::ALLOCATION_STATE_RELEASING, t + 70 * kSec, v1::CLAIM_PHASE_CLEANUP_BLOCKED).empty());
  auto freed = s.To(v1::ALLOCATION_STATE_RELEASED, t + 3670 * kSec, v1::CLAIM_PHASE_RELEASED);
  ASSERT_EQ(freed.size(), 1U);
  EXPECT_EQ(freed[0].kind(), v1::USAGE_KIND_STRANDED);
  EXPECT_EQ(freed[0].tenant(), "acme") << "whose it was, though never billed to it";
  EXPECT_EQ(freed[0].duration_us(), 3600 * kSec);
}

TEST(UsagePolicyTest, AnIntervalAcrossMidnightIsOneRecordPerDay) {
  Story s("a5");
  s.To(v1::ALLOCATION_STATE_ACTIVE, kDay0 + (86400 - 30) * kSec, v1::CLAIM_PHASE_ACTIVE);
  auto out = s.To(v1::ALLOCATION_STATE_RELEASING, kDay0 + (86400 + 60) * kSec, {}, "tenant");
  ASSERT_EQ(out.size(), 2U);
  EXPECT_EQ(out[0].record_id(), "a5/billable/2026-11-27");
  EXPECT_EQ(out[0].duration_us(), 30 * kSec);
  EXPECT_EQ(out[0].stop(), v1::USAGE_STOP_DAY_END);
  EXPECT_EQ(out[0].event_ids_size(), 1);
  EXPECT_EQ(out[1].record_id(), "a5/billable/2026-11-28");
  EXPECT_EQ(out[1].day(), "2026-11-28");
  EXPECT_EQ(out[1].duration_us(), 60 * kSec);
  EXPECT_EQ(out[1].stop(), v1::USAGE_STOP_RELEASE_REQUESTED);
}

TEST(UsagePolicyTest, DaysCloseOnlyOnceTheHorizonIsPastThemByTheLag) {
  Story s("a6");
  s.To(v1::ALLOCATION_STATE_ACTIVE, kDay0 + 10 * kHour, v1::CLAIM_PHASE_ACTIVE);
  const int64_t lag = 60 * kSec;
  // 30 s past the second midnight: within the lag, only the first day closes.
  auto first = CloseDays(s.meter(), CloseHorizon(kDay0 + 2 * kDayUs + 30 * kSec, lag));
  ASSERT_EQ(first.size(), 1U);
  EXPECT_EQ(first[0].day(), "2026-11-27");
  EXPECT_EQ(first[0].duration_us(), 14 * kHour);
  EXPECT_EQ(first[0].stop(), v1::USAGE_STOP_DAY_END);
  EXPECT_TRUE(CloseDays(s.meter(), CloseHorizon(kDay0 + 2 * kDayUs + 30 * kSec, lag)).empty());
  auto second = CloseDays(s.meter(), CloseHorizon(kDay0 + 2 * kDayUs + 90 * kSec, lag));
  ASSERT_EQ(second.size(), 1U);
  EXPECT_EQ(second[0].day(), "2026-11-28");
  EXPECT_EQ(second[0].duration_us(), kDayUs);
  auto last = s.To(v1::ALLOCATION_STATE_RELEASING, kDay0 + 2 * kDayUs + 5 * kHour, {}, "tenant");
  ASSERT_EQ(last.size(), 1U);
  EXPECT_EQ(last[0].day(), "2026-11-29");
  EXPECT_EQ(last[0].duration_us(), 5 * kHour);
}

TEST(UsagePolicyTest, AStopBeforeAClosedDayIsACorrectionNamingTheRecord) {
  Story s("a7", 1);
  s.To(v1::ALLOCATION_STATE_ACTIVE, kDay0 + 10 * kHour, v1::CLAIM_PHASE_ACTIVE);
  ASSERT_EQ(CloseDays(s.meter(), kDay0 + 2 * kDayUs).size(), 2U);
  // The release's transaction started before midnight and its event came after the close.
  auto out = s.To(v1::ALLOCATION_STATE_RELEASING, kDay0 + kDayUs - 10 * kSec, {}, "tenant");
  ASSERT_EQ(out.size(), 2U);
  EXPECT_EQ(out[0].kind(), v1::USAGE_KIND_CORRECTION);
  EXPECT_EQ(out[0].corrects(), "a7/billable/2026-11-27");
  EXPECT_EQ(out[0].record_id(), "a7/billable/2026-11-27/c1");
  EXPECT_EQ(out[0].duration_us(), 14 * kHour - 10 * kSec);
  EXPECT_EQ(out[1].corrects(), "a7/billable/2026-11-28");
  EXPECT_EQ(out[1].duration_us(), 0) << "the next day is corrected to nothing";
}

TEST(UsagePolicyTest, ADuplicateOrOlderSnapshotCountsNothing) {
  Story s("a8");
  s.To(v1::ALLOCATION_STATE_ACTIVE, kDay0, v1::CLAIM_PHASE_ACTIVE);
  v1::Allocation stop = s.allocation();
  stop.set_state(v1::ALLOCATION_STATE_RELEASING);
  stop.set_generation(2);
  *stop.mutable_updated_at() = Stamp(kDay0 + 50 * kSec);
  ASSERT_EQ(Apply(s.meter(), Snapshot{"ev-2", 2, stop}).size(), 1U);
  EXPECT_TRUE(Apply(s.meter(), Snapshot{"ev-2", 2, stop}).empty()) << "redelivered";
  stop.set_generation(1);
  EXPECT_TRUE(Apply(s.meter(), Snapshot{"ev-1", 1, stop}).empty()) << "older";
  EXPECT_EQ(OrderOf(s.meter(), Snapshot{"ev-1", 1, stop}), Order::kSeen);
  EXPECT_EQ(OrderOf(s.meter(), Snapshot{"ev-3", 3, stop}), Order::kNext);
  EXPECT_EQ(OrderOf(s.meter(), Snapshot{"ev-4", 4, stop}), Order::kAhead);
  EXPECT_TRUE(Apply(s.meter(), Snapshot{"ev-4", 4, stop}).empty()) << "ahead: applied later";
  EXPECT_EQ(s.meter().generation, 2);
}

TEST(UsagePolicyTest, ExportLinesHaveAStableColumnOrder) {
  Story s("0193a6f0-0000-7000-8000-000000000001");
  s.To(v1::ALLOCATION_STATE_ACTIVE, kDay0 + 3600 * kSec, v1::CLAIM_PHASE_ACTIVE);
  auto out = s.To(v1::ALLOCATION_STATE_RELEASING, kDay0 + 3690 * kSec + 250000, {}, "tenant");
  ASSERT_EQ(out.size(), 1U);
  EXPECT_EQ(CsvHeader(),
            "policy_version,record_id,kind,tenant,allocation_id,sku,shape,gpu_count,region,pool,"
            "node_id,slot_keys,gpu_pci_addresses,network_mode,endpoints,day,start,end,"
            "duration_s,billable_unit,units,stop,corrects,event_ids\r\n");
  EXPECT_EQ(CsvLine(out[0]),
            "usage-policy/1,0193a6f0-0000-7000-8000-000000000001/billable/2026-11-27,billable,"
            "acme,0193a6f0-0000-7000-8000-000000000001,h200-sxm-slice,gpu_slice,2,us-east-1,"
            "default,gpu-01,gpu-0000:18:00.0;gpu-0000:2a:00.0,0000:18:00.0;0000:2a:00.0,"
            "private-nat,,2026-11-27,2026-11-27T01:00:00.000000Z,2026-11-27T01:01:30.250000Z,"
            "90.250000,gpu_second,180.500000,release_requested,,ev-1;ev-2\r\n");
  EXPECT_EQ(JsonHeader().rfind("{\"policy_version\":\"usage-policy/1\",\"columns\":[", 0), 0U);
  EXPECT_EQ(JsonLine(out[0]).rfind("{\"policy_version\":\"usage-policy/1\",\"record_id\":", 0), 0U);
}

}  // namespace
}  // namespace gpuaas::usage
