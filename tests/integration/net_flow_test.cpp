// Slice networking end to end (root; skipped elsewhere): inventory approves a node's slots and
// ipam reserves their MAC/IP; the node-agent applies ipam's network document inside a network
// namespace with a real bridge, dnsmasq and iptables, and acks it; a "VM" (a namespace with the
// slot MAC on a veth to the bridge) gets exactly its reserved IP from dnsmasq; the agent's lease
// report reaches ipam; a tampered lease becomes IPAM drift (and the slot degraded) until it is
// clean again; a deleted MASQUERADE rule is found and put back by the agent.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "netns_lab.hpp"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

std::string Slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class NetFlowTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (auto why = lab_.Open("nf"); !why.empty()) GTEST_SKIP() << why;
    p_.Start();
    // dnsmasq drops to `nobody` before it reads the hosts file: the directory must be searchable.
    const std::string net_parent = testing::MakeTempDir("gpuaas-net");
    ASSERT_EQ(::chmod(net_parent.c_str(), 0755), 0);
    net_dir_ = net_parent + "/net";
    agent_ = p_.StartAgent("net-node", 2, "h200",
                           {{"GPUAAS_NODE_DESIRED_POLL_MS", "100"},
                            {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "1"},
                            {"GPUAAS_NETWORK_APPLY", "netns"},
                            {"GPUAAS_NETWORK_NETNS", lab_.host()},
                            {"GPUAAS_NETWORK_STATE_DIR", net_dir_},
                            {"GPUAAS_NETWORK_REPORT_MS", "200"}});
    ASSERT_TRUE(testing::WaitFor([&] {
      v1::ShowNodeRequest r;
      r.set_node_id("net-node");
      auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
      return s.ok() && s->snapshot_version() >= 1;
    }));
  }
  void TearDown() override {
    if (agent_) agent_->Shutdown();  // before its network goes
    // The agent's dnsmasq runs in the lab namespace: stop it by its pid file, remove the rules.
    if (!lab_.host().empty() && !net_dir_.empty()) {
      node_agent::NetworkSpec spec;
      spec.bridge = bridge_;
      spec.subnet_cidr = "10.100.0.0/24";
      spec.gateway_cidr = "10.100.0.1/24";
      spec.state_dir = net_dir_;
      node_agent::NetContext ctx;
      ctx.netns = lab_.host();
      (void)node_agent::TeardownNetwork(spec, ctx);
    }
    p_.Stop();
  }
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }
  v1::GetNodeNetworkResponse Network() {
    v1::GetNodeNetworkRequest r;
    r.set_node_id("net-node");
    auto n = Call<v1::GetNodeNetworkResponse>("gpuaas.v1.ipam.node.{node_id}.network.get", r);
    return n.ok() ? *n : v1::GetNodeNetworkResponse();
  }
  v1::ListLeasesResponse Leases() {
    v1::ListLeasesRequest r;
    r.set_node_id("net-node");
    auto l = Call<v1::ListLeasesResponse>("gpuaas.v1.ipam.lease.list", r);
    return l.ok() ? *l : v1::ListLeasesResponse();
  }
  std::vector<v1::IpamDrift> OpenDrift() {
    v1::ListDriftRequest r;
    r.set_node_id("net-node");
    auto d = Call<v1::ListDriftResponse>("gpuaas.v1.ipam.drift.list", r);
    if (!d.ok()) return {};
    std::vector<v1::IpamDrift> out;
    for (const auto& x : d->drift()) {
      if (!x.has_resolved_at()) out.push_back(x);
    }
    return out;
  }
  std::string LeaseStateOf(const std::string& slot_key) {
    const auto all = Leases();
    for (const auto& l : all.leases()) {
      if (l.observation().slot_key() == slot_key) return enums::Text(l.observation().lease_state());
    }
    return "";
  }

  node_agent::testing::NetnsLab lab_;
  testing::Platform p_;
  node_agent::NodeAgent* agent_ = nullptr;
  std::string net_dir_;
  std::string bridge_ = "gpuaasbr0";
};

TEST_F(NetFlowTest, AgentAppliesIpamsDocumentAndLeasesDriftAndRepairAreSeen) {
  v1::ApproveSlotsRequest approve;
  approve.set_node_id("net-node");
  auto approved = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
  ASSERT_TRUE(approved.ok()) << approved.error().ToString();
  ASSERT_EQ(approved->results_size(), 2);
  // The scheduler learns of the approval from inventory's events, as ipam does.
  ASSERT_TRUE(p_.WaitSchedulable("net-node", 2));

  // The agent applies the document and acks it; ipam shows it applied only then.
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto n = Network();
        return n.document().reservations_size() == 2 && n.applied_version() > 0 &&
               n.applied_version() == n.latest_version();
      },
      20s));
  auto net = Network();
  bridge_ = net.document().bridge();
  EXPECT_TRUE(net.blockers().empty()) << ::testing::PrintToString(net.blockers());
  const auto hosts = Slurp(net_dir_ + "/dhcp-hosts");
  for (const auto& r : net.document().reservations()) {
    EXPECT_NE(hosts.find(r.mac() + "," + r.ip()), std::string::npos) << hosts;
  }

  // A tenant's slice binds one reservation; the "VM" with that MAC gets exactly that IP.
  v1::CreateAllocationRequest create;
  create.set_tenant("acme");
  create.set_request_id("net-1");
  create.set_sku("h200-sxm-slice");
  create.set_gpu_count(1);
  create.set_region("us-east-1");
  auto alloc = Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", create);
  ASSERT_TRUE(alloc.ok()) << alloc.error().ToString();
  const std::string slot = alloc->allocation().slot_keys(0);
  v1::NetworkReservation mine;
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto n = Network();
        for (const auto& r : n.document().reservations()) {
          if (r.slot_key() == slot && r.allocation_id() == alloc->allocation().allocation_id() &&
              n.applied_version() == n.latest_version()) {
            mine = r;
            return true;
          }
        }
        return false;
      },
      20s))
      << "the reservation is bound to the allocation and the bound document applied";
  auto vm = lab_.AddVm("vm1", mine.mac(), "vnet1", bridge_);
  ASSERT_FALSE(vm.empty());
  auto ip = lab_.Dhcp(vm);
  ASSERT_TRUE(ip.has_value()) << "no DHCP answer for the reserved MAC";
  EXPECT_EQ(*ip, mine.ip());
  auto stranger = lab_.AddVm("vm2", "52:54:00:de:ad:01", "vnet2", bridge_);
  ASSERT_FALSE(stranger.empty());
  EXPECT_FALSE(lab_.Dhcp(stranger, 2).has_value()) << "an unknown MAC gets nothing";

  // The agent's lease report reaches ipam: the slot's lease is bound at the reserved IP.
  ASSERT_TRUE(testing::WaitFor([&] { return LeaseStateOf(slot) == "bound"; }, 20s));
  EXPECT_TRUE(OpenDrift().empty());

  // Tampering with the lease (a different IP for the MAC) is drift until it is clean again.
  const std::string lease_file = net_dir_ + "/dnsmasq.leases";
  const std::string original = Slurp(lease_file);
  ASSERT_NE(original.find(mine.ip()), std::string::npos) << original;
  std::string tampered = original;
  tampered.replace(tampered.find(mine.ip()), mine.ip().size(), "10.100.0.250");
  std::ofstream(lease_file, std::ios::trunc) << tampered;
  ASSERT_TRUE(testing::WaitFor([&] { return !OpenDrift().empty(); }, 20s));
  auto drift = OpenDrift();
  EXPECT_EQ(drift[0].kind(), "ipam_lease_mismatch");
  EXPECT_EQ(drift[0].slot_key(), slot);
  EXPECT_EQ(drift[0].actual_ip(), "10.100.0.250");
  // Inventory marks the slot degraded while the drift is open (so it is not sold again).
  auto SlotHealth = [&] {
    v1::ShowNodeRequest r;
    r.set_node_id("net-node");
    auto show = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
    if (show.ok()) {
      for (const auto& s : show->slots()) {
        if (s.slot_key() == slot) return enums::Text(s.health()) + ": " + s.health_detail();
      }
    }
    return std::string();
  };
  ASSERT_TRUE(testing::WaitFor([&] { return SlotHealth().rfind("degraded", 0) == 0; }, 20s))
      << SlotHealth();
  std::ofstream(lease_file, std::ios::trunc) << original;
  ASSERT_TRUE(testing::WaitFor([&] { return OpenDrift().empty(); }, 20s)) << "drift resolved";
  ASSERT_TRUE(testing::WaitFor([&] { return SlotHealth().rfind("healthy", 0) == 0; }, 20s))
      << SlotHealth();

  // Release: vm.release, then slot.cleanup, which also releases the slot MAC's DHCP lease
  // before the claims go; the reservation stays with the approved slot, which is reusable.
  v1::ReleaseAllocationRequest rel;
  rel.set_allocation_id(alloc->allocation().allocation_id());
  ASSERT_TRUE(
      Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel).ok());
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        v1::GetAllocationRequest g;
        g.set_allocation_id(alloc->allocation().allocation_id());
        auto a = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
        return a.ok() && a->allocation().state() == v1::ALLOCATION_STATE_RELEASED;
      },
      20s));
  EXPECT_EQ(Slurp(lease_file).find(mine.mac()), std::string::npos)
      << "no lease left for the slot MAC: " << Slurp(lease_file);
  EXPECT_NE(Slurp(net_dir_ + "/dhcp-hosts").find(mine.mac() + "," + mine.ip()), std::string::npos)
      << "the slot keeps its reservation";
  auto again = lab_.Dhcp(vm);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(*again, mine.ip()) << "the slot is reusable with the same identity";

  // The runbook incident: MASQUERADE disappears while everything else looks healthy. The agent
  // finds it missing and puts it back.
  auto rules = lab_.InNs(lab_.host(), {"iptables", "-t", "nat", "-S", "POSTROUTING"});
  std::string masq;
  std::istringstream lines(rules.out);
  for (std::string line; std::getline(lines, line);) {
    if (line.find("MASQUERADE") != std::string::npos) masq = line;
  }
  ASSERT_FALSE(masq.empty()) << rules.out;
  std::vector<std::string> del = {"iptables", "-t", "nat", "-D"};
  std::istringstream words(masq.substr(3));  // "-A POSTROUTING ..." -> "POSTROUTING ..."
  for (std::string w; words >> w;) del.push_back(w[0] == '"' ? w.substr(1, w.size() - 2) : w);
  ASSERT_EQ(lab_.InNs(lab_.host(), del).exit_code, 0);
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        auto now = lab_.InNs(lab_.host(), {"iptables", "-t", "nat", "-S", "POSTROUTING"});
        return now.out.find("MASQUERADE") != std::string::npos;
      },
      20s))
      << "the agent repaired NAT";
}

// A mode change takes the slice network off the host and a return to slice-vm puts it back:
// ipam's document follows the node's mode and the agent acks each version only once it checked
// the host (nothing of the network left; everything back).
TEST_F(NetFlowTest, TheSliceNetworkLeavesWithBaremetalModeAndComesBackWithSliceVm) {
  p_.ApproveAll("net-node");
  ASSERT_TRUE(p_.WaitSchedulable("net-node", 2));
  auto applied = [&](bool removed) {
    return testing::WaitFor(
        [&] {
          auto n = Network();
          return n.document().version() > 0 && n.document().removed() == removed &&
                 n.applied_version() == n.latest_version() && n.blockers().empty();
        },
        30s);
  };
  ASSERT_TRUE(applied(false));
  bridge_ = Network().document().bridge();
  auto bridge_there = [&] {
    return lab_.InNs(lab_.host(), {"ip", "link", "show", "dev", bridge_}).exit_code == 0;
  };
  auto masquerade_there = [&] {
    auto nat = lab_.InNs(lab_.host(), {"iptables", "-t", "nat", "-S", "POSTROUTING"});
    return nat.out.find("MASQUERADE") != std::string::npos;
  };
  ASSERT_TRUE(bridge_there());
  ASSERT_TRUE(masquerade_there());

  auto admin = [&](const std::string& op) {
    v1::NodeAdminRequest r;
    r.set_node_id("net-node");
    r.set_reason("rebalance");
    return Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node." + op, r);
  };
  auto mode = [&](v1::CapacityProfile m) {
    v1::ChangeNodeModeRequest r;
    r.set_node_id("net-node");
    r.set_mode(m);
    r.set_reason("rebalance");
    return Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.mode", r);
  };
  auto node_is = [&](v1::NodeAdminState state, v1::CapacityProfile profile) {
    return testing::WaitFor(
        [&] {
          v1::ShowNodeRequest r;
          r.set_node_id("net-node");
          auto n = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
          return n.ok() && n->node().admin_state() == state &&
                 n->node().capacity_profile() == profile &&
                 n->node().mode_target() == v1::CAPACITY_PROFILE_UNSPECIFIED;
        },
        30s);
  };
  v1::DrainNodeRequest drain;
  drain.set_node_id("net-node");
  drain.set_reason("rebalance");
  ASSERT_TRUE(Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.drain", drain).ok());
  ASSERT_TRUE(node_is(v1::NODE_ADMIN_STATE_DRAINED, v1::CAPACITY_PROFILE_SLICE_VM));
  ASSERT_TRUE(mode(v1::CAPACITY_PROFILE_BAREMETAL).ok());
  // Removed and verified: no bridge, no dnsmasq, no NAT rule of ours.
  ASSERT_TRUE(applied(true)) << Network().DebugString();
  EXPECT_FALSE(bridge_there());
  EXPECT_FALSE(masquerade_there());
  EXPECT_FALSE(std::filesystem::exists(net_dir_ + "/dnsmasq.pid"));
  ASSERT_TRUE(node_is(v1::NODE_ADMIN_STATE_DRAINED, v1::CAPACITY_PROFILE_BAREMETAL));

  // Back to slice-vm: the network is put back (its slots wait for approval).
  ASSERT_TRUE(mode(v1::CAPACITY_PROFILE_SLICE_VM).ok());
  ASSERT_TRUE(applied(false)) << Network().DebugString();
  EXPECT_TRUE(bridge_there());
  EXPECT_TRUE(masquerade_there());
  EXPECT_EQ(Network().document().reservations_size(), 2) << "the slots kept their addresses";
  ASSERT_TRUE(node_is(v1::NODE_ADMIN_STATE_DRAINED, v1::CAPACITY_PROFILE_SLICE_VM));
  ASSERT_TRUE(admin("undrain").ok());
  p_.ApproveAll("net-node");
  EXPECT_TRUE(p_.WaitSchedulable("net-node", 2));
}

}  // namespace
}  // namespace gpuaas
