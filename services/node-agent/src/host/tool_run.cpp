#include "host/tool_run.hpp"

#include <fmt/format.h>

#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"

namespace gpuaas::node_agent {

using std::chrono::milliseconds;

std::string FirstLine(const std::string& s) {
  auto t = Trim(s);
  auto nl = t.find('\n');
  return nl == std::string::npos ? t : t.substr(0, nl);
}

Error ToolFailed(const std::string& stage, Reason reason, const std::string& tool,
                 const ToolResult& r, std::map<std::string, std::string> det) {
  det["tool"] = tool;
  det["exit_code"] = std::to_string(r.exit_code);
  std::string why = r.timed_out ? "timed out" : FirstLine(r.err.empty() ? r.out : r.err);
  return StageError(r.timed_out ? Code::kDeadlineExceeded : Code::kInternal, reason,
                    fmt::format("{} failed: {}", Basename(tool), why), stage, std::move(det));
}

Result<std::string> FindToolIn(const std::string& root, const std::string& name,
                               const std::string& stage) {
  HostRoot r(root);
  if (auto t = r.FindCommand(name)) return *t;
  return StageError(Code::kFailedPrecondition, reason::kToolMissing,
                    name + " is not installed on this host", stage, {{"tool", name}});
}

Result<ToolResult> RunOk(const std::vector<std::string>& argv, milliseconds timeout,
                         const std::string& stage, Reason reason,
                         std::map<std::string, std::string> det) {
  auto r = RunTool(argv, timeout);
  if (!r.ok()) return WithStage(r.error(), stage);
  if (r->exit_code != 0 || r->timed_out) {
    return ToolFailed(stage, reason, argv[0], *r, std::move(det));
  }
  return r;
}

}  // namespace gpuaas::node_agent
