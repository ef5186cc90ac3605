// The driver binding of passthrough devices on a fixture host, whose fixture kernel applies the
// sysfs writes the agent makes (driver_override, unbind, drivers_probe): slice-vm binds GPUs and
// VFs to vfio-pci and keeps it across reboots (driverctl's override file), baremetal gives them
// back; a probe that binds nothing and a device that stays bound are reported, never done.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/host/pci_binding.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;

class PciBindingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("gpuaas-binding") + "/root";
    FixtureOptions o;
    o.gpus = 2;
    ASSERT_TRUE(BuildFixtureHost(dir_, o).ok());
    host_ = std::make_unique<HostRoot>(dir_);
    for (const auto& d : host_->ListDir("/sys/bus/pci/devices")) {
      const std::string base = "/sys/bus/pci/devices/" + d;
      const auto vendor = host_->ReadLine(base + "/vendor").value_or("");
      const auto device = host_->ReadLine(base + "/device").value_or("");
      if (vendor == "0x10de" && gpu_.empty()) gpu_ = d;
      if (vendor == "0x15b3" && device == "0x101e" && vf_.empty()) vf_ = d;
    }
    ASSERT_FALSE(gpu_.empty());
    ASSERT_FALSE(vf_.empty());
    kernel_ = KernelFor(*host_);
  }
  std::string Driver(const std::string& pci) {
    return host_->LinkBasename("/sys/bus/pci/devices/" + pci + "/driver").value_or("");
  }
  void Mark(const std::string& pci, const std::string& marker) {
    std::ofstream(host_->Real(*host_->Resolve("/sys/bus/pci/devices/" + pci) + "/" + marker))
        << "1\n";
  }
  std::string Persistent(const std::string& pci) {
    return host_->ReadLine("/etc/driverctl.d/pci-" + pci).value_or("");
  }

  std::string dir_;
  std::unique_ptr<HostRoot> host_;
  std::unique_ptr<PciKernel> kernel_;
  std::string gpu_, vf_;
};

TEST_F(PciBindingTest, SliceModeBindsEveryDeviceToVfioAndKeepsItAcrossReboots) {
  ASSERT_EQ(Driver(gpu_), "vfio-pci");  // the fixture's GPUs start there
  ASSERT_EQ(Driver(vf_), "mlx5_core");
  auto r = ApplyBinding(*host_, *kernel_, v1::CAPACITY_PROFILE_SLICE_VM, {gpu_, vf_});
  EXPECT_TRUE(r.blockers.empty()) << ::testing::PrintToString(r.blockers);
  EXPECT_TRUE(r.changed);
  EXPECT_EQ(Driver(gpu_), "vfio-pci");
  EXPECT_EQ(Driver(vf_), "vfio-pci");
  EXPECT_EQ(Persistent(gpu_), "vfio-pci");
  EXPECT_EQ(Persistent(vf_), "vfio-pci");
  EXPECT_TRUE(CheckBinding(*host_, v1::CAPACITY_PROFILE_SLICE_VM, {gpu_, vf_}).empty());
  // Applied again: nothing to write.
  EXPECT_FALSE(ApplyBinding(*host_, *kernel_, v1::CAPACITY_PROFILE_SLICE_VM, {gpu_, vf_}).changed);
}

TEST_F(PciBindingTest, BaremetalGivesTheDevicesBackToTheirHostDrivers) {
  ASSERT_TRUE(
      ApplyBinding(*host_, *kernel_, v1::CAPACITY_PROFILE_SLICE_VM, {gpu_, vf_}).blockers.empty());
  auto r = ApplyBinding(*host_, *kernel_, v1::CAPACITY_PROFILE_BAREMETAL, {gpu_, vf_});
  EXPECT_TRUE(r.blockers.empty()) << ::testing::PrintToString(r.blockers);
  EXPECT_EQ(Driver(gpu_), "nvidia");
  EXPECT_EQ(Driver(vf_), "mlx5_core");
  EXPECT_FALSE(host_->Exists("/etc/driverctl.d/pci-" + gpu_));
  EXPECT_EQ(host_->ReadLine("/sys/bus/pci/devices/" + gpu_ + "/driver_override").value_or(""), "");
  // Checked against slice-vm now, both are lost: what the agent reports as drift.
  EXPECT_EQ(CheckBinding(*host_, v1::CAPACITY_PROFILE_SLICE_VM, {gpu_, vf_}),
            (std::vector<std::string>{BindingBlocker(reason::kVfioBindingLost, gpu_),
                                      BindingBlocker(reason::kVfioBindingLost, vf_)}));
}

TEST_F(PciBindingTest, AProbeThatBindsNothingIsReportedNotDone) {
  Mark(vf_, "fixture_bind_fails");
  auto r = ApplyBinding(*host_, *kernel_, v1::CAPACITY_PROFILE_SLICE_VM, {gpu_, vf_});
  EXPECT_EQ(r.blockers, std::vector<std::string>{BindingBlocker(reason::kVfioBindingLost, vf_)});
  EXPECT_EQ(Driver(vf_), "");  // unbound from mlx5_core, bound to nothing
  EXPECT_EQ(Driver(gpu_), "vfio-pci");
}

TEST_F(PciBindingTest, ADeviceThatStaysBoundNeedsAReboot) {
  Mark(gpu_, "fixture_stays_bound");
  auto r = ApplyBinding(*host_, *kernel_, v1::CAPACITY_PROFILE_BAREMETAL, {gpu_});
  EXPECT_EQ(r.blockers, (std::vector<std::string>{BindingBlocker(reason::kRebootRequired, gpu_),
                                                  BindingBlocker(reason::kVfioStillBound, gpu_)}));
  ASSERT_EQ(r.errors.size(), 1U);
  EXPECT_EQ(r.errors[0].reason, reason::kSysfsDeviceBusy.str());
  EXPECT_EQ(Driver(gpu_), "vfio-pci");
  // The persistent override is gone: the reboot brings it up on its host driver.
  EXPECT_FALSE(host_->Exists("/etc/driverctl.d/pci-" + gpu_));
}

TEST_F(PciBindingTest, BlockersAreSnakeCaseTheAckAccepts) {
  const auto b = BindingBlocker(reason::kVfioBindingLost, "0000:18:00.0");
  EXPECT_EQ(b, "vfio_binding_lost_0000_18_00_0");
  EXPECT_TRUE(documents::ValidateAck(1, {b, BindingBlocker(reason::kRebootRequired, gpu_)}).ok());
}

}  // namespace
}  // namespace gpuaas::node_agent
