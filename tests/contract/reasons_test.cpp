// Typed reasons: every area of the code (libs/common, each service, gpuaasctl) lists the reasons
// it answers in one registry header (`inline constexpr Reason kName{"text"};` a line; result.hpp
// says why), and these tests hold the code to it, reading the sources as text:
// - a registry is not empty and names no text twice;
// - production code (src/ and include/, tests left out) never makes an Error with a literal
//   reason and never decides by comparing a reason with a literal, so every reason it answers
//   comes from its registry (or libs/common's);
// - every registry text is documented: in the area's README or in the AsyncAPI document.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace gpuaas {
namespace {

namespace fs = std::filesystem;

const fs::path kRoot = GPUAAS_SOURCE_DIR;

struct Area {
  std::string name;
  fs::path dir;     // the area's code, relative to the root
  fs::path readme;  // its README, relative to the root
};

const std::vector<Area>& Areas() {
  static const std::vector<Area> areas = {
      {"libs/common", "libs/common", "libs/common/README.md"},
      {"inventory", "services/inventory", "services/inventory/README.md"},
      {"scheduler", "services/scheduler", "services/scheduler/README.md"},
      {"ipam", "services/ipam", "services/ipam/README.md"},
      {"ingress", "services/ingress", "services/ingress/README.md"},
      {"console-gw", "services/console-gw", "services/console-gw/README.md"},
      {"usage", "services/usage", "services/usage/README.md"},
      {"node-agent", "services/node-agent", "services/node-agent/README.md"},
      {"gpuaasctl", "tools/gpuaasctl", "tools/gpuaasctl/README.md"},
  };
  return areas;
}

std::string Read(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

bool IsTestPath(const fs::path& rel) {
  for (const auto& part : rel) {
    if (part == "tests" || part == "testing") return true;
  }
  return false;
}

// The area's production sources (.cpp and .hpp outside tests/ and testing/).
std::vector<fs::path> Sources(const Area& a) {
  std::vector<fs::path> out;
  for (const auto& e : fs::recursive_directory_iterator(kRoot / a.dir)) {
    if (!e.is_regular_file()) continue;
    const auto ext = e.path().extension();
    if (ext != ".cpp" && ext != ".hpp") continue;
    if (IsTestPath(fs::relative(e.path(), kRoot / a.dir))) continue;
    out.push_back(e.path());
  }
  return out;
}

struct Entry {
  std::string name, text;
  fs::path file;
  int line = 0;
};

// Every `inline constexpr Reason kName{"text"};` of the area's *reasons.hpp files.
std::vector<Entry> Registry(const Area& a) {
  static const std::regex entry(
      R"re(inline\s+constexpr\s+Reason\s+(k\w+)\s*\{\s*"([^"]*)"\s*\})re");
  std::vector<Entry> out;
  for (const auto& p : Sources(a)) {
    const std::string name = p.filename().string();
    if (name.size() < 11 || name.substr(name.size() - 11) != "reasons.hpp") continue;
    std::ifstream f(p);
    std::string line;
    for (int n = 1; std::getline(f, line); ++n) {
      std::smatch m;
      if (std::regex_search(line, m, entry)) out.push_back({m[1], m[2], p, n});
    }
  }
  return out;
}

// Code with comments and the insides of raw strings blanked, line structure kept, so a
// commented example or SQL text is not read as code.
std::string WithoutComments(const std::string& s) {
  std::string out = s;
  for (size_t i = 0; i < out.size(); ++i) {
    if (out.compare(i, 2, "//") == 0) {
      while (i < out.size() && out[i] != '\n') out[i++] = ' ';
    } else if (out.compare(i, 2, "/*") == 0) {
      const size_t end = out.find("*/", i + 2);
      const size_t stop = end == std::string::npos ? out.size() : end + 2;
      for (size_t j = i; j < stop; ++j) {
        if (out[j] != '\n') out[j] = ' ';
      }
      i = stop - 1;
    } else if (out[i] == '\'' && i + 2 < out.size() &&
               (out[i + 2] == '\'' || (out[i + 1] == '\\' && i + 3 < out.size()))) {
      i += out[i + 1] == '\\' ? 3 : 2;  // a character literal such as '"' or '\n'
    } else if (out[i] == '"') {
      // Skip an ordinary string literal whole (a "//" inside one is not a comment).
      for (++i; i < out.size() && out[i] != '"' && out[i] != '\n'; ++i) {
        if (out[i] == '\\') ++i;
      }
    }
  }
  return out;
}

struct Finding {
  std::string where, what;
};

// Literal reasons where an Error is made, and decisions comparing a reason with a literal.
std::vector<Finding> LiteralReasons(const Area& a) {
  static const std::vector<std::pair<std::regex, std::string>> rules = {
      {std::regex(
           R"(Error::(InvalidArgument|NotFound|FailedPrecondition|Unavailable|Internal|Aborted)\(\s*")"),
       "an Error made with a literal reason"},
      {std::regex(R"(Error::Of\([^,()]+,\s*")"), "an Error made with a literal reason"},
      {std::regex(R"(Error\s*\{\s*Code::k\w+\s*,\s*")"), "an Error made with a literal reason"},
      {std::regex(R"(reason(\(\))?\s*(==|!=)\s*")"), "a decision by a reason's text"},
      {std::regex(R"("\s*(==|!=)\s*[\w.>-]*reason\b)"), "a decision by a reason's text"},
      {std::regex(R"(reason(\(\))?\s*\.\s*(substr|find|rfind|starts_with|ends_with|compare)\s*\()"),
       "a decision by a reason's text"},
      {std::regex(R"(\.reason\s*=\s*")"), "a reason set from a literal"},
  };
  std::vector<Finding> out;
  for (const auto& p : Sources(a)) {
    std::istringstream code(WithoutComments(Read(p)));
    std::string line;
    for (int n = 1; std::getline(code, line); ++n) {
      for (const auto& [re, what] : rules) {
        if (std::regex_search(line, re)) {
          out.push_back({fs::relative(p, kRoot).string() + ":" + std::to_string(n), what});
        }
      }
    }
  }
  return out;
}

TEST(ReasonsTest, EveryAreaHasOneRegistryWithDistinctTexts) {
  for (const auto& a : Areas()) {
    SCOPED_TRACE(a.name);
    const auto entries = Registry(a);
    EXPECT_FALSE(entries.empty()) << a.name << " has no *reasons.hpp registry under " << a.dir;
    std::map<std::string, std::string> seen;
    for (const auto& e : entries) {
      auto [it, fresh] = seen.emplace(e.text, e.name);
      EXPECT_TRUE(fresh) << e.file.string() << ":" << e.line << " " << e.name << " repeats \""
                         << e.text << "\" (" << it->second << ")";
      EXPECT_TRUE(std::regex_match(e.text, std::regex("[a-z][a-z0-9_]*")))
          << e.file.string() << ":" << e.line << " \"" << e.text << "\" is not snake_case";
    }
  }
}

TEST(ReasonsTest, ProductionCodeTakesItsReasonsFromARegistry) {
  for (const auto& a : Areas()) {
    for (const auto& f : LiteralReasons(a)) ADD_FAILURE() << f.where << ": " << f.what;
  }
}

TEST(ReasonsTest, EveryRegisteredReasonIsDocumented) {
  const std::string asyncapi = Read(kRoot / "asyncapi/gpuaas.asyncapi.yaml");
  for (const auto& a : Areas()) {
    const std::string readme = Read(kRoot / a.readme);
    for (const auto& e : Registry(a)) {
      const std::regex word("(^|[^a-z0-9_])" + e.text + "($|[^a-z0-9_])");
      EXPECT_TRUE(std::regex_search(readme, word) || std::regex_search(asyncapi, word))
          << e.file.string() << ":" << e.line << " \"" << e.text << "\" is in neither "
          << a.readme.string() << " nor asyncapi/gpuaas.asyncapi.yaml";
    }
  }
}

// The checks can fail: a literal reason and a text comparison are found where they are.
TEST(ReasonsTest, TheScanFindsALiteralReasonAndATextDecision) {
  const fs::path dir = fs::temp_directory_path() / "gpuaas-reasons-scan/src";
  fs::create_directories(dir);
  {
    std::ofstream f(dir / "x.cpp");
    f << "// Error::NotFound(\"commented\", \"\") is not code\n"
         "Error e = Error::NotFound(\"node_missing\", \"m\");\n"
         "if (e.reason == \"disk_busy\") return;\n"
         "auto ok = Error::NotFound(reason::kNodeMissing, \"m\");\n";
  }
  const Area a{"scan", fs::relative(dir.parent_path(), kRoot), ""};
  const auto found = LiteralReasons(a);
  ASSERT_EQ(found.size(), 2U);
  EXPECT_NE(found[0].where.find("x.cpp:2"), std::string::npos) << found[0].where;
  EXPECT_NE(found[1].where.find("x.cpp:3"), std::string::npos) << found[1].where;
  fs::remove_all(dir.parent_path());
}

}  // namespace
}  // namespace gpuaas
