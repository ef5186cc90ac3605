// The node scheduler (bundle validation, lease ledger) and the simulated VM runtime, on fixture
// hosts written by BuildFixtureHost.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "bundle_fixture.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;

const std::string kAlloc = "0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0b";
const std::string kOther = "0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0c";
const std::string kDigest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";

// A fixture host and a local store that remove themselves.
class Sandbox {
 public:
  explicit Sandbox(const FixtureOptions& o = {})
      : host_(testing::MakeTempDir("gpuaas-host")), state_(testing::MakeTempDir("gpuaas-state")) {
    auto r = BuildFixtureHost(host_, o);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
    auto s = LocalStore::Open(state_);
    EXPECT_TRUE(s.ok());
    store_.emplace(std::move(*s));
  }
  ~Sandbox() {
    std::error_code ec;
    fs::remove_all(host_, ec);
    fs::remove_all(state_, ec);
  }
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  const std::string& root() const { return host_; }
  LocalStore& store() { return *store_; }
  v1::TopologyReport Devices() const {
    auto r = DiscoverDevices(host_);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
    return r.ok() ? *r : v1::TopologyReport{};
  }
  // Full discovery, for its candidate slots (what inventory approves and the scheduler sends).
  v1::TopologyReport Report() const {
    DiscoveryOptions d;
    d.root = host_;
    d.node_id = "node-a";
    d.libvirt_uri = "";
    auto r = Discover(d);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
    return r.ok() ? *r : v1::TopologyReport{};
  }
  // A bundle of the first `n` candidate slots.
  v1::ProvisionBundle Bundle(int n, const std::string& alloc = kAlloc) const {
    auto b = testing::BundleFromCandidates(Report(), n, alloc);
    b.mutable_image()->set_name("ubuntu-24.04-cuda");
    b.mutable_image()->set_url("https://images.example/ubuntu-24.04-cuda.qcow2");
    b.mutable_image()->set_sha256(kDigest);
    b.mutable_cloud_init()->add_ssh_authorized_keys("ssh-ed25519 AAAA test");
    b.mutable_shape()->set_profile("h200_24c_64g");
    b.mutable_shape()->set_vcpus(24 * n);
    b.mutable_shape()->set_memory_mib(65536LL * n);
    return b;
  }
  // Adds a line to the host's /proc/self/mounts (something mounted a disk behind our back).
  void Mount(const std::string& line) {
    std::ofstream f(fs::path(host_) / "proc/self/mounts", std::ios::app);
    f << line << "\n";
  }

 private:
  std::string host_;
  std::string state_;
  std::optional<LocalStore> store_;
};

const v1::NvmeDevice* DiskWhere(const v1::TopologyReport& rep,
                                const std::function<bool(const v1::NvmeDevice&)>& pred) {
  for (const auto& d : rep.nvme()) {
    if (pred(d)) return &d;
  }
  return nullptr;
}

struct Progress {
  std::string stage;
  std::string detail;
  int percent;
};

// Records progress events.
struct Recorder {
  std::vector<Progress> events;
  ProgressFn Fn() {
    return [this](const std::string& s, const std::string& d, int p) {
      events.push_back({s, d, p});
    };
  }
  std::vector<std::string> Stages() const {
    std::vector<std::string> v;
    for (const auto& e : events) v.push_back(e.stage);
    return v;
  }
};

// ---- ValidateBundle ----

TEST(ValidateBundleTest, AcceptsApprovedCandidatesAndPlansEveryStage) {
  Sandbox sb;
  auto b = sb.Bundle(2);
  ASSERT_EQ(b.slots_size(), 2);
  ASSERT_FALSE(b.slots(0).fabric_vf_pci_address().empty());
  ASSERT_FALSE(b.slots(0).nvme_by_id().empty());
  auto plan = ValidateBundle(b, sb.Devices());
  ASSERT_TRUE(plan.ok()) << plan.error().ToString();
  std::vector<std::string> stages;
  for (const auto& step : *plan) {
    const std::string stage = step.substr(0, step.find(':'));
    if (stages.empty() || stages.back() != stage) stages.push_back(stage);
  }
  EXPECT_EQ(stages,
            (std::vector<std::string>{"lease", "image", "seed", "define", "start", "readiness"}));
  auto has = [&](const std::string& text) {
    for (const auto& step : *plan) {
      if (step.find(text) != std::string::npos) return true;
    }
    return false;
  };
  EXPECT_TRUE(has("attach GPU " + b.slots(1).gpu_pci_address()));
  EXPECT_TRUE(has("VF " + b.slots(0).fabric_vf_pci_address()));
  EXPECT_TRUE(has("attach NVMe " + b.slots(1).nvme_by_id()));
  EXPECT_TRUE(has("gpuaas-" + kAlloc));
  EXPECT_TRUE(has(b.slots(0).mac() + " -> " + b.slots(0).private_ip()));
  EXPECT_TRUE(has("sha256:" + kDigest));
}

TEST(ValidateBundleTest, SlotsWithoutDiskOrFabricAreFine) {
  Sandbox sb;
  auto b = sb.Bundle(1);
  b.mutable_slots(0)->clear_nvme_by_id();
  b.mutable_slots(0)->clear_fabric_vf_pci_address();
  auto plan = ValidateBundle(b, sb.Devices());
  ASSERT_TRUE(plan.ok()) << plan.error().ToString();
  for (const auto& step : *plan) {
    EXPECT_EQ(step.find("NVMe"), std::string::npos) << step;
    EXPECT_EQ(step.find(" VF "), std::string::npos) << step;
  }
}

TEST(ValidateBundleTest, EveryRuleHasItsOwnReason) {
  Sandbox sb;
  const auto host = sb.Devices();
  const auto good = sb.Bundle(2);
  const auto* os = DiskWhere(host, [](const v1::NvmeDevice& d) { return d.os_disk(); });
  ASSERT_NE(os, nullptr);
  std::string pf;
  for (const auto& f : host.fabric()) {
    if (!f.is_vf()) pf = f.pci_address();
  }
  ASSERT_FALSE(pf.empty());
  struct Case {
    std::string reason;
    std::function<void(v1::ProvisionBundle&)> mutate;
  };
  const std::vector<Case> cases = {
      {"bundle_empty", [](auto& b) { b.clear_slots(); }},
      {"invalid_allocation_id", [](auto& b) { b.set_allocation_id("alloc-1"); }},
      {"invalid_allocation_id", [](auto& b) { b.set_allocation_id("../../etc/passwd"); }},
      {"shape_invalid", [](auto& b) { b.mutable_shape()->set_vcpus(0); }},
      {"shape_invalid", [](auto& b) { b.mutable_shape()->set_memory_mib(-1); }},
      {"invalid_image_digest", [](auto& b) { b.mutable_image()->clear_sha256(); }},
      {"invalid_image_digest", [](auto& b) { b.mutable_image()->set_sha256(kDigest.substr(1)); }},
      {"invalid_image_digest",
       [](auto& b) {
         std::string upper = kDigest;
         upper[0] = 'F';
         b.mutable_image()->set_sha256(upper);
       }},
      {"invalid_mac", [](auto& b) { b.mutable_slots(1)->set_mac(""); }},
      {"invalid_mac", [](auto& b) { b.mutable_slots(1)->set_mac("52:54:00:zz:00:01"); }},
      {"invalid_mac", [](auto& b) { b.mutable_slots(1)->set_mac("52-54-00-00-00-01"); }},
      {"invalid_mac", [](auto& b) { b.mutable_slots(1)->set_mac("01:00:5e:00:00:01"); }},
      {"invalid_ip", [](auto& b) { b.mutable_slots(1)->set_private_ip(""); }},
      {"invalid_ip", [](auto& b) { b.mutable_slots(1)->set_private_ip("10.100.0.256"); }},
      {"invalid_ip", [](auto& b) { b.mutable_slots(1)->set_private_ip("10.100.0"); }},
      {"invalid_ip", [](auto& b) { b.mutable_slots(1)->set_private_ip("10.100.0.011"); }},
      {"gpu_not_found", [](auto& b) { b.mutable_slots(1)->set_gpu_pci_address("0000:ff:00.0"); }},
      {"gpu_not_found", [](auto& b) { b.mutable_slots(1)->clear_gpu_pci_address(); }},
      // The ASPEED VGA is a display device, not a GPU.
      {"gpu_not_found", [](auto& b) { b.mutable_slots(1)->set_gpu_pci_address("0000:03:00.0"); }},
      {"fabric_vf_not_found",
       [](auto& b) { b.mutable_slots(1)->set_fabric_vf_pci_address("0000:ff:00.1"); }},
      {"fabric_vf_not_found",
       [&](auto& b) { b.mutable_slots(1)->set_fabric_vf_pci_address(pf); }},  // a PF, not a VF
      {"disk_not_found",
       [](auto& b) { b.mutable_slots(1)->set_nvme_by_id("/dev/disk/by-id/nvme-eui.ffff"); }},
      {"os_disk", [&](auto& b) { b.mutable_slots(1)->set_nvme_by_id(os->by_id_path()); }},
      {"duplicate_resource",
       [](auto& b) { b.mutable_slots(1)->set_gpu_pci_address(b.slots(0).gpu_pci_address()); }},
      {"duplicate_resource", [](auto& b) { b.mutable_slots(1)->set_mac(b.slots(0).mac()); }},
  };
  for (const auto& c : cases) {
    auto b = good;
    c.mutate(b);
    auto r = ValidateBundle(b, host);
    ASSERT_FALSE(r.ok()) << c.reason;
    EXPECT_EQ(r.error().reason, c.reason) << r.error().ToString();
    EXPECT_EQ(r.error().details.at("stage"), "validate") << c.reason;
    EXPECT_FALSE(r.error().message.empty());
  }
}

TEST(ValidateBundleTest, MountedDisksAreNeverUsed) {
  FixtureOptions o;
  o.gpus = 3;
  o.mounted_nvme = 1;
  o.mounted_child_nvme = 2;
  Sandbox sb(o);
  const auto host = sb.Devices();
  const auto* whole = DiskWhere(
      host, [](const v1::NvmeDevice& d) { return !d.mountpoints().empty() && !d.os_disk(); });
  ASSERT_NE(whole, nullptr);
  EXPECT_EQ(whole->mountpoints(0), "/scratch");
  const auto* child = DiskWhere(host, [](const v1::NvmeDevice& d) {
    return !d.os_disk() && d.partitions_size() > 0 && d.partitions(0).mountpoints_size() > 0;
  });
  ASSERT_NE(child, nullptr);
  auto b = sb.Bundle(1);
  b.mutable_slots(0)->set_nvme_by_id(whole->by_id_path());
  auto r = ValidateBundle(b, host);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "disk_mounted");
  EXPECT_EQ(r.error().details.at("mountpoint"), "/scratch");
  EXPECT_EQ(r.error().details.at("stage"), "validate");
  b.mutable_slots(0)->set_nvme_by_id(child->by_id_path());
  r = ValidateBundle(b, host);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "disk_child_mounted");
  EXPECT_EQ(r.error().details.at("mountpoint"), "/share 1");
}

TEST(ValidateBundleTest, SyntaxHelpers) {
  EXPECT_TRUE(IsValidMac("52:54:00:91:45:28"));
  EXPECT_TRUE(IsValidMac("52:54:00:AB:cd:EF"));
  EXPECT_FALSE(IsValidMac("ff:ff:ff:ff:ff:ff"));
  EXPECT_FALSE(IsValidMac("00:00:00:00:00:00"));
  EXPECT_FALSE(IsValidMac("52:54:00:91:45:2"));
  EXPECT_TRUE(IsValidIpv4("10.100.0.10"));
  EXPECT_TRUE(IsValidIpv4("0.0.0.1"));
  EXPECT_FALSE(IsValidIpv4("0.0.0.0"));
  EXPECT_FALSE(IsValidIpv4("10.100.0.10.1"));
  EXPECT_FALSE(IsValidIpv4("10..0.1"));
  EXPECT_FALSE(IsValidIpv4("10.100.0.-1"));
  EXPECT_TRUE(IsValidSha256(kDigest));
  EXPECT_FALSE(IsValidSha256(kDigest + "0"));
}

// ---- Lease ledger ----

TEST(LeaseTest, AnotherAllocationsSlotIsRefusedTheSameAllocationMayReLease) {
  Sandbox sb;
  auto& st = sb.store();
  ASSERT_TRUE(TakeLease(st, kAlloc, {"gpu-a", "gpu-b"}, 1).ok());
  auto r = TakeLease(st, kOther, {"gpu-c", "gpu-b"}, 1);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "slot_leased");
  EXPECT_EQ(r.error().details.at("stage"), "lease");
  EXPECT_EQ(r.error().details.at("slot_key"), "gpu-b");
  EXPECT_EQ(r.error().details.at("holder"), kAlloc);
  EXPECT_FALSE(st.Get("lease-" + kOther)->has_value());  // nothing half-taken
  // Idempotent for its holder: a second attempt replaces the record.
  ASSERT_TRUE(TakeLease(st, kAlloc, {"gpu-a", "gpu-b"}, 2).ok());
  auto rec = st.Get("lease-" + kAlloc);
  ASSERT_TRUE(rec.ok() && rec->has_value());
  EXPECT_EQ((**rec)["attempt"], 2);
  EXPECT_EQ((**rec)["slots"], nlohmann::json::array({"gpu-a", "gpu-b"}));
  EXPECT_EQ(LeaseHolder(st, "gpu-b"), kAlloc);
  EXPECT_EQ(LeaseHolder(st, "gpu-b", kAlloc), "");
  EXPECT_EQ(LeaseHolder(st, "gpu-c"), "");
  ASSERT_TRUE(TakeLease(st, kOther, {"gpu-c"}, 1).ok());
  ASSERT_TRUE(DropLease(st, kAlloc).ok());
  ASSERT_TRUE(DropLease(st, kAlloc).ok());  // dropping twice is fine
  EXPECT_TRUE(TakeLease(st, kOther, {"gpu-c", "gpu-b"}, 2).ok());
  EXPECT_EQ(TakeLease(st, "not-a-uuid", {"gpu-z"}, 1).error().reason, "invalid_allocation_id");
}

// ---- SimulatedRuntime ----

SimOptions Sim(const Sandbox& sb, const std::string& behavior = "succeed") {
  return SimOptions{sb.root(), behavior, 0, nullptr, nullptr};
}

v1::CleanupParams CleanupOf(const v1::ProvisionBundle& b) {
  v1::CleanupParams p;
  p.set_allocation_id(b.allocation_id());
  *p.mutable_slots() = b.slots();
  return p;
}

v1::ReleaseParams ReleaseOf(const v1::ProvisionBundle& b) {
  v1::ReleaseParams p;
  p.set_allocation_id(b.allocation_id());
  for (const auto& s : b.slots()) p.add_slot_keys(s.slot_key());
  p.set_graceful_timeout_s(30);
  return p;
}

TEST(SimulatedRuntimeTest, ProvisionReleaseCleanupRoundTrip) {
  Sandbox sb;
  SimulatedRuntime rt(sb.store(), Sim(sb));
  const auto b = sb.Bundle(2);
  Recorder rec;
  auto out = rt.Provision(b, rec.Fn());
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_EQ(out->domain_name(), "gpuaas-" + kAlloc);
  EXPECT_EQ(out->mac(), b.slots(0).mac());
  EXPECT_EQ(out->expected_ip(), b.slots(0).private_ip());
  EXPECT_EQ(out->actual_ip(), out->expected_ip());
  EXPECT_EQ(out->lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(out->runtime(), v1::VM_RUNTIME_SIMULATED);
  EXPECT_GE(out->plan_size(), 8);
  EXPECT_EQ(rec.Stages(), (std::vector<std::string>{"validate", "lease", "image", "image", "image",
                                                    "seed", "define", "start", "readiness"}));
  EXPECT_EQ(rec.events[2].percent, 0);
  EXPECT_EQ(rec.events[3].percent, 50);
  EXPECT_EQ(rec.events[4].percent, 100);
  for (const auto& e : rec.events) EXPECT_FALSE(e.detail.empty()) << e.stage;
  auto dom = sb.store().Get("domain-" + kAlloc);
  ASSERT_TRUE(dom.ok() && dom->has_value());
  EXPECT_EQ((**dom)["name"], "gpuaas-" + kAlloc);
  EXPECT_EQ((**dom)["state"], "running");
  EXPECT_EQ((**dom)["slots"],
            nlohmann::json::array({b.slots(0).slot_key(), b.slots(1).slot_key()}));
  EXPECT_EQ(LeaseHolder(sb.store(), b.slots(1).slot_key()), kAlloc);

  // The same allocation again (a retried attempt) is fine; another one on its slot is not.
  auto again = b;
  again.set_attempt(2);
  EXPECT_TRUE(rt.Provision(again, [](auto&&...) {}).ok());
  auto other = sb.Bundle(2, kOther);
  Recorder rec2;
  auto refused = rt.Provision(other, rec2.Fn());
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.error().reason, "slot_leased");
  EXPECT_EQ(refused.error().details.at("stage"), "lease");
  EXPECT_EQ(rec2.Stages(), (std::vector<std::string>{"validate"}));
  EXPECT_FALSE(sb.store().Get("domain-" + kOther)->has_value());

  Recorder rel;
  auto released = rt.Release(ReleaseOf(b), rel.Fn());
  ASSERT_TRUE(released.ok()) << released.error().ToString();
  EXPECT_EQ(released->stop(), v1::STOP_METHOD_GRACEFUL);
  EXPECT_EQ(released->domain_name(), "gpuaas-" + kAlloc);
  EXPECT_EQ(released->runtime(), v1::VM_RUNTIME_SIMULATED);
  EXPECT_FALSE(sb.store().Get("domain-" + kAlloc)->has_value());
  EXPECT_EQ(LeaseHolder(sb.store(), b.slots(0).slot_key()), kAlloc);  // until cleaned

  Recorder cl;
  auto cleaned = rt.Cleanup(CleanupOf(b), cl.Fn());
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  EXPECT_EQ(cleaned->runtime(), v1::VM_RUNTIME_SIMULATED);
  ASSERT_EQ(cleaned->proofs_size(), 2);
  for (int i = 0; i < 2; ++i) {
    const auto& p = cleaned->proofs(i);
    EXPECT_EQ(p.slot_key(), b.slots(i).slot_key());
    EXPECT_EQ(p.nvme_by_id(), b.slots(i).nvme_by_id());
    EXPECT_EQ(p.method(), v1::WIPE_METHOD_SIMULATED);
    EXPECT_FALSE(p.signatures_remaining());
    EXPECT_TRUE(p.domain_undefined());
    EXPECT_TRUE(p.network_state_removed());
    EXPECT_GT(p.verified_at().seconds(), 0);
  }
  EXPECT_FALSE(cl.events.empty());
  EXPECT_EQ(LeaseHolder(sb.store(), b.slots(0).slot_key()), "");
  EXPECT_FALSE(sb.store().Get("lease-" + kAlloc)->has_value());
  // Cleaning again is harmless, and the slots are free for the next allocation.
  EXPECT_TRUE(rt.Cleanup(CleanupOf(b), [](auto&&...) {}).ok());
  EXPECT_TRUE(rt.Provision(other, [](auto&&...) {}).ok());
}

// The hooks decide the proofs and each says how it went; an unset exposure hook means the node
// has no exposure state (true, no line).
TEST(SimulatedRuntimeTest, CleanupHooksDecideTheProofs) {
  Sandbox sb;
  SimOptions opts = Sim(sb);
  std::vector<std::string> called;
  opts.network_cleanup = [&](const v1::CleanupParams& p) -> Result<void> {
    called.push_back("network " + p.allocation_id());
    return Ok();
  };
  opts.exposure_cleanup = [&](const v1::CleanupParams& p) -> Result<void> {
    called.push_back("exposure " + p.allocation_id());
    return Error::Unavailable("exposure_still_mapped", "10.100.0.2 is still exposed");
  };
  SimulatedRuntime rt(sb.store(), opts);
  const auto b = sb.Bundle(1);
  ASSERT_TRUE(rt.Provision(b, [](auto&&...) {}).ok());
  Recorder rec;
  auto cleaned = rt.Cleanup(CleanupOf(b), rec.Fn());
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  EXPECT_EQ(called, (std::vector<std::string>{"network " + kAlloc, "exposure " + kAlloc}));
  ASSERT_EQ(cleaned->proofs_size(), 1);
  EXPECT_TRUE(cleaned->proofs(0).network_state_removed());
  EXPECT_FALSE(cleaned->proofs(0).exposure_state_removed());
  std::map<std::string, std::string> said;
  for (const auto& e : rec.events) said[e.stage] = e.detail;
  EXPECT_EQ(said["network"], "the allocation's network state removed (DHCP leases released)");
  EXPECT_EQ(
      said["exposure"],
      "exposure cleanup failed: " +
          Error::Unavailable("exposure_still_mapped", "10.100.0.2 is still exposed").ToString());

  SimulatedRuntime plain(sb.store(), Sim(sb));
  ASSERT_TRUE(plain.Provision(b, [](auto&&...) {}).ok());
  Recorder rec2;
  auto again = plain.Cleanup(CleanupOf(b), rec2.Fn());
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  EXPECT_TRUE(again->proofs(0).network_state_removed());
  EXPECT_TRUE(again->proofs(0).exposure_state_removed());
  const auto stages = rec2.Stages();
  EXPECT_EQ(std::count(stages.begin(), stages.end(), "exposure"), 0);
  EXPECT_EQ(std::count(stages.begin(), stages.end(), "network"), 1);
}

TEST(SimulatedRuntimeTest, ReleaseOfAnAbsentDomainSucceeds) {
  Sandbox sb;
  SimulatedRuntime rt(sb.store(), Sim(sb));
  Recorder rec;
  v1::ReleaseParams p;
  p.set_allocation_id(kAlloc);
  auto r = rt.Release(p, rec.Fn());
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->stop(), v1::STOP_METHOD_ABSENT);
  EXPECT_EQ(r->domain_name(), "gpuaas-" + kAlloc);
  EXPECT_EQ(r->runtime(), v1::VM_RUNTIME_SIMULATED);
  p.set_allocation_id("x/../../y");
  auto bad = rt.Release(p, rec.Fn());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "invalid_allocation_id");
  EXPECT_EQ(bad.error().details.at("stage"), "release");
}

TEST(SimulatedRuntimeTest, CleanupRefusesADiskMountedSinceProvisioning) {
  Sandbox sb;
  SimulatedRuntime rt(sb.store(), Sim(sb));
  const auto b = sb.Bundle(2);
  ASSERT_TRUE(rt.Provision(b, [](auto&&...) {}).ok());
  std::string kname;
  const auto rep = sb.Report();
  for (const auto& c : rep.candidates()) {
    if (c.slot_key() == b.slots(1).slot_key()) kname = c.nvme_kernel_name();
  }
  ASSERT_FALSE(kname.empty());
  sb.Mount("/dev/" + kname + " /mnt/data ext4 rw,relatime 0 0");
  Recorder rec;
  auto r = rt.Cleanup(CleanupOf(b), rec.Fn());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "disk_mounted");
  EXPECT_EQ(r.error().details.at("stage"), "cleanup");
  EXPECT_EQ(r.error().details.at("slot_key"), b.slots(1).slot_key());
  EXPECT_EQ(r.error().details.at("mountpoint"), "/mnt/data");
  // Refused before anything was touched: no wipe, the domain and the lease are still there.
  EXPECT_TRUE(rec.events.empty());
  EXPECT_TRUE(sb.store().Get("domain-" + kAlloc)->has_value());
  EXPECT_EQ(LeaseHolder(sb.store(), b.slots(0).slot_key()), kAlloc);

  // The OS disk named: refused as well.
  auto host = sb.Devices();
  const auto* os = DiskWhere(host, [](const v1::NvmeDevice& d) { return d.os_disk(); });
  ASSERT_NE(os, nullptr);
  auto p = CleanupOf(b);
  p.mutable_slots(1)->set_nvme_by_id(os->by_id_path());
  r = rt.Cleanup(p, rec.Fn());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "os_disk");
}

TEST(SimulatedRuntimeTest, CleanupRefusesAMountedChildPartition) {
  FixtureOptions o;
  o.gpus = 2;
  o.mounted_child_nvme = 1;
  Sandbox sb(o);
  SimulatedRuntime rt(sb.store(), Sim(sb));
  const auto host = sb.Devices();
  const auto* child = DiskWhere(
      host, [](const v1::NvmeDevice& d) { return d.partitions_size() > 0 && !d.os_disk(); });
  ASSERT_NE(child, nullptr);
  v1::CleanupParams p;
  p.set_allocation_id(kAlloc);
  auto* s = p.add_slots();
  s->set_slot_key("gpu-0000:2d:00.0");
  s->set_nvme_by_id(child->by_id_path());
  auto r = rt.Cleanup(p, [](auto&&...) {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "disk_child_mounted");
  EXPECT_EQ(r.error().details.at("stage"), "cleanup");
}

TEST(SimulatedRuntimeTest, CleanupNeverTouchesAnotherAllocationsSlot) {
  Sandbox sb;
  SimulatedRuntime rt(sb.store(), Sim(sb));
  const auto b = sb.Bundle(1);
  ASSERT_TRUE(rt.Provision(b, [](auto&&...) {}).ok());
  auto p = CleanupOf(b);
  p.set_allocation_id(kOther);
  auto r = rt.Cleanup(p, [](auto&&...) {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "slot_leased");
  EXPECT_EQ(r.error().details.at("holder"), kAlloc);
  EXPECT_TRUE(sb.store().Get("domain-" + kAlloc)->has_value());
}

TEST(SimulatedRuntimeTest, FailBehaviorTimesOutAtReadinessAndLeavesSomethingToCleanUp) {
  Sandbox sb;
  SimulatedRuntime rt(sb.store(), Sim(sb, "fail"));
  const auto b = sb.Bundle(1);
  Recorder rec;
  auto r = rt.Provision(b, rec.Fn());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "lease_timeout");
  EXPECT_EQ(r.error().details.at("stage"), "readiness");
  EXPECT_EQ(r.error().details.at("mac"), b.slots(0).mac());
  EXPECT_NE(r.error().message.find("no DHCP lease for " + b.slots(0).mac()), std::string::npos);
  EXPECT_EQ(rec.Stages().back(), "start");
  auto dom = sb.store().Get("domain-" + kAlloc);
  ASSERT_TRUE(dom.ok() && dom->has_value());
  EXPECT_EQ((**dom)["state"], "started");
  // Compensation still works in "fail" mode.
  auto rel = rt.Release(ReleaseOf(b), [](auto&&...) {});
  ASSERT_TRUE(rel.ok());
  EXPECT_EQ(rel->stop(), v1::STOP_METHOD_GRACEFUL);
  auto cl = rt.Cleanup(CleanupOf(b), [](auto&&...) {});
  ASSERT_TRUE(cl.ok());
  EXPECT_EQ(cl->proofs_size(), 1);
}

TEST(SimulatedRuntimeTest, ValidationFailuresLeaveNothingBehind) {
  Sandbox sb;
  SimulatedRuntime rt(sb.store(), Sim(sb));
  auto b = sb.Bundle(1);
  b.mutable_slots(0)->set_gpu_pci_address("0000:ff:00.0");
  Recorder rec;
  auto r = rt.Provision(b, rec.Fn());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "gpu_not_found");
  EXPECT_EQ(r.error().details.at("stage"), "validate");
  EXPECT_TRUE(rec.events.empty());
  EXPECT_TRUE(sb.store().Keys().empty());

  SimulatedRuntime gone(sb.store(),
                        SimOptions{sb.root() + "/missing", "succeed", 0, nullptr, nullptr});
  auto g = gone.Provision(sb.Bundle(1), rec.Fn());
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.error().reason, "host_root_missing");
  EXPECT_EQ(g.error().details.at("stage"), "validate");
}

}  // namespace
}  // namespace gpuaas::node_agent
