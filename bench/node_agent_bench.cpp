// P6/P6b: how long the node-agent's libvirt runtime takes from a vm.provision task to a running
// domain, against the bare minimum for the same work measured in the same run: `dd` of the
// image onto the same disk with O_DIRECT, then `virsh start` of the very same domain.
//
// Run by `scripts/bench node-agent [ROUNDS]` (root), which builds the test guest, writes a 1 GiB
// image of random bytes into its work dir (kept between runs), and starts virtlogd + libvirtd
// inside a network namespace with the slice bridge. One fixture host with 4 GPUs whose 4 slot
// NVMes are loop devices (direct I/O on their backing files, so writes reach this machine's disk
// as on a real NVMe), one LibvirtRuntime for all of it (as the agent has). Three cases, each
// ROUNDS rounds after one warm-up round that is not counted (the 1 GiB case's warm-up also
// fetches the image into the agent's cache):
//   P6 image=16MiB  one provision of the 16 MiB guest image
//   P6 image=1GiB   one provision of the 1 GiB image
//   P6b             four 1 GiB provisions at once, one thread each, one GPU and slot each
// A round:
//   agent:    LibvirtRuntime::Provision(bundle) from the call to its "start" progress (the
//             domain is running; the last of them for P6b): host validation, the ledger lease,
//             the image hashed (sha256) and written onto the disk in one read, the NoCloud seed
//             ISO, define, and the domain started paused while the image is written, resumed once
//             its digest matched. (Task receipt adds the JetStream fetch and protobuf unpack, well
//             under a millisecond.) Readiness is cut short (no DHCP server: lease_timeout after
//             10 ms). The agent's "image" stage therefore ends when both the write and the paused
//             start are done, and its define/start stages are what is left after that.
//   baseline: the same domains destroyed, then per domain `dd if=IMAGE of=/dev/loopN bs=4M
//             oflag=direct` followed by `virsh start`, as processes (one thread per domain),
//             timed from the first launch to the last exit. IMAGE is the agent's own cache entry
//             of the image, so both read the same file from the same page cache.
// Then release + cleanup (wipe) before the next round. Prints each round, the per-stage split of
// the agent's time and the baseline's, and
//   P6 image=16MiB agent_start_ms=<median> baseline_ms=<median> ratio=<x/y>
//   P6 image=1GiB agent_start_ms=<median> baseline_ms=<median> ratio=<x/y>
//   P6b provisions=4 agent_ms=<median> baseline_ms=<median> ratio=<x/y>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "bench_util.hpp"
#include "bundle_fixture.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/runtime/libvirt_runtime.hpp"
#include "loop_disk.hpp"

namespace fs = std::filesystem;

using namespace gpuaas::node_agent;  // (not gpuaas: both have a `testing`)
using Clock = std::chrono::steady_clock;

namespace {

constexpr int kSlots = 4;                   // P6b's parallel provisions; P6 uses the first slot
constexpr const char* kDiskSize = "1100M";  // room for the 1 GiB image
const char* const kStages[] = {"validate", "lease", "image", "seed", "define", "start"};

// Thrown instead of exiting, so the loop devices are detached on the way out.
struct Fatal : std::runtime_error {
  using std::runtime_error::runtime_error;
};
[[noreturn]] void Die(const std::string& why) { throw Fatal(why); }

std::string Env(const char* name, const char* def = "") {
  const char* v = std::getenv(name);
  return v && *v ? v : def;
}
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
double Median(const std::vector<double>& v) { return gpuaas::bench::Percentile(v, 0.5); }
std::string Cmd(const std::string& name) { return HostRoot("/").FindCommand(name).value_or(name); }

// "" when the tool ran and exited 0, else why not (thread-safe: no exit, no throw).
std::string Run(const std::vector<std::string>& argv, ToolResult* out = nullptr) {
  auto r = RunTool(argv, std::chrono::minutes(10));
  if (!r.ok()) return argv[0] + ": " + r.error().ToString();
  if (out) *out = *r;
  if (r->exit_code != 0) {
    return fmt::format("{} exited {}: {}", fmt::join(argv, " "), r->exit_code, Trim(r->err));
  }
  return "";
}
std::vector<std::string> Virsh(std::vector<std::string> args) {
  args.insert(args.begin(), {Cmd("virsh"), "-c", "qemu:///system"});
  return args;
}
std::vector<std::string> Dd(const std::string& image, const std::string& dev) {
  return {Cmd("dd"), "if=" + image, "of=" + dev, "bs=4M", "oflag=direct", "status=none"};
}

// Runs one task per index on its own thread; throws the first failure once all have ended.
template <typename F>
void OnThreads(int n, F task) {
  std::vector<std::string> errors(static_cast<size_t>(n));
  std::vector<std::thread> threads;
  threads.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] { errors[static_cast<size_t>(i)] = task(i); });
  }
  for (auto& t : threads) t.join();
  for (const auto& e : errors) {
    if (!e.empty()) Die(e);
  }
}

struct Image {
  std::string label;  // "16MiB", "1GiB"
  std::string path;
  std::string sha256;
};

class Bench {
 public:
  Bench(std::string guest, std::string work, std::string bridge)
      : guest_(std::move(guest)), work_(std::move(work)), bridge_(std::move(bridge)) {}

  void SetUp() {
    const std::string root = work_ + "/host";
    fs::remove_all(root);
    FixtureOptions fo;
    fo.gpus = kSlots;
    fo.unknown_numa_gpus = {0, 1, 2, 3};  // no NUMA pinning: the fixture's CPUs are not ours
    if (auto b = BuildFixtureHost(root, fo); !b.ok()) Die(b.error().ToString());
    DiscoveryOptions dopts;
    dopts.root = root;
    dopts.libvirt_uri = "";
    auto host = Discover(dopts);
    if (!host.ok() || host->candidates_size() < kSlots) {
      Die(fmt::format("fixture host has fewer than {} candidates", kSlots));
    }
    host_ = *host;
    for (int i = 0; i < kSlots; ++i) {
      auto& d = disks_[i];
      if (auto why = d.Attach(root, host_.candidates(i).nvme_by_id(),
                              fmt::format("{}/slot-nvme-{}.raw", work_, i), kDiskSize, true);
          !why.empty()) {
        Die(why);
      }
    }
    // qemu runs as another user: it must reach the disk node, the seed, kernel and initrd.
    for (fs::path d = work_; d != d.root_path(); d = d.parent_path()) {
      fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
    }
    for (const auto& d : {root, root + "/dev", root + "/dev/disk", root + "/dev/disk/by-id"}) {
      fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
    }

    fs::remove_all(work_ + "/state");
    auto store = LocalStore::Open(work_ + "/state");
    if (!store.ok()) Die(store.error().ToString());
    store_.emplace(std::move(*store));
    LibvirtOptions o;
    o.uri = "qemu:///system";
    o.host_root = root;
    o.image_cache_dir = work_ + "/state/images";
    o.seed_dir = work_ + "/state/seeds";
    o.lease_file = work_ + "/no-dhcp.leases";
    o.lease_timeout = std::chrono::milliseconds(10);
    o.domain.domain_type = "qemu";
    o.domain.cpu_mode = "maximum";
    o.domain.passthrough = false;
    o.domain.bridge = bridge_;
    o.domain.kernel = guest_ + "/vmlinuz";
    o.domain.initrd = guest_ + "/initrd.img";
    o.domain.cmdline = "console=ttyS0 quiet panic=-1";
    o.shutdown_timeout = std::chrono::seconds(1);
    rt_.emplace(*store_, o);
  }

  std::string Header() const {
    std::string loops;
    bool dio = true;
    for (const auto& d : disks_) {
      loops += (loops.empty() ? "" : ",") + d.loop();
      dio = dio && d.DirectIo();
    }
    return fmt::format(
        "slot disks {} ({} each, direct-io={}, primed by an untimed dd after each wipe); TCG, 1 "
        "vCPU, 256 MiB, direct kernel boot; baseline dd bs=4M oflag=direct + virsh start",
        loops, kDiskSize, dio ? "on" : "OFF");
  }

  // One case: `n` provisions of `image` at once, each on slot i < n. Returns the medians
  // {agent, baseline}.
  std::pair<double, double> Case(const std::string& name, const Image& image, int n, int rounds) {
    std::vector<double> agent_ms, base_ms, dd_ms, virsh_ms;
    std::map<std::string, std::vector<double>> split;  // stage -> ms since the previous stage
    for (int round = 0; round <= rounds; ++round) {
      std::vector<gpuaas::v1::ProvisionBundle> bundles;
      bundles.reserve(static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) bundles.push_back(MakeBundle(i, image));

      // Fairness: Cleanup's blkdiscard punches holes into the loop's backing file, so the next
      // write there pays for block allocation (several times slower than a rewrite). An untimed
      // dd of the same image first, so the agent's timed write and then the baseline's land on
      // blocks equally allocated, whichever comes first.
      const std::string src = CachedOr(image);
      OnThreads(n, [&](int i) { return Run(Dd(src, disks_[i].loop())); });

      // ---- agent ----
      std::vector<std::map<std::string, Clock::time_point>> at(static_cast<size_t>(n));
      std::mutex mu;  // the runtime may report from a worker thread
      const auto t0 = Clock::now();
      OnThreads(n, [&](int i) -> std::string {
        auto& mine = at[static_cast<size_t>(i)];
        auto progress = [&](const std::string& stage, const std::string&, int pct) {
          const auto now = Clock::now();
          std::lock_guard lock(mu);
          // A stage ends at its last 100 (the image stage may report 100 for the cache first).
          if (pct == 100 && !mine.count("start")) mine[stage] = now;
        };
        auto out = rt_->Provision(bundles[static_cast<size_t>(i)], progress);
        if (out.ok() || out.error().reason != "lease_timeout") {
          return "provision: expected lease_timeout, got " +
                 (out.ok() ? std::string("success") : out.error().ToString());
        }
        if (!mine.count("start")) return "provision never reported the domain started";
        return "";
      });
      Clock::time_point last_start = t0;
      for (const auto& m : at) last_start = std::max(last_start, m.at("start"));
      const double agent = Ms(last_start - t0);
      if (round > 0) {
        for (const auto& m : at) {
          auto prev = t0;
          for (const char* st : kStages) {
            if (!m.count(st)) continue;
            split[st].push_back(Ms(m.at(st) - prev));
            prev = m.at(st);
          }
        }
      }

      // ---- baseline: the same domains, dd then virsh start each ----
      for (const auto& b : bundles) {
        if (auto e = Run(Virsh({"destroy", DomainName(b.allocation_id())})); !e.empty()) Die(e);
      }
      std::vector<double> dd(static_cast<size_t>(n)), vs(static_cast<size_t>(n));
      const std::string cached = CachedOr(image);  // exists now, after the agent's first fetch
      const auto b0 = Clock::now();
      std::vector<Clock::time_point> ended(static_cast<size_t>(n), b0);
      OnThreads(n, [&](int i) -> std::string {
        const auto s0 = Clock::now();
        if (auto e = Run(Dd(cached, disks_[i].loop())); !e.empty()) return e;
        const auto s1 = Clock::now();
        if (auto e =
                Run(Virsh({"start", DomainName(bundles[static_cast<size_t>(i)].allocation_id())}));
            !e.empty()) {
          return e;
        }
        ended[static_cast<size_t>(i)] = Clock::now();
        dd[static_cast<size_t>(i)] = Ms(s1 - s0);
        vs[static_cast<size_t>(i)] = Ms(ended[static_cast<size_t>(i)] - s1);
        return "";
      });
      const double base = Ms(*std::max_element(ended.begin(), ended.end()) - b0);
      for (const auto& b : bundles) {
        ToolResult st;
        const std::string dom = DomainName(b.allocation_id());
        if (auto e = Run(Virsh({"domstate", dom}), &st); !e.empty()) Die(e);
        if (st.out.find("running") == std::string::npos) {
          Die("virsh start returned but " + dom + " is not running");
        }
      }

      OnThreads(n, [&](int i) { return Release(bundles[static_cast<size_t>(i)]); });
      std::printf("%s round %d%s: agent %.1f ms, baseline %.1f ms (dd %.1f, virsh start %.1f)\n",
                  name.c_str(), round, round == 0 ? " (warm-up)" : "", agent, base,
                  *std::max_element(dd.begin(), dd.end()), *std::max_element(vs.begin(), vs.end()));
      std::fflush(stdout);
      if (round == 0) continue;
      agent_ms.push_back(agent);
      base_ms.push_back(base);
      dd_ms.insert(dd_ms.end(), dd.begin(), dd.end());
      virsh_ms.insert(virsh_ms.end(), vs.begin(), vs.end());
    }
    std::printf("%s agent split (median ms per stage):", name.c_str());
    for (const char* st : kStages) std::printf(" %s=%.1f", st, Median(split[st]));
    std::printf("; baseline split: dd=%.1f virsh_start=%.1f\n", Median(dd_ms), Median(virsh_ms));
    return {Median(agent_ms), Median(base_ms)};
  }

 private:
  gpuaas::v1::ProvisionBundle MakeBundle(int slot, const Image& image) const {
    gpuaas::v1::TopologyReport one = host_;  // only candidate `slot`: one GPU, its own disk
    one.clear_candidates();
    *one.add_candidates() = host_.candidates(slot);
    auto b = gpuaas::testing::BundleFromCandidates(one, 1, gpuaas::ids::NewUuidV7());
    b.mutable_image()->set_name("bench-" + image.label);
    b.mutable_image()->set_url("file://" + image.path);
    b.mutable_image()->set_sha256(image.sha256);
    b.mutable_shape()->set_vcpus(1);
    b.mutable_shape()->set_memory_mib(256);
    b.mutable_shape()->set_numa_node(-1);
    return b;
  }

  // The agent's cache entry of the image (<cache>/<sha256>.img, a raw image as is) once it
  // exists, so the baseline reads the very file the agent reads; the original before that.
  std::string CachedOr(const Image& image) const {
    const std::string cached = fmt::format("{}/state/images/{}.img", work_, image.sha256);
    std::error_code ec;
    return fs::is_regular_file(cached, ec) ? cached : image.path;
  }

  // "" once the allocation is released and its disk wiped, else why not (thread-safe).
  std::string Release(const gpuaas::v1::ProvisionBundle& b) {
    gpuaas::v1::ReleaseParams rel;
    rel.set_allocation_id(b.allocation_id());
    rel.set_graceful_timeout_s(1);
    if (auto r = rt_->Release(rel, [](auto&&...) {}); !r.ok()) return r.error().ToString();
    gpuaas::v1::CleanupParams cp;
    cp.set_allocation_id(b.allocation_id());
    for (const auto& s : b.slots()) *cp.add_slots() = s;
    if (auto r = rt_->Cleanup(cp, [](auto&&...) {}); !r.ok()) return r.error().ToString();
    return "";
  }

  std::string guest_, work_, bridge_;
  gpuaas::v1::TopologyReport host_;
  gpuaas::node_agent::testing::LoopDisk disks_[kSlots];
  std::optional<LocalStore> store_;
  std::optional<LibvirtRuntime> rt_;  // destroyed before the store and the disks
};

Image Digested(std::string label, std::string path) {
  ToolResult r;
  if (auto e = Run({Cmd("sha256sum"), path}, &r); !e.empty() || r.out.size() < 64) {
    Die("sha256sum " + path + ": " + e);
  }
  return {std::move(label), std::move(path), r.out.substr(0, 64)};
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::string guest = Env("GPUAAS_BENCH_GUEST");
  const std::string work = Env("GPUAAS_BENCH_WORK");
  const std::string big = Env("GPUAAS_BENCH_IMAGE_1G");
  const std::string bridge = Env("GPUAAS_BENCH_BRIDGE", "ovsbr0");
  if (guest.empty() || work.empty() || big.empty()) {
    std::fprintf(stderr, "node_agent_bench: run through scripts/bench node-agent\n");
    return 2;
  }
  try {
    // Digests outside any timed part (the catalog would carry them).
    const Image small = Digested("16MiB", guest + "/image.raw");
    const Image large = Digested("1GiB", big);
    Bench bench(guest, work, bridge);
    bench.SetUp();
    std::printf("node_agent_bench: %d rounds per case after 1 warm-up; %s\n", rounds,
                bench.Header().c_str());
    std::fflush(stdout);
    const auto [a16, b16] = bench.Case("P6 image=16MiB", small, 1, rounds);
    const auto [a1g, b1g] = bench.Case("P6 image=1GiB", large, 1, rounds);
    const auto [a4, b4] = bench.Case("P6b provisions=4", large, kSlots, rounds);
    std::printf("P6 image=16MiB agent_start_ms=%.1f baseline_ms=%.1f ratio=%.2f\n", a16, b16,
                a16 / b16);
    std::printf("P6 image=1GiB agent_start_ms=%.1f baseline_ms=%.1f ratio=%.2f\n", a1g, b1g,
                a1g / b1g);
    std::printf("P6b provisions=%d agent_ms=%.1f baseline_ms=%.1f ratio=%.2f\n", kSlots, a4, b4,
                a4 / b4);
  } catch (const Fatal& e) {
    std::fprintf(stderr, "node_agent_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
