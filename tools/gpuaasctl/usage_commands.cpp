// gpuaasctl usage: the usage ledger's records (list, export as CSV or JSON lines, summary).
#include <google/protobuf/util/time_util.h>

#include <iostream>

#include <fmt/format.h>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/v1/usage.pb.h"

namespace gpuaas::ctl {

namespace {

using google::protobuf::util::TimeUtil;

// The period flags every usage command takes.
struct PeriodOpts {
  std::string tenant, from, to;
};

void AddPeriod(CLI::App& cmd, PeriodOpts& o) {
  cmd.add_option("--tenant", o.tenant, "Only this tenant's (a tenant token: its own)");
  cmd.add_option("--from", o.from, "First UTC day: YYYY-MM-DD or an RFC 3339 time")->required();
  cmd.add_option("--to", o.to, "End (exclusive): YYYY-MM-DD or an RFC 3339 time")->required();
}

// "2026-11-27" (that day's 00:00 UTC) or an RFC 3339 time.
std::optional<google::protobuf::Timestamp> ParseWhen(const std::string& text) {
  google::protobuf::Timestamp t;
  const std::string full = text.size() == 10 ? text + "T00:00:00Z" : text;
  if (!TimeUtil::FromString(full, &t)) return std::nullopt;
  return t;
}

// Fills tenant/from/to of `req`; a usage error when a time does not parse.
template <typename Req>
std::optional<int> SetPeriod(const Globals& g, const PeriodOpts& o, Req& req) {
  for (const auto& [name, text] : {std::pair{"from", o.from}, std::pair{"to", o.to}}) {
    auto t = ParseWhen(text);
    if (!t) {
      return Usage(g, Error::InvalidArgument(
                          reason::kTimeInvalid,
                          "--" + std::string(name) + " is not YYYY-MM-DD or an RFC 3339 time",
                          {{name, text}}));
    }
    *(std::string(name) == "from" ? req.mutable_from() : req.mutable_to()) = *t;
  }
  req.set_tenant(o.tenant);
  return std::nullopt;
}

std::string Units(int64_t micro) {
  return fmt::format("{}.{:06d}", micro / 1000000, micro % 1000000);
}

// usage list: the records of a period, every page.
Action AddUsageList(CLI::App& usage) {
  auto o = std::make_shared<PeriodOpts>();
  auto* list = usage.add_subcommand("list", "Usage records of a period (UTC days)");
  AddPeriod(*list, *o);
  return [list, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!list->parsed()) return std::nullopt;
    v1::ListUsageRequest req;
    if (auto bad = SetPeriod(g, *o, req)) return bad;
    v1::ListUsageResponse all;
    do {
      auto r = client.Call<v1::ListUsageResponse>("gpuaas.v1.usage.record.list", req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      for (const auto& x : r->records()) *all.add_records() = x;
      req.set_page_token(r->next_page_token());
    } while (!req.page_token().empty());
    return Print(g, all, [&] {
      std::vector<std::vector<std::string>> rows;
      for (const auto& x : all.records()) {
        rows.push_back({x.day(), x.tenant(), x.allocation_id(), enums::Text(x.kind()), x.sku(),
                        std::to_string(x.gpu_count()), Time(x.start()), Time(x.end()),
                        Units(x.units_micro()),
                        x.stop() == v1::USAGE_STOP_UNSPECIFIED ? "-" : enums::Text(x.stop())});
      }
      PrintTable({"DAY", "TENANT", "ALLOCATION", "KIND", "SKU", "GPUS", "START", "END",
                  "GPU-SECONDS", "STOP"},
                 rows);
    });
  };
}

// usage export: the records as CSV or JSON lines on stdout, every page.
Action AddUsageExport(CLI::App& usage) {
  struct Opts : PeriodOpts {
    std::string format = "csv";
  };
  auto o = std::make_shared<Opts>();
  auto* exp = usage.add_subcommand("export", "Usage records as CSV or JSON lines (stdout)");
  AddPeriod(*exp, *o);
  exp->add_option("--format", o->format, "csv | jsonl")
      ->check(CLI::IsMember({"csv", "jsonl"}))
      ->capture_default_str();
  return [exp, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!exp->parsed()) return std::nullopt;
    v1::ExportUsageRequest req;
    if (auto bad = SetPeriod(g, *o, req)) return bad;
    req.set_format(o->format == "jsonl" ? v1::USAGE_FORMAT_JSON_LINES : v1::USAGE_FORMAT_CSV);
    do {
      auto r =
          client.Call<v1::ExportUsageResponse>("gpuaas.v1.usage.record.export", req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      std::cout << r->content();
      req.set_page_token(r->next_page_token());
    } while (!req.page_token().empty());
    std::cout.flush();
    return kExitOk;
  };
}

// usage summary: totals per tenant and SKU.
Action AddUsageSummary(CLI::App& usage) {
  auto o = std::make_shared<PeriodOpts>();
  auto* summary = usage.add_subcommand("summary", "GPU-seconds per tenant and SKU over a period");
  AddPeriod(*summary, *o);
  return [summary, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!summary->parsed()) return std::nullopt;
    v1::UsageSummaryRequest req;
    if (auto bad = SetPeriod(g, *o, req)) return bad;
    auto r = client.Call<v1::UsageSummaryResponse>("gpuaas.v1.usage.summary", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::vector<std::vector<std::string>> rows;
      for (const auto& t : r->totals()) {
        rows.push_back({t.tenant(), t.sku(), std::to_string(t.allocations()),
                        Units(t.billable_units_micro()), Units(t.stranded_units_micro())});
      }
      PrintTable({"TENANT", "SKU", "ALLOCATIONS", "BILLABLE GPU-SECONDS", "STRANDED GPU-SECONDS"},
                 rows);
      std::cout << "complete through: "
                << (r->has_applied_through() ? Time(r->applied_through()) : std::string("-"))
                << "\n";
    });
  };
}

}  // namespace

Action AddUsageCommands(CLI::App& app) {
  auto* usage = app.add_subcommand("usage", "Usage records for billing (the usage ledger)");
  usage->require_subcommand(1);
  return FirstOf<Action>({AddUsageList(*usage), AddUsageExport(*usage), AddUsageSummary(*usage)});
}

}  // namespace gpuaas::ctl
