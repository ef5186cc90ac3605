#include <gtest/gtest.h>

#include "gpuaas/common/config.hpp"

namespace gpuaas::config {
namespace {

struct Cfg {
  std::string url;
  int64_t port = 0;
  bool flag = false;
  std::string level;
  Schema schema;
  Cfg() {
    schema.Add("nats.url", &url, "url", "nats://127.0.0.1:4222", NonEmpty());
    schema.Add("http.port", &port, "port", 0, Range(0, 65535));
    schema.Add("feature.flag", &flag, "flag", false);
    schema.Add("log.level", &level, "level", "info", OneOf({"debug", "info"}));
  }
};

TEST(ConfigTest, DefaultsApplyWhenEmpty) {
  Cfg c;
  ASSERT_TRUE(c.schema.LoadFromString("", {}).ok());
  EXPECT_EQ(c.url, "nats://127.0.0.1:4222");
  EXPECT_EQ(c.port, 0);
  EXPECT_EQ(c.level, "info");
}

TEST(ConfigTest, YamlValuesAndEnvOverride) {
  Cfg c;
  auto r = c.schema.LoadFromString("nats:\n  url: nats://a:1\nhttp:\n  port: 8080\n",
                                   {{"GPUAAS_HTTP_PORT", "9090"}, {"GPUAAS_FEATURE_FLAG", "true"}});
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(c.url, "nats://a:1");
  EXPECT_EQ(c.port, 9090);
  EXPECT_TRUE(c.flag);
}

TEST(ConfigTest, AllProblemsReportedAtOnce) {
  Cfg c;
  auto r = c.schema.LoadFromString(
      "nats:\n  url: ''\n  urll: x\nhttp:\n  port: 70000\nlog:\n  level: loud\nextra: 1\n", {});
  ASSERT_FALSE(r.ok());
  const auto& d = r.error().details;
  EXPECT_EQ(r.error().reason, "config_invalid");
  EXPECT_EQ(d.at("nats.urll"), "unknown key");
  EXPECT_EQ(d.at("extra"), "unknown key");
  EXPECT_NE(d.at("http.port").find("outside"), std::string::npos);
  EXPECT_NE(d.at("log.level").find("not one of"), std::string::npos);
  EXPECT_EQ(d.at("nats.url"), "must not be empty");
  EXPECT_EQ(d.size(), 5u);
}

TEST(ConfigTest, BadTypesAndSyntax) {
  Cfg c;
  auto r = c.schema.LoadFromString("http:\n  port: eighty\nfeature:\n  flag: maybe\n", {});
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.error().details.count("http.port"));
  EXPECT_TRUE(r.error().details.count("feature.flag"));
  Cfg c2;
  auto r2 = c2.schema.LoadFromString("nats: [unclosed\n", {});
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.error().reason, "config_yaml_invalid");
}

TEST(ConfigTest, MissingFileIsAnError) {
  Cfg c;
  auto r = c.schema.Load("/nonexistent/gpuaas.yaml", {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "config_unreadable");
}

TEST(ConfigTest, EnvNames) {
  EXPECT_EQ(EnvName("nats.request_timeout_ms"), "GPUAAS_NATS_REQUEST_TIMEOUT_MS");
  EXPECT_EQ(EnvName("console-gw.port"), "GPUAAS_CONSOLE_GW_PORT");
}

}  // namespace
}  // namespace gpuaas::config
