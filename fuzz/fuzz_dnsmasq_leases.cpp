// fuzz_dnsmasq_leases: dnsmasq's lease file is written by a process that talks DHCP with guests,
// so its lines carry guest-chosen hostnames and client ids. The input is the lease file; both of
// the agent's readers run on it: net_apply's ObserveLeases (what the agent reports to ipam) and
// the VM runtime's LeasedIp (readiness). They must agree: a reservation is missing exactly when
// LeasedIp finds no lease for its MAC, a bound one has its reserved IP, a mismatch another one,
// and an unexpected lease is for a MAC without a reservation. And what the agent reports from
// it (the LeaseReport the agent builds from ObserveLeases with AddLeaseObservations) is a
// report ipam accepts (ipam::ValidateLeaseReport): ipam refuses a malformed report whole.
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <set>
#include <string>

#include "fuzz_check.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/network/lease_report.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"
#include "gpuaas/node_agent/runtime/libvirt_runtime.hpp"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::fuzz {
namespace {

const std::string& StateDir() {
  static const auto* dir = [] {
    char tmpl[] = "/tmp/gpuaas-fuzz-leases-XXXXXX";
    FUZZ_CHECK(::mkdtemp(tmpl) != nullptr, "mkdtemp");
    return new std::string(tmpl);
  }();
  return *dir;
}

node_agent::NetworkSpec Spec() {
  node_agent::NetworkSpec s;
  s.bridge = "gpuaasbr0";
  s.gateway_cidr = "10.100.0.1/24";
  s.subnet_cidr = "10.100.0.0/24";
  s.state_dir = StateDir();
  // The second MAC in upper case: reservations match leases case-insensitively.
  s.reservations = {{"52:54:00:aa:bb:01", "10.100.0.10", "slice-1", "node-a/0"},
                    {"52:54:00:AA:BB:02", "10.100.0.11", "slice-2", "node-a/1"},
                    {"52:54:00:aa:bb:03", "10.100.0.12", "", "node-a/2"}};
  s.version = 1;
  return s;
}

void Check(const std::string& content) {
  const std::string file = StateDir() + "/dnsmasq.leases";
  {
    std::ofstream f(file, std::ios::binary | std::ios::trunc);
    f << content;
  }
  const node_agent::NetworkSpec spec = Spec();
  const std::time_t before = std::time(nullptr);
  auto obs = node_agent::ObserveLeases(spec);
  FUZZ_CHECK(obs.ok(), obs.ok() ? "" : obs.error().ToString());
  FUZZ_CHECK(obs->size() >= spec.reservations.size(), content);

  std::set<std::string> reserved;
  for (size_t i = 0; i < spec.reservations.size(); ++i) {
    const auto& r = spec.reservations[i];
    const auto& o = (*obs)[i];
    reserved.insert(node_agent::Lower(r.mac));
    FUZZ_CHECK(o.mac == node_agent::Lower(r.mac) && o.expected_ip == r.ip &&
                   o.slot_key == r.slot_key && o.hostname == r.hostname,
               o.mac);
    const std::optional<std::string> leased = node_agent::LeasedIp(file, r.mac);
    const bool same_second = std::time(nullptr) == before;  // both saw the same expiries
    if (o.lease_state == v1::LEASE_STATE_MISSING) {
      FUZZ_CHECK(o.actual_ip.empty() && o.expires_at == 0, o.mac);
      if (same_second) FUZZ_CHECK(!leased.has_value(), o.mac + " leased " + leased.value_or(""));
    } else if (o.lease_state == v1::LEASE_STATE_BOUND) {
      FUZZ_CHECK(o.actual_ip == r.ip, o.mac);
      if (same_second) FUZZ_CHECK(leased.has_value(), o.mac);
    } else if (o.lease_state == v1::LEASE_STATE_MISMATCH) {
      FUZZ_CHECK(!o.actual_ip.empty() && o.actual_ip != r.ip, o.mac + " " + o.actual_ip);
      if (same_second) FUZZ_CHECK(leased.has_value() && *leased != r.ip, o.mac);
    } else {
      FUZZ_CHECK(false, "reservation state " + enums::Text(o.lease_state));
    }
    if (leased && same_second) {
      // LeasedIp's answer (the last lease of the MAC) is a lease ObserveLeases saw too.
      FUZZ_CHECK(o.lease_state != v1::LEASE_STATE_MISSING, o.mac);
    }
  }
  for (size_t i = spec.reservations.size(); i < obs->size(); ++i) {
    const auto& o = (*obs)[i];
    FUZZ_CHECK(
        o.lease_state == v1::LEASE_STATE_UNEXPECTED && o.expected_ip.empty() && o.slot_key.empty(),
        o.mac + " " + enums::Text(o.lease_state));
    FUZZ_CHECK(reserved.count(o.mac) == 0, o.mac);
    FUZZ_CHECK(!o.actual_ip.empty() && o.mac == node_agent::Lower(o.mac), o.mac);
    FUZZ_CHECK(o.expires_at == 0 || o.expires_at >= before - 1, std::to_string(o.expires_at));
  }

  v1::LeaseReport report;  // built by the agent's own code, as its lease report loop does
  report.set_node_id("node-a");
  report.set_document_version(spec.version);
  node_agent::AddLeaseObservations(*obs, report);
  auto accepted = ipam::ValidateLeaseReport(report);
  FUZZ_CHECK(accepted.ok(), "ipam refuses the agent's report of this lease file: " +
                                (accepted.ok() ? "" : accepted.error().ToString()));
}

}  // namespace
}  // namespace gpuaas::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  gpuaas::fuzz::Check(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
