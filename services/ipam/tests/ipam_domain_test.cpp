// ipam's pure rules without servers: MAC derivation and fleet-scale collision resolution,
// CIDR parsing, slot address properties, the node network document and lease judgement.
#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>

#include <chrono>
#include <random>
#include <set>
#include <unordered_set>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "load_config.hpp"

namespace gpuaas::ipam {
namespace {

TEST(DeterministicMacTest, QemuLocalPrefixStableAndSpread) {
  const auto a = DeterministicMac("gpu-01", "gpu-0000:18:00.0", 0);
  EXPECT_EQ(a.rfind("52:54:00:", 0), 0u) << a;
  EXPECT_EQ(a.size(), 17u);
  EXPECT_EQ(a, DeterministicMac("gpu-01", "gpu-0000:18:00.0", 0));
  EXPECT_NE(a, DeterministicMac("gpu-02", "gpu-0000:18:00.0", 0));
  EXPECT_NE(a, DeterministicMac("gpu-01", "gpu-0000:19:00.0", 0));
  EXPECT_NE(a, DeterministicMac("gpu-01", "gpu-0000:18:00.0", 1)) << "re-provision epoch";
}

TEST(DeterministicMacTest, SameFormulaAsReservationsMadeBefore) {
  // Reservations made before MAC ownership existed used FNV-1a-64("<node>/<slot>#0"): the slots
  // keep those MACs, and new slots derive the same way.
  uint64_t h = 1469598103934665603ULL;
  for (char c : std::string("gpu-01/gpu-0000:18:00.0#0")) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  EXPECT_EQ(
      DeterministicMac("gpu-01", "gpu-0000:18:00.0", 0),
      fmt::format("52:54:00:{:02x}:{:02x}:{:02x}", (h >> 16) & 0xff, (h >> 8) & 0xff, h & 0xff));
}

TEST(DeterministicMacTest, ParseFormatAndUnicast) {
  auto m = ParseMac("52:54:0A:bc:De:0f");
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(FormatMac(*m), "52:54:0a:bc:de:0f");
  EXPECT_TRUE(IsUnicastMac(*m));
  EXPECT_FALSE(IsUnicastMac(*ParseMac("01:00:5e:00:00:01"))) << "multicast";
  EXPECT_FALSE(IsUnicastMac(*ParseMac("00:00:00:00:00:00")));
  for (const char* bad : {"", "52:54:00:ab:cd", "52-54-00-ab-cd-ef", "52:54:00:ab:cd:eg",
                          "52:54:00:ab:cd:ef:01", "525400abcdef"}) {
    EXPECT_FALSE(ParseMac(bad).has_value()) << bad;
  }
  EXPECT_EQ(FormatMac(PoolMacValue(1)), "52:54:01:00:00:01");
  EXPECT_EQ(FormatMac(PoolMacValue(0xabcdef)), "52:54:01:ab:cd:ef");
}

// 50,000 nodes x 8 slots through the same rule the database applies (derived MAC unless owned,
// then the next pool MAC): every collision is detected, resolved from the pool, and every slot
// ends with its own MAC.
TEST(MacFleetTest, FiftyThousandNodesByEightSlotsResolveEveryCollision) {
  const auto start = std::chrono::steady_clock::now();
  constexpr int kNodes = 50000;
  constexpr int kSlots = 8;
  std::vector<std::string> slot_keys;
  slot_keys.reserve(kSlots);
  for (int s = 0; s < kSlots; ++s) {
    slot_keys.push_back(fmt::format("gpu-0000:{:02x}:00.0", 0x18 + s * 0x10));
  }
  MacLedger ledger;
  std::unordered_set<uint64_t> derived_seen;
  std::unordered_set<uint64_t> assigned;
  size_t expected_collisions = 0;
  size_t pool_choices = 0;
  std::vector<uint64_t> first_run;
  first_run.reserve(size_t{kNodes} * kSlots);
  for (int n = 0; n < kNodes; ++n) {
    const std::string node = fmt::format("gpu-{:05d}", n);
    for (const auto& slot : slot_keys) {
      const uint64_t derived = DerivedMacValue(node, slot, 0);
      // Independent detection: the derived MAC was already some other slot's derived MAC.
      if (!derived_seen.insert(derived).second) ++expected_collisions;
      const auto choice = ledger.Assign(node, slot);
      if (choice.pool) {
        ++pool_choices;
        EXPECT_EQ(choice.mac >> 24, kPoolPrefix);
      } else {
        EXPECT_EQ(choice.mac, derived);
      }
      EXPECT_TRUE(IsUnicastMac(choice.mac));
      assigned.insert(choice.mac);
      first_run.push_back(choice.mac);
    }
  }
  EXPECT_EQ(assigned.size(), size_t{kNodes} * kSlots) << "every slot has a MAC of its own";
  EXPECT_EQ(ledger.collisions(), expected_collisions);
  EXPECT_EQ(pool_choices, expected_collisions) << "every collision was resolved from the pool";
  // 400k MACs in a 2^24 space: the birthday bound says thousands of collisions.
  EXPECT_GT(expected_collisions, 1000u);
  // Deterministic: the same fleet in the same order gets the same MACs.
  MacLedger again;
  size_t i = 0;
  bool same = true;
  for (int n = 0; n < kNodes && same; ++n) {
    const std::string node = fmt::format("gpu-{:05d}", n);
    for (const auto& slot : slot_keys) {
      same = same && again.Assign(node, slot).mac == first_run[i++];
    }
  }
  EXPECT_TRUE(same);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  EXPECT_LT(ms, 20000) << "pure derivation should take well under a second per 100k slots";
  std::cout << fmt::format("{} slots, {} collisions resolved from the pool, {} ms\n",
                           kNodes * kSlots, expected_collisions, ms);
}

TEST(CidrTest, ParsesNetworksAndRejectsMalformedOnes) {
  auto c = ParseCidr("10.100.0.0/24");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->ToString(), "10.100.0.0/24");
  EXPECT_EQ(FormatIpv4(c->Broadcast()), "10.100.0.255");
  for (const char* bad :
       {"", "10.100.0.0", "10.100.0/24", "10.100.0.0/", "10.100.0.0/33", "10.100.0.256/24",
        "10.100.00.0/24", "a.b.c.d/24", "10.100.0.0/24x", "10.100.0.0/-1", " 10.100.0.0/24"}) {
    auto r = ParseCidr(bad);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().reason, "invalid_cidr") << bad;
    EXPECT_TRUE(r.error().details.count("subnet")) << bad;
  }
  auto host_bits = ParseCidr("10.100.0.5/24");
  ASSERT_FALSE(host_bits.ok());
  EXPECT_NE(host_bits.error().message.find("host bits"), std::string::npos);
  EXPECT_FALSE(ParseCidr("10.100.0.0/31").ok()) << "too small for a gateway and a slot";
  EXPECT_FALSE(ParseCidr("10.0.0.0/7").ok());
  EXPECT_TRUE(Overlaps(*ParseCidr("10.100.0.0/24"), *ParseCidr("10.100.0.128/25")));
  EXPECT_TRUE(Overlaps(*ParseCidr("10.0.0.0/8"), *ParseCidr("10.100.0.0/24")));
  EXPECT_FALSE(Overlaps(*ParseCidr("10.100.0.0/24"), *ParseCidr("10.100.1.0/24")));
  auto gw = ResolveGateway(*c, "");
  ASSERT_TRUE(gw.ok());
  EXPECT_EQ(FormatIpv4(*gw), "10.100.0.1");
  for (const char* bad : {"10.100.1.1", "10.100.0.0", "10.100.0.255", "x"}) {
    auto g = ResolveGateway(*c, bad);
    ASSERT_FALSE(g.ok()) << bad;
    EXPECT_EQ(g.error().reason, "invalid_gateway");
  }
}

// Property: whatever the subnet, gateway and host range, the addresses handed out are exactly
// the plan's slot addresses: each inside the subnet, never the network, gateway or broadcast
// address, never twice, and as many as SlotCapacity says; releases make room again.
TEST(AddressPropertyTest, EverySlotGetsExactlyOneAddressInsideItsSubnet) {
  std::mt19937 rng(20260101);
  for (int round = 0; round < 300; ++round) {
    const int prefix = std::uniform_int_distribution<int>(22, 30)(rng);
    const uint32_t size = uint32_t{1} << (32 - prefix);
    const uint32_t base = (0x0a000000u | (rng() & 0x00ffffffu)) & ~(size - 1);
    Cidr subnet{base, prefix};
    const uint32_t gw = base + 1 + static_cast<uint32_t>(rng() % (size - 2));
    AddressPlan plan{subnet, gw, std::uniform_int_distribution<int64_t>(1, 12)(rng),
                     std::uniform_int_distribution<int64_t>(2, 1100)(rng)};
    std::set<uint32_t> used;
    std::map<int, uint32_t> slot_ip;  // slot -> its one address
    for (int slot = 0;; ++slot) {
      auto ip = PickIp(plan, used);
      if (!ip) break;
      ASSERT_TRUE(subnet.Contains(*ip));
      ASSERT_NE(*ip, subnet.network);
      ASSERT_NE(*ip, subnet.Broadcast());
      ASSERT_NE(*ip, gw);
      ASSERT_TRUE(IsSlotAddress(plan, *ip));
      ASSERT_TRUE(used.insert(*ip).second) << "address handed out twice";
      slot_ip[slot] = *ip;
    }
    ASSERT_EQ(static_cast<int64_t>(used.size()), SlotCapacity(plan))
        << subnet.ToString() << " gw " << FormatIpv4(gw) << " " << plan.first_host << ".."
        << plan.last_host;
    if (slot_ip.empty()) continue;
    // Release a random third and reserve again: still one address per slot, none shared.
    for (auto it = slot_ip.begin(); it != slot_ip.end();) {
      if (rng() % 3 == 0) {
        used.erase(it->second);
        it = slot_ip.erase(it);
      } else {
        ++it;
      }
    }
    const size_t before = slot_ip.size();
    for (int slot = 100000; auto ip = PickIp(plan, used); ++slot) {
      ASSERT_TRUE(IsSlotAddress(plan, *ip));
      ASSERT_TRUE(used.insert(*ip).second);
      slot_ip[slot] = *ip;
    }
    ASSERT_EQ(static_cast<int64_t>(slot_ip.size()), SlotCapacity(plan));
    ASSERT_GE(slot_ip.size(), before);
  }
}

TEST(AddressPropertyTest, CapacityOfTheDefaults) {
  const AddressPlan def{*ParseCidr("10.100.0.0/24"), *ParseIpv4("10.100.0.1"), 10, 250};
  EXPECT_EQ(SlotCapacity(def), 241);
  const AddressPlan small{*ParseCidr("10.100.0.0/28"), *ParseIpv4("10.100.0.1"), 10, 250};
  EXPECT_EQ(SlotCapacity(small), 5) << ".10-.14 (.15 is the broadcast)";
  const AddressPlan gw_inside{*ParseCidr("10.100.0.0/28"), *ParseIpv4("10.100.0.12"), 10, 250};
  EXPECT_EQ(SlotCapacity(gw_inside), 4);
  EXPECT_FALSE(IsSlotAddress(gw_inside, *ParseIpv4("10.100.0.12")));
}

std::vector<ReservedSlot> Slots() {
  return {{"gpu-b", "52:54:00:00:00:02", "10.100.0.11", "0190aaaa-0000-7000-8000-000000000001", 0},
          {"gpu-a", "52:54:00:00:00:01", "10.100.0.10", "0190aaaa-0000-7000-8000-000000000001", 0},
          {"gpu-c", "52:54:00:00:00:03", "10.100.0.12", "0190aaaa-0000-7000-8000-000000000002", 0},
          {"gpu-d", "52:54:00:00:00:04", "10.100.0.9", "", 0}};
}

TEST(DocumentTest, ExactReservationsWithHostnamesOnPrimarySlots) {
  auto d = BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1", {}, NetworkDefaults{}, Slots());
  EXPECT_EQ(d.datapath(), v1::NETWORK_DATAPATH_LINUX_BRIDGE) << "an unresolved node: the config's";
  EXPECT_EQ(d.bridge(), "gpuaasbr0");
  EXPECT_TRUE(d.nat().masquerade());
  EXPECT_TRUE(d.nat().ip_forward());
  EXPECT_TRUE(d.isolation().deny_cross_slice());
  ASSERT_EQ(d.reservations_size(), 4);
  EXPECT_EQ(d.reservations(0).ip(), "10.100.0.9") << "ordered by IP";
  EXPECT_EQ(d.reservations(0).hostname(), "") << "unbound";
  EXPECT_EQ(d.reservations(1).slot_key(), "gpu-a");
  // Both allocations start with 0190aaaa: the hostnames are made unique with the id's tail.
  EXPECT_EQ(d.reservations(1).hostname(), "slice-0190aaaa-000001");
  EXPECT_EQ(d.reservations(2).slot_key(), "gpu-b");
  EXPECT_EQ(d.reservations(2).hostname(), "") << "second slot of the same VM";
  EXPECT_EQ(d.reservations(3).hostname(), "slice-0190aaaa-000002");
  auto alone = Slots();
  alone.resize(2);
  auto d2 = BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1", {}, NetworkDefaults{}, alone);
  EXPECT_EQ(d2.reservations(0).hostname(), "slice-0190aaaa");
  auto later = d;
  later.set_version(7);
  EXPECT_TRUE(SameContent(d, later));
  later.mutable_reservations(0)->set_allocation_id("x");
  EXPECT_FALSE(SameContent(d, later));
  for (const auto& r : d.reservations()) {
    EXPECT_EQ(r.network_id(), "") << "room for the seed's networks: never set";
    EXPECT_EQ(r.network_policy_id(), "");
    EXPECT_EQ(r.project_network_id(), "");
  }
}

TEST(DocumentTest, DatapathAndBridgeComeFromTheNodeAndChangeTheContent) {
  const NetworkDefaults defaults;
  const auto linux_doc =
      BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1",
                    {v1::NETWORK_DATAPATH_LINUX_BRIDGE, "gpuaasbr0"}, defaults, Slots());
  const auto ovs_doc = BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1",
                                     {v1::NETWORK_DATAPATH_OVS, "ovsbr0"}, defaults, Slots());
  EXPECT_EQ(ovs_doc.datapath(), v1::NETWORK_DATAPATH_OVS);
  EXPECT_EQ(ovs_doc.bridge(), "ovsbr0");
  EXPECT_FALSE(SameContent(linux_doc, ovs_doc)) << "a datapath change is a new version";
  const auto renamed = BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1",
                                     {v1::NETWORK_DATAPATH_OVS, "br-slice"}, defaults, Slots());
  EXPECT_EQ(renamed.bridge(), "br-slice");
  EXPECT_FALSE(SameContent(ovs_doc, renamed)) << "so is a bridge rename";
  // A datapath without a bridge takes that datapath's configured bridge.
  EXPECT_EQ(BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1", {v1::NETWORK_DATAPATH_OVS, ""},
                          defaults, Slots())
                .bridge(),
            "ovsbr0");
  // Configured for OVS: an unresolved node gets OVS and ipam.ovs_bridge.
  NetworkDefaults ovs_config;
  ovs_config.datapath = v1::NETWORK_DATAPATH_OVS;
  ovs_config.ovs_bridge = "br0";
  const auto from_config =
      BuildDocument("gpu-01", "10.100.0.0/24", "10.100.0.1", {}, ovs_config, Slots());
  EXPECT_EQ(from_config.datapath(), v1::NETWORK_DATAPATH_OVS);
  EXPECT_EQ(from_config.bridge(), "br0");
}

TEST(DocumentTest, TheMostSpecificRuleThatSetsADatapathWins) {
  NetworkDefaults d;
  d.bridge = "lbr0";
  d.ovs_bridge = "obr0";
  using P = Datapath;
  const P inherit{};
  const P ovs{v1::NETWORK_DATAPATH_OVS, ""};
  const P ovs_named{v1::NETWORK_DATAPATH_OVS, "br-pool"};
  const P linux_named{v1::NETWORK_DATAPATH_LINUX_BRIDGE, "br-node"};
  const P linux_plain{v1::NETWORK_DATAPATH_LINUX_BRIDGE, ""};
  // No rule, or rules that all inherit: the configuration (never UNSPECIFIED).
  EXPECT_EQ(ResolveDatapath({}, d), (P{v1::NETWORK_DATAPATH_LINUX_BRIDGE, "lbr0"}));
  EXPECT_EQ(ResolveDatapath({inherit, inherit, inherit}, d),
            (P{v1::NETWORK_DATAPATH_LINUX_BRIDGE, "lbr0"}));
  // node, pool, region: the first that sets a datapath, with its bridge or the default.
  EXPECT_EQ(ResolveDatapath({inherit, inherit, ovs}, d), (P{v1::NETWORK_DATAPATH_OVS, "obr0"}));
  EXPECT_EQ(ResolveDatapath({inherit, ovs_named, linux_plain}, d), ovs_named);
  EXPECT_EQ(ResolveDatapath({linux_named, ovs_named, ovs}, d), linux_named);
  EXPECT_EQ(ResolveDatapath({linux_plain, ovs_named}, d),
            (P{v1::NETWORK_DATAPATH_LINUX_BRIDGE, "lbr0"}))
      << "the bridge comes from the rule that chose the datapath, not a less specific one";
  d.datapath = v1::NETWORK_DATAPATH_OVS;
  EXPECT_EQ(ResolveDatapath({inherit}, d), (P{v1::NETWORK_DATAPATH_OVS, "obr0"}));
  EXPECT_EQ(DefaultBridge(v1::NETWORK_DATAPATH_LINUX_BRIDGE, d), "lbr0");
}

TEST(DocumentTest, BridgeNamesAreInterfaceNames) {
  for (const char* ok : {"ovsbr0", "gpuaasbr0", "br-ex", "a", "br_0.100", "abcdefghijklmno"}) {
    EXPECT_TRUE(ValidBridgeName(ok)) << ok;
  }
  for (const char* bad : {"", "abcdefghijklmnop", "br 0", "br/0", "br0;", "ovsbr0\n"}) {
    EXPECT_FALSE(ValidBridgeName(bad)) << bad;
  }
  EXPECT_EQ(enums::Text(v1::NETWORK_DATAPATH_LINUX_BRIDGE), "linux-bridge");
  EXPECT_EQ(enums::Text(v1::NETWORK_DATAPATH_OVS), "ovs");
  EXPECT_EQ(enums::Parse<v1::NetworkDatapath>("ovs"), v1::NETWORK_DATAPATH_OVS);
  EXPECT_FALSE(enums::Parse<v1::NetworkDatapath>("linux_bridge").has_value());
}

v1::LeaseObservation Obs(const std::string& slot, const std::string& mac, const std::string& ip,
                         const std::string& state) {
  v1::LeaseObservation o;
  o.set_slot_key(slot);
  o.set_mac(mac);
  o.set_actual_ip(ip);
  o.set_lease_state(enums::FromColumn<v1::LeaseState>(state));
  return o;
}

TEST(LeaseJudgementTest, BoundSlotsDriftOnMismatchMissingPastTimeoutAndUnexpected) {
  auto slots = Slots();
  for (auto& s : slots) s.bound_at_ms = 1000;
  v1::LeaseReport r;
  r.set_node_id("gpu-01");
  *r.add_observations() = Obs("gpu-a", "52:54:00:00:00:01", "10.100.0.10", "bound");
  *r.add_observations() = Obs("gpu-b", "52:54:00:00:00:02", "", "missing");
  *r.add_observations() = Obs("gpu-c", "52:54:00:00:00:03", "", "missing");
  *r.add_observations() = Obs("gpu-d", "52:54:00:00:00:04", "10.100.0.99", "mismatch");
  // Within the readiness timeout a missing lease is not drift yet.
  auto early = JudgeLeases(slots, r, 1000 + 500, 1000);
  EXPECT_TRUE(early.drift.empty());
  EXPECT_EQ(early.leases.at("gpu-a").observation().lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(early.leases.at("gpu-d").observation().lease_state(), v1::LEASE_STATE_MISMATCH);
  EXPECT_EQ(early.leases.at("gpu-d").observation().expected_ip(), "10.100.0.9");
  auto late = JudgeLeases(slots, r, 1000 + 1000, 1000);
  ASSERT_EQ(late.drift.size(), 1u) << "gpu-b is a second slot of its VM; gpu-d is unbound";
  EXPECT_EQ(late.drift.at("gpu-c").kind, reason::kIpamLeaseMissing.str());

  *r.mutable_observations(0) = Obs("gpu-a", "52:54:00:00:00:01", "10.100.0.50", "mismatch");
  *r.add_observations() = Obs("", "52:54:00:99:99:99", "10.100.0.12", "unexpected");
  *r.add_observations() = Obs("", "52:54:00:77:77:77", "10.100.0.77", "unexpected");
  auto j = JudgeLeases(slots, r, 1500, 1000);
  ASSERT_EQ(j.drift.size(), 3u);
  EXPECT_EQ(j.drift.at("gpu-a").kind, reason::kIpamLeaseMismatch.str());
  EXPECT_EQ(j.drift.at("gpu-a").actual_ip, "10.100.0.50");
  EXPECT_EQ(j.drift.at("gpu-c").kind, reason::kIpamLeaseUnexpected.str())
      << "a foreign MAC holds gpu-c's IP";
  EXPECT_EQ(j.drift.at("gpu-c").allocation_id, "0190aaaa-0000-7000-8000-000000000002");
  EXPECT_EQ(j.drift.at("mac:52:54:00:77:77:77").kind, reason::kIpamLeaseUnexpected.str());
  EXPECT_EQ(j.leases.at("mac:52:54:00:77:77:77").observation().lease_state(),
            v1::LEASE_STATE_UNEXPECTED);

  // The agent's stale document: slot gpu-a leased under its old MAC.
  v1::LeaseReport stale;
  stale.set_node_id("gpu-01");
  *stale.add_observations() = Obs("gpu-a", "52:54:00:00:00:ff", "10.100.0.10", "bound");
  auto s = JudgeLeases(slots, stale, 1500, 1000);
  EXPECT_EQ(s.drift.at("gpu-a").kind, reason::kIpamLeaseMismatch.str());
}

TEST(LeaseJudgementTest, AgentVnicDriftDegradesOnlyThatBoundSlot) {
  auto slots = Slots();
  for (auto& s : slots) s.bound_at_ms = 1000;
  v1::LeaseReport r;
  r.set_node_id("gpu-01");
  *r.add_observations() = Obs("gpu-a", "52:54:00:00:00:01", "10.100.0.10", "bound");
  *r.add_observations() = Obs("gpu-c", "52:54:00:00:00:03", "", "missing");
  for (const auto& [slot, kind] :
       std::vector<std::pair<std::string, std::string>>{{"gpu-a", "vnic_detached"},
                                                        {"gpu-a", "qos_missing"},
                                                        {"gpu-c", "qos_missing"},
                                                        {"gpu-d", "vnic_detached"},
                                                        {"gpu-zz", "vnic_detached"}}) {
    auto* d = r.add_vnic_drift();
    d->set_slot_key(slot);
    d->set_kind(kind);
  }
  ASSERT_TRUE(ValidateLeaseReport(r).ok());
  auto j = JudgeLeases(slots, r, 5000, 1000);
  ASSERT_EQ(j.drift.size(), 2u) << "gpu-d is unbound, gpu-zz is no slot of ipam's";
  EXPECT_EQ(j.drift.at("gpu-a").kind, reason::kIpamVnicDrift.str());
  EXPECT_EQ(j.drift.at("gpu-a").detail,
            "the node reports its vNIC drifted: vnic_detached, qos_missing");
  EXPECT_EQ(j.drift.at("gpu-a").allocation_id, slots[1].allocation_id);
  EXPECT_EQ(j.drift.at("gpu-c").kind, reason::kIpamLeaseMissing.str())
      << "the lease finding stays the slot's";

  auto bad = r;
  bad.mutable_vnic_drift(0)->set_kind("Vnic-Detached");
  bad.mutable_vnic_drift(1)->set_slot_key("");
  auto v = ValidateLeaseReport(bad);
  ASSERT_FALSE(v.ok());
  EXPECT_TRUE(v.error().details.count("vnic_drift[0].kind"));
  EXPECT_TRUE(v.error().details.count("vnic_drift[1].slot_key"));
}

TEST(LeaseJudgementTest, MalformedReportsListEveryProblem) {
  v1::LeaseReport r;
  r.set_node_id("Bad.Node");
  *r.add_observations() = Obs("gpu-a", "zz:54:00:00:00:01", "10.100.0.300", "leased");
  auto v = ValidateLeaseReport(r);
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.error().reason, "malformed_lease_report");
  EXPECT_TRUE(v.error().details.count("node_id"));
  EXPECT_TRUE(v.error().details.count("observations[0].mac"));
  EXPECT_TRUE(v.error().details.count("observations[0].actual_ip"));
  EXPECT_TRUE(v.error().details.count("observations[0].lease_state"));
}

TEST(IpamConfigTest, EveryProblemIsReportedAtOnce) {
  auto cfg = LoadConfig<IpamConfig>({{"GPUAAS_POSTGRES_DSN", "x"}});
  EXPECT_TRUE(cfg.Validate().ok());
  cfg.default_subnet = "10.100.0.0/28";
  cfg.reserved_cidrs = "192.168.0.0/16, 10.100.0.0/16";
  cfg.bridge = "a-bridge-name-too-long";
  cfg.ovs_bridge = "ovs br";
  cfg.datapath = "linux_bridge";
  auto v = cfg.Validate();
  ASSERT_FALSE(v.ok());
  EXPECT_EQ(v.error().reason, "invalid_config");
  EXPECT_TRUE(v.error().details.count("ipam.default_subnet"));
  EXPECT_TRUE(v.error().details.count("ipam.bridge"));
  EXPECT_TRUE(v.error().details.count("ipam.ovs_bridge"));
  EXPECT_TRUE(v.error().details.count("ipam.datapath"));
  cfg = LoadConfig<IpamConfig>({{"GPUAAS_POSTGRES_DSN", "x"}});
  cfg.default_subnet = "10.100.0.7/24";
  cfg.reserved_cidrs = "nonsense";
  v = cfg.Validate();
  ASSERT_FALSE(v.ok());
  EXPECT_TRUE(v.error().details.count("ipam.default_subnet"));
  EXPECT_TRUE(v.error().details.count("ipam.reserved_cidrs"));
}

TEST(IpamConfigTest, DatapathIsTheLinuxBridgeUnlessConfigured) {
  auto cfg = LoadConfig<IpamConfig>({{"GPUAAS_POSTGRES_DSN", "x"}});
  EXPECT_EQ(cfg.datapath, "linux-bridge");
  EXPECT_EQ(cfg.Network().datapath, v1::NETWORK_DATAPATH_LINUX_BRIDGE);
  EXPECT_EQ(cfg.Network().bridge, "gpuaasbr0");
  EXPECT_EQ(cfg.Network().ovs_bridge, "ovsbr0");
  auto ovs =
      LoadConfig<IpamConfig>({{"GPUAAS_POSTGRES_DSN", "x"}, {"GPUAAS_IPAM_DATAPATH", "ovs"}});
  EXPECT_TRUE(ovs.Validate().ok());
  EXPECT_EQ(ovs.Network().datapath, v1::NETWORK_DATAPATH_OVS);
  // An unknown text is refused when the file is read, naming the valid ones.
  IpamConfig bad;
  config::Schema schema;
  bad.Register(schema);
  auto r =
      schema.LoadFromString("ipam:\n  datapath: openvswitch\n", {{"GPUAAS_POSTGRES_DSN", "x"}});
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(r.error().details.count("ipam.datapath")) << r.error().ToString();
}

}  // namespace
}  // namespace gpuaas::ipam
