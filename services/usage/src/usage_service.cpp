#include "gpuaas/usage/usage_service.hpp"

#include <fmt/format.h>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/usage.pb.h"
#include "usage_metrics.hpp"
#include "usage_reasons.hpp"
#include "usage_store.hpp"

namespace gpuaas::usage {

namespace {

// The most text an export page carries (its last line may go past it).
constexpr size_t kMaxExportBytes = size_t{512} * 1024;

// ---- requests ----

// The period of a request as whole UTC days: `from`'s day up to the day `to` falls in
// (exclusive at a midnight).
Result<Period> PeriodOf(const google::protobuf::Timestamp& from,
                        const google::protobuf::Timestamp& to, const std::string& tenant) {
  std::map<std::string, std::string> bad;
  if (from.seconds() == 0 && from.nanos() == 0) bad["from"] = "required";
  if (to.seconds() == 0 && to.nanos() == 0) bad["to"] = "required";
  if (bad.empty() && Micros(from) >= Micros(to)) bad["to"] = "must be after from";
  Period p;
  p.tenant = tenant;
  if (bad.empty()) {
    p.from_day_us = DayStart(Micros(from));
    p.to_day_us = DayStart(Micros(to) + kDayUs - 1);
    if (p.to_day_us - p.from_day_us > 366 * kDayUs) bad["to"] = "at most 366 days after from";
  }
  if (!bad.empty()) {
    return Error::InvalidArgument(reason::kInvalidPeriod, "the period is not a valid range", bad);
  }
  return p;
}

// The tenant a request may see: a tenant principal only its own.
Result<std::string> TenantOf(const std::string& asked, const rpc::Context& rc) {
  const std::string scope = rc.TenantScope();
  if (scope.empty()) return asked;
  if (!asked.empty() && asked != scope) {
    return Error::Of(Code::kPermissionDenied, reason::kTenantMismatch,
                     "a tenant sees only its own usage", {{"tenant", asked}});
  }
  return scope;
}

std::string HexEncode(const std::string& s) {
  std::string out;
  for (unsigned char ch : s) out += fmt::format("{:02x}", ch);
  return out;
}

std::optional<std::string> HexDecode(const std::string& s) {
  if (s.size() % 2 != 0) return std::nullopt;
  std::string out;
  for (size_t i = 0; i < s.size(); i += 2) {
    try {
      size_t used = 0;
      const int v = std::stoi(s.substr(i, 2), &used, 16);
      if (used != 2) return std::nullopt;
      out += static_cast<char>(v);
    } catch (...) {
      return std::nullopt;
    }
  }
  return out;
}

// A page token is the last record's key, hex-encoded (day, tenant, allocation, record id).
PageKey KeyOf(const v1::UsageRecord& r) {
  return {r.day(), r.tenant(), r.allocation_id(), r.record_id()};
}
std::string PageToken(const PageKey& k) {
  return HexEncode(k.day + '\n' + k.tenant + '\n' + k.allocation_id + '\n' + k.record_id);
}

Result<PageKey> ParsePageToken(const std::string& token) {
  PageKey k;
  if (token.empty()) return k;
  const auto raw = HexDecode(token);
  std::vector<std::string> parts;
  if (raw) {
    size_t start = 0;
    for (size_t nl = raw->find('\n'); nl != std::string::npos; nl = raw->find('\n', start)) {
      parts.push_back(raw->substr(start, nl - start));
      start = nl + 1;
    }
    parts.push_back(raw->substr(start));
  }
  if (parts.size() != 4 || parts[0].size() != 10 || parts[3].empty()) {
    return Error::InvalidArgument(reason::kInvalidPageToken, "page_token was not given by usage");
  }
  return PageKey{parts[0], parts[1], parts[2], parts[3]};
}

Result<int> PageSize(int32_t asked, int fallback, int max) {
  if (asked == 0) return fallback;
  if (asked < 0 || asked > max) {
    return Error::InvalidArgument(reason::kInvalidPageSize, "page_size is out of range",
                                  {{"page_size", fmt::format("1..{} (0 = {})", max, fallback)}});
  }
  return asked;
}

// One page of records and the token of the next (empty on the last page).
struct Page {
  std::vector<v1::UsageRecord> records;
  std::string next;
};

Result<Page> ReadPage(store::Pool& pool, const Period& p, const std::string& token, int size) {
  auto after = ParsePageToken(token);
  if (!after.ok()) return after.error();
  return store::WithTx(
      pool,
      [&](pqxx::work& tx) -> Result<Page> {
        Page page;
        page.records = ListRecords(tx, p, *after, size + 1);
        if (static_cast<int>(page.records.size()) > size) {
          page.records.pop_back();
          page.next = PageToken(KeyOf(page.records.back()));
        }
        return page;
      },
      store::ReadSnapshot());
}

// Up to `size` records of the period after `after` as export lines appended to `out`, read in
// chunks of what the page can still carry: a reply is one NATS message (1 MiB at most), so the
// page ends at kMaxExportBytes rather than not arrive. Returns the lines written; `next` is the
// token of the next page ("" after the last record).
int32_t ExportLines(pqxx::work& tx, const Period& p, PageKey after, int size, bool json,
                    std::string& out, std::string& next) {
  constexpr int kChunk = 1000;
  int32_t n = 0;
  while (true) {
    // One more than the page takes: it says whether a next page exists.
    const int want = std::min(kChunk, size - n + 1);
    const auto rows = ListRecords(tx, p, after, want);
    for (const auto& r : rows) {
      if (n == size || (n > 0 && out.size() >= kMaxExportBytes)) {
        next = PageToken(after);
        return n;
      }
      out += json ? JsonLine(r) : CsvLine(r);
      ++n;
      after = KeyOf(r);
    }
    if (static_cast<int>(rows.size()) < want) return n;
  }
}

// usage's request handlers, one per subject of RegisterRoutes.
class UsageHandlers {
 public:
  explicit UsageHandlers(std::shared_ptr<store::Pool> pool) : pool_(std::move(pool)) {}

  Result<v1::ListUsageResponse> List(const v1::ListUsageRequest& req, rpc::Context& rc) const;
  Result<v1::ExportUsageResponse> Export(const v1::ExportUsageRequest& req, rpc::Context& rc) const;
  Result<v1::UsageSummaryResponse> Summary(const v1::UsageSummaryRequest& req,
                                           rpc::Context& rc) const;

 private:
  std::shared_ptr<store::Pool> pool_;
};

// Every request subject usage serves. gpuaas.v1.usage.dlq.replay is added by ServeRequests().
void RegisterRoutes(rpc::Server& rpc, const std::shared_ptr<UsageHandlers>& h) {
  using H = UsageHandlers;
  rpc.Route("gpuaas.v1.usage.record.list", h, &H::List);
  rpc.Route("gpuaas.v1.usage.record.export", h, &H::Export);
  rpc.Route("gpuaas.v1.usage.summary", h, &H::Summary);
}

Result<v1::ListUsageResponse> UsageHandlers::List(const v1::ListUsageRequest& req,
                                                  rpc::Context& rc) const {
  auto tenant = TenantOf(req.tenant(), rc);
  if (!tenant.ok()) return tenant.error();
  auto period = PeriodOf(req.from(), req.to(), *tenant);
  if (!period.ok()) return period.error();
  auto size = PageSize(req.page_size(), 500, 1000);
  if (!size.ok()) return size.error();
  auto page = ReadPage(*pool_, *period, req.page_token(), *size);
  if (!page.ok()) return page.error();
  v1::ListUsageResponse resp;
  for (auto& r : page->records) *resp.add_records() = std::move(r);
  resp.set_next_page_token(page->next);
  return resp;
}

Result<v1::ExportUsageResponse> UsageHandlers::Export(const v1::ExportUsageRequest& req,
                                                      rpc::Context& rc) const {
  if (!v1::UsageFormat_IsValid(req.format())) {
    return Error::InvalidArgument(reason::kInvalidFormat, "format is not a UsageFormat",
                                  {{"format", std::to_string(req.format())}});
  }
  const bool json = req.format() == v1::USAGE_FORMAT_JSON_LINES;
  auto tenant = TenantOf(req.tenant(), rc);
  if (!tenant.ok()) return tenant.error();
  auto period = PeriodOf(req.from(), req.to(), *tenant);
  if (!period.ok()) return period.error();
  auto size = PageSize(req.page_size(), 5000, 10000);
  if (!size.ok()) return size.error();
  auto after = ParsePageToken(req.page_token());
  if (!after.ok()) return after.error();
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ExportUsageResponse> {
        v1::ExportUsageResponse resp;
        std::string out;
        if (req.page_token().empty()) out = json ? JsonHeader() : CsvHeader();
        resp.set_records(
            ExportLines(tx, *period, *after, *size, json, out, *resp.mutable_next_page_token()));
        resp.set_content(std::move(out));
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::UsageSummaryResponse> UsageHandlers::Summary(const v1::UsageSummaryRequest& req,
                                                        rpc::Context& rc) const {
  auto tenant = TenantOf(req.tenant(), rc);
  if (!tenant.ok()) return tenant.error();
  auto period = PeriodOf(req.from(), req.to(), *tenant);
  if (!period.ok()) return period.error();
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::UsageSummaryResponse> {
        v1::UsageSummaryResponse resp;
        for (auto& t : Summarize(tx, *period)) *resp.add_totals() = std::move(t);
        const Clock clock = ReadClock(tx);
        if (clock.newest_event_us > 0) {
          *resp.mutable_applied_through() = Stamp(clock.newest_event_us);
        }
        return resp;
      },
      store::ReadSnapshot());
}

}  // namespace

void UsageConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("usage.close_lag_s", &close_lag_s,
        "How far past a midnight (UTC) the newest scheduler event must be before that day's "
        "records of running allocations are closed",
        60, config::Range(0, 86400));
}

Result<void> UsageConfig::Validate() const { return Ok(); }

UsageService::UsageService(UsageConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"usage", &Migrations()}, cfg_.common) {}

UsageService::~UsageService() { lag_.reset(); }

Result<void> UsageService::Start() {
  if (auto v = cfg_.Validate(); !v.ok()) return v;
  if (auto r = svc_.Start(); !r.ok()) return r;
  svc_.StartOutboxRelay();
  metrics_ = std::make_unique<UsageMetrics>(svc_.metrics());
  auto ctx = std::make_shared<Context>();
  ctx->cfg = cfg_;
  ctx->source = svc_.source();
  ctx->metrics = metrics_.get();
  RegisterRoutes(svc_.Rpc(), std::make_shared<UsageHandlers>(svc_.pg()));
  // An empty ledger (a new install, or its database dropped to rebuild it) reads the stream
  // from its first event: a durable left from an earlier database would start where that one was.
  auto empty =
      store::WithTx(*svc_.pg(), [](pqxx::work& tx) -> Result<bool> { return LedgerEmpty(tx); });
  if (!empty.ok()) return empty.error();
  if (*empty) {
    auto gone = messaging::DeleteConsumer(*svc_.nats(), messaging::SchedulerEventsStream().name,
                                          kAllocationConsumer);
    if (!gone.ok()) return gone.error();
    svc_.log().Info("empty ledger: consuming the scheduler's allocation events from the start");
  }
  auto consumer = svc_.StartBatchProjection(
      messaging::SchedulerEventsStream().name, kAllocationConsumer,
      "gpuaas.v1.evt.scheduler.allocation.>",
      [ctx](pqxx::work& tx, const v1::Event& ev) { return ApplyAllocationEvent(tx, ev, *ctx); },
      [ctx](pqxx::work& tx, const std::vector<const v1::Event*>& events) {
        return ApplyAllocationEvents(tx, events, *ctx);
      },
      kAllocationBatch);
  if (!consumer.ok()) return consumer.error();
  messaging::Consumer* c = *consumer;
  lag_ = StartLedgerLag([c] { return c->Backlog(); }, svc_.metrics(), svc_.log(),
                        std::chrono::seconds(5));
  return svc_.ServeRequests();
}

}  // namespace gpuaas::usage
