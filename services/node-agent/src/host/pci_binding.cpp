#include "gpuaas/node_agent/host/pci_binding.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "gpuaas/node_agent/node_agent_reasons.hpp"

namespace gpuaas::node_agent {

namespace {

namespace fs = std::filesystem;

constexpr const char* kVfio = "vfio-pci";

std::string DeviceDir(const std::string& pci) { return "/sys/bus/pci/devices/" + pci; }
std::string Persistent(const std::string& pci) { return "/etc/driverctl.d/pci-" + pci; }

Error WriteError(const std::string& logical, int err) {
  return Error::Of(Code::kFailedPrecondition,
                   err == EBUSY ? reason::kSysfsDeviceBusy : reason::kSysfsWriteFailed,
                   "write " + logical + ": " + std::strerror(err), {{"path", logical}});
}

// The real kernel: one write(2) per value, the errno kept.
class SysfsKernel : public PciKernel {
 public:
  explicit SysfsKernel(const HostRoot& host) : host_(host) {}
  Result<void> Write(const std::string& logical, const std::string& value) override {
    const std::string path = host_.Real(logical);
    const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
    if (fd < 0) return WriteError(logical, errno);
    const ssize_t n = ::write(fd, value.data(), value.size());
    const int err = errno;
    ::close(fd);
    if (n < 0) return WriteError(logical, err);
    return Ok();
  }

 private:
  const HostRoot& host_;
};

class Fixture : public PciKernel {
 public:
  explicit Fixture(const HostRoot& host) : host_(host) {}
  Result<void> Write(const std::string& logical, const std::string& value) override {
    const std::string v = value.substr(0, value.find('\n'));
    const std::string devices = "/sys/bus/pci/devices/";
    if (logical.size() > 16 && logical.compare(logical.size() - 16, 16, "/driver_override") == 0) {
      std::ofstream(host_.Real(logical)) << v << "\n";
      return Ok();
    }
    if (logical.size() > 14 && logical.compare(logical.size() - 14, 14, "/driver/unbind") == 0) {
      const std::string dev = logical.substr(0, logical.size() - 14);
      if (host_.Exists(dev + "/fixture_stays_bound")) return WriteError(logical, EBUSY);
      std::error_code ec;
      fs::remove(host_.Real(*host_.Resolve(dev) + "/driver"), ec);
      return Ok();
    }
    if (logical == "/sys/bus/pci/drivers_probe") {
      const auto dev = host_.Resolve(devices + v);
      if (!dev || !host_.Exists(*dev)) return WriteError(logical, ENODEV);
      if (host_.IsSymlink(*dev + "/driver") || host_.Exists(*dev + "/fixture_bind_fails")) {
        return Ok();  // bound already, or the probe finds no driver that takes it
      }
      std::string driver = host_.ReadLine(*dev + "/driver_override").value_or("");
      if (driver.empty() || driver == "(null)") {
        const auto vendor = host_.ReadLine(*dev + "/vendor").value_or("");
        driver = vendor == "0x10de" ? "nvidia" : vendor == "0x15b3" ? "mlx5_core" : "";
      }
      if (driver.empty()) return Ok();
      std::error_code ec;
      fs::create_directories(host_.Real("/sys/bus/pci/drivers/" + driver), ec);
      fs::create_symlink(host_.Real("/sys/bus/pci/drivers/" + driver), host_.Real(*dev + "/driver"),
                         ec);
      if (ec) return WriteError(logical, ec.value());
      return Ok();
    }
    return WriteError(logical, EINVAL);
  }

 private:
  const HostRoot& host_;
};

std::string Driver(const HostRoot& host, const std::string& pci) {
  return host.LinkBasename(DeviceDir(pci) + "/driver").value_or("");
}

// The persistent override driverctl's udev rule applies at boot (set_override on add).
Result<void> Persist(const HostRoot& host, const std::string& pci, bool vfio) {
  std::error_code ec;
  const std::string path = host.Real(Persistent(pci));
  if (!vfio) {
    fs::remove(path, ec);
    return Ok();
  }
  fs::create_directories(fs::path(path).parent_path(), ec);
  std::ofstream out(path, std::ios::trunc);
  out << kVfio << "\n";
  if (!out) return WriteError(Persistent(pci), EIO);
  return Ok();
}

// One device onto vfio-pci (slice-vm) or back to its host driver (baremetal).
void Bind(const HostRoot& host, PciKernel& kernel, const std::string& pci, bool vfio,
          BindingResult& out) {
  const std::string dev = DeviceDir(pci);
  auto fail = [&](const Error& e) {
    out.errors.push_back(e);
    out.blockers.push_back(BindingBlocker(
        e.Is(reason::kSysfsDeviceBusy) ? reason::kRebootRequired : reason::kBindFailed, pci));
  };
  if (auto p = Persist(host, pci, vfio); !p.ok()) fail(p.error());
  const std::string now = Driver(host, pci);
  if (vfio ? now == kVfio : now != kVfio) {
    // Already as wanted; a stale override for baremetal is cleared all the same.
    if (!vfio && !host.ReadLine(dev + "/driver_override").value_or("").empty()) {
      (void)kernel.Write(dev + "/driver_override", "\n");
      out.changed = true;
    }
    return;
  }
  out.changed = true;
  if (auto w = kernel.Write(dev + "/driver_override", vfio ? std::string(kVfio) + "\n" : "\n");
      !w.ok()) {
    return fail(w.error());
  }
  if (!now.empty()) {
    if (auto w = kernel.Write(dev + "/driver/unbind", pci); !w.ok()) return fail(w.error());
  }
  if (auto w = kernel.Write("/sys/bus/pci/drivers_probe", pci); !w.ok()) fail(w.error());
}

}  // namespace

std::unique_ptr<PciKernel> KernelFor(const HostRoot& host) {
  if (host.root() == "/") return std::make_unique<SysfsKernel>(host);
  return FixtureKernel(host);
}

std::unique_ptr<PciKernel> FixtureKernel(const HostRoot& host) {
  return std::make_unique<Fixture>(host);
}

std::string BindingBlocker(Reason kind, const std::string& pci_address) {
  std::string out = kind.str() + "_" + pci_address;
  std::replace_if(
      out.begin() + static_cast<std::ptrdiff_t>(kind.str().size()), out.end(),
      [](char c) { return c == ':' || c == '.'; }, '_');
  return out;
}

std::vector<std::string> CheckBinding(const HostRoot& host, v1::CapacityProfile mode,
                                      const std::vector<std::string>& devices) {
  const bool vfio = mode != v1::CAPACITY_PROFILE_BAREMETAL;
  std::set<std::string> out;
  for (const auto& pci : devices) {
    const std::string now = Driver(host, pci);
    if (vfio && now != kVfio) out.insert(BindingBlocker(reason::kVfioBindingLost, pci));
    if (!vfio && now == kVfio) out.insert(BindingBlocker(reason::kVfioStillBound, pci));
  }
  return {out.begin(), out.end()};
}

BindingResult ApplyBinding(const HostRoot& host, PciKernel& kernel, v1::CapacityProfile mode,
                           const std::vector<std::string>& devices) {
  BindingResult out;
  const bool vfio = mode != v1::CAPACITY_PROFILE_BAREMETAL;
  for (const auto& pci : devices) Bind(host, kernel, pci, vfio, out);
  // What the writes did is only what the links say now.
  for (auto& b : CheckBinding(host, mode, devices)) out.blockers.push_back(std::move(b));
  std::sort(out.blockers.begin(), out.blockers.end());
  out.blockers.erase(std::unique(out.blockers.begin(), out.blockers.end()), out.blockers.end());
  return out;
}

}  // namespace gpuaas::node_agent
