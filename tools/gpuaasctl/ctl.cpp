#include "ctl.hpp"

#include <google/protobuf/util/time_util.h>

#include <iostream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/proto_json.hpp"

namespace gpuaas::ctl {

std::string ToJson(const google::protobuf::Message& m) { return protojson::ToJson(m, true); }

int Fail(const Globals& g, const Error& e) {
  if (g.output == "json") {
    nlohmann::json j = {{"error",
                         {{"code", CodeName(e.code)},
                          {"reason", e.reason},
                          {"message", e.message},
                          {"details", e.details},
                          {"retryable", e.retryable}}}};
    std::cout << j.dump(2) << "\n";
  } else {
    std::cerr << "error: " << e.ToString() << "\n";
  }
  return 1;
}

void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w(header.size());
  for (size_t i = 0; i < header.size(); ++i) w[i] = header[i].size();
  for (const auto& r : rows) {
    for (size_t i = 0; i < r.size(); ++i) w[i] = std::max(w[i], r[i].size());
  }
  auto line = [&](const std::vector<std::string>& r) {
    std::string s;
    for (size_t i = 0; i < r.size(); ++i) {
      s += fmt::format("{:<{}}", r[i], i + 1 == r.size() ? 0 : w[i] + 2);
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

int Print(const Globals& g, const google::protobuf::Message& m,
          const std::function<void()>& table) {
  if (g.output == "json") {
    std::cout << ToJson(m) << "\n";
  } else {
    table();
  }
  return 0;
}

}  // namespace gpuaas::ctl
