// usage in-process against real NATS JetStream and PostgreSQL: scripted scheduler allocation
// events (with the database times the scheduler would have given them) become exactly the
// expected records and export lines; duplicates and redeliveries count nothing twice; a tenant
// sees only its own; bad periods and page tokens are structured errors; the export is paged;
// and a ledger rebuilt from the stream on an empty database exports the same bytes.
#include <gtest/gtest.h>

#include <algorithm>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/usage/usage_policy.hpp"
#include "gpuaas/usage/usage_service.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/usage.pb.h"
#include "load_config.hpp"
#include "test_env.hpp"

namespace gpuaas::usage {
namespace {

using namespace std::chrono_literals;

// 2026-11-27T00:00:00Z
constexpr int64_t kDay0 = int64_t{1795737600} * 1000000;
constexpr int64_t kSec = 1000000;
constexpr int64_t kHour = 3600 * kSec;

class UsageTest : public ::testing::Test {
 protected:
  void SetUp() override { Start(); }
  void Start() {
    if (dsn_.empty()) dsn_ = testing::SharedPostgres().CreateDatabase("usage");
    std::map<std::string, std::string> env = {
        {"GPUAAS_NATS_URL", nats_.url()},
        {"GPUAAS_POSTGRES_DSN", dsn_},
        {"GPUAAS_LOG_LEVEL", std::getenv("USAGE_TEST_LOG") ? "debug" : "error"}};
    for (const auto& [k, v] : nats_.Env("usage")) env[k] = v;
    svc_ = std::make_unique<UsageService>(LoadConfig<UsageConfig>(env));
    auto r = svc_->Start();
    ASSERT_TRUE(r.ok()) << r.error().ToString();
    ASSERT_TRUE(svc_->runtime().nats()->Flush(2000ms).ok());
    if (!conn_) {
      conn_ = nats_.Connect(testing::TestNats::kHarness);
      operator_ = nats_.Connect("operator");
      tenant_api_ = nats_.Connect("tenant-api");
    }
  }
  void TearDown() override { svc_->Shutdown(); }

  // What the scheduler's outbox relay publishes for one state change of `id`, at database time
  // `at`; `msg_id` other than the event id makes the stream hold it twice (a redelivery).
  void Publish(const std::string& id, const std::string& tenant, v1::AllocationState state,
               int64_t generation, int64_t at, v1::ClaimPhase phase,
               const std::string& releaser_role = "", const std::string& msg_id = "") {
    const v1::Event ev = Event(id, tenant, state, generation, at, phase, releaser_role);
    captured_.push_back(ev);
    if (capture_) return;
    auto r = messaging::JsPublish(*conn_, Subject(state), ev.SerializeAsString(),
                                  msg_id.empty() ? ev.id() : msg_id);
    ASSERT_TRUE(r.ok()) << r.error().ToString();
  }
  static std::string Subject(v1::AllocationState state) {
    return fmt::format("gpuaas.v1.evt.scheduler.allocation.{}", enums::Text(state));
  }
  static v1::Event Event(const std::string& id, const std::string& tenant,
                         v1::AllocationState state, int64_t generation, int64_t at,
                         v1::ClaimPhase phase, const std::string& releaser_role) {
    v1::AllocationSnapshot snap;
    auto* a = snap.mutable_allocation();
    a->set_allocation_id(id);
    a->set_tenant(tenant);
    a->set_sku("h200-sxm-slice");
    a->set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
    a->set_gpu_count(1);
    a->set_region("us-east-1");
    a->set_pool("default");
    a->set_node_id("gpu-01");
    a->set_network_mode(v1::NETWORK_MODE_PRIVATE_NAT);
    a->add_slot_keys("gpu-0000:18:00.0");
    a->set_state(state);
    a->set_generation(generation);
    *a->mutable_updated_at() = Stamp(at);
    if (phase != v1::CLAIM_PHASE_UNSPECIFIED) {
      auto* c = a->add_claims();
      c->set_slot_key("gpu-0000:18:00.0");
      c->set_phase(phase);
    }
    if (!releaser_role.empty()) a->mutable_release_requested_by()->add_roles(releaser_role);
    return outbox::MakeEvent({Subject(state), "", "scheduler/test", id, generation, id, "", &snap});
  }

  Result<v1::ExportUsageResponse> Export(rpc::Client c, const std::string& tenant, int64_t from,
                                         int64_t to, int page_size = 0,
                                         const std::string& token = "",
                                         v1::UsageFormat format = v1::USAGE_FORMAT_CSV) {
    v1::ExportUsageRequest req;
    req.set_tenant(tenant);
    *req.mutable_from() = Stamp(from);
    *req.mutable_to() = Stamp(to);
    req.set_format(format);
    req.set_page_size(page_size);
    req.set_page_token(token);
    return c.Call<v1::ExportUsageResponse>("gpuaas.v1.usage.record.export", req, 10s);
  }
  // The whole export of the period, page by page.
  std::string ExportAll(int64_t from, int64_t to, int page_size) {
    std::string out, token;
    do {
      auto page = Export(rpc::Client(operator_), "", from, to, page_size, token);
      EXPECT_TRUE(page.ok()) << page.error().ToString();
      if (!page.ok()) return out;
      out += page->content();
      token = page->next_page_token();
    } while (!token.empty());
    return out;
  }
  int Records(int64_t from, int64_t to) {
    v1::ListUsageRequest req;
    *req.mutable_from() = Stamp(from);
    *req.mutable_to() = Stamp(to);
    auto l =
        rpc::Client(operator_).Call<v1::ListUsageResponse>("gpuaas.v1.usage.record.list", req, 10s);
    EXPECT_TRUE(l.ok()) << l.error().ToString();
    return l.ok() ? l->records_size() : -1;
  }
  rpc::Client Tenant(const std::string& tenant) {
    rpc::Client c(tenant_api_);
    c.WithToken(nats_.Token("tenant", tenant, fmt::format("tenant:{}/alice", tenant)));
    return c;
  }

  // The golden story: six allocations, two tenants.
  void PublishStory() {
    const int64_t t = kDay0 + 10 * kHour;
    using S = v1::AllocationState;
    // active for 90 s
    Publish(a90_, "acme", S::ALLOCATION_STATE_PROVISIONING, 1, t, v1::CLAIM_PHASE_PROVISIONING);
    Publish(a90_, "acme", S::ALLOCATION_STATE_ACTIVE, 2, t + 10 * kSec, v1::CLAIM_PHASE_ACTIVE);
    Publish(a90_, "acme", S::ALLOCATION_STATE_RELEASING, 3, t + 100 * kSec,
            v1::CLAIM_PHASE_RELEASING, "tenant");
    Publish(a90_, "acme", S::ALLOCATION_STATE_RELEASED, 4, t + 110 * kSec,
            v1::CLAIM_PHASE_RELEASED);
    // a redelivery of its release request (the stream holds it twice)
    Publish(a90_, "acme", S::ALLOCATION_STATE_RELEASING, 3, t + 100 * kSec,
            v1::CLAIM_PHASE_RELEASING, "tenant", "redelivered-" + a90_);
    // failed in provisioning, its claim freed an hour later by a cleanup proof
    Publish(failed_, "acme", S::ALLOCATION_STATE_PROVISIONING, 1, t, v1::CLAIM_PHASE_PROVISIONING);
    Publish(failed_, "acme", S::ALLOCATION_STATE_FAILED, 2, t + 20 * kSec,
            v1::CLAIM_PHASE_CLEANUP_BLOCKED);
    Publish(failed_, "acme", S::ALLOCATION_STATE_FAILED, 3, t + 3620 * kSec,
            v1::CLAIM_PHASE_RELEASED);
    // released before active
    Publish(early_, "acme", S::ALLOCATION_STATE_RESERVED, 1, t, v1::CLAIM_PHASE_RESERVED);
    Publish(early_, "acme", S::ALLOCATION_STATE_RELEASING, 2, t + kSec, v1::CLAIM_PHASE_RELEASING,
            "tenant");
    Publish(early_, "acme", S::ALLOCATION_STATE_RELEASED, 3, t + 2 * kSec,
            v1::CLAIM_PHASE_RELEASED);
    // force-released by an operator after 60 s, then an hour cleanup_blocked
    Publish(forced_, "globex", S::ALLOCATION_STATE_ACTIVE, 1, t, v1::CLAIM_PHASE_ACTIVE);
    Publish(forced_, "globex", S::ALLOCATION_STATE_RELEASING, 2, t + 60 * kSec,
            v1::CLAIM_PHASE_RELEASING, "operator");
    Publish(forced_, "globex", S::ALLOCATION_STATE_RELEASING, 3, t + 70 * kSec,
            v1::CLAIM_PHASE_CLEANUP_BLOCKED, "operator");
    Publish(forced_, "globex", S::ALLOCATION_STATE_RELEASED, 4, t + 3670 * kSec,
            v1::CLAIM_PHASE_RELEASED, "operator");
    // across midnight UTC: 30 s on the first day, 60 s on the next
    Publish(midnight_, "globex", S::ALLOCATION_STATE_ACTIVE, 1, kDay0 + kDayUs - 30 * kSec,
            v1::CLAIM_PHASE_ACTIVE);
    Publish(midnight_, "globex", S::ALLOCATION_STATE_RELEASING, 2, kDay0 + kDayUs + 60 * kSec,
            v1::CLAIM_PHASE_RELEASING, "tenant");
  }

  testing::TestNats nats_;
  bool capture_ = false;             // Publish only keeps the events (captured_), in order
  std::vector<v1::Event> captured_;  // what Publish made, in order
  std::string dsn_;
  std::unique_ptr<UsageService> svc_;
  std::shared_ptr<messaging::Connection> conn_, operator_, tenant_api_;
  const std::string a90_ = "0193a6f0-0000-7000-8000-000000000001";
  const std::string failed_ = "0193a6f0-0000-7000-8000-000000000002";
  const std::string early_ = "0193a6f0-0000-7000-8000-000000000003";
  const std::string forced_ = "0193a6f0-0000-7000-8000-000000000004";
  const std::string midnight_ = "0193a6f0-0000-7000-8000-000000000005";
};

std::string Line(const std::string& id, const std::string& tenant, const std::string& kind,
                 const std::string& day, const std::string& start, const std::string& end,
                 const std::string& seconds, const std::string& stop, const std::string& events) {
  return fmt::format(
      "usage-policy/1,{id}/{kind}/{day},{kind},{tenant},{id},h200-sxm-slice,gpu_slice,1,us-east-1,"
      "default,gpu-01,gpu-0000:18:00.0,0000:18:00.0,private-nat,,{day},{day}T{start}Z,{end}Z,"
      "{s},gpu_second,{s},{stop},,{events}\r\n",
      fmt::arg("id", id), fmt::arg("kind", kind), fmt::arg("day", day), fmt::arg("tenant", tenant),
      fmt::arg("start", start), fmt::arg("end", end), fmt::arg("s", seconds),
      fmt::arg("stop", stop), fmt::arg("events", events));
}

TEST_F(UsageTest, AScriptedDayGivesExactlyTheExpectedRecordsAndLines) {
  PublishStory();
  const int64_t from = kDay0, to = kDay0 + 2 * kDayUs;
  ASSERT_TRUE(testing::WaitFor([&] { return Records(from, to) == 6; }, 20s)) << Records(from, to);
  const std::string csv = ExportAll(from, to, 0);
  // Event ids are the events' own: compare everything up to them, line by line.
  std::vector<std::string> lines;
  for (size_t at = 0, nl; (nl = csv.find("\r\n", at)) != std::string::npos; at = nl + 2) {
    const std::string line = csv.substr(at, nl - at + 2);
    lines.push_back(at == 0 ? line : line.substr(0, line.rfind(',') + 1) + "\r\n");
  }
  const std::string d0 = "2026-11-27", d1 = "2026-11-28";
  auto no_events = [](const std::string& l) { return l.substr(0, l.rfind(',') + 1) + "\r\n"; };
  const std::vector<std::string> want = {
      CsvHeader(),
      no_events(Line(a90_, "acme", "billable", d0, "10:00:10.000000", d0 + "T10:01:40.000000",
                     "90.000000", "release_requested", "")),
      no_events(Line(failed_, "acme", "stranded", d0, "10:00:20.000000", d0 + "T11:00:20.000000",
                     "3600.000000", "claims_freed", "")),
      no_events(Line(forced_, "globex", "billable", d0, "10:00:00.000000", d0 + "T10:01:00.000000",
                     "60.000000", "operator_release", "")),
      no_events(Line(forced_, "globex", "stranded", d0, "10:01:10.000000", d0 + "T11:01:10.000000",
                     "3600.000000", "claims_freed", "")),
      no_events(Line(midnight_, "globex", "billable", d0, "23:59:30.000000",
                     d1 + "T00:00:00.000000", "30.000000", "day_end", "")),
      no_events(Line(midnight_, "globex", "billable", d1, "00:00:00.000000",
                     d1 + "T00:01:00.000000", "60.000000", "release_requested", "")),
  };
  ASSERT_EQ(lines.size(), want.size()) << csv;
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(lines[i], want[i]) << "line " << i;
  // Each record names the events it came from: its start's, and its stop's unless a day ended it.
  for (size_t at = csv.find("\r\n") + 2, nl; (nl = csv.find("\r\n", at)) != std::string::npos;
       at = nl + 2) {
    const std::string line = csv.substr(at, nl - at);
    const std::string ids = line.substr(line.rfind(',') + 1);
    const bool day_end = line.find(",day_end,") != std::string::npos;
    EXPECT_EQ(std::count(ids.begin(), ids.end(), ';'), day_end ? 0 : 1) << line;
    EXPECT_FALSE(ids.empty()) << line;
  }

  // Paged, the export is the same bytes.
  EXPECT_EQ(ExportAll(from, to, 2), csv);
  // The summary nets it per tenant and SKU: billable apart from stranded.
  v1::UsageSummaryRequest sreq;
  *sreq.mutable_from() = Stamp(from);
  *sreq.mutable_to() = Stamp(to);
  auto sum =
      rpc::Client(operator_).Call<v1::UsageSummaryResponse>("gpuaas.v1.usage.summary", sreq, 10s);
  ASSERT_TRUE(sum.ok()) << sum.error().ToString();
  ASSERT_EQ(sum->totals_size(), 2);
  EXPECT_EQ(sum->totals(0).tenant(), "acme");
  EXPECT_EQ(sum->totals(0).billable_units_micro(), 90 * kSec);
  EXPECT_EQ(sum->totals(0).stranded_units_micro(), 3600 * kSec);
  EXPECT_EQ(sum->totals(1).tenant(), "globex");
  EXPECT_EQ(sum->totals(1).billable_units_micro(), 150 * kSec);
  EXPECT_EQ(sum->applied_through().seconds(), (kDay0 + kDayUs + 60 * kSec) / kSec);
}

// The chaos campaign's finding: the release request's event came back (redelivered) after the
// allocation's later events. The later ones are kept until it is applied: the stop is the
// release request's time, not the release's.
TEST_F(UsageTest, AnEventOvertakenByLaterOnesIsWaitedFor) {
  const int64_t t = kDay0 + 10 * kHour;
  using S = v1::AllocationState;
  Publish(a90_, "acme", S::ALLOCATION_STATE_ACTIVE, 1, t, v1::CLAIM_PHASE_ACTIVE);
  Publish(a90_, "acme", S::ALLOCATION_STATE_RELEASED, 3, t + 600 * kSec, v1::CLAIM_PHASE_RELEASED);
  Publish(a90_, "acme", S::ALLOCATION_STATE_RELEASING, 2, t + 90 * kSec, v1::CLAIM_PHASE_RELEASING,
          "tenant");
  ASSERT_TRUE(testing::WaitFor([&] { return Records(kDay0, kDay0 + kDayUs) == 1; }, 20s));
  const std::string csv = ExportAll(kDay0, kDay0 + kDayUs, 0);
  EXPECT_NE(csv.find(",90.000000,gpu_second,90.000000,release_requested,"), std::string::npos)
      << csv;
}

TEST_F(UsageTest, ATenantSeesOnlyItsOwnAndBadRequestsAreStructured) {
  PublishStory();
  const int64_t from = kDay0, to = kDay0 + 2 * kDayUs;
  ASSERT_TRUE(testing::WaitFor([&] { return Records(from, to) == 6; }, 20s));
  auto mine = Export(Tenant("acme"), "", from, to);
  ASSERT_TRUE(mine.ok()) << mine.error().ToString();
  EXPECT_EQ(mine->records(), 2);
  EXPECT_EQ(mine->content().find("globex"), std::string::npos);
  auto theirs = Export(Tenant("acme"), "globex", from, to);
  ASSERT_FALSE(theirs.ok());
  EXPECT_EQ(theirs.error().code, Code::kPermissionDenied);
  EXPECT_EQ(theirs.error().reason, "tenant_mismatch");

  rpc::Client op(operator_);
  auto backwards = Export(op, "", to, from);
  ASSERT_FALSE(backwards.ok());
  EXPECT_EQ(backwards.error().reason, "invalid_period");
  EXPECT_EQ(backwards.error().details.count("to"), 1U);
  auto year = Export(op, "", from, from + 400 * kDayUs);
  ASSERT_FALSE(year.ok());
  EXPECT_EQ(year.error().reason, "invalid_period");
  auto token = Export(op, "", from, to, 0, "not-a-token");
  ASSERT_FALSE(token.ok());
  EXPECT_EQ(token.error().reason, "invalid_page_token");
  auto format = Export(op, "", from, to, 0, "", static_cast<v1::UsageFormat>(9));
  ASSERT_FALSE(format.ok());
  EXPECT_EQ(format.error().reason, "invalid_format");
  auto json = Export(op, "", from, to, 0, "", v1::USAGE_FORMAT_JSON_LINES);
  ASSERT_TRUE(json.ok());
  EXPECT_EQ(json->content().rfind(JsonHeader(), 0), 0U);
  EXPECT_EQ(json->records(), 6);
}

TEST_F(UsageTest, ALedgerRebuiltFromTheStreamExportsTheSameBytes) {
  PublishStory();
  const int64_t from = kDay0, to = kDay0 + 2 * kDayUs;
  ASSERT_TRUE(testing::WaitFor([&] { return Records(from, to) == 6; }, 20s));
  const std::string before = ExportAll(from, to, 0);
  // Drop the ledger: a new, empty database. usage sees it is empty and reads the stream again
  // from its first event (its durable from before would start where that one had got to).
  svc_->Shutdown();
  dsn_.clear();
  Start();
  ASSERT_TRUE(testing::WaitFor([&] { return Records(from, to) == 6; }, 20s));
  EXPECT_EQ(ExportAll(from, to, 0), before);
}

// The consumer applies a fetched batch set-based; how the stream was cut into batches changes
// no row: the story applied one event per transaction, three at a time and all at once gives
// the same records, meters and clock.
TEST_F(UsageTest, BatchedOrOneByOneTheLedgerIsTheSame) {
  capture_ = true;
  // An allocation running across midnight: its first day is closed when a later event's time
  // (the story's midnight release) moves the horizon past midnight, in the middle of a batch.
  using S = v1::AllocationState;
  const std::string running = "0193a6f0-0000-7000-8000-000000000006";
  Publish(running, "acme", S::ALLOCATION_STATE_ACTIVE, 1, kDay0 + 23 * kHour,
          v1::CLAIM_PHASE_ACTIVE);
  PublishStory();
  // And a release request overtaken by the release (kept until it arrives).
  const std::string overtaken = "0193a6f0-0000-7000-8000-000000000007";
  const int64_t t = kDay0 + 12 * kHour;
  Publish(overtaken, "acme", S::ALLOCATION_STATE_ACTIVE, 1, t, v1::CLAIM_PHASE_ACTIVE);
  Publish(overtaken, "acme", S::ALLOCATION_STATE_RELEASED, 3, t + 600 * kSec,
          v1::CLAIM_PHASE_RELEASED);
  Publish(overtaken, "acme", S::ALLOCATION_STATE_RELEASING, 2, t + 90 * kSec,
          v1::CLAIM_PHASE_RELEASING, "tenant");
  ASSERT_GT(captured_.size(), 10U);
  Context c;
  c.source = "usage/test";
  auto rows = [&](size_t batch) {
    const std::string dsn = testing::SharedPostgres().CreateDatabase("usage");
    store::Pool pool({dsn}, log::Logger("test", "t"));
    EXPECT_TRUE(store::Migrate(pool, "common", store::CommonMigrations()).ok());
    EXPECT_TRUE(store::Migrate(pool, "usage", Migrations()).ok());
    for (size_t at = 0; at < captured_.size(); at += batch) {
      std::vector<const v1::Event*> events;
      for (size_t i = at; i < std::min(captured_.size(), at + batch); ++i) {
        events.push_back(&captured_[i]);
      }
      auto r =
          store::WithTx(pool, [&](pqxx::work& tx) { return ApplyAllocationEvents(tx, events, c); });
      EXPECT_TRUE(r.ok()) << r.error().ToString();
    }
    std::string out;
    auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
      for (const char* q :
           {"SELECT record_id, day, kind, corrects, counts_as, units_micro, encode(record, 'hex') "
            "FROM usage_records ORDER BY record_id",
            "SELECT allocation_id, generation, bill_since_us, bill_until_us, bill_done, "
            "lost_since_us, lost_until_us, lost_done, open FROM meters ORDER BY allocation_id",
            "SELECT newest_event_us, closed_before_us FROM ledger_clock",
            "SELECT count(*) FROM pending_snapshots", "SELECT count(*) FROM outbox"}) {
        for (const auto& row : tx.exec(q)) {
          for (const auto& f : row) out += std::string(f.c_str()) + "|";
          out += "\n";
        }
      }
      return Ok();
    });
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    return out;
  };
  const std::string one = rows(1);
  EXPECT_NE(one.find(running + "/billable/2026-11-27|"), std::string::npos)
      << "no day was closed:\n"
      << one;
  EXPECT_NE(one.find(overtaken + "/billable/2026-11-27|"), std::string::npos) << one;
  EXPECT_EQ(rows(2), one);
  EXPECT_EQ(rows(3), one);
  EXPECT_EQ(rows(captured_.size()), one);
}

}  // namespace
}  // namespace gpuaas::usage
