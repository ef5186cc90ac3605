#pragma once
// Host commands for the node's network appliers (net_apply: bridge, iptables, dnsmasq;
// exposure_apply: nftables, conntrack). One way to find a tool, run it inside the context's
// network namespace (`ip netns exec <netns> ...`) or through its test seam, and turn a timeout or
// a non-zero exit into an error value.
#include <map>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/network/net_apply.hpp"

namespace gpuaas::node_agent {

// Interface names as the kernel takes them (IFNAMSIZ-1), restricted to a safe alphabet.
bool IsIfName(const std::string& s);
// Names `ip netns` accepts and that stay one path element under /run/netns.
bool IsNetnsName(const std::string& s);

std::string Join(const std::vector<std::string>& v, const char* sep = ",");

class NetHost {
 public:
  explicit NetHost(const NetContext& ctx) : ctx_(ctx) {}

  // Refuses a namespace that does not exist (ip netns exec would fail on every command).
  Result<void> Preflight() const;

  // The tool's path; FAILED_PRECONDITION tool_missing when it is not installed (under the test
  // seam a missing tool is assumed to be in /usr/sbin).
  Result<std::string> Tool(const std::string& name) const;
  bool Has(const std::string& name) const { return Tool(name).ok(); }

  // Runs `tool args...` in the context's namespace. A timeout is UNAVAILABLE
  // host_command_timeout; any exit code is returned to the caller.
  Result<ToolResult> Run(const std::string& tool, const std::vector<std::string>& args) const;

  // Run and insist on exit 0 (else Failed, naming `tool args...`).
  Result<ToolResult> Must(const std::string& tool, const std::vector<std::string>& args) const;

  // INTERNAL host_command_failed for `what` (the command as it should be reported).
  static Error Failed(const std::string& what, const ToolResult& r);

 private:
  const NetContext& ctx_;
  mutable std::map<std::string, std::string> cache_;
};

}  // namespace gpuaas::node_agent
