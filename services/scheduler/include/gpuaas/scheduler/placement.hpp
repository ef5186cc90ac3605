#pragma once
// Pure placement engine of the scheduler (no I/O): given the free slots of candidate nodes,
// rank nodes for a request with a deterministic, fragmentation-aware best-fit score and pick
// the slot group on the chosen node. The service fetches candidates with SQL, ranks here, then
// locks the chosen node's slots (FOR UPDATE SKIP LOCKED) and falls back to the next choice.
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace gpuaas::scheduler::placement {

struct SlotView {
  std::string slot_key;
  int numa = -1;            // -1: unknown
  std::string pcie_switch;  // "" unknown
  std::string fabric_type;  // "infiniband" | "roce" | ""
};

struct NodeView {
  std::string node_id;
  std::vector<SlotView> free;  // schedulable slots without a live claim
  int total_slots = 0;         // approved slots of the node (free + claimed + unschedulable)
  int claimed_slots = 0;       // slots with a live slice claim
  bool baremetal_claimed = false;
};

struct Request {
  int gpus = 1;
  bool baremetal = false;   // whole node: needs a node with no claims at all
  std::string fabric_type;  // required fabric ("" = any)
  bool numa_local = false;  // slices: every slot on one known NUMA node (else: preferred only)
};

struct Choice {
  std::string node_id;
  std::vector<std::string> slot_keys;  // empty for baremetal
  double score = 0;                    // lower is better
};

// Demand mix used by the fragmentation measure: probability of a request of n GPUs.
using Mix = std::map<int, double>;
Mix DefaultMix();  // {1: .4, 2: .3, 4: .2, 8: .1}

// Expected GPUs on a node that could not be used by the next request drawn from `mix`, given
// the node's free slots grouped by locality (FGD-style fragmentation measure, NUMA-local).
//   F = sum over (n, p) in mix with n > 0, p > 0 of  p * S(n)
//   S(n) = 3/4 * sum_numa (c mod n) + 1/4 * sum_switch (c mod n)
// c: free slots of one NUMA node, or of one (NUMA node, PCIe switch) pair. Slots of unknown NUMA
// (-1) form one NUMA group; "" is a switch name like any other. (x mod n) is what is left once
// requests of n are packed inside that domain: slices are placed inside one NUMA node whenever
// they fit (PickSlots' locality order; `numa_local` requests must be), so a GPU that no request
// of n can use inside its NUMA node counts 3/4, one usable only across switches 1/4. There is no
// node-level term (until 2026-11-28 it weighed 1/2): it counted GPUs of different NUMA nodes as
// packable together, so it favoured breaking a whole NUMA node of a big node over using a small
// node whose NUMA nodes are too small for NUMA-local requests anyway. When n exceeds a domain's
// size every such GPU counts at that level, so an idle node scores > 0 for large n; that part is
// the same for every node of a topology and cancels in the increase that Rank compares. A whole
// node stays free for requests bigger than a NUMA node because using it breaks whole NUMA nodes,
// which the terms of the sizes that do fit in one count.
double Fragmentation(const std::vector<SlotView>& free, const Mix& mix);

// Up to `limit` choices, best first; deterministic for equal inputs (ties by node id).
// Slices go to nodes that are not baremetal-claimed and where PickSlots finds a group, ordered by:
// (1) the increase of Fragmentation(free, mix) the placement causes, in steps of 1e-6;
// (2) nodes that could not be sold as baremetal anyway (claims, or unschedulable slots) first;
// (3) fewer free slots left (best fit); (4) locality of the group; (5) node id.
// (Until 2026-11-28 (2) came first: it kept small whole nodes empty while slices broke whole NUMA
// nodes of big ones.)
// Baremetal goes to nodes with no claim at all and every slot free (and of `fabric_type`, when
// set), with at least `gpus` slots: fewest slots first, then node id.
// `score` is that order packed into an exact double (only its order means anything): it never
// decreases along the result.
std::vector<Choice> Rank(const std::vector<NodeView>& nodes, const Request& req, size_t limit,
                         const Mix& mix = DefaultMix());

// The slot group for `gpus` GPUs on one node: same NUMA node and PCIe switch preferred, then
// same NUMA, then anything; empty when the node cannot hold it. Slots of unknown NUMA (-1) form
// one group, worse than a known NUMA node and better than a group spanning NUMA nodes; with
// `req.numa_local` only a group on one known NUMA node will do.
// Among groups of equal locality, the one leaving the least Fragmentation(mix) wins, then the
// smallest sorted list of slot keys. `req.baremetal` is ignored; a baremetal-claimed node and
// `req.gpus <= 0` give an empty group. The two-argument form uses DefaultMix().
std::vector<std::string> PickSlots(const NodeView& node, const Request& req);
std::vector<std::string> PickSlots(const NodeView& node, const Request& req, const Mix& mix);

// Rank over a maintained fleet, with a decision time that does not grow with the fleet. Nodes
// are kept in buckets by shape: the multiset of their free slots' (NUMA, switch, fabric), their
// slot count, whether they could still be sold as baremetal and whether they are baremetal-
// claimed. Every input of a node's ranking key except its id is part of the shape, so a bucket
// is ranked once, from one member, and its members follow in node-id order. A decision costs
// O(log buckets + limit) instead of O(nodes): a bucket's key for a kind of request (GPU count,
// baremetal, fabric) never changes, so each kind keeps its buckets in key order, computed on
// first use and updated as buckets appear and empty. Rank() returns exactly what placement::Rank
// returns for the same nodes (tested on random fleets). Not thread-safe: one writer at a time, no
// concurrent Rank while writing.
class Index {
 public:
  explicit Index(Mix mix = DefaultMix());
  // Adds or replaces the node (by node_id).
  void Upsert(NodeView node);
  void Remove(const std::string& node_id);
  const NodeView* Find(const std::string& node_id) const;
  size_t size() const { return nodes_.size(); }
  size_t buckets() const { return buckets_.size(); }
  std::vector<Choice> Rank(const Request& req, size_t limit) const;

 private:
  // A request's kind: what a bucket's key depends on besides its shape.
  using Kind = std::tuple<int, bool, std::string, bool>;  // gpus, baremetal, fabric, numa_local
  struct Bucket {
    NodeView shape;  // a member (its free slots stand for every member's)
    std::set<std::string> members;
    mutable std::map<Kind, std::optional<uint64_t>> keys;  // per kind; nullopt: cannot serve
  };
  using Order = std::set<std::pair<uint64_t, const Bucket*>>;
  static std::string Signature(const NodeView& node);
  std::optional<uint64_t> KeyOf(const Bucket& b, const Kind& kind) const;
  const Order& OrderFor(const Kind& kind) const;
  Mix mix_;
  std::map<std::string, Bucket> buckets_;
  struct Entry {
    NodeView node;
    std::string signature;
  };
  std::unordered_map<std::string, Entry> nodes_;
  // Buckets in key order for every kind asked so far; kept current as buckets come and go, so a
  // decision walks only the front of one order.
  mutable std::map<Kind, Order> orders_;
};

}  // namespace gpuaas::scheduler::placement
