// fuzz_discovery: the node-agent reads sysfs, procfs and disk heads through a HostRoot, and
// discovery must never throw or fail on an odd host (discovery.hpp). A fixture host
// (BuildFixtureHost: 2 GPUs behind PCIe switches, NVMe, IB PFs with a VF each, no `ip`/`iptables`
// so no tool runs and addresses come from /proc/net/fib_trie) is written once; each input
// overwrites up to 8 of its files (any file of the tree, or /proc/mounts, /proc/swaps,
// /proc/net/route, /proc/net/fib_trie, /proc/cmdline) with fuzzed bytes, runs Discover() and the
// parts it is made of, then restores them. Invariants: Discover succeeds, devices come sorted by
// PCI address with well-formed addresses, NVMe devices are whole namespaces, candidates use
// discovered GPUs and the pure parsers (ParseCidr, DetectFsType, DetectPartitionTable, SplitWs)
// keep their contracts on the same bytes.
#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "fuzz_check.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/host/host.hpp"

namespace gpuaas::fuzz {
namespace {

namespace fs = std::filesystem;
namespace na = node_agent;

struct Fixture {
  std::string dir;
  std::vector<std::string> files;                           // real paths the input may replace
  std::map<std::string, std::optional<std::string>> saved;  // original content (nullopt: none)
};

std::optional<std::string> Slurp(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return std::nullopt;
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

void Spit(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << content;
}

Fixture& Host() {
  static auto* fx = [] {
    auto* out = new Fixture;
    char tmpl[] = "/tmp/gpuaas-fuzz-host-XXXXXX";
    FUZZ_CHECK(::mkdtemp(tmpl) != nullptr, "mkdtemp");
    out->dir = std::string(tmpl) + "/root";
    na::FixtureOptions o;
    o.gpus = 2;
    o.vfs_per_pf = 1;
    o.ip_tool = false;
    o.iptables_tool = false;
    o.os_on_lvm = true;
    o.mounted_child_nvme = 1;
    auto r = na::BuildFixtureHost(out->dir, o);
    FUZZ_CHECK(r.ok(), r.ok() ? "" : r.error().ToString());
    for (const auto& e : fs::recursive_directory_iterator(out->dir)) {
      if (e.is_regular_file() && !e.is_symlink() &&
          e.path().string().find("/usr/") == std::string::npos) {
        out->files.push_back(e.path().string());
      }
    }
    for (const char* p : {"/proc/mounts", "/proc/self/mounts", "/proc/swaps", "/proc/net/route",
                          "/proc/net/fib_trie", "/proc/cmdline", "/proc/sys/net/ipv4/ip_forward"}) {
      const std::string real = out->dir + p;
      if (std::find(out->files.begin(), out->files.end(), real) == out->files.end()) {
        fs::create_directories(fs::path(real).parent_path());
        out->files.push_back(real);
      }
    }
    std::sort(out->files.begin(), out->files.end());
    for (const auto& f : out->files) out->saved[f] = Slurp(f);
    return out;
  }();
  return *fx;
}

na::DiscoveryOptions Options(const Fixture& fx) {
  na::DiscoveryOptions d;
  d.root = fx.dir;
  d.node_id = "node-a";
  d.libvirt_uri = "";  // no libvirt connection per input
  return d;
}

bool IsNamespaceName(const std::string& n) {
  size_t i = 4;
  auto digits = [&] {
    const size_t b = i;
    while (i < n.size() && n[i] >= '0' && n[i] <= '9') ++i;
    return i > b;
  };
  return n.starts_with("nvme") && digits() && i < n.size() && n[i++] == 'n' && digits() &&
         i == n.size();
}

template <typename Devices>
void CheckSorted(const Devices& devs, const char* what) {
  std::string prev;
  for (const auto& d : devs) {
    if (!d.pci_address().empty()) {
      FUZZ_CHECK(na::LooksLikePciAddress(d.pci_address()), std::string(what) + d.pci_address());
    }
    FUZZ_CHECK(prev <= d.pci_address(),
               std::string(what) + " order " + prev + " > " + d.pci_address());
    prev = d.pci_address();
    if (d.has_numa_node()) FUZZ_CHECK(d.numa_node() >= 0 && d.numa_node() <= 4096, what);
  }
}

void CheckDiscovery(const Fixture& fx) {
  // Discover() runs every part (devices, prerequisites, network probe, candidates) once; each
  // sysfs path is resolved link by link, so one run is ~4,000 stats: the parts are checked on
  // its report rather than run twice.
  auto report = na::Discover(Options(fx));
  FUZZ_CHECK(report.ok(), report.ok() ? "" : report.error().ToString());
  CheckSorted(report->gpus(), "gpu ");
  CheckSorted(report->fabric(), "fabric ");
  std::set<std::string> seen;
  for (const auto& d : report->nvme()) {
    FUZZ_CHECK(IsNamespaceName(d.kernel_name()), d.kernel_name());
    FUZZ_CHECK(seen.insert(d.kernel_name()).second, "duplicate " + d.kernel_name());
  }
  std::set<std::string> gpu_addrs;
  for (const auto& g : report->gpus()) gpu_addrs.insert(g.pci_address());
  FUZZ_CHECK(report->candidates_size() <= report->gpus_size(), report->ShortDebugString());
  for (const auto& c : report->candidates()) {
    FUZZ_CHECK(gpu_addrs.count(c.gpu_pci_address()) == 1, c.ShortDebugString());
  }
  for (const auto& check : report->network_checks()) {
    FUZZ_CHECK(!check.name().empty(), check.ShortDebugString());
  }
}

void CheckPure(const std::string& s) {
  static const std::set<std::string> kFs = {"",    "ext4",        "ext3", "ext2",
                                            "xfs", "LVM2_member", "swap", "vfat"};
  FUZZ_CHECK(kFs.count(na::DetectFsType(s)) == 1, na::DetectFsType(s));
  const std::string pt = na::DetectPartitionTable(s);
  FUZZ_CHECK(pt.empty() || pt == "gpt" || pt == "dos", pt);
  for (const auto& tok : na::SplitWs(s)) {
    FUZZ_CHECK(!tok.empty() && na::Trim(tok) == tok && tok.find(' ') == std::string::npos, tok);
  }
  if (auto c = na::ParseCidr(s)) {
    FUZZ_CHECK(c->prefix >= 0 && c->prefix <= 32, s);
    const std::string again = na::FormatIpv4(c->addr) + "/" + std::to_string(c->prefix);
    auto back = na::ParseCidr(again);
    FUZZ_CHECK(back && back->addr == c->addr && back->prefix == c->prefix, s + " -> " + again);
  }
}

}  // namespace
}  // namespace gpuaas::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gpuaas::fuzz;  // NOLINT(google-build-using-namespace)
  Fixture& fx = Host();
  FuzzedDataProvider in(data, size);
  std::vector<std::string> touched;
  const int edits = in.ConsumeIntegralInRange(1, 8);
  for (int i = 0; i < edits && in.remaining_bytes() > 0; ++i) {
    const std::string& file = fx.files[in.ConsumeIntegralInRange<size_t>(0, fx.files.size() - 1)];
    const std::string content =
        i + 1 == edits ? in.ConsumeRemainingBytesAsString() : in.ConsumeRandomLengthString(4096);
    CheckPure(content);
    Spit(file, content);
    touched.push_back(file);
  }
  CheckDiscovery(fx);
  for (const auto& f : touched) {
    const auto& orig = fx.saved[f];
    if (orig) {
      Spit(f, *orig);
    } else {
      ::unlink(f.c_str());
    }
  }
  return 0;
}
