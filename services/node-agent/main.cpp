// gpuaas-node-agent: runs on each GPU host. Without a subcommand it is the agent service; the
// one-shot subcommands read a host (or a fixture tree) and print what discovery sees:
//   discover [--json]   the topology report
//   parity              GPUAAS_SLICE_PARITY lines of the prerequisite and network checks
//   fixture --out DIR   write a simulated host tree
#include <cstring>
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>

#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/node_agent/agent/node_agent.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/discovery/parity.hpp"

namespace {

using namespace gpuaas::node_agent;

void AddDiscoveryFlags(CLI::App& app, DiscoveryOptions& o) {
  app.add_option("--root", o.root, "Host root to read (a fixture tree in simulation)");
  app.add_option("--node-id", o.node_id, "Node id (default: the hostname)");
  app.add_option("--hostname", o.hostname, "Hostname (default: read from the root)");
  app.add_option("--bridge", o.bridge, "Slice management bridge");
  app.add_option("--gateway-cidr", o.gateway_cidr, "Gateway address expected on the bridge");
  app.add_option("--libvirt-uri", o.libvirt_uri, "libvirt URI to probe (\"\" skips the check)");
  app.add_option("--network-mode", o.network_mode, "private-nat | private-routed | ...");
  app.add_option("--ovs-db", o.ovs_db,
                 "Open vSwitch database for ovs-vsctl (unix:/run/x/db.sock; default: its own)");
}

std::string CheckCounts(const google::protobuf::RepeatedPtrField<gpuaas::v1::Check>& checks) {
  int pass = 0, warn = 0, fail = 0;
  for (const auto& c : checks) {
    if (c.status() == gpuaas::v1::CHECK_STATUS_PASS) {
      ++pass;
    } else if (c.status() == gpuaas::v1::CHECK_STATUS_FAIL) {
      ++fail;
    } else {
      ++warn;
    }
  }
  return std::to_string(pass) + " pass, " + std::to_string(warn) + " warn, " +
         std::to_string(fail) + " fail";
}

void PrintSummary(const gpuaas::v1::TopologyReport& r) {
  int os = 0;
  for (const auto& d : r.nvme()) os += d.os_disk() ? 1 : 0;
  std::cout << "node " << r.node_id() << " (hostname " << r.hostname() << ", root " << r.root()
            << ")\n"
            << "  " << r.gpus_size() << " GPUs, " << r.nvme_size() << " NVMe (" << os
            << " OS disk), " << r.fabric_size() << " fabric devices, " << r.candidates_size()
            << " candidate slots\n"
            << "  prereqs: " << CheckCounts(r.prereqs())
            << "; network: " << CheckCounts(r.network_checks())
            << (r.reboot_required() ? "; reboot required" : "") << "\n";
  std::cout << "  blockers:";
  if (r.node_blockers_size() == 0) std::cout << " none";
  for (const auto& b : r.node_blockers()) std::cout << " " << b;
  std::cout << "\n";
  for (const auto& s : r.candidates()) {
    std::cout << "  slot " << s.index() << " " << s.slot_key() << " " << s.locality_group()
              << " nvme=" << (s.nvme_by_id().empty() ? "-" : s.nvme_by_id())
              << " fabric=" << s.fabric_claim_mode();
    if (!s.fabric_vf_pci_address().empty()) std::cout << ":" << s.fabric_vf_pci_address();
    std::cout << " mac=" << s.suggested_mac() << " ip=" << s.suggested_ip() << "\n";
    for (const auto& n : s.notes()) std::cout << "    note: " << n << "\n";
  }
}

int RunDiscover(int argc, char** argv) {
  CLI::App app{"Discover this host's slice topology and print the report"};
  app.name("gpuaas-node-agent discover");
  DiscoveryOptions o;
  o.agent_version = GPUAAS_VERSION;
  bool json = false;
  AddDiscoveryFlags(app, o);
  app.add_flag("--json", json, "Print the TopologyReport as JSON");
  CLI11_PARSE(app, argc, argv);
  auto r = Discover(o);
  if (!r.ok()) {
    std::cerr << "discover: " << r.error().ToString() << "\n";
    return 2;
  }
  if (json) {
    std::cout << gpuaas::protojson::ToJson(*r, true) << "\n";
  } else {
    PrintSummary(*r);
  }
  return 0;
}

int RunParity(int argc, char** argv) {
  CLI::App app{"Print GPUAAS_SLICE_PARITY lines; exit 1 when any check fails"};
  app.name("gpuaas-node-agent parity");
  DiscoveryOptions o;
  o.agent_version = GPUAAS_VERSION;
  AddDiscoveryFlags(app, o);
  CLI11_PARSE(app, argc, argv);
  auto r = Discover(o);
  if (!r.ok()) {
    std::cerr << "parity: " << r.error().ToString() << "\n";
    return 2;
  }
  std::vector<gpuaas::v1::Check> checks(r->prereqs().begin(), r->prereqs().end());
  checks.insert(checks.end(), r->network_checks().begin(), r->network_checks().end());
  std::cout << FormatParity(checks);
  return ParityExitCode(checks);
}

int RunFixture(int argc, char** argv) {
  CLI::App app{"Write a simulated GPU host tree (sysfs, /proc, /dev, tools)"};
  app.name("gpuaas-node-agent fixture");
  std::string out;
  FixtureOptions f;
  app.add_option("--out", out, "Directory to create (must be empty or absent)")->required();
  app.add_option("--gpus", f.gpus, "Number of GPUs")->check(CLI::Range(0, 16));
  app.add_option("--hostname", f.hostname, "Hostname of the simulated host");
  app.add_option("--vfs-per-pf", f.vfs_per_pf, "Fabric VFs per PF")->check(CLI::Range(0, 64));
  bool no_nat = false, no_forward = false, no_bridge = false;
  app.add_flag("--no-nat", no_nat, "Leave out the slice MASQUERADE rule");
  app.add_flag("--no-ip-forward", no_forward, "ip_forward=0");
  app.add_flag("--no-bridge", no_bridge, "No ovsbr0");
  CLI11_PARSE(app, argc, argv);
  f.nat_rule = !no_nat;
  f.ip_forward = !no_forward;
  f.bridge = !no_bridge;
  if (auto r = BuildFixtureHost(out, f); !r.ok()) {
    std::cerr << "fixture: " << r.error().ToString() << "\n";
    return 1;
  }
  std::cout << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 2) {
    // Subcommands parse argv without the program name, so CLI11 sees "discover" as argv[0].
    if (std::strcmp(argv[1], "discover") == 0) return RunDiscover(argc - 1, argv + 1);
    if (std::strcmp(argv[1], "parity") == 0) return RunParity(argc - 1, argv + 1);
    if (std::strcmp(argv[1], "fixture") == 0) return RunFixture(argc - 1, argv + 1);
    if (std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
      std::cout << "one-shot subcommands: discover | parity | fixture (each takes --help)\n";
    }
  }
  using gpuaas::node_agent::NodeAgent;
  using gpuaas::node_agent::NodeAgentConfig;
  return gpuaas::runtime::Main<NodeAgent, NodeAgentConfig>(argc, argv, "node-agent");
}
