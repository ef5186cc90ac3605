#pragma once
// The driver binding of a node's passthrough devices (GPUs and fabric VFs) for its mode:
// slice-vm wants them on vfio-pci (and kept so across reboots), baremetal wants them back on
// their host drivers. Apply writes sysfs the way driverctl does (driver_override, unbind from the
// current driver, drivers_probe) plus the persistent override driverctl's udev rule applies at
// boot (/etc/driverctl.d/pci-<address>, content the driver); Check verifies from the driver
// links alone, so nothing counts as done that was not seen. Problems are blockers of the desired
// slot set's ack, "<kind>_<address with ':' and '.' as '_'>" (snake_case):
//   vfio_binding_lost  slice-vm: not bound to vfio-pci
//   vfio_still_bound   baremetal: still bound to vfio-pci
//   bind_failed        a sysfs write was refused
//   reboot_required    the device could not be released from its driver (in use)
#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::node_agent {

// Where binding writes go. The real kernel (a host root of "/") applies sysfs writes itself;
// a fixture tree has a fixture kernel that applies them to its files (FixtureKernel).
class PciKernel {
 public:
  virtual ~PciKernel() = default;
  // Writes `value` to the sysfs file `logical` (a host path); an error is what the kernel said
  // (EBUSY, EINVAL, ...).
  virtual Result<void> Write(const std::string& logical, const std::string& value) = 0;
};

// The kernel for `host`: the real one for "/", the fixture kernel for any other root.
std::unique_ptr<PciKernel> KernelFor(const HostRoot& host);

// The fixture "kernel" of a tree BuildFixtureHost wrote: a write to driver_override is stored,
// `driver/unbind` removes the device's driver link (EBUSY when the device directory has a file
// `fixture_stays_bound`: it is in use), `drivers_probe` links the device to its override, or
// with none to its host driver (nvidia for 0x10de, mlx5_core for 0x15b3), unless the device
// directory has `fixture_bind_fails` (then it stays unbound, as a failed probe does).
std::unique_ptr<PciKernel> FixtureKernel(const HostRoot& host);

struct BindingResult {
  std::vector<std::string> blockers;  // sorted, unique
  std::vector<Error> errors;          // the writes the kernel refused, for the agent's log
  bool changed = false;               // something was written
};

// Makes `devices` bound as `mode` wants (writes only what differs), then checks.
BindingResult ApplyBinding(const HostRoot& host, PciKernel& kernel, v1::CapacityProfile mode,
                           const std::vector<std::string>& devices);
// Only reads: the blockers of `devices` for `mode` right now.
std::vector<std::string> CheckBinding(const HostRoot& host, v1::CapacityProfile mode,
                                      const std::vector<std::string>& devices);

// kVfioBindingLost + "0000:18:00.0" -> "vfio_binding_lost_0000_18_00_0".
std::string BindingBlocker(Reason kind, const std::string& pci_address);

}  // namespace gpuaas::node_agent
