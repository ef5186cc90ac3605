#pragma once
// Loads a service config from an environment map, the way main() does from the process env
// (tests start services in-process with it).
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "gpuaas/common/config.hpp"

namespace gpuaas {

template <typename Cfg>
Cfg LoadConfig(const std::map<std::string, std::string>& env) {
  Cfg cfg;
  config::Schema schema;
  cfg.Register(schema);
  auto r = schema.LoadFromString("", env);
  EXPECT_TRUE(r.ok()) << r.error().ToString();
  return cfg;
}

}  // namespace gpuaas
