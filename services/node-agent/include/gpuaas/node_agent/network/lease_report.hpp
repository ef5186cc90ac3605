#pragma once
// What the agent tells ipam about dnsmasq's leases: ObserveLeases' judgement (net_apply.hpp) as
// the observations of a gpuaas.v1.LeaseReport. The node-agent's lease loop and the lease-file
// fuzz target both build reports with it, so the fuzzer checks the report the agent sends.
#include <vector>

#include "gpuaas/node_agent/network/net_apply.hpp"

namespace gpuaas::v1 {
class LeaseReport;
}

namespace gpuaas::node_agent {

// Appends one observation per lease, in order.
void AddLeaseObservations(const std::vector<LeaseObservation>& leases, v1::LeaseReport& report);

}  // namespace gpuaas::node_agent
