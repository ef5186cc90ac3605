#include "gpuaas/node_agent/discovery/parity.hpp"

namespace gpuaas::node_agent {

std::string EscapeParity(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case ' ':
        out += "\\ ";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        out += c;
    }
  }
  return out;
}

const char* ParityStatus(v1::CheckStatus status) {
  switch (status) {
    case v1::CHECK_STATUS_PASS:
      return "PASS";
    case v1::CHECK_STATUS_FAIL:
      return "FAIL";
    default:
      return "WARN";
  }
}

std::string FormatParity(const std::vector<v1::Check>& checks) {
  std::string out;
  int failures = 0, warnings = 0;
  for (const auto& c : checks) {
    std::string status = ParityStatus(c.status());
    if (status == "FAIL") ++failures;
    if (status == "WARN") ++warnings;
    out += "GPUAAS_SLICE_PARITY status=" + status + " check=" + EscapeParity(c.name()) +
           " detail=" + EscapeParity(c.detail());
    if (!c.remediation().empty()) out += " remediation=" + EscapeParity(c.remediation());
    out += '\n';
  }
  out += "GPUAAS_SLICE_PARITY summary checks=" + std::to_string(checks.size()) +
         " failures=" + std::to_string(failures) + " warnings=" + std::to_string(warnings) + "\n";
  return out;
}

int ParityExitCode(const std::vector<v1::Check>& checks) {
  for (const auto& c : checks) {
    if (c.status() == v1::CHECK_STATUS_FAIL) return 1;
  }
  return 0;
}

}  // namespace gpuaas::node_agent
