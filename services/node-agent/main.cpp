// gpuaas-node-agent: runs on each GPU host.
//
//   gpuaas-node-agent --config FILE              the agent (registers, reports, runs tasks)
//   gpuaas-node-agent discover [--root DIR] [--json] ...   what this host has, as evidence
//   gpuaas-node-agent parity [--root DIR] ...    prerequisite + network checks, parity lines;
//                                                exit 1 on any FAIL
//   gpuaas-node-agent fixture --out DIR [...]    write a simulated host tree (for scripts/up)
#include <cstring>
#include <iostream>
#include <string>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "discovery.hpp"
#include "fixture_host.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "node_agent.hpp"
#include "parity.hpp"

namespace {

using namespace gpuaas::node_agent;

void AddDiscoveryOptions(CLI::App* cmd, DiscoveryOptions& o) {
  cmd->add_option("--root", o.root, "Root of every host read (a fixture tree in tests)")
      ->capture_default_str();
  cmd->add_option("--node-id", o.node_id, "Node id used for suggested MACs (default: hostname)");
  cmd->add_option("--network-mode", o.network_mode, "private-nat | fabric-only")
      ->capture_default_str();
  cmd->add_option("--bridge", o.bridge, "Slice management bridge")->capture_default_str();
  cmd->add_option("--gateway-cidr", o.gateway_cidr, "Gateway address expected on the bridge")
      ->capture_default_str();
  cmd->add_option("--libvirt-uri", o.libvirt_uri, "libvirt URI (\"\" skips the check)")
      ->capture_default_str();
}

int Summary(const gpuaas::v1::TopologyReport& r) {
  std::cout << fmt::format("node {} ({}), root {}\n", r.node_id(), r.hostname(), r.root());
  std::cout << fmt::format("gpus {}  nvme {}  fabric {}  candidates {}  reboot_required {}\n",
                           r.gpus_size(), r.nvme_size(), r.fabric_size(), r.candidates_size(),
                           r.reboot_required() ? "yes" : "no");
  for (const auto& g : r.gpus()) {
    std::cout << fmt::format("  gpu  {} {} numa {} iommu {} driver {} switch {}\n", g.pci_address(),
                             g.model().empty() ? g.device_id() : g.model(),
                             g.has_numa_node() ? std::to_string(g.numa_node()) : "?",
                             g.iommu_group().empty() ? "-" : g.iommu_group(),
                             g.driver().empty() ? "-" : g.driver(),
                             g.pcie_switch().empty() ? "-" : g.pcie_switch());
  }
  for (const auto& n : r.nvme()) {
    std::cout << fmt::format("  nvme {} ({}) {} GB{}{}\n", n.by_id_path(), n.kernel_name(),
                             n.size_bytes() / 1000000000, n.os_disk() ? " OS-DISK" : "",
                             n.mountpoints().empty() ? "" : " mounted");
  }
  for (const auto& c : r.candidates()) {
    std::cout << fmt::format("  slot {} nvme {} fabric {} {} mac {}\n", c.slot_key(),
                             c.nvme_by_id().empty() ? "-" : c.nvme_by_id(), c.fabric_claim_mode(),
                             c.fabric_vf_pci_address().empty() ? "-" : c.fabric_vf_pci_address(),
                             c.suggested_mac());
  }
  std::cout << "blockers: "
            << (r.node_blockers().empty() ? std::string("none")
                                          : fmt::format("{}", fmt::join(r.node_blockers(), ", ")))
            << "\n";
  return 0;
}

int Tools(int argc, char** argv) {
  CLI::App app{"gpuaas-node-agent host tools"};
  app.require_subcommand(1);
  DiscoveryOptions opts;
  bool json = false;
  auto* discover = app.add_subcommand("discover", "Print what this host has (evidence)");
  AddDiscoveryOptions(discover, opts);
  discover->add_flag("--json", json, "The gpuaas.v1.TopologyReport as JSON");
  auto* parity = app.add_subcommand("parity", "Prerequisite and network checks, parity lines");
  AddDiscoveryOptions(parity, opts);
  std::string out;
  FixtureOptions fo;
  auto* fixture = app.add_subcommand("fixture", "Write a simulated GPU host tree");
  fixture->add_option("--out", out, "Directory to create (must not exist or be empty)")->required();
  fixture->add_option("--gpus", fo.gpus, "GPUs (0..16)")->capture_default_str();
  fixture->add_option("--hostname", fo.hostname, "Hostname")->capture_default_str();
  fixture->add_flag("--no-nat{false}", fo.nat_rule, "Leave out the MASQUERADE rule");
  CLI11_PARSE(app, argc, argv);

  if (fixture->parsed()) {
    auto r = BuildFixtureHost(out, fo);
    if (!r.ok()) {
      std::cerr << "gpuaas-node-agent fixture: " << r.error().ToString() << "\n";
      return 1;
    }
    std::cout << out << "\n";
    return 0;
  }
  auto report = Discover(opts);
  if (!report.ok()) {
    std::cerr << "gpuaas-node-agent: " << report.error().ToString() << "\n";
    return 2;
  }
  if (discover->parsed()) {
    if (json) {
      std::cout << gpuaas::protojson::ToJson(*report, true) << "\n";
      return 0;
    }
    return Summary(*report);
  }
  std::vector<gpuaas::v1::Check> checks(report->prereqs().begin(), report->prereqs().end());
  checks.insert(checks.end(), report->network_checks().begin(), report->network_checks().end());
  std::cout << FormatParity(checks);
  return ParityExitCode(checks);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && (!std::strcmp(argv[1], "discover") || !std::strcmp(argv[1], "parity") ||
                   !std::strcmp(argv[1], "fixture"))) {
    return Tools(argc, argv);
  }
  using gpuaas::node_agent::NodeAgent;
  using gpuaas::node_agent::NodeAgentConfig;
  return gpuaas::runtime::Main<NodeAgent, NodeAgentConfig>(argc, argv, "node-agent");
}
