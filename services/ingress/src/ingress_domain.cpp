#include "ingress_domain.hpp"

#include <map>
#include <set>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "ingress_reasons.hpp"

namespace gpuaas::ingress {

bool IsLabel(std::string_view s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

std::optional<uint32_t> ParseIpv4(std::string_view s) {
  uint32_t out = 0;
  int parts = 0;
  size_t i = 0;
  while (parts < 4) {
    if (i >= s.size() || s[i] < '0' || s[i] > '9') return std::nullopt;
    const size_t start = i;
    uint32_t v = 0;
    while (i < s.size() && s[i] >= '0' && s[i] <= '9') {
      v = v * 10 + static_cast<uint32_t>(s[i] - '0');
      if (v > 255 || i - start >= 3) return std::nullopt;
      ++i;
    }
    if (i - start > 1 && s[start] == '0') return std::nullopt;
    out = (out << 8) | v;
    ++parts;
    if (parts < 4) {
      if (i >= s.size() || s[i] != '.') return std::nullopt;
      ++i;
    }
  }
  if (i != s.size()) return std::nullopt;
  return out;
}

Result<void> ValidatePool(const v1::EndpointPool& p) {
  if (p.kind() == v1::ENDPOINT_POOL_KIND_DNS_NAME || p.kind() == v1::ENDPOINT_POOL_KIND_OVERLAY) {
    Error e = Error::FailedPrecondition(
        reason::kPoolKindNotSupported,
        fmt::format("{} pools are reserved in the contract but not handed out yet; use port_range "
                    "or public_ip",
                    enums::Text(p.kind())));
    e.details = {{"kind", enums::Text(p.kind())}};
    return e;
  }
  std::map<std::string, std::string> problems;
  if (!IsLabel(p.name())) problems["name"] = "a lowercase DNS label (1-63 of [a-z0-9-])";
  if (p.region().empty() || p.region().size() > 64) problems["region"] = "required";
  std::set<std::string> seen;
  for (int i = 0; i < p.addresses_size(); ++i) {
    const auto& a = p.addresses(i);
    if (!ParseIpv4(a)) {
      problems[fmt::format("addresses[{}]", i)] = "an IPv4 address";
    } else if (!seen.insert(a).second) {
      problems[fmt::format("addresses[{}]", i)] = "listed twice";
    }
  }
  switch (p.kind()) {
    case v1::ENDPOINT_POOL_KIND_PORT_RANGE:
      if (!ids::IsNodeId(p.node_id())) problems["node_id"] = "the node whose address it is";
      if (p.addresses_size() != 1) problems["addresses"] = "exactly one address (the node's)";
      if (p.port_min() < 1024 || p.port_min() > 65535) problems["port_min"] = "1024..65535";
      if (p.port_max() < p.port_min() || p.port_max() > 65535) {
        problems["port_max"] = "port_min..65535";
      }
      break;
    case v1::ENDPOINT_POOL_KIND_PUBLIC_IP:
      if (!p.node_id().empty()) problems["node_id"] = "empty: a public_ip pool serves a region";
      if (p.addresses_size() < 1 || p.addresses_size() > 4096) problems["addresses"] = "1..4096";
      if (p.port_min() != 0 || p.port_max() != 0) {
        problems["port_min"] = "0: endpoints keep their own ports";
      }
      break;
    default:
      problems["kind"] = "port_range or public_ip";
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidPool,
                                  fmt::format("{} problem(s) with pool {}", problems.size(),
                                              p.name().empty() ? "\"\"" : p.name()),
                                  problems);
  }
  return Ok();
}

int64_t PoolCapacity(const v1::EndpointPool& p) {
  if (p.kind() == v1::ENDPOINT_POOL_KIND_PORT_RANGE) {
    return p.port_max() >= p.port_min() ? int64_t{p.port_max()} - p.port_min() + 1 : 0;
  }
  return p.addresses_size();
}

Result<void> ValidateEndpoint(const std::string& name, v1::TransportProtocol protocol,
                              int32_t port) {
  std::map<std::string, std::string> problems;
  if (!IsLabel(name)) problems["name"] = "a lowercase DNS label (1-63 of [a-z0-9-])";
  if (protocol != v1::TRANSPORT_PROTOCOL_TCP && protocol != v1::TRANSPORT_PROTOCOL_UDP) {
    problems["protocol"] = "tcp or udp";
  }
  if (port < 1 || port > 65535) problems["port"] = "1..65535";
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidEndpoint, "the endpoint is not valid", problems);
  }
  return Ok();
}

std::string ConnectHint(const v1::Exposure& e, const std::string& ssh_user) {
  if (e.public_ip().empty() || e.public_port() == 0) return "";
  if (e.protocol() == v1::TRANSPORT_PROTOCOL_TCP && e.target_port() == 22) {
    return fmt::format("ssh -p {} {}@{}", e.public_port(), ssh_user, e.public_ip());
  }
  return fmt::format("{}:{}/{}", e.public_ip(), e.public_port(), enums::Text(e.protocol()));
}

}  // namespace gpuaas::ingress
