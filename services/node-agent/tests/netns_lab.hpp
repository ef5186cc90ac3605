#pragma once
// A small lab of network namespaces for tests that need real networking (root): a "host"
// namespace the node-agent's network is applied in, and "VMs" — namespaces whose eth0 (with a
// slot's MAC) is a veth to a port on the host's bridge — with a busybox DHCP client and ping.
// Everything it creates is deleted on destruction; traffic never leaves this machine.
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/node_agent/host/host.hpp"

namespace gpuaas::node_agent::testing {

// A fresh directory under /tmp, removed with everything in it on destruction. 0755: dnsmasq
// drops root before it reads the hosts file (and ipam's network) under it.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix = "gpuaas-net") {
    std::string tmpl = fmt::format("/tmp/{}-XXXXXX", prefix);
    path_ = ::mkdtemp(tmpl.data());
    ::chmod(path_.c_str(), 0755);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

class NetnsLab {
 public:
  NetnsLab() = default;
  NetnsLab(const NetnsLab&) = delete;
  NetnsLab& operator=(const NetnsLab&) = delete;
  ~NetnsLab() {
    for (const char* daemon : {"ovs-vswitchd", "ovsdb-server"}) {
      if (ovs_rundir_.empty()) break;
      std::ifstream f(ovs_rundir_ + "/" + daemon + ".pid");
      int pid = 0;
      if (f >> pid && pid > 1) {
        ::kill(pid, SIGTERM);
        // Exited once it is gone or a zombie (a daemon's parent here does not reap it).
        auto running = [pid] {
          std::ifstream stat(fmt::format("/proc/{}/stat", pid));
          std::string line;
          std::getline(stat, line);
          const size_t rp = line.rfind(')');
          return rp != std::string::npos && rp + 2 < line.size() && line[rp + 2] != 'Z';
        };
        for (int i = 0; i < 300 && running(); ++i) {
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        }
      }
    }
    for (auto it = namespaces_.rbegin(); it != namespaces_.rend(); ++it) {
      (void)RunTool({Tool("ip"), "netns", "del", *it}, std::chrono::seconds(10));
    }
  }

  // "" when the lab can run here; otherwise why not (not root, a tool missing, no netns).
  std::string Open(const std::string& tag) {
    if (::geteuid() != 0) return "needs root (network namespaces, iptables, dnsmasq)";
    for (const char* tool : {"ip", "iptables", "bridge", "sysctl", "dnsmasq", "busybox"}) {
      auto path =
          HostRoot("/").FindTool({std::string("/usr/sbin/") + tool, std::string("/usr/bin/") + tool,
                                  std::string("/sbin/") + tool, std::string("/bin/") + tool});
      if (!path) return std::string(tool) + " is not installed (scripts/install-deps)";
      tools_[tool] = *path;
    }
    auto applets = RunTool({tools_["busybox"], "--list"});
    if (!applets.ok() || applets->out.find("udhcpc\n") == std::string::npos ||
        applets->out.find("ping\n") == std::string::npos) {
      return "busybox has no udhcpc/ping applet (the DHCP client these tests use)";
    }
    prefix_ = fmt::format("gpuaas-{}{}", tag, ::getpid());
    host_ = prefix_ + "-host";
    auto made = Run({"ip", "netns", "add", host_});
    if (made.exit_code != 0) return "cannot create a network namespace here: " + made.err;
    namespaces_.push_back(host_);
    Run({"ip", "-n", host_, "link", "set", "lo", "up"});
    return "";
  }
  const std::string& host() const { return host_; }

  // Open vSwitch for the host namespace, userspace datapath (no kernel module): ovsdb-server and
  // ovs-vswitchd with their database, sockets and logs in `rundir` (so nothing of the machine's
  // own OVS, if any, is used), stopped by PID on destruction. "" when it runs; else why not.
  // After it, AddVm plugs VMs in as OVS ports the way libvirt does (external_ids:attached-mac).
  std::string StartOvs(const std::string& rundir) {
    if (auto why = Need({"ovsdb-tool", "ovsdb-server", "ovs-vswitchd", "ovs-vsctl", "ovs-ofctl"});
        !why.empty()) {
      return why;
    }
    const std::string schema = "/usr/share/openvswitch/vswitch.ovsschema";
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"ovsdb-tool", "create", rundir + "/conf.db", schema},
             {"env", "OVS_RUNDIR=" + rundir, "ovsdb-server", rundir + "/conf.db",
              "--remote=punix:" + rundir + "/db.sock", "--pidfile=" + rundir + "/ovsdb-server.pid",
              "--detach", "--log-file=" + rundir + "/ovsdb-server.log"}}) {
      auto r = args[0] == "env" ? InNs(host_, args) : Run(args);
      if (r.exit_code != 0) return fmt::format("{} failed: {}", args[0], r.err);
    }
    ovs_rundir_ = rundir;
    if (auto r = Vsctl({"--no-wait", "init"}); r.exit_code != 0) return "ovs-vsctl init: " + r.err;
    // ovs-vswitchd puts its <bridge>.mgmt sockets in OVS_RUNDIR.
    auto r =
        InNs(host_, {"env", "OVS_RUNDIR=" + rundir, "ovs-vswitchd", "unix:" + rundir + "/db.sock",
                     "--pidfile=" + rundir + "/ovs-vswitchd.pid", "--detach",
                     "--log-file=" + rundir + "/ovs-vswitchd.log"});
    if (r.exit_code != 0) return "ovs-vswitchd failed: " + r.err;
    return "";
  }
  ToolResult Vsctl(std::vector<std::string> args) {
    args.insert(args.begin(),
                {"ovs-vsctl", "--timeout=5", "--db=unix:" + ovs_rundir_ + "/db.sock"});
    return Run(args);
  }
  // ovs-ofctl <command...> <bridge's mgmt socket> <args...>
  ToolResult Ofctl(std::vector<std::string> command, const std::string& bridge,
                   const std::vector<std::string>& args = {}) {
    command.insert(command.begin(), "ovs-ofctl");
    command.push_back("unix:" + ovs_rundir_ + "/" + bridge + ".mgmt");
    command.insert(command.end(), args.begin(), args.end());
    return Run(command);
  }
  // "" when every tool is installed (then Run/InNs find them by name); otherwise which is not.
  std::string Need(const std::vector<std::string>& tools) {
    for (const auto& tool : tools) {
      auto path = HostRoot("/").FindCommand(tool);
      if (!path) return tool + " is not installed (scripts/install-deps)";
      tools_[tool] = *path;
    }
    return "";
  }
  // A socket(AF_INET, type) that lives in namespace `ns` (a full name, as AddNamespace returns
  // it): made on a short-lived thread that joined the namespace (network namespaces are per
  // thread), usable from any thread afterwards. -1 on failure.
  static int SocketIn(const std::string& ns, int type) {
    int fd = -1;
    std::thread t([&] {
      const int nsfd = ::open(("/run/netns/" + ns).c_str(), O_RDONLY | O_CLOEXEC);
      if (nsfd < 0) return;
      if (::setns(nsfd, CLONE_NEWNET) == 0) fd = ::socket(AF_INET, type | SOCK_CLOEXEC, 0);
      ::close(nsfd);
    });
    t.join();
    return fd;
  }
  // A further namespace of the lab (deleted with it), e.g. an "outside" network.
  std::string AddNamespace(const std::string& name) {
    std::string ns = prefix_ + "-" + name;
    if (Run({"ip", "netns", "add", ns}).exit_code != 0) return "";
    namespaces_.push_back(ns);
    return ns;
  }

  ToolResult Run(std::vector<std::string> argv,
                 std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    argv[0] = Tool(argv[0]);
    auto r = RunTool(argv, timeout);
    return r.ok() ? *r : ToolResult{};
  }
  ToolResult InNs(const std::string& ns, std::vector<std::string> args,
                  std::chrono::milliseconds timeout = std::chrono::seconds(10)) {
    args[0] = Tool(args[0]);
    args.insert(args.begin(), {"ip", "netns", "exec", ns});
    return Run(args, timeout);
  }
  // A "VM" namespace whose eth0 has `mac` and is a veth to `port` on `bridge` in the host ns;
  // the host end carries the MAC libvirt gives a guest's tap (fe: first). Returns the
  // namespace, "" on failure.
  std::string AddVm(const std::string& name, const std::string& mac, const std::string& port,
                    const std::string& bridge) {
    std::string ns = AddNamespace(name);
    if (ns.empty()) return "";
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"ip", "-n", host_, "link", "add", port, "type", "veth", "peer", "name", "eth0",
              "netns", ns},
             {"ip", "-n", host_, "link", "set", port, "address", "fe" + mac.substr(2)},
             {"ip", "-n", host_, "link", "set", port, "up"},
             {"ip", "-n", ns, "link", "set", "lo", "up"},
             {"ip", "-n", ns, "link", "set", "eth0", "address", mac, "up"}}) {
      if (Run(args).exit_code != 0) return "";
    }
    const auto plugged = ovs_rundir_.empty()
                             ? Run({"ip", "-n", host_, "link", "set", port, "master", bridge})
                             : Vsctl({"add-port", bridge, port, "--", "set", "interface", port,
                                      "external_ids:attached-mac=" + mac});
    return plugged.exit_code == 0 ? ns : "";
  }
  // busybox udhcpc in the VM: the leased IP, or nullopt when no server answered.
  std::optional<std::string> Dhcp(const std::string& ns, int tries = 3) {
    auto r = InNs(ns, {"busybox", "udhcpc", "-i", "eth0", "-n", "-q", "-f", "-t",
                       std::to_string(tries), "-T", "1", "-s", "/bin/true"});
    const std::string all = r.out + r.err;
    const std::string key = "lease of ";
    const size_t at = all.find(key);
    if (r.exit_code != 0 || at == std::string::npos) return std::nullopt;
    const size_t end = all.find(' ', at + key.size());
    return all.substr(at + key.size(), end - at - key.size());
  }

 private:
  std::string Tool(const std::string& name) const {
    auto it = tools_.find(name);
    return it == tools_.end() ? name : it->second;
  }
  std::map<std::string, std::string> tools_;
  std::string prefix_, host_, ovs_rundir_;
  std::vector<std::string> namespaces_;
};

}  // namespace gpuaas::node_agent::testing
