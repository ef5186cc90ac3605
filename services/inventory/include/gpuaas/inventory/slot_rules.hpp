#pragma once
// Pure slot rules of the inventory (no I/O): the approval validator that turns an advisory
// candidate into an approved slot only when it is a complete, safe bundle, drift detection of an
// approved slot against newer evidence, and the SKU a GPU is sold as. Every rejection and drift
// record carries a machine-readable reason of inventory_reasons.hpp; every rule has its own unit
// test (tests/slot_rules_test.cpp).
#include <set>
#include <string>
#include <vector>

#include "gpuaas/inventory/inventory_reasons.hpp"  // the rejection reasons (reason::k...)
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::inventory {

struct ApprovalContext {
  // Evidence of the snapshot the candidate comes from.
  const v1::TopologyReport* report = nullptr;
  // The node's other approved (admin_state "available") slots, and those already approved
  // earlier in the same batch: their NVMe and fabric VF must not be taken twice.
  std::vector<v1::Slot> holders;
  // NVMe by-id paths with a recorded wipe proof (an unexpected signature is then accepted).
  std::set<std::string> wiped_nvme;
};

// All local rule violations of one candidate (empty: the bundle is complete and safe). Address
// reservation (MAC/IP from ipam) is checked by the caller after these pass.
std::vector<v1::SlotRejection> ValidateCandidate(const v1::CandidateSlot& c,
                                                 const ApprovalContext& ctx);

// Drift of an approved slot against a newer report: the GPU, its NVMe or its fabric VF vanished,
// or the NVMe became mounted (the disk or a child partition). Empty: no drift.
std::vector<v1::DriftRecord> DetectDrift(const v1::Slot& slot, const v1::TopologyReport& report);

// "0x2335" -> "h200-sxm", "0x2330" -> "h100-sxm", otherwise "nvidia-<id without 0x>".
std::string SkuForDevice(const std::string& device_id);

}  // namespace gpuaas::inventory
