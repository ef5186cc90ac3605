#pragma once
// All of ipam's SQL: the database functions of its request handlers, consumers and orphan
// removal. Every function runs in the caller's transaction; functions that change a node's
// reservations expect the caller to hold the node's subnet row lock (LockNode), which serialises
// all changes of one node across workers and replicas.
#include <pqxx/pqxx>

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::ipam {

struct IpamConfig;

struct NodeNet {
  std::string node_id;
  std::string subnet;
  std::string gateway;
  std::string region;
  std::string pool;
  // Resolved at the node's first reservation, or by a node rule; unresolved (UNSPECIFIED) on
  // rows older than datapaths, whose documents take the configured one.
  Datapath datapath;
};

// The node's subnet row, locked FOR UPDATE; nullopt when ipam has never reserved on the node.
std::optional<NodeNet> LockNode(pqxx::work& tx, const std::string& node_id);

std::optional<v1::SlotReservation> FindReservation(pqxx::work& tx, const std::string& node_id,
                                                   const std::string& slot_key);
std::vector<v1::SlotReservation> ListReservations(pqxx::work& tx, const std::string& node_id);
std::vector<ReservedSlot> LoadReservedSlots(pqxx::work& tx, const std::string& node_id);

// The MAC the slot owns, assigning one when it owns none: its derived MAC unless another slot
// owns that (then the next pool MAC). Concurrent claims of one MAC are settled by the unique
// index: the loser sees the conflict and moves on. Returns {mac, source}.
Result<std::pair<std::string, std::string>> EnsureMac(pqxx::work& tx, const std::string& node_id,
                                                      const std::string& slot_key);
// Tries to make `mac` the slot's (INSERT ... ON CONFLICT DO NOTHING); false when it is owned.
bool ClaimMac(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
              const std::string& mac, const std::string& source, int epoch);
// The next free pool MAC, claimed for the slot.
Result<std::string> ClaimPoolMac(pqxx::work& tx, const std::string& node_id,
                                 const std::string& slot_key, int epoch);

// The node network document and its acks: a versioned per-node document (libs/common
// documents.hpp).
const documents::Tables& NetworkDocumentTables();

// A new document version when the node's network differs from its latest version; returns
// the latest version (0 when the node has neither documents nor reservations).
Result<int64_t> UpdateDocument(pqxx::work& tx, const std::string& node_id, const IpamConfig& cfg);

// gpuaas.v1.evt.ipam.reservation.<event> with the reservation as it is now.
Result<void> AnnounceReservation(pqxx::work& tx, const std::string& event,
                                 const v1::SlotReservation& r, const std::string& reason,
                                 const std::string& source, const std::string& traceparent);

// Opens (or changes the kind/evidence of) the drift of a finding's subject.
Result<void> RecordDrift(pqxx::work& tx, const std::string& node_id, const Finding& f,
                         int64_t document_version, const std::string& source);
// Resolves the open drift of `subject` on the node, if any.
Result<void> ResolveDrift(pqxx::work& tx, const std::string& node_id, const std::string& subject,
                          const std::string& why, const std::string& source);
std::vector<v1::IpamDrift> ListDrift(pqxx::work& tx, const std::string& node_id,
                                     bool include_resolved);

// ---- Subnet rules and node rows ----

// A subnet rule as stored.
struct RuleRow {
  std::string subnet;
  std::string gateway;
  std::vector<std::string> host_cidrs;
  Datapath datapath;  // UNSPECIFIED / "": inherit
};
std::optional<RuleRow> LoadRule(pqxx::work& tx, const RuleScope& rule);
// Inserts or replaces the rule (its updated_at now).
void UpsertRule(pqxx::work& tx, const RuleScope& rule, const std::string& subnet,
                const std::string& gateway, const std::vector<std::string>& host_cidrs,
                const Datapath& datapath);
// The management subnets inside a region or pool rule's scope (`pool` "" for a region rule):
// the pool rules of a region rule, and the nodes of the region or pool, each with its label.
std::vector<HostNetwork> ListNarrowerSubnets(pqxx::work& tx, const std::string& region,
                                             const std::string& pool);

// The subnet and gateway a node gets: node rule, then pool rule, then region rule, then
// ipam.default_subnet / ipam.default_gateway.
std::pair<std::string, std::string> ResolveSubnet(pqxx::work& tx, const IpamConfig& cfg,
                                                  const std::string& node_id,
                                                  const std::string& region,
                                                  const std::string& pool);
// The datapath a node gets: the most specific of its node, pool and region rules that sets one,
// else the configured one. Chosen independently of the subnet: a node rule that only moves the
// subnet keeps the region's datapath.
Datapath ResolveNodeDatapath(pqxx::work& tx, const IpamConfig& cfg, const std::string& node_id,
                             const std::string& region, const std::string& pool);

// The node's subnet row unless it has one already.
void InsertNodeSubnet(pqxx::work& tx, const std::string& node_id, const NodeRow& row);
// Replaces the row's subnet, gateway, region, pool and datapath.
void ReplaceNodeSubnet(pqxx::work& tx, const std::string& node_id, const NodeRow& row);
void SetNodeScope(pqxx::work& tx, const std::string& node_id, const std::string& region,
                  const std::string& pool);
void SetNodeSubnet(pqxx::work& tx, const std::string& node_id, const std::string& subnet,
                   const std::string& gateway);
void SetNodeDatapath(pqxx::work& tx, const std::string& node_id, const Datapath& datapath);

// ---- Reservations ----

int64_t CountReservations(pqxx::work& tx, const std::string& node_id);
bool HasReservations(pqxx::work& tx, const std::string& node_id);
// The node's reservations' slots and IPs, ordered by IP.
std::vector<SlotAddress> ListReservedAddresses(pqxx::work& tx, const std::string& node_id);
// The IPs the node's reservations use.
std::set<uint32_t> LoadUsedIps(pqxx::work& tx, const std::string& node_id);
// A reservation of `ip` for the slot, whose generation continues the slot's MAC row's.
void InsertReservation(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                       const std::string& mac, const std::string& ip);
void DeleteReservation(pqxx::work& tx, const std::string& node_id, const std::string& slot_key);
// The reservation's new MAC, its generation bumped.
void SetReservationMac(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                       const std::string& mac);

// ---- MAC ownership ----

struct MacAssignment {
  std::string mac;
  int epoch = 0;
  int64_t generation = 0;
};
// The slot's MAC row, locked FOR UPDATE; nullopt when the slot owns no MAC.
std::optional<MacAssignment> LockMacAssignment(pqxx::work& tx, const std::string& node_id,
                                               const std::string& slot_key);
void DeleteMacAssignment(pqxx::work& tx, const std::string& node_id, const std::string& slot_key);
// The generation the slot's events continue from (kept on its MAC row across releases).
void SetMacGeneration(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                      int64_t generation);
// A new MAC for a slot that gave up `old` at `epoch`: the derived MAC of the next epochs (up to
// 8 tried, never `old`), else the next pool MAC (at epoch + 1).
Result<std::string> ClaimReprovisionedMac(pqxx::work& tx, const std::string& node_id,
                                          const std::string& slot_key, int epoch,
                                          const std::string& old);

// ---- Lease reports ----

// The node's last lease report (document version, blockers, time) and its observations ordered
// by subject; empty when the node never reported. INTERNAL corrupt_lease for an unreadable one.
Result<v1::ListLeasesResponse> LoadLeases(pqxx::work& tx, const std::string& node_id);
// The observed_at (ms) of the node's stored lease report; nullopt when it never reported.
std::optional<int64_t> LoadLeaseReportTime(pqxx::work& tx, const std::string& node_id);
// Inserts or replaces the node's lease report (its received_at now).
void UpsertLeaseReport(pqxx::work& tx, const std::string& node_id, int64_t document_version,
                       const std::vector<std::string>& blockers, int64_t observed_ms,
                       const std::string& event_id);
// Replaces the node's lease observations with `leases` (by subject).
void ReplaceLeaseObservations(pqxx::work& tx, const std::string& node_id,
                              const std::map<std::string, v1::StoredLease>& leases);
// The subjects of the node's open drift.
std::vector<std::string> ListOpenDriftSubjects(pqxx::work& tx, const std::string& node_id);

// ---- Allocation bindings ----

// The generation of the allocation's binding row, locked FOR UPDATE; nullopt when it has none.
std::optional<int64_t> LockAllocationBinding(pqxx::work& tx, const std::string& allocation_id);
// Inserts or replaces the allocation's binding row (`state` as text, `slot_keys` its claims).
void UpsertAllocationBinding(pqxx::work& tx, const std::string& allocation_id,
                             const std::string& node_id, const std::string& state,
                             int64_t generation, const std::vector<std::string>& slot_keys);
// Binds the node's reservations of `slot_keys` to the allocation; returns the slot keys that
// were not bound to it already.
std::vector<std::string> BindReservations(pqxx::work& tx, const std::string& node_id,
                                          const std::vector<std::string>& slot_keys,
                                          const std::string& allocation_id);
// Unbinds the node's reservations bound to the allocation, except those of `keep`; returns the
// slot keys unbound.
std::vector<std::string> UnbindReservations(pqxx::work& tx, const std::string& node_id,
                                            const std::string& allocation_id,
                                            const std::vector<std::string>& keep);
// The nodes with a reservation bound to the allocation, ordered.
std::vector<std::string> ListNodesOfAllocation(pqxx::work& tx, const std::string& allocation_id);

// ---- Projection of inventory ----

// Records the node and whether its slice network is removed (generation only moves forward;
// an older event changes nothing); true when that flag changed. Locks the node's row.
bool UpsertInventoryNode(pqxx::work& tx, const std::string& node_id, int64_t generation,
                         bool slice_network_removed);
// Whether the node's latest event has it in bare-metal mode or on its way there.
bool SliceNetworkRemoved(pqxx::work& tx, const std::string& node_id);
// Records the slot (generation only moves forward).
void UpsertInventorySlot(pqxx::work& tx, const std::string& node_id, const std::string& slot_key,
                         int64_t generation);
bool InventoryHasNode(pqxx::work& tx, const std::string& node_id);
bool InventoryHasSlot(pqxx::work& tx, const std::string& node_id, const std::string& slot_key);

// ---- Orphans ----

// Nodes inventory does not know with ipam rows and no reservation bound to an allocation,
// ordered by node; only `node_id`'s when it is not "".
std::vector<v1::IpamOrphan> ListNodeOrphans(pqxx::work& tx, const std::string& node_id);
// Known nodes' slots inventory never announced that own a MAC, unbound and unchanged for at
// least `min_age_s`, ordered by node and slot; only `node_id`'s when it is not "".
std::vector<v1::IpamOrphan> ListSlotOrphans(pqxx::work& tx, int64_t min_age_s,
                                            const std::string& node_id);
// The node's next document version (1 when it has none).
int64_t NextDocumentVersion(pqxx::work& tx, const std::string& node_id);
// Deletes every row of the node: leases, drift, documents and acks, reservations, MACs, subnet.
void DeleteNodeRows(pqxx::work& tx, const std::string& node_id);
// The generation after the larger of the slot's MAC row's and reservation's; the slot must own
// a MAC.
int64_t NextSlotGeneration(pqxx::work& tx, const std::string& node_id, const std::string& slot_key);
void DeleteLeaseObservation(pqxx::work& tx, const std::string& node_id, const std::string& subject);

}  // namespace gpuaas::ipam
