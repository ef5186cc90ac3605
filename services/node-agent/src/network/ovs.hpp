#pragma once
// Open vSwitch for the slice network (net_apply's "ovs" datapath): read the bridge, its
// interfaces and our flows through ovs-vsctl / ovs-ofctl, and the pure rules of what the flow
// table must hold.
//
// Ownership: the platform's flows carry kOvsCookie; anything else in the bridge's table is not
// ours and is never modified (a flow with another cookie is "foreign"). OVS's own default flow
// (cookie 0, priority 0, actions=NORMAL, installed on a bridge in fail_mode standalone) goes away
// when the bridge is switched to fail_mode=secure, which adopting a bridge does.
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "gpuaas/common/result.hpp"
#include "network/net_host.hpp"

namespace gpuaas::node_agent {

inline constexpr const char* kOvsCookie = "0x67706173";  // "gpas"

// One `ovs-vsctl --format=json list <table>` result: a row per record, column -> value. Values
// are ovsdb's JSON: an atom, ["uuid", id], ["set", [atoms]] or ["map", [[key, value]...]]. A
// short row has only the columns it reaches. INVALID_ARGUMENT ovs_table_invalid when `json` is
// not such a table or lacks a `required` heading. (The agent's applier and discovery both read
// OVS through this.)
using OvsRow = std::map<std::string, nlohmann::json>;
Result<std::vector<OvsRow>> ParseOvsTable(const std::string& json,
                                          const std::vector<std::string>& required = {});
// An atom or a one-element set as text / integer; "" / 0 for anything else (an empty set).
std::string OvsText(const nlohmann::json& v);
int64_t OvsInt(const nlohmann::json& v);
// A map column's value for `key` ("" when absent).
std::string OvsMapGet(const nlohmann::json& v, const std::string& key);

struct OvsInterface {
  std::string name;
  std::string bridge;        // the bridge whose port it is ("" when none)
  int64_t ofport = 0;        // 0: not yet numbered by ovs-vswitchd; -1: it could not attach it
  std::string type;          // "" (system), "internal", ...
  std::string attached_mac;  // external_ids:attached-mac (libvirt sets the guest's MAC)
  std::string slot;          // external_ids:gpuaas-slot (set by the agent)
  int64_t ingress_rate_kbps = 0;
  int64_t ingress_burst_kb = 0;
};

struct OvsBridge {
  bool exists = false;
  std::string fail_mode;      // "" (standalone) | "secure" | "standalone"
  std::string datapath_type;  // "" (system) | "netdev" | "system"
  bool managed = false;       // external_ids:gpuaas-managed=true
};

// One slice vNIC the flow table admits: the interface's OpenFlow port and the slot's MAC.
struct OvsVnic {
  int64_t ofport = 0;
  std::string mac;  // lowercase
};

// The platform's flows, in the form `ovs-ofctl --no-names dump-flows --no-stats` prints them
// ("cookie=0x67706173, priority=200,in_port=3,dl_src=52:54:00:aa:bb:cc actions=LOCAL"):
//   isolate: each vNIC reaches only the gateway (LOCAL) and only with its own MAC; the gateway
//   reaches each vNIC by its MAC; the gateway's broadcast/multicast (ARP, DHCP) goes to the
//   vNICs; everything else drops (so a slice never sees another slice's frames, and an unknown
//   port's traffic goes nowhere).
//   !isolate: one NORMAL flow (a learning switch).
std::vector<std::string> DesiredOvsFlows(bool isolate, std::vector<OvsVnic> vnics);

// The flows of a dump, trimmed; ours (kOvsCookie) and the others apart.
struct OvsFlowTable {
  std::vector<std::string> ours;
  std::vector<std::string> foreign;
};
OvsFlowTable ParseOvsFlowDump(const std::string& dump);

// "cookie=..., priority=... actions=..." -> the add-flows line
// "cookie=...,priority=...,actions=..."
std::string OvsFlowToAdd(const std::string& printed);

class Ovs {
 public:
  // rundir: where ovsdb-server's db.sock and ovs-vswitchd's <bridge>.mgmt live ("" = the
  // system's default, /var/run/openvswitch).
  Ovs(const NetHost& h, std::string rundir) : h_(h), rundir_(std::move(rundir)) {}

  Result<OvsBridge> Bridge(const std::string& bridge) const;
  // Every interface of every bridge (with its bridge), and those on none.
  Result<std::vector<OvsInterface>> Interfaces() const;
  Result<ToolResult> Vsctl(const std::vector<std::string>& args) const;
  Result<OvsFlowTable> Flows(const std::string& bridge) const;
  // Replaces our flows with `flows` in one atomic bundle (foreign flows untouched); the flow
  // file is written to `scratch`.
  Result<void> ReplaceOurFlows(const std::string& bridge, const std::vector<std::string>& flows,
                               const std::string& scratch) const;

 private:
  std::vector<std::string> Db() const;
  std::string Target(const std::string& bridge) const;

  const NetHost& h_;
  std::string rundir_;
};

}  // namespace gpuaas::node_agent
