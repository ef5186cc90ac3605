// Slice networking. NetSpecValidationTest and NetLeaseTest are pure (a recording runner, a lease
// file in a temp dir). NetApplyTest runs the real thing (bridge, iptables, dnsmasq, busybox
// udhcpc/ping) inside network namespaces it creates per test and deletes afterwards: the root
// namespace's network is never touched and no packet leaves the machine. It SKIPs without root
// or the tools.
#include "gpuaas/node_agent/network/net_apply.hpp"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "gpuaas/node_agent/host/host.hpp"
#include "netns_lab.hpp"

namespace gpuaas::node_agent {
namespace {

using testing::TempDir;

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::Not;

constexpr const char* kMac1 = "52:54:00:a0:00:01";
constexpr const char* kMac2 = "52:54:00:a0:00:02";
constexpr const char* kMac3 = "52:54:00:a0:00:03";
constexpr const char* kStranger = "52:54:00:bb:00:99";

NetworkSpec BaseSpec(const std::string& state_dir) {
  NetworkSpec s;
  s.bridge = "gpuaasbr0";
  s.gateway_cidr = "10.100.0.1/24";
  s.subnet_cidr = "10.100.0.0/24";
  s.state_dir = state_dir;
  s.reservations = {{kMac1, "10.100.0.10", "slice-1", "node-a/0"},
                    {kMac2, "10.100.0.11", "slice-2", "node-a/1"}};
  s.version = 1;
  return s;
}

std::string Slurp(const std::string& path) {
  std::ifstream f(path);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void Spit(const std::string& path, const std::string& content) {
  std::ofstream f(path, std::ios::trunc);
  f << content;
}

// ---------------------------------------------------------------- validation (unit)

class Recorder {
 public:
  NetContext Ctx() {
    NetContext ctx;
    ctx.netns = "gpuaas-never";
    ctx.run = [this](const std::vector<std::string>& argv, std::chrono::milliseconds) {
      calls.push_back(argv);
      return Result<ToolResult>(ToolResult{0, false, "", ""});
    };
    return ctx;
  }
  std::vector<std::vector<std::string>> calls;
};

std::string NeverDir() { return fmt::format("/tmp/gpuaas-net-never-{}/net", ::getpid()); }

// Every entry point refuses the spec with `reason` and touches nothing: no command, no file.
void ExpectRejected(const NetworkSpec& spec, const std::string& reason) {
  SCOPED_TRACE(reason);
  Recorder rec;
  auto ctx = rec.Ctx();
  auto apply = ApplyNetwork(spec, ctx);
  ASSERT_FALSE(apply.ok());
  EXPECT_EQ(apply.error().code, Code::kInvalidArgument);
  EXPECT_EQ(apply.error().reason, reason) << apply.error().ToString();
  EXPECT_EQ(apply.error().details.at("stage"), "validate");
  auto check = CheckNetwork(spec, ctx);
  ASSERT_FALSE(check.ok());
  EXPECT_EQ(check.error().reason, reason);
  auto leases = ObserveLeases(spec);
  ASSERT_FALSE(leases.ok());
  EXPECT_EQ(leases.error().reason, reason);
  auto down = TeardownNetwork(spec, ctx);
  ASSERT_FALSE(down.ok());
  EXPECT_EQ(down.error().reason, reason);
  EXPECT_THAT(rec.calls, IsEmpty());
  EXPECT_FALSE(std::filesystem::exists(std::filesystem::path(NeverDir()).parent_path()));
}

TEST(NetSpecValidationTest, AGoodSpecPasses) {
  EXPECT_TRUE(ValidateNetworkSpec(BaseSpec(NeverDir())).ok());
  auto s = BaseSpec(NeverDir());
  s.reservations[0].mac = "52:54:00:A0:00:01";  // any case
  s.reservations[1].hostname = "";              // no name is fine
  EXPECT_TRUE(ValidateNetworkSpec(s).ok());
}

TEST(NetSpecValidationTest, SubnetTooSmallForTheReservations) {
  auto s = BaseSpec(NeverDir());
  s.subnet_cidr = "10.100.0.0/30";  // .1 gateway, .2 the only free address
  s.gateway_cidr = "10.100.0.1/30";
  s.reservations = {{kMac1, "10.100.0.2", "a", ""}, {kMac2, "10.100.0.3", "b", ""}};
  ExpectRejected(s, "subnet_too_small");
}

TEST(NetSpecValidationTest, IpOutsideTheSubnet) {
  auto s = BaseSpec(NeverDir());
  s.reservations[1].ip = "10.101.0.11";
  ExpectRejected(s, "ip_outside_subnet");
  auto r = ValidateNetworkSpec(s);
  EXPECT_EQ(r.error().details.at("index"), "1");
  EXPECT_EQ(r.error().details.at("slot_key"), "node-a/1");
}

TEST(NetSpecValidationTest, MalformedMac) {
  for (const char* bad : {"52:54:00:a0:00", "52-54-00-a0-00-01", "zz:54:00:a0:00:01",
                          "01:00:5e:00:00:01" /* multicast */, "00:00:00:00:00:00"}) {
    auto s = BaseSpec(NeverDir());
    s.reservations[0].mac = bad;
    ExpectRejected(s, "invalid_mac");
  }
}

TEST(NetSpecValidationTest, DuplicateMacOrIp) {
  auto s = BaseSpec(NeverDir());
  s.reservations[1].mac = "52:54:00:A0:00:01";  // same MAC, other case
  ExpectRejected(s, "duplicate_mac");
  s = BaseSpec(NeverDir());
  s.reservations[1].ip = s.reservations[0].ip;
  ExpectRejected(s, "duplicate_ip");
  s = BaseSpec(NeverDir());
  s.reservations[1].hostname = s.reservations[0].hostname;
  ExpectRejected(s, "duplicate_hostname");
}

TEST(NetSpecValidationTest, OtherBadFieldsEachHaveTheirReason) {
  struct Case {
    std::function<void(NetworkSpec&)> edit;
    const char* reason;
  };
  const std::vector<Case> cases = {
      {[](NetworkSpec& s) { s.reservations[0].ip = "10.100.0.300"; }, "invalid_ip"},
      {[](NetworkSpec& s) { s.reservations[0].ip = "10.100.0.1"; }, "ip_reserved"},
      {[](NetworkSpec& s) { s.reservations[0].ip = "10.100.0.255"; }, "ip_reserved"},
      {[](NetworkSpec& s) { s.reservations[0].hostname = "a,b\nport=53"; }, "invalid_hostname"},
      {[](NetworkSpec& s) { s.bridge = "a-bridge-name-too-long"; }, "invalid_bridge"},
      {[](NetworkSpec& s) { s.subnet_cidr = "10.100.0.5/24"; }, "invalid_subnet"},
      {[](NetworkSpec& s) { s.subnet_cidr = "10.100.0.0/31"; }, "invalid_subnet"},
      {[](NetworkSpec& s) { s.gateway_cidr = "10.200.0.1/24"; }, "gateway_outside_subnet"},
      {[](NetworkSpec& s) { s.gateway_cidr = "10.100.0.1/16"; }, "gateway_outside_subnet"},
      {[](NetworkSpec& s) { s.gateway_cidr = "10.100.0.1"; }, "invalid_gateway"},
      {[](NetworkSpec& s) { s.state_dir = "relative/net"; }, "invalid_state_dir"},
      {[](NetworkSpec& s) { s.state_dir = "/tmp/a b"; }, "invalid_state_dir"},
      {[](NetworkSpec& s) { s.egress_iface = "gpuaasbr0"; }, "invalid_egress_iface"},
  };
  for (const auto& c : cases) {
    auto s = BaseSpec(NeverDir());
    c.edit(s);
    ExpectRejected(s, c.reason);
  }
}

TEST(NetSpecValidationTest, AllProblemsAreListed) {
  auto s = BaseSpec(NeverDir());
  s.reservations[0].mac = "nope";
  s.reservations[1].ip = "10.9.9.9";
  auto r = ValidateNetworkSpec(s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "invalid_mac");
  EXPECT_EQ(r.error().details.at("problems"), "invalid_mac:mac[0];ip_outside_subnet:ip[1]");
}

TEST(NetSpecValidationTest, RemoveReservationRefusesAMalformedMac) {
  Recorder rec;
  auto r = RemoveReservation(BaseSpec(NeverDir()), "52:54:00", rec.Ctx());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "invalid_mac");
  EXPECT_THAT(rec.calls, IsEmpty());
}

// ---------------------------------------------------------------- lease file (unit)

TEST(NetLeaseTest, BoundMissingMismatchAndUnexpected) {
  TempDir dir;
  auto s = BaseSpec(dir.path());
  s.reservations.push_back({kMac3, "10.100.0.12", "slice-3", "node-a/2"});
  const int64_t later = std::time(nullptr) + 3600;
  Spit(dir.path() + "/dnsmasq.leases",
       fmt::format("{0} 52:54:00:a0:00:01 10.100.0.10 slice-1 01:52:54:00:a0:00:01\n"
                   "{0} 52:54:00:a0:00:02 10.100.0.99 slice-2 *\n"
                   "0 52:54:00:ee:ee:ee 10.100.0.77 * *\n"
                   "1000 52:54:00:a0:00:03 10.100.0.12 slice-3 *\n"  // expired long ago
                   "duid 00:01:00:01:2c:3d:4e:5f\n",
                   later));
  auto obs = ObserveLeases(s);
  ASSERT_TRUE(obs.ok()) << obs.error().ToString();
  ASSERT_EQ(obs->size(), 4u);
  EXPECT_EQ((*obs)[0].lease_state, v1::LEASE_STATE_BOUND);
  EXPECT_EQ((*obs)[0].actual_ip, "10.100.0.10");
  EXPECT_EQ((*obs)[0].slot_key, "node-a/0");
  EXPECT_EQ((*obs)[0].expires_at, later);
  EXPECT_EQ((*obs)[1].lease_state, v1::LEASE_STATE_MISMATCH);
  EXPECT_EQ((*obs)[1].expected_ip, "10.100.0.11");
  EXPECT_EQ((*obs)[1].actual_ip, "10.100.0.99");
  EXPECT_EQ((*obs)[2].lease_state, v1::LEASE_STATE_MISSING);
  EXPECT_EQ((*obs)[2].actual_ip, "");
  EXPECT_EQ((*obs)[3].lease_state, v1::LEASE_STATE_UNEXPECTED);
  EXPECT_EQ((*obs)[3].mac, "52:54:00:ee:ee:ee");
  EXPECT_EQ((*obs)[3].actual_ip, "10.100.0.77");
  EXPECT_EQ((*obs)[3].expected_ip, "");
}

// fuzz_dnsmasq_leases (lease_report_refused): one line that is not a unicast Ethernet MAC with an
// IPv4 address made ipam refuse the node's whole report; such lines are skipped and counted.
TEST(NetLeaseTest, LinesNotAUnicastMacWithAnIpv4AddressAreSkipped) {
  TempDir dir;
  auto s = BaseSpec(dir.path());
  Spit(dir.path() + "/dnsmasq.leases",
       "4102444800 01:00:5e:00:00:01 10.100.0.77 x *\n"     // multicast MAC (a guest's)
       "0 52:54:00:a0:00:01 10.100.0.010 slice-1 *\n"       // not an IPv4 address
       "0 00:00:00:00:00:00 10.100.0.78 * *\n"              // all-zero MAC
       "0 20:00:00:00:00:00:00:00:00:00 10.100.0.79 * *\n"  // InfiniBand hardware address
       "duid 00:01:00:01:2c:3d:4e:5f\n"
       "0 1234567 fd00::10 slice-9 00:01:00:01\n"  // DHCPv6: IAID, IPv6 address
       "0 52:54:00:EE:EE:EE 10.100.0.77 * *\n"
       "0 52:54:00:a0:00:02 10.100.0.11 slice-2 *\n");
  int skipped = -1;
  auto obs = ObserveLeases(s, &skipped);
  ASSERT_TRUE(obs.ok()) << obs.error().ToString();
  EXPECT_EQ(skipped, 5);
  ASSERT_EQ(obs->size(), 3u);
  EXPECT_EQ((*obs)[0].lease_state, v1::LEASE_STATE_MISSING);  // its only line had no IPv4 address
  EXPECT_EQ((*obs)[1].lease_state, v1::LEASE_STATE_BOUND);
  EXPECT_EQ((*obs)[2].lease_state, v1::LEASE_STATE_UNEXPECTED);
  EXPECT_EQ((*obs)[2].mac, "52:54:00:ee:ee:ee");
  EXPECT_EQ((*obs)[2].actual_ip, "10.100.0.77");
}

TEST(NetLeaseTest, NoLeaseFileMeansEverythingMissing) {
  TempDir dir;
  auto obs = ObserveLeases(BaseSpec(dir.path() + "/net"));
  ASSERT_TRUE(obs.ok());
  ASSERT_EQ(obs->size(), 2u);
  for (const auto& o : *obs) EXPECT_EQ(o.lease_state, v1::LEASE_STATE_MISSING);
}

// ---------------------------------------------------------------- real namespaces (root)

// Running, not a zombie (dnsmasq daemonises; whoever inherits it may not reap it at once).
bool Alive(int pid) {
  std::string stat = Slurp(fmt::format("/proc/{}/stat", pid));
  size_t rp = stat.rfind(')');
  return rp != std::string::npos && rp + 2 < stat.size() && stat[rp + 2] != 'Z';
}

// Every test runs on both datapaths: a Linux bridge, and Open vSwitch with the userspace
// datapath (ovsdb-server and ovs-vswitchd started in the test's host namespace, state in a temp
// dir), with the same expectations wherever a user sees the same thing.
class NetApplyTest : public ::testing::TestWithParam<Datapath> {
 protected:
  void SetUp() override {
    if (auto why = lab_.Open("t"); !why.empty()) GTEST_SKIP() << why;
    host_ns_ = lab_.host();
    spec_ = BaseSpec(dir_.path() + "/net");
    ctx_.netns = host_ns_;
    if (Ovs()) {
      const std::string rundir = dir_.path() + "/ovs";
      ASSERT_EQ(::mkdir(rundir.c_str(), 0755), 0);
      auto why = lab_.StartOvs(rundir);
      ASSERT_EQ(why, "") << "Open vSwitch is part of scripts/install-deps";
      spec_.datapath = Datapath::kOvs;
      spec_.bridge = "ovsbr0";
      spec_.vnic_ingress_kbps = 200000;
      spec_.vnic_ingress_burst_kb = 20000;
      ctx_.ovs_rundir = rundir;
      ctx_.ovs_datapath_type = "netdev";
    }
    t0_ = std::chrono::steady_clock::now();
  }
  bool Ovs() const { return GetParam() == Datapath::kOvs; }
  // What attaching new VM ports makes the next apply change: their isolation (Linux bridge), or
  // their QoS/slot tag and the flows that admit them (OVS).
  std::vector<std::string> PortChanges() const {
    return Ovs() ? std::vector<std::string>{"configured_vnics", "replaced_flows"}
                 : std::vector<std::string>{"changed_port_isolation"};
  }
  std::string Fwd() const { return "GPUAAS-FWD-" + spec_.bridge; }
  // The slot's VM came back with another MAC (libvirt would give its new tap the new MAC).
  void NewGuestMac(const std::string& vm, const std::string& port, const std::string& mac,
                   const NetworkSpec& spec) {
    Ip(vm, {"link", "set", "eth0", "address", mac});
    Ip(host_ns_, {"link", "set", port, "address", "fe" + std::string(mac).substr(2)});
    if (Ovs()) {
      ASSERT_EQ(
          lab_.Vsctl({"set", "interface", port, "external_ids:attached-mac=" + mac}).exit_code, 0);
      MustApply(spec);
    }
  }

  void TearDown() override {
    if (host_ns_.empty()) return;
    auto down = TeardownNetwork(spec_, ctx_);
    EXPECT_TRUE(down.ok()) << down.error().ToString();
    std::cerr << fmt::format("[ timing ] {} ms\n",
                             std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::steady_clock::now() - t0_)
                                 .count());
  }

  ToolResult Run(std::vector<std::string> argv,
                 std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    return lab_.Run(std::move(argv), timeout);
  }
  // ip -n <ns> ..., which must succeed.
  void Ip(const std::string& ns, std::vector<std::string> args) {
    args.insert(args.begin(), {"ip", "-n", ns});
    auto r = Run(args);
    ASSERT_EQ(r.exit_code, 0) << fmt::format("{}: {}", fmt::join(args, " "), r.err);
  }
  ToolResult InNs(const std::string& ns, std::vector<std::string> args,
                  std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    return lab_.InNs(ns, std::move(args), timeout);
  }
  // A "VM": its own namespace whose eth0 (with the slot MAC) is a veth to `port` on the bridge.
  std::string AddVm(const std::string& name, const std::string& mac, const std::string& port) {
    auto ns = lab_.AddVm(name, mac, port, spec_.bridge);
    EXPECT_FALSE(ns.empty()) << "cannot add VM namespace " << name;
    return ns;
  }
  std::optional<std::string> Dhcp(const std::string& ns, int tries = 3) {
    return lab_.Dhcp(ns, tries);
  }
  // What the guest's DHCP client script would do: address plus default route via the gateway.
  void Configure(const std::string& ns, const std::string& ip) {
    Ip(ns, {"addr", "add", ip + "/24", "dev", "eth0"});
    Ip(ns, {"route", "add", "default", "via", "10.100.0.1"});
  }
  bool Ping(const std::string& ns, const std::string& ip) {
    return InNs(ns, {"busybox", "ping", "-c", "1", "-W", "1", ip}).exit_code == 0;
  }
  ApplyReport MustApply(const NetworkSpec& spec) {
    auto r = ApplyNetwork(spec, ctx_);
    EXPECT_TRUE(r.ok()) << r.error().ToString();
    return r.ok() ? *r : ApplyReport{};
  }
  // The node's blockers, then the slots' drift as "<kind>:<slot key>".
  std::vector<std::string> Blockers() {
    auto c = CheckNetwork(spec_, ctx_);
    EXPECT_TRUE(c.ok()) << c.error().ToString();
    if (!c.ok()) return {"check_failed"};
    auto out = c->blockers;
    for (const auto& d : c->slot_drift) {
      out.push_back(SlotDriftKindText(d.kind).str() + ":" + d.slot_key);
    }
    return out;
  }
  std::string Leases() { return Slurp(spec_.state_dir + "/dnsmasq.leases"); }
  std::string Hosts() { return Slurp(spec_.state_dir + "/dhcp-hosts"); }

  TempDir dir_;
  testing::NetnsLab lab_;
  std::string host_ns_;
  NetworkSpec spec_;
  NetContext ctx_;
  std::chrono::steady_clock::time_point t0_;
};

TEST_P(NetApplyTest, ReservedMacGetsItsIpUnknownMacGetsNothing) {
  auto first = MustApply(spec_);
  EXPECT_TRUE(first.created_bridge);
  EXPECT_TRUE(first.added_gateway_address);
  EXPECT_TRUE(first.added_masquerade);
  EXPECT_TRUE(first.added_forward_rules);
  EXPECT_TRUE(first.started_dnsmasq);
  EXPECT_THAT(first.added_reservations, ElementsAre(kMac1, kMac2));
  EXPECT_GT(first.dnsmasq_pid, 0);

  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  auto stranger = AddVm("vm2", kStranger, "vnet2");
  // New ports get isolated by the next apply, and that is all it changes.
  auto ports = MustApply(spec_);
  if (Ovs()) {
    EXPECT_THAT(ports.configured_vnics, ElementsAre("vnet1"));  // the stranger is no slice
  } else {
    EXPECT_THAT(ports.isolation_changed_ports, ElementsAre("vnet1", "vnet2"));
  }
  EXPECT_EQ(ports.Changes(), PortChanges());

  EXPECT_EQ(Dhcp(vm1), "10.100.0.10");
  EXPECT_EQ(Dhcp(stranger, 2), std::nullopt);

  auto obs = ObserveLeases(spec_);
  ASSERT_TRUE(obs.ok());
  ASSERT_EQ(obs->size(), 2u);  // no lease for the stranger
  EXPECT_EQ((*obs)[0].lease_state, v1::LEASE_STATE_BOUND);
  EXPECT_EQ((*obs)[0].actual_ip, "10.100.0.10");
  EXPECT_EQ((*obs)[1].lease_state, v1::LEASE_STATE_MISSING);
  EXPECT_THAT(Blockers(), IsEmpty());
}

TEST_P(NetApplyTest, SecondApplyChangesNothingAndStaleReservationsGo) {
  auto first = MustApply(spec_);
  auto again = MustApply(spec_);
  EXPECT_THAT(again.Changes(), IsEmpty());
  EXPECT_EQ(again.dnsmasq_pid, first.dnsmasq_pid);

  auto vm2 = AddVm("vm2", kMac2, "vnet2");
  MustApply(spec_);
  EXPECT_EQ(Dhcp(vm2), "10.100.0.11");

  // ipam dropped slice-2: its hosts entry goes and dnsmasq (same process) stops serving it.
  auto smaller = spec_;
  smaller.reservations.pop_back();
  smaller.version = 2;
  auto removed = MustApply(smaller);
  EXPECT_THAT(removed.removed_reservations, ElementsAre(kMac2));
  // On OVS vm2's port is no slice's any more: the flows that admitted it go.
  const std::vector<std::string> removed_changes =
      Ovs() ? std::vector<std::string>{"replaced_flows", "removed_reservations", "reloaded_dnsmasq"}
            : std::vector<std::string>{"removed_reservations", "reloaded_dnsmasq"};
  EXPECT_EQ(removed.Changes(), removed_changes);
  EXPECT_EQ(removed.dnsmasq_pid, first.dnsmasq_pid);
  EXPECT_EQ(Hosts(),
            "# Managed by gpuaas-node-agent: exactly the control plane's reservations.\n"
            "52:54:00:a0:00:01,10.100.0.10,slice-1\n");
  EXPECT_EQ(Dhcp(vm2, 2), std::nullopt);
  // Apply leaves the old lease alone (RemoveReservation is the release path): it shows up.
  auto obs = ObserveLeases(smaller);
  ASSERT_TRUE(obs.ok());
  ASSERT_EQ(obs->size(), 2u);
  EXPECT_EQ((*obs)[1].lease_state, v1::LEASE_STATE_UNEXPECTED);
  EXPECT_EQ((*obs)[1].mac, kMac2);
  EXPECT_THAT(MustApply(smaller).Changes(), IsEmpty());

  auto moved = smaller;
  moved.reservations[0].ip = "10.100.0.20";
  auto changed = MustApply(moved);
  EXPECT_THAT(changed.changed_reservations, ElementsAre(kMac1));
  EXPECT_THAT(changed.Changes(), ElementsAre("changed_reservations", "reloaded_dnsmasq"));
  spec_ = moved;
}

TEST_P(NetApplyTest, TamperedLeaseShowsAsMismatch) {
  MustApply(spec_);
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  MustApply(spec_);
  ASSERT_EQ(Dhcp(vm1), "10.100.0.10");
  auto obs = ObserveLeases(spec_);
  ASSERT_TRUE(obs.ok());
  EXPECT_EQ((*obs)[0].lease_state, v1::LEASE_STATE_BOUND);

  std::string leases = Leases();
  auto at = leases.find("10.100.0.10");
  ASSERT_NE(at, std::string::npos) << leases;
  leases.replace(at, 11, "10.100.0.99");
  leases += "0 52:54:00:ee:ee:ee 10.100.0.77 stranger *\n";
  Spit(spec_.state_dir + "/dnsmasq.leases", leases);

  obs = ObserveLeases(spec_);
  ASSERT_TRUE(obs.ok());
  ASSERT_EQ(obs->size(), 3u);
  EXPECT_EQ((*obs)[0].lease_state, v1::LEASE_STATE_MISMATCH);
  EXPECT_EQ((*obs)[0].expected_ip, "10.100.0.10");
  EXPECT_EQ((*obs)[0].actual_ip, "10.100.0.99");
  EXPECT_EQ((*obs)[1].lease_state, v1::LEASE_STATE_MISSING);
  EXPECT_EQ((*obs)[2].lease_state, v1::LEASE_STATE_UNEXPECTED);
  EXPECT_EQ((*obs)[2].actual_ip, "10.100.0.77");
}

TEST_P(NetApplyTest, MissingMasqueradeIsABlockerAndApplyRepairsIt) {
  MustApply(spec_);
  // An "uplink" to a namespace that only knows 192.0.2.0/24: a slice reaches it only when its
  // source is masqueraded (the reply to 10.100.0.10 has no route there).
  auto out = lab_.AddNamespace("out");
  ASSERT_FALSE(out.empty());
  Ip(host_ns_, {"link", "add", "up0", "type", "veth", "peer", "name", "eth0", "netns", out});
  Ip(host_ns_, {"addr", "add", "192.0.2.1/24", "dev", "up0"});
  Ip(host_ns_, {"link", "set", "up0", "up"});
  Ip(out, {"addr", "add", "192.0.2.2/24", "dev", "eth0"});
  Ip(out, {"link", "set", "eth0", "up"});
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  MustApply(spec_);
  auto ip = Dhcp(vm1);
  ASSERT_EQ(ip, "10.100.0.10");
  Configure(vm1, *ip);
  EXPECT_THAT(Blockers(), IsEmpty());
  EXPECT_TRUE(Ping(vm1, "192.0.2.2"));

  // Where discovery's nat_masquerade check (the scheduler's node blocker) looks for it.
  auto postrouting = InNs(host_ns_, {"iptables", "-w", "5", "-t", "nat", "-S", "POSTROUTING"});
  EXPECT_THAT(postrouting.out,
              ::testing::HasSubstr("-A POSTROUTING -s 10.100.0.0/24 ! -d 10.100.0.0/24 -m comment "
                                   "--comment gpuaas-nat-" +
                                   spec_.bridge + " -j MASQUERADE"));

  // The runbook incident: the rule is gone while bridge, dnsmasq and forwarding look healthy.
  ASSERT_EQ(InNs(host_ns_, {"iptables", "-w", "5", "-t", "nat", "-D", "POSTROUTING", "-s",
                            "10.100.0.0/24", "!", "-d", "10.100.0.0/24", "-m", "comment",
                            "--comment", "gpuaas-nat-" + spec_.bridge, "-j", "MASQUERADE"})
                .exit_code,
            0);
  EXPECT_THAT(Blockers(), ElementsAre("masquerade_missing"));
  EXPECT_FALSE(Ping(vm1, "192.0.2.2"));

  auto repair = MustApply(spec_);
  EXPECT_THAT(repair.Changes(), ElementsAre("added_masquerade"));
  EXPECT_THAT(Blockers(), IsEmpty());
  EXPECT_TRUE(Ping(vm1, "192.0.2.2"));

  // A tagged rule for a subnet the spec no longer has is stale: removed, ours kept.
  ASSERT_EQ(InNs(host_ns_,
                 {"iptables", "-w", "5", "-t", "nat", "-A", "POSTROUTING", "-s", "10.99.0.0/24",
                  "-m", "comment", "--comment", "gpuaas-nat-" + spec_.bridge, "-j", "MASQUERADE"})
                .exit_code,
            0);
  EXPECT_THAT(MustApply(spec_).Changes(), ElementsAre("removed_stale_rules"));
  postrouting = InNs(host_ns_, {"iptables", "-w", "5", "-t", "nat", "-S", "POSTROUTING"});
  EXPECT_THAT(postrouting.out, Not(::testing::HasSubstr("10.99.0.0/24")));
  EXPECT_THAT(Blockers(), IsEmpty());
  EXPECT_TRUE(Ping(vm1, "192.0.2.2"));
}

TEST_P(NetApplyTest, CheckNetworkNamesEachBlockerAndApplyRepairsThem) {
  auto first = MustApply(spec_);
  auto check = CheckNetwork(spec_, ctx_);
  ASSERT_TRUE(check.ok());
  EXPECT_TRUE(check->ok());
  EXPECT_EQ(check->evidence.at("ip_forward"), "1");
  EXPECT_EQ(check->evidence.at("dnsmasq_pid"), std::to_string(first.dnsmasq_pid));

  ASSERT_EQ(InNs(host_ns_, {"sysctl", "-qw", "net.ipv4.ip_forward=0"}).exit_code, 0);
  ASSERT_EQ(InNs(host_ns_, {"iptables", "-w", "5", "-D", "FORWARD", "-j", Fwd()}).exit_code, 0);
  Ip(host_ns_, {"link", "add", "vstray", "type", "veth", "peer", "name", "vstrayp"});
  if (Ovs()) {
    // A stray port is harmless on OVS (nothing admits it); a flow of ours deleted by hand is not.
    ASSERT_EQ(lab_.Vsctl({"add-port", spec_.bridge, "vstray"}).exit_code, 0);
    ASSERT_EQ(lab_.Ofctl({"--strict", "del-flows"}, spec_.bridge, {"priority=0"}).exit_code, 0);
  } else {
    Ip(host_ns_, {"link", "set", "vstray", "master", spec_.bridge});
  }
  ::kill(first.dnsmasq_pid, SIGTERM);
  for (int i = 0; i < 300 && Alive(first.dnsmasq_pid); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  Spit(spec_.state_dir + "/dhcp-hosts", Hosts() + "52:54:00:a0:00:09,10.100.0.99,leftover\n");

  EXPECT_THAT(Blockers(), ElementsAre("ip_forward_off", "forward_rules_missing",
                                      Ovs() ? "flows_stale" : "ports_not_isolated",
                                      "dnsmasq_not_running", "reservations_stale"));
  auto repair = MustApply(spec_);
  EXPECT_THAT(repair.Changes(), ElementsAre("enabled_ip_forward", "added_forward_rules",
                                            Ovs() ? "replaced_flows" : "changed_port_isolation",
                                            "removed_reservations", "started_dnsmasq"));
  EXPECT_THAT(repair.removed_reservations, ElementsAre("52:54:00:a0:00:09"));
  EXPECT_THAT(Blockers(), IsEmpty());

  // A bridge deleted under a running dnsmasq: re-created, and dnsmasq restarted to bind it.
  if (Ovs()) {
    ASSERT_EQ(lab_.Vsctl({"del-br", spec_.bridge}).exit_code, 0);
  } else {
    Ip(host_ns_, {"link", "del", spec_.bridge});
  }
  EXPECT_THAT(Blockers(), ElementsAre("bridge_missing"));
  auto again = MustApply(spec_);
  EXPECT_TRUE(again.created_bridge);
  EXPECT_TRUE(again.restarted_dnsmasq);
  EXPECT_THAT(Blockers(), IsEmpty());
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  MustApply(spec_);
  EXPECT_EQ(Dhcp(vm1), "10.100.0.10");
}

TEST_P(NetApplyTest, SlicesCannotReachEachOtherButReachTheGateway) {
  MustApply(spec_);
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  auto vm2 = AddVm("vm2", kMac2, "vnet2");
  MustApply(spec_);
  auto ip1 = Dhcp(vm1), ip2 = Dhcp(vm2);
  ASSERT_EQ(ip1, "10.100.0.10");
  ASSERT_EQ(ip2, "10.100.0.11");
  Configure(vm1, *ip1);
  Configure(vm2, *ip2);

  EXPECT_TRUE(Ping(vm1, "10.100.0.1"));
  EXPECT_TRUE(Ping(vm2, "10.100.0.1"));
  // L2: isolated ports (or, on OVS, flows that admit only gateway traffic) never forward to each
  // other, not even ARP (which no iptables rule sees, with or without br_netfilter), so vm1
  // never learns vm2's MAC.
  EXPECT_FALSE(Ping(vm1, "10.100.0.11"));
  EXPECT_THAT(InNs(vm1, {"ip", "neigh", "show", "10.100.0.11"}).out,
              Not(::testing::HasSubstr("lladdr")));
  // L3 hairpin: send the other slice's IP to the gateway MAC; the FORWARD DROP catches it.
  Ip(vm1, {"route", "add", "10.100.0.11/32", "via", "10.100.0.1"});
  Ip(vm2, {"route", "add", "10.100.0.10/32", "via", "10.100.0.1"});
  EXPECT_FALSE(Ping(vm1, "10.100.0.11"));
  auto counters = InNs(host_ns_, {"iptables", "-w", "5", "-v", "-n", "-x", "-L", Fwd()});
  bool dropped = false;
  for (const auto& line : SplitLines(counters.out)) {
    auto f = SplitWs(line);
    if (f.size() > 2 && f[2] == "DROP") dropped = ParseInt(f[0]).value_or(0) > 0;
  }
  EXPECT_TRUE(dropped) << counters.out;

  // Control: with isolation off the same two slices do reach each other.
  auto open = spec_;
  open.isolate_ports = false;
  auto opened = MustApply(open);
  if (Ovs()) {
    EXPECT_TRUE(opened.replaced_flows);
  } else {
    EXPECT_THAT(opened.isolation_changed_ports, ElementsAre("vnet1", "vnet2"));
  }
  EXPECT_TRUE(opened.removed_stale_rules);
  Ip(vm1, {"route", "del", "10.100.0.11/32"});
  Ip(vm2, {"route", "del", "10.100.0.10/32"});
  Ip(vm1, {"neigh", "flush", "dev", "eth0"});  // forget the failed ARP attempts
  EXPECT_TRUE(Ping(vm1, "10.100.0.11"));
  spec_ = open;
}

TEST_P(NetApplyTest, RemoveReservationLeavesNoHostsEntryNoLeaseAndTheSlotIsReusable) {
  MustApply(spec_);
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  MustApply(spec_);
  ASSERT_EQ(Dhcp(vm1), "10.100.0.10");
  ASSERT_THAT(Leases(), ::testing::HasSubstr(kMac1));

  RemovalReport rr;
  auto removed = RemoveReservation(spec_, kMac1, ctx_, &rr);
  ASSERT_TRUE(removed.ok()) << removed.error().ToString();
  EXPECT_TRUE(rr.removed_hosts_entry);
  EXPECT_THAT(rr.released_leases, ElementsAre("10.100.0.10"));
  EXPECT_EQ(rr.lease_method, "dhcp_release");
  EXPECT_THAT(Hosts(), Not(::testing::HasSubstr(kMac1)));
  EXPECT_THAT(Hosts(), ::testing::HasSubstr(kMac2));
  EXPECT_THAT(Leases(), Not(::testing::HasSubstr(kMac1)));
  EXPECT_THAT(Leases(), Not(::testing::HasSubstr("10.100.0.10 ")));
  // The hosts file is what ApplyNetwork of the smaller spec writes: applying it changes nothing
  // there (on OVS it drops the flows that admitted the released vNIC).
  auto smaller = spec_;
  smaller.reservations.erase(smaller.reservations.begin());
  EXPECT_EQ(MustApply(smaller).Changes(),
            Ovs() ? std::vector<std::string>{"replaced_flows"} : std::vector<std::string>{});
  auto obs = ObserveLeases(smaller);
  ASSERT_TRUE(obs.ok());
  EXPECT_EQ(obs->size(), 1u);  // slice-2 missing, nothing unexpected

  // Reusable: a new MAC reserved for the same IP gets it (dnsmasq refuses an address it still
  // has leased to someone else).
  auto reuse = spec_;
  reuse.reservations[0] = {kMac3, "10.100.0.10", "slice-1b", "node-a/0"};
  auto applied = MustApply(reuse);
  EXPECT_THAT(applied.added_reservations, ElementsAre(kMac3));
  EXPECT_THAT(applied.removed_reservations, IsEmpty());
  NewGuestMac(vm1, "vnet1", kMac3, reuse);
  EXPECT_EQ(Dhcp(vm1), "10.100.0.10");
  spec_ = reuse;
}

TEST_P(NetApplyTest, RemoveReservationWithoutDhcpReleaseRestartsDnsmasq) {
  auto first = MustApply(spec_);
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  MustApply(spec_);
  ASSERT_EQ(Dhcp(vm1), "10.100.0.10");

  auto ctx = ctx_;
  ctx.use_dhcp_release = false;
  RemovalReport rr;
  auto removed = RemoveReservation(spec_, kMac1, ctx, &rr);
  ASSERT_TRUE(removed.ok()) << removed.error().ToString();
  EXPECT_EQ(rr.lease_method, "restart");
  EXPECT_THAT(Leases(), Not(::testing::HasSubstr(kMac1)));
  auto check = CheckNetwork(spec_, ctx_);
  ASSERT_TRUE(check.ok());
  EXPECT_NE(check->evidence.at("dnsmasq_pid"), std::to_string(first.dnsmasq_pid));
  EXPECT_NE(check->evidence.at("dnsmasq_pid"), "");

  auto reuse = spec_;
  reuse.reservations[0] = {kMac3, "10.100.0.10", "slice-1b", "node-a/0"};
  MustApply(reuse);
  NewGuestMac(vm1, "vnet1", kMac3, reuse);
  EXPECT_EQ(Dhcp(vm1), "10.100.0.10");
  spec_ = reuse;
}

TEST_P(NetApplyTest, StateDirDnsmasqCannotReadIsRefusedBeforeAnythingChanges) {
  // dnsmasq drops root before reading dhcp-hostsfile: a 0700 parent would leave it with no
  // reservations and only a log line, so ApplyNetwork refuses up front.
  const std::string locked = dir_.path() + "/locked";
  ASSERT_EQ(::mkdir(locked.c_str(), 0700), 0);
  auto spec = spec_;
  spec.state_dir = locked + "/net";
  auto r = ApplyNetwork(spec, ctx_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "state_dir_not_traversable");
  EXPECT_EQ(r.error().details.at("path"), locked);
  EXPECT_THAT(Blockers(), ::testing::Contains("bridge_missing"));
}

TEST_P(NetApplyTest, AVnicTakenOffTheBridgeIsPutBack) {
  MustApply(spec_);
  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  MustApply(spec_);
  ASSERT_EQ(Dhcp(vm1), "10.100.0.10");
  if (Ovs()) {
    ASSERT_EQ(lab_.Vsctl({"del-port", spec_.bridge, "vnet1"}).exit_code, 0);
  } else {
    Ip(host_ns_, {"link", "set", "vnet1", "nomaster"});
  }
  // The slot's drift, named by its slot key (on OVS its flows now name a port that is gone).
  const std::vector<std::string> drift =
      Ovs() ? std::vector<std::string>{"flows_stale", "vnic_detached:node-a/0"}
            : std::vector<std::string>{"vnic_detached:node-a/0"};
  EXPECT_EQ(Blockers(), drift);
  auto repair = MustApply(spec_);
  EXPECT_THAT(repair.reattached_vnics, ElementsAre("vnet1"));
  EXPECT_THAT(Blockers(), IsEmpty());
  EXPECT_EQ(Dhcp(vm1), "10.100.0.10");
}

TEST_P(NetApplyTest, GatewayOnAnotherBridgeIsAConflictNotASecondBridge) {
  Ip(host_ns_, {"link", "add", "oldbr", "type", "bridge"});
  Ip(host_ns_, {"addr", "add", "10.100.0.1/24", "dev", "oldbr"});
  auto r = ApplyNetwork(spec_, ctx_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "gateway_conflict");
  EXPECT_EQ(r.error().details.at("owners"), "oldbr");
  EXPECT_NE(Run({"ip", "-n", host_ns_, "link", "show", "dev", spec_.bridge}).exit_code, 0);
  if (Ovs()) {
    EXPECT_EQ(lab_.Vsctl({"list-br"}).out, "");
  }
  EXPECT_THAT(Blockers(), ::testing::IsSupersetOf({"bridge_missing", "gateway_conflict"}));
  Ip(host_ns_, {"link", "del", "oldbr"});
}

TEST_P(NetApplyTest, AnotherDhcpServerOnTheHostIsAConflict) {
  // The runbook host's own dnsmasq serving the slice subnet (here: on the bridge the agent is
  // about to use, bound to every address). The agent's dnsmasq cannot bind beside it, and says so.
  MustApply(spec_);
  const int pid = std::stoi(Trim(Slurp(spec_.state_dir + "/dnsmasq.pid")));
  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  for (int i = 0; i < 300 && Alive(pid); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const std::string site_pid = dir_.path() + "/site-dnsmasq.pid";
  ASSERT_EQ(InNs(host_ns_, {"dnsmasq", "--conf-file=/dev/null", "--port=0",
                            "--pid-file=" + site_pid, "--dhcp-range=10.100.0.100,10.100.0.200,12h"})
                .exit_code,
            0);
  auto r = ApplyNetwork(spec_, ctx_);
  const int site = std::stoi(Trim(Slurp(site_pid)));
  ::kill(site, SIGTERM);
  for (int i = 0; i < 300 && Alive(site); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "dhcp_server_conflict") << r.error().ToString();
  EXPECT_THAT(Blockers(), ::testing::Contains("dnsmasq_not_running"));
  // With the host's server gone the agent's starts again.
  EXPECT_TRUE(MustApply(spec_).started_dnsmasq);
}

// The cases only Open vSwitch has.
class OvsApplyTest : public NetApplyTest {
 protected:
  std::string Iface(const std::string& port, const std::string& column) {
    return Trim(lab_.Vsctl({"get", "interface", port, column}).out);
  }
};

TEST_P(OvsApplyTest, RunbookHostIsAdoptedWithoutASecondBridge) {
  // The seed runbook's host: ovsbr0 made by hand (fail_mode standalone, OVS's NORMAL flow) with
  // the gateway, and the host dnsmasq's directory with a reservation an earlier manual run left.
  ASSERT_EQ(
      lab_.Vsctl({"add-br", "ovsbr0", "--", "set", "bridge", "ovsbr0", "datapath_type=netdev"})
          .exit_code,
      0);
  for (int i = 0; i < 250 && Run({"ip", "-n", host_ns_, "link", "show", "dev", "ovsbr0"}).exit_code;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  Ip(host_ns_, {"addr", "add", "10.100.0.1/24", "dev", "ovsbr0"});
  Ip(host_ns_, {"link", "set", "ovsbr0", "up"});
  const std::string etc = dir_.path() + "/dnsmasq.d";
  ASSERT_EQ(::mkdir(etc.c_str(), 0755), 0);
  Spit(etc + "/gpuaas-gpuaas-slice-5f1c.conf",
       std::string("# lab attempt\ndhcp-host=") + kStranger + ",10.100.0.10,slice-old\n");
  Spit(etc + "/gpuaas-slice-network.conf", "interface=ovsbr0\ndhcp-range=10.100.0.10,static\n");
  Spit(etc + "/site.conf", std::string("dhcp-host=") + kStranger + ",10.100.0.99\n");
  ctx_.host_dnsmasq_dir = etc;

  auto adopted = MustApply(spec_);
  EXPECT_TRUE(adopted.adopted_bridge);
  EXPECT_FALSE(adopted.created_bridge);
  EXPECT_FALSE(adopted.added_gateway_address);
  EXPECT_THAT(adopted.removed_stale_dnsmasq_files, ElementsAre("gpuaas-gpuaas-slice-5f1c.conf"));
  EXPECT_TRUE(
      std::filesystem::exists(spec_.state_dir + "/stale-dnsmasq/gpuaas-gpuaas-slice-5f1c.conf"));
  // Only the leftover reservation file moved; the host's own config is not the platform's.
  EXPECT_TRUE(std::filesystem::exists(etc + "/gpuaas-slice-network.conf"));
  EXPECT_TRUE(std::filesystem::exists(etc + "/site.conf"));
  // One bridge: the adopted one, now in fail_mode secure, no Linux bridge beside it.
  EXPECT_EQ(lab_.Vsctl({"list-br"}).out, "ovsbr0\n");
  EXPECT_EQ(Trim(lab_.Vsctl({"get", "bridge", "ovsbr0", "fail_mode"}).out), "secure");
  EXPECT_EQ(Trim(lab_.Vsctl({"get", "bridge", "ovsbr0", "datapath_type"}).out), "netdev");
  EXPECT_EQ(Trim(Run({"ip", "-n", host_ns_, "-o", "link", "show", "type", "bridge"}).out), "");
  EXPECT_THAT(Blockers(), IsEmpty());
  EXPECT_THAT(MustApply(spec_).Changes(), IsEmpty());

  auto vm1 = AddVm("vm1", kMac1, "vnet1");
  auto old = AddVm("vm2", kStranger, "vnet2");
  MustApply(spec_);
  EXPECT_EQ(Dhcp(vm1), "10.100.0.10");
  EXPECT_EQ(Dhcp(old, 2), std::nullopt);
  EXPECT_THAT(Blockers(), IsEmpty());
}

TEST_P(OvsApplyTest, ForeignFlowsAreABlockerAndLeftAlone) {
  MustApply(spec_);
  ASSERT_EQ(
      lab_.Ofctl({"add-flow"}, spec_.bridge, {"cookie=0x1,priority=300,actions=NORMAL"}).exit_code,
      0);
  EXPECT_THAT(Blockers(), ElementsAre("foreign_flows"));
  auto r = ApplyNetwork(spec_, ctx_);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "foreign_flows");
  EXPECT_THAT(r.error().details.at("flows"), ::testing::HasSubstr("priority=300"));
  EXPECT_THAT(lab_.Ofctl({"dump-flows"}, spec_.bridge).out, ::testing::HasSubstr("cookie=0x1,"));
  ASSERT_EQ(lab_.Ofctl({"del-flows"}, spec_.bridge, {"cookie=0x1/-1"}).exit_code, 0);
  EXPECT_THAT(Blockers(), IsEmpty());
}

TEST_P(OvsApplyTest, EachVnicIsPolicedAndTaggedAndRestoredWhenCleared) {
  MustApply(spec_);
  AddVm("vm1", kMac1, "vnet1");
  auto applied = MustApply(spec_);
  EXPECT_THAT(applied.configured_vnics, ElementsAre("vnet1"));
  EXPECT_EQ(Iface("vnet1", "ingress_policing_rate"), "200000");
  EXPECT_EQ(Iface("vnet1", "ingress_policing_burst"), "20000");
  EXPECT_EQ(Iface("vnet1", "external_ids:gpuaas-slot"), "\"node-a/0\"");
  ASSERT_EQ(lab_.Vsctl({"set", "interface", "vnet1", "ingress_policing_rate=0"}).exit_code, 0);
  EXPECT_THAT(Blockers(), ElementsAre("qos_missing:node-a/0"));
  EXPECT_THAT(MustApply(spec_).Changes(), ElementsAre("configured_vnics"));
  EXPECT_EQ(Iface("vnet1", "ingress_policing_rate"), "200000");
  EXPECT_THAT(Blockers(), IsEmpty());
}

INSTANTIATE_TEST_SUITE_P(Datapaths, OvsApplyTest, ::testing::Values(Datapath::kOvs),
                         [](const ::testing::TestParamInfo<Datapath>&) {
                           return std::string("Ovs");
                         });

INSTANTIATE_TEST_SUITE_P(Datapaths, NetApplyTest,
                         ::testing::Values(Datapath::kLinuxBridge, Datapath::kOvs),
                         [](const ::testing::TestParamInfo<Datapath>& p) {
                           return p.param == Datapath::kOvs ? std::string("Ovs")
                                                            : std::string("LinuxBridge");
                         });

}  // namespace
}  // namespace gpuaas::node_agent
