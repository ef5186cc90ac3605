#include "gpuaas/node_agent/network/lease_report.hpp"

#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::node_agent {

void AddLeaseObservations(const std::vector<LeaseObservation>& leases, v1::LeaseReport& report) {
  for (const auto& l : leases) {
    auto* o = report.add_observations();
    o->set_slot_key(l.slot_key);
    o->set_mac(l.mac);
    o->set_expected_ip(l.expected_ip);
    o->set_actual_ip(l.actual_ip);
    o->set_lease_state(l.lease_state);
    o->set_hostname(l.hostname);
  }
}

}  // namespace gpuaas::node_agent
