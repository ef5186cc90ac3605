#pragma once
// Slice networking on a node (private-nat mode): the control plane (ipam) owns every slice VM's
// MAC/IP/hostname; this applies exactly that and reports what really happened. Two datapaths:
//
//   linux-bridge: bridge <bridge> with <gateway_cidr>, up (ip link / ip addr); slices apart by
//                 bridge port isolation
//   ovs:          Open vSwitch bridge <bridge> (ovs-vsctl --may-exist add-br, fail_mode=secure,
//                 external_ids:gpuaas-managed=true), its internal port with <gateway_cidr>, up;
//                 one port per slice vNIC (the one whose external_ids:attached-mac is the slot's
//                 MAC, as libvirt's <virtualport type='openvswitch'/> sets it) tagged
//                 external_ids:gpuaas-slot and policed (ingress_policing_rate/_burst); slices
//                 apart by OpenFlow rules with the platform's cookie (ovs.hpp: only the gateway
//                 is reachable, with the vNIC's own MAC; everything else drops). An existing
//                 bridge is adopted (fail_mode=secure, marked managed); a Linux bridge of that
//                 name, the gateway address on another interface, or flows that are not ours
//                 are refused (FAILED_PRECONDITION bridge_name_conflict, gateway_conflict,
//                 foreign_flows), never worked around with a second bridge.
// and on both:
//   vNIC taps: a host interface whose MAC is the slot MAC with fe: first (libvirt's tap of that
//              guest) that is not a port of <bridge> (hand-deleted, or on another bridge) is put
//              back on <bridge>
//   stale dnsmasq files: <host_dnsmasq_dir>/gpuaas-*.conf holding only dhcp-host lines (the
//              seed runbook's leftover reservations from manual runs) are moved to
//              <state_dir>/stale-dnsmasq/ so they never hand out an address ipam did not reserve
//   net.ipv4.ip_forward=1                           sysctl (of the namespace it runs in)
//   nat    POSTROUTING -s <subnet> ! -d <subnet> [-o egress] -m comment --comment
//          gpuaas-nat-<bridge> -j MASQUERADE        (directly in POSTROUTING, where discovery's
//                                                   nat_masquerade check looks; found by its tag)
//   filter FORWARD -j GPUAAS-FWD-<bridge> (first)   -i br -o br DROP (isolate_ports), subnet out
//                                                   ACCEPT, established/related back ACCEPT,
//                                                   new connections ingress DNATed in ACCEPT
//   bridge port isolation on every port of <bridge> (isolate_ports)
//   dnsmasq: <state_dir>/dnsmasq.conf + dhcp-hosts (exactly the reservations), static range,
//            leases in <state_dir>/dnsmasq.leases, pid in <state_dir>/dnsmasq.pid
//
// Every host command is an argv vector run through RunTool (no shell), inside `ctx.netns`
// (`ip netns exec <netns> ...`) when set. Specs are validated (pure) before anything is touched.
// Calls on one state_dir are serialised with a lock file there. Nothing here throws.
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/v1/types.pb.h"

namespace gpuaas::node_agent {

struct NetReservation {
  std::string mac;       // unicast "52:54:00:ab:cd:ef" (any case; lowercased when written)
  std::string ip;        // inside subnet_cidr, not the network/broadcast/gateway address
  std::string hostname;  // RFC 1123 label, or "" for none
  std::string slot_key;  // carried into observations only
};

enum class Datapath { kLinuxBridge, kOvs };

struct NetworkSpec {
  Datapath datapath = Datapath::kLinuxBridge;
  std::string bridge;        // bridge name (1-15 of [A-Za-z0-9_.-])
  std::string gateway_cidr;  // "10.100.0.1/24": the bridge's address; same prefix as subnet
  std::string subnet_cidr;   // "10.100.0.0/24"
  std::vector<NetReservation> reservations;
  bool masquerade = true;
  bool ip_forward = true;
  bool isolate_ports = true;
  std::string egress_iface;  // "" = any interface but the bridge
  std::string state_dir;     // absolute; dnsmasq conf, hosts file, lease file, pid live here
  // OVS: every slice vNIC's ingress policing (the runtime profile's); 0 = no policing.
  int64_t vnic_ingress_kbps = 0;
  int64_t vnic_ingress_burst_kb = 0;
  int64_t version = 0;
};

// Test seam: runs an argv (the netns prefix already added). Empty = RunTool.
using NetRunFn =
    std::function<Result<ToolResult>(const std::vector<std::string>&, std::chrono::milliseconds)>;

struct NetContext {
  std::string netns;  // "" = the agent's own network namespace
  std::chrono::milliseconds tool_timeout{5000};
  // RemoveReservation releases leases with dhcp_release (dnsmasq-utils) when this is set and
  // the tool exists; otherwise it stops dnsmasq, edits the lease file and starts it again.
  bool use_dhcp_release = true;
  // Open vSwitch: the directory of ovsdb-server's db.sock and ovs-vswitchd's <bridge>.mgmt
  // ("" = the system's), and the datapath_type of a bridge the agent creates ("" = the kernel
  // datapath; "netdev" = userspace, no kernel module). An adopted bridge keeps its own.
  std::string ovs_rundir;
  std::string ovs_datapath_type;
  // Where the host's own dnsmasq reads extra config ("" = do not look): stale gpuaas-*.conf
  // reservation files there are moved aside.
  std::string host_dnsmasq_dir;
  NetRunFn run;
};

struct ApplyReport {
  int64_t version = 0;
  bool created_bridge = false;
  bool added_gateway_address = false;
  bool set_bridge_up = false;
  bool enabled_ip_forward = false;
  bool added_masquerade = false;     // the MASQUERADE rule or its jump was (re)added
  bool added_forward_rules = false;  // a FORWARD rule or its jump was (re)added
  bool removed_stale_rules = false;  // tagged NAT rules / FORWARD chain rules the spec lacks
  std::vector<std::string> isolation_changed_ports;  // ports whose isolated flag was flipped
  bool adopted_bridge = false;  // OVS: an existing bridge switched to fail_mode=secure, marked ours
  bool replaced_flows = false;  // OVS: our flows did not match the spec and were replaced
  std::vector<std::string> configured_vnics;  // OVS ports whose QoS or slot tag was (re)set
  std::vector<std::string> reattached_vnics;  // taps put (back) on the bridge
  std::vector<std::string> removed_stale_dnsmasq_files;  // moved to <state_dir>/stale-dnsmasq/
  bool wrote_dnsmasq_config = false;
  std::vector<std::string> added_reservations;    // MACs
  std::vector<std::string> changed_reservations;  // MACs whose IP or hostname changed
  std::vector<std::string> removed_reservations;  // MACs (stale: in the hosts file, not the spec)
  bool started_dnsmasq = false;
  // Config changed, the bridge was re-created under it, or a reload went unconfirmed.
  bool restarted_dnsmasq = false;
  // SIGHUP after a hosts-file rewrite, confirmed by dnsmasq logging that it re-read the file.
  bool reloaded_dnsmasq = false;
  int dnsmasq_pid = 0;

  // Stable names of what changed ("created_bridge", "added_masquerade", "removed_reservations",
  // ...); empty when the host already matched the spec.
  std::vector<std::string> Changes() const;
};

// The spec problems ApplyNetwork refuses, first one as the error (reason per rule: invalid_bridge,
// invalid_gateway, invalid_subnet, gateway_outside_subnet, invalid_state_dir, invalid_netns,
// invalid_egress_iface, subnet_too_small, invalid_mac, invalid_ip, ip_outside_subnet,
// ip_reserved, invalid_hostname, duplicate_mac, duplicate_ip, duplicate_hostname), with
// details field/index/value and "problems" listing all of them. Pure.
Result<void> ValidateNetworkSpec(const NetworkSpec& spec, const NetContext& ctx = {});

// Idempotent: a second apply of the same spec changes nothing (Changes() empty). Run it again
// after a VM port is attached to the bridge so the port gets isolated (libvirt can also do it at
// attach time with <port isolated='yes'/>). On a host error the error's
// details["applied_before_error"] lists what had already changed.
Result<ApplyReport> ApplyNetwork(const NetworkSpec& spec, const NetContext& ctx);

struct LeaseObservation {
  std::string mac;
  std::string hostname;
  std::string slot_key;
  std::string expected_ip;                                   // "" for unexpected leases
  std::string actual_ip;                                     // "" when missing
  v1::LeaseState lease_state = v1::LEASE_STATE_UNSPECIFIED;  // BOUND|MISSING|MISMATCH|UNEXPECTED
  int64_t expires_at = 0;  // epoch seconds from the lease file; 0 = infinite or no lease
};

// From dnsmasq's lease file (expired entries ignored): one entry per reservation, in spec order,
// then one per leased MAC that has no reservation ("unexpected"). No lease file = all missing.
// Lines that are not a unicast Ethernet MAC with an IPv4 address (DHCPv6 leases after "duid",
// non-Ethernet hardware addresses, a multicast MAC a guest sent) are skipped and counted in
// `skipped`, so one odd line never makes ipam refuse the whole report.
Result<std::vector<LeaseObservation>> ObserveLeases(const NetworkSpec& spec,
                                                    int* skipped = nullptr);

// How a slice vNIC drifted. Declared in the order of the texts, so sorting by kind sorts by text.
enum class SlotDriftKind {
  kQosMissing,         // qos_missing: the port's policing/tag/isolation is not what we set
  kVnicDetached,       // vnic_detached: the guest's tap is on no bridge or another one
  kVnicHostStackOpen,  // vnic_host_stack_open: the port still answers ARP or forwards
};
// The wire text (LeaseReport.vnic_drift.kind, logs): a registry reason.
Reason SlotDriftKindText(SlotDriftKind kind);

struct SlotDrift {
  std::string slot_key;
  SlotDriftKind kind = SlotDriftKind::kVnicDetached;
};

struct NetCheck {
  // Stable snake_case names, in this order: bridge_missing, bridge_down, gateway_address_missing,
  // gateway_conflict, ip_forward_off, masquerade_missing, forward_rules_missing,
  // ports_not_isolated (linux-bridge), foreign_flows, flows_stale (ovs), dnsmasq_not_running,
  // dnsmasq_config_stale, reservations_stale, stale_dnsmasq_files. Any is a hard blocker for
  // private-nat slots (missing NAT leaks 10.100.x.x sources to the uplink).
  std::vector<std::string> blockers;
  // One per drifted slice vNIC, sorted: the slot's drift, not the node's: vnic_detached (the
  // guest's tap is on no bridge or another one), qos_missing and vnic_host_stack_open (ovs: the
  // port still answers ARP or forwards in the host stack).
  std::vector<SlotDrift> slot_drift;
  std::map<std::string, std::string> evidence;  // ip_forward, dnsmasq_pid, ports, ...
  bool ok() const { return blockers.empty() && slot_drift.empty(); }
};

// Read-only: changes nothing. Errors only for an invalid spec or a tool that cannot run.
Result<NetCheck> CheckNetwork(const NetworkSpec& spec, const NetContext& ctx);

struct RemovalReport {
  bool removed_hosts_entry = false;
  std::vector<std::string> released_leases;  // IPs that had a lease for the MAC or its IP
  // "dhcp_release" | "restart" (stop dnsmasq, edit the lease file, start) | "file" (dnsmasq was
  // not running) | "none" (no lease)
  std::string lease_method = "none";
};

// Drops `mac` from the hosts file (spec.reservations minus mac; the spec may or may not still
// list it), reloads dnsmasq, and removes every lease held by the MAC or by its reserved IP, so
// the slot is reusable with no DHCP state left (checked by re-reading the lease file).
Result<void> RemoveReservation(const NetworkSpec& spec, const std::string& mac,
                               const NetContext& ctx, RemovalReport* report = nullptr);

// For tests and cleanup: stops the dnsmasq this state_dir's pid file names (only when its
// command line is ours), deletes the tagged NAT rules, the GPUAAS-FWD-<bridge> chain and its
// jump, the bridge and the files in state_dir. ip_forward is left as it is.
Result<void> TeardownNetwork(const NetworkSpec& spec, const NetContext& ctx);

// Read-only: what TeardownNetwork removes that is still there ("dnsmasq", "nat_rules",
// "forward_chain", "bridge"); empty once the slice network is gone. For a document with
// `removed` (the node in bare-metal mode).
Result<std::vector<std::string>> CheckTeardown(const NetworkSpec& spec, const NetContext& ctx);

}  // namespace gpuaas::node_agent
