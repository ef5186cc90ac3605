#include "gpuaas/node_agent/network/net_apply.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "network/net_host.hpp"
#include "network/ovs.hpp"

namespace gpuaas::node_agent {
namespace {

using Args = std::vector<std::string>;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------- pure helpers

std::optional<uint32_t> ParseIpv4(std::string_view s) {
  uint32_t out = 0;
  int parts = 0;
  size_t i = 0;
  while (parts < 4) {
    size_t j = i;
    while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) ++j;
    // 1-3 digits, no leading zero (so "010" is never read as octal by some other tool)
    if (j == i || j - i > 3 || (j - i > 1 && s[i] == '0')) return std::nullopt;
    int v = std::stoi(std::string(s.substr(i, j - i)));
    if (v > 255) return std::nullopt;
    out = (out << 8) | static_cast<uint32_t>(v);
    ++parts;
    if (parts < 4) {
      if (j >= s.size() || s[j] != '.') return std::nullopt;
      i = j + 1;
    } else if (j != s.size()) {
      return std::nullopt;
    }
  }
  return out;
}

std::string Ipv4String(uint32_t a) {
  return fmt::format("{}.{}.{}.{}", a >> 24, (a >> 16) & 255, (a >> 8) & 255, a & 255);
}

struct Cidr {
  uint32_t addr = 0;
  int prefix = 0;
};

std::optional<Cidr> ParseCidr(std::string_view s) {
  size_t slash = s.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  auto a = ParseIpv4(s.substr(0, slash));
  auto p = ParseInt(s.substr(slash + 1));
  if (!a || !p || *p < 0 || *p > 32 || s.substr(slash + 1).size() > 2) return std::nullopt;
  return Cidr{*a, static_cast<int>(*p)};
}

uint32_t MaskOf(int prefix) { return prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix); }

// "52:54:00:ab:cd:ef": six hex pairs, unicast, not all zero.
bool IsUnicastMac(const std::string& mac) {
  if (mac.size() != 17) return false;
  for (size_t i = 0; i < mac.size(); ++i) {
    if (i % 3 == 2 ? mac[i] != ':' : !std::isxdigit(static_cast<unsigned char>(mac[i]))) {
      return false;
    }
  }
  if (std::stoi(mac.substr(0, 2), nullptr, 16) & 1) return false;
  return mac != "00:00:00:00:00:00";
}

// RFC 1123 label: what dnsmasq hands out as the client's name.
bool IsHostname(const std::string& s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-';
  });
}

// Absolute, no "..", nothing that could end a dnsmasq config line or split an option.
bool IsStateDir(const std::string& s) {
  if (s.size() < 2 || s.front() != '/' || s.size() > 200) return false;
  for (char c : s) {
    if (std::iscntrl(static_cast<unsigned char>(c)) ||
        std::isspace(static_cast<unsigned char>(c)) || c == ',' || c == '#') {
      return false;
    }
  }
  return ("/" + s + "/").find("/../") == std::string::npos;
}

// ---------------------------------------------------------------- the validated plan

struct Plan {
  Cidr subnet;
  uint32_t gateway = 0;
  std::string subnet_s;  // canonical "10.100.0.0/24"
  std::string gateway_cidr;
  std::vector<NetReservation> res;  // lowercased MACs, sorted by IP
  std::string conf, hosts, leases, pid, log, lock, flows;
  std::string nat_tag, fwd_chain;
};

Result<Plan> MakePlan(const NetworkSpec& spec, const NetContext& ctx) {
  struct Problem {
    Reason reason;
    std::string message;
    std::map<std::string, std::string> details;
  };
  std::vector<Problem> problems;
  auto add = [&](Reason reason, std::string message, std::string field, std::string value,
                 int index = -1) {
    std::map<std::string, std::string> d{{"field", std::move(field)}, {"value", std::move(value)}};
    if (index >= 0) {
      d["index"] = std::to_string(index);
      const auto& slot = spec.reservations[static_cast<size_t>(index)].slot_key;
      if (!slot.empty()) d["slot_key"] = slot;
    }
    problems.push_back({reason, std::move(message), std::move(d)});
  };

  Plan p;
  if (!IsIfName(spec.bridge)) {
    add(reason::kInvalidBridge, "bridge name must be 1-15 of [A-Za-z0-9_.-]", "bridge",
        spec.bridge);
  }
  if (!IsStateDir(spec.state_dir)) {
    add(reason::kInvalidStateDir, "state_dir must be an absolute path without spaces, ',' or '..'",
        "state_dir", spec.state_dir);
  }
  if (!ctx.netns.empty() && !IsNetnsName(ctx.netns)) {
    add(reason::kInvalidNetns, "netns must be 1-64 of [A-Za-z0-9_.-]", "netns", ctx.netns);
  }
  if (!spec.egress_iface.empty() &&
      (!IsIfName(spec.egress_iface) || spec.egress_iface == spec.bridge)) {
    add(reason::kInvalidEgressIface, "egress_iface must be an interface name other than the bridge",
        "egress_iface", spec.egress_iface);
  }

  auto subnet = ParseCidr(spec.subnet_cidr);
  auto gw = ParseCidr(spec.gateway_cidr);
  bool nets_ok = false;
  if (!subnet || subnet->prefix < 8 || subnet->prefix > 30 ||
      (subnet->addr & ~MaskOf(subnet->prefix)) != 0) {
    add(reason::kInvalidSubnet, "subnet_cidr must be a network address with a /8../30 prefix",
        "subnet_cidr", spec.subnet_cidr);
  } else if (!gw) {
    add(reason::kInvalidGateway, "gateway_cidr must be an IPv4 address with a prefix",
        "gateway_cidr", spec.gateway_cidr);
  } else {
    const uint32_t mask = MaskOf(subnet->prefix);
    const uint32_t bcast = subnet->addr | ~mask;
    if (gw->prefix != subnet->prefix || (gw->addr & mask) != subnet->addr) {
      add(reason::kGatewayOutsideSubnet, "gateway_cidr must be inside subnet_cidr with its prefix",
          "gateway_cidr", spec.gateway_cidr);
    } else if (gw->addr == subnet->addr || gw->addr == bcast) {
      add(reason::kInvalidGateway, "gateway is the network or broadcast address", "gateway_cidr",
          spec.gateway_cidr);
    } else {
      nets_ok = true;
    }
    p.subnet = *subnet;
    p.gateway = gw->addr;
  }

  if (nets_ok) {
    // Usable host addresses minus the gateway's.
    const uint64_t room = (uint64_t{1} << (32 - p.subnet.prefix)) - 3;
    if (spec.reservations.size() > room) {
      add(reason::kSubnetTooSmall,
          fmt::format("{} reservations do not fit in {} ({} addresses besides the gateway)",
                      spec.reservations.size(), spec.subnet_cidr, room),
          "reservations", std::to_string(spec.reservations.size()));
    }
  }

  std::set<std::string> macs, hostnames;
  std::set<uint32_t> ips;
  for (size_t i = 0; i < spec.reservations.size(); ++i) {
    const auto& r = spec.reservations[i];
    const int idx = static_cast<int>(i);
    const std::string mac = Lower(r.mac);
    if (!IsUnicastMac(mac)) {
      add(reason::kInvalidMac, "reservation MAC must be unicast xx:xx:xx:xx:xx:xx", "mac", r.mac,
          idx);
    } else if (!macs.insert(mac).second) {
      add(reason::kDuplicateMac, "two reservations name one MAC", "mac", r.mac, idx);
    }
    auto ip = ParseIpv4(r.ip);
    if (!ip) {
      add(reason::kInvalidIp, "reservation IP must be a dotted IPv4 address", "ip", r.ip, idx);
    } else if (nets_ok) {
      const uint32_t mask = MaskOf(p.subnet.prefix);
      if ((*ip & mask) != p.subnet.addr) {
        add(reason::kIpOutsideSubnet, "reservation IP is outside " + spec.subnet_cidr, "ip", r.ip,
            idx);
      } else if (*ip == p.subnet.addr || *ip == (p.subnet.addr | ~mask) || *ip == p.gateway) {
        add(reason::kIpReserved, "reservation IP is the network, broadcast or gateway address",
            "ip", r.ip, idx);
      } else if (!ips.insert(*ip).second) {
        add(reason::kDuplicateIp, "two reservations name one IP", "ip", r.ip, idx);
      }
    }
    if (!r.hostname.empty()) {
      if (!IsHostname(r.hostname)) {
        add(reason::kInvalidHostname, "hostname must be an RFC 1123 label", "hostname", r.hostname,
            idx);
      } else if (!hostnames.insert(Lower(r.hostname)).second) {
        add(reason::kDuplicateHostname, "two reservations name one hostname", "hostname",
            r.hostname, idx);
      }
    }
    NetReservation n = r;
    n.mac = mac;
    p.res.push_back(std::move(n));
  }

  if (!problems.empty()) {
    std::vector<std::string> all;
    for (const auto& pr : problems) {
      auto f = pr.details.find("field");
      auto ix = pr.details.find("index");
      all.push_back(pr.reason.str() + ":" + f->second +
                    (ix == pr.details.end() ? "" : "[" + ix->second + "]"));
    }
    Error e = Error::InvalidArgument(problems[0].reason, problems[0].message, problems[0].details);
    e.details["problems"] = Join(all, ";");
    e.details["stage"] = "validate";
    return e;
  }

  std::sort(p.res.begin(), p.res.end(), [](const NetReservation& a, const NetReservation& b) {
    return *ParseIpv4(a.ip) < *ParseIpv4(b.ip);
  });
  p.subnet_s = Ipv4String(p.subnet.addr) + "/" + std::to_string(p.subnet.prefix);
  p.gateway_cidr = Ipv4String(p.gateway) + "/" + std::to_string(p.subnet.prefix);
  std::string dir = spec.state_dir;
  while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
  p.conf = dir + "/dnsmasq.conf";
  p.hosts = dir + "/dhcp-hosts";
  p.leases = dir + "/dnsmasq.leases";
  p.pid = dir + "/dnsmasq.pid";
  p.log = dir + "/dnsmasq.log";
  p.lock = dir + "/.lock";
  p.flows = dir + "/ovs-flows";
  p.nat_tag = "gpuaas-nat-" + spec.bridge;
  p.fwd_chain = "GPUAAS-FWD-" + spec.bridge;  // <= 26 chars, iptables allows 28
  return p;
}

std::string RenderHosts(const std::vector<NetReservation>& res) {
  std::string out = "# Managed by gpuaas-node-agent: exactly the control plane's reservations.\n";
  for (const auto& r : res) {
    out += r.hostname.empty() ? fmt::format("{},{}\n", r.mac, r.ip)
                              : fmt::format("{},{},{}\n", r.mac, r.ip, r.hostname);
  }
  return out;
}

std::string RenderConf(const Plan& p, const NetworkSpec& spec) {
  const uint32_t mask = MaskOf(p.subnet.prefix);
  std::string out = "# Managed by gpuaas-node-agent; rewritten on apply, do not edit.\n";
  out += "port=0\nno-resolv\nno-hosts\n";
  out += "interface=" + spec.bridge + "\nexcept-interface=lo\nbind-interfaces\n";
  out += "dhcp-authoritative\n";
  // static: only dhcp-hostsfile entries get an address; unknown MACs are not even answered.
  out +=
      fmt::format("dhcp-range={},static,{},12h\n", Ipv4String(p.subnet.addr + 1), Ipv4String(mask));
  out += "dhcp-ignore=tag:!known\n";
  out += "dhcp-option=option:router," + Ipv4String(p.gateway) + "\n";
  out += "dhcp-hostsfile=" + p.hosts + "\n";
  out += "dhcp-leasefile=" + p.leases + "\n";
  out += "pid-file=" + p.pid + "\n";
  out += "log-facility=" + p.log + "\n";
  return out;
}

struct HostsEntry {
  std::string ip, hostname;
};

std::map<std::string, HostsEntry> ParseHosts(const std::string& content) {
  std::map<std::string, HostsEntry> out;
  for (const auto& raw : SplitLines(content)) {
    std::string line = Trim(raw);
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> f;
    std::stringstream ss(line);
    for (std::string x; std::getline(ss, x, ',');) f.push_back(Trim(x));
    if (f.size() < 2) continue;
    out[Lower(f[0])] = {f[1], f.size() > 2 ? f[2] : ""};
  }
  return out;
}

struct LeaseLine {
  int64_t expiry = 0;
  std::string mac, ip, hostname, client_id;
};

// dnsmasq's format: "<expiry> <mac> <ip> <hostname|*> <client-id|*>"; "duid ..." is DHCPv6.
std::vector<LeaseLine> ParseLeases(const std::string& content) {
  std::vector<LeaseLine> out;
  for (const auto& line : SplitLines(content)) {
    auto f = SplitWs(line);
    if (f.size() < 3 || f[0] == "duid") continue;
    auto exp = ParseInt(f[0]);
    if (!exp) continue;
    LeaseLine l;
    l.expiry = *exp;
    l.mac = Lower(f[1]);
    l.ip = f[2];
    if (f.size() > 3 && f[3] != "*") l.hostname = f[3];
    if (f.size() > 4 && f[4] != "*") l.client_id = f[4];
    out.push_back(std::move(l));
  }
  return out;
}

bool Expired(const LeaseLine& l) {
  return l.expiry != 0 && l.expiry < static_cast<int64_t>(std::time(nullptr));
}

// ---------------------------------------------------------------- files and processes

std::optional<std::string> ReadWhole(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

Result<void> WriteAtomic(const std::string& path, const std::string& content) {
  const std::string tmp = fmt::format("{}.tmp.{}", path, ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return Error::Internal(reason::kStateWriteFailed, tmp + ": " + std::strerror(errno));
  size_t off = 0;
  while (off < content.size()) {
    ssize_t n = ::write(fd, content.data() + off, content.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return Error::Internal(reason::kStateWriteFailed, tmp + ": " + std::strerror(e));
    }
    off += static_cast<size_t>(n);
  }
  // dnsmasq reads the hosts file after dropping root, so it must be world-readable.
  ::fchmod(fd, 0644);
  ::fsync(fd);
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    return Error::Internal(reason::kStateWriteFailed, path + ": " + std::strerror(e));
  }
  return Ok();
}

// dnsmasq drops root (to "nobody") before it reads dhcp-hostsfile, and again on every SIGHUP;
// an unreadable file is only a log line there, so refuse up front.
Result<void> PrepareStateDir(const std::string& dir) {
  std::vector<std::string> parts;
  std::stringstream ss(dir);
  for (std::string x; std::getline(ss, x, '/');) {
    if (!x.empty()) parts.push_back(x);
  }
  std::string cur;
  for (size_t i = 0; i < parts.size(); ++i) {
    cur += "/" + parts[i];
    const bool last = i + 1 == parts.size();
    struct stat st {};
    if (::stat(cur.c_str(), &st) != 0) {
      if (errno != ENOENT || ::mkdir(cur.c_str(), 0755) != 0) {
        return Error::FailedPrecondition(reason::kStateDirUnusable,
                                         cur + ": " + std::strerror(errno));
      }
      continue;
    }
    if (!S_ISDIR(st.st_mode)) {
      return Error::FailedPrecondition(reason::kStateDirUnusable, cur + " is not a directory");
    }
    if (last) {
      // Our own directory: make it readable for dnsmasq.
      if ((st.st_mode & 0005) != 0005) ::chmod(cur.c_str(), (st.st_mode & 07777) | 0055);
    } else if ((st.st_mode & S_IXOTH) == 0) {
      Error e = Error::FailedPrecondition(
          reason::kStateDirNotTraversable,
          cur +
              " is not searchable by others; dnsmasq (running as nobody) could not read the "
              "hosts file under it");
      e.details["path"] = cur;
      return e;
    }
  }
  return Ok();
}

class DirLock {
 public:
  explicit DirLock(const std::string& path)
      : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ >= 0) {
      while (::flock(fd_, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
  }
  ~DirLock() {
    if (fd_ >= 0) ::close(fd_);
  }
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  bool ok() const { return fd_ >= 0; }

 private:
  int fd_;
};

bool Alive(int pid) {
  auto stat = ReadWhole(fmt::format("/proc/{}/stat", pid));
  if (!stat) return false;
  size_t rp = stat->rfind(')');
  return rp == std::string::npos || rp + 2 >= stat->size() || (*stat)[rp + 2] != 'Z';
}

// The dnsmasq this state_dir started: pid file, alive, and its command line names our config
// (so a recycled PID is never signalled).
std::optional<int> RunningDnsmasq(const Plan& p) {
  auto pid_s = ReadWhole(p.pid);
  if (!pid_s) return std::nullopt;
  auto pid = ParseInt(Trim(*pid_s));
  if (!pid || *pid <= 1 || *pid > (1 << 22)) return std::nullopt;
  const int ipid = static_cast<int>(*pid);
  auto cmd = ReadWhole(fmt::format("/proc/{}/cmdline", ipid));
  if (!cmd || !Alive(ipid)) return std::nullopt;
  const std::string want = "--conf-file=" + p.conf;
  size_t i = 0;
  while (i < cmd->size()) {
    size_t j = cmd->find('\0', i);
    if (j == std::string::npos) j = cmd->size();
    if (cmd->compare(i, j - i, want) == 0) return ipid;
    i = j + 1;
  }
  return std::nullopt;
}

void StopPid(int pid) {
  ::kill(pid, SIGTERM);
  auto deadline = Clock::now() + std::chrono::seconds(3);
  while (Alive(pid) && Clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (Alive(pid)) {
    ::kill(pid, SIGKILL);
    deadline = Clock::now() + std::chrono::seconds(1);
    while (Alive(pid) && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

// ---------------------------------------------------------------- the runner

Result<ToolResult> Ipt(const NetHost& h, const std::string& table, const Args& args, bool must) {
  Args a{"-w", "5", "-t", table};
  a.insert(a.end(), args.begin(), args.end());
  return must ? h.Must("iptables", a) : h.Run("iptables", a);
}

Args Cat(Args a, const Args& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// ---------------------------------------------------------------- host state probes

struct BridgeState {
  bool exists = false;
  bool is_bridge = false;  // a Linux bridge
  std::string kind;        // ip's info_kind: "bridge", "openvswitch" (OVS kernel datapath's
                           // internal port), "tun" (userspace datapath's), ...
  bool up = false;
  bool has_gateway = false;
};

Result<BridgeState> ProbeBridge(const NetHost& h, const NetworkSpec& spec, const Plan& p) {
  BridgeState b;
  auto link = h.Run("ip", {"-j", "-d", "link", "show", "dev", spec.bridge});
  if (!link.ok()) return link.error();
  if (link->exit_code != 0) return b;
  auto j = nlohmann::json::parse(link->out, nullptr, false);
  if (j.is_discarded() || !j.is_array() || j.empty()) {
    return Error::Internal(reason::kUnexpectedToolOutput,
                           "ip -j link: " + link->out.substr(0, 200));
  }
  b.exists = true;
  const auto& l = j[0];
  b.kind = l.contains("linkinfo") ? l["linkinfo"].value("info_kind", "") : "";
  b.is_bridge = b.kind == "bridge";
  if (l.contains("flags") && l["flags"].is_array()) {
    for (const auto& f : l["flags"]) {
      if (f.is_string() && f.get<std::string>() == "UP") b.up = true;
    }
  }
  auto addr = h.Must("ip", {"-j", "addr", "show", "dev", spec.bridge});
  if (!addr.ok()) return addr.error();
  auto a = nlohmann::json::parse(addr->out, nullptr, false);
  const std::string gw = Ipv4String(p.gateway);
  if (!a.is_discarded() && a.is_array() && !a.empty() && a[0].contains("addr_info")) {
    for (const auto& ai : a[0]["addr_info"]) {
      if (ai.value("family", "") == "inet" && ai.value("local", "") == gw &&
          ai.value("prefixlen", -1) == p.subnet.prefix) {
        b.has_gateway = true;
      }
    }
  }
  return b;
}

// name -> isolated, for the ports of the bridge.
Result<std::map<std::string, bool>> ProbePorts(const NetHost& h, const NetworkSpec& spec) {
  std::map<std::string, bool> out;
  auto r = h.Must("bridge", {"-j", "-d", "link", "show"});
  if (!r.ok()) return r.error();
  if (Trim(r->out).empty()) return out;
  auto j = nlohmann::json::parse(r->out, nullptr, false);
  if (j.is_discarded() || !j.is_array()) {
    return Error::Internal(reason::kUnexpectedToolOutput,
                           "bridge -j link: " + r->out.substr(0, 200));
  }
  for (const auto& port : j) {
    if (port.value("master", "") != spec.bridge) continue;
    const std::string name = port.value("ifname", "");
    if (name.empty() || name == spec.bridge) continue;
    out[name] = port.value("isolated", false);
  }
  return out;
}

Result<std::string> ReadIpForward(const NetHost& h) {
  auto r = h.Must("sysctl", {"-n", "net.ipv4.ip_forward"});
  if (!r.ok()) return r.error();
  return Trim(r->out);
}

// Directly in POSTROUTING (not in a chain of ours): discovery's nat_masquerade check, which feeds
// the scheduler's node blockers, looks for "-A POSTROUTING -s <subnet> ... -j MASQUERADE". The
// comment tag is how ours is found again (repair, stale removal, teardown).
Args NatRule(const NetworkSpec& spec, const Plan& p) {
  Args r{"-s", p.subnet_s, "!", "-d", p.subnet_s};
  if (!spec.egress_iface.empty()) r = Cat(r, {"-o", spec.egress_iface});
  return Cat(r, {"-m", "comment", "--comment", p.nat_tag, "-j", "MASQUERADE"});
}

// Disjoint matches, so order inside the chain does not matter.
std::vector<Args> ForwardRules(const NetworkSpec& spec, const Plan& p) {
  std::vector<Args> out;
  const std::string& br = spec.bridge;
  // Port isolation stops slice-to-slice frames on L2; this stops the L3 hairpin where a slice
  // sends another slice's IP to the gateway MAC and the host routes it back out of the bridge.
  if (spec.isolate_ports) out.push_back({"-i", br, "-o", br, "-j", "DROP"});
  Args egress = spec.egress_iface.empty() ? Args{"!", "-o", br} : Args{"-o", spec.egress_iface};
  Args ingress = spec.egress_iface.empty() ? Args{"!", "-i", br} : Args{"-i", spec.egress_iface};
  out.push_back(Cat(Cat({"-s", p.subnet_s, "-i", br}, egress), {"-j", "ACCEPT"}));
  out.push_back(Cat(Cat({"-d", p.subnet_s}, ingress), {"-o", br, "-m", "conntrack", "--ctstate",
                                                       "RELATED,ESTABLISHED", "-j", "ACCEPT"}));
  // New connections in only when ingress's DNAT (table ip gpuaas_ingress) made them: under a
  // FORWARD policy of DROP, an accept in ingress's own chain is not enough.
  out.push_back(Cat(Cat({"-d", p.subnet_s}, ingress),
                    {"-o", br, "-m", "conntrack", "--ctstate", "DNAT", "-j", "ACCEPT"}));
  return out;
}

Result<bool> ChainHas(const NetHost& h, const std::string& table, const std::string& chain,
                      const Args& rule) {
  auto r = Ipt(h, table, Cat({"-C", chain}, rule), false);
  if (!r.ok()) return r.error();
  return r->exit_code == 0;
}

// -1 when the chain does not exist.
Result<int> ChainRuleCount(const NetHost& h, const std::string& table, const std::string& chain) {
  auto r = Ipt(h, table, {"-S", chain}, false);
  if (!r.ok()) return r.error();
  if (r->exit_code != 0) return -1;
  int n = 0;
  for (const auto& line : SplitLines(r->out)) {
    if (StartsWith(line, "-A " + chain + " ")) ++n;
  }
  return n;
}

// Our tagged rules in nat POSTROUTING, as -D arguments.
Result<std::vector<Args>> TaggedNatRules(const NetHost& h, const Plan& p) {
  auto r = Ipt(h, "nat", {"-S", "POSTROUTING"}, true);
  if (!r.ok()) return r.error();
  std::vector<Args> out;
  for (const auto& line : SplitLines(r->out)) {
    auto t = SplitWs(line);
    if (t.size() < 3 || t[0] != "-A" || t[1] != "POSTROUTING") continue;
    bool ours = false;
    for (auto& tok : t) {
      if (tok.size() >= 2 && tok.front() == '"' && tok.back() == '"') {
        tok = tok.substr(1, tok.size() - 2);
      }
      if (tok == p.nat_tag) ours = true;
    }
    if (ours) out.emplace_back(t.begin() + 2, t.end());
  }
  return out;
}

struct ChainOutcome {
  bool added = false;    // a desired rule or the jump was missing and was added
  bool rebuilt = false;  // extra rules were flushed
};

// Makes `chain` hold exactly `rules` (checked with -C, added with -A only when missing; a chain
// holding anything else is flushed and refilled) and `from` jump to it.
Result<ChainOutcome> EnsureChain(const NetHost& h, const std::string& table,
                                 const std::string& from, const std::string& chain,
                                 const std::vector<Args>& rules) {
  ChainOutcome o;
  auto count = ChainRuleCount(h, table, chain);
  if (!count.ok()) return count.error();
  if (*count < 0) {
    if (auto r = Ipt(h, table, {"-N", chain}, true); !r.ok()) return r.error();
    *count = 0;
  }
  std::vector<const Args*> missing;
  for (const auto& rule : rules) {
    auto has = ChainHas(h, table, chain, rule);
    if (!has.ok()) return has.error();
    if (!*has) missing.push_back(&rule);
  }
  const int present = static_cast<int>(rules.size() - missing.size());
  if (*count != present) {
    if (auto r = Ipt(h, table, {"-F", chain}, true); !r.ok()) return r.error();
    o.rebuilt = true;
    o.added = !missing.empty();
    missing.clear();
    for (const auto& rule : rules) missing.push_back(&rule);
  } else {
    o.added = !missing.empty();
  }
  for (const Args* rule : missing) {
    if (auto r = Ipt(h, table, Cat({"-A", chain}, *rule), true); !r.ok()) return r.error();
  }
  auto jump = ChainHas(h, table, from, {"-j", chain});
  if (!jump.ok()) return jump.error();
  if (!*jump) {
    // FORWARD: ahead of distro/docker DROP rules, or the slices' egress would never be accepted.
    if (auto r = Ipt(h, table, {"-I", from, "1", "-j", chain}, true); !r.ok()) return r.error();
    o.added = true;
  }
  return o;
}

// The MASQUERADE rule present exactly once (checked with -C, added with -A only when missing);
// tagged rules for another subnet/egress, or copies, are deleted first.
Result<ChainOutcome> EnsureNat(const NetHost& h, const NetworkSpec& spec, const Plan& p) {
  ChainOutcome o;
  const Args want = NatRule(spec, p);
  bool present = false;
  if (spec.masquerade) {
    auto has = ChainHas(h, "nat", "POSTROUTING", want);
    if (!has.ok()) return has.error();
    present = *has;
  }
  const bool was_present = present;
  auto tagged = TaggedNatRules(h, p);
  if (!tagged.ok()) return tagged.error();
  if (tagged->size() > (present ? 1u : 0u)) {
    for (const auto& rule : *tagged) {
      if (auto r = Ipt(h, "nat", Cat({"-D", "POSTROUTING"}, rule), true); !r.ok()) return r.error();
    }
    o.rebuilt = true;
    present = false;
  }
  if (spec.masquerade && !present) {
    if (auto r = Ipt(h, "nat", Cat({"-A", "POSTROUTING"}, want), true); !r.ok()) return r.error();
  }
  // Re-adding a rule that was there (after dropping a stale copy) is not a repair.
  o.added = spec.masquerade && !was_present;
  return o;
}

Result<bool> ChainComplete(const NetHost& h, const std::string& table, const std::string& from,
                           const std::string& chain, const std::vector<Args>& rules) {
  auto jump = ChainHas(h, table, from, {"-j", chain});
  if (!jump.ok()) return jump.error();
  if (!*jump) return false;
  for (const auto& rule : rules) {
    auto has = ChainHas(h, table, chain, rule);
    if (!has.ok()) return has.error();
    if (!*has) return false;
  }
  return true;
}

// ---------------------------------------------------------------- conflicts, taps, OVS

// Interfaces other than the bridge that carry the gateway address (any prefix): another bridge
// already serving the slice subnet.
Result<std::vector<std::string>> GatewayOwners(const NetHost& h, const NetworkSpec& spec,
                                               const Plan& p) {
  auto r = h.Must("ip", {"-j", "-4", "addr", "show"});
  if (!r.ok()) return r.error();
  std::vector<std::string> out;
  auto j = nlohmann::json::parse(r->out, nullptr, false);
  if (j.is_discarded() || !j.is_array()) return out;
  const std::string gw = Ipv4String(p.gateway);
  for (const auto& link : j) {
    const std::string name = link.value("ifname", "");
    if (name == spec.bridge || !link.contains("addr_info")) continue;
    for (const auto& ai : link["addr_info"]) {
      if (ai.value("local", "") == gw) out.push_back(name);
    }
  }
  return out;
}

Error GatewayConflict(const NetworkSpec& spec, const Plan& p,
                      const std::vector<std::string>& owners) {
  Error e = Error::FailedPrecondition(
      reason::kGatewayConflict,
      fmt::format("the gateway {} is already on {} (not {}): another bridge "
                  "serves the slice subnet; move it or change ipam's rule",
                  Ipv4String(p.gateway), Join(owners), spec.bridge));
  e.details["owners"] = Join(owners);
  return e;
}

// libvirt names a guest's tap by the guest MAC with fe: first ("fe:54:00:ab:cd:ef").
std::string TapMac(const std::string& guest_mac) { return "fe" + guest_mac.substr(2); }

struct Tap {
  std::string name, master, slot_key, mac;
};

// The taps of the reservations' guests, with the Linux master they hang on ("" for none; OVS
// ports of the kernel datapath show "ovs-system").
Result<std::vector<Tap>> ProbeTaps(const NetHost& h, const NetworkSpec& spec, const Plan& p) {
  auto r = h.Must("ip", {"-j", "link", "show"});
  if (!r.ok()) return r.error();
  std::map<std::string, const NetReservation*> by_tap_mac;
  for (const auto& res : p.res) by_tap_mac[TapMac(res.mac)] = &res;
  std::vector<Tap> out;
  auto j = nlohmann::json::parse(r->out, nullptr, false);
  if (j.is_discarded() || !j.is_array()) return out;
  for (const auto& link : j) {
    auto it = by_tap_mac.find(Lower(link.value("address", "")));
    // A Linux bridge takes its only port's MAC: the bridge is no tap.
    if (it == by_tap_mac.end() || link.value("ifname", "") == spec.bridge) continue;
    out.push_back({link.value("ifname", ""), link.value("master", ""), it->second->slot_key,
                   it->second->mac});
  }
  return out;
}

struct OvsState {
  OvsBridge bridge;
  std::vector<OvsInterface> ifaces;
  OvsFlowTable flows;
};

// The bridge and its flows; its interfaces too when `interfaces` (the check needs them, the
// apply reads them later, after it may have changed them).
Result<OvsState> ProbeOvs(const Ovs& ovs, const std::string& bridge, bool interfaces) {
  OvsState s;
  auto b = ovs.Bridge(bridge);
  if (!b.ok()) return b.error();
  s.bridge = *b;
  if (interfaces) {
    auto ifaces = ovs.Interfaces();
    if (!ifaces.ok()) return ifaces.error();
    s.ifaces = std::move(*ifaces);
  }
  if (s.bridge.exists) {
    auto flows = ovs.Flows(bridge);
    if (!flows.ok()) return flows.error();
    s.flows = std::move(*flows);
    // OVS's own default flow on a bridge not yet in fail_mode=secure (which removes it).
    if (s.bridge.fail_mode != "secure") {
      std::erase(s.flows.foreign, std::string("cookie=0x0, priority=0 actions=NORMAL"));
    }
  }
  return s;
}

Error ForeignFlows(const NetworkSpec& spec, const std::vector<std::string>& flows) {
  Error e = Error::FailedPrecondition(
      reason::kForeignFlows,
      fmt::format("{} has {} OpenFlow rule(s) the platform did not install; they "
                  "could bridge slices: remove them (ovs-ofctl del-flows) or "
                  "give the platform another bridge",
                  spec.bridge, flows.size()));
  e.details["flows"] = Join(flows, "; ");
  return e;
}

// Taps not on the bridge, as "<slot_key>" -> tap.
std::map<std::string, Tap> DetachedTaps(const NetworkSpec& spec, const std::vector<Tap>& taps,
                                        const std::vector<OvsInterface>& ifaces) {
  std::map<std::string, Tap> out;
  for (const auto& t : taps) {
    bool on = false;
    if (spec.datapath == Datapath::kOvs) {
      for (const auto& i : ifaces) on = on || (i.name == t.name && i.bridge == spec.bridge);
    } else {
      on = t.master == spec.bridge;
    }
    if (!on) out[t.slot_key.empty() ? t.mac : t.slot_key] = t;
  }
  return out;
}

// The OVS interfaces of the reservations on the bridge, in the datapath (ofport > 0).
std::vector<std::pair<const OvsInterface*, const NetReservation*>> OvsVnics(
    const NetworkSpec& spec, const Plan& p, const std::vector<OvsInterface>& ifaces) {
  std::map<std::string, const NetReservation*> by_mac;
  for (const auto& r : p.res) by_mac[r.mac] = &r;
  std::vector<std::pair<const OvsInterface*, const NetReservation*>> out;
  for (const auto& i : ifaces) {
    auto it = by_mac.find(i.attached_mac);
    if (it == by_mac.end() || i.bridge != spec.bridge || i.ofport <= 0) continue;
    out.emplace_back(&i, it->second);
  }
  return out;
}

bool VnicConfigured(const NetworkSpec& spec, const OvsInterface& i, const NetReservation& r) {
  return i.ingress_rate_kbps == spec.vnic_ingress_kbps &&
         i.ingress_burst_kb == spec.vnic_ingress_burst_kb && i.slot == r.slot_key;
}

// A vNIC port is no IP interface of the host. With the userspace datapath the host's own stack
// also receives the port's frames (OVS reads them off a socket; the kernel keeps its copy), so
// without these the host would answer a slice's ARP for the gateway with the port's MAC and
// route the slice's packets from the port itself, past the bridge's FORWARD rules.
const std::vector<std::pair<std::string, std::string>> kVnicSysctls = {{"arp_ignore", "8"},
                                                                       {"forwarding", "0"}};

// Ports whose sysctls are not kVnicSysctls ("" when all are).
Result<std::set<std::string>> VnicSysctlsOff(const NetHost& h,
                                             const std::vector<std::string>& ports) {
  std::set<std::string> off;
  if (ports.empty()) return off;
  Args keys{"-n"};
  for (const auto& port : ports) {
    for (const auto& [k, v] : kVnicSysctls) {
      keys.push_back(fmt::format("net/ipv4/conf/{}/{}", port, k));
    }
  }
  auto r = h.Run("sysctl", keys);
  if (!r.ok()) return r.error();
  const auto values = SplitLines(r->out);
  size_t at = 0;
  for (const auto& port : ports) {
    for (const auto& [k, v] : kVnicSysctls) {
      if (at >= values.size() || Trim(values[at]) != v) off.insert(port);
      ++at;
    }
  }
  return off;
}

std::vector<std::string> WantFlows(
    const NetworkSpec& spec,
    const std::vector<std::pair<const OvsInterface*, const NetReservation*>>& vnics) {
  std::vector<OvsVnic> v;
  v.reserve(vnics.size());
  for (const auto& [i, r] : vnics) v.push_back({i->ofport, r->mac});
  auto want = DesiredOvsFlows(spec.isolate_ports, v);
  std::sort(want.begin(), want.end());
  return want;
}

// gpuaas-*.conf files of the host's dnsmasq that hold nothing but dhcp-host reservations.
std::vector<std::string> StaleDnsmasqFiles(const std::string& dir) {
  std::vector<std::string> out;
  if (dir.empty()) return out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || !StartsWith(name, "gpuaas-") || name.size() < 12 ||
        name.substr(name.size() - 5) != ".conf") {
      continue;
    }
    bool only_hosts = true, any = false;
    for (const auto& raw : SplitLines(ReadWhole(entry.path().string()).value_or(""))) {
      const std::string line = Trim(raw);
      if (line.empty() || line[0] == '#') continue;
      any = true;
      if (!StartsWith(line, "dhcp-host=")) only_hosts = false;
    }
    if (any && only_hosts) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

size_t LogSize(const Plan& p) {
  struct stat st {};
  return ::stat(p.log.c_str(), &st) == 0 ? static_cast<size_t>(st.st_size) : 0;
}

// What dnsmasq logged about our hosts file after `offset`: "read <file>" on start and on every
// SIGHUP, "cannot read <file>: ..." when it could not (it keeps running either way).
enum class HostsRead { kNothing, kRead, kFailed };

HostsRead HostsReadSince(const Plan& p, size_t offset, std::chrono::milliseconds wait) {
  const auto deadline = Clock::now() + wait;
  for (;;) {
    auto log = ReadWhole(p.log).value_or("");
    if (log.size() < offset) offset = 0;  // truncated under us
    const std::string tail = log.substr(offset);
    if (tail.find("cannot read " + p.hosts) != std::string::npos) return HostsRead::kFailed;
    if (tail.find("read " + p.hosts) != std::string::npos) return HostsRead::kRead;
    if (Clock::now() >= deadline) return HostsRead::kNothing;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

Error CannotReadHosts(const Plan& p) {
  Error e = Error::FailedPrecondition(
      reason::kDnsmasqCannotReadHosts,
      "dnsmasq could not read " + p.hosts + " (it reads it as an unprivileged user); see " + p.log);
  e.details["path"] = p.hosts;
  return e;
}

Result<int> StartDnsmasq(const NetHost& h, const Plan& p) {
  ::unlink(p.pid.c_str());
  const size_t offset = LogSize(p);
  if (auto r = h.Run("dnsmasq", {"--conf-file=" + p.conf}); !r.ok()) {
    return r.error();
  } else if (r->exit_code != 0) {
    if (r->err.find("Address already in use") != std::string::npos) {
      Error e = Error::FailedPrecondition(
          reason::kDhcpServerConflict,
          "another DHCP server already listens on this host (" + Trim(r->err) +
              "): stop the host's own dnsmasq for the slice subnet; the agent's is the one "
              "that serves ipam's reservations");
      return e;
    }
    return NetHost::Failed("dnsmasq --conf-file=" + p.conf, *r);
  }
  // dnsmasq writes its pid file once it is up; the launcher returns as it daemonises.
  auto deadline = Clock::now() + std::chrono::seconds(3);
  for (;;) {
    if (auto pid = RunningDnsmasq(p)) {
      if (HostsReadSince(p, offset, std::chrono::seconds(1)) == HostsRead::kFailed) {
        StopPid(*pid);
        return CannotReadHosts(p);
      }
      return *pid;
    }
    if (Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string log = ReadWhole(p.log).value_or("");
  if (log.size() > 600) log = log.substr(log.size() - 600);
  Error e = Error::Unavailable(reason::kDnsmasqStartFailed, "dnsmasq did not come up: " + log);
  e.details["log"] = p.log;
  return e;
}

// SIGHUP makes dnsmasq re-read dhcp-hostsfile; the "read" log line confirms it. Without that
// confirmation dnsmasq is restarted, so its memory always matches the file. True = restarted.
Result<bool> ReloadDnsmasq(const NetHost& h, const Plan& p, int& pid) {
  const size_t offset = LogSize(p);
  if (::kill(pid, SIGHUP) != 0) {
    return Error::Unavailable(reason::kDnsmasqReloadFailed,
                              std::string("SIGHUP: ") + std::strerror(errno));
  }
  switch (HostsReadSince(p, offset, std::chrono::seconds(2))) {
    case HostsRead::kRead:
      return false;
    case HostsRead::kFailed:
      return CannotReadHosts(p);
    case HostsRead::kNothing:
      break;
  }
  StopPid(pid);
  auto started = StartDnsmasq(h, p);
  if (!started.ok()) return started.error();
  pid = *started;
  return true;
}

void Note(std::vector<std::string>& out, bool flag, const char* name) {
  if (flag) out.emplace_back(name);
}

Error WithApplied(Error e, const ApplyReport& rep) {
  e.details["applied_before_error"] = Join(rep.Changes());
  return e;
}

// ---------------------------------------------------------------- apply steps
// ApplyNetwork's steps, in order. Each records what it changed in `rep`; its errors once
// something may have changed carry the changes so far (WithApplied), the probes and refusals
// before the first change return their errors as they are.

using Vnics = std::vector<std::pair<const OvsInterface*, const NetReservation*>>;

Result<void> RequireApplyTools(const NetHost& h, const NetworkSpec& spec) {
  if (auto r = h.Preflight(); !r.ok()) return r.error();
  const std::vector<std::string> tools =
      spec.datapath == Datapath::kOvs
          ? std::vector<std::string>{"ip",      "iptables",  "sysctl",
                                     "dnsmasq", "ovs-vsctl", "ovs-ofctl"}
          : std::vector<std::string>{"ip", "iptables", "bridge", "sysctl", "dnsmasq"};
  for (const auto& tool : tools) {
    if (auto t = h.Tool(tool); !t.ok()) return t.error();
  }
  return Ok();
}

// An OVS bridge of that name, created (fail_mode=secure, ours) or adopted; a Linux bridge or
// any other link of that name, or flows the platform did not install, are refused.
Result<void> CreateOrAdoptOvsBridge(const Ovs& ovs, const NetworkSpec& spec, const NetContext& ctx,
                                    const BridgeState& br, ApplyReport& rep) {
  if (br.is_bridge) {
    return Error::FailedPrecondition(reason::kBridgeNameConflict,
                                     spec.bridge + " exists as a Linux bridge, not an OVS bridge");
  }
  auto st = ProbeOvs(ovs, spec.bridge, false);
  if (!st.ok()) return st.error();
  if (br.exists && !st->bridge.exists) {
    return Error::FailedPrecondition(reason::kBridgeNameConflict,
                                     spec.bridge + " exists and is not an OVS bridge");
  }
  if (!st->flows.foreign.empty()) return ForeignFlows(spec, st->flows.foreign);
  if (!st->bridge.exists) {
    Args add{"--may-exist",
             "add-br",
             spec.bridge,
             "--",
             "set",
             "bridge",
             spec.bridge,
             "fail_mode=secure",
             "external_ids:gpuaas-managed=true"};
    if (!ctx.ovs_datapath_type.empty()) add.push_back("datapath_type=" + ctx.ovs_datapath_type);
    if (auto r = ovs.Vsctl(add); !r.ok()) return WithApplied(r.error(), rep);
    rep.created_bridge = true;
  } else if (st->bridge.fail_mode != "secure" || !st->bridge.managed) {
    // A runbook host's ovsbr0: ours from now on; its datapath and ports stay as they are.
    if (auto r = ovs.Vsctl(
            {"set", "bridge", spec.bridge, "fail_mode=secure", "external_ids:gpuaas-managed=true"});
        !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.adopted_bridge = true;
  }
  return Ok();
}

// ovs-vswitchd creates the internal port a moment after the database says so; `br` is
// re-probed until it exists.
Result<void> AwaitOvsInternalPort(const NetHost& h, const NetworkSpec& spec, const Plan& p,
                                  BridgeState& br, const ApplyReport& rep) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  for (;;) {
    auto probed = ProbeBridge(h, spec, p);
    if (!probed.ok()) return WithApplied(probed.error(), rep);
    br = *probed;
    if (br.exists || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!br.exists) {
    return WithApplied(
        Error::Unavailable(reason::kBridgeNotCreated, "ovs-vswitchd did not create " + spec.bridge +
                                                          "'s internal port (is it running?)"),
        rep);
  }
  return Ok();
}

Result<void> EnsureLinuxBridge(const NetHost& h, const NetworkSpec& spec, const BridgeState& br,
                               ApplyReport& rep) {
  if (br.exists && !br.is_bridge) {
    return Error::FailedPrecondition(reason::kBridgeNameConflict,
                                     spec.bridge + " exists and is not a bridge");
  }
  if (!br.exists) {
    if (auto r = h.Must("ip", {"link", "add", spec.bridge, "type", "bridge", "stp_state", "0",
                               "forward_delay", "0"});
        !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.created_bridge = true;
  }
  return Ok();
}

Result<void> EnsureBridgeAddressAndUp(const NetHost& h, const NetworkSpec& spec, const Plan& p,
                                      const BridgeState& br, ApplyReport& rep) {
  if (!br.has_gateway) {
    if (auto r = h.Must("ip", {"addr", "add", p.gateway_cidr, "dev", spec.bridge}); !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.added_gateway_address = true;
  }
  if (!br.up) {
    if (auto r = h.Must("ip", {"link", "set", spec.bridge, "up"}); !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.set_bridge_up = true;
  }
  return Ok();
}

// 1. Bridge with the gateway address, up. Conflicts are refused before anything changes.
Result<void> EnsureBridge(const NetHost& h, const Ovs& ovs, const NetworkSpec& spec,
                          const NetContext& ctx, const Plan& p, ApplyReport& rep) {
  auto owners = GatewayOwners(h, spec, p);
  if (!owners.ok()) return owners.error();
  if (!owners->empty()) return GatewayConflict(spec, p, *owners);
  auto br = ProbeBridge(h, spec, p);
  if (!br.ok()) return br.error();
  if (spec.datapath == Datapath::kOvs) {
    if (auto r = CreateOrAdoptOvsBridge(ovs, spec, ctx, *br, rep); !r.ok()) return r.error();
    if (rep.created_bridge) {
      if (auto r = AwaitOvsInternalPort(h, spec, p, *br, rep); !r.ok()) return r.error();
    }
  } else {
    if (auto r = EnsureLinuxBridge(h, spec, *br, rep); !r.ok()) return r.error();
  }
  return EnsureBridgeAddressAndUp(h, spec, p, *br, rep);
}

// 2. Forwarding (never turned off here: it is namespace-wide and may serve others).
Result<void> EnsureIpForward(const NetHost& h, const NetworkSpec& spec, ApplyReport& rep) {
  if (!spec.ip_forward) return Ok();
  auto fwd = ReadIpForward(h);
  if (!fwd.ok()) return WithApplied(fwd.error(), rep);
  if (*fwd != "1") {
    if (auto r = h.Must("sysctl", {"-q", "-w", "net.ipv4.ip_forward=1"}); !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.enabled_ip_forward = true;
  }
  return Ok();
}

// 3. NAT and FORWARD chains.
Result<void> EnsureNatAndForward(const NetHost& h, const NetworkSpec& spec, const Plan& p,
                                 ApplyReport& rep) {
  auto nat = EnsureNat(h, spec, p);
  if (!nat.ok()) return WithApplied(nat.error(), rep);
  rep.added_masquerade = nat->added;
  auto fwd = EnsureChain(h, "filter", "FORWARD", p.fwd_chain, ForwardRules(spec, p));
  if (!fwd.ok()) return WithApplied(fwd.error(), rep);
  rep.added_forward_rules = fwd->added;
  rep.removed_stale_rules = nat->rebuilt || fwd->rebuilt;
  return Ok();
}

// Every reserved guest's tap onto the bridge. On OVS, `ifaces` is filled with the interfaces
// as listed before the taps were moved.
Result<void> ReattachTaps(const NetHost& h, const Ovs& ovs, const NetworkSpec& spec, const Plan& p,
                          std::vector<OvsInterface>& ifaces, ApplyReport& rep) {
  const bool ovs_dp = spec.datapath == Datapath::kOvs;
  auto taps = ProbeTaps(h, spec, p);
  if (!taps.ok()) return WithApplied(taps.error(), rep);
  if (ovs_dp) {
    auto listed = ovs.Interfaces();
    if (!listed.ok()) return WithApplied(listed.error(), rep);
    ifaces = std::move(*listed);
  }
  for (const auto& [slot, tap] : DetachedTaps(spec, *taps, ifaces)) {
    Result<ToolResult> r = ToolResult{};
    if (!ovs_dp) {
      r = h.Must("ip", {"link", "set", "dev", tap.name, "master", spec.bridge});
    } else {
      if (!tap.master.empty() && tap.master != "ovs-system") {
        r = h.Must("ip", {"link", "set", "dev", tap.name, "nomaster"});
      }
      // --if-exists del-port: off another OVS bridge in the same transaction.
      if (r.ok()) {
        r = ovs.Vsctl({"--if-exists", "del-port", tap.name, "--", "add-port", spec.bridge, tap.name,
                       "--", "set", "interface", tap.name, "external_ids:attached-mac=" + tap.mac});
      }
    }
    if (!r.ok()) return WithApplied(r.error(), rep);
    rep.reattached_vnics.push_back(tap.name);
  }
  return Ok();
}

// Re-read: the re-added ports get their OpenFlow port numbers from ovs-vswitchd.
Result<void> AwaitReattachedPortNumbers(const Ovs& ovs, std::vector<OvsInterface>& ifaces,
                                        const ApplyReport& rep) {
  const auto deadline = Clock::now() + std::chrono::seconds(3);
  for (;;) {
    auto listed = ovs.Interfaces();
    if (!listed.ok()) return WithApplied(listed.error(), rep);
    ifaces = std::move(*listed);
    bool numbered = true;
    for (const auto& i : ifaces) {
      for (const auto& n : rep.reattached_vnics) {
        numbered = numbered && (i.name != n || i.ofport > 0);
      }
    }
    if (numbered || Clock::now() >= deadline) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return Ok();
}

// Every vNIC's sysctls (kVnicSysctls), ingress policing and slot tag.
Result<void> ConfigureOvsVnics(const NetHost& h, const Ovs& ovs, const NetworkSpec& spec,
                               const Vnics& vnics, ApplyReport& rep) {
  std::vector<std::string> names;
  names.reserve(vnics.size());
  for (const auto& [i, r] : vnics) names.push_back(i->name);
  auto sys_off = VnicSysctlsOff(h, names);
  if (!sys_off.ok()) return WithApplied(sys_off.error(), rep);
  for (const auto& [i, r] : vnics) {
    const bool db_ok = VnicConfigured(spec, *i, *r);
    if (db_ok && !sys_off->count(i->name)) continue;
    if (sys_off->count(i->name)) {
      Args set{"-q", "-w"};
      for (const auto& [k, v] : kVnicSysctls) {
        set.push_back(fmt::format("net/ipv4/conf/{}/{}={}", i->name, k, v));
      }
      if (auto w = h.Must("sysctl", set); !w.ok()) return WithApplied(w.error(), rep);
    }
    rep.configured_vnics.push_back(i->name);
    if (db_ok) continue;
    if (auto set = ovs.Vsctl({"set", "interface", i->name,
                              fmt::format("ingress_policing_rate={}", spec.vnic_ingress_kbps),
                              fmt::format("ingress_policing_burst={}", spec.vnic_ingress_burst_kb),
                              "external_ids:gpuaas-slot=" + r->slot_key});
        !set.ok()) {
      return WithApplied(set.error(), rep);
    }
  }
  return Ok();
}

// Exactly our flows on the bridge; flows someone else installed meanwhile are refused.
Result<void> EnsureOurFlows(const Ovs& ovs, const NetworkSpec& spec, const Plan& p,
                            const Vnics& vnics, ApplyReport& rep) {
  auto flows = ovs.Flows(spec.bridge);
  if (!flows.ok()) return WithApplied(flows.error(), rep);
  if (!flows->foreign.empty()) return WithApplied(ForeignFlows(spec, flows->foreign), rep);
  const auto want = WantFlows(spec, vnics);
  if (flows->ours != want) {
    if (auto r = ovs.ReplaceOurFlows(spec.bridge, want, p.flows); !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.replaced_flows = true;
  }
  return Ok();
}

Result<void> EnsurePortIsolation(const NetHost& h, const NetworkSpec& spec, ApplyReport& rep) {
  auto ports = ProbePorts(h, spec);
  if (!ports.ok()) return WithApplied(ports.error(), rep);
  for (const auto& [port, isolated] : *ports) {
    if (isolated == spec.isolate_ports) continue;
    if (auto r = h.Must(
            "bridge", {"link", "set", "dev", port, "isolated", spec.isolate_ports ? "on" : "off"});
        !r.ok()) {
      return WithApplied(r.error(), rep);
    }
    rep.isolation_changed_ports.push_back(port);
  }
  return Ok();
}

// 4. The slice vNICs: every reserved guest's tap on the bridge; then, on a Linux bridge,
// every port isolated; on OVS, every vNIC policed and tagged, and exactly our flows.
Result<void> EnsureVnics(const NetHost& h, const Ovs& ovs, const NetworkSpec& spec, const Plan& p,
                         ApplyReport& rep) {
  std::vector<OvsInterface> ifaces;
  if (auto r = ReattachTaps(h, ovs, spec, p, ifaces, rep); !r.ok()) return r.error();
  if (spec.datapath != Datapath::kOvs) return EnsurePortIsolation(h, spec, rep);
  if (!rep.reattached_vnics.empty()) {
    if (auto r = AwaitReattachedPortNumbers(ovs, ifaces, rep); !r.ok()) return r.error();
  }
  const auto vnics = OvsVnics(spec, p, ifaces);
  if (auto r = ConfigureOvsVnics(h, ovs, spec, vnics, rep); !r.ok()) return r.error();
  return EnsureOurFlows(ovs, spec, p, vnics, rep);
}

// The seed incident: reservation files an earlier manual run left for the host's dnsmasq.
Result<void> MoveStaleDnsmasqFilesAside(const NetworkSpec& spec, const NetContext& ctx,
                                        ApplyReport& rep) {
  for (const auto& name : StaleDnsmasqFiles(ctx.host_dnsmasq_dir)) {
    const std::string aside = spec.state_dir + "/stale-dnsmasq";
    ::mkdir(aside.c_str(), 0755);
    const std::string from = fmt::format("{}/{}", ctx.host_dnsmasq_dir, name);
    if (::rename(from.c_str(), fmt::format("{}/{}", aside, name).c_str()) != 0) {
      return WithApplied(
          Error::Internal(reason::kStateWriteFailed,
                          ctx.host_dnsmasq_dir + "/" + name + ": " + std::strerror(errno)),
          rep);
    }
    rep.removed_stale_dnsmasq_files.push_back(name);
  }
  return Ok();
}

// The MACs added, changed and removed by replacing the hosts file `old_hosts` with p.res.
void NoteReservationChanges(const std::string& old_hosts, const Plan& p, ApplyReport& rep) {
  auto before = ParseHosts(old_hosts);
  std::set<std::string> wanted;
  for (const auto& r : p.res) {
    wanted.insert(r.mac);
    auto it = before.find(r.mac);
    if (it == before.end()) {
      rep.added_reservations.push_back(r.mac);
    } else if (it->second.ip != r.ip || it->second.hostname != r.hostname) {
      rep.changed_reservations.push_back(r.mac);
    }
  }
  for (const auto& [mac, e] : before) {
    if (!wanted.count(mac)) rep.removed_reservations.push_back(mac);
  }
}

// 5. dnsmasq files: the hosts file holds exactly the reservations. True = the hosts file
// changed.
Result<bool> WriteDnsmasqFiles(const NetworkSpec& spec, const Plan& p, ApplyReport& rep) {
  const std::string hosts = RenderHosts(p.res);
  const std::string conf = RenderConf(p, spec);
  auto old_hosts = ReadWhole(p.hosts);
  const bool hosts_changed = old_hosts != hosts;
  if (hosts_changed) {
    NoteReservationChanges(old_hosts.value_or(""), p, rep);
    if (auto r = WriteAtomic(p.hosts, hosts); !r.ok()) return WithApplied(r.error(), rep);
  }
  if (ReadWhole(p.conf) != conf) {
    if (auto r = WriteAtomic(p.conf, conf); !r.ok()) return WithApplied(r.error(), rep);
    rep.wrote_dnsmasq_config = true;
  }
  return hosts_changed;
}

// 6. dnsmasq: started when not running, restarted when its config or bridge changed under it,
// otherwise SIGHUP re-reads dhcp-hostsfile.
Result<void> EnsureDnsmasq(const NetHost& h, const Plan& p, bool hosts_changed, ApplyReport& rep) {
  auto pid = RunningDnsmasq(p);
  if (pid && (rep.wrote_dnsmasq_config || rep.created_bridge)) {
    StopPid(*pid);
    pid.reset();
    rep.restarted_dnsmasq = true;
  }
  if (!pid) {
    auto started = StartDnsmasq(h, p);
    if (!started.ok()) return WithApplied(started.error(), rep);
    pid = *started;
    rep.started_dnsmasq = !rep.restarted_dnsmasq;
  } else if (hosts_changed) {
    auto restarted = ReloadDnsmasq(h, p, *pid);
    if (!restarted.ok()) return WithApplied(restarted.error(), rep);
    (*restarted ? rep.restarted_dnsmasq : rep.reloaded_dnsmasq) = true;
  }
  rep.dnsmasq_pid = *pid;
  return Ok();
}

}  // namespace

// ---------------------------------------------------------------- public API

std::vector<std::string> ApplyReport::Changes() const {
  std::vector<std::string> out;
  Note(out, created_bridge, "created_bridge");
  Note(out, added_gateway_address, "added_gateway_address");
  Note(out, set_bridge_up, "set_bridge_up");
  Note(out, enabled_ip_forward, "enabled_ip_forward");
  Note(out, added_masquerade, "added_masquerade");
  Note(out, added_forward_rules, "added_forward_rules");
  Note(out, removed_stale_rules, "removed_stale_rules");
  Note(out, !isolation_changed_ports.empty(), "changed_port_isolation");
  Note(out, adopted_bridge, "adopted_bridge");
  Note(out, !reattached_vnics.empty(), "reattached_vnics");
  Note(out, !configured_vnics.empty(), "configured_vnics");
  Note(out, replaced_flows, "replaced_flows");
  Note(out, !removed_stale_dnsmasq_files.empty(), "removed_stale_dnsmasq_files");
  Note(out, wrote_dnsmasq_config, "wrote_dnsmasq_config");
  Note(out, !added_reservations.empty(), "added_reservations");
  Note(out, !changed_reservations.empty(), "changed_reservations");
  Note(out, !removed_reservations.empty(), "removed_reservations");
  Note(out, started_dnsmasq, "started_dnsmasq");
  Note(out, restarted_dnsmasq, "restarted_dnsmasq");
  Note(out, reloaded_dnsmasq, "reloaded_dnsmasq");
  return out;
}

Result<void> ValidateNetworkSpec(const NetworkSpec& spec, const NetContext& ctx) {
  auto p = MakePlan(spec, ctx);
  if (!p.ok()) return p.error();
  return Ok();
}

Result<ApplyReport> ApplyNetwork(const NetworkSpec& spec, const NetContext& ctx) {
  auto plan = MakePlan(spec, ctx);
  if (!plan.ok()) return plan.error();
  const Plan& p = *plan;
  NetHost h(ctx);
  if (auto r = RequireApplyTools(h, spec); !r.ok()) return r.error();
  if (auto r = PrepareStateDir(spec.state_dir); !r.ok()) return r.error();
  DirLock lock(p.lock);
  if (!lock.ok()) {
    return Error::FailedPrecondition(reason::kStateDirUnusable,
                                     p.lock + ": " + std::strerror(errno));
  }

  ApplyReport rep;
  rep.version = spec.version;
  const Ovs ovs(h, ctx.ovs_rundir);
  if (auto r = EnsureBridge(h, ovs, spec, ctx, p, rep); !r.ok()) return r.error();
  if (auto r = EnsureIpForward(h, spec, rep); !r.ok()) return r.error();
  if (auto r = EnsureNatAndForward(h, spec, p, rep); !r.ok()) return r.error();
  if (auto r = EnsureVnics(h, ovs, spec, p, rep); !r.ok()) return r.error();
  if (auto r = MoveStaleDnsmasqFilesAside(spec, ctx, rep); !r.ok()) return r.error();
  auto hosts_changed = WriteDnsmasqFiles(spec, p, rep);
  if (!hosts_changed.ok()) return hosts_changed.error();
  if (auto r = EnsureDnsmasq(h, p, *hosts_changed, rep); !r.ok()) return r.error();
  return rep;
}

Result<std::vector<LeaseObservation>> ObserveLeases(const NetworkSpec& spec, int* skipped) {
  auto plan = MakePlan(spec, {});
  if (!plan.ok()) return plan.error();
  std::vector<LeaseLine> leases;
  int odd = 0;
  for (auto& l : ParseLeases(ReadWhole(plan->leases).value_or(""))) {
    if (Expired(l)) continue;
    // Not a unicast Ethernet MAC with an IPv4 address: nothing ipam could judge.
    if (!IsUnicastMac(l.mac) || !ParseIpv4(l.ip)) {
      ++odd;
      continue;
    }
    leases.push_back(std::move(l));
  }
  if (skipped != nullptr) *skipped = odd;

  std::vector<LeaseObservation> out;
  std::set<std::string> reserved;
  for (const auto& r : spec.reservations) {
    LeaseObservation o;
    o.mac = Lower(r.mac);
    o.hostname = r.hostname;
    o.slot_key = r.slot_key;
    o.expected_ip = r.ip;
    o.lease_state = v1::LEASE_STATE_MISSING;
    reserved.insert(o.mac);
    for (const auto& l : leases) {
      if (l.mac != o.mac) continue;
      if (l.ip == r.ip) {
        o.actual_ip = l.ip;
        o.expires_at = l.expiry;
        o.lease_state = v1::LEASE_STATE_BOUND;
        break;
      }
      if (o.lease_state == v1::LEASE_STATE_MISSING) {
        o.actual_ip = l.ip;
        o.expires_at = l.expiry;
        o.lease_state = v1::LEASE_STATE_MISMATCH;
      }
    }
    out.push_back(std::move(o));
  }
  for (const auto& l : leases) {
    if (reserved.count(l.mac)) continue;
    LeaseObservation o;
    o.mac = l.mac;
    o.hostname = l.hostname;
    o.actual_ip = l.ip;
    o.expires_at = l.expiry;
    o.lease_state = v1::LEASE_STATE_UNEXPECTED;
    out.push_back(std::move(o));
  }
  return out;
}

Reason SlotDriftKindText(SlotDriftKind kind) {
  switch (kind) {
    case SlotDriftKind::kQosMissing:
      return reason::kQosMissing;
    case SlotDriftKind::kVnicDetached:
      return reason::kVnicDetached;
    case SlotDriftKind::kVnicHostStackOpen:
      return reason::kVnicHostStackOpen;
  }
  return reason::kVnicDetached;  // unreachable: every kind is handled above
}

Result<NetCheck> CheckNetwork(const NetworkSpec& spec, const NetContext& ctx) {
  auto plan = MakePlan(spec, ctx);
  if (!plan.ok()) return plan.error();
  const Plan& p = *plan;
  NetHost h(ctx);
  if (auto r = h.Preflight(); !r.ok()) return r.error();
  NetCheck c;
  auto block = [&](Reason b) { c.blockers.push_back(b.str()); };

  const bool ovs_dp = spec.datapath == Datapath::kOvs;
  const Ovs ovs(h, ctx.ovs_rundir);
  auto br = ProbeBridge(h, spec, p);
  if (!br.ok()) return br.error();
  OvsState ovs_state;
  if (ovs_dp) {
    auto st = ProbeOvs(ovs, spec.bridge, true);
    if (!st.ok()) return st.error();
    ovs_state = std::move(*st);
  }
  const bool bridge_ok =
      br->exists && (ovs_dp ? ovs_state.bridge.exists && !br->is_bridge : br->is_bridge);
  c.evidence["datapath"] = ovs_dp ? "ovs" : "linux-bridge";
  c.evidence["bridge"] = !br->exists  ? "absent"
                         : !bridge_ok ? (ovs_dp ? "not_an_ovs_bridge" : "not_a_bridge")
                         : br->up     ? "up"
                                      : "down";
  if (!bridge_ok) {
    block(reason::kBridgeMissing);
  } else {
    if (!br->up) block(reason::kBridgeDown);
    if (!br->has_gateway) block(reason::kGatewayAddressMissing);
  }
  auto owners = GatewayOwners(h, spec, p);
  if (!owners.ok()) return owners.error();
  if (!owners->empty()) {
    c.evidence["gateway_owners"] = Join(*owners);
    block(reason::kGatewayConflict);
  }

  if (spec.ip_forward) {
    auto fwd = ReadIpForward(h);
    if (!fwd.ok()) return fwd.error();
    c.evidence["ip_forward"] = *fwd;
    if (*fwd != "1") block(reason::kIpForwardOff);
  }
  if (spec.masquerade) {
    auto ok = ChainHas(h, "nat", "POSTROUTING", NatRule(spec, p));
    if (!ok.ok()) return ok.error();
    c.evidence["masquerade"] = *ok ? "present" : "missing";
    if (!*ok) block(reason::kMasqueradeMissing);
  }
  auto fwd_ok = ChainComplete(h, "filter", "FORWARD", p.fwd_chain, ForwardRules(spec, p));
  if (!fwd_ok.ok()) return fwd_ok.error();
  if (!*fwd_ok) block(reason::kForwardRulesMissing);

  std::vector<SlotDrift> slot_drift;
  if (bridge_ok && !ovs_dp) {
    auto ports = ProbePorts(h, spec);
    if (!ports.ok()) return ports.error();
    std::vector<std::string> ev;
    bool open = false;
    for (const auto& [port, isolated] : *ports) {
      ev.push_back(port + (isolated ? ":isolated" : ":open"));
      if (spec.isolate_ports && !isolated) open = true;
    }
    c.evidence["ports"] = Join(ev);
    if (open) block(reason::kPortsNotIsolated);
  }
  if (bridge_ok && ovs_dp) {
    std::vector<std::string> ev;
    for (const auto& i : ovs_state.ifaces) {
      if (i.bridge != spec.bridge || i.name == spec.bridge) continue;
      ev.push_back(
          fmt::format("{}:{}:{}", i.name, i.ofport, i.attached_mac.empty() ? "-" : i.attached_mac));
    }
    c.evidence["ports"] = Join(ev);
    c.evidence["fail_mode"] = ovs_state.bridge.fail_mode;
    c.evidence["datapath_type"] = ovs_state.bridge.datapath_type;
    if (!ovs_state.flows.foreign.empty()) {
      c.evidence["foreign_flows"] = Join(ovs_state.flows.foreign, "; ");
      block(reason::kForeignFlows);
    }
    const auto vnics = OvsVnics(spec, p, ovs_state.ifaces);
    if (ovs_state.bridge.fail_mode != "secure" || ovs_state.flows.ours != WantFlows(spec, vnics)) {
      block(reason::kFlowsStale);
    }
    std::vector<std::string> names;
    names.reserve(vnics.size());
    for (const auto& [i, r] : vnics) names.push_back(i->name);
    auto sys_off = VnicSysctlsOff(h, names);
    if (!sys_off.ok()) return sys_off.error();
    for (const auto& [i, r] : vnics) {
      if (!VnicConfigured(spec, *i, *r)) {
        slot_drift.push_back({r->slot_key, SlotDriftKind::kQosMissing});
      }
      if (sys_off->count(i->name)) {
        slot_drift.push_back({r->slot_key, SlotDriftKind::kVnicHostStackOpen});
      }
    }
  }
  if (bridge_ok) {
    auto taps = ProbeTaps(h, spec, p);
    if (!taps.ok()) return taps.error();
    for (const auto& [slot, tap] : DetachedTaps(spec, *taps, ovs_state.ifaces)) {
      slot_drift.push_back({slot, SlotDriftKind::kVnicDetached});
    }
  }

  auto pid = RunningDnsmasq(p);
  c.evidence["dnsmasq_pid"] = pid ? std::to_string(*pid) : "";
  if (!pid) block(reason::kDnsmasqNotRunning);
  if (ReadWhole(p.conf) != RenderConf(p, spec)) block(reason::kDnsmasqConfigStale);
  if (ReadWhole(p.hosts) != RenderHosts(p.res)) block(reason::kReservationsStale);
  if (auto stale = StaleDnsmasqFiles(ctx.host_dnsmasq_dir); !stale.empty()) {
    c.evidence["stale_dnsmasq_files"] = Join(stale);
    block(reason::kStaleDnsmasqFiles);
  }
  std::sort(slot_drift.begin(), slot_drift.end(), [](const SlotDrift& a, const SlotDrift& b) {
    return std::tie(a.slot_key, a.kind) < std::tie(b.slot_key, b.kind);
  });
  c.slot_drift = std::move(slot_drift);
  return c;
}

Result<void> RemoveReservation(const NetworkSpec& spec, const std::string& mac,
                               const NetContext& ctx, RemovalReport* report) {
  const std::string target = Lower(mac);
  if (!IsUnicastMac(target)) {
    return Error::InvalidArgument(reason::kInvalidMac, "MAC must be unicast xx:xx:xx:xx:xx:xx",
                                  {{"field", "mac"}, {"value", mac}});
  }
  NetworkSpec rest = spec;
  std::string reserved_ip;
  rest.reservations.clear();
  for (const auto& r : spec.reservations) {
    if (Lower(r.mac) == target) {
      reserved_ip = r.ip;
    } else {
      rest.reservations.push_back(r);
    }
  }
  auto plan = MakePlan(rest, ctx);
  if (!plan.ok()) return plan.error();
  const Plan& p = *plan;
  NetHost h(ctx);
  if (auto r = h.Preflight(); !r.ok()) return r.error();
  if (auto r = PrepareStateDir(spec.state_dir); !r.ok()) return r.error();
  DirLock lock(p.lock);
  if (!lock.ok()) {
    return Error::FailedPrecondition(reason::kStateDirUnusable,
                                     p.lock + ": " + std::strerror(errno));
  }

  RemovalReport rep;
  auto old_hosts = ReadWhole(p.hosts);
  auto before = ParseHosts(old_hosts.value_or(""));
  if (auto it = before.find(target); it != before.end()) {
    rep.removed_hosts_entry = true;
    if (reserved_ip.empty()) reserved_ip = it->second.ip;
  }
  // Only this MAC goes; the rest of the file is left as it is (ApplyNetwork owns the others).
  std::vector<NetReservation> keep;
  for (const auto& [m, e] : before) {
    if (m != target) keep.push_back({m, e.ip, e.hostname, ""});
  }
  std::sort(keep.begin(), keep.end(), [](const NetReservation& a, const NetReservation& b) {
    auto x = ParseIpv4(a.ip), y = ParseIpv4(b.ip);
    return x && y ? *x < *y : a.ip < b.ip;
  });
  const std::string hosts = RenderHosts(keep);
  auto pid = RunningDnsmasq(p);
  if (old_hosts != hosts) {
    if (auto r = WriteAtomic(p.hosts, hosts); !r.ok()) return r.error();
    if (pid) {
      if (auto r = ReloadDnsmasq(h, p, *pid); !r.ok()) return r.error();
    }
  }

  auto victim = [&](const LeaseLine& l) {
    return l.mac == target || (!reserved_ip.empty() && l.ip == reserved_ip);
  };
  auto victims = [&] {
    std::vector<LeaseLine> v;
    for (auto& l : ParseLeases(ReadWhole(p.leases).value_or(""))) {
      if (victim(l)) v.push_back(std::move(l));
    }
    return v;
  };
  auto found = victims();
  for (const auto& l : found) rep.released_leases.push_back(l.ip);

  auto edit_file = [&]() -> Result<void> {
    std::string out;
    for (const auto& line : SplitLines(ReadWhole(p.leases).value_or(""))) {
      auto parsed = ParseLeases(line);
      if (!parsed.empty() && victim(parsed[0])) continue;
      out += line + "\n";
    }
    return WriteAtomic(p.leases, out);
  };

  if (!found.empty()) {
    bool clear = false;
    if (pid && ctx.use_dhcp_release && h.Has("dhcp_release")) {
      // dnsmasq keeps leases in memory and rewrites the file from there: a DHCPRELEASE on the
      // bridge makes it forget the lease and rewrite the file itself.
      bool sent = true;
      for (const auto& l : found) {
        Args a{spec.bridge, l.ip, l.mac};
        if (!l.client_id.empty()) a.push_back(l.client_id);
        auto r = h.Run("dhcp_release", a);
        if (!r.ok() || r->exit_code != 0) sent = false;  // fall back to the restart below
      }
      auto deadline = Clock::now() + std::chrono::seconds(2);
      while (sent && !(clear = victims().empty()) && Clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      if (clear) rep.lease_method = "dhcp_release";
    }
    if (!clear && pid) {
      if (!h.Has("dnsmasq")) return h.Tool("dnsmasq").error();
      StopPid(*pid);
      if (auto r = edit_file(); !r.ok()) return r.error();
      auto started = StartDnsmasq(h, p);
      if (!started.ok()) return started.error();
      rep.lease_method = "restart";
    } else if (!clear) {
      if (auto r = edit_file(); !r.ok()) return r.error();
      rep.lease_method = "file";
    }
    if (!victims().empty()) {
      return Error::Internal(reason::kLeaseStillPresent,
                             "a lease for " + target + " survived its removal");
    }
  }
  if (report) *report = std::move(rep);
  return Ok();
}

Result<void> TeardownNetwork(const NetworkSpec& spec, const NetContext& ctx) {
  auto plan = MakePlan(spec, ctx);
  if (!plan.ok()) return plan.error();
  const Plan& p = *plan;
  if (auto pid = RunningDnsmasq(p)) StopPid(*pid);

  NetHost h(ctx);
  std::optional<Error> first;
  auto keep = [&](const Error& e) {
    if (!first) first = e;
  };
  if (h.Preflight().ok()) {
    auto tagged = TaggedNatRules(h, p);
    if (!tagged.ok()) keep(tagged.error());
    for (const auto& rule : tagged.ok() ? *tagged : std::vector<Args>{}) {
      if (auto r = Ipt(h, "nat", Cat({"-D", "POSTROUTING"}, rule), true); !r.ok()) keep(r.error());
    }
    for (int i = 0; i < 16; ++i) {
      auto has = ChainHas(h, "filter", "FORWARD", {"-j", p.fwd_chain});
      if (!has.ok() || !*has) break;
      if (auto r = Ipt(h, "filter", {"-D", "FORWARD", "-j", p.fwd_chain}, true); !r.ok()) {
        keep(r.error());
        break;
      }
    }
    auto count = ChainRuleCount(h, "filter", p.fwd_chain);
    if (count.ok() && *count >= 0) {
      if (auto r = Ipt(h, "filter", {"-F", p.fwd_chain}, true); !r.ok()) keep(r.error());
      if (auto r = Ipt(h, "filter", {"-X", p.fwd_chain}, true); !r.ok()) keep(r.error());
    }
    if (spec.datapath == Datapath::kOvs) {
      if (auto r = Ovs(h, ctx.ovs_rundir).Vsctl({"--if-exists", "del-br", spec.bridge}); !r.ok()) {
        keep(r.error());
      }
    } else {
      auto link = h.Run("ip", {"link", "show", "dev", spec.bridge});
      if (link.ok() && link->exit_code == 0) {
        if (auto r = h.Must("ip", {"link", "del", spec.bridge}); !r.ok()) keep(r.error());
      }
    }
  }
  for (const auto& f : {p.conf, p.hosts, p.leases, p.pid, p.log, p.lock, p.flows}) {
    ::unlink(f.c_str());
  }
  ::rmdir(spec.state_dir.c_str());
  if (first) return *first;
  return Ok();
}

Result<std::vector<std::string>> CheckTeardown(const NetworkSpec& spec, const NetContext& ctx) {
  auto plan = MakePlan(spec, ctx);
  if (!plan.ok()) return plan.error();
  const Plan& p = *plan;
  NetHost h(ctx);
  if (auto r = h.Preflight(); !r.ok()) return r.error();
  std::vector<std::string> left;
  if (RunningDnsmasq(p)) left.emplace_back("dnsmasq");
  auto tagged = TaggedNatRules(h, p);
  if (!tagged.ok()) return tagged.error();
  if (!tagged->empty()) left.emplace_back("nat_rules");
  auto count = ChainRuleCount(h, "filter", p.fwd_chain);
  if (!count.ok()) return count.error();
  if (*count >= 0) left.emplace_back("forward_chain");
  auto br = ProbeBridge(h, spec, p);
  if (!br.ok()) return br.error();
  bool bridge = br->exists;
  if (spec.datapath == Datapath::kOvs) {
    auto ovs = Ovs(h, ctx.ovs_rundir).Bridge(spec.bridge);
    if (!ovs.ok()) return ovs.error();
    bridge = bridge || ovs->exists;
  }
  if (bridge) left.emplace_back("bridge");
  return left;
}

}  // namespace gpuaas::node_agent
