#include "gpuaas/common/log.hpp"

#include <chrono>
#include <cstdio>
#include <mutex>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace gpuaas::log {

struct Logger::Shared {
  std::string service;
  std::string instance;
  Level level = Level::kInfo;
};

namespace {
std::mutex& OutMutex() {
  static std::mutex m;
  return m;
}
const char* LevelName(Level l) {
  switch (l) {
    case Level::kDebug:
      return "debug";
    case Level::kInfo:
      return "info";
    case Level::kWarn:
      return "warn";
    case Level::kError:
      return "error";
  }
  return "info";
}
}  // namespace

Level ParseLevel(const std::string& s) {
  if (s == "debug") return Level::kDebug;
  if (s == "warn") return Level::kWarn;
  if (s == "error") return Level::kError;
  return Level::kInfo;
}

Logger::Logger(std::string service, std::string instance, Level level)
    : shared_(std::make_shared<Shared>(Shared{std::move(service), std::move(instance), level})) {}

Logger Logger::With(Fields fields) const {
  Logger l = *this;
  for (auto& f : fields) l.fields_.push_back(std::move(f));
  return l;
}

bool Logger::Enabled(Level level) const {
  return shared_ ? level >= shared_->level : level >= Level::kWarn;
}

void Logger::Log(Level level, const std::string& msg, const Fields& f) const {
  if (!Enabled(level)) return;
  nlohmann::json j;
  const auto now = std::chrono::system_clock::now();
  const auto us = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch());
  // UTC whatever the host's TZ: fmt formats a time_point in local time, gmtime does not.
  j["ts"] =
      fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:06d}Z",
                  fmt::gmtime(std::chrono::system_clock::to_time_t(now)), us.count() % 1000000);
  j["level"] = LevelName(level);
  if (shared_) {
    j["service"] = shared_->service;
    j["instance"] = shared_->instance;
  }
  j["msg"] = msg;
  for (const auto& [k, v] : fields_) j[k] = v;
  for (const auto& [k, v] : f) j[k] = v;
  const std::string line = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::lock_guard lock(OutMutex());
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace gpuaas::log
