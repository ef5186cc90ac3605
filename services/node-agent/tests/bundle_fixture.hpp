#pragma once
// Test helper: a provision bundle built from a discovered (fixture) host, the way the scheduler
// builds one from approved slots: the first `n` candidates with their devices, suggested MAC/IP.
#include <string>

#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::testing {

inline v1::ProvisionBundle BundleFromCandidates(const v1::TopologyReport& host, int n,
                                                const std::string& allocation_id) {
  v1::ProvisionBundle b;
  b.set_allocation_id(allocation_id);
  b.set_attempt(1);
  b.set_tenant("acme");
  b.set_network_mode(v1::NETWORK_MODE_PRIVATE_NAT);
  for (int i = 0; i < n && i < host.candidates_size(); ++i) {
    const auto& c = host.candidates(i);
    auto* s = b.add_slots();
    s->set_slot_key(c.slot_key());
    s->set_gpu_pci_address(c.gpu_pci_address());
    s->set_fabric_vf_pci_address(c.fabric_vf_pci_address());
    s->set_fabric_type(c.fabric_type());
    s->set_nvme_by_id(c.nvme_by_id());
    s->set_mac(c.suggested_mac());
    s->set_private_ip(c.suggested_ip());
    if (c.has_numa_node()) s->set_numa_node(c.numa_node());
  }
  b.mutable_cloud_init()->set_hostname("vm-1");
  b.mutable_cloud_init()->set_instance_id(allocation_id);
  return b;
}

}  // namespace gpuaas::testing
