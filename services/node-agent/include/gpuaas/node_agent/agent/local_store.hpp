#pragma once
// The node-agent's crash-safe local state (no PostgreSQL on GPU hosts): a JSON document per
// key under a state directory. A write goes to a temporary file, is fsynced, renamed over the
// old file and the directory fsynced, so after a crash a key holds either its old or its new
// value, never a torn one.
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuaas/common/result.hpp"

namespace gpuaas::node_agent {

class LocalStore {
 public:
  static Result<LocalStore> Open(const std::string& dir);
  LocalStore(LocalStore&& o) noexcept : dir_(std::move(o.dir_)) {}

  Result<void> Put(const std::string& key, const nlohmann::json& value);
  Result<std::optional<nlohmann::json>> Get(const std::string& key) const;
  Result<void> Erase(const std::string& key);
  std::vector<std::string> Keys() const;
  const std::string& dir() const { return dir_; }

 private:
  explicit LocalStore(std::string dir) : dir_(std::move(dir)) {}
  std::string PathOf(const std::string& key) const;
  std::string dir_;
  mutable std::mutex mu_;
};

}  // namespace gpuaas::node_agent
