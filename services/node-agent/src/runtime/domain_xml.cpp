#include "gpuaas/node_agent/runtime/domain_xml.hpp"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/validate.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/node.pb.h"

namespace gpuaas::node_agent {
namespace {

const std::string kStage = "define";

Error DefineError(Reason reason, std::string message,
                  std::map<std::string, std::string> details = {}) {
  details["stage"] = kStage;
  return Error{Code::kInvalidArgument, reason.str(), std::move(message), std::move(details), false};
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

namespace {

// ---- refusals, all before any XML is written ----

// Bundle text the XML carries (metadata): refused before any XML is built, as libvirt would
// refuse the document.
Result<void> CheckBundleText(const v1::ProvisionBundle& b) {
  if (!ids::IsUuid(b.allocation_id())) {
    return DefineError(reason::kInvalidAllocationId,
                       "allocation id is not a UUID: '" + b.allocation_id() + "'",
                       {{"field", "allocation_id"}});
  }
  if (b.slots_size() == 0) return DefineError(reason::kBundleEmpty, "the bundle names no slots");
  if (!IsXmlSafeText(b.tenant())) {
    return DefineError(reason::kInvalidTenant,
                       "the tenant is not UTF-8 text without control characters",
                       {{"field", "tenant"}});
  }
  for (int i = 0; i < b.slots_size(); ++i) {
    if (!IsXmlSafeText(b.slots(i).slot_key())) {
      return DefineError(
          reason::kInvalidSlotKey,
          fmt::format("slot {}: the slot key is not UTF-8 text without control characters", i),
          {{"field", fmt::format("slots[{}].slot_key", i)}});
    }
  }
  return Ok();
}

Result<void> CheckShape(const v1::VmShape& shape) {
  if (shape.vcpus() <= 0 || shape.memory_mib() <= 0 || shape.hugepages_1g() < 0) {
    return DefineError(reason::kShapeInvalid,
                       fmt::format("VM shape needs vcpus > 0 and memory_mib > 0 (got {}, {})",
                                   shape.vcpus(), shape.memory_mib()),
                       {{"field", "shape"}});
  }
  if (shape.hugepages_1g() > 0 &&
      (shape.memory_mib() % 1024 != 0 ||
       static_cast<int64_t>(shape.hugepages_1g()) * 1024 < shape.memory_mib())) {
    return DefineError(reason::kHugepagesMemoryUnaligned,
                       fmt::format("{} MiB of memory cannot be backed by {} x 1 GiB hugepages",
                                   shape.memory_mib(), shape.hugepages_1g()),
                       {{"field", "shape.hugepages_1g"}});
  }
  return Ok();
}

// Every host path the options name is absolute (the seed ISO is required).
Result<void> CheckOptionPaths(const DomainXmlOptions& o) {
  std::vector<std::pair<std::string, std::string>> paths = {
      {"loader", o.loader}, {"nvram_template", o.nvram_template}, {"nvram_dir", o.nvram_dir}};
  if (!o.kernel.empty()) {
    paths.emplace_back("kernel", o.kernel);
    if (!o.initrd.empty()) paths.emplace_back("initrd", o.initrd);
  }
  if (!o.emulator.empty()) paths.emplace_back("emulator", o.emulator);
  if (!o.vnc_socket.empty()) paths.emplace_back("vnc_socket", o.vnc_socket);
  if (!o.serial_log.empty()) paths.emplace_back("serial_log", o.serial_log);
  if (o.seed_iso.empty()) return DefineError(reason::kSeedMissing, "no NoCloud seed ISO given");
  paths.emplace_back("seed_iso", o.seed_iso);
  for (const auto& [field, p] : paths) {
    if (!IsAbsolutePath(p)) {
      return DefineError(reason::kInvalidPath,
                         fmt::format("{} must be an absolute path, got '{}'", field, p),
                         {{"field", field}});
    }
  }
  return Ok();
}

Result<void> CheckOptions(const DomainXmlOptions& o) {
  if (o.domain_type != "kvm" && o.domain_type != "qemu") {
    return DefineError(reason::kInvalidDomainType,
                       "domain type must be kvm or qemu, got '" + o.domain_type + "'",
                       {{"field", "domain_type"}});
  }
  if (auto paths = CheckOptionPaths(o); !paths.ok()) return paths.error();
  if (o.vnc_socket.empty() && !o.vnc_auto_socket && !IsLoopbackAddress(o.vnc_listen)) {
    return DefineError(reason::kVncListenNotLoopback,
                       "VNC may listen on a loopback address or a UNIX socket only, not '" +
                           o.vnc_listen + "' (console-gw relays the console)",
                       {{"field", "vnc_listen"}});
  }
  if (!IsBridgeName(o.bridge)) {
    return DefineError(reason::kInvalidBridge, "bad bridge name '" + o.bridge + "'",
                       {{"field", "bridge"}});
  }
  return Ok();
}

// ---- the document, element by element ----

// The document being written: one line per Add.
class XmlLines {
 public:
  void Add(const std::string& line) {
    text_ += line;
    text_ += '\n';
  }
  std::string Take() && { return std::move(text_); }

 private:
  std::string text_;
};

// Name, metadata, memory, vCPUs and their NUMA placement, hugepage backing.
void AddIdentityAndResources(XmlLines& x, const v1::ProvisionBundle& b, const DomainXmlOptions& o) {
  const auto& shape = b.shape();
  x.Add(fmt::format("<domain type='{}'>", o.domain_type));
  x.Add(fmt::format("  <name>{}</name>", Esc(DomainName(b.allocation_id()))));
  std::vector<std::string> slot_keys;
  for (const auto& s : b.slots()) slot_keys.push_back(s.slot_key());
  std::string joined;
  for (const auto& k : slot_keys) joined += (joined.empty() ? "" : ",") + k;
  x.Add("  <metadata>");
  x.Add(fmt::format(
      "    <gpuaas:allocation xmlns:gpuaas='{}' id='{}' attempt='{}' tenant='{}' slots='{}'/>",
      kDomainMetadataNs, Esc(b.allocation_id()), b.attempt(), Esc(b.tenant()), Esc(joined)));
  x.Add("  </metadata>");
  x.Add(fmt::format("  <memory unit='MiB'>{}</memory>", shape.memory_mib()));
  const auto numa = PinnedNumaNode(b);
  if (numa && !o.numa_cpuset.empty()) {
    x.Add(fmt::format("  <vcpu placement='static' cpuset='{}'>{}</vcpu>", Esc(o.numa_cpuset),
                      shape.vcpus()));
  } else {
    x.Add(fmt::format("  <vcpu placement='static'>{}</vcpu>", shape.vcpus()));
  }
  if (numa) {
    x.Add("  <numatune>");
    x.Add(fmt::format("    <memory mode='{}' nodeset='{}'/>", Esc(o.numa_memory_mode), *numa));
    x.Add("  </numatune>");
  }
  if (shape.hugepages_1g() > 0) {
    x.Add("  <memoryBacking>");
    x.Add("    <hugepages>");
    x.Add("      <page size='1' unit='GiB'/>");
    x.Add("    </hugepages>");
    x.Add("  </memoryBacking>");
  }
}

// Firmware (UEFI with a per-domain NVRAM), direct kernel boot, CPU, clock and lifecycle actions.
void AddBootAndPlatform(XmlLines& x, const std::string& name, const DomainXmlOptions& o) {
  x.Add("  <os>");
  x.Add(fmt::format("    <type arch='x86_64' machine='{}'>hvm</type>", Esc(o.machine)));
  x.Add(fmt::format("    <loader readonly='yes' secure='no' type='pflash'>{}</loader>",
                    Esc(o.loader)));
  std::string nvram_dir = o.nvram_dir;
  while (nvram_dir.size() > 1 && nvram_dir.back() == '/') nvram_dir.pop_back();
  x.Add(fmt::format("    <nvram template='{}'>{}/{}_VARS.fd</nvram>", Esc(o.nvram_template),
                    Esc(nvram_dir), Esc(name)));
  if (!o.kernel.empty()) {
    x.Add(fmt::format("    <kernel>{}</kernel>", Esc(o.kernel)));
    if (!o.initrd.empty()) x.Add(fmt::format("    <initrd>{}</initrd>", Esc(o.initrd)));
    if (!o.cmdline.empty()) x.Add(fmt::format("    <cmdline>{}</cmdline>", Esc(o.cmdline)));
  }
  x.Add("  </os>");
  x.Add("  <features>");
  x.Add("    <acpi/>");
  x.Add("    <apic/>");
  x.Add("  </features>");
  x.Add(fmt::format("  <cpu mode='{}'/>", Esc(o.cpu_mode)));
  x.Add("  <clock offset='utc'/>");
  x.Add("  <on_poweroff>destroy</on_poweroff>");
  x.Add("  <on_reboot>restart</on_reboot>");
  x.Add("  <on_crash>destroy</on_crash>");
}

// Every slot's disk as a virtio block disk (the first the boot disk unless a kernel is booted
// directly), then the read-only seed ISO.
Result<void> AddDisks(XmlLines& x, const v1::ProvisionBundle& b, const DomainXmlOptions& o) {
  int disk_index = 0;
  bool boot_set = !o.kernel.empty();
  for (const auto& s : b.slots()) {
    if (s.nvme_by_id().empty()) continue;
    auto it = o.disk_paths.find(s.slot_key());
    const std::string path = it != o.disk_paths.end() ? it->second : s.nvme_by_id();
    if (!IsAbsolutePath(path)) {
      return DefineError(
          reason::kInvalidPath,
          "slot " + s.slot_key() + ": disk path must be absolute, got '" + path + "'",
          {{"slot_key", s.slot_key()}, {"field", "nvme_by_id"}});
    }
    x.Add("    <disk type='block' device='disk'>");
    x.Add("      <driver name='qemu' type='raw' cache='none' io='native' discard='unmap'/>");
    x.Add(fmt::format("      <source dev='{}'/>", Esc(path)));
    x.Add(fmt::format("      <target dev='{}' bus='virtio'/>", TargetDev(disk_index)));
    x.Add(fmt::format("      <serial>gpuaas-data-{}</serial>", disk_index));
    if (!boot_set) {
      x.Add("      <boot order='1'/>");
      boot_set = true;
    }
    x.Add("    </disk>");
    ++disk_index;
  }
  x.Add("    <disk type='file' device='disk'>");
  x.Add("      <driver name='qemu' type='raw'/>");
  x.Add(fmt::format("      <source file='{}'/>", Esc(o.seed_iso)));
  x.Add(fmt::format("      <target dev='{}' bus='virtio'/>", TargetDev(disk_index)));
  x.Add("      <readonly/>");
  x.Add("    </disk>");
  return Ok();
}

// Every slot's GPU (required) and fabric VF (optional) as a managed VFIO hostdev, each PCI
// address once.
Result<void> AddHostdevs(XmlLines& x, const v1::ProvisionBundle& b) {
  std::set<std::string> seen_pci;
  for (const auto& s : b.slots()) {
    for (const auto& [field, addr] :
         {std::pair<std::string, std::string>{"gpu_pci_address", s.gpu_pci_address()},
          {"fabric_vf_pci_address", s.fabric_vf_pci_address()}}) {
      if (addr.empty()) {
        if (field == "gpu_pci_address") {
          return DefineError(reason::kInvalidPciAddress, "slot " + s.slot_key() + " names no GPU",
                             {{"slot_key", s.slot_key()}, {"field", field}});
        }
        continue;
      }
      auto pci = ParsePci(addr);
      if (!pci || !seen_pci.insert(addr).second) {
        return DefineError(reason::kInvalidPciAddress,
                           "slot " + s.slot_key() + ": bad or repeated PCI address '" + addr + "'",
                           {{"slot_key", s.slot_key()}, {"field", field}});
      }
      x.Add("    <hostdev mode='subsystem' type='pci' managed='yes'>");
      x.Add("      <driver name='vfio'/>");
      x.Add(
          fmt::format("      <source><address domain='0x{:04x}' bus='0x{:02x}' slot='0x{:02x}' "
                      "function='0x{:x}'/></source>",
                      pci->domain, pci->bus, pci->slot, pci->function));
      x.Add("    </hostdev>");
    }
  }
  return Ok();
}

// The one vNIC: the boot slot's MAC on the slice bridge.
void AddInterface(XmlLines& x, const std::string& mac, const DomainXmlOptions& o) {
  x.Add("    <interface type='bridge'>");
  x.Add(fmt::format("      <mac address='{}'/>", Esc(mac)));
  x.Add(fmt::format("      <source bridge='{}'/>", Esc(o.bridge)));
  if (o.bridge_is_ovs) x.Add("      <virtualport type='openvswitch'/>");
  x.Add("      <model type='virtio'/>");
  if (o.bridge_is_ovs && o.userspace_datapath) x.Add("      <driver><host csum='off'/></driver>");
  if (o.isolated_port && !o.bridge_is_ovs) x.Add("      <port isolated='yes'/>");
  x.Add("    </interface>");
}

// The pty serial console, and VNC (a UNIX socket or a loopback address, never more) with its
// video adapter.
void AddConsoles(XmlLines& x, const DomainXmlOptions& o) {
  x.Add("    <serial type='pty'>");
  if (!o.serial_log.empty()) {
    x.Add(fmt::format("      <log file='{}' append='off'/>", Esc(o.serial_log)));
  }
  x.Add("      <target port='0'/>");
  x.Add("    </serial>");
  x.Add("    <console type='pty'>");
  x.Add("      <target type='serial' port='0'/>");
  x.Add("    </console>");
  if (!o.vnc_socket.empty()) {
    x.Add("    <graphics type='vnc'>");
    x.Add(fmt::format("      <listen type='socket' socket='{}'/>", Esc(o.vnc_socket)));
  } else if (o.vnc_auto_socket) {
    // libvirt picks the path in the domain's private directory (and labels it for qemu); the
    // console relay reads it back from the live XML.
    x.Add("    <graphics type='vnc'>");
    x.Add("      <listen type='socket'/>");
  } else {
    x.Add(fmt::format("    <graphics type='vnc' port='-1' autoport='yes' listen='{}'>",
                      Esc(o.vnc_listen)));
    x.Add(fmt::format("      <listen type='address' address='{}'/>", Esc(o.vnc_listen)));
  }
  x.Add("    </graphics>");
  x.Add("    <video>");
  x.Add("      <model type='vga' vram='16384' heads='1'/>");
  x.Add("    </video>");
}

Result<void> AddDevices(XmlLines& x, const v1::ProvisionBundle& b, const DomainXmlOptions& o) {
  x.Add("  <devices>");
  if (!o.emulator.empty()) x.Add(fmt::format("    <emulator>{}</emulator>", Esc(o.emulator)));
  if (auto disks = AddDisks(x, b, o); !disks.ok()) return disks.error();
  if (o.passthrough) {
    if (auto hostdevs = AddHostdevs(x, b); !hostdevs.ok()) return hostdevs.error();
  }
  AddInterface(x, b.slots(0).mac(), o);
  AddConsoles(x, o);
  x.Add("    <rng model='virtio'>");
  x.Add("      <backend model='random'>/dev/urandom</backend>");
  x.Add("    </rng>");
  x.Add("    <memballoon model='none'/>");
  x.Add("  </devices>");
  return Ok();
}

}  // namespace

Result<std::string> GenerateDomainXml(const v1::ProvisionBundle& b, const DomainXmlOptions& o) {
  if (auto text = CheckBundleText(b); !text.ok()) return text.error();
  if (auto shape = CheckShape(b.shape()); !shape.ok()) return shape.error();
  if (auto opts = CheckOptions(o); !opts.ok()) return opts.error();
  const auto& boot = b.slots(0);
  if (!IsValidMac(boot.mac())) {
    return DefineError(reason::kInvalidMac,
                       "slot " + boot.slot_key() + ": bad MAC '" + boot.mac() + "'",
                       {{"slot_key", boot.slot_key()}, {"field", "mac"}});
  }

  XmlLines x;
  AddIdentityAndResources(x, b, o);
  AddBootAndPlatform(x, DomainName(b.allocation_id()), o);
  if (auto devices = AddDevices(x, b, o); !devices.ok()) return devices.error();
  x.Add("</domain>");
  return std::move(x).Take();
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
