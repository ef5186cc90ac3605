#include "ctl.hpp"

#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <iostream>
#include <map>
#include <regex>

#include <fmt/format.h>

#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/status.pb.h"

namespace gpuaas::ctl {

namespace {

void PrintError(const Globals& g, const Error& e) {
  if (g.Json()) {
    v1::Status s;
    s.set_code(static_cast<v1::Code>(static_cast<int>(e.code)));
    s.set_reason(e.reason);
    s.set_message(e.message);
    for (const auto& [k, v] : e.details) (*s.mutable_details())[k] = v;
    s.set_retryable(e.retryable);
    std::cout << ToJson(s, !g.json_lines) << "\n" << std::flush;
  } else {
    std::cerr << "error: " << e.ToString() << "\n";
  }
}

std::map<const CLI::Option*, std::vector<std::string>>& Completions() {
  static std::map<const CLI::Option*, std::vector<std::string>> values;
  return values;
}

}  // namespace

const std::string& ExitCodesHelp() {
  static const std::string text =
      "Exit codes: 0 success; 1 the platform answered an error (its status is printed); 2 usage "
      "error; 3 NATS unreachable or timed out (also --watch-timeout-s); 4 the outcome asked for "
      "was not reached (a --watch settled in another state, a slot approval rejected, an app check "
      "found the app incompatible).";
  return text;
}

bool FromTransport(const Error& e) {
  // messaging::NatsError's reasons: the request never got a service's reply; and rpc::Server's
  // deadline_exceeded: the request expired before a service handled it.
  if (e.code != Code::kUnavailable && e.code != Code::kDeadlineExceeded) return false;
  return e.Is(gpuaas::reason::kNatsTimeout) || e.Is(gpuaas::reason::kNoResponders) ||
         e.Is(gpuaas::reason::kNatsUnavailable) || e.Is(gpuaas::reason::kNatsError) ||
         e.Is(gpuaas::reason::kDeadlineExceeded);
}

int Fail(const Globals& g, const Error& e) {
  PrintError(g, e);
  return FromTransport(e) ? kExitUnreachable : kExitError;
}

int Usage(const Globals& g, const Error& e) {
  PrintError(g, e);
  return kExitUsage;
}

std::string ToJson(const google::protobuf::Message& m, bool pretty) {
  std::string out = protojson::ToJson(m, pretty);
  // The pretty printer ends the document with a newline; callers add their own.
  while (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

int Print(const Globals& g, const google::protobuf::Message& m, const std::function<void()>& text) {
  if (g.Json()) {
    std::cout << ToJson(m, !g.json_lines) << "\n" << std::flush;
  } else {
    text();
  }
  return kExitOk;
}

void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w(header.size());
  for (size_t i = 0; i < header.size(); ++i) w[i] = header[i].size();
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size() && i < w.size(); ++i) w[i] = std::max(w[i], r[i].size());
  }
  auto line = [&](const std::vector<std::string>& r) {
    std::string s;
    for (size_t i = 0; i < r.size(); ++i) {
      s += fmt::format("{:<{}}", r[i], i + 1 == r.size() || i >= w.size() ? 0 : w[i] + 2);
    }
    std::cout << s << "\n";
  };
  line(header);
  for (const auto& r : rows) line(r);
}

std::string Time(const google::protobuf::Timestamp& t) {
  return google::protobuf::util::TimeUtil::ToString(t).substr(0, 19) + "Z";
}

std::string Join(const std::vector<std::string>& items, const std::string& sep) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : sep) + i;
  return out;
}

std::string Or(const std::string& s, const std::string& dash) { return s.empty() ? dash : s; }

CLI::Option* OneOf(CLI::Option* opt, const std::vector<std::string>& values) {
  opt->check(CLI::IsMember(values));
  return Suggest(opt, values);
}

CLI::Option* Suggest(CLI::Option* opt, const std::vector<std::string>& values) {
  Completions()[opt] = values;
  return opt;
}

const std::vector<std::string>& CompletionValues(const CLI::Option* opt) {
  static const std::vector<std::string> kNone;
  auto it = Completions().find(opt);
  return it == Completions().end() ? kNone : it->second;
}

std::optional<int64_t> ParseSeconds(const std::string& text) {
  static const std::regex kForm(R"(^(\d{1,9})([smhd]?)$)");
  std::smatch m;
  if (!std::regex_match(text, m, kForm)) return std::nullopt;
  const int64_t n = std::stoll(m[1].str());
  const std::string unit = m[2].str();
  if (unit == "m") return n * 60;
  if (unit == "h") return n * 3600;
  if (unit == "d") return n * 86400;
  return n;
}

}  // namespace gpuaas::ctl
