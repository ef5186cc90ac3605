#include "domain_xml.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/validate.hpp"
#include "gpuaas/v1/node.pb.h"
#include "host.hpp"
#include "vm_runtime.hpp"

namespace gpuaas::node_agent {
namespace {

const std::string kStage = "define";

Error DefineError(std::string reason, std::string message,
                  std::map<std::string, std::string> details = {}) {
  details["stage"] = kStage;
  return Error{Code::kInvalidArgument, std::move(reason), std::move(message), std::move(details),
               false};
}

// Text and attribute values (single- or double-quoted) alike.
std::string Esc(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// What XML 1.0 (and libvirt) takes as text: plain text (validate::TextProblem; tab and newline
// are not wanted in any value the generator writes either).
bool IsXmlSafeText(std::string_view s) { return validate::TextProblem(s).empty(); }

bool IsAbsolutePath(const std::string& p) { return !p.empty() && p[0] == '/' && IsXmlSafeText(p); }

struct Pci {
  unsigned long domain = 0, bus = 0, slot = 0, function = 0;
};

// "0000:18:00.0" (domain of 4..8 hex digits) -> its parts.
std::optional<Pci> ParsePci(const std::string& a) {
  if (!LooksLikePciAddress(a)) return std::nullopt;
  const size_t c1 = a.find(':');
  const size_t c2 = a.find(':', c1 + 1);
  const size_t dot = a.find('.', c2 + 1);
  if (c1 == std::string::npos || c2 == std::string::npos || dot == std::string::npos || c1 > 8) {
    return std::nullopt;
  }
  try {
    Pci p;
    p.domain = std::stoul(a.substr(0, c1), nullptr, 16);
    p.bus = std::stoul(a.substr(c1 + 1, c2 - c1 - 1), nullptr, 16);
    p.slot = std::stoul(a.substr(c2 + 1, dot - c2 - 1), nullptr, 16);
    p.function = std::stoul(a.substr(dot + 1), nullptr, 16);
    if (p.bus > 0xff || p.slot > 0x1f || p.function > 7) return std::nullopt;
    return p;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

bool IsBridgeName(const std::string& b) {
  return !b.empty() && b.size() <= 15 && std::all_of(b.begin(), b.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.';
  });
}

std::string TargetDev(int index) {  // vda .. vdz, vdaa ..
  std::string suffix;
  int n = index;
  do {
    suffix.insert(suffix.begin(), static_cast<char>('a' + n % 26));
    n = n / 26 - 1;
  } while (n >= 0);
  return "vd" + suffix;
}

}  // namespace

std::string DomainName(const std::string& allocation_id) { return kDomainPrefix + allocation_id; }

bool IsLoopbackAddress(const std::string& addr) {
  if (addr == "::1") return true;
  if (!IsValidIpv4(addr)) return false;
  return addr.rfind("127.", 0) == 0;
}

std::optional<int> PinnedNumaNode(const v1::ProvisionBundle& b) {
  if (b.shape().has_numa_node()) {
    if (b.shape().numa_node() < 0) return std::nullopt;
    return b.shape().numa_node();
  }
  std::optional<int> node;
  for (const auto& s : b.slots()) {
    if (!s.has_numa_node() || s.numa_node() < 0) return std::nullopt;
    if (node && *node != s.numa_node()) return std::nullopt;
    node = s.numa_node();
  }
  return node;
}

Result<std::string> GenerateDomainXml(const v1::ProvisionBundle& b, const DomainXmlOptions& o) {
  if (!ids::IsUuid(b.allocation_id())) {
    return DefineError("invalid_allocation_id",
                       "allocation id is not a UUID: '" + b.allocation_id() + "'",
                       {{"field", "allocation_id"}});
  }
  if (b.slots_size() == 0) return DefineError("bundle_empty", "the bundle names no slots");
  // Bundle text the XML carries (metadata): refused before any XML is built, as libvirt would
  // refuse the document.
  if (!IsXmlSafeText(b.tenant())) {
    return DefineError("invalid_tenant", "the tenant is not UTF-8 text without control characters",
                       {{"field", "tenant"}});
  }
  for (int i = 0; i < b.slots_size(); ++i) {
    if (!IsXmlSafeText(b.slots(i).slot_key())) {
      return DefineError(
          "invalid_slot_key",
          fmt::format("slot {}: the slot key is not UTF-8 text without control characters", i),
          {{"field", fmt::format("slots[{}].slot_key", i)}});
    }
  }
  const auto& shape = b.shape();
  if (shape.vcpus() <= 0 || shape.memory_mib() <= 0 || shape.hugepages_1g() < 0) {
    return DefineError("shape_invalid",
                       fmt::format("VM shape needs vcpus > 0 and memory_mib > 0 (got {}, {})",
                                   shape.vcpus(), shape.memory_mib()),
                       {{"field", "shape"}});
  }
  if (shape.hugepages_1g() > 0 &&
      (shape.memory_mib() % 1024 != 0 ||
       static_cast<int64_t>(shape.hugepages_1g()) * 1024 < shape.memory_mib())) {
    return DefineError("hugepages_memory_unaligned",
                       fmt::format("{} MiB of memory cannot be backed by {} x 1 GiB hugepages",
                                   shape.memory_mib(), shape.hugepages_1g()),
                       {{"field", "shape.hugepages_1g"}});
  }
  if (o.domain_type != "kvm" && o.domain_type != "qemu") {
    return DefineError("invalid_domain_type",
                       "domain type must be kvm or qemu, got '" + o.domain_type + "'",
                       {{"field", "domain_type"}});
  }
  const bool direct_boot = !o.kernel.empty();
  std::vector<std::pair<std::string, std::string>> paths = {
      {"loader", o.loader}, {"nvram_template", o.nvram_template}, {"nvram_dir", o.nvram_dir}};
  if (direct_boot) {
    paths.emplace_back("kernel", o.kernel);
    if (!o.initrd.empty()) paths.emplace_back("initrd", o.initrd);
  }
  if (!o.emulator.empty()) paths.emplace_back("emulator", o.emulator);
  if (!o.vnc_socket.empty()) paths.emplace_back("vnc_socket", o.vnc_socket);
  if (!o.serial_log.empty()) paths.emplace_back("serial_log", o.serial_log);
  if (o.seed_iso.empty()) return DefineError("seed_missing", "no NoCloud seed ISO given");
  paths.emplace_back("seed_iso", o.seed_iso);
  for (const auto& [field, p] : paths) {
    if (!IsAbsolutePath(p)) {
      return DefineError("invalid_path",
                         fmt::format("{} must be an absolute path, got '{}'", field, p),
                         {{"field", field}});
    }
  }
  if (o.vnc_socket.empty() && !o.vnc_auto_socket && !IsLoopbackAddress(o.vnc_listen)) {
    return DefineError("vnc_listen_not_loopback",
                       "VNC may listen on a loopback address or a UNIX socket only, not '" +
                           o.vnc_listen + "' (console-gw relays the console)",
                       {{"field", "vnc_listen"}});
  }
  if (!IsBridgeName(o.bridge)) {
    return DefineError("invalid_bridge", "bad bridge name '" + o.bridge + "'",
                       {{"field", "bridge"}});
  }
  const auto& boot = b.slots(0);
  if (!IsValidMac(boot.mac())) {
    return DefineError("invalid_mac", "slot " + boot.slot_key() + ": bad MAC '" + boot.mac() + "'",
                       {{"slot_key", boot.slot_key()}, {"field", "mac"}});
  }

  const std::string name = DomainName(b.allocation_id());
  std::string x;
  auto add = [&x](const std::string& line) {
    x += line;
    x += '\n';
  };
  add(fmt::format("<domain type='{}'>", o.domain_type));
  add(fmt::format("  <name>{}</name>", Esc(name)));
  std::vector<std::string> slot_keys;
  for (const auto& s : b.slots()) slot_keys.push_back(s.slot_key());
  std::string joined;
  for (const auto& k : slot_keys) joined += (joined.empty() ? "" : ",") + k;
  add("  <metadata>");
  add(fmt::format(
      "    <gpuaas:allocation xmlns:gpuaas='{}' id='{}' attempt='{}' tenant='{}' slots='{}'/>",
      kDomainMetadataNs, Esc(b.allocation_id()), b.attempt(), Esc(b.tenant()), Esc(joined)));
  add("  </metadata>");
  add(fmt::format("  <memory unit='MiB'>{}</memory>", shape.memory_mib()));
  const auto numa = PinnedNumaNode(b);
  if (numa && !o.numa_cpuset.empty()) {
    add(fmt::format("  <vcpu placement='static' cpuset='{}'>{}</vcpu>", Esc(o.numa_cpuset),
                    shape.vcpus()));
  } else {
    add(fmt::format("  <vcpu placement='static'>{}</vcpu>", shape.vcpus()));
  }
  if (numa) {
    add("  <numatune>");
    add(fmt::format("    <memory mode='{}' nodeset='{}'/>", Esc(o.numa_memory_mode), *numa));
    add("  </numatune>");
  }
  if (shape.hugepages_1g() > 0) {
    add("  <memoryBacking>");
    add("    <hugepages>");
    add("      <page size='1' unit='GiB'/>");
    add("    </hugepages>");
    add("  </memoryBacking>");
  }
  add("  <os>");
  add(fmt::format("    <type arch='x86_64' machine='{}'>hvm</type>", Esc(o.machine)));
  add(fmt::format("    <loader readonly='yes' secure='no' type='pflash'>{}</loader>",
                  Esc(o.loader)));
  std::string nvram_dir = o.nvram_dir;
  while (nvram_dir.size() > 1 && nvram_dir.back() == '/') nvram_dir.pop_back();
  add(fmt::format("    <nvram template='{}'>{}/{}_VARS.fd</nvram>", Esc(o.nvram_template),
                  Esc(nvram_dir), Esc(name)));
  if (direct_boot) {
    add(fmt::format("    <kernel>{}</kernel>", Esc(o.kernel)));
    if (!o.initrd.empty()) add(fmt::format("    <initrd>{}</initrd>", Esc(o.initrd)));
    if (!o.cmdline.empty()) add(fmt::format("    <cmdline>{}</cmdline>", Esc(o.cmdline)));
  }
  add("  </os>");
  add("  <features>");
  add("    <acpi/>");
  add("    <apic/>");
  add("  </features>");
  add(fmt::format("  <cpu mode='{}'/>", Esc(o.cpu_mode)));
  add("  <clock offset='utc'/>");
  add("  <on_poweroff>destroy</on_poweroff>");
  add("  <on_reboot>restart</on_reboot>");
  add("  <on_crash>destroy</on_crash>");
  add("  <devices>");
  if (!o.emulator.empty()) add(fmt::format("    <emulator>{}</emulator>", Esc(o.emulator)));

  int disk_index = 0;
  bool boot_set = direct_boot;
  for (const auto& s : b.slots()) {
    if (s.nvme_by_id().empty()) continue;
    auto it = o.disk_paths.find(s.slot_key());
    const std::string path = it != o.disk_paths.end() ? it->second : s.nvme_by_id();
    if (!IsAbsolutePath(path)) {
      return DefineError(
          "invalid_path",
          "slot " + s.slot_key() + ": disk path must be absolute, got '" + path + "'",
          {{"slot_key", s.slot_key()}, {"field", "nvme_by_id"}});
    }
    add("    <disk type='block' device='disk'>");
    add("      <driver name='qemu' type='raw' cache='none' io='native' discard='unmap'/>");
    add(fmt::format("      <source dev='{}'/>", Esc(path)));
    add(fmt::format("      <target dev='{}' bus='virtio'/>", TargetDev(disk_index)));
    add(fmt::format("      <serial>gpuaas-data-{}</serial>", disk_index));
    if (!boot_set) {
      add("      <boot order='1'/>");
      boot_set = true;
    }
    add("    </disk>");
    ++disk_index;
  }
  add("    <disk type='file' device='disk'>");
  add("      <driver name='qemu' type='raw'/>");
  add(fmt::format("      <source file='{}'/>", Esc(o.seed_iso)));
  add(fmt::format("      <target dev='{}' bus='virtio'/>", TargetDev(disk_index)));
  add("      <readonly/>");
  add("    </disk>");

  std::set<std::string> seen_pci;
  for (const auto& s : b.slots()) {
    if (!o.passthrough) break;
    for (const auto& [field, addr] :
         {std::pair<std::string, std::string>{"gpu_pci_address", s.gpu_pci_address()},
          {"fabric_vf_pci_address", s.fabric_vf_pci_address()}}) {
      if (addr.empty()) {
        if (field == "gpu_pci_address") {
          return DefineError("invalid_pci_address", "slot " + s.slot_key() + " names no GPU",
                             {{"slot_key", s.slot_key()}, {"field", field}});
        }
        continue;
      }
      auto pci = ParsePci(addr);
      if (!pci || !seen_pci.insert(addr).second) {
        return DefineError("invalid_pci_address",
                           "slot " + s.slot_key() + ": bad or repeated PCI address '" + addr + "'",
                           {{"slot_key", s.slot_key()}, {"field", field}});
      }
      add("    <hostdev mode='subsystem' type='pci' managed='yes'>");
      add("      <driver name='vfio'/>");
      add(
          fmt::format("      <source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' "
                      "function='0x{:x}'/></source>",
                      pci->domain, pci->bus, pci->slot, pci->function));
      add("    </hostdev>");
    }
  }

  add("    <interface type='bridge'>");
  add(fmt::format("      <mac address='{}'/>", Esc(boot.mac())));
  add(fmt::format("      <source bridge='{}'/>", Esc(o.bridge)));
  if (o.bridge_is_ovs) add("      <virtualport type='openvswitch'/>");
  add("      <model type='virtio'/>");
  if (o.bridge_is_ovs && o.userspace_datapath) add("      <driver><host csum='off'/></driver>");
  if (o.isolated_port && !o.bridge_is_ovs) add("      <port isolated='yes'/>");
  add("    </interface>");
  add("    <serial type='pty'>");
  if (!o.serial_log.empty()) {
    add(fmt::format("      <log file='{}' append='off'/>", Esc(o.serial_log)));
  }
  add("      <target port='0'/>");
  add("    </serial>");
  add("    <console type='pty'>");
  add("      <target type='serial' port='0'/>");
  add("    </console>");
  if (!o.vnc_socket.empty()) {
    add("    <graphics type='vnc'>");
    add(fmt::format("      <listen type='socket' socket='{}'/>", Esc(o.vnc_socket)));
  } else if (o.vnc_auto_socket) {
    // libvirt picks the path in the domain's private directory (and labels it for qemu); the
    // console relay reads it back from the live XML.
    add("    <graphics type='vnc'>");
    add("      <listen type='socket'/>");
  } else {
    add(fmt::format("    <graphics type='vnc' port='-1' autoport='yes' listen='{}'>",
                    Esc(o.vnc_listen)));
    add(fmt::format("      <listen type='address' address='{}'/>", Esc(o.vnc_listen)));
  }
  add("    </graphics>");
  add("    <video>");
  add("      <model type='vga' vram='16384' heads='1'/>");
  add("    </video>");
  add("    <rng model='virtio'>");
  add("      <backend model='random'>/dev/urandom</backend>");
  add("    </rng>");
  add("    <memballoon model='none'/>");
  add("  </devices>");
  add("</domain>");
  return x;
}

// (domain_xml.hpp) The value of attribute `name` in the start tag `tag` ('...' or "..."), XML
// entities decoded; nullopt when absent.
std::optional<std::string> XmlAttr(const std::string& tag, const std::string& name) {
  for (size_t at = tag.find(name + "="); at != std::string::npos;
       at = tag.find(name + "=", at + 1)) {
    // A whole attribute name: preceded by whitespace.
    if (at == 0 || std::isspace(static_cast<unsigned char>(tag[at - 1])) == 0) continue;
    const size_t q = at + name.size() + 1;
    if (q >= tag.size() || (tag[q] != '\'' && tag[q] != '"')) continue;
    const size_t end = tag.find(tag[q], q + 1);
    if (end == std::string::npos) return std::nullopt;
    std::string raw = tag.substr(q + 1, end - q - 1);
    std::string out;
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] != '&') {
        out += raw[i];
        continue;
      }
      static const std::pair<const char*, char> kEntities[] = {
          {"&apos;", '\''}, {"&quot;", '"'}, {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}};
      bool matched = false;
      for (const auto& [ent, ch] : kEntities) {
        if (raw.compare(i, std::strlen(ent), ent) == 0) {
          out += ch;
          i += std::strlen(ent) - 1;
          matched = true;
          break;
        }
      }
      if (!matched) out += raw[i];
    }
    return out;
  }
  return std::nullopt;
}

std::string XmlStartTag(const std::string& xml, size_t pos) {
  const size_t end = xml.find('>', pos);
  return xml.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
}

}  // namespace gpuaas::node_agent
