#pragma once
// JSON-line logs: one object per line with ts, level, service, instance, msg and the ids in
// play (node_id, allocation_id, slot_id, trace_id, ...). Thread-safe; writes to stderr.
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace gpuaas::log {

enum class Level { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
Level ParseLevel(const std::string& s);

using Fields = std::vector<std::pair<std::string, std::string>>;

class Logger {
 public:
  Logger() = default;
  Logger(std::string service, std::string instance, Level level = Level::kInfo);

  // A logger that adds `fields` to every line.
  Logger With(Fields fields) const;

  void Debug(const std::string& msg, const Fields& f = {}) const { Log(Level::kDebug, msg, f); }
  void Info(const std::string& msg, const Fields& f = {}) const { Log(Level::kInfo, msg, f); }
  void Warn(const std::string& msg, const Fields& f = {}) const { Log(Level::kWarn, msg, f); }
  void Error(const std::string& msg, const Fields& f = {}) const { Log(Level::kError, msg, f); }
  void Log(Level level, const std::string& msg, const Fields& f) const;
  bool Enabled(Level level) const;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
  Fields fields_;
};

}  // namespace gpuaas::log
