#pragma once
// Public ingress on a node: the ingress service's per-node exposure document, applied as DNAT
// from the node's uplink to slice VMs' management IPs, in the platform's own nftables table:
//
//   table ip gpuaas_ingress {
//     chain prerouting {  type nat hook prerouting priority dstnat; policy accept;
//       iifname "<uplink>" ip daddr <public_ip> <proto> dport <public_port>
//           dnat to <target_ip>:<target_port> comment "gpuaas-exp-<exposure_id>" }
//     chain forward {  type filter hook forward priority filter; policy accept;
//       iifname "<uplink>" ip daddr <target_ip> <proto> dport <target_port> ct status dnat
//           accept comment "gpuaas-exp-<exposure_id>" }
//   }
//
// The table is replaced in one nft transaction (`nft -f`: declare, delete, re-create), so a
// packet sees either the old or the new mappings, never a half; nothing outside the table is
// touched. Conntrack entries of every mapping that went away are deleted, so established flows
// (and UDP "connections") stop too instead of riding the old NAT binding.
//
// An accept verdict only ends one base chain: a DNATed packet must also be accepted by every other
// forward-hook chain (iptables-nft's `filter FORWARD` with ipam's GPUAAS-FWD-<bridge>). With a
// FORWARD policy of ACCEPT (the default) that holds; under a DROP policy the forward accept here
// does not help and the ipam chain has to accept `ctstate DNAT` towards the subnet.
//
// Commands are argv vectors run through RunTool inside `ctx.netns` (NetContext of net_apply.hpp);
// specs are validated before anything is touched. Nothing here throws.
#include <cstdint>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"

namespace gpuaas::node_agent {

inline constexpr const char* kExposureTable = "gpuaas_ingress";  // family ip

struct ExposureRule {
  std::string exposure_id;  // UUID; tags the rules (nft comment "gpuaas-exp-<exposure_id>")
  std::string protocol;     // "tcp" | "udp"
  std::string public_ip;    // IPv4 the client dials (on the uplink, or routed to the node)
  int public_port = 0;      // 1..65535
  std::string target_ip;    // the slice VM's management IP (must be one of spec.slice_ips)
  int target_port = 0;      // 1..65535
  std::string slot_key;     // carried into reports only
};

struct ExposureSpec {
  int64_t version = 0;                 // >= 1
  std::string uplink;                  // the node's public/uplink interface name
  std::string subnet_cidr;             // the node's management subnet (10.100.0.0/24)
  std::vector<std::string> slice_ips;  // the node's current network document: the only targets
  std::vector<ExposureRule> rules;
  std::string sys_root = "/sys";  // where /class/net/<if> is read (tests use a fixture dir)
};

struct ExposureRefusal {
  std::string exposure_id;
  std::string reason;  // invalid_exposure_id | invalid_protocol | invalid_public_ip |
                       // invalid_port | target_not_slice | duplicate_endpoint
  std::string message;
  std::string slot_key;
};

// What Check found (and Reconcile fixed). Kinds:
//   table_missing  the table is gone (re-created); each expected rule is also rule_missing
//   chain_stale    one of the two base chains is missing or has another type/hook/priority/policy
//   rule_missing   an expected rule is absent (re-applied)
//   rule_stale     a rule tagged for an exposure of the spec differs from it (replaced)
//   rule_foreign   anything else in the table: an untagged rule, a rule tagged for an exposure the
//                  spec does not have (or not valid in it), a duplicate, another chain or object
struct ExposureDrift {
  std::string exposure_id;  // "" for foreign rules and table/chain-level drift
  std::string kind;
  std::string detail;  // the rule as found / expected, in nft syntax (or its JSON when unusual)
};

struct ExposureApplyReport {
  int64_t version = 0;
  std::vector<std::string> applied;      // exposure ids now in the kernel, in spec order
  std::vector<ExposureRefusal> refused;  // rules refused (not applied), each with its reason
  std::vector<std::string> removed;      // exposure ids that had rules in the table and now none
  // Conntrack entries deleted for mappings that went away; -1 when a flush was needed and could
  // not be done (conntrack missing or failing): conntrack_problem then says why.
  int conntrack_flushed = 0;
  std::string conntrack_problem;
  // False when the kernel already held exactly this table (no transaction was run).
  bool changed = false;
  std::vector<ExposureDrift> drift;  // what the table held that the spec did not (before apply)
};

// Pure, plus sysfs reads under spec.sys_root. Whole-spec problems are an error (INVALID_ARGUMENT;
// reasons invalid_version, invalid_uplink, fabric_interface, invalid_subnet, invalid_slice_ip,
// invalid_netns) with details field/value; per-rule problems come back as refusals. All rules
// sharing one protocol+public_ip+public_port are refused (duplicate_endpoint): which of them the
// ingress service meant cannot be told here, and a wrong guess exposes another tenant's VM.
Result<std::vector<ExposureRefusal>> ValidateExposureSpec(const ExposureSpec& spec);

// Makes the table hold exactly the spec's valid rules (one transaction; skipped when it already
// does), then deletes the conntrack entries of every DNAT mapping that went away.
Result<ExposureApplyReport> ApplyExposures(const ExposureSpec& spec, const NetContext& ctx);

// Read-only: `nft -j list table ip gpuaas_ingress` against the spec's valid rules; empty = match.
Result<std::vector<ExposureDrift>> CheckExposures(const ExposureSpec& spec, const NetContext& ctx);

// Check, and when anything drifted apply again; returns what was found (drift events).
Result<std::vector<ExposureDrift>> ReconcileExposures(const ExposureSpec& spec,
                                                      const NetContext& ctx);

// Slot cleanup proof: true when no rule in the platform's table DNATs to, or accepts towards,
// `target_ip` (no table = true).
Result<bool> NoExposureFor(const std::string& target_ip, const NetContext& ctx);

// Tests/teardown: deletes the table (absent = ok). Conntrack is left alone.
Result<void> TeardownExposures(const NetContext& ctx);

}  // namespace gpuaas::node_agent
