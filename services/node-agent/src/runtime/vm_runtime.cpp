#include "gpuaas/node_agent/runtime/vm_runtime.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <map>
#include <optional>
#include <set>
#include <thread>

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"

namespace gpuaas::node_agent {
namespace {

constexpr const char* kRuntime = "simulated";

}  // namespace

Error StageError(Code code, Reason reason, std::string message, const std::string& stage,
                 std::map<std::string, std::string> details) {
  details["stage"] = stage;
  return Error{code, reason.str(), std::move(message), std::move(details),
               code == Code::kUnavailable};
}

Error WithStage(Error e, const std::string& stage) {
  e.details["stage"] = stage;
  return e;
}

const v1::NvmeDevice* FindDisk(const v1::TopologyReport& host, const std::string& by_id) {
  for (const auto& d : host.nvme()) {
    if (d.by_id_path() == by_id) return &d;
  }
  return nullptr;
}

std::optional<Error> DiskInUse(const v1::NvmeDevice& d, const std::string& slot_key,
                               const std::string& stage) {
  std::map<std::string, std::string> det = {{"slot_key", slot_key}, {"nvme_by_id", d.by_id_path()}};
  if (d.os_disk()) {
    return StageError(Code::kFailedPrecondition, reason::kOsDisk,
                      fmt::format("{} holds the host's operating system", d.by_id_path()), stage,
                      det);
  }
  if (d.mountpoints_size() > 0) {
    det["mountpoint"] = d.mountpoints(0);
    return StageError(Code::kFailedPrecondition, reason::kDiskMounted,
                      fmt::format("{} is mounted at {}", d.by_id_path(), d.mountpoints(0)), stage,
                      det);
  }
  for (const auto& p : d.partitions()) {
    if (p.mountpoints_size() == 0) continue;
    det["partition"] = p.kernel_name();
    det["mountpoint"] = p.mountpoints(0);
    return StageError(Code::kFailedPrecondition, reason::kDiskChildMounted,
                      fmt::format("{}: partition {} is mounted at {}", d.by_id_path(),
                                  p.kernel_name(), p.mountpoints(0)),
                      stage, det);
  }
  return std::nullopt;
}

bool IsValidMac(const std::string& mac) {
  if (mac.size() != 17) return false;
  for (size_t i = 0; i < mac.size(); ++i) {
    const char c = mac[i];
    if (i % 3 == 2) {
      if (c != ':') return false;
    } else if (!std::isxdigit(static_cast<unsigned char>(c))) {
      return false;
    }
  }
  const int first = std::stoi(mac.substr(0, 2), nullptr, 16);
  if (first & 1) return false;  // multicast/broadcast
  return mac != "00:00:00:00:00:00";
}

bool IsValidIpv4(const std::string& ip) {
  int parts = 0;
  size_t i = 0;
  while (i <= ip.size()) {
    size_t j = ip.find('.', i);
    if (j == std::string::npos) j = ip.size();
    const std::string part = ip.substr(i, j - i);
    if (part.empty() || part.size() > 3 || (part.size() > 1 && part[0] == '0')) return false;
    if (!std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return false;
    }
    if (std::stoi(part) > 255) return false;
    ++parts;
    i = j + 1;
  }
  return parts == 4 && ip != "0.0.0.0";
}

bool IsValidSha256(const std::string& digest) {
  return digest.size() == 64 && std::all_of(digest.begin(), digest.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

Result<std::vector<std::string>> ValidateBundle(const v1::ProvisionBundle& b,
                                                const v1::TopologyReport& host) {
  const std::string kStage = "validate";
  auto invalid = [&](Reason reason, std::string message,
                     std::map<std::string, std::string> det = {}) {
    return StageError(Code::kInvalidArgument, reason, std::move(message), kStage, std::move(det));
  };
  auto missing = [&](Reason reason, std::string message, std::map<std::string, std::string> det) {
    return StageError(Code::kNotFound, reason, std::move(message), kStage, std::move(det));
  };
  if (b.slots_size() == 0) return invalid(reason::kBundleEmpty, "the bundle names no slots");
  if (!ids::IsUuid(b.allocation_id())) {
    return invalid(reason::kInvalidAllocationId,
                   "allocation id is not a UUID: '" + b.allocation_id() + "'",
                   {{"field", "allocation_id"}});
  }
  const auto& shape = b.shape();
  if (shape.vcpus() <= 0 || shape.memory_mib() <= 0 || shape.hugepages_1g() < 0) {
    return invalid(reason::kShapeInvalid,
                   fmt::format("VM shape needs vcpus > 0 and memory_mib > 0 (got {} vCPU, {} MiB, "
                               "{} 1G hugepages)",
                               shape.vcpus(), shape.memory_mib(), shape.hugepages_1g()),
                   {{"field", "shape"}});
  }
  if (!IsValidSha256(b.image().sha256())) {
    return invalid(reason::kInvalidImageDigest,
                   "image sha256 must be 64 lowercase hex digits, got '" + b.image().sha256() + "'",
                   {{"field", "image.sha256"}});
  }
  // Input syntax first (cheap, the sender's fault), then the host evidence.
  std::map<std::string, std::string> seen;  // resource -> slot_key
  for (const auto& s : b.slots()) {
    const std::map<std::string, std::string> det = {{"slot_key", s.slot_key()}};
    if (!IsValidMac(s.mac())) {
      auto d = det;
      d["field"] = "mac";
      return invalid(reason::kInvalidMac, "slot " + s.slot_key() + ": bad MAC '" + s.mac() + "'",
                     d);
    }
    if (!IsValidIpv4(s.private_ip())) {
      auto d = det;
      d["field"] = "private_ip";
      return invalid(reason::kInvalidIp,
                     "slot " + s.slot_key() + ": bad IPv4 '" + s.private_ip() + "'", d);
    }
    for (const auto& [kind, value] : {std::pair<std::string, std::string>{"slot", s.slot_key()},
                                      {"gpu", s.gpu_pci_address()},
                                      {"fabric_vf", s.fabric_vf_pci_address()},
                                      {"disk", s.nvme_by_id()},
                                      {"mac", s.mac()},
                                      {"ip", s.private_ip()}}) {
      if (value.empty()) continue;
      auto [it, fresh] = seen.emplace(fmt::format("{}/{}", kind, value), s.slot_key());
      if (!fresh) {
        return invalid(
            reason::kDuplicateResource,
            fmt::format("{} {} is named by slots {} and {}", kind, value, it->second, s.slot_key()),
            {{"slot_key", s.slot_key()}, {"field", kind}});
      }
    }
  }
  std::vector<std::string> plan;
  std::vector<std::string> slot_keys;
  std::vector<std::string> attach;
  for (const auto& s : b.slots()) {
    std::map<std::string, std::string> det = {{"slot_key", s.slot_key()}};
    slot_keys.push_back(s.slot_key());
    const bool gpu_here =
        !s.gpu_pci_address().empty() &&
        std::any_of(host.gpus().begin(), host.gpus().end(),
                    [&](const v1::GpuDevice& g) { return g.pci_address() == s.gpu_pci_address(); });
    if (!gpu_here) {
      det["gpu_pci_address"] = s.gpu_pci_address();
      return missing(
          reason::kGpuNotFound,
          "slot " + s.slot_key() + ": GPU '" + s.gpu_pci_address() + "' is not on this host", det);
    }
    attach.push_back("define: attach GPU " + s.gpu_pci_address() + " (slot " + s.slot_key() + ")");
    if (!s.fabric_vf_pci_address().empty()) {
      const bool vf_here =
          std::any_of(host.fabric().begin(), host.fabric().end(), [&](const v1::FabricDevice& f) {
            return f.is_vf() && f.pci_address() == s.fabric_vf_pci_address();
          });
      if (!vf_here) {
        det["fabric_vf_pci_address"] = s.fabric_vf_pci_address();
        return missing(reason::kFabricVfNotFound,
                       "slot " + s.slot_key() + ": fabric VF " + s.fabric_vf_pci_address() +
                           " is not on this host",
                       det);
      }
      attach.push_back("define: attach " +
                       (s.fabric_type() == v1::FABRIC_TYPE_UNSPECIFIED
                            ? std::string("fabric")
                            : enums::Text(s.fabric_type())) +
                       " VF " + s.fabric_vf_pci_address());
    }
    if (!s.nvme_by_id().empty()) {
      const auto* disk = FindDisk(host, s.nvme_by_id());
      if (!disk) {
        det["nvme_by_id"] = s.nvme_by_id();
        return missing(
            reason::kDiskNotFound,
            "slot " + s.slot_key() + ": NVMe " + s.nvme_by_id() + " is not among this host's disks",
            det);
      }
      if (auto e = DiskInUse(*disk, s.slot_key(), kStage)) return *e;
      attach.push_back("define: attach NVMe " + s.nvme_by_id());
    }
  }
  const auto& first = b.slots(0);
  const std::string domain = DomainName(b.allocation_id());
  plan.push_back(
      fmt::format("lease: slots {} (attempt {})", fmt::join(slot_keys, ","), b.attempt()));
  plan.push_back(
      fmt::format("image: fetch {} and verify sha256:{}", b.image().name(), b.image().sha256()));
  plan.push_back(fmt::format("seed: NoCloud seed (hostname {}, instance-id {}, {} ssh keys)",
                             b.cloud_init().hostname(), b.allocation_id(),
                             b.cloud_init().ssh_authorized_keys_size()));
  std::string numa = shape.has_numa_node() ? fmt::format(", NUMA node {}", shape.numa_node()) : "";
  plan.push_back(fmt::format("define: domain {} ({} vCPU, {} MiB, {} x 1G hugepages{})", domain,
                             shape.vcpus(), shape.memory_mib(), shape.hugepages_1g(), numa));
  plan.insert(plan.end(), attach.begin(), attach.end());
  plan.push_back("start: domain " + domain);
  plan.push_back(fmt::format("readiness: DHCP lease {} -> {}", first.mac(), first.private_ip()));
  return plan;
}

Result<v1::TopologyReport> DiscoverDevices(const std::string& root) {
  struct stat st {};
  if (root.empty() || ::stat(root.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Error::NotFound(reason::kHostRootMissing, "host root '" + root + "' is not a directory");
  }
  HostRoot host(root);
  v1::TopologyReport rep;
  rep.set_root(host.root());
  for (const auto& g : DiscoverGpus(host)) *rep.add_gpus() = g;
  for (const auto& d : DiscoverNvme(host)) *rep.add_nvme() = d;
  for (const auto& f : DiscoverFabric(host)) *rep.add_fabric() = f;
  return rep;
}

std::string LeaseHolder(const LocalStore& store, const std::string& slot_key,
                        const std::string& except_allocation) {
  for (const auto& key : store.Keys()) {
    if (key.rfind("lease-", 0) != 0) continue;
    std::string holder = key.substr(6);
    if (holder == except_allocation) continue;
    auto rec = store.Get(key);
    if (!rec.ok() || !rec->has_value()) continue;
    const auto& slots = (**rec).value("slots", nlohmann::json::array());
    for (const auto& s : slots) {
      if (s.is_string() && s.get<std::string>() == slot_key) return holder;
    }
  }
  return "";
}

Result<void> TakeLease(LocalStore& store, const std::string& allocation_id,
                       const std::vector<std::string>& slot_keys, int32_t attempt) {
  if (!ids::IsUuid(allocation_id)) {
    return StageError(Code::kInvalidArgument, reason::kInvalidAllocationId,
                      "allocation id is not a UUID: '" + allocation_id + "'", "lease");
  }
  for (const auto& k : slot_keys) {
    if (auto holder = LeaseHolder(store, k, allocation_id); !holder.empty()) {
      return StageError(Code::kFailedPrecondition, reason::kSlotLeased,
                        fmt::format("slot {} is leased by allocation {} on this host", k, holder),
                        "lease", {{"slot_key", k}, {"holder", holder}});
    }
  }
  nlohmann::json rec = {{"slots", slot_keys},
                        {"attempt", attempt},
                        {"leased_at", google::protobuf::util::TimeUtil::ToString(
                                          google::protobuf::util::TimeUtil::GetCurrentTime())}};
  if (auto w = store.Put(LeaseKey(allocation_id), rec); !w.ok()) {
    return WithStage(w.error(), "lease");
  }
  return Ok();
}

Result<void> LeaseBundleSlots(LocalStore& store, std::mutex& mu, const v1::ProvisionBundle& b,
                              const ProgressFn& progress) {
  std::vector<std::string> slot_keys;
  for (const auto& s : b.slots()) slot_keys.push_back(s.slot_key());
  {
    std::lock_guard lock(mu);
    if (auto r = TakeLease(store, b.allocation_id(), slot_keys, b.attempt()); !r.ok()) {
      return r.error();
    }
  }
  progress("lease",
           fmt::format("slots {} leased (attempt {})", fmt::join(slot_keys, ","), b.attempt()),
           100);
  return Ok();
}

std::string LeaseKey(const std::string& allocation_id) { return "lease-" + allocation_id; }
std::string DomainKey(const std::string& allocation_id) { return "domain-" + allocation_id; }

Result<void> PutDomainRecord(LocalStore& store, const v1::ProvisionBundle& b,
                             const std::string& state, const std::string& runtime) {
  std::vector<std::string> slot_keys;
  for (const auto& s : b.slots()) slot_keys.push_back(s.slot_key());
  const auto& first = b.slots(0);
  nlohmann::json rec = {{"name", DomainName(b.allocation_id())},
                        {"slots", slot_keys},
                        {"state", state},
                        {"attempt", b.attempt()},
                        {"mac", first.mac()},
                        {"ip", first.private_ip()},
                        {"runtime", runtime}};
  return store.Put(DomainKey(b.allocation_id()), rec);
}

bool RunCleanupHook(CleanupHookKind kind, const NetworkCleanupFn& hook,
                    const v1::CleanupParams& params, const ProgressFn& progress) {
  const bool network = kind == CleanupHookKind::kNetwork;
  const char* stage = network ? "network" : "exposure";
  auto r = hook(params);
  if (r.ok()) {
    progress(stage,
             network ? "the allocation's network state removed (DHCP leases released)"
                     : "no public exposure maps to the slots (document and kernel)",
             100);
  } else {
    progress(stage, fmt::format("{} cleanup failed: {}", stage, r.error().ToString()), 100);
  }
  return r.ok();
}

CleanupHooksOutcome RunCleanupHooks(const NetworkCleanupFn& network,
                                    const NetworkCleanupFn& exposure,
                                    const v1::CleanupParams& params, const ProgressFn& progress,
                                    bool unhooked_network_removed,
                                    const std::string& unhooked_network_line) {
  CleanupHooksOutcome out;
  if (network) {
    out.network_removed = RunCleanupHook(CleanupHookKind::kNetwork, network, params, progress);
  } else {
    out.network_removed = unhooked_network_removed;
    progress("network", unhooked_network_line, 100);
  }
  out.exposure_removed =
      !exposure || RunCleanupHook(CleanupHookKind::kExposure, exposure, params, progress);
  return out;
}

Result<void> CheckCleanup(const v1::CleanupParams& p, const LocalStore& store,
                          const v1::TopologyReport& devices, const std::string& stage) {
  if (!ids::IsUuid(p.allocation_id())) {
    return StageError(Code::kInvalidArgument, reason::kInvalidAllocationId,
                      "allocation id is not a UUID: '" + p.allocation_id() + "'", stage);
  }
  for (const auto& s : p.slots()) {
    if (auto holder = LeaseHolder(store, s.slot_key(), p.allocation_id()); !holder.empty()) {
      return StageError(
          Code::kFailedPrecondition, reason::kSlotLeased,
          fmt::format("slot {} is leased by allocation {}; refusing to clean it for {}",
                      s.slot_key(), holder, p.allocation_id()),
          stage, {{"slot_key", s.slot_key()}, {"holder", holder}});
    }
    if (s.nvme_by_id().empty()) continue;
    const auto* disk = FindDisk(devices, s.nvme_by_id());
    if (!disk) {
      return StageError(Code::kNotFound, reason::kDiskNotFound,
                        "slot " + s.slot_key() + ": NVMe " + s.nvme_by_id() +
                            " is not among this host's disks; cannot prove it clean",
                        stage, {{"slot_key", s.slot_key()}, {"nvme_by_id", s.nvme_by_id()}});
    }
    if (auto e = DiskInUse(*disk, s.slot_key(), stage)) return *e;
  }
  return Ok();
}

Result<void> DropLease(LocalStore& store, const std::string& allocation_id) {
  if (!ids::IsUuid(allocation_id)) {
    return StageError(Code::kInvalidArgument, reason::kInvalidAllocationId,
                      "allocation id is not a UUID: '" + allocation_id + "'", "lease");
  }
  return store.Erase(LeaseKey(allocation_id));
}

SimulatedRuntime::SimulatedRuntime(LocalStore& store, SimOptions opts)
    : store_(store), opts_(std::move(opts)) {}

void SimulatedRuntime::Step() const {
  if (opts_.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(opts_.step_ms));
}

Result<v1::ProvisionOutput> SimulatedRuntime::Provision(const v1::ProvisionBundle& b,
                                                        const ProgressFn& progress) {
  auto host = DiscoverDevices(opts_.host_root);
  if (!host.ok()) return WithStage(host.error(), "validate");
  auto plan = ValidateBundle(b, *host);
  if (!plan.ok()) return plan.error();
  progress("validate", fmt::format("node scheduler accepted a plan of {} steps", plan->size()),
           100);
  Step();

  const std::string domain = DomainName(b.allocation_id());
  const auto& first = b.slots(0);
  auto record = [&](const std::string& state) -> Result<void> {
    std::lock_guard lock(mu_);
    if (auto w = PutDomainRecord(store_, b, state, kRuntime); !w.ok()) {
      return WithStage(w.error(), state == "defined" ? "define" : "start");
    }
    return Ok();
  };
  if (auto r = LeaseBundleSlots(store_, mu_, b, progress); !r.ok()) return r.error();
  Step();

  progress("image", "fetching " + b.image().name() + " (simulated)", 0);
  Step();
  progress("image", "fetching " + b.image().name() + " (simulated)", 50);
  Step();
  progress("image", "sha256:" + b.image().sha256() + " verified (simulated)", 100);

  Step();
  progress("seed", "NoCloud seed for " + b.cloud_init().hostname() + " written (simulated)", 100);

  Step();
  if (auto r = record("defined"); !r.ok()) return r.error();
  progress("define", "domain " + domain + " defined (simulated)", 100);

  Step();
  if (auto r = record("started"); !r.ok()) return r.error();
  progress("start", "domain " + domain + " started (simulated)", 100);

  Step();
  if (opts_.behavior == "fail") {
    // The domain stays defined and started, like a VM that booted without getting its lease:
    // the scheduler has to release and clean it up.
    return StageError(
        Code::kDeadlineExceeded, reason::kLeaseTimeout,
        fmt::format("no DHCP lease for {} within the readiness timeout (simulated failure)",
                    first.mac()),
        "readiness",
        {{"mac", first.mac()}, {"expected_ip", first.private_ip()}, {"domain_name", domain}});
  }
  if (auto r = record("running"); !r.ok()) return r.error();
  progress("readiness",
           fmt::format("DHCP lease bound: {} -> {} (simulated)", first.mac(), first.private_ip()),
           100);

  v1::ProvisionOutput out;
  out.set_domain_name(domain);
  out.set_mac(first.mac());
  out.set_expected_ip(first.private_ip());
  out.set_actual_ip(first.private_ip());
  out.set_lease_state(v1::LEASE_STATE_BOUND);
  for (const auto& step : *plan) out.add_plan(step);
  out.set_runtime(v1::VM_RUNTIME_SIMULATED);
  return out;
}

Result<v1::ReleaseOutput> SimulatedRuntime::Release(const v1::ReleaseParams& p,
                                                    const ProgressFn& progress) {
  if (!ids::IsUuid(p.allocation_id())) {
    return StageError(Code::kInvalidArgument, reason::kInvalidAllocationId,
                      "allocation id is not a UUID: '" + p.allocation_id() + "'", "release");
  }
  v1::ReleaseOutput out;
  out.set_domain_name(DomainName(p.allocation_id()));
  out.set_runtime(v1::VM_RUNTIME_SIMULATED);
  std::lock_guard lock(mu_);
  auto rec = store_.Get(DomainKey(p.allocation_id()));
  if (!rec.ok()) return WithStage(rec.error(), "release");
  if (!rec->has_value()) {
    out.set_stop(v1::STOP_METHOD_ABSENT);
    progress("stop", "no domain " + out.domain_name() + " defined: nothing to stop", 100);
    return out;
  }
  Step();
  if (auto e = store_.Erase(DomainKey(p.allocation_id())); !e.ok()) {
    return WithStage(e.error(), "release");
  }
  out.set_stop(v1::STOP_METHOD_GRACEFUL);
  progress("stop", "domain " + out.domain_name() + " shut down and undefined (simulated)", 100);
  return out;
}

Result<v1::CleanupOutput> SimulatedRuntime::Cleanup(const v1::CleanupParams& p,
                                                    const ProgressFn& progress) {
  const std::string kStage = "cleanup";
  auto host = DiscoverDevices(opts_.host_root);
  if (!host.ok()) return WithStage(host.error(), kStage);
  std::lock_guard lock(mu_);
  if (auto ok = CheckCleanup(p, store_, *host, kStage); !ok.ok()) return ok.error();
  const int n = p.slots_size();
  v1::CleanupOutput out;
  out.set_runtime(v1::VM_RUNTIME_SIMULATED);
  for (int i = 0; i < n; ++i) {
    const auto& s = p.slots(i);
    Step();
    progress("wipe",
             fmt::format("slot {}: {} wiped (simulated)", s.slot_key(),
                         s.nvme_by_id().empty() ? "no disk" : s.nvme_by_id()),
             (i + 1) * 100 / n);
  }
  if (auto e = store_.Erase(DomainKey(p.allocation_id())); !e.ok()) {
    return WithStage(e.error(), kStage);
  }
  progress("undefine", "no domain " + DomainName(p.allocation_id()) + " left (simulated)", 100);
  Step();
  const auto [network_removed, exposure_removed] =
      RunCleanupHooks(opts_.network_cleanup, opts_.exposure_cleanup, p, progress, true,
                      "DHCP reservation and NAT/DNAT state removed (simulated)");
  if (auto e = DropLease(store_, p.allocation_id()); !e.ok()) return WithStage(e.error(), kStage);
  const auto now = google::protobuf::util::TimeUtil::GetCurrentTime();
  for (const auto& s : p.slots()) {
    auto* proof = out.add_proofs();
    proof->set_slot_key(s.slot_key());
    proof->set_nvme_by_id(s.nvme_by_id());
    proof->set_method(v1::WIPE_METHOD_SIMULATED);
    proof->set_signatures_remaining(false);
    proof->set_domain_undefined(true);
    proof->set_network_state_removed(network_removed);
    proof->set_exposure_state_removed(exposure_removed);
    *proof->mutable_verified_at() = now;
  }
  return out;
}

}  // namespace gpuaas::node_agent
