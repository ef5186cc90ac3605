#pragma once
// Network faults for the chaos campaign (--net-faults): each service runs in its own network
// namespace with a veth pair to the host, and the campaign cuts, slows or thins that link: a
// partition and packet loss are nftables rules on the host's end of the veth, latency is an
// NFQUEUE in the namespace whose packets gpuaas-net-delay holds 200 ms (this machine's kernel has
// no sch_netem, so no `tc netem`). The servers (PostgreSQL, nats-server) keep listening on
// 127.0.0.1 only: on the host, traffic from a service's veth is translated to 127.0.0.1
// (route_localnet on the veth, DNAT to the loopback address and SNAT to it, so PostgreSQL's
// 127.0.0.1 host rule admits it), and inside a namespace the campaign's own probes of the service's
// HTTP port are translated the same way. Everything is named after the campaign's pid, and deleted
// with it.
#include <string>
#include <vector>

#include "test_env.hpp"

namespace gpuaas::chaos {

enum class NetFault {
  kPartitionPostgres,  // every packet to and from PostgreSQL's ports dropped (a black hole)
  kPartitionNats,      // the same for nats-server's port
  kDelay,              // 200 ms added to everything the service sends
  kLoss,               // 5 % of the packets lost, both ways
};
const char* NetFaultName(NetFault f);

// One service's namespace and link. Not copyable: the destructor deletes the namespace.
class ServiceNet {
 public:
  // `index`: 0.. within the campaign (it picks the link's addresses); `delay_bin`: the
  // gpuaas-net-delay binary; `log`: its log file.
  ServiceNet(int index, std::string delay_bin, std::string log);
  ~ServiceNet();
  ServiceNet(const ServiceNet&) = delete;
  ServiceNet& operator=(const ServiceNet&) = delete;

  // The address a service inside uses for a server on the host's 127.0.0.1.
  const std::string& host_ip() const { return host_ip_; }
  // The address the host reaches the service's loopback ports at.
  const std::string& ns_ip() const { return ns_ip_; }
  // `argv` run inside the namespace (`ip netns exec`, which execs: the pid is the service's).
  std::vector<std::string> Wrap(const std::vector<std::string>& argv) const;
  // Starts `f` (ports: the servers' ports a partition cuts); Heal() ends it.
  void Inject(NetFault f, const std::vector<int>& ports);
  void Heal();

 private:
  std::string ns_;
  std::string host_if_;
  std::string ns_if_;
  std::string host_ip_;
  std::string ns_ip_;
  std::string nat_table_;
  std::string fault_table_;
  std::string queue_rule_;  // the NFQUEUE rule while delayed (iptables -D removes it)
  std::string delay_bin_;
  std::string log_;
  int queue_ = 0;
  testing::Process delayer_;
};

// "127.0.0.1" in a DSN or URL replaced by `ip`.
std::string Rehost(std::string s, const std::string& ip);

}  // namespace gpuaas::chaos
