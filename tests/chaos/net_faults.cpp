#include "net_faults.hpp"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <stdexcept>

#include <fmt/format.h>

#include "test_env.hpp"

namespace gpuaas::chaos {
namespace {

void Must(const std::string& cmd) {
  if (testing::Shell(cmd + " >/dev/null 2>&1") != 0) {
    throw std::runtime_error("network setup failed: " + cmd);
  }
}

void Try(const std::string& cmd) { (void)testing::Shell(cmd + " >/dev/null 2>&1"); }

// Traffic arriving on `dev` for `ip` goes to 127.0.0.1 (same port), from 127.0.0.1: the
// listener bound to the loopback address answers it, and replies are translated back.
std::string LoopbackNat(const std::string& table, const std::string& dev, const std::string& ip) {
  return fmt::format(
      "table ip {0} {{\n"
      "  chain pre {{ type nat hook prerouting priority dstnat; iifname \"{1}\" ip daddr {2} "
      "dnat to 127.0.0.1; }}\n"
      "  chain in {{ type nat hook input priority 100; iifname \"{1}\" snat to 127.0.0.1; }}\n"
      "}}\n",
      table, dev, ip);
}

// Loads `rules` into the host's nftables, or into namespace `ns`'s.
std::string NftApply(const std::string& rules, const std::string& ns = "") {
  return fmt::format("printf '%s' '{}' | {}nft -f -", rules,
                     ns.empty() ? "" : "ip netns exec " + ns + " ");
}

// A table that drops, on the host's end `dev` of a service's veth, the packets coming from the
// service that match `in` and those going to it that match `out`: before connection tracking on
// the way in, after the replies' translation on the way out.
std::string DropTable(const std::string& table, const std::string& dev, const std::string& in,
                      const std::string& out) {
  return fmt::format(
      "table inet {0} {{\n"
      "  chain in {{ type filter hook prerouting priority raw; iifname \"{1}\" {2} drop; }}\n"
      "  chain out {{ type filter hook postrouting priority 300; oifname \"{1}\" {3} drop; }}\n"
      "}}\n",
      table, dev, in, out);
}

}  // namespace

const char* NetFaultName(NetFault f) {
  switch (f) {
    case NetFault::kPartitionPostgres:
      return "partition from postgres";
    case NetFault::kPartitionNats:
      return "partition from nats";
    case NetFault::kDelay:
      return "200 ms latency";
    case NetFault::kLoss:
      return "5 % packet loss";
  }
  return "?";
}

ServiceNet::ServiceNet(int index, std::string delay_bin, std::string log)
    : delay_bin_(std::move(delay_bin)), log_(std::move(log)), queue_(100 + index) {
  // Named and addressed after the campaign's pid, so two campaigns never meet.
  const int tag = static_cast<int>(getpid() % 100000);
  ns_ = fmt::format("gpuaas-chaos-{}-{}", tag, index);
  host_if_ = fmt::format("gc{}h{}", tag, index);
  ns_if_ = fmt::format("gc{}n{}", tag, index);
  const int net = static_cast<int>(getpid() % 250);
  host_ip_ = fmt::format("10.213.{}.{}", net, 4 * index + 1);
  ns_ip_ = fmt::format("10.213.{}.{}", net, 4 * index + 2);
  nat_table_ = fmt::format("gpuaas_chaos_{}_{}", tag, index);
  fault_table_ = nat_table_ + "_fault";
  const std::string in_ns = "ip netns exec " + ns_ + " ";
  Try("ip netns del " + ns_);
  Must("ip netns add " + ns_);
  Must(fmt::format("ip link add {} type veth peer name {} netns {}", host_if_, ns_if_, ns_));
  Must(fmt::format("ip addr add {}/30 dev {}", host_ip_, host_if_));
  Must(fmt::format("ip link set {} up", host_if_));
  Must(fmt::format("sysctl -qw net.ipv4.conf.{}.route_localnet=1", host_if_));
  Must(in_ns + "ip link set lo up");
  Must(in_ns + fmt::format("ip addr add {}/30 dev {}", ns_ip_, ns_if_));
  Must(in_ns + fmt::format("ip link set {} up", ns_if_));
  Must(in_ns + fmt::format("ip route add default via {}", host_ip_));
  Must(in_ns + fmt::format("sysctl -qw net.ipv4.conf.{}.route_localnet=1", ns_if_));
  Must(NftApply(LoopbackNat(nat_table_, host_if_, host_ip_)));
  Must(NftApply(LoopbackNat("gpuaas_chaos", ns_if_, ns_ip_), ns_));
}

ServiceNet::~ServiceNet() {
  Heal();
  Try("nft delete table ip " + nat_table_);
  Try("ip netns del " + ns_);  // the veth pair goes with it
}

std::vector<std::string> ServiceNet::Wrap(const std::vector<std::string>& argv) const {
  std::vector<std::string> out = {"ip", "netns", "exec", ns_};
  out.insert(out.end(), argv.begin(), argv.end());
  return out;
}

void ServiceNet::Inject(NetFault f, const std::vector<int>& ports) {
  const std::string in_ns = "ip netns exec " + ns_ + " ";
  switch (f) {
    case NetFault::kPartitionPostgres:
    case NetFault::kPartitionNats: {
      std::string set;
      for (const int p : ports) set += (set.empty() ? "" : ", ") + std::to_string(p);
      Must(NftApply(DropTable(fault_table_, host_if_, fmt::format("tcp dport {{ {} }}", set),
                              fmt::format("tcp sport {{ {} }}", set))));
      break;
    }
    case NetFault::kDelay: {
      // Everything the service sends waits in the queue; --queue-bypass lets packets through
      // undelayed should the delayer be gone.
      std::filesystem::remove(log_);
      delayer_.Spawn(Wrap({delay_bin_, "--queue", std::to_string(queue_), "--delay-ms", "200"}),
                     log_);
      // Bound to its queue before the rule sends packets there.
      if (!testing::WaitFor(
              [&] {
                std::ifstream in(log_);
                std::string line;
                return std::getline(in, line) && line.rfind("delaying", 0) == 0;
              },
              std::chrono::seconds(10), std::chrono::milliseconds(20))) {
        throw std::runtime_error("gpuaas-net-delay did not start; see " + log_);
      }
      queue_rule_ =
          fmt::format("OUTPUT -o {} -j NFQUEUE --queue-num {} --queue-bypass", ns_if_, queue_);
      Must(in_ns + "iptables -t mangle -A " + queue_rule_);
      break;
    }
    case NetFault::kLoss:
      Must(NftApply(DropTable(fault_table_, host_if_, "numgen random mod 100 < 5",
                              "numgen random mod 100 < 5")));
      break;
  }
}

void ServiceNet::Heal() {
  Try("nft delete table inet " + fault_table_);
  if (!queue_rule_.empty()) {
    Try(fmt::format("ip netns exec {} iptables -t mangle -D {}", ns_, queue_rule_));
    queue_rule_.clear();
  }
  delayer_.Stop(std::chrono::seconds(2));
}

std::string Rehost(std::string s, const std::string& ip) {
  const std::string loop = "127.0.0.1";
  for (size_t at = s.find(loop); at != std::string::npos; at = s.find(loop, at + ip.size())) {
    s.replace(at, loop.size(), ip);
  }
  return s;
}

}  // namespace gpuaas::chaos
