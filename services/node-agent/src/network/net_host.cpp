#include "network/net_host.hpp"

#include <sys/stat.h>

#include <algorithm>
#include <cctype>

#include <fmt/format.h>
#include "gpuaas/node_agent/node_agent_reasons.hpp"

namespace gpuaas::node_agent {
namespace {

bool IsNameOf(const std::string& s, size_t max) {
  if (s.empty() || s.size() > max || s == "." || s == "..") return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '.' || c == '-';
  });
}

}  // namespace

bool IsIfName(const std::string& s) { return IsNameOf(s, 15); }

bool IsNetnsName(const std::string& s) { return IsNameOf(s, 64); }

std::string Join(const std::vector<std::string>& v, const char* sep) {
  std::string out;
  for (const auto& s : v) {
    if (!out.empty()) out += sep;
    out += s;
  }
  return out;
}

Result<void> NetHost::Preflight() const {
  if (!ctx_.netns.empty() && !ctx_.run) {
    struct stat st {};
    if (::stat(("/run/netns/" + ctx_.netns).c_str(), &st) != 0) {
      return Error::FailedPrecondition(reason::kNetnsNotFound,
                                       "network namespace " + ctx_.netns + " does not exist");
    }
  }
  return Ok();
}

Result<std::string> NetHost::Tool(const std::string& name) const {
  auto it = cache_.find(name);
  if (it != cache_.end()) return it->second;
  auto found = HostRoot("/").FindCommand(name);
  if (!found) {
    if (ctx_.run) return "/usr/sbin/" + name;
    Error e = Error::FailedPrecondition(reason::kToolMissing, name + " is not installed");
    e.details["tool"] = name;
    return e;
  }
  cache_[name] = *found;
  return *found;
}

Result<ToolResult> NetHost::Run(const std::string& tool,
                                const std::vector<std::string>& args) const {
  auto path = Tool(tool);
  if (!path.ok()) return path.error();
  std::vector<std::string> argv;
  if (!ctx_.netns.empty()) {
    auto ip = Tool("ip");
    if (!ip.ok()) return ip.error();
    argv = {*ip, "netns", "exec", ctx_.netns};
  }
  argv.push_back(*path);
  argv.insert(argv.end(), args.begin(), args.end());
  auto r = ctx_.run ? ctx_.run(argv, ctx_.tool_timeout) : RunTool(argv, ctx_.tool_timeout);
  if (!r.ok()) return r;
  if (r->timed_out) {
    Error e = Error::Unavailable(reason::kHostCommandTimeout, Join(argv, " ") + " timed out");
    e.details["command"] = Join(argv, " ");
    return e;
  }
  return r;
}

Result<ToolResult> NetHost::Must(const std::string& tool,
                                 const std::vector<std::string>& args) const {
  auto r = Run(tool, args);
  if (!r.ok() || r->exit_code == 0) return r;
  return Failed(fmt::format("{} {}", tool, Join(args, " ")), *r);
}

Error NetHost::Failed(const std::string& what, const ToolResult& r) {
  Error e = Error::Internal(reason::kHostCommandFailed,
                            fmt::format("{} exited {}: {}", what, r.exit_code, Trim(r.err)));
  e.details["command"] = what;
  e.details["exit_code"] = std::to_string(r.exit_code);
  e.details["stderr"] = Trim(r.err);
  return e;
}

}  // namespace gpuaas::node_agent
