#include "gpuaas/node_agent/discovery/discovery.hpp"

#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>

#include <fmt/format.h>
#include <google/protobuf/util/time_util.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "network/ovs.hpp"

namespace gpuaas::node_agent {
namespace {

using v1::Check;
using v1::CheckStatus;

constexpr size_t kSignatureBytes = 8192;

std::string Join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) out += sep;
    out += v[i];
  }
  return out;
}

Check MakeCheck(std::string name, CheckStatus status, std::string detail,
                std::string remediation = "", bool blocker = false) {
  Check c;
  c.set_name(std::move(name));
  c.set_status(status);
  c.set_detail(std::move(detail));
  if (status != v1::CHECK_STATUS_PASS) c.set_remediation(std::move(remediation));
  c.set_blocker(blocker && status == v1::CHECK_STATUS_FAIL);
  return c;
}

// ---------------------------------------------------------------------------------------------
// PCI topology from a resolved sysfs path.

struct PciLocation {
  std::string address;            // the device itself ("" when the path holds no PCI address)
  std::string dev_dir;            // logical sysfs directory of the device
  std::vector<std::string> path;  // ancestors from the root port down to the parent
  std::string root_port;
  // The device's grandparent when that is not the root port: for root port -> switch upstream
  // -> switch downstream -> device it is the switch's upstream port, so devices with the same
  // value sit behind the same PCIe switch. "" when the device hangs off a root port (directly or
  // through a single bridge).
  std::string pcie_switch;
};

// `resolved` is a resolved logical path inside a PCI device's sysfs directory (or the
// directory itself); the last PCI address in it is the device.
PciLocation LocatePci(const std::string& resolved) {
  PciLocation loc;
  std::vector<std::string> chain;
  std::string dir;
  std::string last_dir;
  size_t i = 0;
  while (i < resolved.size()) {
    size_t j = resolved.find('/', i + 1);
    if (j == std::string::npos) j = resolved.size();
    std::string comp = resolved.substr(i + 1, j - i - 1);
    dir = resolved.substr(0, j);
    if (LooksLikePciAddress(comp)) {
      chain.push_back(comp);
      last_dir = dir;
    }
    i = j;
  }
  if (chain.empty()) return loc;
  loc.address = chain.back();
  loc.dev_dir = last_dir;
  loc.path.assign(chain.begin(), chain.end() - 1);
  if (!loc.path.empty()) loc.root_port = loc.path.front();
  if (loc.path.size() >= 3) loc.pcie_switch = loc.path[loc.path.size() - 2];
  return loc;
}

std::optional<int32_t> ReadNuma(const HostRoot& host, const std::string& dev_dir) {
  if (dev_dir.empty()) return std::nullopt;
  auto v = host.ReadInt(dev_dir + "/numa_node");
  if (!v || *v < 0 || *v > 4096) return std::nullopt;  // -1 means unknown, never node 0
  return static_cast<int32_t>(*v);
}

std::string GpuModel(const std::string& device_id) {
  static const std::map<std::string, std::string> kModels = {
      {"0x2335", "H200 SXM 141GB"}, {"0x2330", "H100 SXM5 80GB"}, {"0x2331", "H100 PCIe 80GB"},
      {"0x20b0", "A100 SXM4 40GB"}, {"0x20b2", "A100 SXM4 80GB"}, {"0x20b5", "A100 PCIe 80GB"},
  };
  auto it = kModels.find(Lower(device_id));
  return it == kModels.end() ? "" : it->second;
}

// ---------------------------------------------------------------------------------------------
// Mounts.

std::string UnescapeMount(const std::string& s) {
  // /proc/mounts escapes space, tab, newline and backslash as \ooo.
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '\\' && i + 3 < s.size() && std::isdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isdigit(static_cast<unsigned char>(s[i + 2])) &&
        std::isdigit(static_cast<unsigned char>(s[i + 3]))) {
      out += static_cast<char>((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

// kernel block device name -> mountpoints of data living on it: direct mounts, and mounts of
// dm/md devices stacked on it (through /sys/class/block/<dev>/slaves). Swap shows as "[SWAP]".
std::map<std::string, std::vector<std::string>> ReadMountsByDevice(const HostRoot& host) {
  std::vector<std::pair<std::string, std::string>> mounts;  // source, mountpoint
  auto text = host.ReadFile("/proc/self/mounts");
  if (!text) text = host.ReadFile("/proc/mounts");
  if (text) {
    for (const auto& line : SplitLines(*text)) {
      auto f = SplitWs(line);
      if (f.size() < 2) continue;
      mounts.emplace_back(UnescapeMount(f[0]), UnescapeMount(f[1]));
    }
  }
  if (auto swaps = host.ReadFile("/proc/swaps")) {
    auto lines = SplitLines(*swaps);
    for (size_t i = 1; i < lines.size(); ++i) {
      auto f = SplitWs(lines[i]);
      if (!f.empty()) mounts.emplace_back(UnescapeMount(f[0]), "[SWAP]");
    }
  }
  std::map<std::string, std::vector<std::string>> out;
  for (const auto& [src, mnt] : mounts) {
    if (!StartsWith(src, "/dev/")) continue;
    auto r = host.Resolve(src);
    if (!r || !StartsWith(*r, "/dev/")) continue;
    std::string top = Basename(*r);
    // Walk down the stack (dm on md on partition ...), bounded and loop-safe.
    std::vector<std::string> todo = {top};
    std::set<std::string> seen;
    while (!todo.empty() && seen.size() < 64) {
      std::string dev = todo.back();
      todo.pop_back();
      if (!seen.insert(dev).second) continue;
      auto& v = out[dev];
      if (std::find(v.begin(), v.end(), mnt) == v.end()) v.push_back(mnt);
      for (const auto& s : host.ListDir("/sys/class/block/" + dev + "/slaves")) todo.push_back(s);
    }
  }
  return out;
}

bool IsOsMount(const std::string& m) {
  return m == "/" || m == "/boot" || m == "/boot/efi" || m == "[SWAP]";
}

// nvme<digits>n<digits>: a whole namespace. Rejects partitions (nvme0n1p1) and the hidden
// per-controller path devices of native multipath (nvme4c4n1).
bool IsNvmeNamespace(const std::string& name) {
  auto digits = [&](size_t& i) {
    size_t b = i;
    while (i < name.size() && std::isdigit(static_cast<unsigned char>(name[i]))) ++i;
    return i > b;
  };
  if (!StartsWith(name, "nvme")) return false;
  size_t i = 4;
  if (!digits(i) || i >= name.size() || name[i] != 'n') return false;
  ++i;
  return digits(i) && i == name.size();
}

// Rank of a /dev/disk/by-id name as a stable identity (lower is better); -1 = not usable.
int ByIdRank(const std::string& name) {
  if (name.find("-part") != std::string::npos) return -1;
  if (StartsWith(name, "nvme-eui.")) return 0;
  if (StartsWith(name, "nvme-wwn-") || StartsWith(name, "wwn-")) return 1;
  if (StartsWith(name, "nvme-")) return 2;  // nvme-<model>_<serial>, nvme-nvme.<vid>-...
  return -1;
}

std::map<std::string, std::string> ByIdLinks(const HostRoot& host) {
  std::map<std::string, std::pair<int, std::string>> best;  // kernel name -> (rank, link name)
  for (const auto& name : host.ListDir("/dev/disk/by-id")) {
    int rank = ByIdRank(name);
    if (rank < 0) continue;
    std::string link = "/dev/disk/by-id/" + name;
    if (!host.IsSymlink(link)) continue;
    auto r = host.Resolve(link);
    if (!r || !StartsWith(*r, "/dev/")) continue;
    std::string kname = Basename(*r);
    auto it = best.find(kname);
    if (it == best.end() || std::make_pair(rank, name) < it->second) best[kname] = {rank, name};
  }
  std::map<std::string, std::string> out;
  for (const auto& [k, v] : best) out[k] = "/dev/disk/by-id/" + v.second;
  return out;
}

uint32_t Le32(const std::string& s, size_t off) {
  if (s.size() < off + 4) return 0;
  auto b = [&](size_t i) { return static_cast<uint32_t>(static_cast<unsigned char>(s[off + i])); };
  return b(0) | (b(1) << 8) | (b(2) << 16) | (b(3) << 24);
}

bool At(const std::string& s, size_t off, std::string_view magic) {
  return s.size() >= off + magic.size() && std::string_view(s).substr(off, magic.size()) == magic;
}

bool BootSignature(const std::string& s) {
  return s.size() >= 512 && static_cast<unsigned char>(s[510]) == 0x55 &&
         static_cast<unsigned char>(s[511]) == 0xAA;
}

// ---------------------------------------------------------------------------------------------
// Network helpers.

uint32_t ProcHex(const std::string& s) {
  // /proc/net/route prints the kernel's network-order u32 as native hex (little-endian hosts).
  uint32_t v = 0;
  for (char c : s) {
    v <<= 4;
    if (c >= '0' && c <= '9') {
      v |= static_cast<uint32_t>(c - '0');
    } else if (c >= 'a' && c <= 'f') {
      v |= static_cast<uint32_t>(c - 'a' + 10);
    } else if (c >= 'A' && c <= 'F') {
      v |= static_cast<uint32_t>(c - 'A' + 10);
    } else {
      return 0;
    }
  }
  return ((v & 0xffu) << 24) | ((v & 0xff00u) << 8) | ((v >> 8) & 0xff00u) | (v >> 24);
}

int PrefixOf(uint32_t mask) {
  int n = 0;
  while (mask & 0x80000000u) {
    ++n;
    mask <<= 1;
  }
  return n;
}

struct Route {
  std::string iface;
  uint32_t dest = 0;
  uint32_t mask = 0;
  long long metric = 0;
  bool up = false;
};

std::vector<Route> ReadRoutes(const HostRoot& host) {
  std::vector<Route> out;
  auto text = host.ReadFile("/proc/net/route");
  if (!text) return out;
  auto lines = SplitLines(*text);
  for (size_t i = 1; i < lines.size(); ++i) {
    auto f = SplitWs(lines[i]);
    if (f.size() < 8) continue;
    Route r;
    r.iface = f[0];
    r.dest = ProcHex(f[1]);
    r.up = (std::strtoul(f[3].c_str(), nullptr, 16) & 1u) != 0;  // RTF_UP
    r.metric = ParseInt(f[6]).value_or(0);
    r.mask = ProcHex(f[7]);
    out.push_back(r);
  }
  return out;
}

struct IfAddr {
  std::string iface;
  std::string cidr;  // "10.100.0.1/24"
};

// `ip -o -4 addr show`: "3: ovsbr0    inet 10.100.0.1/24 brd 10.100.0.255 scope global ovsbr0".
std::vector<IfAddr> ParseIpAddr(const std::string& out) {
  std::vector<IfAddr> v;
  for (const auto& line : SplitLines(out)) {
    auto f = SplitWs(line);
    if (f.size() < 4 || f[2] != "inet") continue;
    std::string iface = f[1];
    if (auto at = iface.find('@'); at != std::string::npos) iface.resize(at);
    v.push_back({iface, f[3]});
  }
  return v;
}

// Without an `ip` tool: local addresses from /proc/net/fib_trie, each mapped to the interface
// of the most specific connected route in /proc/net/route (that route's mask is the prefix).
std::vector<IfAddr> AddrsFromProc(const HostRoot& host) {
  std::vector<IfAddr> v;
  auto trie = host.ReadFile("/proc/net/fib_trie");
  if (!trie) return v;
  std::set<uint32_t> locals;
  std::string leaf;
  for (const auto& line : SplitLines(*trie)) {
    auto f = SplitWs(line);
    if (f.size() >= 2 && f[0] == "|--") {
      leaf = f[1];
    } else if (!leaf.empty() && line.find("/32 host LOCAL") != std::string::npos) {
      if (auto c = ParseCidr(leaf + "/32")) locals.insert(c->addr);
    }
  }
  auto routes = ReadRoutes(host);
  for (uint32_t a : locals) {
    if ((a >> 24) == 127) continue;
    const Route* best = nullptr;
    for (const auto& r : routes) {
      if (r.mask == 0 || (a & r.mask) != r.dest) continue;
      if (best == nullptr || PrefixOf(r.mask) > PrefixOf(best->mask)) best = &r;
    }
    if (best != nullptr) {
      v.push_back({best->iface, FormatIpv4(a) + "/" + std::to_string(PrefixOf(best->mask))});
    }
  }
  return v;
}

bool CidrCovers(const Ipv4Cidr& outer, const Ipv4Cidr& inner) {
  if (outer.prefix > inner.prefix) return false;
  Ipv4Cidr probe{inner.Network(), outer.prefix};
  return probe.Network() == outer.Network();
}

// A POSTROUTING rule that masquerades traffic from (a network covering) the slice subnet.
bool HasMasquerade(const std::string& rules, const Ipv4Cidr& subnet) {
  for (const auto& line : SplitLines(rules)) {
    auto t = SplitWs(line);
    if (t.size() < 4 || t[0] != "-A" || t[1] != "POSTROUTING") continue;
    bool masq = false, src = false;
    for (size_t i = 2; i + 1 < t.size(); ++i) {
      if (t[i] == "-j" && t[i + 1] == "MASQUERADE") masq = true;
      if ((t[i] == "-s" || t[i] == "--source") && t[i - 1] != "!") {
        std::string s = t[i + 1];
        if (s.find('/') == std::string::npos) s += "/32";
        if (auto c = ParseCidr(s); c && CidrCovers(*c, subnet)) src = true;
      }
    }
    if (masq && src) return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// libvirt.

void SilentVirError(void* /*user*/, virErrorPtr /*err*/) {}

Check LibvirtCheck(const std::string& uri) {
  if (uri.empty()) {
    return MakeCheck("libvirt", v1::CHECK_STATUS_WARN, "libvirt check skipped (no URI given)",
                     "run discovery with --libvirt-uri qemu:///system on the host");
  }
  static std::once_flag once;
  std::call_once(once, [] {
    virInitialize();
    // libvirt prints every error to stderr by default; errors are reported in the check.
    virSetErrorFunc(nullptr, SilentVirError);
  });
  virConnectPtr conn = virConnectOpenReadOnly(uri.c_str());
  if (conn == nullptr) {
    const char* msg = virGetLastErrorMessage();
    return MakeCheck("libvirt", v1::CHECK_STATUS_FAIL,
                     "cannot connect to " + uri + ": " + (msg ? msg : "unknown error"),
                     "install libvirt-daemon-system and run: systemctl enable --now libvirtd "
                     "(or virtqemud.socket)",
                     true);
  }
  const char* type = virConnectGetType(conn);
  std::string detail = "connected read-only to " + uri + " (" + (type ? type : "?") + ")";
  virConnectClose(conn);
  return MakeCheck("libvirt", v1::CHECK_STATUS_PASS, detail);
}

// ---------------------------------------------------------------------------------------------
// Candidate pairing.

struct Loc {
  std::optional<int32_t> numa;
  std::string sw;
};

// 0: same PCIe switch, 1: same NUMA node, 2: anywhere.
int Tier(const Loc& a, const Loc& b) {
  if (!a.sw.empty() && a.sw == b.sw) return 0;
  if (a.numa && b.numa && *a.numa == *b.numa) return 1;
  return 2;
}

// Gives each slot at most one candidate, each candidate used once. Closest matches are handed
// out first across all slots (so a slot never takes a far disk another slot needed nearby);
// `pref` orders equally close candidates (smaller first) and may change as candidates are
// picked (`picked` is told).
std::vector<int> TieredAssign(const std::vector<Loc>& slots, const std::vector<Loc>& cands,
                              const std::function<std::pair<int, std::string>(size_t)>& pref,
                              const std::function<void(size_t)>& picked) {
  std::vector<int> out(slots.size(), -1);
  std::vector<bool> used(cands.size(), false);
  for (int tier = 0; tier <= 2; ++tier) {
    for (size_t s = 0; s < slots.size(); ++s) {
      if (out[s] >= 0) continue;
      int best = -1;
      std::pair<int, std::string> best_key;
      for (size_t c = 0; c < cands.size(); ++c) {
        if (used[c] || Tier(slots[s], cands[c]) > tier) continue;
        auto key = pref(c);
        if (best < 0 || key < best_key) {
          best = static_cast<int>(c);
          best_key = key;
        }
      }
      if (best >= 0) {
        out[s] = best;
        used[static_cast<size_t>(best)] = true;
        picked(static_cast<size_t>(best));
      }
    }
  }
  return out;
}

std::optional<int32_t> NumaOf(bool has, int32_t v) {
  return has ? std::optional<int32_t>(v) : std::nullopt;
}

std::string NumaLabel(const std::optional<int32_t>& n) {
  return n ? std::to_string(*n) : std::string("?");
}

}  // namespace

// ---------------------------------------------------------------------------------------------

v1::RuntimeProfile DefaultRuntimeProfile() {
  v1::RuntimeProfile p;
  p.set_name("h200_24c_64g");
  p.set_vcpus_per_gpu(24);
  p.set_memory_mib_per_gpu(65536);
  p.set_hugepages_1g_per_gpu(0);
  return p;
}

std::optional<Ipv4Cidr> ParseCidr(const std::string& s) {
  size_t slash = s.find('/');
  if (slash == std::string::npos) return std::nullopt;
  auto prefix = ParseInt(s.substr(slash + 1));
  if (!prefix || *prefix < 0 || *prefix > 32) return std::nullopt;
  std::string ip = s.substr(0, slash);
  uint32_t addr = 0;
  int parts = 0;
  size_t i = 0;
  while (i <= ip.size() && parts < 4) {
    size_t j = ip.find('.', i);
    if (j == std::string::npos) j = ip.size();
    std::string part = ip.substr(i, j - i);
    if (part.empty() || part.size() > 3 ||
        !std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return std::nullopt;
    }
    auto v = ParseInt(part);
    if (!v || *v > 255) return std::nullopt;
    addr = (addr << 8) | static_cast<uint32_t>(*v);
    ++parts;
    i = j + 1;
  }
  if (parts != 4 || i != ip.size() + 1) return std::nullopt;
  return Ipv4Cidr{addr, static_cast<int>(*prefix)};
}

std::string FormatIpv4(uint32_t a) {
  return std::to_string(a >> 24) + "." + std::to_string((a >> 16) & 0xff) + "." +
         std::to_string((a >> 8) & 0xff) + "." + std::to_string(a & 0xff);
}

std::string DetectFsType(const std::string& head) {
  if (At(head, 0, "XFSB")) return "xfs";
  for (size_t sector = 0; sector < 4; ++sector) {
    if (At(head, sector * 512, "LABELONE")) return "LVM2_member";
  }
  if (head.size() >= 1082 && static_cast<unsigned char>(head[1080]) == 0x53 &&
      static_cast<unsigned char>(head[1081]) == 0xEF) {
    uint32_t compat = Le32(head, 1024 + 0x5C);
    uint32_t incompat = Le32(head, 1024 + 0x60);
    if (incompat & (0x40u | 0x80u | 0x200u)) return "ext4";  // extents, 64bit, flex_bg
    if (compat & 0x4u) return "ext3";                        // has_journal
    return "ext2";
  }
  if (At(head, 4086, "SWAPSPACE2") || At(head, 4086, "SWAP-SPACE")) return "swap";
  if (BootSignature(head) &&
      (At(head, 82, "FAT32   ") || At(head, 54, "FAT16   ") || At(head, 54, "FAT12   "))) {
    return "vfat";
  }
  return "";
}

std::string DetectPartitionTable(const std::string& head) {
  if (At(head, 512, "EFI PART")) return "gpt";
  if (!BootSignature(head) || DetectFsType(head) == "vfat") return "";
  for (size_t e = 0; e < 4; ++e) {
    if (head[446 + e * 16 + 4] != 0) return "dos";  // partition type byte
  }
  return "";
}

std::string SuggestedMac(const std::string& node_id, int index) {
  uint64_t h = 14695981039346656037ull;
  std::string key = node_id + "/" + std::to_string(index);
  for (unsigned char c : key) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char buf[32];
  std::snprintf(buf, sizeof(buf), "52:54:00:%02x:%02x:%02x",
                static_cast<unsigned>((h >> 16) & 0xff), static_cast<unsigned>((h >> 8) & 0xff),
                static_cast<unsigned>(h & 0xff));
  return buf;
}

Reason BlockerName(const std::string& check_name) {
  // Every check discovery makes; only those passing `blocker` to MakeCheck become blockers.
  static const std::map<std::string, Reason> kNames = {
      {"bridge", reason::kBridgeMissing},
      {"gateway", reason::kGatewayMissing},
      {"ip_forward", reason::kIpForwardDisabled},
      {"nat_masquerade", reason::kNatMasqueradeMissing},
      {"kvm", reason::kKvmMissing},
      {"iommu_groups", reason::kIommuUnavailable},
      {"vfio_modules", reason::kVfioModulesMissing},
      {"libvirt", reason::kLibvirtUnavailable},
      {"ovmf", reason::kOvmfMissing},
      {"hugepages", reason::kHugepagesInsufficient},
      {"kvm_access", reason::kKvmAccessFailed},
      {"gpus", reason::kGpusFailed},
      {"iommu_cmdline", reason::kIommuCmdlineFailed},
      {"sriov", reason::kSriovFailed},
      {"reboot_required", reason::kRebootRequiredFailed},
      {"default_route", reason::kDefaultRouteFailed},
      {"tmfifo", reason::kTmfifoFailed},
      {"ovs_offload", reason::kOvsOffloadFailed},
  };
  auto it = kNames.find(check_name);
  return it == kNames.end() ? reason::kCheckFailed : it->second;
}

// ---------------------------------------------------------------------------------------------
// Devices.

std::vector<v1::GpuDevice> DiscoverGpus(const HostRoot& host) {
  std::vector<v1::GpuDevice> out;
  for (const auto& name : host.ListDir("/sys/bus/pci/devices")) {
    auto dev = host.Resolve("/sys/bus/pci/devices/" + name);
    if (!dev) continue;  // symlink loop: not a device
    auto vendor = host.ReadLine(*dev + "/vendor");
    auto cls = host.ReadLine(*dev + "/class");
    if (!vendor || !cls || Lower(*vendor) != "0x10de") continue;
    std::string c = Lower(*cls);
    if (!StartsWith(c, "0x0300") && !StartsWith(c, "0x0302")) continue;
    PciLocation loc = LocatePci(*dev);
    v1::GpuDevice g;
    g.set_pci_address(loc.address.empty() ? name : loc.address);
    g.set_vendor_id(Lower(*vendor));
    g.set_device_id(Lower(host.ReadLine(*dev + "/device").value_or("")));
    g.set_class_code(c);
    g.set_model(GpuModel(g.device_id()));
    if (auto n = ReadNuma(host, *dev)) g.set_numa_node(*n);
    g.set_iommu_group(host.LinkBasename(*dev + "/iommu_group").value_or(""));
    g.set_driver(host.LinkBasename(*dev + "/driver").value_or(""));
    g.set_local_cpulist(host.ReadLine(*dev + "/local_cpulist").value_or(""));
    for (const auto& p : loc.path) g.add_pcie_path(p);
    g.set_pcie_root_port(loc.root_port);
    g.set_pcie_switch(loc.pcie_switch);
    out.push_back(std::move(g));
  }
  std::sort(out.begin(), out.end(),
            [](const auto& a, const auto& b) { return a.pci_address() < b.pci_address(); });
  return out;
}

namespace {

// The PCI location of an NVMe namespace's controller.
PciLocation NvmePci(const HostRoot& host, const std::string& kname) {
  const std::string base = "/sys/class/block/" + kname;
  // namespace -> controller (device) -> PCI function (device)
  if (auto r = host.Resolve(base + "/device/device")) {
    if (LooksLikePciAddress(Basename(*r))) return LocatePci(*r);
  }
  if (auto r = host.Resolve(base)) return LocatePci(*r);
  return {};
}

}  // namespace

std::vector<v1::NvmeDevice> DiscoverNvme(const HostRoot& host) {
  std::vector<v1::NvmeDevice> out;
  auto mounts = ReadMountsByDevice(host);
  auto by_id = ByIdLinks(host);
  auto mounts_of = [&](const std::string& k) {
    auto it = mounts.find(k);
    return it == mounts.end() ? std::vector<std::string>{} : it->second;
  };
  for (const auto& kname : host.ListDir("/sys/class/block")) {
    if (!IsNvmeNamespace(kname)) continue;
    const std::string base = "/sys/class/block/" + kname;
    v1::NvmeDevice d;
    d.set_kernel_name(kname);
    if (auto it = by_id.find(kname); it != by_id.end()) d.set_by_id_path(it->second);
    PciLocation loc = NvmePci(host, kname);
    d.set_pci_address(loc.address);
    auto numa = ReadNuma(host, loc.dev_dir);
    if (!numa) numa = ReadNuma(host, base + "/device");
    if (numa) d.set_numa_node(*numa);
    if (auto sectors = host.ReadInt(base + "/size"); sectors && *sectors > 0) {
      d.set_size_bytes(static_cast<uint64_t>(*sectors) * 512u);
    }
    d.set_model(host.ReadLine(base + "/device/model").value_or(""));
    d.set_serial(host.ReadLine(base + "/device/serial").value_or(""));
    bool os = false;
    for (const auto& m : mounts_of(kname)) {
      d.add_mountpoints(m);
      os = os || IsOsMount(m);
    }
    if (auto head = host.ReadPrefix("/dev/" + kname, kSignatureBytes)) {
      d.set_fs_type(DetectFsType(*head));
      d.set_partition_table(DetectPartitionTable(*head));
    }
    for (const auto& child : host.ListDir(base)) {
      if (!StartsWith(child, kname) || child == kname) continue;
      if (!host.Exists(fmt::format("{}/{}/partition", base, child))) continue;
      auto* p = d.add_partitions();
      p->set_kernel_name(child);
      for (const auto& m : mounts_of(child)) {
        p->add_mountpoints(m);
        os = os || IsOsMount(m);
      }
      if (auto head = host.ReadPrefix("/dev/" + child, kSignatureBytes)) {
        p->set_fs_type(DetectFsType(*head));
      }
    }
    d.set_os_disk(os);
    out.push_back(std::move(d));
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(a.by_id_path().empty(), a.by_id_path(), a.kernel_name()) <
           std::make_tuple(b.by_id_path().empty(), b.by_id_path(), b.kernel_name());
  });
  return out;
}

std::vector<v1::FabricDevice> DiscoverFabric(const HostRoot& host) {
  std::map<std::string, v1::FabricDevice> by_key;  // PCI address (or "~name") -> device
  auto fill_sriov = [&](const std::string& dev_dir, v1::FabricDevice* f) {
    if (host.IsSymlink(dev_dir + "/physfn")) {
      f->set_is_vf(true);
      f->set_pf_pci_address(host.LinkBasename(dev_dir + "/physfn").value_or(""));
      return;
    }
    auto total = host.ReadInt(dev_dir + "/sriov_totalvfs");
    if (!total) return;
    f->set_sriov_totalvfs(static_cast<int32_t>(*total));
    f->set_sriov_numvfs(static_cast<int32_t>(host.ReadInt(dev_dir + "/sriov_numvfs").value_or(0)));
    std::vector<std::pair<long long, std::string>> vfs;
    for (const auto& e : host.ListDir(dev_dir)) {
      if (!StartsWith(e, "virtfn")) continue;
      auto n = ParseInt(e.substr(6));
      auto addr = host.LinkBasename(fmt::format("{}/{}", dev_dir, e));
      if (n && addr && LooksLikePciAddress(*addr)) vfs.emplace_back(*n, *addr);
    }
    std::sort(vfs.begin(), vfs.end());
    for (const auto& [n, a] : vfs) f->add_vf_pci_addresses(a);
  };

  for (const auto& name : host.ListDir("/sys/class/infiniband")) {
    auto base = host.Resolve("/sys/class/infiniband/" + name);
    if (!base) continue;
    v1::FabricDevice f;
    f.set_name(name);
    std::string dev_dir;
    if (auto dev = host.Resolve(*base + "/device"); dev && LooksLikePciAddress(Basename(*dev))) {
      PciLocation loc = LocatePci(*dev);
      f.set_pci_address(loc.address);
      f.set_pcie_switch(loc.pcie_switch);
      dev_dir = loc.dev_dir;
      if (auto n = ReadNuma(host, dev_dir)) f.set_numa_node(*n);
    }
    std::vector<std::pair<long long, std::string>> ports;
    for (const auto& p : host.ListDir(*base + "/ports")) {
      if (auto n = ParseInt(p)) ports.emplace_back(*n, p);
    }
    std::sort(ports.begin(), ports.end());
    for (const auto& [n, p] : ports) {
      const std::string pd = *base + "/ports/" + p;
      auto* port = f.add_ports();
      port->set_port(static_cast<int32_t>(n));
      port->set_link_layer(host.ReadLine(pd + "/link_layer").value_or(""));
      std::string state = host.ReadLine(pd + "/state").value_or("");
      if (auto colon = state.find(": "); colon != std::string::npos) {
        state = state.substr(colon + 2);
      }
      port->set_state(state);
      port->set_rate(host.ReadLine(pd + "/rate").value_or(""));
    }
    if (f.ports_size() > 0) {
      std::string ll = Lower(f.ports(0).link_layer());
      if (ll == "infiniband") f.set_fabric_type(v1::FABRIC_TYPE_INFINIBAND);
      if (ll == "ethernet") f.set_fabric_type(v1::FABRIC_TYPE_ROCE);
    }
    if (!dev_dir.empty()) fill_sriov(dev_dir, &f);
    std::string key = f.pci_address().empty() ? "~" + name : f.pci_address();
    by_key.emplace(key, std::move(f));
  }

  // VFs a PF lists but that have no RDMA device of their own (driver not bound yet, or bound
  // to vfio-pci already): they are still passthrough candidates.
  std::vector<v1::FabricDevice> extra;
  for (const auto& [key, f] : by_key) {
    if (f.is_vf()) continue;
    for (const auto& vf : f.vf_pci_addresses()) {
      if (by_key.count(vf)) continue;
      v1::FabricDevice v;
      v.set_pci_address(vf);
      v.set_is_vf(true);
      v.set_pf_pci_address(f.pci_address());
      v.set_fabric_type(f.fabric_type());
      if (auto dev = host.Resolve("/sys/bus/pci/devices/" + vf)) {
        PciLocation loc = LocatePci(*dev);
        v.set_pcie_switch(loc.pcie_switch);
        if (auto n = ReadNuma(host, loc.dev_dir)) v.set_numa_node(*n);
      }
      extra.push_back(std::move(v));
    }
  }
  for (auto& v : extra) by_key.emplace(v.pci_address(), std::move(v));
  // A VF's fabric type is its PF's when it has no port of its own to tell.
  for (auto& [key, f] : by_key) {
    if (!f.is_vf() || f.fabric_type() != v1::FABRIC_TYPE_UNSPECIFIED) continue;
    if (auto it = by_key.find(f.pf_pci_address()); it != by_key.end()) {
      f.set_fabric_type(it->second.fabric_type());
    }
  }
  std::vector<v1::FabricDevice> out;
  out.reserve(by_key.size());
  for (auto& [key, f] : by_key) out.push_back(std::move(f));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Prerequisites.

namespace {

// The last uncommented `key = "value"` of the root's qemu.conf (libvirt reads the file top to
// bottom, so a later line wins); nullopt when unset.
std::optional<std::string> QemuConfValue(const HostRoot& host, std::string_view key) {
  std::optional<std::string> out;
  for (const auto& raw : SplitLines(host.ReadFile("/etc/libvirt/qemu.conf").value_or(""))) {
    std::string line = Trim(raw);
    if (!StartsWith(line, key)) continue;
    std::string_view rest = std::string_view(line).substr(key.size());
    while (!rest.empty() && (rest.front() == ' ' || rest.front() == '\t')) rest.remove_prefix(1);
    if (rest.empty() || rest.front() != '=') continue;  // "group_foo = ..." is another key
    size_t open = rest.find('"');
    size_t close = open == std::string_view::npos ? open : rest.find('"', open + 1);
    if (close == std::string_view::npos) continue;
    out = std::string(rest.substr(open + 1, close - open - 1));
  }
  return out;
}

// Name and id columns of the root's /etc/passwd or /etc/group ("name:x:id:...").
std::vector<std::pair<std::string, long long>> IdTable(const HostRoot& host,
                                                       std::string_view file) {
  std::vector<std::pair<std::string, long long>> out;
  for (const auto& line : SplitLines(host.ReadFile(file).value_or(""))) {
    size_t a = line.find(':');
    size_t b = a == std::string::npos ? a : line.find(':', a + 1);
    size_t c = b == std::string::npos ? b : line.find(':', b + 1);
    if (c == std::string::npos) continue;
    if (auto id = ParseInt(std::string_view(line).substr(b + 1, c - b - 1))) {
      out.emplace_back(line.substr(0, a), *id);
    }
  }
  return out;
}

std::string NameOf(const std::vector<std::pair<std::string, long long>>& table, unsigned id) {
  for (const auto& [name, i] : table) {
    if (i == id) return name;
  }
  return std::to_string(id);
}

// libvirt's "+N" is the numeric id N; anything else is a name looked up in the root's
// /etc/group.
std::optional<long long> GroupId(const std::vector<std::pair<std::string, long long>>& groups,
                                 const std::string& group) {
  if (StartsWith(group, "+")) return ParseInt(std::string_view(group).substr(1));
  for (const auto& [name, id] : groups) {
    if (name == group) return id;
  }
  return std::nullopt;
}

// Whether libvirt's qemu can open /dev/kvm. It runs as qemu.conf's user and group (Debian's
// build defaults: libvirt-qemu, kvm); when it cannot, libvirt 9.0 finds no usable KVM in its
// capability cache and re-probes qemu on every API call, which is slow but works, so a WARN.
std::optional<Check> KvmAccessCheck(const HostRoot& host) {
  auto st = host.Stat("/dev/kvm");
  if (!st) return std::nullopt;  // the kvm check already FAILs
  const std::string group = QemuConfValue(host, "group").value_or("kvm");
  const std::string user = QemuConfValue(host, "user").value_or("libvirt-qemu");
  const auto groups = IdTable(host, "/etc/group");
  const std::string owned =
      fmt::format("{}:{} {:04o}", NameOf(IdTable(host, "/etc/passwd"), st->uid),
                  NameOf(groups, st->gid), st->mode);
  const std::string desc = "/dev/kvm " + owned;
  if (user == "root" || user == "+0") {
    return MakeCheck("kvm_access", v1::CHECK_STATUS_PASS, desc + " (qemu runs as root)");
  }
  auto gid = GroupId(groups, group);
  const bool others_rw = (st->mode & 006u) == 006u;
  const bool group_rw = gid && *gid == st->gid && (st->mode & 060u) == 060u;
  if (others_rw || group_rw) return MakeCheck("kvm_access", v1::CHECK_STATUS_PASS, desc);
  std::string detail = "/dev/kvm is " + owned + ": libvirt's qemu (group " + group +
                       ") cannot open it, and libvirt re-probes qemu on every call (about 90 s "
                       "per define)";
  if (!gid) detail += "; group " + group + " is not in /etc/group";
  return MakeCheck("kvm_access", v1::CHECK_STATUS_WARN, detail,
                   fmt::format("run scripts/host-bootstrap (or: chgrp {} /dev/kvm && chmod 0660 "
                               "/dev/kvm, and a udev rule)",
                               group));
}

Check GpusCheck(const std::vector<v1::GpuDevice>& gpus) {
  if (gpus.empty()) {
    return MakeCheck("gpus", v1::CHECK_STATUS_WARN, "no NVIDIA display/3D PCI devices found",
                     "check that the GPUs are visible in lspci -d 10de: and that this is "
                     "a GPU host");
  }
  std::map<std::string, int> models;
  for (const auto& g : gpus) models[g.model().empty() ? g.device_id() : g.model()]++;
  std::vector<std::string> parts;
  parts.reserve(models.size());
  for (const auto& [m, n] : models) parts.push_back(std::to_string(n) + "x " + m);
  return MakeCheck("gpus", v1::CHECK_STATUS_PASS,
                   std::to_string(gpus.size()) + " GPUs: " + Join(parts, ", "));
}

Check KvmCheck(const HostRoot& host) {
  if (host.Exists("/dev/kvm")) {
    return MakeCheck("kvm", v1::CHECK_STATUS_PASS, "/dev/kvm present");
  }
  return MakeCheck("kvm", v1::CHECK_STATUS_FAIL, "/dev/kvm missing",
                   "enable VT-x/VMX (AMD-V/SVM) in firmware and load kvm_intel/kvm_amd", true);
}

// `groups`: the number of IOMMU groups in /sys/kernel/iommu_groups.
Check IommuGroupsCheck(const std::vector<v1::GpuDevice>& gpus, size_t groups) {
  std::vector<std::string> no_group;
  for (const auto& g : gpus) {
    if (g.iommu_group().empty()) no_group.push_back(g.pci_address());
  }
  if (groups == 0) {
    return MakeCheck("iommu_groups", v1::CHECK_STATUS_FAIL,
                     "no IOMMU groups in /sys/kernel/iommu_groups",
                     "enable VT-d/AMD-Vi in firmware and boot with intel_iommu=on iommu=pt", true);
  }
  if (!no_group.empty()) {
    return MakeCheck(
        "iommu_groups", v1::CHECK_STATUS_FAIL,
        std::to_string(groups) + " IOMMU groups, but GPUs without a group: " + Join(no_group, ","),
        "check firmware VT-d/ACS settings so every GPU gets an IOMMU group", true);
  }
  return MakeCheck("iommu_groups", v1::CHECK_STATUS_PASS,
                   std::to_string(groups) + " IOMMU groups, every GPU in one");
}

// Without the kernel arguments but with IOMMU groups anyway, only a warning.
Check IommuCmdlineCheck(const HostRoot& host, size_t groups) {
  std::vector<std::string> iommu_args;
  for (const auto& tok : SplitWs(host.ReadFile("/proc/cmdline").value_or(""))) {
    if (tok == "intel_iommu=on" || tok == "amd_iommu=on" || tok == "iommu=pt") {
      iommu_args.push_back(tok);
    }
  }
  if (!iommu_args.empty()) {
    return MakeCheck("iommu_cmdline", v1::CHECK_STATUS_PASS,
                     "kernel cmdline has " + Join(iommu_args, " "));
  }
  return MakeCheck("iommu_cmdline", groups > 0 ? v1::CHECK_STATUS_WARN : v1::CHECK_STATUS_FAIL,
                   groups > 0 ? "no intel_iommu=on/amd_iommu=on/iommu=pt on the kernel cmdline "
                                "(IOMMU groups exist anyway)"
                              : "no intel_iommu=on/amd_iommu=on/iommu=pt on the kernel cmdline",
                   "add intel_iommu=on iommu=pt (AMD: iommu=pt) to GRUB_CMDLINE_LINUX, "
                   "update-grub, reboot");
}

Check VfioModulesCheck(const HostRoot& host) {
  if (host.Exists("/sys/module/vfio_pci") || host.Exists("/sys/module/vfio-pci")) {
    return MakeCheck("vfio_modules", v1::CHECK_STATUS_PASS, "vfio_pci loaded");
  }
  return MakeCheck("vfio_modules", v1::CHECK_STATUS_FAIL, "vfio_pci module not loaded",
                   "modprobe vfio-pci; printf 'vfio\\nvfio_iommu_type1\\nvfio_pci\\n' > "
                   "/etc/modules-load.d/gpuaas-vfio.conf",
                   true);
}

// Every GPU wants its own fabric VF: enough VFs in all is a warning when some PF has fewer
// VFs than GPUs, too few in all a failure.
Check SriovCheck(const HostRoot& host, const std::vector<v1::GpuDevice>& gpus) {
  auto fabric = DiscoverFabric(host);
  std::vector<const v1::FabricDevice*> pfs;
  int vfs = 0;
  for (const auto& f : fabric) {
    if (f.is_vf()) {
      ++vfs;
    } else if (!f.pci_address().empty()) {
      pfs.push_back(&f);
    }
  }
  const int need = static_cast<int>(gpus.size());
  std::vector<std::string> short_pfs;
  for (const auto* pf : pfs) {
    if (pf->sriov_numvfs() < need) {
      short_pfs.push_back(pf->pci_address() + "(" + (pf->name().empty() ? "?" : pf->name()) +
                          ") numvfs=" + std::to_string(pf->sriov_numvfs()) +
                          " totalvfs=" + std::to_string(pf->sriov_totalvfs()));
    }
  }
  const std::string fix =
      "enable SR-IOV in firmware (mlxconfig SRIOV_EN=1 NUM_OF_VFS=N) and create VFs: echo N > "
      "/sys/bus/pci/devices/<pf>/sriov_numvfs";
  if (pfs.empty()) {
    return MakeCheck("sriov", v1::CHECK_STATUS_WARN,
                     "no fabric (InfiniBand/RoCE) physical function found",
                     "check /sys/class/infiniband; slots get fabric_claim_mode none");
  }
  if (need == 0 || short_pfs.empty()) {
    return MakeCheck("sriov", v1::CHECK_STATUS_PASS,
                     std::to_string(pfs.size()) + " fabric PFs, " + std::to_string(vfs) +
                         " VFs, every PF has >= " + std::to_string(need) + " VFs");
  }
  if (vfs >= need) {
    return MakeCheck("sriov", v1::CHECK_STATUS_WARN,
                     std::to_string(vfs) + " VFs cover " + std::to_string(need) +
                         " GPUs, but PFs with fewer VFs than GPUs: " + Join(short_pfs, "; "),
                     fix);
  }
  return MakeCheck("sriov", v1::CHECK_STATUS_FAIL,
                   "only " + std::to_string(vfs) + " fabric VFs for " + std::to_string(need) +
                       " GPUs: " + Join(short_pfs, "; "),
                   fix);
}

Check OvmfCheck(const HostRoot& host) {
  static const std::array<const char*, 7> kOvmf = {
      "/usr/share/OVMF/OVMF_CODE_4M.fd",
      "/usr/share/OVMF/OVMF_CODE.fd",
      "/usr/share/qemu/OVMF.fd",
      "/usr/share/ovmf/OVMF.fd",
      "/usr/share/edk2/ovmf/OVMF_CODE.fd",
      "/usr/share/edk2-ovmf/x64/OVMF_CODE.fd",
      "/usr/share/OVMF/OVMF_CODE_4M.secboot.fd",
  };
  for (const char* p : kOvmf) {
    if (host.Exists(p) && !host.IsDir(p)) return MakeCheck("ovmf", v1::CHECK_STATUS_PASS, p);
  }
  return MakeCheck("ovmf", v1::CHECK_STATUS_FAIL, "no OVMF (UEFI) firmware image found",
                   "apt-get install ovmf", true);
}

// The profile's 1G hugepages for every GPU, free now.
Check HugepagesCheck(const HostRoot& host, const DiscoveryOptions& opts,
                     const std::vector<v1::GpuDevice>& gpus) {
  const long long need = static_cast<long long>(opts.profile.hugepages_1g_per_gpu()) *
                         static_cast<long long>(gpus.size());
  auto free_pages = host.ReadInt("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages");
  std::string have = free_pages ? std::to_string(*free_pages) : "unknown";
  if (need <= 0) {
    return MakeCheck(
        "hugepages", v1::CHECK_STATUS_PASS,
        "profile " + opts.profile.name() + " needs no 1G hugepages (free " + have + ")");
  }
  if (free_pages && *free_pages >= need) {
    return MakeCheck(
        "hugepages", v1::CHECK_STATUS_PASS,
        std::to_string(*free_pages) + " free 1G hugepages, profile needs " + std::to_string(need));
  }
  return MakeCheck(
      "hugepages", v1::CHECK_STATUS_FAIL,
      "profile " + opts.profile.name() + " needs " + std::to_string(need) +
          " free 1G hugepages, host has " + have,
      "boot with default_hugepagesz=1G hugepagesz=1G hugepages=" + std::to_string(need) +
          " (or write nr_hugepages under /sys/kernel/mm/hugepages/hugepages-1048576kB)",
      true);
}

Check RebootRequiredCheck(const HostRoot& host, bool* reboot_required) {
  bool reboot = host.Exists("/var/run/reboot-required");
  if (reboot_required != nullptr) *reboot_required = reboot;
  if (!reboot) return MakeCheck("reboot_required", v1::CHECK_STATUS_PASS, "no reboot pending");
  std::string pkgs;
  if (auto p = host.ReadFile("/var/run/reboot-required.pkgs")) {
    auto lines = SplitWs(*p);
    pkgs = lines.empty() ? "" : " (" + Join(lines, ",") + ")";
  }
  return MakeCheck("reboot_required", v1::CHECK_STATUS_WARN,
                   "/var/run/reboot-required exists" + pkgs,
                   "drain the node and reboot it, then re-run discovery");
}

}  // namespace

std::vector<Check> PrereqChecks(const HostRoot& host, const DiscoveryOptions& opts,
                                const std::vector<v1::GpuDevice>& gpus, bool* reboot_required) {
  std::vector<Check> out;
  out.push_back(GpusCheck(gpus));
  out.push_back(KvmCheck(host));
  if (auto c = KvmAccessCheck(host)) out.push_back(std::move(*c));
  const size_t iommu_groups = host.ListDir("/sys/kernel/iommu_groups").size();
  out.push_back(IommuGroupsCheck(gpus, iommu_groups));
  out.push_back(IommuCmdlineCheck(host, iommu_groups));
  out.push_back(VfioModulesCheck(host));
  out.push_back(SriovCheck(host, gpus));
  out.push_back(LibvirtCheck(opts.libvirt_uri));
  out.push_back(OvmfCheck(host));
  out.push_back(HugepagesCheck(host, opts, gpus));
  out.push_back(RebootRequiredCheck(host, reboot_required));
  return out;
}

// ---------------------------------------------------------------------------------------------
// Open vSwitch evidence, read-only through ovs-vsctl.

namespace {

// ovs-vsctl gives up on an unreachable database after kOvsTimeoutS; RunTool's limit is the
// backstop should it hang anyway. Discovery runs on the agent's report path: never wait long.
constexpr int kOvsTimeoutS = 2;
constexpr auto kOvsToolTimeout = std::chrono::seconds(4);

// Why an ovs-vsctl run did not answer, for a note.
std::string ToolFailure(const Result<ToolResult>& r) {
  if (!r.ok()) return r.error().message;
  if (r->timed_out) return "timed out";
  std::string err = Trim(r->err);
  return "exited " + std::to_string(r->exit_code) + (err.empty() ? "" : ": " + err);
}

// ovs-vsctl quotes a string value that would read as another type ("true", "", "1").
std::string Unquote(std::string s) {
  s = Trim(s);
  if (s.size() >= 2 && s.front() == '"' && s.back() == '"') s = s.substr(1, s.size() - 2);
  return s;
}

struct OvsCtl {
  std::string tool;
  std::string db;  // "" = ovs-vsctl's default socket
  Result<ToolResult> Run(const std::vector<std::string>& args) const {
    std::vector<std::string> argv{tool};
    if (!db.empty()) argv.push_back("--db=" + db);
    argv.push_back("--timeout=" + std::to_string(kOvsTimeoutS));
    argv.insert(argv.end(), args.begin(), args.end());
    return RunTool(argv, kOvsToolTimeout);
  }
  std::string Text(const std::vector<std::string>& args) const {
    std::string out = "ovs-vsctl";
    for (const auto& a : args) out += " " + a;
    return out;
  }
};

// Fills the OVS fields of `b` when `ovs-vsctl br-exists` says the bridge is OVS; returns whether
// it is. Every failure is a note (under "bridge", or "ovs_offload" for the offload query).
bool ProbeOvs(const HostRoot& host, const DiscoveryOptions& opts, NetworkProbe& probe) {
  v1::NetworkBaseline& b = probe.baseline;
  auto tool = host.FindCommand("ovs-vsctl");
  if (!tool) {
    probe.notes["bridge"] = "ovs-vsctl not found";
    return false;
  }
  // --version never touches the database.
  if (auto v = RunTool({*tool, "--version"}, kOvsToolTimeout); v.ok() && v->exit_code == 0) {
    auto lines = SplitLines(v->out);
    auto words = lines.empty() ? std::vector<std::string>{} : SplitWs(lines.front());
    if (!words.empty()) b.set_ovs_version(words.back());
  }
  const OvsCtl ctl{*tool, opts.ovs_db};
  auto exists = ctl.Run({"br-exists", opts.bridge});
  // br-exists: 0 = an OVS bridge, 2 = no such bridge, anything else = OVS could not tell.
  if (exists.ok() && !exists->timed_out && exists->exit_code == 2) return false;
  if (!exists.ok() || exists->timed_out || exists->exit_code != 0) {
    probe.notes["bridge"] =
        ctl.Text({"br-exists", opts.bridge}) + " failed: " + ToolFailure(exists);
    return false;
  }
  std::vector<std::string> problems;

  const std::vector<std::string> dp_args{"get", "bridge", opts.bridge, "datapath_type"};
  auto dp = ctl.Run(dp_args);
  if (dp.ok() && !dp->timed_out && dp->exit_code == 0) {
    std::string t = Unquote(dp->out);
    b.set_ovs_datapath_type(t.empty() ? "system" : t);  // OVS reads "" as the kernel datapath
  } else {
    problems.push_back(ctl.Text(dp_args) + " failed: " + ToolFailure(dp));
  }

  const std::vector<std::string> if_args{"list-ifaces", opts.bridge};
  auto ifaces = ctl.Run(if_args);
  const std::vector<std::string> table_args{
      "--format=json",
      "--columns=name,ofport,type,external_ids,ingress_policing_rate,ingress_policing_burst",
      "list", "Interface"};
  if (!ifaces.ok() || ifaces->timed_out || ifaces->exit_code != 0) {
    problems.push_back(ctl.Text(if_args) + " failed: " + ToolFailure(ifaces));
  } else if (auto names = SplitWs(ifaces->out); !names.empty()) {
    auto table = ctl.Run(table_args);
    if (!table.ok() || table->timed_out || table->exit_code != 0) {
      problems.push_back(ctl.Text(table_args) + " failed: " + ToolFailure(table));
    } else if (auto parsed = ParseOvsInterfaces(table->out); !parsed.ok()) {
      problems.push_back(parsed.error().message);
    } else {
      const std::set<std::string> wanted(names.begin(), names.end());
      std::set<std::string> seen;
      for (auto& p : *parsed) {
        if (wanted.count(p.name()) == 0) continue;
        seen.insert(p.name());
        *b.add_ovs_ports() = std::move(p);
      }
      // Listed on the bridge but without an Interface row: keep the name as evidence.
      for (const auto& n : wanted) {
        if (seen.count(n) == 0) b.add_ovs_ports()->set_name(n);
      }
      std::sort(b.mutable_ovs_ports()->begin(), b.mutable_ovs_ports()->end(),
                [](const auto& x, const auto& y) { return x.name() < y.name(); });
    }
  }
  if (!problems.empty()) probe.notes["bridge"] = Join(problems, "; ");

  const std::vector<std::string> off_args{"--if-exists", "get", "Open_vSwitch", ".",
                                          "other_config:hw-offload"};
  auto off = ctl.Run(off_args);
  if (off.ok() && !off->timed_out && off->exit_code == 0) {
    b.set_ovs_hw_offload(Lower(Unquote(off->out)) == "true");
  } else {
    probe.notes["ovs_offload"] = ctl.Text(off_args) + " failed: " + ToolFailure(off);
  }
  return true;
}

}  // namespace

Result<std::vector<v1::OvsPortInfo>> ParseOvsInterfaces(const std::string& json) {
  auto rows = ParseOvsTable(json, {"name"});
  if (!rows.ok()) return rows.error();
  std::vector<v1::OvsPortInfo> out;
  for (auto& row : *rows) {
    v1::OvsPortInfo p;
    p.set_name(OvsText(row["name"]));
    p.set_ofport(static_cast<int32_t>(OvsInt(row["ofport"])));
    p.set_type(OvsText(row["type"]));
    p.set_ingress_policing_rate_kbps(OvsInt(row["ingress_policing_rate"]));
    p.set_ingress_policing_burst_kb(OvsInt(row["ingress_policing_burst"]));
    p.set_attached_mac(OvsMapGet(row["external_ids"], "attached-mac"));
    p.set_slot(OvsMapGet(row["external_ids"], "gpuaas-slot"));
    if (!p.name().empty()) out.push_back(std::move(p));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Network baseline.

NetworkProbe ProbeNetwork(const HostRoot& host, const DiscoveryOptions& opts) {
  NetworkProbe probe;
  v1::NetworkBaseline& b = probe.baseline;
  b.set_mode(enums::FromColumn<v1::NetworkMode>(opts.network_mode));
  b.set_bridge(opts.bridge);
  b.set_gateway_cidr(opts.gateway_cidr);
  auto gw = ParseCidr(opts.gateway_cidr);
  std::optional<Ipv4Cidr> subnet;
  if (gw) {
    subnet = Ipv4Cidr{gw->Network(), gw->prefix};
    b.set_slice_subnet(FormatIpv4(subnet->addr) + "/" + std::to_string(subnet->prefix));
  } else {
    probe.notes["gateway"] = "gateway_cidr '" + opts.gateway_cidr + "' is not an IPv4 CIDR";
    probe.notes["nat_masquerade"] = probe.notes["gateway"];
  }

  // Present = the network device exists (what the gateway address and the VMs' vNICs need). The
  // kind says what owns it; an OVS bridge whose device is missing (ovs-vswitchd down) is "ovs"
  // yet not present.
  const std::string dev = "/sys/class/net/" + opts.bridge;
  const bool device = !opts.bridge.empty() && host.Exists(dev);
  b.set_bridge_present(device);
  const bool ovs = !opts.bridge.empty() && ProbeOvs(host, opts, probe);
  if (ovs) {
    b.set_bridge_kind("ovs");
  } else if (device) {
    b.set_bridge_kind(host.IsDir(dev + "/bridge") ? "linux-bridge" : "other");
  }
  b.set_ip_forward(host.ReadLine("/proc/sys/net/ipv4/ip_forward").value_or("") == "1");

  // Interface addresses: `ip -o -4 addr show` when the root has an ip tool, else /proc.
  std::vector<IfAddr> addrs;
  bool have_addrs = false;
  if (auto ip = host.FindTool({"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"})) {
    auto r = RunTool({*ip, "-o", "-4", "addr", "show"});
    if (r.ok() && r->exit_code == 0) {
      addrs = ParseIpAddr(r->out);
      have_addrs = true;
    } else {
      probe.notes["gateway"] =
          "ip -o -4 addr show failed: " +
          (r.ok() ? (r->timed_out ? "timed out" : Trim(r->err)) : r.error().message);
    }
  }
  if (!have_addrs) addrs = AddrsFromProc(host);
  std::vector<std::string> on_bridge;
  for (const auto& a : addrs) {
    if (a.iface == opts.bridge) {
      on_bridge.push_back(a.cidr);
      auto c = ParseCidr(a.cidr);
      if (gw && c && c->addr == gw->addr && c->prefix == gw->prefix) b.set_gateway_present(true);
    }
    if (a.iface == "tmfifo_net0" && b.tmfifo_address().empty()) b.set_tmfifo_address(a.cidr);
  }
  if (!b.gateway_present() && !on_bridge.empty()) {
    probe.notes["gateway"] = opts.bridge + " has " + Join(on_bridge, ",");
  }

  const Route* def = nullptr;
  auto routes = ReadRoutes(host);
  for (const auto& r : routes) {
    if (r.up && r.dest == 0 && r.mask == 0 && (def == nullptr || r.metric < def->metric)) def = &r;
  }
  if (def != nullptr) b.set_default_route_interface(def->iface);

  if (subnet) {
    auto ipt = host.FindTool(
        {"/usr/sbin/iptables", "/sbin/iptables", "/usr/bin/iptables", "/bin/iptables"});
    if (!ipt) {
      probe.notes["nat_masquerade"] = "iptables not found";
    } else {
      auto r = RunTool({*ipt, "-t", "nat", "-S", "POSTROUTING"});
      if (!r.ok()) {
        probe.notes["nat_masquerade"] = r.error().message;
      } else if (r->timed_out || r->exit_code != 0) {
        probe.notes["nat_masquerade"] =
            "iptables -t nat -S POSTROUTING " +
            (r->timed_out ? std::string("timed out")
                          : "exited " + std::to_string(r->exit_code) + ": " + Trim(r->err));
      } else {
        b.set_nat_masquerade(HasMasquerade(r->out, *subnet));
      }
    }
  }
  return probe;
}

v1::NetworkBaseline ReadNetworkBaseline(const HostRoot& host, const DiscoveryOptions& opts) {
  return ProbeNetwork(host, opts).baseline;
}

std::vector<Check> NetworkChecks(const v1::NetworkBaseline& b,
                                 const std::map<std::string, std::string>& notes) {
  std::vector<Check> out;
  const bool nat_mode = b.mode() == v1::NETWORK_MODE_PRIVATE_NAT;
  // Outside private-nat the baseline is evidence only: failures are warnings.
  const auto kBad = nat_mode ? v1::CHECK_STATUS_FAIL : v1::CHECK_STATUS_WARN;
  const auto kPass = v1::CHECK_STATUS_PASS;
  auto note = [&](const std::string& name) {
    auto it = notes.find(name);
    return it == notes.end() ? std::string() : " (" + it->second + ")";
  };
  std::string mode_note = nat_mode ? "" : " [mode " + enums::Text(b.mode()) + ": not a blocker]";

  const bool ovs = b.bridge_kind() == "ovs";
  if (b.bridge_present() && ovs) {
    out.push_back(MakeCheck("bridge", kPass,
                            b.bridge() + " present (ovs, datapath " + b.ovs_datapath_type() + ", " +
                                std::to_string(b.ovs_ports_size()) + " ports)" + note("bridge")));
  } else if (b.bridge_present()) {
    out.push_back(MakeCheck("bridge", kPass,
                            b.bridge() + " present (" + b.bridge_kind() + ")" + note("bridge")));
  } else if (ovs) {
    out.push_back(MakeCheck("bridge", kBad,
                            "bridge " + b.bridge() +
                                " missing: in Open vSwitch's database but no network device" +
                                note("bridge") + mode_note,
                            "start Open vSwitch (systemctl restart openvswitch-switch) so "
                            "ovs-vswitchd creates " +
                                b.bridge(),
                            true));
  } else {
    out.push_back(MakeCheck("bridge", kBad,
                            "bridge " + b.bridge() + " missing" + note("bridge") + mode_note,
                            "create it: ovs-vsctl --may-exist add-br " + b.bridge() +
                                " (gpuaas-slice-network-baseline service)",
                            true));
  }
  if (b.gateway_present()) {
    out.push_back(MakeCheck("gateway", kPass, b.gateway_cidr() + " on " + b.bridge()));
  } else {
    out.push_back(MakeCheck(
        "gateway", kBad, b.gateway_cidr() + " not on " + b.bridge() + note("gateway") + mode_note,
        "ip addr add " + b.gateway_cidr() + " dev " + b.bridge() + " && ip link set " + b.bridge() +
            " up",
        true));
  }
  if (b.ip_forward()) {
    out.push_back(MakeCheck("ip_forward", kPass, "net.ipv4.ip_forward=1"));
  } else {
    out.push_back(MakeCheck("ip_forward", kBad, "net.ipv4.ip_forward is not 1" + mode_note,
                            "sysctl -w net.ipv4.ip_forward=1 and persist it in "
                            "/etc/sysctl.d/60-gpuaas-slice.conf",
                            true));
  }
  const std::string subnet = b.slice_subnet().empty() ? "<slice subnet>" : b.slice_subnet();
  if (b.nat_masquerade()) {
    out.push_back(
        MakeCheck("nat_masquerade", kPass, "POSTROUTING -s " + subnet + " -j MASQUERADE present"));
  } else {
    out.push_back(
        MakeCheck("nat_masquerade", kBad,
                  "no MASQUERADE rule for " + subnet + " in nat POSTROUTING" +
                      note("nat_masquerade") + mode_note,
                  "iptables -t nat -A POSTROUTING -s " + subnet + " ! -d " + subnet +
                      " -j MASQUERADE (persist it with the gpuaas-slice-network-baseline service)",
                  true));
  }
  if (!b.default_route_interface().empty()) {
    out.push_back(
        MakeCheck("default_route", kPass, "default route via " + b.default_route_interface()));
  } else {
    out.push_back(
        MakeCheck("default_route", v1::CHECK_STATUS_WARN, "no IPv4 default route",
                  "configure the host uplink (netplan) so NATed slice traffic can leave"));
  }
  if (!b.tmfifo_address().empty()) {
    out.push_back(MakeCheck("tmfifo", kPass, "tmfifo_net0 has " + b.tmfifo_address()));
  } else {
    out.push_back(MakeCheck("tmfifo", v1::CHECK_STATUS_WARN,
                            "no IPv4 address on tmfifo_net0 (BlueField management evidence)",
                            "install rshim and give tmfifo_net0 192.168.100.1/30 if the host has a "
                            "BlueField DPU; ignore otherwise"));
  }
  // Evidence only, never a blocker: slices run without offload, just with the host's CPUs doing
  // the switching.
  if (ovs) {
    if (b.ovs_hw_offload()) {
      out.push_back(MakeCheck("ovs_offload", kPass, "hw-offload on"));
    } else {
      out.push_back(MakeCheck("ovs_offload", v1::CHECK_STATUS_WARN,
                              "hw-offload off" + note("ovs_offload"),
                              "where the NIC supports it (a BlueField eswitch in switchdev mode): "
                              "ovs-vsctl set Open_vSwitch . other_config:hw-offload=true, then "
                              "restart openvswitch-switch"));
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Candidates.

namespace {

// GPUs by NUMA node (unknown last), PCIe switch and address: the slots' order.
std::vector<const v1::GpuDevice*> GpusInSlotOrder(const std::vector<v1::GpuDevice>& gpus) {
  std::vector<const v1::GpuDevice*> order;
  order.reserve(gpus.size());
  for (const auto& g : gpus) order.push_back(&g);
  std::sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::make_tuple(!a->has_numa_node(), a->numa_node(), a->pcie_switch(),
                           a->pci_address()) <
           std::make_tuple(!b->has_numa_node(), b->numa_node(), b->pcie_switch(), b->pci_address());
  });
  return order;
}

bool DiskSigned(const v1::NvmeDevice& d) {
  return !d.fs_type().empty() || !d.partition_table().empty() || d.partitions_size() > 0;
}

// The eligible disks, where each sits, and which one each slot got (-1: none).
struct DiskAssignment {
  std::vector<const v1::NvmeDevice*> disks;
  std::vector<Loc> locs;
  std::vector<int> pick;
};

// NVMe: only whole disks that are safe to hand to a VM and have a stable identity.
DiskAssignment AssignDisks(const std::vector<v1::NvmeDevice>& nvme,
                           const std::map<std::string, std::string>& nvme_switch,
                           const std::vector<Loc>& slot_locs) {
  DiskAssignment a;
  for (const auto& d : nvme) {
    if (d.os_disk() || d.by_id_path().empty() || d.mountpoints_size() > 0) continue;
    bool child_mounted = false;
    for (const auto& p : d.partitions()) child_mounted = child_mounted || p.mountpoints_size() > 0;
    if (child_mounted) continue;
    a.disks.push_back(&d);
  }
  for (const auto* d : a.disks) {
    auto it = nvme_switch.find(d->pci_address());
    a.locs.push_back(
        {NumaOf(d->has_numa_node(), d->numa_node()), it == nvme_switch.end() ? "" : it->second});
  }
  a.pick = TieredAssign(
      slot_locs, a.locs,
      [&](size_t c) {
        return std::make_pair(DiskSigned(*a.disks[c]) ? 1 : 0, a.disks[c]->by_id_path());
      },
      [](size_t) {});
  return a;
}

// One fabric type per node (InfiniBand when the host has any, else RoCE).
v1::FabricType NodeFabricType(const std::vector<v1::FabricDevice>& fabric) {
  v1::FabricType type = v1::FABRIC_TYPE_UNSPECIFIED;
  for (const auto& f : fabric) {
    if (f.fabric_type() == v1::FABRIC_TYPE_INFINIBAND) type = v1::FABRIC_TYPE_INFINIBAND;
  }
  if (type == v1::FABRIC_TYPE_UNSPECIFIED) {
    for (const auto& f : fabric) {
      if (f.fabric_type() == v1::FABRIC_TYPE_ROCE) type = v1::FABRIC_TYPE_ROCE;
    }
  }
  return type;
}

// The node's fabric PFs and VFs, and which VF each slot got (-1: none).
struct FabricAssignment {
  std::map<std::string, const v1::FabricDevice*> pf_by_pci;
  std::vector<const v1::FabricDevice*> pfs, vfs;
  std::vector<int> vf_pick;

  // A VF sits where its PF does.
  Loc LocOf(const v1::FabricDevice& f) const {
    const v1::FabricDevice* at = &f;
    if (f.is_vf()) {
      if (auto it = pf_by_pci.find(f.pf_pci_address()); it != pf_by_pci.end()) at = it->second;
    }
    return Loc{NumaOf(at->has_numa_node(), at->numa_node()), at->pcie_switch()};
  }
};

FabricAssignment AssignFabric(const std::vector<v1::FabricDevice>& fabric,
                              const std::vector<Loc>& slot_locs) {
  const v1::FabricType type = NodeFabricType(fabric);
  FabricAssignment a;
  for (const auto& f : fabric) {
    if (f.fabric_type() != type || f.pci_address().empty()) continue;
    if (f.is_vf()) {
      a.vfs.push_back(&f);
    } else {
      a.pfs.push_back(&f);
      a.pf_by_pci[f.pci_address()] = &f;
    }
  }
  std::vector<Loc> vf_locs;
  vf_locs.reserve(a.vfs.size());
  for (const auto* v : a.vfs) vf_locs.push_back(a.LocOf(*v));
  std::map<std::string, int> pf_use;  // spread VFs over PFs of equal distance
  a.vf_pick = TieredAssign(
      slot_locs, vf_locs,
      [&](size_t c) {
        return std::make_pair(pf_use[a.vfs[c]->pf_pci_address()], a.vfs[c]->pci_address());
      },
      [&](size_t c) { pf_use[a.vfs[c]->pf_pci_address()]++; });
  return a;
}

void DescribeGpu(v1::CandidateSlot& s, const v1::GpuDevice& g, int index, const Loc& loc) {
  s.set_slot_key("gpu-" + g.pci_address());
  s.set_index(index);
  s.set_gpu_pci_address(g.pci_address());
  if (g.has_numa_node()) s.set_numa_node(g.numa_node());
  s.set_pcie_switch(g.pcie_switch());
  std::string where = !g.pcie_switch().empty()      ? g.pcie_switch()
                      : !g.pcie_root_port().empty() ? g.pcie_root_port()
                                                    : "none";
  s.set_locality_group("numa" + NumaLabel(loc.numa) + "/" + where);
  if (!g.has_numa_node()) {
    s.add_notes("GPU NUMA node unknown (sysfs numa_node=-1): locality cannot be verified");
  }
}

void PairDisk(v1::CandidateSlot& s, const DiskAssignment& disks, size_t i, const Loc& loc) {
  if (disks.pick[i] < 0) {
    s.add_notes(
        "no eligible NVMe left (OS disk, mounted, mounted partitions or no by-id "
        "identity excluded)");
    return;
  }
  const auto& d = *disks.disks[static_cast<size_t>(disks.pick[i])];
  s.set_nvme_by_id(d.by_id_path());
  s.set_nvme_kernel_name(d.kernel_name());
  if (DiskSigned(d)) {
    std::string what = d.fs_type();
    if (!d.partition_table().empty()) what += (what.empty() ? "" : "+") + d.partition_table();
    if (what.empty()) what = "partitions";
    s.add_notes("NVMe " + d.by_id_path() + " carries " + what +
                " signatures: needs an approved wipe before the slot can be approved");
  }
  int tier = Tier(loc, disks.locs[static_cast<size_t>(disks.pick[i])]);
  if (tier == 2) {
    s.add_notes("NVMe " + d.by_id_path() + " is on NUMA node " +
                NumaLabel(disks.locs[static_cast<size_t>(disks.pick[i])].numa) + ", not the GPU's");
  }
}

// The slot's own VF; else the nearest PF, shared; else no fabric.
void PairFabric(v1::CandidateSlot& s, const FabricAssignment& fab, size_t i, const Loc& loc) {
  if (fab.vf_pick[i] >= 0) {
    const auto& v = *fab.vfs[static_cast<size_t>(fab.vf_pick[i])];
    s.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_PER_SLOT_VF);
    s.set_fabric_vf_pci_address(v.pci_address());
    s.set_fabric_pf_pci_address(v.pf_pci_address());
    s.set_fabric_type(v.fabric_type());
  } else if (!fab.pfs.empty()) {
    const v1::FabricDevice* best = nullptr;
    std::pair<int, std::string> best_key;
    for (const auto* pf : fab.pfs) {
      std::pair<int, std::string> key{Tier(loc, fab.LocOf(*pf)), pf->pci_address()};
      if (best == nullptr || key < best_key) {
        best = pf;
        best_key = key;
      }
    }
    s.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_SHARED_PARENT);
    s.set_fabric_pf_pci_address(best->pci_address());
    s.set_fabric_type(best->fabric_type());
    s.add_notes("no free fabric VF for this slot: " + best->pci_address() +
                " would be shared with other slots; create more VFs (sriov_numvfs) before "
                "approval");
  } else {
    s.set_fabric_claim_mode(v1::FABRIC_CLAIM_MODE_NONE);
    s.add_notes("no fabric (InfiniBand/RoCE) device found");
  }
}

// MAC from the node and index; IP the index's place after .10 of the slice subnet `gw`.
void SuggestAddresses(v1::CandidateSlot& s, const DiscoveryOptions& opts,
                      const std::optional<Ipv4Cidr>& gw, int index) {
  s.set_suggested_mac(SuggestedMac(opts.node_id, index));
  if (!gw) return;
  uint32_t net = gw->Network();
  uint64_t ip = static_cast<uint64_t>(net) + 10u + static_cast<uint64_t>(index);
  uint64_t broadcast =
      static_cast<uint64_t>(net) | (gw->prefix >= 32 ? 0u : (0xffffffffu >> gw->prefix));
  if (ip < broadcast && ip != gw->addr) {
    s.set_suggested_ip(FormatIpv4(static_cast<uint32_t>(ip)));
  } else {
    s.add_notes("slice subnet " + opts.gateway_cidr + " has no room for a suggested IP");
  }
}

}  // namespace

std::vector<v1::CandidateSlot> BuildCandidates(
    const std::vector<v1::GpuDevice>& gpus, const std::vector<v1::NvmeDevice>& nvme,
    const std::vector<v1::FabricDevice>& fabric, const DiscoveryOptions& opts,
    const std::map<std::string, std::string>& nvme_switch) {
  const auto order = GpusInSlotOrder(gpus);
  std::vector<Loc> slot_locs;
  slot_locs.reserve(order.size());
  for (const auto* g : order) {
    slot_locs.push_back({NumaOf(g->has_numa_node(), g->numa_node()), g->pcie_switch()});
  }
  const DiskAssignment disks = AssignDisks(nvme, nvme_switch, slot_locs);
  const FabricAssignment fab = AssignFabric(fabric, slot_locs);

  auto gw = ParseCidr(opts.gateway_cidr);
  std::vector<v1::CandidateSlot> out;
  for (size_t i = 0; i < order.size(); ++i) {
    const int index = static_cast<int>(i);
    v1::CandidateSlot s;
    DescribeGpu(s, *order[i], index, slot_locs[i]);
    PairDisk(s, disks, i, slot_locs[i]);
    PairFabric(s, fab, i, slot_locs[i]);
    SuggestAddresses(s, opts, gw, index);
    *s.mutable_profile() = opts.profile;
    out.push_back(std::move(s));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------

Result<v1::TopologyReport> Discover(const DiscoveryOptions& opts) {
  struct stat st {};
  if (opts.root.empty() || ::stat(opts.root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Error::NotFound(reason::kHostRootMissing,
                           "host root '" + opts.root + "' is not a directory");
  }
  try {
    HostRoot host(opts.root);
    v1::TopologyReport rep;
    std::string hostname = opts.hostname;
    if (hostname.empty()) hostname = host.ReadLine("/proc/sys/kernel/hostname").value_or("");
    if (hostname.empty()) hostname = host.ReadLine("/etc/hostname").value_or("");
    DiscoveryOptions eff = opts;
    eff.hostname = hostname;
    if (eff.node_id.empty()) eff.node_id = hostname;
    rep.set_node_id(eff.node_id);
    rep.set_hostname(hostname);
    rep.set_root(host.root());
    *rep.mutable_discovered_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
    rep.set_agent_version(opts.agent_version);

    auto gpus = DiscoverGpus(host);
    auto nvme = DiscoverNvme(host);
    auto fabric = DiscoverFabric(host);
    std::map<std::string, std::string> pci_switch;
    for (const auto& d : nvme) {
      if (d.pci_address().empty()) continue;
      if (auto r = host.Resolve("/sys/bus/pci/devices/" + d.pci_address())) {
        pci_switch[d.pci_address()] = LocatePci(*r).pcie_switch;
      }
    }
    for (const auto& g : gpus) *rep.add_gpus() = g;
    for (const auto& d : nvme) *rep.add_nvme() = d;
    for (const auto& f : fabric) *rep.add_fabric() = f;

    bool reboot = false;
    for (auto& c : PrereqChecks(host, eff, gpus, &reboot)) *rep.add_prereqs() = std::move(c);
    rep.set_reboot_required(reboot);
    auto probe = ProbeNetwork(host, eff);
    *rep.mutable_network() = probe.baseline;
    for (auto& c : NetworkChecks(probe.baseline, probe.notes)) {
      *rep.add_network_checks() = std::move(c);
    }
    for (auto& s : BuildCandidates(gpus, nvme, fabric, eff, pci_switch)) {
      *rep.add_candidates() = std::move(s);
    }

    for (const auto* list : {&rep.prereqs(), &rep.network_checks()}) {
      for (const auto& c : *list) {
        if (c.blocker() && c.status() == v1::CHECK_STATUS_FAIL) {
          rep.add_node_blockers(BlockerName(c.name()).str());
        }
      }
    }
    return rep;
  } catch (const std::exception& e) {
    return Error::Internal(reason::kDiscoveryFailed, e.what());
  }
}

}  // namespace gpuaas::node_agent
