#pragma once
// Configuration: a schema of typed keys (doc, default, validator) loaded from YAML with
// environment overrides. Unknown keys are rejected and every problem is reported at once.
//
// Environment: key "nats.url" is overridden by GPUAAS_NATS_URL ('.' and '-' become '_').
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::config {

// Returns an empty string when the value is acceptable, else the problem.
template <typename T>
using Validator = std::function<std::string(const T&)>;

class Schema {
 public:
  void Add(std::string key, std::string* target, std::string doc, std::string def,
           Validator<std::string> validate = {});
  void Add(std::string key, int64_t* target, std::string doc, int64_t def,
           Validator<int64_t> validate = {});
  void Add(std::string key, bool* target, std::string doc, bool def);
  void Add(std::string key, double* target, std::string doc, double def,
           Validator<double> validate = {});

  // Loads `path` (empty = defaults only) and the environment. On failure the error's
  // details map every bad key to its problem.
  Result<void> Load(const std::string& path, const std::map<std::string, std::string>& env);
  Result<void> LoadFromString(const std::string& yaml,
                              const std::map<std::string, std::string>& env);

  // A commented YAML of every key with its default, for `--print-config`.
  std::string Describe() const;

 private:
  struct Field;
  void AddField(std::string key, std::string doc, std::string def_text,
                std::function<std::string(const std::string&)> apply);
  std::vector<std::shared_ptr<Field>> fields_;
};

std::map<std::string, std::string> ProcessEnv();
std::string EnvName(const std::string& key);

// Common validators.
Validator<int64_t> Range(int64_t lo, int64_t hi);
Validator<std::string> OneOf(std::vector<std::string> allowed);
Validator<std::string> NonEmpty();

}  // namespace gpuaas::config
