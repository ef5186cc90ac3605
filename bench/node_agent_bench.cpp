// P6: how long the node-agent's libvirt runtime takes from a vm.provision task to a running
// domain, against a bare `virsh start` of the very same domain, in the same run.
//
// Run by `scripts/bench node-agent` (root), which builds the test guest and starts virtlogd +
// libvirtd inside a network namespace with the slice bridge. Each round, on a fixture host whose
// slot NVMe is a loop device:
//   agent: LibvirtRuntime::Provision(bundle) from the call to its "start" progress (the
//          domain is running): host validation, the ledger lease, the image's sha256 and
//          qemu-img write onto the disk, the NoCloud seed ISO, define, virDomainCreate. (Task
//          receipt adds the JetStream fetch and protobuf unpack, well under a millisecond.)
//          Readiness is cut short (no DHCP server: lease_timeout after 10 ms).
//   virsh: the same domain destroyed, then `virsh start` timed until it returns (running).
// Then release + cleanup (wipe) before the next round. One warm-up round is not counted.
// Prints the per-stage split of the agent's time and
//   P6 agent_start_ms=<median> virsh_start_ms=<median> ratio=<x/y>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "bench_util.hpp"
#include "bundle_fixture.hpp"
#include "discovery.hpp"
#include "fixture_host.hpp"
#include "gpuaas/common/ids.hpp"
#include "host.hpp"
#include "libvirt_runtime.hpp"
#include "local_store.hpp"
#include "loop_disk.hpp"

namespace fs = std::filesystem;

using namespace gpuaas::node_agent;  // (not gpuaas: both have a `testing`)
using Clock = std::chrono::steady_clock;

namespace {

std::string Env(const char* name, const char* def = "") {
  const char* v = std::getenv(name);
  return v && *v ? v : def;
}
double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }
[[noreturn]] void Die(const std::string& why) {
  std::fprintf(stderr, "node_agent_bench: %s\n", why.c_str());
  std::exit(1);
}
std::string Cmd(const std::string& name) { return HostRoot("/").FindCommand(name).value_or(name); }
ToolResult Virsh(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {Cmd("virsh"), "-c", "qemu:///system"};
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = RunTool(argv, std::chrono::seconds(120));
  if (!r.ok()) Die("virsh: " + r.error().ToString());
  return *r;
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  const std::string guest = Env("GPUAAS_BENCH_GUEST");
  const std::string work = Env("GPUAAS_BENCH_WORK");
  const std::string bridge = Env("GPUAAS_BENCH_BRIDGE", "ovsbr0");
  if (guest.empty() || work.empty()) Die("run through scripts/bench node-agent");

  const std::string root = work + "/host";
  fs::remove_all(root);
  FixtureOptions fo;
  fo.gpus = 1;
  fo.unknown_numa_gpus = {0};
  if (auto b = BuildFixtureHost(root, fo); !b.ok()) Die(b.error().ToString());
  DiscoveryOptions dopts;
  dopts.root = root;
  dopts.libvirt_uri = "";
  auto host = Discover(dopts);
  if (!host.ok() || host->candidates_size() < 1) Die("fixture host has no candidate");
  gpuaas::node_agent::testing::LoopDisk disk;
  if (auto why = disk.Attach(root, host->candidates(0).nvme_by_id(), work + "/slot-nvme.raw");
      !why.empty()) {
    Die(why);
  }
  // qemu runs as another user: it must reach the disk node, the seed, kernel and initrd.
  for (fs::path d = work; d != d.root_path(); d = d.parent_path()) {
    fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
  }
  for (const auto& d : {root, root + "/dev", root + "/dev/disk", root + "/dev/disk/by-id"}) {
    fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
  }

  fs::remove_all(work + "/state");
  auto store = LocalStore::Open(work + "/state");
  if (!store.ok()) Die(store.error().ToString());
  LibvirtOptions o;
  o.uri = "qemu:///system";
  o.host_root = root;
  o.image_cache_dir = work + "/state/images";
  o.seed_dir = work + "/state/seeds";
  o.lease_file = work + "/no-dhcp.leases";
  o.lease_timeout = std::chrono::milliseconds(10);
  o.domain.domain_type = "qemu";
  o.domain.cpu_mode = "maximum";
  o.domain.passthrough = false;
  o.domain.bridge = bridge;
  o.domain.kernel = guest + "/vmlinuz";
  o.domain.initrd = guest + "/initrd.img";
  o.domain.cmdline = "console=ttyS0 quiet panic=-1";
  o.shutdown_timeout = std::chrono::seconds(1);
  LibvirtRuntime rt(*store, o);

  const std::string image = guest + "/image.raw";
  auto sha = RunTool({Cmd("sha256sum"), image}, std::chrono::seconds(30));
  if (!sha.ok() || sha->out.size() < 64) Die("sha256sum failed");

  std::vector<double> agent_ms, virsh_ms;
  std::map<std::string, std::vector<double>> split;  // stage -> ms since the previous stage
  for (int round = 0; round <= rounds; ++round) {
    const std::string id = gpuaas::ids::NewUuidV7();
    auto b = gpuaas::testing::BundleFromCandidates(*host, 1, id);
    b.mutable_image()->set_name("bench-guest");
    b.mutable_image()->set_url("file://" + image);
    b.mutable_image()->set_sha256(sha->out.substr(0, 64));
    b.mutable_shape()->set_vcpus(1);
    b.mutable_shape()->set_memory_mib(256);
    b.mutable_shape()->set_numa_node(-1);

    std::map<std::string, double> at;
    const auto t0 = Clock::now();
    auto last = t0;
    auto progress = [&](const std::string& stage, const std::string&, int pct) {
      const auto now = Clock::now();
      if (pct == 100 && !at.count(stage)) {
        at[stage] = Ms(now - t0);
        if (round > 0) split[stage].push_back(Ms(now - last));
        last = now;
      }
    };
    auto out = rt.Provision(b, progress);
    if (out.ok() || out.error().reason != "lease_timeout") {
      Die("provision: expected lease_timeout, got " +
          (out.ok() ? std::string("success") : out.error().ToString()));
    }
    if (!at.count("start")) Die("provision never reported the domain started");

    const std::string name = DomainName(id);
    if (Virsh({"destroy", name}).exit_code != 0) Die("virsh destroy failed");
    const auto v0 = Clock::now();
    auto started = Virsh({"start", name});
    const double v = Ms(Clock::now() - v0);
    if (started.exit_code != 0) Die("virsh start failed: " + started.err);
    if (Virsh({"domstate", name}).out.find("running") == std::string::npos) {
      Die("virsh start returned but the domain is not running");
    }

    gpuaas::v1::ReleaseParams rel;
    rel.set_allocation_id(id);
    rel.set_graceful_timeout_s(1);
    if (auto r = rt.Release(rel, [](auto&&...) {}); !r.ok()) Die(r.error().ToString());
    gpuaas::v1::CleanupParams cp;
    cp.set_allocation_id(id);
    for (const auto& s : b.slots()) *cp.add_slots() = s;
    if (auto r = rt.Cleanup(cp, [](auto&&...) {}); !r.ok()) Die(r.error().ToString());
    std::printf("round %d%s: agent %.1f ms, virsh start %.1f ms\n", round,
                round == 0 ? " (warm-up)" : "", at["start"], v);
    if (round == 0) continue;
    agent_ms.push_back(at["start"]);
    virsh_ms.push_back(v);
  }
  std::printf("agent split (median ms per stage):");
  for (const char* st : {"validate", "lease", "image", "seed", "define", "start"}) {
    std::printf(" %s=%.1f", st, gpuaas::bench::Percentile(split[st], 0.5));
  }
  std::printf("\n");
  const double a = gpuaas::bench::Percentile(agent_ms, 0.5),
               v = gpuaas::bench::Percentile(virsh_ms, 0.5);
  std::printf("P6 agent_start_ms=%.1f virsh_start_ms=%.1f ratio=%.2f\n", a, v, a / v);
  return 0;
}
