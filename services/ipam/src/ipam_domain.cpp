#include "gpuaas/ipam/ipam_domain.hpp"

#include <google/protobuf/util/message_differencer.h>
#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <charconv>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/ipam/ipam_reasons.hpp"

namespace gpuaas::ipam {

namespace {

bool ParseInt(std::string_view s, int64_t* out) {
  if (s.empty() || s.size() > 10) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  auto r = std::from_chars(s.data(), s.data() + s.size(), *out);
  return r.ec == std::errc() && r.ptr == s.data() + s.size();
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

constexpr uint64_t kFnvOffset = 1469598103934665603ULL;
constexpr uint64_t kFnvPrime = 1099511628211ULL;

uint64_t Fnv(uint64_t h, std::string_view s) {
  for (char c : s) {
    h ^= static_cast<unsigned char>(c);
    h *= kFnvPrime;
  }
  return h;
}

Error Invalid(Reason reason, const std::string& field, const std::string& problem) {
  return Error::InvalidArgument(reason, field + ": " + problem, {{field, problem}});
}

uint32_t IpOr0(const std::string& s) { return ParseIpv4(s).value_or(0); }

}  // namespace

// ---- IPv4 ----

std::optional<uint32_t> ParseIpv4(std::string_view s) {
  uint32_t out = 0;
  int parts = 0;
  size_t start = 0;
  while (parts < 4) {
    const size_t dot = s.find('.', start);
    const bool last = parts == 3;
    if (last != (dot == std::string_view::npos)) return std::nullopt;
    const std::string_view part = s.substr(start, last ? std::string_view::npos : dot - start);
    int64_t v = 0;
    if (part.size() > 3 || (part.size() > 1 && part[0] == '0') || !ParseInt(part, &v) || v > 255) {
      return std::nullopt;
    }
    out = (out << 8) | static_cast<uint32_t>(v);
    ++parts;
    start = dot + 1;
  }
  return out;
}

std::string FormatIpv4(uint32_t ip) {
  return fmt::format("{}.{}.{}.{}", ip >> 24, (ip >> 16) & 0xff, (ip >> 8) & 0xff, ip & 0xff);
}

std::string Cidr::ToString() const { return fmt::format("{}/{}", FormatIpv4(network), prefix); }

Result<Cidr> ParseCidr(std::string_view s, const std::string& field, int min_prefix,
                       int max_prefix) {
  const size_t slash = s.find('/');
  if (slash == std::string_view::npos) {
    return Invalid(reason::kInvalidCidr, field,
                   fmt::format("'{}' is not an IPv4 CIDR like 10.100.0.0/24", s));
  }
  auto ip = ParseIpv4(s.substr(0, slash));
  int64_t prefix = -1;
  if (!ip || !ParseInt(s.substr(slash + 1), &prefix) || prefix > 32) {
    return Invalid(reason::kInvalidCidr, field,
                   fmt::format("'{}' is not an IPv4 CIDR like 10.100.0.0/24", s));
  }
  if (prefix < min_prefix || prefix > max_prefix) {
    return Invalid(reason::kInvalidCidr, field,
                   fmt::format("prefix /{} is outside /{}../{}", prefix, min_prefix, max_prefix));
  }
  Cidr c{*ip, static_cast<int>(prefix)};
  if ((*ip & c.Mask()) != *ip) {
    return Invalid(reason::kInvalidCidr, field,
                   fmt::format("'{}' has host bits set (the network is {}/{})", s,
                               FormatIpv4(*ip & c.Mask()), prefix));
  }
  return c;
}

bool Overlaps(const Cidr& a, const Cidr& b) {
  const int p = std::min(a.prefix, b.prefix);
  const uint32_t mask = p == 0 ? 0 : ~uint32_t{0} << (32 - p);
  return (a.network & mask) == (b.network & mask);
}

Result<uint32_t> ResolveGateway(const Cidr& subnet, std::string_view gateway) {
  if (gateway.empty()) return subnet.network + 1;
  auto g = ParseIpv4(gateway);
  if (!g) {
    return Invalid(reason::kInvalidGateway, "gateway",
                   fmt::format("'{}' is not an IPv4 address", gateway));
  }
  if (!subnet.Contains(*g) || *g == subnet.network || *g == subnet.Broadcast()) {
    return Invalid(reason::kInvalidGateway, "gateway",
                   fmt::format("{} is not a host address of {}", gateway, subnet.ToString()));
  }
  return *g;
}

namespace {
// Offsets [lo, hi] of the plan that can hold slots (network and broadcast excluded).
std::pair<int64_t, int64_t> OffsetRange(const AddressPlan& p) {
  const int64_t size = int64_t{1} << (32 - p.subnet.prefix);
  return {std::max<int64_t>(p.first_host, 1), std::min<int64_t>(p.last_host, size - 2)};
}
}  // namespace

bool IsSlotAddress(const AddressPlan& plan, uint32_t ip) {
  if (!plan.subnet.Contains(ip) || ip == plan.gateway) return false;
  const auto [lo, hi] = OffsetRange(plan);
  const int64_t off = static_cast<int64_t>(ip - plan.subnet.network);
  return off >= lo && off <= hi;
}

int64_t SlotCapacity(const AddressPlan& plan) {
  const auto [lo, hi] = OffsetRange(plan);
  if (hi < lo) return 0;
  int64_t n = hi - lo + 1;
  const int64_t g = static_cast<int64_t>(plan.gateway) - static_cast<int64_t>(plan.subnet.network);
  if (plan.subnet.Contains(plan.gateway) && g >= lo && g <= hi) --n;
  return n;
}

std::optional<uint32_t> PickIp(const AddressPlan& plan, const std::set<uint32_t>& used) {
  const auto [lo, hi] = OffsetRange(plan);
  for (int64_t off = lo; off <= hi; ++off) {
    const uint32_t ip = plan.subnet.network + static_cast<uint32_t>(off);
    if (ip != plan.gateway && !used.count(ip)) return ip;
  }
  return std::nullopt;
}

// ---- MAC ----

std::optional<uint64_t> ParseMac(std::string_view s) {
  if (s.size() != 17) return std::nullopt;
  uint64_t v = 0;
  for (size_t i = 0; i < 17; i += 3) {
    const int hi = HexDigit(s[i]);
    const int lo = HexDigit(s[i + 1]);
    if (hi < 0 || lo < 0 || (i + 2 < 17 && s[i + 2] != ':')) return std::nullopt;
    v = (v << 8) | static_cast<uint64_t>(hi * 16 + lo);
  }
  return v;
}

std::string FormatMac(uint64_t mac) {
  return fmt::format("{:02x}:{:02x}:{:02x}:{:02x}:{:02x}:{:02x}", (mac >> 40) & 0xff,
                     (mac >> 32) & 0xff, (mac >> 24) & 0xff, (mac >> 16) & 0xff, (mac >> 8) & 0xff,
                     mac & 0xff);
}

bool IsUnicastMac(uint64_t mac) { return mac != 0 && ((mac >> 40) & 0x01) == 0; }

uint64_t DerivedMacValue(std::string_view node_id, std::string_view slot_key, int epoch) {
  uint64_t h = Fnv(kFnvOffset, node_id);
  h = Fnv(h, "/");
  h = Fnv(h, slot_key);
  h = Fnv(h, "#");
  char buf[16];
  auto r = std::to_chars(buf, buf + sizeof(buf), epoch);
  h = Fnv(h, std::string_view(buf, static_cast<size_t>(r.ptr - buf)));
  return (kDerivedPrefix << 24) | (h & 0xffffff);
}

std::string DeterministicMac(const std::string& node_id, const std::string& slot_key, int epoch) {
  return FormatMac(DerivedMacValue(node_id, slot_key, epoch));
}

uint64_t PoolMacValue(uint64_t seq) { return (kPoolPrefix << 24) | (seq & 0xffffff); }

MacLedger::Choice MacLedger::Assign(std::string_view node_id, std::string_view slot_key) {
  const uint64_t derived = DerivedMacValue(node_id, slot_key, 0);
  if (owned_.insert(derived).second) return {derived, false};
  ++collisions_;
  for (;;) {
    const uint64_t mac = PoolMacValue(next_pool_++);
    if (owned_.insert(mac).second) return {mac, true};
  }
}

// ---- Node network document ----

std::set<std::string> PrimarySlots(const std::vector<ReservedSlot>& slots) {
  std::map<std::string, std::string> first;  // allocation -> smallest slot key
  for (const auto& s : slots) {
    if (s.allocation_id.empty()) continue;
    auto [it, fresh] = first.emplace(s.allocation_id, s.slot_key);
    if (!fresh && s.slot_key < it->second) it->second = s.slot_key;
  }
  std::set<std::string> out;
  for (const auto& [a, k] : first) out.insert(k);
  return out;
}

std::map<std::string, std::string> Hostnames(const std::vector<ReservedSlot>& slots) {
  std::map<std::string, std::set<std::string>> by_base;  // base -> allocations
  auto base = [](const std::string& id) { return "slice-" + id.substr(0, 8); };
  for (const auto& s : slots) {
    if (!s.allocation_id.empty()) by_base[base(s.allocation_id)].insert(s.allocation_id);
  }
  std::map<std::string, std::string> out;
  for (const auto& [b, ids] : by_base) {
    for (const auto& id : ids) {
      out[id] = ids.size() == 1 ? b : b + "-" + id.substr(id.size() >= 6 ? id.size() - 6 : 0);
    }
  }
  return out;
}

bool ValidBridgeName(std::string_view name) {
  if (name.empty() || name.size() > 15) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '.' || c == '-';
  });
}

const std::string& DefaultBridge(v1::NetworkDatapath datapath, const NetworkDefaults& defaults) {
  return datapath == v1::NETWORK_DATAPATH_OVS ? defaults.ovs_bridge : defaults.bridge;
}

Datapath ResolveDatapath(const std::vector<Datapath>& rules, const NetworkDefaults& defaults) {
  for (const auto& r : rules) {
    if (r.datapath == v1::NETWORK_DATAPATH_UNSPECIFIED) continue;
    return {r.datapath, r.bridge.empty() ? DefaultBridge(r.datapath, defaults) : r.bridge};
  }
  return {defaults.datapath, DefaultBridge(defaults.datapath, defaults)};
}

v1::NodeNetworkDocument BuildDocument(const std::string& node_id, const std::string& subnet,
                                      const std::string& gateway, const Datapath& datapath,
                                      const NetworkDefaults& defaults,
                                      const std::vector<ReservedSlot>& slots) {
  v1::NodeNetworkDocument d;
  d.set_node_id(node_id);
  const Datapath path = ResolveDatapath({datapath}, defaults);
  d.set_datapath(path.datapath);
  d.set_bridge(path.bridge);
  d.set_subnet(subnet);
  d.set_gateway(gateway);
  d.mutable_nat()->set_masquerade(defaults.masquerade);
  d.mutable_nat()->set_ip_forward(defaults.ip_forward);
  d.mutable_isolation()->set_deny_cross_slice(defaults.deny_cross_slice);
  std::vector<const ReservedSlot*> order;
  order.reserve(slots.size());
  for (const auto& s : slots) order.push_back(&s);
  std::sort(order.begin(), order.end(), [](const ReservedSlot* a, const ReservedSlot* b) {
    const uint32_t x = IpOr0(a->ip), y = IpOr0(b->ip);
    return x != y ? x < y : a->slot_key < b->slot_key;
  });
  const auto primaries = PrimarySlots(slots);
  const auto names = Hostnames(slots);
  for (const auto* s : order) {
    auto* r = d.add_reservations();
    r->set_slot_key(s->slot_key);
    r->set_mac(s->mac);
    r->set_ip(s->ip);
    r->set_allocation_id(s->allocation_id);
    if (!s->allocation_id.empty() && primaries.count(s->slot_key)) {
      r->set_hostname(names.at(s->allocation_id));
    }
  }
  return d;
}

bool SameContent(v1::NodeNetworkDocument a, v1::NodeNetworkDocument b) {
  for (auto* d : {&a, &b}) {
    d->clear_version();
    d->clear_created_at();
  }
  return google::protobuf::util::MessageDifferencer::Equals(a, b);
}

// ---- Lease reports ----

Result<void> ValidateLeaseReport(const v1::LeaseReport& report) {
  std::map<std::string, std::string> problems;
  if (!ids::IsNodeId(report.node_id())) problems["node_id"] = "must be a lowercase DNS label";
  if (report.document_version() < 0) problems["document_version"] = "must be >= 0";
  for (int i = 0; i < report.observations_size(); ++i) {
    const auto& o = report.observations(i);
    const std::string at = fmt::format("observations[{}].", i);
    if (enums::Text(o.lease_state()).empty()) {
      problems[at + "lease_state"] = "one of " + enums::JoinTexts(v1::LeaseState_descriptor());
    }
    auto mac = ParseMac(o.mac());
    if (!mac || !IsUnicastMac(*mac)) problems[at + "mac"] = "not a unicast MAC: '" + o.mac() + "'";
    for (const auto& [name, v] :
         {std::pair<std::string, std::string>{"expected_ip", o.expected_ip()},
          {"actual_ip", o.actual_ip()}}) {
      if (!v.empty() && !ParseIpv4(v)) problems[at + name] = "not an IPv4 address: '" + v + "'";
    }
    if (o.slot_key().size() > 128) problems[at + "slot_key"] = "at most 128 characters";
  }
  for (int i = 0; i < report.vnic_drift_size(); ++i) {
    const auto& d = report.vnic_drift(i);
    const std::string at = fmt::format("vnic_drift[{}].", i);
    if (d.slot_key().empty() || d.slot_key().size() > 128) {
      problems[at + "slot_key"] = "1-128 characters";
    }
    const bool snake = !d.kind().empty() && d.kind().size() <= 64 &&
                       std::all_of(d.kind().begin(), d.kind().end(), [](char c) {
                         return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
                       });
    if (!snake) problems[at + "kind"] = "snake_case, 1-64 characters";
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kMalformedLeaseReport,
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  return Ok();
}

LeaseJudgement JudgeLeases(const std::vector<ReservedSlot>& slots, const v1::LeaseReport& report,
                           int64_t observed_at_ms, int64_t readiness_timeout_ms) {
  LeaseJudgement out;
  std::map<std::string, const v1::LeaseObservation*> by_slot;
  std::map<uint64_t, const v1::LeaseObservation*> by_mac;
  for (const auto& o : report.observations()) {
    if (!o.slot_key().empty()) by_slot.emplace(o.slot_key(), &o);
    if (auto m = ParseMac(o.mac())) by_mac.emplace(*m, &o);
  }
  std::map<uint64_t, const ReservedSlot*> reserved_mac;
  std::map<std::string, const ReservedSlot*> reserved_ip;
  for (const auto& s : slots) {
    if (auto m = ParseMac(s.mac)) reserved_mac[*m] = &s;
    reserved_ip[s.ip] = &s;
  }
  const auto primaries = PrimarySlots(slots);
  const auto at = google::protobuf::util::TimeUtil::MillisecondsToTimestamp(observed_at_ms);
  std::set<const v1::LeaseObservation*> matched;

  for (const auto& s : slots) {
    const v1::LeaseObservation* o = nullptr;
    if (auto it = by_slot.find(s.slot_key); it != by_slot.end()) o = it->second;
    const auto mac = ParseMac(s.mac);
    if (!o && mac) {
      if (auto it = by_mac.find(*mac); it != by_mac.end()) o = it->second;
    }
    if (o) matched.insert(o);
    const std::string actual = o ? o->actual_ip() : "";
    const auto agent_mac = o ? ParseMac(o->mac()) : mac;
    v1::LeaseState state = v1::LEASE_STATE_BOUND;
    if (actual.empty()) {
      state = v1::LEASE_STATE_MISSING;
    } else if (actual != s.ip || agent_mac != mac) {
      state = v1::LEASE_STATE_MISMATCH;
    }
    v1::StoredLease l;
    auto* obs = l.mutable_observation();
    obs->set_slot_key(s.slot_key);
    obs->set_mac(s.mac);
    obs->set_expected_ip(s.ip);
    obs->set_actual_ip(actual);
    obs->set_lease_state(state);
    if (o) obs->set_hostname(o->hostname());
    l.set_allocation_id(s.allocation_id);
    l.set_document_version(report.document_version());
    *l.mutable_observed_at() = at;
    out.leases[s.slot_key] = l;
    if (s.allocation_id.empty()) continue;
    Finding f{s.slot_key, s.slot_key, s.mac, "", "", s.ip, actual, s.allocation_id};
    if (state == v1::LEASE_STATE_MISMATCH) {
      f.kind = reason::kIpamLeaseMismatch.str();
      f.detail = agent_mac != mac
                     ? fmt::format("the node leases {} to MAC {} (reserved MAC {})", actual,
                                   o->mac(), s.mac)
                     : fmt::format("MAC {} has lease {} (reserved {})", s.mac, actual, s.ip);
    } else if (state == v1::LEASE_STATE_MISSING && primaries.count(s.slot_key) &&
               observed_at_ms - s.bound_at_ms >= readiness_timeout_ms) {
      f.kind = reason::kIpamLeaseMissing.str();
      f.detail = fmt::format("no DHCP lease for {} ({}) {}s after binding to allocation {}", s.mac,
                             s.ip, (observed_at_ms - s.bound_at_ms) / 1000, s.allocation_id);
    }
    if (!f.kind.empty()) out.drift[f.subject] = f;
  }

  for (const auto& o : report.observations()) {
    if (matched.count(&o) || o.actual_ip().empty()) continue;
    const auto m = ParseMac(o.mac());
    if (m && reserved_mac.count(*m)) continue;  // a reserved MAC under another slot key
    const std::string key = "mac:" + (m ? FormatMac(*m) : o.mac());
    v1::StoredLease l;
    auto* obs = l.mutable_observation();
    obs->set_mac(m ? FormatMac(*m) : o.mac());
    obs->set_actual_ip(o.actual_ip());
    obs->set_lease_state(v1::LEASE_STATE_UNEXPECTED);
    obs->set_hostname(o.hostname());
    l.set_document_version(report.document_version());
    *l.mutable_observed_at() = at;
    Finding f{key, "", obs->mac(), reason::kIpamLeaseUnexpected.str(), "", "", o.actual_ip(), ""};
    if (auto it = reserved_ip.find(o.actual_ip()); it != reserved_ip.end()) {
      // Someone holds a slot's reserved IP: that slot's drift, whatever else it has.
      const ReservedSlot& s = *it->second;
      f.subject = s.slot_key;
      f.slot_key = s.slot_key;
      f.expected_ip = s.ip;
      f.allocation_id = s.allocation_id;
      f.detail = fmt::format("unreserved MAC {} holds slot {}'s IP {} (reserved for {})",
                             obs->mac(), s.slot_key, s.ip, s.mac);
      obs->set_slot_key(s.slot_key);
      obs->set_expected_ip(s.ip);
      l.set_allocation_id(s.allocation_id);
    } else {
      f.detail = fmt::format("unreserved MAC {} holds a lease on {}", obs->mac(), o.actual_ip());
    }
    out.leases[key] = l;
    out.drift[f.subject] = f;
  }

  // The agent's vNIC drift of a bound slot: that slot's, unless its lease already drifted (one
  // finding per subject; the lease is what readiness and tenants see first).
  std::map<std::string, const ReservedSlot*> by_key;
  for (const auto& s : slots) by_key[s.slot_key] = &s;
  std::map<std::string, std::vector<std::string>> vnic;
  for (const auto& d : report.vnic_drift()) vnic[d.slot_key()].push_back(d.kind());
  for (const auto& [key, kinds] : vnic) {
    auto it = by_key.find(key);
    if (it == by_key.end() || it->second->allocation_id.empty() || out.drift.count(key)) continue;
    const ReservedSlot& s = *it->second;
    out.drift[key] =
        Finding{key,
                key,
                s.mac,
                reason::kIpamVnicDrift.str(),
                fmt::format("the node reports its vNIC drifted: {}", fmt::join(kinds, ", ")),
                s.ip,
                "",
                s.allocation_id};
  }
  return out;
}

// ---- Request fields ----

std::vector<std::string> SplitCsv(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    size_t comma = s.find(',', start);
    if (comma == std::string::npos) comma = s.size();
    std::string item = s.substr(start, comma - start);
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
    start = comma + 1;
  }
  return out;
}

Result<void> CheckNodeId(const std::string& id, Reason reason) {
  if (id.empty()) {
    return Error::InvalidArgument(reason, "node_id is required", {{"node_id", "required"}});
  }
  if (!ids::IsNodeId(id)) {
    return Error::InvalidArgument(reason, "node_id must be a lowercase DNS label: '" + id + "'",
                                  {{"node_id", "must be a lowercase DNS label"}});
  }
  return Ok();
}

Result<void> ValidateSlotKeys(const std::string& node_id, const std::string& slot_key,
                              Reason reason) {
  std::map<std::string, std::string> problems;
  if (!ids::IsNodeId(node_id)) problems["node_id"] = "must be a lowercase DNS label";
  if (slot_key.empty() || slot_key.size() > 128) problems["slot_key"] = "required, at most 128";
  if (!problems.empty()) return Error::InvalidArgument(reason, "invalid field(s)", problems);
  return Ok();
}

Result<void> ValidateReserveRequest(const v1::ReserveSlotAddressRequest& req) {
  if (auto v = ValidateSlotKeys(req.node_id(), req.slot_key(), reason::kInvalidReservationRequest);
      !v.ok()) {
    return v.error();
  }
  std::map<std::string, std::string> problems;
  if (!req.region().empty() && !ids::IsNodeId(req.region())) {
    problems["region"] = "must be a lowercase DNS label";
  }
  if (req.pool().size() > 63) problems["pool"] = "at most 63 characters";
  if (!req.pool().empty() && req.region().empty()) problems["region"] = "required with pool";
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidReservationRequest, "invalid field(s)", problems);
  }
  return Ok();
}

// ---- Subnet rules ----

namespace {

Error SubnetOverlap(const Cidr& subnet, const std::string& other, const std::string& where) {
  return Error::InvalidArgument(
      reason::kSubnetOverlap,
      fmt::format("management subnet {} overlaps {} ({}) within one node's scope",
                  subnet.ToString(), other, where),
      {{"subnet", subnet.ToString()}, {"overlaps", other}, {"source", where}});
}

// The scope a SetSubnetRequest names: node_id alone, region + pool, or region (INVALID_ARGUMENT
// invalid_scope otherwise, and for a bad region or pool).
Result<Scope> SubnetRuleScope(const v1::SetSubnetRequest& req) {
  Scope scope = Scope::kNode;
  if (!req.node_id().empty()) {
    if (!req.region().empty() || !req.pool().empty()) {
      return Error::InvalidArgument(reason::kInvalidScope,
                                    "a node rule names only node_id (not region or pool)",
                                    {{"scope", "node_id alone, region+pool, or region"}});
    }
    if (auto v = CheckNodeId(req.node_id(), reason::kInvalidScope); !v.ok()) return v.error();
    scope = Scope::kNode;
  } else if (!req.pool().empty()) {
    if (req.region().empty()) {
      return Error::InvalidArgument(reason::kInvalidScope, "a pool rule needs its region",
                                    {{"region", "required with pool"}});
    }
    scope = Scope::kPool;
  } else if (!req.region().empty()) {
    scope = Scope::kRegion;
  } else {
    return Error::InvalidArgument(reason::kInvalidScope, "name a region, a region+pool or a node",
                                  {{"scope", "node_id alone, region+pool, or region"}});
  }
  if (!req.region().empty() && !ids::IsNodeId(req.region())) {
    return Error::InvalidArgument(reason::kInvalidScope, "region must be a lowercase DNS label",
                                  {{"region", "must be a lowercase DNS label"}});
  }
  if (req.pool().size() > 63) {
    return Error::InvalidArgument(reason::kInvalidScope, "pool is at most 63 characters",
                                  {{"pool", "at most 63 characters"}});
  }
  return scope;
}

// A subnet rule's datapath and bridge: UNSPECIFIED or a declared value (INVALID_ARGUMENT
// datapath_invalid); a bridge only with a datapath, and a valid interface name (invalid_bridge).
Result<Datapath> ValidateRuleDatapath(const v1::SetSubnetRequest& req) {
  if (req.datapath() != v1::NETWORK_DATAPATH_UNSPECIFIED && enums::Text(req.datapath()).empty()) {
    // What enums::InvalidValue("datapath", ...) answers, from the registry.
    const std::string valid = enums::JoinTexts(v1::NetworkDatapath_descriptor());
    return Error::InvalidArgument(
        reason::kDatapathInvalid,
        fmt::format("datapath '{}' is not one of: {}", static_cast<int>(req.datapath()), valid),
        {{"datapath", "one of " + valid}});
  }
  if (!req.bridge().empty() && !ValidBridgeName(req.bridge())) {
    return Error::InvalidArgument(reason::kInvalidBridge,
                                  "bridge must be 1-15 of [A-Za-z0-9_.-]: '" + req.bridge() + "'",
                                  {{"bridge", "1-15 of [A-Za-z0-9_.-]"}});
  }
  // A bridge name means something only for a datapath: inheriting the datapath but not the
  // bridge could pair an OVS bridge name with a Linux bridge.
  if (!req.bridge().empty() && req.datapath() == v1::NETWORK_DATAPATH_UNSPECIFIED) {
    return Error::InvalidArgument(reason::kInvalidBridge, "a bridge is set only with its datapath",
                                  {{"bridge", "requires datapath"}});
  }
  return Datapath{req.datapath(), req.bridge()};
}

}  // namespace

std::vector<RuleScope> ApplicableRules(const std::string& node_id, const std::string& region,
                                       const std::string& pool) {
  std::vector<RuleScope> out{{Scope::kNode, "", "", node_id}};
  if (!region.empty() && !pool.empty()) out.push_back({Scope::kPool, region, pool, ""});
  if (!region.empty()) out.push_back({Scope::kRegion, region, "", ""});
  return out;
}

std::vector<BroaderRule> BroaderRules(Scope scope, const std::string& region,
                                      const std::string& pool) {
  std::vector<BroaderRule> out;
  if (scope != Scope::kRegion && !region.empty()) {
    out.push_back({{Scope::kRegion, region, "", ""}, "region " + region});
  }
  if (scope == Scope::kNode && !region.empty() && !pool.empty()) {
    out.push_back({{Scope::kPool, region, pool, ""}, fmt::format("pool {}/{}", region, pool)});
  }
  return out;
}

Result<SubnetRuleSpec> ParseSubnetRule(const v1::SetSubnetRequest& req) {
  auto scope = SubnetRuleScope(req);
  if (!scope.ok()) return scope.error();
  auto subnet = ParseCidr(req.subnet(), "subnet");
  if (!subnet.ok()) return subnet.error();
  auto gw = ResolveGateway(*subnet, req.gateway());
  if (!gw.ok()) return gw.error();
  auto path = ValidateRuleDatapath(req);
  if (!path.ok()) return path.error();
  SubnetRuleSpec spec{{*scope, req.region(), req.pool(), req.node_id()},  *subnet, *gw, *path,
                      {req.host_cidrs().begin(), req.host_cidrs().end()}, {}};
  for (int i = 0; i < req.host_cidrs_size(); ++i) {
    auto h = ParseCidr(req.host_cidrs(i), fmt::format("host_cidrs[{}]", i), 1, 32);
    if (!h.ok()) return h.error();
    spec.own_hosts.push_back(*h);
  }
  return spec;
}

Result<void> CheckSubnetCapacity(const AddressPlan& plan, int64_t required) {
  const int64_t capacity = SlotCapacity(plan);
  if (capacity >= required) return Ok();
  return Error::InvalidArgument(
      reason::kSubnetTooSmall,
      fmt::format("{} offers {} slot addresses (offsets {}..{}, less network, gateway "
                  "and broadcast); a node needs {}",
                  plan.subnet.ToString(), capacity, plan.first_host, plan.last_host, required),
      {{"subnet", plan.subnet.ToString()},
       {"capacity", std::to_string(capacity)},
       {"required", std::to_string(required)}});
}

Result<void> CheckHostOverlap(const Cidr& subnet, const std::vector<HostNetwork>& hosts) {
  for (const auto& [cidr, where] : hosts) {
    auto c = ParseCidr(cidr, "host_cidrs", 0, 32);
    if (c.ok() && Overlaps(subnet, *c)) return SubnetOverlap(subnet, cidr, where);
  }
  return Ok();
}

Result<void> CheckNarrowerOverlap(const std::vector<Cidr>& own_hosts,
                                  const std::vector<HostNetwork>& narrower) {
  for (const auto& n : narrower) {
    auto c = ParseCidr(n.cidr, "subnet", 0, 32);
    for (const auto& own : own_hosts) {
      if (c.ok() && Overlaps(*c, own)) {
        return SubnetOverlap(*c, own.ToString(), "host_cidrs of this rule; subnet of " + n.where);
      }
    }
  }
  return Ok();
}

Result<void> CheckReservationsFit(const AddressPlan& plan, const std::string& node_id,
                                  const std::vector<SlotAddress>& reservations) {
  for (const auto& r : reservations) {
    auto ip = ParseIpv4(r.ip);
    if (!ip || !IsSlotAddress(plan, *ip)) {
      return Error::Of(Code::kFailedPrecondition, reason::kSubnetInUse,
                       fmt::format("slot {} holds {}, which is not a slot address of {}; "
                                   "release its reservation first",
                                   r.slot_key, r.ip, plan.subnet.ToString()),
                       {{"node_id", node_id}, {"slot_key", r.slot_key}, {"ip", r.ip}});
    }
  }
  return Ok();
}

bool NodeRuleMovesDatapath(const std::optional<Datapath>& before, const Datapath& now) {
  const bool chose = before && before->datapath != v1::NETWORK_DATAPATH_UNSPECIFIED;
  return now.datapath != v1::NETWORK_DATAPATH_UNSPECIFIED || chose;
}

AddressPlan PlanOf(const std::string& subnet, const std::string& gateway, int64_t first_host,
                   int64_t last_host) {
  AddressPlan p;
  auto c = ParseCidr(subnet, "subnet", 0, 32);
  if (c.ok()) p.subnet = *c;
  p.gateway = ParseIpv4(gateway).value_or(0);
  p.first_host = first_host;
  p.last_host = last_host;
  return p;
}

NodeRowChange ChangeAtReserve(const NodeRow& current, const NodeRow& wanted,
                              bool has_reservations) {
  const bool moved =
      !wanted.region.empty() && (current.region != wanted.region || current.pool != wanted.pool);
  if (!has_reservations && (current.subnet != wanted.subnet || current.gateway != wanted.gateway ||
                            moved || current.datapath != wanted.datapath)) {
    return NodeRowChange::kApplyRules;
  }
  return moved ? NodeRowChange::kMoveScope : NodeRowChange::kNone;
}

}  // namespace gpuaas::ipam
