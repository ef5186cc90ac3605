// The libvirt VM runtime. DomainXmlTest: generated domains (checked against libvirt's schema with
// virt-xml-validate). VmHelpersTest: lease file, SSH banner probe, seed files, disk checks.
// LibvirtRuntimeTest: provision -> release -> cleanup and adoption on libvirt's test:///default
// driver with fixture hosts (their device nodes are regular files; qemu-img, genisoimage, wipefs
// and blkid really run). LoopDiskTest: root only, a loop device stands in for the slot's NVMe
// (real discard, real mounts).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <libvirt/libvirt.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bundle_fixture.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"
#include "gpuaas/node_agent/runtime/libvirt_runtime.hpp"
#include "gpuaas/v1/node.pb.h"
#include "network/net_host.hpp"
#include "runtime/image_cache.hpp"
#include "test_env.hpp"
#include "test_files.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;
using std::chrono::milliseconds;

// virt-xml-validate's verdict: "" = valid, its complaint otherwise; nullopt = not installed.
std::optional<std::string> ValidateDomainXml(const std::string& xml) {
  auto tool = Tool("virt-xml-validate");
  if (!tool) return std::nullopt;
  const std::string dir = testing::MakeTempDir("gpuaas-xml");
  const std::string file = dir + "/domain.xml";
  WriteAll(file, xml);
  auto r = RunTool({*tool, file, "domain"}, std::chrono::seconds(30));
  fs::remove_all(dir);
  if (!r.ok()) return r.error().ToString();
  return r->exit_code == 0 ? "" : r->out + r->err;
}

#define EXPECT_VALID_DOMAIN(xml)                                                         \
  do {                                                                                   \
    auto verdict = ValidateDomainXml(xml);                                               \
    if (!verdict) GTEST_SKIP() << "virt-xml-validate missing (package libvirt-clients)"; \
    EXPECT_EQ(*verdict, "") << (xml);                                                    \
  } while (0)

size_t Count(const std::string& hay, const std::string& needle) {
  size_t n = 0;
  for (size_t p = hay.find(needle); p != std::string::npos; p = hay.find(needle, p + 1)) ++n;
  return n;
}

// A fixture host, a local store and a work dir (image cache, seeds, lease file, NVRAM).
class Sandbox {
 public:
  explicit Sandbox(const FixtureOptions& o = {})
      : host_(testing::MakeTempDir("gpuaas-host")),
        state_(testing::MakeTempDir("gpuaas-state")),
        work_(testing::MakeTempDir("gpuaas-vmwork")) {
    auto r = BuildFixtureHost(host_, o);
    EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
    auto s = LocalStore::Open(state_);
    EXPECT_TRUE(s.ok());
    store_.emplace(std::move(*s));
  }
  ~Sandbox() {
    std::error_code ec;
    for (const auto& d : {host_, state_, work_}) fs::remove_all(d, ec);
  }
  Sandbox(const Sandbox&) = delete;
  Sandbox& operator=(const Sandbox&) = delete;

  const std::string& root() const { return host_; }
  const std::string& work() const { return work_; }
  LocalStore& store() { return *store_; }
  std::string leases() const { return work_ + "/dnsmasq.leases"; }

  v1::ProvisionBundle Bundle(int n, const std::string& alloc) const {
    DiscoveryOptions d;
    d.root = host_;
    d.node_id = "node-a";
    d.libvirt_uri = "";
    auto rep = Discover(d);
    EXPECT_TRUE(rep.ok());
    auto b = testing::BundleFromCandidates(rep.ok() ? *rep : v1::TopologyReport(), n, alloc);
    b.mutable_image()->set_name("tiny-ext4");
    b.mutable_cloud_init()->add_ssh_authorized_keys("ssh-ed25519 AAAAC3Nza test@ci");
    b.mutable_shape()->set_profile("tiny");
    b.mutable_shape()->set_vcpus(2 * n);
    b.mutable_shape()->set_memory_mib(2048LL * n);
    return b;
  }

  // The host path of a slot disk's device node inside the fixture.
  std::string DiskPath(const std::string& by_id) const {
    HostRoot h(host_);
    auto r = h.Resolve(by_id);
    return r ? h.Real(*r) : "";
  }

  void Lease(const std::string& mac, const std::string& ip) {
    const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                         std::chrono::system_clock::now().time_since_epoch())
                         .count();
    std::ofstream f(leases(), std::ios::app);
    f << (now + 3600) << " " << mac << " " << ip << " vm-1 01:" << mac << "\n";
  }

 private:
  std::string host_;
  std::string state_;
  std::string work_;
  std::optional<LocalStore> store_;
};

DomainXmlOptions XmlOptions() {
  DomainXmlOptions o;
  o.seed_iso = "/var/lib/gpuaas/seeds/x/seed.iso";
  o.nvram_dir = "/var/lib/libvirt/qemu/nvram";
  return o;
}

struct Recorder {
  std::vector<std::pair<std::string, int>> events;
  ProgressFn Fn() {
    return [this](const std::string& s, const std::string&, int p) { events.emplace_back(s, p); };
  }
  std::vector<std::string> Stages() const {
    std::vector<std::string> v;
    for (const auto& [s, p] : events) {
      if (v.empty() || v.back() != s) v.push_back(s);
    }
    return v;
  }
};

// ---------------------------------------------------------------------------------------------

TEST(DomainXmlTest, OneSlotHasGpuAndVfHostdevsDiskSeedAndIsolatedNic) {
  Sandbox sb;
  const std::string alloc = ids::NewUuidV7();
  auto b = sb.Bundle(1, alloc);
  ASSERT_FALSE(b.slots(0).fabric_vf_pci_address().empty());
  auto xml = GenerateDomainXml(b, XmlOptions());
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  const std::string& x = *xml;
  EXPECT_NE(x.find("<domain type='kvm'>"), std::string::npos);
  EXPECT_NE(x.find("<name>gpuaas-" + alloc + "</name>"), std::string::npos);
  EXPECT_NE(x.find("id='" + alloc + "'"), std::string::npos);
  EXPECT_NE(x.find(kDomainMetadataNs), std::string::npos);
  EXPECT_NE(x.find("machine='q35'"), std::string::npos);
  EXPECT_NE(x.find("secure='no'"), std::string::npos);
  EXPECT_NE(x.find("/var/lib/libvirt/qemu/nvram/gpuaas-" + alloc + "_VARS.fd</nvram>"),
            std::string::npos);
  EXPECT_EQ(x.find("<tpm"), std::string::npos);
  EXPECT_EQ(Count(x, "<hostdev mode='subsystem' type='pci' managed='yes'>"), 2u);
  auto hex = [](const std::string& pci) {  // "0000:18:00.0" -> the libvirt address attributes
    return "domain='0x" + pci.substr(0, 4) + "' bus='0x" + pci.substr(5, 2) + "' slot='0x" +
           pci.substr(8, 2) + "' function='0x" + pci.substr(11) + "'";
  };
  EXPECT_NE(x.find(hex(b.slots(0).gpu_pci_address())), std::string::npos);
  EXPECT_NE(x.find(hex(b.slots(0).fabric_vf_pci_address())), std::string::npos);
  EXPECT_NE(x.find("<disk type='block' device='disk'>"), std::string::npos);
  EXPECT_NE(x.find("<source dev='" + b.slots(0).nvme_by_id() + "'/>"), std::string::npos);
  EXPECT_NE(x.find("<boot order='1'/>"), std::string::npos);
  EXPECT_NE(x.find("<source file='/var/lib/gpuaas/seeds/x/seed.iso'/>"), std::string::npos);
  EXPECT_NE(x.find("<readonly/>"), std::string::npos);
  EXPECT_NE(x.find("<interface type='bridge'>"), std::string::npos);
  EXPECT_NE(x.find("<mac address='" + b.slots(0).mac() + "'/>"), std::string::npos);
  EXPECT_NE(x.find("<source bridge='ovsbr0'/>"), std::string::npos);
  EXPECT_NE(x.find("<port isolated='yes'/>"), std::string::npos);
  EXPECT_NE(x.find("<serial type='pty'>"), std::string::npos);
  EXPECT_EQ(x.find("<memoryBacking>"), std::string::npos);
  EXPECT_VALID_DOMAIN(x);
}

TEST(DomainXmlTest, AnOvsBridgeGetsAVirtualportAndNoPortIsolation) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  auto o = XmlOptions();
  o.bridge_is_ovs = true;
  auto xml = GenerateDomainXml(b, o);
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  EXPECT_NE(xml->find("<virtualport type='openvswitch'/>"), std::string::npos);
  EXPECT_EQ(xml->find("<port isolated"), std::string::npos) << "OVS isolates with flows";
  EXPECT_EQ(xml->find("csum='off'"), std::string::npos) << "the kernel datapath keeps offloads";
  EXPECT_VALID_DOMAIN(*xml);
  o.userspace_datapath = true;
  xml = GenerateDomainXml(b, o);
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  EXPECT_NE(xml->find("<driver><host csum='off'/></driver>"), std::string::npos);
  EXPECT_VALID_DOMAIN(*xml);
}

TEST(DomainXmlTest, SeveralGpusPinnedToTheirNumaNode) {
  Sandbox sb;
  auto b = sb.Bundle(4, ids::NewUuidV7());  // GPUs 0-3: NUMA 0
  ASSERT_EQ(b.slots_size(), 4);
  ASSERT_EQ(PinnedNumaNode(b), std::optional<int>(0));
  auto o = XmlOptions();
  o.numa_cpuset = "0-47,96-143";
  auto xml = GenerateDomainXml(b, o);
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  const std::string& x = *xml;
  EXPECT_EQ(Count(x, "<hostdev "), 8u);  // 4 GPUs + 4 VFs
  EXPECT_EQ(Count(x, "<disk type='block'"), 4u);
  for (const char* dev : {"vda", "vdb", "vdc", "vdd", "vde"}) {
    EXPECT_NE(x.find(std::string("<target dev='") + dev + "' bus='virtio'/>"), std::string::npos);
  }
  EXPECT_EQ(Count(x, "<boot order="), 1u);
  EXPECT_EQ(Count(x, "<interface "), 1u);  // the boot slot's management NIC
  EXPECT_NE(x.find("<vcpu placement='static' cpuset='0-47,96-143'>8</vcpu>"), std::string::npos);
  EXPECT_NE(x.find("<memory mode='strict' nodeset='0'/>"), std::string::npos);
  EXPECT_NE(x.find("<memory unit='MiB'>8192</memory>"), std::string::npos);
  EXPECT_VALID_DOMAIN(x);
}

TEST(DomainXmlTest, UnknownOrMixedNumaMeansNoPinning) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  b.mutable_shape()->set_numa_node(-1);
  auto o = XmlOptions();
  o.numa_cpuset = "0-47";
  auto xml = GenerateDomainXml(b, o);
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  EXPECT_EQ(xml->find("<numatune>"), std::string::npos);
  EXPECT_EQ(xml->find("cpuset="), std::string::npos);
  EXPECT_VALID_DOMAIN(*xml);

  FixtureOptions fo;
  fo.unknown_numa_gpus = {0};
  Sandbox unknown(fo);
  auto u = unknown.Bundle(1, ids::NewUuidV7());
  u.mutable_slots(0)->set_numa_node(-1);
  EXPECT_EQ(PinnedNumaNode(u), std::nullopt);
  auto mixed = sb.Bundle(6, ids::NewUuidV7());  // GPUs 0-3 on NUMA 0, 4-5 on NUMA 1
  EXPECT_EQ(PinnedNumaNode(mixed), std::nullopt);
  auto mx = GenerateDomainXml(mixed, o);
  ASSERT_TRUE(mx.ok());
  EXPECT_EQ(mx->find("<numatune>"), std::string::npos);
}

TEST(DomainXmlTest, HugepagesBackTheWholeMemory) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  b.mutable_shape()->set_memory_mib(65536);
  b.mutable_shape()->set_hugepages_1g(64);
  auto xml = GenerateDomainXml(b, XmlOptions());
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  EXPECT_NE(xml->find("<hugepages>\n      <page size='1' unit='GiB'/>"), std::string::npos);
  EXPECT_VALID_DOMAIN(*xml);

  b.mutable_shape()->set_memory_mib(65000);
  auto bad = GenerateDomainXml(b, XmlOptions());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "hugepages_memory_unaligned");
  EXPECT_EQ(bad.error().details.at("stage"), "define");
}

TEST(DomainXmlTest, VncListensOnLoopbackOrASocketOnly) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  auto xml = GenerateDomainXml(b, XmlOptions());
  ASSERT_TRUE(xml.ok());
  EXPECT_NE(xml->find("<listen type='address' address='127.0.0.1'/>"), std::string::npos);
  EXPECT_EQ(xml->find("0.0.0.0"), std::string::npos);
  EXPECT_EQ(Count(*xml, "<graphics "), 1u);

  for (const char* bad : {"0.0.0.0", "::", "10.100.0.1", ""}) {
    auto o = XmlOptions();
    o.vnc_listen = bad;
    auto r = GenerateDomainXml(b, o);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().reason, "vnc_listen_not_loopback") << bad;
  }
  auto o = XmlOptions();
  o.vnc_socket = "/run/gpuaas/console/vm.vnc";
  o.vnc_listen = "0.0.0.0";  // ignored: the socket wins
  auto sock = GenerateDomainXml(b, o);
  ASSERT_TRUE(sock.ok()) << sock.error().ToString();
  EXPECT_NE(sock->find("<listen type='socket' socket='/run/gpuaas/console/vm.vnc'/>"),
            std::string::npos);
  EXPECT_EQ(sock->find("0.0.0.0"), std::string::npos);
  EXPECT_EQ(sock->find("listen='"), std::string::npos);
  EXPECT_VALID_DOMAIN(*sock);
}

TEST(DomainXmlTest, DirectKernelBootForTestGuestsTcgAndNoPassthrough) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  auto o = XmlOptions();
  o.domain_type = "qemu";
  o.cpu_mode = "maximum";
  o.kernel = "/var/lib/gpuaas/guest/vmlinuz";
  o.initrd = "/var/lib/gpuaas/guest/initrd.img";
  o.passthrough = false;
  o.bridge = "gpuaasbr0";
  o.serial_log = "/var/log/gpuaas/vm.serial.log";
  o.disk_paths[b.slots(0).slot_key()] = "/dev/loop7";
  auto xml = GenerateDomainXml(b, o);
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  EXPECT_NE(xml->find("<domain type='qemu'>"), std::string::npos);
  EXPECT_NE(xml->find("<kernel>/var/lib/gpuaas/guest/vmlinuz</kernel>"), std::string::npos);
  EXPECT_NE(xml->find("<initrd>/var/lib/gpuaas/guest/initrd.img</initrd>"), std::string::npos);
  EXPECT_EQ(xml->find("<boot order="), std::string::npos);
  EXPECT_EQ(xml->find("<hostdev"), std::string::npos);
  EXPECT_NE(xml->find("<source dev='/dev/loop7'/>"), std::string::npos);
  EXPECT_NE(xml->find("<log file='/var/log/gpuaas/vm.serial.log'"), std::string::npos);
  EXPECT_VALID_DOMAIN(*xml);
}

TEST(DomainXmlTest, RefusesWhatItCannotExpressSafely) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  auto reason = [&](const v1::ProvisionBundle& bb, const DomainXmlOptions& o) {
    auto r = GenerateDomainXml(bb, o);
    return r.ok() ? std::string("ok") : r.error().reason;
  };
  auto o = XmlOptions();
  EXPECT_EQ(reason(b, o), "ok");
  auto bb = b;
  bb.set_allocation_id("not-a-uuid");
  EXPECT_EQ(reason(bb, o), "invalid_allocation_id");
  bb = b;
  bb.mutable_slots(0)->set_gpu_pci_address("18:00.0");
  EXPECT_EQ(reason(bb, o), "invalid_pci_address");
  bb = b;
  bb.mutable_slots(0)->set_mac("01:00:5e:00:00:01");
  EXPECT_EQ(reason(bb, o), "invalid_mac");
  auto oo = o;
  oo.bridge = "br0'/><evil";
  EXPECT_EQ(reason(b, oo), "invalid_bridge");
  oo = o;
  oo.domain_type = "xen";
  EXPECT_EQ(reason(b, oo), "invalid_domain_type");
  oo = o;
  oo.seed_iso = "";
  EXPECT_EQ(reason(b, oo), "seed_missing");
  oo = o;
  oo.loader = "OVMF_CODE.fd";
  EXPECT_EQ(reason(b, oo), "invalid_path");
  // Paths are escaped, not trusted.
  oo = o;
  oo.seed_iso = "/srv/a&b/<seed>'.iso";
  auto esc = GenerateDomainXml(b, oo);
  ASSERT_TRUE(esc.ok());
  EXPECT_NE(esc->find("/srv/a&amp;b/&lt;seed&gt;&apos;.iso"), std::string::npos);
  EXPECT_VALID_DOMAIN(*esc);
}

// fuzz_domain_xml (domain_xml_not_well_formed): characters XML 1.0 forbids (and bytes that are
// not UTF-8) in bundle text gave XML libvirt refuses; such bundles are refused before any XML.
TEST(DomainXmlTest, RefusesControlCharactersAndNonUtf8InBundleText) {
  Sandbox sb;
  auto b = sb.Bundle(1, ids::NewUuidV7());
  auto reason = [&](const v1::ProvisionBundle& bb) {
    auto r = GenerateDomainXml(bb, XmlOptions());
    if (r.ok()) return std::string("ok");
    EXPECT_EQ(r.error().code, Code::kInvalidArgument);
    return r.error().reason;
  };
  for (const std::string& bad : {std::string("\0node-a/0", 9), std::string("a\x1b[31m"),
                                 std::string("a\tb"), std::string("a\x7f"), std::string("\xff"),
                                 std::string("\xc3"), std::string("\xef\xbf\xbe")}) {
    auto bb = b;
    bb.mutable_slots(0)->set_slot_key(bad);
    EXPECT_EQ(reason(bb), "invalid_slot_key") << bad;
    bb = b;
    bb.set_tenant(bad);
    EXPECT_EQ(reason(bb), "invalid_tenant") << bad;
    bb = b;
    bb.mutable_slots(0)->set_nvme_by_id("/dev/disk/by-id/" + bad);
    EXPECT_NE(reason(bb), "ok") << bad;
  }
  // UTF-8 text is escaped and kept.
  auto bb = b;
  bb.set_tenant("acme-\xc3\xbc");
  auto xml = GenerateDomainXml(bb, XmlOptions());
  ASSERT_TRUE(xml.ok()) << xml.error().ToString();
  EXPECT_NE(xml->find("tenant='acme-\xc3\xbc'"), std::string::npos);
  EXPECT_VALID_DOMAIN(*xml);
}

// ---------------------------------------------------------------------------------------------

TEST(VmHelpersTest, LeasedIpReadsDnsmasqLeases) {
  const std::string dir = testing::MakeTempDir("gpuaas-lease");
  const std::string file = dir + "/leases";
  EXPECT_EQ(LeasedIp(file, "52:54:00:aa:bb:cc"), std::nullopt);  // no file yet
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  WriteAll(file, std::to_string(now - 10) + " 52:54:00:aa:bb:cc 10.100.0.99 old *\n" +
                     std::to_string(now + 600) + " 52:54:00:AA:BB:CC 10.100.0.10 vm-1 *\n" +
                     "0 52:54:00:00:00:02 10.100.0.11 vm-2 *\n" +
                     "0 52:54:00:00:00:02 10.100.0.011 vm-2 *\n");  // not IPv4: skipped
  EXPECT_EQ(LeasedIp(file, "52:54:00:aa:bb:cc"), std::optional<std::string>("10.100.0.10"));
  EXPECT_EQ(LeasedIp(file, "52:54:00:00:00:02"), std::optional<std::string>("10.100.0.11"));
  EXPECT_EQ(LeasedIp(file, "52:54:00:00:00:03"), std::nullopt);
  fs::remove_all(dir);
}

// A one-shot TCP server on 127.0.0.1 that writes `banner` to its first client.
class BannerServer {
 public:
  explicit BannerServer(std::string banner) : banner_(std::move(banner)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)), 0);
    socklen_t len = sizeof(sa);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len);
    port_ = ntohs(sa.sin_port);
    ::listen(fd_, 4);
    thread_ = std::thread([this] {
      const int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) return;
      if (!banner_.empty()) {
        [[maybe_unused]] auto n = ::write(c, banner_.data(), banner_.size());
      }
      std::this_thread::sleep_for(milliseconds(300));
      ::close(c);
    });
  }
  ~BannerServer() {
    ::shutdown(fd_, SHUT_RDWR);
    thread_.join();
    ::close(fd_);
  }
  int port() const { return port_; }

 private:
  std::string banner_;
  int fd_ = -1;
  int port_ = 0;
  std::thread thread_;
};

TEST(VmHelpersTest, SshProbeNeedsAnSshBanner) {
  {
    BannerServer ssh("SSH-2.0-dropbear_2022.83\r\n");
    EXPECT_TRUE(ProbeSshBanner("127.0.0.1", ssh.port(), milliseconds(2000)));
  }
  {
    BannerServer http("HTTP/1.0 400 Bad Request\r\n");
    EXPECT_FALSE(ProbeSshBanner("127.0.0.1", http.port(), milliseconds(2000)));
  }
  {
    BannerServer silent("");
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE(ProbeSshBanner("127.0.0.1", silent.port(), milliseconds(200)));
    EXPECT_LT(std::chrono::steady_clock::now() - t0, milliseconds(1500));
  }
  EXPECT_FALSE(
      ProbeSshBanner("127.0.0.1", static_cast<int>(testing::FreePort()), milliseconds(500)));
  EXPECT_FALSE(ProbeSshBanner("not-an-ip", 22, milliseconds(100)));
}

TEST(VmHelpersTest, SeedFilesCarryHostnameInstanceIdAndKeys) {
  v1::ProvisionBundle b;
  b.set_allocation_id("0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0b");
  b.mutable_cloud_init()->set_hostname("slice-1");
  b.mutable_cloud_init()->add_ssh_authorized_keys("ssh-ed25519 AAAAC3 alice@x");
  b.mutable_cloud_init()->add_ssh_authorized_keys("ssh-rsa AAAAB3 \"bob\"");
  auto f = MakeSeedFiles(b);
  ASSERT_TRUE(f.ok()) << f.error().ToString();
  EXPECT_EQ(f->meta_data,
            "instance-id: 0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0b\nlocal-hostname: slice-1\n");
  EXPECT_EQ(f->user_data,
            "#cloud-config\nhostname: slice-1\nssh_authorized_keys:\n"
            "  - \"ssh-ed25519 AAAAC3 alice@x\"\n  - \"ssh-rsa AAAAB3 \\\"bob\\\"\"\n");
  auto bad = b;
  bad.mutable_cloud_init()->set_hostname("bad host\nruncmd:");
  ASSERT_FALSE(MakeSeedFiles(bad).ok());
  EXPECT_EQ(MakeSeedFiles(bad).error().reason, "invalid_hostname");
  bad = b;
  bad.mutable_cloud_init()->add_ssh_authorized_keys("ssh-ed25519 AAAA\nruncmd: [reboot]");
  ASSERT_FALSE(MakeSeedFiles(bad).ok());
  EXPECT_EQ(MakeSeedFiles(bad).error().reason, "invalid_ssh_key");
  EXPECT_EQ(MakeSeedFiles(bad).error().details.at("stage"), "seed");
}

TEST(VmHelpersTest, DiskTargetMustBeABlockDevice) {
  const std::string dir = testing::MakeTempDir("gpuaas-disk");
  WriteAll(dir + "/disk", std::string(4096, 'x'));
  auto file = CheckDiskTarget(dir + "/disk", false, "validate");
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.error().reason, "disk_not_block_device");
  auto allowed = CheckDiskTarget(dir + "/disk", true, "validate");
  ASSERT_TRUE(allowed.ok());
  EXPECT_FALSE(allowed->block);
  EXPECT_EQ(allowed->size, 4096u);
  auto chr = CheckDiskTarget("/dev/null", true, "cleanup");
  ASSERT_FALSE(chr.ok());
  EXPECT_EQ(chr.error().reason, "disk_not_block_device");
  EXPECT_EQ(chr.error().details.at("stage"), "cleanup");
  auto none = CheckDiskTarget(dir + "/missing", true, "validate");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().reason, "disk_not_found");
  fs::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------

// What the runtime tests need on the machine.
std::string MissingTools() {
  for (const char* t : {"qemu-img", "genisoimage", "wipefs", "blkid", "sha256sum", "mkfs.ext4"}) {
    if (!Tool(t)) return t;
  }
  return "";
}

std::string Sha256(const std::string& path) {
  auto r = RunTool({*Tool("sha256sum"), path}, std::chrono::seconds(30));
  return r.ok() ? SplitWs(r->out).at(0) : "";
}

// A small real ext4 image (mkfs.ext4 works on a regular file without root).
std::string MakeExt4Image(const std::string& path, const std::string& size = "4M") {
  auto r = RunTool({*Tool("mkfs.ext4"), "-q", "-F", "-L", "gpuaas-img", path, size},
                   std::chrono::seconds(30));
  EXPECT_TRUE(r.ok() && r->exit_code == 0) << (r.ok() ? r->err : r.error().ToString());
  return Sha256(path);
}

// Signatures wipefs lists on `path` ("" = none).
std::string Signatures(const std::string& path) {
  auto r = RunTool({*Tool("wipefs"), "--noheadings", "--output", "TYPE", path},
                   std::chrono::seconds(30));
  return r.ok() ? Trim(r->out) : "wipefs failed";
}

class LibvirtRuntimeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto t = MissingTools(); !t.empty()) GTEST_SKIP() << t << " is not installed";
    conn_ = virConnectOpen("test:///default");
    ASSERT_NE(conn_, nullptr);
  }
  void TearDown() override {
    if (conn_) virConnectClose(conn_);
  }

  void Init(const FixtureOptions& fo = {}) {
    rt_.reset();
    sb_.emplace(fo);
    image_ = sb_->work() + "/tiny.img";
    digest_ = MakeExt4Image(image_);
    LibvirtOptions o;
    o.uri = "test:///default";
    o.host_root = sb_->root();
    o.image_cache_dir = sb_->work() + "/images";
    o.seed_dir = sb_->work() + "/seeds";
    o.domain.domain_type = "qemu";
    o.domain.nvram_dir = sb_->work() + "/nvram";
    o.allow_regular_file_disks = true;
    o.lease_file = sb_->leases();
    o.lease_timeout = milliseconds(600);
    o.ssh_timeout = milliseconds(600);
    o.poll_interval = milliseconds(20);
    o.undefine_retry_delay = milliseconds(10);
    o.ssh_probe = [this](const std::string& ip, int port, milliseconds) {
      probes_.push_back(ip + ":" + std::to_string(port));
      return ssh_up_.load();
    };
    o.network_cleanup = [this](const v1::CleanupParams& p) -> Result<void> {
      network_cleaned_.push_back(p.allocation_id());
      return Ok();
    };
    rt_.emplace(sb_->store(), o);
  }

  v1::ProvisionBundle Bundle(const std::string& alloc, int n = 1) {
    auto b = sb_->Bundle(n, alloc);
    b.mutable_image()->set_url("file://" + image_);
    b.mutable_image()->set_sha256(digest_);
    return b;
  }

  v1::CleanupParams CleanupOf(const v1::ProvisionBundle& b) {
    v1::CleanupParams p;
    p.set_allocation_id(b.allocation_id());
    for (const auto& s : b.slots()) *p.add_slots() = s;
    return p;
  }

  // The domain's state in libvirt: "absent", "running", "shutoff".
  std::string State(const std::string& alloc) {
    virDomainPtr d = virDomainLookupByName(conn_, DomainName(alloc).c_str());
    if (!d) return "absent";
    int state = 0, reason = 0;
    virDomainGetState(d, &state, &reason, 0);
    virDomainFree(d);
    return state == VIR_DOMAIN_RUNNING   ? "running"
           : state == VIR_DOMAIN_SHUTOFF ? "shutoff"
                                         : "other";
  }

  std::string DomainXml(const std::string& alloc) {
    virDomainPtr d = virDomainLookupByName(conn_, DomainName(alloc).c_str());
    if (!d) return "";
    char* x = virDomainGetXMLDesc(d, 0);
    std::string s = x ? x : "";
    free(x);  // NOLINT(cppcoreguidelines-no-malloc)
    virDomainFree(d);
    return s;
  }

  bool Has(const std::string& key) {
    auto r = sb_->store().Get(key);
    return r.ok() && r->has_value();
  }

  virConnectPtr conn_ = nullptr;
  std::optional<Sandbox> sb_;
  std::optional<LibvirtRuntime> rt_;
  std::string image_;
  std::string digest_;
  std::atomic<bool> ssh_up_{true};
  std::vector<std::string> probes_;
  std::vector<std::string> network_cleaned_;
};

TEST_F(LibvirtRuntimeTest, ProvisionReleaseCleanupWithRealImageSeedAndWipe) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  const auto& slot = b.slots(0);
  const std::string disk = sb_->DiskPath(slot.nvme_by_id());
  ASSERT_FALSE(disk.empty());
  sb_->Lease(slot.mac(), slot.private_ip());

  Recorder rec;
  const auto t0 = std::chrono::steady_clock::now();
  auto out = rt_->Provision(b, rec.Fn());
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  std::cout
      << "provision on test:///default: "
      << std::chrono::duration_cast<milliseconds>(std::chrono::steady_clock::now() - t0).count()
      << " ms\n";
  EXPECT_EQ(out->domain_name(), "gpuaas-" + alloc);
  EXPECT_EQ(out->mac(), slot.mac());
  EXPECT_EQ(out->expected_ip(), slot.private_ip());
  EXPECT_EQ(out->actual_ip(), slot.private_ip());
  EXPECT_EQ(out->lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(out->runtime(), v1::VM_RUNTIME_LIBVIRT);
  EXPECT_GT(out->plan_size(), 3);
  EXPECT_EQ(rec.Stages(), (std::vector<std::string>{"validate", "lease", "image", "seed", "define",
                                                    "start", "readiness"}));
  EXPECT_EQ(probes_, std::vector<std::string>{slot.private_ip() + ":22"});

  // The image really is on the slot's disk: the same bytes, so the same ext4 signature.
  EXPECT_EQ(Sha256(disk), digest_);
  EXPECT_EQ(Signatures(disk), "ext4");
  // The seed is a real ISO labelled cidata with the keys and hostname.
  const std::string seed = sb_->work() + "/seeds/" + alloc + "/seed.iso";
  auto label = RunTool({*Tool("blkid"), "-o", "value", "-s", "LABEL", seed});
  ASSERT_TRUE(label.ok());
  EXPECT_EQ(Trim(label->out), "cidata");
  EXPECT_NE(ReadAll(sb_->work() + "/seeds/" + alloc + "/user-data").find("ssh-ed25519 AAAAC3Nza"),
            std::string::npos);
  // The domain runs, with the disk, the seed and the MAC it was given.
  EXPECT_EQ(State(alloc), "running");
  const std::string xml = DomainXml(alloc);
  EXPECT_NE(xml.find(seed), std::string::npos);
  EXPECT_NE(xml.find(slot.mac()), std::string::npos);
  EXPECT_NE(xml.find("<hostdev"), std::string::npos);
  EXPECT_TRUE(Has("lease-" + alloc));
  EXPECT_EQ((**sb_->store().Get("domain-" + alloc)).value("state", ""), "running");

  Recorder rel_rec;
  v1::ReleaseParams rel;
  rel.set_allocation_id(alloc);
  rel.set_graceful_timeout_s(5);
  auto released = rt_->Release(rel, rel_rec.Fn());
  ASSERT_TRUE(released.ok()) << released.error().ToString();
  EXPECT_EQ(released->stop(), v1::STOP_METHOD_GRACEFUL);
  EXPECT_EQ(released->runtime(), v1::VM_RUNTIME_LIBVIRT);
  EXPECT_EQ(State(alloc), "absent");
  EXPECT_FALSE(fs::exists(seed));
  EXPECT_FALSE(Has("domain-" + alloc));
  EXPECT_TRUE(Has("lease-" + alloc));  // the slot stays held until cleanup

  Recorder cl_rec;
  auto cleaned = rt_->Cleanup(CleanupOf(b), cl_rec.Fn());
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  ASSERT_EQ(cleaned->proofs_size(), 1);
  const auto& proof = cleaned->proofs(0);
  EXPECT_EQ(proof.slot_key(), slot.slot_key());
  EXPECT_EQ(proof.nvme_by_id(), slot.nvme_by_id());
  EXPECT_EQ(proof.method(), v1::WIPE_METHOD_ZERO);  // a regular file cannot be discarded
  EXPECT_FALSE(proof.signatures_remaining());
  EXPECT_TRUE(proof.domain_undefined());
  EXPECT_TRUE(proof.network_state_removed());
  EXPECT_TRUE(proof.has_verified_at());
  EXPECT_EQ(cl_rec.Stages(), (std::vector<std::string>{"undefine", "wipe", "network"}));
  EXPECT_EQ(network_cleaned_, std::vector<std::string>{alloc});
  EXPECT_EQ(Signatures(disk), "");
  EXPECT_EQ(ReadAll(disk).find_first_not_of('\0'), std::string::npos);
  EXPECT_FALSE(Has("lease-" + alloc));

  // Released twice: nothing left to stop.
  auto again = rt_->Release(rel, [](auto&&...) {});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->stop(), v1::STOP_METHOD_ABSENT);
}

TEST_F(LibvirtRuntimeTest, NoLeaseFailsReadinessAndCleanupRemovesTheLeftoverDomain) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  auto out = rt_->Provision(b, [](auto&&...) {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().reason, "lease_timeout");
  EXPECT_EQ(out.error().details.at("stage"), "readiness");
  EXPECT_EQ(out.error().details.at("mac"), b.slots(0).mac());
  EXPECT_EQ(State(alloc), "running");  // left for release/cleanup
  EXPECT_TRUE(Has("lease-" + alloc));
  EXPECT_EQ((**sb_->store().Get("domain-" + alloc)).value("state", ""), "started");

  // Straight to cleanup (no release): the VM is destroyed and undefined before the wipe.
  auto o = rt_->options();
  o.network_cleanup = nullptr;
  LibvirtRuntime rt(sb_->store(), o);
  auto cleaned = rt.Cleanup(CleanupOf(b), [](auto&&...) {});
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  EXPECT_EQ(State(alloc), "absent");
  EXPECT_TRUE(cleaned->proofs(0).domain_undefined());
  EXPECT_FALSE(cleaned->proofs(0).network_state_removed());  // no hook: not claimed
  EXPECT_EQ(Signatures(sb_->DiskPath(b.slots(0).nvme_by_id())), "");
  EXPECT_FALSE(Has("lease-" + alloc));
  EXPECT_FALSE(Has("domain-" + alloc));
}

TEST_F(LibvirtRuntimeTest, SshTimeoutAndLeaseMismatchFailReadiness) {
  Init();
  const std::string a1 = ids::NewUuidV7();
  auto b1 = Bundle(a1, 1);
  sb_->Lease(b1.slots(0).mac(), b1.slots(0).private_ip());
  ssh_up_ = false;
  auto r1 = rt_->Provision(b1, [](auto&&...) {});
  ASSERT_FALSE(r1.ok());
  EXPECT_EQ(r1.error().reason, "ssh_timeout");
  EXPECT_EQ(r1.error().details.at("stage"), "readiness");
  EXPECT_FALSE(probes_.empty());
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(b1), [](auto&&...) {}).ok());

  ssh_up_ = true;
  const std::string a2 = ids::NewUuidV7();
  auto b2 = Bundle(a2, 1);
  sb_->Lease(b2.slots(0).mac(), "10.100.0.250");
  auto r2 = rt_->Provision(b2, [](auto&&...) {});
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.error().reason, "lease_mismatch");
  EXPECT_EQ(r2.error().details.at("actual_ip"), "10.100.0.250");
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(b2), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, ANewAttemptWhileTheOldVmRunsIsRefusedBeforeAnyWrite) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  sb_->Lease(b.slots(0).mac(), b.slots(0).private_ip());
  ASSERT_TRUE(rt_->Provision(b, [](auto&&...) {}).ok());
  const std::string disk = sb_->DiskPath(b.slots(0).nvme_by_id());
  WriteAll(disk, std::string(8192, 'g'));  // the guest's writes
  b.set_attempt(2);
  auto again = rt_->Provision(b, [](auto&&...) {});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().reason, "domain_running");
  EXPECT_EQ(again.error().details.at("stage"), "validate");
  EXPECT_EQ(ReadAll(disk), std::string(8192, 'g'));
  EXPECT_EQ(State(alloc), "running");
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(b), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, ADomainLeftPausedBeforeItsImageVerifiedIsDestroyedAndProvisionedAgain) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  sb_->Lease(b.slots(0).mac(), b.slots(0).private_ip());
  ASSERT_TRUE(rt_->Provision(b, [](auto&&...) {}).ok());
  // As if the agent died after starting it paused, while the image was still being written
  // (libvirt's test driver cannot start paused: suspend it and record what the agent records).
  virDomainPtr d = virDomainLookupByName(conn_, DomainName(alloc).c_str());
  ASSERT_NE(d, nullptr);
  ASSERT_EQ(virDomainSuspend(d), 0);
  virDomainFree(d);
  ASSERT_TRUE(PutDomainRecord(sb_->store(), b, "paused", "libvirt").ok());
  const std::string disk = sb_->DiskPath(b.slots(0).nvme_by_id());
  WriteAll(disk, std::string(8192, 'g'));

  std::vector<std::string> said;
  auto again = rt_->Provision(
      b, [&](const std::string&, const std::string& detail, int) { said.push_back(detail); });
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  EXPECT_NE(std::find_if(said.begin(), said.end(),
                         [](const std::string& x) {
                           return x.find("never resumed: destroyed") != std::string::npos;
                         }),
            said.end());
  EXPECT_EQ(Sha256(disk), digest_);  // written again
  EXPECT_EQ(State(alloc), "running");
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(b), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, ARedeliveredProvisionOfTheRunningAttemptResumesWithoutRewriting) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  // The agent "crashed" while waiting for readiness: the domain runs, the ledger says started.
  ASSERT_FALSE(rt_->Provision(b, [](auto&&...) {}).ok());
  ASSERT_EQ(State(alloc), "running");
  const std::string disk = sb_->DiskPath(b.slots(0).nvme_by_id());
  WriteAll(disk, std::string(8192, 'g'));  // the guest's writes
  sb_->Lease(b.slots(0).mac(), b.slots(0).private_ip());

  LibvirtRuntime restarted(sb_->store(), rt_->options());
  auto adopted = restarted.Adopt();
  ASSERT_TRUE(adopted.ok()) << adopted.error().ToString();
  ASSERT_EQ(adopted->adopted.size(), 1u);
  std::vector<std::string> stages;
  auto out =
      restarted.Provision(b, [&](const std::string& st, auto&&...) { stages.push_back(st); });
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_EQ(out->actual_ip(), b.slots(0).private_ip());
  EXPECT_EQ(stages.front(), "adopt");
  EXPECT_EQ(std::count(stages.begin(), stages.end(), "image"), 0);
  EXPECT_EQ(ReadAll(disk), std::string(8192, 'g'));  // nothing rewritten under the VM
  EXPECT_EQ((**sb_->store().Get("domain-" + alloc)).value("state", ""), "running");

  // A later attempt is not a resume: refused while that VM runs.
  b.set_attempt(2);
  auto again = restarted.Provision(b, [](auto&&...) {});
  ASSERT_FALSE(again.ok());
  EXPECT_EQ(again.error().reason, "domain_running");
  ASSERT_TRUE(restarted.Cleanup(CleanupOf(b), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, AGpuPassedThroughToAnotherDomainIsRefusedBeforeAnyWrite) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  // A VM this agent does not manage already holds the slot's GPU (defined, not even running).
  unsigned dom = 0, bus = 0, slot = 0, fn = 0;
  ASSERT_EQ(
      std::sscanf(b.slots(0).gpu_pci_address().c_str(), "%x:%x:%x.%x", &dom, &bus, &slot, &fn), 4);
  const std::string xml = fmt::format(
      "<domain type='test'><name>legacy-vm</name><memory>1048576</memory><vcpu>1</vcpu>"
      "<os><type arch='x86_64'>hvm</type></os><devices><hostdev mode='subsystem' type='pci' "
      "managed='yes'><source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' "
      "function='0x{:x}'/></source></hostdev></devices></domain>",
      dom, bus, slot, fn);
  virDomainPtr legacy = virDomainDefineXML(conn_, xml.c_str());
  ASSERT_NE(legacy, nullptr);
  const std::string disk = sb_->DiskPath(b.slots(0).nvme_by_id());
  const std::string before = ReadAll(disk);
  sb_->Lease(b.slots(0).mac(), b.slots(0).private_ip());
  auto out = rt_->Provision(b, [](auto&&...) {});
  virDomainUndefine(legacy);
  virDomainFree(legacy);
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().reason, "device_attached");
  EXPECT_EQ(out.error().details.at("stage"), "validate");
  EXPECT_EQ(out.error().details.at("domain_name"), "legacy-vm");
  EXPECT_EQ(out.error().details.at("pci_address"), b.slots(0).gpu_pci_address());
  EXPECT_EQ(ReadAll(disk), before);
  EXPECT_FALSE(Has("lease-" + alloc));
  // Once that VM is gone the same bundle provisions.
  auto again = rt_->Provision(b, [](auto&&...) {});
  ASSERT_TRUE(again.ok()) << again.error().ToString();
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(b), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, TheNodesTerminalRelayKeyIsCreatedOnceAndSeededIntoEveryVm) {
  Init();
  auto o = rt_->options();
  o.relay_key_path = sb_->work() + "/terminal/id_ed25519";
  LibvirtRuntime rt(sb_->store(), o);
  std::string first_pub;
  for (int i = 0; i < 2; ++i) {
    const std::string alloc = ids::NewUuidV7();
    auto b = Bundle(alloc);
    sb_->Lease(b.slots(0).mac(), b.slots(0).private_ip());
    auto out = rt.Provision(b, [](auto&&...) {});
    ASSERT_TRUE(out.ok()) << out.error().ToString();
    const std::string pub = Trim(ReadAll(o.relay_key_path + ".pub"));
    ASSERT_EQ(pub.rfind("ssh-ed25519 ", 0), 0u) << pub;
    if (i == 0) first_pub = pub;
    EXPECT_EQ(pub, first_pub) << "the key is the node's, created once";
    const std::string user_data = ReadAll(o.seed_dir + "/" + alloc + "/user-data");
    EXPECT_NE(user_data.find(pub.substr(0, 40)), std::string::npos) << user_data;
    // The tenant's own key is still there, first.
    EXPECT_LT(user_data.find(b.cloud_init().ssh_authorized_keys(0).substr(0, 30)),
              user_data.find(pub.substr(0, 40)));
    ASSERT_TRUE(rt.Cleanup(CleanupOf(b), [](auto&&...) {}).ok());
  }
  EXPECT_EQ(fs::status(o.relay_key_path).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  EXPECT_EQ(fs::status(sb_->work() + "/terminal").permissions() & fs::perms::all,
            fs::perms::owner_all);
}

TEST_F(LibvirtRuntimeTest, DigestMismatchFailsBeforeTheDiskIsWritten) {
  Init();
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  b.mutable_image()->set_sha256(std::string(64, 'a'));
  const std::string disk = sb_->DiskPath(b.slots(0).nvme_by_id());
  const std::string before = ReadAll(disk);
  auto out = rt_->Provision(b, [](auto&&...) {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().reason, "image_digest_mismatch");
  EXPECT_EQ(out.error().details.at("stage"), "image");
  EXPECT_EQ(out.error().details.at("actual_sha256"), digest_);
  EXPECT_EQ(ReadAll(disk), before);
  EXPECT_EQ(State(alloc), "absent");
  for (const auto& e : fs::directory_iterator(sb_->work() + "/images")) {
    // Nothing unverified is cached (the image's lock file stays).
    EXPECT_EQ(e.path().extension(), ".lock") << e.path();
  }
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(b), [](auto&&...) {}).ok());

  auto missing = Bundle(ids::NewUuidV7());
  missing.mutable_image()->set_url("file://" + sb_->work() + "/nope.img");
  auto r = rt_->Provision(missing, [](auto&&...) {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "image_not_found");
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(missing), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, ACachedImageThatRottedIsFetchedAgainAndTheDiskStillGetsItsBytes) {
  Init();
  auto first = Bundle(ids::NewUuidV7());
  sb_->Lease(first.slots(0).mac(), first.slots(0).private_ip());
  ASSERT_TRUE(rt_->Provision(first, [](auto&&...) {}).ok());
  v1::ReleaseParams rel;
  rel.set_allocation_id(first.allocation_id());
  ASSERT_TRUE(rt_->Release(rel, [](auto&&...) {}).ok());
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(first), [](auto&&...) {}).ok());

  // A byte of the cached copy flips; its size and mtime stay (only reading it can tell).
  const std::string cached = sb_->work() + "/images/" + digest_ + ".img";
  struct stat st {};
  ASSERT_EQ(::stat(cached.c_str(), &st), 0);
  {
    std::fstream f(cached, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100000);
    const char c = static_cast<char>(f.peek());
    f.put(static_cast<char>(c ^ 0x20));
  }
  const timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, cached.c_str(), times, 0), 0);
  ASSERT_NE(Sha256(cached), digest_);

  auto second = Bundle(ids::NewUuidV7());
  sb_->Lease(second.slots(0).mac(), second.slots(0).private_ip());
  std::vector<std::string> said;
  auto out = rt_->Provision(
      second, [&](const std::string&, const std::string& d, int) { said.push_back(d); });
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_NE(std::find_if(said.begin(), said.end(),
                         [](const std::string& d) {
                           return d.find("no longer matches its digest") != std::string::npos;
                         }),
            said.end());
  EXPECT_EQ(Sha256(sb_->DiskPath(second.slots(0).nvme_by_id())), digest_);
  EXPECT_EQ(Sha256(cached), digest_);
  rel.set_allocation_id(second.allocation_id());
  ASSERT_TRUE(rt_->Release(rel, [](auto&&...) {}).ok());
  ASSERT_TRUE(rt_->Cleanup(CleanupOf(second), [](auto&&...) {}).ok());
}

TEST_F(LibvirtRuntimeTest, MountedChildDiskIsRefusedBeforeAnyWrite) {
  FixtureOptions fo;
  fo.mounted_child_nvme = 0;
  Init(fo);
  const std::string alloc = ids::NewUuidV7();
  auto b = Bundle(alloc);
  // Point the slot at the mounted disk (discovery does not offer it as a candidate's disk).
  auto devices = DiscoverDevices(sb_->root());
  ASSERT_TRUE(devices.ok());
  std::string mounted;
  for (const auto& d : devices->nvme()) {
    for (const auto& p : d.partitions()) {
      if (p.mountpoints_size() > 0 && !d.os_disk()) mounted = d.by_id_path();
    }
  }
  ASSERT_FALSE(mounted.empty());
  b.mutable_slots(0)->set_nvme_by_id(mounted);
  const std::string before = ReadAll(sb_->DiskPath(mounted));
  auto out = rt_->Provision(b, [](auto&&...) {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().reason, "disk_child_mounted");
  EXPECT_EQ(out.error().details.at("stage"), "validate");
  EXPECT_EQ(ReadAll(sb_->DiskPath(mounted)), before);
  EXPECT_FALSE(Has("lease-" + alloc));
  EXPECT_EQ(State(alloc), "absent");

  auto cleaned = rt_->Cleanup(CleanupOf(b), [](auto&&...) {});
  ASSERT_FALSE(cleaned.ok());
  EXPECT_EQ(cleaned.error().reason, "disk_child_mounted");
  EXPECT_EQ(ReadAll(sb_->DiskPath(mounted)), before);
}

TEST_F(LibvirtRuntimeTest, HostChecksBeforeAnythingIsLeased) {
  FixtureOptions fo;
  fo.hugepages_free = 2;
  Init(fo);
  auto b = Bundle(ids::NewUuidV7());
  b.mutable_shape()->set_memory_mib(4096);
  b.mutable_shape()->set_hugepages_1g(4);
  auto out = rt_->Provision(b, [](auto&&...) {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().reason, "hugepages_insufficient");
  EXPECT_FALSE(Has("lease-" + b.allocation_id()));

  FixtureOptions nobr;
  nobr.bridge = false;
  Init(nobr);
  auto b2 = Bundle(ids::NewUuidV7());
  auto r2 = rt_->Provision(b2, [](auto&&...) {});
  ASSERT_FALSE(r2.ok());
  EXPECT_EQ(r2.error().reason, "bridge_missing");
  EXPECT_EQ(r2.error().details.at("stage"), "validate");
}

TEST_F(LibvirtRuntimeTest, AdoptionFindsAdoptedOrphanAndMissingDomains) {
  Init();
  // Adopted: provisioned by this agent (4 slots, to exercise a bigger domain too).
  const std::string known = ids::NewUuidV7();
  auto kb = Bundle(known, 4);
  sb_->Lease(kb.slots(0).mac(), kb.slots(0).private_ip());
  auto out = rt_->Provision(kb, [](auto&&...) {});
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  // Orphan: defined directly through libvirt, unknown to the ledger.
  const std::string orphan = ids::NewUuidV7();
  auto ob = sb_->Bundle(1, orphan);
  auto xo = XmlOptions();
  xo.domain_type = "qemu";
  auto oxml = GenerateDomainXml(ob, xo);
  ASSERT_TRUE(oxml.ok());
  virDomainPtr od = virDomainDefineXML(conn_, oxml->c_str());
  ASSERT_NE(od, nullptr);
  virDomainFree(od);
  // Missing: the ledger has a domain record, libvirt has no such domain.
  const std::string gone = ids::NewUuidV7();
  ASSERT_TRUE(sb_->store().Put("domain-" + gone, {{"state", "running"}}).ok());

  LibvirtRuntime fresh(sb_->store(), rt_->options());  // an agent restart
  EXPECT_FALSE(fresh.Adopted());
  auto rep = fresh.Adopt();
  ASSERT_TRUE(rep.ok()) << rep.error().ToString();
  EXPECT_TRUE(fresh.Adopted());
  auto find = [](const std::vector<AdoptedDomain>& v, const std::string& alloc) {
    for (const auto& a : v) {
      if (a.domain_name == DomainName(alloc)) return std::optional<AdoptedDomain>(a);
    }
    return std::optional<AdoptedDomain>();
  };
  auto a = find(rep->adopted, known);
  ASSERT_TRUE(a);
  EXPECT_EQ(a->allocation_id, known);
  EXPECT_EQ(a->state, "running");
  EXPECT_EQ(a->ledger_state, "running");
  auto o = find(rep->orphans, orphan);
  ASSERT_TRUE(o);
  EXPECT_EQ(o->state, "shutoff");
  EXPECT_EQ(o->allocation_id, orphan);
  auto m = find(rep->missing, gone);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->state, "absent");
  EXPECT_EQ(m->ledger_state, "running");
  EXPECT_FALSE(find(rep->orphans, known));
  EXPECT_FALSE(find(rep->adopted, orphan));

  // Cleanup of the orphan's allocation removes it like any leftover (once the known allocation,
  // which leases the same slot, is gone).
  ASSERT_TRUE(fresh.Cleanup(CleanupOf(kb), [](auto&&...) {}).ok());
  EXPECT_EQ(State(known), "absent");
  auto co = fresh.Cleanup(CleanupOf(ob), [](auto&&...) {});
  ASSERT_TRUE(co.ok()) << co.error().ToString();
  EXPECT_EQ(State(orphan), "absent");
}

// ---------------------------------------------------------------------------------------------
// Root only: a loop device stands in for the slot's NVMe. The fixture's device node for the
// slot's disk is replaced by a block node with the loop device's numbers.

class LoopDiskTest : public LibvirtRuntimeTest {
 protected:
  void SetUp() override {
    LibvirtRuntimeTest::SetUp();
    if (IsSkipped()) return;
    if (::geteuid() != 0) GTEST_SKIP() << "needs root (loop devices, mknod, mount)";
    for (const char* t : {"losetup", "mount", "umount", "blkdiscard"}) {
      if (!Tool(t)) GTEST_SKIP() << t << " is not installed";
    }
    if (!fs::exists("/dev/loop-control")) GTEST_SKIP() << "no /dev/loop-control";
    Init();
    backing_ = sb_->work() + "/slice.raw";
    auto t = RunTool({"/usr/bin/truncate", "-s", "64M", backing_});
    ASSERT_TRUE(t.ok() && t->exit_code == 0);
    auto l = RunTool({*Tool("losetup"), "-f", "--show", backing_}, std::chrono::seconds(30));
    if (!l.ok() || l->exit_code != 0) {
      GTEST_SKIP() << "losetup failed: " << (l.ok() ? l->err : l.error().ToString());
    }
    loop_ = Trim(l->out);
    alloc_ = ids::NewUuidV7();
    bundle_ = Bundle(alloc_);
    node_ = sb_->DiskPath(bundle_.slots(0).nvme_by_id());
    struct stat st {};
    ASSERT_EQ(::stat(loop_.c_str(), &st), 0);
    ASSERT_TRUE(fs::remove(node_));
    ASSERT_EQ(::mknod(node_.c_str(), S_IFBLK | 0600, st.st_rdev), 0) << std::strerror(errno);
  }
  void TearDown() override {
    if (!mnt_.empty()) (void)RunTool({*Tool("umount"), mnt_}, std::chrono::seconds(30));
    if (!loop_.empty()) (void)RunTool({*Tool("losetup"), "-d", loop_}, std::chrono::seconds(30));
    LibvirtRuntimeTest::TearDown();
  }
  void Mkfs() {
    auto r = RunTool({*Tool("mkfs.ext4"), "-q", "-F", loop_}, std::chrono::seconds(60));
    ASSERT_TRUE(r.ok() && r->exit_code == 0);
  }
  std::string Head() {
    std::ifstream f(loop_, std::ios::binary);
    std::string s(1 << 16, '\0');
    f.read(s.data(), static_cast<std::streamsize>(s.size()));
    return s;
  }
  bool Discards() {
    return Trim(ReadAll("/sys/block/" + Basename(loop_) + "/queue/discard_max_bytes")) != "0";
  }

  std::string backing_, loop_, node_, mnt_, alloc_;
  v1::ProvisionBundle bundle_;
};

TEST_F(LoopDiskTest, WipeProofOnALoopDeviceWithExt4) {
  Mkfs();
  ASSERT_EQ(Signatures(loop_), "ext4");
  auto cleaned = rt_->Cleanup(CleanupOf(bundle_), [](auto&&...) {});
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  EXPECT_EQ(cleaned->proofs(0).method(),
            Discards() ? v1::WIPE_METHOD_DISCARD : v1::WIPE_METHOD_ZERO);
  EXPECT_FALSE(cleaned->proofs(0).signatures_remaining());
  EXPECT_EQ(Signatures(loop_), "");
  auto blkid = RunTool({*Tool("blkid"), "-p", loop_});
  ASSERT_TRUE(blkid.ok());
  EXPECT_EQ(blkid->exit_code, 2);  // nothing found
}

TEST_F(LoopDiskTest, ProvisionWritesTheImageOntoTheBlockDevice) {
  sb_->Lease(bundle_.slots(0).mac(), bundle_.slots(0).private_ip());
  auto out = rt_->Provision(bundle_, [](auto&&...) {});
  ASSERT_TRUE(out.ok()) << out.error().ToString();
  EXPECT_EQ(Signatures(loop_), "ext4");
  EXPECT_EQ(Head(), ReadAll(image_).substr(0, 1 << 16));
  v1::ReleaseParams rel;
  rel.set_allocation_id(alloc_);
  ASSERT_TRUE(rt_->Release(rel, [](auto&&...) {}).ok());
  auto cleaned = rt_->Cleanup(CleanupOf(bundle_), [](auto&&...) {});
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  EXPECT_EQ(Signatures(loop_), "");
}

TEST_F(LoopDiskTest, MountedDiskIsRefusedBeforeAnyWrite) {
  Mkfs();
  mnt_ = sb_->work() + "/mnt";
  fs::create_directories(mnt_);
  // Read-only: a read-write ext4 mount writes its own superblock later (journal commits), which
  // the head comparison below would blame on the runtime (CI saw it once).
  auto m = RunTool({*Tool("mount"), "-o", "ro", loop_, mnt_}, std::chrono::seconds(30));
  if (!m.ok() || m->exit_code != 0) {
    mnt_.clear();
    GTEST_SKIP() << "mount failed: " << (m.ok() ? m->err : m.error().ToString());
  }
  const std::string before = Head();
  sb_->Lease(bundle_.slots(0).mac(), bundle_.slots(0).private_ip());
  // The fixture's mount table knows nothing: the kernel's view refuses it.
  auto out = rt_->Provision(bundle_, [](auto&&...) {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.error().reason, "disk_mounted");
  EXPECT_EQ(out.error().details.at("stage"), "validate");
  EXPECT_EQ(out.error().details.at("evidence"), "kernel");
  EXPECT_EQ(out.error().details.at("mountpoint"), mnt_);
  EXPECT_FALSE(Has("lease-" + alloc_));
  EXPECT_EQ(State(alloc_), "absent");
  auto cleaned = rt_->Cleanup(CleanupOf(bundle_), [](auto&&...) {});
  ASSERT_FALSE(cleaned.ok());
  EXPECT_EQ(cleaned.error().reason, "disk_mounted");
  EXPECT_EQ(Head(), before);
  EXPECT_EQ(Signatures(loop_), "ext4");
}

// ---------------------------------------------------------------------------------------------
// A real VM (TCG) through qemu:///system: run by scripts/e2e/vm-e2e.sh, which builds the guest,
// starts dnsmasq, virtlogd and libvirtd inside a network namespace and runs this test there.

class VmE2eTest : public LoopDiskTest {
 protected:
  void SetUp() override {
    guest_ = Env("GPUAAS_VM_E2E_GUEST");
    if (guest_.empty()) GTEST_SKIP() << "real-VM e2e: run scripts/e2e/vm-e2e.sh (root)";
    LoopDiskTest::SetUp();
  }
  static std::string Env(const char* name) {
    const char* v = std::getenv(name);
    return v ? v : "";
  }
  std::string guest_;
};

TEST_F(VmE2eTest, ProvisionsAReachableVmReleasesItAndWipesTheDisk) {
  using Clock = std::chrono::steady_clock;
  // qemu runs as another user: it must reach the fixture's disk link, the seed and the NVRAM.
  for (const auto& d : {sb_->root(), sb_->work()}) {
    fs::permissions(d, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                           fs::perms::others_read | fs::perms::others_exec);
  }
  const std::string bridge = Env("GPUAAS_VM_E2E_BRIDGE");
  fs::create_directories(sb_->root() + "/sys/class/net/" + bridge);
  auto o = rt_->options();
  o.uri = "qemu:///system";
  o.allow_regular_file_disks = false;
  o.lease_file = Env("GPUAAS_VM_E2E_LEASES");
  o.lease_timeout = std::chrono::seconds(240);
  o.ssh_timeout = std::chrono::seconds(120);
  o.poll_interval = milliseconds(200);
  o.ssh_probe = nullptr;        // the real banner probe: this process runs in the VM's netns
  o.network_cleanup = nullptr;  // the script's dnsmasq is not the agent's: nothing claimed
  o.domain = DomainXmlOptions{};
  o.domain.domain_type = "qemu";
  o.domain.cpu_mode = "maximum";
  o.domain.passthrough = false;  // no GPUs/VFs to hand over on this machine
  o.domain.bridge = bridge;
  // vm-e2e.sh's DATAPATH=ovs: the agent's own applier builds the slice network on Open vSwitch
  // (bridge, gateway, dnsmasq with the one reservation, NAT, flows, policing), the vNIC attaches
  // with <virtualport type='openvswitch'/> (libvirtd finds OVS through OVS_RUNDIR), and the
  // runtime's vnic_attached hook re-applies it so the flows admit the new port before readiness.
  const bool ovs = !Env("GPUAAS_VM_E2E_OVS").empty();
  o.domain.bridge_is_ovs = ovs;
  o.domain.userspace_datapath = ovs;
  NetworkSpec net;
  NetContext net_ctx;
  // The network goes when the test ends, however it ends (its dnsmasq would outlive the netns).
  struct NetDown {
    const NetworkSpec* spec = nullptr;
    const NetContext* ctx = nullptr;
    ~NetDown() {
      if (spec != nullptr) (void)TeardownNetwork(*spec, *ctx);
    }
  } net_down;
  if (ovs) {
    net.datapath = Datapath::kOvs;
    net.bridge = bridge;
    net.gateway_cidr = "10.100.0.1/24";
    net.subnet_cidr = "10.100.0.0/24";
    net.reservations = {{Env("GPUAAS_VM_E2E_MAC"), Env("GPUAAS_VM_E2E_IP"), "gpuslice-e2e",
                         bundle_.slots(0).slot_key()}};
    net.state_dir = Env("GPUAAS_VM_E2E_NET_DIR");
    net.vnic_ingress_kbps = 1000000;
    net.vnic_ingress_burst_kb = 100000;
    net.version = 1;
    net_ctx.ovs_rundir = Env("OVS_RUNDIR");
    net_ctx.ovs_datapath_type = "netdev";
    net_down = {&net, &net_ctx};
    auto applied = ApplyNetwork(net, net_ctx);
    ASSERT_TRUE(applied.ok()) << applied.error().ToString();
    EXPECT_TRUE(applied->created_bridge);
    o.lease_file = net.state_dir + "/dnsmasq.leases";
    o.vnic_attached = [net, net_ctx]() -> Result<void> {
      auto r = ApplyNetwork(net, net_ctx);
      if (!r.ok()) return r.error();
      return Ok();
    };
  }
  o.domain.kernel = guest_ + "/vmlinuz";
  o.domain.initrd = guest_ + "/initrd.img";
  o.domain.cmdline = "console=ttyS0 quiet panic=-1";
  o.domain.serial_log = sb_->work() + "/serial.log";
  rt_.emplace(sb_->store(), o);

  const std::string image = guest_ + "/image.raw";
  auto b = bundle_;
  b.mutable_slots(0)->set_mac(Env("GPUAAS_VM_E2E_MAC"));
  b.mutable_slots(0)->set_private_ip(Env("GPUAAS_VM_E2E_IP"));
  b.mutable_image()->set_url("file://" + image);
  b.mutable_image()->set_sha256(Sha256(image));
  b.mutable_shape()->set_vcpus(1);
  b.mutable_shape()->set_memory_mib(256);
  b.mutable_shape()->set_numa_node(-1);
  b.mutable_cloud_init()->set_hostname("gpuslice-e2e");
  b.mutable_cloud_init()->clear_ssh_authorized_keys();
  b.mutable_cloud_init()->add_ssh_authorized_keys(Trim(ReadAll(guest_ + "/id_ed25519.pub")));

  const auto t0 = Clock::now();
  auto last = t0;
  auto progress = [&](const std::string& stage, const std::string& detail, int pct) {
    const auto now = Clock::now();
    std::cout << fmt::format("[{:6.1f}s +{:5.1f}s] {} {}% {}\n",
                             std::chrono::duration<double>(now - t0).count(),
                             std::chrono::duration<double>(now - last).count(), stage, pct, detail);
    last = now;
  };
  auto out = rt_->Provision(b, progress);
  ASSERT_TRUE(out.ok()) << out.error().ToString() << "\nserial:\n"
                        << ReadAll(sb_->work() + "/serial.log");
  EXPECT_EQ(out->lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(out->actual_ip(), b.slots(0).private_ip());
  if (ovs) {
    // The guest's tap is an OVS port of the bridge, tagged with the slot MAC by libvirt, then
    // policed and tagged with its slot by the agent, and admitted by the agent's flows; the
    // check sees nothing to repair.
    const std::string db = "--db=unix:" + Env("OVS_RUNDIR") + "/db.sock";
    auto port = RunTool({*Tool("ovs-vsctl"), db, "--bare", "--columns=name", "find", "Interface",
                         "external_ids:attached-mac=\"" + b.slots(0).mac() + "\""});
    ASSERT_TRUE(port.ok());
    const std::string name = Trim(port->out);
    ASSERT_FALSE(name.empty()) << port->err;
    auto on = RunTool({*Tool("ovs-vsctl"), db, "port-to-br", name});
    ASSERT_TRUE(on.ok());
    EXPECT_EQ(Trim(on->out), bridge);
    auto tag = RunTool({*Tool("ovs-vsctl"), db, "get", "interface", name,
                        "external_ids:gpuaas-slot", "ingress_policing_rate"});
    ASSERT_TRUE(tag.ok());
    EXPECT_EQ(tag->out, "\"" + bundle_.slots(0).slot_key() + "\"\n1000000\n");
    auto flows = RunTool({*Tool("ovs-ofctl"), "--no-names", "dump-flows",
                          "unix:" + Env("OVS_RUNDIR") + "/" + bridge + ".mgmt", "--no-stats"});
    ASSERT_TRUE(flows.ok());
    EXPECT_NE(flows->out.find("dl_src=" + b.slots(0).mac() + " actions=LOCAL"), std::string::npos)
        << flows->out;
    auto check = CheckNetwork(net, net_ctx);
    ASSERT_TRUE(check.ok()) << check.error().ToString();
    EXPECT_TRUE(check->blockers.empty()) << Join(check->blockers);
    progress("check",
             "vNIC " + name + " is a policed port of OVS bridge " + bridge +
                 ", admitted by the agent's flows",
             100);
  }

  // Into the guest with the seeded key: the seed's hostname, UEFI, the slice disk with the image.
  const std::string probe =
      "hostname; [ -d /sys/firmware/efi ] && echo efi; "
      "dd if=/dev/vda bs=1 skip=1080 count=2 2>/dev/null | od -An -tx1";
  auto ssh =
      RunTool({*Tool("ssh"), "-i", guest_ + "/id_ed25519", "-o", "StrictHostKeyChecking=no", "-o",
               "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10",
               "-o", "BatchMode=yes", "root@" + out->actual_ip(), probe},
              std::chrono::seconds(60));
  ASSERT_TRUE(ssh.ok()) << ssh.error().ToString();
  EXPECT_EQ(ssh->exit_code, 0) << ssh->err;
  EXPECT_NE(ssh->out.find("gpuslice-e2e\n"), std::string::npos) << ssh->out;
  EXPECT_NE(ssh->out.find("efi\n"), std::string::npos) << ssh->out;
  EXPECT_NE(ssh->out.find("53 ef"), std::string::npos) << ssh->out;  // ext4 magic on vda
  progress("check", "ssh: " + ssh->out.substr(0, ssh->out.find('\n')), 100);

  v1::ReleaseParams rel;
  rel.set_allocation_id(alloc_);
  rel.set_graceful_timeout_s(60);
  auto released = rt_->Release(rel, progress);
  ASSERT_TRUE(released.ok()) << released.error().ToString();
  EXPECT_EQ(released->stop(), v1::STOP_METHOD_GRACEFUL);
  EXPECT_FALSE(fs::exists(o.domain.nvram_dir + "/" + DomainName(alloc_) + "_VARS.fd"));

  auto cleaned = rt_->Cleanup(CleanupOf(b), progress);
  ASSERT_TRUE(cleaned.ok()) << cleaned.error().ToString();
  EXPECT_FALSE(cleaned->proofs(0).signatures_remaining());
  EXPECT_TRUE(cleaned->proofs(0).domain_undefined());
  EXPECT_FALSE(cleaned->proofs(0).network_state_removed());
  EXPECT_EQ(Signatures(loop_), "");
  progress("done", "proof method " + enums::Text(cleaned->proofs(0).method()), 100);

  // An image whose cached copy rotted and whose source changed since: the domain started paused
  // for it is destroyed without ever running, and the disk has no boot sector.
  const std::string bad = sb_->work() + "/changing.raw";
  fs::copy_file(image, bad, fs::copy_options::overwrite_existing);
  auto c = b;
  c.set_allocation_id(ids::NewUuidV7());
  c.mutable_image()->set_url("file://" + bad);
  c.mutable_image()->set_sha256(Sha256(bad));
  ImageCacheOptions io;
  io.dir = o.image_cache_dir;
  auto cached = ImageCache(io).Ensure(c.image(), {});
  ASSERT_TRUE(cached.ok()) << cached.error().ToString();
  struct stat st {};
  ASSERT_EQ(::stat(cached->path.c_str(), &st), 0);
  {
    std::fstream f(cached->path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(1 << 20);
    f.put('\x5a');
    f.put('\xa5');
  }
  const timespec times[2] = {st.st_atim, st.st_mtim};
  ASSERT_EQ(::utimensat(AT_FDCWD, cached->path.c_str(), times, 0), 0);
  WriteAll(bad, ReadAll(image) + "changed at the source");
  std::vector<std::string> said;
  auto failed = rt_->Provision(c, [&](const std::string& stage, const std::string& d, int pct) {
    progress(stage, d, pct);
    said.push_back(d);
  });
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.error().reason, "image_digest_mismatch");
  EXPECT_EQ(failed.error().details.at("stage"), "image");
  EXPECT_NE(
      std::find_if(said.begin(), said.end(),
                   [](const std::string& d) {
                     return d.find("started paused for this image, destroyed: it never ran") !=
                            std::string::npos;
                   }),
      said.end());
  virConnectPtr qemu = virConnectOpen("qemu:///system");
  ASSERT_NE(qemu, nullptr);
  virDomainPtr left = virDomainLookupByName(qemu, DomainName(c.allocation_id()).c_str());
  ASSERT_NE(left, nullptr);  // defined, for cleanup
  EXPECT_EQ(virDomainIsActive(left), 0);
  virDomainFree(left);
  virConnectClose(qemu);
  EXPECT_EQ(Head(), std::string(1 << 16, '\0'));
  auto cleaned_c = rt_->Cleanup(CleanupOf(c), progress);
  ASSERT_TRUE(cleaned_c.ok()) << cleaned_c.error().ToString();
  EXPECT_TRUE(cleaned_c->proofs(0).domain_undefined());
  EXPECT_EQ(Signatures(loop_), "");
}

}  // namespace
}  // namespace gpuaas::node_agent
