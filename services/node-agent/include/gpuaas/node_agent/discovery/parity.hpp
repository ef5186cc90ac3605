#pragma once
// Slice host parity lines: the machine-readable output that bootstrap scripts and operators
// grep after every deploy or reimage (see the node bootstrap runbook).
//
//   GPUAAS_SLICE_PARITY status=PASS check=kvm detail=/dev/kvm\ present
//   GPUAAS_SLICE_PARITY summary checks=12 failures=0 warnings=1
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::node_agent {

// Backslash -> "\\", space -> "\ ", newline -> "\n", tab -> "\t", carriage return -> "\r",
// so every value is one whitespace-free token.
std::string EscapeParity(std::string_view s);
// "PASS", "WARN" or "FAIL" (an unspecified status counts as WARN).
const char* ParityStatus(v1::CheckStatus status);
// One line per check (remediation only when non-empty), then the summary line; every line ends
// with '\n'.
std::string FormatParity(const std::vector<v1::Check>& checks);
// 1 when any check failed, else 0.
int ParityExitCode(const std::vector<v1::Check>& checks);

}  // namespace gpuaas::node_agent
