// Contract checks: the AsyncAPI document, the protobuf contracts and the code agree.
//  * every subject literal in service/library code is a channel of the AsyncAPI document
//    (subscription patterns must match at least one channel);
//  * every channel is used (served or published) by some code;
//  * every protobuf type the document names exists in proto/.
#include <gtest/gtest.h>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

namespace {

namespace fs = std::filesystem;

std::string Read(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::vector<std::string> Tokens(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string t;
  while (std::getline(ss, t, '.')) out.push_back(t);
  return out;
}

bool IsParam(const std::string& t) { return t.size() >= 2 && t.front() == '{' && t.back() == '}'; }

// Does subscription/literal pattern `pat` (NATS wildcards, {} placeholders) match `address`
// (whose {name} tokens match any single token)?
bool Matches(const std::string& pat, const std::string& address) {
  auto p = Tokens(pat);
  auto a = Tokens(address);
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == ">") return a.size() > i;
    if (i >= a.size()) return false;
    if (p[i] == "*" || IsParam(p[i]) || IsParam(a[i])) continue;
    if (p[i] != a[i]) return false;
  }
  return p.size() == a.size();
}

struct Usage {
  std::string literal;
  std::string file;
};

struct Contracts {
  YAML::Node doc;
  std::set<std::string> addresses;
  std::vector<Usage> usages;
  google::protobuf::DescriptorPool pool;

  Contracts() {
    const fs::path root = GPUAAS_SOURCE_DIR;
    doc = YAML::LoadFile((root / "asyncapi/gpuaas.asyncapi.yaml").string());
    for (const auto& ch : doc["channels"]) {
      if (ch.second["address"] && !ch.second["address"].IsNull()) {
        addresses.insert(ch.second["address"].as<std::string>());
      }
    }
    // String literals that are whole subjects: "gpuaas.<lowercase tokens>".
    const std::regex lit("\"(gpuaas\\.[a-z0-9_*>{}-]+(\\.[a-z0-9_*>{}-]+)*)\"");
    for (const char* dir : {"libs", "services", "tools/gpuaasctl"}) {
      for (const auto& e : fs::recursive_directory_iterator(root / dir)) {
        const auto path = e.path().string();
        const auto ext = e.path().extension();
        if (ext != ".cpp" && ext != ".hpp") continue;
        if (path.find("/tests/") != std::string::npos ||
            path.find("/testing/") != std::string::npos) {
          continue;
        }
        const std::string text = Read(e.path());
        for (std::sregex_iterator it(text.begin(), text.end(), lit), end; it != end; ++it) {
          usages.push_back({(*it)[1].str(), fs::relative(e.path(), root).string()});
        }
      }
    }
    google::protobuf::FileDescriptorSet set;
    std::ifstream in(GPUAAS_DESCRIPTOR_SET, std::ios::binary);
    EXPECT_TRUE(set.ParseFromIstream(&in)) << "cannot read " << GPUAAS_DESCRIPTOR_SET;
    for (const auto& f : set.file()) pool.BuildFile(f);
  }
};

const Contracts& C() {
  static Contracts c;
  return c;
}

bool IsPattern(const std::string& s) {
  return s.find('*') != std::string::npos || s.find('>') != std::string::npos ||
         s.find("{}") != std::string::npos;
}

TEST(ContractTest, DocumentDeclaresChannels) {
  EXPECT_EQ(C().doc["asyncapi"].as<std::string>(), "3.0.0");
  EXPECT_GE(C().addresses.size(), 5u);
  EXPECT_GE(C().usages.size(), 5u) << "the source scan found no subjects; is the scan broken?";
}

TEST(ContractTest, EverySubjectInCodeIsDeclared) {
  for (const auto& u : C().usages) {
    if (IsPattern(u.literal)) {
      bool any = false;
      for (const auto& a : C().addresses) any = any || Matches(u.literal, a);
      EXPECT_TRUE(any) << u.file << ": subscription pattern " << u.literal
                       << " matches no AsyncAPI channel";
    } else {
      EXPECT_TRUE(C().addresses.count(u.literal))
          << u.file << ": subject " << u.literal << " is not a channel in asyncapi/";
    }
  }
}

TEST(ContractTest, EveryDeclaredChannelIsServedOrPublished) {
  for (const auto& a : C().addresses) {
    bool used = false;
    for (const auto& u : C().usages) used = used || (!IsPattern(u.literal) && u.literal == a);
    EXPECT_TRUE(used) << "channel " << a << " is declared but no code serves or publishes it";
  }
}

TEST(ContractTest, EveryChannelHasAnOperation) {
  std::set<std::string> with_ops;
  for (const auto& op : C().doc["operations"]) {
    with_ops.insert(op.second["channel"]["$ref"].as<std::string>());
    if (op.second["reply"])
      with_ops.insert(op.second["reply"]["channel"]["$ref"].as<std::string>());
  }
  for (const auto& ch : C().doc["channels"]) {
    EXPECT_TRUE(with_ops.count("#/channels/" + ch.first.as<std::string>()))
        << "channel " << ch.first << " has no operation";
  }
}

TEST(ContractTest, EveryNamedProtobufTypeExists) {
  int named = 0;
  for (const auto& m : C().doc["components"]["messages"]) {
    for (const char* key : {"x-protobuf-type", "x-protobuf-result", "x-protobuf-data"}) {
      if (!m.second[key]) continue;
      const auto type = m.second[key].as<std::string>();
      ++named;
      EXPECT_NE(C().pool.FindMessageTypeByName(type), nullptr)
          << m.first << "." << key << " names " << type << ", which proto/ does not define";
    }
    EXPECT_TRUE(m.second["x-protobuf-type"]) << m.first << " names no protobuf type";
  }
  EXPECT_GT(named, 0);
}

TEST(ContractTest, MatcherSemantics) {
  EXPECT_TRUE(Matches("gpuaas.*.inventory.>", "gpuaas.v1.inventory.node.register"));
  EXPECT_FALSE(Matches("gpuaas.*.inventory.>", "gpuaas.v1.evt.inventory.node.registered"));
  EXPECT_TRUE(Matches("gpuaas.v1.dlq.{stream}.{consumer}", "gpuaas.v1.dlq.{stream}.{consumer}"));
  EXPECT_FALSE(Matches("gpuaas.v1.evt.inventory.node.>", "gpuaas.v1.evt.inventory"));
}

}  // namespace
