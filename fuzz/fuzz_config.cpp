// fuzz_config: config::Schema::LoadFromString with each service's real schema (inventory, ipam,
// scheduler, node-agent: their Config::Register) from fuzzed YAML and one fuzzed environment
// override, and the scheduler's catalog YAML (Catalog::Parse). A bad config is refused with
// every problem listed (INVALID_ARGUMENT, a reason, details naming keys), never an exception or
// a crash; what loads is what the schema allows.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_check.hpp"
#include "gpuaas/common/config.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "gpuaas/node_agent/agent/node_agent.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/scheduler/scheduler_service.hpp"

namespace gpuaas::fuzz {
namespace {

// One service's schema, fresh for every input (a Schema writes into the config it registers).
struct Target {
  std::string name;
  std::function<Result<void>(const std::string& yaml, const std::map<std::string, std::string>& env,
                             std::string* describe)>
      load;
};

template <typename Cfg>
Target Make(std::string name, std::function<void(const Cfg&)> after = {}) {
  return {std::move(name),
          [after](const std::string& yaml, const std::map<std::string, std::string>& env,
                  std::string* describe) -> Result<void> {
            Cfg cfg;
            config::Schema schema;
            cfg.Register(schema);
            if (describe != nullptr) *describe = schema.Describe();
            auto r = schema.LoadFromString(yaml, env);
            if (r.ok() && after) after(cfg);
            return r;
          }};
}

const std::vector<Target>& Targets() {
  static const auto* targets = new std::vector<Target>{
      Make<inventory::InventoryConfig>("inventory"),
      Make<ipam::IpamConfig>("ipam",
                             [](const ipam::IpamConfig& cfg) {
                               auto v = cfg.Validate();
                               if (!v.ok()) {
                                 FUZZ_CHECK_ERROR(v.error(), Code::kInvalidArgument);
                                 FUZZ_CHECK(!v.error().details.empty(), v.error().ToString());
                                 return;
                               }
                               // A valid config's default subnet is one ipam can hand out.
                               auto c = ipam::ParseCidr(cfg.default_subnet);
                               FUZZ_CHECK(c.ok(), cfg.default_subnet);
                             }),
      Make<scheduler::SchedulerConfig>("scheduler"),
      Make<node_agent::NodeAgentConfig>("node-agent"),
  };
  return *targets;
}

// The keys of a schema, from its Describe() text ("key: default" after each comment).
std::vector<std::string> Keys(const std::string& describe) {
  std::vector<std::string> keys;
  size_t pos = 0;
  while (pos < describe.size()) {
    size_t end = describe.find('\n', pos);
    if (end == std::string::npos) end = describe.size();
    const std::string line = describe.substr(pos, end - pos);
    if (!line.empty() && line[0] != '#') keys.push_back(line.substr(0, line.find(':')));
    pos = end + 1;
  }
  return keys;
}

struct Prepared {
  std::vector<std::vector<std::string>> keys;  // per target
};

const Prepared& Prepare() {
  static const auto* p = [] {
    auto* out = new Prepared;
    for (const auto& t : Targets()) {
      std::string describe;
      (void)t.load("", {}, &describe);
      // What --print-config prints loads back, short only of the keys whose default is empty
      // and required (postgres.dsn, node.id).
      auto r = t.load(describe, {}, nullptr);
      if (!r.ok()) {
        for (const auto& [key, problem] : r.error().details) {
          FUZZ_CHECK(describe.find("\n" + key + ": \n") != std::string::npos,
                     t.name + ": " + key + ": " + problem);
        }
      }
      out->keys.push_back(Keys(describe));
      FUZZ_CHECK(out->keys.back().size() >= 5, t.name);
    }
    return out;
  }();
  return *p;
}

void CheckSchema(size_t which, const std::string& env_key, const std::string& env_value,
                 const std::string& yaml) {
  const Target& t = Targets()[which];
  const auto& keys = Prepare().keys[which];
  std::map<std::string, std::string> env;
  if (!env_key.empty()) env[config::EnvName(env_key)] = env_value;
  auto r = t.load(yaml, env, nullptr);
  if (r.ok()) return;
  const Error& e = r.error();
  FUZZ_CHECK_ERROR(e, Code::kInvalidArgument);
  FUZZ_CHECK(e.reason == "config_yaml_invalid" || e.reason == "config_invalid", e.ToString());
  if (e.reason == "config_invalid") {
    FUZZ_CHECK(!e.details.empty(), e.ToString());
    // A problem names a key of the schema, a key the YAML has (unknown key, or a nested one
    // under a schema key), or the root; each says what is wrong.
    for (const auto& [key, problem] : e.details) {
      FUZZ_CHECK(!problem.empty(), t.name + ": '" + key + "': " + problem);
      const bool schema_key = std::find(keys.begin(), keys.end(), key) != keys.end();
      if (schema_key || key == "<root>") continue;
      FUZZ_CHECK(problem == "unknown key" || problem.find("expected") != std::string::npos ||
                     problem.find("mapping") != std::string::npos,
                 t.name + ": '" + key + "': " + problem);
    }
  }
}

void CheckCatalog(const std::string& yaml) {
  Result<scheduler::Catalog> c = Error::Internal("not_parsed", "");
  try {
    c = scheduler::Catalog::Parse(yaml);
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("Catalog::Parse threw instead of listing problems: ") + e.what());
  }
  if (!c.ok()) {
    FUZZ_CHECK_ERROR(c.error(), Code::kInvalidArgument);
    FUZZ_CHECK(c.error().reason == "invalid_catalog", c.error().ToString());
    return;
  }
  FUZZ_CHECK(!c->skus().empty(), yaml);
  for (const auto& [name, sku] : c->skus()) {
    FUZZ_CHECK(sku.name == name && !sku.gpu_sku.empty() && !sku.allowed_gpu_counts.empty() &&
                   !sku.network_modes.empty(),
               name);
    for (int g : sku.allowed_gpu_counts) FUZZ_CHECK(g >= 1 && g <= 16, name);
    // Every count the catalog allows is an order it accepts (reserved shapes aside).
    if (sku.shape == v1::CAPACITY_SHAPE_GPU_SLICE || sku.shape == v1::CAPACITY_SHAPE_BAREMETAL) {
      for (int g : sku.allowed_gpu_counts) {
        auto v = c->Validate(name, g, v1::NETWORK_MODE_UNSPECIFIED);
        FUZZ_CHECK(v.ok() && v->first == &sku, name + (v.ok() ? "" : ": " + v.error().ToString()));
      }
    }
  }
  const auto proto = c->ToProto();
  FUZZ_CHECK(static_cast<size_t>(proto.skus_size()) == c->skus().size(), yaml);
}

}  // namespace
}  // namespace gpuaas::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gpuaas::fuzz;  // NOLINT(google-build-using-namespace)
  Prepare();
  FuzzedDataProvider in(data, size);
  const size_t which = in.ConsumeIntegralInRange<size_t>(0, Targets().size());
  if (which == Targets().size()) {
    CheckCatalog(in.ConsumeRemainingBytesAsString());
    return 0;
  }
  const auto& keys = Prepare().keys[which];
  const size_t k = in.ConsumeIntegralInRange<size_t>(0, keys.size());
  const std::string env_value = in.ConsumeRandomLengthString(64);
  CheckSchema(which, k < keys.size() ? keys[k] : "", env_value, in.ConsumeRemainingBytesAsString());
  return 0;
}
