#pragma once
// The VM lifecycle behind the scheduler's vm.provision / vm.release / slot.cleanup tasks.
//
// The host-level "node scheduler" comes first: ValidateBundle checks a bundle against what
// discovery sees on this host right now (the scheduler's view may be stale), and the lease
// ledger in the local store makes sure two allocations never hold the same slot on this host.
// Only then does a runtime touch anything. Errors carry their own reason and details["stage"].
//
// SimulatedRuntime is the only runtime today (the libvirt one is a later issue): it walks the
// same stages, keeps domain records in the local store and never creates a VM or wipes a disk.
// Everything it reports says "simulated". It can be told to misbehave for tests ("fail",
// "silent"; the silence itself is the agent's business, see NodeAgent::HandleTask).
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::node_agent {

// The ordered plan steps the node scheduler accepts for `bundle` on `host`, or the first rule it
// breaks (reason per rule, details["stage"] = "validate" plus the field/slot in question). Pure.
Result<std::vector<std::string>> ValidateBundle(const v1::ProvisionBundle& bundle,
                                                const v1::TopologyReport& host);

// Syntax checks shared with cleanup: "52:54:00:ab:cd:ef" (unicast), dotted-quad IPv4,
// 64 lowercase hex digits.
bool IsValidMac(const std::string& mac);
bool IsValidIpv4(const std::string& ip);
bool IsValidSha256(const std::string& digest);

// Device evidence only (GPUs, NVMe with mounts/OS disk, fabric), read fresh from `root`: what
// the node scheduler checks bundles and cleanups against. Errors only for an unusable root.
Result<v1::TopologyReport> DiscoverDevices(const std::string& root);

// Shared by the runtimes: errors carry details["stage"] (retryable only when UNAVAILABLE).
Error StageError(Code code, Reason reason, std::string message, const std::string& stage,
                 std::map<std::string, std::string> details = {});
Error WithStage(Error e, const std::string& stage);
// The discovered NVMe device with this by-id path, or nullptr.
const v1::NvmeDevice* FindDisk(const v1::TopologyReport& host, const std::string& by_id);
// The destructive-use rules for a disk from discovery's evidence: never the OS disk, never
// anything mounted, directly or through a partition (os_disk, disk_mounted, disk_child_mounted).
std::optional<Error> DiskInUse(const v1::NvmeDevice& d, const std::string& slot_key,
                               const std::string& stage);

// Host-local lease ledger: key "lease-<allocation_id>" = {slots: [slot_key...], attempt}.
// Taking a lease fails with `slot_leased` (stage "lease") when another allocation's lease holds
// any of the slots; the same allocation taking it again replaces its own (idempotent). Callers
// serialise ledger changes (SimulatedRuntime holds a mutex).
Result<void> TakeLease(LocalStore& store, const std::string& allocation_id,
                       const std::vector<std::string>& slot_keys, int32_t attempt);
// The allocation holding `slot_key`, other than `except_allocation`; "" when none.
std::string LeaseHolder(const LocalStore& store, const std::string& slot_key,
                        const std::string& except_allocation = "");
Result<void> DropLease(LocalStore& store, const std::string& allocation_id);

// Local-store keys of the ledger, the same for every runtime (a restarted agent reads them).
std::string LeaseKey(const std::string& allocation_id);
std::string DomainKey(const std::string& allocation_id);

// The ledger's record of an allocation's domain (name, slots, state, attempt, first MAC/IP,
// runtime): what restart adoption and release read. The caller serialises ledger access.
Result<void> PutDomainRecord(LocalStore& store, const v1::ProvisionBundle& bundle,
                             const std::string& state, const std::string& runtime);

// Before a cleanup touches anything (a wipe needs proof the disk is ours): the allocation id is
// a UUID, no slot is leased by another allocation (slot_leased), and every named disk is among
// `devices` (disk_not_found) and not in use (DiskInUse). The caller serialises ledger access.
Result<void> CheckCleanup(const v1::CleanupParams& params, const LocalStore& store,
                          const v1::TopologyReport& devices, const std::string& stage);

// How far a transfer is (the image's download into the cache, its write onto the boot disk).
struct ByteProgress {
  std::string phase;  // "fetch" | "write"
  uint64_t done = 0;
  uint64_t total = 0;  // 0 while unknown
  uint64_t bytes_per_second = 0;
};

// A runtime's progress: stage, detail, percent (stage-specific; "image" reports 0..100 as it
// fetches and writes), and while bytes move, how many. Built from either a callable taking all
// four (the fourth a `const ByteProgress*`, null when no bytes move) or one taking only the
// first three.
class ProgressFn {
 public:
  using Sink =
      std::function<void(const std::string&, const std::string&, int, const ByteProgress*)>;
  ProgressFn() = default;
  template <typename F>
  requires std::is_invocable_v<F&, const std::string&, const std::string&, int, const ByteProgress*>
  ProgressFn(F f) : sink_(std::move(f)) {}  // NOLINT(google-explicit-constructor)
  template <typename F>
  requires(
      !std::is_invocable_v<F&, const std::string&, const std::string&, int, const ByteProgress*> &&
      std::is_invocable_v<F&, const std::string&, const std::string&, int>)
      ProgressFn(F f)  // NOLINT(google-explicit-constructor)
      : sink_([f = std::move(f)](const std::string& stage, const std::string& detail, int pct,
                                 const ByteProgress*) mutable { f(stage, detail, pct); }) {}

  void operator()(const std::string& stage, const std::string& detail, int percent) const {
    if (sink_) sink_(stage, detail, percent, nullptr);
  }
  void operator()(const std::string& stage, const std::string& detail, int percent,
                  const ByteProgress& bytes) const {
    if (sink_) sink_(stage, detail, percent, &bytes);
  }
  explicit operator bool() const { return static_cast<bool>(sink_); }

 private:
  Sink sink_;
};
// Removes an allocation's network state on the host (the agent's networking code: the slot
// MACs' DHCP leases); both runtimes call it from Cleanup and prove the result per slot.
using NetworkCleanupFn = std::function<Result<void>(const v1::CleanupParams&)>;

enum class CleanupHookKind { kNetwork, kExposure };
// Calls a set network_cleanup or exposure_cleanup hook from a runtime's Cleanup and reports it as
// a progress line of its stage ("network", "exposure"): the state removed, or the hook's error.
// Returns whether the state is gone (what the slots' proofs say).
bool RunCleanupHook(CleanupHookKind kind, const NetworkCleanupFn& hook,
                    const v1::CleanupParams& params, const ProgressFn& progress);

// Both hooks of a runtime's Cleanup, as the slots' proofs report them. Without a network hook
// the network state counts as `unhooked_network_removed` (the simulated runtime has none to
// remove; the libvirt runtime cannot prove it) and `unhooked_network_line` is the progress line;
// without an exposure hook there is no exposure state (a node that follows no exposure document).
struct CleanupHooksOutcome {
  bool network_removed = false;
  bool exposure_removed = false;
};
CleanupHooksOutcome RunCleanupHooks(const NetworkCleanupFn& network,
                                    const NetworkCleanupFn& exposure,
                                    const v1::CleanupParams& params, const ProgressFn& progress,
                                    bool unhooked_network_removed,
                                    const std::string& unhooked_network_line);

// Both runtimes' lease step of a provision: TakeLease on the bundle's slots under `mu` (the
// runtime's ledger lock), then the "lease" progress line.
Result<void> LeaseBundleSlots(LocalStore& store, std::mutex& mu, const v1::ProvisionBundle& b,
                              const ProgressFn& progress);

class VmRuntime {
 public:
  virtual ~VmRuntime() = default;
  virtual Result<v1::ProvisionOutput> Provision(const v1::ProvisionBundle& bundle,
                                                const ProgressFn& progress) = 0;
  virtual Result<v1::ReleaseOutput> Release(const v1::ReleaseParams& params,
                                            const ProgressFn& progress) = 0;
  virtual Result<v1::CleanupOutput> Cleanup(const v1::CleanupParams& params,
                                            const ProgressFn& progress) = 0;
};

struct SimOptions {
  std::string host_root = "/";
  // "succeed" | "fail" (provision fails at readiness with lease_timeout) | "silent" (the agent
  // answers nothing; the runtime itself behaves as "succeed").
  std::string behavior = "succeed";
  int64_t step_ms = 20;  // sleep per stage
  // Set when the agent manages the slice network: called for real, and the proofs say whether
  // it worked. Unset: the network step is simulated too.
  NetworkCleanupFn network_cleanup;
  // Set when the agent follows ingress's exposure documents: waits until no exposure maps to the
  // slots (document and kernel). Unset: the node has no exposure state.
  NetworkCleanupFn exposure_cleanup;
};

class SimulatedRuntime : public VmRuntime {
 public:
  // `store` must outlive the runtime.
  SimulatedRuntime(LocalStore& store, SimOptions opts);
  Result<v1::ProvisionOutput> Provision(const v1::ProvisionBundle& bundle,
                                        const ProgressFn& progress) override;
  Result<v1::ReleaseOutput> Release(const v1::ReleaseParams& params,
                                    const ProgressFn& progress) override;
  Result<v1::CleanupOutput> Cleanup(const v1::CleanupParams& params,
                                    const ProgressFn& progress) override;

 private:
  void Step() const;
  LocalStore& store_;
  SimOptions opts_;
  std::mutex mu_;  // one lifecycle change at a time (lease check + write, domain records)
};

}  // namespace gpuaas::node_agent
