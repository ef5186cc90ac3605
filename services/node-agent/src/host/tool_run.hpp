#pragma once
// Host tools for the VM runtime's stages (qemu-img, genisoimage, wipefs, blkdiscard, ...), run
// with RunTool (host.hpp: absolute argv[0], no shell, stdin /dev/null, a fixed environment, its
// own process group killed on timeout), their failures as stage errors.
#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/host/host.hpp"

namespace gpuaas::node_agent {

// The first line of `s`, trimmed.
std::string FirstLine(const std::string& s);

// A tool ran and said no: `reason` in `stage`, the message with its stderr (DeadlineExceeded when
// it timed out), details tool and exit_code added to `det`.
Error ToolFailed(const std::string& stage, Reason reason, const std::string& tool,
                 const ToolResult& r, std::map<std::string, std::string> det = {});

// `name` looked up in the real root `root` (tools never come from a fixture tree);
// tool_missing (FailedPrecondition, stage `stage`) when it is not installed.
Result<std::string> FindToolIn(const std::string& root, const std::string& name,
                               const std::string& stage);

// Runs the tool and insists on exit 0 (else ToolFailed with `reason`).
Result<ToolResult> RunOk(const std::vector<std::string>& argv, std::chrono::milliseconds timeout,
                         const std::string& stage, Reason reason,
                         std::map<std::string, std::string> det = {});

}  // namespace gpuaas::node_agent
