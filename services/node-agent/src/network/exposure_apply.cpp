#include "gpuaas/node_agent/network/exposure_apply.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "network/net_host.hpp"

namespace gpuaas::node_agent {
namespace {

using Args = std::vector<std::string>;
using Json = nlohmann::json;

constexpr const char* kTagPrefix = "gpuaas-exp-";
constexpr int kArphrdInfiniband = 32;

// Apply and Reconcile read the table, then replace it: one at a time in this process.
std::mutex& ApplyMutex() {
  static std::mutex mu;
  return mu;
}

// ---------------------------------------------------------------- pure helpers

// Dotted-quad IPv4 only (inet_pton refuses leading zeros, so "010" is never octal to anyone).
std::optional<uint32_t> ParseIpv4(const std::string& s) {
  in_addr a{};
  if (s.size() > 15 || ::inet_pton(AF_INET, s.c_str(), &a) != 1) return std::nullopt;
  return ntohl(a.s_addr);
}

std::string Ipv4String(uint32_t a) {
  return fmt::format("{}.{}.{}.{}", a >> 24, (a >> 16) & 255, (a >> 8) & 255, a & 255);
}

uint32_t MaskOf(int prefix) { return prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix); }

bool IsUuid(const std::string& s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const bool dash = i == 8 || i == 13 || i == 18 || i == 23;
    if (dash ? s[i] != '-' : !std::isxdigit(static_cast<unsigned char>(s[i]))) return false;
  }
  return true;
}

// Not a unicast address anyone could dial from outside.
bool IsSpecialIpv4(uint32_t a) {
  const uint32_t first = a >> 24;
  return first == 0 || first == 127 || first >= 224 || (a >> 16) == 0xA9FE;  // 169.254/16
}

// ---------------------------------------------------------------- the rule model

// One rule of the table, reduced to the fields the platform writes. Anything else in a rule
// (a counter, a log, another match) marks it `extra`, so it never equals an expected rule.
struct NftRule {
  std::string chain;
  std::string comment;
  std::string iif;
  std::string daddr;
  std::string proto;
  int dport = 0;
  std::string dnat_addr;
  int dnat_port = 0;
  bool ct_dnat = false;
  bool accept = false;
  bool extra = false;
  std::string raw;  // the expressions' JSON, for a detail when `extra`

  auto Key() const {
    return std::tie(chain, comment, iif, daddr, proto, dport, dnat_addr, dnat_port, ct_dnat, accept,
                    extra);
  }
  bool operator==(const NftRule& o) const { return !extra && !o.extra && Key() == o.Key(); }

  // nft syntax, as `nft list` prints it (the script line for expected rules).
  std::string Render() const {
    std::vector<std::string> parts;
    if (!iif.empty()) parts.push_back(fmt::format("iifname \"{}\"", iif));
    if (!daddr.empty()) parts.push_back("ip daddr " + daddr);
    if (!proto.empty() && dport > 0) parts.push_back(fmt::format("{} dport {}", proto, dport));
    if (ct_dnat) parts.emplace_back("ct status dnat");
    if (!dnat_addr.empty()) {
      parts.push_back(dnat_port > 0 ? fmt::format("dnat to {}:{}", dnat_addr, dnat_port)
                                    : "dnat to " + dnat_addr);
    }
    if (accept) parts.emplace_back("accept");
    if (extra) parts.push_back("<" + raw + ">");
    if (!comment.empty()) parts.push_back(fmt::format("comment \"{}\"", comment));
    return Join(parts, " ");
  }
  std::string Where() const { return fmt::format("chain {}: {}", chain, Render()); }
};

std::string TagOf(const std::string& exposure_id) { return kTagPrefix + exposure_id; }

// The exposure id a comment tags, or "".
std::string IdOfTag(const std::string& comment) {
  if (!StartsWith(comment, kTagPrefix)) return "";
  return comment.substr(std::strlen(kTagPrefix));
}

struct ChainDef {
  std::string name, type, hook, policy;
  int64_t prio = 0;
  bool base = false;
  bool operator==(const ChainDef& o) const {
    return std::tie(name, type, hook, policy, prio, base) ==
           std::tie(o.name, o.type, o.hook, o.policy, o.prio, o.base);
  }
  std::string Render() const {
    if (!base) return fmt::format("chain {} (regular)", name);
    return fmt::format("chain {} {{ type {} hook {} priority {}; policy {}; }}", name, type, hook,
                       prio, policy);
  }
};

// The two base chains the table holds; priorities as nft lists them (dstnat = -100, filter = 0).
const std::vector<ChainDef>& ExpectedChains() {
  static const std::vector<ChainDef> chains = {
      {"prerouting", "nat", "prerouting", "accept", -100, true},
      {"forward", "filter", "forward", "accept", 0, true},
  };
  return chains;
}

struct TableState {
  bool present = false;
  std::vector<ChainDef> chains;
  std::vector<NftRule> rules;
  std::vector<std::string> others;  // sets, maps, flowtables, ...: "set foo"
};

// `{"match": {"op": "==", "left": {...}, "right": ...}}` and friends into the rule's fields.
void ReadExpr(const Json& e, NftRule& r) {
  auto unusual = [&] { r.extra = true; };
  if (!e.is_object() || e.size() != 1) return unusual();
  const std::string& key = e.begin().key();
  const Json& body = e.begin().value();
  if (key == "accept" && !r.accept) {
    r.accept = true;
    return;
  }
  if (key == "dnat" && body.is_object() && r.dnat_addr.empty()) {
    const auto addr = body.find("addr");
    if (addr == body.end() || !addr->is_string()) return unusual();
    r.dnat_addr = addr->get<std::string>();
    if (auto port = body.find("port"); port != body.end()) {
      if (!port->is_number_integer()) return unusual();
      r.dnat_port = port->get<int>();
    }
    if (body.size() != (body.contains("port") ? 2u : 1u)) unusual();
    return;
  }
  if (key != "match" || !body.is_object()) return unusual();
  const std::string op = body.value("op", "");
  const Json left = body.value("left", Json());
  const Json right = body.value("right", Json());
  if (op == "==" && left.contains("meta") && left["meta"].value("key", "") == "iifname" &&
      right.is_string() && r.iif.empty()) {
    r.iif = right.get<std::string>();
    return;
  }
  if (op == "==" && left.contains("payload") && right.is_string() && r.daddr.empty() &&
      left["payload"].value("protocol", "") == "ip" &&
      left["payload"].value("field", "") == "daddr") {
    r.daddr = right.get<std::string>();
    return;
  }
  if (op == "==" && left.contains("payload") && right.is_number_integer() && r.proto.empty()) {
    const std::string proto = left["payload"].value("protocol", "");
    if ((proto == "tcp" || proto == "udp") && left["payload"].value("field", "") == "dport") {
      r.proto = proto;
      r.dport = right.get<int>();
      return;
    }
  }
  if (op == "in" && left.contains("ct") && left["ct"].value("key", "") == "status" &&
      (right == Json("dnat") || right == Json::array({"dnat"})) && !r.ct_dnat) {
    r.ct_dnat = true;
    return;
  }
  unusual();
}

// nlohmann's accessors throw on a type they did not expect: ParseTable catches that, so a
// surprising listing is an error value like any other.
Result<TableState> ParseTableOrThrow(const std::string& out) {
  auto j = Json::parse(out, nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("nftables") || !j["nftables"].is_array()) {
    return Error::Internal(reason::kUnexpectedToolOutput,
                           "nft -j list table: " + out.substr(0, 200));
  }
  TableState t;
  t.present = true;
  for (const auto& item : j["nftables"]) {
    if (!item.is_object() || item.size() != 1) continue;
    const std::string& kind = item.begin().key();
    const Json& body = item.begin().value();
    if (kind == "metainfo" || kind == "table") continue;
    if (kind == "chain") {
      ChainDef c;
      c.name = body.value("name", "");
      c.base = body.contains("hook");
      c.type = body.value("type", "");
      c.hook = body.value("hook", "");
      c.policy = body.value("policy", "");
      c.prio = body.value("prio", int64_t{0});
      t.chains.push_back(std::move(c));
    } else if (kind == "rule") {
      NftRule r;
      r.chain = body.value("chain", "");
      r.comment = body.value("comment", "");
      if (body.contains("expr") && body["expr"].is_array()) {
        for (const auto& e : body["expr"]) ReadExpr(e, r);
        if (r.extra) r.raw = body["expr"].dump().substr(0, 400);
      }
      t.rules.push_back(std::move(r));
    } else {
      t.others.push_back(fmt::format("{} {}", kind, body.value("name", "?")));
    }
  }
  return t;
}

Result<TableState> ParseTable(const std::string& out) {
  try {
    return ParseTableOrThrow(out);
  } catch (const Json::exception& e) {
    return Error::Internal(reason::kUnexpectedToolOutput,
                           fmt::format("nft -j list table: {}: {}", e.what(), out.substr(0, 200)));
  }
}

// ---------------------------------------------------------------- the validated plan

struct Plan {
  std::vector<ExposureRule> valid;  // ids lowercased, spec order
  std::vector<ExposureRefusal> refused;
  std::vector<NftRule> rules;  // expected: prerouting rules, then forward rules
};

Error SpecError(Reason reason, std::string message, std::string field, std::string value) {
  Error e = Error::InvalidArgument(reason, std::move(message),
                                   {{"field", std::move(field)}, {"value", std::move(value)}});
  e.details["stage"] = "validate";
  return e;
}

// The reason `iface` (or what it is stacked on: a VLAN, a bond) is a fabric port, or "".
std::string FabricProblem(const HostRoot& sys, const std::string& iface, int depth) {
  const std::string dir = "/class/net/" + iface;
  if (sys.ReadInt(dir + "/type") == kArphrdInfiniband) {
    return iface + " is an InfiniBand interface (type 32)";
  }
  if (sys.IsDir(dir + "/device/infiniband")) {
    return iface + " is on an RDMA (RoCE) device (device/infiniband exists)";
  }
  if (depth < 4) {
    for (const auto& name : sys.ListDir(dir)) {
      if (!StartsWith(name, "lower_")) continue;
      auto why = FabricProblem(sys, name.substr(6), depth + 1);
      if (!why.empty()) return fmt::format("{} is stacked on {}", iface, why);
    }
  }
  return "";
}

Result<Plan> MakePlan(const ExposureSpec& spec, const NetContext* ctx) {
  if (spec.version < 1) {
    return SpecError(reason::kInvalidVersion, "version must be 1 or more", "version",
                     std::to_string(spec.version));
  }
  if (ctx != nullptr && !ctx->netns.empty() && !IsNetnsName(ctx->netns)) {
    return SpecError(reason::kInvalidNetns, "netns must be 1-64 of [A-Za-z0-9_.-]", "netns",
                     ctx->netns);
  }
  if (!IsIfName(spec.uplink)) {
    return SpecError(reason::kInvalidUplink,
                     "uplink must be an interface name (1-15 of [A-Za-z0-9_.-])", "uplink",
                     spec.uplink);
  }
  HostRoot sys(spec.sys_root);
  if (!sys.Exists("/class/net/" + spec.uplink)) {
    return SpecError(reason::kInvalidUplink,
                     fmt::format("no interface {} under {}/class/net", spec.uplink, sys.root()),
                     "uplink", spec.uplink);
  }
  if (auto why = FabricProblem(sys, spec.uplink, 0); !why.empty()) {
    return SpecError(reason::kFabricInterface,
                     "exposures are never put on a fabric (InfiniBand/RoCE) interface: " + why,
                     "uplink", spec.uplink);
  }
  uint32_t subnet = 0;
  int prefix = -1;
  {
    const size_t slash = spec.subnet_cidr.find('/');
    auto addr = ParseIpv4(spec.subnet_cidr.substr(0, slash));
    auto p = slash == std::string::npos || spec.subnet_cidr.size() - slash > 3
                 ? std::nullopt
                 : ParseInt(spec.subnet_cidr.substr(slash + 1));
    if (addr && p && *p >= 8 && *p <= 30 && (*addr & ~MaskOf(static_cast<int>(*p))) == 0) {
      subnet = *addr;
      prefix = static_cast<int>(*p);
    }
  }
  if (prefix < 0) {
    return SpecError(reason::kInvalidSubnet,
                     "subnet_cidr must be a network address with a /8../30 prefix", "subnet_cidr",
                     spec.subnet_cidr);
  }
  const uint32_t mask = MaskOf(prefix);
  auto in_subnet = [&](uint32_t a) {
    return (a & mask) == subnet && a != subnet && a != (subnet | ~mask);
  };
  std::set<uint32_t> slices;
  for (const auto& ip : spec.slice_ips) {
    auto a = ParseIpv4(ip);
    if (!a || !in_subnet(*a)) {
      return SpecError(reason::kInvalidSliceIp,
                       "slice_ips must be host addresses inside " + spec.subnet_cidr, "slice_ips",
                       ip);
    }
    slices.insert(*a);
  }

  Plan p;
  std::vector<ExposureRule> candidates;
  for (const auto& r : spec.rules) {
    auto refuse = [&](Reason reason, std::string message) {
      p.refused.push_back({r.exposure_id, reason.str(), std::move(message), r.slot_key});
    };
    if (!IsUuid(r.exposure_id)) {
      refuse(reason::kInvalidExposureId, "exposure_id must be a UUID");
      continue;
    }
    if (r.protocol != "tcp" && r.protocol != "udp") {
      refuse(reason::kInvalidProtocol,
             fmt::format("protocol must be tcp or udp, not '{}'", r.protocol));
      continue;
    }
    auto pub = ParseIpv4(r.public_ip);
    if (!pub || IsSpecialIpv4(*pub) || (*pub & mask) == subnet) {
      refuse(reason::kInvalidPublicIp,
             fmt::format("public_ip '{}' is not a unicast IPv4 address outside {}", r.public_ip,
                         spec.subnet_cidr));
      continue;
    }
    if (r.public_port < 1 || r.public_port > 65535 || r.target_port < 1 || r.target_port > 65535) {
      refuse(reason::kInvalidPort, fmt::format("ports must be 1..65535 (public {}, target {})",
                                               r.public_port, r.target_port));
      continue;
    }
    auto target = ParseIpv4(r.target_ip);
    if (!target || !in_subnet(*target) || slices.count(*target) == 0) {
      refuse(reason::kTargetNotSlice,
             fmt::format("target_ip '{}' is not a slice address of this node ({})", r.target_ip,
                         spec.subnet_cidr));
      continue;
    }
    ExposureRule ok = r;
    ok.exposure_id = Lower(r.exposure_id);
    ok.public_ip = Ipv4String(*pub);
    ok.target_ip = Ipv4String(*target);
    candidates.push_back(std::move(ok));
  }
  std::map<std::tuple<std::string, std::string, int>, int> endpoints;
  for (const auto& r : candidates) ++endpoints[{r.protocol, r.public_ip, r.public_port}];
  for (auto& r : candidates) {
    if (endpoints[{r.protocol, r.public_ip, r.public_port}] > 1) {
      p.refused.push_back({r.exposure_id, reason::kDuplicateEndpoint.str(),
                           fmt::format("{} {}:{} is requested by more than one rule", r.protocol,
                                       r.public_ip, r.public_port),
                           r.slot_key});
    } else {
      p.valid.push_back(std::move(r));
    }
  }
  for (const auto& r : p.valid) {
    NftRule dnat;
    dnat.chain = "prerouting";
    dnat.comment = TagOf(r.exposure_id);
    dnat.iif = spec.uplink;
    dnat.daddr = r.public_ip;
    dnat.proto = r.protocol;
    dnat.dport = r.public_port;
    dnat.dnat_addr = r.target_ip;
    dnat.dnat_port = r.target_port;
    p.rules.push_back(std::move(dnat));
  }
  for (const auto& r : p.valid) {
    NftRule fwd;
    fwd.chain = "forward";
    fwd.comment = TagOf(r.exposure_id);
    fwd.iif = spec.uplink;
    fwd.daddr = r.target_ip;
    fwd.proto = r.protocol;
    fwd.dport = r.target_port;
    fwd.ct_dnat = true;
    fwd.accept = true;
    p.rules.push_back(std::move(fwd));
  }
  return p;
}

std::string RenderScript(const Plan& p) {
  std::string out = fmt::format("table ip {0}\ndelete table ip {0}\ntable ip {0} {{\n",
                                static_cast<const char*>(kExposureTable));
  for (const auto& c : ExpectedChains()) {
    out += fmt::format("\tchain {} {{\n\t\ttype {} hook {} priority {}; policy {};\n", c.name,
                       c.type, c.hook, c.name == "prerouting" ? "dstnat" : "filter", c.policy);
    for (const auto& r : p.rules) {
      if (r.chain == c.name) out += "\t\t" + r.Render() + "\n";
    }
    out += "\t}\n";
  }
  out += "}\n";
  return out;
}

// ---------------------------------------------------------------- the runner

// NoExposureFor and TeardownExposures take no spec, so the namespace's name is checked here too.
Result<void> Preflight(const NetHost& h, const NetContext& ctx) {
  if (!ctx.netns.empty() && !IsNetnsName(ctx.netns)) {
    return SpecError(reason::kInvalidNetns, "netns must be 1-64 of [A-Za-z0-9_.-]", "netns",
                     ctx.netns);
  }
  return h.Preflight();
}

Result<TableState> ReadTable(const NetHost& h) {
  auto r = h.Run("nft", {"-j", "list", "table", "ip", kExposureTable});
  if (!r.ok()) return r.error();
  if (r->exit_code != 0) {
    if (r->err.find("No such file or directory") != std::string::npos) return TableState{};
    return NetHost::Failed(fmt::format("nft -j list table ip {}", kExposureTable), *r);
  }
  return ParseTable(r->out);
}

// Drift of `t` against the plan, in table order (chains, then rules), then what is missing.
std::vector<ExposureDrift> Compare(const Plan& p, const TableState& t) {
  std::vector<ExposureDrift> out;
  if (!t.present) {
    out.push_back(
        {"", reason::kTableMissing.str(), fmt::format("table ip {} is absent", kExposureTable)});
    for (const auto& r : p.rules) {
      out.push_back({IdOfTag(r.comment), reason::kRuleMissing.str(), r.Where()});
    }
    return out;
  }
  for (const auto& want : ExpectedChains()) {
    auto it = std::find_if(t.chains.begin(), t.chains.end(),
                           [&](const ChainDef& c) { return c.name == want.name; });
    if (it == t.chains.end()) {
      out.push_back({"", reason::kChainStale.str(), fmt::format("chain {} is absent", want.name)});
    } else if (!(*it == want)) {
      out.push_back({"", reason::kChainStale.str(),
                     fmt::format("found {}, expected {}", it->Render(), want.Render())});
    }
  }
  for (const auto& c : t.chains) {
    if (c.name != "prerouting" && c.name != "forward") {
      out.push_back({"", reason::kRuleForeign.str(), c.Render()});
    }
  }
  for (const auto& o : t.others) out.push_back({"", reason::kRuleForeign.str(), o});

  std::vector<bool> matched(p.rules.size(), false);
  std::vector<const NftRule*> leftover;
  for (const auto& r : t.rules) {
    bool hit = false;
    for (size_t i = 0; i < p.rules.size() && !hit; ++i) {
      if (!matched[i] && p.rules[i] == r) {
        matched[i] = true;
        hit = true;
      }
    }
    if (!hit) leftover.push_back(&r);
  }
  // A tagged rule that differs from its exposure's rule in the same chain replaces it: stale.
  for (const NftRule* r : leftover) {
    bool stale = false;
    for (size_t i = 0; i < p.rules.size() && !stale; ++i) {
      if (!matched[i] && !r->comment.empty() && p.rules[i].comment == r->comment &&
          p.rules[i].chain == r->chain) {
        matched[i] = true;
        stale = true;
        out.push_back({IdOfTag(r->comment), reason::kRuleStale.str(),
                       fmt::format("found {}, expected {}", r->Where(), p.rules[i].Render())});
      }
    }
    if (!stale) out.push_back({"", reason::kRuleForeign.str(), r->Where()});
  }
  for (size_t i = 0; i < p.rules.size(); ++i) {
    if (!matched[i]) {
      out.push_back({IdOfTag(p.rules[i].comment), reason::kRuleMissing.str(), p.rules[i].Where()});
    }
  }
  return out;
}

// A private temp file holding the script (nft -f reads it; argv stays short whatever the size).
class ScriptFile {
 public:
  explicit ScriptFile(const std::string& content) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "gpuaas-ingress-XXXXXX.nft");
    std::vector<char> buf(tmpl.begin(), tmpl.end());
    buf.push_back('\0');
    const int fd = ::mkstemps(buf.data(), 4);
    if (fd < 0) {
      error_ = std::strerror(errno);
      return;
    }
    path_ = buf.data();
    size_t off = 0;
    while (off < content.size()) {
      const ssize_t n = ::write(fd, content.data() + off, content.size() - off);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error_ = std::strerror(errno);
        break;
      }
      off += static_cast<size_t>(n);
    }
    ::close(fd);
  }
  ~ScriptFile() {
    if (!path_.empty()) ::unlink(path_.c_str());
  }
  ScriptFile(const ScriptFile&) = delete;
  ScriptFile& operator=(const ScriptFile&) = delete;
  const std::string& path() const { return path_; }
  const std::string& error() const { return error_; }

 private:
  std::string path_, error_;
};

// "conntrack v1.4.7 (conntrack-tools): 3 flow entries have been deleted."
std::optional<int> DeletedCount(const std::string& text) {
  const std::string key = " flow entries have been deleted";
  const size_t at = text.find(key);
  if (at == std::string::npos) return std::nullopt;
  size_t start = at;
  while (start > 0 && std::isdigit(static_cast<unsigned char>(text[start - 1]))) --start;
  auto n = ParseInt(text.substr(start, at - start));
  if (!n) return std::nullopt;
  return static_cast<int>(*n);
}

// The DNAT mappings a rule set establishes: protocol, public address/port, target address.
using Mapping = std::tuple<std::string, std::string, int, std::string, int>;

std::set<Mapping> Mappings(const std::vector<NftRule>& rules) {
  std::set<Mapping> out;
  for (const auto& r : rules) {
    if (r.dnat_addr.empty() || r.proto.empty() || r.dport <= 0) continue;
    out.insert({r.proto, r.daddr, r.dport, r.dnat_addr, r.dnat_port});
  }
  return out;
}

void FlushGone(const NetHost& h, const std::set<Mapping>& gone, ExposureApplyReport& rep) {
  if (gone.empty()) return;
  if (auto tool = h.Tool("conntrack"); !tool.ok()) {
    rep.conntrack_flushed = -1;
    rep.conntrack_problem =
        "conntrack is not installed: established flows of removed mappings "
        "keep their NAT binding until they time out";
    return;
  }
  int total = 0;
  std::vector<std::string> problems;
  for (const auto& [proto, daddr, dport, target, tport] : gone) {
    // Only flows this mapping translated: to its public address and port, answered by its target.
    Args a{"-D", "-p", proto};
    if (!daddr.empty()) a.insert(a.end(), {"--orig-dst", daddr});
    a.insert(a.end(), {"--orig-port-dst", std::to_string(dport), "--reply-src", target});
    auto r = h.Run("conntrack", a);
    const std::string what = fmt::format("conntrack {}", Join(a, " "));
    if (!r.ok()) {
      problems.push_back(what + ": " + r.error().message);
      continue;
    }
    auto n = DeletedCount(r->out + r->err);
    // Exit 1 with "0 flow entries have been deleted" is conntrack's way of saying none matched.
    if (!n || (r->exit_code != 0 && *n != 0)) {
      problems.push_back(fmt::format("{} exited {}: {}", what, r->exit_code, Trim(r->err)));
      continue;
    }
    total += *n;
  }
  if (problems.empty()) {
    rep.conntrack_flushed = total;
  } else {
    rep.conntrack_flushed = -1;
    rep.conntrack_problem = Join(problems, "; ");
  }
}

std::vector<std::string> AppliedIds(const Plan& p) {
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& r : p.valid) {
    if (seen.insert(r.exposure_id).second) out.push_back(r.exposure_id);
  }
  return out;
}

Result<ExposureApplyReport> ApplyLocked(const ExposureSpec& spec, const NetContext& ctx) {
  auto plan = MakePlan(spec, &ctx);
  if (!plan.ok()) return plan.error();
  const Plan& p = *plan;
  NetHost h(ctx);
  if (auto r = Preflight(h, ctx); !r.ok()) return r.error();
  if (auto t = h.Tool("nft"); !t.ok()) return t.error();

  ExposureApplyReport rep;
  rep.version = spec.version;
  rep.refused = p.refused;
  rep.applied = AppliedIds(p);
  auto before = ReadTable(h);
  if (!before.ok()) return before.error();
  rep.drift = Compare(p, *before);
  if (rep.drift.empty()) return rep;

  ScriptFile script(RenderScript(p));
  if (!script.error().empty()) {
    return Error::Internal(reason::kScriptWriteFailed, "nft script: " + script.error());
  }
  auto r = h.Run("nft", {"-f", script.path()});
  if (!r.ok()) return r.error();
  if (r->exit_code != 0) return NetHost::Failed("nft -f <script>", *r);
  rep.changed = true;

  const std::set<std::string> now(rep.applied.begin(), rep.applied.end());
  std::set<std::string> seen;
  for (const auto& old : before->rules) {
    const std::string id = IdOfTag(old.comment);
    if (!id.empty() && now.count(id) == 0 && seen.insert(id).second) rep.removed.push_back(id);
  }
  const auto was = Mappings(before->rules);
  const auto is = Mappings(p.rules);
  std::set<Mapping> gone;
  std::set_difference(was.begin(), was.end(), is.begin(), is.end(),
                      std::inserter(gone, gone.end()));
  FlushGone(h, gone, rep);
  return rep;
}

Result<std::vector<ExposureDrift>> CheckWith(const ExposureSpec& spec, const NetContext& ctx) {
  auto plan = MakePlan(spec, &ctx);
  if (!plan.ok()) return plan.error();
  NetHost h(ctx);
  if (auto r = Preflight(h, ctx); !r.ok()) return r.error();
  auto t = ReadTable(h);
  if (!t.ok()) return t.error();
  return Compare(*plan, *t);
}

}  // namespace

// ---------------------------------------------------------------- public API

Result<std::vector<ExposureRefusal>> ValidateExposureSpec(const ExposureSpec& spec) {
  auto p = MakePlan(spec, nullptr);
  if (!p.ok()) return p.error();
  return p->refused;
}

Result<ExposureApplyReport> ApplyExposures(const ExposureSpec& spec, const NetContext& ctx) {
  std::lock_guard lock(ApplyMutex());
  return ApplyLocked(spec, ctx);
}

Result<std::vector<ExposureDrift>> CheckExposures(const ExposureSpec& spec, const NetContext& ctx) {
  return CheckWith(spec, ctx);
}

Result<std::vector<ExposureDrift>> ReconcileExposures(const ExposureSpec& spec,
                                                      const NetContext& ctx) {
  std::lock_guard lock(ApplyMutex());
  auto drift = CheckWith(spec, ctx);
  if (!drift.ok() || drift->empty()) return drift;
  auto applied = ApplyLocked(spec, ctx);
  if (!applied.ok()) {
    Error e = applied.error();
    e.details["drift"] = std::to_string(drift->size());
    return e;
  }
  return drift;
}

Result<bool> NoExposureFor(const std::string& target_ip, const NetContext& ctx) {
  auto target = ParseIpv4(target_ip);
  if (!target) {
    return SpecError(reason::kInvalidTargetIp, "target_ip must be a dotted IPv4 address",
                     "target_ip", target_ip);
  }
  NetHost h(ctx);
  if (auto r = Preflight(h, ctx); !r.ok()) return r.error();
  auto t = ReadTable(h);
  if (!t.ok()) return t.error();
  const std::string ip = Ipv4String(*target);
  return std::none_of(t->rules.begin(), t->rules.end(), [&](const NftRule& r) {
    return r.dnat_addr == ip || r.daddr == ip ||
           (r.extra && r.raw.find('"' + ip + '"') != std::string::npos);
  });
}

Result<void> TeardownExposures(const NetContext& ctx) {
  NetHost h(ctx);
  if (auto r = Preflight(h, ctx); !r.ok()) return r.error();
  auto r = h.Run("nft", {"delete", "table", "ip", kExposureTable});
  if (!r.ok()) return r.error();
  if (r->exit_code != 0 && r->err.find("No such file or directory") == std::string::npos) {
    return NetHost::Failed(fmt::format("nft delete table ip {}", kExposureTable), *r);
  }
  return Ok();
}

}  // namespace gpuaas::node_agent
