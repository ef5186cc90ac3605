#pragma once
// ipam's pure domain: IPv4/CIDR arithmetic, slot address picking, MAC derivation and collision
// resolution, the node network document and the judgement of lease reports. No I/O: the
// service (ipam_service.cpp) runs these inside its transactions, and the unit tests run them on
// their own (50,000-node MAC fleets, randomised address properties).
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <unordered_set>
#include <utility>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::ipam {

// ---- IPv4 ----

std::optional<uint32_t> ParseIpv4(std::string_view s);
std::string FormatIpv4(uint32_t ip);

struct Cidr {
  uint32_t network = 0;
  int prefix = 32;
  uint32_t Mask() const { return prefix == 0 ? 0 : ~uint32_t{0} << (32 - prefix); }
  uint32_t Broadcast() const { return network | ~Mask(); }
  bool Contains(uint32_t ip) const { return (ip & Mask()) == network; }
  std::string ToString() const;
};

// "10.100.0.0/24" with the host bits zero and min_prefix <= prefix <= max_prefix. Errors are
// INVALID_ARGUMENT invalid_cidr with details {field: problem}.
Result<Cidr> ParseCidr(std::string_view s, const std::string& field = "subnet", int min_prefix = 8,
                       int max_prefix = 30);
bool Overlaps(const Cidr& a, const Cidr& b);

// Where slot addresses come from in a node's subnet: network + first_host .. network +
// last_host, inside the subnet, never the network, gateway or broadcast address.
struct AddressPlan {
  Cidr subnet;
  uint32_t gateway = 0;
  int64_t first_host = 10;
  int64_t last_host = 250;
};

// The gateway of a subnet: `gateway` ("" = the first host), which must be a host address inside
// it. INVALID_ARGUMENT invalid_gateway otherwise.
Result<uint32_t> ResolveGateway(const Cidr& subnet, std::string_view gateway);
bool IsSlotAddress(const AddressPlan& plan, uint32_t ip);
// How many slot addresses the plan offers.
int64_t SlotCapacity(const AddressPlan& plan);
// The lowest slot address not in `used`; nullopt when the plan is exhausted.
std::optional<uint32_t> PickIp(const AddressPlan& plan, const std::set<uint32_t>& used);

// ---- MAC ----

// 52:54:00 is the QEMU/KVM locally administered prefix for derived MACs; 52:54:01 is the
// platform pool, handed out by sequence when a derived MAC is already owned by another slot.
inline constexpr uint64_t kDerivedPrefix = 0x525400;
inline constexpr uint64_t kPoolPrefix = 0x525401;
inline constexpr uint64_t kPoolSize = uint64_t{1} << 24;

std::optional<uint64_t> ParseMac(std::string_view s);  // aa:bb:cc:dd:ee:ff, any case
std::string FormatMac(uint64_t mac);
bool IsUnicastMac(uint64_t mac);
// 52:54:00 + the low 3 bytes of FNV-1a-64("<node_id>/<slot_key>#<epoch>"); epoch is the slot's
// re-provision count (0 until an admin re-provisions it).
uint64_t DerivedMacValue(std::string_view node_id, std::string_view slot_key, int epoch);
std::string DeterministicMac(const std::string& node_id, const std::string& slot_key, int epoch);
// Pool MAC number `seq` (1 .. kPoolSize-1): 52:54:01 + seq.
uint64_t PoolMacValue(uint64_t seq);

// The fleet's MAC ownership in memory, with the same rule the database applies: a slot gets
// its derived MAC unless another slot owns it, then the next pool MAC. Used by tests to show
// collisions are detected and resolved to unique MACs at fleet scale.
class MacLedger {
 public:
  struct Choice {
    uint64_t mac = 0;
    bool pool = false;  // the derived MAC was owned by another slot (a collision)
  };
  Choice Assign(std::string_view node_id, std::string_view slot_key);
  size_t collisions() const { return collisions_; }
  size_t size() const { return owned_.size(); }

 private:
  std::unordered_set<uint64_t> owned_;
  uint64_t next_pool_ = 1;
  size_t collisions_ = 0;
};

// ---- Node network document ----

struct NetworkDefaults {
  v1::NetworkDatapath datapath = v1::NETWORK_DATAPATH_LINUX_BRIDGE;
  std::string bridge = "gpuaasbr0";   // the Linux bridge's name
  std::string ovs_bridge = "ovsbr0";  // the OVS bridge's name
  bool masquerade = true;
  bool ip_forward = true;
  bool deny_cross_slice = true;
};

// A node's datapath and bridge, or what one subnet rule says of them (UNSPECIFIED / "": inherit).
struct Datapath {
  v1::NetworkDatapath datapath = v1::NETWORK_DATAPATH_UNSPECIFIED;
  std::string bridge;
  bool operator==(const Datapath&) const = default;
};

// 1-15 of [A-Za-z0-9_.-]: what the kernel and Open vSwitch accept as an interface name.
bool ValidBridgeName(std::string_view name);
// The bridge a datapath gets when no rule names one: ipam.bridge or ipam.ovs_bridge.
const std::string& DefaultBridge(v1::NetworkDatapath datapath, const NetworkDefaults& defaults);
// A node's datapath from its rules, most specific first (node, pool, region; absent ones left
// out): the first that sets a datapath, with its bridge or that datapath's default; else the
// configured datapath and its default bridge. Never UNSPECIFIED.
Datapath ResolveDatapath(const std::vector<Datapath>& rules, const NetworkDefaults& defaults);

struct ReservedSlot {
  std::string slot_key;
  std::string mac;
  std::string ip;
  std::string allocation_id;  // "" while unbound
  int64_t bound_at_ms = 0;
};

// The slots of an allocation share one VM, whose management vNIC is the allocation's first slot
// (by slot key, as the scheduler's bundle orders them): only that one is expected to hold a
// lease and carry the hostname.
std::set<std::string> PrimarySlots(const std::vector<ReservedSlot>& slots);
// "slice-<first 8 of the allocation id>" (the scheduler's default guest hostname); made unique
// on the node with "-<last 6 of the id>" when two allocations would share it.
std::map<std::string, std::string> Hostnames(const std::vector<ReservedSlot>& slots);

// The document's content (version 0, no created_at), reservations ordered by IP. `datapath` is
// the node's (ResolveDatapath); an unresolved one (a node row older than datapaths) takes the
// configured datapath and bridge.
v1::NodeNetworkDocument BuildDocument(const std::string& node_id, const std::string& subnet,
                                      const std::string& gateway, const Datapath& datapath,
                                      const NetworkDefaults& defaults,
                                      const std::vector<ReservedSlot>& slots);
// Same content, ignoring version and created_at?
bool SameContent(v1::NodeNetworkDocument a, v1::NodeNetworkDocument b);

// ---- Lease reports ----

// Field problems of a report (node id, lease states, MACs, IPs), all at once: INVALID_ARGUMENT
// malformed_lease_report.
Result<void> ValidateLeaseReport(const v1::LeaseReport& report);

struct Finding {
  std::string subject;  // slot key, or "mac:<mac>" for an unexpected lease on no reserved IP
  std::string slot_key;
  std::string mac;
  std::string kind;  // a drift kind of the registry (reason::kIpamLease*, kIpamVnicDrift)
  std::string detail;
  std::string expected_ip;
  std::string actual_ip;
  std::string allocation_id;
};

struct LeaseJudgement {
  // One per reserved slot (judged against ipam's reservation, not the agent's copy) and one per
  // unexpected lease, keyed by subject.
  std::map<std::string, v1::StoredLease> leases;
  std::map<std::string, Finding> drift;  // by subject; at most one finding each
};

// Judges `report` against the node's reservations. A slot bound to an allocation drifts when its
// lease has another IP or MAC (mismatch) or, for the allocation's primary slot, when it has none
// `readiness_timeout_ms` after binding (missing). A lease whose MAC nobody reserved drifts
// (unexpected), attributed to the slot whose IP it holds if any. A bound slot the agent reports
// vNIC drift for (LeaseReport.vnic_drift) drifts too (vnic), unless its lease already does.
LeaseJudgement JudgeLeases(const std::vector<ReservedSlot>& slots, const v1::LeaseReport& report,
                           int64_t observed_at_ms, int64_t readiness_timeout_ms);

// ---- Request fields ----

// Comma-separated items, blanks around them trimmed, empty ones dropped.
std::vector<std::string> SplitCsv(const std::string& s);
// A node id that must be given: INVALID_ARGUMENT `reason` when missing or not a DNS label.
Result<void> CheckNodeId(const std::string& id, Reason reason);
// A node id (lowercase DNS label) and slot key (1-128 characters), every bad field at once:
// INVALID_ARGUMENT `reason`.
Result<void> ValidateSlotKeys(const std::string& node_id, const std::string& slot_key,
                              Reason reason);
// reserve: the keys, then `region` (a DNS label, required with `pool`) and `pool` (at most 63):
// INVALID_ARGUMENT invalid_reservation_request.
Result<void> ValidateReserveRequest(const v1::ReserveSlotAddressRequest& req);

// ---- Subnet rules ----

// What a subnet rule covers: a node (node_id only), a pool of a region (region + pool) or a
// region (region). Stored as text in subnet_rules.scope (CHECK constraint, same texts) and sent
// as text in SubnetRule.scope; converted only there.
enum class Scope { kNode, kPool, kRegion };
inline constexpr std::array<std::pair<Scope, std::string_view>, 3> kScopeTexts{{
    {Scope::kNode, "node"},
    {Scope::kPool, "pool"},
    {Scope::kRegion, "region"},
}};
constexpr std::string_view ScopeText(Scope scope) {
  for (const auto& [s, text] : kScopeTexts) {
    if (s == scope) return text;
  }
  return "";
}
// The scope of a text; nullopt for any other text.
constexpr std::optional<Scope> ParseScope(std::string_view text) {
  for (const auto& [s, t] : kScopeTexts) {
    if (t == text) return s;
  }
  return std::nullopt;
}

// Which subnet rule: its scope and the keys that scope uses ("" for the others).
struct RuleScope {
  Scope scope = Scope::kNode;
  std::string region;
  std::string pool;
  std::string node_id;
};

// The rules that may apply to a node, most specific first: its node rule, the pool rule of
// `region` + `pool` (both given), the region rule (`region` given).
std::vector<RuleScope> ApplicableRules(const std::string& node_id, const std::string& region,
                                       const std::string& pool);

// A network present on hosts (or a management subnet), with where it comes from.
struct HostNetwork {
  std::string cidr;
  std::string where;
};

// The broader rules over the same nodes as a rule of `scope` whose nodes are in `region`/`pool`:
// the region rule (unless this is one), and the pool rule (for a node rule), each with the
// `where` its host networks are reported as.
struct BroaderRule {
  RuleScope rule;
  std::string where;
};
std::vector<BroaderRule> BroaderRules(Scope scope, const std::string& region,
                                      const std::string& pool);

// A SetSubnetRequest, validated: scope (invalid_scope), subnet (invalid_cidr), gateway
// (invalid_gateway), datapath (datapath_invalid) and bridge (invalid_bridge), host networks
// (invalid_cidr per item); the first problem in that order.
struct SubnetRuleSpec {
  RuleScope rule;
  Cidr subnet;
  uint32_t gateway = 0;
  Datapath datapath;                    // what the rule says (UNSPECIFIED / "": inherit)
  std::vector<std::string> host_cidrs;  // as given
  std::vector<Cidr> own_hosts;          // parsed
};
Result<SubnetRuleSpec> ParseSubnetRule(const v1::SetSubnetRequest& req);

// INVALID_ARGUMENT subnet_too_small when the plan offers fewer than `required` slot addresses.
Result<void> CheckSubnetCapacity(const AddressPlan& plan, int64_t required);
// INVALID_ARGUMENT subnet_overlap for the first of `hosts` (unparseable ones skipped) that
// overlaps `subnet`.
Result<void> CheckHostOverlap(const Cidr& subnet, const std::vector<HostNetwork>& hosts);
// INVALID_ARGUMENT subnet_overlap for the first subnet of `narrower` (narrower rules and nodes in
// the rule's scope) that overlaps one of the rule's own host networks.
Result<void> CheckNarrowerOverlap(const std::vector<Cidr>& own_hosts,
                                  const std::vector<HostNetwork>& narrower);

// A reservation's slot and IP.
struct SlotAddress {
  std::string slot_key;
  std::string ip;
};
// FAILED_PRECONDITION subnet_in_use for the first of the node's reservations whose IP is not a
// slot address of the plan of its new subnet.
Result<void> CheckReservationsFit(const AddressPlan& plan, const std::string& node_id,
                                  const std::vector<SlotAddress>& reservations);

// A node rule that chooses a datapath, or stops choosing one, moves the node at once; one that
// never chose keeps the datapath the node got with its first reservation.
bool NodeRuleMovesDatapath(const std::optional<Datapath>& before, const Datapath& now);

// The plan of a node's stored subnet and gateway (text as the database returns them).
AddressPlan PlanOf(const std::string& subnet, const std::string& gateway, int64_t first_host,
                   int64_t last_host);

// What a node's subnet row gets at a reservation, from the rules of today (`subnet`, `gateway`,
// `datapath`) and the request's `region`/`pool`.
enum class NodeRowChange {
  kNone,
  kApplyRules,  // no address handed out yet: the rules of today apply, and the request's scope
  kMoveScope,   // the node has reservations: only its region/pool follow the request
};
struct NodeRow {
  std::string subnet;
  std::string gateway;
  std::string region;
  std::string pool;
  Datapath datapath;
};
NodeRowChange ChangeAtReserve(const NodeRow& current, const NodeRow& wanted, bool has_reservations);

}  // namespace gpuaas::ipam
