#pragma once
// The node-agent's narrow view of a host: file reads under a root path ("/" on a real host, a
// fixture tree in tests) and a bounded tool runner. Symlinks are resolved component by component
// inside the root, so a relative sysfs link (../../../devices/pci0000:15/...) and an absolute one
// both land inside the root and never escape it. Missing files are normal and come back as
// nullopt/empty; nothing here throws.
#include <chrono>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::node_agent {

// What Stat reports: type, permission bits and numeric owner (names come from the root's own
// /etc/passwd and /etc/group, not this process's).
struct FileStat {
  bool char_device = false;
  bool regular = false;
  unsigned mode = 0;  // permission bits only (0660)
  unsigned uid = 0;
  unsigned gid = 0;
};

class HostRoot {
 public:
  explicit HostRoot(std::string root = "/");

  // The root, normalised: "/" or an absolute path without a trailing slash (a relative root
  // is made absolute against the working directory).
  const std::string& root() const { return display_; }

  // `logical` is an absolute path as seen on the host ("/sys/bus/pci/devices/0000:18:00.0").
  // Returns the logical path with every symlink resolved inside the root. Components that do
  // not exist are kept lexically. nullopt only on a symlink loop (more than 40 links).
  std::optional<std::string> Resolve(std::string_view logical) const;
  // Host filesystem path for a logical path (no resolution).
  std::string Real(std::string_view logical) const;

  bool Exists(std::string_view logical) const;
  bool IsDir(std::string_view logical) const;
  bool IsSymlink(std::string_view logical) const;  // the last component itself is a link
  // stat(2) of what `logical` resolves to; nullopt when missing.
  std::optional<FileStat> Stat(std::string_view logical) const;
  // Whole file (capped at 4 MiB); nullopt when missing or unreadable.
  std::optional<std::string> ReadFile(std::string_view logical) const;
  // At most `n` bytes from the start of a regular file or block device (a disk's first sectors
  // for signature checks). Character devices, FIFOs and sockets are refused (nullopt), so a
  // stray path can never block the agent.
  std::optional<std::string> ReadPrefix(std::string_view logical, size_t n) const;
  // First line, surrounding whitespace trimmed.
  std::optional<std::string> ReadLine(std::string_view logical) const;
  // ReadLine parsed as a decimal integer; nullopt when missing or not a number.
  std::optional<long long> ReadInt(std::string_view logical) const;
  // Names in a directory, sorted; empty when missing.
  std::vector<std::string> ListDir(std::string_view logical) const;
  // Basename of where a symlink points after resolution ("iommu_group" -> "12",
  // "driver" -> "vfio-pci"); nullopt when `logical` is not a symlink.
  std::optional<std::string> LinkBasename(std::string_view logical) const;
  // Real path of the first candidate that is an executable regular file inside the root.
  std::optional<std::string> FindTool(const std::vector<std::string>& logical_candidates) const;
  // FindTool over the standard command directories: /usr/sbin, /usr/bin, /sbin, /bin.
  std::optional<std::string> FindCommand(const std::string& name) const;

 private:
  std::string root_;     // without trailing slash; "" for "/"
  std::string display_;  // "/" or root_
};

struct ToolResult {
  int exit_code = -1;  // -1 when killed by a signal
  bool timed_out = false;
  std::string out;
  std::string err;
};

// fork/exec of argv[0] (an absolute path, no shell, no PATH lookup) with stdin from /dev/null,
// a fixed environment (LC_ALL=C, a standard PATH) and its own process group. Output is captured
// (1 MiB cap per stream; the rest is read and dropped so the tool never blocks on a full pipe).
// On timeout the tool's whole process group is killed. Errors only when the tool could not be
// started (the error carries exec's errno text).
Result<ToolResult> RunTool(const std::vector<std::string>& argv,
                           std::chrono::milliseconds timeout = std::chrono::seconds(5));

// Small string helpers shared by discovery code.
std::string Trim(std::string_view s);
std::string Lower(std::string s);  // ASCII lowercase
std::vector<std::string> SplitWs(std::string_view s);
std::vector<std::string> SplitLines(std::string_view s);
std::string Basename(std::string_view path);
bool StartsWith(std::string_view s, std::string_view prefix);
// "0000:18:00.0" (a domain of 4 or more hex digits, as on VMD hosts).
bool LooksLikePciAddress(std::string_view s);
std::optional<long long> ParseInt(std::string_view s);

}  // namespace gpuaas::node_agent
