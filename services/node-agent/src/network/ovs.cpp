#include "network/ovs.hpp"

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

namespace gpuaas::node_agent {
namespace {

using Json = nlohmann::json;

// The items of a set column (a lone atom is a set of one).
std::vector<Json> SetItems(const Json& v) {
  if (v.is_array() && v.size() == 2 && v[0] == "set" && v[1].is_array()) {
    return {v[1].begin(), v[1].end()};
  }
  return {v};
}

std::string Uuid(const Json& v) {
  return v.is_array() && v.size() == 2 && v[0] == "uuid" && v[1].is_string()
             ? v[1].get<std::string>()
             : "";
}

// The atom of an atom or one-element set; nullptr otherwise.
const Json* Atom(const Json& v) {
  if (v.is_array() && v.size() == 2 && v[0] == "set") {
    return v[1].is_array() && v[1].size() == 1 ? &v[1][0] : nullptr;
  }
  return &v;
}

}  // namespace

Result<std::vector<OvsRow>> ParseOvsTable(const std::string& json,
                                          const std::vector<std::string>& required) {
  auto doc = Json::parse(json, nullptr, false);
  if (doc.is_discarded() || !doc.is_object() || !doc.contains("headings") ||
      !doc["headings"].is_array() || !doc.contains("data") || !doc["data"].is_array()) {
    return Error::InvalidArgument(reason::kOvsTableInvalid,
                                  "not an ovs-vsctl JSON table: " + json.substr(0, 200));
  }
  std::vector<std::string> head;
  for (const auto& h : doc["headings"]) head.push_back(h.is_string() ? h.get<std::string>() : "");
  for (const auto& r : required) {
    if (std::find(head.begin(), head.end(), r) == head.end()) {
      return Error::InvalidArgument(reason::kOvsTableInvalid,
                                    "ovs-vsctl table has no " + r + " column");
    }
  }
  std::vector<OvsRow> out;
  for (const auto& row : doc["data"]) {
    if (!row.is_array()) {
      return Error::InvalidArgument(reason::kOvsTableInvalid,
                                    "ovs-vsctl table row is not an array");
    }
    OvsRow r;
    for (size_t i = 0; i < head.size() && i < row.size(); ++i) r[head[i]] = row[i];
    out.push_back(std::move(r));
  }
  return out;
}

std::string OvsText(const Json& v) {
  const Json* a = Atom(v);
  return a != nullptr && a->is_string() ? a->get<std::string>() : "";
}

int64_t OvsInt(const Json& v) {
  const Json* a = Atom(v);
  return a != nullptr && a->is_number_integer() ? a->get<int64_t>() : 0;
}

std::string OvsMapGet(const Json& v, const std::string& key) {
  if (!(v.is_array() && v.size() == 2 && v[0] == "map" && v[1].is_array())) return "";
  for (const auto& kv : v[1]) {
    if (kv.is_array() && kv.size() == 2 && kv[0] == key && kv[1].is_string()) {
      return kv[1].get<std::string>();
    }
  }
  return "";
}

std::vector<std::string> DesiredOvsFlows(bool isolate, std::vector<OvsVnic> vnics) {
  const std::string c = fmt::format("cookie={}, ", kOvsCookie);
  if (!isolate) return {c + "priority=0 actions=NORMAL"};
  std::sort(vnics.begin(), vnics.end(),
            [](const OvsVnic& a, const OvsVnic& b) { return a.ofport < b.ofport; });
  std::vector<std::string> out;
  std::string flood;
  for (const auto& v : vnics) {
    out.push_back(
        fmt::format("{}priority=200,in_port={},dl_src={} actions=LOCAL", c, v.ofport, v.mac));
    out.push_back(fmt::format("{}priority=200,in_port=LOCAL,dl_dst={} actions=output:{}", c, v.mac,
                              v.ofport));
    flood += (flood.empty() ? "" : ",") + fmt::format("output:{}", v.ofport);
  }
  if (!flood.empty()) {
    out.push_back(c +
                  "priority=100,in_port=LOCAL,dl_dst=01:00:00:00:00:00/01:00:00:00:00:00 "
                  "actions=" +
                  flood);
  }
  out.push_back(c + "priority=0 actions=drop");
  return out;
}

OvsFlowTable ParseOvsFlowDump(const std::string& dump) {
  OvsFlowTable t;
  const std::string ours = fmt::format("cookie={},", kOvsCookie);
  for (const auto& raw : SplitLines(dump)) {
    const std::string line = Trim(raw);
    // Header lines ("NXST_FLOW reply (xid=0x4):", "OFPST_FLOW reply ...") carry no cookie.
    if (!StartsWith(line, "cookie=")) continue;
    (StartsWith(line, ours) ? t.ours : t.foreign).push_back(line);
  }
  std::sort(t.ours.begin(), t.ours.end());
  std::sort(t.foreign.begin(), t.foreign.end());
  return t;
}

std::string OvsFlowToAdd(const std::string& printed) {
  std::string s = printed;
  if (auto i = s.find(", "); i != std::string::npos) s.replace(i, 2, ",");
  if (auto i = s.rfind(" actions="); i != std::string::npos) s.replace(i, 1, ",");
  return s;
}

std::vector<std::string> Ovs::Db() const {
  std::vector<std::string> a{"--timeout=5"};
  if (!rundir_.empty()) a.push_back("--db=unix:" + rundir_ + "/db.sock");
  return a;
}

std::string Ovs::Target(const std::string& bridge) const {
  return rundir_.empty() ? bridge : "unix:" + rundir_ + "/" + bridge + ".mgmt";
}

Result<ToolResult> Ovs::Vsctl(const std::vector<std::string>& args) const {
  auto a = Db();
  a.insert(a.end(), args.begin(), args.end());
  return h_.Must("ovs-vsctl", a);
}

Result<OvsBridge> Ovs::Bridge(const std::string& bridge) const {
  OvsBridge b;
  auto a = Db();
  a.insert(a.end(), {"br-exists", bridge});
  auto exists = h_.Run("ovs-vsctl", a);
  if (!exists.ok()) return exists.error();
  if (exists->exit_code == 2) return b;
  if (exists->exit_code != 0) return NetHost::Failed("ovs-vsctl br-exists " + bridge, *exists);
  b.exists = true;
  auto r = Vsctl({"--format=json", "--columns=fail_mode,datapath_type,external_ids", "list",
                  "Bridge", bridge});
  if (!r.ok()) return r.error();
  auto rows = ParseOvsTable(Trim(r->out));
  if (!rows.ok()) return rows.error();
  if (!rows->empty()) {
    auto& row = rows->front();
    b.fail_mode = OvsText(row["fail_mode"]);
    b.datapath_type = OvsText(row["datapath_type"]);
    b.managed = OvsMapGet(row["external_ids"], "gpuaas-managed") == "true";
  }
  return b;
}

Result<std::vector<OvsInterface>> Ovs::Interfaces() const {
  // One transaction, three tables: which interfaces belong to which port, which ports to which
  // bridge.
  const std::string iface_columns =
      "--columns=_uuid,name,ofport,type,external_ids,ingress_policing_rate,ingress_policing_burst";
  auto r = Vsctl({"--format=json", "--", iface_columns, "list", "Interface", "--",
                  "--columns=_uuid,interfaces", "list", "Port", "--", "--columns=name,ports",
                  "list", "Bridge"});
  if (!r.ok()) return r.error();
  std::vector<std::string> docs;
  for (const auto& line : SplitLines(r->out)) {
    if (!Trim(line).empty()) docs.push_back(Trim(line));
  }
  if (docs.size() != 3) {
    return Error::Internal(
        reason::kUnexpectedToolOutput,
        "ovs-vsctl list: " + r->out.substr(0, std::min<size_t>(200, r->out.size())));
  }
  auto ifaces = ParseOvsTable(docs[0]);
  auto ports = ParseOvsTable(docs[1]);
  auto bridges = ParseOvsTable(docs[2]);
  if (!ifaces.ok()) return ifaces.error();
  if (!ports.ok()) return ports.error();
  if (!bridges.ok()) return bridges.error();
  std::map<std::string, std::string> port_bridge;  // port uuid -> bridge name
  for (auto& b : *bridges) {
    for (const auto& p : SetItems(b["ports"])) port_bridge[Uuid(p)] = OvsText(b["name"]);
  }
  std::map<std::string, std::string> iface_bridge;  // interface uuid -> bridge name
  for (auto& p : *ports) {
    const std::string br = port_bridge[Uuid(p["_uuid"])];
    for (const auto& i : SetItems(p["interfaces"])) iface_bridge[Uuid(i)] = br;
  }
  std::vector<OvsInterface> out;
  for (auto& row : *ifaces) {
    OvsInterface i;
    i.name = OvsText(row["name"]);
    i.bridge = iface_bridge[Uuid(row["_uuid"])];
    i.ofport = OvsInt(row["ofport"]);
    i.type = OvsText(row["type"]);
    i.attached_mac = Lower(OvsMapGet(row["external_ids"], "attached-mac"));
    i.slot = OvsMapGet(row["external_ids"], "gpuaas-slot");
    i.ingress_rate_kbps = OvsInt(row["ingress_policing_rate"]);
    i.ingress_burst_kb = OvsInt(row["ingress_policing_burst"]);
    out.push_back(std::move(i));
  }
  std::sort(out.begin(), out.end(),
            [](const OvsInterface& a, const OvsInterface& b) { return a.name < b.name; });
  return out;
}

Result<OvsFlowTable> Ovs::Flows(const std::string& bridge) const {
  auto r = h_.Must("ovs-ofctl", {"--no-names", "dump-flows", Target(bridge), "--no-stats"});
  if (!r.ok()) return r.error();
  return ParseOvsFlowDump(r->out);
}

Result<void> Ovs::ReplaceOurFlows(const std::string& bridge, const std::vector<std::string>& flows,
                                  const std::string& scratch) const {
  std::string file = fmt::format("delete cookie={}/-1\n", kOvsCookie);
  for (const auto& f : flows) file += "add " + OvsFlowToAdd(f) + "\n";
  {
    std::ofstream out(scratch, std::ios::trunc);
    out << file;
    if (!out.flush()) return Error::Internal(reason::kStateWriteFailed, scratch + ": write failed");
  }
  auto r =
      h_.Must("ovs-ofctl", {"-O", "OpenFlow14", "--bundle", "add-flows", Target(bridge), scratch});
  if (!r.ok()) return r.error();
  return Ok();
}

}  // namespace gpuaas::node_agent
