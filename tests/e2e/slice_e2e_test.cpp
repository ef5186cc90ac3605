// The slice lifecycle with a real VM through the real services (ctest label e2e). Run by
// scripts/e2e/slice-e2e.sh, which builds the test guest and starts virtlogd + libvirtd inside a
// network namespace; without it (GPUAAS_E2E_GUEST unset) every test here SKIPs.
//
// In this process: real NATS and PostgreSQL on loopback, ipam, inventory and the scheduler (with
// a catalog naming the guest image and its sha256). As child processes: the node-agent binary on
// a fixture host whose slot NVMe is a loop device (vm.runtime=libvirt on qemu:///system, TCG;
// network.apply=netns, so the agent runs the bridge, dnsmasq and NAT in the namespace from ipam's
// document), and gpuaasctl for every tenant action. The tests run in order on one slot and each
// leaves it free again:
//   1. create -> placed -> provisioned (image, seed, UEFI domain) -> lease + SSH -> active; SSH
//      into the guest; release -> shutdown, undefine -> wipe proof -> slot free again
//   2. a mounted slot disk is refused before any write and its slot stays cleanup_blocked until
//      the disk is unmounted and the release is retried
//   3. a guest whose DHCP is dropped fails with lease_timeout at readiness; cleanup wipes
//   4. the agent SIGKILLed mid-provision and restarted: it adopts the running domain, the task
//      comes back and readiness resumes; the allocation goes active
//   5. the agent's RSS over repeated provision/release cycles stays small and steady
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "discovery.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "host.hpp"
#include "loop_disk.hpp"
#include "platform.hpp"

namespace gpuaas {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using node_agent::RunTool;
using node_agent::Trim;

constexpr const char* kNode = "e2e-node-01";

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
std::string Tool(const std::string& name) {
  return node_agent::HostRoot("/").FindCommand(name).value_or(name);
}
// Runs argv; stdout + stderr into the test log when `echo`.
node_agent::ToolResult Exec(const std::vector<std::string>& argv,
                            std::chrono::milliseconds timeout = 60s, bool echo = false) {
  auto r = RunTool(argv, timeout);
  if (!r.ok()) {
    ADD_FAILURE() << argv[0] << ": " << r.error().ToString();
    return {};
  }
  if (echo) std::cout << r->out << r->err << std::flush;
  return *r;
}

// Everything the tests share: built once for the suite.
struct World {
  testing::Platform p;
  std::string guest, netns, work, root, state_dir, net_dir, agent_bin, ctl;
  std::string backing, loop, by_id, mnt;
  node_agent::testing::LoopDisk disk;
  uint16_t http_port = 0;
  std::unique_ptr<testing::Process> agent;
  int agent_starts = 0;
};
World* w = nullptr;

class SliceE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (Env("GPUAAS_E2E_GUEST").empty()) return;
    w = new World;
    w->guest = Env("GPUAAS_E2E_GUEST");
    w->netns = Env("GPUAAS_E2E_NETNS");
    w->work = Env("GPUAAS_E2E_WORK");
    w->agent_bin = Env("GPUAAS_E2E_AGENT");
    w->ctl = Env("GPUAAS_E2E_CTL");
    fs::create_directories(w->work);
    // qemu runs as another user: it must reach the disk node, the seed, kernel and initrd.
    for (fs::path d = w->work; d != d.root_path(); d = d.parent_path()) {
      fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
    }

    // The catalog: one slice SKU and the guest image with its digest.
    const std::string image = w->guest + "/image.raw";
    const std::string sha = Trim(Exec({Tool("sha256sum"), image}).out).substr(0, 64);
    const std::string catalog = w->work + "/catalog.yaml";
    std::ofstream(catalog) << fmt::format(
        "skus:\n  h200-sxm-slice:\n    shape: gpu_slice\n    gpu_sku: h200-sxm\n"
        "    allowed_gpu_counts: [1]\n    vcpus_per_gpu: 1\n    memory_mib_per_gpu: 256\n"
        "    fabric_type: infiniband\n    network_modes: [private-nat]\n"
        "images:\n  e2e-guest:\n    url: file://{}\n    sha256: {}\ndefault_image: e2e-guest\n",
        image, sha);
    // A task not acked within 3 s comes back (the agent restart test): the consumer inventory
    // makes for the node.
    w->p.inventory_env["GPUAAS_INVENTORY_NODE_TASK_ACK_WAIT_MS"] = "3000";
    w->p.Start({{"GPUAAS_SCHEDULER_CATALOG_FILE", catalog},
                {"GPUAAS_SCHEDULER_PROVISION_DEADLINE_S", "300"},
                {"GPUAAS_SCHEDULER_SWEEP_INTERVAL_MS", "200"}});

    // The host: a one-GPU fixture (its GPU's NUMA node unknown, as on many real hosts), whose
    // data NVMe node becomes a block node of a fresh loop device.
    w->root = w->work + "/host";
    fs::remove_all(w->root);
    node_agent::FixtureOptions fo;
    fo.gpus = 1;
    fo.hostname = kNode;
    fo.unknown_numa_gpus = {0};
    auto built = node_agent::BuildFixtureHost(w->root, fo);
    ASSERT_TRUE(built.ok()) << built.error().ToString();
    for (const auto& d : node_agent::DiscoverNvme(node_agent::HostRoot(w->root))) {
      if (!d.os_disk()) w->by_id = d.by_id_path();
    }
    ASSERT_FALSE(w->by_id.empty());
    w->backing = w->work + "/slot-nvme.raw";
    ASSERT_EQ(w->disk.Attach(w->root, w->by_id, w->backing), "");
    w->loop = w->disk.loop();
    for (const auto& d :
         {w->root, w->root + "/dev", w->root + "/dev/disk", w->root + "/dev/disk/by-id"}) {
      fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
    }

    w->state_dir = w->work + "/" + kNode;
    w->net_dir = w->state_dir + "/net";
    fs::create_directories(w->net_dir);
    fs::permissions(w->state_dir, fs::perms::others_read | fs::perms::others_exec,
                    fs::perm_options::add);
    w->http_port = testing::FreePort();
    StartAgent();

    // The operator approves the discovered slot; ipam reserves its MAC/IP; the agent applies
    // the network document (dnsmasq with the reservation) in the namespace.
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          v1::ShowNodeRequest r;
          r.set_node_id(kNode);
          auto s = w->p.Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
          return s.ok() && s->snapshot_version() >= 1;
        },
        30s));
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(kNode);
    auto a = w->p.Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    ASSERT_EQ(a->results_size(), 1);
    ASSERT_TRUE(a->results(0).approved()) << a->results(0).DebugString();
    ASSERT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
    ASSERT_TRUE(testing::WaitFor(
        [] { return ReadAll(w->net_dir + "/dhcp-hosts").find(':') != std::string::npos; }, 30s))
        << "the agent never applied its network document";
  }
  static void TearDownTestSuite() {
    if (!w) return;
    if (w->agent) w->agent->Stop(20s);
    w->p.Stop();
    if (!w->mnt.empty()) (void)RunTool({Tool("umount"), w->mnt}, 30s);
    w->disk.Detach();
    delete w;
    w = nullptr;
  }
  void SetUp() override {
    if (!w) GTEST_SKIP() << "real-VM e2e: run scripts/e2e/slice-e2e.sh BUILD_DIR (root)";
  }

  static void StartAgent() {
    w->agent = std::make_unique<testing::Process>();
    w->p.nats.EnrollNode(kNode);
    std::vector<std::string> env = {
        "GPUAAS_LOG_LEVEL=info",
        "GPUAAS_HTTP_PORT=" + std::to_string(w->http_port),
        std::string("GPUAAS_NODE_ID=") + kNode,
        "GPUAAS_NODE_REGION=us-east-1",
        "GPUAAS_NODE_POOL=e2e",
        "GPUAAS_NODE_STATE_DIR=" + w->state_dir,
        "GPUAAS_NODE_HOST_ROOT=" + w->root,
        "GPUAAS_NODE_REGISTER_RETRY_MS=100",
        "GPUAAS_NODE_DESIRED_POLL_MS=200",
        "GPUAAS_LIBVIRT_URI=qemu:///system",
        "GPUAAS_VM_RUNTIME=libvirt",
        "GPUAAS_VM_DOMAIN_TYPE=qemu",
        "GPUAAS_VM_PASSTHROUGH=false",  // no GPU or VF to hand over on this machine
        "GPUAAS_VM_KERNEL=" + w->guest + "/vmlinuz",
        "GPUAAS_VM_INITRD=" + w->guest + "/initrd.img",
        "GPUAAS_VM_PROFILE_NAME=e2e_1c_256m",
        "GPUAAS_VM_VCPUS_PER_GPU=1",
        "GPUAAS_VM_MEMORY_MIB_PER_GPU=256",
        "GPUAAS_VM_LEASE_TIMEOUT_S=45",
        "GPUAAS_VM_SSH_TIMEOUT_S=90",
        "GPUAAS_NETWORK_APPLY=netns",
        "GPUAAS_NETWORK_NETNS=" + w->netns,
        "GPUAAS_NETWORK_STATE_DIR=" + w->net_dir,
        "GPUAAS_NETWORK_REPORT_MS=1000",
    };
    // Its own node identity (enrolled above), as a host's bootstrap would deliver it.
    for (const auto& [k, v] : w->p.nats.Env("node-agent", kNode)) env.push_back(k + "=" + v);
    w->agent->Spawn({w->agent_bin}, w->work + fmt::format("/agent-{}.log", ++w->agent_starts), env);
    ASSERT_TRUE(testing::WaitFor(
        [] {
          auto r = RunTool(
              {Tool("curl"), "-sf", fmt::format("http://127.0.0.1:{}/readyz", w->http_port)}, 2s);
          return r.ok() && r->exit_code == 0;
        },
        60s, 200ms))
        << "agent not ready; log " << w->work << "/agent-" << w->agent_starts << ".log";
  }

  static std::vector<v1::ProjectedSlot> Slots() {
    v1::ListProjectedSlotsRequest lr;
    lr.set_node_id(kNode);
    auto l = w->p.Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
    if (!l.ok()) return {};
    return {l->slots().begin(), l->slots().end()};
  }
  static bool SlotSchedulable() {
    auto s = Slots();
    return s.size() == 1 && s[0].schedulable() &&
           s[0].lifecycle() == v1::SLOT_LIFECYCLE_STATE_AVAILABLE;
  }

  // gpuaasctl: the tenant's and the admin's tool.
  static node_agent::ToolResult Ctl(std::vector<std::string> args, bool echo = true) {
    // As an operator: its NATS key and a request token (what `gpuaasctl auth login` issues).
    std::vector<std::string> argv = {w->ctl,
                                     "--nats",
                                     w->p.nats.url(),
                                     "--nats-seed-file",
                                     w->p.nats.SeedFile("operator"),
                                     "--token",
                                     w->p.nats.Token("operator")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::cout << "$ gpuaasctl " << fmt::format("{}", fmt::join(args, " ")) << "\n";
    return Exec(argv, 300s, echo);
  }
  // `gpuaasctl alloc create` (one slice in pool e2e, the guest's SSH key); the allocation id.
  static std::string Create(const std::string& request_id, const std::string& hostname) {
    auto r = Ctl({"-o", "json", "alloc", "create", "--tenant", "acme", "--request-id", request_id,
                  "--gpus", "1", "--region", "us-east-1", "--pool", "e2e", "--hostname", hostname,
                  "--ssh-key", Trim(ReadAll(w->guest + "/id_ed25519.pub"))},
                 false);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    auto j = nlohmann::json::parse(r.out, nullptr, false);
    if (j.is_discarded() || !j.contains("allocation")) {
      ADD_FAILURE() << "create output: " << r.out;
      return "";
    }
    std::string id = j["allocation"].value("allocation_id", "");
    std::cout << "allocation " << id << " is " << j["allocation"].value("state", "") << "\n";
    return id;
  }
  // `gpuaasctl alloc timeline --watch`: 0 settled active/released, 4 failed or blocked.
  static int Watch(const std::string& id) {
    return Ctl({"alloc", "timeline", "--id", id, "--watch", "--watch-timeout-s", "240"}).exit_code;
  }
  static v1::Allocation Get(const std::string& id) {
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    auto r = w->p.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
    EXPECT_TRUE(r.ok());
    return r.ok() ? r->allocation() : v1::Allocation();
  }
  static v1::GetAllocationTimelineResponse Timeline(const std::string& id) {
    v1::GetAllocationTimelineRequest r;
    r.set_allocation_id(id);
    r.set_page_size(500);
    auto t =
        w->p.Call<v1::GetAllocationTimelineResponse>("gpuaas.v1.scheduler.allocation.timeline", r);
    EXPECT_TRUE(t.ok());
    return t.ok() ? *t : v1::GetAllocationTimelineResponse();
  }
  static bool TimelineHas(const std::string& id, const std::string& step,
                          const std::string& stage = "") {
    const auto t = Timeline(id);
    for (const auto& e : t.entries()) {
      if (enums::Text(e.step()) == step && (stage.empty() || enums::Text(e.stage()) == stage)) {
        return true;
      }
    }
    return false;
  }
  static std::string DomainState(const std::string& id) {
    return Trim(Exec({Tool("virsh"), "-c", "qemu:///system", "domstate", "gpuaas-" + id}).out);
  }
  static bool DomainExists(const std::string& id) {
    return Exec({Tool("virsh"), "-c", "qemu:///system", "domstate", "gpuaas-" + id}).exit_code == 0;
  }
  // Filesystem signatures on the slot disk ("" when none).
  static std::string Signatures() {
    auto r = Exec({Tool("blkid"), "-p", "-o", "value", "-s", "TYPE", w->loop});
    return Trim(r.out);
  }
  static void Release(const std::string& id, int want_rc = 0) {
    EXPECT_EQ(
        Ctl({"alloc", "release", "--id", id, "--watch", "--watch-timeout-s", "240"}).exit_code,
        want_rc);
  }
  // `cmd` in the guest as root with `key`, from inside the slice network's namespace.
  static node_agent::ToolResult Ssh(const std::string& key, const std::string& ip,
                                    const std::string& cmd) {
    return Exec(
        {Tool("ip"), "netns", "exec", w->netns, Tool("ssh"), "-i", key, "-o",
         "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
         "-o", "ConnectTimeout=10", "-o", "BatchMode=yes", "root@" + ip, cmd},
        60s);
  }
  static long RssKib() {
    std::ifstream f(fmt::format("/proc/{}/status", w->agent->pid()));
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    }
    return -1;
  }
};

TEST_F(SliceE2eTest, ProvisionsAReachableSliceAndReleasesItWithAWipeProof) {
  const std::string id = Create("e2e-happy", "e2e-slice-1");
  ASSERT_FALSE(id.empty());
  ASSERT_EQ(Watch(id), 0) << "the slice did not become active";
  auto a = Get(id);
  ASSERT_EQ(a.state(), v1::ALLOCATION_STATE_ACTIVE);
  ASSERT_TRUE(a.has_network());
  EXPECT_EQ(a.network().lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(a.network().actual_ip(), a.network().expected_ip());
  EXPECT_TRUE(DomainExists(id));
  EXPECT_EQ(Slots()[0].lifecycle(), v1::SLOT_LIFECYCLE_STATE_ACTIVE);

  // The tenant's view: SSH with the key from the request into the hostname from the request,
  // UEFI firmware, and the catalog image (ext4) on the slice disk.
  auto ssh = Ssh(w->guest + "/id_ed25519", a.network().actual_ip(),
                 "hostname; [ -d /sys/firmware/efi ] && echo efi; "
                 "dd if=/dev/vda bs=1 skip=1080 count=2 2>/dev/null | od -An -tx1");
  EXPECT_EQ(ssh.exit_code, 0) << ssh.err;
  EXPECT_NE(ssh.out.find("e2e-slice-1\n"), std::string::npos) << ssh.out;
  EXPECT_NE(ssh.out.find("efi\n"), std::string::npos) << ssh.out;
  EXPECT_NE(ssh.out.find("53 ef"), std::string::npos) << ssh.out;  // ext4 magic on vda
  EXPECT_EQ(Signatures(), "ext4");
  // The node's terminal relay key (created by the agent, seeded into every VM) gets in too:
  // the path the audited console takes.
  auto relay = Ssh(w->state_dir + "/terminal/id_ed25519", a.network().actual_ip(), "echo relay-ok");
  EXPECT_EQ(relay.exit_code, 0) << relay.err;
  EXPECT_EQ(Trim(relay.out), "relay-ok");

  Release(id);
  a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_RELEASED);
  for (const auto& c : a.claims()) EXPECT_TRUE(c.has_released_at());
  EXPECT_TRUE(TimelineHas(id, "claims_freed"));
  EXPECT_FALSE(DomainExists(id));
  EXPECT_EQ(Signatures(), "") << "the wipe left a signature";
  EXPECT_FALSE(fs::exists("/var/lib/libvirt/qemu/nvram/gpuaas-" + id + "_VARS.fd"));
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AMountedDiskIsRefusedBeforeAnyWriteAndStaysBlockedUntilUnmounted) {
  ASSERT_EQ(Exec({Tool("mkfs.ext4"), "-q", "-F", "-L", "tenant-data", w->loop}).exit_code, 0);
  w->mnt = w->work + "/mnt";
  fs::create_directories(w->mnt);
  ASSERT_EQ(Exec({Tool("mount"), w->loop, w->mnt}, 30s).exit_code, 0);
  std::ofstream(w->mnt + "/precious") << "do not wipe";
  const std::string id = Create("e2e-mounted", "e2e-slice-2");
  ASSERT_FALSE(id.empty());
  EXPECT_EQ(Watch(id), 4);
  auto a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_FAILED);
  EXPECT_EQ(a.failure().code(), "disk_mounted");
  EXPECT_TRUE(TimelineHas(id, "task_rejected", "validate"));
  EXPECT_FALSE(DomainExists(id));
  // Cleanup refuses the mounted disk too: the slot is cleanup_blocked, nothing was written.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return Slots()[0].lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED; }, 30s));
  EXPECT_EQ(ReadAll(w->mnt + "/precious"), "do not wipe");
  ASSERT_EQ(Exec({Tool("umount"), w->mnt}, 30s).exit_code, 0);
  w->mnt.clear();
  EXPECT_EQ(Signatures(), "ext4");

  // The operator unmounted it; releasing again retries the cleanup, which now wipes. The
  // allocation stays failed (that is its record); its slot is freed.
  Release(id);
  auto a2 = Get(id);
  EXPECT_EQ(a2.state(), v1::ALLOCATION_STATE_FAILED);
  for (const auto& c : a2.claims()) EXPECT_TRUE(c.has_released_at());
  EXPECT_EQ(Signatures(), "");
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AGuestThatNeverGetsALeaseFailsWithANetworkingReason) {
  // DHCP requests from the slice bridge are dropped inside the namespace.
  const std::vector<std::string> rule = {"INPUT", "-p", "udp", "--dport", "67", "-j", "DROP"};
  auto ipt = [&](const std::string& op) {
    std::vector<std::string> argv = {Tool("ip"), "netns", "exec", w->netns, Tool("iptables"), op};
    argv.insert(argv.end(), rule.begin(), rule.end());
    return Exec(argv).exit_code;
  };
  ASSERT_EQ(ipt("-I"), 0);
  const std::string id = Create("e2e-nolease", "e2e-slice-3");
  ASSERT_FALSE(id.empty());
  // The slot is cleanup_blocked from the failure until the cleanup proof arrives.
  bool saw_blocked = false;
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        auto s = Slots();
        saw_blocked = saw_blocked ||
                      (!s.empty() && s[0].lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED);
        return Get(id).state() == v1::ALLOCATION_STATE_FAILED && !Timeline(id).in_flight();
      },
      180s, 200ms));
  EXPECT_EQ(ipt("-D"), 0);
  auto a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_FAILED);
  EXPECT_EQ(a.failure().code(), "lease_timeout");
  EXPECT_TRUE(TimelineHas(id, "task_failed", "readiness"));
  EXPECT_TRUE(saw_blocked) << "the failed slot was never cleanup_blocked";
  EXPECT_TRUE(TimelineHas(id, "claims_freed")) << "cleanup proof did not free the claim";
  EXPECT_FALSE(DomainExists(id));
  EXPECT_EQ(Signatures(), "");
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AnAgentKilledMidProvisionAdoptsTheRunningVmAfterRestart) {
  const std::string id = Create("e2e-kill", "e2e-slice-4");
  ASSERT_FALSE(id.empty());
  // Kill -9 once the domain runs (the guest is booting; readiness not reached).
  ASSERT_TRUE(testing::WaitFor([&] { return DomainState(id) == "running"; }, 120s, 100ms));
  w->agent->Signal(SIGKILL);
  w->agent->Stop(5s);  // reaps it
  std::cout << "agent killed while provisioning " << id << "\n";
  EXPECT_TRUE(DomainExists(id)) << "the VM must outlive its agent";
  StartAgent();  // ready only after adoption
  EXPECT_EQ(Watch(id), 0);
  auto a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_ACTIVE);
  EXPECT_TRUE(TimelineHas(id, "task_progress", "adopt")) << "readiness was not resumed";
  // The restarted agent found the VM in libvirt and in its ledger: adopted, no drift.
  auto metrics =
      Exec({Tool("curl"), "-sf", fmt::format("http://127.0.0.1:{}/metrics", w->http_port)});
  EXPECT_NE(metrics.out.find("gpuaas_node_agent_adopted_domains{result=\"adopted\"} 1"),
            std::string::npos)
      << metrics.out;
  EXPECT_NE(metrics.out.find("gpuaas_node_agent_adopted_domains{result=\"orphan\"} 0"),
            std::string::npos);
  Release(id);
  EXPECT_EQ(Get(id).state(), v1::ALLOCATION_STATE_RELEASED);
  EXPECT_FALSE(DomainExists(id));
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AgentRssStaysSmallAndSteadyOverRepeatedCycles) {
  std::vector<long> rss;
  for (int i = 0; i < 3; ++i) {
    const std::string id = Create(fmt::format("e2e-cycle-{}", i), fmt::format("e2e-cycle-{}", i));
    ASSERT_FALSE(id.empty());
    ASSERT_EQ(Watch(id), 0);
    Release(id);
    ASSERT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
    rss.push_back(RssKib());
    std::cout << fmt::format("cycle {}: agent RSS {} KiB\n", i + 1, rss.back());
  }
  for (long r : rss) EXPECT_LT(r, 64 * 1024) << "agent RSS above 64 MiB";
  EXPECT_LT(rss.back() - rss.front(), 4 * 1024) << "agent RSS grew by more than 4 MiB";
}

}  // namespace
}  // namespace gpuaas
