// Public ingress on a node (nftables DNAT). ExposureSpecTest and ExposureRunnerTest are pure: a
// fixture sysfs in a temp dir and a recording runner with canned `nft -j` output.
// ExposureNetnsTest runs the real thing inside namespaces it creates per test and deletes after:
//
//   client ns  eth0 203.0.113.2/24 ---- up0 203.0.113.10/24  node ns (the lab's "host")
//                                        gpuaasbr0 10.100.0.1/24: the real ipam network
//                                        (ApplyNetwork: bridge, GPUAAS-FWD, MASQUERADE, dnsmasq)
//   VM ns      eth0 10.100.0.11 (DHCP from that dnsmasq) ---- vnet1 on gpuaasbr0
//
// A server in the VM namespace answers TCP :22 with a banner and then echoes, and echoes UDP on
// :7; the client dials 203.0.113.10:20022 (and udp :20007). TEST-NET-3 exists only inside the
// namespaces; no packet leaves the machine. It SKIPs without root, nft or conntrack.
#include "gpuaas/node_agent/network/exposure_apply.hpp"

#include <arpa/inet.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"
#include "netns_lab.hpp"

namespace gpuaas::node_agent {
namespace {

using testing::TempDir;

using ::testing::Contains;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::IsEmpty;
using ::testing::Not;
using ::testing::UnorderedElementsAre;
using Json = nlohmann::json;

constexpr const char* kSsh = "0b6f2a52-1c1e-4f4a-9d7e-000000000001";
constexpr const char* kDns = "0b6f2a52-1c1e-4f4a-9d7e-000000000002";
constexpr const char* kOther = "0b6f2a52-1c1e-4f4a-9d7e-000000000003";
constexpr const char* kPublic = "203.0.113.10";
constexpr const char* kVmIp = "10.100.0.11";
constexpr const char* kVmMac = "52:54:00:a0:00:02";
constexpr const char* kBanner = "SSH-2.0-gpuaas-lab";

// /class/net/<iface>/type (1 = Ethernet, 32 = InfiniBand) under a fixture sys root.
void AddIface(const std::string& sys, const std::string& iface, int type) {
  std::filesystem::create_directories(sys + "/class/net/" + iface);
  std::ofstream(sys + "/class/net/" + iface + "/type") << type << "\n";
}

ExposureRule Rule(const char* id, const char* proto, int pub_port, const std::string& target,
                  int target_port) {
  return {id, proto, kPublic, pub_port, target, target_port, fmt::format("node-a/{}", pub_port)};
}

ExposureSpec BaseSpec(const std::string& sys) {
  ExposureSpec s;
  s.version = 1;
  s.uplink = "up0";
  s.subnet_cidr = "10.100.0.0/24";
  s.slice_ips = {"10.100.0.10", kVmIp};
  s.rules = {Rule(kSsh, "tcp", 20022, kVmIp, 22)};
  s.sys_root = sys;
  return s;
}

std::vector<std::string> Reasons(const std::vector<ExposureRefusal>& refused) {
  std::vector<std::string> out;
  out.reserve(refused.size());
  for (const auto& r : refused) out.push_back(r.exposure_id + ":" + r.reason);
  return out;
}

std::vector<std::string> Kinds(const std::vector<ExposureDrift>& drift) {
  std::vector<std::string> out;
  out.reserve(drift.size());
  for (const auto& d : drift) out.push_back(d.kind + ":" + d.exposure_id);
  return out;
}

// ---------------------------------------------------------------- a recording runner (unit)

class Recorder {
 public:
  NetContext Ctx() {
    NetContext ctx;
    ctx.netns = "gpuaas-never";
    ctx.run = [this](const std::vector<std::string>& argv,
                     std::chrono::milliseconds) -> Result<ToolResult> {
      calls.push_back(argv);
      // argv: ip netns exec <ns> <tool> ...
      const std::string tool = argv.size() > 4 ? Basename(argv[4]) : "";
      if (tool == "nft" && argv.size() > 6 && argv[5] == "-f") {
        std::ifstream f(argv[6]);
        std::ostringstream ss;
        ss << f.rdbuf();
        scripts.push_back(ss.str());
        return ToolResult{0, false, "", ""};
      }
      if (tool == "nft" && argv.size() > 6 && argv[5] == "-j") {
        if (table.empty()) return ToolResult{1, false, "", "Error: No such file or directory\n"};
        return ToolResult{0, false, table, ""};
      }
      if (tool == "conntrack") return conntrack(argv);
      return ToolResult{0, false, "", ""};
    };
    return ctx;
  }
  std::vector<std::string> Tools() const {
    std::vector<std::string> out;
    out.reserve(calls.size());
    for (const auto& c : calls) {
      out.push_back(c.size() > 5 ? fmt::format("{} {}", Basename(c[4]), c[5]) : "?");
    }
    return out;
  }

  std::vector<std::vector<std::string>> calls;
  std::vector<std::string> scripts;
  std::string table;  // what `nft -j list table` prints; "" = no table
  std::function<Result<ToolResult>(const std::vector<std::string>&)> conntrack =
      [](const std::vector<std::string>&) -> Result<ToolResult> {
    return ToolResult{1, false, "",
                      "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"};
  };
};

// `nft -j list table ip gpuaas_ingress` as nft 1.0.6 prints it.
class TableJson {
 public:
  TableJson() {
    items_ = Json::array({{{"metainfo", {{"version", "1.0.6"}, {"json_schema_version", 1}}}},
                          {{"table", {{"family", "ip"}, {"name", "gpuaas_ingress"}}}}});
    Chain("prerouting", "nat", "prerouting", -100, "accept");
    Chain("forward", "filter", "forward", 0, "accept");
  }
  TableJson& Chain(const std::string& name, const std::string& type, const std::string& hook,
                   int prio, const std::string& policy) {
    items_.push_back({{"chain",
                       {{"family", "ip"},
                        {"table", "gpuaas_ingress"},
                        {"name", name},
                        {"type", type},
                        {"hook", hook},
                        {"prio", prio},
                        {"policy", policy}}}});
    return *this;
  }
  static Json Match(Json left, Json right, const char* op = "==") {
    return {{"match", {{"op", op}, {"left", std::move(left)}, {"right", std::move(right)}}}};
  }
  static Json Payload(const char* proto, const char* field) {
    return {{"payload", {{"protocol", proto}, {"field", field}}}};
  }
  TableJson& Raw(const std::string& chain, const std::string& comment, Json expr) {
    Json rule = {{"family", "ip"}, {"table", "gpuaas_ingress"}, {"chain", chain}};
    if (!comment.empty()) rule["comment"] = comment;
    rule["expr"] = std::move(expr);
    items_.push_back({{"rule", rule}});
    return *this;
  }
  // The two rules ApplyExposures writes for one exposure.
  TableJson& Exposure(const std::string& id, const std::string& proto, int pub_port,
                      const std::string& target, int port) {
    const std::string tag = "gpuaas-exp-" + id;
    Raw("prerouting", tag,
        Json::array({Match({{"meta", {{"key", "iifname"}}}}, "up0"),
                     Match(Payload("ip", "daddr"), kPublic),
                     Match(Payload(proto.c_str(), "dport"), pub_port),
                     {{"dnat", {{"addr", target}, {"port", port}}}}}));
    return Raw("forward", tag,
               Json::array({Match({{"meta", {{"key", "iifname"}}}}, "up0"),
                            Match(Payload("ip", "daddr"), target),
                            Match(Payload(proto.c_str(), "dport"), port),
                            Match({{"ct", {{"key", "status"}}}}, "dnat", "in"),
                            {{"accept", nullptr}}}));
  }
  std::string Dump() const { return Json({{"nftables", items_}}).dump(); }

 private:
  Json items_;
};

// ---------------------------------------------------------------- validation (unit)

class ExposureSpecTest : public ::testing::Test {
 protected:
  void SetUp() override {
    sys_ = dir_.path() + "/sys";
    AddIface(sys_, "up0", 1);
    AddIface(sys_, "ib0", 32);
    AddIface(sys_, "roce0", 1);
    std::filesystem::create_directories(sys_ + "/class/net/roce0/device/infiniband/mlx5_0");
    AddIface(sys_, "bond0", 1);
    std::filesystem::create_symlink("../roce0", sys_ + "/class/net/bond0/lower_roce0");
  }

  // Every entry point refuses the spec with `reason` and runs no command.
  void ExpectRejected(const ExposureSpec& spec, const std::string& reason) {
    SCOPED_TRACE(reason);
    auto v = ValidateExposureSpec(spec);
    ASSERT_FALSE(v.ok());
    EXPECT_EQ(v.error().code, Code::kInvalidArgument);
    EXPECT_EQ(v.error().reason, reason) << v.error().ToString();
    EXPECT_EQ(v.error().details.at("stage"), "validate");
    Recorder rec;
    auto ctx = rec.Ctx();
    auto apply = ApplyExposures(spec, ctx);
    ASSERT_FALSE(apply.ok());
    EXPECT_EQ(apply.error().reason, reason);
    auto check = CheckExposures(spec, ctx);
    ASSERT_FALSE(check.ok());
    EXPECT_EQ(check.error().reason, reason);
    auto rec2 = ReconcileExposures(spec, ctx);
    ASSERT_FALSE(rec2.ok());
    EXPECT_EQ(rec2.error().reason, reason);
    EXPECT_THAT(rec.calls, IsEmpty());
  }

  // The spec passes as a whole and refuses exactly `rule` with `reason`.
  void ExpectRefused(const ExposureRule& rule, const std::string& reason) {
    SCOPED_TRACE(fmt::format("{} {}:{} -> {}:{}", rule.protocol, rule.public_ip, rule.public_port,
                             rule.target_ip, rule.target_port));
    auto s = BaseSpec(sys_);
    s.rules.push_back(rule);
    auto v = ValidateExposureSpec(s);
    ASSERT_TRUE(v.ok()) << v.error().ToString();
    ASSERT_EQ(v->size(), 1u);
    EXPECT_EQ((*v)[0].reason, reason);
    EXPECT_EQ((*v)[0].exposure_id, rule.exposure_id);
    EXPECT_EQ((*v)[0].slot_key, rule.slot_key);
    EXPECT_FALSE((*v)[0].message.empty());
  }

  TempDir dir_{"gpuaas-exp"};
  std::string sys_;
};

TEST_F(ExposureSpecTest, AGoodSpecHasNoRefusals) {
  auto s = BaseSpec(sys_);
  s.rules.push_back(Rule(kDns, "udp", 20007, kVmIp, 7));
  s.rules.push_back(Rule(kOther, "tcp", 20007, "10.100.0.10", 22));  // same port, other protocol
  s.rules.push_back({"0B6F2A52-1C1E-4F4A-9D7E-00000000000A", "tcp", "198.51.100.7", 443, kVmIp,
                     8443, ""});  // upper-case UUID, another public address
  auto v = ValidateExposureSpec(s);
  ASSERT_TRUE(v.ok()) << v.error().ToString();
  EXPECT_THAT(*v, IsEmpty());
  s.rules.clear();  // nothing to expose is a valid document (it removes everything)
  EXPECT_TRUE(ValidateExposureSpec(s).ok());
}

TEST_F(ExposureSpecTest, WholeSpecProblemsAreErrors) {
  struct Case {
    std::function<void(ExposureSpec&)> edit;
    const char* reason;
  };
  const std::vector<Case> cases = {
      {[](ExposureSpec& s) { s.version = 0; }, "invalid_version"},
      {[](ExposureSpec& s) { s.uplink = ""; }, "invalid_uplink"},
      {[](ExposureSpec& s) { s.uplink = "up0; drop"; }, "invalid_uplink"},
      {[](ExposureSpec& s) { s.uplink = "an-uplink-too-long"; }, "invalid_uplink"},
      {[](ExposureSpec& s) { s.uplink = "eth9"; }, "invalid_uplink"},  // no such interface
      {[](ExposureSpec& s) { s.uplink = "ib0"; }, "fabric_interface"},
      {[](ExposureSpec& s) { s.uplink = "roce0"; }, "fabric_interface"},
      {[](ExposureSpec& s) { s.uplink = "bond0"; }, "fabric_interface"},  // on top of roce0
      {[](ExposureSpec& s) { s.subnet_cidr = "10.100.0.5/24"; }, "invalid_subnet"},
      {[](ExposureSpec& s) { s.subnet_cidr = "10.100.0.0/31"; }, "invalid_subnet"},
      {[](ExposureSpec& s) { s.subnet_cidr = "10.100.0.0"; }, "invalid_subnet"},
      {[](ExposureSpec& s) { s.slice_ips.emplace_back("10.101.0.5"); }, "invalid_slice_ip"},
      {[](ExposureSpec& s) { s.slice_ips.emplace_back("10.100.0.255"); }, "invalid_slice_ip"},
  };
  for (const auto& c : cases) {
    auto s = BaseSpec(sys_);
    c.edit(s);
    ExpectRejected(s, c.reason);
  }
  auto fabric = ValidateExposureSpec([&] {
    auto s = BaseSpec(sys_);
    s.uplink = "bond0";
    return s;
  }());
  EXPECT_THAT(fabric.error().message, HasSubstr("stacked on roce0"));

  Recorder rec;
  auto ctx = rec.Ctx();
  ctx.netns = "bad ns";
  auto apply = ApplyExposures(BaseSpec(sys_), ctx);
  ASSERT_FALSE(apply.ok());
  EXPECT_EQ(apply.error().reason, "invalid_netns");
  EXPECT_THAT(rec.calls, IsEmpty());
}

TEST_F(ExposureSpecTest, EachRuleProblemIsARefusalWithItsReason) {
  ExpectRefused(Rule("not-a-uuid", "tcp", 20023, kVmIp, 22), "invalid_exposure_id");
  ExpectRefused(Rule("0b6f2a52-1c1e-4f4a-9d7e-00000000000g", "tcp", 20023, kVmIp, 22),
                "invalid_exposure_id");
  ExpectRefused(Rule(kOther, "sctp", 20023, kVmIp, 22), "invalid_protocol");
  ExpectRefused(Rule(kOther, "TCP", 20023, kVmIp, 22), "invalid_protocol");
  for (const char* ip : {"203.0.113", "203.0.113.010", "0.0.0.0", "127.0.0.1", "224.0.0.1",
                         "255.255.255.255", "169.254.1.1", "10.100.0.11", "::1"}) {
    auto r = Rule(kOther, "tcp", 20023, kVmIp, 22);
    r.public_ip = ip;
    ExpectRefused(r, "invalid_public_ip");
  }
  ExpectRefused(Rule(kOther, "tcp", 0, kVmIp, 22), "invalid_port");
  ExpectRefused(Rule(kOther, "tcp", 65536, kVmIp, 22), "invalid_port");
  ExpectRefused(Rule(kOther, "udp", 20023, kVmIp, -1), "invalid_port");
  ExpectRefused(Rule(kOther, "tcp", 20023, "10.100.0.50", 22), "target_not_slice");  // no slice
  ExpectRefused(Rule(kOther, "tcp", 20023, "192.168.1.5", 22), "target_not_slice");  // outside
  ExpectRefused(Rule(kOther, "tcp", 20023, "10.100.0.1", 22), "target_not_slice");   // gateway
  ExpectRefused(Rule(kOther, "tcp", 20023, "vm-1", 22), "target_not_slice");
}

TEST_F(ExposureSpecTest, EveryRuleOfADuplicatedEndpointIsRefused) {
  auto s = BaseSpec(sys_);
  s.rules.push_back(Rule(kOther, "tcp", 20022, "10.100.0.10", 22));  // same endpoint
  s.rules.push_back(Rule(kDns, "udp", 20022, kVmIp, 7));             // other protocol: fine
  auto v = ValidateExposureSpec(s);
  ASSERT_TRUE(v.ok()) << v.error().ToString();
  EXPECT_THAT(Reasons(*v), ElementsAre(fmt::format("{}:duplicate_endpoint", kSsh),
                                       fmt::format("{}:duplicate_endpoint", kOther)));

  // Only the udp rule is applied.
  Recorder rec;
  auto rep = ApplyExposures(s, rec.Ctx());
  ASSERT_TRUE(rep.ok()) << rep.error().ToString();
  EXPECT_THAT(rep->applied, ElementsAre(kDns));
  EXPECT_EQ(rep->refused.size(), 2u);
  ASSERT_EQ(rec.scripts.size(), 1u);
  EXPECT_THAT(rec.scripts[0], Not(HasSubstr("10.100.0.10")));
  EXPECT_THAT(rec.scripts[0], HasSubstr("udp dport 20022 dnat to 10.100.0.11:7"));
}

// ---------------------------------------------------------------- commands (unit)

class ExposureRunnerTest : public ExposureSpecTest {};

TEST_F(ExposureRunnerTest, ApplyReplacesOnlyItsTableInOneTransaction) {
  auto s = BaseSpec(sys_);
  s.rules.push_back(Rule(kDns, "udp", 20007, kVmIp, 7));
  s.rules.push_back(Rule(kOther, "tcp", 20023, "10.100.0.77", 22));  // refused
  Recorder rec;
  auto rep = ApplyExposures(s, rec.Ctx());
  ASSERT_TRUE(rep.ok()) << rep.error().ToString();
  EXPECT_TRUE(rep->changed);
  EXPECT_THAT(rep->applied, ElementsAre(kSsh, kDns));
  EXPECT_THAT(Reasons(rep->refused), ElementsAre(fmt::format("{}:target_not_slice", kOther)));
  EXPECT_THAT(rep->removed, IsEmpty());
  EXPECT_EQ(rep->conntrack_flushed, 0);
  EXPECT_THAT(Kinds(rep->drift), ElementsAre("table_missing:", fmt::format("rule_missing:{}", kSsh),
                                             fmt::format("rule_missing:{}", kDns),
                                             fmt::format("rule_missing:{}", kSsh),
                                             fmt::format("rule_missing:{}", kDns)));
  EXPECT_THAT(rec.Tools(), ElementsAre("nft -j", "nft -f"));
  EXPECT_THAT(rec.calls[0], ElementsAre(::testing::EndsWith("/ip"), "netns", "exec", "gpuaas-never",
                                        ::testing::EndsWith("/nft"), "-j", "list", "table", "ip",
                                        "gpuaas_ingress"));
  ASSERT_EQ(rec.scripts.size(), 1u);
  EXPECT_EQ(rec.scripts[0],
            "table ip gpuaas_ingress\n"
            "delete table ip gpuaas_ingress\n"
            "table ip gpuaas_ingress {\n"
            "\tchain prerouting {\n"
            "\t\ttype nat hook prerouting priority dstnat; policy accept;\n"
            "\t\tiifname \"up0\" ip daddr 203.0.113.10 tcp dport 20022 dnat to 10.100.0.11:22 "
            "comment \"gpuaas-exp-0b6f2a52-1c1e-4f4a-9d7e-000000000001\"\n"
            "\t\tiifname \"up0\" ip daddr 203.0.113.10 udp dport 20007 dnat to 10.100.0.11:7 "
            "comment \"gpuaas-exp-0b6f2a52-1c1e-4f4a-9d7e-000000000002\"\n"
            "\t}\n"
            "\tchain forward {\n"
            "\t\ttype filter hook forward priority filter; policy accept;\n"
            "\t\tiifname \"up0\" ip daddr 10.100.0.11 tcp dport 22 ct status dnat accept "
            "comment \"gpuaas-exp-0b6f2a52-1c1e-4f4a-9d7e-000000000001\"\n"
            "\t\tiifname \"up0\" ip daddr 10.100.0.11 udp dport 7 ct status dnat accept "
            "comment \"gpuaas-exp-0b6f2a52-1c1e-4f4a-9d7e-000000000002\"\n"
            "\t}\n"
            "}\n");
  // The script file is gone once nft has read it.
  EXPECT_FALSE(std::filesystem::exists(rec.calls[1].back()));
}

TEST_F(ExposureRunnerTest, AMatchingTableIsLeftAlone) {
  Recorder rec;
  rec.table = TableJson().Exposure(kSsh, "tcp", 20022, kVmIp, 22).Dump();
  auto rep = ApplyExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_TRUE(rep.ok()) << rep.error().ToString();
  EXPECT_FALSE(rep->changed);
  EXPECT_THAT(rep->drift, IsEmpty());
  EXPECT_THAT(rep->applied, ElementsAre(kSsh));
  EXPECT_THAT(rec.Tools(), ElementsAre("nft -j"));
  auto check = CheckExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_TRUE(check.ok());
  EXPECT_THAT(*check, IsEmpty());
}

TEST_F(ExposureRunnerTest, CheckNamesForeignStaleMissingAndChainDrift) {
  auto s = BaseSpec(sys_);
  s.rules.push_back(Rule(kDns, "udp", 20007, kVmIp, 7));
  Recorder rec;
  rec.table = TableJson()
                  .Chain("extra", "filter", "input", 0, "drop")
                  .Exposure(kSsh, "tcp", 20022, kVmIp, 2222)          // stale: other port
                  .Exposure(kOther, "tcp", 20023, "10.100.0.10", 22)  // not in the spec
                  .Raw("prerouting", "",
                       Json::array({TableJson::Match(  // untagged
                                        TableJson::Payload("tcp", "dport"), 2222),
                                    {{"dnat", {{"addr", "10.100.0.12"}}}}}))
                  .Dump();
  auto check = CheckExposures(s, rec.Ctx());
  ASSERT_TRUE(check.ok()) << check.error().ToString();
  EXPECT_THAT(
      Kinds(*check),
      ElementsAre("rule_foreign:",  // chain extra
                  fmt::format("rule_stale:{}", kSsh), fmt::format("rule_stale:{}", kSsh),
                  "rule_foreign:", "rule_foreign:", "rule_foreign:",
                  fmt::format("rule_missing:{}", kDns), fmt::format("rule_missing:{}", kDns)));
  EXPECT_THAT((*check)[0].detail, HasSubstr("chain extra"));
  EXPECT_THAT((*check)[1].detail, HasSubstr("dnat to 10.100.0.11:2222"));
  EXPECT_THAT((*check)[1].detail, HasSubstr("expected iifname \"up0\" ip daddr 203.0.113.10 tcp "
                                            "dport 20022 dnat to 10.100.0.11:22"));
  EXPECT_THAT((*check)[5].detail, HasSubstr("tcp dport 2222 dnat to 10.100.0.12"));
  EXPECT_THAT(rec.Tools(), ElementsAre("nft -j"));  // read-only

  // The forward chain's policy turned to drop, its hook priority moved: the chain is stale.
  rec.table = TableJson().Dump();
  Json t = Json::parse(rec.table);
  t["nftables"][3]["chain"]["policy"] = "drop";
  t["nftables"][2]["chain"]["prio"] = 0;
  rec.table = t.dump();
  check = CheckExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_TRUE(check.ok());
  EXPECT_THAT(Kinds(*check),
              ElementsAre("chain_stale:", "chain_stale:", fmt::format("rule_missing:{}", kSsh),
                          fmt::format("rule_missing:{}", kSsh)));
  EXPECT_THAT((*check)[1].detail, HasSubstr("policy drop"));

  rec.table = "{\"nftables\": [{\"rule\": {\"expr\": 5}}, {\"chain\": {\"prio\": \"x\"}}]}";
  check = CheckExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_FALSE(check.ok());
  EXPECT_EQ(check.error().reason, "unexpected_tool_output");
}

TEST_F(ExposureRunnerTest, MappingsThatGoAreFlushedFromConntrack) {
  Recorder rec;
  rec.table = TableJson()
                  .Exposure(kSsh, "tcp", 20022, kVmIp, 22)
                  .Exposure(kDns, "udp", 20007, kVmIp, 7)
                  .Exposure(kOther, "tcp", 20023, "10.100.0.10", 22)
                  .Dump();
  std::vector<std::vector<std::string>> flushed;
  rec.conntrack = [&](const std::vector<std::string>& argv) -> Result<ToolResult> {
    flushed.emplace_back(argv.begin() + 5, argv.end());
    return ToolResult{0, false, "tcp 6 ...\n",
                      "conntrack v1.4.7 (conntrack-tools): 2 flow entries have been deleted.\n"};
  };
  auto s = BaseSpec(sys_);
  s.version = 2;
  s.rules.push_back(Rule(kOther, "tcp", 20023, "10.100.0.10", 2222));  // target port moved
  auto rep = ApplyExposures(s, rec.Ctx());
  ASSERT_TRUE(rep.ok()) << rep.error().ToString();
  EXPECT_EQ(rep->version, 2);
  EXPECT_THAT(rep->removed, ElementsAre(kDns));
  EXPECT_EQ(rep->conntrack_flushed, 4);
  EXPECT_EQ(rep->conntrack_problem, "");
  EXPECT_THAT(flushed, UnorderedElementsAre(
                           ElementsAre("-D", "-p", "tcp", "--orig-dst", kPublic, "--orig-port-dst",
                                       "20023", "--reply-src", "10.100.0.10"),
                           ElementsAre("-D", "-p", "udp", "--orig-dst", kPublic, "--orig-port-dst",
                                       "20007", "--reply-src", kVmIp)));

  // "0 flow entries" (conntrack exits 1) is a success with nothing to delete.
  rec.conntrack = [](const std::vector<std::string>&) -> Result<ToolResult> {
    return ToolResult{1, false, "",
                      "conntrack v1.4.7 (conntrack-tools): 0 flow entries have been deleted.\n"};
  };
  rep = ApplyExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->conntrack_flushed, 0);

  // A conntrack that cannot run, or fails: the rules are still replaced, and the report says
  // the flows were not flushed instead of claiming 0.
  rec.conntrack = [](const std::vector<std::string>&) -> Result<ToolResult> {
    return Error::Internal("exec_failed", "conntrack: No such file or directory");
  };
  rep = ApplyExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_TRUE(rep.ok());
  EXPECT_TRUE(rep->changed);
  EXPECT_EQ(rep->conntrack_flushed, -1);
  EXPECT_THAT(rep->conntrack_problem, HasSubstr("No such file or directory"));
  rec.conntrack = [](const std::vector<std::string>&) -> Result<ToolResult> {
    return ToolResult{1, false, "",
                      "conntrack v1.4.7 (conntrack-tools): Operation not permitted\n"};
  };
  rep = ApplyExposures(BaseSpec(sys_), rec.Ctx());
  ASSERT_TRUE(rep.ok());
  EXPECT_EQ(rep->conntrack_flushed, -1);
  EXPECT_THAT(rep->conntrack_problem, HasSubstr("Operation not permitted"));
}

TEST_F(ExposureRunnerTest, NoExposureForLooksAtEveryRule) {
  Recorder rec;
  EXPECT_EQ(NoExposureFor(kVmIp, rec.Ctx()).value(), true);  // no table
  rec.table = TableJson().Exposure(kSsh, "tcp", 20022, kVmIp, 22).Dump();
  EXPECT_EQ(NoExposureFor(kVmIp, rec.Ctx()).value(), false);
  EXPECT_EQ(NoExposureFor("10.100.0.10", rec.Ctx()).value(), true);
  // A hand-made rule with a counter still names its target.
  rec.table = TableJson()
                  .Raw("prerouting", "",
                       Json::array({{{"counter", nullptr}}, {{"dnat", {{"addr", "10.100.0.10"}}}}}))
                  .Dump();
  EXPECT_EQ(NoExposureFor("10.100.0.10", rec.Ctx()).value(), false);
  auto bad = NoExposureFor("10.100.0", rec.Ctx());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_target_ip");
}

// ---------------------------------------------------------------- real namespaces (root)

// TCP :22 answers a banner line and then echoes; UDP :7 echoes. In the VM namespace.
class LabServer {
 public:
  bool Start(const std::string& ns) {
    listen_ = testing::NetnsLab::SocketIn(ns, SOCK_STREAM);
    udp_ = testing::NetnsLab::SocketIn(ns, SOCK_DGRAM);
    if (listen_ < 0 || udp_ < 0) return false;
    const int one = 1;
    ::setsockopt(listen_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (!Bind(listen_, 22) || ::listen(listen_, 16) != 0 || !Bind(udp_, 7)) return false;
    thread_ = std::thread([this] { Loop(); });
    return true;
  }
  ~LabServer() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
    for (int fd : conns_) ::close(fd);
    if (listen_ >= 0) ::close(listen_);
    if (udp_ >= 0) ::close(udp_);
  }

 private:
  static bool Bind(int fd, int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    return ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  void Loop() {
    while (!stop_) {
      std::vector<pollfd> fds{{listen_, POLLIN, 0}, {udp_, POLLIN, 0}};
      for (int fd : conns_) fds.push_back({fd, POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 50) <= 0) continue;
      char buf[512];
      if (fds[0].revents & POLLIN) {
        const int c = ::accept4(listen_, nullptr, nullptr, SOCK_CLOEXEC);
        if (c >= 0) {
          const std::string banner = std::string(kBanner) + "\r\n";
          (void)::send(c, banner.data(), banner.size(), MSG_NOSIGNAL);
          conns_.push_back(c);
        }
      }
      if (fds[1].revents & POLLIN) {
        sockaddr_in from{};
        socklen_t len = sizeof from;
        const ssize_t n =
            ::recvfrom(udp_, buf, sizeof buf, 0, reinterpret_cast<sockaddr*>(&from), &len);
        if (n > 0) {
          (void)::sendto(udp_, buf, static_cast<size_t>(n), 0, reinterpret_cast<sockaddr*>(&from),
                         len);
        }
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        const ssize_t n = ::recv(fds[i].fd, buf, sizeof buf, 0);
        if (n <= 0) {
          ::close(fds[i].fd);
          conns_.erase(std::find(conns_.begin(), conns_.end(), fds[i].fd));
        } else {
          (void)::send(fds[i].fd, buf, static_cast<size_t>(n), MSG_NOSIGNAL);
        }
      }
    }
  }

  int listen_ = -1, udp_ = -1;
  std::vector<int> conns_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A client socket in the client namespace. Outcomes: "banner" / "echo" (what was read is in
// `text`), "refused", "timeout", "reset", "closed", or "error: ...".
class Client {
 public:
  Client(const std::string& ns, int type) : fd_(testing::NetnsLab::SocketIn(ns, type)) {}
  ~Client() {
    if (fd_ >= 0) ::close(fd_);
  }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  std::string Connect(int port, std::chrono::milliseconds timeout = std::chrono::seconds(2)) {
    if (fd_ < 0) return "error: no socket";
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    ::inet_pton(AF_INET, kPublic, &a.sin_addr);
    const int flags = ::fcntl(fd_, F_GETFL);
    ::fcntl(fd_, F_SETFL, flags | O_NONBLOCK);
    int rc = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    if (rc != 0 && errno == EINPROGRESS) {
      pollfd p{fd_, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(timeout.count())) == 0) return "timeout";
      int err = 0;
      socklen_t len = sizeof err;
      ::getsockopt(fd_, SOL_SOCKET, SO_ERROR, &err, &len);
      errno = err;
      rc = err == 0 ? 0 : -1;
    }
    ::fcntl(fd_, F_SETFL, flags);
    if (rc != 0) return errno == ECONNREFUSED ? "refused" : fmt::format("error: {}", errno);
    return "connected";
  }
  // Connect and read the first line: "banner" when it is the lab server's.
  std::string Dial(int port, std::chrono::milliseconds timeout = std::chrono::seconds(2)) {
    auto c = Connect(port, timeout);
    if (c != "connected") return c;
    auto r = Read(timeout);
    if (r != "data") return r;
    return StartsWith(text, kBanner) ? "banner" : "data";
  }
  // Send `msg` and read the answer: "echo" when it came back unchanged.
  std::string Echo(const std::string& msg,
                   std::chrono::milliseconds timeout = std::chrono::seconds(2)) {
    if (::send(fd_, msg.data(), msg.size(), MSG_NOSIGNAL) < 0) {
      return errno == ECONNREFUSED ? "refused" : fmt::format("error: {}", errno);
    }
    auto r = Read(timeout);
    if (r != "data") return r;
    return text == msg ? "echo" : "data";
  }

  std::string text;

 private:
  std::string Read(std::chrono::milliseconds timeout) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(timeout.count())) == 0) return "timeout";
    char buf[512];
    const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
    if (n < 0) {
      if (errno == ECONNRESET) return "reset";
      if (errno == ECONNREFUSED) return "refused";
      return fmt::format("error: {}", errno);
    }
    if (n == 0) return "closed";
    text.assign(buf, static_cast<size_t>(n));
    return "data";
  }
  int fd_;
};

class ExposureNetnsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = lab_.Open("e"); !why.empty()) GTEST_SKIP() << why;
    if (auto why = lab_.Need({"nft", "conntrack"}); !why.empty()) GTEST_SKIP() << why;
    node_ = lab_.host();
    ctx_.netns = node_;

    // The slice network, exactly as the agent applies it (ipam's document).
    net_.bridge = "gpuaasbr0";
    net_.gateway_cidr = "10.100.0.1/24";
    net_.subnet_cidr = "10.100.0.0/24";
    net_.state_dir = dir_.path() + "/net";
    net_.reservations = {{"52:54:00:a0:00:01", "10.100.0.10", "slice-1", "node-a/0"},
                         {kVmMac, kVmIp, "slice-2", "node-a/1"}};
    net_.version = 1;
    auto applied = ApplyNetwork(net_, ctx_);
    ASSERT_TRUE(applied.ok()) << applied.error().ToString();

    client_ = lab_.AddNamespace("client");
    ASSERT_FALSE(client_.empty());
    Ip(node_, {"link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", client_});
    Ip(node_, {"addr", "add", std::string(kPublic) + "/24", "dev", "up0"});
    Ip(node_, {"link", "set", "up0", "up"});
    Ip(client_, {"link", "set", "lo", "up"});
    Ip(client_, {"addr", "add", "203.0.113.2/24", "dev", "eth0"});
    Ip(client_, {"link", "set", "eth0", "up"});

    vm_ = lab_.AddVm("vm", kVmMac, "vnet1", net_.bridge);
    ASSERT_FALSE(vm_.empty());
    applied = ApplyNetwork(net_, ctx_);  // isolates the new port
    ASSERT_TRUE(applied.ok()) << applied.error().ToString();
    auto leased = lab_.Dhcp(vm_);
    ASSERT_EQ(leased, kVmIp);
    Ip(vm_, {"addr", "add", std::string(kVmIp) + "/24", "dev", "eth0"});
    Ip(vm_, {"route", "add", "default", "via", "10.100.0.1"});
    ASSERT_TRUE(server_.Start(vm_));

    sys_ = dir_.path() + "/sys";
    AddIface(sys_, "up0", 1);
    spec_ = BaseSpec(sys_);
    spec_.rules.push_back(Rule(kDns, "udp", 20007, kVmIp, 7));
  }

  void TearDown() override {
    if (node_.empty()) return;
    auto down = TeardownExposures(ctx_);
    EXPECT_TRUE(down.ok()) << down.error().ToString();
    auto net = TeardownNetwork(net_, ctx_);
    EXPECT_TRUE(net.ok()) << net.error().ToString();
  }

  void Ip(const std::string& ns, std::vector<std::string> args) {
    args.insert(args.begin(), {"ip", "-n", ns});
    auto r = lab_.Run(args);
    ASSERT_EQ(r.exit_code, 0) << fmt::format("{}: {}", fmt::join(args, " "), r.err);
  }
  ToolResult Nft(std::vector<std::string> args) {
    args.insert(args.begin(), "nft");
    return lab_.InNs(node_, std::move(args));
  }
  std::string Table() { return Nft({"-a", "list", "table", "ip", kExposureTable}).out; }
  // The handle of the rule in `chain` whose listing contains `needle`.
  std::string Handle(const std::string& chain, const std::string& needle) {
    for (const auto& line :
         SplitLines(Nft({"-a", "list", "chain", "ip", kExposureTable, chain}).out)) {
      const size_t at = line.find("# handle ");
      if (line.find(needle) != std::string::npos && at != std::string::npos) {
        return Trim(line.substr(at + 9));
      }
    }
    return "";
  }
  // The node's conntrack entries for a public port that were DNATed to the VM.
  int Flows(const std::string& proto, int port) {
    auto r = lab_.InNs(node_, {"conntrack", "-L", "-p", proto, "--orig-port-dst",
                               std::to_string(port), "--reply-src", kVmIp});
    int n = 0;
    for (const auto& line : SplitLines(r.out)) n += StartsWith(line, proto) ? 1 : 0;
    return n;
  }
  ExposureApplyReport MustApply(const ExposureSpec& spec) {
    auto r = ApplyExposures(spec, ctx_);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    return r.ok() ? *r : ExposureApplyReport{};
  }
  std::vector<ExposureDrift> MustCheck() {
    auto r = CheckExposures(spec_, ctx_);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    return r.ok() ? *r : std::vector<ExposureDrift>{{"", "check_failed", ""}};
  }
  std::string DialSsh(std::chrono::milliseconds timeout = std::chrono::seconds(2)) {
    Client c(client_, SOCK_STREAM);
    return c.Dial(20022, timeout);
  }

  TempDir dir_{"gpuaas-exp"};
  testing::NetnsLab lab_;
  std::string node_, client_, vm_, sys_;
  NetworkSpec net_;
  NetContext ctx_;
  ExposureSpec spec_;
  LabServer server_;
};

TEST_F(ExposureNetnsTest, ClientReachesTheVmThroughTheDnatOnThePublicAddress) {
  // Without an exposure the public port is closed (the node itself answers with a RST).
  EXPECT_EQ(DialSsh(), "refused");

  auto rep = MustApply(spec_);
  EXPECT_TRUE(rep.changed);
  EXPECT_THAT(rep.applied, ElementsAre(kSsh, kDns));
  EXPECT_THAT(rep.refused, IsEmpty());
  EXPECT_EQ(rep.conntrack_flushed, 0);

  Client ssh(client_, SOCK_STREAM);
  EXPECT_EQ(ssh.Dial(20022), "banner") << ssh.text;
  EXPECT_EQ(ssh.Echo("uname -a\n"), "echo");
  Client udp(client_, SOCK_DGRAM);
  ASSERT_EQ(udp.Connect(20007), "connected");
  EXPECT_EQ(udp.Echo("ping"), "echo");

  // Alongside ipam's own forward chain (iptables-nft), which the packet also passes.
  EXPECT_THAT(lab_.InNs(node_, {"iptables", "-w", "5", "-S", "FORWARD"}).out,
              HasSubstr("-A FORWARD -j GPUAAS-FWD-gpuaasbr0"));
  EXPECT_THAT(MustCheck(), IsEmpty());
  EXPECT_EQ(NoExposureFor(kVmIp, ctx_).value(), false);
  EXPECT_EQ(NoExposureFor("10.100.0.10", ctx_).value(), true);
  // The VM sees the client's own address (DNAT only, no SNAT on the way in).
  EXPECT_EQ(Flows("tcp", 20022), 1);
  EXPECT_THAT(lab_.InNs(node_, {"conntrack", "-L", "-p", "tcp", "--orig-port-dst", "20022"}).out,
              HasSubstr("src=10.100.0.11 dst=203.0.113.2 sport=22"));
}

TEST_F(ExposureNetnsTest, RemovingTheExposureClosesThePortAndFlushesItsFlows) {
  MustApply(spec_);
  Client ssh(client_, SOCK_STREAM);
  ASSERT_EQ(ssh.Dial(20022), "banner");
  Client udp(client_, SOCK_DGRAM);
  ASSERT_EQ(udp.Connect(20007), "connected");
  ASSERT_EQ(udp.Echo("ping"), "echo");

  // Control: rules deleted without a conntrack flush leave both flows working on their old NAT
  // binding. That is why ApplyExposures flushes.
  ASSERT_TRUE(TeardownExposures(ctx_).ok());
  EXPECT_EQ(ssh.Echo("still there?\n"), "echo");
  EXPECT_EQ(udp.Echo("ping"), "echo");
  EXPECT_EQ(DialSsh(), "refused");  // new connections are refused at once
  auto back = MustApply(spec_);
  EXPECT_THAT(Kinds(back.drift), Contains(std::string("table_missing:")));
  EXPECT_EQ(back.conntrack_flushed, 0);  // nothing went away: the flows are kept
  EXPECT_EQ(ssh.Echo("after re-apply\n"), "echo");
  EXPECT_EQ(Flows("tcp", 20022), 1);
  EXPECT_EQ(Flows("udp", 20007), 1);

  // Release: version 2 has no rules.
  auto gone = spec_;
  gone.version = 2;
  gone.rules.clear();
  auto t0 = std::chrono::steady_clock::now();
  auto rep = MustApply(gone);
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_TRUE(rep.changed);
  EXPECT_THAT(rep.applied, IsEmpty());
  EXPECT_THAT(rep.removed, ElementsAre(kSsh, kDns));
  EXPECT_EQ(rep.conntrack_flushed, 2) << rep.conntrack_problem;
  EXPECT_EQ(Flows("tcp", 20022), 0);
  EXPECT_EQ(Flows("udp", 20007), 0);
  std::cerr << fmt::format("[ timing ] release apply with flush: {} ms\n",
                           std::chrono::duration_cast<std::chrono::milliseconds>(took).count());

  // The established session is cut (its next segment meets no DNAT and the node resets it),
  // the UDP flow gets port-unreachable, and a new connection is refused quickly.
  EXPECT_EQ(ssh.Echo("hello?\n"), "reset");
  EXPECT_EQ(udp.Echo("ping"), "refused");
  t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(DialSsh(std::chrono::milliseconds(500)), "refused");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  EXPECT_EQ(NoExposureFor(kVmIp, ctx_).value(), true);
  EXPECT_THAT(Table(), Not(HasSubstr("dnat")));
  spec_ = gone;
}

TEST_F(ExposureNetnsTest, HandAddedRulesAreForeignDeletedRulesMissingAndReconcileRepairs) {
  MustApply(spec_);
  ASSERT_EQ(DialSsh(), "banner");

  // Someone adds rules by hand to the platform's table: untagged, and tagged for an exposure
  // this node does not have.
  ASSERT_EQ(Nft({"add", "rule", "ip", kExposureTable, "prerouting", "iifname", "\"up0\"", "tcp",
                 "dport", "2222", "dnat", "to", "10.100.0.10:22"})
                .exit_code,
            0);
  ASSERT_EQ(Nft({"add", "rule", "ip", kExposureTable, "forward", "ip", "daddr", "10.100.0.10",
                 "accept", "comment", fmt::format("\"gpuaas-exp-{}\"", kOther)})
                .exit_code,
            0);
  auto drift = MustCheck();
  EXPECT_THAT(Kinds(drift), ElementsAre("rule_foreign:", "rule_foreign:"));
  EXPECT_THAT(drift[0].detail, HasSubstr("tcp dport 2222 dnat to 10.100.0.10:22"));
  EXPECT_THAT(drift[1].detail, HasSubstr(kOther));
  EXPECT_THAT(Table(), HasSubstr("dport 2222"));  // Check changed nothing

  auto fixed = ReconcileExposures(spec_, ctx_);
  ASSERT_TRUE(fixed.ok()) << fixed.error().ToString();
  EXPECT_THAT(Kinds(*fixed), ElementsAre("rule_foreign:", "rule_foreign:"));
  EXPECT_THAT(Table(), Not(HasSubstr("2222")));
  EXPECT_THAT(Table(), Not(HasSubstr(kOther)));
  EXPECT_THAT(MustCheck(), IsEmpty());
  EXPECT_EQ(DialSsh(), "banner");

  // A deleted DNAT rule: missing; the client is refused until reconcile restores it.
  const auto handle = Handle("prerouting", "dport 20022");
  ASSERT_FALSE(handle.empty()) << Table();
  ASSERT_EQ(Nft({"delete", "rule", "ip", kExposureTable, "prerouting", "handle", handle}).exit_code,
            0);
  EXPECT_EQ(DialSsh(), "refused");
  EXPECT_THAT(Kinds(MustCheck()), ElementsAre(fmt::format("rule_missing:{}", kSsh)));
  fixed = ReconcileExposures(spec_, ctx_);
  ASSERT_TRUE(fixed.ok()) << fixed.error().ToString();
  EXPECT_THAT(Kinds(*fixed), ElementsAre(fmt::format("rule_missing:{}", kSsh)));
  EXPECT_EQ(DialSsh(), "banner");

  // A tagged rule edited in place (another target port): stale, replaced.
  const auto edited = Handle("prerouting", "dport 20022");
  ASSERT_EQ(Nft({"replace",    "rule",
                 "ip",         kExposureTable,
                 "prerouting", "handle",
                 edited,       "iifname",
                 "\"up0\"",    "ip",
                 "daddr",      kPublic,
                 "tcp",        "dport",
                 "20022",      "dnat",
                 "to",         "10.100.0.11:2200",
                 "comment",    fmt::format("\"gpuaas-exp-{}\"", kSsh)})
                .exit_code,
            0);
  EXPECT_EQ(DialSsh(), "refused");  // the VM has nothing on 2200
  drift = MustCheck();
  EXPECT_THAT(Kinds(drift), ElementsAre(fmt::format("rule_stale:{}", kSsh)));
  EXPECT_THAT(drift[0].detail, HasSubstr("10.100.0.11:2200"));
  ASSERT_TRUE(ReconcileExposures(spec_, ctx_).ok());
  EXPECT_EQ(DialSsh(), "banner");

  // The forward chain's policy flipped to drop (replies stop): the chain is stale.
  ASSERT_EQ(Nft({"add", "chain", "ip", kExposureTable, "forward", "{ policy drop; }"}).exit_code,
            0);
  EXPECT_EQ(DialSsh(std::chrono::milliseconds(500)), "timeout");
  EXPECT_THAT(Kinds(MustCheck()), ElementsAre("chain_stale:"));
  ASSERT_TRUE(ReconcileExposures(spec_, ctx_).ok());
  EXPECT_EQ(DialSsh(), "banner");

  // The whole table deleted: re-created.
  ASSERT_EQ(Nft({"delete", "table", "ip", kExposureTable}).exit_code, 0);
  EXPECT_EQ(DialSsh(), "refused");
  fixed = ReconcileExposures(spec_, ctx_);
  ASSERT_TRUE(fixed.ok());
  EXPECT_EQ(Kinds(*fixed).front(), "table_missing:");
  EXPECT_EQ(DialSsh(), "banner");
  EXPECT_THAT(MustCheck(), IsEmpty());
  // Reconcile of a matching table does nothing at all.
  const std::string before = Table();
  fixed = ReconcileExposures(spec_, ctx_);
  ASSERT_TRUE(fixed.ok());
  EXPECT_THAT(*fixed, IsEmpty());
  EXPECT_EQ(Table(), before);
}

TEST_F(ExposureNetnsTest, FabricUplinkIsRefusedAndANonSliceTargetIsRefusedPerRule) {
  // The uplink as an InfiniBand port, then as a RoCE port: nothing is created.
  const std::string fabric = dir_.path() + "/sys-ib";
  AddIface(fabric, "up0", 32);
  auto s = spec_;
  s.sys_root = fabric;
  auto r = ApplyExposures(s, ctx_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kInvalidArgument);
  EXPECT_EQ(r.error().reason, "fabric_interface");
  const std::string roce = dir_.path() + "/sys-roce";
  AddIface(roce, "up0", 1);
  std::filesystem::create_directories(roce + "/class/net/up0/device/infiniband/mlx5_0");
  s.sys_root = roce;
  r = ApplyExposures(s, ctx_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "fabric_interface");
  EXPECT_THAT(Nft({"list", "tables"}).out, Not(HasSubstr(kExposureTable)));
  EXPECT_EQ(DialSsh(), "refused");

  // A target that is no slice (an unreserved address, one outside the subnet) is refused per
  // rule; the valid rule of the same document is applied.
  s = spec_;
  s.rules = {Rule(kSsh, "tcp", 20022, kVmIp, 22), Rule(kDns, "tcp", 20023, "10.100.0.50", 22),
             Rule(kOther, "tcp", 20024, "192.168.1.5", 22)};
  auto rep = MustApply(s);
  EXPECT_THAT(rep.applied, ElementsAre(kSsh));
  EXPECT_THAT(Reasons(rep.refused), ElementsAre(fmt::format("{}:target_not_slice", kDns),
                                                fmt::format("{}:target_not_slice", kOther)));
  EXPECT_EQ(DialSsh(), "banner");
  Client other(client_, SOCK_STREAM);
  EXPECT_EQ(other.Dial(20023), "refused");
  EXPECT_THAT(Table(), Not(HasSubstr("10.100.0.50")));
  EXPECT_THAT(Table(), Not(HasSubstr("192.168.1.5")));
  spec_ = s;
  EXPECT_THAT(MustCheck(), IsEmpty());  // refused rules are not expected in the kernel
}

TEST_F(ExposureNetnsTest, ApplyTwiceChangesNothingAndNewExposuresLeaveOpenSessionsAlone) {
  auto one = spec_;
  one.rules.pop_back();  // ssh only
  EXPECT_TRUE(MustApply(one).changed);
  const std::string table = Table();  // with rule handles
  auto again = MustApply(one);
  EXPECT_FALSE(again.changed);
  EXPECT_THAT(again.drift, IsEmpty());
  EXPECT_THAT(again.removed, IsEmpty());
  EXPECT_EQ(again.conntrack_flushed, 0);
  EXPECT_EQ(Table(), table);

  Client ssh(client_, SOCK_STREAM);
  ASSERT_EQ(ssh.Dial(20022), "banner");
  // A second exposure replaces the table; the open session keeps going (its NAT binding lives in
  // conntrack, and that mapping did not go away).
  auto two = spec_;
  two.version = 2;
  auto rep = MustApply(two);
  EXPECT_TRUE(rep.changed);
  EXPECT_THAT(rep.removed, IsEmpty());
  EXPECT_EQ(rep.conntrack_flushed, 0);
  EXPECT_EQ(ssh.Echo("still here\n"), "echo");
  Client udp(client_, SOCK_DGRAM);
  ASSERT_EQ(udp.Connect(20007), "connected");
  EXPECT_EQ(udp.Echo("ping"), "echo");
  spec_ = two;
}

// Not a benchmark: what an apply and a check cost through `ip netns exec` on this machine.
TEST_F(ExposureNetnsTest, ApplyAndCheckTimings) {
  using Ms = std::chrono::duration<double, std::milli>;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (int n : {1, 100}) {
    auto s = spec_;
    s.rules.clear();
    for (int i = 0; i < n; ++i) {
      s.rules.push_back(
          Rule("", "tcp", 30000 + i, i % 2 == 0 ? kVmIp : "10.100.0.10", 22 + (i / 2)));
      s.rules.back().exposure_id = fmt::format("0b6f2a52-1c1e-4f4a-9d7e-{:012x}", 0x100 + i);
    }
    std::vector<double> changed, unchanged, check;
    for (int run = 0; run < 5; ++run) {
      ASSERT_TRUE(TeardownExposures(ctx_).ok());
      auto t0 = std::chrono::steady_clock::now();
      auto a = MustApply(s);
      changed.push_back(Ms(std::chrono::steady_clock::now() - t0).count());
      EXPECT_TRUE(a.changed);
      EXPECT_EQ(a.applied.size(), static_cast<size_t>(n));
      t0 = std::chrono::steady_clock::now();
      auto b = MustApply(s);
      unchanged.push_back(Ms(std::chrono::steady_clock::now() - t0).count());
      EXPECT_FALSE(b.changed);
      t0 = std::chrono::steady_clock::now();
      auto c = CheckExposures(s, ctx_);
      check.push_back(Ms(std::chrono::steady_clock::now() - t0).count());
      ASSERT_TRUE(c.ok());
      EXPECT_THAT(*c, IsEmpty());
    }
    std::cerr << fmt::format(
        "[ timing ] {} exposures: apply (table replaced) median {:.1f} ms, apply (unchanged) "
        "median {:.1f} ms, check median {:.1f} ms; runs {:.1f} / {:.1f} / {:.1f}\n",
        n, median(changed), median(unchanged), median(check), fmt::join(changed, " "),
        fmt::join(unchanged, " "), fmt::join(check, " "));
  }
}

}  // namespace
}  // namespace gpuaas::node_agent
