#pragma once
// Root only: a loop device stands in for a fixture host's slot NVMe. The fixture's device node
// behind `by_id` (a regular file) is replaced by a block node with the loop device's numbers,
// so the runtime's kernel-level disk checks, qemu and the wipe all act on a real block device.
// Shared by the real-VM e2e test and the node-agent benchmark.
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "gpuaas/node_agent/host/host.hpp"

namespace gpuaas::node_agent::testing {

class LoopDisk {
 public:
  ~LoopDisk() { Detach(); }
  // A `size` backing file at `backing`, attached to a free loop device, whose numbers replace
  // the fixture node of `by_id` under `host_root`. "" on success, else why not. `direct_io`:
  // the loop device reads and writes its backing file with O_DIRECT, so a write reaches the
  // machine's disk as on a real NVMe instead of ending in the page cache (benchmarks); whether
  // the kernel agreed is DirectIo().
  std::string Attach(const std::string& host_root, const std::string& by_id,
                     const std::string& backing, const std::string& size = "64M",
                     bool direct_io = false) {
    namespace fs = std::filesystem;
    const HostRoot h(host_root);
    auto logical = h.Resolve(by_id);
    if (!logical) return by_id + " does not resolve under " + host_root;
    node_ = h.Real(*logical);
    std::error_code ec;
    fs::remove(backing, ec);
    auto t = RunTool({Find("truncate"), "-s", size, backing});
    if (!t.ok() || t->exit_code != 0) return "truncate failed";
    std::vector<std::string> argv = {Find("losetup"), "-f", "--show"};
    if (direct_io) argv.push_back("--direct-io=on");
    argv.push_back(backing);
    auto l = RunTool(argv, std::chrono::seconds(30));
    if (!l.ok() || l->exit_code != 0) return "losetup failed: " + (l.ok() ? l->err : "");
    loop_ = Trim(l->out);
    struct stat st {};
    if (::stat(loop_.c_str(), &st) != 0) return loop_ + ": " + std::strerror(errno);
    fs::remove(node_, ec);
    if (::mknod(node_.c_str(), S_IFBLK | 0600, st.st_rdev) != 0) {
      return "mknod " + node_ + ": " + std::strerror(errno);
    }
    return "";
  }
  void Detach() {
    if (loop_.empty()) return;
    (void)RunTool({Find("losetup"), "-d", loop_}, std::chrono::seconds(30));
    loop_.clear();
  }
  // The kernel's word on whether the device does direct I/O on its backing file now.
  bool DirectIo() const {
    if (loop_.empty()) return false;
    std::ifstream f("/sys/block/" + loop_.substr(loop_.rfind('/') + 1) + "/loop/dio");
    std::string v;
    return std::getline(f, v) && Trim(v) == "1";
  }
  const std::string& loop() const { return loop_; }  // /dev/loopN
  const std::string& node() const { return node_; }  // the fixture's node, now a block node

 private:
  static std::string Find(const std::string& name) {
    return HostRoot("/").FindCommand(name).value_or(name);
  }
  std::string loop_, node_;
};

}  // namespace gpuaas::node_agent::testing
