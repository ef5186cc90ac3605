#pragma once
// ingress's pure rules: what a valid pool and endpoint are, how many endpoints a pool offers, and
// how a user reaches an exposure. No I/O.
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ingress {

// A lowercase RFC 1123 label of 1-63 characters.
bool IsLabel(std::string_view s);
// A dotted-quad IPv4 address (no leading zeros, no CIDR).
std::optional<uint32_t> ParseIpv4(std::string_view s);

// FAILED_PRECONDITION pool_kind_not_supported for the reserved kinds (dns_name, overlay), else
// INVALID_ARGUMENT invalid_pool with every bad field in details: name a label; kind set; region
// non-empty; PORT_RANGE: a valid node id, exactly one address, 1024 <= port_min <= port_max <=
// 65535; PUBLIC_IP: node_id empty, 1..4096 distinct addresses, no ports.
Result<void> ValidatePool(const v1::EndpointPool& pool);

// Endpoints the pool can hand out: ports (PORT_RANGE) or addresses (PUBLIC_IP).
int64_t PoolCapacity(const v1::EndpointPool& pool);

// INVALID_ARGUMENT invalid_endpoint (details: name, protocol, port) for one endpoint request.
Result<void> ValidateEndpoint(const std::string& name, v1::TransportProtocol protocol,
                              int32_t port);

// How a client reaches an exposure: "ssh -p <port> <user>@<ip>" for TCP port 22, else
// "<ip>:<port>/<protocol>"; "" until it has a public endpoint.
std::string ConnectHint(const v1::Exposure& e, const std::string& ssh_user);

}  // namespace gpuaas::ingress
